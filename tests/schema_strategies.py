"""Hypothesis strategies from the JSON Schema subset the gateway's OpenAPI description uses (object, array,
string, integer, number, boolean, null, oneOf, anyOf, enum, const, pattern, bounds). hypothesis-jsonschema would
do this but no longer works with current hypothesis."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def from_schema(schema: dict[str, Any], root: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        path = schema["$ref"].removeprefix("#/").split("/")
        target: Any = root
        for part in path:
            target = target[part]
        return from_schema(target, root)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("oneOf", "anyOf"):
        if key in schema:
            return st.one_of(*(from_schema(option, root) for option in schema[key]))
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of(*(from_schema({**schema, "type": k}, root) for k in kind))
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {name: from_schema(sub, root) for name, sub in properties.items() if name in required},
            optional={name: from_schema(sub, root) for name, sub in properties.items() if name not in required},
        )
    if kind == "array":
        items = from_schema(schema.get("items", {}), root)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=max(4, schema.get("minItems", 0)))
    if kind == "string":
        if "pattern" in schema:  # mostly matching strings, so valid-shaped requests get past the first check
            return st.from_regex(schema["pattern"], fullmatch=True).filter(
                lambda text: schema.get("minLength", 0) <= len(text) <= schema.get("maxLength", 1 << 30)
            ) | st.text(max_size=20)
        return st.text(min_size=schema.get("minLength", 0), max_size=40)
    if kind == "integer":
        return st.integers(min_value=schema.get("minimum"), max_value=schema.get("maximum"))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(
            min_value=low, max_value=schema.get("maximum"), exclude_min="exclusiveMinimum" in schema, allow_nan=False
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return st.none() | st.booleans() | st.integers() | st.text(max_size=10)

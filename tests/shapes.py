"""The structure of an answer without its values, for comparing answers whose texts differ on purpose (two
engines, or one engine's answer with another's)."""

from __future__ import annotations


def shape(value: object) -> object:
    """Keys and the types of leaves; a list as its first item's shape."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value[:1]]
    return type(value).__name__ if value is not None else None

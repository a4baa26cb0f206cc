"""The gateway's own OpenAPI description, served at ``GET /openapi.json``: the tenant endpoints and the request
subset the gateway checks (gateway/serving/openai_request.py), and the admin API (its bodies' schemas from the
config's own models, so they cannot drift). The fuzz tests generate requests from it."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel

from gateway.config import AdapterConfig, TenantConfig

_STRING_OR_LIST = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "description": "One of the tenant's adapters or allowed base models."},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "max_tokens": {"type": "integer", "minimum": 1},
    "n": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "stop": _STRING_OR_LIST,
    "seed": {"type": "integer"},
    "user": {"type": "string"},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "ignore_eos": {"type": "boolean", "description": "vLLM: generate max_tokens whatever the model says."},
    "top_k": {"type": "integer"},
}
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant"]},
        "content": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                    },
                },
            ]
        },
    },
}


def _endpoint(summary: str, schema: str) -> dict[str, Any]:
    errors = {
        str(status): {"$ref": "#/components/responses/Error"} for status in (400, 401, 404, 413, 429, 502, 503, 504)
    }
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": schema}}}},
            "responses": {
                "200": {
                    "description": "The engine's answer (application/json), or server-sent events when streaming",
                    "content": {"application/json": {}, "text/event-stream": {}},
                },
                **errors,
            },
        }
    }


_ADMIN_ERRORS = {str(status): {"$ref": "#/components/responses/Error"} for status in (400, 401, 404)}
_PATH_PARAMETER = {"in": "path", "required": True, "schema": {"type": "string"}}


def _admin(method: str, summary: str, schema: str | None = None, *, parameters: tuple[str, ...] = ()) -> dict[str, Any]:
    """An admin operation: the admin token as a Bearer, an OpenAI error body for every refusal."""
    operation: dict[str, Any] = {
        "summary": summary,
        "security": [{"admin": []}],
        "responses": {"200": {"description": "Done (a JSON object)"}, **_ADMIN_ERRORS},
    }
    if parameters:
        operation["parameters"] = [{"name": name, **_PATH_PARAMETER} for name in parameters]
    if schema is not None:
        body = {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}
        operation["requestBody"] = {"required": True, "content": body}
    return {method: operation}


_ADMIN_PATHS: dict[str, Any] = {
    "/admin/tenants": _admin("post", "Add a tenant at run time (the config's tenant schema)", "TenantConfig"),
    "/admin/tenants/{tenant_id}": _admin("delete", "Remove a tenant added at run time", parameters=("tenant_id",)),
    "/admin/tenants/{tenant_id}/keys": _admin(
        "post", "Add a key: a plain api_key (hashed at once) or a key_hash", "KeyRequest", parameters=("tenant_id",)
    ),
    "/admin/keys/{key_hash}": _admin("delete", "Revoke a key, config keys included", parameters=("key_hash",)),
    "/admin/catalog/adapters": _admin("post", "Add an adapter to the catalog", "AdapterConfig"),
    "/admin/catalog/adapters/{name}": _admin("delete", "Retire an adapter", parameters=("name",)),
    "/admin/adapters/{name}/rollout": {
        **_admin("post", "Roll out a new version of a versioned name", "RolloutRequest", parameters=("name",)),
        **_admin("get", "A rollout's progress", parameters=("name",)),
    },
    "/admin/adapters/{name}/rollback": _admin("post", "Return a name to its old version", parameters=("name",)),
    "/admin/adapters/{name}/warm": _admin("post", "Load an adapter on its homes and warm it", parameters=("name",)),
    "/admin/adapters/{name}/residency": _admin("delete", "Unload an adapter everywhere", parameters=("name",)),
    "/admin/replicas/{pool}/{replica}/drain": _admin(
        "post", "Take no new requests on a replica", parameters=("pool", "replica")
    ),
    "/admin/replicas/{pool}/{replica}/undrain": _admin(
        "post", "Take requests on a replica again", parameters=("pool", "replica")
    ),
    "/admin/route": _admin("get", "The routing decision the gateway would take now (?tenant=&adapter=&session=)"),
    "/admin/residency": _admin("get", "The residency record per pool and replica"),
    "/admin/state": _admin("get", "The status page's state (also with the page's session cookie)"),
    "/admin/reload": _admin("post", "Re-read the config file and swap it in whole, or refuse it whole"),
    "/admin/ui/actions/{action}": {
        "post": {
            **_admin("post", "A status page action (session cookie and X-CSRF-Token)", "UiAction")["post"],
            "parameters": [{"name": "action", **_PATH_PARAMETER}],
            "security": [{"session": []}],
        }
    },
}
_ADMIN_SCHEMAS: dict[str, Any] = {
    "KeyRequest": {
        "type": "object",
        "properties": {
            "api_key": {"type": "string", "minLength": 1},
            "key_hash": {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"},
        },
    },
    # By hand, as gateway/admin/rollout.py's RolloutRequest checks it (a test keeps the two the same).
    "RolloutRequest": {
        "type": "object",
        "required": ["version"],
        "properties": {
            "version": {
                "oneOf": [{"type": "string", "minLength": 1, "maxLength": 128}, {"type": "integer", "minimum": 0}]
            },
            "steps": {"type": "array", "minItems": 1, "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
            "step_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400},
            "max_error_rate_increase": {"type": "number", "minimum": 0, "maximum": 1},
            "max_ttft_p99_ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
        },
    },
    "UiAction": {
        "type": "object",
        "properties": {"pool": {"type": "string"}, "replica": {"type": "string"}, "adapter": {"type": "string"}},
    },
}


def _model_schemas(*models: type[BaseModel]) -> dict[str, Any]:
    """Each model's JSON schema, and the models it refers to, under components.schemas."""
    schemas: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


SPEC: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "tenantgate", "version": "1", "description": "A multi-tenant LoRA gateway (OpenAI-compatible)."},
    "paths": {
        "/v1/completions": _endpoint(
            "Text completion with one of the tenant's models", "#/components/schemas/Completion"
        ),
        "/v1/chat/completions": _endpoint(
            "Chat completion with one of the tenant's models", "#/components/schemas/Chat"
        ),
        "/v1/models": {
            "get": {
                "summary": "The tenant's models",
                "security": [{"bearer": []}],
                "responses": {"200": {"description": "A list of models"}},
            }
        },
        "/healthz": {"get": {"summary": "The process is up", "responses": {"200": {"description": "up"}}}},
        "/readyz": {
            "get": {
                "summary": "Ready to serve",
                "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}},
            }
        },
        **_ADMIN_PATHS,
    },
    "components": {
        "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer", "description": "A tenant's API key"},
            "admin": {"type": "http", "scheme": "bearer", "description": "The admin token"},
            "session": {"type": "apiKey", "in": "cookie", "name": "tenantgate_session"},
        },
        "responses": {
            "Error": {"description": "An OpenAI-style error", "content": {"application/json": {"schema": _ERROR}}}
        },
        "schemas": {
            "Completion": {
                "type": "object",
                "required": ["prompt"],
                "additionalProperties": False,
                "properties": {
                    **_COMMON,
                    "prompt": {
                        "oneOf": [
                            {"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": {"type": "string"}},
                            {"type": "array", "minItems": 1, "items": {"type": "integer"}},
                            {
                                "type": "array",
                                "minItems": 1,
                                "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}},
                            },
                        ]
                    },
                },
            },
            "Chat": {
                "type": "object",
                "required": ["messages"],
                "additionalProperties": False,
                "properties": {
                    **_COMMON,
                    "max_completion_tokens": {"type": "integer", "minimum": 1},
                    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                },
            },
            "Error": _ERROR,
            **_ADMIN_SCHEMAS,
            **_model_schemas(TenantConfig, AdapterConfig),
        },
    },
}


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(SPEC)

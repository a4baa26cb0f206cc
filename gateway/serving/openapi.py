"""The gateway's own OpenAPI description, served at ``GET /openapi.json``: the tenant endpoints and the request
subset the gateway checks (gateway/serving/openai_request.py). The fuzz tests generate requests from it."""

from __future__ import annotations

from typing import Any

from aiohttp import web

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
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
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
        },
    },
}


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(SPEC)

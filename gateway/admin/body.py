"""The admin API's JSON bodies: read and parsed as strictly as the tenant endpoints' (gateway/serving/json_body.py),
so a hostile body is a 400 with an OpenAI error body here too, never a 500."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.appkeys import STATE
from gateway.serving.json_body import parse_object, read_body


async def json_object(request: web.Request, *, empty_is: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body as a JSON object; an empty body is ``empty_is`` when given (else refused like any non-object)."""
    raw = await read_body(request)
    if not raw and empty_is is not None:
        return empty_is
    limits = request.app[STATE].config.limits
    return parse_object(raw, limits.max_json_depth, limits.max_json_containers)

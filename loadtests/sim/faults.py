"""Faults a test can switch on in a running simulated engine (``POST /sim/control {"faults": {...}}``): the ways
real engines fail that a router must survive. Not part of vLLM's API; the engine's own routes under /sim are
never affected.

- ``hang``: every engine route waits without answering (health included), as a wedged process does, until the
  fault is switched off;
- ``delay_s``: every engine route answers this much later;
- ``error_status``: inference routes answer this status with vLLM's error body (e.g. 503 when overloaded);
- ``cut_stream_after``: a stream's connection is dropped after this many token chunks, without [DONE];
- ``failing_adapters``: requests for these adapters answer 500 (a bad adapter version);
- ``failing_marker``: inference requests whose body holds this text answer 500, as vLLM does for a prompt that
  breaks it (a lone surrogate did): a failure the request causes, on every replica alike;
- ``reported_completion_tokens``: every usage the engine reports says this many completion tokens, whatever it
  generated (an engine whose usage count is wrong).

In Triton mode the same switches act on gRPC (loadtests/sim/triton_grpc.py): ``hang`` and ``delay_s`` hold every
RPC and every request on a stream; ``error_status`` answers each inference with an in-stream error;
``cut_stream_after`` aborts the whole gRPC stream (UNAVAILABLE) after that many token responses;
``failing_adapters`` names LoRA tasks as the engine does, ``task-<lora_task_id>``; ``failing_marker`` fails a request
whose ``text_input`` holds it with TensorRT-LLM's executor error (loadtests/sim/triton_model.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_INFERENCE = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Faults:
    hang: bool = False
    delay_s: float = 0.0
    error_status: int | None = None
    cut_stream_after: int | None = None
    failing_adapters: frozenset[str] = frozenset()
    failing_marker: str | None = None
    reported_completion_tokens: int | None = None
    _released: asyncio.Event = field(default_factory=asyncio.Event)

    def update(self, settings: dict[str, Any]) -> None:
        """Apply ``settings`` (the keys above; null or false switches one off); raises ValueError on a bad one."""
        known = {
            "hang", "delay_s", "error_status", "cut_stream_after", "failing_adapters", "failing_marker",
            "reported_completion_tokens",
        }  # fmt: skip
        unknown = set(settings) - known
        if unknown:
            raise ValueError(f"unknown faults: {sorted(unknown)}")
        hang = settings.get("hang", self.hang)
        delay = settings.get("delay_s", self.delay_s) or 0.0
        status = settings.get("error_status", self.error_status)
        cut = settings.get("cut_stream_after", self.cut_stream_after)
        if not isinstance(hang, bool):
            raise ValueError("hang must be true or false")
        if not isinstance(delay, int | float) or delay < 0:
            raise ValueError("delay_s must be a number of seconds >= 0")
        if status is not None and (not isinstance(status, int) or not 400 <= status <= 599):
            raise ValueError("error_status must be an HTTP error status (400-599) or null")
        if cut is not None and (not isinstance(cut, int) or cut < 0):
            raise ValueError("cut_stream_after must be a number of chunks >= 0 or null")
        failing = settings.get("failing_adapters", list(self.failing_adapters))
        if not isinstance(failing, list) or not all(isinstance(name, str) for name in failing):
            raise ValueError("failing_adapters must be a list of adapter names")
        marker = settings.get("failing_marker", self.failing_marker)
        if marker is not None and (not isinstance(marker, str) or not marker):
            raise ValueError("failing_marker must be a non-empty string or null")
        reported = settings.get("reported_completion_tokens", self.reported_completion_tokens)
        if reported is not None and (not isinstance(reported, int) or isinstance(reported, bool) or reported < 0):
            raise ValueError("reported_completion_tokens must be a number of tokens >= 0 or null")
        self.reported_completion_tokens = reported
        self.failing_adapters = frozenset(failing)
        self.failing_marker = marker
        self.hang, self.delay_s, self.error_status, self.cut_stream_after = hang, float(delay), status, cut
        if hang:
            self._released.clear()
        else:
            self._released.set()

    def as_json(self) -> dict[str, Any]:
        return {
            "hang": self.hang,
            "delay_s": self.delay_s,
            "error_status": self.error_status,
            "cut_stream_after": self.cut_stream_after,
            "failing_adapters": sorted(self.failing_adapters),
            "failing_marker": self.failing_marker,
            "reported_completion_tokens": self.reported_completion_tokens,
        }

    async def stall(self) -> None:
        """What every engine route does before it answers: wait while ``hang`` is on, then ``delay_s``."""
        if self.hang:
            await self._released.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)

    def middleware(self) -> Middleware:
        @web.middleware
        async def faults(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path.startswith("/sim/"):
                return await handler(request)
            await self.stall()
            if self.error_status is not None and request.path in _INFERENCE:
                error = {"message": "Injected fault", "type": "ServiceUnavailableError", "param": None}
                return web.json_response({"error": {**error, "code": self.error_status}}, status=self.error_status)
            marker = self.failing_marker
            if marker is not None and request.path in _INFERENCE and marker.encode() in await request.read():
                error = {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "param": None}
                return web.json_response({"error": {**error, "code": 500}}, status=500)
            return await handler(request)

        return faults

"""An engine's SSE stream cut at event boundaries, so each event is seen whole (the usage event's counts cannot be
split across two reads), with the usage event left out when the gateway asked for it and the client did not.

The gateway asks every stream for its usage (``stream_options.include_usage``) rather than counting chunks: the
engine's own count is exact (a chunk may carry several tokens, or none), includes the prompt, and is what a
non-streamed answer reports. The event it adds is ``data: {..., "choices": [], "usage": {...}}``; other events
may then carry ``"usage": null``, as OpenAI's own streams do with include_usage, which clients accept.
"""

from __future__ import annotations

import orjson

_END = b"\n\n"
_USAGE = b'"prompt_tokens"'
# An engine that never ends an event (not SSE): pass its bytes on rather than hold them.
_MAX_PENDING = 1 << 20


class StreamEvents:
    def __init__(self, strip_usage: bool) -> None:
        self._strip = strip_usage
        self._pending = bytearray()

    def feed(self, chunk: bytes) -> tuple[bytes, bytes]:
        """(the events this chunk completed, what of them goes to the client); an unfinished event waits."""
        pending = self._pending
        if pending:
            # The held bytes end no event: only the chunk can (with the held last byte). Appended to in place, not
            # joined anew and searched again for each chunk: an event an engine sent in 10-byte pieces cost the
            # event loop 85 s of CPU a MiB.
            if chunk.find(_END) < 0 and not (chunk[:1] == b"\n" and pending[-1:] == b"\n"):
                pending += chunk
                if len(pending) > _MAX_PENDING:
                    data = bytes(pending)
                    pending.clear()
                    return data, data
                return b"", b""
            data = bytes(pending) + chunk
            pending.clear()
        else:
            data = chunk
        end = data.rfind(_END)
        if end < 0:
            if len(data) > _MAX_PENDING:
                return data, data
            pending += data
            return b"", b""
        complete = data[: end + 2]
        if end + 2 < len(data):
            pending += data[end + 2 :]
        if not self._strip or _USAGE not in complete:
            return complete, complete
        return complete, b"".join(event for event in _events(complete) if not _is_usage(event))

    def rest(self) -> bytes:
        """What is left when the engine's stream ends (an unfinished last event goes on as it is)."""
        rest = bytes(self._pending)
        self._pending.clear()
        return rest


def _events(data: bytes) -> list[bytes]:
    """``data`` (ending at an event's end) as its events, each with its terminator, byte for byte."""
    events, start = [], 0
    while start < len(data):
        end = data.find(_END, start)
        if end < 0:  # a blank line after the last event's end (SSE allows them): as it is. Read as an event's end
            events.append(data[start:])  # at -1, it sent the walk back to the start, round forever.
            break
        events.append(data[start : end + 2])
        start = end + 2
    return events


def _is_usage(event: bytes) -> bool:
    if _USAGE not in event or not event.startswith(b"data:"):
        return False
    try:
        payload = orjson.loads(event[5:])
    except orjson.JSONDecodeError:
        return False
    return isinstance(payload, dict) and payload.get("choices") == [] and isinstance(payload.get("usage"), dict)

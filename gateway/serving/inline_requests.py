"""aiohttp's connection handler with each request handled in the connection's own task.

aiohttp 3.14's ``RequestHandler.start`` (the loop that takes a connection's requests one after another) runs each
request's handler in a task of its own, made and awaited per request. On Python 3.11 that task costs a request
about 15 k instructions: its registration in asyncio's task set (a ``WeakSet``: Python calls, and a weak reference
whose callback removes it again), a loop callback for its first step and another, at its end, to wake the
connection's task (Python 3.12 would start it eagerly; 3.11 cannot). The task is there to give each request a fresh
copy of the context variables (aiohttp #3406). ``InlineRequestHandler.start`` is aiohttp's loop with that one
change: the handler is awaited in the connection's task. Each request then starts from the context the previous one
left, which is the one it started from: nothing that serves a request on the gateway leaves a context variable set
past it (OpenTelemetry's spans, the only ones that set any, reset them on exit), and
tests/gateway/serving/test_inline_requests.py holds the gateway's requests to that. Everything else (the pipelined
requests' queue, the error handler for an unparsable request, the lingering read of an unread body, keep-alive, the
cancellations) is aiohttp's, line for line, and pinned to aiohttp 3.14 with gateway/serving/connections.py
(pyproject: >=3.14,<3.15); tests/gateway/serving/test_aiohttp_pinned.py fails when the installed aiohttp's
``RequestHandler.start`` is not the 3.14.5 source this was copied from.

One consequence to keep: a request's task (``request.task``) is now its connection's, so nothing may cancel it while
the connection goes on serving. ``asyncio.timeout`` and the Triton driver's cancellation check read the task's
``cancelling()`` count, which a cancel left on the connection's task would carry into every later request on it.
aiohttp cancels that task only when the connection is lost or at shutdown, and the gateway never cancels it itself.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp.helpers import ceil_timeout
from aiohttp.http import StreamWriter
from aiohttp.web_protocol import _PAYLOAD_ACCESS_ERROR, ERROR, RequestHandler, _ErrInfo


class InlineRequestHandler(RequestHandler):
    """A connection's handler whose requests run in the connection's task (the module docstring says why)."""

    async def start(self) -> None:
        # aiohttp 3.14.5's RequestHandler.start, but for the marked lines.
        loop = self._loop
        manager = self._manager
        assert manager is not None
        keepalive_timeout = self._keepalive_timeout
        resp = None
        assert self._request_factory is not None
        assert self._request_handler is not None

        while not self._force_close:
            if not self._messages:
                try:
                    self._waiter = loop.create_future()
                    await self._waiter
                finally:
                    self._waiter = None

            message, payload = self._messages.popleft()
            if self._parser is not None:
                self._parser.message_consumed()
            if self._buffer_paused and len(self._messages) <= self._msg_queue_resume_size:
                self._resume_reading_if_drained()

            start = loop.time() if self._logging_enabled else None

            manager.requests_count += 1
            writer = StreamWriter(self, loop)
            if isinstance(message, _ErrInfo):
                request_handler = self._make_error_handler(message)
                message = ERROR
            else:
                request_handler = self._request_handler

            request = self._request_factory(
                message,
                payload,
                self,
                writer,
                self._task_handler or asyncio.current_task(loop),  # type: ignore[arg-type]
            )
            try:
                try:
                    # Changed: awaited here, not in a task of its own.
                    resp, reset = await self._handle_request(request, start, request_handler)
                except ConnectionError:
                    self.log_debug("Ignored premature client disconnection")
                    break

                if reset:
                    self.log_debug("Ignored premature client disconnection 2")
                    break

                self._keepalive = bool(resp.keep_alive)

                if not payload.is_eof():
                    lingering_time = self._lingering_time
                    if not self._force_close and lingering_time:
                        self.log_debug("Start lingering close timer for %s sec.", lingering_time)
                        now = loop.time()
                        end_t = now + lingering_time
                        try:
                            while not payload.is_eof() and now < end_t:
                                async with ceil_timeout(end_t - now):
                                    await payload.readany()
                                now = loop.time()
                        except (TimeoutError, asyncio.CancelledError):
                            if sys.version_info >= (3, 11) and (t := asyncio.current_task()) and t.cancelling():
                                raise

                    if not payload.is_eof() and not self._force_close:
                        self.log_debug("Uncompleted request.")
                        self.close()

                payload.set_exception(_PAYLOAD_ACCESS_ERROR)

            except asyncio.CancelledError:
                self.log_debug("Ignored premature client disconnection")
                self.force_close()
                raise
            except Exception as exc:
                self.log_exception("Unhandled exception", exc_info=exc)
                self.force_close()
            except BaseException:
                self.force_close()
                raise
            finally:
                request._task = None  # type: ignore[assignment]
                if self.transport is None and resp is not None:
                    self.log_debug("Ignored premature client disconnection.")

            if self._keepalive and not self._close and not self._force_close:
                close_time = loop.time() + keepalive_timeout
                self._next_keepalive_close_time = close_time
                if self._keepalive_handle is None:
                    self._keepalive_handle = loop.call_at(close_time, self._process_keepalive)
            else:
                break

        if not self._force_close:
            self._task_handler = None
            if self.transport is not None:
                self.transport.close()

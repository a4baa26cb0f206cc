"""An in-process gateway on two tenant listeners of one app: the gateway's own server (``OwnSite``, as
gateway/server.py serves) and aiohttp's alone (``GuardedSite``, as the gateway served before), so a test can send
the same bytes to both and compare the answers; and a client that reads raw answers with llhttp's response parser."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httptools

from backends.registry import EngineSpec, NoSettings, register
from gateway.app import GatewayRunner, create_app
from gateway.appkeys import METRICS
from gateway.config import GatewayConfig, ListenConfig
from gateway.serving.connections import ConnectionGuard, GuardedSite, keepalive_timeout
from gateway.serving.own_server import OwnSite
from loadtests.fleet import api_key, gateway_config, write_adapters
from tests.gateway.residency.fakes import FakeDriver, FakeEngine

DRIVER = FakeDriver(FakeEngine())
register(EngineSpec("own-server-fake", NoSettings, lambda settings, pool: DRIVER))

KEY = api_key("acme")
BODY = b'{"model": "lora-a", "prompt": "hi", "max_tokens": 4}'


def request(
    body: bytes = BODY, key: str = KEY, path: str = "/v1/completions", extra: bytes = b"", method: bytes = b"POST"
) -> bytes:
    """One request's bytes: a Content-Length body, the tenant's key (none when empty) and ``extra`` header lines."""
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    return (
        method + b" " + path.encode() + b" HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n" + auth
        + f"Content-Length: {len(body)}\r\n".encode() + extra + b"\r\n" + body
    )  # fmt: skip


class Answer(NamedTuple):
    """An answer as compared: status, headers (names lower-cased, sorted, Date left out) and body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


class Answers:
    """llhttp's response parser's callbacks: the complete answers read so far."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self._headers: list[tuple[str, str]] = []
        self._body = b""
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._headers, self._body = [], b""

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() != b"date":
            self._headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.answers.append(Answer(self.parser.get_status_code(), tuple(sorted(self._headers)), self._body))


@dataclass
class Sites:
    own: int
    aiohttp: int
    guard: ConnectionGuard
    runner: GatewayRunner
    config: GatewayConfig
    seen: dict[str, Any] = field(default_factory=dict)

    def closed(self, reason: str) -> float:
        value: float = self.guard._metrics.client_connections_closed.labels(reason)._value.get()
        return value


async def read_answers(reader: asyncio.StreamReader, parsed: Answers, until: int) -> bool:
    """Read into ``parsed`` until it holds ``until`` answers; False when the server closed the connection first."""
    while len(parsed.answers) < until:
        chunk = await asyncio.wait_for(reader.read(65_536), 10)
        if not chunk:
            return False
        parsed.parser.feed_data(chunk)
    return True


async def exchange(port: int, data: bytes, answers: int = 1, probe: bool = True) -> tuple[list[Answer], str]:
    """Send ``data`` on a new connection and read ``answers`` answers, or what came before the server closed it;
    then, with ``probe``, what became of the connection: "kept" (a next request on it is answered), "closed"."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    parsed = Answers()
    fate = "kept"
    try:
        writer.write(data)
        if not await read_answers(reader, parsed, answers):
            fate = "closed"
        elif probe:
            writer.write(request())
            if await read_answers(reader, parsed, len(parsed.answers) + 1):
                parsed.answers.pop()
            else:
                fate = "closed"
    except (ConnectionResetError, BrokenPipeError):
        fate = "closed"
    finally:
        writer.close()
    return parsed.answers, fate


def config(
    tmp_path: Path,
    limits: dict[str, Any] | None = None,
    backend: str = "own-server-fake",
    pool: dict[str, Any] | None = None,
    tenants: dict[str, list[str]] | None = None,
) -> GatewayConfig:
    """One replica of ``backend``; tenant acme with adapter lora-a unless ``tenants`` says otherwise; ``pool``: the
    pool's fields to set (request_timeout_s...)."""
    tenants = tenants or {"acme": ["lora-a"]}
    adapters = write_adapters(tmp_path, sorted({name for names in tenants.values() for name in names}))
    raw = gateway_config({"r0": "http://127.0.0.1:9"}, tenants, adapters, port=0)
    raw["pools"][0].update({"backend": backend, **(pool or {})})
    if limits:
        raw["limits"] = limits
    return GatewayConfig.model_validate(raw)


async def two_sites(
    tmp_path: Path,
    listen: dict[str, Any] | None = None,
    limits: dict[str, Any] | None = None,
    backend: str = "own-server-fake",
    pool: dict[str, Any] | None = None,
    tenants: dict[str, list[str]] | None = None,
    **runner: Any,
) -> Sites:
    """The gateway app on an ``OwnSite`` and a ``GuardedSite`` sharing one runner and one guard (the guard's
    deadlines long unless ``listen`` says otherwise); ``runner``: aiohttp's handler settings (lingering_time...)."""
    DRIVER.engine, DRIVER.before_load = FakeEngine(), None
    gateway = config(tmp_path, limits, backend, pool, tenants)
    settings = ListenConfig(**{"header_timeout_s": 30, "idle_timeout_s": 30, "body_grace_s": 30, **(listen or {})})
    app = create_app(gateway)
    options = {"keepalive_timeout": keepalive_timeout(settings), **runner}
    gateway_runner = GatewayRunner(app, handler_cancellation=True, access_log=None, **options)
    await gateway_runner.setup()
    guard = ConnectionGuard(settings, app[METRICS])
    own = OwnSite(gateway_runner, guard, "127.0.0.1", 0, drain_timeout_s=runner.get("shutdown_timeout", 60.0),
                  drains=gateway_runner.drains)  # fmt: skip
    plain = GuardedSite(gateway_runner, guard, "127.0.0.1", 0)
    await own.start()
    await plain.start()
    guard.start()
    return Sites(own.port, plain.port, guard, gateway_runner, gateway)


async def sites_fixture(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """The ``sites`` fixture's body: start two_sites as often as a test asks, clean every one up after it."""
    started: list[Sites] = []

    async def start(**options: Any) -> Sites:
        sites = await two_sites(tmp_path, **options)
        started.append(sites)
        return sites

    yield start
    for sites in started:
        if sites.runner.server is not None:
            await sites.runner.cleanup()
        await sites.guard.stop()

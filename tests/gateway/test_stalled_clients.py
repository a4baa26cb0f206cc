"""Slow clients cost nothing (issue 20), against a gateway process: hundreds of stalled connections (127.0.0.1 only)
do not stop a normal request from being served, even under a low file limit; a tenant's half-sent bodies count
against its concurrency and are closed when they trickle."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from loadtests.faultkit import GatewayUnderTest, SimReplica, sim_replicas
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, write_adapters
from loadtests.processes import free_port

pytestmark = pytest.mark.timeout(180)

SIM = ["--time-scale", "0.1"]
STALLED = 300
FILE_LIMIT = 256  # below STALLED: without the caps, the stalled connections take every descriptor
UNAUTH_CAP_4 = {"header_timeout_s": 60, "max_unauthenticated_connections": 4}


def gateway(
    root: Path, replicas: dict[str, SimReplica], listen: dict[str, Any], tenant: dict[str, Any] | None = None
) -> GatewayUnderTest:
    adapters = write_adapters(root, ["lora-a"])
    urls = {name: replica.url for name, replica in replicas.items()}
    options = {"acme": tenant} if tenant else None
    config = gateway_config(urls, {"acme": ["lora-a"]}, adapters, port=free_port(), tenant_options=options)
    config["listen"].update(listen)
    process = GatewayUnderTest(root, config)
    process.cmd = ["prlimit", f"--nofile={FILE_LIMIT}:{FILE_LIMIT}", *process.cmd]
    return process


async def stall(port: int, count: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """``count`` connections that each send half a request head and then nothing."""
    connections = []
    for _ in range(count):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:  # the gateway cannot accept any more (what the caps prevent)
            break
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n")
        connections.append((reader, writer))
    return connections


async def closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 10) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_hundreds_of_stalled_connections_do_not_stop_a_normal_request(tmp_path: Path) -> None:
    """300 connections send half a head and stall, under a file limit of 256. The header deadline is a minute, so
    only the caps can help: at most 64 unauthenticated connections (each newcomer closes the oldest) and at most
    half the file limit open. A normal request through the openai SDK is served at once."""
    listen = {"header_timeout_s": 60, "max_unauthenticated_connections": 64}
    with sim_replicas(tmp_path, 1, *SIM) as replicas, gateway(tmp_path, replicas, listen) as gw:
        port = int(gw.url.rsplit(":", 1)[1])

        async def scenario() -> tuple[int, int]:
            stalled = await stall(port, STALLED)
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=api_key("acme"), max_retries=0, timeout=10)
            async with client:
                answer = await client.completions.create(model="lora-a", prompt="hello", max_tokens=4)
            assert answer.choices
            gone = sum(await asyncio.gather(*(closed(reader) for reader, _ in stalled)))
            for _, writer in stalled:
                writer.close()
            return len(stalled), gone

        opened, gone = asyncio.run(scenario())
    assert opened == STALLED
    assert gone >= STALLED - 64  # the gateway closed all but the newest 64 stalled connections


def test_a_tenants_half_sent_bodies_count_against_its_concurrency_and_trickles_are_closed(tmp_path: Path) -> None:
    """A tenant limited to 4 concurrent requests opens 10 connections, each sending its head (with its key) and 10
    bytes of a 100 kB body: 6 are refused at once with 429, the 4 others are closed when their body falls under
    1 kB/s after the 1 s grace, and then the tenant is served again."""
    listen = {"body_grace_s": 1, "min_body_bytes_per_s": 1024}
    with (
        sim_replicas(tmp_path, 1, *SIM) as replicas,
        gateway(tmp_path, replicas, listen, {"limits": {"max_concurrent": 4}}) as gw,
    ):
        port = int(gw.url.rsplit(":", 1)[1])
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {api_key('acme')}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        ).encode()

        async def one() -> str:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + b'{"model": ')
            try:
                status = await asyncio.wait_for(reader.readline(), 20)
            except (ConnectionResetError, BrokenPipeError):
                status = b""
            finally:
                writer.close()
            return "closed" if not status else status.decode().split()[1]

        async def scenario() -> list[str]:
            return list(await asyncio.gather(*(one() for _ in range(10))))

        outcomes = sorted(asyncio.run(scenario()))
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key("acme"), max_retries=0, timeout=10)
        assert client.completions.create(model="lora-a", prompt="hello", max_tokens=4).choices
    assert outcomes == ["429"] * 6 + ["closed"] * 4, outcomes


def test_an_admin_connection_is_not_evicted_as_unauthenticated(tmp_path: Path) -> None:
    """A kept-alive connection that presented the admin token is no longer one of the unauthenticated the listener
    caps: stalled newcomers evict each other, never it."""
    with sim_replicas(tmp_path, 1, *SIM) as replicas, gateway(tmp_path, replicas, UNAUTH_CAP_4) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        ask = f"GET /admin/residency HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n\r\n".encode()

        async def scenario() -> tuple[bytes, bytes]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(ask)
            first = await asyncio.wait_for(reader.readline(), 10)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
            await asyncio.wait_for(reader.readexactly(length), 10)  # the whole answer: the next one starts clean
            stalled = await stall(port, 12)  # three times the cap: the oldest stalled ones are closed
            assert sum(await asyncio.gather(*(closed(r) for r, _ in stalled[:8]))) == 8
            writer.write(ask)  # the same connection answers again
            second = await asyncio.wait_for(reader.readline(), 10)
            for _, stalled_writer in stalled:
                stalled_writer.close()
            writer.close()
            return first, second

        first, second = asyncio.run(scenario())
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 200"), (first, second)

"""A compressed body the gateway answers before reading (a 401 without a key, a 413 past limits.max_body_bytes) is
not decompressed after the answer (gateway/error_answers.py, ``unread_body``). aiohttp's lingering close read and
so decoded the rest on the event loop: a 200 KB gzip of 200 MiB cost the gateway 0.5-0.7 s of CPU, sent by anyone,
without a key. A real `tenantgate serve` process and its CPU time, from /proc."""

from __future__ import annotations

import contextlib
import socket
import zlib
from pathlib import Path

import pytest

from loadtests.fleet import api_key, fleet_with_gateway, process_cpu_s

pytestmark = pytest.mark.timeout(120)

SIM = ["--time-scale", "0.01", "--max-loras", "4"]
BOMB_MIB = 400


def gzip_bomb(mib: int) -> bytes:
    """``mib`` MiB of one byte as a JSON string, gzip-compressed (about 400 KB for 400 MiB)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip wrapper
    parts = [packer.compress(b'{"model": "support-acme", "prompt": "')]
    block = b"a" * (1 << 20)
    parts += [packer.compress(block) for _ in range(mib)]
    parts.append(packer.compress(b'"}') + packer.flush())
    return b"".join(parts)


@pytest.mark.parametrize("key", [None, api_key("acme")], ids=["no-key-401", "over-the-limit-413"])
def test_a_compressed_body_answered_unread_is_not_decompressed_and_its_connection_closes(
    tmp_path: Path, key: str | None
) -> None:
    bomb = gzip_bomb(BOMB_MIB)
    with fleet_with_gateway(tmp_path, {"acme": ["support-acme"]}, 1, SIM) as fleet:
        port = int(fleet.gateway_url.rsplit(":", 1)[1])
        auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
        head += b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb)
        before = process_cpu_s(fleet.gateway_pid)
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.settimeout(20)
            client.sendall(head + bomb)
            answer = b""
            # Until the gateway closes: it did not, it kept reading (lingering). Closing with the rest of the body
            # unread, it may reset the connection once its answer is out.
            with contextlib.suppress(ConnectionResetError):
                while chunk := client.recv(65536):
                    answer += chunk
        used = process_cpu_s(fleet.gateway_pid) - before
    assert answer.split(b"\r\n", 1)[0] == (
        b"HTTP/1.1 413 Request Entity Too Large" if key else b"HTTP/1.1 401 Unauthorized"
    )
    assert used < 0.5, f"the gateway spent {used:.2f} s of CPU on a body it refused"

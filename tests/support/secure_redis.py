"""A real redis-server as the overlays run it: TLS only (no plain port), a password, and client certificates
required (tls-auth-clients). The certificates come from the openssl command line, signed by a CA made here."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
import redis.exceptions

from loadtests.processes import free_port
from tests.redis_server import redis_server_binary
from tests.servers import debian_tool


@dataclass(frozen=True)
class SecureRedis:
    url: str  # rediss://localhost:PORT/0, no password in it (the name its certificate is for)
    password: str
    ca_file: Path
    cert_file: Path  # the client's certificate and key, signed by the CA
    key_file: Path

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(
            self.url, password=self.password, ssl_ca_certs=str(self.ca_file), ssl_certfile=str(self.cert_file),
            ssl_keyfile=str(self.key_file), decode_responses=True, socket_timeout=5,
        )  # fmt: skip


def _openssl(*args: str) -> None:
    subprocess.run([debian_tool("openssl", "redis"), *args], check=True, capture_output=True)


def make_certificates(root: Path) -> tuple[Path, Path, Path, Path, Path]:
    """A CA, a server certificate for the name localhost (not for 127.0.0.1), and a client certificate: (ca,
    server cert, server key, client cert, client key)."""
    root.mkdir(parents=True, exist_ok=True)
    ca, ca_key = root / "ca.crt", root / "ca.key"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
             "-subj", "/CN=tenantgate test CA")  # fmt: skip
    made = []
    for name, extension in (("server", "subjectAltName=DNS:localhost"), ("client", None)):
        key, request, cert = root / f"{name}.key", root / f"{name}.csr", root / f"{name}.crt"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(request),
                 "-subj", f"/CN=tenantgate test {name}")  # fmt: skip
        extra = []
        if extension is not None:
            (root / f"{name}.ext").write_text(extension + "\n")
            extra = ["-extfile", str(root / f"{name}.ext")]
        _openssl("x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
                 "-out", str(cert), "-days", "2", *extra)  # fmt: skip
        made += [cert, key]
    return ca, made[0], made[1], made[2], made[3]


@contextlib.contextmanager
def secure_redis(root: Path) -> Iterator[SecureRedis]:
    ca, server_cert, server_key, client_cert, client_key = make_certificates(root / "tls")
    port, password = free_port(), secrets.token_urlsafe(24)
    cmd = [
        redis_server_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "-::1",
        "--tls-cert-file", str(server_cert), "--tls-key-file", str(server_key), "--tls-ca-cert-file", str(ca),
        "--tls-auth-clients", "yes", "--requirepass", password, "--save", "", "--appendonly", "no",
        "--dir", str(root),
    ]  # fmt: skip
    server = SecureRedis(f"rediss://localhost:{port}/0", password, ca, client_cert, client_key)
    with (root / "secure-redis.log").open("ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if server.client().ping():
                    break
            except (redis.exceptions.ConnectionError, OSError):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((root / "secure-redis.log").read_text()[-2000:]) from None
                time.sleep(0.05)
        yield server
    finally:
        process.kill()
        process.wait(timeout=10)

"""deploy/compose.yaml serves completions as shipped. No container engine runs here, so the test reads each
service's command, environment and mounts from the compose file itself (and the image's ENTRYPOINT from
deploy/Dockerfile), runs the same commands as plain processes on loopback, and sends completions through the
openai SDK. What it adapts, and nothing else: each service's name and port become 127.0.0.1 and a free port,
0.0.0.0 becomes 127.0.0.1, and a path inside a container becomes the host path compose mounts there (all
processes share this machine's file system, so a mount is a path rewrite)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from loadtests.processes import free_port, running, stop
from tests.redis_server import answers_ping, redis_server_binary

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
# What each service listens on inside its container when its command does not say (--port does for `sim`).
IMAGE_PORTS = {"redis": 6379}


@dataclass
class Service:
    name: str
    argv: list[str]
    environment: dict[str, str]
    mounts: dict[str, Path]  # container path -> host path
    depends_on: list[str]
    container_port: int
    port: int  # the free loopback port it gets here


def image_entrypoint() -> list[str]:
    [entrypoint] = re.findall(r"^ENTRYPOINT (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE)
    command: list[str] = json.loads(entrypoint)
    return command


def _mounts(spec: dict[str, Any]) -> dict[str, Path]:
    mounts = {}
    for volume in spec.get("volumes", []):
        host, container, *_ = volume.split(":")
        assert host.startswith("."), f"{volume}: the test runs bind mounts of files in the repository only"
        mounts[container] = (DEPLOY / host).resolve()
    return mounts


def _container_port(name: str, argv: list[str], spec: dict[str, Any], mounts: dict[str, Path]) -> int:
    if "--port" in argv:
        return int(argv[argv.index("--port") + 1])
    if name in IMAGE_PORTS:
        return IMAGE_PORTS[name]
    # The gateway: the port its config listens on, which must be the one compose publishes.
    config = yaml.safe_load(mounts[argv[argv.index("--config") + 1]].read_text())
    published = {int(p.split(":")[-1]) for p in spec.get("ports", [])}
    assert config["listen"]["port"] in published, (config["listen"], spec.get("ports"))
    port: int = config["listen"]["port"]
    return port


def read_services() -> dict[str, Service]:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = {}
    for name, spec in compose["services"].items():
        if "build" in spec:  # our image: its ENTRYPOINT unless the service replaces it
            argv = list(spec.get("entrypoint") or image_entrypoint()) + list(spec.get("command", []))
        else:
            argv = list(spec["command"])
        mounts = _mounts(spec)
        services[name] = Service(
            name=name,
            argv=argv,
            environment={k: str(v) for k, v in (spec.get("environment") or {}).items()},
            mounts=mounts,
            depends_on=list(spec.get("depends_on", [])),
            container_port=_container_port(name, argv, spec, mounts),
            port=free_port(),
        )
    return services


class Translate:
    """Rewrites a string from the containers' world to this machine's."""

    def __init__(self, services: dict[str, Service]) -> None:
        self.addresses = {f"{s.name}:{s.container_port}": f"127.0.0.1:{s.port}" for s in services.values()}
        self.paths: dict[str, Path] = {}
        for service in services.values():
            for container, host in service.mounts.items():
                # One meaning per container path, or the rewrite would be wrong for some service.
                assert self.paths.setdefault(container, host) == host, container
        self.paths = dict(sorted(self.paths.items(), key=lambda item: -len(item[0])))

    def __call__(self, text: str) -> str:
        for address, local in self.addresses.items():
            text = text.replace(address, local)
        for container, host in self.paths.items():
            if text == container or text.startswith(container + "/"):
                return str(host) + text[len(container) :]
        return "127.0.0.1" if text == "0.0.0.0" else text

    def tree(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.tree(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.tree(v) for v in value]
        return self(value) if isinstance(value, str) else value


def local_argv(service: Service, translate: Translate, work: Path) -> list[str]:
    argv = [translate(arg) for arg in service.argv]
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(service.port)
    if "--config" in argv:  # the gateway's mounted config: the same file, its addresses and paths rewritten
        config = translate.tree(yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()))
        config["listen"] = {"host": "127.0.0.1", "port": service.port}
        local = work / f"{service.name}.yaml"
        local.write_text(yaml.safe_dump(config))
        argv[argv.index("--config") + 1] = str(local)
    program, *rest = argv
    if program == "tenantgate":
        return [sys.executable, "-m", "gateway.cli", *rest]
    if program == "redis-server":
        return [redis_server_binary(), *rest, "--port", str(service.port), "--bind", "127.0.0.1"]
    raise AssertionError(f"{service.name}: the test does not know how to run {program!r} without its image")


def start_order(services: dict[str, Service]) -> list[Service]:
    order: list[Service] = []
    while len(order) < len(services):
        ready = [s for s in services.values() if s not in order and all(services[d] in order for d in s.depends_on)]
        assert ready, "depends_on has a cycle"
        order += ready
    return order


@contextmanager
def redis_process(argv: list[str], log_path: Path) -> Iterator[None]:
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield
    finally:
        stop(process)


def _wait_for_ping(port: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not answers_ping(port):
        assert time.monotonic() < deadline, f"redis-server did not answer on {port}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def compose_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    services = read_services()
    translate = Translate(services)
    work = tmp_path_factory.mktemp("compose")
    with ExitStack() as stack:
        for service in start_order(services):
            argv = local_argv(service, translate, work)
            url = f"http://127.0.0.1:{service.port}"
            log = work / f"{service.name}.log"
            if argv[0].endswith("redis-server"):
                stack.enter_context(redis_process(argv, log))
                _wait_for_ping(service.port)
                continue
            # The gateway is ready once its replicas passed a probe; a replica once it answers /health.
            path = "/readyz" if "serve" in argv else "/health"
            stack.enter_context(running(argv, url, log, env=service.environment, start_timeout_s=60, health_path=path))
        yield services


def test_compose_serves_completions_through_the_openai_sdk(compose_up: dict[str, Service]) -> None:
    gateway = compose_up["gateway"]
    # The keys the compose file's comment gives (deploy/examples/gateway.yaml's), as a tenant app would use them.
    for key, model in (("acme-secret-key", "support-acme"), ("globex-secret-key", "sql-globex")):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=key, max_retries=0, timeout=30)
        completion = client.completions.create(model=model, prompt="Hello", max_tokens=16)
        assert completion.choices[0].text
        assert completion.model == model
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert chat.choices[0].message.content


def test_the_weak_example_admin_token_is_published_on_loopback_only() -> None:
    """compose keeps the example admin token (change-me), which serve refuses unless the config allows a weak one:
    that is only for a gateway nothing but this machine can reach."""
    gateway = yaml.safe_load(COMPOSE.read_text())["services"]["gateway"]
    config = yaml.safe_load(_mounts(gateway)["/etc/tenantgate/gateway.yaml"].read_text())
    if config.get("admin", {}).get("allow_weak_token"):
        assert all(port.startswith("127.0.0.1:") for port in gateway["ports"]), gateway["ports"]

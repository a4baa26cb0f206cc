"""Engines by registration: a new engine is one module that calls ``register`` when it is imported.

An ``EngineSpec`` says everything the gateway needs to know about an engine kind:

- ``name``: what a pool's ``backend:`` names, and the key of the pool's own section for it (``triton:``);
- ``settings``: that section's pydantic model (frozen, ``extra="forbid"``); ``NoSettings`` when it has none;
- ``driver``: the factory of the pool's driver, from the section and the ``PoolSettings`` every pool gives;
- ``replica``: an optional pydantic model of the extra keys a replica entry may carry (Triton's ``grpc`` and
  ``metrics_url``); ``endpoint`` turns a replica entry into the ``Endpoint`` the driver takes (a subclass of it
  when the engine needs more than an id and a URL);
- ``checks``: optional config checks over a pool's adapters, run when the config is validated (problems as
  lines); ``read_adapters``: optional checks that read the adapters, for ``tenantgate check-config
  --read-adapters``.

The built-in engines (``backends.vllm``, ``backends.triton``) are always registered: the registry imports them
on first use. Other engines are registered by importing their module: a gateway config lists the modules in its
top-level ``engines:`` list (``engines: [mycompany.sglang_engine]``), and the config loader imports each one
(``load_engine``) before it validates the pools, in every process that loads the config (``tenantgate serve``,
``check-config``, a reload). The module must be importable by the gateway's Python (installed, or on
``PYTHONPATH``). A registration lasts as long as the process: a reload that drops a module from ``engines:``
leaves its engines known until the gateway restarts (``check-config``, a fresh process, sees what a restart
would). This module never imports ``gateway``: ``backends/`` stands on its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from backends.base import AdapterEvent, AdapterRef, Endpoint, EngineDriver

BUILTIN_MODULES = ("backends.vllm", "backends.triton")


class NoSettings(BaseModel):
    """The section of an engine that has no settings of its own: empty."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def _no_events(replica_id: str, adapter: str, event: str) -> None:
    """The default adapter-event callback: nobody listening."""


@dataclass(frozen=True)
class PoolSettings:
    """What every pool gives its driver, whatever the engine."""

    pool: str
    connect_timeout_s: float
    request_timeout_s: float
    adapter_load_timeout_s: float
    probe_timeout_s: float
    max_connections_per_replica: int
    # The engine reported something about an adapter on a replica (Triton: "cache_miss", "cache_full"); the
    # gateway counts it (tenantgate_engine_adapter_events_total) and logs it.
    on_adapter_event: AdapterEvent = _no_events


@dataclass(frozen=True)
class ConfiguredReplica:
    """A replica as the config gives it: id, URL (no trailing slash), the URL's host (an IPv6 host in brackets)
    and the engine's own replica keys (an instance of the spec's ``replica`` model, or None)."""

    id: str
    url: str
    host: str
    extras: BaseModel | None = None


def plain_endpoint(replica: ConfiguredReplica, settings: BaseModel) -> Endpoint:
    """The endpoint of an engine reached at one URL."""
    return Endpoint(replica.id, replica.url)


S = TypeVar("S", bound=BaseModel)
# (pool name, the pool's engine settings, its adapters by catalog name) -> problems, one line each.
AdapterCheck = Callable[[str, S, Mapping[str, AdapterRef]], list[str]]


@dataclass(frozen=True)
class EngineSpec(Generic[S]):
    """One engine kind, as registered (see the module's docstring)."""

    name: str
    settings: type[S]
    driver: Callable[[S, PoolSettings], EngineDriver]
    replica: type[BaseModel] | None = None
    endpoint: Callable[[ConfiguredReplica, S], Endpoint] = plain_endpoint
    checks: AdapterCheck[S] | None = None
    read_adapters: AdapterCheck[S] | None = None
    # The engine queues a request whose adapter finds no free slot until one frees (vLLM), rather than refusing
    # it (TensorRT-LLM: "PEFT Cache is full"). The gateway then lets a working set run over its bound briefly
    # instead of failing a request the engine would serve.
    queues_when_full: bool = True
    # The engine runs an adapter load between its steps, stalling every request there (vLLM), rather than as a
    # request among the others (TensorRT-LLM: a one-token request carrying the weights). The gateway then holds a
    # replica after a load until the requests that waited for it have started (``residency.load_settle_s``).
    loads_between_steps: bool = True
    # The engine takes a request's ``cache_salt`` (vLLM: mixed into its prefix-cache block hashes), so the gateway
    # can keep tenants that call one model out of each other's cached prefixes.
    takes_cache_salt: bool = False


class UnknownEngine(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown engine {name!r}; registered engines: {', '.join(names())}")
        self.name = name


class EngineImportError(ImportError):
    """An engine module listed in a config could not be imported."""

    def __init__(self, module: str, cause: BaseException) -> None:
        super().__init__(f"cannot import engine module {module!r}: {type(cause).__name__}: {cause}")
        self.module = module


_specs: dict[str, EngineSpec[Any]] = {}
_builtins_loaded = False


def register(spec: EngineSpec[Any]) -> EngineSpec[Any]:
    """Make ``spec`` the engine of its name. Registering the very same spec again is a no-op; another engine
    under a taken name is an error (two modules would fight over what ``backend: NAME`` means)."""
    known = _specs.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(
            f"engine {spec.name!r} is already registered (by {known.driver.__module__}); "
            f"{spec.driver.__module__} cannot register it again"
        )
    _specs[spec.name] = spec
    return spec


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def find(name: str) -> EngineSpec[Any] | None:
    """The engine registered under ``name``, or None."""
    _load_builtins()
    return _specs.get(name)


def spec(name: str) -> EngineSpec[Any]:
    """The engine registered under ``name``; raises ``UnknownEngine`` naming the registered ones."""
    found = find(name)
    if found is None:
        raise UnknownEngine(name)
    return found


def names() -> list[str]:
    """The registered engines' names, sorted."""
    _load_builtins()
    return sorted(_specs)


def load_engine(module: str) -> None:
    """Import an engine module (it registers its engines on import); raises ``EngineImportError`` if that fails.
    A module already imported is not imported again."""
    _load_builtins()
    try:
        importlib.import_module(module)
    except Exception as exc:  # whatever the module raised: the operator needs to see it, with the module's name
        raise EngineImportError(module, exc) from exc

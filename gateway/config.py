"""The gateway's configuration: YAML validated by pydantic, frozen, unknown keys rejected.

Cross-references (an adapter's pool, a tenant's adapters) are checked here, so a config that loads is one the
gateway can serve. ``load_config`` raises ``ConfigError`` listing every problem with the path of its field.

Engines are registered (backends/registry.py), not listed here: a pool's ``backend`` names a registered engine,
whose spec validates the pool's section under the engine's name (``triton: {...}``) and its replicas' own keys,
and checks its adapters. The top-level ``engines:`` list names modules to import first, which register more.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    InstanceOf,
    IPvAnyNetwork,
    ModelWrapValidatorHandler,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError
from pydantic_core.core_schema import ErrorType

from backends import registry as engines
from backends.base import AdapterRef
from backends.registry import EngineSpec, NoSettings
from gateway import adapter_sources
from gateway.routing.scorers import SCORERS

# "@" for versions: support-acme@2 is version 2 of the tenant-facing name support-acme.
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@-]*$")]
KeyHash = Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
Policy = Literal["bounded_consistent_hash", "predicted_ttft", "consistent_hash", "round_robin", "least_loaded"]
_MODULE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
ModuleName = Annotated[str, Field(pattern=_MODULE)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ListenConfig(_Frozen):
    """The tenant listener, and what a client connection may cost (gateway/serving/connections.py): its request
    line and headers within header_timeout_s; its body at min_body_bytes_per_s on average after body_grace_s; closed
    after idle_timeout_s without a request; at most max_connections open (and never more than half the process's
    file limit), at most max_unauthenticated_connections without a valid key yet (a newcomer closes the oldest)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    header_timeout_s: float = Field(default=10.0, gt=0, le=600)
    body_grace_s: float = Field(default=10.0, ge=0, le=600)
    min_body_bytes_per_s: int = Field(default=1024, ge=0)
    idle_timeout_s: float = Field(default=75.0, gt=0, le=3600)
    max_connections: int = Field(default=4096, ge=1)
    max_unauthenticated_connections: int = Field(default=256, ge=1)


class TtftPriors(_Frozen):
    """predicted_ttft's starting point (gateway/routing/costs.py): each regime's TTFT at no load, and what each
    request ahead adds, in milliseconds. Learned from measured TTFTs from there. The defaults are a 7B model with
    rank-16 adapters on one data-centre GPU (docs/architecture.md's latency table)."""

    warm_ms: float = Field(default=20.0, ge=0, le=600_000)
    kv_cold_ms: float = Field(default=40.0, ge=0, le=600_000)
    host_ms: float = Field(default=70.0, ge=0, le=600_000)
    cold_ms: float = Field(default=500.0, ge=0, le=600_000)
    per_request_ms: float = Field(default=10.0, ge=0, le=600_000)
    # The wait for a GPU adapter slot (the gpu_slot scorer, off by default): a request whose adapter is not in use on
    # a replica whose GPU slots other adapters in use fill all. Above 0, so a learned wait never vanishes.
    gpu_slot_ms: float = Field(default=200.0, gt=0, le=600_000)


class RoutingConfig(_Frozen):
    # tenant: one home per tenant; adapter: one home per adapter; session: tenant + x-session-id (or `user`).
    affinity: Literal["tenant", "adapter", "session"] = "tenant"
    # No replica takes more than ceil(balance_factor x mean in-flight load); 1.0 would forbid any imbalance.
    balance_factor: float = Field(default=1.25, ge=1.0, le=10.0)
    # ... but a replica with fewer requests than this in flight (+ reserved) is never over capacity: an engine
    # batches a few more sequences almost for free, while a spill can cost a cold adapter load (100 ms to over
    # 1 s). 1 gives the plain bound.
    capacity_floor: int = Field(default=8, ge=1, le=100_000)
    vnodes: int = Field(default=160, ge=1, le=10_000)
    # A decision weighs `candidates` replicas at most, so it costs the same at any fleet size: the first of the
    # key's ring order, of which the last (up to half) give way to replicas where its adapter is resident outside
    # them. Pools this size or smaller: all.
    candidates: int = Field(default=8, ge=1, le=1024)
    # What the bound counts on each replica: "gateway", this gateway's own requests in flight (with N gateways it
    # sees about 1/N of a replica's queue); "engine", the engine's own queue (running + waiting, scraped every
    # load_scrape_interval_s) plus this gateway's change since that scrape, falling back to its own count when the
    # scrape is older than 3 intervals or failed; "shared", this gateway's own plus the requests the other gateways
    # sharing its Redis have in flight there, as each shares them every 50 ms (gateway/residency/signal.py; without
    # Redis the same as "gateway"). The default: with 3 gateways on the hot trace its TTFT p99 was within one
    # gateway's spread where "gateway"'s was not (docs/benchmarks.md, "Three gateways").
    load_view: Literal["gateway", "engine", "shared"] = "shared"
    load_scrape_interval_s: float = Field(default=0.5, gt=0, le=60)
    # balanced: the tenants (or adapters) this file names get homes balanced over each pool's replicas, at most
    # ceil(keys / replicas) each (gateway/routing/ring.py); ring: every home where the ring puts it. Sessions and
    # tenants added at run time keep their ring home.
    # traffic: balanced homes to start with, then every placement.interval_s homes follow the measured traffic
    # (gateway/placement/): expected load and adapter count even per replica, hot keys on more than one replica.
    home_placement: Literal["balanced", "ring", "traffic"] = "balanced"
    # bounded_consistent_hash: a key active within this window keeps one slot at its home, so a hot key's
    # overflow cannot push it off (gateway/routing/reservations.py). 0 turns reservations off.
    home_reservation_s: float = Field(default=2.0, ge=0, le=3600)
    # When a request must leave its home, prefer an allowed replica where its adapter is already resident over
    # the next one on the ring (false: ring order only, the plain bounded-load rule). bounded_consistent_hash only:
    # predicted_ttft always reads residency (it is the host regime's evidence).
    prefer_resident: bool = True
    # --- predicted_ttft (gateway/routing/costs.py and scorers/) ---
    ttft_priors: TtftPriors = TtftPriors()
    # How much each measured TTFT (streams only) weighs against the past when the lines are refitted; about
    # 1/rate recent requests make up the model. 0 keeps the priors.
    ttft_learning_rate: float = Field(default=0.05, ge=0, le=1)
    # A key served on a replica this recently counts as having its prefix in that replica's KV cache.
    prefix_warm_s: float = Field(default=30.0, ge=0, le=86_400)
    # Leaving the key's home must be predicted faster by more than this (the affinity scorer's hysteresis).
    affinity_margin_ms: float = Field(default=10.0, ge=0, le=600_000)
    # predicted_ttft, for a hot key (its requests in flight reach capacity_floor on every replica where its adapter
    # is warm and are two thirds of the load there; counted by the home reservations): a replica where its adapter
    # is cold is chosen only when predicted faster than a warm one by more than this (the load runs on the request's
    # path and stalls the requests already there), and one predicted within this of the warm ones gets the adapter
    # loaded and warmed in the background, one at a time per pool, so the key's next requests spill there warm; no
    # more once the adapter is resident on spill_warm_replicas replicas. 0 (the default) turns both off: a cold
    # replica is taken when predicted faster. 500 meets issue 19's hot-trace point; on the collide trace it now costs
    # no cold loads beyond the seeds' spread, but its TTFT p99 rose 12-17% (6 of 6 seeds; docs/benchmarks.md), so
    # it is opt-in.
    cold_margin_ms: float = Field(default=0.0, ge=0, le=600_000)
    # predicted_ttft: a key whose adapter is resident on two replicas or more takes no replica where it is cold on
    # the request path, however much faster predicted: the adapter is warmed there in the background instead (due)
    # once that replica is predicted faster, and the key's next requests spill there warm. A key with one copy
    # still spills cold when faster (its first spill loads its second). Issue 19's hot trace: the hot tenant's
    # next copy, loaded on the request path, cost up to 9 of its streams a cold load in most seeds; held, none
    # (the streams a decision log found), with TTFT and the other traces within the seeds' spread
    # (docs/benchmarks.md, "Hot: a key's copies held at the defaults").
    hold_copies: bool = True
    spill_warm_replicas: int = Field(default=3, ge=1, le=1024)
    # A warm-up ahead takes a free slot, or pushes out only an adapter no request has used for this long, until the
    # cold replica is predicted faster outright (then the key would take it without the margin, pushing out the same
    # adapter): one still in use pushed out for a copy costs its tenant a cold load on the request path (collide: 16
    # adapters in 16 slots, where that tenant then pushes out another).
    spill_warm_idle_s: float = Field(default=5.0, ge=0, le=86_400)
    # The scorers summed into a candidate's predicted TTFT, by name (gateway/routing/scorers/), with weights;
    # a weight of 0 turns one off.
    scorers: dict[str, float] = Field(
        default_factory=lambda: {"queue": 1.0, "regime": 1.0, "affinity": 1.0, "cold_stall": 1.0}
    )
    # The `eviction` scorer (off unless named in `scorers`; gateway/routing/scorers/eviction.py): a cold load where
    # the adapter set is full pushes out the least recently used idle adapter; the chance that it is wanted there
    # again within eviction_horizon_s follows from its request rate (a moving average over reuse_window_s, shared
    # by the replicas that hold it), and a victim wanted again costs eviction_cost cold loads.
    eviction_horizon_s: float = Field(default=5.0, gt=0, le=86_400)
    reuse_window_s: float = Field(default=30.0, gt=0, le=86_400)
    eviction_cost: float = Field(default=2.0, ge=0, le=100)

    @field_validator("scorers")
    @classmethod
    def _known_scorers(cls, weights: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(weights) - set(SCORERS))
        if unknown:
            raise ValueError(f"unknown scorers {unknown}; known: {sorted(SCORERS)}")
        if any(not 0 <= weight <= 1000 for weight in weights.values()):
            raise ValueError("scorer weights must be between 0 and 1000")
        return weights

    @model_validator(mode="after")
    def _traffic_homes_not_by_session(self) -> RoutingConfig:
        # Homes from traffic plan one adapter slot per key, and bound a key's copies per key: a tenant's session
        # keys share its one adapter, so the slot count is wrong (two sessions' copies on one replica count two
        # slots), and a tenant splitting its demand over sessions passed the bound (20 in flight as two keys cost
        # its neighbours 4 planned slots, as one key none: tests/gateway/placement/test_plan.py). Refused, not bounded.
        if self.affinity == "session" and self.home_placement == "traffic":
            raise ValueError(
                "home_placement: traffic cannot be used with affinity: session: the plan counts one adapter slot per"
                " key, and a tenant's session keys share one adapter, so a tenant could split its demand over"
                " sessions to take its neighbours' slots; use affinity: tenant (or adapter) with traffic homes, or"
                " home_placement: balanced with session affinity"
            )
        return self


class ReplicaConfig(_Frozen):
    """A replica entry. ``id`` and ``url`` are every engine's; any other key is the pool's engine's own (Triton:
    ``grpc``, ``metrics_url``), validated by its spec's replica model when the pool is, and held in ``extras``
    (written back as the entry's own keys when the config is dumped)."""

    id: Name
    # The engine's HTTP endpoint (vLLM: its OpenAI API; Triton: health and metadata).
    url: HttpUrl
    extras: SerializeAsAny[InstanceOf[BaseModel]] | None = None

    @model_serializer(mode="wrap")
    def _extras_as_keys(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        extras = data.pop("extras", None)
        return {**data, **(extras or {})}


class HealthConfig(_Frozen):
    """Active probes: the engine's health endpoint every interval_s; down after unhealthy_after failed probes in
    a row, up again after healthy_after good ones."""

    interval_s: float = Field(default=2.0, gt=0, le=3600)
    timeout_s: float = Field(default=2.0, gt=0, le=600)
    unhealthy_after: int = Field(default=2, ge=1, le=100)
    healthy_after: int = Field(default=2, ge=1, le=100)


class OutlierConfig(_Frozen):
    """Passive outlier detection: a replica whose requests fail this many times in a row, counting only failures
    that point at the replica (gateway/fleet/outlier.py says which), is ejected for base_ejection_s, doubled at each
    ejection up to max_ejection_s; at most max_ejected_percent of a pool is ejected at once. stall_after_s: an
    engine that generated no token for this long while requests wait in it has stalled (its metrics are scraped
    every telemetry.engine_scrape_interval_s, which must be shorter)."""

    consecutive_failures: int = Field(default=5, ge=1, le=1000)
    base_ejection_s: float = Field(default=10.0, gt=0)
    max_ejection_s: float = Field(default=300.0, gt=0)
    max_ejected_percent: int = Field(default=50, ge=0, le=100)
    stall_after_s: float = Field(default=15.0, gt=0, le=3600)


class RetryConfig(_Frozen):
    """A request that failed before its first byte reached the client is retried once on the next replica, while
    retries stay under budget_ratio of recent requests (or min_per_s), so they cannot amplify an outage."""

    enabled: bool = True
    budget_ratio: float = Field(default=0.2, ge=0, le=1)
    min_per_s: float = Field(default=3.0, ge=0)


class DiscoveryConfig(_Frozen):
    """Replicas from DNS instead of a static list, re-resolved every interval_s; a change rebuilds the pool as a
    config reload would. SRV (a Kubernetes headless Service of a StatefulSet): each target's first label is the
    replica id (stable across restarts, so the ring keeps its shape) and its port the replica's. A: each address
    is a replica on ``port``, its id the address itself."""

    name: str = Field(min_length=1, max_length=253)
    record: Literal["SRV", "A"] = "SRV"
    port: int = Field(default=8000, ge=1, le=65535)
    interval_s: float = Field(default=10.0, gt=0, le=3600)
    # Nameservers to ask instead of the system's (host or host:port).
    nameservers: list[str] = Field(default_factory=list)


class PoolConfig(_Frozen):
    name: Name
    # The engine: a registered one (backends/registry.py): vllm, triton, or one a module of `engines:` registers.
    backend: Name
    # The engine's own section, written under its name (`triton: {...}`) and validated by its spec's model.
    settings: SerializeAsAny[InstanceOf[BaseModel]] = NoSettings()
    base_model: Name
    # predicted_ttft: the lowest predicted time to first token under the bounded-load cap (docs/architecture.md);
    # bounded_consistent_hash, consistent_hash, round_robin and least_loaded are baselines.
    policy: Policy = "predicted_ttft"
    # Resident adapters per replica the gateway plans for (at most the engine's own --max-cpu-loras).
    max_adapters: int = Field(default=4, ge=1)
    # Requests one replica runs at once (the engine's --max-num-seqs). Stated, homes from traffic size a heavy
    # key's replica set by it (placement.seat_share), and a spill leaves a key's planned replicas only once each
    # runs this many (placement.off_plan_queue 0). 0: not stated (not learned either: an engine also queues requests
    # whose adapter waits for a GPU slot, so a queue seen is no seat count). A stated figure below what an engine
    # reports running at once is wrong, and raised to that (logged once: gateway/fleet/pool.py), then follows the
    # engines down again with hysteresis, never below the stated figure (pool.SEATS_FOLLOW_S).
    seats: int = Field(default=0, ge=0, le=1_000_000)
    # A static list, or replicas found through DNS (discovery), which then replaces this list with what it finds.
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    discovery: DiscoveryConfig | None = None
    connect_timeout_s: float = Field(default=2.0, gt=0)
    request_timeout_s: float = Field(default=300.0, gt=0)
    # The engine's context length in tokens (vLLM's --max-model-len): no request uses more per sequence, so no usage
    # report is charged more (gateway/tenants/admission.py). The default is above every model's; set it to tighten.
    context_tokens: int = Field(default=1_048_576, ge=1)
    adapter_load_timeout_s: float = Field(default=60.0, gt=0)
    max_connections_per_replica: int = Field(default=256, ge=1)
    health: HealthConfig = HealthConfig()
    outlier: OutlierConfig = OutlierConfig()
    retry: RetryConfig = RetryConfig()
    # A replica back from down or ejection takes a growing share of its capacity over this long (0: at once).
    slow_start_s: float = Field(default=10.0, ge=0, le=3600)
    # Chat content part types a request to this pool may carry (OpenAI's text, image_url, input_audio, file...):
    # text only by default, so no URL or file reaches an engine unless the operator lets it.
    content_part_types: frozenset[Annotated[str, Field(pattern=r"^[a-z_]+$")]] = frozenset({"text"})
    # chat_template_kwargs keys a request may set (e.g. enable_thinking); none by default. Never a template: a key
    # naming one is refused here, so a request can never make the engine render a template it brings.
    chat_template_kwargs: frozenset[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = frozenset()
    # Prefix-cache isolation: a request for a model another tenant can also call (a base model, an adapter two
    # tenants list) carries a cache_salt of its tenant's own, so no tenant's prompt hits (and so times) a prefix
    # another cached. For engines that take a salt (vLLM; Triton pools get none: docs/triton.md). false: tenants
    # of one model share its prefix cache.
    cache_salt: bool = True

    @property
    def salts_prefix_cache(self) -> bool:
        return self.cache_salt and engines.spec(self.backend).takes_cache_salt

    @model_validator(mode="after")
    def _no_template_kwargs(self) -> PoolConfig:
        templates = sorted(key for key in self.chat_template_kwargs if "template" in key.lower())
        if templates:
            raise ValueError(f"chat_template_kwargs may not allow a template: {templates}")
        return self

    @model_validator(mode="after")
    def _unique_replicas(self) -> PoolConfig:
        if self.discovery is None and not self.replicas:
            raise ValueError("a pool needs replicas, or discovery to find them")
        _reject_duplicates("replica id", [r.id for r in self.replicas])
        _reject_duplicates("replica url", [str(r.url) for r in self.replicas])
        return self

    @model_validator(mode="wrap")
    @classmethod
    def _engine_keys(cls, data: Any, handler: ModelWrapValidatorHandler[PoolConfig]) -> PoolConfig:
        """The engine's own keys, by its registered spec: the section under the engine's name into ``settings``,
        each replica's extra keys into its ``extras``. Their problems are reported with every other one."""
        if not isinstance(data, dict):
            return handler(data)
        data, problems = _engine_keys(data)
        try:
            pool = handler(data)
        except ValidationError as exc:
            if not problems:
                raise
            problems += [_relocated(error, ()) for error in exc.errors()]
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return pool

    @model_serializer(mode="wrap")
    def _section_under_engine_name(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dumped as written: the engine's section under its name (none for an engine without settings)."""
        data: dict[str, Any] = handler(self)
        settings = data.pop("settings", None)
        if type(self.settings).model_fields:
            data[self.backend] = settings
        return data


_REPLICA_KEYS = frozenset({"id", "url"})
_ERROR_TYPES = frozenset(get_args(ErrorType))


def _engine_keys(data: dict[str, Any]) -> tuple[dict[str, Any], list[InitErrorDetails]]:
    """A pool's raw entry with its engine's keys validated: (the entry for the model's own fields, problems)."""
    data = dict(data)
    problems: list[InitErrorDetails] = []
    backend = data.get("backend")
    engine = engines.find(backend) if isinstance(backend, str) else None
    if isinstance(backend, str) and engine is None:
        known = ", ".join(engines.names())
        message = f"unknown engine {backend!r}; registered engines: {known} (modules in `engines:` register more)"
        problems.append(_problem(("backend",), backend, message))
    elif engine is not None and engine.name in PoolConfig.model_fields:
        message = f"engine {engine.name!r} cannot have a section: its name is a pool key"
        problems.append(_problem(("backend",), backend, message))
        engine = None
    for name in engines.names():
        if name != backend and name in data and name not in PoolConfig.model_fields:
            article = "an" if str(backend)[:1] in tuple("aeiou") else "a"
            problems.append(_problem((name,), data.pop(name), f"`{name}` settings on {article} {backend} pool"))
    if "settings" in data and (engine is None or not isinstance(data["settings"], engine.settings)):
        problems.append(_extra(("settings",), data.pop("settings")))  # not a key of the file: the section is
    if engine is None:
        return data, problems
    if engine.name in data or "settings" not in data:
        settings = _validated(engine.settings, data.pop(engine.name, None) or {}, (engine.name,), problems)
        data.pop("settings", None)
        if settings is not None:
            data["settings"] = settings
    replicas = data.get("replicas")
    if isinstance(replicas, list):
        data["replicas"] = [
            _replica_keys(engine, entry, index, problems) if isinstance(entry, dict) else entry
            for index, entry in enumerate(replicas)
        ]
    return data, problems


def _replica_keys(
    engine: EngineSpec[Any], entry: dict[str, Any], index: int, problems: list[InitErrorDetails]
) -> dict[str, Any]:
    """A replica entry with its engine's own keys validated into ``extras``."""
    own = {key: value for key, value in entry.items() if key not in _REPLICA_KEYS}
    entry = {key: value for key, value in entry.items() if key in _REPLICA_KEYS}
    accepted = engine.replica.model_fields if engine.replica is not None else {}
    for key in [key for key in own if key not in accepted]:
        owners = [name for name in engines.names() if key in (engines.spec(name).replica or NoSettings).model_fields]
        if owners:
            message = f"replica `{key}` is for {' and '.join(owners)} pools, not {engine.name}"
            problems.append(_problem(("replicas", index, key), own.pop(key), message))
        elif engine.replica is None:
            problems.append(_extra(("replicas", index, key), own.pop(key)))
    if engine.replica is not None:
        extras = _validated(engine.replica, own, ("replicas", index), problems)
        if extras is not None:
            entry["extras"] = extras
    return entry


def _validated(
    model: type[BaseModel], value: Any, where: tuple[str | int, ...], problems: list[InitErrorDetails]
) -> BaseModel | None:
    """``value`` validated by ``model``, or None after adding its problems, located under ``where``."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        problems += [_relocated(error, where) for error in exc.errors()]
        return None


def _relocated(error: ErrorDetails, where: tuple[str | int, ...]) -> InitErrorDetails:
    """A problem found by a nested validation, located under ``where``."""
    location = (*where, *error["loc"])
    if error["type"] not in _ERROR_TYPES:  # a model's own error kind: keep its message
        return {"type": PydanticCustomError(error["type"], error["msg"]), "loc": location, "input": error["input"]}
    details: InitErrorDetails = {"type": error["type"], "loc": location, "input": error["input"]}
    if "ctx" in error:
        details["ctx"] = error["ctx"]
    return details


def _problem(where: tuple[str | int, ...], value: Any, message: str) -> InitErrorDetails:
    return {"type": "value_error", "loc": where, "input": value, "ctx": {"error": ValueError(message)}}


def _extra(where: tuple[str | int, ...], value: Any) -> InitErrorDetails:
    return {"type": "extra_forbidden", "loc": where, "input": value}


class RedisTlsConfig(_Frozen):
    """For a rediss:// URL: the CA that signed the server's certificate (default: the system's), and the client
    certificate and its key that a server with tls-auth-clients asks for. Paths to files (mounted Secrets)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _key_with_cert(self) -> RedisTlsConfig:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file: the client certificate the key belongs to")
        return self


class StateConfig(_Frozen):
    # Shared state for several gateways (residency record and its locks). None: in-process, one gateway.
    redis_url: Annotated[str, Field(pattern=r"^(redis|rediss|unix)://")] | None = None
    # redis_url names one node of a Redis Cluster (keys are hash-tagged per pool and replica, tenant, registry).
    cluster: bool = False
    # A Redis call that takes longer counts as Redis being down; requests never wait on Redis beyond this.
    operation_timeout_s: float = Field(default=0.5, gt=0, le=30)
    # Redis AUTH. The password comes from an environment variable or a file (a mounted Secret), never from this
    # file: a redis_url holding one is refused. username: an ACL user (none: Redis' default user).
    username: str | None = Field(default=None, min_length=1)
    password_env: str | None = Field(default=None, min_length=1)
    password_file: str | None = Field(default=None, min_length=1)
    # rediss:// only: CA, client certificate and key files.
    tls: RedisTlsConfig | None = None
    # The key that signs the tenant registry's entries in Redis and its messages (gateway/tenants/signing.py), from
    # an environment variable or a file; neither: derived from the admin token (whoever holds it may change the
    # registry anyway). Every gateway sharing the Redis needs the same key.
    registry_key_env: str | None = Field(default=None, min_length=1)
    registry_key_file: str | None = Field(default=None, min_length=1)
    # A directory of this gateway's own that outlives its process (a pod's emptyDir, a host path): each process
    # claims an identity file there, so restarted it gives back at once the replicas' locks it held when it died
    # instead of waiting residency.lock_ttl_s (gateway/residency/owner.py). Never shared by gateways on two hosts
    # through a copy. None: every start is a new identity.
    identity_dir: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _secrets_not_here(self) -> StateConfig:
        url = self.redis_url or ""
        credentials = url.split("://", 1)[-1].split("/", 1)[0].rpartition("@")[0]
        if ":" in credentials or "password=" in url.partition("?")[2]:
            raise ValueError(
                "redis_url holds a password: set state.password_env or state.password_file (never in the config)"
            )
        if self.password_env is not None and self.password_file is not None:
            raise ValueError("password_env or password_file, not both")
        if self.registry_key_env is not None and self.registry_key_file is not None:
            raise ValueError("registry_key_env or registry_key_file, not both")
        if self.tls is not None and not url.startswith("rediss://"):
            raise ValueError("tls needs a rediss:// redis_url")
        return self


class ResidencyConfig(_Frozen):
    # Last-use times are written to the store in one batch this often, never per request.
    use_flush_interval_s: float = Field(default=0.25, gt=0, le=60)

    @property
    def shared_in_use_window_s(self) -> float:
        """Gateways sharing a store count an adapter used by any of them this recently as in use: long enough
        for a use in flight to have been flushed (4 flushes), and at least a second. On vLLM pools only while the
        slot signal is down: listening, the others' in-flight adapters it shares decide (signal.FLYING_GRACE_S)."""
        return max(1.0, 4 * self.use_flush_interval_s)

    # How often the local view of the record is refreshed from the store (other gateways' use times; their loads
    # and unloads reach it at once through the slot signal's news, gateway/residency/signal.py).
    sync_interval_s: float = Field(default=2.0, gt=0, le=600)
    # How often the record is compared with what each engine lists, and corrected.
    reconcile_interval_s: float = Field(default=10.0, gt=0, le=3600)
    # The eviction timer: adapters idle longer than idle_evict_s are unloaded; each replica is also brought down
    # to max_adapters - headroom, so a newcomer's load seldom has to evict on the request path.
    evict_interval_s: float = Field(default=30.0, gt=0, le=3600)
    idle_evict_s: float = Field(default=600.0, gt=0)
    headroom: int = Field(default=1, ge=0)
    # No empty slot (gateway/fleet/fill.py): at start-up and when a replica comes back, its free slots are filled
    # with the adapters of the keys homed there (pinned, then prewarm, then config order), never evicting. The
    # timer then keeps headroom, and evicts an idle adapter of the replica's own keys, only where a slot is wanted
    # (a load found the set full within idle_evict_s, or loads wait for a slot): a slot freed for nobody is a cold
    # load later. false: no fill, and the timer's rule above everywhere.
    fill_free_slots: bool = True
    # Readiness (and a returning replica's return to service) waits this long at most for the fill; what is left
    # is loaded in the background, so a large working set cannot hold a gateway out of service.
    fill_wait_s: float = Field(default=30.0, ge=0, le=3600)
    # Also send each adapter the fill loaded a one-token request, the most important last, so the engine's GPU slots
    # (vLLM's --max-loras, LRU) hold the most important and a first request does not wait for its copy to the GPU
    # (loadtests/no_empty_slot.py: TTFT p99 about 4x the p50 without it, about 2x with it). false: load only.
    fill_warm_up: bool = True
    # A warm-up (an adapter's load and one-token request that no request waits for: the pre-warm, the fill, a
    # warm-up ahead of a hot key's spills, a move's make before break) is waited for at most this long, in seconds;
    # then it is given up and logged. The pool runs one warm-up ahead at a time: one tenant's adapter whose load
    # hung held it for every other tenant's up to adapter_load_timeout_s (60 s), and a hung one-token request up to
    # the pool's request_timeout_s (300 s). A load requests wait for goes on within adapter_load_timeout_s, as do an
    # operator's warm-ups (the admin API's, a rollout's).
    warm_up_timeout_s: float = Field(default=15.0, gt=0, le=3600)
    # A load that finds every slot of a replica's working set in use waits (outside the replica's lock) up to this
    # long for one to free. Then an engine that queues such requests itself (vLLM) gets the adapter anyway, over
    # max_adapters until the timer brings it back; one that refuses them (TensorRT-LLM) answers 503 Retry-After.
    # With gateways sharing Redis, a slot another gateway frees ends the wait at once (its release, through the slot
    # signal); while this gateway's subscription to that signal is down, only once the adapter's last use has left
    # the in-use window (1 s, or 4 x use_flush_interval_s): a wait shorter than that window then ends in 503.
    slot_wait_timeout_s: float = Field(default=3.0, gt=0, le=600)
    # Loads waiting for a slot at once, per replica; past it a newcomer does not wait (over, or 503, as above).
    slot_wait_queue: int = Field(default=64, ge=1, le=100_000)

    # A load or eviction holds the replica's lock at most this long if its gateway dies mid-way: every load,
    # eviction and reconciliation on the replica (another gateway's, or its own once restarted) waits that long.
    # A live holder renews it every third of the ttl, however long its load takes.
    lock_ttl_s: float = Field(default=10.0, gt=0)
    # A load that requests waited for keeps the replica's lock (this gateway's and, shared, the store's) after the
    # engine loaded the adapter until each of those requests has had its first byte, at most this long: the next
    # load there (any gateway's) does not begin until then. vLLM runs a load between engine steps, so a load begun
    # as the previous one ends stalls the requests that waited for the first one before their first step: they pay
    # two loads. About one cold load at a GPU's pace: the next load's requests wait no longer for the hold than the
    # hold spares the first load's. 0: no hold.
    load_settle_s: float = Field(default=0.5, ge=0, le=60)


# The module each exporter needs beyond the SDK, and the extra that installs it (pip install 'tenantgate[otlp]').
EXPORTER_MODULES = {"otlp": ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "otlp")}


class TracingConfig(_Frozen):
    # none: no spans at all (free); console: spans printed to stdout; otlp: sent to an OpenTelemetry collector
    # (needs the extra tenantgate[otlp], which the image installs).
    exporter: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: HttpUrl | None = None
    service_name: str = "tenantgate"
    sample_ratio: float = Field(default=1.0, ge=0, le=1)

    @field_validator("exporter")
    @classmethod
    def _exporter_installed(cls, exporter: str) -> str:
        """A config whose exporter cannot be built fails here, in check-config, not when serve starts."""
        if exporter in EXPORTER_MODULES:
            module, extra = EXPORTER_MODULES[exporter]
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ValueError(
                    f"the {exporter} exporter needs {module}, which is not installed: "
                    f"pip install 'tenantgate[{extra}]' ({exc})"
                ) from exc
        return exporter


class TelemetryConfig(_Frozen):
    tracing: TracingConfig = TracingConfig()
    # One JSON line per request on the "tenantgate.access" logger (no prompt text, no keys).
    access_log: bool = True
    # How often each replica's own metrics (queue depth, KV usage) are read.
    engine_scrape_interval_s: float = Field(default=5.0, gt=0, le=3600)


class AdapterSourcesConfig(_Frozen):
    """Where adapters may come from (gateway/adapter_sources.py): paths under ``roots`` (when set; without roots
    the file's own sources are taken as written and the admin API takes paths beside them), URLs only with one of
    ``schemes`` (none by default) and never to a non-public address."""

    roots: list[Annotated[str, Field(pattern=r"^/")]] = Field(default_factory=list)
    schemes: list[Annotated[str, Field(pattern=r"^[a-z][a-z0-9+.-]*$")]] = Field(default_factory=list)

    @field_validator("roots")
    @classmethod
    def _plain_roots(cls, roots: list[str]) -> list[str]:
        return [adapter_sources.normalised(root) for root in roots]  # SourceRefused is a ValueError: at the field


class AdapterConfig(_Frozen):
    name: Name
    pool: Name
    # Where the engine reads the adapter from (a path on the replicas' disk); only ever from this catalog. Checked
    # and normalised (gateway/adapter_sources.py); the normalised form is what engines get.
    source: str = Field(min_length=1)
    # Two adapters may name one source only if both say so: otherwise one tenant's adapter could be another's.
    shared_source: bool = False

    @field_validator("source")
    @classmethod
    def _source_is_safe(cls, source: str) -> str:
        return adapter_sources.normalised(source)

    # The name the engine serves it under, if not `name`.
    engine_name: Name | None = None
    # Load on its home replicas (and warm with a one-token request) before the gateway reports ready;
    # pinned also keeps it there: never evicted.
    prewarm: bool = False
    pinned: bool = False


class VariantConfig(_Frozen):
    # A catalog adapter or a base model; the split's variants must all live in one pool.
    model: Name
    weight: float = Field(gt=0)


class SplitConfig(_Frozen):
    """A tenant-facing model name served by weighted variants: an A/B experiment, or the versions of an adapter
    (one variant: the version that serves the name; two during a rollout). Each end user (the OpenAI ``user``
    field or the ``x-session-id`` header) always gets the same variant; the response names it in
    ``x-tenantgate-variant`` and metrics label its requests with the variant's model."""

    name: Name
    variants: list[VariantConfig] = Field(min_length=1)


class TenantLimits(_Frozen):
    """Admission limits for one tenant; None: no limit. Rates hold across gateways sharing Redis (tokens are
    leased from a shared bucket); max_concurrent holds per gateway instance."""

    requests_per_minute: int | None = Field(default=None, ge=1)
    # Counted as the prompt's estimated tokens (characters / 4) + max_tokens, corrected by the engine's usage.
    tokens_per_minute: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    # A request asking for more is refused with 400; one that names none gets this many at most.
    max_tokens: int | None = Field(default=None, ge=1)
    # Overrides the pool's request_timeout_s for this tenant's requests.
    request_timeout_s: float | None = Field(default=None, gt=0)


class TenantConfig(_Frozen):
    id: Name
    api_keys: list[KeyHash] = Field(min_length=1)
    adapters: list[Name] = Field(default_factory=list)
    # Base models (by pool name's base_model) this tenant may call without an adapter.
    base_models: list[Name] = Field(default_factory=list)
    limits: TenantLimits = TenantLimits()

    @model_validator(mode="after")
    def _has_something_to_call(self) -> TenantConfig:
        if not self.adapters and not self.base_models:
            raise ValueError("a tenant needs at least one adapter or base model")
        return self


class AuthConfig(_Frozen):
    """Trusted-header mode, off by default: an authenticating ingress in front sets this header to the tenant id,
    and it is believed only from these source networks (from anywhere else it is ignored: a key is needed)."""

    trusted_header: str | None = Field(default=None, pattern=r"^[A-Za-z0-9-]+$")
    trusted_networks: list[IPvAnyNetwork] = Field(default_factory=list)

    @model_validator(mode="after")
    def _networks_with_header(self) -> AuthConfig:
        if self.trusted_header and not self.trusted_networks:
            raise ValueError("trusted_header needs trusted_networks: the ingress addresses it may come from")
        return self


class OperatorListenConfig(_Frozen):
    """The operator listener: /metrics, the admin API and the status page on their own port, and not on the
    tenant port (gateway/admin/operator.py). Loopback by default; a pod binds 0.0.0.0 and the Service leaves it out."""

    host: str = "127.0.0.1"
    port: int = Field(ge=0, le=65535)


class AdminConfig(_Frozen):
    # The admin API is off unless this environment variable holds a token.
    token_env: str = "TENANTGATE_ADMIN_TOKEN"
    # Unset (the default): /metrics and /admin share the tenant port, and /metrics needs a Bearer token (the
    # metrics token below, or the admin token). Set: they answer only on this listener (the tenant port's answer is
    # the 404 of any unknown route), where /metrics needs no token; /admin still needs the admin token.
    listen: OperatorListenConfig | None = None
    # A read-only token for /metrics on the tenant port (a scraper need not hold the admin token); checked like it.
    metrics_token_env: str = "TENANTGATE_METRICS_TOKEN"
    # serve refuses a weak token (under 32 characters, fewer than 8 distinct ones, or a known default such as
    # change-me); true allows one, for a local setup on loopback only.
    allow_weak_token: bool = False
    # Failed admin logins (Bearer or the status page) per source address and minute, per gateway; past it, 429
    # with Retry-After before the token is even compared.
    failed_logins_per_minute: int = Field(default=10, ge=1, le=100_000)
    # Proxies whose X-Forwarded-For names the source address for that limit; from anywhere else the peer counts.
    trusted_proxies: list[IPvAnyNetwork] = Field(default_factory=list)
    # An api_key added through the admin API must be at least this long; a key request without one gets a
    # generated key, returned once.
    min_api_key_chars: int = Field(default=32, ge=1, le=4096)


class LimitsConfig(_Frozen):
    """Global protection, whoever sends: bounded work in flight, bounded input."""

    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    # Requests in flight through this gateway, in total and per replica; over either, 503 with Retry-After
    # rather than an unbounded queue.
    max_in_flight: int = Field(default=4096, ge=1)
    max_in_flight_per_replica: int = Field(default=512, ge=1)
    # The prompt (or all messages' text) in characters, and how deeply a JSON body may nest.
    max_prompt_chars: int = Field(default=200_000, ge=1)
    max_json_depth: int = Field(default=32, ge=2, le=254)  # 254: orjson's limit writing it back
    # Arrays and objects one JSON body may hold, counted before it is parsed: each costs the event loop its parse,
    # and a 1 MB body of 340,000 empty arrays held it ~1 s (gateway/serving/json_body.py).
    max_json_containers: int = Field(default=10_000, ge=2)
    # The completions one request may ask for: its prompts (a completions batch) times n (or best_of). The engine
    # schedules every one as a sequence of its own, and the tenant limits count requests, not sequences: one batch of
    # 1,000 prompts took a replica for 7.6 s, another tenant's TTFT there 29 ms -> 3.6 s. 128: OpenAI's bound on n.
    max_choices: int = Field(default=128, ge=1)
    # Every tenant's limits where its own leave a field unset (a tenant's own value wins), e.g. a concurrency
    # limit for all tenants set once: tenant_defaults: {max_concurrent: 16}. Nothing by default.
    tenant_defaults: TenantLimits = TenantLimits()


class ShutdownConfig(_Frozen):
    # On SIGTERM: /readyz fails at once; after drain_delay_s the listener closes; in-flight requests and streams
    # then have up to drain_timeout_s to finish before they are cancelled.
    drain_delay_s: float = Field(default=0.0, ge=0, le=600)
    drain_timeout_s: float = Field(default=30.0, gt=0, le=3600)


class TrafficConfig(_Frozen):
    """Traffic measured per affinity key (gateway/observe/traffic.py; gateway/placement/exchange.py merges it): each
    gateway counts its requests and tokens per key, folds them every ``interval_s`` into a moving average, and with
    Redis swaps its figures for the other gateways' in one call per interval, never per request; the sum is the
    fleet-wide figure every gateway reads."""

    # How often the counts are folded into the average and exchanged through Redis (one call per gateway).
    interval_s: float = Field(default=5.0, gt=0, le=600)
    # The average's time constant: a key's rate weighs the last window_s seconds most (exponentially weighted).
    window_s: float = Field(default=60.0, gt=0, le=86_400)
    # The busiest keys kept, per gateway and fleet-wide (session keys are unbounded in number); each pool's total
    # counts every key.
    max_keys: int = Field(default=2000, ge=1, le=1_000_000)
    # Distinct keys counted within one interval; a key past it counts only in its pool's total that interval.
    max_keys_per_interval: int = Field(default=20_000, ge=1, le=10_000_000)
    # The busiest keys per pool exported as metrics with a `key` label (the metric's cardinality); 0: none.
    metric_keys: int = Field(default=20, ge=0, le=1000)

    @model_validator(mode="after")
    def _window_spans_intervals(self) -> TrafficConfig:
        if self.window_s < self.interval_s:
            raise ValueError("window_s must be at least interval_s: the average spans whole intervals")
        return self


class PlacementConfig(_Frozen):
    """Homes from traffic (routing.home_placement: traffic; gateway/placement/): every ``interval_s`` the gateway
    holding the leader's lease in Redis plans each pool's homes from the fleet's measured traffic and publishes a
    versioned table every gateway installs; without Redis each gateway plans from its own figures."""

    # How often the leader plans and every gateway polls the table's version (one Redis call per gateway).
    interval_s: float = Field(default=10.0, gt=0, le=3600)
    # At most this many keys change homes (a move, a replica set grown or shrunk) per pool per interval.
    max_moves: int = Field(default=4, ge=0, le=10_000)
    # A move must lower its source replica's expected load (requests per second) by more than this share.
    min_gain: float = Field(default=0.1, ge=0, lt=1)
    # ... and by more than this many standard deviations of the measured load (a moving average over
    # traffic.window_s of Poisson counts: a rate r is known to about sqrt(r / (2 window_s))); the same margin holds
    # for growing a replica set. Noise in a short window then moves nothing: each move costs a cold load.
    sigmas: float = Field(default=3.0, ge=0, le=100)
    # A key gets one more replica while its requests per second per replica exceed grow_above x the pool's mean
    # per replica (the bounded-load cap's factor by default) ...
    grow_above: float = Field(default=1.25, gt=0, le=100)
    # ... or while more than spill_share of its requests leave its set for demand (the scheduler found its homes
    # over the bound, or another replica predicted faster: the spills a second warm replica would serve) ...
    spill_share: float = Field(default=0.2, gt=0, le=1)
    # ... and loses one after shrink_after_s with one fewer replica below shrink_below x that mean,
    # spilling less than half spill_share (hysteresis).
    shrink_below: float = Field(default=0.75, gt=0, le=100)
    shrink_after_s: float = Field(default=60.0, ge=0, le=86_400)
    # ... or while its requests in flight per replica of its set exceed seat_share of a replica's seats (the pool's
    # seats; not stated: never): it queues at its bursts, even where slots are full; then a key planned alone on the
    # replica it gains, sending fewer requests per second than 1 / off_plan_idle_s by more than the noise (sigmas),
    # gives its planned slot up (its adapter loaded on demand; plan.py).
    seat_share: float = Field(default=0.5, gt=0, le=100)
    # A key that gave a copy back as its demand fell makes no other key give up its planned slot for a copy again
    # for this long (seconds; it grows into free slots only): a tenant bursting past shrink_after_s apart took a
    # neighbour's slot at every burst (29 an hour at 60 s on, 70 s off), at most max_replicas_per_key - 1 per
    # cool-down with it (4 in that hour). 0: no cool-down.
    repay_after_s: float = Field(default=1800.0, ge=0, le=86_400)
    # A key is replicated only with at least this many requests per second (below it one replica serves it).
    replicate_min_rps: float = Field(default=1.0, ge=0, le=1_000_000)
    # The most replicas one key's set may hold (1: no replication).
    max_replicas_per_key: int = Field(default=3, ge=1, le=1024)
    # Spills kept on a key's planned replicas (gateway/fleet/plan_bound.py): a request goes off its key's set only
    # once every planned replica has off_plan_queue requests in flight, to a replica predicted faster than the best
    # planned one by off_plan_margin_ms, where its adapter pushes out no other key's planned adapter used within
    # off_plan_idle_s (false: spills go wherever predicted faster, as with balanced homes).
    confine_spills: bool = True
    # 0: the pool's seats where stated (a spill leaves once every planned replica runs as many as it can), else
    # routing.capacity_floor.
    off_plan_queue: int = Field(default=0, ge=0, le=100_000)
    off_plan_margin_ms: float = Field(default=100.0, ge=0, le=600_000)
    off_plan_idle_s: float = Field(default=5.0, ge=0, le=86_400)
    # A move whose adapter is not resident at its new home after this long is given up (the key stays put).
    warm_timeout_s: float = Field(default=120.0, gt=0, le=86_400)
    # Keep the table as it is: no moves, no growth (pins still apply).
    freeze: bool = False
    # Homes operators fix: key (a tenant, an adapter under adapter affinity) -> replica id. A pinned key moves only
    # off its replica while that one is drained or gone (and back once it returns).
    pins: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _hysteresis(self) -> PlacementConfig:
        if self.shrink_below >= self.grow_above:
            raise ValueError("shrink_below must be below grow_above: a replica set would grow and shrink in turn")
        return self


class GatewayConfig(_Frozen):
    # Modules that register more engines (backends/registry.py), imported before the pools are validated, e.g.
    # `engines: [mycompany.sglang_engine]`; vllm and triton are always registered.
    engines: list[ModuleName] = Field(default_factory=list)
    listen: ListenConfig = ListenConfig()
    routing: RoutingConfig = RoutingConfig()
    pools: list[PoolConfig] = Field(min_length=1)
    adapters: list[AdapterConfig] = Field(default_factory=list)
    splits: list[SplitConfig] = Field(default_factory=list)
    tenants: list[TenantConfig] = Field(min_length=1)
    admin: AdminConfig = AdminConfig()
    auth: AuthConfig = AuthConfig()
    limits: LimitsConfig = LimitsConfig()
    state: StateConfig = StateConfig()
    residency: ResidencyConfig = ResidencyConfig()
    traffic: TrafficConfig = TrafficConfig()
    placement: PlacementConfig = PlacementConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    adapter_sources: AdapterSourcesConfig = AdapterSourcesConfig()

    @property
    def pools_by_name(self) -> dict[str, PoolConfig]:
        return {pool.name: pool for pool in self.pools}

    @model_validator(mode="before")
    @classmethod
    def _import_engines(cls, data: Any) -> Any:
        """Import the ``engines:`` modules first: they register the engines the pools' ``backend`` may name."""
        modules = data.get("engines") if isinstance(data, dict) else None
        if not isinstance(modules, list):
            return data  # none, or not a list (the field says so)
        problems: list[InitErrorDetails] = []
        for index, module in enumerate(modules):
            if not isinstance(module, str) or not re.match(_MODULE, module):
                message = "not a module name (dotted, as in `mycompany.sglang_engine`)"
                problems.append(_problem(("engines", index), module, message))
                continue
            try:
                engines.load_engine(module)
            except engines.EngineImportError as exc:
                problems.append(_problem(("engines", index), module, str(exc)))
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return data

    @model_validator(mode="wrap")
    @classmethod
    def _every_problem(cls, data: Any, handler: ModelWrapValidatorHandler[GatewayConfig]) -> GatewayConfig:
        """Every problem in one run, each at its field's path: the cross-references (names, pools, models) are
        checked on the file's own data, so an error in some field does not hide them; the checks that need valid
        fields (an engine's own, the slot wait) run once the fields are valid."""
        problems: list[InitErrorDetails] = []
        config: GatewayConfig | None = None
        try:
            config = handler(data)
        except ValidationError as exc:
            problems += [_relocated(error, ()) for error in exc.errors()]
        if isinstance(data, dict):
            problems += cross_reference_problems(data)
        if config is not None and not problems:
            problems += _engine_checks(config) + _source_problems(config)
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        assert config is not None
        return config


def _source_problems(config: GatewayConfig) -> list[InitErrorDetails]:
    """Each adapter's source within adapter_sources, and no source under two adapters unless both share it."""
    problems: list[InitErrorDetails] = []
    first: dict[str, AdapterConfig] = {}
    sources = config.adapter_sources
    for index, adapter in enumerate(config.adapters):
        try:
            adapter_sources.check(adapter.source, sources.roots, sources.schemes)
        except adapter_sources.SourceRefused as exc:
            problems.append(_problem(("adapters", index, "source"), adapter.source, str(exc)))
        other = first.setdefault(adapter.source, adapter)
        if other is not adapter and not (other.shared_source and adapter.shared_source):
            message = f"adapter {other.name!r} has this source too (set shared_source: true on both to share it)"
            problems.append(_problem(("adapters", index, "source"), adapter.source, message))
    return problems


Where = tuple[str | int, ...]


def _entries(data: dict[str, Any], key: str) -> list[tuple[int, dict[str, Any]]]:
    """The dict entries of a top-level list, with their indexes (anything else is the fields' error to report)."""
    value = data.get(key)
    return [(i, entry) for i, entry in enumerate(value) if isinstance(entry, dict)] if isinstance(value, list) else []


def _texts(entry: dict[str, Any], key: str) -> list[tuple[int, str]]:
    value = entry.get(key)
    return [(i, item) for i, item in enumerate(value) if isinstance(item, str)] if isinstance(value, list) else []


def _text(entry: dict[str, Any], key: str) -> str | None:
    value = entry.get(key)
    return value if isinstance(value, str) else None


def _duplicates(what: str, found: Sequence[tuple[Where, str]]) -> list[InitErrorDetails]:
    """Each repeat of a value, at its own path, naming where it was first."""
    first: dict[str, Where] = {}
    problems = []
    for where, value in found:
        if value in first:
            at = ".".join(str(part) for part in first[value])
            problems.append(_problem(where, value, f"duplicate {what} {value!r} (first at {at})"))
        else:
            first[value] = where
    return problems


def cross_reference_problems(data: dict[str, Any]) -> list[InitErrorDetails]:
    """Names that must be unique and references that must resolve, each problem at the path of the field that
    is wrong, read from the config's raw data (entries that are not even dicts are left to field validation)."""
    pools, adapters = _entries(data, "pools"), _entries(data, "adapters")
    tenants, splits = _entries(data, "tenants"), _entries(data, "splits")
    named = [(i, _text(e, "name")) for i, e in adapters]
    problems = _duplicates("pool name", [(("pools", i, "name"), n) for i, e in pools if (n := _text(e, "name"))])
    problems += _duplicates("adapter name", [(("adapters", i, "name"), n) for i, n in named if n])
    problems += _duplicates("tenant id", [(("tenants", i, "id"), n) for i, e in tenants if (n := _text(e, "id"))])
    keys = [(("tenants", i, "api_keys", j), key) for i, e in tenants for j, key in _texts(e, "api_keys")]
    problems += _duplicates("api key", keys)
    bases = [(("pools", i, "base_model"), m) for i, e in pools if (m := _text(e, "base_model"))]
    problems += _duplicates("base model (one pool per base model)", bases)
    problems += _duplicates("split name", [(("splits", i, "name"), n) for i, e in splits if (n := _text(e, "name"))])
    pool_names = {n for _, e in pools if (n := _text(e, "name"))}
    base_models = {m for _, m in bases}
    catalog = {n for _, n in named if n}
    engine_names: dict[tuple[str, str], int] = Counter()
    for i, entry in adapters:
        name, pool, engine_name = _text(entry, "name"), _text(entry, "pool"), _text(entry, "engine_name")
        if name in base_models:
            problems.append(_problem(("adapters", i, "name"), name, "adapter names must differ from base model names"))
        if pool is not None and pool not in pool_names:
            problems.append(_problem(("adapters", i, "pool"), pool, f"adapter {name!r} names unknown pool {pool!r}"))
        if engine_name not in (None, name) and engine_name in catalog:
            message = f"adapter {name!r} has engine_name {engine_name!r}, another adapter's name"
            problems.append(_problem(("adapters", i, "engine_name"), engine_name, message))
        if pool is not None and (engine_name or name):
            engine_names[(pool, engine_name or name or "")] += 1
    for i, entry in adapters:
        pool, served = _text(entry, "pool"), _text(entry, "engine_name") or _text(entry, "name")
        if pool is not None and served and engine_names[(pool, served)] > 1:
            key = "engine_name" if entry.get("engine_name") else "name"
            message = f"engine name {served!r} is used by more than one adapter in pool {pool!r}"
            problems.append(_problem(("adapters", i, key), served, message))
    problems += _split_problems(splits, adapters, pools, catalog | base_models)
    targets = catalog | {n for _, e in splits if (n := _text(e, "name"))}  # a tenant may name a split
    for i, entry in tenants:
        tenant = _text(entry, "id")
        for j, adapter in _texts(entry, "adapters"):
            if adapter not in targets:
                message = f"tenant {tenant!r} names unknown adapter {adapter!r}"
                problems.append(_problem(("tenants", i, "adapters", j), adapter, message))
        for j, model in _texts(entry, "base_models"):
            if model not in base_models:
                message = f"tenant {tenant!r} names unknown base model {model!r}"
                problems.append(_problem(("tenants", i, "base_models", j), model, message))
    pinned = Counter(_text(e, "pool") for _, e in adapters if e.get("pinned") is True)
    for i, entry in pools:
        name, max_adapters = (
            _text(entry, "name"),
            entry.get("max_adapters", PoolConfig.model_fields["max_adapters"].default),
        )
        if name in pinned and isinstance(max_adapters, int) and pinned[name] > max_adapters:
            message = f"pool {name!r} pins {pinned[name]} adapters but max_adapters is {max_adapters}"
            problems.append(_problem(("pools", i, "max_adapters"), max_adapters, message))
    return problems


def _split_problems(
    splits: list[tuple[int, dict[str, Any]]],
    adapters: list[tuple[int, dict[str, Any]]],
    pools: list[tuple[int, dict[str, Any]]],
    taken: set[str],
) -> list[InitErrorDetails]:
    problems = []
    pool_of = {n: p for _, e in adapters if (n := _text(e, "name")) and (p := _text(e, "pool"))}
    pool_of |= {m: n for _, e in pools if (m := _text(e, "base_model")) and (n := _text(e, "name"))}
    for i, split in splits:
        name = _text(split, "name")
        if name in taken:
            problems.append(
                _problem(("splits", i, "name"), name, f"split {name!r} has the name of an adapter or base model")
            )
        variants = _entries(split, "variants")
        for j, variant in variants:
            model = _text(variant, "model")
            if model is not None and model not in pool_of:
                message = f"split {name!r} names unknown model {model!r}"
                problems.append(_problem(("splits", i, "variants", j, "model"), model, message))
        spanned = sorted({pool_of[m] for _, v in variants if (m := _text(v, "model")) in pool_of})
        if len(spanned) > 1:
            message = f"split {name!r} spans pools {spanned}: its variants must share one"
            problems.append(_problem(("splits", i, "variants"), spanned, message))
    return problems


def pool_adapters(config: GatewayConfig, pool: str) -> dict[str, AdapterRef]:
    """A pool's catalog adapters as its engine knows them, by catalog name."""
    return {a.name: AdapterRef(a.engine_name or a.name, a.source) for a in config.adapters if a.pool == pool}


def _engine_checks(config: GatewayConfig) -> list[InitErrorDetails]:
    """Each pool's engine's own checks of the pool's adapters (Triton: no two share a task id), at the pool."""
    problems = []
    for index, pool in enumerate(config.pools):
        check = engines.spec(pool.backend).checks
        if check is not None:
            found = check(pool.name, pool.settings, pool_adapters(config, pool.name))
            problems += [_problem(("pools", index), pool.name, message) for message in found]
    return problems


def _reject_duplicates(what: str, values: list[str]) -> None:
    repeated = sorted(value for value, count in Counter(values).items() if count > 1)
    if repeated:
        raise ValueError(f"duplicate {what}: {repeated}")


class ConfigError(Exception):
    """A config that cannot be served; ``problems`` holds one "path: message" line per error."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: invalid config\n" + "\n".join(f"  {p}" for p in problems))
        self.problems = problems


def parse_config(text: str, source: str = "<config>") -> GatewayConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from exc
    try:
        return GatewayConfig.model_validate(data if data is not None else {})
    except ValidationError as exc:
        raise ConfigError(source, describe_errors(exc)) from exc


def load_config(path: str | Path) -> GatewayConfig:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read: {exc.strerror}"]) from exc
    return parse_config(text, str(path))


def describe_errors(exc: ValidationError) -> list[str]:
    return [_describe(error) for error in exc.errors()]


def _describe(error: ErrorDetails) -> str:
    location = ".".join(str(part) for part in error["loc"]) or "(top level)"
    message = re.sub(r"^Value error, ", "", error["msg"])
    return f"{location}: {message}"

"""A Triton pool's config: its ``triton:`` section, its replicas' extra keys (``grpc``, ``metrics_url``), the
endpoint they make, and the checks config validation and ``check-config --read-adapters`` run on its adapters.
backends/triton.py registers them with its driver (backends/registry.py); docs/triton.md describes them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

from jinja2 import TemplateSyntaxError
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator

from backends.base import AdapterRef, Endpoint
from backends.lora_weights import AdapterFormatError, convert_peft, task_id
from backends.registry import ConfiguredReplica
from backends.triton_openai import ChatTemplate


class TritonConfig(BaseModel):
    """How a Triton pool's TensorRT-LLM model is called (docs/triton.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The model tenants' requests go to: `ensemble` or `tensorrt_llm_bls` in TensorRT-LLM's model repository.
    model: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")] = "ensemble"
    grpc_port: int = Field(default=8001, ge=1, le=65535)
    metrics_port: int = Field(default=8002, ge=1, le=65535)
    # The engine's weight dtype: LoRA weights must match it.
    lora_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    # TensorRT-LLM needs max_tokens; chat requests may omit it (completions then default to 16, as OpenAI's API).
    # Keep it within the engine's own output limit.
    default_max_tokens: int = Field(default=1024, ge=1, le=2**31 - 1)
    # Converted adapter weights kept in the gateway's memory (each is resent from there after an engine evicts it).
    weights_cache_mib: int = Field(default=1024, ge=1)
    # Jinja over `messages` (role, content) and `add_generation_prompt`; None: ChatML (backends/triton_openai.py).
    chat_template: str | None = None

    @field_validator("chat_template")
    @classmethod
    def _template_compiles(cls, template: str | None) -> str | None:
        if template is not None:
            try:
                ChatTemplate(template)
            except TemplateSyntaxError as exc:
                raise ValueError(f"chat_template is not valid Jinja (line {exc.lineno}): {exc.message}") from exc
        return template


class TritonReplica(BaseModel):
    """A Triton replica's own keys, when not on the pool's default ports of its url's host."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # gRPC address (host:port) for inference.
    grpc: Annotated[str, Field(pattern=r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")] | None = None
    metrics_url: HttpUrl | None = None

    @field_validator("grpc")
    @classmethod
    def _grpc_port_in_range(cls, address: str | None) -> str | None:
        if address is not None and not 1 <= int(address.rsplit(":", 1)[1]) <= 65535:
            raise ValueError("the gRPC port must be between 1 and 65535")
        return address


@dataclass(frozen=True)
class TritonEndpoint(Endpoint):
    """A Triton replica: its HTTP URL (health, metadata), gRPC address (host:port) and metrics page."""

    grpc_address: str
    metrics_url: str


def triton_endpoint(replica: ConfiguredReplica, settings: TritonConfig) -> TritonEndpoint:
    """A replica's addresses; its gRPC and metrics ports default to the pool's, on the url's host."""
    extras = replica.extras if isinstance(replica.extras, TritonReplica) else TritonReplica()
    grpc_address = extras.grpc or f"{replica.host}:{settings.grpc_port}"
    metrics_url = (
        str(extras.metrics_url) if extras.metrics_url else f"http://{replica.host}:{settings.metrics_port}/metrics"
    )
    return TritonEndpoint(replica.id, replica.url, grpc_address, metrics_url)


def task_id_collisions(pool: str, settings: TritonConfig, adapters: Mapping[str, AdapterRef]) -> list[str]:
    """A Triton pool names adapters to the engine by a task id hashed from engine name and source: two must
    never meet."""
    names: dict[int, set[str]] = {}
    for adapter in adapters.values():
        names.setdefault(task_id(adapter.engine_name, adapter.source), set()).add(adapter.engine_name)
    return [
        f"adapters {sorted(clash)} of pool {pool!r} share lora_task_id {tid}: rename one"
        for tid, clash in names.items()
        if len(clash) > 1
    ]


def adapters_convert(pool: str, settings: TritonConfig, adapters: Mapping[str, AdapterRef]) -> list[str]:
    """The gateway reads a Triton pool's adapters and sends their weights: each must convert to TensorRT-LLM's
    layout in the pool's dtype (reads every adapter: for ``check-config --read-adapters``, not every load)."""
    problems = []
    for name, adapter in adapters.items():
        try:
            convert_peft(adapter.source, settings.lora_dtype)
        except AdapterFormatError as exc:
            problems.append(f"adapter {name!r}: {exc}")
    return problems

"""The vLLM driver: vLLM's OpenAI HTTP API, its runtime LoRA endpoints and /health, over one aiohttp session.

Adapters are loaded with ``POST /v1/load_lora_adapter`` (the engine needs
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). vLLM answers 400 "has already been loaded" for a name it knows, which
this driver takes as success: another gateway, or an operator, loaded it first. Registered as engine ``vllm``
(backends/registry.py): no settings section, replicas are a URL each.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator

import aiohttp
from yarl import URL

from backends import http1
from backends.base import AdapterRef, Endpoint, EngineLoad, EngineRequest
from backends.errors import (
    AdapterLoadFailed,
    AdapterNotLoaded,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    StreamBroken,
)
from backends.registry import EngineSpec, NoSettings, PoolSettings, register
from backends.side_reads import MAX_METRICS_PAGE, read_text

_JSON = {"Content-Type": "application/json"}
# vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): one idle 4 s is dropped here
# first, so a request never goes out on a connection the engine is closing at that moment.
_IDLE_TIMEOUT_S = 4.0
_GENERATED = "vllm:generation_tokens"


class VllmResponse:
    def __init__(self, response: http1.Response) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("content-type", "application/json")

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except TimeoutError as exc:  # before OSError: TimeoutError is one
            raise EngineTimeout(f"engine response ran past its timeout: {exc!r}") from exc
        except OSError as exc:
            raise StreamBroken(f"engine response broke off: {exc!r}") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.chunks():
                yield chunk
        except TimeoutError as exc:  # a long generation past the timeout, or a stalled engine: not a reset
            raise EngineTimeout(f"engine stream ran past its timeout: {exc!r}") from exc
        except OSError as exc:
            raise StreamBroken(f"engine stream broke off: {exc!r}") from exc

    def release(self) -> None:
        self._response.release()


class VllmDriver:
    def __init__(
        self,
        *,
        connect_timeout_s: float,
        request_timeout_s: float,
        adapter_load_timeout_s: float,
        max_connections_per_replica: int,
        probe_timeout_s: float,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=max_connections_per_replica),
            timeout=self._timeout,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
        )
        self._load_timeout = aiohttp.ClientTimeout(total=adapter_load_timeout_s, sock_connect=connect_timeout_s)
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        # The requests themselves go over backends/http1.py's client (a fifth of the gateway's CPU per request
        # went to aiohttp's client machinery); the LoRA API, probes and scrapes stay on the session above.
        self._request_timeout_s, self._connect_timeout_s = request_timeout_s, connect_timeout_s
        self._max_connections = max_connections_per_replica
        self._origins: dict[str, http1.Origin] = {}
        self._targets: dict[tuple[str, str], tuple[http1.Origin, bytes]] = {}

    def _target(self, replica: Endpoint, path: str) -> tuple[http1.Origin, bytes]:
        """The replica's connection pool and the start of the request's head, made once per replica and path."""
        found = self._targets.get((replica.url, path))
        if found is None:
            url = URL(replica.url + path)
            origin = self._origins.get(replica.url)
            if origin is None:
                origin = self._origins[replica.url] = http1.Origin(
                    url, limit=self._max_connections, connect_timeout_s=self._connect_timeout_s,
                    idle_timeout_s=_IDLE_TIMEOUT_S,
                )  # fmt: skip
            prefix = origin.head_prefix("POST", url.raw_path_qs, "application/json")
            found = self._targets[(replica.url, path)] = (origin, prefix)
        return found

    async def prepare_adapter(self, adapter: AdapterRef) -> None:
        """Nothing: vLLM reads the adapter from its own disk when it loads it."""

    async def load_adapter(self, replica: Endpoint, adapter: AdapterRef) -> None:
        body = {"lora_name": adapter.engine_name, "lora_path": adapter.source}
        status, text = await self._lora_api(replica, "/v1/load_lora_adapter", body, f"loading {adapter.engine_name}")
        if status == 200 or (status == 400 and "has already been loaded" in text):
            return
        raise AdapterLoadFailed(adapter.engine_name, status, _error_message(text))

    async def unload_adapter(self, replica: Endpoint, engine_name: str) -> None:
        body = {"lora_name": engine_name}
        status, text = await self._lora_api(replica, "/v1/unload_lora_adapter", body, f"unloading {engine_name}")
        # vLLM answers 404 for a name it does not know: already gone, which is what we wanted.
        if status not in (200, 404):
            raise EngineRejected(status, _error_message(text))

    async def _lora_api(self, replica: Endpoint, path: str, body: dict[str, str], what: str) -> tuple[int, str]:
        """POST to vLLM's runtime LoRA API: (status, text), or the driver's errors when there is no answer."""
        try:
            async with self._session.post(
                replica.url + path, data=json.dumps(body).encode(), headers=_JSON, timeout=self._load_timeout
            ) as response:
                return response.status, await read_text(response)
        except TimeoutError as exc:
            raise EngineTimeout(f"{what} on {replica.id} timed out") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"{replica.id} unreachable: {exc!r}") from exc

    async def list_adapters(self, replica: Endpoint) -> set[str]:
        """vLLM's /v1/models lists the base model and every registered adapter; adapters carry a ``parent``."""
        try:
            async with self._session.get(replica.url + "/v1/models", timeout=self._load_timeout) as response:
                if response.status != 200:
                    raise EngineUnavailable(f"{replica.id} answered /v1/models with {response.status}")
                body = json.loads(await read_text(response))
        except TimeoutError as exc:
            raise EngineTimeout(f"{replica.id} did not list its models in time") from exc
        except (aiohttp.ClientError, ValueError, RecursionError) as exc:
            raise EngineUnavailable(f"{replica.id} did not list its models: {exc!r}") from exc
        models = body.get("data") if isinstance(body, dict) else None
        if not isinstance(models, list):  # another shape: no listing (not an exception reconciliation does not expect)
            raise EngineUnavailable(f"{replica.id} did not list its models: no 'data' list in its answer")
        return {
            model["id"]
            for model in models
            if isinstance(model, dict) and model.get("parent") and isinstance(model.get("id"), str)
        }

    async def send(self, replica: Endpoint, request: EngineRequest) -> VllmResponse:
        origin, prefix = self._target(replica, request.path)
        timeout_s = self._request_timeout_s if request.timeout_s is None else request.timeout_s
        head = http1.head(prefix, request.headers, len(request.body))
        try:
            response = await origin.request(head, request.body, timeout_s)
        except OSError as exc:  # TimeoutError and ConnectionWaitTimeout are ones
            raise http1.request_failure(exc, replica.id) from exc
        if 200 <= response.status < 300:
            return VllmResponse(response)
        try:
            text = (await response.read(MAX_ERROR_BODY)).decode("utf-8", "replace")
        except http1.AnswerTooLong:
            # Not read, but the engine's status stands: a refusal that echoes a large request (a validation error
            # quoting the field it refused) is the request's, and must not count against the replica.
            text = f"the engine's error answer is longer than {MAX_ERROR_BODY:,} bytes (not read)"
        except OSError as exc:
            raise EngineUnavailable(f"{replica.id} broke off its error answer: {exc!r}") from exc
        finally:
            response.release()
        if response.status < 400:  # a redirect (a front one hop off the engine): no answer, the replica's failure
            raise EngineRejected(502, f"{replica.id} answered {response.status} ({text[:200]!r}), not an answer")
        message, kind = _error_of(text)
        if response.status == 404 and "does not exist" in message:
            raise AdapterNotLoaded(404, message)
        raise EngineRejected(response.status, message, kind)

    async def healthy(self, replica: Endpoint) -> bool:
        try:
            # Not following a redirect: a front's page answering 200 is not the engine up.
            async with self._session.get(
                replica.url + "/health", timeout=self._probe_timeout, allow_redirects=False
            ) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def load_signals(self, replica: Endpoint) -> EngineLoad | None:
        """vLLM's own gauges: requests running and waiting, and KV cache usage (summed over its label sets), and its
        counter of generated tokens (outlier detection reads a stall from it: gateway/fleet/outlier.py)."""
        try:
            async with self._session.get(replica.url + "/metrics", timeout=self._probe_timeout) as response:
                if response.status != 200:
                    return None
                text = await read_text(response, MAX_METRICS_PAGE)
        except (TimeoutError, aiohttp.ClientError):
            return None
        # Parsed on a worker thread: however the engine makes its page, the event loop (every tenant's requests) goes
        # on while it is read, holding the interpreter at most its switch interval (5 ms) at a time.
        return await asyncio.to_thread(parse_load_signals, text)

    async def close(self) -> None:
        for origin in self._origins.values():
            origin.close()
        await self._session.close()


# The most of an error answer read (an engine's refusal is a line of JSON; 1 MiB parses in a few ms): one of
# megabytes (a proxy's page, a broken or hostile engine) was read whole, up to the 64 MiB an answer may take, and
# parsed on the event loop.
MAX_ERROR_BODY = 1 << 20


def _error_message(text: str) -> str:
    return _error_of(text)[0]


def _error_of(text: str) -> tuple[str, str]:
    """The message and the error type of vLLM's error body (``{"error": {"message", "type", ...}}``)."""
    try:
        error = json.loads(text).get("error", {})
        return str(error.get("message", text)), str(error.get("type") or "")
    except (ValueError, AttributeError, RecursionError):  # not JSON, not vLLM's shape, or nested past the parser
        return text[:500], ""


def _driver(settings: NoSettings, pool: PoolSettings) -> VllmDriver:
    return VllmDriver(
        connect_timeout_s=pool.connect_timeout_s,
        request_timeout_s=pool.request_timeout_s,
        adapter_load_timeout_s=pool.adapter_load_timeout_s,
        max_connections_per_replica=pool.max_connections_per_replica,
        probe_timeout_s=pool.probe_timeout_s,
    )


SPEC = register(EngineSpec(name="vllm", settings=NoSettings, driver=_driver, takes_cache_salt=True))


_LOAD_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
_LORA_INFO = "vllm:lora_requests_info"

# The page is read with string operations and regular expressions, not prometheus-client's exposition parser, which
# reads a character at a time in Python: 0.6-0.9 ms per scrape of a page whose ``vllm:lora_requests_info`` had grown
# 150 series (it grows a series for every label set it ever reported), four replicas scraped twice a second. Only
# the sample lines of the families read are looked at; each must be a well-formed sample line (as the parser reads
# it; of ``vllm:lora_requests_info``, the newest), else the page reads as no signal, as before.
_SAMPLE_NAMES = (*_LOAD_GAUGES, _GENERATED + "_total", _LORA_INFO)
_LABEL_VALUE = r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'  # quoted, with the format's escapes (\\, \", \n)
_LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*=" + _LABEL_VALUE
_SAMPLE = re.compile(rf"([^{{ \t]+)(?:\{{((?:{_LABEL}(?:,{_LABEL})*,?)?)\}})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t]*")
_LABEL_PAIR = re.compile(rf"([a-zA-Z_][a-zA-Z0-9_]*)=({_LABEL_VALUE})")
_ESCAPE = re.compile(r"\\(.)")
_ESCAPED = {"n": "\n", "\\": "\\", '"': '"'}


def parse_load_signals(text: str) -> EngineLoad | None:
    """The three load gauges (summed over their label sets), the counter of generated tokens (outlier detection
    reads a stall from it: its ``_total`` samples; None when the page has none) and the running adapters from vLLM's
    /metrics page: ``vllm:lora_requests_info`` has one series per label set it ever reported, valued with when it was
    last true, so the newest is current (its ``waiting_lora_adapters`` repeats the running ones: not read)."""
    wanted = dict.fromkeys(_LOAD_GAUGES, 0.0)
    generated: float | None = None
    newest, newest_line = -math.inf, ""
    for line in text.splitlines():
        if not line.startswith(_SAMPLE_NAMES):
            continue
        if line.startswith(_LORA_INFO + "{"):  # one of many: its value only (from the end: labels may hold spaces)
            try:
                value = float(line[line.rindex("}") + 1 :].split()[0])
            except (ValueError, IndexError):
                return None
            if value > newest:
                newest, newest_line = value, line
            continue
        sample = _sample(line)
        if sample is None:
            return None
        name, _, value = sample
        if name in wanted:
            wanted[name] += value
        elif name == _GENERATED + "_total":
            generated = (generated or 0.0) + value
    labels: dict[str, str] = {}
    if newest_line:
        sample = _sample(newest_line)
        if sample is None:
            return None
        labels = sample[1]
    running = labels.get("running_lora_adapters", "")
    return EngineLoad(
        running=wanted["vllm:num_requests_running"],
        waiting=wanted["vllm:num_requests_waiting"],
        kv_cache_usage=wanted["vllm:kv_cache_usage_perc"],
        running_adapters=frozenset(name for name in running.split(",") if name),
        generated_tokens=generated,
        gpu_slots=_count(labels.get("max_lora")),
    )


def _sample(line: str) -> tuple[str, dict[str, str], float] | None:
    """A sample line's name, labels and value; None if it is not one."""
    sample = _SAMPLE.fullmatch(line.rstrip("\r"))
    if sample is None:
        return None
    name, labels, raw = sample.groups()
    try:
        value = float(raw)
    except ValueError:
        return None
    pairs = _LABEL_PAIR.findall(labels or "")
    return name, {key: _ESCAPE.sub(_unescape, quoted[1:-1]) for key, quoted in pairs}, value


def _unescape(escape: re.Match[str]) -> str:
    """A label value's escape as the exposition format defines it (an unknown one is kept as written, as the
    exposition parser keeps it)."""
    return _ESCAPED.get(escape.group(1), escape.group(0))


def _count(text: str | None) -> int | None:
    """A label's count (``max_lora``), or None: the engine's text, and int() refuses what str.isdigit accepts (a
    Unicode digit) and long numbers; raised here, it failed the pool's whole scrape."""
    return int(text) if text and len(text) <= 9 and text.isascii() and text.isdigit() else None

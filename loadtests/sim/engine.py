"""The simulated engine: a continuous-batching step loop over the adapter caches and the KV cache.

Each step admits waiting requests in arrival order while the batch has seats, their adapter can get a GPU slot
(otherwise the request is skipped and later ones overtake it, as in vLLM) and the KV cache can hold them (else
admission stops). The step's simulated duration is the adapter loads it needed, prefill of the uncached prompt
tokens it admitted, and one decode step whose cost grows with the batch and with its distinct adapters. Every
running request then emits one token. Adapter loads through the API hold the same lock as a step: vLLM's engine
core runs them between steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from loadtests.sim.adapters import AdapterCaches, AdapterInfo, read_adapter
from loadtests.sim.defaults import SimParams
from loadtests.sim.kvcache import Allocation, KVCache
from loadtests.sim.stats import SimStats
from loadtests.sim.textgen import answer_tokens
from loadtests.sim.timeline import RequestSeen, Timeline, prompt_digest
from loadtests.sim.tokenizer import tokenize


class PromptTooLong(ValueError):
    pass


@dataclass(eq=False)
class SimRequest:
    adapter: str | None
    cache_salt: str
    prompt_tokens: list[str]
    answer: list[str]
    finish_reason: str
    arrived_at: float
    submitted_wall: float
    tokens: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    emitted: int = 0
    done: bool = False
    allocation: Allocation | None = None
    waited_for: set[str] = field(default_factory=set)
    first_token_wall: float | None = None
    # The adapter as it was when the request arrived: like vLLM's LoRARequest, a queued request keeps it, so an
    # unload (which only forgets the name) does not take it away from a request already accepted.
    adapter_info: AdapterInfo | None = None
    # For the timeline (loadtests/sim/timeline.py): the prompt's digest, and when a step admitted the request.
    digest: str = ""
    admitted_wall: float | None = None


class SimEngine:
    def __init__(self, params: SimParams, model_name: str) -> None:
        self.params = params
        self.model_name = model_name
        self.stats = SimStats()
        self._rng = random.Random(params.seed)
        self.adapters = AdapterCaches(params, self.stats, self._rng)
        self.kv = KVCache(params.kv_blocks, params.block_size)
        self._waiting: list[SimRequest] = []
        self._running: list[SimRequest] = []
        self._lock = asyncio.Lock()
        self._work = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._steps_before_hold: int | None = None  # set by ``run_steps``: hold again after this many
        self._sim_now = 0.0
        self._loop_task: asyncio.Task[None] | None = None
        # Called with each request's wall-clock time to first token (the /metrics histogram hooks in here).
        self.on_first_token: Callable[[float], None] = lambda seconds: None
        # vLLM's vllm:lora_requests_info: one series per label set ever seen, valued with when it was last seen.
        self.lora_info_series: dict[str, float] = {}
        # What each request waited for, and the stalls between steps (GET /sim/timeline).
        self.timeline = Timeline()
        # The stalls the step being planned needs, in simulated seconds: (kind, adapter, seconds).
        self._step_stalls: list[tuple[str, str, float]] = []

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="sim-engine-steps")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task

    # --- adapters -------------------------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> None:
        if name in self.adapters.registered:
            self.stats.duplicate_loads += 1
        self.adapters.check_unregistered(name)
        info = read_adapter(name, path, self.params.max_lora_rank)
        async with self._lock:
            cost = self.adapters.register(info)
            self.stats.registrations += 1
            self.stats.peak_registered = max(self.stats.peak_registered, len(self.adapters.registered))
            started = time.monotonic()
            await self._spend(cost)
            if cost > 0:
                self.timeline.stall(started, time.monotonic(), "load", name)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unregister(name)
        self.stats.unregistrations += 1

    # --- requests -------------------------------------------------------------------------------------------
    def submit(
        self,
        adapter: str | None,
        prompt: str,
        max_tokens: int | None,
        ignore_eos: bool = False,
        answer_key: str | None = None,
        stop_words: Collection[str] = (),
        cache_salt: str | None = None,
    ) -> SimRequest:
        """Queue a request. The answer is derived from ``answer_key`` (default: the adapter or model name) and the
        prompt; Triton mode passes a digest of the adapter's weights, so different weights give different text.
        The answer ends after the first of ``stop_words`` it says (kept in the text, as TensorRT-LLM keeps it)."""
        p = self.params
        prompt_tokens = tokenize(prompt)
        model = adapter or self.model_name
        room = p.max_model_len - len(prompt_tokens)
        wanted = max_tokens if max_tokens is not None else room
        if wanted > room:
            self.stats.rejected += 1
            raise PromptTooLong(
                f"This model's maximum context length is {p.max_model_len} tokens. However, you requested "
                f"{len(prompt_tokens) + wanted} tokens ({len(prompt_tokens)} in the messages, {wanted} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        natural = answer_tokens(answer_key or model, prompt, p.seed, p.min_natural_tokens, p.max_natural_tokens)
        if ignore_eos:  # vLLM's extra parameter: generate exactly max_tokens
            natural = (natural * (wanted // len(natural) + 1))[: wanted + 1]
        answer = natural[:wanted]
        stopped = next((index for index, word in enumerate(answer) if word in stop_words), None)
        if stopped is not None:
            answer = natural = answer[: stopped + 1]
        request = SimRequest(
            adapter=adapter,
            adapter_info=self.adapters.registered.get(adapter) if adapter is not None else None,
            # As vLLM: prefix blocks are keyed by the adapter and the request's cache_salt (when it sends one).
            cache_salt=model if cache_salt is None else f"{model}\x00{cache_salt}",
            prompt_tokens=prompt_tokens,
            answer=answer,
            finish_reason="stop" if len(natural) <= wanted else "length",
            arrived_at=self._sim_now,
            submitted_wall=time.monotonic(),
            digest=prompt_digest(prompt),
        )
        self.stats.requests += 1
        self.stats.requests_by_model[model] += 1
        self.stats.prompt_tokens += len(prompt_tokens)
        self._waiting.append(request)
        self._work.set()
        return request

    def abort(self, request: SimRequest) -> None:
        """The client went away: free what the request holds and stop working for it."""
        if request.done:
            return
        self.stats.aborted += 1
        if request in self._waiting:
            self._waiting.remove(request)
        if request in self._running:
            self._running.remove(request)
            self._release(request)
        request.done = True

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self, paused: bool) -> None:
        """Hold the step loop before its next step (tests use it to line requests up deterministically)."""
        self._steps_before_hold = None
        if paused:
            self._resumed.clear()
        else:
            self._resumed.set()

    def run_steps(self, count: int) -> None:
        """Run ``count`` more steps (steps wait for work), then hold: a test can stop a stream after its first
        token however slow the machine is. Call it while the engine is idle or paused: a step already under way
        counts, and so does one that admits nothing (a request waiting for an adapter slot or KV space)."""
        self._steps_before_hold = count
        if count > 0:
            self._resumed.set()
        else:
            self._resumed.clear()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def running_requests(self) -> tuple[SimRequest, ...]:
        return tuple(self._running)

    # --- the step loop --------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._work.clear()
                await self._work.wait()
                continue
            await self._resumed.wait()
            async with self._lock:
                batch, duration = self._plan_step()
                self._note_stalls()
                await self._spend(duration)
                self.stats.steps += 1
                self.stats.busy_s += duration
                self._emit(batch)
                if self._steps_before_hold is not None:
                    self._steps_before_hold -= 1
                    if self._steps_before_hold <= 0:
                        self.pause(True)

    def _plan_step(self) -> tuple[list[SimRequest], float]:
        p = self.params
        cost = 0.0
        still_waiting: list[SimRequest] = []
        self._step_stalls = []
        planned_at = time.monotonic()
        for index, request in enumerate(self._waiting):
            if len(self._running) >= p.max_num_seqs:
                for blocked in self._waiting[index:]:
                    self._note_wait(blocked, "batch")
                still_waiting.extend(self._waiting[index:])
                break
            if request.adapter is not None and not self.adapters.can_activate(request.adapter):
                self._note_wait(request, "lora_slot")
                still_waiting.append(request)
                continue
            keys = self.kv.block_keys(request.cache_salt, request.prompt_tokens)
            allocation = self.kv.try_allocate(keys, len(request.prompt_tokens), len(request.answer))
            if allocation is None:
                for blocked in self._waiting[index:]:
                    self._note_wait(blocked, "kv")
                still_waiting.extend(self._waiting[index:])
                break
            request.allocation = allocation
            if request.adapter is not None:
                activation = self.adapters.activate(request.adapter, request.adapter_info)
                if activation > 0:  # a swap-in, after a read from disk when the adapter had left host memory
                    if activation > p.swap_in_s:
                        self._step_stalls.append(("load", request.adapter, activation - p.swap_in_s))
                    self._step_stalls.append(("swap", request.adapter, p.swap_in_s))
                cost += activation
            request.admitted_wall = planned_at
            uncached = len(request.prompt_tokens) - allocation.cached_tokens
            self.stats.prefix_hit_tokens += allocation.cached_tokens
            self.stats.prefix_miss_tokens += uncached
            self.stats.queue_wait_s += self._sim_now - request.arrived_at
            cost += uncached * p.prefill_per_token_s
            self._running.append(request)
        self._waiting = still_waiting
        batch = list(self._running)
        distinct_adapters = len({r.adapter for r in batch if r.adapter is not None})
        cost += p.decode_step_s + p.decode_per_seq_s * len(batch) + p.decode_per_adapter_s * distinct_adapters
        return batch, cost

    def _emit(self, batch: list[SimRequest]) -> None:
        now = time.monotonic()
        for request in batch:
            if request.done:  # aborted while the step ran
                continue
            if request.first_token_wall is None:
                request.first_token_wall = now
                self.on_first_token(now - request.submitted_wall)
                self.timeline.requests.append(
                    RequestSeen(request.adapter, request.digest, request.submitted_wall,
                                request.admitted_wall or now, now, tuple(sorted(request.waited_for)))
                )  # fmt: skip
            request.tokens.put_nowait(request.answer[request.emitted])
            request.emitted += 1
            self.stats.generation_tokens += 1
            if request.emitted >= len(request.answer):
                request.done = True
                self._running.remove(request)
                self._release(request)
                self.stats.finished += 1
                request.tokens.put_nowait(None)
        running = ",".join(sorted({r.adapter for r in self._running if r.adapter is not None}))
        self.lora_info_series[running] = time.time()

    def _note_stalls(self) -> None:
        """Lay the planned step's stalls on the wall clock from now, in the order the step pays them (loads and
        swap-ins first, then prefill and decode, all within one sleep)."""
        at = time.monotonic()
        for kind, adapter, seconds in self._step_stalls:
            end = at + seconds * self.params.time_scale
            self.timeline.stall(at, end, kind, adapter)
            at = end

    def _release(self, request: SimRequest) -> None:
        if request.allocation is not None:
            self.kv.release(request.allocation)
            request.allocation = None
            if request.adapter is not None:
                self.adapters.deactivate(request.adapter)

    def _note_wait(self, request: SimRequest, reason: str) -> None:
        if reason not in request.waited_for:
            request.waited_for.add(reason)
            self.stats.waits[reason] += 1

    async def _spend(self, simulated_s: float) -> None:
        self._sim_now += simulated_s
        if self.params.time_scale > 0 and simulated_s > 0:
            await asyncio.sleep(simulated_s * self.params.time_scale)
        else:
            await asyncio.sleep(0)

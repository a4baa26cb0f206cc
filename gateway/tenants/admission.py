"""Per-tenant admission: requests and tokens per minute, concurrent requests, and the per-request token cap.

Rates are token buckets (capacity = the per-minute limit, refilled continuously). With Redis, a tenant's buckets
live there and each gateway leases tokens from them in small batches (a tenth of a minute's limit), so the limit
holds across gateways without a Redis round trip per request: a gateway asks Redis only when its lease runs out.
Leases never over-admit; each gateway may hold back up to one unused lease, which is the stated tolerance. If
Redis is unreachable, each gateway falls back to a local bucket with the full limit until Redis answers again.
Concurrency is counted per gateway instance.

Tokens are counted before a request runs (its estimate) and corrected by what the engine reports when it ends
(streams too: ingress asks the engine for usage on every stream). A request that used more than its estimate is
never cut short: the excess is a debt the tenant's next requests pay. A stream that ends without the engine's usage
(its client left first, the engine broke off) is charged a token for each event it relayed, where that is more than
its estimate (``unreported_usage``). With Redis the debt is taken from the shared
bucket at once (one call, off the request path, only for a request that overran), so every gateway sees it.

What the engine reports is believed up to what the request could have used (``clamp_usage``, on the request's way
out with its ticket's settling). Above that bound a report is the engine's bug (a counter gone wrong, a garbled
body), not tokens anyone used, and charging it would do lasting harm: the tenant's token bucket in a debt it could
never pay off (a report of 10^15 tokens against a limit of 100,000 a minute), its traffic figure (what placement
moves keys by) and its token counters absurd. So each figure is clamped to the request's own ceiling, and every
clamp is counted (``tenantgate_usage_clamped_total{pool, replica}``, the replica that sent it) and logged.

The ceiling, per figure:
- prompt: the pool's ``context_tokens`` (an engine refuses a longer prompt); for a request of text alone, also the
  body's length in bytes plus ``PROMPT_OVERHEAD_TOKENS``: every token of a byte-level tokenizer (SentencePiece's
  byte fallback too) covers at least one byte of the text, which the JSON holds in as many bytes or more; a token
  id takes at least two (a digit and a comma); a chat template adds a preamble and a few tokens per message, fewer
  than the message's own JSON takes. Images and other parts may cost tokens their bytes do not show: context only.
- completion: ``choices`` x the request's ``max_tokens`` (its own, or the tenant's cap), none above the context;
  ``choices`` is ``n`` for each prompt of a completions batch (a ``prompt`` that is a list of strings).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from gateway.config import GatewayConfig, TenantLimits
from gateway.errors import InvalidRequest, RequestRateLimited, TokenRateLimited
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.telemetry import RequestRecord

log = logging.getLogger(__name__)

# Without max_tokens a request may generate up to the engine's context; count this many until usage corrects it.
DEFAULT_MAX_TOKENS_ESTIMATE = 256
LEASE_SHARE = 0.1


class SharedBuckets(Protocol):
    """Token buckets several gateways share (Redis)."""

    async def lease(self, key: str, want: float, need: float, capacity: float, per_s: float) -> tuple[float, float]:
        """Take ``want`` tokens, or at least ``need``, from the bucket: (granted, seconds until ``need`` would
        be there when nothing was granted). Raises ``StoreUnavailable`` when the store cannot be reached."""
        ...

    async def debit(self, key: str, amount: float, capacity: float, per_s: float) -> None:
        """Take ``amount`` tokens used beyond what was leased, below zero if need be: a debt every gateway's next
        lease waits out. Raises ``StoreUnavailable`` when the store cannot be reached."""
        ...


class Bucket:
    """A local token bucket: ``capacity`` tokens, refilled at ``per_s``."""

    def __init__(self, capacity: float, per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.per_s, self._clock = capacity, per_s, clock
        self.tokens, self._at = capacity, clock()

    def _refill(self) -> None:
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._at) * self.per_s)
        self._at = now

    def take(self, amount: float) -> float:
        """Take ``amount`` if there; else take nothing and return the seconds until there would be enough."""
        self._refill()
        if self.tokens >= amount:
            self.tokens -= amount
            return 0.0
        return (min(amount, self.capacity) - self.tokens) / self.per_s

    def give(self, amount: float) -> None:
        """Give tokens back (a request used fewer than counted), or take more (negative: it used more)."""
        self._refill()
        self.tokens = min(self.capacity, self.tokens + amount)


# After a shared bucket did not answer, every limit of the gateway uses its local bucket this long.
FALLBACK_S = 5.0
# A refusal from the shared bucket is repeated here, without Redis, only while the bucket cannot have refilled
# enough even if Redis' clock ran this much ahead of this host's since (RateLimit._short_of).
SHORT_SLACK_S = 0.05


class Outage:
    """Until when the shared buckets count as unreachable, for every limit of a gateway at once. Each lease that
    finds Redis hung (accepting connections, never answering) waits ``state.operation_timeout_s`` (0.5 s) for
    nothing; when each limit learned the outage for itself, every tenant's requests and tokens limits each paid
    that wait every ``FALLBACK_S``, and a tenant's concurrent requests paid it one after another (one lease at a
    time): 4 tenants' 20 requests made 24 leases where one per tenant, side by side, tells the same (a tenant's
    fifth request waited 2.5 s; tests/gateway/tenants/test_admission.py)."""

    def __init__(self) -> None:
        self.until = 0.0

    @property
    def now(self) -> bool:
        return time.monotonic() < self.until

    def began(self) -> None:
        self.until = time.monotonic() + FALLBACK_S


class RateLimit:
    """One per-minute limit: a local bucket, or leases from a shared one (falling back to the local bucket)."""

    def __init__(self, key: str, per_minute: int, shared: SharedBuckets | None, outage: Outage | None = None) -> None:
        self.key, self.capacity, self.per_s = key, float(per_minute), per_minute / 60
        self.local = Bucket(self.capacity, self.per_s)
        self.shared = shared
        self.leased = 0.0
        self.lease_size = max(1.0, per_minute * LEASE_SHARE)
        self._leasing = asyncio.Lock()
        self._outage = outage if outage is not None else Outage()
        # Tokens used beyond the lease, not yet taken from the shared bucket; one debit in flight at a time.
        self._debt = 0.0
        self._debiting: asyncio.Task[None] | None = None
        # What the shared bucket held when it last refused a lease, and when it was asked (time.monotonic): it
        # refills at per_s and only leases and debts take from it, so until it can hold a request's need that
        # request is refused here, asking Redis nothing. A tenant over its limit made a script call for every
        # request it sent, on the Redis every tenant's leases (and the residency store, the slot signal) share, each
        # refusal a round trip.
        self._short: tuple[float, float] | None = None

    async def take(self, amount: float) -> float:
        if self.shared is None or self._outage.now:
            return self.local.take(amount)
        if self.leased >= amount:
            self.leased -= amount
            return 0.0
        async with self._leasing:  # one lease at a time: concurrent requests wait for it rather than each leasing
            if self._debiting is not None:  # a debt on its way to the shared bucket: this lease must see it
                await asyncio.shield(self._debiting)
            if self.leased >= amount:
                self.leased -= amount
                return 0.0
            if self._outage.now:  # the lease this one waited behind found the store unreachable
                return self.local.take(amount)
            # A debt larger than a minute's limit could never be leased at once: forgive what exceeds it.
            self.leased = max(self.leased, amount - self.capacity)
            need = amount - self.leased
            if (short := self._short_of(need)) is not None:
                return short
            # Before the call: the script read the bucket after this, and the refill since counts from here, so the
            # figure below is never less than the bucket holds (stamped at the reply, a slow round trip refused here
            # what the bucket had refilled while the answer travelled).
            asked_at = time.monotonic()
            try:
                granted, wait = await self.shared.lease(
                    self.key, max(need, self.lease_size), need, self.capacity, self.per_s
                )
            except Exception as exc:  # StoreUnavailable: the local bucket, with the full limit, for a while
                if not self._outage.now:
                    log.warning("rate limits: shared buckets unreachable (%s), local fallback for %.0f s: %s",
                                self.key, FALLBACK_S, exc)  # fmt: skip
                self._outage.began()
                return self.local.take(amount)
            self.leased += granted
            # Refused: the bucket held min(need, capacity) less what refills in the wait (the script's own sum).
            self._short = (min(need, self.capacity) - wait * self.per_s, asked_at) if not granted else None
            if self.leased >= amount:
                self.leased -= amount
                return 0.0
            return max(wait, 0.001)

    def _short_of(self, need: float) -> float | None:
        """The wait, when the shared bucket cannot hold ``need`` yet by what its last refusal said (None: ask)."""
        if self._short is None:
            return None
        tokens, at = self._short
        # At most what it held then, refilled since (with SHORT_SLACK_S for the two clocks' rates): never more.
        have = tokens + (time.monotonic() - at + SHORT_SLACK_S) * self.per_s
        want = min(need, self.capacity)
        if have >= want:
            return None
        return (want - have) / self.per_s + SHORT_SLACK_S

    def give(self, amount: float) -> None:
        """Give tokens back (negative: take more, a debt). Locally the bucket goes below zero; with a shared
        bucket a debt first comes out of this gateway's lease, and the rest out of the shared bucket."""
        if self.shared is None:
            self.local.give(amount)
            return
        self.leased += amount
        if self.leased < 0:
            self._debt, self.leased = self._debt - self.leased, 0.0
            if self._debiting is None:
                self._debiting = asyncio.get_running_loop().create_task(self._pay_debt(), name=f"debit {self.key}")

    async def _pay_debt(self) -> None:
        assert self.shared is not None
        try:
            while self._debt > 0:
                amount, self._debt = self._debt, 0.0
                try:
                    await self.shared.debit(self.key, amount, self.capacity, self.per_s)
                except Exception as exc:  # StoreUnavailable: the debt stays with the local fallback bucket
                    log.warning(
                        "rate limit %s: could not debit %.0f tokens from the shared bucket: %s", self.key, amount, exc
                    )
                    self.local.give(-amount)
        finally:
            self._debiting = None


@dataclass
class Ticket:
    """An admitted request: what it took, to settle when it ends."""

    estimated_tokens: int
    limiter: TenantLimiter | None

    def settle(self, actual_tokens: int | None) -> None:
        if self.limiter is not None:
            self.limiter.settle(self, actual_tokens)


# The ticket of every request of a tenant without limits: it takes nothing, so it has nothing to settle.
_UNLIMITED = Ticket(0, None)


class TenantLimiter:
    def __init__(
        self, tenant: str, limits: TenantLimits, shared: SharedBuckets | None, outage: Outage | None = None
    ) -> None:
        self.tenant, self.limits = tenant, limits
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        outage = outage if outage is not None else Outage()  # the tenant's two limits learn an outage together
        self.requests = None if rpm is None else RateLimit(f"{tenant}:requests", rpm, shared, outage)
        self.tokens = None if tpm is None else RateLimit(f"{tenant}:tokens", tpm, shared, outage)
        self.in_flight = 0

    def hold(self) -> None:
        """Take one of the tenant's concurrent requests (429 at its limit); ``settle`` or ``release`` gives it back."""
        limits = self.limits
        if limits.max_concurrent is not None and self.in_flight >= limits.max_concurrent:
            raise RequestRateLimited(
                f"Too many concurrent requests: the limit is {limits.max_concurrent}.", headers={"Retry-After": "1"}
            )
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    async def admit(self, estimated_tokens: int) -> Ticket:
        self.hold()  # held before any await, so concurrent admissions see it; given back if refused
        try:
            await self._take_rates(estimated_tokens)
        except BaseException:
            self.in_flight -= 1
            raise
        return Ticket(estimated_tokens, self)

    async def _take_rates(self, estimated_tokens: int) -> None:
        limits = self.limits
        if self.requests is not None:
            wait = await self.requests.take(1)
            if wait:
                raise RequestRateLimited(
                    f"Rate limit reached: {limits.requests_per_minute} requests per minute.",
                    headers={"Retry-After": str(math.ceil(wait))},
                )
        if self.tokens is not None:
            wait = await self.tokens.take(estimated_tokens)
            if wait:
                if self.requests is not None:
                    self.requests.give(1)  # not admitted: the request does not count
                raise TokenRateLimited(
                    f"Rate limit reached: {limits.tokens_per_minute} tokens per minute.",
                    headers={"Retry-After": str(math.ceil(wait))},
                )

    def settle(self, ticket: Ticket, actual_tokens: int | None) -> None:
        self.in_flight -= 1
        if self.tokens is not None and actual_tokens is not None:
            self.tokens.give(ticket.estimated_tokens - actual_tokens)


class Admission:
    def __init__(self, metrics: GatewayMetrics, shared: SharedBuckets | None) -> None:
        self._metrics, self._shared = metrics, shared
        self._limiters: dict[str, TenantLimiter] = {}
        self._outage = Outage()  # one for every tenant's limits: Redis is away for all of them

    def configure(self, config: GatewayConfig) -> None:
        """Take a (re)loaded config's limits (each tenant's own over ``limits.tenant_defaults``); a tenant whose
        limits did not change keeps its buckets."""
        limiters = {}
        defaults = config.limits.tenant_defaults
        for tenant in config.tenants:
            limits = with_defaults(tenant.limits, defaults)
            current = self._limiters.get(tenant.id)
            if current is not None and current.limits == limits:
                limiters[tenant.id] = current
            elif limits != TenantLimits():
                limiters[tenant.id] = TenantLimiter(tenant.id, limits, self._shared, self._outage)
        self._limiters = limiters

    def limits(self, tenant: str) -> TenantLimits | None:
        limiter = self._limiters.get(tenant)
        return limiter.limits if limiter else None

    def check_max_tokens(self, tenant: str, max_tokens: int | None) -> int | None:
        """The request's max_tokens, or the tenant's cap when it names none (so leaving it out cannot escape the
        cap); a request over the cap is refused."""
        limits = self.limits(tenant)
        cap = limits.max_tokens if limits else None
        if cap is not None and max_tokens is not None and max_tokens > cap:
            self._metrics.rejections.labels(tenant, "max_tokens").inc()
            raise InvalidRequest(f"max_tokens is {max_tokens}; this key may ask for at most {cap}.", param="max_tokens")
        return max_tokens if max_tokens is not None else cap

    @contextlib.contextmanager
    def reading_body(self, tenant: str) -> Iterator[None]:
        """While ``tenant``'s request body is read it counts against the tenant's concurrency (429 at the limit), so
        half-sent bodies cannot pile up past it; given back when the read ends, with no await before ``admit``
        takes the place for the request."""
        limiter = self._limiters.get(tenant)
        if limiter is None:
            yield
            return
        try:
            limiter.hold()
        except RequestRateLimited:
            self._metrics.rejections.labels(tenant, "concurrency").inc()
            raise
        try:
            yield
        finally:
            limiter.release()

    def unlimited(self, tenant: str) -> Ticket | None:
        """The ticket of a tenant without limits (nothing taken, nothing to settle), at once; None for a tenant with
        limits, whose request ``admit`` takes its place."""
        return _UNLIMITED if tenant not in self._limiters else None

    async def admit(self, tenant: str, estimated_tokens: int) -> Ticket:
        limiter = self._limiters.get(tenant)
        if limiter is None:
            return Ticket(estimated_tokens, None)
        try:
            return await limiter.admit(estimated_tokens)
        except (RequestRateLimited, TokenRateLimited) as exc:
            reason = "concurrency" if "concurrent" in exc.message else exc.error_type
            self._metrics.rejections.labels(tenant, reason).inc()
            raise


def with_defaults(own: TenantLimits, defaults: TenantLimits) -> TenantLimits:
    """A tenant's limits: its own fields, and the defaults' where its own are unset."""
    if defaults == TenantLimits():
        return own
    unset = {name: getattr(defaults, name) for name in TenantLimits.model_fields if getattr(own, name) is None}
    return own.model_copy(update=unset)


def estimate_tokens(prompt_chars: int, max_tokens: int | None, choices: int = 1) -> int:
    """The prompt's tokens (about 4 characters each, OpenAI's rule of thumb) plus what may be generated, for each
    of the ``choices`` completions asked for."""
    generated = max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS_ESTIMATE
    return math.ceil(prompt_chars / 4) + choices * generated


# What a chat template may add besides the messages' own text (a system preamble, a tool-use instruction, BOS).
PROMPT_OVERHEAD_TOKENS = 4096


def prompt_ceiling(body_bytes: int, text_only: bool, context_tokens: int) -> int:
    return min(context_tokens, body_bytes + PROMPT_OVERHEAD_TOKENS) if text_only else context_tokens


def completion_ceiling(max_tokens: int | None, choices: int, context_tokens: int) -> int:
    return choices * (context_tokens if max_tokens is None else min(max_tokens, context_tokens))


def unreported_usage(estimate: int, prompt_chars: int, events: int, most: int) -> int | None:
    """What a stream that ended without the engine's usage is charged, once it relayed ``events`` SSE events: its
    prompt's estimate and a token an event (vLLM sends an event a token; a role or a finish event carries none, a
    speculative step several), at most ``most`` (its ceilings), never less than its estimate (None: keep that).
    Charged the estimate alone, a client that asked for no max_tokens (an estimate of DEFAULT_MAX_TOKENS_ESTIMATE),
    read all it wanted and left before the usage event was charged a fraction of what it used."""
    sent = min(math.ceil(prompt_chars / 4) + events, most)
    return sent if sent > estimate else None


def clamp_usage(record: RequestRecord, metrics: GatewayMetrics, prompt_most: int, completion_most: int) -> int | None:
    """The tokens to charge for ``record``'s request (None when the engine did not report both figures); a figure
    above its ceiling is set to it in the record, so the token counters and the access line say what was charged."""
    prompt, completion = record.prompt_tokens, record.completion_tokens
    if (prompt is not None and prompt > prompt_most) or (completion is not None and completion > completion_most):
        log.warning(
            "replica %s of pool %s reported usage of %s prompt and %s completion tokens for a request of tenant %s "
            "that could use at most %d and %d: charged those",
            record.replica, record.pool, prompt, completion, record.tenant, prompt_most, completion_most,
        )  # fmt: skip
        metrics.usage_clamped.labels(record.pool, record.replica).inc()
        if prompt is not None:
            prompt = record.prompt_tokens = min(prompt, prompt_most)
        if completion is not None:
            completion = record.completion_tokens = min(completion, completion_most)
    return prompt + completion if prompt is not None and completion is not None else None

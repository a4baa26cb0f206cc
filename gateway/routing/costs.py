"""What a request's time to first token (TTFT) is predicted to be on a replica, learned from what the gateway sees.

A request's *regime* on a replica is what the gateway knows there when it routes (docs/architecture.md's latency
table describes the three the engines have; the adapter-warm case splits by where the adapter is):

- ``warm``: the adapter is likely in a GPU slot there (the engine's ``vllm:lora_requests_info`` lists it running,
  a gateway has requests in flight with it there (this one, or another as the slot signal shares them), or it is
  among the replica's most recently used adapters, as
  many as the engine has GPU slots) and the key was served there within ``routing.prefix_warm_s``: its prefix is
  likely in the KV cache;
- ``kv_cold``: the adapter is likely on the GPU there, the key was not served there: prefill pays for the whole
  prompt;
- ``host``: the residency record holds the adapter there but not among the likely GPU ones: a swap into a GPU
  slot first (vLLM's CPU LoRA cache; Triton's host cache);
- ``cold``: the adapter is not resident there: the gateway loads it (100 ms to over 1 s on a GPU).

A request for the base model is never cold. Per regime, TTFT is a line in the replica's load (the requests ahead
of this one, as routing counts them): ``base + per_request x load``. Each line is fitted online by exponentially
weighted least squares over the TTFTs the gateway measures (streams only: a whole answer's first byte is its
last), starting from the line in config as a prior worth ``PRIOR_WEIGHT`` observations, which fades like any old
observation: the first few requests cannot swing the model, and a steady fleet moves it to what it does. A
trace of the prior (``PRIOR_FLOOR``) never fades, so the slope stays defined when every measurement came at one
load. The learning rate 0 freezes the priors (tests, or an operator who measured their own).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Regime = Literal["warm", "kv_cold", "host", "cold"]
REGIMES: tuple[Regime, ...] = ("warm", "kv_cold", "host", "cold")

# The prior's weight, in observations, at first (it fades with the learning rate) and for ever.
PRIOR_WEIGHT = 2.0
PRIOR_FLOOR = 0.05
# A measurement counts as at most this many times the prediction (plus the slack, for predictions near 0).
_OUTLIER_RATIO = 3.0
_OUTLIER_SLACK_MS = 10.0
# The prior's two points are at loads 0 and this many requests ahead, so its slope is defined.
_PRIOR_LOAD = 8.0


@dataclass(frozen=True)
class Line:
    """TTFT in milliseconds on a replica with ``load`` requests ahead: ``base_ms + per_request_ms x load``."""

    base_ms: float
    per_request_ms: float

    def at(self, load: float) -> float:
        return self.base_ms + self.per_request_ms * load


class _WeightedFit:
    """Exponentially weighted least squares of y on x, over a prior's two points."""

    __slots__ = ("_floor", "_rate", "_sums", "line")

    def __init__(self, prior: Line, rate: float) -> None:
        self._floor = _prior_sums(prior, PRIOR_FLOOR)
        self._sums = _prior_sums(prior, PRIOR_WEIGHT - PRIOR_FLOOR)
        self._rate = rate
        self.line = prior

    def observe(self, x: float, y: float) -> None:
        if not self._rate:
            return
        # TTFTs have a long tail (one request behind a long prefill): one of them may move the line by at most a
        # few times what it predicted, so it takes a run of slow ones, not one, to make a regime look slow.
        y = min(y, _OUTLIER_RATIO * self.line.at(x) + _OUTLIER_SLACK_MS)
        keep = 1.0 - self._rate
        w, sx, sy, sxx, sxy = (keep * s for s in self._sums)
        self._sums = (w + 1, sx + x, sy + y, sxx + x * x, sxy + x * y)
        self.line = self._fit()

    def _fit(self) -> Line:
        w, sx, sy, sxx, sxy = (a + b for a, b in zip(self._sums, self._floor, strict=True))
        spread = w * sxx - sx * sx  # > 0: the prior's floor alone has two distinct loads
        slope = max(0.0, (w * sxy - sx * sy) / spread)
        base = max(0.0, (sy - slope * sx) / w)
        return Line(base, slope)


def _prior_sums(prior: Line, weight: float) -> tuple[float, float, float, float, float]:
    """The sums of two points on ``prior`` (at loads 0 and ``_PRIOR_LOAD``) weighing ``weight`` together."""
    w = weight / 2
    y0, y1 = prior.at(0.0), prior.at(_PRIOR_LOAD)
    return (2 * w, w * _PRIOR_LOAD, w * (y0 + y1), w * _PRIOR_LOAD**2, w * _PRIOR_LOAD * y1)


class TtftModel:
    """One pool's lines, one per regime; ``learning_rate`` 0 keeps the priors. ``lines`` is read per candidate:
    a plain dict, replaced entry by entry as the fits move."""

    def __init__(self, priors: dict[Regime, Line], learning_rate: float, gpu_slot_ms: float = 0.0) -> None:
        self._fits = {regime: _WeightedFit(priors[regime], learning_rate) for regime in REGIMES}
        self.lines: dict[Regime, Line] = {regime: fit.line for regime, fit in self._fits.items()}
        # Bumped whenever a line moves: what is derived from the lines (the scorers' table) is rebuilt on change.
        self.version = 0
        # The expected wait for a GPU adapter slot (``gpu_slot_waits``): a moving average, at ``learning_rate``,
        # of what requests predicted to wait for one took beyond their regime's line, from the prior.
        self.gpu_slot_ms = gpu_slot_ms
        self._rate = learning_rate

    def line(self, regime: Regime) -> Line:
        return self.lines[regime]

    def observe_gpu_slot(self, regime: Regime, load: float, ttft_ms: float) -> None:
        """A request predicted to wait for a GPU adapter slot took ``ttft_ms``: what it took beyond its regime's
        line is one sample of that wait (clipped like a line's outliers: one stream stuck behind a long one cannot
        make every slot look that slow). Its regime's line does not learn from it: the line is the regime's cost
        without the wait, and the gpu_slot term adds the wait."""
        if not self._rate:
            return
        expected = self.lines[regime].at(load) + self.gpu_slot_ms
        ttft_ms = min(ttft_ms, _OUTLIER_RATIO * expected + _OUTLIER_SLACK_MS)
        excess = max(0.0, ttft_ms - self.lines[regime].at(load))
        self.gpu_slot_ms += self._rate * (excess - self.gpu_slot_ms)

    def observe(self, regime: Regime, load: float, ttft_ms: float) -> None:
        fit = self._fits[regime]
        fit.observe(load, ttft_ms)
        if fit.line is not self.lines[regime]:
            self.lines[regime] = fit.line
            self.version += 1


def regime_of(on_gpu: bool, resident: bool, key_recent: bool) -> Regime:
    """The regime of a request on a replica, from what the gateway knows there (see the module docstring)."""
    if on_gpu:
        return "warm" if key_recent else "kv_cold"
    return "host" if resident else "cold"


# A replica's adapter loads under way at one gateway, or at the others together: how many are queued for the
# replica's lock (not yet at the engine), and when (time.monotonic) the one the engine runs now began, or None.
Loading = tuple[int, float | None]


def loads_ahead_ms(here: Loading | None, there: Loading | None, now: float, load_ms: float) -> float:
    """What a cold load on a replica would wait for, in milliseconds, before its own load begins: what is left of
    the load running there (``load_ms``, the expected time of one load, less what it has run; none left once it has
    run that long) and ``load_ms`` per load queued there. ``here``: this gateway's loads on the replica; ``there``:
    the other gateways' as they last shared them (either None: none). Loads run one at a time on a replica (its
    lock), so the earlier of the two running loads is the one the engine runs now."""
    queued, running = here if here is not None else (0, None)
    if there is not None:
        queued += there[0]
        if there[1] is not None and (running is None or there[1] < running):
            running = there[1]
    ms = queued * load_ms
    if running is not None:
        left = load_ms - 1000.0 * (now - running)
        if left > 0:
            ms += left
    return ms


def gpu_slot_waits(
    adapter: str,
    here: Mapping[str, int],
    there: Mapping[str, int],
    running: frozenset[str],
    slots: int | None,
) -> bool:
    """Whether a request for ``adapter`` on a replica would wait for one of its GPU adapter slots: other adapters in
    use there fill every slot, and the adapter does not hold one. vLLM gives a request a GPU slot only if its
    adapter holds one or one can be freed from an adapter no running request uses; otherwise the request waits in
    the engine's queue while later requests overtake it (the simulator does the same: its ``lora_slot`` wait). In
    use there: the adapters this gateway has requests in flight for (``here``), those the other gateways have as
    they last shared them (``there``), and those the engine's last scrape listed running (``running``: vLLM's
    ``vllm:lora_requests_info``; empty when no scrape is fresh enough). ``slots``: the engine's GPU adapter slots
    (``max_lora``), None where it does not say (then no wait is predicted).

    An adapter the scrape lists running holds a slot. One only in flight holds one too, unless the scrape lists
    others running and not it while those others fill every slot: its requests there are queued for a slot
    themselves, and this one joins them (on the churn trace, about half the requests that waited for a slot had
    their adapter already in flight there)."""
    if slots is None or adapter in running:
        return False
    others = 0
    for name in here:
        if name != adapter:
            others += 1
    for name in there:
        if name != adapter and name not in here:
            others += 1
    for name in running:
        if name not in here and name not in there:
            others += 1
    if others < slots:
        return False
    if adapter in here or adapter in there:
        return len(running) >= slots  # the engine lists other adapters running in every slot, not this one
    return True

"""A bounded soak: steady multi-tenant traffic through the gateway for a while, with faults (a replica killed and
brought back, a replica hanging, a replica answering 503, streams cut mid-way), then what happened: requests,
outcomes by kind, lost (must be 0), 5xx answers, and the gateway's memory at the start and the end.

The faults follow a fixed plan (``plan``): each fires once early in the run, one after another, then they take turns
every ``--fault-every-s``. So a short run (the test's) sees every fault, and a long one sees each many times.

Every outcome other than ok must be one that a fault in progress explains (``unexplained``): an error event (a
started stream cut by a kill, a stream-cut fault or a hang's deadline) or a 504 (a hang's deadline), within the
fault's window (its start to its end plus the request timeout). Anything else fails the soak: a lost request, any
other 5xx, any error outside a fault.

    python -m loadtests.soak [--minutes 10] [--fault-every-s 15]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtests.faultkit import GatewayUnderTest, Outcomes, SimReplica, SteadyTraffic, sim_replicas
from loadtests.fleet import gateway_config, write_adapters
from loadtests.processes import free_port

SIM_ARGS = ["--time-scale", "0.1", "--max-loras", "4", "--max-cpu-loras", "8"]
TENANTS = {f"soak-{i:02d}": [f"lora-{i:02d}"] for i in range(8)}
REQUEST_TIMEOUT_S = 3.0
FIRST_FAULT_AT_S = 2.0  # traffic has warmed every tenant's adapter by then
# Between one fault's end and the next's start in the first round: what a fault caught ends before the next begins,
# so each outcome is judged against one fault.
GAP_S = REQUEST_TIMEOUT_S


@dataclass(frozen=True)
class Fault:
    name: str
    start: Callable[[], None]
    end: Callable[[], None]
    allowed: frozenset[str]  # the outcomes other than ok that it explains


@dataclass(frozen=True)
class Window:
    name: str
    started: float  # time.monotonic()
    ended: float
    allowed: frozenset[str]


def faults(replicas: dict[str, SimReplica]) -> list[Fault]:
    """The faults, in the order they first fire; replicas take turns as victims."""
    victims = itertools.cycle(sorted(replicas))
    current: list[SimReplica] = []

    def pick() -> SimReplica:
        current[:] = [replicas[next(victims)]]
        return current[0]

    def switch(**settings: object) -> Callable[[], None]:
        return lambda: pick().faults(**settings)

    def clear() -> None:
        current[0].faults(hang=False, error_status=None, cut_stream_after=None, delay_s=0)

    def restart() -> None:
        current[0].start()

    stream_cut = frozenset({"error_event"})
    return [
        # Requests not started yet are retried on the next replica; a stream that had started ends with an event.
        Fault("replica killed", lambda: pick().kill(), restart, stream_cut),
        # The deadline ends what was caught in the hang: a 504, or an error event once a stream had started.
        Fault("replica hangs", switch(hang=True), clear, frozenset({"error_event", "http_504"})),
        # Every 503 is retried on another replica (or the replica ejected): the client sees none.
        Fault("replica answers 503", switch(error_status=503), clear, frozenset()),
        Fault("streams cut after 3 chunks", switch(cut_stream_after=3), clear, stream_cut),
    ]


def plan(fault_count: int, run_s: float, every_s: float, hold_s: float) -> list[float]:
    """When each fault starts, in seconds from the run's start: the first round back to back from
    ``FIRST_FAULT_AT_S`` (``GAP_S`` apart), then one every ``every_s`` after the last one's end, as long as it ends,
    and its requests have timed out, before the run does. Raises if the run cannot hold the first round."""
    starts = [FIRST_FAULT_AT_S + i * (hold_s + GAP_S) for i in range(fault_count)]
    last = starts[-1] + hold_s + REQUEST_TIMEOUT_S
    if last > run_s:
        raise ValueError(f"a {run_s:.0f} s run cannot fire each fault once: it needs at least {last:.0f} s")
    while starts[-1] + hold_s + every_s + hold_s + REQUEST_TIMEOUT_S <= run_s:
        starts.append(starts[-1] + hold_s + every_s)
    return starts


def unexplained(timeline: Sequence[tuple[float, str, str]], windows: Sequence[Window]) -> Counter[str]:
    """The outcomes other than ok that no fault explains: not one it allows, or outside its window (start to end
    plus the request timeout, the longest a request caught in it can take)."""
    left: Counter[str] = Counter()
    for at, _, outcome in timeline:
        if outcome == "ok":
            continue
        if not any(w.started <= at <= w.ended + REQUEST_TIMEOUT_S and outcome in w.allowed for w in windows):
            left[outcome] += 1
    return left


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class SoakResult:
    outcomes: Outcomes
    windows: list[Window]
    rss_mib: tuple[float, float]  # the gateway's, at the start and at the end

    def during(self, window: Window) -> Counter[str]:
        """The outcomes known within the window (its start to its end plus the request timeout)."""
        return Counter(
            o for at, _, o in self.outcomes.timeline if window.started <= at <= window.ended + REQUEST_TIMEOUT_S
        )

    @property
    def unexplained(self) -> Counter[str]:
        return unexplained(self.outcomes.timeline, self.windows)


def run(minutes: float, fault_every_s: float, root: Path, hold_s: float | None = None) -> SoakResult:
    hold = hold_s if hold_s is not None else min(5.0, fault_every_s / 2)
    run_s = 60 * minutes
    adapters = write_adapters(root, [names[0] for names in TENANTS.values()])
    with sim_replicas(root, 3, *SIM_ARGS) as replicas:
        config = gateway_config({n: r.url for n, r in replicas.items()}, TENANTS, adapters, port=free_port())
        config["pools"][0].update(
            {
                "request_timeout_s": REQUEST_TIMEOUT_S,
                "slow_start_s": 2,
                "outlier": {"consecutive_failures": 3, "base_ejection_s": 2},
            }
        )
        config["telemetry"] = {"access_log": False}
        kinds = faults(replicas)
        starts = plan(len(kinds), run_s, fault_every_s, hold)
        gateway = GatewayUnderTest(root, config).start()
        assert gateway.process is not None
        pid = gateway.process.pid
        windows: list[Window] = []
        try:
            models = {tenant: names[0] for tenant, names in TENANTS.items()}
            rss_start = rss_mib(pid)
            with SteadyTraffic(gateway.url, models, deadline_s=REQUEST_TIMEOUT_S) as traffic:
                began = time.monotonic()
                for at, fault in zip(starts, itertools.cycle(kinds), strict=False):
                    time.sleep(max(0.0, began + at - time.monotonic()))  # later if the last one ran long
                    print(f"  {time.strftime('%H:%M:%S')} fault: {fault.name}", flush=True)
                    started = time.monotonic()
                    fault.start()
                    time.sleep(hold)
                    fault.end()
                    windows.append(Window(fault.name, started, time.monotonic(), fault.allowed))
                time.sleep(max(0.0, began + run_s - time.monotonic()))
            rss_end = rss_mib(pid)
        finally:
            gateway.stop()
    return SoakResult(traffic.outcomes, windows, (rss_start, rss_end))


def report(result: SoakResult) -> int:
    """Print what happened; 1 if anything no fault explains happened (a lost request, a 5xx other than a hang's
    504, an error outside a fault's window), else 0."""
    outcomes = result.outcomes
    fives = sum(count for outcome, count in outcomes.counts.items() if outcome.startswith("http_5"))
    print(f"requests: {outcomes.total}")
    for outcome, count in sorted(outcomes.counts.items()):
        print(f"  {outcome:14} {count}")
    for window in result.windows:
        print(f"  during '{window.name}': {dict(sorted(result.during(window).items()))}")
    print(f"lost: {outcomes.counts['lost']} (must be 0)")
    for detail in outcomes.lost_details[:10]:
        print(f"  lost: {detail}")
    print(f"5xx: {fives}")
    left = result.unexplained
    print(f"errors no fault explains: {sum(left.values())} (must be 0) {dict(sorted(left.items()))}")
    print(f"gateway memory (RSS): {result.rss_mib[0]:.1f} MiB at start, {result.rss_mib[1]:.1f} MiB at the end")
    return 1 if left else 0


def soak(minutes: float, fault_every_s: float, root: Path, hold_s: float | None = None) -> int:
    return report(run(minutes, fault_every_s, root, hold_s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--fault-every-s", type=float, default=15.0, help="seconds between faults (default 15)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return soak(args.minutes, args.fault_every_s, Path(tmp))


if __name__ == "__main__":
    raise SystemExit(main())

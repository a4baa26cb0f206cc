"""A bounded soak: steady multi-tenant traffic through the gateway for a while, with a fault every few seconds
(a replica killed and brought back, a replica hanging, a replica answering 503, streams cut mid-way), then what
happened: requests, outcomes by kind, lost (must be 0) and the gateway's memory at the start and the end.

    python -m loadtests.soak [--minutes 10] [--fault-every-s 15]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from loadtests.faultkit import GatewayUnderTest, SimReplica, SteadyTraffic, sim_replicas
from loadtests.fleet import gateway_config, write_adapters
from loadtests.processes import free_port

SIM_ARGS = ["--time-scale", "0.1", "--max-loras", "4", "--max-cpu-loras", "8"]
TENANTS = {f"soak-{i:02d}": [f"lora-{i:02d}"] for i in range(8)}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def faults(replicas: dict[str, SimReplica], hold_s: float) -> list[tuple[str, Callable[[], None]]]:
    """Each fault starts, holds for ``hold_s`` and ends; replicas take turns."""
    victims = itertools.cycle(sorted(replicas))

    def kill() -> None:
        replica = replicas[next(victims)]
        replica.kill()
        time.sleep(hold_s)
        replica.start()

    def switched(**settings: object) -> Callable[[], None]:
        def fault() -> None:
            replica = replicas[next(victims)]
            replica.faults(**settings)
            time.sleep(hold_s)
            replica.faults(hang=False, error_status=None, cut_stream_after=None, delay_s=0)

        return fault

    return [
        ("replica killed", kill),
        ("replica hangs", switched(hang=True)),
        ("replica answers 503", switched(error_status=503)),
        ("streams cut after 3 chunks", switched(cut_stream_after=3)),
    ]


def soak(minutes: float, fault_every_s: float, root: Path) -> int:
    adapters = write_adapters(root, [names[0] for names in TENANTS.values()])
    with sim_replicas(root, 3, *SIM_ARGS) as replicas:
        config = gateway_config({n: r.url for n, r in replicas.items()}, TENANTS, adapters, port=free_port())
        config["pools"][0].update(
            {"request_timeout_s": 3.0, "slow_start_s": 2, "outlier": {"consecutive_failures": 3, "base_ejection_s": 2}}
        )
        config["telemetry"] = {"access_log": False}
        gateway = GatewayUnderTest(root, config).start()
        assert gateway.process is not None
        pid = gateway.process.pid
        try:
            models = {tenant: names[0] for tenant, names in TENANTS.items()}
            rss_start = rss_mib(pid)
            ended = time.monotonic() + 60 * minutes
            schedule = itertools.cycle(faults(replicas, hold_s=min(5.0, fault_every_s / 2)))
            with SteadyTraffic(gateway.url, models, deadline_s=3.0) as traffic:
                while time.monotonic() < ended:
                    time.sleep(min(fault_every_s, max(0.0, ended - time.monotonic())))
                    if time.monotonic() >= ended:
                        break
                    name, fault = next(schedule)
                    print(f"  {time.strftime('%H:%M:%S')} fault: {name}", flush=True)
                    fault()
            rss_end = rss_mib(pid)
        finally:
            gateway.stop()
    outcomes = traffic.outcomes
    print(f"requests: {outcomes.total}")
    for outcome, count in sorted(outcomes.counts.items()):
        print(f"  {outcome:14} {count}")
    print(f"lost: {outcomes.counts['lost']} (must be 0)")
    for detail in outcomes.lost_details[:10]:
        print(f"  lost: {detail}")
    print(f"gateway memory (RSS): {rss_start:.1f} MiB at start, {rss_end:.1f} MiB at the end")
    return 1 if outcomes.counts["lost"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--fault-every-s", type=float, default=15.0, help="seconds between faults (default 15)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        return soak(args.minutes, args.fault_every_s, Path(tmp))


if __name__ == "__main__":
    raise SystemExit(main())

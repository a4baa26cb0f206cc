"""``make loadtest``: a simulated fleet and the gateway, then locust headless against it for a bounded time,
writing locust's CSV and HTML reports (a row per tenant and adapter).

    python -m loadtests.loadtest [--seconds 60] [--users 16] [--shape steady|burst] [--out loadtest-report]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtests.fleet import fleet_with_gateway

SIM_ARGS = ["--time-scale", "0.1", "--max-loras", "2", "--max-cpu-loras", "4"]
LOCUSTFILE = Path(__file__).with_name("locustfile.py")
REPO = Path(__file__).resolve().parent.parent


def run(seconds: float, users: int, shape: str, tenants: int, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    tenant_adapters = {f"t{i:02d}": [f"lora-t{i:02d}"] for i in range(tenants)}
    with tempfile.TemporaryDirectory() as tmp, fleet_with_gateway(
        Path(tmp), tenant_adapters, 4, SIM_ARGS, max_adapters=4, extra={"telemetry": {"access_log": False}}
    ) as fleet:  # fmt: skip
        env = {
            **os.environ,
            "TENANTGATE_TENANTS": str(tenants),
            "LOADTEST_SHAPE": shape,
            "LOADTEST_SECONDS": str(seconds),
            # The locustfile imports loadtests.collector: the repository on the path whatever the caller's directory.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        cmd = [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", fleet.gateway_url,
            "-u", str(users), "-r", str(max(1, users // 2)), "-t", f"{int(seconds)}s", "--stop-timeout", "10",
            "--csv", str(out / "loadtest"), "--html", str(out / "loadtest.html"), "--only-summary",
        ]  # fmt: skip
        return subprocess.run(cmd, env=env, timeout=seconds + 120).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60, help="how long locust runs (default 60)")
    parser.add_argument("--users", type=int, default=16, help="concurrent users (default 16)")
    parser.add_argument("--shape", choices=["steady", "burst"], default="steady")
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("loadtest-report"), help="where the reports go")
    args = parser.parse_args(argv)
    return run(args.seconds, args.users, args.shape, args.tenants, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

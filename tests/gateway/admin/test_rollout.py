"""Rolling out an adapter version under steady load: the share follows the steps, users stay on one version per
step, nothing fails, the old version is unloaded once idle; a version that fails halts and rolls back itself."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.admin.rollout import Rollout, RolloutRequest, judge
from gateway.observe.activity import Activity
from loadtests.fleet import ADMIN_TOKEN, RunningFleet, api_key, fleet_with_gateway, sim_stats

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
USERS = [f"user-{i}" for i in range(200)]
Z_999 = 3.29  # two-sided 99.9% of a normal: a fair split misses the bound once in a thousand user sets
SIM = ["--time-scale", "0.01", "--max-loras", "4"]
# The first step to 30% of users, then everyone; TTFT here is milliseconds of scheduling noise: judged by errors only.
TO_VERSION_2 = {"version": 2, "steps": [0.3, 1.0], "step_s": 3, "max_ttft_p99_ratio": 1000}


def binomial_bound(share: float, users: int) -> float:
    """How far the share of ``users`` end users on a version may lie from ``share`` if each user's version is a
    fair draw (the split hashes tenant, split and user): Z_999 standard deviations of Binomial(users, share) / users.
    The hash is deterministic, so for these user names the test always passes or always fails."""
    return Z_999 * math.sqrt(share * (1 - share) / users)


class Traffic:
    """Requests one after another for the name, cycling through end users; records (time, user, variant, status)."""

    def __init__(self, gateway_url: str) -> None:
        self.url = gateway_url
        self.seen: list[tuple[float, str, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {api_key('acme')}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=30) as client:
            turn = 0
            while not self._stop.is_set():
                user = USERS[turn % len(USERS)]
                answer = client.post(
                    "/v1/completions", json={"model": "support", "prompt": "hi", "max_tokens": 2, "user": user}
                )
                self.seen.append(
                    (time.time(), user, answer.headers.get("x-tenantgate-variant", ""), answer.status_code)
                )
                turn += 1

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def until_seen(self, count: int) -> None:
        while len(self.seen) < count:
            time.sleep(0.02)


@contextlib.contextmanager
def support_split(tmp_path: Path, versions: int, replicas: int, sim_args: list[str]) -> Iterator[RunningFleet]:
    """acme calls the split ``support``, all on support@1, with support@1 to support@<versions> in the catalog."""
    tenants = {"acme": [f"support@{version}" for version in range(1, versions + 1)]}
    split = {"splits": [{"name": "support", "variants": [{"model": "support@1", "weight": 1}]}]}
    with fleet_with_gateway(tmp_path, tenants, replicas, sim_args, extra=split,
                            tenant_options={"acme": {"adapters": ["support"]}}) as fleet:  # fmt: skip
        yield fleet


def start_rollout(gateway_url: str, body: dict[str, Any]) -> None:
    started = httpx.post(gateway_url + "/admin/adapters/support/rollout", headers=ADMIN, json=body)
    assert started.status_code == 202, started.text


def wait_for(gateway_url: str, status: set[str]) -> dict[str, Any]:
    for _ in range(600):  # bounded
        rollout: dict[str, Any] = httpx.get(gateway_url + "/admin/adapters/support/rollout", headers=ADMIN).json()
        if rollout["status"] in status:
            return rollout
        time.sleep(0.05)
    raise AssertionError(f"the rollout never reached {status}: {rollout}")


def test_a_rollout_under_load_then_a_bad_version_rolls_back(tmp_path: Path) -> None:
    with support_split(tmp_path, 3, 2, SIM) as fleet:
        with Traffic(fleet.gateway_url) as traffic:
            traffic.until_seen(40)
            start_rollout(fleet.gateway_url, TO_VERSION_2)
            done = wait_for(fleet.gateway_url, {"done", "rolled_back", "failed"})
            assert done["status"] == "done", done
            # The old version leaves once no request uses it (the rollout waits up to a minute for its last ones, and
            # records "unloaded" when it is gone): wait for that record, not for a fixed time, which a loaded
            # machine outlasted (10 s: the CI of stop 36).
            for _ in range(1400):  # bounded: 70 s, past the rollout's own minute
                history = httpx.get(fleet.gateway_url + "/admin/adapters/support/rollout", headers=ADMIN).json()
                if any("unloaded" in entry for entry in history["history"]):
                    break
                time.sleep(0.05)
            registered = {name for url in fleet.replica_urls.values() for name in sim_stats(url)["registered"]}
            # A bad version: it fails, the rollout halts at its first step and returns to support@2 by itself.
            for url in fleet.replica_urls.values():
                httpx.post(url + "/sim/control", json={"faults": {"failing_adapters": ["support@3"]}})
            start_rollout(fleet.gateway_url, {"version": "support@3", "steps": [0.5, 1.0], "step_s": 2})
            halted = wait_for(fleet.gateway_url, {"done", "rolled_back", "failed"})
            after_halt = len(traffic.seen)
            traffic.until_seen(after_halt + 40)
        seen = list(traffic.seen)

    steps = [h for h in done["history"] if "share" in h]
    step = steps[0]["started"], steps[1]["started"]
    in_step = [s for s in seen if step[0] + 0.2 <= s[0] < step[1]]
    per_user: dict[str, set[str]] = defaultdict(set)
    for _, user, variant, _ in in_step:
        per_user[user].add(variant)
    # The traffic reaches enough users within the 3 s step for the share to mean something (the bound below widens
    # with fewer): a quarter of them; half failed once at load 15 (70 of 200 reached).
    assert len(per_user) >= len(USERS) // 4
    assert all(len(variants) == 1 for variants in per_user.values())  # one version per user within the step
    share = sum(variants == {"support@2"} for variants in per_user.values()) / len(per_user)
    assert abs(share - 0.3) <= binomial_bound(0.3, len(per_user)), (share, len(per_user))
    first_rollout = [s for s in seen if s[0] < steps[-1]["started"] + 1]
    assert {status for *_, status in first_rollout} == {200}  # nothing failed during the good rollout
    assert "support@1" not in registered and "support@2" in registered
    assert halted["status"] == "rolled_back" and "failed" in halted["reason"]  # caught at warm-up, before users
    assert {v for _, _, v, _ in seen[after_halt:]} == {"support@2"}  # back on the good version for everyone


def test_a_version_that_warms_fine_and_fails_under_traffic_halts_and_rolls_back(tmp_path: Path) -> None:
    """support@2 passes its warm-up, then fails every request once users reach it (the engines' fault switched on
    as the rollout starts its first step). The step's judgement halts the rollout at 30% and returns everyone to
    support@1; within the step only support@2's users failed, and they were a fair 30% of the users."""
    with support_split(tmp_path, 2, 2, SIM) as fleet:
        with Traffic(fleet.gateway_url) as traffic:
            traffic.until_seen(40)
            start_rollout(fleet.gateway_url, TO_VERSION_2)
            running = wait_for(fleet.gateway_url, {"running", "done", "rolled_back", "failed"})
            assert running["status"] == "running", running  # past its warm-up: it warmed fine
            for url in fleet.replica_urls.values():
                httpx.post(url + "/sim/control", json={"faults": {"failing_adapters": ["support@2"]}})
            failing_since = time.time()
            halted = wait_for(fleet.gateway_url, {"done", "rolled_back", "failed"})
            halt_seen = time.time()
            traffic.until_seen(len([s for s in traffic.seen if s[0] < halt_seen]) + len(USERS))
        seen = list(traffic.seen)

    assert halted["status"] == "rolled_back" and halted["reason"].startswith("halted at 30%: error rate"), halted
    assert [h["share"] for h in halted["history"]] == [0.3]  # it never went past its first step
    step_started = halted["history"][0]["started"]
    judged = step_started + 3  # the step's judgement, then the rollback: not before its pause ended
    in_step = [s for s in seen if step_started + 0.2 <= s[0] < judged]
    per_user: dict[str, set[str]] = defaultdict(set)
    for _, user, variant, _ in in_step:
        per_user[user].add(variant)
    assert len(per_user) >= len(USERS) // 4  # as in the test above: 94 of 200 reached once at load 17
    assert all(len(variants) == 1 for variants in per_user.values())
    share = sum(variants == {"support@2"} for variants in per_user.values()) / len(per_user)
    assert abs(share - 0.3) <= binomial_bound(0.3, len(per_user)), (share, len(per_user))
    assert all(variant for _, _, variant, _ in in_step)  # a failure names its version too
    failing = [s for s in in_step if s[0] > failing_since + 0.2]
    assert {status for _, _, v, status in failing if v == "support@2"} <= set(range(500, 600))  # its users failed
    assert {status for _, _, v, status in failing if v == "support@1"} == {200}  # the others did not
    after = [s for s in seen if s[0] > halt_seen]
    assert len({user for _, user, _, _ in after}) == len(USERS)
    assert {(v, status) for _, _, v, status in after} == {("support@1", 200)}  # everyone back, nothing failing


def test_a_step_is_judged_by_error_rate_and_ttft_against_the_old_version() -> None:
    from gateway.admin.rollout import Rollout, judge
    from gateway.observe.activity import Activity

    activity, now = Activity(), time.time()
    rollout = Rollout("support", "support@1", "support@2", [0.5, 1.0], 1, 0.05, 1.5)
    for i in range(20):
        activity.request("acme", "support@1", "r0", [], 200, 0.010)
        activity.request("acme", "support@2", "r0", [], 502 if i % 4 == 0 else 200, 0.010)
    assert "error rate 25%" in (judge(activity, rollout, now - 1) or "")
    slow = Activity()
    for _ in range(20):
        slow.request("acme", "support@1", "r0", [], 200, 0.010)
        slow.request("acme", "support@2", "r0", [], 200, 0.050)
    assert "TTFT p99" in (judge(slow, rollout, now - 1) or "")
    fine = Activity()
    for _ in range(20):
        fine.request("acme", "support@1", "r0", [], 200, 0.010)
        fine.request("acme", "support@2", "r0", [], 200, 0.011)
    assert judge(fine, rollout, now - 1) is None


def test_a_rollback_returns_everyone_to_the_old_version_at_once(tmp_path: Path) -> None:
    with support_split(tmp_path, 2, 1, ["--time-scale", "0.01"]) as fleet:
        start_rollout(fleet.gateway_url, {"version": 2, "steps": [0.5, 1.0], "step_s": 60})
        wait_for(fleet.gateway_url, {"running"})
        back = httpx.post(fleet.gateway_url + "/admin/adapters/support/rollback", headers=ADMIN)
        assert back.status_code == 200 and back.json()["status"] == "rolled_back"
        headers = {"Authorization": f"Bearer {api_key('acme')}"}
        url = fleet.gateway_url + "/v1/completions"
        bodies = [{"model": "support", "prompt": "x", "max_tokens": 2, "user": user} for user in USERS]
        variants = {httpx.post(url, headers=headers, json=body).headers["x-tenantgate-variant"] for body in bodies}
    assert variants == {"support@1"}


@pytest.mark.parametrize(
    ("new_ttft_ms", "new_errors", "verdict"),
    [
        (149.0, 0, None),  # within 1.5x the old version's p99
        (151.0, 0, "TTFT p99"),  # over it
        (100.0, 1, None),  # 5% more errors: at the bound, not over it
        (100.0, 2, "error rate"),  # 10% more
    ],
)
def test_a_step_is_judged_by_the_documented_error_rate_and_ttft_bounds(
    new_ttft_ms: float, new_errors: int, verdict: str | None
) -> None:
    """README and docs/operations.md: after each step the new version halts the rollout when its error rate is
    higher by more than max_error_rate_increase (0.05) or its TTFT p99 above max_ttft_p99_ratio (1.5) x the old's.
    The end-to-end tests judge by errors only (their TTFT is scheduling noise); this is the TTFT rule too."""
    defaults = RolloutRequest.model_validate({"version": 2})
    assert (defaults.max_error_rate_increase, defaults.max_ttft_p99_ratio) == (0.05, 1.5)
    now = [1000.0]
    activity = Activity(clock=lambda: now[0])
    for n in range(20):
        activity.request("acme", "support@1", "r0", ["home"], 200, 0.1)
        failed = n < new_errors
        activity.request("acme", "support@2", "r0", ["home"], 502 if failed else 200, new_ttft_ms / 1000)
    rollout = Rollout(
        "support", "support@1", "support@2", [0.5, 1.0], 30.0,
        defaults.max_error_rate_increase, defaults.max_ttft_p99_ratio,
    )  # fmt: skip
    reason = judge(activity, rollout, since=now[0])
    assert reason is None if verdict is None else reason is not None and reason.startswith(verdict), reason

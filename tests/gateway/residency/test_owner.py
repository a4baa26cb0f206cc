"""A process's lock identity (gateway/residency/owner.py): kept across restarts through a file it holds with flock,
never given to two live processes at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.residency import owner


@pytest.fixture(autouse=True)
def _forget_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test claims as a fresh process would (the module keeps its claims for the process's life)."""
    monkeypatch.setattr(owner, "_held", {})
    monkeypatch.setattr(owner, "_current", owner.ProcessOwner("0" * 12, "0" * 8))


def _claim_in_child(directory: Path, hold: bool = False) -> subprocess.Popen[str]:
    """A process that claims an identity in ``directory``, prints its stable id, and holds it until stdin closes."""
    code = (
        "import sys; from pathlib import Path; from gateway.residency import owner; "
        f"print(owner.claim(Path({str(directory)!r})).stable, flush=True); " + ("sys.stdin.read()" if hold else "")
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip


def test_a_process_restarted_on_the_directory_gets_its_predecessors_id_a_live_twin_does_not(tmp_path: Path) -> None:
    first = _claim_in_child(tmp_path)
    assert first.stdout is not None
    died = first.stdout.readline().strip()
    first.communicate(timeout=30)  # it exited: the kernel let its flock go
    living = _claim_in_child(tmp_path, hold=True)
    twin = _claim_in_child(tmp_path, hold=True)
    try:
        assert living.stdout is not None and twin.stdout is not None
        ids = {living.stdout.readline().strip(), twin.stdout.readline().strip()}
        assert died in ids and len(ids) == 2  # one heir; the twin alive beside it has an id of its own
    finally:
        for process in (living, twin):
            process.communicate("", timeout=30)


def test_two_claims_in_one_directory_hold_different_ids_and_each_run_is_a_new_incarnation(tmp_path: Path) -> None:
    mine = owner.claim(tmp_path)
    assert owner.claim(tmp_path) == mine and owner.current() == mine  # again: the same
    assert mine.claimed and mine.live.startswith(mine.any_run) and mine.any_run == f"{mine.stable}:"
    other_dir = tmp_path / "other"
    other = owner.claim(other_dir)
    assert other.stable != mine.stable and other.incarnation != mine.incarnation
    claimed = tmp_path / "owner-0"
    assert claimed.read_text() == mine.stable and claimed.stat().st_mode & 0o777 == 0o600

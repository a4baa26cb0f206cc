"""The simulator's own test routes, the same in every protocol mode (not part of any engine's API):
``GET /sim/stats`` (what the engine did and what it holds) and ``POST /sim/control`` (``{"paused": true}`` holds
the step loop before its next step; ``{"run_steps": n}`` runs n more steps and then holds it; ``{"faults": {...}}``
switches faults on or off, loadtests/sim/faults.py)."""

from __future__ import annotations

from typing import Any

from loadtests.sim.engine import SimEngine
from loadtests.sim.faults import Faults


class ControlError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def engine_stats(engine: SimEngine) -> dict[str, Any]:
    return {
        **engine.stats.as_json(),
        "registered": sorted(engine.adapters.registered),
        "gpu_resident": engine.adapters.gpu_resident,
        "host_resident": engine.adapters.host_resident,
        "running": engine.num_running,
        "waiting": engine.num_waiting,
        "kv_usage": engine.kv.usage,
    }


def apply_control(engine: SimEngine, faults: Faults, body: dict[str, Any]) -> dict[str, Any]:
    """Apply a /sim/control body; raises ControlError (naming the bad field) and then changes nothing more."""
    if "paused" in body:
        if not isinstance(body["paused"], bool):
            raise ControlError("paused must be true or false", "paused")
        engine.pause(body["paused"])
    if "run_steps" in body:
        steps = body["run_steps"]
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ControlError("run_steps must be a number of steps >= 0", "run_steps")
        engine.run_steps(steps)
    if "faults" in body:
        if not isinstance(body["faults"], dict):
            raise ControlError("faults must be an object", "faults")
        try:
            faults.update(body["faults"])
        except ValueError as exc:
            raise ControlError(str(exc), "faults") from exc
    return {"paused": engine.paused, "faults": faults.as_json()}

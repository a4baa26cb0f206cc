"""The admin documents of serve --workers' workers merged into one (gateway/admin/siblings.py asks for them).

What adds up is added: requests in flight (per replica and per adapter), counters, ejections, each adapter's
requests and cold loads per minute (its TTFT percentiles are read again from every worker's samples). What each
worker decides for itself is combined so the answer is never rosier than a worker's: a replica is healthy (up)
only if every worker routes to it, ejected or drained if any worker has it so, an adapter pinned if any worker pins
it, idle for the shortest time any worker saw. What is the same everywhere (the ring, homes, the engines' scrape,
which is one per host) and what a decision shows (``tenants``: where each tenant goes now) is the answering
worker's. ``workers`` lists every worker that answered, with its requests in flight and whether it scrapes the
engines for the host; ``by_worker`` on each replica keeps each worker's own requests in flight, load view and
health; ``missing_workers`` names those that did not answer.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gateway.observe.activity import summarize

_RECENT_DECISIONS = 50  # as many as one worker keeps (gateway/observe/activity.py)


def _workers(documents: list[dict[str, Any]], missing: list[int]) -> dict[str, Any]:
    workers = sorted((d["worker"] for d in documents), key=lambda w: int(w["worker"]))
    return {"answered_by": documents[0]["worker"]["worker"], "workers": workers, "missing_workers": missing}


def _adapters(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """One replica's resident adapters over every worker's view of them."""
    merged: dict[str, dict[str, Any]] = {}
    for replica in replicas:
        for name, adapter in replica["adapters"].items():
            seen = merged.setdefault(name, {**adapter, "in_flight": 0})
            seen["in_flight"] += adapter["in_flight"]
            seen["pinned"] = seen["pinned"] or adapter["pinned"]
            seen["idle_s"] = min(seen["idle_s"], adapter["idle_s"])
    return dict(sorted(merged.items()))


def _health(replica: dict[str, Any], views: list[dict[str, Any]]) -> None:
    """A replica's health over every worker's view: never rosier than one worker's."""
    replica["healthy"] = all(view["healthy"] for view in views)
    replica["up"] = all(view["up"] for view in views)
    replica["ejected"] = any(view["ejected"] for view in views)
    if "drained" in replica:
        replica["drained"] = any(view["drained"] for view in views)
    replica["loading"] = sorted({adapter for view in views for adapter in view["loading"]})
    replica["adapters"] = _adapters(views)


def merge_state(own: dict[str, Any], others: list[dict[str, Any]], missing: list[int]) -> dict[str, Any]:
    """``/admin/state`` over every worker; ``own`` is the answering worker's (its adapters as TTFT samples)."""
    documents = [own, *others]
    merged = {key: value for key, value in own.items() if key != "worker"}
    merged["store"] = "up" if all(d["store"] == "up" for d in documents) else "down"
    for name, pool in merged["pools"].items():
        for replica in pool["replicas"]:
            views = {
                str(d["worker"]["worker"]): r
                for d in documents if name in d["pools"]
                for r in d["pools"][name]["replicas"] if r["id"] == replica["id"]
            }  # fmt: skip
            replica["by_worker"] = {
                worker: {key: r[key] for key in ("in_flight", "load_view", "healthy", "ejected")}
                for worker, r in views.items()
            }
            _health(replica, list(views.values()))
            replica["in_flight"] = sum(view["in_flight"] for view in views.values())
    minutes: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for document in documents:
        for adapter, entries in document["adapters"].items():
            for entry in entries:
                seen = minutes[adapter].setdefault(
                    entry["minute"], {"minute": entry["minute"], "requests": 0, "cold_loads": 0, "ttft_ms": []}
                )
                seen["requests"] += entry["requests"]
                seen["cold_loads"] += entry["cold_loads"]
                seen["ttft_ms"] += entry["ttft_ms"]
    merged["adapters"] = summarize(
        {adapter: [by_minute[m] for m in sorted(by_minute)] for adapter, by_minute in sorted(minutes.items())}
    )
    decisions = sorted((d for document in documents for d in document["decisions"]), key=lambda d: -d["at"])
    merged["decisions"] = decisions[:_RECENT_DECISIONS]
    return {**merged, **_workers(documents, missing)}


def merge_residency(own: dict[str, Any], others: list[dict[str, Any]], missing: list[int]) -> dict[str, Any]:
    """``/admin/residency`` over every worker; ``own`` is the answering worker's."""
    documents = [own, *others]
    merged = {key: value for key, value in own.items() if key != "worker"}
    merged["store"] = "up" if all(d["store"] == "up" for d in documents) else "down"
    for name, pool in merged["pools"].items():
        pools = [d["pools"][name] for d in documents if name in d["pools"]]
        pool["counters"] = {key: sum(p["counters"].get(key, 0) for p in pools) for key in pool["counters"]}
        for replica_id, replica in pool["replicas"].items():
            views = [p["replicas"][replica_id] for p in pools if replica_id in p["replicas"]]
            _health(replica, views)
            replica["ejections"] = sum(view["ejections"] for view in views)
            replica["ejected_for_s"] = max(view["ejected_for_s"] for view in views)
            replica["last_ejection_s"] = max(view.get("last_ejection_s", 0.0) for view in views)
            replica["weight"] = min(view["weight"] for view in views)
    return {**merged, **_workers(documents, missing)}

"""How few cold loads a router could pay on a bench_routing trace: offline bounds, no engines.

The fleet's host adapter slots (replicas x slots) are what every router shares. Whatever the routing, a set of
per-replica caches is a restricted case of one cache of all the slots, so the fewest cold loads one cache of that
size could pay, holding at first the adapters needed soonest and evicting with full knowledge of the future
(Belady's rule: the adapter needed again last), is a floor for every router and every start-up fill on that trace.
Beside it, what the same one cache pays from the busiest adapters (a fill by popularity) with the engines' own
rule (least recently used) and with an eviction by known popularity (the adapter the trace's weights say is least
wanted): per-replica least recently used caches (vLLM's host cache) evict by neither, and reach neither.

    python -m loadtests.cold_load_floor --trace churn --seeds 17,18,19 --seconds 30
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Callable, Sequence

from loadtests.bench_routing import MAX_CPU_LORAS, REPLICAS, TRACES, make_trace, popularity

Evict = Callable[[OrderedDict[str, None], int], str]


def cold_loads(requests: Sequence[str], slots: int, start: Sequence[str], evict: str, weights: dict[str, float]) -> int:
    """Cold loads of one cache of ``slots`` adapters, holding ``start`` at first, over ``requests`` (adapter
    names in order). ``evict``: ``belady`` (needed again last, or never), ``lru`` or ``popularity`` (the least
    weight in ``weights``)."""
    next_use: list[int] = [0] * len(requests)
    seen: dict[str, int] = {}
    for index in range(len(requests) - 1, -1, -1):
        next_use[index] = seen.get(requests[index], len(requests))
        seen[requests[index]] = index
    upcoming = dict(seen)  # adapter -> the index of its next request from the current position
    cache: OrderedDict[str, None] = OrderedDict((name, None) for name in start[:slots])
    paid = 0
    for index, name in enumerate(requests):
        upcoming[name] = next_use[index]
        if name in cache:
            cache.move_to_end(name)
            continue
        paid += 1
        if len(cache) >= slots:
            if evict == "belady":
                victim = max(cache, key=lambda n: upcoming.get(n, len(requests)))
            elif evict == "lru":
                victim = next(iter(cache))
            else:
                victim = min(cache, key=lambda n: weights.get(n, 0.0))
            del cache[victim]
        cache[name] = None
    return paid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default="churn")
    parser.add_argument("--seeds", default="17,18,19")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    spec = TRACES[args.trace]
    weights = popularity(spec)
    busiest = sorted(weights, key=lambda t: -weights[t])
    slots = REPLICAS * MAX_CPU_LORAS
    print(f"trace {spec.name}, {args.seconds:g} s, one cache of {slots} slots")
    for seed in (int(s) for s in args.seeds.split(",")):
        requests = [arrival.tenant for arrival in make_trace(args.seconds, spec.rate, seed, spec)]
        soonest = list(dict.fromkeys(requests))
        paid = {"floor (belady)": cold_loads(requests, slots, soonest, "belady", weights)}
        paid |= {rule: cold_loads(requests, slots, busiest, rule, weights) for rule in ("popularity", "lru")}
        print(f"  seed {seed}: {len(requests)} requests; " + ", ".join(f"{r} {n}" for r, n in paid.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What balanced homes cost at a change: how many keys move besides those that must, measured on the real Ring.

    python -m loadtests.ring_churn [--draws 200] [--per-replica 8]

For each fleet size, over ``draws`` independent sets of key names (8 keys per replica by default): a replica
joining (the keys that move between the replicas already there, besides the new replica's own share), and one
key more (how many other keys move), when the count stays under a multiple of the replica count and when it
crosses one (the per-replica cap, ceil(keys / replicas), rises by one and keys return to their ring homes). The
README's figures are this script's output; tests/gateway/routing/test_ring_churn.py checks them on fewer draws.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from gateway.routing.ring import Ring

FLEETS = (2, 4, 8, 16)


@dataclass(frozen=True)
class Churn:
    replicas: int
    keys: int
    join_elsewhere: list[float]  # per draw: share of the keys that moved between the replicas already there
    join_to_new: list[float]  # per draw: share of the keys that moved to the new replica
    added_under: list[int]  # per draw: other keys moved by one key more, the cap unchanged
    added_crossing: list[int]  # per draw: other keys moved by the key that raises the cap


def _homes(replicas: int, keys: list[str]) -> dict[str, str]:
    ring = Ring([f"r{i}" for i in range(replicas)], vnodes=160)
    ring.balance(keys)
    return {key: ring.home(key) for key in keys}


def _moved(before: dict[str, str], after: dict[str, str]) -> int:
    return sum(1 for key, home in before.items() if after[key] != home)


def measure(replicas: int, draws: int, per_replica: int = 8) -> Churn:
    elsewhere, to_new, under, crossing = [], [], [], []
    for draw in range(draws):
        keys = [f"d{draw}-tenant-{i}" for i in range(per_replica * replicas)]
        before, after = _homes(replicas, keys), _homes(replicas + 1, keys)
        new = f"r{replicas}"
        elsewhere.append(sum(1 for k in keys if before[k] != after[k] != new) / len(keys))
        to_new.append(sum(1 for k in keys if after[k] == new) / len(keys))
        fewer = keys[:-1]  # 8n - 1 keys, then 8n: the cap stays ceil(8n / n)
        under.append(_moved(_homes(replicas, fewer), _homes(replicas, [*fewer, f"d{draw}-new"])))
        crossing.append(_moved(before, _homes(replicas, [*keys, f"d{draw}-new"])))  # 8n -> 8n + 1
    return Churn(replicas, per_replica * replicas, elsewhere, to_new, under, crossing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--per-replica", type=int, default=8)
    args = parser.parse_args()
    print("replicas keys | a replica joins: moved between the others mean (p90, max), to the new one mean"
          " | one key more moves, mean (max): cap unchanged, cap crossed")  # fmt: skip
    for replicas in FLEETS:
        c = measure(replicas, args.draws, args.per_replica)
        p90 = statistics.quantiles(c.join_elsewhere, n=10)[-1]
        print(
            f"{c.replicas:8d} {c.keys:4d} | {100 * statistics.mean(c.join_elsewhere):.1f}% ({100 * p90:.1f}%,"
            f" {100 * max(c.join_elsewhere):.1f}%), {100 * statistics.mean(c.join_to_new):.1f}%"
            f" | {statistics.mean(c.added_under):.2f} ({max(c.added_under)}),"
            f" {statistics.mean(c.added_crossing):.2f} ({max(c.added_crossing)})"
        )


if __name__ == "__main__":
    main()

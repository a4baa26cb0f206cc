"""What a body of many arrays costs the event loop: the gateway's refusal of it (``limits.max_json_containers``)
against what parsing it would cost.

The body is README's: a 1 MB request of 340,000 empty arrays (3 levels deep, within the default max_body_bytes).
Timed in this process, one call at a time, ``--rounds`` times each: ``parse_object`` (gateway/serving/json_body.py)
refusing it by its bytes before any parse (what the gateway does now), and orjson building it (what the gateway did
first before the limit; the Python depth walk that came after the parse, another ~0.8 s, is gone from the code and
not timed). Prints a Markdown table (min, median, max in ms) and the load average, for docs/benchmarks.md.

    python -m loadtests.bench_json_containers [--rounds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import orjson

from gateway.serving.json_body import RefusedInput, parse_object

COUNT = 340_000


def hostile_body(count: int = COUNT) -> bytes:
    return b'{"model": "m", "prompt": "hi", "stop": [' + b",".join([b"[]"] * count) + b"]}"


def refuse(raw: bytes) -> None:
    try:
        parse_object(raw, max_depth=32)
    except RefusedInput as exc:
        assert exc.reason == "containers", exc.reason
        return
    raise AssertionError("not refused")


def timed_ms(work: Callable[[bytes], object], raw: bytes, rounds: int) -> list[float]:
    figures = []
    for _ in range(rounds):
        began = time.perf_counter()
        work(raw)
        figures.append(1000 * (time.perf_counter() - began))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    raw = hostile_body()
    before = os.getloadavg()[0]
    rows = [
        ("refused by its bytes (the gateway now)", timed_ms(refuse, raw, args.rounds)),
        ("parsed by orjson (no limit)", timed_ms(orjson.loads, raw, args.rounds)),
    ]
    after = os.getloadavg()[0]
    print(f"{len(raw):,} bytes, {COUNT:,} empty arrays; {args.rounds} rounds; load {before:.1f}-{after:.1f}")
    print("| what | min ms | median ms | max ms |")
    print("|---|---|---|---|")
    for what, figures in rows:
        print(f"| {what} | {min(figures):.1f} | {statistics.median(figures):.1f} | {max(figures):.1f} |")


if __name__ == "__main__":
    main()

"""``tenantgate demo``: a simulated replica, real traffic through the openai SDK, and what the engine did.

The gateway arrives with the next slice of work; until then the demo shows the engine model the gateway will be
judged against: a cold adapter load, warm repeats, a slot eviction and the prefix cache, each visible in the
simulator's own counters.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai

from loadtests.processes import free_port, running, sim_command

TIME_SCALE = 0.1  # ten times faster than the GPU figures in loadtests/sim/defaults.py


def _stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/sim/stats", timeout=5) as response:
        stats: dict[str, Any] = json.load(response)
        return stats


def _load(url: str, name: str, path: Path) -> None:
    body = json.dumps({"lora_name": name, "lora_path": str(path)}).encode()
    request = urllib.request.Request(url + "/v1/load_lora_adapter", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def _what_happened(before: dict[str, Any], after: dict[str, Any]) -> str:
    events = []
    for key, label in (("cold_loads", "cold load"), ("swap_ins", "swap-in"), ("gpu_evictions", "slot eviction")):
        if after[key] > before[key]:
            events.append(f"{after[key] - before[key]} {label}")
    hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    if hits:
        events.append(f"{hits} prompt tokens from the prefix cache")
    return ", ".join(events) or "warm"


def run() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = sim_command(port, "--max-loras", "2", "--time-scale", str(TIME_SCALE))
        with running(cmd, url, Path(tmp) / "sim.log", start_timeout_s=30):
            print(f"simulated vLLM replica at {url}: 2 GPU adapter slots, time scale {TIME_SCALE}\n")
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            context = " ".join(f"policy{i}" for i in range(80))  # a long shared system prompt
            script = ["support-acme", "support-acme", "sql-globex", "support-acme", "chat-initech", "sql-globex"]
            for name in sorted(set(script)):
                directory = Path(tmp) / name
                directory.mkdir()
                (directory / "adapter_config.json").write_text('{"r": 16}')
                before = _stats(url)
                started = time.monotonic()
                _load(url, name, directory)
                took_ms = 1000 * (time.monotonic() - started)
                print(f"load {name:<13} {took_ms:6.1f} ms  ({_what_happened(before, _stats(url))})")
            print()
            print(f"{'adapter':<13} {'TTFT ms':>8}  what the engine did")
            for name in script:
                before = _stats(url)
                started = time.monotonic()
                stream = client.completions.create(model=name, prompt=context + " question", max_tokens=8, stream=True)
                ttft_ms = None
                for _ in stream:
                    ttft_ms = ttft_ms or 1000 * (time.monotonic() - started)
                print(f"{name:<13} {ttft_ms or 0:8.1f}  {_what_happened(before, _stats(url))}")
            final = _stats(url)
            print(
                f"\nengine totals: {final['requests']} requests, {final['cold_loads']} cold loads, "
                f"{final['swap_ins']} swap-ins, {final['gpu_evictions']} slot evictions, "
                f"{final['prefix_hit_tokens']}/{final['prompt_tokens']} prompt tokens from the prefix cache"
            )
    return 0

"""What the vLLM driver reads from an engine's /metrics page: load gauges, the token counter, the running adapters
and the GPU adapter slots (the real engine's page is checked in tests/engines/test_vllm_conformance.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from backends.base import EngineLoad
from backends.vllm import parse_load_signals

PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a1,a2",waiting_lora_adapters="a1,a2"} 1.7000000005e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a3",waiting_lora_adapters="a3"} 1.7000000009e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7000000001e9
"""


def test_the_newest_lora_series_names_the_running_adapters_and_its_label_the_gpu_slots() -> None:
    load = parse_load_signals(PAGE)
    assert load is not None
    assert (load.running, load.waiting, load.kv_cache_usage) == (3.0, 2.0, 0.25)
    assert load.generated_tokens == 1234.0  # the _total sample, not _created
    assert load.running_adapters == frozenset({"a3"})
    assert load.gpu_slots == 4


def test_a_page_without_the_lora_family_reads_no_adapters_and_no_slots() -> None:
    page = "\n".join(line for line in PAGE.splitlines() if "lora" not in line)
    load = parse_load_signals(page)
    assert load is not None and load.running_adapters == frozenset() and load.gpu_slots is None


def test_a_page_that_does_not_parse_reads_as_no_signal() -> None:
    assert parse_load_signals("vllm:num_requests_running{engine= 3\n") is None


def test_of_many_lora_series_the_newest_is_read_wherever_it_is() -> None:
    older = [
        f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="old{i}",waiting_lora_adapters=""}} {1.6e9 + i}'
        for i in range(300)
    ]
    page = PAGE + "\n".join(older) + "\n"
    load = parse_load_signals(page)
    assert load is not None and load.running_adapters == frozenset({"a3"})  # 1.7000000009e9 is still the newest
    newest = 'vllm:lora_requests_info{max_lora="4",running_lora_adapters="b1,b2",waiting_lora_adapters=""} 1.8e9\n'
    load = parse_load_signals(page + newest)
    assert load is not None and load.running_adapters == frozenset({"b1", "b2"})


def test_a_lora_series_whose_value_does_not_read_is_left_to_the_parser() -> None:
    broken = 'vllm:lora_requests_info{max_lora="4",running_lora_adapters="x",waiting_lora_adapters=""} soon\n'
    assert parse_load_signals(PAGE + broken) is None  # the page does not parse: no signal, as before


@pytest.mark.parametrize(
    "slots", ["²", "9" * 5000, "-1", "4.0"], ids=["unicode-digit", "5000-digits", "negative", "float"]
)
def test_a_gpu_slot_count_that_is_no_count_reads_as_unknown(slots: str) -> None:
    """The max_lora label is the engine's text: one int() refuses (a Unicode digit, which str.isdigit accepts, or
    more digits than it converts) raised out of the parse, and failed the whole pool's scrape, every replica's."""
    page = PAGE.replace('max_lora="4",running_lora_adapters="a3"', f'max_lora="{slots}",running_lora_adapters="a3"')
    load = parse_load_signals(page)
    assert load is not None and load.running_adapters == frozenset({"a3"}) and load.gpu_slots is None


def _parser_reading(text: str) -> EngineLoad | None:
    """The reading before the string scan: prometheus-client's exposition parser over the whole page."""
    wanted = dict.fromkeys(("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"), 0.0)
    newest, running, generated, slots = -math.inf, "", None, None
    try:
        for family in text_string_to_metric_families(text):
            if family.name in wanted:
                wanted[family.name] = sum(sample.value for sample in family.samples)
            elif family.name == "vllm:generation_tokens":
                generated = sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
            elif family.name == "vllm:lora_requests_info":
                for sample in family.samples:
                    if sample.value > newest:
                        newest, running = sample.value, sample.labels.get("running_lora_adapters", "")
                        slots = sample.labels.get("max_lora")
    except ValueError:
        return None
    return EngineLoad(
        running=wanted["vllm:num_requests_running"],
        waiting=wanted["vllm:num_requests_waiting"],
        kv_cache_usage=wanted["vllm:kv_cache_usage_perc"],
        running_adapters=frozenset(name for name in running.split(",") if name),
        generated_tokens=generated,
        gpu_slots=int(slots) if slots is not None and slots.isascii() and slots.isdigit() else None,
    )


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_VALUES = st.floats(min_value=0, max_value=1e12, allow_nan=False)
_NAMES = st.text(alphabet='ab1-_."\\\n {}=', min_size=1, max_size=8).filter(lambda name: "," not in name)


@settings(max_examples=300, deadline=None)
@given(
    gauges=st.lists(st.tuples(st.sampled_from(("running", "waiting", "kv")), _VALUES), max_size=6),
    generated=st.lists(_VALUES, max_size=2),
    lora=st.lists(
        st.tuples(st.lists(_NAMES, max_size=3), st.sampled_from(("2", "8", "16")), _VALUES), max_size=12, unique_by=str
    ),
    histogram=st.booleans(),
)
def test_the_string_scan_reads_what_the_exposition_parser_reads(
    gauges: list[tuple[str, float]], generated: list[float], lora: list[tuple[list[str], str, float]], histogram: bool
) -> None:
    """Any well-formed page of these families (several label sets each, adapter names with the format's escapes,
    a histogram family beside them) reads the same as with prometheus-client's exposition parser."""
    family = {
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv": "vllm:kv_cache_usage_perc",
    }
    lines: list[str] = []
    for key in ("running", "waiting", "kv"):
        lines.append(f"# TYPE {family[key]} gauge")
        lines += [
            f'{family[key]}{{engine="{i}",model_name="m"}} {value!r}' for i, (k, value) in enumerate(gauges) if k == key
        ]
    if generated:
        lines.append("# TYPE vllm:generation_tokens_total counter")
        lines += [f'vllm:generation_tokens_total{{engine="{i}"}} {value!r}' for i, value in enumerate(generated)]
    if histogram:
        lines += ["# TYPE vllm:e2e_request_latency_seconds histogram",
                  'vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 3.0',
                  'vllm:e2e_request_latency_seconds_count{model_name="m"} 3.0',
                  'vllm:e2e_request_latency_seconds_sum{model_name="m"} 0.5']  # fmt: skip
    if lora:
        lines.append("# TYPE vllm:lora_requests_info gauge")
        for names, slots, value in lora:
            running = _escaped(",".join(names))
            lines.append(
                f'vllm:lora_requests_info{{max_lora="{slots}",running_lora_adapters="{running}",'
                f'waiting_lora_adapters="{running}"}} {value!r}'
            )
    page = "\n".join(lines) + "\n"
    assert parse_load_signals(page) == _parser_reading(page)

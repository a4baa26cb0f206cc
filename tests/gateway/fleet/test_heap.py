"""The start-up heap reserve (gateway/fleet/heap.py): small objects allocated after it land in memory already
touched, without page faults, where the allocator is CPython's own."""

from __future__ import annotations

import gc
import os
import resource
import sys

import pytest

from gateway.fleet import heap

PAGE = 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults as getrusage counts them")
@pytest.mark.skipif(os.environ.get("PYTHONMALLOC", "pymalloc") not in ("pymalloc", ""), reason="CPython's allocator")
def test_small_objects_made_after_the_reserve_take_no_page_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_kept", [])
    gc.collect()
    gc.disable()
    try:
        assert heap.reserve(8 * 1024 * 1024) > 0
        assert heap.reserve(8 * 1024 * 1024) == 0  # once per process
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        # 4 MiB of the objects a first sight keeps (tuples of eight, a slotted object, a float), all kept alive.
        made = [(tuple(range(i, i + 8)), float(i), object()) for i in range(4 * 1024 * 1024 // 300)]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    finally:
        gc.enable()
    assert made
    # Without the reserve about one fault per page these take (over 1,000); allow some for the list itself (a large
    # block, from the system allocator) and the interpreter's own.
    assert faults < 4 * 1024 * 1024 // PAGE // 10

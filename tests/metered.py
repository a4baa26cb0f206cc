"""A buffer that counts the bytes its owner's code touches: how a test tells work linear in a stream's length from
work growing with its square by counting, not by timing (a slow or busy machine cannot fail it; a quadratic
implementation cannot pass it however fast the machine).

A test puts a ``MeteredBuffer`` where the code under test keeps its held bytes (it is a ``bytearray``, so the
code's own operations run unchanged) and reads ``touched`` afterwards: every search, copy, slice, join, append and
deletion adds the number of bytes it walks over. A test should also check that the buffer it put in is still the
one the code holds at the end: code that replaces its buffer with a new object per read (the classic quadratic
join) would otherwise escape the count.
"""

from __future__ import annotations

from typing import Any, SupportsIndex


class MeteredBuffer(bytearray):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.touched = 0

    def _span(self, start: SupportsIndex | None, end: SupportsIndex | None) -> int:
        first, last, _ = slice(start, end).indices(len(self))
        return max(0, last - first)

    def find(self, sub: Any, start: SupportsIndex | None = None, end: SupportsIndex | None = None) -> int:
        self.touched += self._span(start, end)
        return super().find(sub, start, end)

    def rfind(self, sub: Any, start: SupportsIndex | None = None, end: SupportsIndex | None = None) -> int:
        self.touched += self._span(start, end)
        return super().rfind(sub, start, end)

    def index(self, sub: Any, start: SupportsIndex | None = None, end: SupportsIndex | None = None) -> int:
        self.touched += self._span(start, end)
        return super().index(sub, start, end)

    def count(self, sub: Any, start: SupportsIndex | None = None, end: SupportsIndex | None = None) -> int:
        self.touched += self._span(start, end)
        return super().count(sub, start, end)

    def __contains__(self, item: Any) -> bool:
        self.touched += len(self)
        return super().__contains__(item)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            self.touched += len(range(*key.indices(len(self))))
        return super().__getitem__(key)

    def __delitem__(self, key: Any) -> None:
        # The bytes deleted: CPython's bytearray drops a prefix without moving the rest.
        self.touched += len(range(*key.indices(len(self)))) if isinstance(key, slice) else 1
        super().__delitem__(key)

    def __bytes__(self) -> bytes:
        self.touched += len(self)
        return bytes(memoryview(self))

    def __add__(self, other: Any) -> bytearray:
        self.touched += len(self) + len(other)
        return super().__add__(other)

    def __iadd__(self, other: Any) -> MeteredBuffer:
        self.touched += len(other)
        super().__iadd__(other)
        return self

    def strip(self, chars: Any = None) -> bytearray:
        self.touched += len(self)
        return super().strip(chars)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        self.touched += len(self)
        return super().decode(encoding, errors)

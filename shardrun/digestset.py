"""A set of 64-bit id digests kept in one flat array.

The coordinator remembers the digest of every id it has handed out (a repeated id is a reject,
not a second result) and, on resume, of every id already finished. Those are the only things it
holds per input item. In a Python `set` each digest costs about 70 bytes (a 32-byte int object
and its slot); here it is one 8-byte slot of an `array('Q')` kept between 3/8 and 3/4 full,
11 to 21 bytes per digest: 10 million ids take about 130-270 MB instead of 700 MB.

Open addressing with linear probing. Digests come from blake2b, so their low bits are uniform
and index the table directly. 0 marks an empty slot, so the digest 0 is stored as 1: two ids
collide that way with probability 2^-63, beside the 2^-64 of any two digests being equal.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

__all__ = ["DigestSet"]

_MIN_SLOTS = 1024
_MAX_LOAD_NUM, _MAX_LOAD_DEN = 3, 4  # grow (double) beyond 3/4 full


class DigestSet:
    """`add`, `in` and `len` over unsigned 64-bit ints; nothing is ever removed."""

    __slots__ = ("_count", "_limit", "_mask", "_table")

    def __init__(self, digests: Iterable[int] = ()) -> None:
        self._count = 0
        self._allocate(_MIN_SLOTS)
        self.update(digests)

    def _allocate(self, slots: int) -> None:
        self._table = array("Q", [0]) * slots  # exactly `slots`; from bytes it over-allocates
        self._mask = slots - 1
        self._limit = slots * _MAX_LOAD_NUM // _MAX_LOAD_DEN

    def _slot(self, digest: int) -> int:
        """The slot holding `digest`, or the empty slot where it would go."""
        table, mask = self._table, self._mask
        i = digest & mask
        while (held := table[i]) and held != digest:
            i = (i + 1) & mask
        return i

    def add(self, digest: int) -> bool:
        """Insert `digest`; False if it was already there."""
        digest = digest or 1
        i = self._slot(digest)
        if self._table[i]:
            return False
        self._table[i] = digest
        self._count += 1
        if self._count > self._limit:
            self._grow()
        return True

    def update(self, digests: Iterable[int]) -> None:
        add = self.add
        for digest in digests:
            add(digest)

    def __contains__(self, digest: object) -> bool:
        return isinstance(digest, int) and self._table[self._slot(digest or 1)] != 0

    def __len__(self) -> int:
        return self._count

    def _grow(self) -> None:
        old = self._table
        self._allocate(2 * len(old))
        table, mask = self._table, self._mask
        for digest in old:
            if digest:
                i = digest & mask
                while table[i]:
                    i = (i + 1) & mask
                table[i] = digest

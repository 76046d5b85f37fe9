"""A set of 64-bit id digests kept in one flat array.

The coordinator remembers the digest of every id it has handed out (a repeated id is a reject,
not a second result) and, on resume, of every id already finished. Those are the only things it
holds per input item. In a Python `set` each digest costs about 70 bytes (a 32-byte int object
and its slot); here it is one 8-byte slot of an `array('Q')` kept between 3/8 and 3/4 full,
11 to 21 bytes per digest: 10 million ids take about 130-270 MB instead of 700 MB.

Open addressing with linear probing. Digests come from blake2b, so their low bits are uniform
and index the table directly. 0 marks an empty slot, so the digest 0 is stored as 1: two ids
collide that way with probability 2^-63, beside the 2^-64 of any two digests being equal.

The table doubles incrementally: the old array stays alive, untouched (its probe chains intact,
so lookups may search it), while each `add` moves the next few of its slots into the new one.
Rehashing all at once took the coordinator's loop away for 0.3 s at 3 million ids (1.2 s on a
busy machine; twice as long at each doubling after), during which no shard was handed work.
While the two arrays coexist, for 1/64 of the old one's size in adds, a digest costs up to 32
bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

__all__ = ["DigestSet"]

_MIN_SLOTS = 1024
_MAX_LOAD_NUM, _MAX_LOAD_DEN = 3, 4  # grow (double) beyond 3/4 full
# Old slots moved per add while growing: a few microseconds an add, and the old array is empty
# after 1/64 of its size in adds, long before the new one (3/8 full when growing starts) nears
# its own 3/4. Moving slots in runs keeps the Python overhead per slot near a bulk rehash's.
_MOVE_PER_ADD = 64


class DigestSet:
    """`add`, `in` and `len` over unsigned 64-bit ints; nothing is ever removed."""

    __slots__ = ("_count", "_limit", "_mask", "_moved", "_old", "_old_mask", "_table")

    def __init__(self, digests: Iterable[int] = ()) -> None:
        self._count = 0
        self._old: array[int] | None = None  # the array being moved from while growing
        self._old_mask = 0
        self._moved = 0  # old slots moved so far
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

    def _in_old(self, digest: int) -> bool:
        old = self._old
        assert old is not None
        mask = self._old_mask
        i = digest & mask
        while held := old[i]:
            if held == digest:
                return True
            i = (i + 1) & mask
        return False

    def add(self, digest: int) -> bool:
        """Insert `digest`; False if it was already there."""
        digest = digest or 1
        table, mask = self._table, self._mask  # `_slot` inlined: the coordinator's hot path
        i = digest & mask
        while held := table[i]:
            if held == digest:
                return False
            i = (i + 1) & mask
        if self._old is not None:
            if self._in_old(digest):
                return False
            table[i] = digest
            self._count += 1
            self._move_some()
            return True
        table[i] = digest
        self._count += 1
        if self._count > self._limit:
            self._old, self._old_mask, self._moved = table, mask, 0
            self._allocate(2 * len(table))
        return True

    def update(self, digests: Iterable[int]) -> None:
        add = self.add
        for digest in digests:
            add(digest)
        # Slots move only as adds come, and a set built in bulk (a resume's finished ids) is
        # then only looked up: left mid-growth, both arrays stayed alive for the whole pass
        # and each absent id was looked for twice. A bulk call may take the rest at once.
        while self._old is not None:
            self._move_some()

    def __contains__(self, digest: object) -> bool:
        if not isinstance(digest, int):
            return False
        digest = digest or 1
        return self._table[self._slot(digest)] != 0 or (
            self._old is not None and self._in_old(digest))

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """The arrays' size: the table's, and the old one's while growing."""
        held = self._table.buffer_info()[1] * self._table.itemsize
        if self._old is not None:
            held += self._old.buffer_info()[1] * self._old.itemsize
        return held

    def _move_some(self) -> None:
        """Move the old array's next slots into the table; drop it once all are moved.

        A digest is never in both: `add` stores one only where neither array holds it."""
        old = self._old
        assert old is not None
        table, mask = self._table, self._mask
        end = min(self._moved + _MOVE_PER_ADD, len(old))
        for digest in old[self._moved:end]:
            if digest:
                i = digest & mask
                while table[i]:
                    i = (i + 1) & mask
                table[i] = digest
        self._moved = end
        if end == len(old):
            self._old = None

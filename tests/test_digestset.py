"""DigestSet against Python's set: same answers for any sequence of adds and lookups."""

from __future__ import annotations

import random
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.digestset import _MOVE_PER_ADD, DigestSet
from shardrun.worksource import id_digest

U64 = st.integers(0, 2**64 - 1)
# Digests that share their low bits crowd one run of slots: probing and growth must cope.
CLUSTERED = st.builds(lambda high, low: (high << 10) | low, st.integers(0, 2**54 - 1),
                      st.integers(0, 3))  # fmt: skip


def stored(d: int) -> int:
    """The model of the one documented merge: digest 0 is stored as 1."""
    return d or 1


@settings(max_examples=300)
@given(st.lists(st.tuples(st.booleans(), st.one_of(U64, CLUSTERED, st.sampled_from([0, 1]))),
                max_size=3000))  # fmt: skip
def test_behaves_as_a_set(ops: list[tuple[bool, int]]) -> None:
    mine, model = DigestSet(), set()
    for is_add, d in ops:
        if is_add:
            assert mine.add(d) == (stored(d) not in model)
            model.add(stored(d))
        else:
            assert (d in mine) == (stored(d) in model)
        assert len(mine) == len(model)
    assert all(d in mine for d in model)


def test_growth_keeps_every_digest_and_rejects_strangers() -> None:
    rng = random.Random(7)
    digests = [rng.getrandbits(64) for _ in range(50_000)]  # 1,024 slots doubled six times
    s = DigestSet(digests)
    assert len(s) == len(set(digests))
    assert all(d in s for d in digests)
    strangers = [rng.getrandbits(64) for _ in range(50_000)]
    assert sum(d in s for d in strangers) == len(set(strangers) & set(digests))
    assert "not an int" not in s


def test_smaller_than_a_python_set_per_digest() -> None:
    digests = [id_digest(f"item-{i}") for i in range(140_000)]
    mine, most_per_digest = DigestSet(), 0.0
    for d in digests:
        mine.add(d)
        if len(mine) > 768:  # past the first 3/4 of the smallest table, 1,024 slots
            most_per_digest = max(most_per_digest, mine.nbytes / len(mine))
    assert mine._old is None  # 140,000 is past the growth that began at 98,305
    assert mine.nbytes >= sys.getsizeof(mine._table) - 100  # nbytes counts the array itself
    python_set = set(digests)
    set_bytes = sys.getsizeof(python_set) + sum(sys.getsizeof(d) for d in python_set)
    assert mine.nbytes / len(mine) <= 22  # 8-byte slots, at least 3/8 full
    assert mine.nbytes * 3 < set_bytes
    assert most_per_digest <= 32  # both arrays while growing: 3 slots of 8 bytes per 3/4
    assert most_per_digest * 2 < set_bytes / len(mine)


def test_growth_moves_a_few_slots_per_add_not_all_at_once() -> None:
    """A doubling rehashed every digest in one add: a 1.2 s stall of the coordinator at 3
    million ids. Now each add moves a few of the old array's slots, and lookups see both."""
    rng = random.Random(11)
    s, added = DigestSet(), []
    while s._old is None and len(added) < 2_000:
        added.append(rng.getrandbits(64) | 1)
        s.add(added[-1])
    assert s._old is not None
    assert not any(s._table)  # the add that began the growth moved nothing yet
    adds_since = 0
    while s._old is not None:
        added.append(rng.getrandbits(64) | 1)
        s.add(added[-1])
        adds_since += 1
        assert sum(1 for d in s._table if d) <= adds_since * (1 + _MOVE_PER_ADD)
        assert added[0] in s and added[-1] in s
        assert not s.add(rng.choice(added))  # wherever it is, old array or new, it is known
        assert len(s) == len(added)
    assert adds_since <= 1024 // _MOVE_PER_ADD  # the old array had 1,024 slots
    assert sorted(d for d in s._table if d) == sorted(set(added))


def test_a_set_built_in_bulk_is_left_whole() -> None:
    """Slots move as adds come; a set built by `update` (a resume's finished ids) is then only
    looked up, so one that ended mid-growth kept both arrays for the whole pass. The 769th of
    769 digests begins a growth; the bulk call finishes it."""
    s = DigestSet(range(1, 770))
    assert s._old is None and s.nbytes == 2048 * 8
    assert len(s) == 769 and all(d in s for d in range(1, 770)) and 770 not in s

"""DigestSet against Python's set: same answers for any sequence of adds and lookups."""

from __future__ import annotations

import random
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun.digestset import DigestSet
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
    digests = [id_digest(f"item-{i}") for i in range(100_000)]
    mine = DigestSet(digests)
    table_bytes = sys.getsizeof(mine._table)
    python_set = set(digests)
    set_bytes = sys.getsizeof(python_set) + sum(sys.getsizeof(d) for d in python_set)
    assert table_bytes / len(mine) <= 22  # 8-byte slots, at least 3/8 full
    assert table_bytes * 3 < set_bytes

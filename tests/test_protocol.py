"""The shard's `tried` map goes to the coordinator as changes (`protocol.CountChanges`): applied
report after report, the coordinator's copy is the shard's map as of each report."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun import protocol

KEYS = st.sampled_from([f"0-{n}" for n in range(6)])
STEPS = st.lists(st.one_of(st.tuples(st.just("set"), KEYS, st.integers(1, 5)),
                           st.tuples(st.just("drop"), KEYS, st.just(0)),
                           st.tuples(st.just("report"), st.just(""), st.just(0))), max_size=60)


@given(STEPS)
@settings(max_examples=300, deadline=None)
def test_the_changes_applied_in_order_rebuild_the_map_at_every_report(
        steps: list[tuple[str, str, int]]) -> None:
    sender, copy = protocol.CountChanges(), {}
    for op, key, count in [*steps, ("report", "", 0)]:
        if op == "set":
            sender.set(key, count)
        elif op == "drop":
            sender.drop(key)
        else:
            changes = protocol.decode(protocol.encode({"t": "progress",
                                                       "tried": sender.take_changes()}))
            protocol.apply_changes(copy, changes["tried"])
            assert copy == sender.counts


def test_a_report_carries_only_what_changed_since_the_last() -> None:
    tried = protocol.CountChanges()
    for n in range(100):
        tried.set(f"0-{n}", 1)
    assert len(tried.take_changes()) == 100
    tried.set("0-7", 2)  # a second failed attempt
    tried.drop("0-8")  # ended
    tried.set("0-200", 1)
    tried.drop("0-200")  # opened and ended between two reports: the coordinator never knew it
    tried.drop("0-300")  # never set
    assert tried.take_changes() == {"0-7": 2, "0-8": 0}
    assert tried.take_changes() == {}
    assert len(tried.counts) == 99 and tried.counts["0-7"] == 2

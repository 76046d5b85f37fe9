"""Both event layouts fold to the same numbers.

Today a shard logs an attempt's transitions (`conn_ready_t`, `reused`, `first_token_t`,
`last_token_t`, `tokens`) on its `attempt_end` line; runs written before that logged them as
separate `conn_ready`, `first_token` and `last_token` lines. The readers take both.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
from hypothesis import given, settings
from test_aggregate_fixtures import (
    T0,
    B,
    ev,
    hand_coordinator,
    hand_shard,
    steady_shard,
    to_new_layout,
    to_old_layout,
)
from test_aggregate_props import logs, simulate

from shardrun.aggregate import RunFacts, ShardFold, build_report, fold_coordinator, fold_shard

M = B // 60


def _doc(records: list[dict[str, Any]]) -> dict[str, Any]:
    summary = fold_shard(records, idle_until=T0 + 9.5)
    summary.name = "00"
    facts = RunFacts(run_id="fixture-run", run_dir="/x", state="finished", state_reason="test")
    return build_report(facts, [fold_coordinator(hand_coordinator())], [summary])


def test_conversion_moves_the_instants_onto_attempt_end() -> None:
    """The hand fixture in today's layout: 8 lines fewer, s2's retry keeps its own instants."""
    old = hand_shard()
    new = to_new_layout(old)
    assert not [r for r in new if r["ev"] in ("conn_ready", "first_token", "last_token")]
    assert len(old) - len(new) == 8
    ends = {(r["span"], r["attempt"]): r for r in new if r["ev"] == "attempt_end"}
    s2_failed, s2_ok = ends["0-2", 1], ends["0-2", 2]
    assert (s2_failed["conn_ready_t"], s2_failed["reused"]) == (T0 + 1, True)
    assert (s2_failed["first_token_t"], s2_failed["last_token_t"]) == (None, None)
    assert (s2_ok["conn_ready_t"], s2_ok["first_token_t"], s2_ok["last_token_t"]) == (
        T0 + 3.25, T0 + 4, T0 + 7)
    assert list(s2_ok)[:15] == ["run_id", "shard", "ev", "t", "span", "id", "attempt", "status",
                                "http", "retry_after", "conn_ready_t", "reused", "first_token_t",
                                "last_token_t", "tokens"]
    back = Counter(r["ev"] for r in to_old_layout(new))
    assert back == Counter(r["ev"] for r in old)


def test_hand_fixture_report_is_the_same_in_both_layouts() -> None:
    """Every number of the report document, hand fixture, old layout vs today's."""
    old, new = _doc(hand_shard()), _doc(to_new_layout(hand_shard()))
    assert new == old
    assert old["connections"]["new"] == 2 and old["connections"]["reused"] == 2


def test_a_log_with_both_layouts_counts_as_the_old_fold_did() -> None:
    """attempt_end with the new fields AND the separate lines: each connection counts once, the
    separate lines' instants win (here they are made to disagree, to see which one is used)."""
    both = []
    for rec in to_new_layout(hand_shard()):
        if rec["ev"] == "attempt_end":
            both += [r for r in to_old_layout([rec]) if r["ev"] != "attempt_end"]
            rec = {**rec, **{k: rec[k] + 100 for k in ("conn_ready_t", "first_token_t",
                                                       "last_token_t") if rec[k] is not None}}
        both.append(rec)
    assert _doc(both) == _doc(hand_shard())


def test_new_layout_alone_gives_the_instants() -> None:
    """Without the separate lines the instants come from attempt_end: a shifted first token
    moves t_first_token and t_stream of that span, and nothing else."""
    new = to_new_layout(hand_shard())
    for rec in new:
        if rec["ev"] == "attempt_end" and rec["span"] == "0-1":
            rec["first_token_t"] += 0.5
    base = _doc(to_new_layout(hand_shard()))["latency"]["all"]
    moved = _doc(new)["latency"]["all"]
    assert moved["t_first_token"]["sum"] == base["t_first_token"]["sum"] + 0.5
    assert moved["t_stream"]["sum"] == base["t_stream"]["sum"] - 0.5
    assert moved["e2e"] == base["e2e"] and moved["t_conn"] == base["t_conn"]


def test_ok_attempt_without_tokens_counts_at_its_end_in_the_new_layout() -> None:
    """last_token_t null on the ok attempt: its minute is attempt_end's own `t`."""
    end = {"conn_ready_t": B - 3, "reused": False, "first_token_t": None, "last_token_t": None,
           "tokens": 0}
    recs = [
        ev("queued", B - 5, span="s", id="i"), ev("admitted", B - 5, span="s", id="i"),
        ev("attempt_start", B - 5, span="s", id="i", attempt=1),
        ev("attempt_end", B - 4, span="s", id="i", attempt=1, status="timeout_idle",
           **{**end, "conn_ready_t": B - 5, "reused": True, "last_token_t": B - 4.5,
              "tokens": 2}),
        ev("attempt_start", B - 3, span="s", id="i", attempt=2),
        ev("attempt_end", B + 1, span="s", id="i", attempt=2, status="ok", completion_tokens=0,
           **end),
        ev("released", B + 2, span="s", id="i", outcome="ok"),
    ]
    s = fold_shard(recs)
    assert set(s.minutes) == {M}
    assert (s.new_conns, s.reused_conns) == (1, 1)


def test_failed_attempt_without_connection_counts_none() -> None:
    """conn_ready_t null (no connection obtained): no connection is counted."""
    recs = [ev("attempt_start", B, span="s", id="i", attempt=1),
            ev("attempt_end", B + 1, span="s", id="i", attempt=1, status="timeout_connect",
               conn_ready_t=None, reused=None, first_token_t=None, last_token_t=None, tokens=0)]
    s = fold_shard(recs)
    assert (s.new_conns, s.reused_conns, s.by_status) == (0, 0, {"timeout_connect": 1})


def test_counted_lines_per_layout() -> None:
    """Old layout: last_token, attempt_end, released per span; today's: attempt_end, released."""
    for layout, per_span in (("old", 3), ("new", 2)):
        fold = ShardFold(minutes_only=True, keep_lines=True)
        for rec in steady_shard(0, B + 1, minutes=1, per_minute=4, layout=layout):
            fold.feed(rec, orjson.dumps(rec))
        cell = fold.finish().minutes[M]
        assert (cell.spans, cell.lines) == (4, 4 * per_span), layout


@settings(max_examples=60, deadline=None)
@given(logs)
def test_random_logs_report_the_same_in_both_layouts(log: tuple[int, list[Any]]) -> None:
    """Random valid shard logs (retries, reuse, dead letters): the same report document."""
    old, _ = simulate(*log)
    facts = RunFacts(run_id="r", run_dir="/x", state="finished", state_reason="test")
    docs = []
    for recs in (old, to_new_layout(old)):
        summary = fold_shard(recs)
        summary.name = "00"
        docs.append(build_report(facts, [], [summary]))
    assert docs[0] == docs[1]


def test_minute_and_t_post_come_from_last_token_t_not_attempt_end_t() -> None:
    """s1's attempt_end moved past the minute boundary B (its last token stays before it):
    its tokens stay in the minute before B and its t_post stays released − last token."""
    base = to_new_layout(hand_shard())
    moved = [dict(r) for r in base]
    for rec in moved:
        if rec["ev"] == "attempt_end" and rec["span"] == "0-1":
            rec["t"] = B + 0.25  # s1's last_token_t is B − 1.5
    assert _doc(moved)["tpm"] == _doc(base)["tpm"]
    assert _doc(moved)["latency"] == _doc(base)["latency"]
    assert fold_shard(base).minutes[M - 1].tokens == 10

"""Hypothesis properties of the aggregator over random but valid shard logs.

`simulate` plays a FIFO shard with `cap` slots: span i waits for the earliest free slot (plus an
optional admission stall), makes some failed attempts with backoff, then succeeds or is
dead-lettered. It returns the event records in file order and the ground truth.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_aggregate_fixtures import ev

from shardrun.aggregate import Dist, RunFacts, build_report, fold_shard
from shardrun.aggregate._segments import BUCKETS, overall
from shardrun.itl import REL_ERROR, nearest_rank

RANK = {"released": 0, "queued": 1, "admitted": 2, "attempt_start": 3, "conn_ready": 4,
        "first_token": 5, "last_token": 6, "attempt_end": 7, "retry": 8}
T_START = 1_800_000_000.0


@dataclass
class Truth:
    tokens: int = 0
    refusals: int = 0
    reasoning: int = 0
    per_minute: dict[int, int] = field(default_factory=dict)
    estimated: dict[int, tuple[int, int]] = field(default_factory=dict)  # minute: spans, tokens
    ok: int = 0
    first_tokens: int = 0  # successes with a first token of their own (not `at_once`)
    tpots: int = 0  # of those, the ones of 2 tokens or more


span_plan = st.tuples(
    st.floats(0.0, 2.0),  # gap since the previous arrival
    st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(0.001, 1.0)), max_size=2),  # failures
    st.floats(0.0, 0.1), st.booleans(),  # connection time, reused
    st.floats(0.001, 1.0), st.floats(0.0, 2.0), st.floats(1e-4, 0.1),  # first token, stream, post
    st.integers(1, 50), st.booleans(),  # tokens, dead-lettered
)


def _attempts(sid: str, t: float, plan: tuple[Any, ...], out: list[tuple[Any, ...]]) -> float:
    """The failed attempts of one span from `t`; returns the final attempt's start."""
    for n, (duration, wait) in enumerate(plan[1], start=1):
        out += [(t, "attempt_start", sid, {"attempt": n}),
                (t, "conn_ready", sid, {"attempt": n, "reused": True}),
                (t + duration, "attempt_end", sid,
                 {"attempt": n, "status": "http_5xx", "wasted_tokens": 0,
                  "usage_estimated": True}),  # as the client logs a failure: never counted
                (t + duration, "retry", sid, {"attempt": n, "cause": "http_5xx"})]
        t += duration + wait
    return t


def _span_events(sid: str, q: float, a: float, plan: tuple[Any, ...],
                 truth: Truth) -> tuple[float, list[tuple[Any, ...]]]:
    _, failures, conn, reused, first, stream, post, tokens, dead = plan
    out: list[tuple[Any, ...]] = [(q, "queued", sid, {"prompt_chars": 8}), (a, "admitted", sid, {})]
    start = _attempts(sid, a, plan, out)
    n = len(failures) + 1
    c = start if reused else start + conn
    out += [(start, "attempt_start", sid, {"attempt": n}),
            (c, "conn_ready", sid, {"attempt": n, "reused": reused})]
    if dead:
        out += [(c + first, "attempt_end", sid, {"attempt": n, "status": "http_4xx"}),
                (c + first + 0.001, "released", sid, {"outcome": "dead", "reason": "x: y"})]
        return c + first + 0.001, out
    f, last = c + first, c + first + stream
    refusal = "refusal" if tokens % 4 == 0 else None  # the model declined (`Shard._succeed`)
    # Tokens the client counted (the server sent no usage), the server's, or an older log's
    # line without `usage_estimated` at all.
    usage = ({"usage_estimated": True}, {"usage_estimated": False}, {})[tokens % 3]
    # An answer that came at once (whole, or a stream a proxy held back): no TTFT or TPOT.
    at_once = {"at_once": True} if tokens % 5 == 0 else {}
    out += [(f, "first_token", sid, {"attempt": n}),
            (last, "last_token", sid, {"attempt": n, "tokens": tokens}),
            (last, "attempt_end", sid, {"attempt": n, "status": "ok", "completion_tokens": tokens,
                                        "prompt_tokens": 2, "cached_tokens": tokens % 3,
                                        "reasoning_tokens": tokens // 2,
                                        "itl_hist": {"100": tokens - 1}, **usage,
                                        **at_once}),
            (last + post, "released", sid, {"outcome": "ok", "reason": refusal})]
    truth.tokens += tokens
    truth.ok += 1
    truth.refusals += refusal is not None
    truth.reasoning += tokens // 2
    m = int(last // 60)
    truth.per_minute[m] = truth.per_minute.get(m, 0) + tokens
    truth.first_tokens += not at_once
    truth.tpots += not at_once and tokens >= 2
    if usage.get("usage_estimated"):
        spans, est = truth.estimated.get(m, (0, 0))
        truth.estimated[m] = (spans + 1, est + tokens)
    return last + post, out


def simulate(cap: int, plans: list[tuple[Any, ...]],
             stalls: list[float] | None = None) -> tuple[list[dict[str, Any]], Truth]:
    truth, rows, free = Truth(), [], [T_START] * cap
    q = T_START
    for i, plan in enumerate(plans):
        q += plan[0]
        a = max(q, heapq.heappop(free)) + (stalls[i % len(stalls)] if stalls else 0.0)
        released, span_rows = _span_events(f"0-{i}", q, a, plan, truth)
        rows += span_rows
        heapq.heappush(free, released)
    rows.sort(key=lambda r: (r[0], RANK[r[1]]))
    recs = [ev("shard_start", T_START, cap=cap)]
    recs += [ev(name, t, span=sid, id=f"i{sid}", **fields) for t, name, sid, fields in rows]
    recs.append(ev("shard_end", max([r["t"] for r in recs]) + 0.01))
    return recs, truth


logs = st.tuples(st.integers(1, 4), st.lists(span_plan, min_size=1, max_size=25))


@settings(max_examples=60, deadline=None)
@given(logs)
def test_buckets_sum_to_end_to_end(log: tuple[int, list[tuple[Any, ...]]]) -> None:
    """For every span and for the whole log, the six bucket sums equal the e2e sum."""
    recs, _ = simulate(*log)
    spans = {r["span"] for r in recs if "span" in r}
    for sid in spans:
        d = overall(fold_shard([r for r in recs if r.get("span") in (None, sid)]).segments)
        assert math.isclose(sum(d[b].total for b in BUCKETS), d["e2e"].total, abs_tol=1e-6)
    d = overall(fold_shard(recs).segments)
    assert math.isclose(sum(d[b].total for b in BUCKETS), d["e2e"].total, rel_tol=1e-9,
                        abs_tol=1e-6)


@settings(max_examples=60, deadline=None)
@given(logs)
def test_answers_that_came_at_once_have_no_ttft_or_tpot(
        log: tuple[int, list[tuple[Any, ...]]]) -> None:
    """A success whose `attempt_end` says `at_once` counts in every bucket and in e2e, but in
    neither TTFT figure nor TPOT: its first token came with its last. The notes say how many."""
    recs, truth = simulate(*log)
    s = fold_shard(recs)
    d = overall(s.segments)
    assert d["e2e"].n == d["t_first_token"].n == truth.ok
    assert d["ttft"].n == d["ttft_request"].n == truth.first_tokens
    assert d["tpot"].n == truth.tpots
    doc = build_report(RunFacts(run_id="r", run_dir="/", state="finished", state_reason=""),
                       [], [s])
    said = [n for n in doc["notes"] if "came at once" in n]
    at_once = truth.ok - truth.first_tokens
    assert said == ([f"{at_once:,} successful answers that came at once, not token by token "
                     "(a proxy or gateway that buffers streams, a server that ignores stream, "
                     "or a client too busy to read), so their first token is their end: left "
                     "out of ttft, ttft_request and tpot"] if at_once else [])


@settings(max_examples=60, deadline=None)
@given(logs)
def test_minutes_sum_to_completion_tokens(log: tuple[int, list[tuple[Any, ...]]]) -> None:
    """Per-minute TPM over all minutes sums to the tokens of successful spans, minute by minute;
    the refusals among them are counted from their `released` lines, their reasoning tokens
    and estimated token counts from their ok `attempt_end` lines."""
    recs, truth = simulate(*log)
    s = fold_shard(recs)
    assert {m: c.tokens for m, c in s.minutes.items()} == truth.per_minute
    doc = build_report(RunFacts(run_id="r", run_dir="/", state="finished", state_reason=""),
                       [], [s])
    assert sum(r["completion_tokens"] for r in doc["tpm"]["minutes"]) == truth.tokens
    assert s.refusals == doc["items"]["refusals"] == truth.refusals
    assert s.reasoning_tokens == doc["items"]["reasoning_tokens"] == truth.reasoning
    # Estimated: the final ok attempt's `usage_estimated` is true; failed attempts' never count.
    assert {m: (c.estimated_spans, c.estimated_tokens) for m, c in s.minutes.items()
            if c.estimated_spans} == truth.estimated
    spans = sum(n for n, _ in truth.estimated.values())
    tokens = sum(t for _, t in truth.estimated.values())
    assert (doc["items"]["estimated_successes"], doc["items"]["estimated_completion_tokens"],
            doc["tpm"]["estimated_completion_tokens"]) == (spans, tokens, tokens)


@settings(max_examples=60, deadline=None)
@given(logs, st.lists(st.floats(0.0, 0.5), min_size=1, max_size=5))
def test_gap_fraction_is_a_fraction(log: tuple[int, list[tuple[Any, ...]]],
                                    stalls: list[float]) -> None:
    """With admission stalls, 0 <= gap <= backlog; idle stays within the observed time."""
    s = fold_shard(simulate(*log, stalls)[0])
    assert 0.0 <= s.gap_s <= s.backlog_s + 1e-9
    assert 0.0 <= s.idle_s <= s.observed_s + 1e-9


@settings(max_examples=60, deadline=None)
@given(logs)
def test_gap_is_zero_when_slots_fill_at_once(log: tuple[int, list[tuple[Any, ...]]]) -> None:
    """Admitting the moment a slot frees keeps in_flight at the cap whenever work waits."""
    s = fold_shard(simulate(*log)[0])
    assert s.gap_s == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(span_plan, min_size=1, max_size=10))
def test_no_backlog_no_gap(plans: list[tuple[Any, ...]]) -> None:
    """A shard whose cap exceeds its spans never has a backlog: gap_fraction is 0."""
    s = fold_shard(simulate(len(plans), plans)[0])
    doc = build_report(RunFacts(run_id="r", run_dir="/", state="finished", state_reason=""),
                       [], [s])
    assert s.backlog_s == 0.0 and doc["scheduler"]["shards"][0]["gap_fraction"] == 0.0


def _occupancy(log: tuple[int, list[tuple[Any, ...]]],
               stalls: list[float] | None = None) -> tuple[Any, dict[str, Any]]:
    s = fold_shard(simulate(*log, stalls)[0])
    doc = build_report(RunFacts(run_id="r", run_dir="/", state="finished", state_reason=""),
                       [], [s])
    return s, doc["scheduler"]


@settings(max_examples=60, deadline=None)
@given(logs, st.lists(st.floats(0.0, 0.5), min_size=1, max_size=5))
def test_occupancy_is_a_fraction_bounded_by_the_gap(log: tuple[int, list[tuple[Any, ...]]],
                                                   stalls: list[float]) -> None:
    """0 <= occupancy <= 1, and 1 - occupancy <= gap_fraction: a free slot's time is gap time,
    and at most all cap slots are free in it (cap is constant within this log)."""
    s, sch = _occupancy(log, stalls)
    assert 0.0 <= s.busy_slot_s <= s.cap_slot_s + 1e-9
    assert math.isclose(s.cap_slot_s, s.cap * s.backlog_s, rel_tol=1e-9, abs_tol=1e-9)
    if s.backlog_s:
        assert 1 - s.busy_slot_s / s.cap_slot_s <= s.gap_s / s.backlog_s + 1e-9
    for r in (*sch["shards"], sch["overall"]):
        assert 0.0 <= r["occupancy_under_backlog"] <= 1.0
        assert 1 - r["occupancy_under_backlog"] <= r["gap_fraction"] + 2e-6  # both rounded


@settings(max_examples=60, deadline=None)
@given(logs)
def test_occupancy_is_one_when_slots_fill_at_once(log: tuple[int, list[tuple[Any, ...]]]) -> None:
    """in_flight at the cap whenever work waits: every cap slot-second is busy, occupancy 1."""
    s, sch = _occupancy(log)
    assert s.busy_slot_s == s.cap_slot_s
    assert sch["shards"][0]["occupancy_under_backlog"] == 1.0
    assert sch["overall"]["occupancy_under_backlog"] == 1.0


values = st.lists(st.one_of(st.floats(0.0, 3600.0), st.floats(1e-7, 1e-2)), min_size=1,
                  max_size=300)


@settings(max_examples=100, deadline=None)
@given(values)
def test_percentiles_are_monotone_and_close(xs: list[float]) -> None:
    """min <= p50 <= p95 <= p99 <= max, each within the histogram's error of the exact value."""
    d = Dist()
    for x in xs:
        d.add(x)
    st_ = d.stats()
    assert st_ is not None
    assert st_.min <= st_.p50 <= st_.p95 <= st_.p99 <= st_.max == max(xs)
    ordered = sorted(xs)
    for q, got in ((0.5, st_.p50), (0.95, st_.p95), (0.99, st_.p99)):
        exact = ordered[nearest_rank(q, len(xs)) - 1]
        assert abs(got - exact) <= max(REL_ERROR * exact + 1e-12, 1e-6)


@settings(max_examples=50, deadline=None)
@given(values, values)
def test_merged_distributions_equal_one(xs: list[float], ys: list[float]) -> None:
    """Merging two distributions gives exactly what adding all values to one gives."""
    a, b, both = Dist(), Dist(), Dist()
    for x in xs:
        a.add(x)
        both.add(x)
    for y in ys:
        b.add(y)
        both.add(y)
    a.merge(b)
    assert (a.counts, a.n, a.lo, a.hi) == (both.counts, both.n, both.lo, both.hi)
    assert math.isclose(a.total, both.total, rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(values)
def test_batches_bucket_like_single_adds(xs: list[float]) -> None:
    """`Dist.add_many` (sort, then bisect per bucket) counts exactly like `Dist.add`."""
    one, many = Dist(), Dist()
    for x in xs:
        one.add(x)
    many.add_many(list(xs))
    assert (many.counts, many.n, many.lo, many.hi) == (one.counts, one.n, one.lo, one.hi)
    assert math.isclose(many.total, one.total, rel_tol=1e-9, abs_tol=1e-9)

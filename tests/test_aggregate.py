"""The aggregator's numbers on fixtures small enough to check by hand (see the fixtures' doc)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import test_aggregate_fixtures as fixtures
from test_aggregate_fixtures import T0, B, ev, hand_coordinator, hand_shard, steady_shard

from shardrun.aggregate import (
    Dist,
    Pricing,
    RunFacts,
    ShardSummary,
    build_report,
    fold_coordinator,
    fold_shard,
    minute_label,
    parse_minute,
    pricing_from_effective,
    segment_of,
)
from shardrun.aggregate._metrics import client_cpu_section
from shardrun.aggregate._segments import DIST_NAMES, overall
from shardrun.itl import REL_ERROR, bucket_of
from shardrun.report._text import _client_cpu, _peak_lines, format_attempts

M = B // 60  # the minute that starts at B


def _named(summary: ShardSummary) -> dict[str, Dist]:
    return overall(summary.segments)


def _report(shards: list[ShardSummary], coord: list[dict[str, Any]] | None = None,
            pricing: Pricing | None = None) -> dict[str, Any]:
    facts = RunFacts(run_id="fixture-run", run_dir="/x", state="finished", state_reason="test",
                     pricing=pricing)
    return build_report(facts, [fold_coordinator(coord)] if coord else [], shards)


def _shard(name: str = "00") -> ShardSummary:
    summary = fold_shard(hand_shard(), idle_until=T0 + 9.5)
    summary.name = name
    return summary


def test_buckets_of_the_hand_fixture() -> None:
    """s1 = (1, 0, 0.5, 1.5, 2, 1) and s2 = (1, 2, 0.25, 0.75, 3, 1): sums, maxima, TTFTs, TPOT."""
    d = _named(_shard())
    sums = {name: d[name].total for name in DIST_NAMES}
    assert sums == {"t_queue": 2.0, "t_retry": 2.0, "t_conn": 0.75, "t_first_token": 2.25,
                    "t_stream": 5.0, "t_post": 2.0, "ttft": 7.0, "ttft_request": 3.0,
                    "tpot": pytest.approx(2 / 9 + 1), "e2e": 14.0}
    assert (d["e2e"].hi, d["e2e"].lo, d["t_retry"].hi, d["ttft"].hi) == (8.0, 6.0, 2.0, 4.0)
    assert d["itl"].n == 12 and all(d[n].n == 2 for n in DIST_NAMES)


def test_an_answer_sent_whole_has_no_tpot() -> None:
    """A whole (non-streamed) answer's first and last token are one instant: its TPOT is
    unknown, not 0. Mixed with a streamed one, TPOT is the streamed one's alone (s2: 3 s over
    3 tokens after the first); with none streamed, the report has no TPOT at all."""
    mixed = fold_shard(fixtures.whole_answers(fixtures.to_new_layout(hand_shard()), {"0-1"}))
    tpot = _named(mixed)["tpot"]
    assert (tpot.n, tpot.total) == (1, 1.0)
    assert _report([mixed])["latency"]["all"]["tpot"]["mean"] == 1.0
    assert _named(mixed)["t_stream"].n == 2  # the whole answer is still a span, t_stream 0
    none = fold_shard(fixtures.whole_answers(fixtures.to_new_layout(hand_shard()),
                                            {"0-1", "0-2"}))
    assert _report([none])["latency"]["all"]["tpot"] is None


def test_prompt_length_segments() -> None:
    """s1 (20 prompt tokens) is in `<64`, s2 (300) in `256-1023`; edges at powers of four."""
    summary = _shard()
    assert {i: seg.spans for i, seg in summary.segments.items()} == {0: 1, 2: 1}
    assert [segment_of(n, None) for n in (0, 63, 64, 255, 256, 1023, 1024, 4096, 16384, 10**9)] \
        == [0, 0, 1, 1, 2, 2, 3, 4, 5, 5]
    assert segment_of(None, 1200) == 2  # no usage: ceil(chars / 4) = 300 tokens


def test_minutes_of_the_hand_fixture() -> None:
    """s1's 10 tokens count in the minute before B (last token B-1.5), s2's 4 in B's minute."""
    cells = _shard().minutes
    assert {m: (c.tokens, c.spans) for m, c in cells.items()} == {M - 1: (10, 1), M: (4, 1)}


def test_scheduler_integrals_of_the_hand_fixture() -> None:
    """Backlog 6 s, gap 1 s (queue waiting with a free slot during [0, 1)), idle 0.5 s."""
    s = _shard()
    assert (s.backlog_s, s.gap_s, s.idle_s) == (6.0, 1.0, 0.5)
    assert (s.busy_slot_s, s.cap_slot_s) == (10.0, 12.0)  # 0 x 1 s + 2 x 5 s; cap 2 x 6 s
    assert (s.queue_depth, s.in_flight, s.open_spans, s.cap) == (0, 0, 0, 2)
    no_input_end = fold_shard(hand_shard())
    assert no_input_end.idle_s == 1.0  # [9, 10): the coordinator never logged input_end


def _occupancy_shard() -> list[dict[str, Any]]:
    def span(sid: str, name: str, t: float, **fields: Any) -> dict[str, Any]:
        return ev(name, T0 + t, span=sid, id=f"item-{sid}", **fields)

    return [
        ev("shard_start", T0, cap=2, pid=1, version="0", host="fixture-host"),
        *(span(sid, "queued", 0, prompt_chars=8) for sid in ("a", "b", "c")),
        span("a", "admitted", 0), span("b", "admitted", 0),
        span("a", "released", 6, outcome="abandoned", reason=None),
        span("c", "admitted", 10),
        span("b", "released", 11, outcome="abandoned", reason=None),
        span("c", "released", 11, outcome="abandoned", reason=None),
        ev("shard_end", T0 + 11),
    ]


def test_occupancy_under_backlog_is_slot_weighted() -> None:
    """Cap 2; a, b, c queued at 0; a, b admitted at 0; a released at 6; c admitted at 10.

    Queue depth is 1 during [0, 10) and 0 after: backlog_s = 10.
    in_flight is 2 during [0, 6) and 1 during [6, 10): gap_s = 4, gap_fraction = 4 / 10 = 0.4.
    Slot-seconds busy = 2 x 6 + 1 x 4 = 16; cap slot-seconds = 2 x 10 = 20;
    occupancy_under_backlog = 16 / 20 = 0.8, so 1 - 0.8 = 0.2 of the slot time was idle
    (one slot of two for 4 s of 10), half of what gap_fraction's 0.4 suggests.
    """
    s = fold_shard(_occupancy_shard())
    assert (s.backlog_s, s.gap_s, s.busy_slot_s, s.cap_slot_s) == (10.0, 4.0, 16.0, 20.0)
    sch = _report([s])["scheduler"]
    row, over = sch["shards"][0], sch["overall"]
    for r in (row, over):
        assert (r["gap_fraction"], r["occupancy_under_backlog"]) == (0.4, 0.8)
        assert (r["busy_slot_s"], r["cap_slot_s"]) == (16.0, 20.0)


def test_occupancy_is_one_without_backlog() -> None:
    """No queue depth > 0 at all: 0 / 0 slot-seconds reads as 1 (no slot was lost to waiting)."""
    recs = [ev("shard_start", T0, cap=2),
            ev("queued", T0, span="a", id="a", prompt_chars=8),
            ev("admitted", T0, span="a", id="a"),
            ev("released", T0 + 1, span="a", id="a", outcome="abandoned", reason=None)]
    row = _report([fold_shard(recs)])["scheduler"]["shards"][0]
    assert (row["backlog_s"], row["gap_fraction"], row["occupancy_under_backlog"]) == (0, 0, 1.0)


def test_attempt_counters_of_the_hand_fixture() -> None:
    """4 attempts (3 first), 1 retry for conn_reset, 3 wasted tokens, 2 new and 2 reused, 3
    requests sent again (1 + 2: the count, not the lines that have one)."""
    s = _shard()
    assert (s.attempts, s.first_attempts, s.wasted_tokens) == (4, 3, 3)
    assert s.retries == {"conn_reset": 1}
    assert s.by_status == {"conn_reset": 1, "ok": 2, "http_4xx": 1}
    assert (s.new_conns, s.reused_conns, s.ok, s.dead, s.queued) == (2, 2, 2, 1, 3)
    assert s.resent == 3
    assert s.dead_reasons == {"not_retryable_http_4xx": 1}
    assert (s.completion_tokens, s.prompt_tokens, s.cached_tokens) == (12 + 2, 320, 256)
    assert s.reasoning_tokens == 3  # the success's; the failed attempt's 2 are not counted


def test_report_numbers_of_the_hand_fixture() -> None:
    """Rates and fractions of the report document, each worked out in the fixtures' doc."""
    doc = _report([_shard()], hand_coordinator())
    assert doc["items"]["success_rate"] == round(2 / 3, 6)
    att, conn = doc["attempts"], doc["connections"]
    assert (att["retry_rate"], att["attempts_per_success"]) == (round(1 / 3, 6), 2.0)
    assert (conn["churn_per_success"], conn["expected_churn"]) == (1.0, round(2 / 3, 6))
    assert (conn["new"], conn["reused"], conn["resent"]) == (2, 2, 3)
    assert "connections: 2 new, 2 reused, 3 requests sent again" in format_attempts(doc)
    over = doc["scheduler"]["overall"]
    assert (over["gap_fraction"], over["cross_shard_idle_s"]) == (round(1 / 6, 6), 0.5)
    assert over["occupancy_under_backlog"] == round(10 / 12, 6)
    assert over["cross_shard_idle_fraction"] == round(0.5 / 9.5, 6)  # shard seen 9.5 s before
    dom = doc["triage"]["dominant_bucket"]
    assert (dom["bucket"], dom["share"]) == ("t_stream", round(5 / 14, 4))


def test_tpm_table_flags_partial_minutes() -> None:
    """The run lasts B-7 .. B+4: both minutes are partial, there is no peak full minute."""
    tpm = _report([_shard()], hand_coordinator())["tpm"]
    rows = [(r["minute"], r["completion_tokens"], r["partial"]) for r in tpm["minutes"]]
    assert rows == [(minute_label(M - 1), 10, True), (minute_label(M), 4, True)]
    assert tpm["peak_full_minute"] is None and tpm["total_completion_tokens"] == 14
    assert tpm["run_average_tpm"] == round(14 / 11 * 60, 1)


def test_peak_full_minute_and_each_shards_peak() -> None:
    """Shard 00 makes 30 tokens a minute; shard 01 adds 15 in minute M+1, the peak full minute."""
    a = fold_shard(steady_shard(0, B - 30, minutes=3, per_minute=6))
    b = fold_shard(steady_shard(1, B + 59, minutes=1, per_minute=3))
    a.name, b.name = "00", "01"
    tpm = _report([a, b])["tpm"]
    table = {r["minute"]: (r["per_shard"], r["partial"]) for r in tpm["minutes"]}
    assert table[minute_label(M)] == ([30, 0], False)
    assert table[minute_label(M + 1)] == ([30, 15], False)
    assert table[minute_label(M - 1)][1] and table[minute_label(M + 2)][1]
    assert tpm["peak_full_minute"]["minute"] == minute_label(M + 1)
    assert tpm["peak_full_minute"]["completion_tokens"] == 45
    peaks = {p["shard"]: (p["minute"], p["completion_tokens"]) for p in tpm["per_shard_peak"]}
    assert peaks == {"00": (minute_label(M), 30), "01": (minute_label(M + 1), 15)}


def test_a_shard_logs_peak_is_a_minute_it_was_writing_in() -> None:
    """A first pass of 40 s (no full minute of its own), resumed ten minutes later for three:
    the first pass's log claims none of the resume's full minutes as its peak."""
    short = fold_shard(steady_shard(0, B + 5, minutes=1, per_minute=3))
    later = fold_shard(steady_shard(0, B + 600, minutes=3, per_minute=6))
    short.name, later.name, later.segment = "00", "00.r1", 1
    peaks = {p["shard"]: (p["minute"], p["completion_tokens"])
             for p in _report([short, later])["tpm"]["per_shard_peak"]}
    assert peaks["00"] == (None, None)
    assert peaks["00.r1"] == (minute_label(M + 10), 30)
    # The text says so, where it read "00: - at ," (an empty minute and a dash for tokens).
    lines = _peak_lines(_report([short, later])["tpm"])
    at = minute_label(M + 10)[11:]
    assert lines[1] == f"  each shard's own peak: 00: none,  00.r1: 30 at {at}"


def test_minutes_only_mode_gives_the_same_figure() -> None:
    """`verify`'s mode (only last_token, attempt_end, released) counts the same minutes."""
    full, lean = _shard().minutes, fold_shard(hand_shard(), minutes_only=True).minutes
    assert {m: (c.tokens, c.spans) for m, c in lean.items()} == {
        m: (c.tokens, c.spans) for m, c in full.items()}


def test_ok_attempt_without_tokens_counts_at_its_end() -> None:
    """A failed attempt's last_token is not used for a later ok attempt that streamed none."""
    recs = [
        ev("queued", B - 5, span="s", id="i"), ev("admitted", B - 5, span="s", id="i"),
        ev("attempt_start", B - 5, span="s", id="i", attempt=1),
        ev("last_token", B - 4, span="s", id="i", attempt=1, tokens=2),
        ev("attempt_end", B - 4, span="s", id="i", attempt=1, status="timeout_idle"),
        ev("attempt_start", B - 3, span="s", id="i", attempt=2),
        ev("attempt_end", B + 1, span="s", id="i", attempt=2, status="ok", completion_tokens=0),
        ev("released", B + 2, span="s", id="i", outcome="ok"),
    ]
    assert set(fold_shard(recs).minutes) == {M}


def test_odd_logs_are_counted_not_guessed() -> None:
    """A release without its attempt, a span without its queue line, unknown events."""
    recs = [
        ev("released", B, span="x", id="x", outcome="ok"),
        ev("attempt_end", B, span="y", id="y", attempt=1, status="ok", completion_tokens=3),
        ev("released", B + 1, span="y", id="y", outcome="ok"),
        ev("mystery", B + 2),
    ]
    s = fold_shard(recs)
    assert (s.ok_without_attempt, s.ok_incomplete, s.unknown_events, s.ok) == (1, 1, 1, 1)
    assert s.minutes[M].tokens == 3
    notes = _report([s])["notes"]
    assert any("without a successful attempt" in n for n in notes)


def test_attempts_cut_off_by_a_killed_shard_are_noted() -> None:
    """Two attempts started, one ended: the report says one never ended (its shard was killed),
    and which of the two ways it can come about the run summary counts."""
    recs = [ev("shard_start", B, cap=2, pid=1, version="0", host="h")]
    for sid in ("a", "b"):
        recs += [ev("queued", B, span=sid, id=sid), ev("admitted", B, span=sid, id=sid),
                 ev("attempt_start", B, span=sid, id=sid, attempt=1)]
    recs += [ev("attempt_end", B + 1, span="a", id="a", attempt=1, status="ok",
                completion_tokens=3), ev("released", B + 1, span="a", id="a", outcome="ok")]
    doc = _report([fold_shard(recs)])
    assert (doc["attempts"]["started"], doc["attempts"]["by_status"]) == (2, {"ok": 1})
    assert [n for n in doc["notes"] if "never ended" in n] == [
        "1 attempt started and never ended in the log, so they have no status: their shard "
        "was killed or crashed mid-attempt (their items ran again; the run summary counts "
        "these attempts too, from the shard's last report), or could not write the rest of its "
        "log (a full disk; the run summary, counted from the shards' reports, counts those as "
        "well)"]


def test_restart_abandons_open_spans() -> None:
    """A second shard_start (a resumed process) drops open spans and restarts the step function."""
    recs = [ev("shard_start", B, cap=1), ev("queued", B, span="a", id="a"),
            ev("admitted", B + 1, span="a", id="a"), ev("shard_start", B + 5, cap=3),
            ev("queued", B + 6, span="a", id="a"), ev("admitted", B + 6, span="a", id="a")]
    s = fold_shard(recs)
    assert (s.lost_at_restart, s.starts, s.cap, s.in_flight, s.queue_depth) == (1, 2, 3, 1, 0)
    assert s.backlog_s == 1.0  # [B, B+1) only; nothing is integrated across the restart


def test_dist_quantiles_are_clamped_and_bounded() -> None:
    """Histogram quantiles stay within ±4.4 % and never leave the exact [min, max]."""
    d = Dist()
    for x in (0.1, 0.2, 0.3, 0.4, 10.0):
        d.add(x)
    st = d.stats()
    assert st is not None
    assert st.max == 10.0 and st.min == 0.1 and st.n == 5 and st.sum == pytest.approx(11.0)
    assert abs(st.p50 - 0.3) <= REL_ERROR * 0.3 and st.p99 == 10.0
    one = Dist()
    one.add(1.0)
    assert one.quantile(0.5) == one.quantile(0.99) == 1.0  # the bucket mid is clamped
    assert Dist().stats() is None


def test_dist_add_matches_itl_buckets() -> None:
    """`Dist.add` inlines `itl.bucket_of`; both must put every value in the same bucket."""
    for x in (0.0, 5e-7, 1e-6, 1.5e-6, 0.001, 0.0123, 1.0, 2.0, 61.7, 3600.0, -1.0):
        d = Dist()
        d.add(x)
        assert list(d.counts) == [bucket_of(x)]
    with pytest.raises(OverflowError):
        Dist().add(math.inf)


def test_minute_labels_round_trip() -> None:
    """`YYYY-MM-DDTHH:MMZ` labels parse back to their minute; other text is refused."""
    assert minute_label(M) == "2027-01-15T08:00Z" and parse_minute("2027-01-15T08:00Z") == M
    with pytest.raises(ValueError, match="not a minute"):
        parse_minute("2027-01-15 08:00")


def test_cost_from_manifest_prices() -> None:
    """Prices from `effective` (value/source entries): 320 prompt tokens at 1/1M and 14 + 3
    completion+wasted at 2/1M = 0.000354, over 2 successes = 0.000177 each."""
    effective = {"pricing.input_per_1m": {"value": 1.0, "source": "job file"},
                 "pricing.output_per_1m": {"value": 2.0, "source": "job file"},
                 "pricing.hourly": {"value": None, "source": "default"}}
    pricing = pricing_from_effective(effective)
    cost = _report([_shard()], hand_coordinator(), pricing=pricing)["cost"]
    assert cost["basis"] == "tokens" and cost["spend"] == pytest.approx(0.000354)
    assert cost["cost_per_success"] == pytest.approx(0.000177)
    assert cost["wasted_cost"] == pytest.approx(0.000006)
    assert pricing_from_effective({}) is None
    assert _report([_shard()])["cost"] is None


def test_cost_prices_cached_prompt_tokens_apart() -> None:
    """256 of the 320 prompt tokens were cached: 64 at 1/1M + 256 at 0.5/1M + 17 at 2/1M =
    0.000226. Without a cached price they cost the input rate (0.000354, as above)."""
    prices = {"pricing.input_per_1m": 1.0, "pricing.output_per_1m": 2.0}
    cached_price = pricing_from_effective({**prices, "pricing.cached_input_per_1m": 0.5})
    doc = _report([_shard()], hand_coordinator(), pricing=cached_price)
    assert doc["items"]["cached_tokens"] == 256 and doc["cost"]["cached_tokens"] == 256
    assert doc["cost"]["spend"] == pytest.approx(0.000226)
    assert doc["cost"]["input_cost"] == pytest.approx(0.000192)
    plain = _report([_shard()], hand_coordinator(), pricing=pricing_from_effective(prices))
    assert plain["cost"]["spend"] == pytest.approx(0.000354)


def test_client_limited_label_follows_loop_lag() -> None:
    """p99 loop lag of 80 ms (over the 50 ms limit) labels the run client-limited."""
    calm = _report([_shard()])
    assert calm["loop_lag"]["client_limited"] is False
    # 1 dead letter of 3 ended spans, 1 retry / 3 firsts
    assert [f["id"] for f in calm["triage"]["findings"]] == ["dead_letters", "retries"]
    recs = [*hand_shard()[:-1], *(ev("loop_lag", T0 + 9.6, lag=0.08) for _ in range(3))]
    busy = _report([fold_shard(recs)])
    assert busy["loop_lag"]["client_limited"] is True
    assert [f["id"] for f in busy["triage"]["findings"]] == ["dead_letters", "client_limited",
                                                            "retries"]


def _lat(ft: tuple[float, float], tpot: tuple[float, float]) -> dict[str, Any]:
    names = ("t_queue", "t_retry", "t_conn", "t_first_token", "t_stream", "t_post")
    dists: dict[str, Any] = {n: {"p50": 1.0, "p99": 1.0} for n in (*names, "tpot")}
    dists["t_first_token"] = {"p50": ft[0], "p99": ft[1]}
    dists["tpot"] = {"p50": tpot[0], "p99": tpot[1]}
    return {"all": dists, "by_prompt_length": [], "bucket_share": dict.fromkeys(names, 0.1)}


def test_ttft_tail_signature() -> None:
    """p99/p50 of t_first_token 5 with TPOT p99/p50 1.5 is the signature; TPOT 3 is not."""
    from shardrun.aggregate._triage import ttft_tail

    seen = ttft_tail(_lat((0.1, 0.5), (0.01, 0.015)))
    assert seen["present"] and seen["evidence"]["t_first_token_p99_over_p50"] == 5.0
    assert "lower concurrency" in seen["control"]
    assert not ttft_tail(_lat((0.1, 0.5), (0.01, 0.03)))["present"]
    assert not ttft_tail(_lat((0.1, 0.2), (0.01, 0.015)))["present"]


def test_idle_gap_signature() -> None:
    """gap_fraction 0.2 on shard 01 is the signature, with that shard named as the worst."""
    from shardrun.aggregate._triage import idle_gaps

    rows = [{"shard": "00", "stall_gap_fraction": 0.0}, {"shard": "01", "stall_gap_fraction": 0.4}]
    over = {"gap_fraction": 0.2, "stall_gap_fraction": 0.2, "rate_limited_gap_s": 0.0,
            "gap_s": 2.0, "backlog_s": 10.0, "cross_shard_idle_s": 0.0,
            "cross_shard_idle_fraction": 0.0}
    seen = idle_gaps({"shards": rows, "overall": over})
    assert seen["present"] and seen["evidence"]["worst_shard"] == "01"
    assert "scheduler" in seen["meaning"]
    idle = idle_gaps({"shards": rows, "overall": {**over, "stall_gap_fraction": 0.0,
                                                  "cross_shard_idle_s": 3.0,
                                                  "cross_shard_idle_fraction": 0.3}})
    assert idle["present"] and "unassigned work" in idle["meaning"]
    limited = idle_gaps({"shards": rows, "overall": {**over, "stall_gap_fraction": 0.01}})
    assert not limited["present"]  # a gap that is our own rate limit is not a stall


def test_idle_gaps_need_a_second_of_time() -> None:
    """A tiny run's backlog of milliseconds, all of it gap, is no finding; the same fractions
    with a second or more behind them are. The rate-limited part of the gap does not count."""
    from shardrun.aggregate._triage import MIN_GAP_S, idle_gaps

    rows = [{"shard": "00", "stall_gap_fraction": 1.0}]
    tiny = {"gap_fraction": 1.0, "stall_gap_fraction": 1.0, "rate_limited_gap_s": 0.0,
            "gap_s": 0.0006, "backlog_s": 0.0006, "cross_shard_idle_s": 0.013,
            "cross_shard_idle_fraction": 1.0}
    found = idle_gaps({"shards": rows, "overall": tiny})
    assert not found["present"] and found["evidence"]["min_s"] == MIN_GAP_S
    gap = {**tiny, "gap_s": MIN_GAP_S, "backlog_s": MIN_GAP_S}
    assert idle_gaps({"shards": rows, "overall": gap})["present"]
    rate_held = {**gap, "gap_s": MIN_GAP_S + 0.5, "rate_limited_gap_s": 0.6}
    assert not idle_gaps({"shards": rows, "overall": rate_held})["present"]
    idle = idle_gaps({"shards": rows, "overall": {**tiny, "cross_shard_idle_s": MIN_GAP_S}})
    assert idle["present"] and "unassigned work" in idle["meaning"]


def test_rate_waits_are_not_stalls() -> None:
    """s1 waits 0.75 s for our rate limit before its admission at 1 (a slot held, so gap time):
    of the 1 s gap, 0.75 s is our own limit and 0.25 s a stall. s2 waits 0.25 s before its
    second attempt, which is t_retry, not gap."""
    recs = hand_shard()
    at = next(i for i, r in enumerate(recs) if r["ev"] == "admitted")
    recs.insert(at, ev("rate_wait", T0 + 0.25, span="0-1", id="item-0-1", attempt=1, wait=0.75))
    at = next(i for i, r in enumerate(recs) if r["ev"] == "retry")
    recs.insert(at + 1, ev("rate_wait", T0 + 2.75, span="0-2", id="item-0-2", attempt=2,
                           wait=0.25))
    s = fold_shard(recs, idle_until=T0 + 9.5)
    assert (s.rate_waits, s.rate_wait_first_s, s.rate_wait_retry_s) == (2, 0.75, 0.25)
    sch = _report([s])["scheduler"]
    over = sch["overall"]
    assert (over["gap_fraction"], over["rate_limited_gap_s"]) == (round(1 / 6, 6), 0.75)
    assert over["stall_gap_fraction"] == round(0.25 / 6, 6)
    assert sch["rate_waits"] == {"count": 2, "before_admission_s": 0.75,
                                 "before_retries_s": 0.25}


def test_rate_waits_judged_as_a_share_of_slot_time_under_backlog() -> None:
    """The rate-limit finding weighs waits before admission (each holds a slot while its span
    is queued) against the slot-seconds under backlog: 5 % is a finding, but only from half on
    did the rate limit, not the cap, hold the backlog, and its advice replaces the cap's."""
    from shardrun.aggregate._triage import TABLE, triage_section

    recs = hand_shard()
    at = next(i for i, r in enumerate(recs) if r["ev"] == "admitted")
    recs.insert(at, ev("rate_wait", T0 + 0.25, span="0-1", id="item-0-1", attempt=1, wait=0.75))
    doc = _report([fold_shard(recs, idle_until=T0 + 9.5)])
    doc["latency"]["bucket_share"] = {**doc["latency"]["bucket_share"], "t_queue": 0.9}

    slots = doc["scheduler"]["overall"]["cap_slot_s"]
    assert slots == 12.0  # cap 2 over 6 s of backlog

    def triage(waited: float) -> tuple[float | None, str]:
        doc["scheduler"]["rate_waits"]["before_admission_s"] = waited
        seen = triage_section(doc)
        found = {f["id"]: f["evidence"] for f in seen["findings"]}
        share = found["rate_limited"]["share_of_slot_time"] if "rate_limited" in found else None
        return share, seen["dominant_bucket"]["control"]

    assert triage(0.75) == (0.0625, TABLE["t_queue"][1])  # the fixture's own wait
    assert triage(0.5) == (None, TABLE["t_queue"][1])  # 4.2 %: no finding
    assert triage(6.0) == (0.5, TABLE["rate_limit"][1])
    assert triage(13.0) == (1.0, TABLE["rate_limit"][1])


def test_many_dead_letters_come_first_among_the_findings() -> None:
    """The dominant bucket describes successes only: when 5 % or more of the ended spans are
    dead letters, triage says so first, with their commonest reasons."""
    from shardrun.aggregate._triage import triage_section

    doc = _report([_shard()])  # 2 ok, 1 dead letter
    first = triage_section(doc)["findings"][0]
    assert (first["id"], first["evidence"]) == ("dead_letters", {
        "dead": 1, "share": round(1 / 3, 6), "reasons": {"not_retryable_http_4xx": 1}})
    doc["items"]["succeeded"] = 20  # 1 of 21: under 5 %
    assert "dead_letters" not in {f["id"] for f in triage_section(doc)["findings"]}


def test_abandoned_spans_are_neither_ok_nor_dead() -> None:
    """`released` with outcome abandoned (no line; redone on resume) is counted apart."""
    recs = [ev("queued", B, span="a", id="a"), ev("admitted", B, span="a", id="a"),
            ev("released", B + 1, span="a", id="a", outcome="abandoned", reason="stop")]
    s = fold_shard(recs)
    assert (s.abandoned, s.dead, s.ok, s.open_spans) == (1, 0, 0, 0)
    assert _report([s])["items"]["success_rate"] is None


def _coordinator_with_cpu(cpu: object) -> list[dict[str, Any]]:
    """The hand fixture's coordinator log, its `run_end` recording `client_cpu_s`."""
    *rest, end = hand_coordinator()
    return [*rest, {**end, "client_cpu_s": cpu}]


def test_a_pass_that_could_not_know_its_cpu_gives_the_reason_its_summary_gave() -> None:
    """A `run_end` with no CPU time and the reason (shards no shardrun process reaped): the
    report says it, alone or beside the passes that recorded theirs, and beside a pass that
    did not end cleanly (which gives none)."""
    why = "no shardrun process reaped shard 0, so their CPU time is not known"
    *rest, end = hand_coordinator()
    unknown = [*rest, {**end, "client_cpu_s": None, "client_cpu_unknown": why}]
    cpu = _report([_shard()], unknown)["client_cpu"]
    assert (cpu["cpu_s"], cpu["unknown"]) == (None, [why])
    assert _client_cpu(cpu) == f"unknown: {why}"
    facts = RunFacts(run_id="r", run_dir="/x", state="finished", state_reason="test")
    passes = [fold_coordinator(_coordinator_with_cpu(2.2)), fold_coordinator(unknown),
              fold_coordinator(rest)]
    partial = build_report(facts, passes, [_shard()])["client_cpu"]
    assert _client_cpu(partial) == (f"2.2 s in 1 of 3 passes ({why}; a pass that did not end "
                                    "cleanly records none)")
    assert _client_cpu(_report([_shard()], rest)["client_cpu"]) == (
        "not in the log (no pass recorded it at its run_end)")


def test_client_cpu_comes_from_each_pass_run_end() -> None:
    """2.2 CPU-s over the log's 4 attempts, 14 completion tokens and the run's 11 s (T0 - 0.5 to
    T0 + 10.5); a second pass with nothing recorded keeps the sum but drops the ratios, which
    would understate the cost; a value that is not a CPU time counts as not recorded."""
    cpu = _report([_shard()], _coordinator_with_cpu(2.2))["client_cpu"]
    assert cpu == {"passes": 1, "passes_recorded": 1, "unknown": [], "cpu_s": 2.2,
                   "ms_per_attempt": 550.0, "s_per_1k_completion_tokens": round(2200 / 14, 5),
                   "cores": 0.2}
    facts = RunFacts(run_id="r", run_dir="/x", state="finished", state_reason="test")
    passes = [fold_coordinator(_coordinator_with_cpu(2.2)), fold_coordinator(hand_coordinator())]
    partial = build_report(facts, passes, [_shard()])["client_cpu"]
    assert (partial["passes"], partial["passes_recorded"], partial["cpu_s"]) == (2, 1, 2.2)
    assert partial["ms_per_attempt"] is partial["cores"] is None
    # A window under 5 s gives no cores: start-up CPU before it opens would read as more cores
    # than the machine has.
    one = [fold_coordinator(_coordinator_with_cpu(2.2))]
    assert client_cpu_section(one, 4, 14, 4.9)["cores"] is None
    assert client_cpu_section(one, 4, 14, 5.0)["cores"] == 0.44
    for odd in (None, True, -1.0, "2.2"):
        none = _report([_shard()], _coordinator_with_cpu(odd))["client_cpu"]
        assert (none["passes_recorded"], none["cpu_s"], none["ms_per_attempt"]) == (0, None, None)

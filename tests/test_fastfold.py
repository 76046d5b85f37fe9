"""The C fold (`aggregate._fast`) computes what the Python fold computes, or hands the file back.

The Python fold (`ShardFold` fed by `report._scan`) is the reference. For every log here both
folds read the same bytes; the C fold must either raise `Fallback` or produce the same
`ShardSummary`: every count, dict, minute cell (with its line hash), scheduler integral and
histogram bucket exactly, and each distribution's float total to rounding (it sums in arrival
order, the reference in sorted batches). Real runs and generated logs in today's layout must
not fall back at all; mutated lines may, but must never give a different answer.
"""

from __future__ import annotations

import math
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import FAST_SIM, run_cli, write_input, write_job
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_aggregate_fixtures import (
    _end,
    _span,
    ev,
    hand_shard,
    to_new_layout,
    to_old_layout,
    whole_answers,
    write_log,
)
from test_aggregate_props import logs, simulate

from shardrun.aggregate import MINUTES_ONLY_EVENTS, ShardFold, ShardSummary
from shardrun.aggregate import _fast as fast
from shardrun.aggregate._dist import Dist
from shardrun.aggregate._segments import overall
from shardrun.report._rundir import FoldOptions, fold_shard_file
from shardrun.report._scan import FileScan, scan_file

MODES = [pytest.param(False, False, id="full"), pytest.param(True, True, id="minutes+lines")]


@pytest.fixture(autouse=True)
def _built() -> None:
    if fast._fastfold is None:
        if os.environ.get("CI"):
            pytest.fail("the C fold (shardrun/aggregate/_fastfold.c) was not built by the "
                        "install: is a C compiler with Python's headers there?")
        pytest.skip("the C fold is not built here (no C compiler at install time)")


def python_fold(path: Path, minutes_only: bool, keep_lines: bool, cap: int = 0,
                idle_until: float = math.inf) -> tuple[FileScan, ShardSummary]:
    fold = ShardFold(idle_until=idle_until, cap=cap, minutes_only=minutes_only,
                     keep_lines=keep_lines)
    scan = scan_file(path, "log", fold.handlers, MINUTES_ONLY_EVENTS if minutes_only else None)
    return scan, fold.finish()


def c_fold(path: Path, minutes_only: bool, keep_lines: bool, cap: int = 0,
           idle_until: float = math.inf) -> tuple[FileScan, ShardSummary]:
    folder = fast.FastShardFold(idle_until=idle_until, cap=cap, minutes_only=minutes_only,
                                keep_lines=keep_lines)
    scan = scan_file(path, "log", {}, folder=folder)
    return scan, folder.finish()


def _dist(d: Dist) -> tuple[Any, ...]:
    return sorted(d.counts.items()), d.n, d.lo, d.hi


def view(s: ShardSummary) -> tuple[dict[str, Any], list[float]]:
    """Everything exact, and the distribution totals apart (compared to rounding)."""
    exact = {name: getattr(s, name) for name in ShardSummary.__slots__
             if name not in ("loop_lag", "segments", "minutes", "trace")}
    exact["minutes"] = dict(s.minutes)
    exact["loop_lag"] = _dist(s.loop_lag)
    totals = [s.loop_lag.total]
    segments = {}
    for i, seg in s.segments.items():
        seg.flush()
        segments[i] = (seg.spans, [_dist(d) for d in seg.dists], seg.itl)
        totals += [d.total for d in seg.dists]
    exact["segments"] = segments
    return exact, totals


def assert_same(ref: tuple[FileScan, ShardSummary], got: tuple[FileScan, ShardSummary]) -> None:
    assert ref[0].as_dict() == got[0].as_dict()
    (ref_exact, ref_totals), (got_exact, got_totals) = view(ref[1]), view(got[1])
    assert ref_exact == got_exact
    assert got_totals == pytest.approx(ref_totals, rel=1e-12, abs=1e-12)


def both(path: Path, minutes_only: bool, keep_lines: bool, **kw: Any) -> None:
    """The C fold does not fall back and agrees with the reference."""
    assert_same(python_fold(path, minutes_only, keep_lines, **kw),
                c_fold(path, minutes_only, keep_lines, **kw))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run on the simulator with 5xx, 429 and dropped streams (retries, waste, dead
    letters) under a job-wide rate limit (rate waits)."""
    root = tmp_path_factory.mktemp("fast")
    write_input(root / "input.jsonl", 400)
    # 15 % 500s at two attempts for dead letters: the 429s are held, never dead-lettered.
    # Retry-After 0.05 s, not the simulator's 1 s: each 429 held its shard's requests for 1 s
    # (the job-wide limit waits it out), and the run took 11 s where 2 do.
    sim = {**FAST_SIM, "fail_500": 0.15, "fail_429": 0.03, "retry_after_s": 0.05,
           "drop_mid_stream": 0.03, "cached_tokens": 3, "refusal": 0.2, "reasoning_tokens": 2}
    write_job(root / "job.yaml", shards=2, concurrency=8,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim},
              retry={"backoff_s": 0.01, "backoff_max_s": 0.05, "max_attempts": 2},
              rate_limits={"rpm": 15_000})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=root)
    assert done.returncode in (0, 1), done.stderr
    return root / "runs" / "r1"


@pytest.mark.parametrize(("minutes_only", "keep_lines"), MODES)
def test_real_run(real_run: Path, minutes_only: bool, keep_lines: bool) -> None:
    files = sorted((real_run / "events").glob("shard-*.jsonl"))
    assert len(files) == 2
    for path in files:
        both(path, minutes_only, keep_lines, cap=8, idle_until=math.inf)
    text = b"".join(p.read_bytes() for p in files)
    # the run exercised what the C fold must get right
    for needle in (b'"ev":"retry"', b'"why":"rate_limited"', b'"outcome":"dead"',
                   b'"wasted_tokens":', b'"reused":true', b'"ev":"rate_wait"',
                   b'"ev":"loop_lag"', b'"cached_tokens":3', b'"reason":"refusal"',
                   b'"reasoning_tokens":2'):
        assert needle in text


def with_limit_holds(records: list[dict[str, Any]], every: int) -> list[dict[str, Any]]:
    """Every `every`-th failed attempt made a 429, as a shard logs it: the attempt_end's status
    and a retry of cause http_429; two of three such retries held for the server's rate limit
    (`rate_limited`, then a `rate_learned` line, its pace now a float, now an integer, of
    requests, of tokens or both, set from a stated limit or cut, or a re-split of either over
    the shards now live, `resplit`), the third retried on a backoff as before holds were (no
    hold)."""
    out: list[dict[str, Any]] = []
    failed = 0
    refused: dict[tuple[str, int], bool] = {}  # (span, attempt) answered 429: held?
    for rec in records:
        if rec["ev"] == "attempt_end" and rec.get("status") == "http_5xx":
            failed += 1
            if failed % every == 0:
                rec = {**rec, "status": "http_429"}
                refused[rec["span"], rec["attempt"]] = failed // every % 3 != 0
        held = refused.get((rec.get("span"), rec.get("attempt")))
        if rec["ev"] == "retry" and held is not None:
            if not held:
                rec = {**rec, "cause": "http_429"}
            else:
                out.append({**rec, "cause": "http_429", "why": "rate_limited"})
                pace = failed if failed % 2 else round(rec["t"] % 7 + 0.25, 4)
                kinds = ({"rps": pace}, {"tps": pace * 100}, {"rps": pace, "tps": 3 * pace,
                         "seeded": True}, {"tps": pace, "seeded": True},
                         {"rps": pace, "seeded": True, "resplit": True},
                         {"tps": pace, "resplit": True})  # fmt: skip
                rec = ev("rate_learned", rec["t"], **kinds[len(out) % len(kinds)])
        out.append(rec)
    return out


@settings(max_examples=40, deadline=None)
@given(log=logs, minutes_only=st.booleans(), every=st.integers(1, 3))
def test_generated_logs(log: tuple[int, list[tuple[Any, ...]]], minutes_only: bool,
                        every: int) -> None:
    records, _ = simulate(*log)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard-00.jsonl"
        write_log(path, with_limit_holds(to_new_layout(records), every), checkpoint_every=7)
        both(path, minutes_only, minutes_only, cap=log[0], idle_until=records[-1]["t"] - 0.5)


def test_limit_holds_are_counted_once_per_item_by_both_folds(tmp_path: Path) -> None:
    """The generator above makes what the folds must count: items held more than once, 429s
    retried without a hold (an older log's, no hold), and paces learned, the last of which
    stands; a re-split sets the pace but is counted as no seed or cut."""
    failures = [[(0.1, 0.1), (0.2, 0.1), (0.3, 0.1)], [(0.4, 0.1)], [(0.5, 0.1), (0.6, 0.1)], [],
                [(0.7, 0.1), (0.8, 0.1)], [(0.9, 0.1), (1.0, 0.1), (1.1, 0.1)]]
    records, _ = simulate(2, [(0.1, f, 0.01, True, 0.1, 0.2, 0.01, 5, False) for f in failures])
    path = tmp_path / "shard-00.jsonl"
    held = with_limit_holds(to_new_layout(records), 1)
    write_log(path, held)
    holds = [r for r in held if r["ev"] == "retry" and r.get("why") == "rate_limited"]
    spans = {r["span"] for r in holds}
    paces = [r for r in held if r["ev"] == "rate_learned"]
    learned = [r for r in paces if not r.get("resplit")]
    seeds = sum(bool(r.get("seeded")) for r in learned)
    unheld = sum(r["ev"] == "retry" and r.get("why") != "rate_limited" for r in held)
    assert len(holds) > len(spans) > 0 and unheld > 0 and len(paces) == len(holds)  # premise
    assert 0 < seeds < len(learned) < len(paces) and any("rps" not in r for r in paces)
    assert {bool(r.get("seeded")) for r in paces if r.get("resplit")} == {True, False}
    assert all(r["cause"] == "http_429" for r in held if r["ev"] == "retry")
    last = paces[-1]
    for fold in (python_fold, c_fold):
        got = fold(path, False, False, cap=2)[1]
        assert (got.held_retries, got.limited_spans, got.learned_cuts, got.learned_seeds) == (
            len(holds), len(spans), len(learned) - seeds, seeds), fold.__name__
        assert (got.learned_rps, got.learned_tps, got.learned_seeded) == (
            last.get("rps"), last.get("tps"), bool(last.get("seeded"))), fold.__name__
        assert got.retries == {"http_429": len(holds) + unheld}, fold.__name__


# Values a mutated field may take: each a different type, spelling or edge of the grammar.
ODD_VALUES = [b"null", b"true", b"false", b"0", b"-0", b"1", b"2", b"-3", b"1.5", b"1e3",
              b"1E400", b"00", b"1.", b'""', b'"ok"', b'"dead"', b'"x\\"y"', b'"\\u00e9"',
              '"é"'.encode(), b'"\xff"', b'"a\\u0000b"', b"{}", b"[]", b'{"1":2}',
              b'{"-0":1}', b'{"3":1,"3":2}', b"1790000000.5", b" 1", b"nul"]


def _mutations() -> st.SearchStrategy[tuple[str, int, int, bytes]]:
    return st.tuples(st.sampled_from(["value", "overwrite", "append"]), st.integers(0, 10_000),
                     st.integers(0, 10_000),
                     st.one_of(st.sampled_from(ODD_VALUES), st.binary(max_size=4)))


def _mutate(data: bytes, kind: str, line_no: int, at: int, new: bytes) -> bytes:
    """One line changed: the value after its `at`-th colon replaced by `new` ("value"),
    bytes overwritten from offset `at` ("overwrite"), or `new` added at its end ("append")."""
    lines = data.split(b"\n")
    i = line_no % (len(lines) - 1)
    line = lines[i]
    colons = [k for k, c in enumerate(line) if c == ord(":")]
    if kind == "value" and colons:
        start = colons[at % len(colons)] + 1
        end = start
        depth = 0
        while end < len(line):  # to the end of this value
            c = line[end:end + 1]
            if c == b"{":
                depth += 1
            elif c == b"}":
                if depth == 0:
                    break
                depth -= 1
            elif c == b"," and depth == 0:
                break
            end += 1
        lines[i] = line[:start] + new + line[end:]
    elif kind == "append":
        lines[i] = line + new
    else:
        k = at % max(len(line), 1)
        lines[i] = line[:k] + new + line[k + len(new):]
    return b"\n".join(lines)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutation=_mutations(), minutes_only=st.booleans(), seed=st.integers(0, 3))
def test_a_mutated_line_never_gives_a_different_answer(mutation: tuple[str, int, int, bytes],
                                                       minutes_only: bool, seed: int) -> None:
    records, _ = simulate(2, _plans(seed))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard-00.jsonl"
        write_log(path, to_new_layout(records), checkpoint_every=9)
        path.write_bytes(_mutate(path.read_bytes(), *mutation))
        ref = python_fold(path, minutes_only, minutes_only, cap=2)
        try:
            got = c_fold(path, minutes_only, minutes_only, cap=2)
        except fast.Fallback:
            return  # handed back: the Python fold's answer is the one used
        assert ref[0].bad_lines == 0  # a line the reference could not read never passes
        assert_same(ref, got)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutation=_mutations(), minutes_only=st.booleans())
def test_a_mutated_line_of_a_real_run_never_gives_a_different_answer(
        real_run: Path, mutation: tuple[str, int, int, bytes], minutes_only: bool) -> None:
    head = b"".join((real_run / "events" / "shard-00.jsonl").open("rb").readlines()[:600])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "shard-00.jsonl"
        path.write_bytes(_mutate(head, *mutation))
        ref = python_fold(path, minutes_only, minutes_only, cap=8)
        try:
            got = c_fold(path, minutes_only, minutes_only, cap=8)
        except fast.Fallback:
            return
        assert ref[0].bad_lines == 0
        assert_same(ref, got)


def _plans(seed: int) -> list[tuple[Any, ...]]:
    rnd = random.Random(seed)
    plans = []
    for _ in range(12):
        failures = [(rnd.uniform(0.01, 0.5), rnd.uniform(0.001, 0.5))
                    for _ in range(rnd.randint(0, 1))]
        plans.append((rnd.uniform(0, 0.5), failures, rnd.uniform(0, 0.05), rnd.random() < 0.5,
                      rnd.uniform(0.001, 0.5), rnd.uniform(0, 1), rnd.uniform(1e-4, 0.05),
                      rnd.randint(1, 40), rnd.random() < 0.2))
    return plans


def test_the_older_layout_falls_back_and_the_python_fold_answers(tmp_path: Path) -> None:
    path = tmp_path / "events" / "shard-00.jsonl"
    write_log(path, to_old_layout(hand_shard()))
    with pytest.raises(fast.Fallback):
        c_fold(path, False, False)
    opts = FoldOptions()
    scan, summary = fold_shard_file(path, "events/shard-00.jsonl", math.inf, 0, opts)
    ref_scan, ref = python_fold(path, False, False)
    assert summary.ok == ref.ok > 0 and scan.as_dict()["lines"] == ref_scan.lines
    assert view(summary)[0] | {"name": "", "segment": 0} == view(ref)[0]


def test_an_unreadable_line_falls_back_and_is_counted_as_before(tmp_path: Path) -> None:
    path = tmp_path / "events" / "shard-00.jsonl"
    write_log(path, to_new_layout(hand_shard()))
    lines = path.read_bytes().split(b"\n")
    lines[3] = b"{not json"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(fast.Fallback):
        c_fold(path, False, False)
    scan, _ = fold_shard_file(path, "events/shard-00.jsonl", math.inf, 0, FoldOptions())
    assert scan.bad_lines == 1 and scan.first_bad == ["line 4: not valid JSON"]


def test_refusals_are_read_off_released_lines_and_escapes_fall_back(tmp_path: Path) -> None:
    """An ok `released` line with reason "refusal" counts a refusal in both folds; the same
    word spelled with an escape goes to the reference, which reads it the same."""
    path = tmp_path / "shard-00.jsonl"
    records = to_new_layout(hand_shard())
    ok = [r for r in records if r["ev"] == "released" and r.get("outcome") == "ok"]
    assert len(ok) >= 2
    ok[0]["reason"] = "refusal"
    write_log(path, records)
    for minutes_only in (False, True):
        both(path, minutes_only, minutes_only)
    assert c_fold(path, False, False)[1].refusals == 1
    path.write_bytes(path.read_bytes().replace(b'"refusal"', b'"refus\\u0061l"'))
    with pytest.raises(fast.Fallback):
        c_fold(path, False, False)
    assert python_fold(path, False, False)[1].refusals == 1


def test_an_answer_sent_whole_has_no_tpot_in_either_fold(tmp_path: Path) -> None:
    """s1 answered whole (one content chunk, first token at its last): no TPOT from it, in the
    C fold as in the reference; s2's streamed one (3 s over 3 tokens) is the only one."""
    path = tmp_path / "shard-00.jsonl"
    write_log(path, whole_answers(to_new_layout(hand_shard()), {"0-1"}))
    both(path, False, False)
    summary = c_fold(path, False, False)[1]
    tpot = overall(summary.segments)["tpot"]
    assert (tpot.n, tpot.total) == (1, 1.0)


def test_unknown_events_are_counted_like_the_reference(tmp_path: Path) -> None:
    path = tmp_path / "shard-00.jsonl"
    records = to_new_layout(hand_shard())
    records.insert(3, {**records[2], "ev": "from_the_future", "t": records[2]["t"]})
    write_log(path, records)
    for minutes_only in (False, True):
        both(path, minutes_only, minutes_only)
    assert c_fold(path, False, False)[0].unknown_events == 1


def test_a_lifted_rate_cap_is_a_known_event_in_both_folds(tmp_path: Path) -> None:
    """A shard whose stated rate limit stopped binding writes `rate_uncapped` (lifted, then put
    back), as `Shard` does: an event of this version, so neither fold counts it as a line from a
    newer one (`report` would note it in every shard log of such a run), and they agree."""
    path = tmp_path / "shard-00.jsonl"
    records = to_new_layout(hand_shard())
    t = records[2]["t"]
    for at, lifted in ((3, True), (5, False)):
        records.insert(at, ev("rate_uncapped", t, kind="requests", stated=1200, lifted=lifted))
    write_log(path, records)
    for minutes_only in (False, True):
        both(path, minutes_only, minutes_only)
    assert python_fold(path, False, False)[1].unknown_events == 0
    assert c_fold(path, False, False)[1].unknown_events == 0


def test_an_attempt_a_stop_cancelled_is_an_attempt_and_no_verdict(tmp_path: Path) -> None:
    """A stop cut the last item's attempt short mid-stream (status `cancelled`, with the tokens
    it had received) and released the span `abandoned`: both folds count the attempt (started,
    `by_status`, its connection and wasted tokens), the span as abandoned, and nothing of it as
    a success, a failure, a latency or a token minute, as for the item that failed instead."""
    records = hand_shard()
    at = next(i for i, r in enumerate(records)
              if r["ev"] == "attempt_end" and r["span"] == "0-3")
    records[at:at + 2] = [  # its 400 and dead letter become a stream a stop cut
        _span("0-3", "first_token", 7, attempt=1),
        _span("0-3", "last_token", 8, attempt=1, tokens=5),
        _end("0-3", 9, 1, "cancelled", http=200, wasted_tokens=5, completion_tokens=5,
             error="cancelled by a stop after 5 tokens"),
        _span("0-3", "released", 9, outcome="abandoned",
              reason="the stop's grace period ended"),
    ]
    records[-1] = ev("shard_end", records[-1]["t"], received=3, ok=2, dead=0)
    path = tmp_path / "shard-00.jsonl"
    write_log(path, to_new_layout(records))
    for minutes_only in (False, True):
        both(path, minutes_only, minutes_only)
    write_log(tmp_path / "hand.jsonl", to_new_layout(hand_shard()))
    failed = python_fold(tmp_path / "hand.jsonl", False, False)[1]
    for s in (c_fold(path, False, False)[1], python_fold(path, False, False)[1]):
        assert (s.attempts, s.by_status) == (4, {"conn_reset": 1, "ok": 2, "cancelled": 1})
        assert (s.ok, s.dead, s.abandoned, s.dead_reasons) == (2, 0, 1, {})
        assert s.wasted_tokens == failed.wasted_tokens + 5
        assert (s.completion_tokens, dict(s.minutes)) == (
            failed.completion_tokens, dict(failed.minutes))
        assert (s.new_conns, s.reused_conns) == (failed.new_conns, failed.reused_conns)


def test_it_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fast.available()
    monkeypatch.setenv(fast.FAST_VAR, "0")
    assert not fast.available()


def test_the_sample_of_a_real_run_is_the_same_either_way(real_run: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`publish` through the C fold and through the Python fold: byte-identical samples."""
    from shardrun.provenance import publish

    samples = []
    for flag in ("1", "0"):
        monkeypatch.setenv(fast.FAST_VAR, flag)
        sample, _ = publish(real_run, out=real_run / f"sample-{flag}.json")
        samples.append(orjson.dumps(sample))
    assert samples[0] == samples[1]


@pytest.mark.parametrize("chunk", [1, 37, 4096])
def test_chunk_boundaries_change_nothing(real_run: Path, chunk: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines cut across the reader's chunks, even one byte at a time: the same scan and fold,
    for both folds, as with the default chunk; and the file's torn tail still found."""
    from shardrun.report import _scan

    path = real_run / "events" / "shard-00.jsonl"
    torn = real_run.parent / "torn.jsonl"
    torn.write_bytes(path.read_bytes() + b'{"run_id":"r1","sh')
    for log in (path, torn):
        expected = python_fold(log, False, False, cap=8), c_fold(log, False, False, cap=8)
        assert_same(*expected)
        monkeypatch.setattr(_scan, "CHUNK", chunk)
        assert_same(expected[0], python_fold(log, False, False, cap=8))
        assert_same(expected[1], c_fold(log, False, False, cap=8))
        monkeypatch.undo()
    assert expected[0][0].torn_tail_bytes == len(b'{"run_id":"r1","sh')


@settings(max_examples=3000, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False))
def test_numbers_read_as_python_reads_them(x: float) -> None:
    """Every float as orjson and repr write it, and the same digits cut short, plus the
    integers: the C reader's value is Python's, bit for bit (its fast division included)."""
    from shardrun.aggregate import _fastfold  # type: ignore[attr-defined]

    for text in (repr(x), orjson.dumps(x).decode(), f"{x:.3f}", f"{abs(x) % 1e12:.7f}"):
        if "e" in text or "inf" in text:
            expected: float | int = float(text)
        else:
            expected = float(text) if "." in text else int(text)
        got = _fastfold._number(text.encode())
        assert got == expected and math.copysign(1, got) == math.copysign(1, expected), text


@pytest.mark.parametrize("text", [
    "9007199254740993.0",  # 2^53 + 1: exactly halfway between two doubles (ties to even)
    "9007199254740995.0", "0.1", "0.30000000000000004", "1795444750.3025353",
    "2.2250738585072014e-308", "4.9e-324", "123456789012345678.9", "0.0000000000000000000000001",
    "1.00000000000000011102230246251565404236316680908203125",  # the midpoint above 1.0
])
def test_hard_numbers(text: str) -> None:
    from shardrun.aggregate import _fastfold  # type: ignore[attr-defined]

    assert _fastfold._number(text.encode()) == float(text)

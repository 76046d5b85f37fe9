"""The experimental vector reader (`report/_vector.py`) gives the reference fold's document.

Compared as the `report --json` text (sorted keys, every number as printed), on the hand
fixture, on fixtures that stretch it (retries, dead letters, ITL histograms, open spans, an
unknown event, a torn tail) and on a real run on the simulator. Files the vector reader does
not take (an integer `t`, an unreadable line, a restarted shard) must fall back, not differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli, write_input, write_job
from test_aggregate_fixtures import T0, ev, hand_coordinator, hand_shard, steady_shard, write_run
from test_report import FAST_SIM

from shardrun.report import _vector, format_json, load_report

pytest.importorskip("polars")


def _both(run: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, dict[str, int]]:
    """`report --json` by the reference and by the vector reader, and how the latter went."""
    monkeypatch.delenv("SHARDRUN_AGGREGATE_READER", raising=False)
    ref, _ = load_report(run, workers=1)
    calls = {"vector": 0, "fallback": 0}
    real = _vector.fold_shard_file_vector

    def spy(*args: Any) -> Any:
        got = real(*args)
        calls["vector" if got is not None else "fallback"] += 1
        return got

    monkeypatch.setattr(_vector, "fold_shard_file_vector", spy)
    monkeypatch.setenv("SHARDRUN_AGGREGATE_READER", "vector")
    vec, _ = load_report(run, workers=1)
    return format_json(ref), format_json(vec), calls


def _shifted(records: list[dict[str, Any]], dt: float) -> list[dict[str, Any]]:
    return [{**r, "t": r["t"] + dt} for r in records]


def test_hand_fixture_is_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = write_run(tmp_path, {"00": hand_shard()}, hand_coordinator())
    ref, vec, calls = _both(run, monkeypatch)
    assert calls == {"vector": 1, "fallback": 0}
    assert vec == ref


def _busy_shard() -> list[dict[str, Any]]:
    """The hand fixture plus: an open span, a rate wait, a span ok without attempt_end, an
    unknown event, a negative loop lag, an abandoned span, more ITL keys, then steady spans."""
    recs = hand_shard()[:-1]
    extra = [
        ev("rate_wait", T0 + 10.1, span="0-4", id="item-0-4", attempt=1, wait=0.3),
        ev("queued", T0 + 10.2, span="0-4", id="item-0-4", prompt_chars=90_000),
        ev("admitted", T0 + 10.3, span="0-4", id="item-0-4"),
        ev("attempt_start", T0 + 10.3, span="0-4", id="item-0-4", attempt=1),
        ev("conn_ready", T0 + 10.4, span="0-4", id="item-0-4", attempt=1, reused=True),
        ev("first_token", T0 + 10.6, span="0-4", id="item-0-4", attempt=1),
        ev("attempt_end", T0 + 10.9, span="0-4", id="item-0-4", attempt=1, status="ok",
           prompt_tokens=None, completion_tokens=1, wasted_tokens=0,
           itl_hist={"-1": 2, "150": 1, "7": 4}),
        ev("released", T0 + 11.1, span="0-4", id="item-0-4", outcome="ok", reason=None),
        ev("queued", T0 + 11.2, span="0-5", id="item-0-5", prompt_chars=5),
        ev("released", T0 + 11.3, span="0-5", id="item-0-5", outcome="ok", reason=None),
        ev("queued", T0 + 11.4, span="0-6", id="item-0-6", prompt_chars=5),
        ev("something_new", T0 + 11.5, span="0-6"),
        ev("loop_lag", T0 + 11.7, lag=-0.001),
        ev("queued", T0 + 11.8, span="0-8", id="item-0-8", prompt_chars=400),
        ev("admitted", T0 + 11.9, span="0-8", id="item-0-8"),
        ev("released", T0 + 12.1, span="0-8", id="item-0-8", outcome="abandoned", reason=None),
    ]
    steady = steady_shard(9, T0 + 13.3, 2, 7)[1:-1]
    return [*recs, *extra, *steady, ev("shard_end", T0 + 200.7, received=9)]


def test_stretched_fixture_is_identical(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    shards = {"00": _busy_shard(), "01": _shifted(hand_shard(), 0.25)}
    run = write_run(tmp_path, shards, hand_coordinator())
    with open(run / "events" / "shard-01.jsonl", "ab") as f:
        f.write(b'{"run_id":"r","shard":0,"ev":"queued","t":')  # a torn last line
    ref, vec, calls = _both(run, monkeypatch)
    assert calls == {"vector": 2, "fallback": 0}
    assert vec == ref


@pytest.mark.parametrize("damage", ["int_t", "bad_line", "restart", "blank_line"])
def test_what_it_does_not_take_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          damage: str) -> None:
    recs = hand_shard()
    if damage == "int_t":
        recs[-2] = {**recs[-2], "t": int(T0 + 20)}
    elif damage == "restart":
        recs.insert(20, ev("shard_start", T0 + 6.2, cap=2, pid=2, version="0", host="h"))
    run = write_run(tmp_path, {"00": recs}, hand_coordinator())
    path = run / "events" / "shard-00.jsonl"
    if damage in ("bad_line", "blank_line"):
        lines = path.read_bytes().split(b"\n")
        lines.insert(7, b"{not json" if damage == "bad_line" else b"")
        path.write_bytes(b"\n".join(lines))
    ref, vec, calls = _both(run, monkeypatch)
    assert calls == {"vector": 0, "fallback": 1}
    assert vec == ref


def test_real_run_is_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real 300-item run on the simulator, with faults, so retries and wasted tokens occur."""
    write_input(tmp_path / "input.jsonl", 300)
    sim = {**FAST_SIM, "fail_500": 0.05, "drop_mid_stream": 0.03}
    write_job(tmp_path / "job.yaml", shards=2, concurrency=8,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim},
              retry={"backoff_s": 0.01, "backoff_max_s": 0.05})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=tmp_path)
    assert done.returncode in (0, 1), done.stderr
    ref, vec, calls = _both(tmp_path / "runs" / "r1", monkeypatch)
    assert calls == {"vector": 2, "fallback": 0}
    assert vec == ref

"""Tests for the live progress view: plain lines, the terminal frame, rates, line counting."""

from __future__ import annotations

import re
import threading
from io import StringIO
from pathlib import Path
from typing import Any

import orjson
import pytest
from rich.console import Console

from shardrun import progress
from shardrun.progress import (
    SILENT_AFTER_S,
    ProgressView,
    ShardRow,
    Snapshot,
    count_lines_cheaply,
    estimate_total,
    format_final_line,
    shard_table,
)
from tests.conftest import run_cli, write_job

ESCAPE = re.compile(r"\x1b")


class Clock:
    """A fake monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def report(ok: int, dead: int = 0, tokens: int = 0, **gauges: int) -> dict[str, Any]:
    """A shard `progress` message."""
    return {"t": "progress", "ok": ok, "dead": dead, "attempts": ok + dead,
            "retries": 0, "completion_tokens": tokens, "received": ok + dead, **gauges}


def feed(view: ProgressView, clock: Clock, seconds: int, per_s: int = 8) -> None:
    """Two shards each finishing `per_s` items (20 tokens each) a second, refreshed 4x/s."""
    start = clock.now
    for quarter in range(1, seconds * 4 + 1):
        clock.now = start + quarter / 4
        done = int(per_s * quarter / 4)
        for shard in (0, 1):
            view.update(shard, report(done, 0, 20 * done, in_flight=3, cap=8, queued=5))
        view.refresh()


def test_plain_mode_prints_a_line_every_interval_without_escapes() -> None:
    """Not a terminal: one plain line per interval, counts and rates in it, no escape codes."""
    clock, out = Clock(), StringIO()
    view = ProgressView(400, tty=False, stream=out, clock=clock, interval=10.0)
    view.start()
    feed(view, clock, 25)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and not ESCAPE.search(out.getvalue())
    assert lines[0] == (
        "[   10.0s] 160/400 done (40.0%): 160 ok, 0 failed, 0 retrying;"
        " 19,200 TPM, 16.0 req/s, ETA 0:15"
    )
    assert lines[1].startswith("[   20.0s] 320/400 done (80.0%)")
    view.stop()
    assert view.final_line() == (
        "400 items in 25.0 s: 400 succeeded, 0 failed; 19,200 completion TPM (run average)"
    )


def test_the_final_line_of_one_item_says_item() -> None:
    """A run of one item (a smoke test) ends on '1 item in', not '1 items in'."""
    one = Snapshot(elapsed=2.0, total=1, ok=1, dead=0, retrying=0, attempts=1,
                   completion_tokens=10, tpm=None, requests_per_s=None, items_per_s=None,
                   shards=())  # fmt: skip
    assert format_final_line(one) == (
        "1 item in 2.0 s: 1 succeeded, 0 failed; 300 completion TPM (run average)")


def test_quiet_prints_nothing() -> None:
    """quiet=True: no output in either mode."""
    clock, out = Clock(), StringIO()
    for tty in (False, True):
        console = Console(file=out, force_terminal=tty)
        view = ProgressView(10, quiet=True, tty=tty, console=console, stream=out, clock=clock)
        view.start()
        feed(view, clock, 12)
        view.stop()
    assert out.getvalue() == ""


def test_tty_mode_renders_counts_and_shards() -> None:
    """On a terminal the frame shows done/total, counts, rates and each shard's cap."""
    clock, out = Clock(), StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    view = ProgressView(1000, console=console, clock=clock)
    assert view.tty
    view.start()
    feed(view, clock, 3)
    view.update(1, report(30, 4, 600, in_flight=8, cap=8, queued=0, retrying=2))
    view.refresh()
    view.stop()
    text = out.getvalue()
    assert "58/1,000" in text and "succeeded 54  failed 4  retrying 2" in text
    assert "19,200 TPM  16.0 req/s" in text and "3 / 8" in text and "8 / 8" in text


def test_an_endpoint_down_is_shown_while_every_shard_waits_for_as_long_as_all_have() -> None:
    """While every shard waits for an endpoint that is down (`down_s` in their reports), both
    views say so, for as long as the shard that waited least (none heard an answer in that
    time); once every shard hears answers again, neither does."""
    clock, out = Clock(), StringIO()
    view = ProgressView(400, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    clock.now += 1
    view.refresh()
    for shard in (0, 1):
        view.update(shard, report(5, in_flight=8, cap=8, queued=8))
    clock.now += 1
    view.refresh()
    assert ", ETA " in out.getvalue().splitlines()[-1]  # a rate: the time left follows
    view.update(0, report(10, in_flight=0, cap=8, queued=8, retrying=8, down_s=75.4))
    view.update(1, report(12, in_flight=0, cap=8, queued=8, retrying=8, down_s=63.0))
    clock.now += 1
    view.refresh()
    assert out.getvalue().splitlines()[-1].endswith(
        "; endpoint down for 1:03, items held until it answers")
    assert "ETA" not in out.getvalue().splitlines()[-1]  # the rate says nothing of time left
    console_out = StringIO()
    console = Console(file=console_out, force_terminal=True, width=160, color_system=None)
    frame = ProgressView(400, console=console, clock=clock)
    frame.update(0, report(10, down_s=75.4))
    with console.capture() as cap:
        console.print(frame.render())
    assert "│ endpoint down for 1:15, items held until it answers" in cap.get()
    for shard in (0, 1):
        view.update(shard, report(20, down_s=0.0))
    clock.now += 1
    view.refresh()
    assert "endpoint down" not in out.getvalue().splitlines()[-1]
    assert view.snapshot().down_s is None


def test_shards_waiting_for_the_endpoint_while_others_succeed_are_no_outage() -> None:
    """After a restart of a busy endpoint some shards' probes are answered late while the
    others succeed: the line counts the shards waiting and says the others hear answers, never
    "endpoint down" (it read so while the successes rose from 3,137 to 3,199), and keeps its
    ETA. A shard that has finished (its `done` report) waits for nothing."""
    clock, out = Clock(), StringIO()
    view = ProgressView(4000, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    for second in range(1, 5):
        clock.now += 1
        for shard in (0, 1):
            view.update(shard, report(800 + 31 * second, in_flight=32, cap=32))
        for shard in (2, 3):  # shard 3's outage began a second after shard 2's
            view.update(shard, report(760, in_flight=0, cap=32, retrying=32,
                                      down_s=2.0 * second - (shard - 2)))
        view.refresh()
    line = out.getvalue().splitlines()[-1]
    assert "endpoint down" not in line
    assert line.endswith("; 2 of 4 shards waiting for the endpoint (up to 0:08), the others "
                         "hear answers")
    assert ", ETA " in line  # the endpoint answers: the rate says how long is left
    console = Console(file=StringIO(), force_terminal=True, width=200, color_system=None)
    with console.capture() as cap:
        console.print(view.render())
    assert "│ 2 of 4 shards waiting for the endpoint (up to 0:08)" in cap.get()
    view.update(0, {**report(900), "t": "done"})
    view.update(1, {**report(900), "t": "done"})
    snap = view.snapshot()
    # All the shards still working wait: down, for as long as both have.
    assert snap.down_s == 7.0 and snap.waiting_s is None
    view.update(2, report(770, in_flight=32, cap=32))
    assert view.snapshot().waiting_shards == 1 and view.snapshot().working_shards == 2


def test_idle_shards_are_not_said_to_hear_answers_while_others_wait() -> None:
    """An idle shard (nothing in flight, queued or retrying) is in neither group of the waiting
    line: with one busy shard hearing answers the line counts only the busy ones, and with
    none the endpoint is down (an idle shard's wait of 0 kept that off the line)."""
    clock = Clock()
    view = ProgressView(400, tty=False, stream=StringIO(), clock=clock)
    view.start()
    clock.now += 5
    view.update(0, report(50, in_flight=0, cap=8, queued=0))  # idle: its items are done
    view.update(1, report(40, in_flight=0, cap=8, retrying=8, down_s=6.0))
    view.update(2, report(45, in_flight=8, cap=8, queued=3))
    line = progress.format_plain_line(view.snapshot())
    assert line.endswith("; 1 of 2 shards waiting for the endpoint (up to 0:06), the others "
                         "hear answers")
    view.update(2, report(53, in_flight=0, cap=8, queued=0))  # idle now too
    line = progress.format_plain_line(view.snapshot())
    assert "hear answers" not in line  # nor is 0 the least wait: the idle shards have none
    assert line.endswith("; endpoint down for 0:06, items held until it answers")


def test_shards_not_heard_from_since_their_start_are_said_to_be_starting() -> None:
    """A shard may take 30 s to start (`coordinator.START_SILENCE_MIN_S`): once one started
    STARTING_AFTER_S ago has sent nothing, both views count the shards starting and how long
    the longest has been; its first report, or its end, takes it off."""
    clock, out = Clock(), StringIO()
    view = ProgressView(400, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    for shard in range(3):
        view.shard_started(shard)
    clock.now += progress.STARTING_AFTER_S - 1
    view.update(0, report(0, in_flight=4, cap=8))
    assert "starting" not in progress.format_plain_line(view.snapshot())  # a start is quick
    clock.now += 2
    view.shard_started(3)  # a replacement, started later
    clock.now += 2
    view.refresh()
    assert out.getvalue().splitlines()[-1].endswith(
        "; 2 of 4 shards starting, not heard from for up to 0:06")
    console = Console(file=StringIO(), force_terminal=True, width=200, color_system=None)
    with console.capture() as cap:
        console.print(view.render())
    assert "│ 2 of 4 shards starting, not heard from for up to 0:06" in cap.get()
    view.update(1, report(0, in_flight=4, cap=8))
    view.ended(2)  # died before a word: it starts no more
    clock.now += 1
    assert progress.format_plain_line(view.snapshot()).endswith(
        "; 1 of 3 shards starting, not heard from for up to 0:03")
    view.update(3, report(0, in_flight=4, cap=8))
    assert "starting" not in progress.format_plain_line(view.snapshot())


def test_a_stopping_run_says_so_with_its_requests_in_flight_instead_of_an_eta() -> None:
    """After the first Ctrl-C the run ends with its requests in flight, not at the total: both
    views say it is stopping and how many requests it waits for, and show no ETA."""
    clock, out = Clock(), StringIO()
    view = ProgressView(4000, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    feed(view, clock, 3)
    assert ", ETA " in out.getvalue().splitlines()[-1]
    view.stopping = True
    feed(view, clock, 2)
    line = out.getvalue().splitlines()[-1]
    assert "ETA" not in line
    assert "; stopping: 6 requests in flight to finish" in line  # 3 in each of the two shards
    console = Console(file=StringIO(), force_terminal=True, width=200, color_system=None)
    with console.capture() as cap:
        console.print(view.render())
    assert "ETA" not in cap.get() and "%  stopping" in cap.get()  # where the ETA was
    assert "│ stopping: 6 requests in flight to finish" in cap.get()


def test_a_storm_is_shown_with_its_cause_for_the_shard_in_it_longest() -> None:
    """Shards in a storm report `failing_s` and `failing_cause`: both views name the longest
    storm and its shard's cause (clipped), and give no ETA; a shard out of it reports 0."""
    clock, out = Clock(), StringIO()
    view = ProgressView(400, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    cause = "HTTP 500: " + "the model worker crashed " * 4
    view.update(0, report(5, failing_s=4.0, failing_cause="HTTP 503: overloaded"))
    view.update(1, report(5, failing_s=12.3, failing_cause=cause))
    clock.now += 1
    view.update(0, report(10, failing_s=5.0, failing_cause="HTTP 503: overloaded"))
    view.refresh()
    shown = cause[:59] + "…"
    line = out.getvalue().splitlines()[-1]
    assert line.endswith(f"; endpoint failing every request for 0:12 ({shown}), items held "
                         "until it answers") and "ETA" not in line, line
    console_out = StringIO()
    console = Console(file=console_out, force_terminal=True, width=200, color_system=None)
    frame = ProgressView(400, console=console, clock=clock)
    frame.update(0, report(10, failing_s=61.0, failing_cause="HTTP 503: overloaded"))
    with console.capture() as cap:
        console.print(frame.render())
    assert "│ endpoint failing every request for 1:01 (HTTP 503: overloaded)" in cap.get()
    for shard in (0, 1):
        view.update(shard, report(20, failing_s=0.0))
    assert view.snapshot().failing_s is None and view.snapshot().failing_cause is None


def test_a_server_rate_limit_is_one_clause_with_its_429s_and_the_pace_learned() -> None:
    """Shards count the 429s of the server's rate limit (`limited_429s`) and report the pace
    they learned at their last cut (`paced_rps`): both views say so in one clause, the 429s
    over every shard, the pace over the shards still working; nothing before the first 429."""
    clock, out = Clock(), StringIO()
    view = ProgressView(400, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    view.update(0, report(5, in_flight=8, cap=8))
    view.refresh()
    assert "server rate limit" not in out.getvalue()
    view.update(0, {**report(9, in_flight=8, cap=8), "limited_429s": 7, "paced_rps": 2.5})
    view.update(1, {**report(9, in_flight=8, cap=8), "limited_429s": 5, "paced_rps": None})
    view.update(2, {**report(9), "t": "done", "limited_429s": 3, "paced_rps": 4.0})
    clock.now += 1
    view.refresh()
    line = out.getvalue().splitlines()[-1]
    assert line.endswith("; server rate limit: 15 429s held, pace last cut to 150 req/min"), line
    console_out = StringIO()
    console = Console(file=console_out, force_terminal=True, width=200, color_system=None)
    frame = ProgressView(400, console=console, clock=clock)
    frame.update(0, {**report(10), "limited_429s": 1})
    with console.capture() as cap:
        console.print(frame.render())
    assert "│ server rate limit: 1 429 held" in cap.get()


def test_a_token_pace_and_a_stated_one_are_said_as_what_they_are() -> None:
    """A shard paced in tokens only (`paced_tps`, no `paced_rps`) is said in tokens a minute,
    not as 0 req/min; paces all set from the limit a 429 stated (`paced_seeded`) are said so,
    and one cut among them makes the clause say cut."""
    clock, out = Clock(), StringIO()
    view = ProgressView(400, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    view.update(0, {**report(9, in_flight=8, cap=8), "limited_429s": 2, "paced_tps": 100.0,
                    "paced_seeded": True})
    view.update(1, {**report(9, in_flight=8, cap=8), "limited_429s": 1, "paced_rps": 2.0,
                    "paced_tps": 50.0, "paced_seeded": True})
    clock.now += 1
    view.refresh()
    line = out.getvalue().splitlines()[-1]
    assert line.endswith("; server rate limit: 3 429s held, pace set from the server's stated "
                         "limit to 120 req/min and 9,000 tokens/min"), line
    view.update(1, {**report(9, in_flight=8, cap=8), "limited_429s": 4, "paced_rps": 1.0,
                    "paced_seeded": False})
    clock.now += 1
    view.refresh()
    line = out.getvalue().splitlines()[-1]
    assert line.endswith("server rate limit: 6 429s held, pace last cut to 60 req/min and "
                         "6,000 tokens/min"), line


def test_requests_out_with_nothing_heard_are_shown_once_silent_long_enough() -> None:
    """Shards report the requests they have out (`sending`) and how long they have heard
    nothing (`unheard_s`). Once every shard sending has heard nothing for SILENT_AFTER_S, both
    views say how long (the shard that heard last) and how many are out; a shard that hears,
    or a down or failing endpoint's own text, takes it away (a shard or two waiting for the
    endpoint do not)."""
    clock, out = Clock(), StringIO()
    view = ProgressView(400, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    quiet = SILENT_AFTER_S + 15
    view.update(0, report(5, in_flight=8, cap=8, sending=8, unheard_s=quiet))
    view.update(1, report(5, in_flight=8, cap=8, sending=6, unheard_s=SILENT_AFTER_S - 1))
    view.update(2, report(5, in_flight=2, cap=8, sending=0, unheard_s=0))  # nothing out
    clock.now += 1
    view.refresh()
    assert "nothing heard" not in out.getvalue()  # shard 1 heard 29 s ago
    view.update(1, report(5, in_flight=8, cap=8, sending=6, unheard_s=SILENT_AFTER_S))
    clock.now += 1
    view.refresh()
    assert out.getvalue().splitlines()[-1].endswith(
        f"; nothing heard for {int(SILENT_AFTER_S) // 60}:{int(SILENT_AFTER_S) % 60:02d} with 14 "
        "requests out, waiting for the endpoint")
    console_out = StringIO()
    console = Console(file=console_out, force_terminal=True, width=200, color_system=None)
    frame = ProgressView(400, console=console, clock=clock)
    frame.update(0, report(5, in_flight=8, cap=8, sending=8, unheard_s=quiet))
    with console.capture() as cap:
        console.print(frame.render())
    assert "│ nothing heard for 0:45 with 8 requests out" in cap.get()
    view.update(1, report(5, in_flight=8, cap=8, sending=6, unheard_s=0.2))
    assert view.snapshot().silent_s is None  # one shard hears: the endpoint answers
    view.update(1, report(5, in_flight=8, cap=8, sending=6, unheard_s=quiet, down_s=3.0))
    # One shard of three waits for the endpoint: no outage, and the silence is still news.
    assert view.snapshot().silent_s == quiet and view.snapshot().down_s is None
    for shard in (0, 2):
        view.update(shard, report(5, in_flight=8, cap=8, sending=6, unheard_s=quiet, down_s=4.0))
    assert view.snapshot().silent_s is None  # "endpoint down" says it better
    view.update(0, report(5, in_flight=8, cap=8, sending=8, unheard_s=quiet))
    view.update(2, report(5, in_flight=2, cap=8, sending=0, unheard_s=0))
    view.update(1, report(5, in_flight=8, cap=8, sending=6, unheard_s=quiet, failing_s=3.0))
    assert view.snapshot().silent_s is None  # and so does "endpoint failing"
    view.update(1, report(5, in_flight=8, cap=8, sending=6, unheard_s=quiet))
    assert view.snapshot().silent_s == quiet


def test_requests_held_by_a_rate_limit_are_shown() -> None:
    """Shards report how many requests wait for the rate limit (`rate_waiting`): summed, both
    views say so, so a run the limit holds does not read like a hang."""
    clock, out = Clock(), StringIO()
    view = ProgressView(400, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    view.update(0, report(1, in_flight=0, cap=8, queued=8, rate_waiting=5))
    view.update(1, report(1, in_flight=0, cap=8, queued=8, rate_waiting=3))
    clock.now += 1
    view.refresh()
    assert out.getvalue().splitlines()[-1].endswith("; 8 waiting for the rate limit")
    console = Console(file=StringIO(), force_terminal=True, width=160, color_system=None)
    with console.capture() as cap:
        console.print(view.render())
    assert "│ 8 waiting for the rate limit" in cap.get()
    view.update(0, report(2, rate_waiting=0))
    view.update(1, report(2, rate_waiting=0))
    assert view.snapshot().rate_waiting == 0


def test_unknown_total_shows_count_and_rate() -> None:
    """Without a total there is no bar and no ETA, only the count and the item rate."""
    clock, out = Clock(), StringIO()
    console = Console(file=out, force_terminal=True, width=100, color_system=None)
    view = ProgressView(None, console=console, clock=clock)
    view.start()
    feed(view, clock, 2)
    view.stop()
    assert "32 done  16.0 items/s" in out.getvalue() and "ETA" not in out.getvalue()


def test_shard_table_snapshot() -> None:
    """The per-shard table, rows beyond the limit folded into one."""
    rows = tuple(ShardRow(i, in_flight=i, cap=8, queued=10 * i, retrying=i % 2) for i in range(5))
    snap = Snapshot(1.0, None, 0, 0, 0, 0, 0, None, None, None, rows)
    console = Console(file=StringIO(), width=60, color_system=None, force_terminal=False)
    with console.capture() as cap:
        console.print(shard_table(snap, max_rows=3))
    assert [line.rstrip() for line in cap.get().splitlines()] == [
        "  shard  in flight / cap  queue  retrying",
        "      0            0 / 8      0         0",
        "      1            1 / 8     10         1",
        "      2            2 / 8     20         0",
        "+2 more           7 / 16     70         1",
    ]


def test_rates_use_a_sliding_window() -> None:
    """After a burst the rate decays to the recent pace: 10 s window, not the run average."""
    clock = Clock()
    view = ProgressView(None, tty=False, stream=StringIO(), clock=clock)
    feed(view, clock, 20, per_s=50)  # 100 items/s overall
    feed_start = view.snapshot().done
    for step in range(1, 81):  # 20 s at 10 items/s (5 per shard)
        clock.now += 0.25
        done = feed_start // 2 + int(5 * step / 4)
        for shard in (0, 1):
            view.update(shard, report(done, 0, 0))
        view.refresh()
    snap = view.snapshot()
    assert snap.items_per_s == pytest.approx(10.0, rel=0.05)
    assert snap.tpm == pytest.approx(0.0)


def test_restarted_shard_keeps_what_it_reported() -> None:
    """A counter that goes backwards is a restarted shard: earlier counts are kept."""
    view = ProgressView(None, tty=False, stream=StringIO(), clock=Clock())
    view.update(0, report(40, 2, 800))
    view.update(0, report(5, 0, 100))
    snap = view.snapshot()
    assert (snap.ok, snap.dead, snap.completion_tokens) == (45, 2, 900)


def test_count_lines_cheaply(tmp_path: Path) -> None:
    """Newlines counted, a last line without one included, none above a given size or once
    told to stop."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\nb\nc")
    assert count_lines_cheaply(path) == 3
    path.write_bytes(b"a\n" * 3_000_000)
    assert count_lines_cheaply(path) == 3_000_000
    assert count_lines_cheaply(path, limit_bytes=1000) is None
    stopped = threading.Event()
    stopped.set()
    assert count_lines_cheaply(path, stop=stopped) is None
    path.write_bytes(b"")
    assert count_lines_cheaply(path) == 0
    assert count_lines_cheaply(tmp_path / "missing") is None


def test_a_csv_total_counts_rows_ended_by_a_lone_cr(tmp_path: Path) -> None:
    """A CSV's rows may end with a lone CR (old Mac exports), as the csv module reads them, or
    CRLF: the total counts each row once, a CRLF split between two chunks too, where counting
    LF bytes alone made a CR-only file one line, a total of 0 items."""
    path = tmp_path / "in.csv"
    for ending in (b"\r", b"\r\n", b"\n"):
        path.write_bytes(b"id,prompt" + b"".join(ending + b"%d,p" % i for i in range(5)))
        assert estimate_total(path, "csv") == 5
        path.write_bytes(path.read_bytes() + ending)
        assert estimate_total(path, "csv") == 5
    row = b"x" * (progress._CHUNK - 1)  # its CR is a chunk's last byte, its LF the next's first
    path.write_bytes(row + b"\r\n" + b"1,p\r" + b"2,p\r")
    assert count_lines_cheaply(path, lone_cr=True) == 3
    assert count_lines_cheaply(path) == 2  # LF bytes, and the last line without one


def test_the_total_is_counted_while_the_run_goes(tmp_path: Path) -> None:
    """The input's count does not hold the run back: the view starts without its total, which
    the count brings once it ends, for the plain lines and the frame alike. The input's end
    knows better: a count ending after it is dropped; and `stop` ends a count still going."""
    go, asked = threading.Event(), threading.Event()

    def slow_count(stop: threading.Event) -> int | None:
        asked.set()
        go.wait(30)
        return 400

    clock, out = Clock(), StringIO()
    view = ProgressView(None, tty=False, stream=out, clock=clock, interval=10.0, count=slow_count)
    view.start()  # returns while the count waits
    assert asked.wait(30) and view.snapshot().total is None
    go.set()
    for _ in range(500):  # bounded: the count's thread ends at once
        if view.snapshot().total is not None:
            break
        threading.Event().wait(0.01)
    feed(view, clock, 10)
    view.stop()
    assert out.getvalue().startswith("[   10.0s] 160/400 done (40.0%)"), out.getvalue()

    late = threading.Event()
    view = ProgressView(None, tty=False, stream=StringIO(), clock=Clock(),
                        count=lambda stop: 400 if late.wait(30) else None)
    view.start()
    view.set_total(7)  # the input ended first: 7 items
    late.set()
    view.stop()
    assert view.snapshot().total == 7

    path = tmp_path / "in.jsonl"
    path.write_bytes(b"a\n" * 3_000_000)
    counted: list[int | None] = []
    started, ended = threading.Event(), threading.Event()

    def stopped_count(stop: threading.Event) -> int | None:
        started.set()
        stop.wait(30)
        counted.append(count_lines_cheaply(path, stop=stop))
        ended.set()
        return counted[-1]

    view = ProgressView(None, tty=False, stream=StringIO(), clock=Clock(), count=stopped_count)
    view.start()
    assert started.wait(30)
    view.stop()
    assert ended.wait(30) and counted == [None] and view.snapshot().total is None


def test_estimate_total_by_format(tmp_path: Path) -> None:
    """CSV minus its header; Parquet from its footer; JSONL by lines."""
    csv_path = tmp_path / "in.csv"
    csv_path.write_text("id,prompt\n1,a\n2,b\n")
    assert estimate_total(csv_path, "csv") == 2
    assert estimate_total(csv_path, "jsonl") == 3
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"prompt": ["x"] * 7}), tmp_path / "in.parquet")
    assert estimate_total(tmp_path / "in.parquet", "parquet") == 7
    assert estimate_total(csv_path, "parquet") is None


class FakeTty(StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stream_type", "env"), [
    (StringIO, {}), (FakeTty, {}), (StringIO, {"FORCE_COLOR": "1"}),
    (StringIO, {"FORCE_COLOR": ""}), (FakeTty, {"TTY_COMPATIBLE": "0"}),
    (StringIO, {"TTY_COMPATIBLE": "1"}),
])  # fmt: skip
def test_terminal_detection_agrees_with_rich(
    stream_type: type[StringIO], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The view decides tty or not as rich would, but makes no rich Console where it can say
    "no" without one (a run logging to a file never imports rich)."""
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    stream = stream_type()
    view = ProgressView(10, stream=stream, clock=Clock())
    assert view.tty == Console(file=stream).is_terminal
    if stream_type is StringIO and not env:
        assert view.console is None
    assert ProgressView(10, quiet=True, stream=stream, clock=Clock()).console is None


def _etas(rates: list[float], left: float, dt: float = 0.25) -> list[float]:
    """The ETA after each of `rates` (one per refresh, `dt` apart), smoothed and raw."""
    from shardrun.progress import smoothed_rate

    smooth: float | None = None
    out = []
    for step, rate in enumerate(rates, start=1):
        smooth = smoothed_rate(smooth, rate, dt, elapsed=60.0 + step * dt)
        assert smooth is not None
        out.append(left / smooth)
    return out


def test_the_eta_rate_damps_a_noisy_window_and_follows_a_real_change() -> None:
    """A window rate swinging 30% either way every 5 s (a shared machine) moves the ETA far
    less than dividing by the window's rate does; a real halving of the rate is followed."""
    from shardrun.progress import smoothed_rate

    noisy = [100.0 * (1.3 if (step // 20) % 2 else 0.7) for step in range(240)]  # 60 s
    etas = _etas(noisy, left=10_000.0)
    raw = [10_000.0 / r for r in noisy]
    late = etas[120:]
    assert max(late) - min(late) < 0.25 * (max(raw) - min(raw))
    # A real change: from 100/s to 50/s, held; within a few time constants the rate is there.
    smooth: float | None = 100.0
    for step in range(4 * 60 * 4):  # 4 minutes of refreshes
        smooth = smoothed_rate(smooth, 50.0, 0.25, elapsed=600.0 + step / 4)
    assert smooth == pytest.approx(50.0, rel=0.01)
    # Early in a run it follows the window closely: 2 s after a change, most of the way.
    smooth = 100.0
    for step in range(8):
        smooth = smoothed_rate(smooth, 50.0, 0.25, elapsed=4.0 + step / 4)
    assert smooth is not None and smooth < 70.0
    # No rate (too short a window) keeps the one before; the first is taken as it is.
    assert smoothed_rate(42.0, None, 0.25, 10.0) == 42.0
    assert smoothed_rate(None, 7.0, 0.25, 10.0) == 7.0


def test_the_views_eta_divides_by_the_smoothed_rate() -> None:
    """The view's ETA: a burst in the last seconds moves it less than the window rate does."""
    clock = Clock()
    view = ProgressView(100_000, tty=False, stream=StringIO(), clock=clock)
    view.start()
    feed(view, clock, 60, per_s=50)  # 100 items/s for a minute
    start = view.snapshot().done // 2
    for step in range(1, 21):  # 5 s at 300 items/s
        clock.now += 0.25
        for shard in (0, 1):
            view.update(shard, report(start + int(150 * step / 4), 0, 0))
        view.refresh()
    snap = view.snapshot()
    assert snap.items_per_s is not None and snap.eta_items_per_s is not None
    assert snap.items_per_s > 190.0  # the window
    assert 100.0 < snap.eta_items_per_s < 150.0
    assert snap.eta_s == pytest.approx((100_000 - snap.done) / snap.eta_items_per_s)
    for _ in range(48):  # then 12 s in which nothing finishes: no ETA, the rate decaying
        clock.now += 0.25
        view.refresh()
    snap = view.snapshot()
    assert snap.items_per_s == 0 and snap.eta_items_per_s and snap.eta_s is None


def test_a_resume_skipping_finished_lines_says_so() -> None:
    """While a resume passes over the finished input lines the view says how far it has got,
    in plain lines and on a terminal; after, the usual display."""
    clock, out = Clock(), StringIO()
    view = ProgressView(1000, tty=False, stream=out, clock=clock, interval=1.0)
    skipped = [0]
    view.skipping = lambda: skipped[0]
    view.start()
    for _ in range(3):
        clock.now += 1.0
        skipped[0] += 5000
        view.refresh()
    view.skipping = None
    feed(view, clock, 2)
    lines = out.getvalue().splitlines()
    assert lines[:3] == [f"[{t:7.1f}s] reading up to the first item to run: {n:,} input lines"
                         " so far" for t, n in ((1.0, 5000), (2.0, 10000), (3.0, 15000))]
    assert "done" in lines[3] and not ESCAPE.search(out.getvalue())
    term = StringIO()
    console = Console(file=term, force_terminal=True, width=100, color_system=None)
    view = ProgressView(1000, console=console, clock=clock)
    view.skipping = lambda: 2_300_000
    view.start()
    view.refresh()
    view.stop()
    assert "first item to run: 2,300,000 input lines so far" in term.getvalue()


def test_lines_rejected_while_reading_up_to_the_first_item_are_counted() -> None:
    """A job whose every line is rejected (a misnamed prompt field) reads its whole input
    before it says so: a million lines took 25 s saying only how many lines were read. The
    line says how many of them were rejected, in plain lines and on a terminal."""
    clock, out = Clock(), StringIO()
    view = ProgressView(None, tty=False, stream=out, clock=clock, interval=1.0)
    read = [0]
    view.skipping = lambda: read[0]
    view.skipping_rejected = lambda: read[0] - 1  # one blank line among them
    view.start()
    for _ in range(2):
        clock.now += 1.0
        read[0] += 70_000
        view.refresh()
    assert out.getvalue().splitlines()[-1] == (
        "[    2.0s] reading up to the first item to run: 140,000 input lines so far, 139,999 of "
        "them rejected (the pass's rejects file says why)")
    term = StringIO()
    console = Console(file=term, force_terminal=True, width=200, color_system=None)
    view = ProgressView(None, console=console, clock=clock)
    view.skipping, view.skipping_rejected = (lambda: 2_000), (lambda: 12)
    view.start()
    view.refresh()
    view.stop()
    assert "2,000 input lines so far, 12 of them rejected" in term.getvalue()


def test_rejected_input_lines_count_as_failed_and_done_as_the_summary_counts_them() -> None:
    """Rejected input lines are items of the pass, failed ones (the summary says "failed N (D
    dead-lettered, R rejected input lines)"): a pass of 200,000 rejected lines showed "0
    failed" to its end, and a total it never reached. Plain lines, the final line and a
    terminal's frame all say them."""
    clock, out = Clock(), StringIO()
    view = ProgressView(10, tty=False, stream=out, clock=clock, interval=1.0)
    view.rejected = lambda: 6
    view.start()
    view.update(0, {"ok": 3, "dead": 1})
    clock.now += 1.0
    view.refresh()
    said = "7 failed (1 dead-lettered, 6 rejected input lines)"
    assert out.getvalue().splitlines()[-1].startswith(
        f"[    1.0s] 10/10 done (100.0%): 3 ok, {said}, 0 retrying;"), out.getvalue()
    assert view.final_line().startswith(f"10 items in 1.0 s: 3 succeeded, {said};")
    term = StringIO()
    console = Console(file=term, force_terminal=True, width=200, color_system=None)
    view = ProgressView(10, console=console, clock=clock)
    view.rejected = lambda: 6
    view.start()
    view.update(0, {"ok": 3, "dead": 1})
    view.stop()
    frame = term.getvalue()
    assert "failed 7 (1 dead-lettered, 6 rejected input lines)" in frame and "10/10" in frame
    clean = ProgressView(4, tty=False, stream=StringIO(), clock=clock)
    clean.update(0, {"ok": 3, "dead": 1})
    assert "3 succeeded, 1 failed;" in clean.final_line()


def test_a_limit_passs_total_holds_its_rejected_lines_as_its_done_does() -> None:
    """--limit makes the total a count of items, and rejected lines are done too: a --limit
    1000 pass over an input of one rejected line per item showed 1,616/1,000 done (161.6%),
    ETA 0:00. Until the input's end they are added to the limit; a count of lines (fewer than
    the limit) holds them already, as the input's end does."""
    clock = Clock()
    view = ProgressView(1_000, tty=False, stream=StringIO(), clock=clock, limit=1_000)
    view.rejected = lambda: 600
    view.update(0, {"ok": 500, "dead": 0})
    assert (view.snapshot().done, view.snapshot().total) == (1_100, 1_600)
    view.set_total(1_900)  # the input ended: 1,000 items taken, 900 lines rejected
    assert view.snapshot().total == 1_900
    counted = ProgressView(300, tty=False, stream=StringIO(), clock=clock, limit=1_000)
    counted.rejected = lambda: 100
    assert counted.snapshot().total == 300  # the input's lines, its rejected ones among them
    assert ProgressView(1_000, tty=False, stream=StringIO(), clock=clock).snapshot().total == 1_000


def test_a_run_of_mostly_rejected_lines_shows_them_failed_while_it_goes(tmp_path: Path) -> None:
    """A real run whose input is mostly rejected lines, its few items slow to answer: every
    progress line printed while they are out counts the rejected lines among the failed, as
    many as the summary does, and in its done, against a total of every line."""
    lines = [orjson.dumps({"id": f"i{n}", "prompt": "p"}) if n % 10 == 0 else b"{broken"
             for n in range(200)]
    (tmp_path / "input.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    write_job(tmp_path / "job.yaml", shards=1, endpoint={
        "base_url": "sim://", "api": "chat", "model": "m",
        "sim": {"ttft_ms": 1500, "itl_ms": 0, "tokens": 2}})
    ran = run_cli("job.yaml", "--runs-dir", "runs", "--progress-interval", "0.1", cwd=tmp_path)
    assert "  failed             180  (0 dead-lettered, 180 rejected input lines)" in ran.stdout
    shown = [line for line in ran.stderr.splitlines() if " done" in line]
    # The last comes while the items are out (1.5 s each), long after the 200 lines were read;
    # the ones before may come while they are read.
    assert shown and "/200 done" in shown[-1], ran.stderr
    assert ", 180 failed (0 dead-lettered, 180 rejected input lines), " in shown[-1], shown


@pytest.mark.parametrize("capacity, ttft_ms, queues", [(1, 100, True), (0, 600, False)])
def test_a_server_queue_is_named_on_the_line_and_a_server_keeping_up_is_not(
        tmp_path: Path, capacity: int, ttft_ms: int, queues: bool) -> None:
    """16 requests in flight at a simulator serving one at a time: its queue holds each for
    the 15 before it, and the line says the server queues, with the first token's wait now
    and early on. With no capacity limit (a slower first token, so that lines come while
    items are out) the first token stays as quick, and nothing is said."""
    (tmp_path / "input.jsonl").write_bytes(b"".join(
        orjson.dumps({"id": f"i{n}", "prompt": "p"}) + b"\n" for n in range(40)))
    write_job(tmp_path / "job.yaml", shards=1, concurrency=16, endpoint={
        "base_url": "sim://", "api": "chat", "model": "m",
        "sim": {"ttft_ms": ttft_ms, "itl_ms": 0, "tokens": 2, "capacity": capacity}})
    ran = run_cli("job.yaml", "--runs-dir", "runs", "--progress-interval", "0.2", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    # A line came after the first 16 answers, with items still out: the view had figures.
    assert re.search(r"\] (1[6-9]|2\d|3\d)/40 done", ran.stderr), ran.stderr
    said = [line for line in ran.stderr.splitlines() if "; server queueing: " in line]
    assert bool(said) == queues, ran.stderr
    if queues:
        assert re.search(r"first token after \d\.\d\d s, against 0\.\d\d s early", said[-1])


def test_an_early_first_token_of_0_ms_stays_the_early_figure() -> None:
    """A local server's first tokens rounded to 0 ms early on: that 0.0 is the lowest mean
    of the run, not an unset one that the next window's mean replaces (it read 0.2 s, and
    0.6 s later was judged no queueing against it)."""
    clock = Clock()
    view = ProgressView(100, quiet=True, clock=clock)
    ms = n = 0
    for second, mean_ms in enumerate((0, 0, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200,
                                      200, 200, 200, 600)):
        for quarter in range(1, 5):
            clock.now = 100.0 + second + quarter / 4
            ms, n = ms + 2 * mean_ms, n + 2
            view.update(0, report(n, first_token_ms=ms, first_tokens=n))
            snap = view.snapshot()
    assert snap.first_token_early_s == 0.0
    assert snap.first_token_s is not None and snap.first_token_s > 0.2


@pytest.mark.parametrize("late_chars, said", [(100, True), (400, False)])
def test_first_tokens_lengthened_by_longer_prompts_are_no_server_queue(
        late_chars: int, said: bool) -> None:
    """First tokens 0.2 s early on and 1.0 s later: with prompts as long as before the server
    queues, and the line says so; with prompts 4 times as long their prefill may be all of it,
    and the line says nothing (a stream of long prompts after short ones)."""
    clock, out = Clock(), StringIO()
    view = ProgressView(1000, tty=False, stream=out, clock=clock, interval=1.0)
    view.start()
    ms = n = chars = 0
    for second in range(30):
        mean_ms, prompt = (200, 100) if second < 5 else (1000, late_chars)
        for quarter in range(1, 5):
            clock.now = 100.0 + second + quarter / 4
            ms, n, chars = ms + 2 * mean_ms, n + 2, chars + 2 * prompt
            view.update(0, report(n, first_token_ms=ms, first_tokens=n, first_token_chars=chars,
                                  in_flight=8, cap=8))
            view.refresh()
    last = out.getvalue().splitlines()[-1]
    assert ("; server queueing: first token after 1.00 s, against 0.20 s early in the run"
            in last) == said, last

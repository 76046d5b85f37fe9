"""The progress of a command's long loop (`shardrun.ticker`): as the run's view shows its own."""

from __future__ import annotations

from io import StringIO

from shardrun.ticker import Ticker, ticker_line


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def run_loop(ticker: Ticker, clock: Clock, rows: int, per_s: int = 100) -> None:
    start = clock.now
    for row in range(1, rows + 1):
        clock.now = start + row / per_s
        ticker.step()


def test_plain_lines_come_every_interval_without_escape_codes() -> None:
    clock, out = Clock(), StringIO()
    ticker = Ticker(interval=2.0, stream=out, clock=clock)
    assert not ticker.tty
    ticker.phase("writing rows", "rows", lambda: 0.5)
    run_loop(ticker, clock, 500)  # 5 s
    ticker.close()
    lines = out.getvalue().splitlines()
    assert lines == ["[    2.0s] writing rows: 200 rows (50.0% of the input read), 100 rows/s",
                     "[    4.0s] writing rows: 400 rows (50.0% of the input read), 100 rows/s"]


def test_quiet_shows_nothing_and_a_terminal_gets_one_live_line() -> None:
    clock, out = Clock(), StringIO()
    ticker = Ticker(quiet=True, interval=0.1, stream=out, clock=clock)
    ticker.phase("reading", "lines")
    run_loop(ticker, clock, 300)
    ticker.close()
    assert out.getvalue() == ""
    ticker = Ticker(interval=100.0, stream=out, clock=clock, tty=True)
    assert ticker.tty
    ticker.phase("reading the input", "lines")
    run_loop(ticker, clock, 300)  # 3 s: redrawn, not one line per interval
    ticker.close()
    text = out.getvalue()
    assert "reading the input: 300 lines, 100 lines/s  elapsed 0:03" in text
    assert text.count("reading the input:") > 5


def test_the_line_leaves_out_what_is_not_known() -> None:
    assert ticker_line("reading", 10, "lines", None, 0.1) == "reading: 10 lines"
    assert ticker_line("reading", 1500, "lines", 0.25, 2.0) == (
        "reading: 1,500 lines (25.0% of the input read), 750 lines/s")

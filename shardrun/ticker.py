"""Progress of one long loop of a command (`export`, `validate`), shown as a run shows its own.

On a terminal (`progress._may_be_terminal`, then rich's answer) one live line, redrawn at most
four times a second: what the loop does, how far it has got, how much of the input it has read
when that is known, the rate and the time gone. Anywhere else one plain line every `interval`
seconds, with no escape codes; `quiet` shows nothing. Always on standard error unless told: a
command's standard output stays its own (`export` can write there).

A loop calls `step()` once per line or row: a counter and a clock read, no more, until a line
is due. At a million rows `export` was 20 s of silence, `validate` 3.5 s.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from shardrun.progress import _may_be_terminal, clock_text

if TYPE_CHECKING:
    from rich.live import Live
    from rich.text import Text

__all__ = ["Ticker", "ticker_line"]

REDRAW_EVERY_S = 0.25  # on a terminal, as the run's display


def ticker_line(what: str, count: int, unit: str, read: float | None, elapsed: float) -> str:
    """'writing rows: 123,456 rows (12.3% of the input read), 45,678 rows/s' (pure)."""
    share = "" if read is None else f" ({100 * read:.1f}% of the input read)"
    rate = f", {count / elapsed:,.0f} {unit}/s" if elapsed >= 0.5 else ""
    return f"{what}: {count:,} {unit}{share}{rate}"


class Ticker:
    """See the module docstring. `phase` names the loop that follows; `close` ends the display
    (a terminal keeps the last line)."""

    def __init__(self, *, quiet: bool = False, interval: float = 10.0,
                 stream: TextIO | None = None, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.quiet, self.interval, self.clock = quiet, interval, clock
        self.stream = stream if stream is not None else sys.stderr
        self._console = None
        if not quiet and (tty or (tty is None and _may_be_terminal(self.stream))):
            from rich.console import Console

            self._console = Console(file=self.stream, force_terminal=tty or None)
        self.tty = self._console is not None and self._console.is_terminal
        self._live: Live | None = None
        self.what, self.unit, self.count = "", "", 0
        self._read: Callable[[], float | None] | None = None
        self.started = self._due = clock()

    def phase(self, what: str, unit: str,
              read: Callable[[], float | None] | None = None) -> None:  # fmt: skip
        """Start counting a new loop: `what` it does, the `unit` it counts, and `read`, the
        share of the input read so far (0 to 1) when known."""
        self.what, self.unit, self.count, self._read = what, unit, 0, read
        self.started = self.clock()
        self._due = self.started + (REDRAW_EVERY_S if self.tty else self.interval)

    def step(self) -> None:
        self.count += 1
        if self.quiet or self.clock() < self._due:
            return
        self._show()

    def _text(self) -> str:
        now = self.clock()
        read = None if self._read is None else self._read()
        return ticker_line(self.what, self.count, self.unit, read, now - self.started)

    def _show(self) -> None:
        now = self.clock()
        try:
            if self.tty:
                self._due = now + REDRAW_EVERY_S
                self._draw()
            else:
                self._due = now + self.interval
                print(f"[{now - self.started:7.1f}s] {self._text()}", file=self.stream,
                      flush=True)
        except OSError:  # the terminal hung up, or the pipe's reader left: show no more
            self.quiet, self._live = True, None

    def _frame(self) -> Text:
        from rich.text import Text

        return Text(f"{self._text()}  elapsed {clock_text(self.clock() - self.started)}")

    def _draw(self) -> None:
        if self._live is None:
            from rich.live import Live

            self._live = Live(self._frame(), console=self._console, auto_refresh=False)
            self._live.start()
        else:
            self._live.update(self._frame(), refresh=True)

    def close(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            with contextlib.suppress(OSError):
                live.update(self._frame(), refresh=True)
                live.stop()

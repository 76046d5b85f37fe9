"""The live view of a run: what the operator watches while it goes.

The coordinator feeds each shard's periodic `progress` message to `ProgressView.update` and
calls `refresh` about four times a second (never per request). On a terminal the view is one
rich Live display: an overall bar (done / total with an ETA, or a count and a rate when the
total is unknown), succeeded / failed / retrying, completion TPM and requests/s over the last
~10 s, how many requests wait for a rate limit, how long the endpoint has been down while
every shard waits for it (or how many shards wait while the others hear answers; or how long it
has failed every request, or sent nothing back to the requests out), a stop letting its
requests in flight finish, how many shards are still starting (not heard from yet), and per
shard its in_flight / cap and queue depth. Anywhere else (a log file, CI) it is one plain line
every `interval` seconds, with no escape codes; `quiet` shows nothing.

Shard counters are cumulative; a shard whose counter goes backwards (a restarted process) is
taken to have started again from zero, and what it reported before is kept.

rich is imported only when the view may draw on a terminal (`_may_be_terminal`), so a run
logging to a file or a pipe never loads it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from shardrun._ellipsis import counted

if TYPE_CHECKING:
    # rich is imported where it draws, only on a terminal: a run logging to a file or a pipe
    # prints plain lines and never loads it (about 0.1 CPU-s of imports).
    from rich.console import Console, Group
    from rich.live import Live
    from rich.table import Table

__all__ = ["ProgressView", "Snapshot", "clock_text", "count_lines_cheaply", "estimate_total",
           "limit_clause", "server_queueing", "smoothed_rate", "summed_paces"]

COUNTERS = ("ok", "dead", "attempts", "retries", "completion_tokens", "limited_429s",
            "first_token_ms", "first_tokens", "first_token_chars")
GAUGES = ("queued", "in_flight", "retrying", "cap", "down_s", "rate_waiting", "failing_s",
          "failing_cause", "sending", "unheard_s", "paced_rps", "paced_tps", "paced_seeded")
CAUSE_CHARS = 60  # of a storm's cause on the progress line
# Requests out and nothing heard for this long (no stream's events, no answer): say so. A hung
# endpoint holds every request until its timeouts fire, and timeouts are no storm; without the
# line the view shows only "0 TPM" for minutes. Long enough that a slow first token at a small
# cap rarely trips it, and the text only states what is seen.
SILENT_AFTER_S = 30.0
# A shard started this long ago and not heard from yet is said to be starting: its start-up may
# take the coordinator's START_SILENCE_MIN_S (30 s) whatever `shard_silence_s` says, and a
# start that long showed nothing moving and no reason. Most shards report within a second.
STARTING_AFTER_S = 3.0
WINDOW_S = 10.0
# How long the view's start waits for the input's count (which then goes on in a thread): an
# input counted this fast has its total from the first frame; 190 MB take about 0.14 s.
COUNT_WAIT_S = 0.05
MIN_SPAN_S = 0.5  # a rate over less than this is noise: show none
# The ETA's rate: the window's item rate averaged with exponential weights whose time constant
# is a quarter of the time the run has gone, between these bounds. Early on it follows the
# window (a run's first seconds say little), later it damps the swings a shared machine puts
# in a 10 s window: the ETA went 2:10, 2:35, 1:52 in three lines 5 s apart.
ETA_TAU_MIN_S = 2.0
ETA_TAU_MAX_S = 30.0
_CHUNK = 1 << 20
# "server queueing": the successes' time to first token over the window, against the lowest
# such mean of the run (its early requests, before the server's queue grew). Only a mean of
# this many first tokens is judged, and only a rise this many times over and this much longer
# is said: a server's own queue lengthens the first token, a long answer or a busy client
# barely does, and a 20 ms first token doubling to 40 ms is no news.
QUEUE_MIN_FIRST_TOKENS = 4
QUEUE_FACTOR = 3.0
QUEUE_RISE_S = 0.5
# ... and only while the window's prompts average at most this many times the early ones'
# characters: a longer prompt's prefill lengthens its first token with no queue at all.
QUEUE_PROMPT_FACTOR = 1.5


@dataclass(frozen=True, slots=True)
class ShardRow:
    index: int
    in_flight: int
    cap: int | None
    queued: int
    retrying: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the view shows at one instant; pure data, rendered by the format_* functions."""

    elapsed: float
    total: int | None
    ok: int
    dead: int
    retrying: int
    attempts: int
    completion_tokens: int
    tpm: float | None
    requests_per_s: float | None
    items_per_s: float | None
    shards: tuple[ShardRow, ...]
    # How long the endpoint has been down while every shard still working waits for it: as the
    # shard that waited least saw it, so no shard has heard an answer in that time. None while
    # any hears answers (`shardrun.outage`): the worst shard's wait read "endpoint down for
    # 0:04" while the others' successes went from 3,137 to 3,199 after a restart.
    down_s: float | None = None
    # Requests held by a rate limit right now (the job's rpm/tpm, or a pause the server's
    # x-ratelimit-* headers asked for): without it, a run held so reads like a hang.
    rate_waiting: int = 0
    # How long the endpoint has failed every request it answered (a storm, `shardrun.outage`),
    # and the latest failure, from the shard in it longest; None while none is in one.
    failing_s: float | None = None
    failing_cause: str | None = None
    # How long requests have been out with nothing heard in any shard sending them (shards
    # report `unheard_s`), once that passes SILENT_AFTER_S; None otherwise, or while `down_s`
    # / `failing_s` already say why. `sending`: the requests out (attempts running).
    silent_s: float | None = None
    sending: int = 0
    # The item rate the ETA divides by (`smoothed_rate`); None: `items_per_s`.
    eta_items_per_s: float | None = None
    # A resume passing over the input lines earlier passes finished, before it starts the
    # shards: how many it has passed so far; None once it is done (or when there was none).
    skipping: int | None = None
    # Of those lines, how many were rejected: a job whose every line is (a misnamed prompt
    # field) read a million of them in 25 s with nothing on the screen saying so.
    skipping_rejected: int = 0
    # Input lines this pass rejected: failed, as the summary counts them (`RunSummary.failed`),
    # and done. A pass of 200,000 rejected lines showed "0 failed" to its end.
    rejected: int = 0
    # While some shards wait for the endpoint and others do not (`down_s` is None): how many
    # wait, of how many hold items (in flight, queued or retrying), and the longest wait. A
    # shard's probe waits out its backoff (up to `outage.PROBE_MAX_S`) after the endpoint is
    # back, and a busy server answers some shards' queued probes late; the endpoint is up,
    # these items only wait their turn.
    waiting_shards: int = 0
    working_shards: int = 0
    waiting_s: float | None = None
    # A stop letting the requests in flight finish (the first Ctrl-C, SIGTERM, an error): no
    # ETA then, the run ends once they have.
    stopping: bool = False
    # Shards started at least STARTING_AFTER_S ago that have sent no report yet, of how many
    # shards are started and not ended, and the longest of those starts so far.
    starting_shards: int = 0
    started_shards: int = 0
    starting_s: float | None = None
    # 429s of the server's rate limit so far (each held its item), and the pace the working
    # shards learned of it (`summed_paces`): requests and tokens a second (None: none learned
    # one), and whether all of it was set from the limit the server stated, none cut.
    limited_429s: int = 0
    paced_rps: float | None = None
    paced_tps: float | None = None
    paced_seeded: bool = False
    # The successes' mean time to first token over the window, and the lowest such mean of the
    # run (`_first_token_text`); None: too few first tokens to say.
    first_token_s: float | None = None
    first_token_early_s: float | None = None
    # Their prompts' mean characters, likewise: a rise from longer prompts is no queue.
    first_token_chars: float | None = None
    first_token_early_chars: float | None = None

    @property
    def in_flight(self) -> int:
        return sum(row.in_flight for row in self.shards)

    @property
    def done(self) -> int:
        return self.ok + self.dead + self.rejected

    @property
    def failed(self) -> int:
        return self.dead + self.rejected

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current item rate, when the total and a rate are known; none
        while the endpoint is down or fails everything (the rate then says nothing about the
        time left), nor while nothing finished in the window (the smoothed rate only decays
        then, and an ETA from it would promise an end that nothing says is coming), nor during
        a stop (the run ends with its requests in flight, not at the total)."""
        rate = self.items_per_s if self.eta_items_per_s is None else self.eta_items_per_s
        if (self.total is None or not rate or not self.items_per_s or self.down_s is not None
                or self.failing_s is not None or self.stopping):
            return None
        return max(0, self.total - self.done) / rate


class _Shard:
    """One shard's latest report, with counters carried over a restart."""

    def __init__(self) -> None:
        self.last: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.base: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.gauges: dict[str, Any] = {}
        self.finished = False  # its last report (`done`) came: it waits for nothing now

    def apply(self, report: Mapping[str, Any]) -> None:
        for name in COUNTERS:
            value = int(report.get(name) or 0)
            if value < self.last[name]:
                self.base[name] += self.last[name]
            self.last[name] = value
        self.gauges = {name: report.get(name) for name in GAUGES}
        self.finished = report.get("t") == "done"

    def total(self, name: str) -> int:
        return self.base[name] + self.last[name]


class ProgressView:
    """Live progress of one run (see the module docstring). Not thread-safe: one event loop."""

    def __init__(
        self,
        total: int | None = None,
        *,
        quiet: bool = False,
        tty: bool | None = None,
        interval: float = 10.0,
        console: Console | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_shard_rows: int = 16,
        count: Callable[[threading.Event], int | None] | None = None,
        limit: int | None = None,
    ) -> None:
        self.total, self.quiet, self.interval = total, quiet, interval
        # --limit: a total that is the limit counts items, not the lines rejected on the way,
        # which are done too (`rejected`): until the input's end (`set_total`) they are added.
        self.limit = limit
        self.stream = stream if stream is not None else sys.stderr
        if console is None and not quiet and (
            tty or (tty is None and _may_be_terminal(self.stream))
        ):
            from rich.console import Console

            console = Console(file=self.stream)
        self.console: Console | None = console
        if tty is None:
            tty = console is not None and console.is_terminal
        self.tty = tty
        self.clock, self.max_shard_rows = clock, max_shard_rows
        self.shards: dict[int, _Shard] = {}
        # Shards started and not heard from yet (`shard_started`): when each was started.
        self._unheard: dict[int, float] = {}
        self.started = clock()
        self._samples: deque[tuple[float, int, int, int, int, int, int]] = deque()
        # The lowest window mean of first tokens, with its prompts' mean characters.
        self._first_token_early: tuple[float, float] | None = None
        self._eta_rate: float | None = None
        self._eta_at = self.started
        # Set by a resume while it skips the finished input lines: how many so far, and how
        # many of them were rejected.
        self.skipping: Callable[[], int] | None = None
        self.skipping_rejected: Callable[[], int] = lambda: 0
        # The input lines this pass rejected so far (set by the coordinator).
        self.rejected: Callable[[], int] = lambda: 0
        # Set by the coordinator once it has told the shards to stop.
        self.stopping = False
        self._last_line = self.started
        self._live: Live | None = None
        # The total, counted off the event loop (`count`) while the run goes: a big input's
        # count no longer holds back its first request, and has no size limit. The input's
        # end (`set_total`) knows better, and a count that comes later is dropped.
        self._count = None if quiet else count
        self._counted: int | None = None
        self._total_known = False
        self._stop_count = threading.Event()
        self._counter: threading.Thread | None = None

    def set_total(self, n: int | None) -> None:
        self.total, self._total_known = n, True

    def _total(self) -> int | None:
        """The total shown: a --limit pass's rejected lines are done, and no item of its limit
        (a --limit 1000 pass of half rejected lines showed 1,616/1,000 done, ETA 0:00)."""
        if self._total_known or self.total is None or self.limit is None or (
                self.total < self.limit):
            return self.total  # the input's end, or a count of lines, holds them already
        return self.total + self.rejected()

    def _run_count(self, count: Callable[[threading.Event], int | None]) -> None:
        self._counted = count(self._stop_count)

    def _take_count(self) -> None:
        """The count's result, set by its thread, made the total in the loop's."""
        if self._counted is not None:
            counted, self._counted = self._counted, None
            if not self._total_known:
                self.total = counted

    def shard_started(self, shard_index: int) -> None:
        """A shard's process was started: until its first report it is starting."""
        self._unheard[shard_index] = self.clock()

    def update(self, shard_index: int, report: Mapping[str, Any]) -> None:
        self._unheard.pop(shard_index, None)
        self.shards.setdefault(shard_index, _Shard()).apply(report)

    def ended(self, shard_index: int) -> None:
        """A shard's process is gone (a dead one sends no `done`): it works and waits no more,
        and its requests are not in flight. Its counts stand. A dead shard's last report
        lingered: its wait of 0 kept "endpoint down" from every other shard's outage, and its
        in_flight counted in a stop's requests to finish."""
        self._unheard.pop(shard_index, None)
        shard = self.shards.get(shard_index)
        if shard is not None and not shard.finished:
            shard.finished = True
            shard.gauges = {"cap": shard.gauges.get("cap")}

    def start(self) -> None:
        """Start the clock, the count (a thread: call this after any fork) and the display."""
        self.started = self._last_line = self._eta_at = self.clock()
        if self._count is not None and self._counter is None:
            self._counter = threading.Thread(target=self._run_count, args=(self._count,),
                                             name="shardrun-count", daemon=True)
            self._counter.start()
            # A small input is counted before the first frame, as if counted up front.
            self._counter.join(timeout=COUNT_WAIT_S)
            self._take_count()
        if self.tty and not self.quiet:
            from rich.live import Live

            self._live = Live(self.render(), console=self.console, auto_refresh=False)
            self._live.start()

    def refresh(self) -> None:
        """Sample the rates and redraw (terminal) or print a line when one is due (plain)."""
        if self.quiet:  # the samples only feed the display's rates; `final_line` needs none
            return
        snap = self.snapshot()
        try:
            if self._live is not None:
                self._live.update(render_snapshot(snap, self.max_shard_rows), refresh=True)
            elif not self.tty and self.clock() - self._last_line >= self.interval:
                self._last_line = self.clock()
                print(format_plain_line(snap), file=self.stream, flush=True)
        except OSError:  # the terminal hung up, or the reader of a pipe went away: show no more
            self.quiet, self._live = True, None

    def stop(self) -> None:
        """Stop the count, leave the last frame on screen and give the terminal back."""
        self._stop_count.set()
        if self._counter is not None:
            self._counter.join(timeout=1.0)  # it stops within one chunk's read
        if self._live is not None:
            live, self._live = self._live, None
            with contextlib.suppress(OSError):  # a terminal that hung up takes no last frame
                live.update(self.render(), refresh=True)
                live.stop()

    def final_line(self) -> str:
        """One line for the end of the run, averages over the whole run."""
        return format_final_line(self.snapshot(sample=False))

    def render(self) -> Group:
        return render_snapshot(self.snapshot(sample=False), self.max_shard_rows)

    def snapshot(self, *, sample: bool = True) -> Snapshot:
        """The current figures; `sample` records this instant for the sliding-window rates."""
        now = self.clock()
        self._take_count()
        sums = {name: sum(s.total(name) for s in self.shards.values()) for name in COUNTERS}
        done = sums["ok"] + sums["dead"]
        if sample:
            self._samples.append((now, done, sums["attempts"], sums["completion_tokens"],
                                  sums["first_token_ms"], sums["first_tokens"],
                                  sums["first_token_chars"]))
            while len(self._samples) > 2 and self._samples[1][0] <= now - WINDOW_S:
                self._samples.popleft()
        rates = _rates(self._samples)
        first_token = _first_token_s(self._samples)
        early = self._first_token_early
        if sample and first_token is not None and (early is None or first_token[0] < early[0]):
            self._first_token_early = early = first_token  # 0.0 s is a lowest mean too
        if sample:
            self._eta_rate = smoothed_rate(self._eta_rate, rates[2], now - self._eta_at,
                                           now - self.started)
            self._eta_at = now
        rows = tuple(_row(i, s) for i, s in sorted(self.shards.items()))
        working = [s for s in self.shards.values() if not s.finished]
        # An idle shard not waiting hears no answers either, so it counts for neither: it read
        # as one "hearing answers", and its wait of 0 kept "endpoint down" off the line while
        # every shard with items waited.
        busy = [s for s in working if _has_items(s.gauges) or s.gauges.get("down_s")]
        waits = [float(s.gauges.get("down_s") or 0) for s in busy]
        waiting = [wait for wait in waits if wait > 0]
        # Down only while every shard counted waits (one hearing answers says the endpoint is
        # up), and for as long as all have: the least wait.
        down = min(waits, default=0.0)
        held = sum(int(s.gauges.get("rate_waiting") or 0) for s in self.shards.values())
        failing = max((s.gauges for s in self.shards.values()), default={},
                      key=lambda g: float(g.get("failing_s") or 0))
        failing_s = float(failing.get("failing_s") or 0) or None
        sending = [s.gauges for s in self.shards.values() if s.gauges.get("sending")]
        # The shard that heard last: one shard hearing answers means the endpoint answers.
        unheard = min((float(g.get("unheard_s") or 0) for g in sending), default=0.0)
        silent_s = None if unheard < SILENT_AFTER_S or down or failing_s else unheard
        starts = [now - at for at in self._unheard.values() if now - at >= STARTING_AFTER_S]
        return Snapshot(now - self.started, self._total(), sums["ok"], sums["dead"],
                        sum(r.retrying for r in rows), sums["attempts"],
                        sums["completion_tokens"], *rates, rows, down or None, held,
                        failing_s, failing.get("failing_cause") if failing_s else None,
                        silent_s, sum(int(g["sending"]) for g in sending),
                        self._eta_rate, None if self.skipping is None else self.skipping(),
                        self.skipping_rejected() if self.skipping is not None else 0,
                        self.rejected(), 0 if down else len(waiting), len(busy),
                        None if down or not waiting else max(waiting), self.stopping,
                        len(starts), len(working) + len(self._unheard), max(starts, default=None),
                        sums["limited_429s"], *summed_paces(s.gauges for s in working),
                        *_first_token_figures(first_token, early))


def _may_be_terminal(stream: TextIO) -> bool:
    """False only where rich's `Console.is_terminal` would say False too, without rich.

    rich answers from `TTY_COMPATIBLE` and `FORCE_COLOR` first, then from `isatty()`; when
    neither variable is set and the stream is no tty, the answer is no.
    """
    if os.environ.get("TTY_COMPATIBLE", "") or os.environ.get("FORCE_COLOR") is not None:
        return True
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream: as rich does
        return False


def _has_items(gauges: Mapping[str, Any]) -> bool:
    """Whether a shard's last report holds items: in flight, queued or waiting to retry."""
    return any(int(gauges.get(name) or 0) for name in ("in_flight", "queued", "retrying"))


def _row(index: int, shard: _Shard) -> ShardRow:
    g = shard.gauges
    cap = g.get("cap")
    return ShardRow(index, int(g.get("in_flight") or 0), None if cap is None else int(cap),
                    int(g.get("queued") or 0), int(g.get("retrying") or 0))  # fmt: skip


def _rates(
    samples: deque[tuple[float, int, int, int, int, int, int]],
) -> tuple[float | None, float | None, float | None]:
    """(completion TPM, requests/s, items/s) between the oldest and newest sample."""
    if len(samples) < 2:
        return None, None, None
    (t0, done0, att0, tok0, *_), (t1, done1, att1, tok1, *_) = samples[0], samples[-1]
    span = t1 - t0
    if span < MIN_SPAN_S:
        return None, None, None
    return (tok1 - tok0) / span * 60, (att1 - att0) / span, (done1 - done0) / span


def _first_token_s(
    samples: deque[tuple[float, int, int, int, int, int, int]],
) -> tuple[float, float] | None:
    """The successes' mean seconds to first token between the oldest and newest sample, and
    their prompts' mean characters; None for fewer than QUEUE_MIN_FIRST_TOKENS of them."""
    if len(samples) < 2:
        return None
    (*_, ms0, n0, chars0), (*_, ms1, n1, chars1) = samples[0], samples[-1]
    n = n1 - n0
    if n < QUEUE_MIN_FIRST_TOKENS:
        return None
    return (ms1 - ms0) / n / 1000, (chars1 - chars0) / n


def _first_token_figures(
    now: tuple[float, float] | None, early: tuple[float, float] | None,
) -> tuple[float | None, float | None, float | None, float | None]:
    """The window's and the early mean first token, then their prompts' mean characters: the
    order of Snapshot's fields."""
    (s, chars), (early_s, early_chars) = now or (None, None), early or (None, None)
    return s, early_s, chars, early_chars


def smoothed_rate(previous: float | None, rate: float | None, dt: float,
                  elapsed: float) -> float | None:
    """The ETA's rate after a new window `rate`, `dt` seconds after `previous`, `elapsed`
    seconds into the run: an exponentially weighted average, its time constant a quarter of
    `elapsed` within [ETA_TAU_MIN_S, ETA_TAU_MAX_S]. No rate yet keeps the previous one; the
    first rate is taken as it is."""
    if rate is None:
        return previous
    if previous is None:
        return rate
    tau = min(ETA_TAU_MAX_S, max(ETA_TAU_MIN_S, elapsed / 4))
    weight = 1.0 - math.exp(-max(0.0, dt) / tau)
    return previous + weight * (rate - previous)


# -- rendering (pure) --------------------------------------------------------------------------


def clock_text(seconds: float | None) -> str:
    """Seconds as M:SS, or H:MM:SS from an hour on; '--:--' for none."""
    if seconds is None:
        return "--:--"
    s = int(seconds + 0.5)
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_plain_line(s: Snapshot) -> str:
    """The status line printed when the output is not a terminal."""
    if s.skipping is not None:
        return f"[{s.elapsed:7.1f}s] {_skipping_text(s.skipping, s.skipping_rejected)}"
    if s.total:
        head = f"{s.done:,}/{s.total:,} done ({100 * s.done / s.total:.1f}%)"
    else:
        head = f"{s.done:,} done"
    eta = "" if s.eta_s is None else f", ETA {clock_text(s.eta_s)}"
    return (f"[{s.elapsed:7.1f}s] {head}: {s.ok:,} ok, {_failed_text(s)}, "
            f"{s.retrying:,} retrying; {_num(s.tpm)} TPM, {_num(s.requests_per_s, 1)} req/s"
            f"{eta}{_stopping_text(s)}{_held_text(s.rate_waiting)}{_down_text(s.down_s)}"
            f"{_waiting_text(s.waiting_shards, s.working_shards, s.waiting_s)}"
            f"{_failing_text(s.failing_s, s.failing_cause)}"
            f"{_silent_text(s.silent_s, s.sending)}"
            f"{_starting_text(s.starting_shards, s.started_shards, s.starting_s)}"
            f"{_limit_text(s)}{_first_token_text(s)}")


def _failed_text(s: Snapshot) -> str:
    """The failed count, and when input lines were rejected, what it is made of, as the run's
    summary says it."""
    if not s.rejected:
        return f"{s.failed:,} failed"
    return f"{s.failed:,} failed ({s.dead:,} dead-lettered, {s.rejected:,} rejected input lines)"


def _skipping_text(lines: int, rejected: int) -> str:
    # Lines read, not items skipped: a retry pass passes over the lines it leaves out, and any
    # pass over rejects, which no count of finished items shows moving.
    text = f"reading up to the first item to run: {lines:,} input lines so far"
    # A resume's rejects go to rejects.rK.jsonl, hence no file name here.
    said = f", {rejected:,} of them rejected (the pass's rejects file says why)"
    return text + (said if rejected else "")


def _held_text(rate_waiting: int) -> str:
    return f"; {rate_waiting:,} waiting for the rate limit" if rate_waiting else ""


def summed_paces(reports: Iterable[Mapping[str, Any]]) -> tuple[float | None, float | None,
                                                                  bool]:  # fmt: skip
    """The paces the shards' reports say they learned of the server's limit, summed over the
    shards that learned one: requests a second and tokens a second (None where none did; a
    shard may learn either or both), and whether every such shard's was last set from the
    limit a 429 stated (`paced_seeded`), not cut."""
    paced = [r for r in reports
             if r.get("paced_rps") is not None or r.get("paced_tps") is not None]
    rps = [float(r["paced_rps"]) for r in paced if r.get("paced_rps") is not None]
    tps = [float(r["paced_tps"]) for r in paced if r.get("paced_tps") is not None]
    return (sum(rps) if rps else None, sum(tps) if tps else None,
            bool(paced) and all(r.get("paced_seeded") for r in paced))


def limit_clause(refused: int, paced_rps: float | None, answered_rpm: float | None = None,
                 paced_tps: float | None = None, seeded: bool = False) -> str:
    """The server's rate limit in a few words: its 429s, what it answered a minute on average
    when known (at most its limit), and the shards' pace of requests and of tokens as last set:
    from the limit a 429 stated (`seeded`), or at their last cut (which grows after it, and one
    from the opening burst can be above the limit)."""
    answered = "" if answered_rpm is None else f", {answered_rpm:,.0f} req/min answered on average"
    paces = [f"{per_s * 60:,.0f} {unit}/min"
             for per_s, unit in ((paced_rps, "req"), (paced_tps, "tokens")) if per_s is not None]
    how = "set from the server's stated limit to" if seeded else "last cut to"
    pace = f", pace {how} {' and '.join(paces)}" if paces else ""
    return f"{counted(refused, '429')} held{answered}{pace}"


def _limit_text(s: Snapshot) -> str:
    """The server refused requests for its rate limit: its limit, not the cap, sets the pace."""
    if not s.limited_429s:
        return ""
    clause = limit_clause(s.limited_429s, s.paced_rps, None, s.paced_tps, s.paced_seeded)
    return f"; server rate limit: {clause}"


def server_queueing(first_token_s: float | None, early_s: float | None,
                    chars: float | None = None, early_chars: float | None = None) -> bool:
    """Whether the server is the bottleneck: its first tokens now come QUEUE_FACTOR times and
    QUEUE_RISE_S later than early in the run, which its own queue does (requests wait there
    for a slot before it starts them), and no client-side limit can; with the prompts' mean
    `chars` and `early_chars`, not when the prompts grew QUEUE_PROMPT_FACTOR times (their
    prefill lengthens the first token, as a stream of long prompts after short ones)."""
    if first_token_s is None or early_s is None:
        return False
    if chars is not None and early_chars is not None and chars > QUEUE_PROMPT_FACTOR * early_chars:
        return False
    return first_token_s >= QUEUE_FACTOR * early_s and first_token_s - early_s >= QUEUE_RISE_S


def _first_token_text(s: Snapshot) -> str:
    """The server's queue, not the cap or a limit, sets the pace: more concurrency only
    lengthens the wait."""
    if not server_queueing(s.first_token_s, s.first_token_early_s, s.first_token_chars,
                           s.first_token_early_chars):
        return ""
    return (f"; server queueing: first token after {s.first_token_s:,.2f} s, against "
            f"{s.first_token_early_s:,.2f} s early in the run")


def _down_text(down_s: float | None) -> str:
    """Why nothing moves while the endpoint is away, and that the items are held, not lost."""
    if down_s is None:
        return ""
    return f"; endpoint down for {clock_text(down_s)}, items held until it answers"


def _waiting_text(waiting: int, working: int, waiting_s: float | None) -> str:
    """Some shards wait for the endpoint while the others hear answers: it is up, and their
    items go once their probe is answered."""
    if waiting_s is None:
        return ""
    return (f"; {waiting:,} of {counted(working, 'shard')} waiting for the endpoint "
            f"(up to {clock_text(waiting_s)}), the others hear answers")


def _starting_text(starting: int, started: int, starting_s: float | None) -> str:
    """Shards not heard from since they were started: a slow start-up, not a hang (yet)."""
    if starting_s is None:
        return ""
    return (f"; {starting:,} of {counted(started, 'shard')} starting, not heard from "
            f"for up to {clock_text(starting_s)}")


def _stopping_text(s: Snapshot) -> str:
    """A stop: what the run waits for before it ends."""
    if not s.stopping:
        return ""
    return f"; stopping: {counted(s.in_flight, 'request')} in flight to finish"


def _failing_text(failing_s: float | None, cause: str | None) -> str:
    """A storm: the endpoint answers, but fails everything; what it says, and that the items
    are held one probe at a time, not dead-lettered."""
    if failing_s is None:
        return ""
    said = ""
    if cause:
        said = f" ({cause if len(cause) <= CAUSE_CHARS else cause[:CAUSE_CHARS - 1] + '…'})"
    return (f"; endpoint failing every request for {clock_text(failing_s)}{said}, items held "
            "until it answers")


def _silent_text(silent_s: float | None, sending: int) -> str:
    """Requests out and nothing back: a hung or very slow endpoint, until timeouts fire."""
    if silent_s is None:
        return ""
    return (f"; nothing heard for {clock_text(silent_s)} with {counted(sending, 'request')} out, "
            "waiting for the endpoint")


def format_final_line(s: Snapshot) -> str:
    """Totals and run-average completion TPM."""
    tpm = s.completion_tokens / s.elapsed * 60 if s.elapsed > 0 else 0.0
    return (f"{counted(s.done, 'item')} in {s.elapsed:.1f} s: {s.ok:,} succeeded, "
            f"{_failed_text(s)}; {tpm:,.0f} completion TPM (run average)")  # fmt: skip


def shard_table(s: Snapshot, max_rows: int = 16) -> Table:
    """Per shard: in flight / cap and queue depth; beyond `max_rows`, one summary row."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("shard", justify="right")
    table.add_column("in flight / cap", justify="right")
    table.add_column("queue", justify="right")
    table.add_column("retrying", justify="right")
    for row in s.shards[:max_rows]:
        cap = "?" if row.cap is None else f"{row.cap:,}"
        table.add_row(str(row.index), f"{row.in_flight:,} / {cap}", f"{row.queued:,}",
                      f"{row.retrying:,}")  # fmt: skip
    rest = s.shards[max_rows:]
    if rest:
        caps = sum(r.cap or 0 for r in rest)
        table.add_row(f"+{len(rest)} more", f"{sum(r.in_flight for r in rest):,} / {caps:,}",
                      f"{sum(r.queued for r in rest):,}", f"{sum(r.retrying for r in rest):,}")
    return table


def render_snapshot(s: Snapshot, max_rows: int = 16) -> Group:
    """The terminal frame: bar line, counts line, shard table."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    if s.skipping is not None:
        return Group(Text(f"{_skipping_text(s.skipping, s.skipping_rejected)}  "
                          f"elapsed {clock_text(s.elapsed)}"))
    if s.total:
        pct = 100 * s.done / s.total
        left = "stopping" if s.stopping else f"ETA {clock_text(s.eta_s)}"
        head.add_row(ProgressBar(total=s.total, completed=min(s.done, s.total), width=40),
                     Text(f"{s.done:,}/{s.total:,}  {pct:.1f}%  {left}"))
    else:
        head.add_row(Text(f"{s.done:,} done  {_num(s.items_per_s, 1)} items/s"))
    counts = Text.assemble(
        ("succeeded ", "dim"), (f"{s.ok:,}", "green"), ("  failed ", "dim"),
        (f"{s.failed:,}", "red" if s.failed else ""),
        (f" ({s.dead:,} dead-lettered, {s.rejected:,} rejected input lines)" if s.rejected
         else "", "dim"),
        ("  retrying ", "dim"), f"{s.retrying:,}",
        ("  │  ", "dim"), f"{_num(s.tpm)} TPM  {_num(s.requests_per_s, 1)} req/s",
        ("  elapsed ", "dim"), clock_text(s.elapsed),
    )  # fmt: skip
    if s.stopping:
        counts.append(_stopping_text(s).replace(";", "  │", 1), "yellow")
    if s.rate_waiting:
        counts.append(_held_text(s.rate_waiting).replace(";", "  │", 1), "yellow")
    if s.down_s is not None:
        counts.append(_down_text(s.down_s).replace(";", "  │", 1), "bold red")
    if s.waiting_s is not None:
        counts.append(_waiting_text(s.waiting_shards, s.working_shards, s.waiting_s)
                      .replace(";", "  │", 1), "yellow")
    if s.failing_s is not None:
        counts.append(_failing_text(s.failing_s, s.failing_cause).replace(";", "  │", 1),
                      "bold red")
    if s.silent_s is not None:
        counts.append(_silent_text(s.silent_s, s.sending).replace(";", "  │", 1), "yellow")
    if s.starting_s is not None:
        counts.append(_starting_text(s.starting_shards, s.started_shards, s.starting_s)
                      .replace(";", "  │", 1), "yellow")
    if s.limited_429s:
        counts.append(_limit_text(s).replace(";", "  │", 1), "yellow")
    if queueing := _first_token_text(s):
        counts.append(queueing.replace(";", "  │", 1), "yellow")
    return Group(head, counts, shard_table(s, max_rows))


# -- the total, cheaply ------------------------------------------------------------------------


def count_lines_cheaply(path: Path, limit_bytes: int | None = None,
                        stop: threading.Event | None = None, lone_cr: bool = False) -> int | None:
    """Lines in a file (a last line without newline counts); None for a file over
    `limit_bytes`, one that cannot be read, or once `stop` is set. With `lone_cr` a CR not
    followed by an LF ends a line too, as in a CSV file (the csv module reads it so).

    Counts newline bytes in 1 MiB chunks: about 0.7 s per GB from the page cache.
    """
    try:
        if limit_bytes is not None and os.path.getsize(path) > limit_bytes:
            return None
        lines, last = 0, b"\n"
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                if stop is not None and stop.is_set():
                    return None
                lines += chunk.count(b"\n")
                if lone_cr:  # a CRLF split between two chunks is counted once
                    lines += (chunk.count(b"\r") - chunk.count(b"\r\n")
                              - (last == b"\r" and chunk[:1] == b"\n"))
                last = chunk[-1:]
    except OSError:
        return None
    return lines + (last not in (b"\n", b"\r" if lone_cr else b"\n"))


def estimate_total(path: Path, fmt: str, limit_bytes: int | None = None,
                   stop: threading.Event | None = None) -> int | None:
    """The number of items an input likely holds, or None (see `count_lines_cheaply`).

    Parquet: the row count from its footer. CSV: lines less the header (a quoted cell spanning
    lines makes this an overestimate). JSON lines: lines (blank lines included).
    """
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq  # type: ignore[import-untyped, import-not-found, unused-ignore]

            return int(pq.ParquetFile(path).metadata.num_rows)
        except Exception:  # no pyarrow, or not Parquet: the reader will say so properly
            return None
    lines = count_lines_cheaply(path, limit_bytes, stop, lone_cr=fmt == "csv")
    if lines is None or fmt != "csv":
        return lines
    return max(0, lines - 1)

"""The coordinator: hands work to shards on request, supervises them, handles signals.

Work is pulled: a shard asks for `n` items when its own queue runs low, and the coordinator takes
that many from the `WorkSource` and sends them. The input is never held in memory; what the
coordinator does hold is each shard's outstanding items (at most a few times its cap), so that
when a shard dies its unfinished items go to the others and to a replacement shard. An item
counts as finished only when its shard reports the line flushed (`fin`), and a dead shard's own
files are checked before anything is handed out again, so nothing is lost or done twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from shardrun import _import_structlog_without_rich, protocol
from shardrun.clock import Clock
from shardrun.errors import RunError, fix_for_write, run_dir_gone
from shardrun.launch import (
    Launcher,
    PreparedLaunch,
    fork_available,
    fork_launcher,
    start_forked_shards,
)
from shardrun.manifest import RunDir
from shardrun.placement import ShardHandle, start_local_shard
from shardrun.progress import ProgressView
from shardrun.ratelimit import shares
from shardrun.shard_config import ABANDON, ShardConfig, shard_file_name
from shardrun.summary import RunSummary, add_unreported
from shardrun.worksource import SETTLE_LINES, WorkSource, fair_share

# Before the event log imports structlog: rich is for the terminal display only, and a run
# whose output is not a terminal never loads it (see the function and progress.py).
_import_structlog_without_rich()

from shardrun import events  # noqa: E402
from shardrun.events import EventLog  # noqa: E402

REFRESH_EVERY_S = 0.25  # the live display redraws from the shards' reports, never per request
# A run whose shards keep dying is broken, not unlucky: give up after this many deaths.
MAX_SHARD_DEATHS = 3
LAUNCHER_CLOSE_S = 5.0
# A shard's stdout ends when it exits, so its exit status follows at once. When it does not (a
# shard that closed its stdout and hung, a launcher that stopped reporting), the run must not
# wait for ever: kill the shard, and after a second wait go on without its status.
EXIT_AFTER_EOF_S = 10.0
KILL_WAIT_S = 5.0
# A shard reports progress every 0.2 s while it runs, busy or idle. One silent for the job's
# `shard_silence_s` has a blocked event loop or a stopped process: it is killed, and its items
# go to a replacement. The watchdog looks this often.
WATCH_EVERY_S = 1.0
# Until its first message a shard is starting (a process, imports, a loop): on a loaded machine
# that took over 2 s, the least `shard_silence_s`, and healthy shards were killed before their
# first word. So a shard not heard yet may be silent this long at least.
START_SILENCE_MIN_S = 30.0
# The input is read at most this far ahead of what has been handed out, to see its end coming.
LOOKAHEAD_MAX = 4096


@dataclass
class ShardState:
    """What the coordinator knows of one shard."""

    handle: ShardHandle
    outstanding: dict[str, dict[str, Any]] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)
    # Its open spans' failed attempts that its reports counted (`tried`, sent as changes).
    tried: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)  # and their held retries (`held`)
    refused: dict[str, int] = field(default_factory=dict)  # and their 429s (`refused`)
    done: dict[str, Any] | None = None
    died: str | None = None
    heard_at: float = 0.0  # event-loop time of its last message (or of its start)
    heard: bool = False  # whether it has sent anything yet
    silenced: str = ""  # why the watchdog killed it, if it did


@dataclass
class Totals:
    """Finished items, counted from the shards' `fin_*` reports (each id once)."""

    ok: int = 0
    dead: int = 0


def _reap(tasks: set[asyncio.Task[None]]) -> None:
    """Forget the tasks that have ended; one that failed (a full disk under rejects.jsonl)
    fails its caller, as the work it did in line did."""
    for task in [t for t in tasks if t.done()]:
        tasks.discard(task)
        if not task.cancelled():
            task.result()


def _finishing(signum: int, frame: object) -> None:
    """A stop signal while the run's summary and manifest are written: they are, in a moment."""


class Coordinator:
    """One pass of a run: work source → shards → summary."""

    def __init__(self, config: ShardConfig, shards: int, source: WorkSource, run_dir: RunDir,
                 view: ProgressView, rate_limits: tuple[float | None, float | None],
                 *, silence_s: float, fork: bool = True,
                 endpoint_gone: Callable[[], str | None] | None = None) -> None:
        self.config = config  # the template every shard's config is made from
        self.shard_count = shards
        self.view = view
        self.rate_limits = rate_limits
        self.silence_s = silence_s
        # Why the endpoint can never answer again, once that is so (the simulator this run
        # started has exited); None while it may.
        self.endpoint_gone = endpoint_gone
        self.source = source
        self.run_dir = run_dir
        self.clock = Clock()
        name = "coordinator" + shard_file_name(0, config.segment).removeprefix("shard-00")
        self.log = EventLog(run_dir.path / "events" / name,
                            run_id=run_dir.event_run_id, shard=None)
        source.on_input_end = self._input_ended
        self.states: list[ShardState] = []
        self.tasks: dict[asyncio.Task[None], ShardState] = {}
        self.interrupts = 0
        self.terminal_fds: list[int] = []  # stdout, stderr: those that are a terminal
        self.fatal_reason: str | None = None
        self.fatal_mode: str | None = None
        self.fatal_cause: str | None = None  # an outage or a storm that stopped the run
        self.failure: Exception | None = None  # a hand-out's, which fails the pass (`_fail`)
        self.log_problem: str | None = None  # why the coordinator's log could not be written
        # The run directory as the pass started (device, inode): a directory no longer there
        # stops the run (`_check_run_dir`).
        self.run_dir_at: tuple[int, int] | None = None
        self.deaths: list[str] = []
        self.reassigned = 0
        self.totals = Totals()
        self.started = time.time()
        self.fork = fork and fork_available()
        self.launcher: Launcher | None = None
        self.prepared: PreparedLaunch | None = None
        # What this process had already reaped before the run: a shell that ran `pip install`
        # and then exec'd shardrun hands its children's CPU time down through the exec.
        self.reaped_before = resource.getrusage(resource.RUSAGE_CHILDREN)

    def _input_ended(self) -> None:
        # Its rejected lines are items of the pass too, as the summary counts them.
        self.view.set_total(self.source.taken + self.source.rejects)
        self.log.emit(events.INPUT_END, t=self.clock.now(), lines=self.source.reader.lines_read,
                      rejects=self.source.rejects)

    @property
    def handing_out(self) -> bool:
        return not self.interrupts and self.fatal_mode != ABANDON and self.failure is None

    # -- one shard -----------------------------------------------------------------------------

    async def serve(self, state: ShardState) -> None:
        """Answer one shard's messages until it finishes or dies."""
        handle = state.handle
        loop = asyncio.get_running_loop()
        # A hand-out may read long (`WorkSource.fill`): each is a task of its own, so that the
        # shard's reports are heard meanwhile (and its silence not taken for a hang).
        handing: set[asyncio.Task[None]] = set()
        while (message := await handle.receive()) is not None:
            state.heard_at, state.heard = loop.time(), True
            self._reap_hand_outs(handing)
            kind = message["t"]
            if kind == protocol.WANT:
                handing.add(asyncio.create_task(self._hand_out(state, int(message["n"]))))
            elif kind in (protocol.PROGRESS, protocol.DONE):
                self._finished(state, message["fin_ok"], message["fin_dead"])
                protocol.apply_changes(state.tried, message.get("tried") or {})
                protocol.apply_changes(state.held, message.get("held") or {})
                protocol.apply_changes(state.refused, message.get("refused") or {})
                state.progress = message
                self.view.update(handle.index, message)
                if kind == protocol.DONE:
                    state.done = message
                    self._rebalance_rates()
            elif kind == protocol.FATAL:
                self._on_fatal(str(message["reason"]), str(message["mode"]), handle.index,
                               message.get("cause"))
        for task in handing:
            # Its pipe is closed: a read still going ends there (items a hand-out took are
            # `outstanding`, and a dead shard's go back to the source).
            task.cancel()
        if handing:
            await asyncio.wait(handing)
            self._reap_hand_outs(handing)
        state.died, killed = await self._exit_status(handle)
        self.view.ended(handle.index)  # dead, it sends no `done`: its last report lingered
        if state.died is not None and state.done is not None:
            # Its work is all reported, its files closed before it said so: the run goes on as
            # if it had exited, and says what happened (killed after closing its output, or
            # its exit unknown because the launcher that forked it was killed).
            _say(f"warning: shard {handle.index} {state.died}; its results stand (it had "
                 "reported done)")
            state.died = None
        if state.silenced and state.done is None:
            state.died = state.silenced
        if state.done is None and state.died is None:
            state.died = "closed its pipe without reporting"
        if state.died is not None:
            self._rebalance_rates()
        elif self.fatal_reason is not None and state.outstanding:
            # A run stopped by a fatal error (a full disk above all): a write that failed
            # part-way may have put lines in the files that the shard could not report.
            # Count what is there, so the summary says what is done (a dead shard's files are
            # read the same way in `_after_death`). Its `done` report counted their tokens
            # and attempts already: it counts an item as it hands its line to the writer.
            ok, dead = handle.finished_among(set(state.outstanding))
            self._finished(state, list(ok), list(dead))
        extra = {"killed": killed} if killed else {}
        self.log.emit(events.SHARD_EXIT, t=self.clock.now(), to=handle.index,
                      status=state.died or "done", **extra)

    @staticmethod
    async def _exit_status(handle: ShardHandle) -> tuple[str | None, str]:
        """`handle.wait()` for a shard whose output has ended, bounded in time.

        (its status, "") when it exits in time; otherwise it is killed, and both values say so.
        """
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(handle.wait(), EXIT_AFTER_EOF_S), ""
        handle.kill()
        why = f"closed its output but did not exit within {EXIT_AFTER_EOF_S:g} s; it was killed"
        try:
            await asyncio.wait_for(handle.wait(), KILL_WAIT_S)
        except TimeoutError:
            why += ", and its end was never reported"
        return why, why

    def _reap_hand_outs(self, handing: set[asyncio.Task[None]]) -> None:
        try:
            _reap(handing)
        except Exception as exc:  # whatever it is, the pass fails by it
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        """A hand-out failed (a reject the disk would not take, the input cut short): every
        shard is stopped as on a first Ctrl-C, finishing what it has in flight, and once all
        have ended the pass fails with `exc` (`_supervise`). Left running, they went on until
        the launcher's close gave up on them (`LAUNCHER_CLOSE_S`) and killed them, their CPU
        time lost with them."""
        if self.failure is not None:
            return
        self.failure = exc
        # The error itself is said once the pass has ended, with its way on.
        _say("\nstopping on an error: letting in-flight requests finish (Ctrl-C twice to abort)")
        self.view.stopping = True
        for state in self.states:
            state.handle.send({"t": protocol.STOP})

    async def _hand_out(self, state: ShardState, n: int) -> None:
        # Read first, yielding as it goes: where most input lines hold no item to hand out,
        # reading up to the next ones held the event loop for seconds.
        ahead = min(len(self.states) * n, LOOKAHEAD_MAX)
        await self.source.fill(max(n, ahead), lambda: self.handing_out, settle=SETTLE_LINES)
        if state.done is not None or state.died is not None:
            # It finished (or died) while the input was read: items handed to it now would
            # be held as its outstanding ones and never run. They stay in the source.
            return
        batch = self.source.take(self._share(state, n, ahead)) if self.handing_out else []
        if batch:
            for item in batch:
                state.outstanding[item["id"]] = item
            state.handle.send({"t": protocol.ITEMS, "items": batch})
            self.log.emit(events.BATCH, t=self.clock.now(), to=state.handle.index, n=len(batch))
        # Items a shard gives back when it dies go to a replacement shard, so END is final.
        if not self.handing_out or self.source.empty:
            state.handle.send({"t": protocol.END})

    def _share(self, state: ShardState, n: int, ahead: int) -> int:
        """How many of the `n` items `state`'s shard asks for it gets (see `fair_share`), the
        input read `ahead` items ahead (`WorkSource.fill`).

        Until the input's end is in sight this costs no pass over the shards (a run of a
        thousand shards asks a thousand times a second), but in a sparse stretch, whose items
        took up to `SETTLE_LINES` lines each to find."""
        if not self.source.read_ahead(ahead):
            # A sparse stretch (the read settled for what it found, `SETTLE_LINES`), its end
            # not in sight: what was found is split over the live shards, as they ask.
            return max(1, min(n, -(-self.source.ready // max(1, len(self._live())))))
        left = self.source.remaining(ahead)
        if left is None:
            return n
        live = self._live()
        held = sum(len(s.outstanding) for s in live)
        return fair_share(n, left, len(state.outstanding), held, len(live))

    def _finished(self, state: ShardState, ok: list[str], dead: list[str]) -> None:
        first = self.totals.ok == 0
        for item_id in ok:
            if state.outstanding.pop(item_id, None) is not None:
                self.totals.ok += 1
        if first and self.totals.ok:
            # A shard in a storm that has seen no success of its own holds it for a minute only
            # while none of the run has (`Shard._storm_too_long`): tell every shard.
            for other in self._live():
                other.handle.send({"t": protocol.ANSWERED})
        for item_id in dead:
            if state.outstanding.pop(item_id, None) is not None:
                self.totals.dead += 1

    def _live(self) -> list[ShardState]:
        return [s for s in self.states if s.done is None and s.died is None]

    def _rebalance_rates(self) -> None:
        """Job-wide limits are split over the shards still running; tell them their new share
        and how many they are, since a pace seeded from the server's stated limit is split
        over them too, up or down (sent without job limits as well: only as a shard starts or
        ends)."""
        live = self._live()
        rpm, tpm = shares(*self.rate_limits, len(live))
        for state in live:
            state.handle.send({"t": protocol.RATE, "rpm": rpm, "tpm": tpm, "live": len(live)})

    def _on_fatal(self, reason: str, mode: str, origin: int, cause: str | None = None) -> None:
        """One shard (or, with `origin` -1, this process) found the endpoint (or the disk)
        unusable: tell the others at once."""
        if self.fatal_reason is not None:
            return
        self.fatal_reason, self.fatal_mode, self.fatal_cause = reason, mode, cause
        for other in self.states:
            if other.handle.index != origin:
                other.handle.send({"t": protocol.FATAL, "reason": reason, "mode": mode})

    # -- signals and progress ------------------------------------------------------------------

    def interrupt(self, why: str = "", again: str = "Ctrl-C again") -> None:
        """First signal: stop handing out work and let in-flight finish; second: abort."""
        self.interrupts += 1
        kind = protocol.STOP if self.interrupts == 1 else protocol.ABORT
        if self.interrupts == 1:
            _say(f"\nstopping{why}: letting in-flight requests finish ({again} to abort)")
            self.view.stopping = True  # its line says so, not an ETA
        elif self.interrupts == 2:  # answers paid for are given up: say what stays, and how on
            # No count: the shards' reports lag their files, and the summary counts them.
            _say(f"\naborting{why}: the requests in flight are cancelled, their items left "
                 "unfinished; every result and dead letter already written is kept: "
                 f"{self.config.way_on}")
        for state in self.states:
            state.handle.send({"t": kind})

    def hang_up(self) -> None:
        """SIGHUP: the terminal is gone (a dropped SSH session). Output that went to it now goes
        nowhere, since writing to a hung-up terminal fails, and the run stops as on SIGTERM:
        the in-flight requests finish, the files are closed, --resume goes on."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            for fd in self.terminal_fds:
                with contextlib.suppress(OSError):
                    os.dup2(devnull, fd)
        finally:
            os.close(devnull)
        self.view.quiet = True
        # A log file that outlives the terminal gets this line: with no terminal left, Ctrl-C
        # is no way to abort, a SIGTERM (or a second SIGHUP) is.
        # A SIGHUP sent by `kill` reads the same: no terminal need have hung up.
        self.interrupt(" (SIGHUP: a hang-up)", "SIGTERM")

    async def progress(self) -> None:
        """Redraw the display; once a second flush and checkpoint the coordinator's own log,
        so a killed coordinator leaves its run_start, batches and input_end behind."""
        ticks = 0
        while True:
            await asyncio.sleep(REFRESH_EVERY_S)
            self.view.refresh()
            ticks += 1
            if ticks % 4 == 0:
                self.log.checkpoint(self.clock.now())
                self._write_log(self.log.flush)

    def _write_log(self, write: Callable[[], None]) -> None:
        """Hand the coordinator's log to the OS. A failed write (a full disk) is recorded, not
        raised: the shards decide whether the run can go on, and the summary says it."""
        try:
            write()
        except OSError as exc:
            if self.log_problem is None:
                self.log_problem = (
                    f"cannot write {self.log.path}: {(exc.strerror or str(exc)).lower()}, so the "
                    f"coordinator's events since are lost (the results are not); "
                    f"{fix_for_write(exc)}, then {self.config.way_on}")

    async def watch(self) -> None:
        """Kill a running shard that has sent nothing for `silence_s` (its pipe then closes, and
        `serve` treats it as a death with that reason)."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(WATCH_EVERY_S)
            now = loop.time()
            if now - last > 5 * WATCH_EVERY_S:
                # This process was itself stopped or starved (Ctrl-Z of the whole job, a
                # suspended machine): the shards' silence over that time proves nothing.
                for state in self.states:
                    state.heard_at = max(state.heard_at, now)
            last = now
            for state in self._live():
                if not state.silenced and (why := self.too_silent(state, now)):
                    state.silenced = why
                    state.handle.kill()
            self._check_endpoint()
            self._check_run_dir()

    def too_silent(self, state: ShardState, now: float) -> str:
        """Why `state`'s shard is to be killed for its silence at `now`, or "" if it is not."""
        if state.heard:
            if now - state.heard_at <= self.silence_s:
                return ""
            return (f"sent nothing for {self.silence_s:g} s, the shard_silence_s limit (a "
                    "blocked event loop or a stopped process); it was killed")
        limit = max(self.silence_s, START_SILENCE_MIN_S)
        if now - state.heard_at <= limit:
            return ""
        return (f"sent nothing in the {limit:g} s since it was started (a starting shard may take "
                f"shard_silence_s, at least {START_SILENCE_MIN_S:g} s: a start-up that hangs or a "
                "stopped process); it was killed")

    def _check_endpoint(self) -> None:
        """Stop the run at once when its endpoint can never answer again: the shards would take
        it for an outage and hold their items for `retry.outage_s`, waiting for nothing. The
        items are left unfinished (mode abandon) for --resume."""
        if self.endpoint_gone is not None and self.fatal_reason is None and (
                why := self.endpoint_gone()) is not None:
            self._on_fatal(why, ABANDON, origin=-1)

    def _check_run_dir(self) -> None:
        """Stop the run at once when its directory is gone (deleted, or moved away): the shards
        write on into files no path leads to, and every answer from then on would be paid for
        and kept nowhere, while the summary said the run succeeded. Mode abandon: nothing is
        dead-lettered; a directory put back is resumed."""
        if self.fatal_reason is None and self.run_dir_at is not None and (
                _identity(self.run_dir.path) not in (self.run_dir_at, None)):
            self._on_fatal(run_dir_gone(self.run_dir.path, self.config.way_on), ABANDON,
                           origin=-1)

    # -- the run -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Before the event loop starts: fork the shard launcher from this process.

        The launcher then starts with what this process has already imported and loads only
        the client's libraries (docs/PERFORMANCE.md, "Start-up"). Where the fork is unsafe,
        `run` starts the launcher as a fresh interpreter instead.
        """
        if self.fork and self.prepared is None:
            self.prepared = fork_launcher(range(self.shard_count), self.run_dir.logs,
                                          self.config.segment,
                                          tls=urlsplit(self.config.base_url).scheme != "http")

    async def run(self) -> RunSummary:
        loop = asyncio.get_running_loop()
        # A signal the run was started ignoring stays ignored: `nohup` keeps a run going when
        # its session ends, and a background job of a script is not stopped by Ctrl-C.
        heeded = [sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                  if signal.getsignal(sig) is not signal.SIG_IGN]
        for sig in heeded:
            if sig == signal.SIGHUP:
                loop.add_signal_handler(sig, self.hang_up)
            elif sig == signal.SIGTERM:  # from `timeout`, systemd, kill: no Ctrl-C at hand
                loop.add_signal_handler(sig, self.interrupt, " (SIGTERM)", "SIGTERM again")
            else:
                loop.add_signal_handler(sig, self.interrupt)
        # Known now: once the terminal has hung up, isatty() no longer says it was one.
        self.terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]
        self.run_dir_at = _identity(self.run_dir.path)
        # The summary's wall time is the log's window (run_start to run_end), so its run-average
        # TPM is the one `report` computes from the log.
        self.started = self.clock.now()
        self.log.emit(events.RUN_START, t=self.started, shards=self.shard_count,
                      cap=self.config.concurrency)
        # On disk at once: a coordinator killed in its first second still leaves the run's start.
        self._write_log(self.log.flush)
        self.view.start()
        ticker = asyncio.create_task(self.progress())
        watchdog = asyncio.create_task(self.watch())
        try:
            # A resume passes over the lines earlier passes finished before the shards are
            # started, yielding as it goes (`WorkSource.fill`): the display and Ctrl-C stay
            # live, and the display says so (at ten million done, half a minute).
            self.view.skipping = lambda: self.source.reader.lines_read
            self.view.skipping_rejected = lambda: self.source.rejects + self.source.prior_rejects
            self.view.rejected = lambda: self.source.rejects
            try:
                await self.source.fill(1, lambda: self.handing_out)
            finally:
                self.view.skipping = None
            await self._start_first_shards()
            await self._supervise()
        finally:
            if self.prepared is not None:  # never started: its shards must not linger
                self.prepared.abandon()
            ticker.cancel()
            watchdog.cancel()
            if self.launcher is not None:
                await self._close_launcher(self.launcher)
            self.view.stop()
            for sig in heeded:
                loop.remove_signal_handler(sig)
                # Not the default action (a KeyboardInterrupt, or the end of the process): the
                # summary and the manifest are written next, and must be written whole.
                signal.signal(sig, _finishing)
            self.source.close()
            ended = self.clock.now()
            summary = self.summary(ended)
            # The client's CPU goes into the log too, so that `report` reads it from the
            # evidence rather than from the manifest's summary; so does why it is unknown.
            cpu, why = summary.client_cpu_s, summary.client_cpu_unknown
            self.log.emit(events.RUN_END, t=ended, status=summary.status,
                          client_cpu_s=None if cpu is None else round(cpu, 3),
                          **({"client_cpu_unknown": why} if cpu is None and why else {}),
                          **({"stopped_by": self.fatal_cause} if self.fatal_cause else {}))
            self.log.checkpoint(self.clock.now())
            self._write_log(self.log.close)
        if self.log_problem is not None:
            summary = replace(summary, unrecorded=(*summary.unrecorded, self.log_problem))
        return summary

    @staticmethod
    async def _close_launcher(launcher: Launcher) -> None:
        """Reap the launcher: it ends right after reporting its last shard's end. One that
        does not (stopped, or stuck) is killed, or the event loop's shutdown would wait for it."""
        try:
            await asyncio.wait_for(launcher.close(), LAUNCHER_CLOSE_S)
            return
        except TimeoutError:
            launcher.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(launcher.close(), LAUNCHER_CLOSE_S)

    async def _start_first_shards(self) -> None:
        """Fork the run's shards from one launcher (one set of imports), else spawn each."""
        if not self.fork:
            for _ in range(self.shard_count):
                await self._start_shard()
            return
        if self.prepared is not None:
            prepared, self.prepared = self.prepared, None
            handles, self.launcher = await prepared.start(self.run_dir.path)
        else:
            handles, self.launcher = await start_forked_shards(
                range(self.shard_count), self.run_dir.logs, self.run_dir.path,
                self.config.segment)
        for handle in handles:
            self._adopt(handle)

    async def _start_shard(self) -> None:
        """A fresh interpreter: a replacement for a dead shard, or where forking is unavailable."""
        self._adopt(await start_local_shard(len(self.states), self.run_dir.logs,
                                            self.run_dir.path, self.config.segment))

    def _adopt(self, handle: ShardHandle) -> None:
        state = ShardState(handle, heard_at=asyncio.get_running_loop().time())
        self.states.append(state)
        self.view.shard_started(handle.index)  # "starting" on the line until its first report
        # The config goes first, before any `rate` message a rebalance may send.
        rpm, tpm = shares(*self.rate_limits, len(self._live()))
        index = state.handle.index
        config = ShardConfig(**{**self.config.__dict__, "shard": index,
                                "rate": {"rpm": rpm, "tpm": tpm},
                                "rate_phase": index % self.shard_count / self.shard_count,
                                "shard_count": self.shard_count,
                                "answered_before": (self.config.answered_before
                                                    or self.totals.ok > 0)})
        state.handle.send(config.to_message())
        self.tasks[asyncio.create_task(self.serve(state))] = state
        self._rebalance_rates()

    async def _supervise(self) -> None:
        """Serve every shard; a dead shard's unfinished items go to the others."""
        while pending := [t for t in self.tasks if not t.done()]:
            finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()
                state = self.tasks[task]
                if state.died is not None:
                    await self._after_death(state)
        if self.failure is not None:
            raise self.failure

    async def _after_death(self, state: ShardState) -> None:
        index = state.handle.index
        log_path = self.run_dir.logs / shard_file_name(index, self.config.segment).replace(
            ".jsonl", ".log")
        self.deaths.append(f"shard {index} died ({state.died}); its log is {log_path}")
        _say(f"warning: {self.deaths[-1]}")
        ok, dead = state.handle.finished_among(set(state.outstanding))
        self._finished(state, list(ok), list(dead))
        # The lines it wrote after its last report: their tokens and attempts are in no report.
        state.progress = add_unreported(state.progress, state.tried, ok.values(), dead.values(),
                                        state.held, state.refused)
        items = list(state.outstanding.values())
        state.outstanding.clear()
        self.reassigned += len(items)
        self.source.requeue(items)
        if len(self.deaths) >= MAX_SHARD_DEATHS:
            await self._abandon()
            raise RunError(f"{len(self.deaths)} shards died, the last: {self.deaths[-1]}; "
                           f"results so far are in {self.run_dir.path}; {self.config.way_on}")
        if self.handing_out and not (self.source.empty and not items):
            await self._start_shard()

    async def _abandon(self) -> None:
        """Stop the surviving shards: stop, a short grace, then kill."""
        for state in self.states:
            state.handle.send({"t": protocol.STOP})
        pending = [t for t in self.tasks if not t.done()]
        if pending:
            _, still = await asyncio.wait(pending, timeout=5.0)
            for state in self.states:
                if state.done is None:
                    state.handle.kill()
            if still:
                await asyncio.wait(still, timeout=5.0)

    def summary(self, ended_at: float) -> RunSummary:
        cpu_unknown = self._cpu_unknown()
        return RunSummary.from_shard_reports(
            run_dir=self.run_dir.path,
            reports=[s.done or s.progress for s in self.states],
            ok=self.totals.ok,
            dead=self.totals.dead,
            taken=self.source.taken,
            skipped=self.source.skipped,
            left_out=self.source.left_out,
            rejects=self.source.rejects,
            started_at=self.started,
            ended_at=ended_at,
            interrupted=self.interrupts > 0,
            fatal_reason=self.fatal_reason,
            shard_deaths=len(self.deaths),
            reassigned=self.reassigned,
            rejects_file=self.source.rejects_path,
            input_read=self.source.read_to_end,
            limit=self.source.limit if self.source.limit_reached else None,
            read_to_line=self.source.reader.lines_read if self.source.rest_unread else None,
            client_cpu_s=None if cpu_unknown else client_cpu_s(self.reaped_before),
            client_cpu_unknown=cpu_unknown,
        )

    def _cpu_unknown(self) -> str | None:
        """Why the client's CPU time cannot be known, if it cannot: a process of the run that
        no shardrun process reaped took its CPU time with it (`client_cpu_s`)."""
        lost = [str(s.handle.index) for s in self.states if not s.handle.reaped()]
        names = [f"shard{'s' if len(lost) > 1 else ''} {', '.join(lost)}"] if lost else []
        if self.launcher is not None and not self.launcher.reaped():
            names.insert(0, "the shard launcher")
        if not names:
            return None
        return (f"no shardrun process reaped {' or '.join(names)}, so their CPU time is not "
                "known (a shard whose launcher was killed is reaped by the OS)")


def client_cpu_s(reaped_before: resource.struct_rusage) -> float:
    """CPU seconds (user + system) of this process and every process it reaped since
    `reaped_before` was read.

    At the end of a run that is the coordinator, the launcher and every shard, forked or spawned:
    the launcher reaps its forked shards, which folds their time into its own children's, and
    the coordinator reaps the launcher. An embedded simulator is still running when this is read,
    so its time is not in it. The process's own time includes the few milliseconds a shell may
    have spent before exec'ing it.
    """
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    children = (reaped.ru_utime - reaped_before.ru_utime) + (reaped.ru_stime
                                                             - reaped_before.ru_stime)
    return own.ru_utime + own.ru_stime + children


def _identity(path: Path) -> tuple[int, int] | None:
    """A directory's (device, inode); (0, 0) when nothing is at its path, None when it cannot
    be told (a stat that fails otherwise: no verdict)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (0, 0)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _say(text: str) -> None:
    """A line on standard error that cannot stop the run: once its reader has gone (`shardrun
    job.yaml 2>&1 | head`), the write fails, and the stop or the recovery the line announces
    must still happen (a first Ctrl-C or SIGTERM raised there and was lost, so the run went on
    until a second one aborted its in-flight requests)."""
    with contextlib.suppress(OSError):
        print(text, file=sys.stderr)

"""Shards forked from one launcher: the launcher's start, its reports, our ends of its pipes.

The launcher (`_launcher.py`) imports a shard's code once and forks every shard of the run from
it. It is normally a fork of the coordinator made before the coordinator's event loop starts
(`fork_launcher`, then `PreparedLaunch.start` inside the loop); where that fork is unsafe it is
started from the loop as `python -m shardrun._launcher` (`start_forked_shards`). Either way the
coordinator gets a `LocalShard` per shard, as from `placement.start_local_shard`, and a
`Launcher` that turns the launcher's report lines into each shard's PID and exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn, TypeVar

from shardrun._launcher import STOP_SIGNALS, Slot, leave_stop_signals_to_the_coordinator, serve
from shardrun._title import launcher_title, set_title
from shardrun.placement import (
    UNKNOWN_EXIT,
    LocalShard,
    OSProcess,
    SpawnedProcess,
    connect_pipes,
    log_path_of,
    poll_until_ended,
    reader_of,
    reaped,
    spawn_holding_stop_signals,
    start_local_shard,
)

T = TypeVar("T")

# The launcher's command line when it cannot be forked from this process, less its slot
# arguments (a test substitutes its own).
LAUNCHER_ARGV: tuple[str, ...] = (sys.executable, "-m", "shardrun._launcher")
# False: always start `LAUNCHER_ARGV`, never fork the launcher from this process (for tests).
FORK_LAUNCHER = True


class ForkedProcess:
    """A shard forked by the launcher: its PID, and its exit code as the launcher reports it."""

    def __init__(self, pid: int, ended: asyncio.Future[int], stdout: asyncio.StreamReader) -> None:
        self.pid = pid
        self._ended = ended
        self._stdout = stdout

    @property
    def returncode(self) -> int | None:
        return self._ended.result() if self._ended.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)

    def kill(self) -> None:
        # Until the launcher reports the end, it has not reaped the shard: the PID is still
        # ours. With the launcher gone, the shard's stdout still open means it still runs
        # (it holds the pipe), so the PID cannot have been reused either.
        gone = self._ended.done() and (self._ended.result() != UNKNOWN_EXIT
                                       or self._stdout.at_eof())
        if not gone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class ForkedLauncher:
    """The launcher as a fork of this process, reaped here with `waitpid`.

    No asyncio child watcher knows a PID that `os.fork` returned, so `wait` polls. It is only
    awaited once the launcher's report pipe has ended.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by something else: the status is lost
                self.returncode = UNKNOWN_EXIT
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    async def wait(self) -> int:
        return await poll_until_ended(self.poll)

    def kill(self) -> None:
        if self.poll() is None:  # not reaped yet, so the PID is still ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class Launcher:
    """The coordinator's side of `_launcher.py`: its report lines, turned into futures."""

    def __init__(self, proc: OSProcess, report: asyncio.StreamReader,
                 indexes: Sequence[int]) -> None:
        loop = asyncio.get_running_loop()
        self.proc = proc
        self.report = report
        # A shard's PID once forked (None: not forked), and its exit code once reaped.
        self.pids: dict[int, asyncio.Future[int | None]] = {}
        self.ends: dict[int, asyncio.Future[int]] = {}
        for i in indexes:
            self.pids[i], self.ends[i] = loop.create_future(), loop.create_future()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while line := await self.report.readline():
                try:
                    kind, index_text, value = line.decode("utf-8", "replace").split(" ", 2)
                    index = int(index_text)
                except ValueError:
                    continue  # not a report line
                value = value.strip()
                if kind == "pid":
                    _resolve(self.pids.get(index), int(value))
                elif kind == "exit":
                    _resolve(self.ends.get(index), int(value))
                elif kind == "fail":  # the reason is in its stderr log too
                    _resolve(self.pids.get(index), None)
        finally:
            await self.proc.wait()
            for pid in self.pids.values():
                _resolve(pid, None)
            for end in self.ends.values():
                _resolve(end, UNKNOWN_EXIT)

    async def close(self) -> None:
        """Wait for the launcher to end (it does once its last shard has been reaped)."""
        await asyncio.shield(self.reader)

    def reaped(self) -> bool:
        """Whether this process reaped the launcher (see `placement.reaped`)."""
        return reaped(self.proc)

    def kill(self) -> None:
        """SIGKILL the launcher (not its shards); `close` then returns once it is reaped."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


def _resolve(future: asyncio.Future[T] | None, value: T) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def fork_available() -> bool:
    return hasattr(os, "fork") and sys.platform != "win32"


@dataclass
class _Ends:
    """The coordinator's ends of one shard's pipes, and where its files go."""

    stdin: IO[bytes]
    stdout: IO[bytes]
    file_name: str
    log_path: Path

    def close(self) -> None:
        self.stdin.close()
        self.stdout.close()


@dataclass
class _Slots:
    """The pipes of the shards a launcher is to fork: its slots, and our ends of them."""

    slots: list[Slot]
    ends: dict[int, _Ends]
    log_dir: Path
    segment: int

    @classmethod
    def open(cls, indexes: Sequence[int], log_dir: Path, segment: int) -> _Slots:
        made = cls([], {}, log_dir, segment)
        try:
            for index in indexes:
                file_name, log_path = log_path_of(index, log_dir, segment)
                fresh: list[int] = []  # this shard's, until they are in `made`
                try:
                    fresh += os.pipe()
                    fresh += os.pipe()
                    fresh.append(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                         0o644))
                except BaseException:
                    for fd in fresh:
                        os.close(fd)
                    raise
                in_r, in_w, out_r, out_w, err = fresh
                made.slots.append(Slot(index, in_r, out_w, err))
                made.ends[index] = _Ends(open(in_w, "wb", buffering=0),  # noqa: SIM115
                                         open(out_r, "rb", buffering=0),  # noqa: SIM115
                                         file_name, log_path)
        except BaseException:
            made.close()
            raise
        return made

    def theirs(self) -> list[int]:
        return [fd for slot in self.slots for fd in slot.fds()]

    def close_theirs(self) -> None:
        """Once the launcher holds them (or never will)."""
        for fd in self.theirs():
            os.close(fd)
        self.slots = []

    def close_ours(self) -> None:
        for ends in self.ends.values():
            ends.close()

    def close(self) -> None:
        """Both sides: no launcher will take them."""
        self.close_ours()
        self.close_theirs()

    async def adopt(self, launcher: Launcher, out_dir: Path) -> list[LocalShard]:
        """Our side of each shard the launcher forked; a spawned one for each it could not."""
        shards: list[LocalShard] = []
        for index, ends in self.ends.items():
            pid = await launcher.pids[index]
            if pid is None:  # not forked: the same shard as a fresh interpreter
                print(f"warning: the shard launcher did not fork shard {index} (see "
                      f"{self.log_dir / 'launcher.log'}); it starts as a fresh interpreter",
                      file=sys.stderr)
                ends.close()
                shards.append(await start_local_shard(index, self.log_dir, out_dir,
                                                      self.segment))
                continue
            writer, reader = await connect_pipes(ends.stdin, ends.stdout)
            shards.append(LocalShard(index, ForkedProcess(pid, launcher.ends[index], reader),
                                     writer, reader, ends.log_path, out_dir, ends.file_name,
                                     (ends.stdin, ends.stdout)))
        return shards


@dataclass
class PreparedLaunch:
    """A launcher forked before the event loop started: our ends of its report and shards."""

    process: ForkedLauncher
    report: IO[bytes]
    shards: _Slots

    async def start(self, out_dir: Path) -> tuple[list[LocalShard], Launcher]:
        """In the event loop: read the launcher's reports and take over its shards."""
        report = await reader_of(self.report)
        launcher = Launcher(self.process, report, list(self.shards.ends))
        return await self.shards.adopt(launcher, out_dir), launcher

    def abandon(self, wait_s: float = 5.0) -> None:
        """Never started: close our ends (its shards see EOF and exit, then the launcher does)
        and reap the launcher, killing it if it is still there after `wait_s`."""
        self.shards.close_ours()
        self.report.close()
        deadline = time.monotonic() + wait_s
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.process.poll() is None:
            self.process.kill()
            os.waitpid(self.process.pid, 0)


def fork_launcher(indexes: Sequence[int], log_dir: Path, segment: int, *,
                  tls: bool) -> PreparedLaunch | None:
    """Fork the shard launcher from this process, to fork these shards; None where unsafe.

    Call it before the event loop starts. A fork is safe only in a process with one thread
    (another thread may hold a lock the child would wait on for ever) and no running loop (the
    child would share its epoll set); where either does not hold, or the fork fails, this
    returns None and the coordinator starts `LAUNCHER_ARGV` from its loop instead. `tls`:
    whether the shards need the system's CA store (see `_tls.ca_store_deferred`).
    """
    if not (FORK_LAUNCHER and fork_available()) or threading.active_count() > 1 or (
            _loop_running()):
        return None
    _occupy_standard_fds()  # so no pipe made below is fd 0, 1 or 2 (see `_become_launcher`)
    try:
        shards = _Slots.open(indexes, log_dir, segment)  # closes what it made if it fails
    except OSError:  # out of descriptors, say: the loop's way meets it again and says so
        return None
    made: list[int] = []
    try:
        report_r, report_w = os.pipe()
        made += [report_r, report_w]
        null = os.open(os.devnull, os.O_RDONLY)
        made.append(null)
        log = os.open(log_dir / "launcher.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        made.append(log)
    except OSError:
        for fd in made:
            os.close(fd)
        shards.close()
        return None
    launcher_fds = (null, report_w, log)  # its stdin, stdout and stderr
    theirs = shards.theirs()  # the slots' descriptors: the only ones the launcher keeps
    # Frozen objects are never examined by the collector, so the child cannot collect (and
    # close) a file object of ours that happened to be garbage at the fork.
    gc.freeze()
    # SIGINT and SIGTERM are held back across the fork: a KeyboardInterrupt (or our SIGTERM
    # handler) in the child before it ignores them would unwind into this process's code (its
    # `finally` blocks, the manifest) there. One that arrives meanwhile reaches this process
    # when the mask is restored.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        pid = os.fork()
    except OSError:
        pid = -1
    if pid == 0:
        leave_stop_signals_to_the_coordinator()  # as the shards do: the coordinator decides
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        set_title(launcher_title(log_dir.parent.name))  # the run directory's name is its id
        _become_launcher(shards.slots, *launcher_fds, keep=set(theirs), tls=tls)
    gc.unfreeze()
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for fd in launcher_fds:
        os.close(fd)
    shards.close_theirs()
    if pid < 0:
        os.close(report_r)
        shards.close_ours()
        return None
    return PreparedLaunch(ForkedLauncher(pid), open(report_r, "rb", buffering=0), shards)


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _occupy_standard_fds() -> None:
    """Open /dev/null on any of fds 0, 1, 2 that is closed (a daemon, a CI step without stdin)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


_inherited_streams: tuple[object, ...] = ()


def _become_launcher(slots: list[Slot], stdin: int, stdout: int, stderr: int, *,
                     keep: set[int], tls: bool) -> NoReturn:
    """The forked child: fds 0-2 become /dev/null, the report pipe and launcher.log, every
    descriptor of the coordinator's other than the slots' is closed (its run lock, its event
    log, the simulator's pipes), then the launcher runs and the process exits."""
    global _inherited_streams
    code = 1
    # The coordinator's sys.stdin/stdout/stderr stay referenced (never finalized here, so
    # never closing a descriptor number that a shard reuses); fresh ones take their place.
    _inherited_streams = (sys.stdin, sys.stdout, sys.stderr)
    try:
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        _close_all_but({0, 1, 2} | keep)
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                          buffering=1, closefd=False)
        if faulthandler.is_enabled():  # its old file descriptor is closed now
            faulthandler.enable(sys.stderr)
        code = serve(slots, tls=tls)
    except BaseException:
        with contextlib.suppress(Exception):
            os.write(2, traceback.format_exc().encode())
    finally:
        os._exit(code)


def _close_all_but(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


async def start_forked_shards(indexes: Sequence[int], log_dir: Path, out_dir: Path,
                              segment: int) -> tuple[list[LocalShard], Launcher]:
    """From the event loop: start `LAUNCHER_ARGV` to fork these shards; any it could not fork
    are spawned."""
    shards = _Slots.open(indexes, log_dir, segment)
    try:
        with open(log_dir / "launcher.log", "ab") as log:
            # Like a spawned shard, it must not die of a Ctrl-C before it ignores it.
            popen = spawn_holding_stop_signals(
                [*LAUNCHER_ARGV, *(slot.arg() for slot in shards.slots)],
                subprocess.DEVNULL, subprocess.PIPE, log, pass_fds=shards.theirs())
    except BaseException:
        shards.close_ours()
        raise
    finally:
        shards.close_theirs()
    assert popen.stdout is not None
    launcher = Launcher(SpawnedProcess(popen), await reader_of(popen.stdout), indexes)
    return await shards.adopt(launcher, out_dir), launcher

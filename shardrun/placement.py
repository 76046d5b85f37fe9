"""Where shards run. Local OS processes today; a remote engine later, behind the same seam.

A placement starts a shard and returns a `ShardHandle`: send a message, receive one, learn how it
ended. The coordinator sees nothing else, so a Ray placement can carry the same JSON lines.

Local shards start two ways: forked by the shard launcher, which imports a shard's code once
(`launch.py`), or spawned here by `start_local_shard` as one fresh interpreter (`python -m
shardrun._shard_main`), for a replacement after a death and wherever forking is unavailable.
Either way a shard speaks the protocol on its stdin and stdout and writes its stderr to
`logs/shard-NN.log`, and the coordinator holds it as a `LocalShard`.

A fresh interpreter is started by `spawn_holding_stop_signals`, never through the event loop:
it must start with the stop signals blocked (see there).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from shardrun import protocol
from shardrun._launcher import STOP_SIGNALS
from shardrun.recovery import line_records, repair_torn_tail
from shardrun.shard_config import shard_file_name

PIPE_LIMIT = 1 << 26
# The exit code of a forked shard whose launcher ended without reporting the shard's end.
UNKNOWN_EXIT = -(1 << 16)
# Result or dead-letter lines of a shard's files, parsed, by item id.
Lines = dict[str, dict[str, Any]]


class ShardHandle(Protocol):
    """One running shard, seen from the coordinator."""

    index: int

    def send(self, message: protocol.Message) -> None: ...

    async def receive(self) -> protocol.Message | None: ...

    async def wait(self) -> str | None:
        """Wait for the shard to end; None if it ended cleanly, else how it died."""
        ...

    def kill(self) -> None: ...

    def finished_among(self, ids: set[str]) -> tuple[Lines, Lines]:
        """After a death: the lines of those of `ids` the shard did finish (results, dead)."""
        ...

    def reaped(self) -> bool:
        """Whether a shardrun process collected the shard's end, and with it its CPU time."""
        ...


class OSProcess(Protocol):
    """An OS process as the coordinator holds it: a spawned one (`SpawnedProcess`), a shard
    forked by the launcher (`launch.ForkedProcess`) or the launcher itself
    (`launch.ForkedLauncher`)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


class _Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...

    def close(self) -> None: ...


class LocalShard:
    """A shard in a local OS process speaking the protocol on its stdin and stdout."""

    def __init__(self, index: int, proc: OSProcess, stdin: _Writer, stdout: asyncio.StreamReader,
                 log_path: Path, out_dir: Path, file_name: str,
                 pipes: Sequence[IO[bytes]] = ()) -> None:
        self.index = index
        self.pipes = pipes  # our ends of its stdin and stdout, as files: closed once it ended
        self.proc = proc
        self.stdin = stdin
        self.stdout = stdout
        self.log_path = log_path
        self.out_dir = out_dir
        self.file_name = file_name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: protocol.Message) -> None:
        if not self.stdin.is_closing():
            self.stdin.write(protocol.encode(message))

    async def receive(self) -> protocol.Message | None:
        line = await self.stdout.readline()
        return protocol.decode(line) if line else None

    async def wait(self) -> str | None:
        code = await self.proc.wait()
        # Our ends of its pipes, its output read to the end (the coordinator waits only then):
        # uvloop's pipe transports work on copies of the descriptors and leave the files open,
        # and each replacement shard would keep two until the run's end.
        self.stdin.close()
        for pipe in self.pipes:
            pipe.close()
        if code == 0:
            return None
        if code == UNKNOWN_EXIT:
            return "ended with an unknown status: the shard launcher is gone"
        return exit_description(code)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has ended: nothing to kill
            self.proc.kill()

    def reaped(self) -> bool:
        return reaped(self.proc)

    def finished_among(self, ids: set[str]) -> tuple[Lines, Lines]:
        """Read the dead shard's own files (repairing a torn last line first)."""
        found: list[Lines] = []
        for sub in ("results", "dead"):
            path = self.out_dir / sub / self.file_name
            hits: Lines = {}
            if path.exists():
                repair_torn_tail(path)
                hits = {i: record for i, record in line_records(path) if i in ids}
            found.append(hits)
        return found[0], found[1]


def exit_description(code: int) -> str:
    """How a process ended, from its exit code as `subprocess` gives it (negative: a signal)."""
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:  # a real-time signal, which has no name
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def reaped(proc: OSProcess) -> bool:
    """Whether `proc`'s exit was collected by its parent among shardrun's processes: only then
    is its CPU time in the coordinator's children's (a process whose parent ended first is
    reaped by the OS, its time with it)."""
    return proc.returncode is not None and proc.returncode != UNKNOWN_EXIT


def log_path_of(index: int, log_dir: Path, segment: int) -> tuple[str, Path]:
    file_name = shard_file_name(index, segment)
    return file_name, log_dir / file_name.replace(".jsonl", ".log")


async def poll_until_ended(poll: Callable[[], int | None]) -> int:
    """Call `poll` (a non-blocking reap) from 1 ms up to 50 ms apart until it gives a status.

    For a child no asyncio child watcher knows. Only awaited once the child's output has
    ended, that is, once it is exiting or gone, so the first poll or two normally find it.
    """
    delay = 0.001
    while (code := poll()) is None:
        await asyncio.sleep(delay)
        delay = min(2 * delay, 0.05)
    return code


class SpawnedProcess:
    """A fresh interpreter started by `spawn_holding_stop_signals`, reaped with its `poll`."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    async def wait(self) -> int:
        return await poll_until_ended(self._popen.poll)

    def kill(self) -> None:
        self._popen.kill()  # does nothing once it has been reaped (the PID is no longer ours)


def spawn_holding_stop_signals(argv: Sequence[str], stdin: int | IO[bytes],
                               stdout: int | IO[bytes], stderr: IO[bytes],
                               pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """Start `argv` with SIGINT, SIGTERM and SIGHUP blocked until it ignores them itself.

    Ctrl-C reaches the whole process group, and a fresh interpreter spends a fraction of a
    second importing before it can ignore SIGINT: a Ctrl-C just after a shard died killed its
    replacement (a KeyboardInterrupt in its log, one more death counted). Blocked at exec, a
    signal waits, and ignoring it drops it (`_launcher.leave_stop_signals_to_the_coordinator`,
    which then unblocks them). `subprocess` execs with the caller's signal mask; the event
    loop's spawn would not do: uvloop (libuv) resets the child's mask and dispositions first.
    The mask is this thread's, restored at once: a signal for this process meanwhile waits too.
    """
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, bufsize=0,
                                pass_fds=pass_fds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


async def reader_of(pipe: IO[bytes]) -> asyncio.StreamReader:
    """Our end of a child's output pipe (a shard's stdout, the launcher's reports), in the loop."""
    reader = asyncio.StreamReader(limit=PIPE_LIMIT)
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader


async def connect_pipes(stdin: IO[bytes], stdout: IO[bytes],
                        ) -> tuple[asyncio.WriteTransport, asyncio.StreamReader]:  # fmt: skip
    """Our ends of a shard's stdin and stdout, in the loop."""
    reader = await reader_of(stdout)
    writer, _ = await asyncio.get_running_loop().connect_write_pipe(asyncio.Protocol, stdin)
    return writer, reader


async def start_local_shard(index: int, log_dir: Path, out_dir: Path, segment: int) -> LocalShard:
    """Spawn `python -m shardrun._shard_main`; its stderr goes to logs/shard-NN.log."""
    file_name, log_path = log_path_of(index, log_dir, segment)
    with open(log_path, "ab") as log:
        popen = spawn_holding_stop_signals([sys.executable, "-m", "shardrun._shard_main"],
                                           subprocess.PIPE, subprocess.PIPE, log)
    assert popen.stdin is not None and popen.stdout is not None
    writer, reader = await connect_pipes(popen.stdin, popen.stdout)
    return LocalShard(index, SpawnedProcess(popen), writer, reader, log_path, out_dir, file_name,
                      (popen.stdin, popen.stdout))

"""Where shards run. Local OS processes today; a remote engine later, behind the same seam.

A placement starts a shard and returns a `ShardHandle`: send a message, receive one, learn how it
ended. The coordinator sees nothing else, so a Ray placement can carry the same JSON lines.

Local shards start two ways. `start_forked_shards` starts the shard launcher (`_launcher.py`),
which imports a shard's code once and forks every shard of the run from it; `start_local_shard`
spawns one fresh interpreter (`python -m shardrun._shard_main`), for a replacement after a
death and wherever forking is unavailable. Either way a shard speaks the protocol on its stdin
and stdout and writes its stderr to `logs/shard-NN.log`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol, TypeVar

from shardrun import protocol
from shardrun._launcher import Slot
from shardrun.recovery import line_ids, repair_torn_tail
from shardrun.shard_config import shard_file_name

PIPE_LIMIT = 1 << 26
T = TypeVar("T")


class ShardHandle(Protocol):
    """One running shard, seen from the coordinator."""

    index: int

    def send(self, message: protocol.Message) -> None: ...

    async def receive(self) -> protocol.Message | None: ...

    async def wait(self) -> str | None:
        """Wait for the shard to end; None if it ended cleanly, else how it died."""
        ...

    def kill(self) -> None: ...

    def finished_among(self, ids: set[str]) -> tuple[list[str], list[str]]:
        """After a death: which of `ids` the shard did finish (result lines, dead lines)."""
        ...


class _Process(Protocol):
    """The OS process under a `LocalShard`: an asyncio subprocess, or a `ForkedProcess`."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


class _Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...


class LocalShard:
    """A shard in a local OS process speaking the protocol on its stdin and stdout."""

    def __init__(self, index: int, proc: _Process, stdin: _Writer, stdout: asyncio.StreamReader,
                 log_path: Path, out_dir: Path, file_name: str) -> None:
        self.index = index
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
        if code == 0:
            return None
        if code == UNKNOWN_EXIT:
            return "ended with an unknown status: the shard launcher is gone"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has ended: nothing to kill
            self.proc.kill()

    def finished_among(self, ids: set[str]) -> tuple[list[str], list[str]]:
        """Read the dead shard's own files (repairing a torn last line first)."""
        found: list[list[str]] = []
        for sub in ("results", "dead"):
            path = self.out_dir / sub / self.file_name
            hits: list[str] = []
            if path.exists():
                repair_torn_tail(path)
                hits = [i for i in line_ids(path) if i in ids]
            found.append(hits)
        return found[0], found[1]


def _log_path(index: int, log_dir: Path, segment: int) -> tuple[str, Path]:
    file_name = shard_file_name(index, segment)
    return file_name, log_dir / file_name.replace(".jsonl", ".log")


async def start_local_shard(index: int, log_dir: Path, out_dir: Path, segment: int) -> LocalShard:
    """Spawn `python -m shardrun._shard_main`; its stderr goes to logs/shard-NN.log."""
    file_name, log_path = _log_path(index, log_dir, segment)
    with open(log_path, "ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "shardrun._shard_main",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            limit=PIPE_LIMIT,
        )
    assert proc.stdin is not None and proc.stdout is not None
    return LocalShard(index, proc, proc.stdin, proc.stdout, log_path, out_dir, file_name)


# -- forked shards -----------------------------------------------------------------------------

# The launcher's command line, less its slot arguments (a test substitutes its own).
LAUNCHER_ARGV: tuple[str, ...] = (sys.executable, "-m", "shardrun._launcher")
# What `ForkedProcess.wait` returns when the launcher ended without reporting the shard's end.
UNKNOWN_EXIT = -(1 << 16)


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


class Launcher:
    """The coordinator's side of `_launcher.py`: its report lines, turned into futures."""

    def __init__(self, proc: asyncio.subprocess.Process, indexes: Sequence[int]) -> None:
        loop = asyncio.get_running_loop()
        self.proc = proc
        # A shard's PID once forked (None: not forked), and its exit code once reaped.
        self.pids: dict[int, asyncio.Future[int | None]] = {}
        self.ends: dict[int, asyncio.Future[int]] = {}
        for i in indexes:
            self.pids[i], self.ends[i] = loop.create_future(), loop.create_future()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        try:
            while line := await self.proc.stdout.readline():
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

    def kill(self) -> None:
        """SIGKILL the launcher (not its shards); `close` then returns once it is reaped."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()


def _resolve(future: asyncio.Future[T] | None, value: T) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def fork_available() -> bool:
    return hasattr(os, "fork") and sys.platform != "win32"


async def start_forked_shards(indexes: Sequence[int], log_dir: Path, out_dir: Path,
                              segment: int) -> tuple[list[LocalShard], Launcher]:
    """Start these shards as children of one launcher; any it could not fork are spawned."""
    loop = asyncio.get_running_loop()
    slots: list[Slot] = []
    ours: dict[int, tuple[IO[bytes], IO[bytes], str, Path]] = {}
    child_fds: list[int] = []
    try:
        for index in indexes:
            file_name, log_path = _log_path(index, log_dir, segment)
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            child_fds += [in_r, out_w]
            err = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            child_fds.append(err)
            ours[index] = (open(in_w, "wb", buffering=0), open(out_r, "rb", buffering=0),  # noqa: SIM115
                           file_name, log_path)
            slots.append(Slot(index, in_r, out_w, err))
        launcher_log = log_dir / "launcher.log"
        with open(launcher_log, "ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *LAUNCHER_ARGV, *(slot.arg() for slot in slots),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=log,
                pass_fds=child_fds)
    except BaseException:
        for stdin_file, stdout_file, _, _ in ours.values():
            stdin_file.close()
            stdout_file.close()
        raise
    finally:
        for fd in child_fds:
            os.close(fd)  # the launcher holds them now (or never will)
    launcher = Launcher(proc, indexes)
    shards: list[LocalShard] = []
    for index in indexes:
        stdin_file, stdout_file, file_name, log_path = ours[index]
        pid = await launcher.pids[index]
        if pid is None:  # not forked: the same shard as a fresh interpreter
            stdin_file.close()
            stdout_file.close()
            shards.append(await start_local_shard(index, log_dir, out_dir, segment))
            continue
        reader = asyncio.StreamReader(limit=PIPE_LIMIT)
        await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r),  # type: ignore[misc]
                                     stdout_file)
        writer, _ = await loop.connect_write_pipe(asyncio.Protocol, stdin_file)
        shards.append(LocalShard(index, ForkedProcess(pid, launcher.ends[index], reader), writer,
                                 reader, log_path, out_dir, file_name))
    return shards, launcher

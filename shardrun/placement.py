"""Where shards run. Local OS processes today; a remote engine later, behind the same seam.

A placement starts a shard and returns a `ShardHandle`: send a message, receive one, learn how it
ended. The coordinator sees nothing else, so a Ray placement can carry the same JSON lines.

Local shards start two ways: forked by the shard launcher, which imports a shard's code once
(`launch.py`), or spawned here by `start_local_shard` as one fresh interpreter (`python -m
shardrun._shard_main`), for a replacement after a death and wherever forking is unavailable.
Either way a shard speaks the protocol on its stdin and stdout and writes its stderr to
`logs/shard-NN.log`, and the coordinator holds it as a `LocalShard`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Protocol

from shardrun import protocol
from shardrun.recovery import line_ids, repair_torn_tail
from shardrun.shard_config import shard_file_name

PIPE_LIMIT = 1 << 26
# The exit code of a forked shard whose launcher ended without reporting the shard's end.
UNKNOWN_EXIT = -(1 << 16)


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


class OSProcess(Protocol):
    """An OS process as the coordinator holds it: an asyncio subprocess, a shard forked by the
    launcher (`launch.ForkedProcess`) or the launcher itself (`launch.ForkedLauncher`)."""

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

    def __init__(self, index: int, proc: OSProcess, stdin: _Writer, stdout: asyncio.StreamReader,
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


def log_path_of(index: int, log_dir: Path, segment: int) -> tuple[str, Path]:
    file_name = shard_file_name(index, segment)
    return file_name, log_dir / file_name.replace(".jsonl", ".log")


async def start_local_shard(index: int, log_dir: Path, out_dir: Path, segment: int) -> LocalShard:
    """Spawn `python -m shardrun._shard_main`; its stderr goes to logs/shard-NN.log."""
    file_name, log_path = log_path_of(index, log_dir, segment)
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

"""Where shards run. Local OS processes today; a remote engine later, behind the same seam.

A placement starts a shard and returns a `ShardHandle`: send a message, receive one, learn how it
ended. The coordinator sees nothing else, so a Ray placement can carry the same JSON lines.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Protocol

from shardrun import protocol
from shardrun.recovery import line_ids, repair_torn_tail
from shardrun.shard_config import shard_file_name

PIPE_LIMIT = 1 << 26


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


class LocalShard:
    """A shard in a child process speaking the protocol on its stdin and stdout."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process, log_path: Path,
                 out_dir: Path, file_name: str) -> None:
        self.index = index
        self.proc = proc
        self.log_path = log_path
        self.out_dir = out_dir
        self.file_name = file_name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: protocol.Message) -> None:
        stdin = self.proc.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.write(protocol.encode(message))

    async def receive(self) -> protocol.Message | None:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        return protocol.decode(line) if line else None

    async def wait(self) -> str | None:
        code = await self.proc.wait()
        if code == 0:
            return None
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def kill(self) -> None:
        if self.proc.returncode is None:
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


async def start_local_shard(index: int, log_dir: Path, out_dir: Path, segment: int) -> LocalShard:
    """Spawn `python -m shardrun._shard_main`; its stderr goes to logs/shard-NN.log."""
    file_name = shard_file_name(index, segment)
    log_path = log_dir / file_name.replace(".jsonl", ".log")
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
    return LocalShard(index, proc, log_path, out_dir, file_name)

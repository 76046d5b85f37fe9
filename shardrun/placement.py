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


class LocalShard:
    """A shard in a child process speaking the protocol on its stdin and stdout."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.index = index
        self.proc = proc
        self.log_path = log_path

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


async def start_local_shard(index: int, log_dir: Path) -> LocalShard:
    """Spawn `python -m shardrun._shard_main`; its stderr goes to logs/shard-NN.log."""
    log_path = log_dir / f"shard-{index:02d}.log"
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
    return LocalShard(index, proc, log_path)

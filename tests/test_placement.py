"""Local placement: shards forked by the launcher, and what happens when the launcher fails.

Real processes and real pipes throughout: the launcher is `python -m shardrun._launcher` (or, for
the failure paths, a stand-in script speaking its report lines), and a shard that gets no config
exits by itself when its stdin closes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from shardrun import placement, protocol
from shardrun.placement import ForkedProcess, start_forked_shards

GUARD_S = 60.0  # hang guard only


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    logs = tmp_path / "logs"
    logs.mkdir()
    return logs, tmp_path


async def _end_without_config(shard: placement.LocalShard) -> str | None:
    """Close the shard's stdin before any config: it exits with status 2 on its own."""
    assert hasattr(shard.stdin, "close")
    shard.stdin.close()
    return await asyncio.wait_for(shard.wait(), GUARD_S)


def test_forked_shards_speak_the_protocol_and_report_their_exit(tmp_path: Path) -> None:
    async def main() -> None:
        logs, out = _dirs(tmp_path)
        shards, launcher = await start_forked_shards([0, 1], logs, out, 0)
        assert all(isinstance(s.proc, ForkedProcess) for s in shards)
        assert len({s.pid for s in shards}) == 2 and os.getpid() not in {s.pid for s in shards}
        # Shard 0 gets a message it cannot take as its first: it says so on stderr, exits 2.
        shards[0].send({"t": protocol.END})
        assert await asyncio.wait_for(shards[0].wait(), GUARD_S) == "exited with status 2"
        assert "expected a config message first" in (logs / "shard-00.log").read_text()
        # Shard 1 is killed: the launcher reaps it and reports the signal.
        shards[1].kill()
        assert await asyncio.wait_for(shards[1].wait(), GUARD_S) == "killed by signal SIGKILL"
        await asyncio.wait_for(launcher.close(), GUARD_S)
        assert launcher.proc.returncode == 0

    asyncio.run(main())


async def _orphan(tmp_path: Path) -> placement.LocalShard:
    """One forked shard, waiting for its config, whose launcher was killed."""
    logs, out = _dirs(tmp_path)
    (shard,), launcher = await start_forked_shards([0], logs, out, 0)
    os.kill(launcher.proc.pid, signal.SIGKILL)
    await asyncio.wait_for(launcher.close(), GUARD_S)
    return shard


def test_a_shard_outlives_a_killed_launcher_and_ends_with_an_unknown_status(
        tmp_path: Path) -> None:
    async def main() -> None:
        shard = await _orphan(tmp_path)
        why = await _end_without_config(shard)
        assert why == "ended with an unknown status: the shard launcher is gone"

    asyncio.run(main())


def test_kill_still_reaches_a_shard_whose_launcher_is_gone(tmp_path: Path) -> None:
    """The coordinator's last resort (kill) works on an orphaned shard: its pipes close."""
    async def main() -> None:
        shard = await _orphan(tmp_path)
        shard.kill()  # it waits for a config that never comes: only the kill ends it
        assert await asyncio.wait_for(shard.stdout.read(), GUARD_S) == b""  # EOF: it is gone
        assert shard.stdout.at_eof()
        shard.kill()  # and now does nothing (its PID is no longer ours to signal)

    asyncio.run(main())


def test_a_shard_the_launcher_could_not_fork_is_spawned(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher that forks shard 1 only: shard 0 starts as a fresh interpreter instead."""
    stand_in = tmp_path / "launcher.py"
    stand_in.write_text(
        "import os, sys\n"
        "slots = [a.split(':') for a in sys.argv[1:]]\n"
        "print('fail 0 no memory to fork', flush=True)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    index, stdin, stdout, stderr = map(int, slots[1])\n"
        "    os.dup2(stdin, 0); os.dup2(stdout, 1)\n"
        "    os.execv(sys.executable, [sys.executable, '-m', 'shardrun._shard_main'])\n"
        "print(f'pid 1 {pid}', flush=True)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(f'exit 1 {os.waitstatus_to_exitcode(status)}', flush=True)\n"
    )
    monkeypatch.setattr(placement, "LAUNCHER_ARGV", (sys.executable, str(stand_in)))

    async def main() -> None:
        logs, out = _dirs(tmp_path)
        shards, launcher = await start_forked_shards([0, 1], logs, out, 0)
        assert not isinstance(shards[0].proc, ForkedProcess)  # spawned
        assert isinstance(shards[1].proc, ForkedProcess)
        for shard in shards:
            assert await _end_without_config(shard) == "exited with status 2"
        await asyncio.wait_for(launcher.close(), GUARD_S)

    asyncio.run(main())

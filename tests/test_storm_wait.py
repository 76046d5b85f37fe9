"""A span held in a storm wakes at the news that its turn has come, however soon the news comes
after it began to wait (`Shard._ride_out_storm`, `Shard._wake_held`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shardrun import shard as shard_module
from shardrun.shard import Shard
from shardrun.shard_config import ShardConfig
from shardrun.spans import Span


def test_a_wake_that_comes_before_the_waiter_first_runs_is_not_missed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe ends, and the held span's turn comes, in the same turn of the event loop in
    which the span began to wait. On Python 3.11 `asyncio.wait_for` runs the wait in a task of
    its own, which had not started yet: an event set and cleared at once was missed, and the
    span waited for the next recheck. With the recheck an hour away, the span must still take
    its turn within a few turns of the loop."""
    monkeypatch.setattr(shard_module, "RECHECK_S", 3600.0)
    cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://x",
                      api="chat", model="m")  # fmt: skip
    shard = Shard(cfg, lambda message: None)  # type: ignore[arg-type]
    shard.storm.since = shard.clock.now()  # a storm, its next probe due at once
    shard.storm_probe = Span("probe", {"id": "probe"}, 0.0)
    held = Span("held", {"id": "held"}, 0.0)

    def probe_ends() -> None:
        shard.storm_probe = None
        shard._wake_held()

    async def go() -> bool:
        loop = asyncio.get_running_loop()
        waiter = asyncio.create_task(shard._ride_out_storm(held))
        loop.call_soon(probe_ends)  # runs after the waiter's first step, before its wait's
        for _ in range(50):  # bounded: each is one turn of the loop, no time passes
            if waiter.done():
                break
            await asyncio.sleep(0)
        took_turn = waiter.done() and shard.storm_probe is held
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        return took_turn

    try:
        assert asyncio.run(go())
    finally:
        shard.close()

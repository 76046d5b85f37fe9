"""Admission inside one shard: a span is admitted by the task that runs it, and a task that
never ran still releases its span and its permit.

These drive `Shard` on a real event loop with real files and a real client session. Its base
URL is a closed loopback port, so an attempt that wrongly starts is refused at once and shows.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from shardrun import protocol
from shardrun.client import StreamingClient, Timeouts, make_session
from shardrun.items import API_PATHS
from shardrun.shard import Shard
from shardrun.shard_config import ShardConfig

CAP = 4


def _shard(tmp_path: Path, sent: list[protocol.Message]) -> Shard:
    cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://127.0.0.1:9",
                      api="completions", model="m", concurrency=CAP)  # fmt: skip
    return Shard(cfg, sent.append)


def _events(tmp_path: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in (tmp_path / "events" / "shard-00.jsonl").open("rb")]


def _items(n: int) -> protocol.Message:
    return {"t": protocol.ITEMS, "items": [{"id": str(i), "prompt": "p"} for i in range(n)]}


def test_a_slot_task_cancelled_before_it_ran_releases_its_span_and_permit(
        tmp_path: Path) -> None:
    """A second Ctrl-C (abort) can cancel the tasks the dispatcher has just made, before any
    of them takes a step: Python then runs none of their code, `finally` included. Their spans
    still end (abandoned, for --resume) and their permits come back."""

    async def go() -> Shard:
        sent: list[protocol.Message] = []
        shard = _shard(tmp_path, sent)
        shard.on_message(_items(CAP))
        dispatcher = asyncio.create_task(shard.dispatch())
        await asyncio.sleep(0)  # one step of the dispatcher: a task per slot, none started
        made = list(shard.tasks)
        assert len(made) == CAP and not shard.queue
        shard.on_message({"t": protocol.ABORT})
        await asyncio.gather(*made, return_exceptions=True)
        assert all(task.cancelled() for task in made)
        dispatcher.cancel()
        await asyncio.gather(dispatcher, return_exceptions=True)
        shard.close()
        return shard

    shard = asyncio.run(go())
    kinds = Counter(e["ev"] for e in _events(tmp_path))
    assert kinds["queued"] == kinds["admitted"] == kinds["released"] == CAP
    assert kinds["attempt_start"] == 0
    released = [e for e in _events(tmp_path) if e["ev"] == "released"]
    assert {e["outcome"] for e in released} == {"abandoned"}
    assert shard.counters.abandoned == CAP and shard.counters.in_flight == 0
    assert shard.sem._value == CAP  # every permit back


def test_a_stop_between_dispatch_and_the_tasks_turn_starts_no_attempt(tmp_path: Path) -> None:
    """A stop that arrives after the dispatcher made a slot's task but before the task ran:
    the span is released as abandoned without an attempt, like a span still queued."""

    async def go() -> None:
        sent: list[protocol.Message] = []
        shard = _shard(tmp_path, sent)
        async with make_session(CAP, Timeouts()) as session:
            shard.clients = {api: StreamingClient(session, shard.cfg.base_url, api, {},
                                                  Timeouts(), shard.clock) for api in API_PATHS}
            shard.on_message(_items(CAP))
            dispatcher = asyncio.create_task(shard.dispatch())
            await asyncio.sleep(0)
            made = list(shard.tasks)
            shard.on_message({"t": protocol.STOP})
            await asyncio.gather(*made, dispatcher)
        shard.close()
        assert shard.fatal_reason is None

    asyncio.run(go())
    events = _events(tmp_path)
    kinds = Counter(e["ev"] for e in events)
    assert kinds["queued"] == kinds["released"] == CAP and kinds["attempt_start"] == 0
    assert {e["outcome"] for e in events if e["ev"] == "released"} == {"abandoned"}


async def _held_then_stopped(shard: Shard, base: str, held: Callable[[], bool],
                             ) -> tuple[protocol.Message, protocol.Message]:
    """Two items through `shard` to `base`: its report once `held()` (both items waiting to
    be tried again), and its report after a stop has ended them."""
    async with make_session(CAP, Timeouts()) as session:
        shard.clients = {api: StreamingClient(session, base, api, {}, Timeouts(), shard.clock)
                         for api in API_PATHS}
        shard.on_message(_items(2))
        dispatcher = asyncio.create_task(shard.dispatch())
        for _ in range(1000):  # bounded: each step is one local connection
            if held():
                break
            await asyncio.sleep(0.01)
        waiting = shard.report(protocol.PROGRESS)
        made = list(shard.tasks)
        shard.on_message({"t": protocol.STOP})  # the waits end at once: abandoned
        await asyncio.gather(*made, dispatcher)
        ended = shard.report(protocol.PROGRESS)
    shard.close()
    return waiting, ended


def test_a_report_names_the_open_spans_whose_failed_attempts_it_counted(tmp_path: Path) -> None:
    """Each span still open after a failed attempt is in the report's `tried`, with the number
    of attempts the counters hold for it, and leaves it (0) when it ends: the coordinator reads it
    when the shard dies after writing lines it never reported (`summary.add_unreported`)."""
    cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path),
                      base_url="http://127.0.0.1:9", api="completions", model="m",
                      concurrency=CAP, retry={"backoff_s": 60, "backoff_max_s": 60})
    shard = Shard(cfg, [].append)  # two refused connections: not yet "unreachable"
    waiting, ended = asyncio.run(_held_then_stopped(
        shard, cfg.base_url, lambda: shard.counters.retrying == 2))
    assert waiting["tried"] == {"0-1": 1, "0-2": 1} and waiting["attempts"] == 2
    # Each report carries the changes since the one before: here, both spans ended.
    assert ended["tried"] == {"0-1": 0, "0-2": 0} and ended["abandoned"] == 2


def test_a_report_names_the_429s_of_the_open_spans_it_counted(tmp_path: Path) -> None:
    """Each span still open after a 429 is in the report's `refused`, with the 429s the
    counters hold for it, and leaves it (0) when it ends: the coordinator subtracts them from
    a dead shard's lines, whose retries `tried` holds from their sending, before their 429s."""

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "slow down", "type": "requests"}},
                                 status=429, headers={"Retry-After": "30"})

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)

    async def go() -> tuple[protocol.Message, protocol.Message]:
        async with TestServer(app, host="127.0.0.1", port=0) as server:
            base = str(server.make_url("/v1"))
            shard = Shard(ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path),
                                      base_url=base, api="completions", model="m",
                                      concurrency=CAP), [].append)
            return await _held_then_stopped(shard, base,
                                            lambda: shard.counters.http_429s == 2)

    waiting, ended = asyncio.run(go())
    assert waiting["refused"] == {"0-1": 1, "0-2": 1} and waiting["http_429s"] == 2
    assert ended["refused"] == {"0-1": 0, "0-2": 0} and ended["abandoned"] == 2


def test_a_fatal_error_during_a_retrys_rate_wait_sends_no_retry(tmp_path: Path) -> None:
    """A retry waits for the rate limit; a fatal error (another span's, the coordinator's)
    arrives meanwhile: the retry is not sent, and the item ends as the fatal error says."""

    async def go() -> Shard:
        sent: list[protocol.Message] = []
        cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path),
                          base_url="http://127.0.0.1:9", api="completions", model="m",
                          concurrency=1, retry={"backoff_s": 0.0})  # fmt: skip
        shard = Shard(cfg, sent.append)
        waited = shard._rate_wait

        async def wait_then_fatal(span: object, attempt: int) -> None:
            await waited(span, attempt)  # type: ignore[arg-type]
            if attempt > 1:
                shard._go_fatal("the coordinator says stop", tell=False)

        shard._rate_wait = wait_then_fatal  # type: ignore[method-assign]
        async with make_session(1, Timeouts()) as session:
            shard.clients = {api: StreamingClient(session, shard.cfg.base_url, api, {},
                                                  Timeouts(), shard.clock) for api in API_PATHS}
            shard.on_message(_items(1))
            shard.on_message({"t": protocol.END})
            await shard.dispatch()
            while shard.tasks:
                await asyncio.gather(*shard.tasks)
        shard.close()
        return shard

    shard = asyncio.run(go())
    kinds = Counter(e["ev"] for e in _events(tmp_path))
    assert kinds["attempt_start"] == 1 and kinds["released"] == 1
    assert shard.counters.dead == 1 and shard.fatal_reason == "the coordinator says stop"


def test_a_shard_reports_the_lines_it_wrote_before_it_fsyncs_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ticker sends its report after a flush's writes and before their fsync: a shard
    killed in an fsync (milliseconds, once a second) has reported every line it wrote. Sent
    after the fsync, a report was lost with the shard, and the summary took the lines from
    the files but missed the attempts, retries and 429s whose ends the log already held
    (tests/test_reliability.py, killed `in_an_fsync`)."""
    sent: list[protocol.Message] = []
    cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://127.0.0.1:9",
                      api="chat", model="m", fsync_interval_s=0.001)
    shard = Shard(cfg, sent.append)
    shard.out.add_result("a", {"id": "a"})
    told: list[list[str]] = []  # at each fsync, the ids the reports sent so far had finished
    fsync = os.fsync

    def watched(fd: int) -> None:
        told.append([i for message in sent for i in message["fin_ok"]])
        fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)

    async def go() -> None:
        ticker = asyncio.create_task(shard.ticker())
        for _ in range(500):  # bounded: the first flush comes after 0.2 s
            if told:
                break
            await asyncio.sleep(0.01)
        ticker.cancel()
        with suppress(asyncio.CancelledError):
            await ticker

    asyncio.run(go())
    shard.close()
    assert told and told[0] == ["a"]

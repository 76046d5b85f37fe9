"""`Coordinator._hand_out`: what a shard's request for items is answered with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from shardrun import protocol
from shardrun.coordinator import START_SILENCE_MIN_S, Coordinator, ShardState
from shardrun.digestset import DigestSet
from shardrun.errors import SpecError
from shardrun.inputs import InputPlan, InputReader
from shardrun.manifest import RunDir
from shardrun.placement import Lines
from shardrun.progress import STARTING_AFTER_S, ProgressView
from shardrun.shard_config import ShardConfig
from shardrun.worksource import SETTLE_LINES, SKIP_SLICE_LINES, WorkSource, id_digest
from tests.conftest import write_input

IDS = [f"item-{i:05d}" for i in range(10)]  # `write_input`'s ids of 10 items


class Handle:
    """A shard seen from the coordinator that only records what it is sent."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.sent: list[protocol.Message] = []

    def send(self, message: protocol.Message) -> None:
        self.sent.append(message)

    async def receive(self) -> protocol.Message | None:
        return None

    async def wait(self) -> str | None:
        return None

    def kill(self) -> None:
        return None

    def finished_among(self, ids: set[str]) -> tuple[Lines, Lines]:
        return {}, {}

    def reaped(self) -> bool:
        return True


class HeldSource(WorkSource):
    """A work source whose `fill` waits, once it has begun, until the test lets it read."""

    def __init__(self, reader: InputReader, rejects_path: Path) -> None:
        super().__init__(reader, rejects_path)
        self.reading, self.go_on = asyncio.Event(), asyncio.Event()

    async def fill(self, n: int, keep_going: Callable[[], bool] = lambda: True,
                   lines: int = SKIP_SLICE_LINES, settle: int | None = None) -> None:
        self.reading.set()
        await self.go_on.wait()
        await super().fill(n, keep_going, lines, settle)


def _finish(state: ShardState) -> None:
    state.done = {"t": protocol.DONE}


def _die(state: ShardState) -> None:
    state.died = "killed by signal 9"


def _nothing(state: ShardState) -> None:
    return None


async def _hand_out_while(tmp_path: Path, meanwhile: Callable[[ShardState], None]) -> tuple[
        Handle, ShardState, list[str]]:
    """One shard asks for 4 of 10 items; `meanwhile` happens to it while the input is read.
    What the shard was sent, its state, and the ids the source has left to hand out."""
    write_input(tmp_path / "input.jsonl", 10)
    run_dir = RunDir.create(tmp_path / "runs", "r1")
    source = HeldSource(InputReader(tmp_path / "input.jsonl", InputPlan()),
                        run_dir.path / "rejects.jsonl")
    config = ShardConfig(shard=0, run_id="r1", out_dir=str(run_dir.path),
                         base_url="http://127.0.0.1:9", api="chat", model="m")
    coordinator = Coordinator(config, 1, source, run_dir, ProgressView(quiet=True), (None, None),
                              silence_s=60.0, fork=False)
    handle = Handle(0)
    state = ShardState(handle=handle)
    coordinator.states.append(state)
    try:
        asking = asyncio.create_task(coordinator._hand_out(state, 4))
        await source.reading.wait()
        meanwhile(state)
        source.go_on.set()
        await asking
        left = [item["id"] for item in source.take(10)]
    finally:
        coordinator.log.close()
        source.reader.close()
    return handle, state, left


@pytest.mark.parametrize("meanwhile", [_finish, _die])
def test_a_shard_that_ended_while_the_input_was_read_is_handed_nothing(
        tmp_path: Path, meanwhile: Callable[[ShardState], None]) -> None:
    """A hand-out reads the input before it takes items (`WorkSource.fill`, a task of its own,
    so the shard is heard meanwhile). A shard that reported done, or died, during that read is
    sent nothing and holds nothing: items given it then would be its outstanding ones, and a
    finished shard never runs them. They stay in the source for the others."""
    handle, state, left = asyncio.run(_hand_out_while(tmp_path, meanwhile))
    assert handle.sent == [] and state.outstanding == {}
    assert left == IDS


def test_a_shard_still_running_after_the_read_gets_its_items(tmp_path: Path) -> None:
    """The same hand-out to a shard that neither finished nor died sends the items asked for
    (the case above is told apart by the shard's state, not by the read)."""
    handle, state, left = asyncio.run(_hand_out_while(tmp_path, _nothing))
    [sent] = handle.sent
    assert sent["t"] == protocol.ITEMS and [i["id"] for i in sent["items"]] == IDS[:4]
    assert list(state.outstanding) == IDS[:4] and left == IDS[4:]


def test_a_sparse_pass_hands_out_what_it_found_before_reading_to_the_end(
        tmp_path: Path) -> None:
    """A pass that runs a few of the input's items (dead letters among a long input, or what a
    resume has left) read until the look-ahead was full, here the input's end, before it sent
    the first shard anything. Now it settles once `SETTLE_LINES` lines are read: the first shard
    to ask gets its part of what was found (3 items, 2 shards: 2), the rest of the input
    unread yet, and the next the item left, before any more is read."""
    lines = SETTLE_LINES + 20_000
    wanted = {1, 2, 3, lines - 1}
    path = tmp_path / "input.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"i{i}", "prompt": "p"}) + b"\n"
                              for i in range(lines)))
    only = DigestSet(id_digest(f"i{i}") for i in wanted)
    run_dir = RunDir.create(tmp_path / "runs", "r1")
    source = WorkSource(InputReader(path, InputPlan(id_field="id", prompt_field="prompt")),
                        run_dir.path / "rejects.jsonl", only=only)
    config = ShardConfig(shard=0, run_id="r1", out_dir=str(run_dir.path),
                         base_url="http://127.0.0.1:9", api="chat", model="m")
    coordinator = Coordinator(config, 2, source, run_dir, ProgressView(quiet=True), (None, None),
                              silence_s=60.0, fork=False)
    first, second = Handle(0), Handle(1)
    coordinator.states.extend([ShardState(handle=first), ShardState(handle=second)])
    try:
        asyncio.run(coordinator._hand_out(coordinator.states[0], 4))
        assert source.reader.lines_read < lines and not source.exhausted
        [sent] = first.sent
        assert sent["t"] == protocol.ITEMS and [i["id"] for i in sent["items"]] == ["i1", "i2"]
        read = source.reader.lines_read
        asyncio.run(coordinator._hand_out(coordinator.states[1], 4))
        # The item found and not handed out yet goes at once: no other stretch is read first.
        [sent] = second.sent
        assert [i["id"] for i in sent["items"]] == ["i3"] and source.reader.lines_read == read
    finally:
        coordinator.log.close()
        source.reader.close()


def test_no_run_is_named_latest(tmp_path: Path) -> None:
    """`--resume latest` means the job's newest run: a run named latest would print a resume
    command that resumes whichever run is newest, so the name is refused, and nothing made."""
    with pytest.raises(SpecError, match=r"^--run-id latest is the word --resume reads as the "):
        RunDir.create(tmp_path / "runs", "latest")
    assert not (tmp_path / "runs").exists()
    assert RunDir.create(tmp_path / "runs", "latest-2").path.is_dir()


def _coordinator(tmp_path: Path, shards: int, view: ProgressView, silence_s: float) -> tuple[
        Coordinator, WorkSource]:
    """A coordinator of `shards` over 10 items, none started: close its log and reader after."""
    run_dir = RunDir.create(tmp_path / "runs", "r1")
    config = ShardConfig(shard=0, run_id="r1", out_dir=str(run_dir.path),
                         base_url="http://127.0.0.1:9", api="chat", model="m")
    write_input(tmp_path / "input.jsonl", 10)
    source = WorkSource(InputReader(tmp_path / "input.jsonl", InputPlan()),
                        run_dir.path / "rejects.jsonl")
    return Coordinator(config, shards, source, run_dir, view, (None, None),
                       silence_s=silence_s, fork=False), source


def test_a_shard_not_heard_yet_has_a_start_up_s_grace_past_a_short_silence_limit(
        tmp_path: Path) -> None:
    """A shard is killed after `shard_silence_s` without a word, but its start-up (a process,
    imports, a loop) took over 2 s, the least limit, on a loaded machine: every shard of a run
    with that limit was killed before its first message. Until it is heard it may be silent
    `START_SILENCE_MIN_S` at least; once heard, the job's limit holds."""
    coordinator, source = _coordinator(tmp_path, 1, ProgressView(quiet=True), silence_s=2.0)
    starting, running = ShardState(handle=Handle(0)), ShardState(handle=Handle(1), heard=True)
    try:
        late = START_SILENCE_MIN_S + 0.5
        assert [coordinator.too_silent(starting, t) for t in (2.5, START_SILENCE_MIN_S)] == ["", ""]
        assert coordinator.too_silent(starting, late) == (
            f"sent nothing in the {START_SILENCE_MIN_S:g} s since it was started (a starting "
            f"shard may take shard_silence_s, at least {START_SILENCE_MIN_S:g} s: a start-up "
            "that hangs or a stopped process); it was killed")
        assert coordinator.too_silent(running, 2.0) == ""
        assert coordinator.too_silent(running, 2.5).startswith(
            "sent nothing for 2 s, the shard_silence_s limit")
    finally:
        coordinator.log.close()
        source.reader.close()


class DyingHandle(Handle):
    """A shard that reports once (an answer just heard: no wait, requests in flight) and dies."""

    def __init__(self, index: int, report: protocol.Message) -> None:
        super().__init__(index)
        self.reports = [report]

    async def receive(self) -> protocol.Message | None:
        return self.reports.pop() if self.reports else None

    async def wait(self) -> str | None:
        return "killed by signal 9"


def test_a_dead_shards_last_report_neither_hides_an_outage_nor_counts_in_flight(
        tmp_path: Path) -> None:
    """A dead shard sends no `done`: its last report (no wait, 5 in flight) lingered in the
    view, so with every live shard waiting the line said "1 of 2 shards waiting for the
    endpoint, the others hear answers", never "endpoint down", and a stop counted its 5."""
    view = ProgressView(quiet=True)
    coordinator, source = _coordinator(tmp_path, 2, view, silence_s=60.0)
    last = {"t": protocol.PROGRESS, "fin_ok": [], "fin_dead": [], "ok": 3, "in_flight": 5,
            "cap": 8, "down_s": 0}
    state = ShardState(handle=DyingHandle(0, last))
    try:
        asyncio.run(coordinator.serve(state))
        assert state.died is not None
        view.update(1, {"t": "progress", "ok": 2, "in_flight": 0, "cap": 8, "down_s": 30.0})
        view.stopping = True
        snap = view.snapshot()
        assert snap.down_s == 30.0 and snap.waiting_s is None
        assert snap.in_flight == 0 and snap.ok == 5
    finally:
        coordinator.log.close()
        source.reader.close()


def test_an_adopted_shard_is_starting_in_the_view_until_it_is_heard(tmp_path: Path) -> None:
    """The coordinator tells the view of each shard it starts: not heard from for
    STARTING_AFTER_S, it shows as starting (the view's own test has the wording)."""
    clock = [100.0]
    view = ProgressView(quiet=True, clock=lambda: clock[0])
    coordinator, source = _coordinator(tmp_path, 1, view, silence_s=60.0)

    async def adopt() -> None:
        coordinator._adopt(Handle(0))
        clock[0] += STARTING_AFTER_S
        assert view.snapshot().starting_shards == 1
        await asyncio.wait(list(coordinator.tasks))  # it says nothing and ends: no more starting

    try:
        asyncio.run(adopt())
        assert view.snapshot().starting_shards == 0
    finally:
        coordinator.log.close()
        source.reader.close()


def test_each_shard_is_told_how_many_shards_share_the_servers_limit(tmp_path: Path) -> None:
    """A shard's config says the run's shard count (and its phase k/N), so that a 429 stating
    the key's limit paces it at its share of it (`RateLimiter.limited`), not at all of it."""
    coordinator, source = _coordinator(tmp_path, 4, ProgressView(quiet=True), silence_s=60.0)
    handle = Handle(2)

    async def adopt() -> None:
        coordinator._adopt(handle)
        await asyncio.wait(list(coordinator.tasks))

    try:
        asyncio.run(adopt())
        config = ShardConfig.from_message(handle.sent[0])
        assert (config.shard, config.shard_count, config.rate_phase) == (2, 4, 0.5)
    finally:
        coordinator.log.close()
        source.reader.close()


def test_the_shards_left_are_told_how_many_they_are_without_job_limits_too(
        tmp_path: Path) -> None:
    """A run with no rate_limits whose shard 0 of 3 finished: the other two are each sent a
    RATE message saying 2 are left, since a pace seeded from the server's stated limit is that
    limit over the shards sharing it (`RateLimiter.set_share`); the one done is sent none."""
    coordinator, source = _coordinator(tmp_path, 3, ProgressView(quiet=True), silence_s=60.0)
    handles = [Handle(i) for i in range(3)]
    coordinator.states.extend(ShardState(handle=h) for h in handles)
    try:
        _finish(coordinator.states[0])
        coordinator._rebalance_rates()
        told = [[m for m in h.sent if m["t"] == protocol.RATE] for h in handles]
        assert told == [[], *[[{"t": protocol.RATE, "rpm": None, "tpm": None, "live": 2}]] * 2]
    finally:
        coordinator.log.close()
        source.reader.close()

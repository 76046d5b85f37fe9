"""The coordinator: streams the input to shards on request, supervises them, handles signals.

Work is pulled: a shard asks for `n` items when its own queue runs low, and the coordinator reads
that many lines from the input and sends them. The input is never held in memory, and a shard
with free slots is served as soon as it asks, so no shard idles while work remains.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from shardrun import events, protocol
from shardrun.clock import Clock
from shardrun.errors import RunError
from shardrun.events import EventLog
from shardrun.inputs import FieldMap, InputReader, Reject
from shardrun.manifest import RunDir, finish_manifest, start_manifest
from shardrun.placement import ShardHandle, start_local_shard
from shardrun.shard import ShardConfig
from shardrun.spec import LoadedJob
from shardrun.summary import RunSummary

PROGRESS_EVERY_S = 10.0


@dataclass
class ShardState:
    """What the coordinator knows of one shard."""

    handle: ShardHandle
    progress: dict[str, Any] = field(default_factory=dict)
    done: dict[str, Any] | None = None
    died: str | None = None


class Coordinator:
    """One run: input → shards → summary."""

    def __init__(self, job: LoadedJob, reader: InputReader, run_dir: RunDir, base_url: str,
                 api_key: str | None) -> None:
        self.job = job
        self.run_dir = run_dir
        self.base_url = base_url
        self.api_key = api_key
        self.reader = reader
        self.items: Iterator[dict[str, Any] | Reject] = iter(self.reader)
        self.input_exhausted = False
        self.rejects = 0
        self._rejects_file = open(run_dir.rejects_path, "ab")  # noqa: SIM115 - closed in run()
        self.shards: list[ShardState] = []
        self.interrupts = 0
        self.fatal_reason: str | None = None
        self.started = time.time()
        self.clock = Clock()
        self.log = EventLog(run_dir.path / "events" / "coordinator.jsonl", run_id=run_dir.run_id,
                            shard=None)

    # -- the input -----------------------------------------------------------------------------

    def take(self, n: int) -> list[dict[str, Any]]:
        """Up to `n` items from the input; rejects go to rejects.jsonl on the way."""
        batch: list[dict[str, Any]] = []
        if self.interrupts:
            return batch
        for entry in self.items:
            if isinstance(entry, Reject):
                self._reject(entry)
                continue
            batch.append(entry)
            if len(batch) >= n:
                return batch
        if not self.input_exhausted:
            self.input_exhausted = True
            self.log.emit(events.INPUT_END, t=self.clock.now(), lines=self.reader.lines_read,
                          rejects=self.rejects)
        return batch

    def _reject(self, reject: Reject) -> None:
        self.rejects += 1
        record = {"line": reject.line, "reason": reject.reason, "path": str(self.job.input_path)}
        self._rejects_file.write(orjson.dumps(record) + b"\n")

    # -- shards --------------------------------------------------------------------------------

    def shard_config(self, index: int) -> ShardConfig:
        spec = self.job.spec
        return ShardConfig(
            shard=index,
            run_id=self.run_dir.run_id,
            out_dir=str(self.run_dir.path),
            base_url=self.base_url,
            api=spec.endpoint.api,
            model=spec.endpoint.model,
            api_key=self.api_key,
            params=dict(spec.params),
            concurrency=spec.concurrency,
            retry=spec.retry.model_dump(),
            timeouts=spec.timeouts.model_dump(),
            grace_s=spec.shutdown_grace_s,
        )

    async def serve(self, state: ShardState) -> None:
        """Answer one shard's messages until it finishes or dies."""
        handle = state.handle
        handle.send(self.shard_config(handle.index).to_message())
        while (message := await handle.receive()) is not None:
            kind = message["t"]
            if kind == protocol.WANT:
                batch = self.take(int(message["n"]))
                if batch:
                    handle.send({"t": protocol.ITEMS, "items": batch})
                    self.log.emit(events.BATCH, t=self.clock.now(), to=handle.index,
                                  n=len(batch))
                if self.input_exhausted or self.interrupts:
                    handle.send({"t": protocol.END})
            elif kind == protocol.PROGRESS:
                state.progress = message
            elif kind == protocol.FATAL:
                self._on_fatal(str(message["reason"]), handle.index)
            elif kind == protocol.DONE:
                state.done = message
        state.died = await handle.wait()
        if state.done is None and state.died is None:
            state.died = "closed its pipe without reporting"
        self.log.emit(events.SHARD_EXIT, t=self.clock.now(), to=handle.index,
                      status=state.died or "done")

    def _on_fatal(self, reason: str, origin: int) -> None:
        """One shard found the endpoint unusable: tell the others at once."""
        if self.fatal_reason is None:
            self.fatal_reason = reason
            for other in self.shards:
                if other.handle.index != origin:
                    other.handle.send({"t": protocol.FATAL, "reason": reason})

    def interrupt(self) -> None:
        """First signal: stop handing out work and let in-flight finish; second: abort."""
        self.interrupts += 1
        kind = protocol.STOP if self.interrupts == 1 else protocol.ABORT
        if self.interrupts == 1:
            print("\nstopping: letting in-flight requests finish (Ctrl-C again to abort)",
                  file=sys.stderr)
        for state in self.shards:
            state.handle.send({"t": kind})

    async def progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            ok = sum(s.progress.get("ok", 0) for s in self.shards)
            dead = sum(s.progress.get("dead", 0) for s in self.shards)
            tokens = sum(s.progress.get("completion_tokens", 0) for s in self.shards)
            elapsed = time.time() - self.started
            print(f"[{elapsed:6.1f}s] {ok + dead:,} done ({ok:,} ok, {dead:,} failed), "
                  f"{tokens / elapsed * 60:,.0f} completion tokens/min", file=sys.stderr)

    async def run(self) -> RunSummary:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.interrupt)
        n = self.job.spec.shards
        self.log.emit(events.RUN_START, t=self.clock.now(), shards=n,
                      cap=self.job.spec.concurrency)
        handles = [await start_local_shard(i, self.run_dir.logs) for i in range(n)]
        self.shards = [ShardState(h) for h in handles]
        ticker = asyncio.create_task(self.progress())
        try:
            await self._supervise()
        finally:
            ticker.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            self._rejects_file.close()
            self.reader.close()
            summary = self.summary()
            self.log.emit(events.RUN_END, t=self.clock.now(), status=summary.status)
            self.log.checkpoint(self.clock.now())
            self.log.close()
        return summary

    async def _supervise(self) -> None:
        """Serve every shard; the first death fails the run after stopping the rest."""
        tasks = {asyncio.create_task(self.serve(s)): s for s in self.shards}
        pending = set(tasks)
        while pending:
            finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                task.result()
                state = tasks[task]
                if state.died is not None:
                    await self._abandon(pending)
                    raise RunError(
                        f"shard {state.handle.index} died ({state.died}); its log is "
                        f"{self.run_dir.logs / f'shard-{state.handle.index:02d}.log'}; "
                        f"results so far are in {self.run_dir.path}"
                    )

    async def _abandon(self, pending: set[asyncio.Task[None]]) -> None:
        """Stop the surviving shards: stop, a short grace, then kill."""
        for state in self.shards:
            state.handle.send({"t": protocol.STOP})
        _, still = await asyncio.wait(pending, timeout=5.0) if pending else (set(), set())
        for state in self.shards:
            if state.done is None:
                state.handle.kill()
        if still:
            await asyncio.wait(still, timeout=5.0)

    def summary(self) -> RunSummary:
        reports = [s.done or s.progress for s in self.shards]
        return RunSummary.from_shard_reports(
            run_dir=self.run_dir.path,
            reports=reports,
            rejects=self.rejects,
            started_at=self.started,
            ended_at=time.time(),
            interrupted=self.interrupts > 0,
            fatal_reason=self.fatal_reason,
        )


def open_input(job: LoadedJob) -> InputReader:
    """Open the job's input for streaming (raises InputError when it cannot be read)."""
    spec = job.spec.input
    return InputReader(job.input_path, FieldMap(spec.id_field, spec.prompt_field,
                                                spec.messages_field))


async def run_job(job: LoadedJob, reader: InputReader, run_dir: RunDir, base_url: str,
                  api_key: str | None, argv: list[str]) -> RunSummary:
    """Run a job into `run_dir` and return its summary; the manifest records everything."""
    manifest = start_manifest(job, run_dir, base_url, argv)
    coordinator = Coordinator(job, reader, run_dir, base_url, api_key)
    status = "failed"
    summary: RunSummary | None = None
    try:
        summary = await coordinator.run()
        status = summary.status
        return summary
    finally:
        finish_manifest(manifest, run_dir, status, coordinator.reader, summary)


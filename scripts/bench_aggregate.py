"""Benchmark the aggregator: a synthetic run of N spans over S shards, then `report --json`,
`publish` and `verify`, timed, with the peak RSS of each command's whole process tree.

    .venv/bin/python scripts/bench_aggregate.py [--spans 1000000] [--shards 8] [--dir DIR]
                                               [--keep] [--workers N]

The synthetic run is written in the real event format (today's layout: five lines for a
first-try span, the attempt's instants on its `attempt_end`; the key order `EventLog` produces;
a `checkpoint` line with the running SHA-256 every simulated second; a manifest with file
hashes). Each shard is a small discrete-event simulation: a pull-based queue topped up by
batches of `cap` items, `cap` = 64 slots, connection reuse after the first use of a slot, and a
realistic mix of faults: 2 % HTTP 429 and 1 % 5xx (retried after backoff), 0.5 % connections
cut mid-stream (retried, wasting the tokens already received), 0.3 % HTTP 400 (dead-lettered).
Timings go to stdout as a markdown table; docs/PERFORMANCE.md ("Aggregation") holds the ones
measured on the project's machine.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import psutil

RUN_ID = "bench-run"
T_START = 1_800_000_000.0
CAP = 64
FAULTS = (("http_429", 0.02), ("http_5xx", 0.01), ("conn_reset", 0.005), ("http_4xx", 0.003))
FLUSH_BYTES = 1 << 20  # write buffered lines once this many bytes are pending


class ShardWriter:
    """Lines in the real format, a running SHA-256, a checkpoint each simulated second."""

    def __init__(self, path: Path, shard: int | None) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.head = {"run_id": RUN_ID, "shard": shard}
        self.sha = hashlib.sha256()
        self.lines = 0
        self.pending: list[bytes] = []
        self.size = 0
        self.next_checkpoint = T_START + 1.0

    def emit(self, ev: str, t: float, **fields: Any) -> None:
        while t >= self.next_checkpoint:
            self._write_checkpoint(self.next_checkpoint)
            self.next_checkpoint += 1.0
        self._line(orjson.dumps({**self.head, "ev": ev, "t": t, **fields}))

    def _write_checkpoint(self, t: float) -> None:
        self._line(orjson.dumps({**self.head, "ev": "loop_lag", "t": t, "lag": 0.0004}))
        self._line(orjson.dumps({**self.head, "ev": "checkpoint", "t": t, "lines": self.lines,
                                 "sha256": self.sha.hexdigest()}))

    def _line(self, data: bytes) -> None:
        data += b"\n"
        self.sha.update(data)
        self.lines += 1
        self.pending.append(data)
        self.size += len(data)
        if self.size >= FLUSH_BYTES:
            self.file.write(b"".join(self.pending))
            self.pending, self.size = [], 0

    def close(self, t: float) -> None:
        self.file.write(b"".join(self.pending))
        self.pending = []
        self._line(orjson.dumps({**self.head, "ev": "checkpoint", "t": t, "lines": self.lines,
                                 "sha256": self.sha.hexdigest()}))
        self.file.write(b"".join(self.pending))
        self.file.close()


class ShardSim:
    """One shard's spans as a discrete-event simulation, written in time order."""

    def __init__(self, shard: int, spans: int, out: ShardWriter, seed: int) -> None:
        self.shard, self.total, self.out = shard, spans, out
        self.rng = random.Random(seed)
        self.heap: list[tuple[float, int, str, dict[str, Any]]] = []
        self.seq = 0
        self.made = 0
        self.queue: deque[str] = deque()
        self.free = CAP
        self.slots_used = 0
        self.batch_pending = False
        self.prompt_chars: dict[str, int] = {}  # per open span only
        self.batches: list[tuple[float, int]] = []

    def at(self, t: float, kind: str, **state: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, state))

    def run(self) -> float:
        self.at(T_START + 0.02, "batch", n=2 * CAP)
        self.batch_pending = True
        t = T_START
        while self.heap:
            t, _, kind, state = heapq.heappop(self.heap)
            getattr(self, "_" + kind)(t, state)
        return t

    def _batch(self, t: float, state: dict[str, Any]) -> None:
        self.batch_pending = False
        n = min(state["n"], self.total - self.made)
        if n <= 0:
            return
        self.batches.append((t, n))
        for _ in range(n):
            self.made += 1
            sid = f"{self.shard}-{self.made}"
            chars = self.prompt_chars[sid] = self.rng.choice((120, 300, 1500, 6000))
            self.out.emit("queued", t, span=sid, id=f"item-{sid}", prompt_chars=chars)
            self.queue.append(sid)
        self._admit(t)

    def _admit(self, t: float) -> None:
        while self.free and self.queue:
            self.free -= 1
            sid = self.queue.popleft()
            self.out.emit("admitted", t, span=sid, id=f"item-{sid}")
            self.at(t + 1e-5, "start", sid=sid, attempt=1)
        if len(self.queue) < CAP and self.made < self.total and not self.batch_pending:
            self.at(t + 0.003, "batch", n=2 * CAP - len(self.queue))
            self.batch_pending = True

    def _start(self, t: float, st: dict[str, Any]) -> None:
        sid, n, rng = st["sid"], st["attempt"], self.rng
        self.out.emit("attempt_start", t, span=sid, id=f"item-{sid}", attempt=n)
        reused = self.slots_used >= CAP and rng.random() > 0.002
        self.slots_used += 1
        conn = t if reused else t + rng.uniform(0.002, 0.02)
        fault = self._fault()
        if fault in ("http_429", "http_5xx", "http_4xx"):
            self.at(conn + rng.uniform(0.005, 0.05), "fail", sid=sid, attempt=n, status=fault,
                    conn=conn, reused=reused, first=None, last=None, tokens=0)
            return
        first = conn + rng.lognormvariate(-1.9, 0.4)
        tokens = rng.randint(16, 256)
        self.at(first, "first", sid=sid, attempt=n, tokens=tokens, fault=fault, conn=conn,
                reused=reused)

    def _fault(self) -> str | None:
        u = self.rng.random()
        for name, share in FAULTS:
            if u < share:
                return name
            u -= share
        return None

    def _first(self, t: float, st: dict[str, Any]) -> None:
        """The first token: the attempt's instants travel on to its attempt_end line."""
        sid, n = st["sid"], st["attempt"]
        tpot = self.rng.uniform(0.008, 0.012)
        if st["fault"] == "conn_reset":
            got = st["tokens"] // 3
            last = t + got * tpot
            self.at(last + 0.001, "fail", sid=sid, attempt=n, status="conn_reset",
                    conn=st["conn"], reused=st["reused"], first=t, last=last, tokens=got)
            return
        last = t + (st["tokens"] - 1) * tpot
        self.at(last, "done", sid=sid, attempt=n, tokens=st["tokens"], tpot=tpot,
                conn=st["conn"], reused=st["reused"], first=t)

    def _done(self, t: float, st: dict[str, Any]) -> None:
        sid, n, tokens = st["sid"], st["attempt"], st["tokens"]
        b = int(math.log2(st["tpot"] * 1e6) * 8)
        hist = {"-1": tokens // 4, str(b): tokens - 1 - tokens // 4 - 2, str(b + 1): 1,
                str(b + 9): 1}
        self.out.emit("attempt_end", t + 5e-5, span=sid, id=f"item-{sid}", attempt=n,
                      status="ok", http=200, retry_after=None, conn_ready_t=st["conn"],
                      reused=st["reused"], first_token_t=st["first"], last_token_t=t,
                      tokens=tokens, prompt_tokens=self.prompt_chars[sid] // 4,
                      completion_tokens=tokens, usage_estimated=False, wasted_tokens=0,
                      error=None, itl_hist=hist)
        self.at(t + self.rng.uniform(1e-4, 5e-4), "release", sid=sid, outcome="ok")

    def _fail(self, t: float, st: dict[str, Any]) -> None:
        sid, n, status = st["sid"], st["attempt"], st["status"]
        self.out.emit("attempt_end", t, span=sid, id=f"item-{sid}", attempt=n, status=status,
                      http=None, retry_after=None, conn_ready_t=st["conn"],
                      reused=st["reused"], first_token_t=st["first"], last_token_t=st["last"],
                      tokens=st["tokens"], prompt_tokens=None, completion_tokens=0,
                      usage_estimated=True, wasted_tokens=st["tokens"], error=status,
                      itl_hist=None)
        if status == "http_4xx" or n >= 4:
            self.at(t + 1e-4, "release", sid=sid, outcome="dead")
            return
        wait = min(5.0, 0.5 * 2 ** (n - 1)) * self.rng.uniform(0.5, 1.0)
        self.out.emit("retry", t, span=sid, id=f"item-{sid}", attempt=n, cause=status,
                      wait=wait, why="backoff")
        self.at(t + wait, "start", sid=sid, attempt=n + 1)

    def _release(self, t: float, st: dict[str, Any]) -> None:
        sid = st["sid"]
        del self.prompt_chars[sid]
        reason = None if st["outcome"] == "ok" else "not_retryable: synthetic"
        self.out.emit("released", t, span=sid, id=f"item-{sid}", outcome=st["outcome"],
                      reason=reason)
        self.free += 1
        self._admit(t)


def make_shard(args: tuple[Path, int, int]) -> tuple[float, list[tuple[float, int]]]:
    run_dir, shard, spans = args
    out = ShardWriter(run_dir / "events" / f"shard-{shard:02d}.jsonl", shard)
    out.emit("shard_start", T_START + 0.01, cap=CAP, pid=1, version="bench", host="bench")
    sim = ShardSim(shard, spans, out, seed=shard)
    end = sim.run() + 0.01
    out.emit("shard_end", end, received=spans)
    out.close(end)
    return end, sim.batches


def generate(run_dir: Path, spans: int, shards: int) -> None:
    """Write a whole synthetic run (events, coordinator log, manifest)."""
    (run_dir / "events").mkdir(parents=True)
    per = [spans // shards + (1 if i < spans % shards else 0) for i in range(shards)]
    with ProcessPoolExecutor(max_workers=min(shards, os.cpu_count() or 1)) as pool:
        done = list(pool.map(make_shard, [(run_dir, i, n) for i, n in enumerate(per)]))
    coord = ShardWriter(run_dir / "events" / "coordinator.jsonl", None)
    coord.emit("run_start", T_START, shards=shards, cap=CAP)
    batches = sorted((t, i, n) for i, (_, b) in enumerate(done) for t, n in b)
    for t, i, n in batches:
        coord.emit("batch", t - 1e-4, to=i, n=n)
    coord.emit("input_end", batches[-1][0], lines=spans, rejects=0)
    end = max(e for e, _ in done)
    for i in range(shards):
        coord.emit("shard_exit", end + 0.01, to=i, status="done")
    coord.emit("run_end", end + 0.02, status="succeeded")
    coord.close(end + 0.02)
    write_manifest(run_dir, shards)


def write_manifest(run_dir: Path, shards: int) -> None:
    files = []
    for path in sorted((run_dir / "events").iterdir()):
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                sha.update(chunk)
        files.append({"path": f"events/{path.name}", "sha256": sha.hexdigest(),
                      "bytes": path.stat().st_size})
    effective = {"concurrency": {"value": CAP, "source": "bench"},
                 "pricing.input_per_1m": {"value": 0.15, "source": "bench"},
                 "pricing.output_per_1m": {"value": 0.6, "source": "bench"}}
    manifest = {"schema": 1, "run_id": RUN_ID, "status": "succeeded", "shards": shards,
                "started_at": "bench", "ended_at": "bench", "effective": effective,
                "files": files}
    (run_dir / "manifest.json").write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2))


def timed(argv: list[str], workers: int | None) -> tuple[float, float, float, int]:
    """Run `python -m shardrun.cli_analysis ARGV`: wall seconds, CPU seconds of the whole
    process tree, peak tree RSS (MB) and the exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = dict(os.environ)
    if workers is not None:
        env["SHARDRUN_AGGREGATE_WORKERS"] = str(workers)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "shardrun.cli_analysis", *argv],
                            stdout=subprocess.DEVNULL, env=env)
    peak = 0
    me = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [me, *me.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.Error:
            pass
        time.sleep(0.05)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, peak / 1e6, proc.returncode


def breakdown(run_dir: Path, spans: int, shards: int) -> None:
    """Where the time goes: CPU per span of each stage, on one shard file, in this process."""
    import gc

    from shardrun.aggregate import ShardFold
    from shardrun.report._scan import scan_file

    path = run_dir / "events" / "shard-00.jsonl"
    per_file = spans / shards

    def noop(rec: Any, raw: bytes) -> None:
        return None

    class Every(dict[str, Any]):
        def get(self, key: Any, default: Any = None) -> Any:
            return noop

    def fold(**options: Any) -> None:
        f = ShardFold(**options)
        wanted = frozenset(f.handlers) | {"checkpoint"} if options else None
        scan_file(path, "x", f.handlers, wanted)
        f.finish()

    stages = (("read, hash, split, orjson.loads every line", lambda: scan_file(path, "x", Every())),
              ("report: the full fold", fold),
              ("verify/publish: sparse fold with line hashes",
               lambda: fold(minutes_only=True, keep_lines=True)))
    gc.disable()
    print("| stage (one shard file, one process, GC off) | CPU per span |")
    print("| --- | --- |")
    for name, stage in stages:
        best = min(_cpu(stage) for _ in range(2))
        print(f"| {name} | {best / per_file * 1e6:.1f} µs |")
    gc.enable()


def _cpu(stage: Any) -> float:
    start = time.process_time()
    stage()
    return time.process_time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--dir", type=Path, help="where to write the run (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic run")
    parser.add_argument("--workers", type=int, help="worker processes for the aggregator")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each stage on one shard file, in this process")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-aggregate-"))
    run_dir = base / RUN_ID
    started = time.perf_counter()
    generate(run_dir, args.spans, args.shards)
    size = sum(p.stat().st_size for p in (run_dir / "events").iterdir())
    print(f"generated {args.spans:,} spans over {args.shards} shards in "
          f"{time.perf_counter() - started:.1f} s: {size / 1e6:,.0f} MB of events")
    sample = run_dir / "samples" / "bench.json"
    rows = []
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for name, argv in (("report --json", ["report", str(run_dir), "--json"]),
                       ("publish --peak", ["publish", str(run_dir), "-o", str(sample)]),
                       ("verify", ["verify", str(sample)])):
        wall, cpu, rss, code = timed(argv, args.workers)
        rows.append(f"| {name} | {wall:.1f} s | {args.spans / wall:,.0f} | {cpu:.1f} s | "
                    f"{args.spans / cpu:,.0f} | {rss:,.0f} MB | {code} |")
    print("| command | wall | spans/s (wall) | CPU (all processes) | spans per CPU-second "
          "| peak RSS (tree) | exit |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    if args.breakdown:
        breakdown(run_dir, args.spans, args.shards)
    if not args.keep and args.dir is None:
        shutil.rmtree(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Client CPU per request: shardrun's `StreamingClient` against the floor's request function.

    .venv/bin/python scripts/bench_client.py                        # 4,000 requests x 3 repeats
    .venv/bin/python scripts/bench_client.py --requests 2000 --repeats 5
    .venv/bin/python scripts/bench_client.py --baseline /tmp/before # also a copy of the package
    .venv/bin/python scripts/bench_client.py --itl-ms 10            # tokens as they come

A script, not a test. It starts one `shardrun sim` process on a free loopback port (ttft 200 ms,
itl 0, 16-96 tokens per answer, all in one write: the throughput benchmark's settings; with
`--itl-ms` the tokens come apart, one write each, as a server streams them), then for each
repeat runs, one after the other in alternating order, one child process per client:

- `shardrun`: `StreamingClient.attempt` over `make_session(C)` (what one shard does per attempt,
  with no-op `on_conn_ready` / `on_first_token` callbacks, without the shard's event log);
- `floor`: `_one` from `scripts/floor_client.py` over a plain `TCPConnector(limit=C)` session,
  with no result file (the shardrun side writes nothing either);
- `baseline` (with `--baseline DIR`): the `shardrun` client imported from `DIR/shardrun`, for a
  before/after comparison in one run.

Each child runs on uvloop (as a shard does), sends `2 * C` warm-up requests to fill the pool,
then `--requests` more at concurrency C, and reports `time.process_time()` over those only, so
interpreter start-up, imports and connection set-up are excluded. The simulator's answer depends
only on its seed and the prompt, so every client must read the same number of tokens; the script
checks that. Printed: CPU microseconds per request per client (median over repeats) and the
ratio to the floor measured in the same repeat (median of the per-repeat ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from _bench_sim import stop_sim, wait_for_base_url

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
SIM_ARGS = ["--ttft-ms", "200", "--tokens", "uniform:16:96", "--seed", "1"]
MODEL = "sim-small"
MAX_TOKENS = 128


# -- child: one client, measured --------------------------------------------------------------


def _prompt(i: int) -> str:
    return f"Question {i}: say something about the number {i}."


async def _drive(one: Callable[[int], Awaitable[None]], first: int, n: int, cap: int) -> None:
    """Requests first..first+n-1 at concurrency `cap`, admitted as the floor does (semaphore)."""
    sem = asyncio.Semaphore(cap)
    tasks: set[asyncio.Task[None]] = set()
    done: list[asyncio.Task[None]] = []

    async def run_one(i: int) -> None:
        try:
            await one(i)
        finally:
            sem.release()

    for i in range(first, first + n):
        await sem.acquire()
        task = asyncio.create_task(run_one(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        done.append(task)
    if tasks:
        await asyncio.wait(tasks)
    for task in done:
        task.result()  # a request function that raised is a bug in this script: stop here


async def _child(kind: str, base_url: str, n: int, cap: int) -> dict[str, Any]:
    import aiohttp

    base = {"model": MODEL, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    # The keys `floor_client._one` updates, so both clients fill the same dict.
    stats: dict[str, Any] = {"ok": 0, "failed": 0, "completion_tokens": 0, "latency_sum": 0.0,
                             "first_start": float("inf"), "last_end": 0.0}  # fmt: skip
    one: Callable[[int], Awaitable[None]]
    if kind == "floor":
        spec = importlib.util.spec_from_file_location("floor_client", ROOT / "scripts" /
                                                      "floor_client.py")  # fmt: skip
        assert spec is not None and spec.loader is not None
        floor = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(floor)
        # What its main() sets before running, so `_one` counts client errors as failures.
        floor.__dict__["ClientError"] = aiohttp.ClientError
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cap, limit_per_host=cap),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        url = base_url.rstrip("/") + "/chat/completions"
        dummy = asyncio.Semaphore(1 << 30)  # `_one` releases a permit; ours is in `_drive`

        async def one(i: int) -> None:
            await floor._one(session, url, {"id": str(i), "prompt": _prompt(i)}, base, None,
                             stats, dummy)  # fmt: skip

    else:
        from shardrun.client import StreamingClient, Timeouts, make_session
        from shardrun.clock import Clock

        timeouts = Timeouts()
        session = make_session(cap, timeouts)
        client = StreamingClient(session, base_url, "chat", {"Authorization": "Bearer k"},
                                 timeouts, Clock())  # fmt: skip

        def on_conn(t: float, reused: bool) -> None:
            pass

        def on_first(t: float) -> None:
            pass

        async def one(i: int) -> None:
            body = dict(base)
            body["messages"] = [{"role": "user", "content": _prompt(i)}]
            out = await client.attempt(body, on_conn, on_first)
            if out.status == "ok":
                stats["ok"] += 1
                stats["completion_tokens"] += out.completion_tokens
            else:
                stats["failed"] += 1

    try:
        await _drive(one, 0, 2 * cap, cap)  # warm-up: fill the pool, not measured
        stats.update(ok=0, failed=0, completion_tokens=0, latency_sum=0.0)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await _drive(one, 2 * cap, n, cap)
        stats["cpu_s"] = time.process_time() - cpu0
        stats["wall_s"] = time.perf_counter() - wall0
        if kind != "floor":
            import shardrun

            stats["package"] = str(Path(shardrun.__file__).parent)
    finally:
        await session.close()
    return stats


def child_main(args: argparse.Namespace) -> int:
    coro = _child(args.child, args.base_url, args.requests, args.concurrency)
    try:
        import uvloop

        stats = uvloop.run(coro)
    except ImportError:
        stats = asyncio.run(coro)
    sys.stdout.write(orjson.dumps(stats).decode() + "\n")
    return 0


# -- parent: simulator, repeats, table ----------------------------------------------------------


class Sim:
    """`shardrun sim` on 127.0.0.1, port 0; stopped by its own PID."""

    def __init__(self, itl_ms: float) -> None:
        argv = [PY, "-m", "shardrun", "sim", "--host", "127.0.0.1", "--port", "0", *SIM_ARGS,
                "--itl-ms", repr(itl_ms), "--flush-ms", repr(min(itl_ms, 20.0)),
                "--exit-on-stdin-eof"]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, cwd=ROOT, env=env)  # fmt: skip
        try:
            self.base_url = wait_for_base_url(self.proc)
        except SystemExit:
            self.stop()
            raise

    def stop(self) -> None:
        stop_sim(self.proc)


def run_child(kind: str, pythonpath: Path, base_url: str,
              args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    argv = [PY, __file__, "--child", kind if kind == "floor" else "shardrun", "--base-url",
            base_url, "--requests", str(args.requests),
            "--concurrency", str(args.concurrency)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    # A hang guard, not a measurement: a request's longest time at cap C, plus generous slack.
    seconds = 0.2 + MAX_TOKENS * args.itl_ms / 1000
    limit = 60 + 4 * (args.requests + 2 * args.concurrency) * seconds / args.concurrency
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, timeout=limit)
    if done.returncode != 0:
        raise SystemExit(f"{kind} child failed ({done.returncode}):\n{done.stderr.decode()}")
    stats: dict[str, Any] = orjson.loads(done.stdout.splitlines()[-1])
    want = pythonpath / "shardrun"
    if kind != "floor" and Path(stats["package"]) != want:
        raise SystemExit(f"{kind} child imported {stats['package']}, not {want}")
    return stats


def parent_main(args: argparse.Namespace) -> int:
    clients: list[tuple[str, Path]] = [("shardrun", ROOT), ("floor", ROOT)]
    if args.baseline is not None:
        if not (args.baseline / "shardrun" / "client.py").is_file():
            raise SystemExit(f"--baseline {args.baseline}: no shardrun/client.py there")
        clients.insert(0, ("baseline", args.baseline))
    per: dict[str, list[dict[str, Any]]] = {kind: [] for kind, _ in clients}
    sim = Sim(args.itl_ms)
    try:
        print(f"simulator at {sim.base_url}; {args.requests} requests at concurrency "
              f"{args.concurrency}, {args.repeats} repeats, itl {args.itl_ms:g} ms",
              flush=True)  # fmt: skip
        for r in range(args.repeats):
            order = clients if r % 2 == 0 else clients[::-1]
            for kind, path in order:
                stats = run_child(kind, path, sim.base_url, args)
                per[kind].append(stats)
                print(f"  repeat {r + 1} {kind:8s} {1e6 * stats['cpu_s'] / args.requests:7.1f} "
                      f"µs/req  {args.requests / stats['wall_s']:6.1f} req/s  ok {stats['ok']:.0f}"
                      f"  failed {stats['failed']:.0f}  tokens {stats['completion_tokens']:.0f}",
                      flush=True)  # fmt: skip
    finally:
        sim.stop()
    tokens = {s["completion_tokens"] for runs in per.values() for s in runs}
    failed = sum(s["failed"] for runs in per.values() for s in runs)
    print()
    print("| client | CPU µs/req (median) | min-max | vs floor (median of per-repeat ratios) |")
    print("|---|---:|---:|---:|")
    floor = per["floor"]
    for kind, _ in clients:
        us = [1e6 * s["cpu_s"] / args.requests for s in per[kind]]
        ratios = [a["cpu_s"] / b["cpu_s"] for a, b in zip(per[kind], floor, strict=True)]
        print(f"| {kind} | {statistics.median(us):.1f} | {min(us):.1f}-{max(us):.1f} | "
              f"{statistics.median(ratios):.2f}× |")  # fmt: skip
    if len(tokens) != 1 or failed:
        print(f"\nWARNING: clients disagree (completion tokens {sorted(tokens)}, {failed:.0f} "
              "failed requests): the comparison is not like for like")  # fmt: skip
        return 1
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4000, help="measured requests per run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="a directory holding another shardrun/ package")
    p.add_argument("--itl-ms", type=float, default=0.0,
                   help="the simulator's time between tokens (0: an answer in one write)")
    p.add_argument("--child", choices=["shardrun", "floor"], help=argparse.SUPPRESS)
    p.add_argument("--base-url", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.requests < 1 or args.concurrency < 1 or args.repeats < 1:
        p.error("--requests, --concurrency and --repeats must be at least 1")
    if not 0 <= args.itl_ms <= 100:
        p.error("--itl-ms must be 0..100")
    if args.child:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    raise SystemExit(main())

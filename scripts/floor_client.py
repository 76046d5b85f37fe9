"""The floor: the least a Python client must do to stream N chat completions at concurrency C.

    python scripts/floor_client.py --base-url http://127.0.0.1:PORT/v1 --input in.jsonl \
        --concurrency 256 --out results.jsonl

One process, one uvloop event loop, one aiohttp session (a pool of C keep-alive connections),
one semaphore of C. Per response: one POST with the same body shardrun sends (model, params,
`stream`, `stream_options.include_usage`, one user message), every read split into SSE lines
with `bytes` methods, `orjson.loads` per `data:` line, content pieces joined. Per request it
writes ONE result line (id, output, finish_reason, usage, start/end time) to a buffered file,
so the floor pays for the persistence shardrun cannot skip; there is no event log, no time
buckets, no retries, no timeouts, no logging. Failures are only counted.

`scripts/bench_throughput.py` runs it as the reference point in the same run as shardrun, at
the same total concurrency (shards x cap here in one process). At the end it prints one JSON
line on stdout: counts, completion tokens, first start, last end and summed latency.

`--procs N` runs N such processes side by side, child i taking every N-th line from line i, each
with its own semaphore of `--concurrency` and result file `OUT.i`; the parent only waits and
adds up their lines. It is the floor of a *sharded* client: the same minimal work, paid for by
N processes and N event loops, which is what sharding costs on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Any

import orjson

# aiohttp.ClientError once a client process imports aiohttp (the --procs parent never does).
ClientError: type[Exception] = Exception


async def _one(
    session: Any, url: str, item: dict[str, Any], base: dict[str, Any],
    out: Any, stats: dict[str, float], sem: asyncio.Semaphore,
) -> None:  # fmt: skip
    body = dict(base)
    body["messages"] = [{"role": "user", "content": item["prompt"]}]
    t0 = time.time()
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    finish = None
    done = False
    try:
        async with session.post(url, data=orjson.dumps(body),
                                headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
            if resp.status == 200:
                rest = b""
                async for chunk in resp.content.iter_any():
                    lines = (rest + chunk).split(b"\n") if rest else chunk.split(b"\n")
                    rest = lines.pop()
                    for line in lines:
                        if not line.startswith(b"data: "):
                            continue
                        payload = line[6:]
                        if payload == b"[DONE]":
                            done = True
                            break
                        obj = orjson.loads(payload)
                        choices = obj.get("choices")
                        if choices:
                            first = choices[0]
                            piece = first.get("delta", {}).get("content")
                            if piece:
                                pieces.append(piece)
                            if first.get("finish_reason"):
                                finish = first["finish_reason"]
                        if obj.get("usage"):
                            usage = obj["usage"]
            else:
                await resp.read()
    except (ClientError, OSError, ValueError):
        done = False
    finally:
        sem.release()
    t1 = time.time()
    if not done:
        stats["failed"] += 1
        return
    tokens = usage.get("completion_tokens", len(pieces)) if usage else len(pieces)
    stats["ok"] += 1
    stats["completion_tokens"] += tokens
    stats["latency_sum"] += t1 - t0
    stats["first_start"] = min(stats["first_start"], t0)
    stats["last_end"] = max(stats["last_end"], t1)
    if out is not None:
        out.write(orjson.dumps({"id": item["id"], "output": "".join(pieces),
                                "finish_reason": finish, "usage": usage,
                                "started_at": t0, "released_at": t1}) + b"\n")  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, float]:
    import aiohttp

    url = args.base_url.rstrip("/") + "/chat/completions"
    base = {"model": args.model, "max_tokens": args.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    stats: dict[str, float] = {"ok": 0, "failed": 0, "completion_tokens": 0, "latency_sum": 0.0,
                               "first_start": float("inf"), "last_end": 0.0}  # fmt: skip
    sem = asyncio.Semaphore(args.concurrency)
    tasks: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=args.concurrency, limit_per_host=args.concurrency)
    out = open(args.out, "ab", buffering=1 << 16) if args.out else None  # noqa: SIM115
    try:
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as session:
            with open(args.input, "rb") as f:
                for i, raw in enumerate(f):
                    if i % args.parts != args.part:
                        continue
                    item = orjson.loads(raw)
                    await sem.acquire()
                    task = asyncio.create_task(_one(session, url, item, base, out, stats, sem))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks)
    finally:
        if out is not None:
            out.close()
    return stats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--input", type=Path, required=True, help="JSONL with id and prompt")
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--out", type=Path, help="result file (one line per request); omit for none")
    p.add_argument("--model", default="sim-small")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--procs", type=int, default=1, help="run N client processes side by side")
    p.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--parts", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.procs > 1:
        return _fan_out(args)
    global ClientError
    from aiohttp import ClientError

    try:
        import uvloop

        stats = uvloop.run(run(args))
    except ImportError:
        stats = asyncio.run(run(args))
    sys.stdout.write(orjson.dumps(stats).decode() + "\n")
    return 0 if stats["failed"] == 0 else 1


def _fan_out(args: argparse.Namespace) -> int:
    """Start `procs` children on disjoint parts of the input; sum their summary lines."""
    import subprocess

    n = args.procs
    children = []
    for i in range(n):
        argv = [
            sys.executable,
            __file__,
            "--base-url",
            args.base_url,
            "--input",
            str(args.input),
            "--concurrency",
            str(args.concurrency),
            "--model",
            args.model,
            "--max-tokens",
            str(args.max_tokens),
            "--part",
            str(i),
            "--parts",
            str(n),
        ]
        if args.out:
            argv += ["--out", f"{args.out}.{i}"]
        children.append(subprocess.Popen(argv, stdout=subprocess.PIPE))
    total: dict[str, float] = {"ok": 0, "failed": 0, "completion_tokens": 0, "latency_sum": 0.0,
                               "first_start": float("inf"), "last_end": 0.0}  # fmt: skip
    code = 0
    for child in children:
        out, _ = child.communicate()
        code = code or child.returncode
        lines = out.splitlines()
        part = orjson.loads(lines[-1]) if lines else {"failed": 1}
        for key in ("ok", "failed", "completion_tokens", "latency_sum"):
            total[key] += part.get(key, 0)
        total["first_start"] = min(total["first_start"], part.get("first_start", math.inf))
        total["last_end"] = max(total["last_end"], part.get("last_end", 0.0))
    sys.stdout.write(orjson.dumps(total).decode() + "\n")
    return code or (0 if total["failed"] == 0 else 1)


if __name__ == "__main__":
    raise SystemExit(main())

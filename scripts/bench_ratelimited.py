"""A server that enforces a rate limit: what a run gets done when it sends faster than allowed.

    .venv/bin/python scripts/bench_ratelimited.py                   # this tree
    .venv/bin/python scripts/bench_ratelimited.py --before 14fd7a8  # that revision too, in turn
    .venv/bin/python scripts/bench_ratelimited.py --items 600 --shards 2 --cap 16 --rpm 1500

Each case starts this tree's simulator as its own process (ttft 200 ms, 16-64 tokens) with an
enforced limit (`rpm_limit`, a token bucket of one second's worth) well under what the cap
would send, and runs `python -m shardrun` (default 4 shards x 32, 2,000 items, the default
retry policy, no `rate_limits` in the job) against it. The cases differ in what the server says
of its limit: OpenAI's x-ratelimit-* headers on every answer and Retry-After on a 429, a 429's
Retry-After only, or nothing at all. The table counts results and dead letters from the run's
files, the requests the simulator read and the 429s it answered (its /sim/stats), and the
throughput of results against the limit. A revision given with `--before` runs from a read-only
`git archive` snapshot against the same simulator.

Only loopback traffic; every run is bounded in time (`--timeout-s`, then it is killed and its
row says so); every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_storm as bs  # the snapshot and table helpers
import bench_throughput as bt  # the input helper

from shardrun.sim.config import SimConfig
from shardrun.sim.launcher import start_sim

MODES = ("openai", "retry_after", "none")
LABELS = {"openai": "x-ratelimit-* + Retry-After", "retry_after": "Retry-After only",
          "none": "no headers"}  # fmt: skip


def dead_kinds(run: Path) -> str:
    """The dead letters' reasons (before any ':'), most common first: '1,234 retry_budget...'."""
    kinds: collections.Counter[str] = collections.Counter()
    for path in run.glob("dead/*.jsonl"):
        for line in path.read_bytes().splitlines():
            kinds[str(orjson.loads(line).get("reason", "?")).split(":", 1)[0]] += 1
    return ", ".join(f"{n:,} {kind}" for kind, n in kinds.most_common(3)) or "-"


def run_case(src: Path, work: Path, args: argparse.Namespace, mode: str,
             name: str) -> list[object]:  # fmt: skip
    """One run against a fresh simulator whose answers say `mode` of the limit; its row."""
    sim = start_sim(SimConfig(ttft_ms=200, itl_ms=2, tokens="uniform:16:64",
                              rpm_limit=args.rpm, rpm_headers=mode))  # fmt: skip
    try:
        code, wall, stats = bs.run_job(src, work, sim, name, work / "input.jsonl", args.shards,
                                       args.cap, args.timeout_s)
    finally:
        sim.stop()
    run = work / "runs" / name
    ok = bs.lines("results/*.jsonl", run)
    per_s = ok / wall if wall > 0 and code is not None else 0.0
    return [LABELS[mode], ok, bs.lines("dead/*.jsonl", run), stats["requests_total"],
            stats["faults"]["rpm_limit"], round(wall, 1), round(per_s, 1),
            f"{per_s / (args.rpm / 60):.0%}", "timeout" if code is None else code, dead_kinds(run)]


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--before", metavar="REV", help="also run this git revision, in turn")
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--cap", type=int, default=32)
    # The cap sends about 4 x 32 / 0.28 s = 450 requests a second at ttft 200 ms and 40
    # tokens of 2 ms: 6,000 a minute is 100 a second, under a quarter of it.
    p.add_argument("--rpm", type=int, default=6000, help="the server's limit, requests/minute")
    p.add_argument("--modes", default=",".join(MODES), help="which cases, comma-separated")
    p.add_argument("--timeout-s", type=float, default=240.0, help="the longest one run may take")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes some of {', '.join(MODES)}")
    work = Path(tempfile.mkdtemp(prefix="shardrun-ratelimited-"))
    try:
        sides, srcs = bs.snapshots(work, args.before)
        bt.write_input(work / "input.jsonl", args.items)
        rows = []
        for mode in modes:
            for side, src in srcs.items():
                row = run_case(src, work, args, mode, f"r{len(rows)}")
                rows.append([row[0], side, *row[1:]])
                print(f"  {rows[-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"# {args.shards} x {args.cap}, {args.items:,} items, ttft 200 ms, 16-64 tokens, "
          f"rpm_limit {args.rpm:,} ({args.rpm / 60:g}/s, burst {-(-args.rpm // 60)}); "
          + "; ".join(f"{k}: {v}" for k, v in sides.items()))
    print("| server says | client | succeeded | dead letters | requests | 429s | wall s "
          "| results/s | of the limit | exit | dead letters' reasons |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    bs.print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

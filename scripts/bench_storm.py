"""Storms: what a run loses when the endpoint answers but fails every request for a while.

    .venv/bin/python scripts/bench_storm.py                      # this tree
    .venv/bin/python scripts/bench_storm.py --before ecaf15d     # that revision too, in turn

Each case starts this tree's simulator as its own process (ttft 200 ms, 16-64 tokens), which
answers every request with the storm's status for `--storm-s` seconds once `--storm-after-n`
requests have arrived, and runs `python -m shardrun` (4 shards x 128, 3,000 items, the default
retry policy) against it. The table counts results and dead letters from the run's files and
the requests the simulator answered in the storm (its /sim/stats). A revision given with
`--before` runs from a read-only `git archive` snapshot against the same simulator, so both
rows see the same storm.

Only loopback traffic; every run is bounded in time; every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_throughput as bt  # the snapshot and input helpers

from shardrun.sim.config import SimConfig
from shardrun.sim.launcher import SimProcess, start_sim

RUN_TIMEOUT_S = 600.0  # a hang guard for one run, not a measurement
ITEMS, SHARDS, CAP, AFTER_N = 3000, 4, 128, 800
CASES = ((503, 10.0, False), (500, 10.0, False), (503, 60.0, True))  # status, seconds, Retry-After


def storm_sim(status: int, seconds: float, retry_after: bool) -> SimProcess:
    """This tree's simulator with a storm, on a free loopback port."""
    return start_sim(SimConfig(ttft_ms=200, itl_ms=2, tokens="uniform:16:64",
                               storm_after_n=AFTER_N, storm_s=seconds, storm_status=status,
                               retry_after_503=retry_after, retry_after_s=2))


def lines(pattern: str, run: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in run.glob(pattern))


def run_case(src: Path, work: Path, case: tuple[int, float, bool], name: str) -> list[object]:
    status, seconds, retry_after = case
    sim = storm_sim(*case)
    try:
        job = work / f"job-{name}.yaml"
        job.write_text(f"endpoint: {{base_url: '{sim.base_url}', api: chat, model: m}}\n"
                       f"input: {{path: {work / 'input.jsonl'}}}\nparams: {{max_tokens: 64}}\n"
                       f"shards: {SHARDS}\nconcurrency: {CAP}\n")
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "shardrun", str(job), "--runs-dir",
                               str(work / "runs"), "--run-id", name, "--quiet"],
                              cwd=work, env={**bt.ENV, "PYTHONPATH": str(src)},
                              capture_output=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
        wall = time.monotonic() - started
        stats_url = sim.base_url.removesuffix("/v1") + "/sim/stats"
        with urllib.request.urlopen(stats_url, timeout=10) as resp:
            stats = orjson.loads(resp.read())
    finally:
        sim.stop()
    run = work / "runs" / name
    storm = f"{status} × {seconds:g} s" + (" (Retry-After 2 s)" if retry_after else "")
    return [storm, lines("results/*.jsonl", run), lines("dead/*.jsonl", run),
            stats["faults"]["storm"], stats["requests_total"], round(wall, 1), done.returncode]


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--before", metavar="REV", help="also run this git revision, in turn")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shardrun-storm-"))
    try:
        sides = {"this tree": bt.snapshot(work, None, "now")}
        srcs = {"this tree": work / "now"}
        if args.before:
            sides[args.before] = bt.snapshot(work, args.before, "before")
            srcs[args.before] = work / "before"
        bt.write_input(work / "input.jsonl", ITEMS)
        rows = []
        for i, case in enumerate(CASES):
            for side, src in srcs.items():
                row = run_case(src, work, case, f"c{i}-{len(rows)}")
                rows.append([row[0], side, *row[1:]])
                print(f"  {rows[-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"# {SHARDS} x {CAP}, {ITEMS:,} items, storm from request {AFTER_N + 1}; "
          + "; ".join(f"{k}: {v}" for k, v in sides.items()))
    print("| storm | client | succeeded | dead letters | requests in the storm | requests "
          "| wall s | exit |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Storms: what a run loses when the endpoint answers but fails every request for a while.

    .venv/bin/python scripts/bench_storm.py                      # this tree
    .venv/bin/python scripts/bench_storm.py --before ecaf15d     # that revision too, in turn
    .venv/bin/python scripts/bench_storm.py --flaky --before d93c978 --repeats 3
    .venv/bin/python scripts/bench_storm.py --gateway --before fb18c2f

Each case starts this tree's simulator as its own process (ttft 200 ms, 16-64 tokens), which
answers every request with the storm's status for `--storm-s` seconds once `--storm-after-n`
requests have arrived, and runs `python -m shardrun` (4 shards x 128, 3,000 items, the default
retry policy) against it. The table counts results and dead letters from the run's files and
the requests the simulator answered in the storm (its /sim/stats). A revision given with
`--before` runs from a read-only `git archive` snapshot against the same simulator, so both
rows see the same storm.

`--flaky` runs the other side of it: a server that fails most requests at random (80 % 503s,
80 % 500s, 50 % 503s) is no storm, and must not be held as one; and a real 3 s storm at the
same small shape (2 shards x 8, 200 items) must still be. "held retries" counts the event log's
retries held in a storm (cause `endpoint_failing`).

`--gateway` restarts a server behind tests/models_gateway.py, which answers GET of the model
list itself and resets every other request while nothing is behind it: 200 items at 1 x 8
(ttft 100 ms, the default retry policy), the server killed once 16 results are in and started
again on its port 8, 20 or 40 s later. The table counts results and dead letters, and the
wall time of the whole run.

Only loopback traffic; every run is bounded in time; every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_throughput as bt  # the snapshot and input helpers

from shardrun.sim.config import SimConfig
from shardrun.sim.launcher import SimProcess, start_sim

RUN_TIMEOUT_S = 600.0  # a hang guard for one run, not a measurement
AFTER_N = 800


@dataclass(frozen=True)
class Case:
    label: str
    sim: dict[str, object]  # SimConfig settings on top of ttft 200 ms, 16-64 tokens
    items: int = 3000
    shards: int = 4
    cap: int = 128


def _storm(status: int, seconds: float, retry_after: bool, after_n: int = AFTER_N,
           items: int = 3000, shards: int = 4, cap: int = 128) -> Case:
    label = f"{status} × {seconds:g} s" + (" (Retry-After 2 s)" if retry_after else "")
    return Case(label, {"storm_after_n": after_n, "storm_s": seconds, "storm_status": status,
                        "retry_after_503": retry_after, "retry_after_s": 2},
                items, shards, cap)


STORMS = (_storm(503, 10.0, False), _storm(500, 10.0, False), _storm(503, 60.0, True))
FLAKY = (Case("503 at random, 80 %", {"fail_503": 0.8, "seed": 1}, 200, 2, 8),
         Case("500 at random, 80 %", {"fail_500": 0.8, "seed": 1}, 200, 2, 8),
         Case("503 at random, 50 %", {"fail_503": 0.5, "seed": 1}, 200, 2, 8),
         _storm(503, 3.0, False, after_n=100, items=600, shards=2, cap=8))


def storm_sim(case: Case) -> SimProcess:
    """This tree's simulator with the case's faults, on a free loopback port."""
    return start_sim(SimConfig(ttft_ms=200, itl_ms=2, tokens="uniform:16:64",
                               **case.sim))  # type: ignore[arg-type]


def lines(pattern: str, run: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in run.glob(pattern))


def held_retries(run: Path) -> int:
    """Retries the event log says a storm held."""
    return sum(line.count(b'"endpoint_failing"') > 0
               for p in run.glob("events/*.jsonl") for line in p.read_bytes().splitlines()
               if b'"retry"' in line)


def run_job(src: Path, work: Path, sim: SimProcess, name: str, input_path: Path, shards: int,
            cap: int, timeout_s: float = RUN_TIMEOUT_S,
            ) -> tuple[int | None, float, Any]:  # fmt: skip
    """Run `src`'s shardrun against `sim` (not stopped here): its exit status (None: killed
    at `timeout_s`; its shards follow their coordinator out), wall seconds and the simulator's
    /sim/stats after it."""
    job = work / f"job-{name}.yaml"
    job.write_text(f"endpoint: {{base_url: '{sim.base_url}', api: chat, model: m}}\n"
                   f"input: {{path: {input_path}}}\n"
                   f"params: {{max_tokens: 64}}\n"
                   f"shards: {shards}\nconcurrency: {cap}\n")
    started = time.monotonic()
    try:
        code: int | None = subprocess.run(
            [sys.executable, "-m", "shardrun", str(job), "--runs-dir", str(work / "runs"),
             "--run-id", name, "--quiet"], cwd=work, env={**bt.ENV, "PYTHONPATH": str(src)},
            capture_output=True, timeout=timeout_s).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        code = None
    wall = time.monotonic() - started
    stats_url = sim.base_url.removesuffix("/v1") + "/sim/stats"
    with urllib.request.urlopen(stats_url, timeout=10) as resp:
        return code, wall, orjson.loads(resp.read())


def run_case(src: Path, work: Path, case: Case, name: str) -> list[object]:
    sim = storm_sim(case)
    try:
        code, wall, stats = run_job(src, work, sim, name, work / f"input-{case.items}.jsonl",
                                    case.shards, case.cap)
    finally:
        sim.stop()
    run = work / "runs" / name
    failed = sum(stats["faults"].get(k, 0) for k in ("storm", "fail_500", "fail_503"))
    return [case.label, lines("results/*.jsonl", run), lines("dead/*.jsonl", run),
            failed, stats["requests_total"], held_retries(run), round(wall, 1), code]


def snapshots(work: Path, before: str | None) -> tuple[dict[str, str], dict[str, Path]]:
    """This tree's code, and `before`'s if given, copied under `work`: what each is (for the
    table's heading) and where, by side."""
    sides = {"this tree": bt.snapshot(work, None, "now")}
    srcs = {"this tree": work / "now"}
    if before:
        sides[before] = bt.snapshot(work, before, "before")
        srcs[before] = work / "before"
    return sides, srcs


def print_rows(rows: list[list[object]]) -> None:
    """The table's rows in Markdown, whole numbers with thousands separators."""
    for row in rows:
        print("| " + " | ".join(f"{v:,}" if isinstance(v, int) else str(v) for v in row) + " |")


GATEWAY_DOWN_S = (8.0, 20.0, 40.0)


def gateway_case(src: Path, work: Path, down_s: float, name: str) -> list[object]:
    """200 items at 1 x 8 through the model-list gateway, its server down `down_s` mid-run."""
    config = SimConfig(ttft_ms=100, itl_ms=2, tokens="uniform:16:64")
    port = _free_port()
    servers = [start_sim(config, port=port)]
    gateway = subprocess.Popen([sys.executable, str(bt.ROOT / "tests" / "models_gateway.py"),
                                str(port), "reset"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    run = work / "runs" / name
    try:
        assert gateway.stdout is not None
        front = int(gateway.stdout.readline().removeprefix("listening on "))
        job = work / f"job-{name}.yaml"
        job.write_text(f"endpoint: {{base_url: 'http://127.0.0.1:{front}/v1', api: chat, "
                       f"model: m}}\ninput: {{path: {work / 'input-200.jsonl'}}}\n"
                       "params: {max_tokens: 64}\nshards: 1\nconcurrency: 8\n")
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardrun", str(job), "--runs-dir", str(work / "runs"),
             "--run-id", name, "--quiet"], cwd=work, env={**bt.ENV, "PYTHONPATH": str(src)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            while lines("results/*.jsonl", run) < 16 and time.monotonic() - started < 60:
                time.sleep(0.05)
            os.kill(servers[-1].pid, signal.SIGKILL)
            time.sleep(down_s)
            servers.append(start_sim(config, port=port))
            code: int | None = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        wall = time.monotonic() - started
    finally:
        for server in servers:
            server.stop()
        assert gateway.stdin is not None
        gateway.stdin.close()
        gateway.wait(timeout=30)
    return [f"down {down_s:g} s", lines("results/*.jsonl", run), lines("dead/*.jsonl", run),
            round(wall, 1), code]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def gateway_main(work: Path, srcs: dict[str, Path], sides: dict[str, str]) -> None:
    bt.write_input(work / "input-200.jsonl", 200)
    rows = []
    for down_s in GATEWAY_DOWN_S:
        for side, src in srcs.items():
            row = gateway_case(src, work, down_s, f"g{len(rows)}")
            rows.append([row[0], side, *row[1:]])
            print(f"  {rows[-1]}", file=sys.stderr)
    print("# 200 items at 1 x 8 behind tests/models_gateway.py; "
          + "; ".join(f"{k}: {v}" for k, v in sides.items()))
    print("| server down | client | succeeded | dead letters | wall s | exit |")
    print("|---|---|---:|---:|---:|---:|")
    print_rows(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--before", metavar="REV", help="also run this git revision, in turn")
    p.add_argument("--flaky", action="store_true",
                   help="random failures (no storm) and a short storm, at 2 x 8")
    p.add_argument("--gateway", action="store_true",
                   help="a server restarted behind a gateway answering its model list")
    p.add_argument("--repeats", type=int, default=1, metavar="N", help="runs of each case")
    args = p.parse_args()
    cases = FLAKY if args.flaky else STORMS
    work = Path(tempfile.mkdtemp(prefix="shardrun-storm-"))
    try:
        sides, srcs = snapshots(work, args.before)
        if args.gateway:
            gateway_main(work, srcs, sides)
            return 0
        for n in {case.items for case in cases}:
            bt.write_input(work / f"input-{n}.jsonl", n)
        rows = []
        for i, case in enumerate(cases):
            for _ in range(args.repeats):
                for side, src in srcs.items():
                    row = run_case(src, work, case, f"c{i}-{len(rows)}")
                    rows.append([row[0], side, *row[1:]])
                    print(f"  {rows[-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("# " + "; ".join(f"{c.label}: {c.shards} x {c.cap}, {c.items:,} items" for c in cases)
          + "; " + "; ".join(f"{k}: {v}" for k, v in sides.items()))
    print("| faults | client | succeeded | dead letters | requests failed | requests "
          "| held retries | wall s | exit |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

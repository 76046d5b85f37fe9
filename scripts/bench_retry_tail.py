"""How long a `retry-failed` pass of a `--limit` trial's dead letters goes on after its last batch.

    .venv/bin/python scripts/bench_retry_tail.py                  # this tree, 300k lines
    .venv/bin/python scripts/bench_retry_tail.py --src before=DIR1 --src after=DIR2

One trial over an input of `--lines` JSON lines against the embedded `sim://` (fast settings,
`fail_500: 0.2`, one attempt, 2 shards of cap 32): `--limit` items, a fifth of them dead letters.
Then `retry-failed` of it `--repeats` times per tree, each on a fresh copy of the trial's run
directory, the trees alternating. Per pass, from its manifest and its coordinator's log:

- pass s: the pass's wall time (`summary.wall_s`, run_start to run_end);
- tail s: from the last batch handed out to `input_end`, the time the pass spent reading input
  with nothing left to hand out;
- lines read: the input lines the pass read (`input.lines_read`).

With several `--src` (a directory holding `shardrun/`), each process runs with
`PYTHONPATH=--src` and `PYTHONDONTWRITEBYTECODE=1`, so nothing is written into the trees. The
table shows the median and the range.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600.0  # a hang guard for one process, not a measurement
SIM = {"ttft_ms": 1, "itl_ms": 0, "tokens": 4, "seed": 1, "fail_500": 0.2}


def write_input(path: Path, lines: int) -> None:
    with open(path, "wb") as f:
        for i in range(lines):
            f.write(orjson.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}) + b"\n")


def shardrun(src: Path, work: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDRUN_")}
    env.update(PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, "-m", "shardrun", *args], cwd=work, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if done.returncode not in (0, 1):  # 1: some items failed, as they are made to
        raise SystemExit(f"shardrun {' '.join(args)} exited {done.returncode}: {done.stderr}")


def measure(run: Path) -> tuple[float, float, int]:
    """(pass s, tail s, lines read) of the run's newest pass, a retry pass."""
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    entry = manifest["resumes"][-1]
    log = [orjson.loads(line) for line in
           (run / "events" / "coordinator.r1.jsonl").read_bytes().splitlines()]
    last_batch = max(e["t"] for e in log if e["ev"] == "batch")
    input_end = next(e["t"] for e in log if e["ev"] == "input_end")
    # The input's end is logged inside the last hand-out, just before its batch: none is 0.
    tail = max(0.0, input_end - last_batch)
    return entry["summary"]["wall_s"], tail, entry["input"]["lines_read"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--lines", type=int, default=300_000)
    parser.add_argument("--limit", type=int, default=40_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    trees = dict(s.split("=", 1) for s in args.src) or {"this": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="bench-retry-tail-") as tmp:
        work = Path(tmp)
        write_input(work / "input.jsonl", args.lines)
        job = {"endpoint": {"base_url": "sim://", "api": "chat", "model": "m", "sim": SIM},
               "input": {"path": "input.jsonl"}, "params": {"max_tokens": 8},
               "shards": 2, "concurrency": 32, "retry": {"max_attempts": 1}}
        (work / "job.yaml").write_text(yaml.safe_dump(job))
        first = next(iter(trees.values()))
        shardrun(Path(first), work, "job.yaml", "--runs-dir", "runs", "--run-id", "trial",
                 "--limit", str(args.limit), "--quiet")
        trial = work / "runs" / "trial"
        got: dict[str, list[tuple[float, float, int]]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, src in trees.items():
                copy = work / "runs" / "copy"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(trial, copy)
                shardrun(Path(src), work, "retry-failed", str(copy), "--quiet")
                got[name].append(measure(copy))
    print(f"retry-failed of a --limit {args.limit:,} trial over {args.lines:,} lines, "
          f"{args.repeats} repeats each: median (min-max)")
    for name, rows in got.items():
        cells = []
        for i, (label, digits) in enumerate((("pass s", 2), ("tail s", 2), ("lines read", 0))):
            values = [row[i] for row in rows]
            cells.append(f"{label} {statistics.median(values):,.{digits}f} "
                         f"({min(values):,.{digits}f}-{max(values):,.{digits}f})")
        print(f"  {name:>8}: " + ", ".join(cells))


if __name__ == "__main__":
    main()

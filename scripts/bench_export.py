"""What `shardrun export` costs as runs grow: wall time, CPU and peak memory per size.

    .venv/bin/python scripts/bench_export.py                      # 100k and 1M items, 3 repeats
    .venv/bin/python scripts/bench_export.py --items 200000 --repeats 5

A script, not a test. For each size it builds a finished run's files in a temporary directory
without running anything: a JSON-lines input of N items, a job file naming it, and 8 shards'
result files shaped like real ones (about 3 % of the items as dead letters instead), each
shard's lines in a locally shuffled order as completion order is; the manifest records the job's
and input's SHA-256 as a run does. Then it runs `python -m shardrun export RUN -o FILE` as a
child process, in JSON lines, in CSV, and in both with `--with-input`, and reports wall
time, the child's user + sys CPU and its peak RSS (`wait4`), medians over the repeats. The
reference measured in the same run is `cat` of the run's results and dead letters into one file
(no order, no join): what the bare bytes cost to copy.

It sends nothing anywhere. Every loop is bounded by N.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from shardrun.manifest import file_digest

ROOT = Path(__file__).resolve().parent.parent
SHARDS = 8
DEAD_EVERY = 33  # one item in 33 ends as a dead letter
WORDS = ("fag", "dek", "gaf", "dob", "for", "bef", "dab", "fir", "fof", "bev", "boz", "baz")


def result_line(item_id: str, shard: int, rng: random.Random) -> bytes:
    """A result line with a real one's keys and sizes (an answer of 16-96 words)."""
    words = rng.randint(16, 96)
    output = " " + " ".join(rng.choice(WORDS) for _ in range(words))
    t = 1795605495.0 + rng.random() * 60
    return orjson.dumps({
        "id": item_id, "output": output, "finish_reason": "stop",
        "usage": {"prompt_tokens": rng.randint(10, 80), "completion_tokens": words,
                  "estimated": False},
        "attempts": 1, "shard": shard, "span": f"{shard}-{rng.randint(1, 10**6)}",
        "prompt_chars": rng.randint(40, 320), "queued_at": t, "first_token_at": t + 0.24,
        "last_token_at": t + 0.24, "released_at": t + 0.2401, "e2e": 0.2401, "ttft": 0.24,
        "buckets": {"t_queue": 0.0004, "t_retry": 0.0003, "t_conn": 0.035,
                    "t_first_token": 0.208, "t_stream": 0.0, "t_post": 0.0003},
    }, option=orjson.OPT_APPEND_NEWLINE)  # fmt: skip


def dead_line(item_id: str, shard: int) -> bytes:
    return orjson.dumps({
        "id": item_id, "reason": "max_attempts: HTTP 500: The server had an error (simulated).",
        "shard": shard, "span": f"{shard}-1",
        "attempts": [{"attempt": 1, "status": "http_5xx", "http": 500, "error": "HTTP 500",
                      "started_at": 1.0, "ended_at": 1.2, "wait": 0.0}],
    }, option=orjson.OPT_APPEND_NEWLINE)  # fmt: skip


def build_run(root: Path, items: int) -> Path:
    """A run directory as a finished run leaves it; returns its path."""
    rng = random.Random(items)
    input_path = root / "input.jsonl"
    with open(input_path, "wb") as f:
        for i in range(items):
            f.write(orjson.dumps({"id": f"it-{i:08d}", "prompt": f"Question {i}: say something."},
                                 option=orjson.OPT_APPEND_NEWLINE))  # fmt: skip
    job = root / "job.yaml"
    job.write_text("endpoint: {base_url: 'sim://', api: chat, model: m}\n"
                   "input: {path: input.jsonl}\nparams: {max_tokens: 128}\n")  # fmt: skip
    run = root / "runs" / "bench"
    for sub in ("results", "dead", "events"):
        (run / sub).mkdir(parents=True)
    outs = [open(run / "results" / f"shard-{s:02d}.jsonl", "wb") for s in range(SHARDS)]  # noqa: SIM115
    deads = [open(run / "dead" / f"shard-{s:02d}.jsonl", "wb") for s in range(SHARDS)]  # noqa: SIM115
    batch = 64 * SHARDS
    for start in range(0, items, batch):
        # Shards take batches of 64 in turn and finish them in about, not exactly, that order.
        order = list(range(start, min(items, start + batch)))
        rng.shuffle(order)
        for i in order:
            shard, item_id = (i // 64) % SHARDS, f"it-{i:08d}"
            if i % DEAD_EVERY == 0:
                deads[shard].write(dead_line(item_id, shard))
            else:
                outs[shard].write(result_line(item_id, shard, rng))
    for f in (*outs, *deads):
        f.close()
    manifest = {
        "run_id": "bench", "status": "succeeded", "resumes": [],
        "job": {"path": str(job), "sha256": file_digest(job)[0], "bytes": job.stat().st_size},
        "input": {"path": str(input_path), "lines_read": items,
                  "bytes_read": input_path.stat().st_size,
                  "sha256_of_bytes_read": file_digest(input_path)[0]},
    }  # fmt: skip
    (run / "manifest.json").write_bytes(orjson.dumps(manifest))
    return run


def measure(argv: list[str], stdout: int | None = None) -> tuple[float, float, float]:
    """(wall s, user+sys CPU s, peak RSS MB) of one child process."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=subprocess.DEVNULL, cwd=ROOT)  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", default="100000,1000000",
                        help="comma-separated run sizes (default 100000,1000000)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(n) for n in args.items.split(",")]
    rows = []
    for items in sizes:
        with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
            root = Path(tmp)
            run = build_run(root, items)
            run_bytes = sum(p.stat().st_size for p in run.rglob("*.jsonl"))
            cases = {
                "export → jsonl": [sys.executable, "-m", "shardrun", "export", str(run), "-o",
                                   str(root / "out.jsonl")],
                "export → csv": [sys.executable, "-m", "shardrun", "export", str(run), "-o",
                                 str(root / "out.csv")],
                "export --with-input → jsonl": [sys.executable, "-m", "shardrun", "export",
                                                str(run), "-o", str(root / "wide.jsonl"),
                                                "--with-input"],
                "export --with-input → csv": [sys.executable, "-m", "shardrun", "export",
                                              str(run), "-o", str(root / "wide.csv"),
                                              "--with-input"],
                "cat (reference)": ["sh", "-c", f"cat {run}/results/*.jsonl {run}/dead/*.jsonl "
                                                f"> {root / 'cat.jsonl'}"],
            }  # fmt: skip
            for name, argv in cases.items():
                runs = [measure(argv) for _ in range(args.repeats)]
                wall, cpu, rss = (statistics.median(r[i] for r in runs) for i in range(3))
                rows.append((items, name, wall, cpu, rss, run_bytes))
                print(f"  {items:>9,}  {name:<27} wall {wall:6.2f} s  cpu {cpu:6.2f} s  "
                      f"peak RSS {rss:6.1f} MB", file=sys.stderr, flush=True)  # fmt: skip
    print(f"\n{args.repeats} repeat(s), medians; {os.cpu_count()} cores\n")
    print("| items | run's result files MB | command | wall s | CPU s | µs per item | "
          "peak RSS MB |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for items, name, wall, cpu, rss, run_bytes in rows:
        print(f"| {items:,} | {run_bytes / 1e6:,.0f} | {name} | {wall:.2f} | {cpu:.2f} | "
              f"{cpu / items * 1e6:.1f} | {rss:.1f} |")


if __name__ == "__main__":
    main()

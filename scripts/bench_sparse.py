"""A sparse pass and the coordinator's event loop: how soon a SIGINT is heard, and the longest
the loop goes without a turn, while a pass reads past input lines that hold no item to hand out.

    .venv/bin/python scripts/bench_sparse.py                      # this tree, 1M lines, ~2 min
    .venv/bin/python scripts/bench_sparse.py --src before=DIR1 --src after=DIR2   # compare

Scenarios, each over an input of `--lines` JSON lines, against the embedded `sim://` with fast
settings, 2 shards of cap 4:

- retry: a `--limit 10` trial whose 10 items all fail (`fail_500: 1.0`, one attempt), then
  `retry-failed` of it: it runs those 10 and reads the rest of the input, every other line
  left out for --resume (each measurement on a fresh copy of the trial's run directory);
- rejects: a fresh run where one line in 20,000 is an item and the others are not JSON
  (rejects, each written to rejects.jsonl).

Two measurements of each:

- heard: SIGINT sent once the coordinator has read `--at` (20%) of the input (its open file's
  offset, from psutil, polled every 2 ms), to its `stopping` line on stderr;
- stall: the pass run to its end, the longest the coordinator's event loop went without a
  turn: a sampler task sleeps 5 ms at a time and notes how late it wakes (added by `-c` code
  that wraps `Coordinator.run` and then calls `shardrun.cli.entry`).

With several `--src` (a directory holding `shardrun/`), each measurement's repeats alternate
between them. Each process runs with `PYTHONPATH=--src` and `PYTHONDONTWRITEBYTECODE=1`, so
nothing is written into the trees measured. The table shows the median and the range.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300.0  # a hang guard for one process, not a measurement
FAST_SIM = {"ttft_ms": 5, "itl_ms": 0.5, "tokens": "uniform:4:24", "seed": 3, "flush_ms": 5}

SAMPLED = """
import asyncio, sys
from shardrun import coordinator

run = coordinator.Coordinator.run


async def sampled(self):
    loop, worst = asyncio.get_running_loop(), [0.0]

    async def sample():
        while True:
            before = loop.time()
            await asyncio.sleep(0.005)
            worst[0] = max(worst[0], loop.time() - before - 0.005)

    task = asyncio.create_task(sample())
    try:
        return await run(self)
    finally:
        task.cancel()
        print(f"LOOP_STALL_S {worst[0]:.4f}", file=sys.stderr)


coordinator.Coordinator.run = sampled
sys.argv[0] = "shardrun"
from shardrun.cli import entry
entry()
"""


def _job(path: Path, **sim: object) -> None:
    path.write_text(yaml.safe_dump({
        "endpoint": {"base_url": "sim://", "api": "chat", "model": "m",
                     "sim": {**FAST_SIM, **sim}},
        "input": {"path": "input.jsonl"}, "params": {"max_tokens": 16},
        "retry": {"max_attempts": 1}, "shards": 2, "concurrency": 4}, sort_keys=False))


def _write_input(path: Path, lines: int, sparse: bool) -> None:
    with open(path, "wb") as f:
        for i in range(lines):
            if sparse and i % 20_000 != 7:
                f.write(b"{not json\n")
            else:
                f.write(orjson.dumps({"id": f"i{i}", "prompt": f"Question {i}: say something."})
                        + b"\n")


def _env(src: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    return {**env, "PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1"}


def _start(src: Path, cwd: Path, args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", SAMPLED, *args], cwd=cwd, env=_env(src),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)


def _read_position(proc: psutil.Process, path: Path) -> int:
    try:
        return max((f.position for f in proc.open_files() if Path(f.path) == path), default=0)
    except psutil.Error:
        return 0


def heard(src: Path, cwd: Path, args: list[str], at: float) -> float:
    """Seconds from a SIGINT sent once the pass has read `at` of its input to `stopping`."""
    path = (cwd / "input.jsonl").resolve()  # a link to the one input of its scenario
    size = path.stat().st_size
    proc = _start(src, cwd, args)
    said: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: said.extend(
        (time.monotonic(), line) for line in proc.stderr or ()), daemon=True)
    reader.start()
    try:
        watched = psutil.Process(proc.pid)
        deadline = time.monotonic() + TIMEOUT_S
        while _read_position(watched, path) < at * size:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the pass ended before reading {at:.0%}: {said[-3:]}")
            time.sleep(0.002)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(TIMEOUT_S)
        reader.join(TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return next(t for t, line in said if line.startswith("stopping")) - sent


def stall(src: Path, cwd: Path, args: list[str]) -> float:
    """The longest the coordinator's loop went without a turn over the whole pass."""
    proc = _start(src, cwd, args)
    _, err = proc.communicate(timeout=TIMEOUT_S)
    found = [line for line in err.splitlines() if line.startswith("LOOP_STALL_S ")]
    if not found:
        raise SystemExit(f"no loop figure (exit {proc.returncode}): {err[-500:]}")
    return float(found[-1].split()[1])


def _retry_setup(base: Path, lines: int, src: Path) -> Callable[[], tuple[Path, list[str]]]:
    """The `--limit 10` trial; each call gives a fresh copy of it to retry."""
    trial = base / "retry-trial"
    trial.mkdir()
    _write_input(trial / "input.jsonl", lines, sparse=False)
    _job(trial / "job.yaml", fail_500=1.0)
    done = subprocess.run([sys.executable, "-m", "shardrun", "job.yaml", "--runs-dir", "runs",
                           "--limit", "10", "--quiet"], cwd=trial, env=_env(src),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 1:
        raise SystemExit(f"the trial ended {done.returncode}: {done.stderr[-500:]}")
    copies = iter(range(1_000_000))

    def fresh() -> tuple[Path, list[str]]:
        cwd = base / f"retry-{next(copies)}"
        cwd.mkdir()
        (cwd / "input.jsonl").symlink_to(trial / "input.jsonl")
        shutil.copy(trial / "job.yaml", cwd / "job.yaml")
        shutil.copytree(trial / "runs", cwd / "runs", symlinks=True)
        (run,) = (cwd / "runs").iterdir()
        return cwd, ["retry-failed", str(run), "--quiet"]

    return fresh


def _rejects_setup(base: Path, lines: int) -> Callable[[], tuple[Path, list[str]]]:
    source = base / "rejects-input.jsonl"
    _write_input(source, lines, sparse=True)
    copies = iter(range(1_000_000))

    def fresh() -> tuple[Path, list[str]]:
        cwd = base / f"rejects-{next(copies)}"
        cwd.mkdir()
        (cwd / "input.jsonl").symlink_to(source)
        _job(cwd / "job.yaml")
        return cwd, ["job.yaml", "--runs-dir", "runs", "--quiet"]

    return fresh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--src", action="append", default=[],
                        help="[NAME=]DIR holding shardrun/ (repeatable; default: this tree)")
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--at", type=float, default=0.2, help="share read before the SIGINT")
    opts = parser.parse_args()
    srcs = [(s.partition("=")[0], Path(s.partition("=")[2])) if "=" in s else (s, Path(s))
            for s in opts.src] or [("this tree", ROOT)]
    print(f"{opts.lines:,} input lines, {opts.repeats} repeats, SIGINT at {opts.at:.0%} read; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-sparse-") as tmp:
        base = Path(tmp)
        scenarios = {"retry": _retry_setup(base, opts.lines, srcs[0][1]),
                     "rejects": _rejects_setup(base, opts.lines)}
        print("| scenario | tree | SIGINT heard after (s) | longest loop stall (s) |")
        print("|---|---|---:|---:|")
        for name, fresh in scenarios.items():
            got: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n, _ in srcs}
            for _ in range(opts.repeats):
                for label, src in srcs:
                    got[label][0].append(heard(src, *fresh(), opts.at))
                    got[label][1].append(stall(src, *fresh()))
            for label, _ in srcs:
                cells = [f"{statistics.median(v):.3f} ({min(v):.3f}\u2013{max(v):.3f})"
                         for v in got[label]]
                print(f"| {name} | {label} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()

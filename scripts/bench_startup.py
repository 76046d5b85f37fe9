"""Start-up benchmark: what it costs to start shardrun's interpreters, and a whole tiny run.

    .venv/bin/python scripts/bench_startup.py                 # ~1 min: 5 repeats of each row
    .venv/bin/python scripts/bench_startup.py --src DIR       # another copy of shardrun/
    .venv/bin/python scripts/bench_startup.py --src before=DIR1 --src after=DIR2   # compare

Rows (docs/PERFORMANCE.md, "## Start-up", explains how to read the table):

- `python -c pass` and `python -c "import aiohttp"`: references, the interpreter alone and the
  one dependency every shard needs;
- shard imports: `python -c "import shardrun._shard_main"`, everything a shard imports before
  it reads its config message (the shard imports nothing else later);
- coordinator imports: every module the coordinator process had loaded at the end of a real
  run of the tiny job below (found once by a probe run), imported in a fresh interpreter; so a
  lazy import on the run path still counts, and a module only `validate` needs does not;
- `shardrun --help`;
- tiny run: `python -m shardrun run JOB --shards 8 --quiet` on `--items` items against the
  embedded `sim://` simulator with fast settings. CPU is the whole process tree's user+sys
  (`os.wait4` on the root: the coordinator, every shard and the simulator, which is the
  coordinator's child); "shards up" is the last shard's `shard_start` minus the coordinator's
  `run_start`, from the run's own event logs, and "client CPU" the run's own `client_cpu_s`
  (coordinator, launcher and shards: the tree without the simulator).

Every row runs once unmeasured (warm page cache), then `--repeats` times; the table shows the
median (and the range). With several `--src`, each row's repeats alternate between them (in
turn-about order), so a slow spell of a shared machine falls on all of them alike. CPU is
user+sys from `os.wait4`, wall is `time.perf_counter` around the process. Each process runs
in a scratch directory with `PYTHONPATH=--src`, so the code measured is `--src`'s `shardrun/`,
not an installed one. The environment is otherwise inherited; the header prints
`PYTHONDONTWRITEBYTECODE`, which decides whether shardrun's own modules are compiled from
source in every process (see PERFORMANCE.md).
Every process is waited for; a row that fails stops the script.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TIMEOUT_S = 120.0  # a hang guard for one process, not a measurement
FAST_SIM = {"ttft_ms": 5, "itl_ms": 0.5, "tokens": "uniform:4:24", "seed": 3, "flush_ms": 5}

# Runs the CLI in-process and then lists every loaded module, so the coordinator's real imports
# (lazy ones included) can be replayed in a fresh interpreter.
PROBE = """
import sys, orjson
from shardrun.cli import main
code = main(sys.argv[2:])
with open(sys.argv[1], "wb") as f:
    f.write(orjson.dumps(sorted(sys.modules)))
raise SystemExit(code)
"""
REPLAY = """
import importlib, sys, orjson
for name in orjson.loads(open(sys.argv[1], "rb").read()):
    try:
        importlib.import_module(name)
    except Exception:
        pass
"""


@dataclass
class Sample:
    cpu_s: float
    wall_s: float
    shards_up_s: float | None = None
    client_cpu_s: float | None = None  # the run's own figure: coordinator, launcher, shards


def measure(argv: Sequence[str], env: dict[str, str], cwd: Path) -> Sample:
    """Run one process to the end; CPU of its whole tree from wait4, wall from the clock."""
    start = time.perf_counter()
    proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    deadline = start + TIMEOUT_S
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            raise SystemExit(f"timed out: {' '.join(argv)}")
        time.sleep(0.002)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}\n{err[-2000:]}")
    return Sample(usage.ru_utime + usage.ru_stime, wall)


def write_job(work: Path, items: int, shards: int) -> Path:
    with open(work / "input.jsonl", "wb") as f:
        for i in range(items):
            f.write(orjson.dumps({"id": f"item-{i:05d}", "prompt": f"Question {i}: hello."}))
            f.write(b"\n")
    job = {
        "endpoint": {"base_url": "sim://", "api": "chat", "model": "sim-bench", "sim": FAST_SIM},
        "input": {"path": "input.jsonl"},
        "params": {"max_tokens": 32},
        "shards": shards,
        "concurrency": 8,
    }
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_figures(run_dir: Path) -> tuple[float, float]:
    """Seconds from the coordinator's run_start to the last shard's shard_start, and the
    client CPU the run reports on `run_end` (everything but the simulator)."""
    coord_log = [orjson.loads(line) for line in
                 (run_dir / "events" / "coordinator.jsonl").read_bytes().splitlines() if line]
    starts = []
    for log in sorted((run_dir / "events").glob("shard-*.jsonl")):
        first = orjson.loads(log.read_bytes().split(b"\n", 1)[0])
        starts.append(float(first["t"]))
    (end,) = [e for e in coord_log if e["ev"] == "run_end"]
    return max(starts) - float(coord_log[0]["t"]), float(end["client_cpu_s"])


@dataclass
class Target:
    """One copy of shardrun to measure, with its own scratch directory and job."""

    label: str
    src: Path
    env: dict[str, str]
    work: Path
    runs: Path
    run_args: list[str]
    listing: Path
    modules: dict[str, int] = field(default_factory=dict)
    samples: dict[str, list[Sample]] = field(default_factory=dict)

    def last_run(self) -> tuple[float, float]:
        latest = max(self.runs.iterdir(), key=lambda p: p.stat().st_mtime)
        return run_figures(latest)


def prepare(label: str, src: Path, scratch: Path, items: int, shards: int) -> Target:
    if not (src / "shardrun" / "__init__.py").is_file():
        raise SystemExit(f"{src} holds no shardrun/ package")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    env["PYTHONPATH"] = str(src)
    work = scratch / label
    work.mkdir()
    job = write_job(work, items, shards)
    runs = work / "runs"
    run_args = ["run", str(job), "--shards", str(shards), "--quiet", "--runs-dir", str(runs)]
    target = Target(label, src, env, work, runs, run_args, work / "coordinator-modules.json")
    measure([PY, "-c", PROBE, str(target.listing), *run_args], env, work)
    target.modules[COORD] = len(orjson.loads(target.listing.read_bytes()))
    for name, code in ((SHARD, "import shardrun._shard_main"), (AIOHTTP, "import aiohttp"),
                       (BARE, "pass")):
        out = subprocess.run([PY, "-c", f"{code}; import sys; print(len(sys.modules))"],
                             cwd=work, env=env, capture_output=True, text=True, check=True,
                             timeout=TIMEOUT_S)
        target.modules[name] = int(out.stdout)
    return target


BARE, AIOHTTP = "`python -c pass`", "`python -c 'import aiohttp'`"
SHARD, COORD, HELP = "shard imports", "coordinator imports (run)", "`shardrun --help`"


def plan(t: Target, tiny: str,
         ) -> list[tuple[str, list[str], Callable[[], tuple[float, float]] | None]]:
    return [
        (BARE, [PY, "-c", "pass"], None),
        (AIOHTTP, [PY, "-c", "import aiohttp"], None),
        (SHARD, [PY, "-c", "import shardrun._shard_main"], None),
        (COORD, [PY, "-c", REPLAY, str(t.listing)], None),
        (HELP, [PY, "-m", "shardrun", "--help"], None),
        (tiny, [PY, "-m", "shardrun", *t.run_args], t.last_run),
    ]


def cell(values: list[float], digits: int = 3) -> str:
    if not values:
        return ""
    return (f"{statistics.median(values):.{digits}f} "
            f"({min(values):.{digits}f}-{max(values):.{digits}f})")


def parse_src(text: str) -> tuple[str, Path]:
    label, _, path = text.rpartition("=")
    resolved = Path(path).resolve()
    return label or resolved.name, resolved


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--src", action="append", type=parse_src, metavar="[LABEL=]DIR",
                    help="a directory holding a shardrun/ package (default: this tree); give "
                         "several to compare them, measured interleaved")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--items", type=int, default=50)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--json", type=Path, help="also write every sample here")
    args = ap.parse_args()
    sources: list[tuple[str, Path]] = args.src or [("this tree", ROOT)]
    tiny = f"tiny run: {args.items} items, {args.shards} shards, sim://"
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        targets = [prepare(f"{i}-{label}", src, Path(tmp), args.items, args.shards)
                   for i, (label, src) in enumerate(sources)]
        for row in range(len(plan(targets[0], tiny))):
            for t in targets:  # warm-up (page cache), not counted
                measure(plan(t, tiny)[row][1], t.env, t.work)
            for r in range(args.repeats):
                # Interleaved, in turn-about order, so slow spells of a shared machine fall on
                # every target alike.
                for t in targets if r % 2 == 0 else targets[::-1]:
                    name, argv, after = plan(t, tiny)[row]
                    sample = measure(argv, t.env, t.work)
                    if after is not None:
                        sample.shards_up_s, sample.client_cpu_s = after()
                    t.samples.setdefault(name, []).append(sample)
            print(f"  {plan(targets[0], tiny)[row][0]}: done", file=sys.stderr)

    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}, "
          f"median (min-max) of {args.repeats}; "
          + ", ".join(f"{t.label.split('-', 1)[1]} = {t.src}" for t in targets) + "\n")
    print("| measurement | code | CPU s | wall s | modules | shards up s | client CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in targets[0].samples:
        for t in targets:
            samples = t.samples[name]
            up = [s.shards_up_s for s in samples if s.shards_up_s is not None]
            client = [s.client_cpu_s for s in samples if s.client_cpu_s is not None]
            print(f"| {name} | {t.label.split('-', 1)[1]} | {cell([s.cpu_s for s in samples])} "
                  f"| {cell([s.wall_s for s in samples])} | {t.modules.get(name, '')} "
                  f"| {cell(up)} | {cell(client)} |")
    if args.json:
        args.json.write_bytes(orjson.dumps(
            {t.label: {name: [s.__dict__ for s in samples]
                       for name, samples in t.samples.items()} for t in targets},
            option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

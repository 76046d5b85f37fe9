"""Side by side: two copies of shardrun run at the same moment, each against its own simulator.

    .venv/bin/python scripts/bench_ab.py --a e9bc4e5               # e9bc4e5 against this tree
    .venv/bin/python scripts/bench_ab.py --a REV1 --b REV2 --repeats 8 --point 4x32
    .venv/bin/python scripts/bench_ab.py --a 43d457b --reasoning-tokens 256   # a thinking model
    .venv/bin/python scripts/bench_ab.py --a 43d457b --text prose --sim-from b  # escaped words
    .venv/bin/python scripts/bench_ab.py --a e23896b --obfuscation --sim-from b  # OpenAI's padding

Why: on a shared VM the machine's speed drifts by ±15 % between runs taken seconds apart, so
two copies measured in turn (`bench_throughput.py --compare`) cannot tell a 3 % change. Run at
once, both see the same machine at the same moment; the two simulators are swapped between
repeats so that neither copy keeps the same one. What is compared is each run's own
`client_cpu_s` (its `run_end` event: user + sys of coordinator, launcher and shards, the
simulator never in it), so the script needs no sampling of its own.

What it cannot do: compare shardrun with the floor client. Two clients of different process
counts load the machine differently, which is the bias docs/PERFORMANCE.md describes for the
÷ sim columns. Same code on both sides (`--a HEAD --b HEAD`) shows the method's own spread.

Only loopback traffic. Every run is bounded in time; every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_throughput as bt  # the snapshot, simulator and input helpers

RUN_TIMEOUT_S = 600.0  # a hang guard for one run, not a measurement


def run_pair(srcs: tuple[Path, Path], sims: tuple[bt.Sim, bt.Sim], input_path: Path,
             shards: int, cap: int, work: Path, tag: str,
             max_tokens: int = 128) -> tuple[dict[str, float], ...]:  # fmt: skip
    """Start both copies at once, each on its simulator; wait for both; return their figures."""
    procs = []
    for side, src, sim in zip("ab", srcs, sims, strict=True):
        job = work / f"job-{tag}-{side}.yaml"
        bt.write_job(job, sim.base_url, input_path, max_tokens)
        argv = [bt.PY, "-m", "shardrun", str(job), "--shards", str(shards), "--concurrency",
                str(cap), "--runs-dir", str(work / "runs"), "--run-id", f"{tag}-{side}",
                "--quiet"]
        # `python -m` puts its working directory first on sys.path: run each copy from its own.
        procs.append(subprocess.Popen(argv, cwd=src, env={**bt.ENV, "PYTHONPATH": str(src)},
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE))
    out = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for side, proc in zip("ab", procs, strict=True):
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            raise SystemExit(f"run {tag}-{side} did not end within {RUN_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            raise SystemExit(f"run {tag}-{side} exited with {proc.returncode}:\n"
                             f"{err.decode(errors='replace')[-1500:]}")
        out.append(_figures(work / "runs" / f"{tag}-{side}"))
    return tuple(out)


def _figures(run_dir: Path) -> dict[str, float]:
    events = [orjson.loads(line) for line in
              (run_dir / "events" / "coordinator.jsonl").read_bytes().splitlines() if line]
    start = next(e for e in events if e["ev"] == "run_start")
    end = next(e for e in events if e["ev"] == "run_end")
    if end.get("status") != "succeeded":
        raise SystemExit(f"{run_dir.name} ended {end.get('status')!r}")
    return {"cpu_s": float(end["client_cpu_s"]), "wall_s": float(end["t"]) - float(start["t"])}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--a", required=True, metavar="REV", help="the reference: a git revision")
    p.add_argument("--b", metavar="REV", help="a git revision (default: the working tree)")
    p.add_argument("--point", default="8x32", metavar="SxCAP")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--duration", type=float, default=10.0,
                   help="seconds each run lasts at the ceiling (sets the input size)")
    p.add_argument("--reasoning-tokens", type=int, default=0, metavar="N",
                   help="the simulators think N tokens before each answer (max_tokens grows "
                        "by N); the reference must have the simulator's --reasoning-tokens")
    p.add_argument("--text", choices=("words", "prose"), default="words",
                   help="the simulators' words: plain, or prose whose every fourth word JSON "
                        "escapes (a line break, quotes); needs a simulator with --text")
    p.add_argument("--obfuscation", action="store_true",
                   help="the simulators pad every chunk as OpenAI does; needs a simulator with "
                        "--obfuscation")  # fmt: skip
    p.add_argument("--sim-from", choices=("a", "b"), default="a",
                   help="the copy the simulators run from (default a, the reference; b when "
                        "the reference's simulator lacks a flag asked for)")
    args = p.parse_args()
    (shards, cap), = bt.parse_points(args.point)
    if not 1 <= args.repeats <= 30 or not 0 < args.duration <= 120:
        p.error("--repeats must be 1..30 and --duration 0..120")
    if not 0 <= args.reasoning_tokens <= 4096:
        p.error("--reasoning-tokens must be 0..4096")
    sim_args = argparse.Namespace(ttft_ms=200.0, itl_ms=0.0, tokens="uniform:16:96",
                                  flush_ms=20.0, reasoning_tokens=args.reasoning_tokens,
                                  text=args.text, obfuscation=args.obfuscation)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="shardrun-ab-"))
    sims: list[bt.Sim] = []
    try:
        what = {side: bt.snapshot(work, rev, side) for side, rev in (("a", args.a),
                                                                     ("b", args.b))}
        srcs = (work / "a", work / "b")
        bt.SRC = srcs["ab".index(args.sim_from)]  # the simulators' copy
        bt.ENV["PYTHONPATH"] = str(bt.SRC)
        n = round(shards * cap / 0.2 * args.duration)
        input_path = work / "input.jsonl"
        bt.write_input(input_path, n)
        sims = [bt.Sim(sim_args, work) for _ in range(2)]
        print(f"# a: {what['a']}\n# b: {what['b']}\n# {shards} x {cap}, {n:,} items per run, "
              f"{args.repeats} repeats, both at once, simulators swapped every repeat",
              file=sys.stderr)
        rows = []
        for rep in range(args.repeats):
            pair = (sims[0], sims[1]) if rep % 2 == 0 else (sims[1], sims[0])
            a, b = run_pair(srcs, pair, input_path, shards, cap, work, f"r{rep}",
                            128 + args.reasoning_tokens)
            rows.append((a, b))
            print(f"  r{rep}: a {a['cpu_s']:.3f} CPU-s, b {b['cpu_s']:.3f} CPU-s, "
                  f"b/a {b['cpu_s'] / a['cpu_s']:.3f}", file=sys.stderr)
    finally:
        for sim in sims:
            sim.stop()
        shutil.rmtree(work, ignore_errors=True)
    ratios = [b["cpu_s"] / a["cpu_s"] for a, b in rows]
    thinking = (f", {args.reasoning_tokens} reasoning tokens per answer"
                if args.reasoning_tokens else "") + (", prose" if args.text == "prose" else "") \
        + (", OpenAI's padding on every chunk" if args.obfuscation else "")
    print(f"\na: {what['a']}\nb: {what['b']}\n{shards} × {cap}, {n:,} items per run{thinking}, "
          f"{args.repeats} repeats side by side\n")
    print("| repeat | a client CPU s | b client CPU s | b / a | a wall s | b wall s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rep, ((a, b), ratio) in enumerate(zip(rows, ratios, strict=True)):
        print(f"| {rep} | {a['cpu_s']:.3f} | {b['cpu_s']:.3f} | {ratio:.3f} "
              f"| {a['wall_s']:.1f} | {b['wall_s']:.1f} |")
    print(f"\nb / a: median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A server that enforces a rate limit: what a run gets done when it sends faster than allowed.

    .venv/bin/python scripts/bench_ratelimited.py                   # this tree
    .venv/bin/python scripts/bench_ratelimited.py --before 14fd7a8  # that revision too, in turn
    .venv/bin/python scripts/bench_ratelimited.py --items 600 --shards 2 --cap 16 --rpm 1500
    .venv/bin/python scripts/bench_ratelimited.py --tpm 1200000 --before 14fd7a8  # tokens
    .venv/bin/python scripts/bench_ratelimited.py --rpm 2400 --burst 2400 --items 4000  # a minute

Each case starts this tree's simulator as its own process (ttft 200 ms, 16-64 tokens) with an
enforced limit (`rpm_limit`, a token bucket of one second's worth, or of `--burst`: the limit
for a full minute's, as OpenAI's remaining counts say) well under what the cap would send, and
runs `python -m shardrun` (default 4 shards x 32, 2,000 items, the default
retry policy, no `rate_limits` in the job) against it. The cases differ in what the server says
of its limit: OpenAI's x-ratelimit-* headers on every answer and Retry-After on a 429, a 429's
Retry-After only, or nothing at all, or OpenAI's headers stating a quarter of the limit
enforced (`rpm_stated`, as a gateway's replicas each state their own). The table counts results
and dead letters from the run's files, the requests the simulator read and the 429s it answered
(its /sim/stats), the throughput of results against the limit, and the attempts the results took
(held retries included: how often the same items were refused), mean and most. A revision given
with `--before` runs from a read-only `git archive` snapshot against the same simulator.

With `--tpm N` the server enforces a token limit instead (`tpm_limit`, a bucket of one second's
worth, charged prompt + max_tokens per request, as OpenAI counts), and the input mixes small
prompts (10 tokens, 74 charged with max_tokens 64) with every tenth a big one (1,000 tokens,
1,064 charged): the case where a pace of requests lets the small ones take the tokens a big
one waits for. "of the limit" is then the tokens charged by the results a second against N/60.

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

MODES = ("openai", "retry_after", "none", "stated")
LABELS = {"openai": "x-ratelimit-* + Retry-After", "retry_after": "Retry-After only",
          "none": "no headers", "stated": "x-ratelimit-* stating 1/4"}  # fmt: skip
SMALL, BIG = "x" * 40, "x" * 4000  # 10 and 1,000 prompt tokens to the simulator (chars / 4)
CHARGE = {b"small": 10 + 64, b"big": 1000 + 64}  # with the job's max_tokens 64


def write_mixed_input(path: Path, n: int) -> None:
    """n prompts, every tenth a big one: ids say which (`small-7`, `big-10`)."""
    with open(path, "wb") as f:
        for i in range(n):
            kind = "big" if i % 10 == 0 else "small"
            f.write(orjson.dumps({"id": f"{kind}-{i}", "prompt": BIG if kind == "big"
                                  else SMALL}) + b"\n")  # fmt: skip


def tokens_done(run: Path) -> tuple[int, str]:
    """The tokens the simulator charged for the run's results (by their ids' kind), and the
    attempts the big prompts' results took, mean and most ('1.4 / 6')."""
    tokens, big = 0, []
    for path in run.glob("results/*.jsonl"):
        for line in path.read_bytes().splitlines():
            record = orjson.loads(line)
            kind = record["id"].split("-")[0].encode()
            tokens += CHARGE[kind]
            if kind == b"big":
                big.append(record["attempts"])
    return tokens, f"{sum(big) / len(big):.1f} / {max(big)}" if big else "-"


def attempts_taken(run: Path) -> str:
    """The attempts the run's results took, held retries included, mean and most ('1.10 / 5'):
    how often the same items were refused."""
    taken = [orjson.loads(line)["attempts"] for path in run.glob("results/*.jsonl")
             for line in path.read_bytes().splitlines()]
    return f"{sum(taken) / len(taken):.2f} / {max(taken)}" if taken else "-"


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
    limit = ({"tpm_limit": args.tpm, "tpm_burst": args.burst} if args.tpm else
             {"rpm_limit": args.rpm, "rpm_burst": args.burst})  # fmt: skip
    if mode == "stated":  # OpenAI's headers, stating a quarter of the limit enforced
        limit |= {"tpm_stated": args.tpm // 4} if args.tpm else {"rpm_stated": args.rpm // 4}
    sim = start_sim(SimConfig(ttft_ms=200, itl_ms=2, tokens="uniform:16:64",
                              rpm_headers="openai" if mode == "stated" else mode,
                              **limit))  # fmt: skip
    try:
        code, wall, stats = bs.run_job(src, work, sim, name, work / "input.jsonl", args.shards,
                                       args.cap, args.timeout_s)
    finally:
        sim.stop()
    run = work / "runs" / name
    ok = bs.lines("results/*.jsonl", run)
    per_s = ok / wall if wall > 0 and code is not None else 0.0
    share, big = per_s / (args.rpm / 60), [attempts_taken(run)]
    if args.tpm:
        tokens, attempts = tokens_done(run)
        share, big = (tokens / wall / (args.tpm / 60) if per_s else 0.0), [attempts]
    refused = stats["faults"]["tpm_limit" if args.tpm else "rpm_limit"]
    return [LABELS[mode], ok, bs.lines("dead/*.jsonl", run), stats["requests_total"],
            refused, round(wall, 1), round(per_s, 1), f"{share:.0%}",
            "timeout" if code is None else code, dead_kinds(run), *big]


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--before", metavar="REV", help="also run this git revision, in turn")
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--cap", type=int, default=32)
    # The cap sends about 4 x 32 / 0.28 s = 450 requests a second at ttft 200 ms and 40
    # tokens of 2 ms: 6,000 a minute is 100 a second, under a quarter of it.
    p.add_argument("--rpm", type=int, default=6000, help="the server's limit, requests/minute")
    p.add_argument("--tpm", type=int, default=0,
                   help="a token limit instead, tokens/minute, and an input of mixed sizes")
    p.add_argument("--burst", type=int, default=0,
                   help="the bucket, requests (tokens); 0: one second's worth; the limit: a "
                        "full minute's, as OpenAI's remaining counts it")
    p.add_argument("--modes", default=",".join(MODES), help="which cases, comma-separated")
    p.add_argument("--timeout-s", type=float, default=240.0, help="the longest one run may take")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes some of {', '.join(MODES)}")
    work = Path(tempfile.mkdtemp(prefix="shardrun-ratelimited-"))
    try:
        sides, srcs = bs.snapshots(work, args.before)
        if args.tpm:
            write_mixed_input(work / "input.jsonl", args.items)
        else:
            bt.write_input(work / "input.jsonl", args.items)
        rows = []
        for mode in modes:
            for side, src in srcs.items():
                row = run_case(src, work, args, mode, f"r{len(rows)}")
                rows.append([row[0], side, *row[1:]])
                print(f"  {rows[-1]}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_min = args.tpm or args.rpm
    burst = f"burst {args.burst or -(-per_min // 60):,}"
    limit = (f"tpm_limit {args.tpm:,} ({args.tpm / 60:g}/s, {burst}), every tenth prompt big"
             if args.tpm else f"rpm_limit {args.rpm:,} ({args.rpm / 60:g}/s, {burst})")
    print(f"# {args.shards} x {args.cap}, {args.items:,} items, ttft 200 ms, 16-64 tokens, "
          f"{limit}; "
          + "; ".join(f"{k}: {v}" for k, v in sides.items()))
    big = " big prompts'" if args.tpm else ""
    print("| server says | client | succeeded | dead letters | requests | 429s | wall s | "
          f"results/s | of the limit | exit | dead letters' reasons |{big} attempts, mean / most |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    bs.print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

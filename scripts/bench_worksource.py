"""Coordinator memory per input item: what remembering every id costs as the input grows.

    .venv/bin/python scripts/bench_worksource.py                  # 1M and 3M items
    .venv/bin/python scripts/bench_worksource.py --items 500000,2000000

A script, not a test. For each size it writes a JSON-lines input of N items (ids like a real
job's, short prompts) to a temporary directory, then in a fresh child process streams it
through the coordinator's own `InputReader` and `WorkSource` in batches of 64, as shards would
pull it, and reports the child's peak RSS above its RSS after imports, per item, and the items
per second. A second child does the same but also holds a resume's "already done" set for every
id (`--resume` of a run that finished half of the input remembers N/2 digests). The reference
measured in the same run: the same digests in a plain Python `set`.

Loopback only in spirit: it sends nothing anywhere. Every loop is bounded by N.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(input_path: Path, items: int, mode: str) -> None:
    """Stream the input through WorkSource (or a plain set) and print one JSON line."""
    sys.path.insert(0, str(ROOT))
    from shardrun.digestset import DigestSet
    from shardrun.inputs import InputPlan, InputReader
    from shardrun.worksource import WorkSource, id_digest

    plan = InputPlan()  # jsonl, id_field "id", prompt_field "prompt"
    base = _rss_kb()
    started = time.perf_counter()
    taken = 0
    if mode == "python-set":
        seen: set[int] = set()
        for entry in InputReader(input_path, plan):
            seen.add(id_digest(entry["id"]))  # type: ignore[index]
            taken += 1
    else:
        done = DigestSet()
        if mode == "worksource+resume":  # a resume of a run that finished every other item
            done.update(id_digest(_item_id(i)) for i in range(0, items, 2))
        source = WorkSource(InputReader(input_path, plan), input_path.with_suffix(".rejects"),
                            done)  # fmt: skip
        while batch := source.take(64):
            taken += len(batch)
        taken += source.skipped
    elapsed = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"mode": mode, "items": taken, "bytes_per_item": (peak - base) * 1024 / taken,
                      "items_per_s": taken / elapsed}))  # fmt: skip


def _item_id(i: int) -> str:
    return f"item-{i:09d}"


def write_input(path: Path, n: int) -> None:
    with open(path, "wb") as out:
        for i in range(n):
            out.write(b'{"id":"%s","prompt":"summarise document %d"}\n' % (_item_id(i).encode(), i))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", default="1000000,3000000", help="comma list of input sizes")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(Path(args.child[0]), int(args.child[1]), args.child[2])
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.items.split(",")):
            path = Path(tmp) / f"in-{n}.jsonl"
            write_input(path, n)
            for mode in ("python-set", "worksource", "worksource+resume"):
                out = subprocess.run([sys.executable, __file__, "--child", str(path), str(n), mode],
                                     check=True, capture_output=True, text=True).stdout
                rows.append(json.loads(out))
                print(f"  {n:>10,} {mode:<18} {rows[-1]['bytes_per_item']:6.1f} B/item  "
                      f"{rows[-1]['items_per_s']:>10,.0f} items/s", file=sys.stderr)
    print("\n| items | what | peak RSS above start, bytes per item | items/s |")
    print("|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['items']:,} | {r['mode']} | {r['bytes_per_item']:.1f} "
              f"| {r['items_per_s']:,.0f} |")


if __name__ == "__main__":
    main()

"""What one stray quote in a big CSV input costs the process that reads it (the coordinator).

    .venv/bin/python scripts/bench_csv_quote.py                       # 1,000,000 rows
    .venv/bin/python scripts/bench_csv_quote.py --src before=DIR --src after=DIR --repeats 3

A script, not a test. It writes a CSV of N rows (id, a prompt of about 170 characters with no
quote character) and the same file with a `"` opening the second row's prompt, which no quote
ever closes: the csv module reads on across rows until its field limit. Each file is read
through shardrun's `InputReader` in a fresh child process, as the coordinator reads its input.
Per read: the child's peak RSS and its RSS after the whole file (both above its RSS after
imports), the longest time between two entries (what the coordinator's loop is held for at
once), the rows the reject took with it, and the wall time. The file without the stray quote is
the reference, measured in the same run. Each `--src` is a directory holding a `shardrun`
package (a checkout's root); the default is this checkout. Nothing is sent anywhere; every loop
is bounded by N.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def status_mb(field: str) -> float:
    """A field of /proc/self/status in MB: VmRSS now, VmHWM the peak."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def child(src: str, path: Path) -> None:
    """Read the file through InputReader; print one JSON line of what it cost."""
    sys.path.insert(0, src)
    from shardrun.inputs import InputPlan, InputReader

    base = status_mb("VmRSS")
    reader = InputReader(path, InputPlan(format="csv"))
    started = last = time.perf_counter()
    longest = 0.0
    items = rejected_lines = 0
    for entry in reader:
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
        if isinstance(entry, dict):
            items += 1
        else:
            rejected_lines += 1
    wall = time.perf_counter() - started
    reader.close()
    print(json.dumps({"peak_mb": status_mb("VmHWM") - base,
                      "end_mb": status_mb("VmRSS") - base,
                      "longest_s": longest, "items": items, "rejects": rejected_lines,
                      "wall_s": wall}))


def write_inputs(folder: Path, rows: int) -> dict[str, Path]:
    prompt = "Summarize the water cycle in two sentences and consider its history " * 2
    clean, stray = folder / "clean.csv", folder / "stray.csv"
    with open(clean, "w") as plain, open(stray, "w") as broken:
        for out in (plain, broken):
            out.write("id,prompt\n")
        for i in range(rows):
            line = f"r{i:08d},{prompt}{i}\n"
            plain.write(line)
            broken.write(f'r{i:08d},"{prompt}{i}\n' if i == 1 else line)
    return {"clean (reference)": clean, "stray quote": stray}


def add_tree_arguments(parser: argparse.ArgumentParser) -> None:
    """`--src NAME=DIR`, the trees to compare, and `--child SRC PATH`, one read in a child."""
    parser.add_argument("--src", action="append", default=[],
                        help="NAME=DIR: a directory holding a shardrun package (repeatable)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)


def trees(args: argparse.Namespace) -> dict[str, str]:
    """The trees `--src` names, by name; this checkout when it names none."""
    return dict(s.split("=", 1) for s in args.src) or {"this tree": str(ROOT)}


def interleaved(script: str, sources: dict[str, str], files: dict[str, Path],
                repeats: int) -> Iterator[tuple[str, str, str, Path, dict[str, Any]]]:
    """Every tree's child run on every file, `repeats` times: (tree, input, src, path, figures).

    The runs go round in turn, so that the machine's load falls on every tree and file alike.
    """
    for _ in range(repeats):
        for name, src in sources.items():
            for what, path in files.items():
                out = subprocess.run([sys.executable, script, "--child", src, str(path)],
                                     capture_output=True, text=True, check=True, timeout=600)
                yield name, what, src, path, json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    add_tree_arguments(parser)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    sources = trees(args)
    with tempfile.TemporaryDirectory(prefix="bench_csv_quote-") as folder:
        files = write_inputs(Path(folder), args.rows)
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        for name, what, _src, _path, figures in interleaved(__file__, sources, files,
                                                            args.repeats):
            runs.setdefault((name, what), []).append(figures)
    print(f"{args.rows:,} rows, median of {args.repeats}")
    print("| tree | input | peak RSS MB | RSS at end MB | longest between entries s "
          "| items | rejects | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (name, what), got in runs.items():
        med = {k: statistics.median(r[k] for r in got) for k in got[0]}
        print(f"| {name} | {what} | {med['peak_mb']:.0f} | {med['end_mb']:.0f} | "
              f"{med['longest_s']:.3f} | {med['items']:,.0f} | {med['rejects']:,.0f} | "
              f"{med['wall_s']:.2f} |")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)

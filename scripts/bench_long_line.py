"""What a JSON line longer than a block costs the processes that read it: the coordinator's
reader and `shardrun validate`.

    .venv/bin/python scripts/bench_long_line.py                       # files of 191 MiB
    .venv/bin/python scripts/bench_long_line.py --src before=DIR --src after=DIR --repeats 3

A script, not a test. It writes four JSON lines files of about the same size: short lines of
about 1 KiB (the reference, measured in the same run), one line of the whole size with no line
break (a dump that lost its line breaks: one reject), a line of 100 MiB between two short
ones (one reject), and lines of 2 MiB each (items, each longer than a block). Each file is
read through shardrun's `InputReader` in a fresh child process, as the coordinator reads its
input: the child's peak RSS above its RSS after imports, and the wall time. Then `python -m
shardrun validate JOB --quiet` on it, in a fresh process too: its peak RSS (`wait4`), imports
included. Each `--src` is a directory holding a `shardrun` package (a checkout's root); the
default is this checkout. Nothing is sent anywhere; every loop is bounded by the size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_csv_quote import add_tree_arguments, interleaved, status_mb, trees

MIB = 1 << 20


def child(src: str, path: Path) -> None:
    """Read the file through InputReader; print one JSON line of what it cost."""
    sys.path.insert(0, src)
    from shardrun.inputs import InputPlan, InputReader

    base = status_mb("VmRSS")
    started = time.perf_counter()
    reader = InputReader(path, InputPlan())
    items = sum(isinstance(entry, dict) for entry in reader)
    reader.close()
    print(json.dumps({"peak_mb": status_mb("VmHWM") - base, "items": items,
                      "lines": reader.lines_read, "sha": reader.sha.hexdigest(),
                      "wall_s": time.perf_counter() - started}))


def validate_peak_mb(src: str, job: Path) -> float:
    """`shardrun validate JOB` in a fresh process of the tree `src`: its peak RSS in MB."""
    env = {**os.environ, "PYTHONPATH": src}
    # In the job's directory: `-m` puts the working directory first on the path, and this
    # checkout's there would stand before `src`.
    proc = subprocess.Popen([sys.executable, "-m", "shardrun", "validate", str(job), "--quiet"],
                            cwd=job.parent, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss / 1024


def _prompt_line(number: int, length: int) -> bytes:
    start = b'{"id": "%d", "prompt": "' % number
    return start + b"w" * (length - len(start) - 3) + b'"}\n'


def write_inputs(folder: Path, size: int) -> dict[str, Path]:
    """The four inputs, each about `size` bytes, and a job file beside each."""
    files = {"short lines (reference)": folder / "short.jsonl",
             "one line, no break": folder / "one.jsonl",
             "a 100 MiB line among short": folder / "mid.jsonl",
             "lines of 2 MiB": folder / "long.jsonl"}  # fmt: skip
    with open(files["short lines (reference)"], "wb") as f:
        for number in range(size // 1024):
            f.write(_prompt_line(number, 1024))
    with open(files["one line, no break"], "wb") as f:
        f.write(b'{"id": "big", "prompt": "')
        for _ in range(size // MIB):
            f.write(b"x" * MIB)
    with open(files["a 100 MiB line among short"], "wb") as f:
        f.write(_prompt_line(0, 100) + b'{"id": "big", "prompt": "')
        for _ in range(100):
            f.write(b"x" * MIB)
        f.write(b'"}\n' + _prompt_line(2, 100))
    with open(files["lines of 2 MiB"], "wb") as f:
        for number in range(size // (2 * MIB)):
            f.write(_prompt_line(number, 2 * MIB))
    for path in files.values():
        path.with_suffix(".yaml").write_text(
            "endpoint:\n  base_url: sim://\n  model: sim-small\n"
            f"input:\n  path: {path.name}\n")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=191, help="each file's size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write the files (default: a temp)")
    add_tree_arguments(parser)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    sources = trees(args)
    with tempfile.TemporaryDirectory(prefix="bench_long_line-", dir=args.dir) as folder:
        files = write_inputs(Path(folder), args.mib * MIB)
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        shas: dict[str, set[tuple[int, int, str]]] = {}
        for name, what, src, path, figures in interleaved(__file__, sources, files,
                                                          args.repeats):
            shas.setdefault(what, set()).add((figures["items"], figures["lines"], figures["sha"]))
            figures["validate_mb"] = validate_peak_mb(src, path.with_suffix(".yaml"))
            runs.setdefault((name, what), []).append(figures)
    print(f"files of {args.mib} MiB, median of {args.repeats}")
    print("| tree | input | items | reader peak RSS MB | reader wall s | validate peak RSS MB |")
    print("|---|---|---:|---:|---:|---:|")
    for (name, what), got in runs.items():
        med = {k: statistics.median(r[k] for r in got) for k in ("peak_mb", "items", "wall_s",
                                                                  "validate_mb")}  # fmt: skip
        print(f"| {name} | {what} | {med['items']:,.0f} | {med['peak_mb']:.0f} | "
              f"{med['wall_s']:.2f} | {med['validate_mb']:.0f} |")
    # Every tree read every file alike: its items, lines and SHA-256.
    differ = [what for what, seen in shas.items() if len(seen) > 1]
    print("items, lines and SHA-256 the same in every tree" if not differ
          else f"items, lines or SHA-256 differ between trees: {', '.join(differ)}")


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)

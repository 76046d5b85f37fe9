"""What reading a stream's chunks costs, per payload, by the kind of text a model generates.

    .venv/bin/python scripts/bench_chunks.py                  # this tree alone
    .venv/bin/python scripts/bench_chunks.py --a 43d457b      # and a git revision beside it
    .venv/bin/python scripts/bench_chunks.py --a HEAD --per-read 50   # reads of 50 payloads

A script, not a test. It feeds synthetic streams, chunks shaped as vLLM and the simulator send
them, one payload per read (or `--per-read N`, as a server that sends many tokens per write
is read), to `ChunkReader.read` and reports nanoseconds per payload, the
median of the repeats. With `--a REV`, `shardrun/_chunks.py` of that revision is loaded from
git and measured in the same loop, alternating, so both see the machine at the same moments.

The streams: plain words, also with the `obfuscation` padding OpenAI adds to every chunk unless
`stream_options.include_obfuscation` is false; prose with line breaks and quotes (about a
quarter of the chunks hold a byte JSON escapes); JSON-mode output (about half of them); a
reasoning model's thinking followed by its answer; a function call whose arguments (the same
JSON) stream in pieces, in a stream of the usual length and in one of LONG_CALL pieces (some
100 KB of arguments). A payload that fits the stream's learned envelope is sliced, not parsed
(docs/ARCHITECTURE.md, "The envelope"), a padded one once its padding is read off; the rest
is parsed with orjson.

It sends nothing anywhere. Every loop is bounded by its counts.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
PAYLOADS = 400  # per stream
STREAMS = 100  # per timing
LONG_CALL = 40_000  # argument pieces of the long call

PLAIN = [" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", "."]
PROSE = [" It", " said", ' "', "hello", '"', ".", "\n", " The", " end", " came", ".", "\n\n",
         " Then", " we", " left", "."]  # fmt: skip
JSON_MODE = ['{"', "name", '":"', "Ann", " Lee", '","', "age", '":', "31", ',"', "tags", '":["',
             "a", '","', "b", '"]}', "\n"]  # fmt: skip


def chunk(delta: dict[str, Any], padding: str | None = None) -> bytes:
    """A chat chunk; `padding`: OpenAI's `obfuscation` field, which differs chunk by chunk."""
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
    return orjson.dumps(obj if padding is None else {**obj, "obfuscation": padding})


def padding(i: int) -> str:
    """The i-th chunk's obfuscation: 1 to 15 letters, as OpenAI pads a chunk to hide its size."""
    return "".join(chr(97 + (i * 7 + k * 3) % 26) for k in range(1 + (i * 5) % 15))


def streams() -> dict[str, list[bytes]]:
    def words(pool: list[str], key: str = "content", n: int = PAYLOADS) -> list[bytes]:
        return [chunk({key: pool[i % len(pool)]}) for i in range(n)]

    thinking = words(PLAIN, "reasoning_content", PAYLOADS * 3 // 4)
    start = chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "save", "arguments": ""}}]})
    pieces = [chunk({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
              for text in JSON_MODE]  # fmt: skip
    call = [start, *(pieces[i % len(pieces)] for i in range(PAYLOADS - 1))]
    long_call = [start, *(pieces[i % len(pieces)] for i in range(LONG_CALL))]
    return {
        "plain words": words(PLAIN),
        "plain words, OpenAI's obfuscation": [chunk({"content": PLAIN[i % len(PLAIN)]},
                                                    padding(i)) for i in range(PAYLOADS)],
        "prose, line breaks, quotes": words(PROSE),
        "JSON mode": words(JSON_MODE),
        "thinking, then answer": thinking + words(PLAIN, n=PAYLOADS - len(thinking)),
        "function call arguments": call,
        f"one call of {LONG_CALL:,} argument pieces": long_call,
    }


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def streams_per_timing(payloads: list[bytes]) -> int:
    """STREAMS for a stream of the usual length; fewer, as many payloads in all, for a longer."""
    return max(1, STREAMS * PAYLOADS // len(payloads))


def time_once(module: ModuleType, payloads: list[bytes], per_read: int = 1) -> float:
    """Seconds for `streams_per_timing` readers to read `payloads`, `per_read` per read."""
    reader_class = module.ChunkReader
    reads = [payloads[i : i + per_read] for i in range(0, len(payloads), per_read)]
    started = time.perf_counter()
    for _ in range(streams_per_timing(payloads)):
        reader, pieces = reader_class(True), list[str]()
        for read in reads:
            reader.read(read, pieces)
    return time.perf_counter() - started


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--a", metavar="REV", help="a git revision to measure beside this tree")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--per-read", type=int, default=1, metavar="N",
                   help="payloads per read (default 1)")
    args = p.parse_args()
    if not 1 <= args.repeats <= 100 or not 1 <= args.per_read <= 1000:
        p.error("--repeats must be 1..100 and --per-read 1..1000")
    modules = {"this tree": load(ROOT / "shardrun" / "_chunks.py", "chunks_b")}
    if args.a:
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.a}:shardrun/_chunks.py"],
                                check=True, capture_output=True).stdout  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "_chunks.py").write_bytes(source)
            modules = {args.a: load(Path(tmp) / "_chunks.py", "chunks_a"), **modules}
    names = list(modules)
    print(f"ns per payload, {args.per_read} per read, median of {args.repeats}; {PAYLOADS} "
          f"payloads per stream, {STREAMS} streams per timing (the long call: one)\n")
    print("| stream | " + " | ".join(names) + (" | ratio |" if len(names) == 2 else ""))
    print("|---|" + "---:|" * (len(names) + (len(names) == 2)))
    for label, payloads in streams().items():
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:  # alternating: both see the machine at the same moments
                times[name].append(time_once(modules[name], payloads, args.per_read))
        count = streams_per_timing(payloads) * len(payloads)
        ns = {name: statistics.median(t) / count * 1e9
              for name, t in times.items()}  # fmt: skip
        cells = " | ".join(f"{ns[name]:.0f}" for name in names)
        ratio = f" | {ns[names[1]] / ns[names[0]]:.2f}" if len(names) == 2 else ""
        print(f"| {label} | {cells}{ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write the example job's input: N prompts of varied length, deterministic for a seed.

    python scripts/make_example_input.py jobs/example.jsonl --count 10000
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import orjson

TOPICS = (
    "the water cycle", "TCP congestion control", "sourdough starters", "the French Revolution",
    "binary search trees", "photosynthesis", "the stock market", "volcanoes", "jazz harmony",
    "garbage collection", "plate tectonics", "the Roman road network", "vaccines", "rainbows",
    "compound interest", "bird migration", "the printing press", "black holes", "tea ceremonies",
    "error-correcting codes",
)
ASKS = (
    "Summarize {t} in two sentences.",
    "Explain {t} to a ten-year-old.",
    "Write a haiku about {t}.",
    "List three surprising facts about {t}.",
    "What are the common misconceptions about {t}? Answer briefly.",
)
FILLER = "Consider history, mechanisms, and practical consequences along the way. "


def make_record(i: int, rng: random.Random) -> dict[str, str]:
    prompt = rng.choice(ASKS).format(t=rng.choice(TOPICS))
    # A long tail of prompt lengths, so prompt-length buckets have something to show.
    prompt += " " + FILLER * min(int(rng.expovariate(0.5)), 40)
    return {"id": f"ex-{i:06d}", "prompt": prompt.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "wb") as f:
        for i in range(args.count):
            f.write(orjson.dumps(make_record(i, rng)) + b"\n")


if __name__ == "__main__":
    main()

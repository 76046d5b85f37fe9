"""Per-span latency distributions, segmented by prompt length.

Every successful span adds one value to each of `DIST_NAMES` in the segment of its prompt
length; run-wide distributions are the exact merge of the segments. Prompt length is the
server's `prompt_tokens` of the final attempt when reported, else `ceil(prompt_chars / 4)`.
Segments are powers of four of tokens: <64, 64-255, 256-1023, 1024-4095, 4096-16383, >=16384.
"""

from __future__ import annotations

from shardrun.aggregate._dist import Dist, merged

BUCKETS = ("t_queue", "t_retry", "t_conn", "t_first_token", "t_stream", "t_post")
DIST_NAMES = (*BUCKETS, "ttft", "ttft_request", "tpot", "e2e")
ALL_NAMES = (*DIST_NAMES, "itl")
SEGMENT_LABELS = ("<64", "64-255", "256-1023", "1024-4095", "4096-16383", ">=16384")
SEGMENT_EDGES = ((0, 64), (64, 256), (256, 1024), (1024, 4096), (4096, 16384), (16384, None))
CHARS_PER_TOKEN = 4


def segment_of(prompt_tokens: int | None, prompt_chars: int | None) -> int:
    """Index into `SEGMENT_LABELS` of a prompt's length."""
    n = prompt_tokens
    if n is None:
        n = -(-(prompt_chars or 0) // CHARS_PER_TOKEN)
    if n < 64:
        return 0
    return min(len(SEGMENT_LABELS) - 1, (n.bit_length() - 7) // 2 + 1)


# A span whose answer came at once has no first token of its own: `first` and `tpot` skip it.
FIRST = (DIST_NAMES.index("ttft"), DIST_NAMES.index("ttft_request"))
TPOT = DIST_NAMES.index("tpot")
PENDING = tuple(i for i in range(len(DIST_NAMES)) if i not in (*FIRST, TPOT))
FLUSH_AT = 4096


class Segment:
    """The distributions of one prompt-length segment (ITL as the events' bucket counts).

    The fold appends each span's values as one tuple (`pending`, in `PENDING` order; TTFT and
    ttft_request to `first`, TPOT to `tpot`), and they are bucketed a batch at a time (`flush`):
    far cheaper per span than ten separate `Dist.add` calls.
    """

    __slots__ = ("dists", "first", "itl", "pending", "spans", "tpot")

    def __init__(self) -> None:
        self.dists = [Dist() for _ in DIST_NAMES]
        self.itl: dict[str, int] = {}  # keys as in `itl_hist` events: converted only at the end
        self.spans = 0
        self.pending: list[tuple[float, ...]] = []
        self.first: list[tuple[float, float]] = []
        self.tpot: list[float] = []

    def flush(self) -> None:
        """Bucket the pending values."""
        for ids, rows in ((PENDING, self.pending), (FIRST, self.first)):
            if rows:
                for i, column in zip(ids, zip(*rows, strict=True), strict=True):
                    self.dists[i].add_many(list(column))
        self.pending, self.first = [], []
        if self.tpot:
            self.dists[TPOT].add_many(self.tpot)
            self.tpot = []

    def merge(self, other: Segment) -> None:
        self.flush()
        other.flush()
        for mine, theirs in zip(self.dists, other.dists, strict=True):
            mine.merge(theirs)
        for b, c in other.itl.items():
            self.itl[b] = self.itl.get(b, 0) + c
        self.spans += other.spans

    def named(self) -> dict[str, Dist]:
        """`{name: Dist}` for every name in `ALL_NAMES`."""
        self.flush()
        out = dict(zip(DIST_NAMES, self.dists, strict=True))
        out["itl"] = Dist.from_buckets({int(b): c for b, c in self.itl.items()})
        return out


def merge_segments(groups: list[dict[int, Segment]]) -> dict[int, Segment]:
    """Merge per-shard `{segment index: Segment}` maps into one."""
    out: dict[int, Segment] = {}
    for group in groups:
        for i, seg in group.items():
            out.setdefault(i, Segment()).merge(seg)
    return out


def overall(segments: dict[int, Segment]) -> dict[str, Dist]:
    """Run-wide distributions: the exact merge of every segment."""
    named = [seg.named() for seg in segments.values()]
    return {name: merged([n[name] for n in named]) for name in ALL_NAMES}

"""Mergeable log-bucket histogram of inter-token gaps (ITL). Pure, no I/O.

Why a histogram and not the raw gaps: a long response has thousands of gaps and a run has
millions of responses. Each attempt event carries its own sparse histogram (a few dozen buckets);
the aggregator merges them per shard, per segment or per run, and reads quantiles off the merge.
Merging is exact (counts add), so the order of merging never changes a result.

Buckets: gap `g` microseconds, `g >= 1`, lands in `floor(log2(g) * 8)`: eight buckets per octave,
each `2**(1/8)` (≈ 9.05 %) wide. A bucket is reported by its geometric midpoint, so for every gap
`x` in it `|mid - x| / x <= 2**(1/16) - 1` ≈ 4.43 % (`REL_ERROR`). Gaps under 1 µs (content
chunks that arrived in the same network read, or a negative gap from clock noise) share bucket
`SUB_US` = -1, reported as 0.0 s: there the bound is absolute, below 1 µs.

Quantiles use the nearest-rank definition (`nearest_rank`): the value of rank `ceil(q * n)` in
the sorted gaps. The histogram returns the midpoint of the bucket that holds that exact value, so
the relative error bound above holds for every quantile, not just on average.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

PER_OCTAVE = 8
SUB_US = -1
REL_ERROR = 2 ** (1 / (2 * PER_OCTAVE)) - 1  # ≈ 0.0443


def bucket_of(gap_s: float) -> int:
    """Bucket index of a gap in seconds; `SUB_US` for gaps below one microsecond."""
    us = gap_s * 1e6
    if us < 1.0:
        return SUB_US
    if not math.isfinite(us):
        raise ValueError(f"inter-token gap must be a finite number of seconds, got {gap_s!r}")
    return math.floor(math.log2(us) * PER_OCTAVE)


def bucket_bounds(b: int) -> tuple[float, float]:
    """The half-open range `[lo, hi)` of gaps (seconds) that fall into bucket `b`."""
    if b == SUB_US:
        return (0.0, 1e-6)
    _check_bucket(b)
    return (2 ** (b / PER_OCTAVE) * 1e-6, 2 ** ((b + 1) / PER_OCTAVE) * 1e-6)


def bucket_mid(b: int) -> float:
    """The value (seconds) that stands for bucket `b`: its geometric midpoint (0.0 for `SUB_US`)."""
    if b == SUB_US:
        return 0.0
    _check_bucket(b)
    return 2 ** ((b + 0.5) / PER_OCTAVE) * 1e-6


def nearest_rank(q: float, n: int) -> int:
    """1-based rank of quantile `q` among `n` sorted values: `ceil(q * n)`, at least 1.

    `q * n` is rounded to 9 decimals first so that float noise (0.95 * 100 = 95.00000000000001)
    does not push the rank up by one.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be between 0 and 1, got {q!r}")
    return min(n, max(1, math.ceil(round(q * n, 9))))


def _check_bucket(b: int) -> None:
    if b < SUB_US:
        raise ValueError(f"no ITL bucket {b}")


class ItlHistogram:
    """Sparse counts per bucket. `to_json()` / `from_json()` round-trip through JSON objects."""

    __slots__ = ("_counts", "_n")
    __hash__ = None  # type: ignore[assignment]  # mutable: equality by content, not hashable

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._n = 0

    @property
    def count(self) -> int:
        """Number of gaps recorded."""
        return self._n

    def add(self, gap_s: float, times: int = 1) -> None:
        """Record `times` gaps of `gap_s` seconds each. Cheap: one log2 and one dict update.

        Identical to `times` single adds. The client passes all the content chunks of one network
        read at once: they share the read's timestamp, so all but the first have gap 0.
        """
        if times < 1:
            if times == 0:
                return
            raise ValueError(f"cannot record {times} gaps")
        b = bucket_of(gap_s)
        counts = self._counts
        counts[b] = counts.get(b, 0) + times
        self._n += times

    def merge(self, other: ItlHistogram | Mapping[str, int]) -> None:
        """Add another histogram's counts, given as a histogram or as its `to_json()` form."""
        items = other._counts.items() if isinstance(other, ItlHistogram) else _parse(other)
        counts = self._counts
        for b, n in items:
            counts[b] = counts.get(b, 0) + n
            self._n += n

    def to_json(self) -> dict[str, int]:
        """Sparse `{bucket: count}` with string keys (JSON objects need them), sorted."""
        return {str(b): self._counts[b] for b in sorted(self._counts)}

    @classmethod
    def from_json(cls, data: Mapping[str, int]) -> ItlHistogram:
        """Rebuild a histogram from `to_json()` output; raises ValueError on malformed input."""
        hist = cls()
        hist.merge(data)
        return hist

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile in seconds, within `REL_ERROR` (or 1 µs below 1 µs) of exact.

        Raises ValueError when the histogram is empty: there is no gap to report.
        """
        if self._n == 0:
            raise ValueError("quantile of an empty ITL histogram")
        rank = nearest_rank(q, self._n)
        seen = 0
        for b in sorted(self._counts):
            seen += self._counts[b]
            if seen >= rank:
                return bucket_mid(b)
        raise AssertionError("unreachable: counts sum to n")  # pragma: no cover

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ItlHistogram):
            return NotImplemented
        return self._counts == other._counts

    def __repr__(self) -> str:
        return f"ItlHistogram({self.to_json()!r})"


def _parse(data: Mapping[str, int]) -> list[tuple[int, int]]:
    """Validate a `to_json()` mapping: integer bucket keys >= SUB_US, non-negative int counts."""
    out: list[tuple[int, int]] = []
    for key, n in data.items():
        try:
            b = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"ITL bucket key {key!r} is not an integer") from None
        if b < SUB_US or type(n) is not int or n < 0:
            raise ValueError(f"bad ITL bucket {key!r}: {n!r}")
        if n:
            out.append((b, n))
    return out

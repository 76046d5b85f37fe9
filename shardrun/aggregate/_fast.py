"""The C fold of one shard file (`_fastfold.c`), behind what `ShardFold` returns.

`_fastfold` is an optional compiled extension: built by `pip install` where a C compiler and
Python's headers are present, absent elsewhere. It reads lines as the pure-Python reader and
`ShardFold` do and computes the same `ShardSummary` (the reference is the Python fold; tests
hold the two equal on real and synthetic runs). It handles the log layout shardrun writes today
and raises `Fallback` on anything else (an unreadable line, a field of an unexpected type, the
older layout, `--html`'s step trace): the caller then folds the whole file in Python, so a
file is folded by one implementation, never a mix.

`SHARDRUN_FAST_FOLD=0` turns it off (to compare the two, or to rule it out).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from types import ModuleType
from typing import Any

from shardrun.aggregate._dist import Dist
from shardrun.aggregate._minutes import MinuteCell
from shardrun.aggregate._segments import Segment
from shardrun.aggregate._summary import ShardSummary, reason_key

FAST_VAR = "SHARDRUN_FAST_FOLD"  # listed in `_env.ANALYSIS_VARS`

_fastfold: ModuleType | None
try:
    _fastfold = importlib.import_module("shardrun.aggregate._fastfold")
except ImportError:  # not compiled here: the Python fold does the work
    _fastfold = None


class Fallback(Exception):
    """The file needs the Python fold (also raised for the C module's own `Fallback`)."""


def setting_problem() -> str | None:
    """What is wrong with `SHARDRUN_FAST_FOLD`, if anything: `0` turns the C fold off, `1`
    (or nothing) leaves it on; any other value would silently mean "on"."""
    raw = os.environ.get(FAST_VAR, "").strip()
    if raw in ("", "0", "1"):
        return None
    return (f"{FAST_VAR}={raw!r} is neither 0 (fold event files in Python) nor 1 (use the C "
            "fold where it is built)")


def available() -> bool:
    """The extension is built and not turned off by `SHARDRUN_FAST_FOLD=0`."""
    return _fastfold is not None and os.environ.get(FAST_VAR, "").strip() != "0"


class FastShardFold:
    """Feed complete lines with `body(chunk)`, then `finish()`: a `ShardSummary`."""

    def __init__(self, *, idle_until: float, cap: int, minutes_only: bool,
                 keep_lines: bool) -> None:
        if _fastfold is None:
            raise Fallback("the C fold is not built")
        self._fold = _fastfold.Fold(cap, idle_until, minutes_only, keep_lines,
                                    hashlib.sha256, reason_key)

    def body(self, chunk: bytes | memoryview) -> tuple[int, list[tuple[int, int, int]]]:
        """Fold every line of `chunk` (it ends with a newline); Fallback if one is not ours.

        Returns the number of lines and, for each line holding `"ev":"checkpoint"`, its index
        in the chunk and its start and end offsets (without the newline).
        """
        assert _fastfold is not None
        try:
            lines, marks = self._fold.body(chunk)
        except _fastfold.Fallback as exc:
            raise Fallback(str(exc)) from None
        return lines, marks

    @property
    def unknown_events(self) -> int:
        return int(self._fold.unknown_events)

    def finish(self) -> ShardSummary:
        raw: dict[str, Any] = self._fold.finish(None)
        s = ShardSummary()
        for name in ("shard", "pid", "host", "cap", "starts", "ended", "first_t", "last_t",
                     "queued", "ok", "refusals", "dead", "open_spans", "queue_depth", "in_flight",
                     "abandoned", "lost_at_restart", "other_outcomes", "ok_without_attempt",
                     "ok_incomplete", "attempts", "first_attempts", "by_status", "retries",
                     "retry_minutes", "dead_reasons", "wasted_tokens", "prompt_tokens",
                     "cached_tokens", "reasoning_tokens", "completion_tokens", "estimated_ok",
                     "estimated_tokens", "new_conns",
                     "reused_conns", "resent", "held_retries", "limited_spans", "learned_cuts",
                     "learned_rps", "learned_seeds", "learned_tps", "learned_seeded",
                     "rate_waits", "rate_wait_first_s", "rate_wait_retry_s", "backlog_s",
                     "gap_s", "busy_slot_s", "cap_slot_s", "sending_slot_s", "idle_s"):
            setattr(s, name, raw[name])
        s.minutes = {m: MinuteCell(*cell) for m, cell in sorted(raw["minutes"].items())}
        s.segments = {i: _segment(*entry) for i, entry in sorted(raw["segments"].items())}
        s.loop_lag = _dist(*raw["loop_lag"])
        return s


def _dist(counts: dict[int, int], n: int, total: float, lo: float, hi: float) -> Dist:
    d = Dist()
    d.counts, d.n, d.total, d.lo, d.hi = counts, n, total, lo, hi
    return d


def _segment(spans: int, dists: list[tuple[Any, ...]], itl: dict[str, int]) -> Segment:
    seg = Segment()
    seg.spans = spans
    seg.dists = [_dist(*d) for d in dists]
    seg.itl = itl
    return seg

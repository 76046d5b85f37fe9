"""Aggregate completion TPM: every UTC minute of the run, its per-shard split, and the peaks.

A minute is *full* when it lies wholly inside the run's window (first to last instant of the
run); the first and last minutes are usually partial and flagged. Minutes inside the window in
which nothing finished are listed with zero tokens. The peak is taken over full minutes only;
each shard's own peak is its best full minute.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from shardrun.aggregate._minutes import MinuteCell
from shardrun.aggregate._summary import ShardSummary

MAX_LISTED_MINUTES = 100_000  # a bogus timestamp must not make the report list a million zeros


def minute_label(m: int) -> str:
    """`YYYY-MM-DDTHH:MMZ` of minute `m` (= floor(epoch seconds / 60))."""
    return datetime.fromtimestamp(m * 60, UTC).strftime("%Y-%m-%dT%H:%MZ")


def parse_minute(text: str) -> int:
    """The minute index of `YYYY-MM-DDTHH:MMZ`; ValueError otherwise."""
    try:
        dt = datetime.strptime(text, "%Y-%m-%dT%H:%MZ").replace(tzinfo=UTC)
    except ValueError:
        raise ValueError(f"{text!r} is not a minute like 2026-01-31T14:05Z") from None
    return int(dt.timestamp()) // 60


def is_full(m: int, windows: list[tuple[float, float]]) -> bool:
    """Whether minute `m` lies wholly inside one of the run's windows."""
    return any(m * 60 >= start and (m + 1) * 60 <= end for start, end in windows)


def minute_keys(shards: list[ShardSummary], windows: list[tuple[float, float]]) -> list[int]:
    """Every minute with data, plus every minute of every window (bounded)."""
    keys = {m for s in shards for m in s.minutes}
    for start, end in windows:
        if math.isfinite(start) and math.isfinite(end):
            first, last = int(start // 60), int(end // 60)
            if 0 <= last - first <= MAX_LISTED_MINUTES:
                keys.update(range(first, last + 1))
    return sorted(keys)


def tpm_section(shards: list[ShardSummary], windows: list[tuple[float, float]],
                duration_s: float) -> dict[str, Any]:
    """The `tpm` part of the report document."""
    empty = MinuteCell(0, 0)
    rows: list[dict[str, Any]] = []
    for m in minute_keys(shards, windows):
        cells = [s.minutes.get(m, empty) for s in shards]
        rows.append({
            "minute": minute_label(m), "start": m * 60,
            "completion_tokens": sum(c.tokens for c in cells),
            "spans": sum(c.spans for c in cells),
            "estimated_completion_tokens": sum(c.estimated_tokens for c in cells),
            "partial": not is_full(m, windows),
            "per_shard": [c.tokens for c in cells],
        })  # fmt: skip
    total = sum(r["completion_tokens"] for r in rows)
    full = [r for r in rows if not r["partial"]]
    return {
        "shards": [s.name for s in shards],
        "minutes": rows,
        "total_completion_tokens": total,
        "estimated_completion_tokens": sum(r["estimated_completion_tokens"] for r in rows),
        "run_average_tpm": round(total / duration_s * 60, 1) if duration_s > 0 else None,
        "peak_full_minute": _peak(full, "completion_tokens"),
        "best_minute_any": _peak(rows, "completion_tokens"),
        "per_shard_peak": [_shard_peak(full, i, s) for i, s in enumerate(shards)],
    }


def _peak(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    if not rows:
        return None
    best = max(rows, key=lambda r: (r[key], -r["start"]))
    # Its own estimated tokens: a run's estimate may lie in other minutes than its peak.
    return {"minute": best["minute"], "completion_tokens": best[key], "spans": best["spans"],
            "estimated_completion_tokens": best["estimated_completion_tokens"],
            "partial": best["partial"], "per_shard": best["per_shard"]}


def _shard_peak(full: list[dict[str, Any]], i: int, s: ShardSummary) -> dict[str, Any]:
    """The log's best full minute among those it was writing in: a resumed run's full minutes
    are not the first pass's logs' to claim (with 0 tokens)."""
    first, last = s.first_t, s.last_t
    alive = [r for r in full
             if first is not None and last is not None and r["start"] < last
             and r["start"] + 60 > first]  # fmt: skip
    if not alive:
        return {"shard": s.name, "minute": None, "completion_tokens": None}
    best = max(alive, key=lambda r: (r["per_shard"][i], -r["start"]))
    return {"shard": s.name, "minute": best["minute"],
            "completion_tokens": best["per_shard"][i]}

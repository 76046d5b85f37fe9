"""Each pass of a run on its own: its settings, where they came from, and what it achieved. Pure.

A run that was stopped and resumed with other settings (a lower concurrency while the endpoint
throttled) has figures for the whole run that blend the passes; the reader needs each pass's
cap and throughput side by side, and why they were what they were, to see what a change did.
"""

from __future__ import annotations

from typing import Any

from shardrun.aggregate._metrics import pass_window, ratio, segments_of
from shardrun.aggregate._segments import merge_segments, overall
from shardrun.aggregate._summary import CoordinatorSummary, ShardSummary

# The settings an operator turns between passes, by their manifest key.
PASS_SETTINGS = ("shards", "concurrency", "rate_limits.rpm", "rate_limits.tpm")


def pass_settings(effective: object, *, kind: str,
                  keys: tuple[str, ...] = PASS_SETTINGS) -> dict[str, Any]:
    """A pass's settings `keys` ({value, source}) from its manifest record's `effective`."""
    found = effective if isinstance(effective, dict) else {}
    settings = {key: found[key] for key in keys if isinstance(found.get(key), dict)}
    return {"kind": kind, "settings": settings}


def recorded_passes(manifest: dict[str, Any],
                    keys: tuple[str, ...] = PASS_SETTINGS) -> list[dict[str, Any]]:
    """Each pass's kind and settings `keys`, pass K at index K (the first, then resumes)."""
    found = [pass_settings(manifest.get("effective"), kind="first", keys=keys)]
    for resume in manifest.get("resumes") or []:
        if not isinstance(resume, dict):
            found.append(pass_settings(None, kind="resume", keys=keys))
            continue
        kind = ("retry-failed" if resume.get("only_failed") else
                "resume+retry-failed" if resume.get("retry_failed") else "resume")
        found.append(pass_settings(resume.get("effective"), kind=kind, keys=keys))
    return found


def passes_section(coords: list[CoordinatorSummary], shards: list[ShardSummary],
                   recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per pass with a window, in order; `recorded[K]` is pass K's manifest facts."""
    out = []
    for seg in segments_of(coords, shards):
        if (window := pass_window(seg, coords, shards)) is None:
            continue
        start, end = window
        c = next((c for c in coords if c.segment == seg), CoordinatorSummary())
        mine = [s for s in shards if s.segment == seg]
        facts = recorded[seg] if seg < len(recorded) else {"kind": None, "settings": {}}
        tokens = sum(s.completion_tokens for s in mine)
        attempts = sum(s.attempts for s in mine)
        throttled = sum(s.by_status.get("http_429", 0) for s in mine)
        # As the scheduler table counts it: slot time the rate limit held while work waited.
        held = sum(s.rate_wait_first_s for s in mine)
        # The server's own wait per request: it grows with the server's queue, so a pass whose
        # lower cap cut it and left the TPM as it was ran at the server's pace, not the cap's.
        ttft = overall(merge_segments([s.segments for s in mine]))["ttft_request"].stats()
        out.append({
            "segment": seg, "start_t": start, "end_t": end, "kind": facts["kind"],
            "settings": facts["settings"], "status": c.run_status, "stopped_by": c.stopped_by,
            "shard_logs": len(mine), "caps": sorted({s.cap for s in mine if s.cap}),
            "succeeded": sum(s.ok for s in mine), "dead": sum(s.dead for s in mine),
            "abandoned": sum(s.abandoned for s in mine), "attempts": attempts,
            "http_429": throttled, "http_429_share": ratio(throttled, attempts),
            "rate_limited_share": ratio(held, sum(s.cap_slot_s for s in mine)),
            "completion_tokens": tokens,
            "ttft_request_p50": None if ttft is None else round(ttft.p50, 6),
            "completion_tpm": round(tokens * 60 / (end - start), 1) if end > start else None,
        })  # fmt: skip
    return out

"""The report document: every number of `shardrun report`, as one JSON-ready dict. Pure.

`RunFacts` carries what a reader learned outside the event records (manifest, run state, file
integrity); the rest comes from fold summaries. The layout is versioned by `SCHEMA` and
documented in docs/METRICS.md; renderers (terminal, HTML) read only this document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardrun import __version__
from shardrun.aggregate._cost import Pricing, cost_section
from shardrun.aggregate._metrics import (
    attempts_section,
    client_cpu_section,
    connections_section,
    items_section,
    latency_section,
    loop_lag_section,
    windows,
)
from shardrun.aggregate._passes import passes_section
from shardrun.aggregate._scheduler import scheduler_section
from shardrun.aggregate._summary import CoordinatorSummary, ShardSummary
from shardrun.aggregate._tpm import tpm_section
from shardrun.aggregate._triage import triage_section
from shardrun.itl import REL_ERROR

SCHEMA = "shardrun.report/1"
METHOD_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What the reader found besides the event records."""

    run_id: str | None
    run_dir: str
    state: str  # finished | running | crashed
    state_reason: str
    manifest_status: str | None = None
    pricing: Pricing | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Pass K's kind and turnable settings with their sources (`pass_settings`), from the manifest.
    passes: list[dict[str, Any]] = field(default_factory=list)


def build_report(facts: RunFacts, coords: list[CoordinatorSummary],
                 shards: list[ShardSummary]) -> dict[str, Any]:
    """The whole report document for one run (all of its passes)."""
    shards = sorted(shards, key=lambda s: (s.segment, s.name))
    spans = windows(coords, shards)
    duration = sum(end - start for start, end in spans)
    items = items_section(coords, shards)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "generator": f"shardrun {__version__}",
        "method_version": METHOD_VERSION,
        "run": _run(facts, coords, shards, duration),
        "integrity": _integrity(facts.files),
        "items": items,
        "tpm": tpm_section(shards, spans, duration),
        "latency": latency_section(shards),
        "attempts": attempts_section(shards, items["succeeded"]),
        "connections": connections_section(shards, items["succeeded"]),
        "scheduler": scheduler_section(coords, shards),
        "loop_lag": loop_lag_section(shards),
        "client_cpu": client_cpu_section(coords, sum(s.attempts for s in shards),
                                         items["completion_tokens"], duration),
        "cost": cost_section(facts.pricing, successes=items["succeeded"],
                             prompt_tokens=items["prompt_tokens"],
                             cached_tokens=items["cached_tokens"],
                             completion_tokens=items["completion_tokens"],
                             wasted_tokens=sum(s.wasted_tokens for s in shards),
                             duration_s=duration),
    }
    doc["latency"]["relative_error"] = round(REL_ERROR, 4)
    doc["triage"] = triage_section(doc)
    doc["notes"] = [*facts.notes, *_notes(doc, shards)]
    return doc


def _run(facts: RunFacts, coords: list[CoordinatorSummary], shards: list[ShardSummary],
         duration: float) -> dict[str, Any]:
    passes = passes_section(coords, shards, facts.passes)
    last = max(coords, key=lambda c: c.segment, default=CoordinatorSummary())
    return {
        "run_id": facts.run_id, "dir": facts.run_dir, "state": facts.state,
        "state_reason": facts.state_reason, "manifest_status": facts.manifest_status,
        "run_end_status": last.run_status,
        # Passes stopped by an outage or a storm: triage names it even if no held retry was sent.
        "stopped_by": [c.stopped_by for c in sorted(coords, key=lambda c: c.segment)
                       if c.stopped_by],
        "start_t": min((p["start_t"] for p in passes), default=None),
        "end_t": max((p["end_t"] for p in passes), default=None),
        "passes": passes, "duration_s": round(duration, 6), "shard_logs": len(shards),
    }  # fmt: skip


def _integrity(files: list[dict[str, Any]]) -> dict[str, Any]:
    problems = [f for f in files if f.get("checkpoint_error") or f.get("bad_lines")]
    return {"files": files, "ok": not problems,
            "torn_tails": sum(1 for f in files if f.get("torn_tail_bytes"))}


def _notes(doc: dict[str, Any], shards: list[ShardSummary]) -> list[str]:
    notes = []
    tpm, lat = doc["tpm"], doc["latency"]
    if tpm["peak_full_minute"] is None and tpm["minutes"]:
        notes.append(f"no full minute: the run lasted {doc['run']['duration_s']:.1f} s, so "
                     "every minute is partial and there is no peak full minute")
    odd = {
        "spans released ok without a successful attempt in the log":
            sum(s.ok_without_attempt for s in shards),
        "successful spans whose earlier lines are missing (left out of latency)":
            sum(s.ok_incomplete for s in shards),
        # `at_once` on their attempt_end: see the folds' `_latency`
        "successful answers that came at once, not token by token (a proxy or gateway that "
        "buffers streams, a server that ignores stream, or a client too busy to read), so "
        "their first token is their end: left out of ttft, ttft_request and tpot":
            lat["spans"] - ((lat["all"]["ttft"] or {}).get("n") or 0),
        "lines with an unknown event name": sum(s.unknown_events for s in shards),
    }  # fmt: skip
    notes += [f"{n:,} {what}" for what, n in odd.items() if n]
    att = doc["attempts"]
    if (unended := att["started"] - sum(att["by_status"].values())) > 0:
        plural = "s" if unended != 1 else ""
        notes.append(f"{unended:,} attempt{plural} started and never ended in the log, so they "
                     "have no status: their shard was killed or crashed mid-attempt (their items "
                     "ran again; the run summary counts these attempts too, from the shard's "
                     "last report), or could not write the rest of its log (a full disk; the "
                     "run summary, counted from the shards' reports, counts those as well)")
    return notes

"""From fold summaries to the numbers of the report (docs/METRICS.md defines each one). Pure."""

from __future__ import annotations

from typing import Any

from shardrun.aggregate._dist import Dist, merged
from shardrun.aggregate._segments import (
    ALL_NAMES,
    BUCKETS,
    SEGMENT_EDGES,
    SEGMENT_LABELS,
    merge_segments,
    overall,
)
from shardrun.aggregate._summary import CoordinatorSummary, ShardSummary
from shardrun.summary import CORES_MIN_WALL_S

# Loop lag above either figure labels the run client-limited (see docs/METRICS.md).
LAG_P50_LIMIT_S = 0.010
LAG_P99_LIMIT_S = 0.050


def ratio(num: float, den: float, digits: int = 6) -> float | None:
    """`num / den` rounded, or None when the denominator is 0."""
    return round(num / den, digits) if den else None


Window = tuple[float, float]


def windows(coords: list[CoordinatorSummary], shards: list[ShardSummary]) -> list[Window]:
    """Each pass's first and last instants (`run_start`/`run_end` when logged, else its events').

    A run has one pass, plus one per resume; time between passes belongs to no window.
    """
    found = (pass_window(seg, coords, shards) for seg in segments_of(coords, shards))
    return [w for w in found if w is not None]


def segments_of(coords: list[CoordinatorSummary], shards: list[ShardSummary]) -> list[int]:
    """The passes that left a log, in order."""
    return sorted({c.segment for c in coords} | {s.segment for s in shards})


def pass_window(seg: int, coords: list[CoordinatorSummary],
                shards: list[ShardSummary]) -> Window | None:
    """Pass `seg`'s window, or None when neither its coordinator nor its shards logged a time."""
    c = next((c for c in coords if c.segment == seg), CoordinatorSummary())
    mine = [s for s in shards if s.segment == seg]
    firsts = [t for t in [c.first_t, *(s.first_t for s in mine)] if t is not None]
    lasts = [t for t in [c.last_t, *(s.last_t for s in mine)] if t is not None]
    start = c.run_start if c.run_start is not None else min(firsts, default=None)
    end = c.run_end if c.run_end is not None else max(lasts, default=None)
    if start is None or end is None:
        return None
    return start, max(start, end)


def _stats(d: Dist) -> dict[str, Any] | None:
    st = d.stats()
    return None if st is None else st.as_dict()


def items_section(coords: list[CoordinatorSummary],
                  shards: list[ShardSummary]) -> dict[str, Any]:
    ok = sum(s.ok for s in shards)
    dead = sum(s.dead for s in shards)
    return {
        "queued": sum(s.queued for s in shards),
        "succeeded": ok,
        "refusals": sum(s.refusals for s in shards),
        "dead": dead,
        "open": sum(s.open_spans for s in shards),
        "abandoned": sum(s.abandoned for s in shards),
        "abandoned_at_restart": sum(s.lost_at_restart for s in shards),
        "rejected_input_lines": None if all(c.rejects is None for c in coords)
        else sum(c.rejects or 0 for c in coords),
        "success_rate": ratio(ok, ok + dead),
        "completion_tokens": sum(s.completion_tokens for s in shards),
        # Of succeeded and completion_tokens: those the client counted (no usage from the server).
        "estimated_successes": sum(s.estimated_ok for s in shards),
        "estimated_completion_tokens": sum(s.estimated_tokens for s in shards),
        "prompt_tokens": sum(s.prompt_tokens for s in shards),
        "cached_tokens": sum(s.cached_tokens for s in shards),
        "reasoning_tokens": sum(s.reasoning_tokens for s in shards),
    }


def latency_section(shards: list[ShardSummary]) -> dict[str, Any]:
    segments = merge_segments([s.segments for s in shards])
    everything = overall(segments)
    by_segment = []
    for i in sorted(segments):
        named = segments[i].named()
        lo, hi = SEGMENT_EDGES[i]
        by_segment.append({
            "segment": SEGMENT_LABELS[i], "min_tokens": lo,
            "max_tokens": None if hi is None else hi - 1, "spans": segments[i].spans,
            "dists": {name: _stats(named[name]) for name in ALL_NAMES},
        })  # fmt: skip
    return {
        "spans": sum(seg.spans for seg in segments.values()),
        "all": {name: _stats(everything[name]) for name in ALL_NAMES},
        "by_prompt_length": by_segment,
        "bucket_share": bucket_shares(everything),
    }


def bucket_shares(dists: dict[str, Dist]) -> dict[str, float | None]:
    """Each bucket's share of all bucket time summed over successful spans."""
    total = sum(dists[b].total for b in BUCKETS)
    return {b: ratio(dists[b].total, total, 4) for b in BUCKETS}


def attempts_section(shards: list[ShardSummary], successes: int) -> dict[str, Any]:
    started = sum(s.attempts for s in shards)
    first = sum(s.first_attempts for s in shards)
    causes = _sum_maps([s.retries for s in shards])
    retries = sum(causes.values())
    per_minute: dict[int, dict[str, int]] = {}
    for s in shards:
        for m, counts in s.retry_minutes.items():
            per_minute[m] = _sum_maps([per_minute.get(m, {}), counts])
    return {
        "started": started, "first": first, "retries": retries,
        "retry_rate": ratio(retries, first), "attempts_per_success": ratio(started, successes),
        "by_status": _sum_maps([{str(k): v for k, v in s.by_status.items()} for s in shards]),
        "retry_causes": causes,
        "retries_by_minute": [{"start": m * 60, "causes": per_minute[m]}
                              for m in sorted(per_minute)],
        "wasted_tokens": sum(s.wasted_tokens for s in shards),
        "dead_reasons": _sum_maps([s.capped_reasons() for s in shards]),
        "server_limit": server_limit(shards),
    }  # fmt: skip


def server_limit(shards: list[ShardSummary]) -> dict[str, Any]:
    """The server's own rate limit: its 429s, the retries it held (`rate_limited`) and the
    items those were, and the pace the shards learned of it: each shard's last `rate_learned`,
    of requests and of tokens (a shard may learn either or both), summed over the shard logs
    of the latest pass that learned one (the passes of a resumed run ran apart), and how many
    of those shards last set it from the limit a 429 stated rather than cut it."""
    paces: dict[int, list[ShardSummary]] = {}
    for s in shards:
        if s.learned_rps is not None or s.learned_tps is not None:
            paces.setdefault(s.segment, []).append(s)
    last = paces[max(paces)] if paces else []
    rps = [s.learned_rps for s in last if s.learned_rps is not None]
    tps = [s.learned_tps for s in last if s.learned_tps is not None]
    return {
        "http_429": sum(s.by_status.get("http_429", 0) for s in shards),
        "held_retries": sum(s.held_retries for s in shards),
        "held_items": sum(s.limited_spans for s in shards),
        "pace_cuts": sum(s.learned_cuts for s in shards),
        "pace_seeds": sum(s.learned_seeds for s in shards), "paced_shards": len(last),
        "seeded_shards": sum(s.learned_seeded for s in last),
        "paced_rps": round(sum(rps), 3) if rps else None,
        "paced_rpm": round(sum(rps) * 60, 1) if rps else None,
        "paced_tps": round(sum(tps), 1) if tps else None,
        "paced_tpm": round(sum(tps) * 60) if tps else None,
    }  # fmt: skip


def _sum_maps(maps: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def connections_section(shards: list[ShardSummary], successes: int) -> dict[str, Any]:
    new = sum(s.new_conns for s in shards)
    items = sum(s.queued for s in shards)
    return {
        "new": new,
        "reused": sum(s.reused_conns for s in shards),
        "resent": sum(s.resent for s in shards),
        "churn_per_success": ratio(new, successes),
        "expected_churn": ratio(sum(s.cap for s in shards), items),
    }


def loop_lag_section(shards: list[ShardSummary]) -> dict[str, Any]:
    lag = merged([s.loop_lag for s in shards])
    st = lag.stats()
    limited = st is not None and (st.p50 >= LAG_P50_LIMIT_S or st.p99 >= LAG_P99_LIMIT_S)
    return {
        "samples": lag.n,
        "p50": None if st is None else round(st.p50, 6),
        "p99": None if st is None else round(st.p99, 6),
        "max": None if st is None else round(st.max, 6),
        "client_limited": limited,
        "limits": {"p50_s": LAG_P50_LIMIT_S, "p99_s": LAG_P99_LIMIT_S},
    }


def client_cpu_section(coords: list[CoordinatorSummary], attempts: int, completion_tokens: int,
                       duration_s: float) -> dict[str, Any]:
    """The client's CPU time, summed over the passes whose `run_end` recorded it.

    The ratios need every pass: a pass that did not end cleanly has no `run_end`, and dividing
    the other passes' CPU by all the attempts would understate the cost.
    """
    recorded = [c.client_cpu_s for c in coords if c.client_cpu_s is not None]
    cpu = sum(recorded)
    complete = bool(coords) and len(recorded) == len(coords)
    return {
        "passes": len(coords),
        "passes_recorded": len(recorded),
        # Why a pass that ended recorded none (its shards were reaped by no shardrun process).
        "unknown": [c.client_cpu_unknown for c in coords
                    if c.client_cpu_s is None and c.client_cpu_unknown],
        "cpu_s": round(cpu, 3) if recorded else None,
        "ms_per_attempt": ratio(cpu * 1e3, attempts, 4) if complete else None,
        "s_per_1k_completion_tokens": ratio(cpu * 1e3, completion_tokens, 5) if complete else None,
        "cores": ratio(cpu, duration_s, 3) if complete and duration_s >= CORES_MIN_WALL_S
        else None,
    }

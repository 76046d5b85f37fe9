"""The scheduler section per shard log and overall: backlog, gap_fraction, occupancy under backlog
and cross-shard idle.

Gap time has two causes the log tells apart. Before a span's first attempt the dispatcher holds
a free slot while our own rate limit (`rate_limits`) makes it wait, and logs that wait as
`rate_wait` (attempt 1) before `admitted`: the whole wait is queue > 0 with in_flight < cap, so
it is gap time by construction. What remains is the scheduler's own stall.

gap_fraction counts time with *any* free slot, so one free slot of 64 counts as much as 64 free.
`occupancy_under_backlog` weighs by slots: integral of in_flight over integral of cap, both over
the time with queue depth > 0, so `1 - occupancy` is the share of slot-seconds left idle while
work waited (what maps to lost throughput). A slot is busy from `admitted` to `released`, also
while its item waits for a retry: `sending_under_backlog` weighs the requests actually out
(`attempt_start` to `attempt_end`) the same way, so a shard whose slots all hold items in a
storm, one probe out at a time, reads full occupancy and the sending share it had.
"""

from __future__ import annotations

from typing import Any

from shardrun.aggregate._metrics import ratio
from shardrun.aggregate._summary import CoordinatorSummary, ShardSummary


def input_end(coords: list[CoordinatorSummary], segment: int) -> float | None:
    """When the pass `segment` ran out of input (None: never, as far as its log says)."""
    return next((c.input_end for c in coords if c.segment == segment), None)


def time_before(s: ShardSummary, end_t: float | None) -> float:
    """Shard-seconds observed before `end_t` (all of them when it is None)."""
    if s.first_t is None or s.last_t is None:
        return 0.0
    end = s.last_t if end_t is None else min(s.last_t, end_t)
    return max(0.0, end - s.first_t)


def _split(backlog: float, gap: float, busy: float, slots: float, sending: float, rate: float,
           idle: float, before: float) -> dict[str, float]:
    rate_gap = min(gap, rate)
    occupancy = ratio(busy, slots)
    sent = ratio(sending, slots)
    return {
        "backlog_s": round(backlog, 6), "gap_s": round(gap, 6),
        "gap_fraction": ratio(gap, backlog) or 0.0,
        "busy_slot_s": round(busy, 6), "cap_slot_s": round(slots, 6),
        "occupancy_under_backlog": 1.0 if occupancy is None else occupancy,
        "sending_slot_s": round(sending, 6),
        "sending_under_backlog": 1.0 if sent is None else sent,
        "rate_limited_gap_s": round(rate_gap, 6),
        "stall_gap_fraction": ratio(gap - rate_gap, backlog) or 0.0,
        "idle_before_input_end_s": round(idle, 6),
        "idle_fraction": ratio(idle, before) or 0.0,
    }  # fmt: skip


def scheduler_section(coords: list[CoordinatorSummary],
                      shards: list[ShardSummary]) -> dict[str, Any]:
    rows = []
    for s in shards:
        before = time_before(s, input_end(coords, s.segment))
        rows.append({
            "shard": s.name, "cap": s.cap, "observed_s": round(s.observed_s, 6),
            **_split(s.backlog_s, s.gap_s, s.busy_slot_s, s.cap_slot_s, s.sending_slot_s,
                     s.rate_wait_first_s, s.idle_s, before),
            "queue_depth_at_end": s.queue_depth, "in_flight_at_end": s.in_flight,
        })  # fmt: skip
    total = _split(
        sum(s.backlog_s for s in shards), sum(s.gap_s for s in shards),
        sum(s.busy_slot_s for s in shards), sum(s.cap_slot_s for s in shards),
        sum(s.sending_slot_s for s in shards),
        sum(min(s.gap_s, s.rate_wait_first_s) for s in shards), sum(s.idle_s for s in shards),
        sum(time_before(s, input_end(coords, s.segment)) for s in shards),
    )  # fmt: skip
    overall = {k: v for k, v in total.items()
               if k not in ("idle_before_input_end_s", "idle_fraction")}
    overall["cross_shard_idle_s"] = total["idle_before_input_end_s"]
    overall["cross_shard_idle_fraction"] = total["idle_fraction"]
    return {
        "input_end_t": [c.input_end for c in sorted(coords, key=lambda c: c.segment)],
        "shards": rows,
        "overall": overall,
        "rate_waits": {
            "count": sum(s.rate_waits for s in shards),
            "before_admission_s": round(sum(s.rate_wait_first_s for s in shards), 6),
            "before_retries_s": round(sum(s.rate_wait_retry_s for s in shards), 6),
        },
    }

"""What a fold leaves behind: `ShardSummary` and `CoordinatorSummary`, small and picklable.

Their size depends on minutes, segments and distinct causes, never on the number of spans, so
shard files can be folded in worker processes and only these travel back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shardrun.aggregate._dist import Dist
from shardrun.aggregate._minutes import MinuteCell
from shardrun.aggregate._segments import Segment
from shardrun.aggregate._steps import StepTrace

MAX_REASONS = 32
REASON_CHARS = 80


def reason_key(reason: object) -> str:
    """A dead-letter reason without its per-item details: the text before the first colon."""
    text = str(reason or "unknown").split(":", 1)[0].strip()
    return text[:REASON_CHARS] or "unknown"


@dataclass(slots=True)
class ShardSummary:
    """Everything the report needs from one shard's event log."""

    name: str = ""  # the file's: "03" for shard-03.jsonl, "03.r1" for its first resume
    segment: int = 0  # the run pass that wrote the file: 0, then 1, 2... for resumes
    shard: int | None = None
    cap: int = 0
    pid: int | None = None
    host: str | None = None
    starts: int = 0
    ended: bool = False
    first_t: float | None = None
    last_t: float | None = None
    queued: int = 0
    ok: int = 0
    refusals: int = 0  # of ok, answers that were a refusal (`released` with reason "refusal")
    dead: int = 0
    open_spans: int = 0
    queue_depth: int = 0
    in_flight: int = 0
    abandoned: int = 0  # released with outcome "abandoned": no line, redone on resume
    lost_at_restart: int = 0  # open when a second shard_start appeared in the same file
    other_outcomes: int = 0
    ok_without_attempt: int = 0
    ok_incomplete: int = 0
    unknown_events: int = 0
    attempts: int = 0
    first_attempts: int = 0
    by_status: dict[Any, int] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    retry_minutes: dict[int, dict[str, int]] = field(default_factory=dict)
    dead_reasons: dict[str, int] = field(default_factory=dict)
    wasted_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, where the server counted its prompt cache
    reasoning_tokens: int = 0  # of the successes' completion tokens, where the server says
    completion_tokens: int = 0
    # Of ok and completion_tokens: successes whose tokens the client estimated (the server sent
    # no usage; `usage_estimated` on their attempt_end), and their tokens.
    estimated_ok: int = 0
    estimated_tokens: int = 0
    new_conns: int = 0
    reused_conns: int = 0
    resent: int = 0  # requests sent again, their pooled connection found dead (`resent`)
    # Retries `rate_limited` (held for the server's rate limit) and the spans they were, each
    # once, and the `rate_learned` lines: how many cut a pace and how many set one from the
    # limit a 429 stated, and the last one's paces (requests, tokens a second; None: no such
    # pace) and whether it was so set.
    held_retries: int = 0
    limited_spans: int = 0
    learned_cuts: int = 0
    learned_rps: float | None = None
    learned_seeds: int = 0
    learned_tps: float | None = None
    learned_seeded: bool = False
    rate_waits: int = 0
    rate_wait_first_s: float = 0.0  # before admission: inside t_queue, and all of it gap time
    rate_wait_retry_s: float = 0.0  # before a later attempt: inside t_retry
    backlog_s: float = 0.0
    gap_s: float = 0.0
    busy_slot_s: float = 0.0  # integral of in_flight (up to cap) while queue depth > 0
    sending_slot_s: float = 0.0  # integral of requests out (up to cap) while queue depth > 0
    cap_slot_s: float = 0.0  # integral of cap while queue depth > 0
    idle_s: float = 0.0
    minutes: dict[int, MinuteCell] = field(default_factory=dict)
    segments: dict[int, Segment] = field(default_factory=dict)
    loop_lag: Dist = field(default_factory=Dist)
    trace: StepTrace | None = None

    @property
    def observed_s(self) -> float:
        """Time from the shard's first event to its last."""
        if self.first_t is None or self.last_t is None:
            return 0.0
        return self.last_t - self.first_t

    def capped_reasons(self) -> dict[str, int]:
        """Dead reasons, the rarest folded into "other" past `MAX_REASONS` distinct ones."""
        ranked = sorted(self.dead_reasons.items(), key=lambda kv: (-kv[1], kv[0]))
        out = dict(ranked[:MAX_REASONS])
        rest = sum(n for _, n in ranked[MAX_REASONS:])
        if rest:
            out["other"] = out.get("other", 0) + rest
        return out


@dataclass(slots=True)
class CoordinatorSummary:
    """The coordinator's log: when the run started and ended, and when the input ran out."""

    segment: int = 0
    run_start: float | None = None
    run_end: float | None = None
    run_status: str | None = None
    client_cpu_s: float | None = None  # user + sys of coordinator, launcher and shards
    client_cpu_unknown: str | None = None  # why `run_end` recorded no CPU time, if it said
    stopped_by: str | None = None  # the outage or storm that stopped the pass, if one did
    input_end: float | None = None
    input_lines: int | None = None
    rejects: int | None = None
    shards: int | None = None
    cap: int | None = None
    batches: int = 0
    handed: dict[int, int] = field(default_factory=dict)
    shard_exits: dict[int, str] = field(default_factory=dict)
    first_t: float | None = None
    last_t: float | None = None

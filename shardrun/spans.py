"""A span's timestamps, and the pure functions that turn them into result and dead-letter lines.

The six time buckets (DESIGN §3) are differences of consecutive timestamps of the final attempt,
so they telescope: their sum is `released_at - queued_at` up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from shardrun.client import AttemptOutcome

BUCKETS = ("t_queue", "t_retry", "t_conn", "t_first_token", "t_stream", "t_post")


@dataclass(slots=True, eq=False)  # compared by identity: a storm's wait list looks one up
class Span:
    """One item's life inside a shard."""

    span_id: str
    item: dict[str, Any]
    queued_at: float
    item_id: str = field(init=False)  # str(item["id"]), kept: every event line names it
    prompt_chars: int = 0
    charged: int = 0  # tokens reserved with the rate limiter (0: not estimated yet)
    admitted_at: float | None = None
    attempt_started_at: float | None = None
    conn_ready_at: float | None = None  # of the latest attempt (None: no connection)
    history: list[dict[str, Any]] = field(default_factory=list)
    ended: bool = False  # released (ok, dead or abandoned)
    # Attempts that were not the item's own: made while the endpoint was down, its first
    # stream cut mid-answer (`Shard._first_cut`), or retries that failed in a storm before any
    # request of the run succeeded (`Shard._storm_failed`).
    outage_tries: int = 0
    cut_once: bool = False  # a stream of it was cut mid-answer (the next cut is its own)
    # When its latest attempt failed saying the endpoint was down (None after any other end).
    down_failure_at: float | None = None
    # It failed so once after the endpoint answered a later request, and was held all the same
    # (`Shard._endpoint_down`): the next such failure is its own.
    held_again: bool = False
    # Its latest failure came while only the server's model list answered (`Shard._list_only`),
    # and whether it has had the one free retry of such a failure (`Shard._first_list_only`).
    list_only_now: bool = False
    list_free_used: bool = False
    # Sent beside the cap with no slot of it, as a fresh probe (`Shard._send_list_probe`), and
    # not yet given one (`Shard._take_a_slot`).
    beside_cap: bool = False
    # The `retry` line of a retry decided but not yet sent (`Shard._plan_retry`).
    retry_line: dict[str, Any] | None = None
    # When a 429 first held it (`Shard._hold_for_limit`): held past retry.outage_s while the
    # server answers others, it is a dead letter.
    limited_at: float | None = None
    # Of its `outage_tries`, those that were such holds: an outage's probe backs off by the
    # others alone (`Shard._wait_out_outage`), not the longer for having met a rate limit.
    limit_holds: int = 0

    def __post_init__(self) -> None:
        self.item_id = str(self.item["id"])


class Timeline(NamedTuple):
    """The seven instants that delimit the six buckets of a successful span."""

    queued: float
    admitted: float
    attempt_start: float
    conn_ready: float
    first_token: float
    last_token: float
    released: float


def buckets(tl: Timeline) -> dict[str, float]:
    """The six time buckets of DESIGN §3, in seconds."""
    return {
        "t_queue": tl.admitted - tl.queued,
        "t_retry": tl.attempt_start - tl.admitted,
        "t_conn": tl.conn_ready - tl.attempt_start,
        "t_first_token": tl.first_token - tl.conn_ready,
        "t_stream": tl.last_token - tl.first_token,
        "t_post": tl.released - tl.last_token,
    }


def timeline(span: Span, outcome: AttemptOutcome, released_at: float) -> Timeline:
    """The final attempt's instants; a response with no content token has t_stream = 0."""
    assert span.admitted_at is not None and span.attempt_started_at is not None
    start = span.attempt_started_at
    conn = span.conn_ready_at if span.conn_ready_at is not None else start
    last = outcome.last_token_at if outcome.last_token_at is not None else outcome.ended_at
    first = outcome.first_token_at if outcome.first_token_at is not None else last
    return Timeline(span.queued_at, span.admitted_at, start, conn, first, last, released_at)


def result_record(
    span: Span, outcome: AttemptOutcome, shard: int, released_at: float
) -> dict[str, Any]:
    """The results/shard-NN.jsonl line of a successful span."""
    tl = timeline(span, outcome, released_at)
    record: dict[str, Any] = {
        "id": span.item_id,
        "output": outcome.text,
        "finish_reason": outcome.finish_reason,
        "usage": {
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            "estimated": outcome.usage_estimated,
        },
        "attempts": len(span.history),
        "shard": shard,
        "span": span.span_id,
        "prompt_chars": span.prompt_chars,
        "queued_at": tl.queued,
        "first_token_at": tl.first_token,
        "last_token_at": tl.last_token,
        "released_at": tl.released,
        "e2e": tl.released - tl.queued,
        "ttft": tl.first_token - tl.queued,
        "buckets": buckets(tl),
    }
    # Only answers that have them carry these keys: most lines stay as short as they were.
    if outcome.cached_tokens is not None:
        record["usage"]["cached_tokens"] = outcome.cached_tokens
    if outcome.reasoning_tokens is not None:
        record["usage"]["reasoning_tokens"] = outcome.reasoning_tokens
    if outcome.reasoning is not None:
        record["reasoning"] = outcome.reasoning
    if outcome.tool_calls is not None:
        record["tool_calls"] = outcome.tool_calls
    if outcome.refusal is not None:
        record["refusal"] = outcome.refusal
    if outcome.function_call is not None:
        record["function_call"] = outcome.function_call
    if len(span.history) > 1:  # its 429s and their held retries: `summary.add_unreported`
        if refused := sum(a["status"] == "http_429" for a in span.history):
            record["http_429s"] = refused
        if held := sum(a.get("held") is True for a in span.history):
            record["held_429s"] = held
    # An OpenAI Batch line names its own endpoint and model: its Batch output line is shaped by
    # them (`batch_format.batch_output_line`), not by the job's api and model.
    if (url := span.item.get("url")) is not None:
        record["url"] = url
        body = span.item.get("body")
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            record["model"] = body["model"]
    return record


def dead_record(span: Span, reason: str, shard: int) -> dict[str, Any]:
    """The dead/shard-NN.jsonl line of a span that ended without a result."""
    return {
        "id": span.item_id,
        "reason": reason,
        "shard": shard,
        "span": span.span_id,
        "attempts": span.history,
    }

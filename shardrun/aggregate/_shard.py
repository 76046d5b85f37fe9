"""`ShardFold`: one shard's event records, folded into a `ShardSummary`. Pure: no I/O, no clock.

Records are the parsed lines of `events/shard-NN.jsonl` (see docs/ARCHITECTURE.md), fed in file
order. Both layouts of an attempt are read: the current one, where `attempt_end` carries the
attempt's `conn_ready_t`, `reused`, `first_token_t` and `last_token_t`, and the older one, where
those instants came on separate `conn_ready`, `first_token` and `last_token` lines (runs written
before the change). When a log has both for one attempt, the separate lines win, which is what
the older fold computed (a writer puts the same instants on both).

State per span lives only while the span is open (from `queued` to `released`); what stays is
per-minute, per-segment and per-shard. A fold tolerates missing lines (a torn log, a
log read from its middle, or the `minutes_only` mode of `publish` and `verify`, where only
`MINUTES_ONLY_EVENTS` are fed): what cannot be computed is counted, never guessed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from shardrun.aggregate._dist import Dist
from shardrun.aggregate._minutes import MinuteTally
from shardrun.aggregate._segments import FLUSH_AT, Segment, segment_of
from shardrun.aggregate._steps import Scheduler, StepTrace
from shardrun.aggregate._summary import ShardSummary, reason_key
from shardrun.event_names import RATE_LIMITED

Record = Mapping[str, Any]
Handler = Callable[[Record, bytes], None]

# Slots of an open span's state list: queued, prompt chars, admitted, attempt start, connection
# ready, first token (the current attempt's), last token with its attempt and raw line (older
# layout only), the ok attempt_end, and whether a 429 of the server's rate limit held it.
Q, PC, A, S, C, F, L, LA, LR, E, H = range(11)
_EMPTY: list[Any] = [None] * 11
MAX_TRACKED_REASONS = 256
# What `verify` reads: the figure's lines, and every line that moves the log's time window
# exactly as in a full fold (so both agree on which minutes are partial).
# (`last_token` only occurs in logs of the older layout.)
MINUTES_ONLY_EVENTS = frozenset({"shard_start", "last_token", "attempt_end", "released",
                                 "loop_lag", "checkpoint", "shard_end"})


class ShardFold:
    """Feed one shard's records with `feed` (or `handlers[ev](record, raw_line)`), then `finish`."""

    def __init__(self, *, idle_until: float = math.inf, cap: int = 0, minutes_only: bool = False,
                 keep_lines: bool = False, trace: bool = False) -> None:
        self.full = not minutes_only
        self.sum = ShardSummary()
        self.sched = Scheduler(cap, idle_until, StepTrace() if trace else None)
        self.tally = MinuteTally(keep_lines=keep_lines)
        self.keep_lines = keep_lines
        self.open: dict[str, list[Any]] = {}
        self.legacy_conn = False  # a `conn_ready` line was seen: attempt_end may repeat it
        self.segments: dict[int, Segment] = {}
        self.loop_lag = Dist()
        self.handlers: dict[str, Handler] = {
            "shard_start": self._shard_start, "queued": self._queued, "admitted": self._admitted,
            "attempt_start": self._attempt_start, "conn_ready": self._conn_ready,
            "first_token": self._first_token, "last_token": self._last_token,
            "attempt_end": self._attempt_end, "retry": self._retry, "released": self._released,
            "rate_wait": self._rate_wait, "rate_learned": self._rate_learned,
            "rate_uncapped": self._no_figure,
            "loop_lag": self._loop_lag, "checkpoint": self._seen, "shard_end": self._shard_end,
        }  # fmt: skip
        if minutes_only:
            self.handlers = {k: v for k, v in self.handlers.items() if k in MINUTES_ONLY_EVENTS}

    def feed(self, rec: Record, raw: bytes = b"") -> None:
        """Fold one record; unknown events are counted and otherwise ignored."""
        handler = self.handlers.get(rec.get("ev"))  # type: ignore[arg-type]
        if handler is None:
            self.sum.unknown_events += 1
        else:
            handler(rec, raw)

    def _no_figure(self, rec: Record, raw: bytes) -> None:
        """An event of ours that no figure is read from (`rate_uncapped`): known, not counted
        as a line from a newer shardrun."""

    def _new(self, sid: str) -> list[Any]:
        span = self.open[sid] = _EMPTY.copy()
        return span

    def _seen(self, rec: Record, raw: bytes) -> None:
        t = rec["t"]
        s = self.sum
        if s.first_t is None or t < s.first_t:
            s.first_t = t
        if s.last_t is None or t > s.last_t:
            s.last_t = t

    # -- lifecycle -----------------------------------------------------------------------------

    def _shard_start(self, rec: Record, raw: bytes) -> None:
        s = self.sum
        self._seen(rec, raw)
        s.shard = rec.get("shard")
        s.pid, s.host = rec.get("pid"), rec.get("host")
        s.cap = int(rec.get("cap") or self.sched.cap)
        s.starts += 1
        s.ended = False
        s.lost_at_restart += len(self.open)
        self.open.clear()
        self.sched.restart(rec["t"], s.cap)

    def _shard_end(self, rec: Record, raw: bytes) -> None:
        self._seen(rec, raw)
        self.sum.ended = True

    def _loop_lag(self, rec: Record, raw: bytes) -> None:
        self._seen(rec, raw)
        self.loop_lag.add(max(0.0, float(rec["lag"])))

    # -- scheduler events ----------------------------------------------------------------------

    def _queued(self, rec: Record, raw: bytes) -> None:
        t = rec["t"]
        span = self.open[rec["span"]] = _EMPTY.copy()
        span[Q] = t
        span[PC] = rec.get("prompt_chars")
        self.sum.queued += 1
        if self.sum.first_t is None:
            self.sum.first_t = t
        self.sched.move(t, 1, 0)

    def _admitted(self, rec: Record, raw: bytes) -> None:
        t = rec["t"]
        sid = rec["span"]
        (self.open.get(sid) or self._new(sid))[A] = t
        self.sched.move(t, -1, 1)

    def _released(self, rec: Record, raw: bytes) -> None:
        t = rec["t"]
        s = self.sum
        if s.last_t is None or t > s.last_t:
            s.last_t = t
        if self.full:
            self.sched.move(t, 0, -1)
        span = self.open.pop(rec["span"], None) or _EMPTY
        outcome = rec.get("outcome")
        if outcome == "ok":
            self._close_ok(span, t, raw, rec.get("reason") == "refusal")
        elif outcome == "abandoned":
            s.abandoned += 1
        elif outcome != "dead":
            s.other_outcomes += 1
        else:
            s.dead += 1
            key = reason_key(rec.get("reason"))
            if key not in s.dead_reasons and len(s.dead_reasons) >= MAX_TRACKED_REASONS:
                key = "other"
            s.dead_reasons[key] = s.dead_reasons.get(key, 0) + 1

    # -- attempts ------------------------------------------------------------------------------

    def _attempt_start(self, rec: Record, raw: bytes) -> None:
        sid = rec["span"]
        span = self.open.get(sid) or self._new(sid)
        span[S] = rec["t"]
        span[C] = span[F] = None
        self.sched.sending(rec["t"], 1)
        self.sum.attempts += 1
        if rec.get("attempt") == 1:
            self.sum.first_attempts += 1

    def _conn_ready(self, rec: Record, raw: bytes) -> None:
        """Older layout: the attempt's connection on its own line."""
        sid = rec["span"]
        (self.open.get(sid) or self._new(sid))[C] = rec["t"]
        self.legacy_conn = True
        self._count_conn(rec)

    def _first_token(self, rec: Record, raw: bytes) -> None:
        """Older layout: the attempt's first content token on its own line."""
        sid = rec["span"]
        (self.open.get(sid) or self._new(sid))[F] = rec["t"]

    def _last_token(self, rec: Record, raw: bytes) -> None:
        """Older layout: the attempt's last content token on its own line."""
        sid = rec["span"]
        span = self.open.get(sid) or self._new(sid)
        span[L] = rec["t"]
        span[LA] = rec.get("attempt")
        span[LR] = raw

    def _attempt_end(self, rec: Record, raw: bytes) -> None:
        s = self.sum
        if self.full and isinstance(t := rec.get("t"), float):
            self.sched.sending(t, -1)
        status = rec.get("status")
        s.by_status[status] = s.by_status.get(status, 0) + 1
        s.wasted_tokens += rec.get("wasted_tokens") or 0
        s.prompt_tokens += rec.get("prompt_tokens") or 0
        s.cached_tokens += rec.get("cached_tokens") or 0
        s.resent += rec.get("resent") or 0  # absent before it was logged: none was counted
        conn = rec.get("conn_ready_t")  # absent in the older layout
        span = None
        if conn is not None:
            if self.legacy_conn:  # the log also has conn_ready lines: count a connection once
                span = self.open.get(rec["span"])
            if span is None or span[C] is None:
                self._count_conn(rec)
                if span is not None:
                    span[C] = conn
        if status == "ok":
            s.reasoning_tokens += rec.get("reasoning_tokens") or 0
            span = span or self.open.get(rec["span"]) or self._new(rec["span"])
            if conn is not None and span[C] is None:
                span[C] = conn
            if span[F] is None:
                span[F] = rec.get("first_token_t")
            chunks = rec.get("tokens")  # content chunks; absent in some older logs: unknown
            span[E] = (
                rec["t"], rec.get("completion_tokens") or 0, rec.get("prompt_tokens"),
                rec.get("itl_hist"), rec.get("attempt"), raw, rec.get("last_token_t"),
                rec.get("usage_estimated") is True, rec.get("at_once") is True,
                type(chunks) is int and chunks < 2,
            )  # fmt: skip

    def _count_conn(self, rec: Record) -> None:
        if rec.get("reused"):
            self.sum.reused_conns += 1
        else:
            self.sum.new_conns += 1

    def _rate_wait(self, rec: Record, raw: bytes) -> None:
        """Our own rate limit held an attempt; before attempt 1 the span is not yet admitted."""
        s = self.sum
        s.rate_waits += 1
        if rec.get("attempt") == 1:
            s.rate_wait_first_s += rec["wait"]
        else:
            s.rate_wait_retry_s += rec["wait"]

    def _rate_learned(self, rec: Record, raw: bytes) -> None:
        """The shard set the pace it learned of the server's limit: `rps` requests and `tps`
        tokens a second (either may be absent), from the limit a 429 stated (`seeded`) or cut.
        A line with neither is ignored; one that re-split a seeded pace over the shards now
        live (`resplit`: fewer, or a replacement joined) sets the pace but is no seed or cut of
        its own."""
        rps, tps = _number(rec.get("rps")), _number(rec.get("tps"))
        if rps is None and tps is None:
            return
        s = self.sum
        s.learned_seeded = rec.get("seeded") is True
        if rec.get("resplit") is not True:
            if s.learned_seeded:
                s.learned_seeds += 1
            else:
                s.learned_cuts += 1
        s.learned_rps, s.learned_tps = rps, tps

    def _retry(self, rec: Record, raw: bytes) -> None:
        s = self.sum
        cause = str(rec.get("cause"))
        s.retries[cause] = s.retries.get(cause, 0) + 1
        per_minute = s.retry_minutes.setdefault(int(rec["t"] // 60), {})
        per_minute[cause] = per_minute.get(cause, 0) + 1
        if rec.get("why") != RATE_LIMITED:  # a hold is its why: 429s were retried before holds
            return
        s.held_retries += 1
        # An item counts once however often the limit held it (a span never opened in this
        # log, read from its middle, not at all).
        sid = rec.get("span")
        span = self.open.get(sid) if isinstance(sid, str) else None
        if span is not None and not span[H]:
            span[H] = True
            s.limited_spans += 1

    # -- a successful span ---------------------------------------------------------------------

    def _close_ok(self, span: list[Any], t_rel: float, raw: bytes, refusal: bool) -> None:
        s = self.sum
        end = span[E]
        if end is None:
            s.ok_without_attempt += 1
            return
        end_t, tokens, prompt_tokens, itl, attempt, end_raw, end_last, estimated, at_once, \
            one_piece = end
        s.ok += 1
        s.refusals += refusal
        s.completion_tokens += tokens
        if estimated:
            s.estimated_ok += 1
            s.estimated_tokens += tokens
        lines: tuple[bytes, ...]
        if span[L] is not None and span[LA] == attempt:
            # Older layout: the final attempt's own last_token line holds the instant.
            last, lines = span[L], (span[LR], end_raw, raw)
        else:
            # attempt_end's last_token_t; no content token at all: attempt_end's own t.
            last, lines = (end_last if end_last is not None else end_t), (end_raw, raw)
        self.tally.count(last, tokens, lines if self.keep_lines else (), estimated)
        if self.full:
            self._latency(span, t_rel, last, tokens, prompt_tokens, itl, at_once, one_piece)

    def _latency(self, span: list[Any], t_rel: float, last: float, tokens: int,
                 prompt_tokens: int | None, itl: dict[str, int] | None, at_once: bool,
                 one_piece: bool) -> None:
        q, a, st = span[Q], span[A], span[S]
        if q is None or a is None or st is None:
            self.sum.ok_incomplete += 1  # its earlier lines were not in this log
            return
        c = span[C] if span[C] is not None else st
        f = span[F] if span[F] is not None else last
        i = segment_of(prompt_tokens, span[PC])
        seg = self.segments.get(i) or self.segments.setdefault(i, Segment())
        seg.spans += 1
        # In `_segments.PENDING` order: the six buckets, e2e.
        seg.pending.append((a - q, st - a, c - st, f - c, last - f, t_rel - last, t_rel - q))
        if not at_once:  # its first token came with the rest: no TTFT, and gaps of 0
            seg.first.append((f - q, f - st))
            # An answer in one content chunk (a whole answer in an old log, or one event)
            # has its first and last token at one instant: no TPOT, not 0.
            if tokens >= 2 and not one_piece:
                seg.tpot.append((last - f) / (tokens - 1))
        if len(seg.pending) >= FLUSH_AT:
            seg.flush()
        if itl:
            counts = seg.itl
            for b, n in itl.items():
                counts[b] = counts.get(b, 0) + n

    # -- the end -------------------------------------------------------------------------------

    def finish(self, end_t: float | None = None) -> ShardSummary:
        """The summary; scheduler integrals run to `end_t` (default: the last event seen)."""
        s = self.sum
        end = end_t if end_t is not None else s.last_t
        sched = self.sched
        if end is not None:
            sched.advance(end)
        for seg in self.segments.values():
            seg.flush()
        s.open_spans = len(self.open)
        s.queue_depth, s.in_flight = sched.q, sched.f
        s.backlog_s, s.gap_s, s.idle_s = sched.backlog, sched.gap, sched.idle
        s.busy_slot_s, s.cap_slot_s = sched.busy_slots, sched.cap_slots
        s.sending_slot_s = sched.sending_slots
        s.minutes = self.tally.cells()
        s.segments = self.segments
        s.loop_lag = self.loop_lag
        s.trace = sched.trace
        return s


def _number(value: Any) -> float | None:
    """A JSON number as a float; None for anything else (a bool is no number)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None

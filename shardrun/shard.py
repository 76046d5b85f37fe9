"""One shard: admits items under its cap, runs their attempts, writes events, results, dead letters.

`run_shard()` holds all of a shard's work and takes its transport as two callables, so a test can
run a shard in-process and a placement can run it anywhere. The process entry is
`_shard_main.py`. Nothing here reads the job file or the input, or assumes the coordinator shares
this filesystem: configuration and items arrive as messages (see `protocol.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import socket
import sys
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from shardrun import __version__, events, protocol
from shardrun._chunks import QUOTA_NAMES, clip, masked
from shardrun._urls import credentials_advice, masked_url, under_v1
from shardrun.client import (
    AttemptCancelled,
    AttemptOutcome,
    StreamingClient,
    Timeouts,
    make_session,
    refused_stream_options,
    request_headers,
)
from shardrun.clock import Clock
from shardrun.event_names import RATE_LIMITED
from shardrun.fdlimit import OUT_OF_FILES, ensure_open_files
from shardrun.items import API_PATHS, build_request, prompt_chars, tokens_of_chars
from shardrun.outage import (
    PROBE_MAX_S,
    RECHECK_S,
    STORM_AFTER,
    OutageWatch,
    StormWatch,
    says_endpoint_down,
    says_endpoint_failing,
    says_endpoint_up,
)
from shardrun.ratelimit import RateLimiter, request_tokens, stated_cap, tokens_used
from shardrun.resume import share_lock
from shardrun.retry import (
    Decision,
    Retrier,
    RetryPolicy,
    is_retryable,
    over_whole_limit,
    server_wait,
)
from shardrun.shard_config import ABANDON, DEAD_LETTER, Counters, ShardConfig
from shardrun.shard_output import ShardOutput
from shardrun.spans import Span, dead_record, result_record

__all__ = ["ABANDON", "DEAD_LETTER", "Counters", "Shard", "ShardConfig", "run_shard"]

Send = Callable[[protocol.Message], None]
Receive = Callable[[], Awaitable[protocol.Message | None]]

FLUSH_INTERVAL_S = 0.2
TICK_S = 1.0  # loop-lag samples and checkpoints
# `attempt_end` carries `at_once` only when true: most lines stay as short as they were.
_AT_ONCE = {"at_once": True}
# Connection failures, with no connection ever made, after which the endpoint counts as
# unreachable and the shard stops sending requests (instead of retrying every item).
UNREACHABLE_AFTER = 3
UNREACHABLE_STATUSES = frozenset({"conn_reset", "timeout_connect"})
# Requests refused in a row with one and the same HTTP 4xx answer, before any success, after
# which the job (not an item) is taken to be wrong: a parameter or model the server refuses.
# Item-specific refusals (a prompt over the context length) differ from item to item.
REFUSED_ALIKE_AFTER = 10
STORM = "endpoint_failing"  # the cause and why of a retry held in a storm
OUTAGE = "endpoint_down"  # of one held while the endpoint is down
# The longest a failure asking to wait above retry.max_server_wait_s waits for the storm watch
# to decide whether its streak is a storm (`Shard._storm_decides`).
STREAK_WAIT_S = 5.0
# How long a storm may last before any request of the run succeeded (`_storm_too_long`).
UNPROVEN_STORM_S = 60.0
# The interval between fresh probes while only the model list answers and the last one
# failed (`Shard._send_list_probe`): one item a shard every 0.75 s goes beside the cap and,
# failing too, is held there with the others. An answer to any of them ends the state, so a run
# of prompts the server resets is told from a backend down after as many probes as the run is
# long; a backend down costs an item of the backlog a probe, held until it is back.
LIST_PROBE_S = 0.75


def pool_size(cap: int) -> int:
    """The connections of a shard's session pool (`make_session`): one for each request that
    may be out at once, the cap's and the one fresh probe beside it (the spans held beside the
    cap take a slot of it before they go again, `Shard._take_a_slot`). Sized to the cap alone,
    the probe waited in the pool for a connection once the list-only state ended, the wait
    counted in connect_s, and it ended timeout_connect: a false outage, whose probe's GET of
    the model list waited in the full pool too, stopped the run at retry.outage_s."""
    return cap + 1


class Shard:
    """The state of one running shard."""

    def __init__(self, cfg: ShardConfig, send: Send, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.send = send
        self.clock = clock or Clock()
        self.clients: dict[str, StreamingClient] = {}  # by API: one Batch file may mix both
        self.counters = Counters()
        self.retrier = Retrier(RetryPolicy(**cfg.retry))
        self.outage = OutageWatch(self.retrier.policy.outage_s)
        self.endpoint_back = asyncio.Event()
        self.endpoint_back.set()
        self.prober: Span | None = None  # the one span trying the endpoint while it is down
        self.outage_cause = ""  # the latest failure of an outage, for the stop's sentence
        # When the latest attempt the endpoint answered (`outage.says_endpoint_up`) started.
        self.answered_start = -math.inf
        # Since when the server has answered its model list but not our requests: an outage's
        # probe found the list answering (None: not so, or a request was answered since).
        self.list_only_since: float | None = None
        # While it is so, items failing with no answer are held (`_hold_for_a_fresh_item`),
        # oldest first, and the span probing for them.
        self.list_held: deque[Span] = deque()
        self.list_probe: Span | None = None
        # That probe failed too: the backend is down behind a list that answers (an outage the
        # list does not end), and when the next may go.
        self.list_down = False
        self.list_next_probe_at = 0.0
        # Spans beside the cap waiting for a slot of it to go again (`_take_a_slot`): a slot
        # whose span ends is handed to them before the queue's next item (`_pass_slot`).
        self.slot_wanted: deque[asyncio.Future[None]] = deque()
        # A storm: the endpoint answers, but fails every request (`shardrun.outage`).
        self.storm = StormWatch(STORM_AFTER)
        self.storm_probe: Span | None = None  # the one span trying the endpoint in a storm
        self.storm_held: deque[Span] = deque()  # the others, in turn to probe, oldest first
        # Set at news for the held spans (then replaced): wakes them to look again.
        self.storm_news = asyncio.Event()
        self.storm_cause = ""  # the latest failure of the storm, for the progress line
        self.storm_asked_until = -math.inf  # until when the server last asked us to wait
        self.deciding = 0  # failures waiting for the storm watch to decide (`_storm_decides`)
        # Since when every answer has been a 429 (rate limited), none a success (None: not so);
        # the items are held meanwhile (`_hold_for_limit`), and retry.outage_s of it stops.
        self.limited_since: float | None = None
        # The pace learned of the server's limit when it was last set, as its `rate_learned`
        # line says: requests a second, tokens a second (None: no such pace), and whether it
        # was set from the limit a 429 stated rather than cut.
        self.paced_rps: float | None = None
        self.paced_tps: float | None = None
        self.paced_seeded = False
        # For the live view's "nothing heard for": attempts out now, when one last ended with an
        # answer, and the last moment none was out (`_unheard_s`).
        self.sending = 0
        self.answer_at = self.quiet_since = self.clock.now()
        # For its "server queueing": the successes' times to first token, summed in ms, how
        # many, and their prompts' characters. A server's own queue lengthens these; a long
        # answer does not, and a long prompt's prefill does, which its characters tell.
        self.first_token_ms = self.first_tokens = self.first_token_chars = 0
        self.queue: deque[Span] = deque()
        self.sem = asyncio.Semaphore(cfg.concurrency)
        self.tasks: set[asyncio.Task[None]] = set()
        self.wakeup = asyncio.Event()
        self.want_pending = False
        self.input_ended = False
        self.stopping = False
        self.fatal_reason: str | None = None
        self.fatal_mode = DEAD_LETTER
        self.ok_once = False
        self.run_answered = False  # another shard has had a success (`protocol.ANSWERED`)
        self.ever_connected = cfg.answered_before or cfg.endpoint_watched
        # Raised to what the pool needs where the hard limit allows (`fdlimit`): the cap's
        # connections and those of the spans beside it (`pool_size`).
        self.open_files = ensure_open_files(pool_size(cfg.concurrency))
        self.connect_failures = 0
        self.refusal: str | None = None  # the last HTTP 4xx answer, before any success
        self.refusals = 0  # how many attempts in a row got exactly that answer
        self.seq = 0
        self.minute_tokens: dict[str, int] = {}
        # Why items were dead-lettered, for the run's summary: {kind: [count, first reason]}.
        # A kind is the retry decision and the last attempt's status ("max_attempts http_5xx"),
        # so it stays a handful of keys however many items fail.
        self.dead_reasons: dict[str, list[Any]] = {}
        # Spans still open that have failed attempts, and how many: those attempts are in the
        # counters already. The coordinator needs it when this shard dies with lines written
        # after its last report (`summary.add_unreported`), so that it counts them once. Each
        # report carries only its changes (a storm holds an entry for every slot).
        self.tried = protocol.CountChanges()
        # Likewise the held retries of 429s each such span has sent, which `limited_429s`
        # counts as they go: a dead letter's attempts mark them (`held`), reported or not.
        self.held = protocol.CountChanges()
        # And their 429s, which `http_429s` counts as each attempt ends: a retry out at a report
        # is in `tried` before its answer is, so `tried` cannot tell whether its 429 was counted.
        self.refused = protocol.CountChanges()
        self.out = ShardOutput(cfg, self._on_write_error)
        self.log = self.out.log
        # Every shard has a limiter: without job limits it still honours the server's headers,
        # pausing no longer than the job lets the server make it wait (max_server_wait_s).
        # Set by a stop or a fatal error: a retry's wait, or one for the rate limit, ends at
        # once then (`_pause`): no attempt follows either (no request may start after a stop,
        # and a shard stopped after 429s alone had a span wait 20 s more for a pace of one
        # request a minute).
        self.halted = asyncio.Event()
        self.params_cap = stated_cap({}, cfg.params)  # an item without a body states it
        self.limiter = RateLimiter(cfg.rate.get("rpm"), cfg.rate.get("tpm"),
                                   max_pause_s=self.retrier.policy.max_server_wait_s,
                                   sleep=self._pause, phase=cfg.rate_phase,
                                   stopped=self.halted.is_set, shards=cfg.shard_count)

    # -- messages from the coordinator ---------------------------------------------------------

    def on_message(self, message: protocol.Message) -> None:
        kind = message["t"]
        if kind == protocol.ITEMS:
            self.want_pending = False
            for item in message["items"]:
                self._enqueue(item)
        elif kind == protocol.END:
            self.want_pending = False
            self.input_ended = True
            if self.deciding or self.list_held:  # the items left may be too few for their
                self._wake_held()  # streak, or none left to probe with
        elif kind == protocol.FATAL:
            self._go_fatal(str(message.get("reason", "endpoint unusable")),
                           str(message.get("mode", DEAD_LETTER)), tell=False)
        elif kind == protocol.ANSWERED:
            self.run_answered = True
        elif kind == protocol.RATE:
            if self.limiter.set_share(message.get("rpm"), message.get("tpm"),
                                      message.get("live")) and not self.input_ended:
                # Re-split over the shards now live, logged and reported while there is input
                # to pace: once it has ended, shards finish one by one and each survivor's pace
                # rises to the whole share of those gone, so the paces last logged, summed as
                # `report` and the summary sum them, read as up to twice the server's limit.
                self._paced(self.clock.now(), resplit=True)
        elif kind in (protocol.STOP, protocol.ABORT):
            self.stopping = True
            self.halted.set()
            self._wake_held()
            self._abandon_queued()
            if kind == protocol.ABORT:
                for task in self.tasks:
                    task.cancel()
        self.wakeup.set()

    def _enqueue(self, item: dict[str, Any]) -> None:
        self.seq += 1
        span = Span(f"{self.cfg.span_prefix}{self.seq}", item, self.clock.now())
        self.counters.received += 1
        span.prompt_chars = chars = prompt_chars(item)
        self.log.emit(events.QUEUED, t=span.queued_at, span=span.span_id, id=item["id"],
                      prompt_chars=chars)
        if self.fatal_reason is not None and self.fatal_mode == DEAD_LETTER:
            self._dead_letter(span, self.fatal_reason, admitted=False)
        elif self.fatal_reason is not None or self.stopping:  # none of it is admitted now
            self._abandon(span, admitted=False)
        else:
            self.queue.append(span)

    def _request_more(self) -> None:
        """Ask for work while the local queue is below the cap (one request outstanding)."""
        if self.want_pending or self.input_ended or self.stopping or self.fatal_mode == ABANDON:
            return
        cap = self.cfg.concurrency
        if len(self.queue) < cap:
            self.want_pending = True
            self.send({"t": protocol.WANT, "n": 2 * cap - len(self.queue)})

    # -- admission -----------------------------------------------------------------------------

    async def dispatch(self) -> None:
        """Admit queued spans whenever a slot is free, until the input ends or a stop.

        It may wait long for a slot or for the rate limit, so it runs as a task beside
        `_drain`, which may cancel it once a stop's grace period is over.
        """
        while not self.stopping and not (self.fatal_reason and self.fatal_mode == ABANDON):
            self._request_more()
            if not self.queue:
                if self.input_ended:
                    return
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            await self.sem.acquire()
            if self._pass_slot():  # a span beside the cap was waiting for it
                continue
            if self.stopping or not self.queue or self.fatal_mode == ABANDON:
                self.sem.release()
                continue
            span = self.queue.popleft()
            try:
                await self._rate_wait(span, 1)
            except asyncio.CancelledError:  # the grace period ended: no attempt for the span
                self._abandon(span, admitted=False)
                self.sem.release()
                raise
            if self.stopping:  # a stop came during the rate wait: start no attempt after it
                self._abandon(span, admitted=False)
                self.sem.release()
                continue
            # The span is admitted by its task, when that first runs: the loop's delay before
            # then is queueing, and t_retry of a first-try success stays 0 (DESIGN §3).
            task = asyncio.create_task(self._hold_slot(span))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            task.add_done_callback(functools.partial(self._never_ran, span))

    def _never_ran(self, span: Span, _task: asyncio.Task[None], *, permit: bool = True) -> None:
        """A slot's task cancelled before its first step (a stop's end, a second Ctrl-C) ran
        none of its code, not even its `finally`: release its span and permit here (a list-only
        probe's task holds none, `_send_list_probe`)."""
        if span.admitted_at is None and not span.ended:
            self._abandon(span, admitted=False)
            if permit:
                self._free_slot()
            if self.list_probe is span:
                self.list_probe = None

    async def _pause(self, seconds: float) -> None:
        """A retry's wait, and the rate limiter's sleep: a stop or a fatal error ends it (no
        attempt follows either), so the run stops when it is called, not after the longest
        wait (a probe napping a 20 s Retry-After held a storm's stop 17 s past
        retry.outage_s)."""
        if not self.halted.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.halted.wait(), seconds)

    async def _probe_pause(self, seconds: float) -> None:
        """An outage probe's wait before it tries again (`_pause`), over too once the endpoint
        is back by another word: a request of ours answered (`_endpoint_up`). The items waiting
        on the probe go then; the probe itself slept out its interval (up to PROBE_MAX_S), its
        slot idle, and then went on its own, no longer the probe, beside whichever item had
        taken its place. Back already (an answer came while its GET of the model list was out:
        the failure that made the outage had cleared it), it goes at once: it slept out its
        whole interval then, as a plain pause."""
        back = self.endpoint_back
        if back.is_set():
            return
        waits = [asyncio.ensure_future(event.wait()) for event in (self.halted, back)]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _back_off(self, seconds: float) -> None:
        """A retry's backoff (`_pause`), cut short when a storm begins: the item then joins the
        held ones at once, in the order they failed. The streak's items before the one that
        made the storm sat out their backoff (up to backoff_s and more) while that one, alone
        in the queue, probed again and again: 3 of its 4 attempts in 0.75 s, and under load the
        4th dead-lettered it in a storm that should have dead-lettered nothing."""
        if self.storm.on:  # a storm's own retry of another kind (a 429, a timeout): as before
            await self._pause(seconds)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (not self.storm.on and not self.halted.is_set()
               and (left := deadline - loop.time()) > 0):
            with contextlib.suppress(TimeoutError):  # a stop or a fatal error is news too
                await asyncio.wait_for(self.storm_news.wait(), left)

    def _stated_cap(self, item: dict[str, Any]) -> int | None:
        """`stated_cap` of an item: the job's, worked out once, unless the item has a body of its
        own (an OpenAI Batch line; `stated_cap` reads a falsy body as none)."""
        return self.params_cap if not item.get("body") else stated_cap(item, self.cfg.params)

    async def _rate_wait(self, span: Span, attempt: int) -> None:
        """Wait for the job's rate limit before an attempt; a wait is its own event.

        Before the first attempt the span is not yet admitted, so the wait is part of t_queue
        and the report can tell "held by our rate limit" from "held by the cap".
        """
        if not span.charged:  # the same item and params give the same estimate every attempt
            span.charged = request_tokens(span.prompt_chars, self._stated_cap(span.item))
        waited = await self.limiter.acquire(span.charged)
        # The clock is read only after a wait: without limits this costs next to nothing. A
        # wait a stop or a fatal error cut short is not counted: no attempt follows it.
        if waited > 0 and not self.halted.is_set():
            self.counters.rate_waits += 1
            self.counters.rate_wait_ms += round(waited * 1000)
            self.log.emit(events.RATE_WAIT, t=self.clock.now() - waited, span=span.span_id,
                          id=span.item_id, attempt=attempt, wait=waited)

    def _admit(self, span: Span) -> None:
        # The first attempt starts at this very time (`_attempt`): nothing awaits in between.
        span.admitted_at = self.clock.now()
        self.counters.in_flight += 1
        self.log.emit(events.ADMITTED, t=span.admitted_at, span=span.span_id, id=span.item_id)

    async def _hold_slot(self, span: Span) -> None:
        """Run spans while work is queued, holding one permit of the cap throughout.

        A finished span hands its slot straight to the next queued one in the same task.
        Releasing the permit and letting the dispatcher re-acquire it would leave the slot
        empty for two passes of the event loop, which shows up as lost occupancy.
        """
        try:
            while True:
                if self.stopping:  # a stop came before the span's turn: start no attempt after it
                    self._abandon(span, admitted=False)
                    return
                await self._run_span(span)
                if (self.stopping or self.fatal_reason is not None or not self.queue
                        or self.slot_wanted):  # a span beside the cap goes first (`_free_slot`)
                    return
                span = self.queue.popleft()
                self._request_more()
                await self._rate_wait(span, 1)
        except asyncio.CancelledError:  # the grace period ended, or a second Ctrl-C
            if not span.ended:  # no verdict on the item: released as abandoned, for --resume
                self._abandon(span, admitted=span.admitted_at is not None)
            raise
        except Exception as exc:  # a bug, or an error no one foresaw: never a silent end
            self._unexpected(span, exc)
        finally:
            self._free_slot()

    def _pass_slot(self) -> bool:
        """Hand the caller's slot of the cap to a span beside it waiting for one
        (`_take_a_slot`); False when none waits."""
        while self.slot_wanted:
            wanted = self.slot_wanted.popleft()
            if not wanted.done():
                wanted.set_result(None)
                return True
        return False

    def _free_slot(self) -> None:
        """A slot of the cap is free: to a span beside it waiting for one, else to the queue.
        Released to the semaphore, it went to the dispatcher first, and a slot hands itself to
        the queue's next item while there is one: the spans held beside the cap waited for the
        input's end."""
        if not self._pass_slot():
            self.sem.release()

    async def _take_a_slot(self, span: Span) -> None:
        """A span sent beside the cap (`_send_list_probe`) takes a slot of it before it goes
        again: released at once, the probes held beside the cap through a long restart (one
        every LIST_PROBE_S) went out together beyond the cap and its connection pool. It waits
        for a slot whose span ends, or a stop or a fatal error (the caller then ends it)."""
        if not self.sem.locked():
            await self.sem.acquire()  # free now: taken without a wait
            span.beside_cap = False
            return
        # An outage's or a storm's probe hands its role on: the spans in the slots may be
        # waiting for its word, and none would end to give it one (a stall to retry.outage_s).
        if self.prober is span:
            self.prober = None  # a span waiting for the endpoint takes over (`_wait_for_endpoint`)
        if self.storm_probe is span:
            self.storm_probe = None  # the next held in turn probes, at the time set already
            self._wake_held()
        wanted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.slot_wanted.append(wanted)
        halted = asyncio.ensure_future(self.halted.wait())
        try:
            await asyncio.wait((wanted, halted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            halted.cancel()
            if wanted.done() and not wanted.cancelled():
                span.beside_cap = False  # the slot is its own now, released at its end
            else:
                wanted.cancel()
                self.slot_wanted.remove(wanted)

    async def _run_span(self, span: Span) -> None:
        """Admit a span and run its attempts to its end."""
        self._admit(span)
        try:
            await self._attempts(span)
        finally:
            self.counters.in_flight -= 1
            if self.list_probe is span:  # it ended (a stop, a fatal error) as the probe
                self.list_probe = None
            if self.storm_probe is span:  # it ended (or was cancelled) as the probe
                self._probe_done()
            elif self.deciding or self.list_held:  # one fewer that may join their streak,
                self._wake_held()  # or tell the held items anything

    async def _attempts(self, span: Span) -> None:
        cfg = self.cfg
        api, body = build_request(span.item, model=cfg.model, params=cfg.params,
                                  api=cfg.api, stream_usage=cfg.stream_usage)  # type: ignore[arg-type]
        client = self.clients[api]
        attempt = 0
        while True:
            attempt += 1
            if self.fatal_reason is not None:
                self._end_early(span)
                return
            if attempt == 1:
                self.retrier.budget.first_attempts += 1
            if attempt > 1:
                if span.beside_cap:
                    await self._take_a_slot(span)
                await self._rate_wait(span, attempt)
                while await self._storm_comes_first(span):
                    await self._rate_wait(span, attempt)
                if self.stopping:  # a retry after a stop: no verdict on the item (see below)
                    self._abandon(span)
                    return
                if self.fatal_reason is not None:  # one came while it waited for the limit
                    self._end_early(span)
                    return
            outcome = await self._attempt(client, span, attempt, body)
            self._settle_rate(span, outcome)
            if outcome.status == "ok":
                self._succeed(span, outcome)
                return
            self._note_failure(outcome, client.url)
            if self._endpoint_down(span, outcome):
                if await self._wait_out_outage(client, span, attempt):
                    continue
                return
            if span.list_only_now and self._list_may_probe():
                again = await self._hold_for_a_fresh_item(span, attempt, outcome)
                if again is None:
                    return
                if again:
                    continue
            if outcome.status == "http_429" and self.fatal_reason is None:  # not a quota's
                if over_whole_limit(outcome.error):  # no wait cures it: dead now, as a 4xx
                    self._limit_answered(span)
                    self._dead_letter(span, f"request_over_limit: {outcome.error}")
                    return
                if await self._hold_for_limit(span, attempt, outcome):
                    continue
                return
            if outcome.http_status is not None:  # another answer: not every one is a 429
                self._limit_answered(span)
            storm = False
            if self._first_cut(span, outcome):
                span.outage_tries += 1
                decision = Decision(True, wait=self.retrier.backoff(1), why="stream_cut")
            elif self._first_list_only(span):
                span.outage_tries += 1
                decision = Decision(True, wait=self.retrier.backoff(1), why="list_only")
            else:
                storm = self._storm_failed(span, outcome)
                decision = self._decide(span, attempt, outcome, storm=storm)
                if decision.why == "server_wait_too_long" and await self._storm_decides(span,
                                                                                        outcome):
                    storm = True
                    decision = self._decide(span, attempt, outcome, storm=storm)
            held = storm and decision.retry  # it waits its turn to probe: how long, unknown
            span.history[-1]["wait"] = decision.wait if decision.retry and not held else None
            if self.fatal_reason is not None:
                self._end_early(span)
                return
            if self.stopping and is_retryable(outcome.status, outcome.http_status):
                # Shutting down: a passing failure now (often the endpoint going away with us)
                # is no verdict on the item, even where it used the last attempt or the retry
                # budget up. It ends with no line and runs again on --resume.
                self._abandon(span)
                return
            if not decision.retry:
                if decision.why == "retry_budget_exhausted":
                    self.counters.budget_exhausted += 1
                self._dead_letter(span, _reason(decision.why, decision.wait, outcome))
                return
            # A storm's retries name it as their cause, as an outage's do (the attempt_end line
            # has the status): `report` tells them apart.
            self._plan_retry(span, attempt, cause=STORM if held else outcome.status,
                             wait=None if held else decision.wait,
                             why=STORM if held else decision.why)
            self.counters.retrying += 1
            try:
                if not held:
                    await self._back_off(decision.wait)
                if self.storm.on:  # held, or a storm began during its backoff: one at a time
                    await self._ride_out_storm(span)
            finally:
                self.counters.retrying -= 1

    async def _hold_for_limit(self, span: Span, attempt: int, outcome: AttemptOutcome) -> bool:
        """A 429 that is no quota's says the shard sends faster than the server allows, not
        that the item is wrong: the item tries again, spending neither its attempts nor the
        retry budget, after the wait the server asked for (at most retry.max_server_wait_s),
        or one growing with the item's holds where it asked none (`_unasked_hold`); and the
        shard slows down, every request paced by what it learned of the server's limit
        (`RateLimiter.limited`), so the retry and the items after it wait their turn as
        `rate_wait`. False once the span has ended: a stop,
        429s alone for retry.outage_s (`_limited_too_long`), or this item refused that long
        while the server answered others (a dead letter)."""
        now = self.clock.now()
        if self.limited_since is None:
            self.limited_since = now
        # The requests sent: those ended, and those out now (its first 429 may be its first end).
        if self.limiter.limited(self.counters.attempts + self.sending, outcome.rate_headers,
                                outcome.error, span.charged):
            # Logged at a seed or a cut only (a window of requests apart at least), not as each
            # success grows it: `report` reads the pace the server's limit left the shards from
            # these, and the progress reports carry the same figures. A pace of tokens may stand
            # alone: no `rps` then, where 0 would say the shard sent nothing. A pace only
            # lowered to a stated limit's share is marked as a re-split is: no cut of its own.
            self._paced(now, resplit=self.limiter.capped)
        if self.stopping:
            self._abandon(span)  # a passing failure in a stop: no verdict on the item
            return False
        if self._limited_too_long(now):
            self._end_early(span)
            return False
        policy = self.retrier.policy
        if span.limited_at is None:
            span.limited_at = now
        elif now - span.limited_at >= policy.outage_s:
            # The server answered others meanwhile (else `_limited_too_long` stopped the run):
            # this one it keeps refusing, as a token limit may a prompt too big to fit among
            # smaller ones. A bound, so that no item cycles for the rest of the run unheard of.
            self._dead_letter(span, f"rate_limited_too_long: refused with 429 for "
                                    f"{now - span.limited_at:.0f} s while the server answered "
                                    f"other requests; last: {outcome.error}")
            return False
        span.outage_tries += 1
        span.limit_holds += 1
        asked = server_wait(429, outcome.retry_after, outcome.rate_headers)
        wait = (self._unasked_hold(span.limit_holds) if asked is None
                else min(asked, policy.max_server_wait_s))
        span.history[-1]["wait"] = wait
        self._plan_retry(span, attempt, cause=outcome.status, wait=wait, why=RATE_LIMITED)
        self.counters.retrying += 1
        try:
            await self._pause(wait)
        finally:
            self.counters.retrying -= 1
        return True

    def _unasked_hold(self, holds: int) -> float:
        """A held item's wait where the 429 asked none (no Retry-After, no reset header), at its
        `holds`-th hold: half the ceiling of the backoff after that many failures (at most
        PROBE_MAX_S) and a jittered half of it, so the wait grows with the item's holds and is
        never near none. The first backoff alone (0 to 0.5 s, full jitter) sent an item back
        within half a second however often refused: over the limit, the same items were
        refused again and again, a burst of 429s for every cut of the pace."""
        policy = self.retrier.policy
        ceiling = min(policy.backoff_s * 2.0 ** min(holds - 1, 30), policy.backoff_max_s,
                      PROBE_MAX_S)
        return ceiling / 2 + min(self.retrier.backoff(holds), ceiling) / 2

    def _paced(self, now: float, *, resplit: bool = False) -> None:
        """Log the limiter's learned paces (`rate_learned`) and keep them for the reports;
        `resplit`: a seeded pace re-split to its share of the shards now live, raised as they
        end or lowered as one joins, or a pace lowered to the first limit stated for it: no
        pace learned anew (marked on the line, so that `report` counts no seed or cut for it)."""
        lim = self.limiter
        self.paced_rps = None if lim.learned is None else round(lim.learned, 4)
        self.paced_tps = None if lim.learned_tokens is None else round(lim.learned_tokens, 2)
        self.paced_seeded = lim.seeded
        fields: dict[str, Any] = {k: v for k, v in (("rps", self.paced_rps),
                                                    ("tps", self.paced_tps)) if v is not None}
        if lim.seeded:
            fields["seeded"] = True
        if resplit:
            fields["resplit"] = True
        self.log.emit(events.RATE_LEARNED, t=now, **fields)

    def _limit_answered(self, span: Span) -> None:
        """An answer other than a 429: not every one is a 429 any more, unless its request
        went before the first of them (a 429 and the success of a request sent with it come
        back together: the success says nothing of the server since)."""
        since = self.limited_since
        if since is not None and (span.attempt_started_at or 0.0) >= since:
            self.limited_since = None

    def _limited_too_long(self, now: float) -> bool:
        """Stop the run once every answer has been a 429 for retry.outage_s: a limit used up
        for long (a daily one), or a key the server allows nothing; True when it stopped."""
        since = self.limited_since
        if since is None or now - since < self.retrier.policy.outage_s or self.stopping:
            return False
        self._go_fatal(f"the endpoint answered every request with 429 (rate limited) for "
                       f"{now - since:.0f} s, longer than retry.outage_s; {self.cfg.way_on} "
                       f"once its limit lets requests through again", ABANDON)
        return self.fatal_reason is not None

    async def _storm_comes_first(self, span: Span) -> bool:
        """A retry whose wait for the rate limit ended in a storm that began during it waits
        its turn to probe, as one napping its backoff does (`_back_off`); True when it is then
        to wait for the limit again (the request it was paced for was never sent). Before, the
        retries past their backoff and in line for the limit as the storm began went out at
        the limit's pace beside the storm's queue (0.05 s apart under rpm 1200, where the 503s
        asked for 0.3 s), spending their attempts."""
        if (not self.storm.on or self.storm_probe is span or self.stopping
                or self.fatal_reason is not None):
            return False
        self.counters.retrying += 1
        try:
            await self._ride_out_storm(span)
        finally:
            self.counters.retrying -= 1
        return not self.stopping and self.fatal_reason is None

    def _decide(self, span: Span, attempt: int, outcome: AttemptOutcome, *,
                storm: bool) -> Decision:
        """Retry or give up after a failed attempt; tries made while the endpoint was down are
        not the item's attempts, nor, before any success of the run, retries in a storm."""
        if storm and not self._proven() and attempt - span.outage_tries > 1:
            span.outage_tries += 1  # a retry, not the item's attempt: `_storm_failed`
        return self.retrier.decide(outcome.status, outcome.http_status,
                                   attempt - span.outage_tries, outcome.retry_after,
                                   outcome.rate_headers, budgeted=not storm)

    async def _storm_decides(self, span: Span, outcome: AttemptOutcome) -> bool:
        """Whether the streak this failure joined turns out a storm: a failure of the server's
        own asking to wait above retry.max_server_wait_s, which outside a storm dead-letters,
        waits for the storm watch to decide, at most STREAK_WAIT_S. In a storm it is held like
        the others; before, the streak's first failures died at once (7 per shard, 14 of 200
        items at 2 x 8 with Retry-After 30 and a ceiling of 2 s). The wait ends at the streak's
        end (a success sent after its first failure, then it dead-letters) or a stop."""
        if not says_endpoint_failing(outcome.status):
            return False
        storm, deadline = self.storm, self.clock.now() + STREAK_WAIT_S
        self.deciding += 1
        try:
            while (span.span_id in storm.failing and not storm.on and not self.halted.is_set()
                   and not self.stopping and self._streak_may_grow()
                   and not self._storm_begun_by(outcome)
                   and (left := deadline - self.clock.now()) > 0):
                with contextlib.suppress(TimeoutError):  # the event of the news after this look
                    await asyncio.wait_for(self.storm_news.wait(), min(left, RECHECK_S))
        finally:
            self.deciding -= 1
        return storm.on and span.span_id in storm.failing

    def _storm_begun_by(self, outcome: AttemptOutcome) -> bool:
        """Begin the storm where the streak has become long enough with no new failure (the
        input ended since, and the items left are all in it: `_streak_may_grow` took the
        streak's new length); whether it began."""
        now = self.clock.now()
        if not self.storm.due(now):
            return False
        self._storm_begins(now)
        self._storm_heard(outcome, now)
        return True

    def _streak_may_grow(self) -> bool:
        """Whether items that may still fail could make the streak a storm: only other
        requests of this shard can, and a failure waiting for the watch holds its slot. At a
        cap of 1, or with every slot held so, nothing more goes out; a shard's last items may
        be too few. Waiting then only delayed the dead letter by STREAK_WAIT_S (11 s against
        1 s for 60 items at a cap of 1 with two such asks). The other items in flight may have
        failed already (counted twice): the bound is an upper one, so no storm is missed. The
        streak's length is taken anew: the input may have ended since its last failure."""
        self.storm.after = self._streak_after()
        others = self.counters.in_flight - self.deciding  # the waiting ones are in the streak
        if self.deciding < self.cfg.concurrency:  # a slot free for the queued items
            if not self.input_ended:
                return True  # more items to come
            others += len(self.queue)
        return len(self.storm.failing) + others >= self.storm.needed()

    @staticmethod
    def _first_cut(span: Span, outcome: AttemptOutcome) -> bool:
        """Whether this is the item's first stream cut mid-answer (the connection lost after
        tokens had come). Such a cut says nothing about the item, and a server restart cuts
        every stream in flight at once: charged, they would use the retry budget up in one
        blow and dead-letter the items the restart happened to be answering. The first cut
        of an item is retried without spending its attempts or the budget; the retry then
        meets the endpoint down (held as an outage) or up. A second cut is the item's own."""
        if span.cut_once or outcome.status != "conn_reset" or not outcome.content_chunks:
            return False
        span.cut_once = True
        return True

    @staticmethod
    def _first_list_only(span: Span) -> bool:
        """Whether this failure is the item's first while only the model list answered, at
        the input's tail (else it is held for a fresh item's word, `_hold_for_a_fresh_item`):
        it is retried free, after its backoff. A restart behind a listener that outlives the
        server has the list answered first (the probe's GET waits in the listener), and a
        second restart soon after cut the held items, which went again at once, each charged
        (23 of 300 dead-lettered at 1 x 64 with the defaults). The next is the item's own."""
        if not span.list_only_now or span.list_free_used:
            return False
        span.list_free_used = True
        return True

    def _endpoint_down(self, span: Span, outcome: AttemptOutcome) -> bool:
        """Count the failure if it is the endpoint's (see `outage`); whether it is down now."""
        span.list_only_now = False
        if not says_endpoint_down(outcome.status, outcome.http_status, outcome.content_chunks):
            span.down_failure_at = None  # its latest failure is another kind (a cut stream...)
            if says_endpoint_up(outcome.status, outcome.http_status):
                self._endpoint_answered(span)
            return False
        now = self.clock.now()
        if self._list_only(span, outcome):
            span.down_failure_at = now  # the item's own (but its first): no outage
            span.list_only_now = True
            return False
        last = span.down_failure_at
        own = last is not None and self.outage.since is None and self.answered_start > last
        self.outage.failed(now)  # the item's own failure too: others failing after it are held
        if own and span.held_again:
            # The endpoint answered a request sent after this item last failed so, and no
            # request has failed so since: it is serving, and this item is what it cannot
            # answer (its attempts are spent, not held forever). Answers to requests sent
            # before then say nothing: a server shutting down finishes those it has.
            return False
        # The first time, the endpoint may as well be down again: a restart following one,
        # which the items held in the first meet alone when they go again at its end (the
        # first of them was charged). Held once like the others; the next time it is its own.
        span.held_again |= own
        span.down_failure_at = now
        # Before the endpoint ever answered this run, `_note_failure` judges it unreachable
        # (every item failed with the cause, promptly); after, it is waited for.
        down = self.outage.down and self.ever_connected
        if down:
            self.endpoint_back.clear()
            self.outage_cause = outcome.error or outcome.status
        return down

    def _list_only(self, span: Span, outcome: AttemptOutcome) -> bool:
        """Whether a failure that says the endpoint is down may be the item's own after all:
        the server has answered its model list since the request was sent, but not our
        requests (`list_only_since`). Such a failure is held while another item can tell
        (`_hold_for_a_fresh_item`); at the input's tail it is charged, from an item's second on
        (its first is retried free, `_first_list_only`). When the list's answer ended every
        outage, the items held went again at once and all failed again, the first charged and
        the rest held anew: 1,499 requests for 300 items in 2.7 s. A request that found no
        connection at all is the server gone again (restarted): that ends this, and is an
        outage as before."""
        since = self.list_only_since
        if since is None:
            return False
        if outcome.conn_ready_at is None and outcome.http_status is None:
            self._list_only_ends()
            return False
        return (span.attempt_started_at or 0.0) >= since

    def _list_may_probe(self) -> bool:
        """Whether something may yet tell an item that failed while only the model list
        answers whether the server behind it is up: a request out, a fresh item queued or to
        come, or the fresh probe out. Else it is the input's tail, and the item is charged."""
        return bool(self.queue or not self.input_ended or self.list_probe is not None
                    or self.sending)

    async def _hold_for_a_fresh_item(self, span: Span, attempt: int,
                                     outcome: AttemptOutcome) -> bool | None:
        """Hold an item whose request failed with no answer while only the model list
        answers, spending neither its attempts nor the budget, until another item tells: one
        in flight, or a fresh one (not failed in this state) sent beside the cap as the probe
        (`_send_list_probe`). A request of ours answered ends the state, and this item goes
        again (True): its next such failure is held once more, as any is, and the one after is
        its own (`held_again`, `_endpoint_down`). The probe failing too is the backend
        down behind the list, or its prompt is reset as well: it is held beside the cap, and
        the next fresh item probes LIST_PROBE_S later, in any number, until one is answered
        (the prompts held are then told apart as above) or retry.outage_s stops the run. With
        nothing left to tell (the input's tail: no fresh item, nothing out), the item is charged
        (False): its prompt may be what the server resets, and the run must go on; a dead
        letter can go again with retry-failed. None: a stop or a fatal error ended the span."""
        span.outage_tries += 1
        span.history[-1]["wait"] = None
        self._plan_retry(span, attempt, cause=OUTAGE, wait=None, why=OUTAGE)
        held = self.list_held
        held.append(span)
        self.counters.retrying += 1
        try:
            while True:
                if self.fatal_reason is not None or self.stopping:
                    if self.fatal_reason is not None:
                        self._end_early(span)
                    else:
                        self._abandon(span)
                    return None
                if self.list_only_since is None:  # answered (or gone: an outage as before)
                    return self._list_release(span)
                if not self._list_may_probe():
                    span.outage_tries -= 1  # the tail: this failure is the item's, as before
                    span.retry_line = None
                    return False
                news, wait = self.storm_news, RECHECK_S
                if self.list_probe is None and not self.sending:
                    due = self.list_next_probe_at - self.clock.now()
                    if due > 0:
                        wait = min(due, RECHECK_S)
                    elif self.queue:
                        self._send_list_probe()
                        continue
                if not self.queue:
                    self._request_more()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(news.wait(), wait)
        finally:
            if span in held:
                held.remove(span)
            self.counters.retrying -= 1

    def _list_release(self, span: Span) -> bool:
        """A held item goes again: its retry line's wait is the time it was held."""
        line, now = span.retry_line, self.clock.now()
        if line is not None:  # it waited for the news, not a planned backoff
            line["wait"] = span.history[-1]["wait"] = max(0.0, now - line["t"])
        return True

    def _send_list_probe(self) -> None:
        """Send the queue's next item, fresh, as the probe of the items held while only the
        model list answers. It runs beside the cap, whose slots the held items keep: the
        shard has a request out more than its cap while it does, and a span in flight more for
        each such probe that failed and is held (each takes a slot to go again)."""
        span = self.queue.popleft()
        self.list_probe = span
        span.beside_cap = True
        self._request_more()
        task = asyncio.create_task(self._run_list_probe(span))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(functools.partial(self._never_ran, span, permit=False))

    async def _run_list_probe(self, span: Span) -> None:
        """Run the probe's span (`_send_list_probe`) as `_hold_slot` runs one, with no
        permit: it ends there, its slot-less run the probe's only."""
        try:
            await self._rate_wait(span, 1)
            if self.stopping:  # no attempt after a stop (`_attempts` ends it at a fatal error)
                self._abandon(span, admitted=False)
                return
            await self._run_span(span)
        except asyncio.CancelledError:
            if not span.ended:
                self._abandon(span, admitted=span.admitted_at is not None)
            raise
        except Exception as exc:  # as in `_hold_slot`
            self._unexpected(span, exc)
        finally:
            if not span.beside_cap:  # it took a slot of the cap to go again
                self._free_slot()
            self._wake_held()

    def _list_probe_ended(self, outcome: AttemptOutcome | None) -> None:
        """The fresh probe's attempt ended: a failure with no answer, while only the list
        still answers, is the backend down behind it: an outage, which its list does not end
        (`_wait_out_outage` asks it no more) and which stops the run at retry.outage_s, unless
        a request is answered first. The next fresh item probes LIST_PROBE_S later. A success
        or an answer ends the state on its own (`_endpoint_answered`)."""
        self.list_probe = None
        if (outcome is not None and self.list_only_since is not None
                and (outcome.conn_ready_at is not None or outcome.http_status is not None)
                and says_endpoint_down(outcome.status, outcome.http_status,
                                       outcome.content_chunks)):
            now = self.clock.now()
            self.list_down = True
            self.outage.failed(now)
            self.endpoint_back.clear()
            self.outage_cause = outcome.error or outcome.status
            self.list_next_probe_at = now + LIST_PROBE_S
        self._wake_held()

    def _list_only_ends(self) -> None:
        """The list's say is over (one of our requests was answered, or found no connection
        at all): the items held for a fresh probe go again."""
        self.list_only_since = None
        if self.list_down or self.list_held:
            self.list_down = False
            self.list_next_probe_at = 0.0
            self._wake_held()

    def _probe_answered(self, span: Span, _first_token_at: float) -> None:
        """The first token of a probe's answer: the endpoint answers again."""
        if span is self.prober or span is self.list_probe:
            self._endpoint_answered(span)
        if self.storm.failing:
            self._storm_success(span, finished=False)

    # -- storms: the endpoint answers, but fails every request (`shardrun.outage`) ------------

    def _storm_failed(self, span: Span, outcome: AttemptOutcome) -> bool:
        """Count a failure of the server's own toward a storm; whether one is on (then the
        item waits its turn to probe, and spends no retry budget; before any request of the
        run has succeeded, its retries spend no attempts either, its first failure only: a job
        the server fails from the start stops after a minute, `_storm_too_long`, and its items
        are better left for --resume than dead-lettered, as they were at a small cap, while
        max_attempts 1 still means no retry)."""
        if not says_endpoint_failing(outcome.status):
            return False
        storm, now = self.storm, self.clock.now()
        storm.after = self._streak_after()
        if storm.failed(span.span_id, now):
            self._storm_begins(now)
        if not storm.on:
            return False
        self._storm_heard(outcome, now)
        return True

    def _streak_after(self) -> int:
        """How many different items failing in a row make a storm, as the shard stands now
        (before the failure rate's say, `StormWatch.needed`)."""
        # Before any request of the run has succeeded, the items the cap holds make a storm
        # (two at least: one item alone is never one): at a small cap, eight different items
        # failing first took the retry budget and the attempts of most of them.
        after = STORM_AFTER
        if not self._proven():
            after = max(2, min(STORM_AFTER, self.cfg.concurrency))
        if self.input_ended:
            # A shard's last items, fewer than the streak: all of them failing with no success
            # between is the streak (a storm in a run's last seconds dead-lettered its tail).
            after = max(2, min(after, self.counters.in_flight + len(self.queue)))
        return after

    def _storm_begins(self, now: float) -> None:
        self.storm.next_probe_at = now + self._probe_interval()
        self._wake_held()  # failures waiting for the storm watch (`_storm_decides`)

    def _storm_heard(self, outcome: AttemptOutcome, now: float) -> None:
        """A failure in a storm: its cause for the progress line, and its Retry-After."""
        self.storm_cause = outcome.error or outcome.status
        asked = server_wait(outcome.http_status, outcome.retry_after, outcome.rate_headers)
        if asked is not None:  # the server says when to come back: no probe before then
            self.storm.next_probe_at = max(self.storm.next_probe_at,
                                           now + self._server_ask(asked, now))

    def _server_ask(self, asked: float, now: float) -> float:
        """A wait the server asked for in a storm, held to the job's ceiling on such waits (an
        ask above it is no dead letter here); noted for `_storm_too_long`."""
        asked = min(asked, self.retrier.policy.max_server_wait_s)
        self.storm_asked_until = max(self.storm_asked_until, now + asked)
        return asked

    def _proven(self) -> bool:
        """Whether a request of the run has succeeded (in this pass or an earlier one, in any
        shard)."""
        return self.ok_once or self.run_answered or self.cfg.answered_before

    def _probe_interval(self) -> float:
        return min(self.retrier.backoff(self.storm.probes + 1), PROBE_MAX_S)

    def _probe_done(self, outcome: AttemptOutcome | None = None) -> None:
        """The probe's attempt ended (None: it ended with no outcome, or its span did): unless
        the storm is over, the next span in turn probes after an interval, or after what the
        server asked for (`_storm_failed`)."""
        self.storm_probe = None
        if self.storm.on:
            self.storm.next_probe_at = self.clock.now() + self._next_probe_wait(outcome)
        self._wake_held()

    def _next_probe_wait(self, outcome: AttemptOutcome | None) -> float:
        """The interval grows with the probes failing as the storm does. A probe that ends
        otherwise (a 429, a timeout, a refusal of its item; a success ended the storm) says
        neither that the server still fails every request nor that it no longer does (a rate
        limit can stand in front of a broken server, a timeout is no answer): the next probe
        goes after the storm's first interval, or what a 429 asked for, not one grown long,
        which held the items that long after a server that had recovered."""
        if outcome is not None and says_endpoint_failing(outcome.status):
            self.storm.probes += 1
            return self._probe_interval()
        asked = None if outcome is None else server_wait(outcome.http_status,
                                                          outcome.retry_after,
                                                          outcome.rate_headers)
        ask = self._server_ask(asked, self.clock.now()) if asked else 0.0  # as for a 5xx's
        return max(min(self.retrier.backoff(1), PROBE_MAX_S), ask)

    def _storm_success(self, span: Span, *, finished: bool = True) -> None:
        storm = self.storm
        streak = bool(storm.failing)
        if storm.succeeded(span.attempt_started_at or 0.0, finished=finished) or (
                streak and not storm.failing):  # a streak's end: no storm (`_storm_decides`)
            self._wake_held()

    def _wake_held(self) -> None:
        # A new event for the next news, the old one left set: an event set and cleared at once
        # was missed by a waiter whose wait had not started yet (on Python 3.11, `wait_for` runs
        # it in a task of its own), which then slept until the recheck, up to 1 s.
        news, self.storm_news = self.storm_news, asyncio.Event()
        news.set()

    def _storm_too_long(self, now: float) -> str | None:
        """Why the run stops, once a storm has lasted `retry.outage_s`; or, before any request
        of the run succeeded, UNPROVEN_STORM_S if that is shorter: a job the server fails
        from the start is more likely wrong than the server overloaded, and its user should
        hear so in a minute, not in ten."""
        lasted, limit = self.storm.lasted(now), self.retrier.policy.outage_s
        if self._proven():
            if lasted < limit:
                return None
            return _failed_too_long(lasted, self.storm_cause, self.cfg.way_on)
        if lasted < min(limit, UNPROVEN_STORM_S):
            return None
        if lasted < limit and now < self.storm_asked_until + PROBE_MAX_S:
            return None  # the server said when to come back: ask it then (a probe's time)
        base_url, model = map(self.cfg.key_named, ("endpoint.base_url", "endpoint.model"))
        return (f"the endpoint failed every request for {lasted:.0f} s ({self.storm_cause}) and "
                f"none of this run has succeeded: check {base_url}, {model} and "
                "the job's params against the server (its log says why it fails), then "
                f"{self.cfg.way_on}")

    def _failing_limit(self, now: float) -> None:
        """Stop the run once an outage or a storm has lasted its limit, whatever its spans are
        doing (the ticker calls this once a second): they checked it only between their waits,
        and a storm's probe may nap a server's Retry-After (20 s of a storm against
        retry.outage_s 3), an outage's probe up to PROBE_MAX_S (4 s past an outage_s of 1)."""
        if self.fatal_reason is not None or self.stopping:
            return  # a stop is under way: no second reason to stop
        reason, cause = None, STORM
        if not self.endpoint_back.is_set() and self.outage.too_long(now):
            reason = _failed_too_long(self.outage.lasted(now), self.outage_cause,
                                      self.cfg.way_on)
            cause = OUTAGE
        elif self.storm.on:
            reason = self._storm_too_long(now)
        if reason is not None:
            self._go_fatal(reason, ABANDON, cause=cause)
        else:
            self._limited_too_long(now)

    async def _ride_out_storm(self, span: Span) -> None:
        """Wait in a storm until a success ends it, or until this span's turn to probe comes
        (then until the probe's time); a stop or a fatal error ends the wait too, and the
        caller then ends the span."""
        held = self.storm_held
        held.append(span)
        try:
            while self.storm.on and not self.stopping and self.fatal_reason is None:
                now = self.clock.now()
                if (reason := self._storm_too_long(now)) is not None:
                    self._go_fatal(reason, ABANDON, cause=STORM)
                    return
                if self.storm_probe is None and held[0] is span:
                    held.popleft()
                    self.storm_probe = span
                    await self._probe_nap(max(0.0, self.storm.next_probe_at - now))
                    return
                with contextlib.suppress(TimeoutError):  # the event of the news after this look
                    await asyncio.wait_for(self.storm_news.wait(), RECHECK_S)
        finally:
            if held and span in held:  # a stop, a fatal error or the storm's end: out of turn
                held.remove(span)

    async def _probe_nap(self, seconds: float) -> None:
        """The storm's probe's wait for its time (`_pause`), over too once the storm is: a
        success of another request (a first attempt sent in the storm, one sent as the streak
        grew) ended it, and the held retries go at once. Before, the probe slept out its
        interval or the server's Retry-After (5 s in a test) after they had all finished."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while (self.storm.on and not self.halted.is_set()
               and (left := deadline - loop.time()) > 0):
            with contextlib.suppress(TimeoutError):  # the storm's end, a stop: news all
                await asyncio.wait_for(self.storm_news.wait(), left)

    def _endpoint_answered(self, span: Span) -> None:
        """One of our requests was answered: whatever the model list said, they are served."""
        self._endpoint_up(span.attempt_started_at or 0.0)
        self._list_only_ends()

    def _endpoint_up(self, started: float) -> None:
        """The endpoint answered a request sent at `started`: an outage, if any, is over."""
        if started > self.answered_start:
            self.answered_start = started
        if not self.outage.streak and self.endpoint_back.is_set():
            return  # the common case, once per success: nothing to undo
        self.outage.answered()
        self.prober = None
        self.endpoint_back.set()

    async def _wait_out_outage(self, client: StreamingClient, span: Span, attempt: int) -> bool:
        """Wait to try again while the endpoint is down, spending neither the item's attempts
        nor the retry budget; False once the span has ended (a stop, or an outage too long).

        One span at a time probes the endpoint, at growing intervals of at most PROBE_MAX_S;
        the others wait for its answer, so a shard sends about one request per interval however
        many slots it has, and none while the endpoint is away. Before each wait the probe asks
        the server for its model list (`StreamingClient.answers`): an answer ends the outage at
        once, and until one of our requests is answered, their failures with no answer are held
        for a fresh item's word (`_list_answered`, `_list_only`, `_hold_for_a_fresh_item`). Not
        once a fresh item failed too (`list_down`): the list answers, the backend behind it does
        not. How long the outage lasts is the ticker's to judge (`_failing_limit`)."""
        if self.fatal_reason is not None or self.stopping:
            if self.prober is span:
                self.prober = None
            if self.fatal_reason is not None:
                self._end_early(span)
            else:
                self._abandon(span)
            return False
        span.outage_tries += 1
        probe = self.prober is None or self.prober is span
        tries = span.outage_tries - span.limit_holds  # never longer for its 429 holds
        wait = min(self.retrier.backoff(tries), PROBE_MAX_S) if probe else None
        span.history[-1]["wait"] = wait
        # Its cause names the outage (the attempt_end line has the status): `report` tells
        # these waits from a retry storm.
        self._plan_retry(span, attempt, cause=OUTAGE, wait=wait, why=OUTAGE)
        self.counters.retrying += 1
        try:
            if probe:
                self.prober = span
                asked = self.clock.now()
                # Behind a list that answered while a fresh item failed, its answer says nothing.
                if not self.list_down and await client.answers(PROBE_MAX_S):
                    self._list_answered(span, asked)
                else:
                    await self._probe_pause(wait or 0.0)
            else:
                await self._wait_for_endpoint()
        finally:
            self.counters.retrying -= 1
        return True

    def _list_answered(self, span: Span, asked: float) -> None:
        """The probe's GET of the model list, sent at `asked`, was answered: the outage is
        over, and until one of our requests is answered, their failures with no answer are
        their own (`_list_only`). The probe's retry goes now: its line says the time the check
        took, not the wait it was planned with (it said 5.0 s for a retry sent at once).
        Where one of our requests was answered while the GET was out (the outage is over
        already), the list adds nothing to that answer: no such state."""
        answered_meanwhile = self.outage.since is None
        self._endpoint_up(asked)
        now = self.clock.now()
        # Held since an earlier answer: judged from then.
        if self.list_only_since is None and not answered_meanwhile:
            self.list_only_since = now
        line = span.retry_line
        if line is not None:
            line["wait"] = span.history[-1]["wait"] = max(0.0, now - line["t"])

    async def _wait_for_endpoint(self) -> None:
        """Until the prober hears an answer, a stop or a fatal error comes, or the prober is
        gone without an answer (then this span may take over)."""
        while not (self.endpoint_back.is_set() or self.stopping or self.fatal_reason
                   or self.prober is None):  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.endpoint_back.wait(), RECHECK_S)

    def _plan_retry(self, span: Span, attempt: int, *, cause: str, wait: float | None,
                    why: str) -> None:
        """Note a retry decided now after failed attempt `attempt`; its `retry` line is written
        when the retry is sent (`_attempt`), so a retry a stop or a fatal error leaves unsent
        has none: the log, the summary and `report` count only retries sent (a run stopped in
        a storm counted 22 retries of 22 attempts, a retry rate of 137.5 %)."""
        span.retry_line = {"t": self.clock.now(), "span": span.span_id, "id": span.item_id,
                           "attempt": attempt, "cause": cause, "wait": wait, "why": why}

    def _settle_rate(self, span: Span, outcome: AttemptOutcome) -> None:
        """Correct the token charge by what the server counted; heed its rate-limit headers."""
        limiter = self.limiter
        if outcome.rate_headers:
            limiter.observe_headers(outcome.rate_headers)
        if limiter.tokens is None:
            return  # no token bucket: `correct` would do nothing, so skip working out usage
        used = tokens_used(outcome.status, outcome.prompt_tokens, outcome.completion_tokens,
                           outcome.wasted_tokens, tokens_of_chars(span.prompt_chars))
        # A request with no cap of its own is charged a guess the server never counts.
        limiter.correct(span.charged, used, self._stated_cap(span.item) is not None)

    async def _attempt(self, client: StreamingClient, span: Span, attempt: int,
                       body: dict[str, Any]) -> AttemptOutcome:
        sid, iid = span.span_id, span.item_id
        # A first attempt starts when its span is admitted (`_hold_slot` admits it just before),
        # so a first-try success has t_retry 0 exactly, as DESIGN §3 defines it.
        started = span.admitted_at if attempt == 1 else None
        if started is None:
            started = self.clock.now()
        span.attempt_started_at = started
        if span.retry_line is not None:  # its `t` is when it was decided, before this line's
            self.log.emit(events.RETRY, **span.retry_line)
            # Counted as it is sent, as `report` counts its line: a shard killed while it is
            # out counts it too (its attempt, out, from `sending`), and `tried` says so.
            self.counters.retries += 1
            self.tried.set(sid, attempt)
            # A hold's 429 is counted as its retry goes, as `report` counts its line: not one
            # a stop or a fatal error ended during the wait (nor one a dead letter ended).
            if span.retry_line["why"] == RATE_LIMITED:
                self.counters.limited_429s += 1
                span.history[-1]["held"] = True
                self.held.set(sid, self.held.counts.get(sid, 0) + 1)
            span.retry_line = None
        self.log.emit(events.ATTEMPT_START, t=started, span=sid, id=iid, attempt=attempt)
        # No callbacks: the attempt's transitions are read off the outcome and logged on its
        # attempt_end line, one line where there were four (docs/ARCHITECTURE.md, Event log).
        # But for the probe of an endpoint that is down: its first token says the endpoint is
        # back, and the requests waiting for it go at once, not after the whole answer (a
        # minute of idle slots for a long one).
        probe = None
        if span is self.prober or span is self.storm_probe or span is self.list_probe:
            probe = functools.partial(self._probe_answered, span)
        outcome: AttemptOutcome | None = None
        self.sending += 1
        try:
            outcome = await client.attempt(body, on_first_token=probe)
        except AttemptCancelled as stop:  # a stop's end: the attempt still gets its line
            self._end_attempt(span, attempt, started, stop.outcome)
            raise
        finally:
            self.sending -= 1
            if self.storm_probe is span:
                self._probe_done(outcome)
            elif self.list_probe is span:
                self._list_probe_ended(outcome)
        if not outcome.status.startswith("timeout"):  # an answer, even a failure, is news
            self.answer_at = outcome.ended_at
        self._end_attempt(span, attempt, started, outcome)
        return outcome

    def _end_attempt(self, span: Span, attempt: int, started: float,
                     outcome: AttemptOutcome) -> None:
        sid, iid = span.span_id, span.item_id
        conn = outcome.conn_ready_at
        if conn is not None and outcome.conn_reused:
            conn = started  # A pooled connection is ready the moment the attempt starts.
        span.conn_ready_at = conn
        counters = self.counters
        counters.attempts += 1
        counters.http_429s += outcome.status == "http_429"
        counters.prompt_tokens += outcome.prompt_tokens or 0
        counters.cached_tokens += outcome.cached_tokens or 0
        wasted = outcome.wasted_tokens
        counters.wasted_tokens += wasted
        ok = outcome.status == "ok"
        # An answer that came at once (whole, or a stream a proxy held back) has its first token
        # at its end: it would read a long answer as a long queue on the live view's "server
        # queueing" figure.
        if ok and outcome.first_token_at is not None and not outcome.at_once:
            self.first_token_ms += round(1000 * (outcome.first_token_at - started))
            self.first_tokens += 1
            self.first_token_chars += span.prompt_chars
        self.log.emit(events.ATTEMPT_END, t=outcome.ended_at, span=sid, id=iid, attempt=attempt,
                      status=outcome.status, http=outcome.http_status,
                      retry_after=outcome.retry_after, conn_ready_t=conn,
                      reused=outcome.conn_reused, resent=outcome.resent,
                      first_token_t=outcome.first_token_at,
                      last_token_t=outcome.last_token_at, tokens=outcome.content_chunks,
                      prompt_tokens=outcome.prompt_tokens, cached_tokens=outcome.cached_tokens,
                      completion_tokens=outcome.completion_tokens,
                      reasoning_tokens=outcome.reasoning_tokens,
                      usage_estimated=outcome.usage_estimated, wasted_tokens=wasted,
                      error=outcome.error, itl_hist=outcome.itl.to_json() if ok else None,
                      **(_AT_ONCE if outcome.at_once else {}))  # the report's TTFT leaves it out
        span.history.append({"attempt": attempt, "status": outcome.status,
                             "http": outcome.http_status, "error": outcome.error,
                             "started_at": started, "ended_at": outcome.ended_at})
        if not ok:
            self.tried.set(sid, len(span.history))
            if outcome.status == "http_429":
                self.refused.set(sid, self.refused.counts.get(sid, 0) + 1)

    def _note_failure(self, outcome: AttemptOutcome, url: str) -> None:
        """Spot the failures that say the whole endpoint is unusable, not just this request."""
        http = outcome.http_status
        if outcome.error_code == OUT_OF_FILES:
            # Every later connection would fail the same way, and items would be dead-lettered
            # for a limit of this machine: stop, and leave them for --resume.
            self._go_fatal(f"this machine ran out of file descriptors ({outcome.error}) with "
                           f"{self.cfg.concurrency} connections per shard and a limit of "
                           f"{self.open_files} open files per process: raise it (ulimit -n) "
                           f"or lower the concurrency, then {self.cfg.way_on}", ABANDON)
            return
        if outcome.error_code in QUOTA_NAMES or http == 402:
            # OpenAI answers 429 once the account's credit is used up, OpenRouter 402 (Payment
            # Required): a retry never cures it, and every item would spend its attempts on it
            # (or, a 402 not being retried, be dead-lettered at once). Stop, and leave them for
            # --resume.
            self._go_fatal(f"the endpoint says the account's quota is used up "
                           f"({outcome.error or outcome.error_code}): add credit or raise the "
                           f"account's limit, then {self.cfg.way_on}", ABANDON)
            return
        if outcome.flagged:
            # A moderation check flagged this item's content (OpenRouter's 403): the item's
            # refusal alone, however many flagged items come in a row (a red-team dataset).
            self.ever_connected = True
            return
        if http == 401 or (http == 403 and not self.ok_once):
            # The error already reads "HTTP 401: <the server's message>".
            self._go_fatal("the endpoint refused the credentials "
                           f"({outcome.error or f'HTTP {http}'}): {credentials_fix(self.cfg)}, "
                           f"then {self.cfg.way_on}", ABANDON)
            return
        if http == 407:
            said = (outcome.error or "HTTP 407").removeprefix("the proxy answered ")  # a CONNECT
            self._go_fatal(f"the proxy refused the credentials ({said}); set them in the proxy "
                           "variable as http://user:password@host:port, then "
                           f"{self.cfg.way_on}", ABANDON)
            return
        if http == 404 and not self.ok_once:
            # No item makes a completions URL "not found": the path, the API or the model is
            # wrong, and every other request would end the same way. Stop with the items
            # unfinished, so a --resume with the right settings runs them.
            source = self.cfg.set_outside.get("endpoint.base_url")
            note = "" if source is None else f"from {source}; "
            fix = under_v1(self.cfg.base_url)  # a URL with no path: say the one meant
            serve = "serve under /v1" + ("" if fix is None else f": likely {fix}")
            self._go_fatal(f"POST {url} answered {outcome.error or 'HTTP 404'} before any "
                           f"request succeeded: check endpoint.base_url ({note}OpenAI-compatible "
                           f"servers {serve}), endpoint.api and "
                           f"{self.cfg.key_named('endpoint.model')}, then {self.cfg.way_on}",
                           ABANDON)
            return
        if (self.cfg.stream_usage and not self.ok_once
                and refused_stream_options(http, outcome.error)):
            # The server does not know the option that asks for usage in the stream (older
            # API versions and servers): every request would be refused the same way.
            self._go_fatal(f"the endpoint refused stream_options, which asks it to report "
                           f"usage in the stream ({outcome.error}): set endpoint.stream_usage: "
                           "false in the job file (completion tokens are then counted from the "
                           f"stream and marked estimated), then {self.cfg.way_on}", ABANDON)
            return
        if not self.ok_once and (outcome.not_an_answer or (
                outcome.status == "http_4xx" and not is_retryable(outcome.status, http))):
            # The same 4xx, or the same page that is no answer at all, for every request.
            self._note_refusal(outcome.error)
            return
        if self.ever_connected or outcome.conn_ready_at is not None:
            self.ever_connected = True
            return
        if outcome.status in UNREACHABLE_STATUSES:
            self.connect_failures += 1
            if self.connect_failures >= UNREACHABLE_AFTER:
                self._go_fatal(f"endpoint unreachable: {outcome.error or outcome.status}"
                               f"{self._url_set_outside()}")

    def _url_set_outside(self) -> str:
        """' (endpoint.base_url URL from env SHARDRUN_BASE_URL)' when a variable or a flag set
        the URL: in an incident, the job file is not where the wrong one is."""
        source = self.cfg.set_outside.get("endpoint.base_url")
        if source is None:
            return ""
        return f" (endpoint.base_url {masked_url(self.cfg.base_url)} from {source})"

    def _note_refusal(self, error: str | None) -> None:
        """Count refusals in a row with the same answer; enough of them stop the run (abandon,
        so that --resume with a fixed job runs the rest)."""
        self.ever_connected = True  # an HTTP answer came back
        if error != self.refusal:
            self.refusal, self.refusals = error, 0
        self.refusals += 1
        if self.refusals >= REFUSED_ALIKE_AFTER:
            self._go_fatal(f"the endpoint refused {self.refusals} requests in a row with the "
                           f"same answer before any succeeded ({error or 'no message'}): the "
                           "job's params, endpoint.base_url, endpoint.model or endpoint.api do "
                           "not suit this server; fix the job file, then "
                           f"{self.cfg.way_on_retrying}", ABANDON)

    def _unexpected(self, span: Span, exc: Exception) -> None:
        """An exception escaped a span: the traceback goes to the shard's log (its stderr), the
        run stops with one sentence, and this span, like every queued one, is left unfinished
        for --resume (unless it had already ended)."""
        sys.stderr.write(masked("".join(traceback.format_exception(exc))))  # it may quote one
        sys.stderr.flush()
        self._go_fatal(f"shard {self.cfg.shard} stopped on an unexpected {type(exc).__name__}: "
                       f"{clip(exc)} (the traceback is in its log); {self.cfg.way_on}",
                       ABANDON)
        if not span.ended:
            self._abandon(span, admitted=span.admitted_at is not None)

    def _go_fatal(self, reason: str, mode: str = DEAD_LETTER, *, tell: bool = True,
                  cause: str | None = None) -> None:
        """Stop sending requests; queued and later items end as `mode` says. `cause` names an
        outage or a storm that lasted too long, for the run's `run_end` line: a stop before
        any held retry was sent leaves no retry line to tell `report` so."""
        if self.fatal_reason is not None:
            return
        self.fatal_reason = reason
        self.fatal_mode = mode
        self.halted.set()
        if tell:
            self.send({"t": protocol.FATAL, "reason": reason, "mode": mode,
                       **({"cause": cause} if cause else {})})
        while self.queue:
            span = self.queue.popleft()
            if mode == DEAD_LETTER:
                self._dead_letter(span, reason, admitted=False)
            else:
                self._abandon(span, admitted=False)
        self.wakeup.set()
        self._wake_held()

    def _end_early(self, span: Span) -> None:
        assert self.fatal_reason is not None
        if self.fatal_mode == DEAD_LETTER:
            self._dead_letter(span, self.fatal_reason)
        else:
            self._abandon(span)

    # -- endings -------------------------------------------------------------------------------

    def _succeed(self, span: Span, outcome: AttemptOutcome) -> None:
        self.ever_connected = self.ok_once = True
        self._endpoint_answered(span)
        self._storm_success(span)  # every success: it tells a flaky server from a storm
        if self.limited_since is not None:  # 429s alone no longer, if sent after the first
            self._limit_answered(span)
        if self.limiter.learning:  # paced by the server's 429s: a little faster
            if self.limiter.grew(span.charged, outcome.rate_headers):
                self._paced(self.clock.now(), resplit=True)  # lowered to a first statement
            for kind, stated, lifted in self.limiter.take_uncapped():  # rare: once a statement
                self.log.emit(events.RATE_UNCAPPED, t=self.clock.now(), kind=kind,
                              stated=stated, lifted=lifted)
        released_at = self.clock.now()
        record = result_record(span, outcome, self.cfg.shard, released_at)
        if not self.out.add_result(span.item_id, record):
            self._abandon(span)
            return
        self.counters.ok += 1
        self.counters.completion_tokens += outcome.completion_tokens
        self.counters.reasoning_tokens += outcome.reasoning_tokens or 0
        self.counters.refusals += outcome.refusal is not None
        self.counters.estimated_ok += outcome.usage_estimated
        minute = str(int(record["last_token_at"] // 60))
        self.minute_tokens[minute] = self.minute_tokens.get(minute, 0) + outcome.completion_tokens
        # An answer that is a refusal says so on its `released` line, so the report counts
        # refusals from the event log alone, at no cost to the other lines.
        self.log.emit(events.RELEASED, t=released_at, span=span.span_id, id=span.item_id,
                      outcome="ok", reason=None if outcome.refusal is None else "refusal")
        span.ended = True
        if len(span.history) > 1:
            self.tried.drop(span.span_id)
            self.held.drop(span.span_id)
            self.refused.drop(span.span_id)

    def _dead_letter(self, span: Span, reason: str, *, admitted: bool = True) -> None:
        if not self.out.add_dead(span.item_id, dead_record(span, reason, self.cfg.shard)):
            self._abandon(span, admitted=admitted)
            return
        self.counters.dead += 1
        # The run's fatal reason is one kind, whether or not the item had an attempt.
        last = span.history[-1]["status"] if span.history and reason != self.fatal_reason else ""
        kind = f"{reason.split(':', 1)[0]} {last}".rstrip()
        if (seen := self.dead_reasons.get(kind)) is None:
            self.dead_reasons[kind] = [1, reason]
        else:
            seen[0] += 1
        self._release(span, "dead", reason, admitted)

    def _abandon_queued(self) -> None:
        """A stop: nothing queued will be admitted in this pass. Released now (abandoned, so
        --resume runs them), or the log would read as a backlog the scheduler left waiting
        through the whole grace period, and as spans still open in a finished run."""
        while self.queue:
            self._abandon(self.queue.popleft(), admitted=False)

    def _abandon(self, span: Span, *, admitted: bool = True) -> None:
        """End a span with no result or dead-letter line: the item stays unfinished."""
        self.counters.abandoned += 1
        self._release(span, "abandoned", self.fatal_reason, admitted)

    def _release(self, span: Span, outcome: str, reason: str | None, admitted: bool) -> None:
        released_at = self.clock.now()
        if not admitted:
            # Never admitted: record the admission at release so the step function stays exact.
            self.log.emit(events.ADMITTED, t=released_at, span=span.span_id, id=span.item_id)
        self.log.emit(events.RELEASED, t=released_at, span=span.span_id, id=span.item_id,
                      outcome=outcome, reason=reason)
        span.ended = True
        self.tried.drop(span.span_id)
        self.held.drop(span.span_id)
        self.refused.drop(span.span_id)

    def _on_write_error(self, path: Path, exc: OSError) -> None:
        self._go_fatal(f"cannot write {path}: {exc.strerror or exc}; free some space and "
                       f"{self.cfg.way_on}", ABANDON)

    # -- housekeeping --------------------------------------------------------------------------

    async def ticker(self) -> None:
        """Flush often, fsync on the configured interval, report progress after each flush;
        once a second, sample the event-loop lag and write a checkpoint."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time() + TICK_S
        next_sync = loop.time() + self.cfg.fsync_interval_s
        while True:
            expected = loop.time() + FLUSH_INTERVAL_S
            await asyncio.sleep(FLUSH_INTERVAL_S)
            now_loop = loop.time()
            if now_loop >= next_tick:
                next_tick += TICK_S
                now = self.clock.now()
                self.log.emit(events.LOOP_LAG, t=now, lag=max(0.0, now_loop - expected))
                self.log.checkpoint(now)
                self._failing_limit(now)
            sync = now_loop >= next_sync
            if sync:
                next_sync = now_loop + self.cfg.fsync_interval_s
            self.out.flush()
            self.send(self.report(protocol.PROGRESS))
            if sync:  # after the report: a kill during an fsync finds every written line told
                self.out.sync()

    def report(self, kind: str) -> protocol.Message:
        """A progress or done message; `fin_*` list the items whose lines are now flushed.
        Made only to be sent: it takes the changes to `tried` since the last one."""
        ok, dead = self.out.take_finished()
        now = self.clock.now()
        # While the endpoint is down, for how long: the progress display says so.
        down_s = 0.0 if self.endpoint_back.is_set() else self.outage.lasted(now)
        # `at`: when `sending` was read, so that a dead shard's lines tell which of their last
        # attempts it holds (`summary.add_unreported`).
        return {"t": kind, "at": now, "queued": len(self.queue), "cap": self.cfg.concurrency,
                "sending": self.sending, "unheard_s": self._unheard_s(),
                "fin_ok": ok, "fin_dead": dead, "dead_reasons": self.dead_reasons,
                "down_s": round(down_s, 1), "rate_waiting": self.limiter.pending,
                "paced_rps": self.paced_rps, "paced_tps": self.paced_tps,
                "paced_seeded": self.paced_seeded, "first_token_ms": self.first_token_ms,
                "first_tokens": self.first_tokens, "first_token_chars": self.first_token_chars,
                "failing_s": round(self.storm.lasted(now), 1),
                "failing_cause": self.storm_cause if self.storm.on else None,
                "tried": self.tried.take_changes(), "held": self.held.take_changes(),
                "refused": self.refused.take_changes(),
                **self.counters.as_dict()}

    def _unheard_s(self) -> float:
        """How long requests have been out with nothing heard: no stream's events, no answer
        (a timeout is none), since the last moment none was out."""
        now = self.clock.now()
        if not self.sending:
            self.quiet_since = now
        heard = max(self.quiet_since, self.answer_at,
                    *(client.heard_at for client in self.clients.values()))
        return round(max(0.0, now - heard), 1)

    def close(self) -> None:
        self.log.emit(events.SHARD_END, t=self.clock.now(), **self.counters.as_dict())
        self.log.checkpoint(self.clock.now())
        self.out.close()


def credentials_fix(cfg: ShardConfig) -> str:
    """`credentials_advice` for the shard's job: the key's variable counts once a key is set."""
    return credentials_advice(cfg.api_key_env if cfg.api_key is not None else None,
                              cfg.base_url, cfg.headers)


async def run_shard(cfg: ShardConfig, receive: Receive, send: Send) -> Counters:
    """Run one shard until its input ends (or a stop), then flush and report `done`."""
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    with share_lock(Path(cfg.out_dir)):
        return await _run_locked(cfg, receive, send)


async def _run_locked(cfg: ShardConfig, receive: Receive, send: Send) -> Counters:
    shard = Shard(cfg, send)
    shard.log.emit(events.SHARD_START, t=shard.clock.now(), cap=cfg.concurrency, pid=os.getpid(),
                   version=__version__, host=socket.gethostname())
    headers = request_headers(cfg.api_key, cfg.api_key_header, cfg.headers)
    timeouts = Timeouts(**cfg.timeouts)
    async with make_session(pool_size(cfg.concurrency), timeouts) as session:
        shard.clients = {api: StreamingClient(session, cfg.base_url, api, headers, timeouts,
                                              shard.clock, proxy=cfg.proxy,
                                              proxy_authorization=cfg.proxy_authorization,
                                              params=cfg.params)
                         for api in API_PATHS}
        reader = asyncio.create_task(_pump(receive, shard))
        ticker = asyncio.create_task(shard.ticker())
        dispatcher = asyncio.create_task(shard.dispatch())
        try:
            await _drain(shard, dispatcher)
        finally:
            for task in (reader, ticker, dispatcher):
                task.cancel()
            for task in list(shard.tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(reader, ticker, dispatcher, *shard.tasks,
                                     return_exceptions=True)
            shard.close()
    send(done_message(shard))
    return shard.counters


def done_message(shard: Shard) -> protocol.Message:
    """The shard's last report. No fatal stop in it: the coordinator has each one already, the
    FATAL message the shard sent as it stopped (earlier on the same pipe) or the one it relayed,
    and words the run's end from that, with the outage or storm that caused it."""
    return {**shard.report(protocol.DONE), "minutes": shard.minute_tokens}


async def _pump(receive: Receive, shard: Shard) -> None:
    """Feed coordinator messages to the shard; EOF (the coordinator died) means stop."""
    while True:
        message = await receive()
        if message is None:
            shard.on_message({"t": protocol.STOP})
            return
        shard.on_message(message)


async def _drain(shard: Shard, dispatcher: asyncio.Task[None]) -> None:
    """Wait for admission to end and in-flight spans to finish; once a stop arrives, only for
    the grace period, then cancel them (they end with no result line, for --resume).

    The grace period is timed here, beside the dispatcher and not after it: the dispatcher
    can be waiting for a slot (every one held by a stalled stream) or for the rate limit, and
    the in-flight spans must not get longer than the grace period for that.
    """
    loop = asyncio.get_running_loop()
    deadline: float | None = None
    while not dispatcher.done() or shard.tasks:
        if shard.stopping and deadline is None:
            deadline = loop.time() + shard.cfg.grace_s
        timeout = 0.25 if deadline is None else min(0.25, deadline - loop.time())
        if timeout <= 0:
            dispatcher.cancel()
            for task in shard.tasks:
                task.cancel()
            return
        waiting = [*shard.tasks] if dispatcher.done() else [dispatcher, *shard.tasks]
        done, _ = await asyncio.wait(waiting, timeout=timeout)
        if dispatcher in done:
            dispatcher.result()  # an error in admission ends the shard at once, as it did


def _failed_too_long(lasted: float, cause: str, way_on: str) -> str:
    """The run's stop after an outage or a storm of `retry.outage_s`."""
    return (f"the endpoint failed every request for {lasted:.0f} s ({cause}), longer than "
            f"retry.outage_s; {way_on} once it answers again")


def _reason(why: str, wait: float, outcome: AttemptOutcome) -> str:
    """A dead letter's reason: the decision, then what the last attempt said."""
    last = outcome.error or outcome.status
    if why == "server_wait_too_long":
        return f"server_wait_too_long: the server asked to wait {wait:.0f} s ({last})"
    return f"{why}: {last}"

"""A job-wide rate limit (requests and tokens per minute) shared by the shards.

The coordinator splits the job's `rate_limits` evenly: each live shard gets rpm/N and tpm/N
(`shares`), and sends new shares when a shard finishes or dies so the survivors use what it
left. A shard enforces its share with a `RateLimiter`: two pacers (requests, tokens) charged
when a request is reserved, corrected once the server's usage is known, and slowed further by
the server's own `x-ratelimit-*` headers before they turn into 429s.

`Pacer.take` is pay-after pacing (the generic cell rate algorithm): a request waits until the
debt the earlier ones ran up has been paid off at the rate, then adds its own cost to the
debt. So callers are served in the order they asked, a request goes out as soon as what came
before it is paid for (the first one at once, whatever its size, instead of first sitting out
its own cost), and over a long run the average is the rate. Requests are paced evenly instead
of in clumps, which is also what servers that count in sub-minute windows want to see: in any
window of T seconds a shard sends at most T times its share plus one request, as long as its
loop wakes on time: debt is paid by the clock, so the requests that fell due while a starved
shard slept go together when it wakes.

Shards start staggered: shard k of N begins with a debt of k/N of its first request
(`RateLimiter(phase=k/N)`), so the job's first requests are spread one job-wide interval apart
instead of N of them going out at once (8 shards under `rpm: 2` would otherwise send 8 in the
first second).

The clock and sleep are parameters: tests are plain arithmetic on a fake clock.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardrun.items import TOKEN_LIMITS, prompt_chars, tokens_of_chars

__all__ = [
    "DEFAULT_COMPLETION_TOKENS",
    "SERVER_LIMIT_SHARE",
    "Pacer",
    "RateLimiter",
    "estimate_request_tokens",
    "limit_set_pace",
    "parse_duration",
    "request_tokens",
    "shares",
    "stated_cap",
    "tokens_used",
]

DEFAULT_COMPLETION_TOKENS = 256
"""Completion tokens assumed for a request that sets no max_tokens (corrected afterwards)."""
SERVER_LIMIT_SHARE = 0.05
"""The share of the attempts held for the server's rate limit from which, with no pace learned
(cut or seeded), that limit is said to have set the run's pace (`limit_set_pace`): a few held
429s in a run of hundreds are a brush with the limit, not its ceiling."""
SEEDED_PACE_NEAR = 0.75
"""The share of a pace seeded from a stated limit that the run's requests must reach on average
for that limit to have set its pace (`limit_set_pace`): one that binds keeps the shards at it."""
RECHECK_S = 0.25
"""Longest sleep before a waiting request asks again: a new share from the coordinator or a
refund of tokens charged too much may let it go sooner."""
NEGLIGIBLE_S = 1e-6
"""A wait this short is none: float rounding leaves waits of 1e-17 s that a clock at 1e5 s
cannot even advance by."""
DEFAULT_PAUSE_S = 1.0
"""How long to hold off when the server says nothing is left but not when it resets."""
MAX_PAUSE_S = 60.0
"""Longest single pause taken on the server's word; the next response refreshes it. A job's
`retry.max_server_wait_s` below it lowers it for that job (`RateLimiter(max_pause_s=...)`)."""
LEARN_CUT = 0.7
"""A cut leaves the pace a shard learned of the server at this share of what it was sending
(TCP CUBIC's factor: a half left a shard at three quarters of the limit on average)."""
LEARN_SHARE = 0.3
"""The share of a window's requests that must have been 429s for a cut: a server that refuses a
fifth of the requests at random, whatever the pace, is not slowed down to nothing (cutting at
every 429, 20 % of them crawled to 1.6 requests a second), while one sending well past a real
limit (a 429 share of (pace - limit) / pace) still is."""
LEARN_WINDOW_S = 1.0
LEARN_WINDOW_N = 20
"""A window the 429 share is judged over: at least this long, with at least this many requests
sent (the first, from the shard's start, needs no time: its opening burst may be the cause)."""
LEARN_GROW = 0.05
"""What each success adds to the learned pace, in requests a second: successes coming at the
pace make it grow by 5 % a second, back from a cut in about 7 s, and on until the next one."""
LEARN_MIN_PER_S = 1 / 60
"""The slowest learned pace: a request a minute (a server answering only 429s stops the run
at retry.outage_s, `Shard._limited_too_long`)."""
ROOM_SHARE = 0.5
"""A pace held at its stated cap whose successes say, for a whole window (LEARN_WINDOW_N of them
over LEARN_WINDOW_S at least), that the key has more than this share of the stated limit left
(x-ratelimit-remaining-* against x-ratelimit-limit-*) is not held by that limit: the cap is
lifted (`RateLimiter.grew`). Half: a key paced at the limit it states keeps what it had left,
little after the 429s that seeded the pace, and a gateway replica stating its own limit sees a
part of the key's traffic. An honest limit counted over a full minute (OpenAI's) that refilled
while the shards paused (`observe_headers`, up to its reset) lifts too: the pace then spends
the burst the key holds, and comes back at a quarter left (PERFORMANCE.md). Back under half
of this share, a lifted cap is put back: the statement binds after
all, and the pace returns to it before the key runs dry."""
LIMIT_HEADER = "x-ratelimit-limit-requests"
"""OpenAI's statement of the key's limit, in requests a minute: a shard's first 429 that
carries it starts the learned pace at the shard's share of it (`RateLimiter.limited`)."""
TOKEN_LIMIT_HEADER = "x-ratelimit-limit-tokens"
_STATED_LIMIT = re.compile(r"Limit:? (\d+)")
"""The limit in a 429's words ("on tokens per min (TPM): Limit 30000, Used ..."), for a token
limit whose answer has no `TOKEN_LIMIT_HEADER`."""
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s|us|µs|ns)")
DURATION_MAX = 64
"""The longest reset header read as a duration ("1h2m3.5s" is 8): `_DURATION`'s scan takes
time quadratic in a run of digits with no unit, and a header of 8 KB of them (aiohttp's limit)
held the shard's event loop 0.9 s per response that carried it."""
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


@dataclass(slots=True)
class Pacer:
    """Paces units at `rate_per_s`. `take` gives a reservation its place in line: the total
    charged before it. It may go once that much has been paid, and paying runs at the rate,
    never ahead of what was charged (no credit builds up while idle). A new rate or a refund
    moves every place in line at once, so a wait is asked again (`wait`), not fixed when the
    reservation was made."""

    rate_per_s: float
    charged: float = 0.0
    paid: float = 0.0
    updated: float | None = None

    def __post_init__(self) -> None:
        if not self.rate_per_s > 0:
            raise ValueError(f"rate must be positive: {self.rate_per_s}")

    @property
    def debt(self) -> float:
        return self.charged - self.paid

    def _pay(self, now: float) -> None:
        if self.updated is not None and now > self.updated:
            self.paid = min(self.charged, self.paid + (now - self.updated) * self.rate_per_s)
        if self.updated is None or now > self.updated:
            self.updated = now

    def take(self, now: float, amount: float) -> float:
        """Reserve `amount`; its place in line, for `wait`."""
        self._pay(now)
        place = self.charged
        self.charged += amount
        return place

    def wait(self, now: float, place: float) -> float:
        """Seconds until the reservation at `place` may go (0 when it may now)."""
        self._pay(now)
        return max(0.0, (place - self.paid) / self.rate_per_s)

    def charge(self, now: float, amount: float) -> None:
        """Add `amount` to the debt without a place in line (negative: a refund, which pays
        off debt and so moves everyone waiting forward, never beyond what was charged)."""
        self._pay(now)
        if amount >= 0:
            self.charged += amount
        else:
            self.paid = min(self.charged, self.paid - amount)

    def retune(self, now: float, rate_per_s: float) -> None:
        """A new rate from `now` on; the debt already run up stays."""
        self._pay(now)
        self.rate_per_s = rate_per_s


def _pacer_for(per_minute: float | None) -> Pacer | None:
    if per_minute is None or math.isinf(per_minute):
        return None
    return Pacer(per_minute / 60.0)


def shares(rpm: float | None, tpm: float | None, live: int) -> tuple[float | None, float | None]:
    """Each of `live` shards' share of the job-wide limits (None stays unlimited)."""
    n = max(1, live)
    return (None if rpm is None else rpm / n), (None if tpm is None else tpm / n)


class RateLimiter:
    """One shard's share of the job's limits. Call `acquire` before every attempt."""

    def __init__(
        self,
        rpm: float | None,
        tpm: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        max_pause_s: float = MAX_PAUSE_S,
        phase: float = 0.0,
        stopped: Callable[[], bool] = lambda: False,
        shards: int = 1,
    ) -> None:
        """`phase` (0 <= phase < 1): the share of its first request this shard owes from the
        start, k/N for shard k of N, so the shards' first requests do not all go at once.
        `shards`: how many shards the run has, which share the server's limit of one key.
        `stopped` says no attempt may follow (a stop, a fatal error): a wait then ends at once
        (`sleep` returns early)."""
        self._clock, self._sleep, self._stopped = clock, sleep, stopped
        self.max_pause_s = min(max_pause_s, MAX_PAUSE_S)
        self.requests = _pacer_for(rpm)
        self.tokens = _pacer_for(tpm)
        self._phase = phase
        self._share_rpm, self._share_tpm = rpm, tpm
        self._shards = max(1, shards)
        # The server's limit as this shard learned it from its 429s (requests a second; None:
        # none yet); the window its 429s are judged over: since when (the shard's start, or
        # the last window's end), the requests sent by then, and the 429s since.
        self.learned: float | None = None
        # The same of a token limit, in tokens a second, learned from 429s that say tokens
        # (`_says_tokens`), and the tokens charged by the window's start.
        self.learned_tokens: float | None = None
        self.learning = False  # either is learned: each success grows it (`grew`)
        # The last `limited` only lowered a pace to the first limit stated for it (`_heard`),
        # no seed or cut: the shard logs that pace marked so, and `report` counts no cut.
        self.capped = False
        # The server's stated limits the paces were seeded from, a second for the whole key
        # (by the name of the pace: "learned", "learned_tokens"), with the slowest pace a seed
        # may take (`_share`'s floor), re-split by `set_share` until a cut of that pace says
        # the server allows less (`seeded`).
        self._stated: dict[str, tuple[float, float]] = {}
        # The limit the server last stated of each kind, kept through cuts (as `_stated`'s),
        # and this shard's share of it (`_caps`): no success grows a pace past that share.
        self._said: dict[str, tuple[float, float]] = {}
        self._cap: dict[str, float] = {}
        # A window of successes at a pace's cap whose headers said the key has room (since
        # when, how many; `_judge_room`), the limits stated of caps lifted for it, and the
        # lifts and returns not logged yet (`take_uncapped`).
        self._room: dict[str, tuple[float, int]] = {}
        self._lifted: set[str] = set()
        self._uncapped: list[tuple[str, float, bool]] = []
        self._since, self._sent_at_cut, self._refused = clock(), 0, 0
        self._tokens_at_cut, self._refused_tokens = 0.0, 0
        self.pause_until = -math.inf
        self.pending = 0
        self.pending_tokens = 0
        self.last_charge = 0

    def reserve(self, now: float, tokens: int) -> tuple[float | None, float | None]:
        """Charge one request and `tokens` at `now`; its places in line (requests, tokens)."""
        self.last_charge = tokens
        if self._phase:  # the first request only: start this shard's pacing staggered
            for pacer, amount in ((self.requests, 1), (self.tokens, tokens)):
                if pacer is not None:
                    pacer.charge(now, self._phase * amount)
            self._phase = 0.0
        requests, tokens_pacer = self.requests, self.tokens
        return (None if requests is None else requests.take(now, 1),
                None if tokens_pacer is None else tokens_pacer.take(now, tokens))

    def wait(self, now: float, places: tuple[float | None, float | None]) -> float:
        """Seconds from `now` until a reservation at `places` may go: both paid for, no
        server pause."""
        wait = self.pause_until - now
        request_place, token_place = places
        if request_place is not None and self.requests is not None:
            wait = max(wait, self.requests.wait(now, request_place))
        if token_place is not None and self.tokens is not None:
            wait = max(wait, self.tokens.wait(now, token_place))
        return max(0.0, wait)

    async def acquire(self, tokens: int) -> float:
        """Reserve, then sleep until the reservation is paid for and no server pause holds.

        `tokens` is the request's estimate: prompt tokens + max_tokens. The wait is asked
        again at least every `RECHECK_S`, since a new share or a refund may shorten it and a
        server pause lengthen it. Returns the seconds waited (0.0 when nothing held it back).
        """
        start = self._clock()
        places = self.reserve(start, tokens)
        wait = self.wait(start, places)
        if wait <= NEGLIGIBLE_S:
            return 0.0  # the common case: no sleep, no event
        self.pending += 1
        self.pending_tokens += tokens
        try:
            while wait > NEGLIGIBLE_S and not self._stopped():
                await self._sleep(min(wait, RECHECK_S))
                wait = self.wait(self._clock(), places)
        finally:
            self.pending -= 1
            self.pending_tokens -= tokens
        return max(0.0, self._clock() - start)

    def correct(self, charged: int, actual_total_tokens: int, capped: bool = True) -> None:
        """The server counted `actual_total_tokens` where `charged` was reserved: settle up.
        Not downwards for an answer of a request that states its own cap (`capped`:
        max_tokens or the like, `stated_cap`) once a token pace is learned of the server: its
        limit counts the prompt and that cap when the request comes, as OpenAI's does,
        whatever the answer used (refunding the unused cap sent a third more than the limit).
        A request with no cap is counted as it is answered, so the DEFAULT_COMPLETION_TOKENS
        guessed for it are settled as before: kept, it was paced far below the limit. A
        request refused or never answered (0) is refunded: the server counted nothing."""
        if self.tokens is None or charged == actual_total_tokens:
            return
        if 0 < actual_total_tokens < charged and capped and self.learned_tokens is not None:
            return
        self.tokens.charge(self._clock(), actual_total_tokens - charged)

    def set_share(self, rpm: float | None, tpm: float | None, live: int | None = None) -> bool:
        """A new share from the coordinator (a shard started, finished or died, or limits
        changed), with how many shards now share the limits (`live`; None: as before). A pace
        seeded from the server's stated limit and not cut since is re-split: raised to the
        survivors' share of that limit when fewer are left (one grown past it stays), lowered
        to it when more are (a replacement for a dead shard seeds at its share too: the others
        kept at theirs would send above the limit together). One cut stays as cut: the server
        allows less than it said. Every pace's cap (`grew`) is re-split the same way, and a pace
        above its new cap, cut or not, goes down to it. True when a pace was re-split (the caller
        logs it)."""
        now = self._clock()
        self._share_rpm, self._share_tpm = rpm, tpm
        resplit = False
        if live is not None and live != self._shards:
            fewer, self._shards = live < self._shards, max(1, live)
            for kind in self._said.keys() - self._lifted:  # a lifted cap stays lifted
                share, pace = self._reset_cap(kind), getattr(self, kind)
                # Above the new share (more shards): down to it, cut or not, or the shards
                # together send above the limit; below it (fewer): a seed not cut since rises
                # to it, a cut pace grows to it with the successes.
                if pace > share or (fewer and kind in self._stated and pace < share):
                    setattr(self, kind, share)
                    resplit = True
        self.requests = _retuned(self.requests, self._rpm(), now)
        self.tokens = _retuned(self.tokens, self._tpm(), now)
        return resplit

    @property
    def seeded(self) -> bool:
        """Every pace learned is as the server's stated limit set it (its share, or the re-split
        of `set_share`), none cut since: asked of each kind, since one `rate_learned` line
        carries both and a seeded pace of tokens beside a cut one of requests is no seed."""
        kinds = [kind for kind in ("learned", "learned_tokens") if getattr(self, kind) is not None]
        return bool(kinds) and all(kind in self._stated for kind in kinds)

    def _rpm(self) -> float | None:
        """The requests pacer's pace: the job's share or the learned pace, the slower."""
        return _slower(self._share_rpm, self.learned)

    def _tpm(self) -> float | None:
        """The tokens pacer's pace: the job's share or the learned pace, the slower."""
        return _slower(self._share_tpm, self.learned_tokens)

    def limited(self, sent: int, headers: Mapping[str, str] | None = None,
                error: str | None = None, tokens: int = 0) -> bool:
        """A 429 (rate limited, not a quota), after this shard had sent `sent` requests (those
        out now too), with the response's x-ratelimit-* `headers` and its `error` words, for a
        request charged `tokens`. It teaches a pace of requests, or of tokens where it says
        tokens (`_says_tokens`) and their limit, so that a big prompt waits its turn in the
        tokens pacer rather than being refused among small ones.

        The first one that states the limit (x-ratelimit-limit-*, or a token limit's words)
        while no such pace is learned sets it at this shard's share of the limit (`_share`)
        and starts a window; a later one that states a higher limit raises the pace's cap
        (`_heard`). Else, once the window since the last cut (or since the shard
        started) holds LEARN_WINDOW_N requests and has lasted LEARN_WINDOW_S (the first needs
        no time), it is judged: where more than LEARN_SHARE of its requests (of their tokens,
        for a token pace) were 429s, the learned pace is cut to LEARN_CUT of what the shard
        sent in it (at most of the learned pace, which stands alone where the window was too
        short to say a pace), and every request of the shard is paced by it from then on;
        either way a new window starts. True when it cut (or seeded, or capped a pace learned
        with no limit stated at the first one's share, `_heard`, which starts a window too). The
        429s of the requests sent at the old pace come back together after a cut or a cap: only
        a window of the new pace can cut again."""
        now = self._clock()
        headers = headers or {}
        self._room.clear()  # a 429 says the key had no room
        by_tokens = _says_tokens(headers, error, tokens)
        lowered = self.capped = False  # a pace learned with no limit stated, to the first's share
        if by_tokens:
            stated = headers.get(TOKEN_LIMIT_HEADER)
            if stated is None and (found := _STATED_LIMIT.search(error or "")):
                stated = found[1]
            if self.learned_tokens is None:
                self.learned_tokens = self._share(stated, max(1, tokens), "learned_tokens")
                if self.learned_tokens is not None:
                    self.tokens = _retuned(self.tokens, self._tpm(), now)
                    return self._new_window(now, sent)
            else:
                lowered = self._heard("learned_tokens", stated, max(1, tokens))
        elif self.learned is None:
            self.learned = self._share(headers.get(LIMIT_HEADER), 1, "learned")
            if self.learned is not None:
                self.requests = _retuned(self.requests, self._rpm(), now)
                return self._new_window(now, sent)
        else:
            lowered = self._heard("learned", headers.get(LIMIT_HEADER), 1)
        if lowered:  # a new pace, as after a cut: the 429s of the old one judge it no more
            self.capped = True
            return self._new_window(now, sent)
        self._refused += 1
        self._refused_tokens += tokens
        n, measured = sent - self._sent_at_cut, now - self._since
        if n < LEARN_WINDOW_N or (self.learning and measured < LEARN_WINDOW_S):
            return False
        if by_tokens and self.learned_tokens is not None and self.tokens is not None:
            # Judged in tokens: over a token limit the big requests are the ones refused, a
            # small share of the requests (never a cut) but a large one of the tokens.
            tokens_sent = self.tokens.charged - self._tokens_at_cut
            cut = self._refused_tokens > LEARN_SHARE * tokens_sent
            if cut:
                was = tokens_sent / max(measured, LEARN_WINDOW_S)
                self.learned_tokens = max(LEARN_MIN_PER_S * max(1, tokens),
                                          LEARN_CUT * min(was, self.learned_tokens))
                self.tokens = _retuned(self.tokens, self._tpm(), now)
                self._stated.pop("learned_tokens", None)
            self._new_window(now, sent)
            return cut
        cut = self._refused > LEARN_SHARE * n
        if cut:
            was = n / max(measured, LEARN_WINDOW_S)
            if self.learned is not None:
                was = min(was, self.learned)
            self.learned = max(LEARN_MIN_PER_S, LEARN_CUT * was)
            self.requests = _retuned(self.requests, self._rpm(), now)
            self._stated.pop("learned", None)
        self._new_window(now, sent)
        return cut

    def _new_window(self, now: float, sent: int) -> bool:
        """Judge 429s afresh from `now`, after `sent` requests; True (a pace was set)."""
        self.learning = self.learned is not None or self.learned_tokens is not None
        self._since, self._sent_at_cut, self._refused, self._refused_tokens = now, sent, 0, 0
        self._tokens_at_cut = 0.0 if self.tokens is None else self.tokens.charged
        return True

    def _share(self, limit: str | None, unit: int, kind: str) -> float | None:
        """This shard's share, a second, of the server's stated limit per minute, at least
        `unit` a minute (a request, or one request's tokens); None for none, or one that is no
        positive finite number (a gateway's own, or garbage). A start and a cap: a value per
        replica or per gateway that is too high is cut by the windows that follow, as any
        learned pace is, and the successes grow a pace back up to the share and no further
        (`grew`), so one too low holds until the server states another. The limit is kept as
        the `kind` of pace it seeds, for `set_share`."""
        per_minute = _number(limit)
        if per_minute is None or not 0 < per_minute < math.inf:
            return None
        self._stated[kind] = self._said[kind] = per_minute / 60.0, LEARN_MIN_PER_S * unit
        return self._reset_cap(kind)

    def _reset_cap(self, kind: str) -> float:
        """This shard's share, a second, of the limit the server last stated of the `kind` of
        pace, kept as that pace's cap. Never below a seed's own floor: a limit stated below a
        request a minute a shard leaves each shard that one request, however many join."""
        stated, floor = self._said[kind]
        cap = self._cap[kind] = max(floor, stated / self._shards)
        return cap

    def _heard(self, kind: str, limit: str | None, unit: int) -> bool:
        """The server stated its limit (per minute) again for a `kind` of pace already learned:
        a higher one than before raises the pace's cap (the limit was raised), for the
        successes to grow the pace to. A lower one leaves it: the pace over a limit lowered
        meets 429s, which cut it, and the statements of a gateway's replicas, each stating its
        own, would otherwise pull the cap down and up by turns. The first one stated for a
        pace learned without one caps it at once: True where that lowered the pace (kept above
        its cap until the next success, it was sent at and cut from, and logged, unheeded)."""
        pace = getattr(self, kind)
        if pace is None:
            return False
        per_minute = _number(limit)
        said = self._said.get(kind)
        if per_minute is None or not 0 < per_minute < math.inf or (
                said is not None and per_minute / 60.0 <= said[0]):
            return False  # the common case: the same limit again, or none stated
        self._said[kind] = per_minute / 60.0, LEARN_MIN_PER_S * unit if said is None else said[1]
        self._lifted.discard(kind)  # a new statement caps anew, to be judged as the first was
        cap = self._reset_cap(kind)
        if pace <= cap:
            return False
        setattr(self, kind, cap)
        now = self._clock()
        self.requests = _retuned(self.requests, self._rpm(), now)
        self.tokens = _retuned(self.tokens, self._tpm(), now)
        return True

    def grew(self, tokens: int = 0, headers: Mapping[str, str] | None = None) -> bool:
        """A success of a request charged `tokens`, with its x-ratelimit-* `headers`, while a
        learned pace holds: a little more pace (LEARN_GROW, of requests or of that request's
        tokens; the caller tests `learning` first, so a shard never limited pays nothing), up
        to this shard's share of the limit the server stated (`_cap`), if it stated one.

        Growth is for a pace below what the server allows: one cut (or seeded) too low, or a
        share that grew as shards ended (`set_share` raises the cap). Past a stated limit it
        only finds the 429s the server announced, a cut's episode of them; a limit the server
        raised is heard from its statement instead, here from a success's headers where they
        state it (a server stating it in a 429's words alone says so at its next 429). True
        where those headers first stated a limit for a pace learned without one and lowered it
        to its share (`_heard`), for the shard to log as a 429 that does so is logged."""
        now = self._clock()
        lowered = False
        if headers:
            lowered = self._heard("learned", headers.get(LIMIT_HEADER), 1)
            lowered |= self._heard("learned_tokens", headers.get(TOKEN_LIMIT_HEADER),
                                   max(1, tokens))
            self._judge_room("learned", "requests", headers, now)
            self._judge_room("learned_tokens", "tokens", headers, now)
        cap = self._cap
        if self.learned is not None:
            self.learned = min(self.learned + LEARN_GROW, cap.get("learned", math.inf))
            self.requests = _retuned(self.requests, self._rpm(), now)
        if self.learned_tokens is not None:
            self.learned_tokens = min(self.learned_tokens + LEARN_GROW * tokens,
                                      cap.get("learned_tokens", math.inf))
            self.tokens = _retuned(self.tokens, self._tpm(), now)
        return lowered

    def _judge_room(self, kind: str, name: str, headers: Mapping[str, str], now: float) -> None:
        """A success's word on the room the key has left of its stated limit (of `name`,
        "requests" or "tokens") for the `kind` of pace. A whole window of them at the pace's
        cap, each with more than ROOM_SHARE of the limit left, lifts the cap: the statement
        does not bind the key (a gateway replica's own, a limit raised, another model's), and
        growth goes on until a 429 cuts the pace, as with no statement. One with less than
        half of that left while lifted puts the cap back at the pace's share of the statement."""
        if kind not in self._cap and kind not in self._lifted:
            return  # no statement caps this pace: nothing to lift (the common case, no parse)
        pace = getattr(self, kind)
        limit = _number(headers.get(f"x-ratelimit-limit-{name}"))
        left = _number(headers.get(f"x-ratelimit-remaining-{name}"))
        if pace is None or limit is None or left is None or not 0 < limit < math.inf:
            return
        if kind in self._lifted:
            if left < ROOM_SHARE / 2 * limit:
                self._lifted.discard(kind)
                setattr(self, kind, min(pace, self._reset_cap(kind)))
                self._uncapped.append((name, limit, False))
            return
        cap = self._cap.get(kind)
        if cap is None or pace < cap or left <= ROOM_SHARE * limit:
            self._room.pop(kind, None)  # not at the cap, or the key near its limit: start again
            return
        since, n = self._room.get(kind, (now, 0))
        if n + 1 < LEARN_WINDOW_N or now - since < LEARN_WINDOW_S:
            self._room[kind] = since, n + 1
            return
        del self._room[kind], self._cap[kind]
        self._stated.pop(kind, None)  # no seed any more: the statement is not the key's limit
        self._lifted.add(kind)
        self._uncapped.append((name, limit, True))

    def take_uncapped(self) -> list[tuple[str, float, bool]]:
        """The caps lifted (True) or put back (False) since asked: (requests or tokens, the
        limit stated per minute, lifted), for the shard's log."""
        taken, self._uncapped = self._uncapped, []
        return taken

    def observe_headers(self, headers: Mapping[str, str], now: float | None = None) -> float:
        """Hold off until the server's reset when it has less left than we are about to send.

        Reads x-ratelimit-remaining-requests/-tokens and x-ratelimit-reset-requests/-tokens
        (lower-case names). `now` is on the limiter's clock (default: read it). Returns the
        pause set, in seconds from `now` (0.0 for none).
        """
        now = self._clock() if now is None else now
        pause = 0.0
        checks = (("requests", max(1, self.pending)),
                  ("tokens", max(1, self.pending_tokens, self.last_charge)))  # fmt: skip
        for kind, about_to_send in checks:
            remaining = _number(headers.get(f"x-ratelimit-remaining-{kind}"))
            if remaining is not None and remaining < about_to_send:
                reset = parse_duration(headers.get(f"x-ratelimit-reset-{kind}"))
                pause = max(pause, DEFAULT_PAUSE_S if reset is None else reset)
        pause = min(pause, self.max_pause_s)
        if pause > 0:
            self.pause_until = max(self.pause_until, now + pause)
        return pause


def _slower(share: float | None, learned_per_s: float | None) -> float | None:
    """A pacer's pace a minute: the job's share or the pace learned (a second), the slower."""
    if learned_per_s is None:
        return share
    learned = learned_per_s * 60.0
    return learned if share is None else min(learned, share)


def _says_tokens(headers: Mapping[str, str], error: str | None, tokens: int) -> bool:
    """A 429 of a token limit: its words say so (OpenAI's "on tokens per min (TPM)"), or, where
    they name neither, x-ratelimit-remaining-tokens has less than the request's `tokens` while
    requests remain."""
    words = (error or "").lower()
    if "tokens per min" in words:
        return True
    if "requests" in words:
        return False
    left = _number(headers.get("x-ratelimit-remaining-tokens"))
    requests_left = _number(headers.get("x-ratelimit-remaining-requests"))
    return left is not None and left < max(1, tokens) and not (
        requests_left is not None and requests_left < 1)


def _retuned(pacer: Pacer | None, per_minute: float | None, now: float) -> Pacer | None:
    """The pacer for a new per-minute share, keeping the old pacer's debt when it had one.
    No new pacer is made for that (`RateLimiter.grew` retunes at every success)."""
    if pacer is None or per_minute is None or math.isinf(per_minute):
        return _pacer_for(per_minute)
    pacer.retune(now, per_minute / 60.0)
    return pacer


def _number(text: str | None) -> float | None:
    try:
        return None if text is None else float(text.strip())
    except ValueError:
        return None


EPOCH_S = (1e9, 1e11)
"""A reset header's bare number in this range is a moment in seconds since the epoch (2001 to
5138), not a duration: some gateways send one, and read as seconds it asked for decades (an
item given up, `retry.max_server_wait_s`). No wait a server means is that long."""
EPOCH_MS = (1e12, 1e14)
"""The same moments in milliseconds since the epoch; a bare number in neither is seconds."""


def parse_duration(text: str | None, now: float | None = None) -> float | None:
    """Seconds from a reset header: "1s", "6m0s", "20ms", "1h2m3.5s" or plain "0.5"; else None.
    A bare number that is a moment (`EPOCH_S`, `EPOCH_MS`) gives the seconds from `now` (this
    machine's clock by default) to it, 0 when it has passed."""
    if text is None:
        return None
    text = text.strip()
    plain = _number(text)
    if plain is not None:
        if not math.isfinite(plain) or plain < 0:
            return None
        if EPOCH_MS[0] <= plain < EPOCH_MS[1]:
            plain /= 1000
        elif not EPOCH_S[0] <= plain < EPOCH_S[1]:
            return plain
        return max(0.0, plain - (time.time() if now is None else now))
    if len(text) > DURATION_MAX:
        return None
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def tokens_used(
    status: str,
    prompt_tokens: int | None,
    completion_tokens: int,
    wasted_tokens: int,
    prompt_estimate: int,
) -> int:
    """What an attempt most likely counted against the server's token limit, for `correct`.

    A success: its usage (the prompt estimate when the server sent none). A refusal (429 or
    another 4xx) or a connection that never produced a token: nothing. Any other failure:
    the prompt and the tokens streamed before it broke.
    """
    prompt = prompt_estimate if prompt_tokens is None else prompt_tokens
    if status == "ok":
        return prompt + completion_tokens
    if status.startswith("http_4") or wasted_tokens == 0:  # http_4xx and http_429
        return 0
    return prompt + wasted_tokens


def limit_set_pace(held: int, attempts: int, paced: bool, *, seeded_rps: float | None = None,
                   sent_rps: float | None = None) -> bool:
    """Whether the server's rate limit set a run's pace: a shard learned a pace of it (`paced`,
    cut or seeded), or it held at least SERVER_LIMIT_SHARE of the `attempts` (`held` retries).
    A pace of requests only seeded from a stated limit (`seeded_rps`, none cut, no pace of
    tokens) counts only where the requests sent (`sent_rps`, on average) came within
    SEEDED_PACE_NEAR of it: the first 429 stating the limit seeds it, though a stray one (a
    gateway's, a burst's) comes far below it, where the cap or the server's capacity set the
    pace and a higher limit would change nothing. One rule for the report's finding and the
    run summary's line, so they say the same."""
    if seeded_rps and sent_rps is not None and sent_rps < SEEDED_PACE_NEAR * seeded_rps:
        paced = False
    return paced or (attempts > 0 and held / attempts >= SERVER_LIMIT_SHARE)


def stated_cap(item: Mapping[str, Any], params: Mapping[str, Any]) -> int | None:
    """The completion tokens a request states as its cap (`max_tokens`,
    `max_completion_tokens`, or the Responses API's `max_output_tokens`), or None where it
    states none. As `items.build_request` sends it: a body naming any of them takes none from
    the job's params, so its `"max_tokens": null` sends no cap however the job sets one."""
    body: Mapping[str, Any] = item.get("body") or {}
    source = body if any(key in body for key in TOKEN_LIMITS) else params
    for key in TOKEN_LIMITS:
        value = source.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def estimate_request_tokens(item: Mapping[str, Any], params: Mapping[str, Any]) -> int:
    """Tokens to reserve for one request: prompt estimate (chars / 4) + its stated cap
    (`stated_cap`), else DEFAULT_COMPLETION_TOKENS."""
    return request_tokens(prompt_chars(item), stated_cap(item, params))


def request_tokens(chars: int, cap: int | None) -> int:
    """`estimate_request_tokens` of a request whose prompt characters and stated cap are known
    (a shard has both at hand: it works neither out again per request)."""
    return tokens_of_chars(chars) + (DEFAULT_COMPLETION_TOKENS if cap is None else cap)

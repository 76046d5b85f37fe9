"""A shard's configuration and counters: plain values that travel in protocol messages."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from shardrun import protocol
from shardrun.errors import CONTINUE, CONTINUE_RETRYING

# How a shard stops early. DEAD_LETTER: every remaining item ends as a dead letter with the
# reason (the endpoint is unreachable). ABANDON: stop; items without a line are left for
# `--resume` (credentials refused, disk full): dead-lettering millions of items would help no one.
DEAD_LETTER = "dead_letter"
ABANDON = "abandon"


def shard_file_name(index: int, segment: int) -> str:
    """`shard-03.jsonl` in a run's first pass, `shard-03.r2.jsonl` in its second resume."""
    suffix = "" if segment == 0 else f".r{segment}"
    return f"shard-{index:02d}{suffix}.jsonl"


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """Everything a shard needs, as sent in the `config` message."""

    shard: int
    run_id: str
    out_dir: str
    base_url: str
    api: str
    model: str
    api_key: str | None = None
    api_key_env: str | None = None  # the variable the key came from, for the messages
    api_key_header: str = "Authorization"
    headers: dict[str, str] = field(default_factory=dict)  # the job's own, for every request
    stream_usage: bool = True  # ask for usage in the stream (stream_options.include_usage)
    # The HTTP proxy to send requests through (shardrun.proxy): its URL without credentials,
    # and the Proxy-Authorization value made of them.
    proxy: str | None = None
    proxy_authorization: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 16
    retry: dict[str, Any] = field(default_factory=dict)
    timeouts: dict[str, Any] = field(default_factory=dict)
    grace_s: float = 30.0
    fsync_interval_s: float = 1.0
    rate: dict[str, float | None] = field(default_factory=dict)  # this shard's rpm/tpm share
    # k/N for shard k of N: how far into one job-wide interval its pacing starts
    # (shardrun.ratelimit), so the shards' first requests are spread out.
    rate_phase: float = 0.0
    # How many shards the run starts, which share the server's limit of one key: a 429 that
    # states that limit paces a shard at its share of it (`RateLimiter.limited`).
    shard_count: int = 1
    segment: int = 0  # 0 for the first pass of a run, k for its k-th resume
    # The endpoint answered this run before (an earlier pass, or another shard of this one): a
    # shard that cannot reach it waits for it (an outage), rather than judging it unreachable.
    answered_before: bool = False
    # The endpoint is the simulator this pass started, which listened before any shard began,
    # and whose end the coordinator watches (`runner._sim_ended`): a connection it refuses is
    # that end, which stops the run for --resume; never a reason to judge it unreachable and
    # dead-letter every item.
    endpoint_watched: bool = False
    # How the sentence of a stop ends: what continues the run after this pass, and what does
    # when the stop also dead-lettered items (`runner.choose_way_on`).
    way_on: str = CONTINUE
    way_on_retrying: str = CONTINUE_RETRYING
    # Where the endpoint settings a stop tells the user to check came from, for those a
    # variable or a flag set ('env SHARDRUN_BASE_URL'): the job file is not where to look.
    set_outside: dict[str, str] = field(default_factory=dict)

    def key_named(self, key: str) -> str:
        """`key` as a stop names it: 'endpoint.base_url (from env SHARDRUN_BASE_URL)'."""
        source = self.set_outside.get(key)
        return key if source is None else f"{key} (from {source})"

    @property
    def file_name(self) -> str:
        return shard_file_name(self.shard, self.segment)

    @property
    def span_prefix(self) -> str:
        """Span ids are unique in the run: `3-17`, or `r1.3-17` in the first resume."""
        return f"{self.shard}-" if self.segment == 0 else f"r{self.segment}.{self.shard}-"

    @classmethod
    def from_message(cls, message: protocol.Message) -> ShardConfig:
        return cls(**{k: v for k, v in message.items() if k != "t"})

    def to_message(self) -> protocol.Message:
        return {"t": protocol.CONFIG, **self.__dict__}


@dataclass(slots=True)
class Counters:
    """Running totals reported to the coordinator."""

    received: int = 0
    ok: int = 0
    dead: int = 0
    attempts: int = 0
    retries: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0  # every attempt's, as billed (server usage, else estimated)
    wasted_tokens: int = 0
    # Where the server counted them: of prompt_tokens, those read from its prompt cache (every
    # attempt's, as prompt_tokens is); of completion_tokens, the reasoning (successes').
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    # Successes whose completion tokens the client counted (the server sent no usage), so that
    # the run's summary can say its TPM is an estimate.
    estimated_ok: int = 0
    refusals: int = 0  # successes whose answer was a refusal (the model declined)
    # Waits for a rate limit before an attempt (the job's rpm/tpm, or a pause the server's
    # x-ratelimit-* headers asked for), and their time in milliseconds, summed over slots.
    rate_waits: int = 0
    rate_wait_ms: int = 0
    # 429s of the server's rate limit that held their item for a retry (`rate_limited`,
    # `Shard._hold_for_limit`), counted as the retry is sent: not one that a stop, a dead
    # letter or a fatal stop ended, before or during the hold's wait.
    limited_429s: int = 0
    # Attempts answered 429, held or not (a quota's, one over the whole limit, one a stop
    # ended), as `report` counts attempt_end lines of that status: what the server did not
    # answer, for the summary's requests answered a minute.
    http_429s: int = 0
    in_flight: int = 0
    retrying: int = 0
    abandoned: int = 0
    budget_exhausted: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

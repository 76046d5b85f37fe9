"""`shardrun validate`: check a job, its environment and its input without running it.

Everything here is the library side: `check_input` reads the whole input through the same
reader a run uses (so a reject here is a reject there), `config_rows` lists each effective
value with where it came from, and `ping` sends exactly one real request. Presentation lives
in `cli_validate`.
"""

from __future__ import annotations

import asyncio
import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from shardrun._urls import under_v1
from shardrun.clock import Clock
from shardrun.digestset import DigestSet
from shardrun.fdlimit import FILES_BESIDES_CONNECTIONS
from shardrun.inputs import Reject, make_reader
from shardrun.items import TOKEN_LIMITS, Api, build_request, prompt_chars, tokens_of_chars
from shardrun.proxy import Proxy, proxy_for
from shardrun.ratelimit import estimate_request_tokens
from shardrun.spec import LoadedJob
from shardrun.ticker import Ticker
from shardrun.worksource import derived, duplicate_reason, id_digest, id_field_warning

__all__ = ["InputCheck", "PingResult", "check_input", "config_rows", "ping", "run_ping"]

PING_MAX_TOKENS = 16
"""A ping caps max_tokens / max_completion_tokens (when the job sets them) at this."""
PING_PROMPT = {"id": "ping", "prompt": "Reply with one word."}


@dataclass(frozen=True)
class InputCheck:
    """What reading the whole input found."""

    items: int
    rejects: int
    first_rejects: tuple[Reject, ...]
    prompt_chars: int
    lines: int
    bytes_read: int
    first_item: Mapping[str, Any] | None
    # The item whose request the rate limiter charges most (prompt / 4 + its token limit):
    # (tokens, line), or None for an input without items.
    largest_request: tuple[int, int] | None = None
    named_ids: int = 0  # items whose id the record gives (not derived from its content)

    @property
    def prompt_tokens_estimate(self) -> int:
        """Prompt tokens by the rule of thumb of 4 characters per token (not a tokenizer)."""
        return tokens_of_chars(self.prompt_chars)


NO_CONNECTION_LABELS = (("connection refused", "conn_refused"),
                        ("cannot resolve", "dns_failure"),
                        ("cannot connect", "conn_failed"))  # fmt: skip
"""The starts of `client._describe`'s sentences for a connection never made, and the ping's
status for each."""


@dataclass(frozen=True)
class PingResult:
    """The outcome of the one request `ping` sends."""

    url: str
    status: str
    http_status: int | None
    ttft_s: float | None
    total_s: float
    completion_tokens: int
    reply: str
    error: str | None
    rate_headers: Mapping[str, str] = field(default_factory=dict)
    proxy: Mapping[str, str] | None = None  # Proxy.describe() of the proxy it went through
    not_an_answer: bool = False  # a 2xx that was no stream and no JSON answer (a web page)
    refusal: str | None = None  # the model declined, in its words (then `reply` is empty)
    at_once: bool = False  # the answer came at once, not as a stream (`AttemptOutcome.at_once`)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def label(self) -> str:
        """`status` as the ping shows it: a run counts a connection refused or a name not
        resolved as conn_reset (both are retried alike), but the ping names which it was."""
        if self.status == "conn_reset" and self.error is not None:
            for start, label in NO_CONNECTION_LABELS:
                if self.error.startswith(start):
                    return label
        return self.status


def check_input(job: LoadedJob, show: int = 10, ticker: Ticker | None = None) -> InputCheck:
    """Read the whole input as a run would; keep the first `show` rejects and the first item.
    A repeated id is a reject, as a run makes it one (`WorkSource`). `ticker` shows how far
    the read has got (3.5 s at a million prompts)."""
    reader = make_reader(job)
    if ticker is not None:
        try:
            size = os.path.getsize(job.input_path)
        except OSError:
            size = 0
        share = (lambda: min(1.0, reader.bytes_read / size)) if size else None
        ticker.phase(f"reading {job.input_path}", "lines", share)
    items = rejects = chars = 0
    first_rejects: list[Reject] = []
    first_item: Mapping[str, Any] | None = None
    seen = DigestSet()
    largest: tuple[int, int] | None = None
    named = 0
    params = job.spec.params
    try:
        for entry in reader:
            if ticker is not None:
                ticker.step()
            if not isinstance(entry, Reject) and not seen.add(id_digest(entry["id"])):
                entry = Reject(reader.line, duplicate_reason(entry["id"]), entry["id"])
            if isinstance(entry, Reject):
                rejects += 1
                if len(first_rejects) < show:
                    first_rejects.append(entry)
                continue
            items += 1
            named += not derived(entry["id"])
            chars += prompt_chars(entry)
            if first_item is None:
                first_item = entry
            charged = estimate_request_tokens(entry, params)
            if largest is None or charged > largest[0]:
                largest = (charged, reader.line)
    finally:
        reader.close()
    return InputCheck(items, rejects, tuple(first_rejects), chars, reader.lines_read,
                      reader.bytes_read, first_item, largest, named)  # fmt: skip


def id_warning(job: LoadedJob, check: InputCheck) -> str | None:
    """A warning when the job names an id field that no item's record has: every id was then
    derived from its record's content, which is a typo's doing far more often than the job's
    intent (a CSV header or Parquet schema without the column is an error already)."""
    spec = job.spec.input
    if spec.id_field == "id" or spec.format == "openai-batch" or check.named_ids or (
            not check.items):
        return None
    return id_field_warning(spec.id_field)


def tpm_warning(job: LoadedJob, check: InputCheck) -> str | None:
    """A warning when one request is charged more than a shard's share of rate_limits.tpm
    for a whole minute: it then waits minutes for its turn, and the run looks stuck."""
    tpm, largest = job.spec.rate_limits.tpm, check.largest_request
    if tpm is None or largest is None:
        return None
    share = tpm / job.spec.shards
    tokens, line = largest
    if tokens <= share:
        return None
    return (f"line {line} is charged about {tokens:,} tokens (prompt / 4 + its token limit), "
            f"more than a shard's share of rate_limits.tpm for a whole minute ({share:,.0f}): "
            f"such a request waits about {tokens / share:.1f} min for its turn")


def base_url_warning(job: LoadedJob) -> str | None:
    """A warning for a base_url with no path (`http://127.0.0.1:8000` where `/v1` was meant):
    a run would stop on its first 404. Not an error: some gateways do serve at the root."""
    fix = under_v1(job.spec.endpoint.base_url)
    if fix is None:
        return None
    source = job.sources.get("endpoint.base_url", "job file")
    where = "" if source == "job file" else f" (from {source})"
    return (f"endpoint.base_url{where} has no path, and OpenAI-compatible servers serve under "
            f"/v1: a run stops on its first 404 unless this server serves at its root (some "
            f"gateways do); most want {fix} (`validate --ping` tries one request)")


def open_files_warning(job: LoadedJob, check: InputCheck, hard: int | None = None) -> str | None:
    """A warning when a shard's connections would pass the hard open-file limit, which a shard
    cannot raise: the run would stop part-way, out of descriptors. `hard`: the limit, else
    this process's (the shards inherit it)."""
    if hard is None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    per_shard = -(-check.items // job.spec.shards)  # the most a shard has in flight at once
    connections = min(job.spec.concurrency, per_shard)
    need = connections + FILES_BESIDES_CONNECTIONS
    if hard == resource.RLIM_INFINITY or need <= hard:
        return None
    return (f"a shard would keep up to {connections:,} connections open (concurrency "
            f"{job.spec.concurrency:,}), about {need:,} open files, above the hard limit of "
            f"{hard:,} (ulimit -Hn): a run would stop once its connections reach it; lower "
            "concurrency, run more shards or raise the limit")


# Settings an OpenAI Batch input makes moot, and what stands in for each.
BATCH_OVERRIDES = {"input.id_field": "each line's custom_id is its id",
                   "endpoint.api": "each line's url names its API"}


def config_rows(job: LoadedJob) -> list[tuple[str, str, str]]:
    """(key, value as text, source) for every effective value; secrets already masked."""
    batch = job.spec.input.format == "openai-batch"
    rows = []
    for key, entry in job.effective().items():
        value = entry["value"]
        text = value if isinstance(value, str) else orjson.dumps(value).decode()
        source = str(entry["source"])
        if batch and key in BATCH_OVERRIDES:
            source += f" (not used: {BATCH_OVERRIDES[key]})"
        rows.append((key, text, source))
    return rows


def ping_body(job: LoadedJob, item: Mapping[str, Any]) -> tuple[Api, dict[str, Any]]:
    """The request a run would send for `item`, with its token limit capped for the ping."""
    spec = job.spec
    api, body = build_request(item, model=spec.endpoint.model, params=spec.params,
                              api=spec.endpoint.api,
                              stream_usage=spec.endpoint.stream_usage)  # fmt: skip
    for key in TOKEN_LIMITS:
        if isinstance(body.get(key), int):
            body[key] = min(body[key], PING_MAX_TOKENS)
    return api, body


async def ping(
    job: LoadedJob, base_url: str, api_key: str | None, item: Mapping[str, Any] | None,
    proxy: Proxy | None = None,
) -> PingResult:
    """Send one streaming request for `item` (or a one-word prompt) to `base_url`, through
    `proxy` as a run would."""
    # Only a ping needs the HTTP client; plain `validate` never imports aiohttp.
    from shardrun.client import StreamingClient, Timeouts, make_session, request_headers

    api, body = ping_body(job, item or PING_PROMPT)
    timeouts = Timeouts(**job.spec.timeouts.model_dump())
    endpoint = job.spec.endpoint
    headers = request_headers(api_key, endpoint.api_key_header, endpoint.headers)
    async with make_session(1, timeouts) as session:
        client = StreamingClient(session, base_url, api, headers, timeouts, Clock(),
                                 proxy=None if proxy is None else proxy.url,
                                 proxy_authorization=None if proxy is None
                                 else proxy.authorization, params=job.spec.params)  # fmt: skip
        out = await client.attempt(body)
    ttft = None if out.first_token_at is None else out.first_token_at - out.started_at
    return PingResult(client.url, out.status, out.http_status, ttft,
                      out.ended_at - out.started_at, out.completion_tokens, out.text[:200],
                      out.error, dict(out.rate_headers),
                      None if proxy is None else proxy.describe(), out.not_an_answer,
                      out.refusal, out.at_once)  # fmt: skip


def run_ping(
    job: LoadedJob, env: Mapping[str, str], item: Mapping[str, Any] | None
) -> PingResult:
    """`ping` from synchronous code; for sim:// a simulator is started and stopped around it."""
    from shardrun.sim.launcher import start_sim

    api_key = job.api_key(env)
    endpoint = job.spec.endpoint
    config = job.sim_config()
    if config is None:
        proxy = proxy_for(endpoint.base_url, env)
        return asyncio.run(ping(job, endpoint.base_url, api_key, item, proxy))
    sim = start_sim(config)
    try:
        return asyncio.run(ping(job, sim.base_url, api_key, item))
    finally:
        sim.stop()

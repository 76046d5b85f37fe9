"""A 429 that is no quota's holds its item (`Shard._hold_for_limit`): what bounds one item's
holds. The shard runs its real attempt loop against a client that answers from a script, on a
clock the test moves, so no hold takes any time."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from shardrun.client import AttemptOutcome
from shardrun.shard import Shard
from shardrun.shard_config import ShardConfig
from shardrun.spans import Span

TOO_LARGE = ("HTTP 429: Request too large for gpt-4o in organization org-x on tokens per min "
             "(TPM): Limit 30000, Requested 45000. The input or output tokens must be reduced "
             "in order to run successfully.")
PACE = "HTTP 429: Rate limit reached for requests. Please try again in 1s."


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


class _Client:
    """Answers each attempt with the next of `errors` (a 429 with those words; None: a
    success), then successes; each attempt takes `took` seconds of the test's clock."""

    url = "http://x"

    def __init__(self, clock: _Clock, errors: list[str | None], took: float = 1.0) -> None:
        self.clock, self.errors, self.took, self.calls = clock, errors, took, 0

    async def attempt(self, body: Any, on_first_token: Any = None) -> AttemptOutcome:
        started = self.clock.t
        self.clock.t += self.took
        error = self.errors[self.calls] if self.calls < len(self.errors) else None
        self.calls += 1
        if error is None:
            return AttemptOutcome(status="ok", http_status=200, started_at=started,
                                  ended_at=self.clock.t, text="hi", finish_reason="stop")
        return AttemptOutcome(status="http_429", http_status=429, started_at=started,
                              ended_at=self.clock.t, error=error)


def _run_one(tmp_path: Path, errors: list[str | None], **retry: float) -> tuple[Shard, int]:
    """One item through the shard's attempts: the shard, and how many attempts it made."""
    clock = _Clock()
    cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://x",
                      api="chat", model="m", retry=retry)
    shard = Shard(cfg, lambda message: None, clock=clock)  # type: ignore[arg-type]
    client = _Client(clock, errors)
    shard.clients = {"chat": client}  # type: ignore[dict-item]

    async def pause(wait: float) -> None:  # a hold's wait passes on the test's clock
        clock.t += wait

    shard._pause = pause  # type: ignore[method-assign]
    span = Span("s0", {"id": "a", "messages": [{"role": "user", "content": "x"}]}, clock.t)
    span.admitted_at = clock.t
    asyncio.run(shard._attempts(span))
    shard.close()
    return shard, client.calls


def _dead(tmp_path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for path in (tmp_path / "dead").glob("*.jsonl")
            for line in path.read_bytes().splitlines()]


def test_a_request_larger_than_the_whole_limit_is_dead_lettered_at_once(tmp_path: Path) -> None:
    """OpenAI's 429 for a request that alone asks more than the per-minute limit: no wait lets
    it through, so the item is a dead letter at its first answer, with the server's words
    (held, it cycled for ever; here the script would let its fourth attempt succeed)."""
    shard, calls = _run_one(tmp_path, [TOO_LARGE] * 3)
    assert calls == 1 and shard.counters.dead == 1
    assert [d["reason"] for d in _dead(tmp_path)] == [f"request_over_limit: {TOO_LARGE}"]
    assert shard.limited_since is None  # not a sign the server refuses everything

"""The names of the events in a run's logs (docs/ARCHITECTURE.md lists their fields).

Kept apart from `events.py` (the writer) so that readers (`report`, `publish`, `verify`) need
not import structlog.
"""

SHARD_START = "shard_start"
QUEUED = "queued"
ADMITTED = "admitted"
ATTEMPT_START = "attempt_start"
ATTEMPT_END = "attempt_end"
RETRY = "retry"
RATE_WAIT = "rate_wait"
# The pace a shard learned of the server's limit, at each seed, cut or re-split
# (`RateLimiter.limited`, `RateLimiter.set_share`): rare.
RATE_LEARNED = "rate_learned"
# A pace's cap at a stated limit lifted, the key having room well past it, or put back (rare).
RATE_UNCAPPED = "rate_uncapped"
# The `why` of a `retry` held for the server's rate limit (`Shard._hold_for_limit`), which
# `report` counts apart from the retries that spend attempts.
RATE_LIMITED = "rate_limited"
RELEASED = "released"
LOOP_LAG = "loop_lag"
CHECKPOINT = "checkpoint"
SHARD_END = "shard_end"
# Written by shards before the attempt's transitions moved onto `attempt_end` (its
# `conn_ready_t`, `first_token_t`, `last_token_t`, `tokens`). No shard writes them any more;
# readers still accept them, so runs already on disk keep their report and their samples.
CONN_READY = "conn_ready"
FIRST_TOKEN = "first_token"
LAST_TOKEN = "last_token"
LEGACY_ATTEMPT_EVENTS = frozenset({CONN_READY, FIRST_TOKEN, LAST_TOKEN})
# The coordinator's own log, events/coordinator.jsonl (`shard` is null there).
RUN_START = "run_start"
BATCH = "batch"
INPUT_END = "input_end"
SHARD_EXIT = "shard_exit"
RUN_END = "run_end"

ALL_EVENTS = frozenset(
    {
        SHARD_START,
        QUEUED,
        ADMITTED,
        ATTEMPT_START,
        ATTEMPT_END,
        RETRY,
        RATE_WAIT,
        RATE_LEARNED,
        RATE_UNCAPPED,
        RELEASED,
        LOOP_LAG,
        CHECKPOINT,
        SHARD_END,
        RUN_START,
        BATCH,
        INPUT_END,
        SHARD_EXIT,
        RUN_END,
        *LEGACY_ATTEMPT_EVENTS,
    }
)

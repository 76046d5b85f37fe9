"""Event-log fixtures small enough to check by hand, and a writer for real-format run dirs.

No tests here: the helpers are shared by the aggregate, report and provenance tests.

The fixtures are written in the older layout (separate `conn_ready`, `first_token` and
`last_token` lines); `to_new_layout` and `to_old_layout` convert between it and today's, where
`attempt_end` carries those instants, so every fixture serves both.

The hand fixture, one shard with cap 2 (times in seconds after T0; B is a minute boundary and
T0 = B - 6.5, so s1's last token falls in the minute before B and s2's in the minute of B):

    t    queue in_flight  event
    0      3      0       s1, s2, s3 queued
    1      1      2       s1, s2 admitted; both start attempt 1 (s1 new connection ready at
                          1.5, s2 reuses one at 1.0)
    2                     s2 attempt 1 ends conn_reset after 3 tokens; retry, wait 1
    3                     s1 first token; s2 attempt 2 starts (new connection ready 3.25,
                          its request sent once more: its pooled connection was dead)
    4                     s2 first token
    5                     s1 last token (10 tokens), attempt ok
    6      0      2       s1 released ok; s3 admitted, attempt 1 on a reused connection
                          (the third it was sent on: two pooled ones were dead)
    7                     s2 last token (4 tokens), attempt 2 ok
    8      0      1       s2 released ok
    9      0      0       s3 attempt 1 ends http_4xx; released dead
    10                    shard_end

    s1: t_queue 1, t_retry 0, t_conn 0.5,  t_first_token 1.5,  t_stream 2, t_post 1 = e2e 6
    s2: t_queue 1, t_retry 2, t_conn 0.25, t_first_token 0.75, t_stream 3, t_post 1 = e2e 8
    backlog [0, 6) = 6 s, of which in_flight < cap during [0, 1) = 1 s: gap_fraction 1/6.
    With input_end at 9.5, the shard is idle (nothing queued or in flight) during [9, 9.5).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from shardrun.events import EventLog

RUN_ID = "fixture-run"
B = 1_800_000_000 - 1_800_000_000 % 60
T0 = B - 6.5


def ev(name: str, t: float, shard: int | None = 0, **fields: Any) -> dict[str, Any]:
    """One record as the event log writes it."""
    return {"run_id": RUN_ID, "shard": shard, "ev": name, "t": t, **fields}


def _span(sid: str, name: str, t: float, **fields: Any) -> dict[str, Any]:
    return ev(name, T0 + t, span=sid, id=f"item-{sid}", **fields)


def _end(sid: str, t: float, attempt: int, status: str, **fields: Any) -> dict[str, Any]:
    base = {"http": 200 if status == "ok" else None, "retry_after": None, "prompt_tokens": None,
            "completion_tokens": 0, "usage_estimated": False, "wasted_tokens": 0,
            "reused": None, "error": None, "itl_hist": None}
    return _span(sid, "attempt_end", t, attempt=attempt, status=status, **{**base, **fields})


def hand_shard() -> list[dict[str, Any]]:
    """The hand fixture of the module docstring, in file order."""
    return [
        ev("shard_start", T0, cap=2, pid=1, version="0", host="fixture-host"),
        _span("0-1", "queued", 0, prompt_chars=40),
        _span("0-2", "queued", 0, prompt_chars=1200),
        _span("0-3", "queued", 0, prompt_chars=10),
        _span("0-1", "admitted", 1), _span("0-2", "admitted", 1),
        _span("0-1", "attempt_start", 1, attempt=1),
        _span("0-2", "attempt_start", 1, attempt=1),
        _span("0-2", "conn_ready", 1, attempt=1, reused=True),
        _span("0-1", "conn_ready", 1.5, attempt=1, reused=False),
        _end("0-2", 2, 1, "conn_reset", wasted_tokens=3, error="cut"),
        _span("0-2", "retry", 2, attempt=1, cause="conn_reset", wait=1.0, why="backoff"),
        _span("0-1", "first_token", 3, attempt=1),
        _span("0-2", "attempt_start", 3, attempt=2),
        _span("0-2", "conn_ready", 3.25, attempt=2, reused=False),
        _span("0-2", "first_token", 4, attempt=2),
        _span("0-1", "last_token", 5, attempt=1, tokens=10),
        _end("0-1", 5, 1, "ok", prompt_tokens=20, completion_tokens=10, itl_hist={"150": 9}),
        _span("0-1", "released", 6, outcome="ok", reason=None),
        _span("0-3", "admitted", 6),
        _span("0-3", "attempt_start", 6, attempt=1),
        _span("0-3", "conn_ready", 6, attempt=1, reused=True),
        _span("0-2", "last_token", 7, attempt=2, tokens=4),
        _end("0-2", 7, 2, "ok", prompt_tokens=300, cached_tokens=256, completion_tokens=4,
             reasoning_tokens=3, resent=1, itl_hist={"160": 3}),
        _span("0-2", "released", 8, outcome="ok", reason=None),
        _end("0-3", 9, 1, "http_4xx", error="HTTP 400: bad", reasoning_tokens=2, resent=2),
        _span("0-3", "released", 9, outcome="dead",
              reason="not_retryable_http_4xx: HTTP 400: bad"),
        ev("loop_lag", T0 + 9.5, lag=0.002),
        ev("shard_end", T0 + 10, received=3, ok=2, dead=1),
    ]  # fmt: skip


def hand_coordinator(input_end: float = T0 + 9.5) -> list[dict[str, Any]]:
    """The coordinator's log for the hand fixture: run from T0 - 0.5 to T0 + 10.5."""
    return [
        ev("run_start", T0 - 0.5, shard=None, shards=1, cap=2),
        ev("batch", T0 - 0.1, shard=None, to=0, n=3),
        ev("input_end", input_end, shard=None, lines=3, rejects=0),
        ev("shard_exit", T0 + 10.2, shard=None, to=0, status="done"),
        ev("run_end", T0 + 10.5, shard=None, status="failed"),
    ]


def steady_shard(shard: int, t0: float, minutes: int, per_minute: int, tokens: int = 5,
                 layout: str = "old") -> list[dict[str, Any]]:
    """A shard that finishes `per_minute` one-attempt spans per minute for `minutes` minutes."""
    recs = [ev("shard_start", t0, shard=shard, cap=4, pid=1, version="0", host="fixture-host")]
    step = 60.0 / per_minute
    for i in range(minutes * per_minute):
        sid, t = f"{shard}-{i + 1}", t0 + 1 + i * step
        recs += [
            ev("queued", t, shard=shard, span=sid, id=f"i{shard}-{i}", prompt_chars=8),
            ev("admitted", t, shard=shard, span=sid, id=f"i{shard}-{i}"),
            ev("attempt_start", t, shard=shard, span=sid, id=f"i{shard}-{i}", attempt=1),
            ev("first_token", t + 0.1, shard=shard, span=sid, id=f"i{shard}-{i}", attempt=1),
            ev("last_token", t + 0.2, shard=shard, span=sid, id=f"i{shard}-{i}", attempt=1,
               tokens=tokens),
            {**_end(sid, 0, 1, "ok", completion_tokens=tokens, prompt_tokens=2),
             "t": t + 0.2, "shard": shard, "id": f"i{shard}-{i}"},
            ev("released", t + 0.3, shard=shard, span=sid, id=f"i{shard}-{i}", outcome="ok",
               reason=None),
        ]  # fmt: skip
    recs.append(ev("shard_end", recs[-1]["t"] + 0.1, shard=shard))
    return to_new_layout(recs) if layout == "new" else recs


LEGACY = ("conn_ready", "first_token", "last_token")
# attempt_end's fields in today's layout: these come after `retry_after`, in this order.
HEAD = ("run_id", "shard", "ev", "t", "span", "id", "attempt", "status", "http", "retry_after")
ATTEMPT_FIELDS = ("conn_ready_t", "reused", "first_token_t", "last_token_t", "tokens")


def to_new_layout(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Today's layout: each attempt's conn_ready, first_token and last_token lines folded into
    its attempt_end (lines of an attempt that never ended are dropped, as a shard drops them)."""
    out: list[dict[str, Any]] = []
    seen: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for rec in records:
        if rec["ev"] in LEGACY:
            seen.setdefault((rec["span"], rec["attempt"]), {})[rec["ev"]] = rec
            continue
        if rec["ev"] == "attempt_end":
            lines = seen.pop((rec["span"], rec["attempt"]), {})
            conn, first, last = (lines.get(name) for name in LEGACY)
            moved = {
                "conn_ready_t": conn["t"] if conn else None,
                "reused": conn["reused"] if conn else rec.get("reused"),
                "first_token_t": first["t"] if first else None,
                "last_token_t": last["t"] if last else None,
                "tokens": last["tokens"] if last else 0,
            }  # fmt: skip
            head = {k: rec[k] for k in HEAD if k in rec}
            rec = {**head, **moved, **{k: v for k, v in rec.items() if k not in moved}}
        out.append(rec)
    return out


def whole_answers(records: Iterable[dict[str, Any]], spans: set[str]) -> list[dict[str, Any]]:
    """Today's layout with the ok attempts of `spans` made answers sent whole, as a server that
    ignores `stream` sends them: one content chunk, its first token at its last."""
    return [{**rec, "first_token_t": rec["last_token_t"], "tokens": 1}
            if rec["ev"] == "attempt_end" and rec["status"] == "ok" and rec["span"] in spans
            else rec for rec in records]


def to_old_layout(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The layout of runs written before the change: the attempt's instants as separate lines
    before its attempt_end, and attempt_end without them."""
    out = []
    for rec in records:
        if rec["ev"] == "attempt_end" and "conn_ready_t" in rec:
            base = {k: rec[k] for k in ("run_id", "shard")}
            who = {k: rec[k] for k in ("span", "id", "attempt")}
            if rec["conn_ready_t"] is not None:
                out.append({**base, "ev": "conn_ready", "t": rec["conn_ready_t"], **who,
                            "reused": bool(rec["reused"])})
            if rec["first_token_t"] is not None:
                out.append({**base, "ev": "first_token", "t": rec["first_token_t"], **who})
            if rec["last_token_t"] is not None:
                out.append({**base, "ev": "last_token", "t": rec["last_token_t"], **who,
                            "tokens": rec["tokens"]})
            rec = {k: v for k, v in rec.items() if k not in ATTEMPT_FIELDS or k == "reused"}
        out.append(rec)
    return out


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace `path` with `records` written by the real `EventLog`; a `checkpoint` record
    becomes a fresh checkpoint at the same place (the bytes before it may have changed)."""
    path.unlink(missing_ok=True)
    log = EventLog(path, run_id=records[0]["run_id"], shard=records[0]["shard"])
    for rec in records:
        if rec["ev"] == "checkpoint":
            log.checkpoint(rec["t"])
        else:
            log.emit(rec["ev"], **{k: v for k, v in rec.items()
                                   if k not in ("run_id", "shard", "ev")})
    log.close()


def write_log(path: Path, records: list[dict[str, Any]], checkpoint_every: int = 5) -> None:
    """Write records through the real `EventLog` (orjson lines, running-hash checkpoints)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    first = records[0]
    log = EventLog(path, run_id=first["run_id"], shard=first["shard"])
    for i, rec in enumerate(records, 1):
        log.emit(rec["ev"], **{k: v for k, v in rec.items()
                               if k not in ("run_id", "shard", "ev")})
        if i % checkpoint_every == 0:
            log.checkpoint(rec["t"])
    log.checkpoint(records[-1]["t"])
    log.close()


def write_run(root: Path, shards: dict[str, list[dict[str, Any]]],
              coordinator: list[dict[str, Any]] | None, *, status: str = "failed",
              **manifest: Any) -> Path:
    """A run directory: `events/shard-<name>.jsonl` per entry of `shards`, and a manifest."""
    for name, records in shards.items():
        write_log(root / "events" / f"shard-{name}.jsonl", records)
    if coordinator:
        write_log(root / "events" / "coordinator.jsonl", coordinator)
    doc = {"schema": 1, "run_id": RUN_ID, "status": status,
           "ended_at": None if status == "running" else "2027-01-15T08:00:04.000Z",
           "effective": {"concurrency": {"value": 2, "source": "job file"}}, **manifest}
    (root / "manifest.json").write_bytes(orjson.dumps(doc))
    return root


def run_with_a_cut_log(root: Path, sub: str, layout: str = "new") -> Path:
    """Shard 00: 30 tokens in each of minutes M and M+1 (M = B // 60); shard 01: 15 more in
    M+1, its log cut before its shard_end (as a full disk cuts it), and its `sub` file
    ("results" or "dead") one line longer than the log records, written in M+1."""
    coordinator = [ev("run_start", B - 31, shard=None, shards=2, cap=4),
                   ev("input_end", B + 100, shard=None, lines=27, rejects=0),
                   ev("run_end", B + 160, shard=None, status="succeeded")]
    shards = {"00": steady_shard(0, B - 30, minutes=3, per_minute=6, layout=layout),
              "01": steady_shard(1, B + 59, minutes=1, per_minute=3, layout=layout)[:-1]}
    run = write_run(root, shards, coordinator)
    logged = 3 if sub == "results" else 0  # shard 01's successful spans; it has no dead ones
    path = run / sub / "shard-01.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"".join(orjson.dumps({"id": f"i1-{i}", "last_token_at": B + 80 + i})
                              + b"\n" for i in range(logged + 1)))
    os.utime(path, (B + 110.0, B + 110.0))  # written in M+1, after the log's last event
    return run

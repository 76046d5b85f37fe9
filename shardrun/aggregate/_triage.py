"""Triage: which bucket dominates, the two control-plane signatures, and other red flags.

Works on the report document's numbers only. Meanings and controls are DESIGN §4's table; the
thresholds are documented in docs/METRICS.md and kept here as named constants.
"""

from __future__ import annotations

from typing import Any

from shardrun.ratelimit import SERVER_LIMIT_SHARE, limit_set_pace

TTFT_TAIL_RATIO = 3.0  # p99/p50 of t_first_token at or above: the tail moves
STREAM_STABLE_RATIO = 2.0  # p99/p50 of TPOT at or below: decode speed is stable
GAP_FRACTION_LIMIT = 0.05
IDLE_FRACTION_LIMIT = 0.05
# Below this much gap (or cross-shard idle) time, summed over shards, neither is a finding: the
# first batch of any run waits a few ms for its admissions, which in a run of seconds is a
# large fraction of a tiny backlog and tells nothing about the scheduler.
MIN_GAP_S = 1.0
RETRY_RATE_LIMIT = 0.05
DEAD_SHARE_LIMIT = 0.05  # dead letters over ended spans at or above: a finding, listed first
DEAD_REASONS_SHOWN = 3
# Rate waits before admission, as a share of the slot-seconds there were while work waited:
# from this share a finding; from the larger one the rate limit, not the cap, held the backlog,
# and its advice replaces "raise the cap" for a dominant t_queue.
RATE_LIMIT_SHARE = 0.05
RATE_LIMIT_DOMINANT_SHARE = 0.5
CHURN_FACTOR = 2.0
ENDPOINT_DOWN = "endpoint_down"  # the `cause` of a retry line that waited out an outage
ENDPOINT_FAILING = "endpoint_failing"  # of one that waited its turn to probe in a storm

TABLE: dict[str, tuple[str, str]] = {
    "t_queue": ("backlog above the cap, or an arrival spike; if gap_fraction is also high, our "
                "own scheduler stalls",
                "raise the cap if the server has headroom (TTFT flat), else accept; fix stalls "
                "first"),
    "t_retry": ("retries and backoff (429s, 5xx, timeouts)",
                "fix timeouts and retry budget before touching concurrency; honour server limits"),
    "t_conn": ("connections not reused (churn well above shards × cap / items)",
               "keep-alive, pool size = cap, fewer hops"),
    "t_first_token": ("server-side queueing, long prompts (prefill), admission gaps",
                      "lower concurrency or split long/short prompts; compare by prompt-length "
                      "bucket"),
    "t_stream": ("decode speed or long outputs",
                 "shorter max_tokens, a faster model or server; not a client problem"),
    "t_post": ("our own parsing/validation/persistence on the hot path",
               "move heavy work off the event loop, batch writes"),
    "loop_lag": ("the client itself is saturated", "more shards, or less per-request work"),
    "idle_gaps": ("our own scheduler leaves slots free while work waits (admission gaps)",
                  "fix the stall first: look for blocking work on the event loop or a slow "
                  "hand-out; then reconsider the cap"),
    "rate_limit": ("the client held work back for a rate limit: the job's own rate_limits "
                   "(rpm/tpm), the server's x-ratelimit-* headers saying it had no room "
                   "left until their reset, or the pace a shard learned from the server's "
                   "429s; that part of t_queue and of the gap time is intended",
                   "raise rate_limits if the job sets them and the provider allows more; "
                   "otherwise this is the provider's ceiling (ask it for a higher limit)"),
    "server_rate_limit": ("the server refused requests with 429 for its rate limit (no quota): "
                          "the shards held those items, spending none of their attempts, and "
                          "slowed down, so the server's limit, not shardrun's shards or cap, "
                          "set the run's pace; answered_rpm is what it let through on average "
                          "(paced_rpm, or paced_tpm for a limit of tokens, is the shards' pace "
                          "as last set: from the limit a 429 stated for the seeded_shards, "
                          "else at their last cut, which can be above its limit); the "
                          "holds are inside t_retry and the waits for the pace inside t_queue "
                          "and t_retry",
                          "ask the provider for a higher limit, or set rate_limits.rpm near "
                          "answered_rpm (rate_limits.tpm near paced_tpm for a limit of tokens) "
                          "so that the shards send no faster than the server allows and it "
                          "refuses nothing; more shards or a larger cap would only be refused "
                          "too"),
    "server_rate_limit_touched": ("a few requests met the server's rate limit (429, no "
                                  "quota's) and were held and sent again, spending none of "
                                  "their attempts; too few to have set the run's pace, and no "
                                  "shard learned a pace from them that the run came near "
                                  "(paced_rpm: one a 429's stated limit set, unreached)",
                                  "nothing needed: the holds spent no attempts; should they "
                                  "grow in a bigger run, the shards learn a pace from them and "
                                  "the server_rate_limit finding says what limit to set"),
    "endpoint_down": ("the endpoint stopped answering for a while (connections refused or "
                      "dropped before an answer, or a gateway's 502/504): the shards held the "
                      "items and probed it, spending none of their attempts",
                      "look at the server's side (a restart, a deploy, a crash); "
                      "retry.outage_s bounds how long a run waits for it"),
    "endpoint_failing": ("the endpoint answered but failed every request for a while (503s "
                         "from an overload, 500s from a broken server): the shards "
                         "held the items and probed it one request at a time, each try one of "
                         "the item's attempts but none of the retry budget",
                         "look at the server's side (its load, its logs); retry.outage_s bounds "
                         "how long a run waits for it"),
    "dead_letters": ("items ended without an answer; the dominant bucket and the latencies "
                     "describe the successes only",
                     "read the reasons: retry_budget_exhausted or max_attempts after a burst of "
                     "5xx or timeouts says the server failed for a while (fix that side, then "
                     "`shardrun retry-failed RUN_DIR` gives them another pass); an HTTP 4xx "
                     "says the requests themselves are wrong"),
    "cross_shard_idle": ("a shard sat idle while the coordinator still held unassigned work",
                         "hand out work sooner (larger or earlier batches), more shards"),
}


def _ratio(dist: dict[str, Any] | None) -> float | None:
    if not dist or not dist.get("p50"):
        return None
    return round(float(dist["p99"]) / float(dist["p50"]), 3)


def dominant(latency: dict[str, Any]) -> dict[str, Any] | None:
    """The bucket with the largest share of summed bucket time."""
    shares = {k: v for k, v in latency["bucket_share"].items() if v is not None}
    if not shares:
        return None
    name = max(shares, key=lambda k: shares[k])
    dist = latency["all"][name] or {}
    meaning, control = TABLE[name]
    return {"bucket": name, "share": shares[name], "shares": latency["bucket_share"],
            "evidence": {"share": shares[name], "p50": dist.get("p50"), "p99": dist.get("p99")},
            "meaning": meaning, "control": control}


def ttft_tail(latency: dict[str, Any]) -> dict[str, Any]:
    """Signature 1: the TTFT tail moves while decode (TPOT, else t_stream) stays stable."""
    ft = latency["all"]["t_first_token"]
    stream_name = "tpot" if latency["all"]["tpot"] else "t_stream"
    tail, stable = _ratio(ft), _ratio(latency["all"][stream_name])
    present = (tail is not None and stable is not None and tail >= TTFT_TAIL_RATIO
               and stable <= STREAM_STABLE_RATIO)
    by_len = {seg["segment"]: (seg["dists"]["t_first_token"] or {}).get("p50")
              for seg in latency["by_prompt_length"]}
    meaning, control = TABLE["t_first_token"]
    return {"id": "ttft_tail_moving", "present": present,
            "title": "TTFT tail moving while t_stream is stable",
            "evidence": {"t_first_token_p99_over_p50": tail,
                         f"{stream_name}_p99_over_p50": stable,
                         "t_first_token_p50_by_prompt_length": by_len,
                         "thresholds": [TTFT_TAIL_RATIO, STREAM_STABLE_RATIO]},
            "meaning": meaning, "control": control}


def idle_gaps(scheduler: dict[str, Any]) -> dict[str, Any]:
    """Signature 2: free slots while work waits, or idle shards under backlog.

    Judged on the stall part of the gap (gap time less our own rate-limit waits): a run held by
    its `rate_limits` is not a stalled scheduler; that case is its own finding.
    """
    over = scheduler["overall"]
    worst = max(scheduler["shards"], key=lambda r: r["stall_gap_fraction"], default=None)
    gap = over["stall_gap_fraction"]
    idle = over["cross_shard_idle_fraction"]
    stall_s = over["gap_s"] - over["rate_limited_gap_s"]
    gap_seen = gap >= GAP_FRACTION_LIMIT and stall_s >= MIN_GAP_S
    idle_seen = idle >= IDLE_FRACTION_LIMIT and over["cross_shard_idle_s"] >= MIN_GAP_S
    present = gap_seen or idle_seen
    key = "cross_shard_idle" if idle_seen and not gap_seen else "idle_gaps"
    meaning, control = TABLE[key]
    return {"id": "idle_gaps_under_backlog", "present": present,
            "title": "idle gaps under backlog",
            "evidence": {"gap_fraction": over["gap_fraction"], "stall_gap_fraction": gap,
                         "rate_limited_gap_s": over["rate_limited_gap_s"],
                         "gap_s": over["gap_s"], "backlog_s": over["backlog_s"],
                         "worst_shard": None if worst is None else worst["shard"],
                         "worst_shard_stall_gap_fraction": None if worst is None
                         else worst["stall_gap_fraction"],
                         "cross_shard_idle_fraction": idle,
                         "cross_shard_idle_s": over["cross_shard_idle_s"],
                         "thresholds": [GAP_FRACTION_LIMIT, IDLE_FRACTION_LIMIT],
                         "min_s": MIN_GAP_S},
            "meaning": meaning, "control": control}


def other_findings(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Dead letters, client saturation, outages, heavy retries, the server's rate limit, our
    own rate limit and connection churn, if present."""
    out = []
    items = doc["items"]
    ended = items["succeeded"] + items["dead"]
    if ended and items["dead"] / ended >= DEAD_SHARE_LIMIT:
        ranked = sorted(doc["attempts"]["dead_reasons"].items(), key=lambda kv: (-kv[1], kv[0]))
        out.append(_finding("dead_letters", "many items dead-lettered",
                            {"dead": items["dead"], "share": round(items["dead"] / ended, 6),
                             "reasons": dict(ranked[:DEAD_REASONS_SHOWN])},
                            *TABLE["dead_letters"]))
    lag = doc["loop_lag"]
    if lag["client_limited"]:
        out.append(_finding("client_limited", "client-limited: event-loop lag is high",
                            {"p50": lag["p50"], "p99": lag["p99"], "max": lag["max"]},
                            *TABLE["loop_lag"]))
    att = doc["attempts"]
    # Waits while the endpoint was down are retries in the log, but no retry storm: their own
    # finding says what they were.
    # A storm's held retries are the item's own attempts, so they count among the retries below
    # too. A pass stopped by either before a held retry was sent has no retry line to show it.
    stopped = doc["run"].get("stopped_by") or []
    for cause, title in ((ENDPOINT_DOWN, "the endpoint was down"),
                         (ENDPOINT_FAILING, "the endpoint failed every request")):
        held = att["retry_causes"].get(cause, 0)
        if held or cause in stopped:
            evidence = {"held_retries": held, **({"stopped_the_run": True} if cause in stopped
                                                 else {})}
            out.append(_finding(cause, title, evidence, *TABLE[cause]))
    own = own_retries(att)
    rate = sum(own.values()) / att["first"] if att["first"] else None
    if rate is not None and rate >= RETRY_RATE_LIMIT:
        out.append(_finding("retries", "many retries",
                            {"retry_rate_without_outage_waits": round(rate, 6), "causes": own,
                             "wasted_tokens": att["wasted_tokens"]}, *TABLE["t_retry"]))
    if found := server_rate_limit(doc):
        out.append(found)
    waits = doc["scheduler"]["rate_waits"]
    share = rate_share_of_slots(doc)
    if share is not None and share >= RATE_LIMIT_SHARE:
        out.append(_finding("rate_limited", "held back by a rate limit",
                            {"rate_waits": waits["count"],
                             "before_admission_s": waits["before_admission_s"],
                             "share_of_slot_time": share}, *TABLE["rate_limit"]))
    conn = doc["connections"]
    churn, expected = conn["churn_per_success"], conn["expected_churn"]
    if churn is not None and expected is not None and churn > CHURN_FACTOR * expected:
        out.append(_finding("connection_churn", "connections not reused",
                            {"churn_per_success": churn, "expected_churn": expected},
                            *TABLE["t_conn"]))
    return out


def own_retries(att: dict[str, Any]) -> dict[str, int]:
    """Retries by cause, less the waits that spend no attempts and have findings of their own:
    the outage waits, and the holds for the server's rate limit (`rate_limited`, of cause
    http_429; "fix timeouts" is no advice for them)."""
    own = {cause: n for cause, n in att["retry_causes"].items() if cause != ENDPOINT_DOWN}
    limited = own.pop("http_429", 0) - att["server_limit"]["held_retries"]
    return own | ({"http_429": limited} if limited > 0 else {})


def server_rate_limit(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The server's rate limit taught a shard a pace (a cut or a seed) or held at least
    SERVER_LIMIT_SHARE of the attempts: what it answered and refused, the shards' pace as last
    set (seeded from the stated limit, or cut), and the share of the span time that the holds
    (t_retry) and the waits before admission (t_queue) took. Fewer holds and no pace: a smaller
    mention of the holds alone (`server_rate_limit_touched`). None when it held nothing and
    taught no pace."""
    limit = doc["attempts"]["server_limit"]
    paced = limit["pace_cuts"] or limit["pace_seeds"]
    if not limit["held_retries"] and not paced:
        return None
    # What the server did answer, a minute of the run on average, comes first: at most its
    # limit, and near it when the limit held the run back, where a pace cut from a window of
    # the opening burst can be well above it.
    duration = doc["run"]["duration_s"]
    started = doc["attempts"]["started"]
    answered = started - limit["http_429"]
    evidence = {"answered_rpm": round(answered * 60 / duration, 1) if duration else None}
    held_share = limit["held_retries"] / started if started else 0.0
    seeded = (not limit["pace_cuts"] and limit["paced_tps"] is None
              and limit["seeded_shards"] == limit["paced_shards"])
    sent = started / duration if duration else None
    if not limit_set_pace(limit["held_retries"], started, bool(paced), sent_rps=sent,
                          seeded_rps=limit["paced_rps"] if seeded else None):
        evidence |= {key: limit[key]
                     for key in ("http_429", "held_retries", "held_items", "paced_rpm")}
        evidence |= {"held_share_of_attempts": round(held_share, 6),
                     "threshold": SERVER_LIMIT_SHARE}
        return _finding("server_rate_limit_touched",
                        "a few requests met the server's rate limit", evidence,
                        *TABLE["server_rate_limit_touched"])
    shares = doc["latency"]["bucket_share"]
    waits = doc["scheduler"]["rate_waits"]
    evidence |= {key: limit[key] for key in ("http_429", "held_retries", "held_items",
                                             "paced_rpm", "paced_rps", "paced_tpm", "paced_tps",
                                             "paced_shards", "seeded_shards")}
    evidence |= {"t_retry_share": shares.get("t_retry"), "t_queue_share": shares.get("t_queue"),
                 "rate_wait_before_admission_s": waits["before_admission_s"],
                 "rate_wait_before_retries_s": waits["before_retries_s"]}
    return _finding("server_rate_limit", "the server's rate limit set the pace", evidence,
                    *TABLE["server_rate_limit"])


def rate_share_of_slots(doc: dict[str, Any]) -> float | None:
    """Rate waits before admission over `cap_slot_s`, the slot-seconds under backlog.

    A slot is held through each such wait, and the waiting span is still queued, so the waits
    are slot-seconds under backlog too: the share of the capacity a rate limit held while work
    waited (at most 1; capped against rounding). The rest was busy, or free for no logged
    reason (a stall). None without a backlog."""
    slots = float(doc["scheduler"]["overall"]["cap_slot_s"])
    waited = float(doc["scheduler"]["rate_waits"]["before_admission_s"])
    return round(min(1.0, waited / slots), 4) if slots else None


def settle_dead_letters(triage: dict[str, Any], standing: int) -> None:
    """Give the dead-letter finding the dead letters that still stand once a retry pass has run
    some again (`items.by_item.dead`): the finding counts spans, and told a run whose retry pass
    answered every one to run `retry-failed`, which it had just done."""
    for finding in triage["findings"]:
        if finding["id"] == "dead_letters":
            finding["evidence"]["standing"] = standing
            if not standing:
                finding["control"] = ("nothing: a retry pass has answered every one of them "
                                      "since; the reasons say what failed before it")


def _finding(fid: str, title: str, evidence: dict[str, Any], meaning: str,
             control: str) -> dict[str, Any]:
    return {"id": fid, "present": True, "title": title, "evidence": evidence,
            "meaning": meaning, "control": control}


def triage_section(doc: dict[str, Any]) -> dict[str, Any]:
    """The `triage` part of the report document."""
    top, findings = dominant(doc["latency"]), other_findings(doc)
    share = rate_share_of_slots(doc)
    if top is not None and top["bucket"] == "t_queue" and (
            share is not None and share >= RATE_LIMIT_DOMINANT_SHARE):
        # Most of the queue time was a wait for a rate limit, not for the cap: a bigger cap
        # would only wait too, so the advice is the rate limit's.
        top["meaning"], top["control"] = TABLE["rate_limit"]
    att = doc["attempts"]
    if top is not None and top["bucket"] == "t_retry" and (
            att["server_limit"]["held_retries"] > sum(own_retries(att).values())):
        # Most retries were the server's rate-limit holds: no timeout to fix, its limit's
        # advice instead, the finding's own (held_retries > 0, so there is one): holds too few
        # to have set the pace (`limit_set_pace`) are no reason to set a rate limit.
        (limit,) = [f["id"] for f in findings if f["id"].startswith("server_rate_limit")]
        top["meaning"], top["control"] = TABLE[limit]
    return {
        "dominant_bucket": top,
        "signatures": [ttft_tail(doc["latency"]), idle_gaps(doc["scheduler"])],
        "findings": findings,
    }

"""The terminal report: pure `format_*` functions from the report document to lines of text."""

from __future__ import annotations

from typing import Any

from shardrun._ellipsis import counted
from shardrun.aggregate import BUCKETS
from shardrun.report._table import ms, num, pct, secs, short, size, table, when

MAX_MINUTE_ROWS = 30
LATENCY_ROWS = (*BUCKETS, "ttft", "ttft_request", "itl", "tpot", "e2e")
MAX_SHARD_COLUMNS = 8


def format_report(doc: dict[str, Any]) -> str:
    """The whole terminal report."""
    parts = [
        format_header(doc), format_passes(doc), format_items(doc), format_tpm(doc),
        format_latency(doc), format_segments(doc), format_attempts(doc), format_scheduler(doc),
        format_cost(doc), format_integrity(doc), format_triage(doc), format_notes(doc),
    ]  # fmt: skip
    return "\n\n".join(p for p in parts if p)


def format_header(doc: dict[str, Any]) -> str:
    run = doc["run"]
    return "\n".join([
        f"shardrun report  {run['run_id']}  [{run['state'].upper()}]",
        f"  {run['state_reason']}",
        f"  dir     {run['dir']}",
        f"  window  {when(run['start_t'])} -> {when(run['end_t'])}  "
        f"({num(run['duration_s'], 1)} s in {len(run['passes'])} pass"
        f"{'es' if len(run['passes']) != 1 else ''}, {run['shard_logs']} shard logs)",
    ])  # fmt: skip


def format_passes(doc: dict[str, Any]) -> str:
    """Each pass's settings, where they came from and what it achieved; none for a lone pass."""
    passes = doc["run"]["passes"]
    if len(passes) < 2:
        return ""
    rows = []
    for p in passes:
        settings = p.get("settings") or {}
        rows.append([
            str(p["segment"]), p.get("kind") or "?", _pass_status(p, passes, doc["run"]),
            _setting(settings.get("shards")), _setting(settings.get("concurrency")),
            _setting(settings.get("rate_limits.rpm")), _setting(settings.get("rate_limits.tpm")),
            num(p["succeeded"]), num(p["dead"]), num(p["completion_tpm"]),
            ms(p.get("ttft_request_p50")), pct(p["http_429_share"]),
            pct(p["rate_limited_share"]),
        ])  # fmt: skip
    headers = ["pass", "kind", "status", "shards", "concurrency", "rpm", "tpm", "ok", "dead",
               "TPM", "TTFT p50 ms", "429s", "rate-limited"]
    return "\n".join([
        "Passes (each setting's source unless a default; TPM over the pass's window; TTFT of "
        "its requests, the server's wait; 429s of its attempts; rate-limited: its slot time "
        "under backlog a rate limit held)",
        *table(headers, rows)])


def _pass_status(p: dict[str, Any], passes: list[dict[str, Any]], run: dict[str, Any]) -> str:
    """The status its coordinator logged at its end; a pass that logged none did not end: one
    that a later pass followed crashed (a killed coordinator), the newest is as the run is."""
    if status := p.get("status"):
        return str(status)
    if p is not passes[-1]:
        return "crashed"
    return run["state"] if run.get("state") in ("crashed", "running") else "?"


def _setting(entry: Any) -> str:
    """`8 (env SHARDRUN_CONCURRENCY)`; a default or unset limit as its value alone."""
    if not isinstance(entry, dict):
        return "?"
    value = "none" if entry.get("value") is None else short(entry["value"])
    source = entry.get("source")
    return value if source in (None, "default") else f"{value} ({source})"


def format_items(doc: dict[str, Any]) -> str:
    it, att = doc["items"], doc["attempts"]
    rows = [
        ["spans", num(it["queued"]), "succeeded", num(it["succeeded"]),
         "success rate", pct(it["success_rate"], 2)],
        ["dead", num(it["dead"]), "still open", num(it["open"]),
         "rejected input lines", num(it["rejected_input_lines"])],
        ["abandoned", num(it["abandoned"]), "lost at restart", num(it["abandoned_at_restart"]),
         "", ""],
        ["completion tokens", num(it["completion_tokens"]), "prompt tokens",
         num(it["prompt_tokens"]), "wasted tokens", num(att["wasted_tokens"])],
    ]  # fmt: skip
    if it.get("cached_tokens") or it.get("reasoning_tokens"):  # where the server counted them
        rows.append(["reasoning of those", num(it.get("reasoning_tokens") or 0),
                     "cached of those", num(it.get("cached_tokens") or 0), "", ""])
    if it.get("refusals"):  # absent from reports made before it existed
        rows.insert(1, ["", "", "of them refusals", num(it["refusals"]), "", ""])
    lines = ["Items (per span: one per pass that handed an item out, so a retry pass counts it "
             "again)", *table(["", "", "", "", "", ""], rows)[1:]]
    if estimated := estimated_text(doc):
        lines.append(f"  {estimated}")
    if by_item := it.get("by_item"):
        lines.append(f"  by item, after the retry passes: {num(by_item['succeeded'])} succeeded, "
                     f"{counted(by_item['dead'], 'dead letter')} standing, success rate "
                     f"{pct(by_item['success_rate'], 2)}")
        if answered := by_item.get("answered_dead"):  # absent from reports made before it
            are = "is of an item" if answered == 1 else "are of items"
            lines.append(f"  {counted(answered, 'dead letter')} {are} answered later (a result "
                         "line too), so counted as answered, not standing")
    if missing := it.get("not_in_log"):  # a log was cut: right under the counts
        # Only the kinds there are: one of the two may be zero.
        kinds = [f"{num(missing['succeeded'])} more succeeded" if missing["succeeded"] else "",
                 counted(missing["dead"], "dead letter") if missing["dead"] else ""]
        lines.append(f"  not in the event log: {' and '.join(filter(None, kinds))} "
                     "on disk (a log cut by a full disk or a power cut; see Notes), in no "
                     # The fold does not say which open spans these are: not subtracted.
                     "figure here but still open where the log began their spans")
    return "\n".join(lines)


def estimated_text(doc: dict[str, Any]) -> str | None:
    """That the run's token counts are partly the client's own (the server sent no usage), or
    None when the server counted them all. Run-wide: the peak minute may hold none of them."""
    it = doc.get("items") or {}
    n = it.get("estimated_successes")  # absent from reports made before it existed
    if not n:
        return None
    return (f"across the run, {num(n)} of {num(it['succeeded'])} successes' token counts are "
            "estimated (the server sent no usage)")


def tpm_estimated_text(doc: dict[str, Any]) -> str | None:
    """`estimated_text` and how much of the peak minute (the best partial one, if none is
    full) is estimated, which is what makes its TPM an estimate or not."""
    if (run_wide := estimated_text(doc)) is None:
        return None
    tpm = doc["tpm"]
    peak = tpm["peak_full_minute"] or tpm["best_minute_any"]
    if peak is None or "estimated_completion_tokens" not in peak:  # a report made before it
        return run_wide
    which = "the peak full minute" if tpm["peak_full_minute"] else "the best partial minute"
    estimated, tokens = peak["estimated_completion_tokens"], peak["completion_tokens"]
    if not estimated:
        return f"{run_wide}; in {which}, none: its TPM is the server's count"
    if estimated == tokens:  # "partly" would undersell it: none of the minute is the server's
        return f"{run_wide}; in {which}, all {num(tokens)} of its tokens: its TPM is an estimate"
    return (f"{run_wide}; in {which}, {num(estimated)} of its {num(tokens)} tokens: its TPM is "
            "partly an estimate")


def format_tpm(doc: dict[str, Any]) -> str:
    tpm = doc["tpm"]
    headers, rows = _minute_rows(tpm)
    shown = rows[:MAX_MINUTE_ROWS]
    lines = ["Completion TPM (tokens of successful spans, by UTC minute of the last token; "
             "* = the shard's own peak full minute)", *table(headers, shown)]
    if len(rows) > len(shown):
        lines.append(f"  … {counted(len(rows) - len(shown), 'more minute')} in --json")
    lines += _peak_lines(tpm)
    lines.append(f"  run average: {num(tpm['run_average_tpm'])} tokens/min")
    if estimated := tpm_estimated_text(doc):
        lines.append(f"  {estimated}")
    return "\n".join(lines)


def _minute_rows(tpm: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per-shard columns for up to `MAX_SHARD_COLUMNS` shard logs, else their min and max."""
    shards = tpm["shards"]
    peaks = {(p["minute"], i) for i, p in enumerate(tpm["per_shard_peak"]) if p["minute"]}
    wide = len(shards) <= MAX_SHARD_COLUMNS
    headers = ["minute", "tokens", "spans",
               *((f"shard {s}" for s in shards) if wide else ("min shard", "max shard")), ""]
    rows = []
    for r in tpm["minutes"]:
        split = r["per_shard"]
        cells = ([num(v) + ("*" if (r["minute"], i) in peaks else " ")
                  for i, v in enumerate(split)] if wide
                 else [num(min(split, default=0)), num(max(split, default=0))])
        rows.append([r["minute"], num(r["completion_tokens"]), num(r["spans"]), *cells,
                     "partial" if r["partial"] else "full"])
    return headers, rows


def _peak_lines(tpm: dict[str, Any]) -> list[str]:
    peak = tpm["peak_full_minute"]
    if peak is None:
        best = tpm["best_minute_any"]
        return ["  peak full minute: none (no minute lies wholly inside the run)"
                + (f"; best partial minute {best['minute']} with "
                   f"{num(best['completion_tokens'])} tokens" if best else "")]
    return [f"  peak full minute: {peak['minute']}  {num(peak['completion_tokens'])} "
            f"tokens/min ({num(peak['spans'])} spans)",
            "  each shard's own peak: " + ",  ".join(
                f"{p['shard']}: {num(p['completion_tokens'])} at {p['minute'][11:]}"
                if p["minute"] else f"{p['shard']}: none"  # no full minute of its own
                for p in tpm["per_shard_peak"])]


def _dist_row(name: str, d: dict[str, Any] | None, share: float | None) -> list[str]:
    if d is None:
        return [name, "0", "-", "-", "-", "-", "-", pct(share)]
    return [name, num(d["n"]), ms(d["p50"]), ms(d["p95"]), ms(d["p99"]),
            ms(d["max"]), ms(d["mean"]), "" if share is None else pct(share)]


def format_latency(doc: dict[str, Any]) -> str:
    lat = doc["latency"]
    shares = lat["bucket_share"]
    rows = [_dist_row(n, lat["all"][n], shares.get(n)) for n in LATENCY_ROWS]
    err = lat["relative_error"]
    return "\n".join([
        f"Latency of successful spans, ms (quantiles within ±{100 * err:.1f}%; "
        "share = of summed bucket time)",
        *table(["", "n", "p50", "p95", "p99", "max", "mean", "share"], rows),
    ])  # fmt: skip


def format_segments(doc: dict[str, Any]) -> str:
    segs = doc["latency"]["by_prompt_length"]
    if not segs:
        return ""
    rows = []
    for seg in segs:
        for i, stat in enumerate(("p50", "p95", "p99", "max")):
            label = [seg["segment"], num(seg["spans"])] if i == 0 else ["", ""]
            rows.append([*label, stat, *(_stat(seg["dists"][n], stat) for n in LATENCY_ROWS)])
    return "\n".join(["By prompt length (tokens), ms",
                      *table(["prompt", "spans", "", *LATENCY_ROWS], rows)])


def _stat(d: dict[str, Any] | None, stat: str) -> str:
    return "-" if d is None else ms(d[stat])


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {num(v)}" for k, v in counts.items()) or "none"


def format_attempts(doc: dict[str, Any]) -> str:
    att, conn, lag = doc["attempts"], doc["connections"], doc["loop_lag"]
    limited = "CLIENT-LIMITED" if lag["client_limited"] else "not client-limited"
    return "\n".join([
        "Attempts, connections, client",
        f"  attempts {num(att['started'])} (first {num(att['first'])}), retries "
        # Not the triage's retry_rate_without_outage_waits: this counts every retry line.
        f"{num(att['retries'])}: retry rate with outage waits {pct(att['retry_rate'], 2)}, "
        f"{num(att['attempts_per_success'], 3)} attempts per success",
        f"  by status: {_counts(att['by_status'])}",
        f"  retry causes: {_counts(att['retry_causes'])}",
        f"  dead-letter reasons: {_counts(att['dead_reasons'])}",
        f"  connections: {num(conn['new'])} new, {num(conn['reused'])} reused, "
        f"{num(conn['resent'])} requests sent again (a pooled one found dead); churn "
        f"{num(conn['churn_per_success'], 4)} new per success (shards x cap / items = "
        f"{num(conn['expected_churn'], 4)})",
        f"  event-loop lag: p50 {ms(lag['p50'])} ms, p99 {ms(lag['p99'])} ms, max "
        f"{ms(lag['max'])} ms over {num(lag['samples'])} samples: {limited} (limits p50 >= "
        f"{ms(lag['limits']['p50_s'])} ms or p99 >= {ms(lag['limits']['p99_s'])} ms)",
        f"  client CPU: {_client_cpu(doc['client_cpu'])}",
    ])  # fmt: skip


def _client_cpu(cpu: dict[str, Any]) -> str:
    # Why passes recorded none: the reason a pass gave at its end (as its summary printed it),
    # or, for a pass without one, that it did not end cleanly.
    why = list(cpu.get("unknown") or [])
    if len(why) < cpu["passes"] - cpu["passes_recorded"]:
        why.append("a pass that did not end cleanly records none")
    if cpu["cpu_s"] is None:
        return ("unknown: " + "; ".join(why) if cpu.get("unknown")
                else "not in the log (no pass recorded it at its run_end)")
    if cpu["passes_recorded"] < cpu["passes"]:
        return (f"{num(cpu['cpu_s'], 1)} s in {cpu['passes_recorded']} of {cpu['passes']} "
                f"passes ({'; '.join(why)})")
    # Null under CORES_MIN_WALL_S of windows: left out, as the run's summary leaves it out.
    cores = "" if cpu["cores"] is None else f", {num(cpu['cores'], 2)} cores on average"
    return (f"{num(cpu['cpu_s'], 1)} s user+sys of coordinator, launcher and shards: "
            f"{num(cpu['ms_per_attempt'], 3)} ms per attempt, "
            f"{num(cpu['s_per_1k_completion_tokens'], 4)} s per 1k completion tokens{cores}")


def format_scheduler(doc: dict[str, Any]) -> str:
    sch = doc["scheduler"]
    rows = [[str(r["shard"]), str(r["cap"]), secs(r["observed_s"]), *_gap_cells(r),
             secs(r["idle_before_input_end_s"]), pct(r["idle_fraction"], 2)]
            for r in sch["shards"]]
    o = sch["overall"]
    rows.append(["all", "", "", *_gap_cells(o), secs(o["cross_shard_idle_s"]),
                 pct(o["cross_shard_idle_fraction"], 2)])
    waits = sch["rate_waits"]
    lines = [
        "Scheduler (exact step functions; seconds; stall = gap less our own rate-limit waits; "
        "occupancy = busy / cap slot-seconds under backlog, a slot busy while its item waits "
        "for a retry too; sending = requests out / cap slot-seconds under backlog)",
        *table(["shard", "cap", "observed", "backlog", "gap", "gap_fraction", "occupancy",
                "sending", "rate-limited", "stall", "idle<input_end", "idle %"], rows),
        "  input_end at " + ", ".join(
            when(t) if t else "(not logged: work still unassigned)" for t in sch["input_end_t"]),
    ]  # fmt: skip
    if waits["count"]:
        lines.append(f"  rate-limit waits: {num(waits['count'])}, "
                     f"{secs(waits['before_admission_s'])} s before admission (in t_queue), "
                     f"{secs(waits['before_retries_s'])} s before retries (in t_retry)")
    return "\n".join(lines)


def _gap_cells(r: dict[str, Any]) -> list[str]:
    return [secs(r["backlog_s"]), secs(r["gap_s"]), pct(r["gap_fraction"], 2),
            pct(r["occupancy_under_backlog"], 2), pct(r["sending_under_backlog"], 2),
            secs(r["rate_limited_gap_s"]), pct(r["stall_gap_fraction"], 2)]


def format_cost(doc: dict[str, Any]) -> str:
    cost = doc["cost"]
    if not cost or cost.get("basis") is None:
        return ""
    per_token = cost["basis"] == "tokens"
    basis = "per token" if per_token else f"hourly, {_money(cost['hours'])} h of wall time"
    lines = [
        f"Cost ({basis})",
        f"  spend {_money(cost['spend'])}, cost per success "
        f"{_money(cost['cost_per_success'])}, wasted tokens {num(cost['wasted_tokens'])} "
        f"costing {_money(cost['wasted_cost'])}",
    ]  # fmt: skip
    if per_token:
        cached = cost.get("cached_tokens") or 0  # absent from reports made before it existed
        lines.append(f"  input {_money(cost['input_cost'])}"
                     + (f" ({num(cached)} prompt tokens cached)" if cached else "")
                     + f", output {_money(cost['output_cost'])}")
    return "\n".join(lines)


def _money(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def format_integrity(doc: dict[str, Any]) -> str:
    rows = []
    for f in doc["integrity"]["files"]:
        ended = {True: "shard_end", False: "NO shard_end", None: ""}[f["shard_end"]]
        state = _coverage(f)
        rows.append([f["path"], num(f["lines"]), size(f["bytes"]), num(f["checkpoints"]),
                     state, ended, "torn tail" if f["torn_tail_bytes"] else ""])
    return "\n".join(["Event files (running SHA-256 checked at every checkpoint)",
                      *table(["file", "lines", "bytes", "checkpoints", "coverage", "", ""],
                             rows)])


def _coverage(f: dict[str, Any]) -> str:
    if f["checkpoint_error"]:
        return "CHECKPOINT MISMATCH"
    if not f["lines"]:
        return "empty"
    if not f["covered_lines"]:
        return "no checkpoint yet"
    return f"lines 1-{num(f['covered_lines'])} verified"


def format_triage(doc: dict[str, Any]) -> str:
    tri = doc["triage"]
    lines = ["Triage"]
    dom = tri["dominant_bucket"]
    if dom:
        ev = dom["evidence"]
        lines += [f"  dominant bucket: {dom['bucket']}, {pct(dom['share'])} of summed span "
                  f"time (p50 {ms(ev['p50'])} ms, p99 {ms(ev['p99'])} ms)",
                  f"      means: {dom['meaning']}", f"      try:   {dom['control']}"]
    for f in [*tri["signatures"], *tri["findings"]]:
        mark = "[!]" if f["present"] else "[ ]"
        status = "SEEN" if f["present"] else "not seen"
        lines.append(f"  {mark} {f['title']}: {status}; {_evidence(f['evidence'])}")
        if f["present"]:
            lines += [f"      means: {f['meaning']}", f"      try:   {f['control']}"]
    return "\n".join(lines)


def _evidence(ev: dict[str, Any]) -> str:
    out = []
    for k, v in ev.items():
        text = ", ".join(f"{a} {short(b)}" for a, b in v.items()) if isinstance(v, dict) else (
            short(v))
        out.append(f"{k} {text}")
    return "; ".join(out)


def format_notes(doc: dict[str, Any]) -> str:
    return "\n".join(["Notes", *(f"  - {n}" for n in doc["notes"])]) if doc["notes"] else ""

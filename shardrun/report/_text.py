"""The terminal report: pure `format_*` functions from the report document to lines of text."""

from __future__ import annotations

from typing import Any

from shardrun.aggregate import BUCKETS
from shardrun.report._table import ms, num, pct, secs, short, size, table, when

MAX_MINUTE_ROWS = 30
LATENCY_ROWS = (*BUCKETS, "ttft", "ttft_request", "itl", "tpot", "e2e")
SEGMENT_COLUMNS = ("t_queue", "t_first_token", "t_stream", "ttft", "e2e")


def format_report(doc: dict[str, Any]) -> str:
    """The whole terminal report."""
    parts = [
        format_header(doc), format_items(doc), format_tpm(doc), format_latency(doc),
        format_segments(doc), format_attempts(doc), format_scheduler(doc), format_cost(doc),
        format_integrity(doc), format_triage(doc), format_notes(doc),
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


def format_items(doc: dict[str, Any]) -> str:
    it, att = doc["items"], doc["attempts"]
    rows = [
        ["items", num(it["queued"]), "succeeded", num(it["succeeded"]),
         "success rate", pct(it["success_rate"], 2)],
        ["dead", num(it["dead"]), "still open", num(it["open"]),
         "rejected input lines", num(it["rejected_input_lines"])],
        ["completion tokens", num(it["completion_tokens"]), "prompt tokens",
         num(it["prompt_tokens"]), "wasted tokens", num(att["wasted_tokens"])],
    ]  # fmt: skip
    return "\n".join(["Items", *table(["", "", "", "", "", ""], rows)[1:]])


def format_tpm(doc: dict[str, Any]) -> str:
    tpm = doc["tpm"]
    shards = tpm["shards"]
    rows = [[r["minute"], num(r["completion_tokens"]), num(r["spans"]),
             *(num(v) for v in r["per_shard"]), "partial" if r["partial"] else "full"]
            for r in tpm["minutes"]]
    shown = rows[:MAX_MINUTE_ROWS]
    lines = ["Completion TPM (tokens of successful spans, by UTC minute of the last token)",
             *table(["minute", "tokens", "spans", *(f"shard {s}" for s in shards), ""], shown)]
    if len(rows) > len(shown):
        lines.append(f"  … {len(rows) - len(shown)} more minutes in --json")
    peak = tpm["peak_full_minute"]
    if peak is None:
        best = tpm["best_minute_any"]
        lines.append("  peak full minute: none (no minute lies wholly inside the run)"
                     + (f"; best partial minute {best['minute']} with "
                        f"{num(best['completion_tokens'])} tokens" if best else ""))
    else:
        lines.append(f"  peak full minute: {peak['minute']}  {num(peak['completion_tokens'])} "
                     f"tokens/min ({num(peak['spans'])} spans)")
        lines.append("  each shard's own peak: " + ",  ".join(
            f"{p['shard']}: {num(p['completion_tokens'])} at {(p['minute'] or '-')[11:]}"
            for p in tpm["per_shard_peak"]))
    lines.append(f"  run average: {num(tpm['run_average_tpm'])} tokens/min")
    return "\n".join(lines)


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
        cells = [seg["segment"], num(seg["spans"])]
        for name in SEGMENT_COLUMNS:
            d = seg["dists"][name]
            cells.append("-" if d is None else f"{ms(d['p50'])} / {ms(d['p99'])}")
        rows.append(cells)
    return "\n".join(["By prompt length (tokens): p50 / p99 ms",
                      *table(["prompt", "spans", *SEGMENT_COLUMNS], rows)])


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {num(v)}" for k, v in counts.items()) or "none"


def format_attempts(doc: dict[str, Any]) -> str:
    att, conn, lag = doc["attempts"], doc["connections"], doc["loop_lag"]
    limited = "CLIENT-LIMITED" if lag["client_limited"] else "not client-limited"
    return "\n".join([
        "Attempts, connections, client",
        f"  attempts {num(att['started'])} (first {num(att['first'])}), retries "
        f"{num(att['retries'])}: retry rate {pct(att['retry_rate'], 2)}, "
        f"{num(att['attempts_per_success'], 3)} attempts per success",
        f"  by status: {_counts(att['by_status'])}",
        f"  retry causes: {_counts(att['retry_causes'])}",
        f"  dead-letter reasons: {_counts(att['dead_reasons'])}",
        f"  connections: {num(conn['new'])} new, {num(conn['reused'])} reused; churn "
        f"{num(conn['churn_per_success'], 4)} new per success (shards x cap / items = "
        f"{num(conn['expected_churn'], 4)})",
        f"  event-loop lag: p50 {ms(lag['p50'])} ms, p99 {ms(lag['p99'])} ms, max "
        f"{ms(lag['max'])} ms over {num(lag['samples'])} samples: {limited} (limits p50 >= "
        f"{ms(lag['limits']['p50_s'])} ms or p99 >= {ms(lag['limits']['p99_s'])} ms)",
    ])  # fmt: skip


def format_scheduler(doc: dict[str, Any]) -> str:
    sch = doc["scheduler"]
    rows = [[str(r["shard"]), str(r["cap"]), secs(r["observed_s"]), secs(r["backlog_s"]),
             secs(r["gap_s"]), pct(r["gap_fraction"], 2), secs(r["idle_before_input_end_s"]),
             pct(r["idle_fraction"], 2)] for r in sch["shards"]]
    o = sch["overall"]
    rows.append(["all", "", "", secs(o["backlog_s"]), secs(o["gap_s"]),
                 pct(o["gap_fraction"], 2), secs(o["cross_shard_idle_s"]),
                 pct(o["cross_shard_idle_fraction"], 2)])
    return "\n".join([
        "Scheduler (exact step functions; seconds)",
        *table(["shard", "cap", "observed", "backlog", "gap", "gap_fraction",
                "idle<input_end", "idle %"], rows),
        "  input_end at " + ", ".join(
            when(t) if t else "(not logged: work still unassigned)" for t in sch["input_end_t"]),
    ])  # fmt: skip


def format_cost(doc: dict[str, Any]) -> str:
    cost = doc["cost"]
    if not cost or cost.get("basis") is None:
        return ""
    basis = ("per token" if cost["basis"] == "tokens"
             else f"hourly, {_money(cost['hours'])} h of wall time")
    return "\n".join([
        f"Cost ({basis})",
        f"  spend {_money(cost['spend'])}, cost per success "
        f"{_money(cost['cost_per_success'])}, wasted tokens {num(cost['wasted_tokens'])} "
        f"costing {_money(cost['wasted_cost'])}",
    ])  # fmt: skip


def _money(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def format_integrity(doc: dict[str, Any]) -> str:
    rows = []
    for f in doc["integrity"]["files"]:
        ended = {True: "shard_end", False: "NO shard_end", None: ""}[f["shard_end"]]
        state = ("CHECKPOINT MISMATCH" if f["checkpoint_error"]
                 else f"lines 1-{num(f['covered_lines'])} verified")
        rows.append([f["path"], num(f["lines"]), size(f["bytes"]), num(f["checkpoints"]),
                     state, ended, "torn tail" if f["torn_tail_bytes"] else ""])
    return "\n".join(["Event files (running SHA-256 checked at every checkpoint)",
                      *table(["file", "lines", "bytes", "checkpoints", "coverage", "", ""],
                             rows)])


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

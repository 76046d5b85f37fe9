"""`report --html`: one self-contained HTML file (plotly.js inlined, opens offline).

Plotly is an optional extra (`pip install -e '.[html]'`), imported only here and only when
asked for. It ships no type information, so it is reached through `importlib` as `Any`.
"""

from __future__ import annotations

import html
import importlib
from pathlib import Path
from typing import Any

from shardrun.aggregate import BUCKETS, SEGMENT_LABELS, ShardSummary, minute_label
from shardrun.aggregate._segments import merge_segments
from shardrun.errors import ShardrunError
from shardrun.itl import bucket_mid
from shardrun.outpath import cannot_write, write_bytes_atomically
from shardrun.report._rundir import LoadedRun
from shardrun.report._text import format_report, tpm_estimated_text

MAX_STEP_PANELS = 16


class HtmlExtraMissing(ShardrunError):
    """Plotly is not installed."""

    exit_code = 2


def _plotly() -> tuple[Any, Any]:
    try:
        go = importlib.import_module("plotly.graph_objects")
        subplots = importlib.import_module("plotly.subplots")
    except ImportError:
        raise HtmlExtraMissing(
            "--html needs the html extra: in shardrun's directory, "
            ".venv/bin/pip install -e '.[html]'") from None
    return go, subplots


def write_html(doc: dict[str, Any], loaded: LoadedRun, path: Path) -> None:
    """Write the report's plots and its text summary to `path`."""
    go, subplots = _plotly()
    figures = [
        tpm_figure(go, doc), steps_figure(go, subplots, doc, loaded.shards),
        buckets_figure(go, doc), ttft_figure(go, loaded.shards), retries_figure(go, doc),
    ]  # fmt: skip
    divs = [fig.to_html(full_html=False, include_plotlyjs=(i == 0), default_width="100%")
            for i, fig in enumerate(figures)]
    title = html.escape(f"shardrun report {doc['run']['run_id']}")
    text = html.escape(format_report(doc))
    page = (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{title}</title></head>"
            f"<body style='font-family:sans-serif'><h1>{title}</h1>\n"
            + "\n".join(divs)
            + f"\n<h2>Summary</h2><pre>{text}</pre></body></html>\n")
    # Through a temporary file, as export's: a page a full disk cut short renders as a whole
    # one, its last plots and the summary missing. A device or a pipe is written in place.
    try:
        write_bytes_atomically(path, page.encode())
    except OSError as exc:
        raise cannot_write("--html", path, exc) from None


def tpm_figure(go: Any, doc: dict[str, Any]) -> Any:
    """Aggregate completion tokens per minute, stacked by shard, each shard's peak marked."""
    tpm = doc["tpm"]
    x = [r["minute"] + (" (partial)" if r["partial"] else "") for r in tpm["minutes"]]
    fig = go.Figure()
    for i, shard in enumerate(tpm["shards"]):
        fig.add_bar(name=f"shard {shard}", x=x, y=[r["per_shard"][i] for r in tpm["minutes"]])
    peaks = [p for p in tpm["per_shard_peak"] if p["minute"] is not None]
    fig.add_scatter(name="shard peak", mode="markers", marker_symbol="star", marker_size=12,
                    x=[_label(tpm, p["minute"]) for p in peaks],
                    y=[p["completion_tokens"] for p in peaks],
                    text=[f"shard {p['shard']}" for p in peaks])
    peak = tpm["peak_full_minute"]
    sub = f"peak full minute {peak['minute']}: {peak['completion_tokens']:,}" if peak else (
        "no full minute")
    title = f"Completion tokens per minute ({sub})"
    if estimated := tpm_estimated_text(doc):  # on the plot itself: it may be shown alone
        title += f"<br><sup>{estimated}</sup>"  # plain words: nothing to escape
    fig.update_layout(barmode="stack", title=title, yaxis_title="completion tokens / min")
    return fig


def _label(tpm: dict[str, Any], minute: str) -> str:
    row = next(r for r in tpm["minutes"] if r["minute"] == minute)
    return minute + (" (partial)" if row["partial"] else "")


def steps_figure(go: Any, subplots: Any, doc: dict[str, Any],
                 shards: list[ShardSummary]) -> Any:
    """in_flight, cap and queue depth of each shard over time (exact step functions)."""
    traced = [s for s in shards if s.trace is not None]
    shown = traced[:MAX_STEP_PANELS]
    t0 = doc["run"]["start_t"] or 0.0
    # Titled by the log's name: a resumed run has one log per shard and pass ("03", "03.r1").
    fig = subplots.make_subplots(rows=max(1, len(shown)), cols=1, shared_xaxes=True,
                                 subplot_titles=[f"shard log {s.name or s.shard}"
                                                 for s in shown])
    for row, s in enumerate(shown, start=1):
        for name, xs, ys in _step_series(s, t0):
            fig.add_trace(go.Scattergl(x=xs, y=ys, name=name, line_shape="hv",
                                       legendgroup=name, showlegend=row == 1), row=row, col=1)
    exact = all(s.trace is not None and s.trace.exact for s in shown)
    how = "exact step functions" if exact else "per-second envelopes (many change points)"
    cut = (f"; the first {len(shown)} of {len(traced)} shard logs"
           if len(traced) > len(shown) else "")
    fig.update_layout(title=f"in_flight vs cap vs queue depth ({how}{cut}); seconds since run "
                            "start",
                      height=220 * max(1, len(shown)) + 120)
    return fig


def _step_series(s: ShardSummary, t0: float) -> list[tuple[str, list[float], list[int]]]:
    trace = s.trace
    assert trace is not None
    if trace.bins is None:
        xs = [t - t0 for t, _, _ in trace.points]
        out = [("in_flight", xs, [f for _, _, f in trace.points]),
               ("queue depth", xs, [q for _, q, _ in trace.points])]
    else:
        secs = sorted(trace.bins)
        xs = [sec - t0 for sec in secs]
        out = [("in_flight max", xs, [trace.bins[k][2] for k in secs]),
               ("in_flight min", xs, [trace.bins[k][1] for k in secs]),
               ("queue depth max", xs, [trace.bins[k][0] for k in secs])]
    if xs:
        out.append(("cap", [xs[0], xs[-1]], [s.cap, s.cap]))
    return out


def buckets_figure(go: Any, doc: dict[str, Any]) -> Any:
    """p50 / p95 / p99 / max of each bucket and of TTFT, ITL, TPOT and end-to-end time."""
    lat = doc["latency"]["all"]
    names = [*BUCKETS, "ttft", "ttft_request", "itl", "tpot", "e2e"]
    fig = go.Figure()
    for q in ("p50", "p95", "p99", "max"):
        fig.add_bar(name=q, x=names, y=[(lat[n] or {}).get(q) for n in names])
    fig.update_layout(barmode="group", title="Time-bucket percentiles (seconds, log scale)",
                      yaxis_type="log", yaxis_title="seconds")
    return fig


def ttft_figure(go: Any, shards: list[ShardSummary]) -> Any:
    """The distribution of user-seen TTFT in each prompt-length segment."""
    segments = merge_segments([s.segments for s in shards])
    fig = go.Figure()
    for i in sorted(segments):
        counts = segments[i].named()["ttft"].counts
        keys = sorted(counts)
        n = sum(counts.values()) or 1
        fig.add_scatter(name=f"prompt {SEGMENT_LABELS[i]} tokens", mode="lines+markers",
                        x=[bucket_mid(b) for b in keys], y=[counts[b] / n for b in keys])
    fig.update_layout(title="TTFT distribution by prompt length (fraction of spans per bucket)",
                      xaxis_type="log", xaxis_title="TTFT, seconds", yaxis_title="fraction")
    return fig


def retries_figure(go: Any, doc: dict[str, Any]) -> Any:
    """Retries per minute, stacked by cause."""
    rows = doc["attempts"]["retries_by_minute"]
    causes = sorted({c for r in rows for c in r["causes"]})
    x = [minute_label(r["start"] // 60) for r in rows]
    fig = go.Figure()
    for cause in causes:
        fig.add_bar(name=cause, x=x, y=[r["causes"].get(cause, 0) for r in rows])
    title = "Retries by cause per minute" + ("" if rows else " (no retries)")
    fig.update_layout(barmode="stack", title=title, yaxis_title="retries")
    return fig

"""Readers and renderers around the aggregator: `shardrun report` for terminal, JSON and HTML.

    load_report(run_dir)        read every event file -> (report document, LoadedRun)
    format_report(doc)          the terminal summary (pure)
    format_json(doc)            the JSON document (pure)
    write_html(doc, run, path)  the self-contained HTML file (needs the `html` extra)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from shardrun._ellipsis import counted
from shardrun.aggregate import (
    RunFacts,
    build_report,
    pricing_from_effective,
    ratio,
    recorded_passes,
)
from shardrun.aggregate._triage import settle_dead_letters
from shardrun.errors import RunDirError
from shardrun.manifest import asked_otherwise, changed_results
from shardrun.report._html import HtmlExtraMissing, write_html
from shardrun.report._rundir import (
    FoldOptions,
    LoadedRun,
    foreign_text,
    load_run,
    run_state,
    standing_dead_letters,
    unlogged_text,
    where_it_went,
)
from shardrun.report._scan import FileScan
from shardrun.report._text import format_report

__all__ = [
    "FoldOptions",
    "HtmlExtraMissing",
    "LoadedRun",
    "RunDirError",
    "format_json",
    "format_report",
    "integrity_problem",
    "load_report",
    "write_html",
]


def load_report(run_dir: Path, *, trace: bool = False,
                workers: int | None = None) -> tuple[dict[str, Any], LoadedRun]:
    """Read a run directory (finished, crashed or still running) into its report document."""
    loaded = load_run(run_dir, FoldOptions(trace=trace), workers)
    state, why = run_state(loaded)
    manifest = loaded.manifest
    recorded = {f.get("path") for f in manifest.get("files") or [] if isinstance(f, dict)}
    changed = set(loaded.manifest_mismatches())
    files = [_file_entry(scan, loaded, recorded, changed) for scan in loaded.scans]
    facts = RunFacts(
        run_id=manifest.get("run_id"), run_dir=str(run_dir), state=state, state_reason=why,
        manifest_status=manifest.get("status"),
        pricing=pricing_from_effective(_effective(manifest)),
        files=files, notes=[n for f in files for n in _file_notes(f, state)],
        passes=recorded_passes(manifest),
    )  # fmt: skip
    doc = build_report(facts, loaded.coordinators, loaded.shards)
    # An event file the manifest lists that is gone would silently take its figures with it.
    if missing := loaded.missing_files():
        doc["integrity"]["missing_files"] = missing
        doc["integrity"]["ok"] = False
        doc["notes"] += [f"{p}: listed in the manifest but missing from the run directory, so "
                         f"its figures are not in this report{where_it_went(p, run_dir)}"
                         for p in missing]
    # A crashed pass lists no files: its shards' results say which logs it wrote.
    if unlogged := loaded.unlogged_files():
        doc["integrity"]["unlogged_files"] = unlogged
        doc["integrity"]["ok"] = False
        doc["notes"] += [unlogged_text(p, run_dir) for p in unlogged]
    # A log of another run would count its spans as this run's.
    if foreign := loaded.foreign_files():
        doc["integrity"]["foreign_files"] = [p for p, _ in foreign]
        doc["integrity"]["ok"] = False
        doc["notes"] += [foreign_text(p, theirs, manifest.get("run_id"))
                         for p, theirs in foreign]
    # One it does not list, though its pass had ended, adds figures no pass wrote (a copy).
    if added := loaded.unlisted_files():
        doc["integrity"]["added_files"] = added
        doc["integrity"]["ok"] = False
        doc["notes"] += [f"{p}: not in the manifest's list of the run's files, though the pass "
                         "that wrote it had ended (added since, or renamed): its figures are in "
                         "this report" for p in added]
    # Answers a cut event log (a full disk, a power cut) lacks: kept, but in no figure here.
    # Those of a live pass are left out: its shards write results read later than their logs.
    if beyond := loaded.beyond_log(live=state == "running"):
        doc["integrity"]["beyond_log"] = [b.as_dict() for b in beyond]
        doc["items"]["not_in_log"] = {
            key: sum(b.lines - b.logged for b in beyond if b.path.startswith(sub))
            for key, sub in (("succeeded", "results/"), ("dead", "dead/"))}
        doc["notes"] += [b.text() for b in beyond]
    # Spans are not items once a retry pass has run dead letters again: say how the items ended.
    if (standing := standing_dead_letters(run_dir)) is not None:
        ok, dead = doc["items"]["succeeded"], standing.dead
        doc["items"]["by_item"] = {"succeeded": ok, "dead": dead,
                                   "answered_dead": standing.answered,
                                   "success_rate": ratio(ok, ok + dead)}
        settle_dead_letters(doc["triage"], dead)
        if standing.bad:
            more = f" (and {len(standing.bad) - 1:,} more)" if len(standing.bad) > 1 else ""
            doc["notes"].append(
                f"{standing.bad[0]}{more} is not a record (the run directory was edited or "
                f"damaged), so the {dead:,} dead letters standing (by item) are a partial "
                "count: an item such a line ended may be counted wrongly")
    # Result files do not feed the figures, but answers removed by hand are answers lost.
    if edited := changed_results(manifest, run_dir):
        doc["integrity"]["results_changed"] = [
            {"path": path, "bytes_listed": listed, "bytes_now": size}
            for path, listed, size in edited]
        doc["notes"] += [
            f"{path}: {'missing' if size is None else f'{size:,} bytes'} where the manifest "
            f"recorded {listed:,}: answers were removed or changed by hand (export and --resume "
            "see what is there now)" for path, listed, size in edited]
    if asked := asked_otherwise(manifest):
        doc["notes"].append(asked)
    return doc, loaded


def integrity_problem(doc: dict[str, Any]) -> str | None:
    """The first reason not to trust the raw log a report was built from, if any.

    A failed checkpoint, unreadable lines, or a file changed since the manifest recorded its
    SHA-256. A torn last line or lines beyond the last checkpoint are not problems: a crashed or
    running run has them, and the report says how much of each file is covered.
    """
    if missing := doc["integrity"].get("missing_files"):
        more = f" (and {len(missing) - 1:,} more)" if len(missing) > 1 else ""
        return f"{missing[0]}{more} is listed in the manifest but missing from the run directory"
    for key, what in (("unlogged_files", "is missing from the run directory, though its "
                       "shard wrote results or dead letters"),
                      ("foreign_files", "holds events of another run")):
        if found := doc["integrity"].get(key):
            more = f" (and {len(found) - 1:,} more)" if len(found) > 1 else ""
            return f"{found[0]}{more} {what}"
    for f in doc["integrity"]["files"]:
        if f["checkpoint_error"]:
            return f"{f['path']}: checkpoint check failed at {f['checkpoint_error']}"
        if f["bad_lines"]:
            return f"{f['path']}: {f['bad_lines']:,} unreadable lines, first {f['first_bad'][0]}"
        if f.get("matches_manifest") is False:
            return f"{f['path']} differs from the SHA-256 the manifest recorded for it"
    if added := doc["integrity"].get("added_files"):
        more = f" (and {len(added) - 1:,} more)" if len(added) > 1 else ""
        return (f"{added[0]}{more} is not in the manifest's list of the run's files, though the "
                "pass that wrote it had ended: added since, or renamed")
    return None


def format_json(doc: dict[str, Any]) -> str:
    """The report document as indented JSON with sorted keys."""
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()


def _effective(manifest: dict[str, Any]) -> dict[str, Any]:
    """The effective settings of the latest pass (a resume may have changed prices)."""
    resumes = manifest.get("resumes") or []
    latest = resumes[-1].get("effective") if resumes and isinstance(resumes[-1], dict) else None
    found = latest or manifest.get("effective") or {}
    return found if isinstance(found, dict) else {}


def _file_entry(scan: FileScan, loaded: LoadedRun, recorded: set[Any],
                changed: set[str]) -> dict[str, Any]:
    entry = scan.as_dict()
    shard = next((s for s, sc in zip(loaded.shards, loaded.shard_scans, strict=True)
                  if sc is scan), None)
    entry["shard_end"] = None if shard is None else shard.ended
    entry["matches_manifest"] = (scan.path not in changed) if scan.path in recorded else None
    return entry


def _file_notes(f: dict[str, Any], state: str) -> list[str]:
    path, notes = f["path"], []
    if f["torn_tail_bytes"]:
        notes.append(f"{path}: torn last line ({counted(f['torn_tail_bytes'], 'byte')}) ignored"
                     + (" (the run is still writing)" if state == "running" else ""))
    if f["bad_lines"]:
        notes.append(f"{path}: {counted(f['bad_lines'], 'unreadable line')} ignored, first "
                     f"{f['first_bad'][0]}")
    if f["unknown_events"]:
        notes.append(f"{path}: {counted(f['unknown_events'], 'line')} with an event name this "
                     "version does not know, ignored")
    if f["checkpoint_error"]:
        notes.append(f"{path}: checkpoint check failed at {f['checkpoint_error']}")
    if f["matches_manifest"] is False:
        notes.append(f"{path}: differs from the SHA-256 the manifest recorded at the end of "
                     "the run (changed since)")
    if f["lines"] and not f["covered_lines"] and not f["checkpoint_error"]:
        notes.append(f"{path}: no checkpoint yet, so none of its {f['lines']:,} lines is "
                     "verified")
    elif f["lines"] and f["covered_lines"] < f["lines"]:
        pct = 100 * f["covered_bytes"] / f["bytes"] if f["bytes"] else 0.0
        notes.append(f"{path}: checkpoints cover lines 1-{f['covered_lines']:,} of "
                     f"{f['lines']:,} ({pct:.1f}% of its bytes)")
    return notes

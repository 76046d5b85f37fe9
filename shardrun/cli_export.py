"""The `shardrun export` subcommand: argument parsing and presentation only.

    shardrun export RUN_DIR [-o FILE] [--format jsonl|csv] [--job JOB.yaml] [--with-input]

Exit codes: 0 when the export was written (whatever its rows' statuses; the counts go to
standard error), 2 when the run directory, its job file or its input is unusable (the input
changed since the run included), 1 when a file of the run cannot be read or the export cannot
be written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from shardrun._ellipsis import counted
from shardrun.argtypes import file_path, job_path, path, progress_seconds
from shardrun.cli_analysis import guarded

__all__ = ["handle", "register"]


def register(subparsers: Any) -> None:
    """Add `export` to the CLI's subparsers; the handler is in `set_defaults(handler=...)`."""
    p = subparsers.add_parser(
        "export",
        help="write a run's answers as one file, one row per input record, in input order",
        description="Write one row per input record, in input order: the answer (status ok), "
                    "the reason it failed (failed), why the line was set aside (rejected), or "
                    "nothing yet (pending: resume the run). The input is read again and must "
                    "be the one the run read.",
    )  # fmt: skip
    p.add_argument("run_dir", type=path, metavar="RUN_DIR", help="the run directory")
    p.add_argument("-o", "--output", type=file_path, metavar="FILE",
                   help="the file to write (default, or -: standard output); replaced only once "
                        "the export is whole. A name ending in .tsv, .xlsx, .xls, .parquet, "
                        ".pq, .feather or .arrow, or a compressed file's, .gz, .bz2, .xz, .zst "
                        "or .zip, is refused (export writes JSON lines or CSV only) unless "
                        "--format says which to write")  # fmt: skip
    p.add_argument("--format", choices=("jsonl", "csv"),
                   help="JSON lines or CSV (default: csv when FILE ends in .csv, else jsonl)")
    p.add_argument("--job", type=job_path, metavar="JOB.yaml",
                   help="the run's job file, if it has moved since the run")
    p.add_argument("--with-input", action="store_true",
                   help="add each row's input record: as 'input' in JSON lines; in CSV as one "
                        "input.NAME column per column of a CSV or Parquet input, or per "
                        "top-level key of a JSON lines input; empty for a rejected line "
                        "that is no record (a CSV row of the wrong width, a line that is not "
                        "JSON)")  # fmt: skip
    p.add_argument("--quiet", action="store_true",
                   help="no progress on standard error (the counts at the end are kept)")
    p.add_argument("--progress-interval", type=progress_seconds, default=10.0, metavar="S",
                   help="seconds between progress lines when standard error is not a "
                        "terminal (default 10)")
    p.set_defaults(handler=handle)


@guarded
def handle(args: argparse.Namespace) -> int:
    from shardrun.export import export, format_of
    from shardrun.manifest import (
        newest_pass,
        read_manifest,
        resume_command_of,
        retry_failed_command,
    )
    from shardrun.resume import in_use
    from shardrun.ticker import Ticker

    if args.output == Path("-"):  # the usual word for standard output, not a file named -
        args.output = None
    fmt = format_of(args.output, args.format, args.run_dir)
    # Rows written to a terminal would be torn by a live line redrawn on the same screen.
    rows_on_screen = args.output is None and sys.stdout.isatty()
    ticker = Ticker(quiet=args.quiet or rows_on_screen, interval=args.progress_interval)
    try:
        summary = export(args.run_dir, args.output, fmt, args.job, args.with_input, ticker)
    finally:
        ticker.close()
    for warning in summary.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    where = "standard output" if args.output is None else str(args.output)
    print(f"exported {counted(summary.rows, 'row')} to {where} ({fmt}, in input order): "
          f"{summary.ok:,} ok, {summary.failed:,} failed, {summary.rejected:,} rejected, "
          f"{summary.pending:,} pending", file=sys.stderr)  # fmt: skip
    run = args.run_dir
    # The commands carry the newest pass's flags, as its summary's and `report`'s do.
    manifest = read_manifest(run)
    resume = resume_command_of(run, manifest, summary.job_path)
    job = str(summary.job_path or "JOB.yaml")
    retry = retry_failed_command(run, manifest, *([] if args.job is None else ["--job", job]))
    way_on = f"`{resume}` runs them"
    retry_on = f"failed: `{retry}` gives them another pass"
    if in_use(run):  # a pass at work: a --resume or retry-failed now would only wait for it
        # One that retries dead letters only never ends an input item no pass has run.
        way_on = (f"the pass at work retries dead letters only; once it ends, {way_on}"
                  if newest_pass(manifest).get("only_failed") else
                  "the run is still at work (a process holds its lock): export again once it "
                  "ends")
        # A retry-failed now is refused once it has waited a minute for the lock; a retry
        # pass at work may be retrying these very dead letters.
        retry_on = (f"failed: once the pass at work ends, `{retry}` gives those still "
                    "failed another pass")
    notes = [
        (summary.pending, "record has", "records have", f"no answer yet: {way_on}"),
        (summary.failed, "record", "records", retry_on),
        (summary.torn, "line of the run is", "lines of the run are", "cut short (a run still "
         "writing, or one killed since): their records count as pending"),
        (summary.repeated, "line repeats", "lines repeat", "an id an earlier line of the run "
         "has: the first line read was exported (answers before dead letters, each in pass "
         "order)"),
        (summary.orphans, "line of the run matches", "lines of the run match", "no input "
         "record: not in the export"),
        (summary.no_record, "rejected line is", "rejected lines are", "no record (not JSON, "
         "too long, a CSV row of the wrong width...): input left empty, the error says why"),
    ]  # fmt: skip
    for count, one, many, text in notes:
        if count:
            print(f"  {count:,} {one if count == 1 else many} {text}", file=sys.stderr)
    return 0

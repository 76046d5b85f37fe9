"""The analysis commands: `report`, `publish`, `verify`. Parse, call the library, print.

`register(subparsers)` adds them to the main parser; each sets `handler`, which takes the parsed
arguments and returns the exit code. The library raises `ShardrunError`s for user errors; the
handlers print them as `error: <message>` and return their exit code (2 for a bad run directory
or an impossible publish, a path `verify` cannot take or a run it cannot check yet; 1 for a
sample or a run that does not verify, a run `publish` refuses as altered, and a file that could
not be written). `report` prints its report whatever the log's state, and exits 1 when the log
fails its integrity check.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

from shardrun.argtypes import file_path, path
from shardrun.errors import NO_ROOM, RunDirError, RunError, ShardrunError, SpecError
from shardrun.outpath import check_not_a_run_file, check_output_file


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `report`, `publish` and `verify` subcommands."""
    report = subparsers.add_parser(
        "report", help="summarize a run from its raw event log",
        description="Summarize a run (finished, crashed or still running) from its event log. "
                    "Exit 0, or 1 when an event file fails its integrity check (a checkpoint "
                    "that does not match, unreadable lines, a file changed since the run ended, "
                    "one the manifest lists that is gone, or one it does not list though its "
                    "pass had ended; the report is printed either way), or when the --html "
                    "file cannot be written.",
    )  # fmt: skip
    report.add_argument("run_dir", type=path, metavar="RUN_DIR", help="the run directory")
    report.add_argument("--json", action="store_true",
                        help="print the report as JSON (schema shardrun.report/1)")
    report.add_argument("--html", type=file_path, metavar="FILE",
                        help="also write a self-contained HTML file with plots")
    report.set_defaults(handler=run_report)

    publish = subparsers.add_parser(
        "publish", help="publish a hash-verifiable minute sample",
        description="Write a minute sample (completion tokens of one UTC minute, with the "
                    "SHA-256 of every event file and of the counted lines) and print it. "
                    "Exit 0; 1 for a run whose files are not as it wrote them (as verify finds) "
                    "or a sample that cannot be written; 2 for a run still running or a minute "
                    "that cannot be published.",
    )  # fmt: skip
    publish.add_argument("run_dir", type=path, metavar="RUN_DIR", help="the run directory")
    which = publish.add_mutually_exclusive_group()
    which.add_argument("--minute", metavar="YYYY-MM-DDTHH:MMZ", help="the UTC minute to publish")
    which.add_argument("--peak", action="store_true",
                       help="the peak full minute (the default; the best partial minute, "
                            "flagged partial, when no minute is full), passing over a minute "
                            "a cut event log may leave short")
    publish.add_argument("-o", "--output", type=file_path, metavar="FILE",
                         help="where to write it (default: RUN_DIR/samples/minute-….json)")
    publish.set_defaults(handler=run_publish)

    verify = subparsers.add_parser(
        "verify", help="check a run directory against its manifest, or re-derive a sample",
        description="Given a run directory: check every file its manifest lists (size, "
                    "SHA-256, and the checkpoints of event files) and that results/, events/ "
                    "and dead/ hold no other file; a run whose pass is still at work is "
                    "refused. Given a sample file: re-read the raw event files, check every "
                    "SHA-256 and recompute the figure. Exit 0 when everything matches, 1 with "
                    "what differs otherwise, 2 for a path that is neither, a run still "
                    "running, or a sample whose run is not found (--run-dir names it).",
    )  # fmt: skip
    verify.add_argument("path", type=path, metavar="RUN_DIR|SAMPLE.json",
                        help="a run directory, or a sample file `publish` wrote")
    verify.add_argument("--run-dir", type=path, metavar="DIR",
                        help="for a sample: its run directory (default: the one it sits in)")
    verify.set_defaults(handler=run_verify)


Handler = Callable[[argparse.Namespace], int]


def reader_gone() -> None:
    """Standard output's reader left early (`shardrun ... | head`): point stdout at /dev/null,
    so that the flush at exit meets no broken pipe either."""
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until the process ends


def say(text: str, *, status_stands: bool = False) -> None:
    """Print a command's output. A reader that left early (`shardrun report RUN | head -1`)
    changes nothing else: the command goes on to say on standard error what it would have said,
    and exits as it would have, its verdict included (a log that fails its integrity check is
    exit 1 still); so does a terminal that hung up with no SIGHUP heard yet (EIO), with a
    warning. Any other failure (a full disk under `> file`) is a RunError: the output is the
    command's product, cut short, and exit 0 would pass the half file on as whole; unless
    `status_stands` (a run's summary: the run's own files hold what it did), then a warning."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        reader_gone()
    except OSError as exc:
        reader_gone()
        why = exc.strerror or str(exc)
        if exc.errno != errno.EIO and not status_stands:
            full = exc.errno in NO_ROOM
            raise RunError(f"could not write to standard output: {why.lower()}; what this "
                           "command printed is cut short: "
                           f"{'free some space or ' if full else ''}send it elsewhere, then run "
                           "the command again") from None  # fmt: skip
        guess = "; a terminal that hung up?" if exc.errno == errno.EIO else ""
        with contextlib.suppress(OSError):
            print(f"warning: cannot write to standard output ({why}{guess}): what this command "
                  "prints is dropped, its exit status stands", file=sys.stderr)


def guarded(handler: Handler) -> Handler:
    """Print a `ShardrunError` as `error: <message>` and return its exit code, so a handler
    behaves the same whether or not the caller catches errors itself."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ShardrunError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
        except BrokenPipeError:  # `export RUN | head`: the reader left early, its rows cut
            reader_gone()  # short as it chose; nothing went wrong (`say` for the other ways)
            return 0
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130

    return run


@guarded
def run_report(args: argparse.Namespace) -> int:
    from shardrun.report import (
        format_json,
        format_report,
        integrity_problem,
        load_report,
        write_html,
    )

    _not_a_dash("--html", args.html, "the text report goes to standard output")
    if args.html is not None:
        check_output_file("--html", args.html)
        check_not_a_run_file("--html", args.html)
    doc, loaded = load_report(args.run_dir, trace=args.html is not None)
    if args.html is not None:
        write_html(doc, loaded, args.html)
    say(format_json(doc) if args.json else format_report(doc))
    if args.html is not None:
        print(f"wrote {args.html}", file=sys.stderr)
    problem = integrity_problem(doc)
    if problem is not None:
        print(f"error: {args.run_dir}: the event log fails its integrity check ({problem}); "
              "the figures above come from the lines that could be read", file=sys.stderr)
        return 1
    return 0


@guarded
def run_publish(args: argparse.Namespace) -> int:
    from shardrun.provenance import format_sample, publish

    _not_a_dash("-o", args.output, "the sample is printed on standard output as well")
    warnings: list[str] = []
    sample, path = publish(args.run_dir, minute=args.minute, out=args.output, warnings=warnings)
    say(format_sample(sample))
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if sample["partial"]:  # the run covered no whole minute (or --minute named one it did not)
        print(f"warning: minute {sample['minute']} is partial: the run did not cover all of it, "
              "so its tokens are not a full minute's throughput", file=sys.stderr)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _not_a_dash(flag: str, value: Path | None, why: str) -> None:
    """Refuse '-' for a file the command writes beside what it prints: it made a file named
    '-' in the working directory, where `export -o -` writes to standard output."""
    if value == Path("-"):
        raise SpecError(f"{flag} -: {why}, so '-' is no place for this file; give a file name")


@guarded
def run_verify(args: argparse.Namespace) -> int:
    from shardrun.provenance import verify

    path: Path = args.path
    if path.is_dir():
        from shardrun.runverify import verify_run

        if args.run_dir is not None:
            raise SpecError(f"--run-dir goes with a sample file, and {path} is a directory: "
                             f"`shardrun verify {path}` checks that run")
        say(verify_run(path))
        return 0
    if not path.is_file():
        raise RunDirError(f"{path} is neither a run directory nor a sample file: "
                         f"{'nothing is there' if not path.exists() else 'it is no file'}")
    say(verify(path, args.run_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m shardrun.cli_analysis ...`) until `cli.py` wires these."""
    from shardrun.cli import UsageParser  # long options only in full, as `shardrun`'s

    parser = UsageParser(prog="shardrun")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""The `shardrun validate` subcommand: argument parsing and presentation only.

    shardrun validate JOB.yaml [--ping] [--show N] [--strict] [--shards N] [--concurrency C]
                               [--runs-dir DIR] [--rpm X] [--tpm X]

Exit codes: 0 valid (rejected input lines are warnings), 1 with `--strict` when a line was
rejected or when the `--ping` request failed, 2 when the job, a flag, the environment or the
input file is unusable. On a terminal the report uses rich tables; otherwise plain text with
no escape codes.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

from shardrun._ellipsis import counted, ellipsize
from shardrun.argtypes import integer, job_path, path, progress_seconds
from shardrun.errors import InputError, ShardrunError

if TYPE_CHECKING:
    from rich.console import Console

    from shardrun.spec import LoadedJob
    from shardrun.validate import InputCheck, PingResult

# The CLI imports this module for every command (to register `validate`), so what only the
# checks need (rich, the spec models, validate.py) is imported when `validate` runs.

__all__ = ["handle", "register"]

VALUE_MAX = 60  # characters of a configuration value shown in the table


def register(subparsers: Any) -> None:
    """Add `validate` to the CLI's subparsers; the handler is in `set_defaults(handler=...)`."""
    p = subparsers.add_parser(
        "validate",
        help="check a job file, its environment and its input without running it",
        description="Check a job file, environment overrides and the input; send no request "
        "unless --ping is given.",
    )
    p.add_argument("job", type=job_path, metavar="JOB.yaml", help="the job file")
    p.add_argument("--ping", action="store_true",
                   help="send ONE real request to the endpoint and report status and TTFT")
    p.add_argument("--show", type=integer(0, "rejected lines to list"), default=10, metavar="N",
                   help="list the first N rejected lines (default 10)")
    p.add_argument("--strict", action="store_true", help="exit 1 if any input line is rejected")
    p.add_argument("--shards", metavar="N", help="as for run")  # text, as run's: see there
    p.add_argument("--concurrency", metavar="C", help="as for run")
    p.add_argument("--runs-dir", type=path, metavar="DIR",
                   help="as for run: checked to be a place run directories can be made in")
    p.add_argument("--rpm", metavar="X", help="as for run (none: no limit)")
    p.add_argument("--tpm", metavar="X", help="as for run (none: no limit)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on standard error while the input is read")
    p.add_argument("--progress-interval", type=progress_seconds, default=10.0, metavar="S",
                   help="seconds between progress lines when standard error is not a "
                        "terminal (default 10)")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the checks and print the report; never raises a shardrun error (prints it)."""
    from rich.console import Console

    stream = out if out is not None else sys.stdout
    console = Console(file=stream, highlight=False)
    try:
        return _validate(args, console)
    except ShardrunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


def _validate(args: argparse.Namespace, console: Console) -> int:
    from shardrun.preflight import check_runs_dir, preflight
    from shardrun.spec import load_job
    from shardrun.validate import check_input

    flags = {"shards": args.shards, "concurrency": args.concurrency,
             "runs_dir": None if args.runs_dir is None else str(args.runs_dir),
             "rate_limits.rpm": args.rpm, "rate_limits.tpm": args.tpm}  # fmt: skip
    job = load_job(args.job, env=os.environ, flags=flags)
    preflight(job, os.environ)  # what `run` refuses before it starts, refused here too
    check_runs_dir(job)
    from shardrun.ticker import Ticker

    ticker = Ticker(quiet=args.quiet, interval=args.progress_interval)
    try:
        check = check_input(job, show=args.show, ticker=ticker)
    finally:
        ticker.close()
    if check.rejects and not check.items:
        one = check.rejects == 1  # not "all 1 were rejected, the first"
        every, which = ("its only line was", "") if one else (
            f"all {check.rejects:,} were", ", the first")
        first = (f"{which} (line {check.first_rejects[0].line}) because "
                 f"{check.first_rejects[0].reason}" if check.first_rejects else "")
        raise InputError(f"no line of {job.input_path} is an item: {every} rejected{first}; "
                         "check the input section of the job file")
    if not check.items:  # as the run's summary asks: an empty file is rarely the one meant
        raise InputError(f"{job.input_path} holds no records, so a run of it would send "
                         "nothing; check input.path in the job file")
    result = run_ping(job, os.environ, check.first_item) if args.ping else None
    failed = (result is not None and not result.ok) or (args.strict and check.rejects > 0)
    try:
        if console.is_terminal:
            print_report(console, job, check, result)
        else:
            console.file.write(format_report(job, check, result) + "\n")
            console.file.flush()
    except BrokenPipeError:  # `validate JOB | head`: the reader left early; the verdict stands
        from shardrun.cli_analysis import reader_gone

        reader_gone()
    return 1 if failed else 0


def run_ping(
    job: LoadedJob, env: Mapping[str, str], item: Mapping[str, Any] | None
) -> PingResult:
    """`validate.run_ping`, imported on use (it brings aiohttp); a seam for tests."""
    from shardrun.validate import run_ping as ping

    return ping(job, env, item)


def _input_lines(job: LoadedJob, check: InputCheck) -> list[str]:
    spec = job.spec.input
    per_item = check.prompt_tokens_estimate / check.items if check.items else 0.0
    # Not a warning for the default field (no ids is a documented way to run), but said: a
    # file whose ids are under another key (`uid`) would otherwise pass without a word.
    # Another field named and absent is warned of below (`id_warning`).
    hashed = (" (no record has 'id': ids are derived from content)" if spec.id_field == "id"
              and check.items and not check.named_ids and spec.format != "openai-batch"
              else "")  # fmt: skip
    lines = [
        f"input: {job.input_path} ({spec.format}): {counted(check.items, 'item')}{hashed}, "
        f"{counted(check.rejects, 'rejected line')}",
        f"prompt tokens: ~{check.prompt_tokens_estimate:,} (~{per_item:,.1f} per item), "
        "estimated as characters / 4, not by a tokenizer",
    ]
    from shardrun.validate import id_warning, open_files_warning, tpm_warning

    for warning in (id_warning(job, check), tpm_warning(job, check),
                    open_files_warning(job, check)):
        if warning is not None:
            lines.append(f"warning: {warning}")
    if check.rejects:
        shown = len(check.first_rejects)
        lines.append(f"rejected lines (warnings; the first {shown}):")
        lines.extend(f"  line {r.line}: {r.reason}" for r in check.first_rejects)
    return lines


def _ping_lines(result: PingResult, job: LoadedJob) -> list[str]:
    from shardrun._chunks import clip  # imported by the ping already
    from shardrun._urls import credentials_advice
    from shardrun.client import refused_stream_options

    ttft = "-" if result.ttft_s is None else f"{result.ttft_s:.3f} s"
    http = "no response" if result.http_status is None else f"HTTP {result.http_status}"
    tokens = counted(result.completion_tokens, "token")
    lines = [f"ping: {result.label} ({http}) {result.url}: TTFT {ttft}, "
             f"total {result.total_s:.3f} s, {tokens}"]  # fmt: skip
    if result.proxy is not None:
        lines.append(f"  through the proxy {result.proxy['url']} (from {result.proxy['from']})")
    if result.error:
        lines.append(f"  error: {result.error}")
        if result.http_status == 404:
            lines.append("  hint: a 404 means a wrong path, API or model: OpenAI-compatible "
                         "servers serve under /v1; check endpoint.base_url, endpoint.api and "
                         "endpoint.model")
        elif result.http_status in (401, 403):  # a run that stops for either says so
            endpoint = job.spec.endpoint
            lines.append("  hint: the endpoint refused the credentials: " + credentials_advice(
                endpoint.api_key_env, endpoint.base_url, endpoint.headers))
        elif result.not_an_answer:
            lines.append("  hint: that is no OpenAI-compatible answer (a login page, a proxy's "
                         "notice or a web app?): check endpoint.base_url, which for "
                         "OpenAI-compatible servers ends in /v1")
        elif refused_stream_options(result.http_status, result.error):
            lines.append("  hint: this server does not take stream_options, which asks for usage "
                         "in the stream; set endpoint.stream_usage: false")
    elif result.reply:
        lines.append(f"  reply: {clip(result.reply, 80)}")
    if result.ok and result.at_once:
        lines.append("  note: the answer came at once, not token by token (a proxy or gateway "
                     "that buffers streams, or a server that ignores stream), so its TTFT is its "
                     "end; a run leaves such answers out of TTFT and TPOT")
    if result.refusal:
        lines.append(f"  refusal (the model declined): {clip(result.refusal, 80)}")
    if result.rate_headers:
        # the server's text, as a reply is: no escape sequence, no credential it quotes back
        lines.extend(f"  {k}: {clip(v, 80)}" for k, v in sorted(result.rate_headers.items()))
    else:
        lines.append("  no x-ratelimit-* headers")
    return lines


def _warnings(job: LoadedJob, result: PingResult | None) -> list[str]:
    """The job's warnings, and one for a base_url with no path unless a ping just got an
    answer there (the server then does serve at its root)."""
    from shardrun.validate import base_url_warning

    url = None if result is not None and result.ok else base_url_warning(job)
    return [*job.warnings, *filter(None, [url])]


def format_report(job: LoadedJob, check: InputCheck, result: PingResult | None) -> str:
    """The whole report as plain text."""
    from shardrun.validate import config_rows

    lines = [f"job: {job.origin} is valid", *_input_lines(job, check)]
    lines.extend(f"warning: {w}" for w in _warnings(job, result))
    rows = config_rows(job)
    width = max(len(k) for k, _, _ in rows)
    vwidth = min(40, max(len(v) for _, v, _ in rows))
    lines.append("configuration (value, and where it came from):")
    lines.extend(f"  {k:<{width}}  {ellipsize(v, VALUE_MAX):<{vwidth}}  {s}" for k, v, s in rows)
    if result is not None:
        lines.extend(_ping_lines(result, job))
    return "\n".join(lines)


def print_report(
    console: Console, job: LoadedJob, check: InputCheck, result: PingResult | None
) -> None:
    """The same report with rich tables, for a terminal."""
    from rich.table import Table
    from rich.text import Text

    from shardrun.validate import config_rows

    console.print(f"[bold]job:[/bold] {job.origin} is [green]valid[/green]")
    for line in _input_lines(job, check):
        console.print(line, markup=False)
    for warning in _warnings(job, result):  # its text as written: a URL may hold [brackets]
        console.print(Text.assemble(("warning:", "yellow"), " ", warning))
    table = Table(title="configuration", title_justify="left")
    for name in ("key", "value", "source"):
        table.add_column(name)
    for key, value, source in config_rows(job):
        table.add_row(key, ellipsize(value, VALUE_MAX), source,
                      style="dim" if source == "default" else None)
    console.print(table)
    if result is not None:
        for line in _ping_lines(result, job):
            console.print(line, markup=False)

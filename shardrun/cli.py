"""The command line. It parses arguments and calls the library; nothing else lives here.

Exit codes: 0 every item succeeded, 1 some failed (or the run could not go on), 2 usage or spec
errors, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import os
import re
import shlex
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from shardrun import __version__, cli_analysis, cli_export, cli_validate
from shardrun.argtypes import (
    ITEMS_TO_RUN,
    bad_value,
    job_path,
    path,
    progress_seconds,
    with_close_flags,
)
from shardrun.errors import ShardrunError, SpecError, fix_for_write

_NUMBER = re.compile(r"-[0-9.][0-9.e+-]*")  # a negative number argparse takes for a value
SUBCOMMANDS = ("run", "sim", "retry-failed", "validate", "report", "publish", "verify",
               "export")


class UsageParser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error:` line (as every other error is, README) with
    a pointer to --help, not the whole usage block; exit 2. Subcommands inherit the class.

    A long option is taken only in full: argparse's default reads `--con 4` as --concurrency,
    and a script written so would change meaning the day a new flag shares the prefix."""

    _given: list[str] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # `add_parser` passes none: every subcommand
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str, *, then: str = "") -> NoReturn:
        """`then`: a clause after the message, its flags not read as unknown ones. A bad value
        is said as a bad `SHARDRUN_*` value is, with no pointer: the sentence says what the
        value must be (README, exit codes), as the job's own checks of --shards say it."""
        if (said := bad_value(message)) is not None:
            self.exit(2, f"error: {said}{_shadowed(self.prog)}\n")
        if message.startswith("the following arguments are required"):
            unknown = self._unknown_options()
            if unknown:  # `shardrun --bogus`: the flag is the mistake, not a missing JOB.yaml
                message = f"unrecognized arguments: {' '.join(unknown)}"
        message = with_close_flags(message, self) + then
        self.exit(2, f"error: {message} (`{self.prog} --help` lists the arguments)"
                     f"{_shadowed(self.prog)}\n")

    def _unknown_options(self) -> list[str]:
        """The words given to this parser that look like options it does not take (as argparse
        reads them: `--flag=value`; a long option is known only in full)."""
        known = [name for action in self._actions for name in action.option_strings]
        unknown = []
        for word in self._given or []:
            if word == "--":
                break
            name = word.partition("=")[0]
            if not word.startswith("-") or word == "-" or _NUMBER.fullmatch(word):
                continue
            if name in known:
                continue
            unknown.append(word)
        return unknown


def _mistyped_command(word: str) -> str | None:
    """What to say of a first word that is no command and no file but reads like a command
    (`shardrun reprot RUN`, `shardrun help`): taken for a job file, it made a run's usage
    error ('unrecognized arguments: RUN') or 'help: job file not found'."""
    if word.startswith("-") or os.path.lexists(word) or word.endswith((".yaml", ".yml")):
        return None
    if word in ("help", "version"):
        return f"no command or job file named {word}: `shardrun --{word}` gives it"
    close = difflib.get_close_matches(word, SUBCOMMANDS, n=1, cutoff=0.75)
    if not close:
        return None
    return (f"no command or job file named {word} (did you mean `shardrun {close[0]}`?); "
            "`shardrun --help` lists the commands")


def _shadowed(prog: str) -> str:
    """A job file named as the command that just failed (`shardrun report`, with ./report a
    job): the command word wins, so say how to run the file."""
    hint = _run_the_file(prog.rpartition(" ")[2])
    return f"; {hint}" if hint else ""


def _run_the_file(command: str) -> str:
    """How to run the job file ./COMMAND, when there is one the command word hides."""
    if command == "run" or command not in SUBCOMMANDS or not os.path.isfile(command):
        return ""
    return f"to run the job file ./{command}, give `shardrun run {command}`"


RATE_HELP = {
    "rpm": "job-wide requests per minute (all shards); none lifts the job file's limit",
    "tpm": "job-wide prompt+completion tokens per minute (all shards); none lifts the job "
           "file's limit",
}
# The defaults of JobSpec (`_models`), written out: pydantic is not imported for `--help`.
# tests/test_e2e.py checks them against JobSpec.
DEFAULT_SHARDS, DEFAULT_CONCURRENCY, DEFAULT_RUNS_DIR = 4, 16, "runs"
SHARDS_HELP = ("worker processes (default: SHARDRUN_SHARDS, else the job file's shards, "
               f"else {DEFAULT_SHARDS})")
CONCURRENCY_HELP = ("requests in flight per shard (default: SHARDRUN_CONCURRENCY, else the job "
                    f"file's concurrency, else {DEFAULT_CONCURRENCY})")
RUNS_DIR_HELP = ("where run directories go (default: SHARDRUN_RUNS_DIR, else the job file's "
                 f"runs_dir, else {DEFAULT_RUNS_DIR}; a relative one is in the working "
                 "directory)")


def _env_help() -> str:
    # From `_env`, not `spec`: the table needs no pydantic or YAML, and every command's parser
    # (`--help` included) builds this text.
    from shardrun._env import ANALYSIS_VARS, ENV_VARS, IGNORE_HELP, IGNORE_VAR

    width = max(len(name) for name in [*(var.name for var in ENV_VARS), *ANALYSIS_VARS])
    rows = "\n".join(f"  {var.name:<{width}}  {var.help}" for var in ENV_VARS)
    rows += f"\n  {IGNORE_VAR:<{width}}  {IGNORE_HELP}"
    analysis = "\n".join(f"  {name:<{width}}  {text}" for name, text in ANALYSIS_VARS.items())
    return (
        "environment variables (precedence: flag > environment > job file > default;\n"
        "a variable set to nothing, or to spaces only, counts as not set):\n" + rows
        + "\n\nfor report, publish and verify:\n" + analysis
    )


def _add_progress_flags(command: argparse.ArgumentParser) -> None:
    command.add_argument("--quiet", action="store_true", help="no progress display")
    command.add_argument("--progress-interval", type=progress_seconds, default=10.0, metavar="S",
                         help="seconds between status lines when not on a terminal (default 10)")


def build_parser() -> UsageParser:
    parser = UsageParser(
        prog="shardrun",
        description="Run bulk LLM generation across sharded worker processes.",
        epilog="`shardrun JOB.yaml` is short for `shardrun run JOB.yaml`.\n\n" + _env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"shardrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run a job (the default command)",
        description="Run a job file: every input item ends with one result or one dead letter.",
        epilog=_env_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("job", type=job_path, metavar="JOB.yaml", help="the job file")
    # --shards and --concurrency stay text, as --rpm: the job's own check says what they want
    # (`--shards must be an integer from 1 to 1024, got 'abc'`), as for SHARDRUN_SHARDS.
    run.add_argument("--shards", metavar="N", help=SHARDS_HELP)
    run.add_argument("--concurrency", metavar="C", help=CONCURRENCY_HELP)
    run.add_argument("--runs-dir", type=path, metavar="DIR", help=RUNS_DIR_HELP)
    run.add_argument("--run-id", metavar="ID",
                     help="name of the run directory (default: the UTC time and a random "
                          "suffix, as 20261127T000407Z-bdb3d8)")
    run.add_argument("--resume", metavar="RUN_ID",
                     help="continue run RUN_ID (or `latest`: this job file's newest, else the "
                          "newest of all, with a warning) in its directory, skipping "
                          "every item that has a result or dead-letter line")
    run.add_argument("--retry-failed", action="store_true",
                     help="with --resume: give dead-lettered items another pass")
    run.add_argument("--limit", type=ITEMS_TO_RUN, metavar="N",
                     help="run at most N items in this pass, the first N of the input not "
                          "done yet, on at most N shards (try a job on a few); --resume runs "
                          "the rest")
    run.add_argument("--strict", action="store_true",
                     help="check the whole input first; the first bad line is an error")
    run.add_argument("--rpm", metavar="X", help=RATE_HELP["rpm"])
    run.add_argument("--tpm", metavar="X", help=RATE_HELP["tpm"])
    _add_progress_flags(run)
    retry = sub.add_parser(
        "retry-failed",
        help="give a run's dead-lettered items another pass",
        description="Give RUN_DIR's dead-lettered items another pass, with the run's own job "
                    "file. Only those: items no pass has run yet are left for `--resume` "
                    "(`shardrun JOB.yaml --resume RUN_ID --retry-failed` does both).",
    )
    retry.add_argument("run_dir", type=path, metavar="RUN_DIR", help="the run directory")
    retry.add_argument("--job", type=job_path, metavar="JOB.yaml",
                       help="the run's job file, if it has moved since the run")
    retry.add_argument("--shards", metavar="N", help=SHARDS_HELP)
    retry.add_argument("--concurrency", metavar="C", help=CONCURRENCY_HELP)
    retry.add_argument("--rpm", metavar="X", help=RATE_HELP["rpm"])
    retry.add_argument("--tpm", metavar="X", help=RATE_HELP["tpm"])
    _add_progress_flags(retry)
    cli_validate.register(sub)
    cli_analysis.register(sub)
    cli_export.register(sub)
    sub.add_parser("sim", help="run the OpenAI-compatible simulator", add_help=False)
    for command in sub.choices.values():  # so that an unknown flag is blamed on its command
        command.set_defaults(command_parser=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "sim":
        _command_signals(run=False)  # the simulator stops on SIGTERM in its own way
        if hint := _run_the_file("sim"):  # the command word wins, as for every command
            print(f"note: `shardrun sim` starts the simulator; {hint}", file=sys.stderr)
        from shardrun.sim import main as sim_main

        return sim_main(args_list[1:])
    if args_list and args_list[0] not in SUBCOMMANDS and args_list[0] not in (
        "-h", "--help", "--version"
    ):
        if (mistyped := _mistyped_command(args_list[0])) is not None:
            print(f"error: {mistyped}", file=sys.stderr)
            return 2
        args_list.insert(0, "run")
    parser = build_parser()
    args, extra = parser.parse_known_args(args_list)
    if extra:  # argparse would name `shardrun`; the flag belongs to the command's --help
        # `shardrun job.yaml validate`: the other command of a job file came after it.
        order = ("" if "validate" not in extra or args.command != "run" else
                 "; a command goes before the job file: "
                 f"{_validate_instead(args_list, args.command_parser, parser)}")
        # A UsageParser too: subparsers inherit the class (its `then` keeps the hint apart).
        blamed: UsageParser = getattr(args, "command_parser", parser)
        blamed.error(f"unrecognized arguments: {' '.join(extra)}", then=order)
    if args.command is None:
        parser.print_help()
        return 2
    handler = getattr(args, "handler", None)
    if handler is not None:
        _command_signals(run=False)
        code: int = handler(args)
        return code
    try:
        return _run(args, args_list)
    except ShardrunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # the coordinator turns a stop into a summary once it runs
        print(f"error: {_stopped_early(args)}", file=sys.stderr)
        return 130
    except OSError as exc:  # a file no code path above names in its own words
        if isinstance(exc, BrokenPipeError):  # our reader went away: nothing to tell it
            raise
        # One in a pass is said by the pass, with its way on (`runner.run`): this one came
        # before a pass began, so the command is the one to run again (the next pass puts back
        # what this one's preparation set aside, `resume.prepare`).
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{(exc.strerror or str(exc)).lower()}; no request was sent: "
              f"{fix_for_write(exc)}, then run the same command again", file=sys.stderr)
        return 1


def entry() -> NoReturn:
    """The console script and `python -m shardrun`: `main()`, then exit without a teardown.

    Every file a command writes is closed before `main` returns (a run's also fsynced), so all
    the interpreter's teardown would still do is free, object by object, memory the OS frees at
    once: about 0.03 CPU-s with a run's modules loaded, billed to the run's client CPU.
    """
    _stop_at_once_from_now()  # `main` hands over to the command's own handling
    try:
        status = main()
    except SystemExit as done:  # argparse's --help, --version and usage errors: their output
        # is flushed below, where a reader that left early (`shardrun --help | head -c 0`)
        # changes nothing; the interpreter's own flush said "Exception ignored", exit 120.
        status = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader that went away: nothing to do
            stream.flush()
    os._exit(status)


def _check_run_flags(args: argparse.Namespace) -> None:
    """Flags argparse takes but a run cannot use: one sentence each, before anything starts."""
    if args.run_id is not None and not args.run_id.strip():
        raise SpecError("--run-id is empty: name the run directory, or leave the flag out for "
                        "a name from the time")
    if args.run_id is not None and args.resume is not None:
        raise SpecError(f"--run-id {args.run_id} names a new run and --resume {args.resume} "
                        "an existing one: give one of them")


def _validate_instead(args_list: list[str], run: argparse.ArgumentParser,
                      parser: argparse.ArgumentParser) -> str:
    """`shardrun job.yaml validate --ping` as the command meant, to paste as is: every word
    given (`--ping` and any other flag) kept in its order, `validate` moved to the front, but
    for the run's own flags `validate` refuses (`--limit 5`), which are named as left out."""
    words = args_list[1:]  # without `run`, given or put in front of the job file by `main`
    takes_value = {flag for action in run._actions if action.nargs != 0
                   for flag in action.option_strings}
    # The `validate` argparse left over, not a flag's value (`--runs-dir validate`).
    del words[next(at for at, word in enumerate(words)
                   if word == "validate" and (at == 0 or words[at - 1] not in takes_value))]
    validate = next(action for action in parser._actions
                    if isinstance(action, argparse._SubParsersAction)).choices["validate"]
    run_only = ({flag for action in run._actions for flag in action.option_strings}
                - set(validate._option_string_actions))
    kept: list[str] = []
    dropped: list[str] = []
    at = 0
    while at < len(words):
        flag, joined, _ = words[at].partition("=")
        # A flag's value is kept or left out with it (`--runs-dir --limit` keeps both).
        step = 2 if flag in takes_value and not joined else 1
        if flag in run_only:
            dropped.append(flag)
        else:
            kept.extend(words[at:at + step])
        at += step
    command = f"`{shlex.join(['shardrun', 'validate', *kept])}`"
    if not dropped:
        return command
    *most, last = dict.fromkeys(dropped)
    which = f"{', '.join(most)} and {last}" if most else last
    return f"{command}, leaving out {which}, which only a run takes"


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _hung_up(terminal: list[int], signum: int, frame: object) -> None:
    """SIGHUP before the coordinator hears it: a stop like SIGTERM, its sentence sent where
    the terminal was to /dev/null (writing to a hung-up terminal fails), as the coordinator
    does (`Coordinator.hang_up`)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in terminal:
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    raise KeyboardInterrupt


_EARLY_STOP = ["stopped before the command started; nothing was sent"]
"""What `_stop_at_once` says; a run's pass puts its own words here (a one-item list: no
`global`)."""


def _stop_at_once(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM while the command's modules load: nothing exists yet that would need
    cleaning up, so say so and end here. A KeyboardInterrupt could land inside an extension
    module's initialisation (orjson's crashed the interpreter so, exit 139)."""
    os.write(2, f"error: {_EARLY_STOP[0]}\n".encode())
    os._exit(130)


def _stop_at_once_from_now() -> None:
    """`_stop_at_once` for SIGINT and SIGTERM, except a signal the process started ignoring
    (`nohup`, a background job of a script): without it SIGTERM ends the process silently."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _stop_at_once)


def _command_signals(*, run: bool) -> None:
    """The command's own handling once its modules are loaded: Ctrl-C a KeyboardInterrupt, and
    SIGTERM one too for a run (until the coordinator takes over: no half-made run directory
    is left behind), else its default action."""
    if signal.getsignal(signal.SIGINT) is _stop_at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if run and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        # Else a hang-up ended the pass at once, leaving a run directory without a manifest.
        terminal = [fd for fd in (1, 2) if os.isatty(fd)]  # not once it has hung up
        signal.signal(signal.SIGHUP, functools.partial(_hung_up, terminal))
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        return
    if run:
        signal.signal(signal.SIGTERM, _interrupted)
    elif signal.getsignal(signal.SIGTERM) is _stop_at_once:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _stopped_early(args: argparse.Namespace) -> str:
    """A stop before the coordinator handles signals itself: no shard had started."""
    resumed = args.command == "retry-failed" or getattr(args, "resume", None) is not None
    return f"stopped before {'this pass of ' if resumed else ''}the run started; nothing was sent"


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    _EARLY_STOP[0] = _stopped_early(args)  # the imports below take most of the first 0.3 s
    from shardrun.runner import NothingToRetry, RunOptions, job_of_run, run
    from shardrun.summary import format_summary

    _command_signals(run=True)
    if args.command == "retry-failed":
        job, runs_dir = job_of_run(args.run_dir, args.job)
        options = RunOptions(resume=args.run_dir.name, retry_failed=True, only_failed=True,
                             quiet=args.quiet, progress_interval=args.progress_interval)
    else:
        _check_run_flags(args)
        job, runs_dir = args.job, args.runs_dir
        options = RunOptions(run_id=args.run_id, resume=args.resume,
                             retry_failed=args.retry_failed, strict=args.strict,
                             quiet=args.quiet, progress_interval=args.progress_interval,
                             limit=args.limit)
    flags = {
        "shards": args.shards,
        "concurrency": args.concurrency,
        "runs_dir": None if runs_dir is None else str(runs_dir),
        "rate_limits.rpm": getattr(args, "rpm", None),
        "rate_limits.tpm": getattr(args, "tpm", None),
    }
    try:
        summary = run(job, env=os.environ, flags=flags, options=options, argv=argv)
    except NothingToRetry as nothing:
        cli_analysis.say(str(nothing), status_stands=True)  # a reader gone changes nothing
        return 0
    # A reader that left early (`shardrun job.yaml | head -3`) changes nothing: the run is over
    # and its files are written, so the exit status stays the run's.
    cli_analysis.say(format_summary(summary), status_stands=True)
    for problem in filter(None, [summary.fatal_reason, *summary.unrecorded]):
        print(f"error: {problem}", file=sys.stderr)
    return summary.exit_code

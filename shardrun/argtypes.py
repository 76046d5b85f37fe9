"""Argument types shared by the subcommands' parsers (modules `cli` imports, so they cannot
import `cli` at their top)."""

from __future__ import annotations

import argparse
import difflib
import os
import re
from collections.abc import Callable
from pathlib import Path

from shardrun._env import parse_int

# argparse's words for an error about one argument the command takes (its last name given).
_ARGUMENT = re.compile(r"argument (?:\S+/)?(?P<flag>\S+): (?P<said>.*)", re.DOTALL)
# Of those, the ones about how it was given, not its value: no value, two that exclude each
# other, a value to a flag that takes none. A look at --help is what helps there.
_SHAPE = re.compile(r"expected .*|not allowed with argument .*|ignored explicit argument .*")
# A value its `type=int` or `type=float` could not convert, or not among its `choices`.
_NOT_CONVERTED = re.compile(r"invalid (?P<kind>int|float) value: (?P<value>.*)")
_NOT_A_CHOICE = re.compile(r"invalid choice: (?P<value>.*) \(choose from (?P<choices>.*)\)")


def bad_value(message: str) -> str | None:
    """argparse's `message` about a bad value given to an argument the command takes, said as a
    bad `SHARDRUN_*` value is (`--shards must be an integer ..., got 'abc'`), not in argparse's
    words (`argument --shards: invalid int value: 'abc'`), which name a Python type and not
    what the flag wants. None for any other usage error (an argument the command does not
    take, one missing or given in the wrong shape), which points at --help instead."""
    match = _ARGUMENT.fullmatch(message)
    if match is None or _SHAPE.fullmatch(match["said"]):
        return None
    flag, said = match["flag"], match["said"]
    if value := _NOT_CONVERTED.fullmatch(said):
        wants = "an integer" if value["kind"] == "int" else "a number"
        return f"{flag} must be {wants}, got {value['value']}"
    if value := _NOT_A_CHOICE.fullmatch(said):
        return f"{flag} must be one of {value['choices']}, got {value['value']}"
    # One of ours (an ArgumentTypeError): "must be ..." and "is ..." go on from the flag's name.
    return f"{flag} {said}" if said.startswith(("must ", "is ")) else f"{flag}: {said}"


def with_close_flags(message: str, parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments: ..." with the flag each unknown one likely meant: the
    ones it shortens (taken only in full) or, else, a close spelling (`--shard`, `--reseume`).
    """
    said, colon, words = message.partition(": ")
    if said != "unrecognized arguments" or not colon:
        return message
    known = [name for action in parser._actions for name in action.option_strings
             if name.startswith("--")]  # fmt: skip
    meant = {}
    for word in words.split():
        name = word.partition("=")[0]
        if not name.startswith("--") or name in ("--", *known):  # `--=x` shortens every flag
            continue
        # A prefix of several flags (`--re`) is one of them, not a closer spelling of another
        # (difflib's `--rpm`); a misspelling must be close (0.6 took `--json`, a flag of
        # `report` given to `validate`, for `--show`).
        longer = [flag for flag in known if flag.startswith(name)]
        close = longer or difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        if close:
            meant[name] = " or ".join(close)
    if not meant:
        return message
    if len(meant) == 1:
        return f"{message}; did you mean {next(iter(meant.values()))}?"
    pairs = ", ".join(f"{flag} for {name}" for name, flag in meant.items())
    return f"{message}; did you mean {pairs}?"


def integer(least: int, counts: str) -> Callable[[str], int]:
    """An argument that counts `counts`, `least` or more (`--show -1` would show 'the first 0',
    `--limit 0` run nothing), written as `--shards` and SHARDRUN_* integers are (`parse_int`):
    Python's `int()` also took `1_000` and other digits than 0-9, which those refuse."""
    def parse(text: str) -> int:
        try:
            value = parse_int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an integer of at least {least} "
                                             f"({counts}), got {text!r}")
        return value

    return parse


# `--limit`: the CLI's type and `RunOptions`'s check of an API caller's limit, one rule.
ITEMS_TO_RUN = integer(1, "items to run")


# A status line a tenth of a second apart at most: `--progress-interval 1e-9` printed one per
# row `export` wrote and per line `validate` read, a million lines in a log; the run's own view
# redraws only 4 times a second whatever it is told.
PROGRESS_FLOOR_S = 0.1


def progress_seconds(text: str) -> float:
    """Seconds between status lines (every `--progress-interval`, and `RunOptions`'s):
    PROGRESS_FLOOR_S or more, and finite."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not PROGRESS_FLOOR_S <= value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds of at least "
                                         f"{PROGRESS_FLOOR_S} (a status line ten times a "
                                         f"second at most), got {text!r}")
    return value


def path(text: str) -> Path:
    """A path argument, not empty: `Path("")` is the working directory, so `--runs-dir "$DIR"`
    with DIR unset would make the run there, and an empty RUN_DIR would name it '.'."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a path")
    return Path(text)


def file_path(text: str) -> Path:
    """A path for a file to write (`export -o`, `report --html`, `publish -o`): one ending in a
    slash names a directory, so it is refused, as `>` refuses it; `Path` drops the slash, and
    `-o out/` wrote a file named out."""
    if text.endswith(("/", os.sep)) and text.strip("/" + os.sep):
        raise argparse.ArgumentTypeError(f"{text} ends in {text[-1]}, so it names a directory; "
                                         "name the file to write")
    return path(text)


def job_path(text: str) -> Path:
    """A job file's path (`run`, `validate`, `--job`): `-`, the usual word for standard input,
    is refused, since a resume and `retry-failed` read the job file again (`./-` names a file
    called -)."""
    if text == "-":
        raise argparse.ArgumentTypeError("a job cannot be read from standard input (-): give "
                                         "the job file's path")
    return path(text)

"""Argument types shared by the subcommands' parsers (modules `cli` imports, so they cannot
import `cli` at their top)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def positive_seconds(text: str) -> float:
    """An interval in seconds: above 0 and finite (`--progress-interval` of export, validate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
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

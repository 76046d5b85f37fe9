"""Argument types shared by the subcommands' parsers (modules `cli` imports, so they cannot
import `cli` at their top)."""

from __future__ import annotations

import argparse


def positive_seconds(text: str) -> float:
    """An interval in seconds: above 0 and finite (`--progress-interval` of export, validate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not 0 < value < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value

"""Checks of a file the user names for output, made before any work (exit 2 on a bad one)."""

from __future__ import annotations

from pathlib import Path

from shardrun.errors import SpecError


def check_output_file(flag: str, path: Path) -> None:
    """Refuse an output path that is a directory or lies in a directory that does not exist:
    a usage error, found before a run directory is read rather than after."""
    if path.is_dir():
        raise SpecError(f"{flag} {path} is a directory; name the file to write")
    if not path.parent.is_dir():
        raise SpecError(f"{flag} {path}: there is no directory {path.parent}; create it, or "
                        "name a file in one that exists")

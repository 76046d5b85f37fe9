"""Checks of a file the user names for output, made before any work (exit 2 on a bad one)."""

from __future__ import annotations

from pathlib import Path

from shardrun.errors import SpecError


def check_not_read_back(flag: str, path: Path, others: dict[str, Path]) -> None:
    """Refuse an output path inside a run directory (this run's or another's): a file written
    into results/ would read as finished items to --resume, export and retry-failed, and one
    over rejects.jsonl or the manifest would lose the run's own record; refuse one over the
    input or the job file, which would destroy what the run was made from. (`others`: what
    each path is.)"""
    target = path.resolve()
    for folder in target.parents:
        if (folder / "manifest.json").is_file():
            raise SpecError(f"{flag} {path} lies inside run directory {folder}, whose files "
                            "--resume, export and report read back; name a file outside it")
    for what, other in others.items():
        if target == other.resolve():
            raise SpecError(f"{flag} {path} is {what}; writing there would destroy it, so name "
                            "another file")


def check_output_file(flag: str, path: Path) -> None:
    """Refuse an output path that is a directory or lies in a directory that does not exist:
    a usage error, found before a run directory is read rather than after."""
    if path.is_dir():
        raise SpecError(f"{flag} {path} is a directory; name the file to write")
    if not path.parent.is_dir():
        raise SpecError(f"{flag} {path}: there is no directory {path.parent}; create it, or "
                        "name a file in one that exists")


RUN_FOLDERS = ("results", "events", "dead", "logs")
"""A run's own folders: a file there is one of the run's to `verify` (or read back)."""
RUN_FILES = ("manifest.json", "rejects.jsonl", ".lock", ".pass.lock")


def check_not_a_run_file(flag: str, path: Path) -> None:
    """Refuse an output path among a run directory's own files (its results/, events/, dead/,
    logs/, manifest, rejects): `verify` would find a file the manifest does not list there, and
    one written over the manifest would lose the run's record. Elsewhere in a run directory (its
    samples/, beside its manifest) a report or a sample is welcome."""
    target = path.resolve()
    for folder in target.parents:
        if (folder / "manifest.json").is_file():
            rel = target.relative_to(folder)
            if rel.parts[0] in RUN_FOLDERS or str(rel) in RUN_FILES:
                raise SpecError(f"{flag} {path} is among the files of run directory {folder}, "
                                "which verify checks against its manifest; name a file outside "
                                "its results/, events/, dead/ and logs/ (its samples/ will do)")
            return


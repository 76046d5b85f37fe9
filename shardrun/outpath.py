"""Checks of a file the user names for output, made before any work (exit 2 on a bad one)."""

from __future__ import annotations

from pathlib import Path

from shardrun.errors import SpecError

RUN_OWN_DIRS = ("results", "dead", "events", "logs")


def check_not_read_back(flag: str, path: Path, run_path: Path,
                        others: dict[str, Path]) -> None:  # fmt: skip
    """Refuse an output path among the files a run reads back: a file written into results/
    would read as finished items to --resume, export and retry-failed; one over the input or
    the job file would destroy what the run was made from. (`others`: what each path is.)"""
    target, run = path.resolve(), run_path.resolve()
    if target == run / "manifest.json" or any(target.is_relative_to(run / sub)
                                              for sub in RUN_OWN_DIRS):
        raise SpecError(f"{flag} {path} lies among run {run.name}'s own files, which --resume, "
                        "export and report read back; name a file outside results/, dead/, "
                        "events/ and logs/")
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

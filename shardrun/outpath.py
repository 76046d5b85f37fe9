"""Checks of a file the user names for output, made before any work (exit 2 on a bad one), and
the error of one that then cannot be written (exit 1)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from shardrun.errors import NO_ROOM, RunError, SpecError


def check_not_read_back(flag: str, path: Path, sources: Iterable[tuple[str, Path]]) -> None:
    """Refuse an output path inside a run directory (this run's or another's): a file written
    into results/ would read as finished items to --resume, export and retry-failed, and one
    over rejects.jsonl or the manifest would lose the run's own record; and one that is a file
    the run was made from (`check_not_a_source`)."""
    target = path.resolve()
    for folder in target.parents:
        if (folder / "manifest.json").is_file():
            raise SpecError(f"{flag} {path} lies inside run directory {folder}, whose files "
                            "--resume, export and report read back; name a file outside it")
    check_not_a_source(flag, path, sources)


def check_not_a_source(flag: str, path: Path, sources: Iterable[tuple[str, Path]]) -> None:
    """Refuse an output path that is one of `sources` (what each is, its path): the input or
    the job file a run was made from, which writing would destroy. One file by another name
    (a hard link, a bind mount, a case-insensitive file system) is the same file: compared by
    device and inode where both exist, else by the path resolved. Any other existing file is
    overwritten, as scripts that export again expect."""
    target = path.resolve()
    for what, source in sources:
        if "\x00" in str(source):  # a damaged manifest's path: it names no file to destroy
            continue
        try:
            same = os.path.samefile(target, source)
        except OSError:  # either is not there (yet): nothing to destroy by another name
            same = target == source.resolve()
        if same:
            also = "" if target == source.resolve() else f" ({source}, by another name)"
            raise SpecError(f"{flag} {path} is {what}{also}; writing there would destroy it, "
                            "so name another file")


def check_output_file(flag: str, path: Path, *, makes_folders: bool = False) -> None:
    """Refuse an output path that is a directory or lies in a directory that does not exist
    (unless the command `makes_folders`, as publish makes a run's samples/): a usage error,
    found before a run directory is read rather than after."""
    if path.is_dir():
        raise SpecError(f"{flag} {path} is a directory; name the file to write")
    if path.parent.exists() and not path.parent.is_dir():
        raise SpecError(f"{flag} {path}: {path.parent} is a file, not a directory; name a file "
                        "in a directory")
    if not path.parent.is_dir() and not makes_folders:
        raise SpecError(f"{flag} {path}: there is no directory {path.parent}; create it, or "
                        "name a file in one that exists")


RUN_FOLDERS = ("results", "events", "dead", "logs")
"""A run's own folders: a file there is one of the run's to `verify` (or read back)."""
RUN_FILES = ("manifest.json", "rejects.jsonl", ".lock", ".pass.lock")
_REJECTS = re.compile(r"rejects(\.r[0-9]+)?\.jsonl")
# The Batch API's files a run with output.format openai-batch writes at its end
# (`batch_format.OUTPUT_NAME`, `ERRORS_NAME`): the run's own, listed and verified.
_BATCH_FILES = ("batch_output.jsonl", "batch_errors.jsonl")
# Paths that name a descriptor: what they lead to (a pipe, a terminal, a file opened with >>)
# is written in place, never replaced.
_DESCRIPTOR = re.compile(r"/dev/(stdout|stderr|fd/[0-9]+)|/proc/(self|[0-9]+)/fd/[0-9]+")


def is_run_file(rel: str) -> bool:
    """Whether `rel` (a path inside a run directory) names a file the run itself writes: one
    in its results/, events/, dead/ or logs/, or its rejects (`rejects.jsonl`, one a pass K
    wrote as `rejects.rK.jsonl`), its Batch API files. The manifest lists these, and verify
    RUN_DIR checks them; a report or a sample written beside them (samples/, the top level) is
    not the run's."""
    parts = PurePosixPath(rel).parts
    if len(parts) > 1:
        return parts[0] in RUN_FOLDERS
    return bool(parts) and (_REJECTS.fullmatch(parts[0]) is not None
                            or parts[0] in _BATCH_FILES)


def check_not_a_run_file(flag: str, path: Path) -> None:
    """Refuse an output path among a run directory's own files (its results/, events/, dead/,
    logs/, manifest, rejects): `verify` would find a file the manifest does not list there, and
    one written over the manifest would lose the run's record. Elsewhere in a run directory (its
    samples/, beside its manifest) a report or a sample is welcome."""
    target = path.resolve()
    for folder in target.parents:
        if (folder / "manifest.json").is_file():
            rel = target.relative_to(folder)
            if rel.parts[0] in RUN_FOLDERS or is_run_file(rel.as_posix()) or str(rel) in RUN_FILES:
                raise SpecError(f"{flag} {path} is among the files of run directory {folder}, "
                                "which verify checks against its manifest; name a file outside "
                                "its results/, events/, dead/ and logs/ (its samples/ will do)")
            return


def replace_target(path: Path) -> Path | None:
    """Where a file written for `path` through a temporary file is renamed to, or None when
    `path` is written in place. In place: a path that names a descriptor (/dev/stdout, as
    given: on a pipe it resolves to /proc/PID/fd/pipe:[N], which does not exist), one that
    resolves under /proc/, and an existing file that is no regular one (a FIFO, a device),
    whose reader or driver a renamed file would replace. Otherwise the path resolved: through a
    symbolic link the file it names is replaced and the link kept. A regular file under /dev/
    (/dev/shm) is replaced as any is: written in place it was appended to, two samples in one."""
    given = str(path)
    if _DESCRIPTOR.fullmatch(given) or given.startswith("/proc/"):
        return None
    target = Path(os.path.realpath(path))
    if str(target).startswith("/proc/"):
        return None
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return target  # none yet (or unreachable: the write says why)
    return target if stat.S_ISREG(mode) else None


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` (`replace_target`): through a temporary file beside the target,
    renamed over it, so a write that fails part way (a full disk) leaves the earlier file whole
    and no temporary one; or in place, appended as `>>` does (what a descriptor path leads to
    is kept). OSError when it failed."""
    target = replace_target(path)
    if target is None:
        with open(path, "ab") as f:
            f.write(data)
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cannot_write(flag: str, path: Path, exc: OSError) -> RunError:
    """The error of an output file whose write failed (a read-only place, a full disk): exit 1,
    as a failed write to standard output is; the path itself passed the checks above, which
    are the usage errors. Written through a temporary file, nothing reached `path`."""
    why = (exc.strerror or str(exc)).lower()
    if replace_target(path) is None:  # written in place: what reached it stays
        return RunError(f"could not write {path}: {why}")
    room = "free some space, or " if exc.errno in NO_ROOM else ""
    return RunError(f"could not write {path}: {why}; nothing was written ({room}name another "
                    f"file with {flag})")

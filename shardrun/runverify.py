"""`shardrun verify RUN_DIR`: check a whole run directory against its manifest (DESIGN §5).

At each pass's end the manifest lists every file of the run's own (not a sample or report
written into its directory) with its SHA-256 and size (`manifest.list_files`), as the files are
then: the list of the run's last pass to end names
each file at its last path and with its last bytes (a retry pass's dead letters set aside
under `dead/superseded-rK/`, a shared log appended to by every pass). Each listed file is read
once, streaming, in worker processes where that helps (as `report` folds); event files also
have their checkpoint chain checked (`report/_scan.scan_file`, what `report` and `publish`
check). A file in results/, events/ or dead/ that the list does not name is extra.

A pass that lives is refused: its files are being written and the list is the previous
pass's. A pass that crashed never wrote its list: the files listed are checked as the last
pass to end left them, and the files the crashed pass wrote or appended to since are checked
as far as they can be: an event file up to its last checkpoint, the bytes a listed file held
then (`prefix_digests`), and its results and dead letters not at all.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from shardrun._ellipsis import counted
from shardrun.manifest import listed_file, pass_reads, prefix_digests, read_manifest
from shardrun.outpath import is_run_file
from shardrun.provenance import VerifyError
from shardrun.report._rundir import (
    LoadedRun,
    event_files,
    first_run_id,
    foreign_text,
    map_files,
    run_state,
    unlogged_text,
)
from shardrun.report._scan import FileScan, scan_file
from shardrun.resume import PASS_LOCK, in_use, pass_of

CHECKED_DIRS = ("results", "events", "dead")
"""Where a file the manifest does not list is named as extra: what the run wrote."""
MAX_SHOWN = 20
"""Problems named one by one; the rest are counted."""
MAX_LISTED = 5
"""Unchecked files of a crashed pass named in its summary; the rest are counted."""


class RunLiveError(VerifyError):
    """A pass of the run is alive: its files cannot be checked yet."""

    exit_code = 2


@dataclass(frozen=True)
class FileCheck:
    """What reading one file of the run found."""

    scan: FileScan  # its bytes, lines and SHA-256; an event file's checkpoints too
    events: bool = False  # an event file: its checkpoints were checked
    missing: bool = False
    unreadable: str | None = None
    head_sha256: str | None = None  # of its first `bytes` listed, when it holds more now

    @property
    def rel(self) -> str:
        return self.scan.path


def check_file(path: Path, rel: str, listed_bytes: int | None) -> FileCheck:
    """Hash one file (and count its lines), streaming; an event file's checkpoints too. A
    top-level function: it runs in workers."""
    events = rel.startswith("events/") and rel.endswith(".jsonl")
    try:
        if events:
            scan = scan_file(path, rel, None)  # no line parsed
        else:
            scan = FileScan(rel)
            scan.bytes, scan.lines, scan.sha256 = _digest(path)
        head = None
        if listed_bytes is not None and scan.bytes > listed_bytes:
            head = prefix_digests(path, [listed_bytes])[listed_bytes]
    except FileNotFoundError:
        return FileCheck(FileScan(rel), missing=True)
    except OSError as exc:
        return FileCheck(FileScan(rel), unreadable=exc.strerror or str(exc))
    return FileCheck(scan, events, head_sha256=head)


def _digest(path: Path) -> tuple[int, int, str]:
    size = lines = 0
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            sha.update(block)
            size += len(block)
            lines += block.count(b"\n")
    return size, lines, sha.hexdigest()


@dataclass
class Outcome:
    """The checks' verdict: problems (each one sentence) and notes."""

    run_id: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    lines: int = 0
    event_files: int = 0
    crashed_events: list[FileCheck] = field(default_factory=list)  # checked to checkpoints
    crashed_unchecked: list[str] = field(default_factory=list)  # results, dead letters


def verify_run(run_dir: Path, workers: int | None = None) -> str:
    """Check every file the run's manifest lists, and that results/, events/ and dead/ hold no
    other; the summary to print, or VerifyError naming what disagrees (RunLiveError for a pass
    still at work, RunDirError for no run directory)."""
    manifest = read_manifest(run_dir)
    state, why = run_state(_bare(run_dir, manifest))
    if state != "running" and in_use(run_dir):  # a pass starting, before its manifest says so
        state, why = "running", f"a process of the run holds its {PASS_LOCK} or .lock"
    if state == "running":
        raise RunLiveError(f"{run_dir} is still running ({why}), so its files are still being "
                           "written and its manifest lists them as the previous pass left them; "
                           "verify it once the pass has ended")
    if state == "finished" and manifest.get("status") == "running":
        manifest = read_manifest(run_dir)  # it ended while we looked: its list is the new one
    crashed = state == "crashed"
    out = _check(run_dir, manifest, crashed, workers)
    if in_use(run_dir) or read_manifest(run_dir) != manifest:
        raise RunLiveError(f"a pass of {run_dir} began or ended while verify read it, so its "
                           "files were compared with a list that no longer holds; verify it "
                           "once the pass has ended")
    return _verdict(run_dir, out, crashed, manifest)


def _bare(run_dir: Path, manifest: dict[str, Any]) -> LoadedRun:
    """A run as `run_state` reads it, without its logs: a pass alive or gone is told by the
    run's locks (and, for a run of an older shardrun without them, by its logs' age)."""
    newest = 0.0
    for path in event_files(run_dir):
        try:
            newest = max(newest, path.stat().st_mtime)
        except OSError:
            continue
    return LoadedRun(path=run_dir, manifest=manifest, coordinators=[], coordinator_scans=[],
                     shards=[], shard_scans=[], newest_mtime=newest)


def _check(run_dir: Path, manifest: dict[str, Any], crashed: bool,
           workers: int | None) -> Outcome:
    out = Outcome(str(manifest.get("run_id")))
    listed = _listed(run_dir, manifest, out)
    if listed is None and not crashed:
        raise VerifyError(f"{run_dir}/manifest.json lists no files (a run of a shardrun older "
                          "than the list, or a manifest edited by hand), so there is nothing "
                          "to check the run against")
    listed = listed or {}
    present = _present(run_dir)
    unlisted = sorted(set(present) - set(listed))
    jobs = [(run_dir / rel, rel, rec["bytes"]) for rel, rec in listed.items()]
    jobs += [(run_dir / rel, rel, None) for rel in unlisted]
    size = sum(rec["bytes"] for rec in listed.values()) + sum(present[r] for r in unlisted)
    found = {c.rel: c for c in map_files(check_file, jobs, workers, size)}
    newest = len(manifest.get("resumes") or [])
    listed_by = _listed_by(manifest)
    aside = {newest + 1, newest} if crashed else {newest + 1}
    moved = _moved_aside(listed, found, unlisted, aside)
    for rel, rec in listed.items():
        if rel in moved:
            out.notes.append(f"{rel} was set aside, unchanged, to {moved[rel]} by a retry pass "
                             "that did not end")
            _count(out, found[moved[rel]])
        else:
            _compare(out, found[rel], rec, crashed)
    ours = set(listed)  # the files that are the run's: listed, or a crashed pass's
    for rel in unlisted:
        if rel in moved.values():
            continue
        by = _written_by(rel)
        if crashed and listed_by < by <= newest:  # each pass since the list crashed
            _crashed_file(out, found[rel])
            ours.add(rel)
        else:
            twin = next((r for r, rec in listed.items() if found[r].missing
                         and rec["sha256"] == found[rel].scan.sha256), None)
            how = (f"it has the SHA-256 the manifest records for {twin}, which is gone: renamed "
                   "or moved" if twin else "added, or renamed")
            out.problems.append(f"{rel} is in the run directory but not in the manifest ({how})")
    out.problems += _not_this_runs(run_dir, manifest, present, ours)
    return out


def _not_this_runs(run_dir: Path, manifest: dict[str, Any], present: dict[str, int],
                   ours: set[str]) -> list[str]:
    """Event logs that no list names and that are gone though their shard wrote results, or
    that hold another run's events: what a crashed pass's files cannot be compared with.
    `ours`: the run's files (listed, or a crashed pass's); an added one is no shard's."""
    problems = []
    for rel in sorted(p for p in ours if p.startswith(("results/", "dead/"))):
        log = "events/" + PurePosixPath(rel).name
        # A shard's file only: a retry pass's dead/unretried-rK.jsonl is its coordinator's.
        if (PurePosixPath(rel).parent.name in ("results", "dead") and log not in present
                and PurePosixPath(rel).name.startswith("shard-")
                and log not in ours and unlogged_text(log, run_dir) not in problems):
            problems.append(unlogged_text(log, run_dir))
    mine = manifest.get("run_id")
    for rel in sorted(p for p in present if p.startswith("events/")):
        theirs = first_run_id(run_dir / rel)
        if isinstance(mine, str) and theirs is not None and theirs != mine:
            problems.append(foreign_text(rel, theirs, mine))
    return problems


def _listed_by(manifest: dict[str, Any]) -> int:
    """The pass that wrote the manifest's list of files: the last to end (each that ends lists
    every file), -1 when none did. Each pass after it crashed, and no list names its files."""
    ended = [at for at, *_ in pass_reads(manifest)]
    if ended:
        return max(ended)
    return len(manifest.get("resumes") or []) - 1 if "files" in manifest else -1


def _listed(run_dir: Path, manifest: dict[str, Any],
            out: Outcome) -> dict[str, dict[str, Any]] | None:
    """The manifest's list (path -> record), None when it has none (no pass ended). A record
    that is no file of the run (an edited manifest) is a problem, not a path to read."""
    files = manifest.get("files")
    if files is None:
        return None
    if not isinstance(files, list):
        raise VerifyError(f"{run_dir}/manifest.json: files is not a list; the manifest was "
                          "edited or damaged")
    listed: dict[str, dict[str, Any]] = {}
    for i, rec in enumerate(files):
        path = rec.get("path") if isinstance(rec, dict) else None
        if (isinstance(path, str) and isinstance(rec.get("sha256"), str)
                and type(rec.get("bytes")) is int and _inside(path) and path not in listed):
            if is_run_file(path):  # an older shardrun listed reports and samples too
                listed[path] = rec
        else:
            out.problems.append(f"the manifest's files[{i}] is not a file of the run (a path "
                                "inside it, its SHA-256 and size, each listed once): the "
                                "manifest was edited or damaged")
    return listed


def _inside(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    return bool(parts) and not PurePosixPath(rel).is_absolute() and ".." not in parts


def _present(run_dir: Path) -> dict[str, int]:
    """The files in results/, events/ and dead/ a pass would list (path -> size)."""
    found = {}
    for sub in CHECKED_DIRS:
        for root, _, names in os.walk(run_dir / sub):
            for name in names:
                path = Path(root) / name
                if listed_file(path):
                    try:
                        found[str(path.relative_to(run_dir))] = path.stat().st_size
                    except OSError:
                        continue
    return found


def _written_by(rel: str) -> int:
    """The pass that wrote a file: K for `*.rK.jsonl` and anything under `superseded-rK/`."""
    path = PurePosixPath(rel)
    if path.parent.name.startswith("superseded-r"):
        return pass_of(Path(path.parent.name))
    return pass_of(Path(path.name))


def _moved_aside(listed: dict[str, dict[str, Any]], found: dict[str, FileCheck],
                 unlisted: list[str], passes: set[int]) -> dict[str, str]:
    """Listed dead letters that a retry pass that has not ended (one of `passes`) set aside
    unchanged under `dead/superseded-rK/`: listed path -> where they are now."""
    moved = {}
    for rel in unlisted:
        path = PurePosixPath(rel)
        if path.parent.name.startswith("superseded-r") and _written_by(rel) in passes:
            was = f"dead/{path.name}"
            rec = listed.get(was)
            if rec and found[was].missing and (rec["sha256"], rec["bytes"]) == (
                    found[rel].scan.sha256, found[rel].scan.bytes):
                moved[was] = rel
    return moved


def _count(out: Outcome, check: FileCheck) -> None:
    out.files += 1
    out.bytes += check.scan.bytes
    out.lines += check.scan.lines
    out.event_files += check.events


def _compare(out: Outcome, check: FileCheck, rec: dict[str, Any], crashed: bool) -> None:
    rel, size, sha = check.rel, rec["bytes"], rec["sha256"]
    if check.missing:
        out.problems.append(f"{rel} is listed in the manifest but missing from the run directory")
        return
    if check.unreadable:
        out.problems.append(f"{rel} cannot be read ({check.unreadable})")
        return
    _count(out, check)
    if (check.scan.sha256, check.scan.bytes) == (sha, size):
        if check.scan.checkpoint_error:
            out.problems.append(f"{rel} matches the manifest but fails its own checkpoints "
                                f"({check.scan.checkpoint_error})")
        return
    if check.head_sha256 == sha:
        grown = (f"{check.scan.bytes - size:,} bytes were appended to {rel} after the "
                 f"manifest recorded its {size:,}")
        if crashed and check.scan.checkpoint_error:
            out.problems.append(f"{grown}, and they fail its own checkpoints "
                                f"({check.scan.checkpoint_error}); those {size:,} are as "
                                "recorded")
        elif crashed:
            out.notes.append(f"{grown} (by the pass that crashed); those {size:,} are as "
                             "recorded" + _covered(check))
        else:
            out.problems.append(f"{grown}, though the run had ended; those {size:,} are as "
                                "recorded")
        return
    out.problems.append(f"{rel} differs from the manifest: {_difference(check, size, sha)}")


def _difference(check: FileCheck, size: int, sha: str) -> str:
    got = check.scan
    if got.bytes == size:
        what = (f"SHA-256 {got.sha256[:12]}… where it recorded {sha[:12]}…, the same size "
                f"({size:,} bytes): bytes were changed in place")
    elif got.bytes < size:
        what = f"{got.bytes:,} bytes where it recorded {size:,}: cut short or rewritten"
    else:
        what = (f"{got.bytes:,} bytes where it recorded {size:,}, and its first {size:,} "
                "differ: rewritten")
    if got.checkpoint_error:
        what += f"; its own checkpoints locate the change: {got.checkpoint_error}"
    return what


def _crashed_file(out: Outcome, check: FileCheck) -> None:
    """A file the crashed pass wrote after the manifest's last list: nothing to check it against
    but an event file's own checkpoints."""
    if check.missing or check.unreadable:
        out.problems.append(f"{check.rel} cannot be read ({check.unreadable or 'gone'})")
        return
    if check.scan.checkpoint_error:
        out.problems.append(f"{check.rel}, written by the pass that crashed, fails its own "
                            f"checkpoints ({check.scan.checkpoint_error})")
    elif check.events:
        out.crashed_events.append(check)
    else:
        out.crashed_unchecked.append(check.rel)


def _covered(check: FileCheck) -> str:
    if not check.events:
        return ""
    if not check.scan.checkpoints:
        return f" (none yet: its {check.scan.lines:,} lines are unchecked)"
    return f" (lines 1-{check.scan.covered_lines:,} of {check.scan.lines:,})"


def _verdict(run_dir: Path, out: Outcome, crashed: bool, manifest: dict[str, Any]) -> str:
    if out.problems:
        shown = out.problems[:MAX_SHOWN]
        more = len(out.problems) - len(shown)
        raise VerifyError(
            f"{run_dir} does not match its manifest ({counted(len(out.problems), 'problem')}):\n  "
            + "\n  ".join(shown) + (f"\n  and {more:,} more" if more else ""))
    head = (f"ok: run {out.run_id}: {counted(out.files, 'file')} ({out.bytes:,} bytes, "
            f"{out.lines:,} lines) match the SHA-256 and size its manifest records; the "
            f"checkpoints of its {counted(out.event_files, 'event file')} verify; results/, "
            "events/ and dead/ hold no other file")
    if crashed:
        head = _crashed_head(out, manifest)
    return "\n  ".join([head, *out.notes])


def _crashed_head(out: Outcome, manifest: dict[str, Any]) -> str:
    """What could be checked of a run whose newest pass crashed, and what could not."""
    newest = len(manifest.get("resumes") or [])
    since = range(max(_listed_by(manifest) + 1, 0), newest + 1)
    names = ["its first pass" if k == 0 else f"resume {k}" for k in since]
    who = names[-1] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    one = len(names) == 1
    if "files" in manifest:
        listed = (f"so the list is the pass before's: the {counted(out.files, 'file')} it names "
                  f"match it ({out.bytes:,} bytes, {out.lines:,} lines, the checkpoints of "
                  f"{counted(out.event_files, 'event file')} verify); of the")
    else:
        listed = f"and no pass before {'it' if one else 'them'} did; of the"
    events = out.crashed_events
    lines = sum(c.scan.lines for c in events)
    covered = sum(c.scan.covered_lines for c in events)
    wrote = [f"the {counted(len(events), 'event file')} verify up to their checkpoints "
             f"(lines {covered:,} of {lines:,} covered; the lines after a file's last "
             "checkpoint are unchecked)"] if events else []
    if unchecked := out.crashed_unchecked:
        shown = ", ".join(unchecked[:MAX_LISTED]) + (
            f" and {len(unchecked) - MAX_LISTED:,} more" if len(unchecked) > MAX_LISTED else "")
        wrote.append(f"the {counted(len(unchecked), 'results or dead-letter file')} cannot be "
                     f"checked at all, having no checkpoints ({shown})")
    files = counted(len(events) + len(out.crashed_unchecked), "file")
    return (f"ok, as far as a crashed run can be checked: {who} crashed before "
            f"{'it' if one else 'any of them'} listed the run's files, {listed} {files} "
            f"{who} wrote" + (" since, " if "files" in manifest else ", ")
            + ("; ".join(wrote) if wrote else "none is left"))

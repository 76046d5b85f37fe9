"""Read a run directory: manifest, event files (in parallel when large), and the run's state.

Shard files are independent and their summaries merge, so big runs fold one file per worker
process; the coordinator's small log is read first because `input_end` bounds cross-shard idle.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

import orjson

from shardrun import event_names as events
from shardrun._ellipsis import counted
from shardrun.aggregate import (
    MINUTES_ONLY_EVENTS,
    CoordinatorFold,
    CoordinatorSummary,
    ShardFold,
    ShardSummary,
)
from shardrun.aggregate import _fast as fast
from shardrun.digestset import DigestSet
from shardrun.errors import RunDirError, ShardrunError
from shardrun.inputs import InputReader, Reject
from shardrun.manifest import (
    newest_pass,
    newest_read_before,
    newest_summary,
    pass_reads,
    read_manifest,
    restate_way_on,
    retry_failed_command,
)
from shardrun.recovery import line_ids
from shardrun.report._scan import FileScan, scan_file
from shardrun.resume import (
    PASS_LOCK,
    check_input,
    first_set_aside_pass,
    in_use,
    pass_lives,
    pass_of,
    set_aside_lines,
)
from shardrun.summary import work_left
from shardrun.worksource import id_digest

PARALLEL_BYTES = 64 << 20  # below this, worker start-up costs more than it saves
WORKERS_VAR = "SHARDRUN_AGGREGATE_WORKERS"
RUNNING_WINDOW_S = 10.0  # a live shard writes its log at least once a second
STALLED_WINDOW_S = 300.0  # a shard process alive but silent this long is not trusted as ours
T = TypeVar("T")
COORDINATOR_EVENTS = (events.RUN_START, events.BATCH, events.INPUT_END, events.SHARD_EXIT,
                      events.RUN_END, events.CHECKPOINT)


@dataclass(frozen=True, kw_only=True)
class FoldOptions:
    minutes_only: bool = False
    keep_lines: bool = False
    trace: bool = False


@dataclass(kw_only=True)
class LoadedRun:
    """Everything read from one run directory."""

    path: Path
    manifest: dict[str, Any]
    coordinators: list[CoordinatorSummary]  # one per pass, aligned with `coordinator_scans`
    coordinator_scans: list[FileScan]
    shards: list[ShardSummary]  # in path order, aligned with `shard_scans`
    shard_scans: list[FileScan]
    newest_mtime: float = 0.0

    @property
    def scans(self) -> list[FileScan]:
        """Every event file read: the coordinators' first, then the shards'."""
        return self.coordinator_scans + self.shard_scans

    def manifest_mismatches(self) -> list[str]:
        """Event files whose bytes differ from what the manifest recorded when the run ended."""
        recorded = {f.get("path"): f for f in self.manifest.get("files") or []
                    if isinstance(f, dict)}
        out = []
        for scan in self.scans:
            rec = recorded.get(scan.path)
            if rec is not None and (rec.get("sha256"), rec.get("bytes")) != (scan.sha256,
                                                                             scan.bytes):
                out.append(scan.path)
        return out

    def unlisted_files(self) -> list[str]:
        """Event files the manifest's list does not name though the pass that wrote them had
        ended: the list names every file of the run as the last pass to end left it, so such
        a file was added since (a copied log counts its spans twice), or renamed. A pass that
        has not ended (running, or crashed) wrote files of its own that no list names yet."""
        return [s.path for s in self.scans if self._added(s.path)]

    def _added(self, rel: str) -> bool:
        """Whether the manifest's list should name `rel` and does not."""
        if self._listing is None:
            return False
        listed, last, newest = self._listing
        # A pass the manifest has no record of (`.r9` of a run of two passes) wrote nothing.
        return rel not in listed and not last < segment_of(Path(rel)) <= newest

    @cached_property
    def _listing(self) -> tuple[set[Any], int, int] | None:
        """The manifest's list of files, the last pass it covers and the newest pass; None
        when it has no list. Read once: `_added` asks for each of a run's files (thousands)."""
        files = self.manifest.get("files")
        if not isinstance(files, list):
            return None
        resumes = self.manifest.get("resumes")
        newest = len(resumes) if isinstance(resumes, list) else 0
        if self.manifest.get("status") != "running" and self.manifest.get("ended_at"):
            last = newest
        else:
            last = max((at for at, *_ in pass_reads(self.manifest)), default=-1)
        return {f.get("path") for f in files if isinstance(f, dict)}, last, newest

    def missing_files(self) -> list[str]:
        """Event files the manifest lists that are not in the run directory: their figures
        would silently be left out of anything computed from it."""
        present = {scan.path for scan in self.scans}
        return sorted(p for f in self.manifest.get("files") or [] if isinstance(f, dict)
                      and isinstance(p := f.get("path"), str) and p.startswith("events/")
                      and p not in present)


    def unlogged_files(self) -> list[str]:
        """Shard event files missing from `events/` whose shard's results or dead-letter file
        is there (a shard opens its log first): a crashed pass lists no files, so without this
        a copy that left a log out, or a log deleted, would drop its figures unsaid."""
        present = {scan.path for scan in self.scans} | set(self.missing_files())
        out = {f"events/{p.name}" for sub in ("results", "dead")
               for p in (self.path / sub).glob("shard-*.jsonl")
               if not self._added(f"{sub}/{p.name}")}  # an added file is no shard's
        # On disk now, not only among the logs read: a shard that started since they were
        # read (a live run's resume or replacement) opened its log before its results.
        return sorted(p for p in out - present if not (self.path / p).exists())

    def beyond_log(self, *, live: bool = False) -> list[BeyondLog]:
        """Results and dead-letter files holding more lines than their shard's event log ended
        that way: a flush writes the log first, so a full disk cuts the log while the answers
        of the requests still in flight reach their file, and a power cut can lose the log's
        last writes and keep the results' (`ShardOutput.flush`); a kill leaves neither.

        `live`: a pass runs. Its shards (of the newest pass, or a newer one the manifest read
        does not record yet) and any shard process still alive write results read later than
        their logs were, so they are left out; an earlier pass's files no longer change."""
        newest = len(self.manifest.get("resumes") or [])
        out = []
        for shard, scan in zip(self.shards, self.shard_scans, strict=True):
            # A log that reached its shard_end and reads whole lost no flush: its files are not
            # read (about 600 MB of results for 1M items, a sixth of the report's time).
            if shard.ended and not scan.bad_lines:
                continue
            if live and (segment_of(Path(scan.path)) >= newest or _alive(shard)):
                continue
            name = scan.path.removeprefix("events/")
            for sub, logged in (("results", shard.ok), ("dead", shard.dead)):
                path = self.path / sub / name
                try:
                    lines, written = _line_count(path), path.stat().st_mtime
                except OSError:  # none, or moved aside by a retry pass: fewer, never more
                    continue
                if lines > logged:
                    answers = _last_tokens(path, lines - logged) if sub == "results" else None
                    out.append(BeyondLog(f"{sub}/{name}", scan.path, lines, logged,
                                         shard.last_t, written, answers))
        return out

    def foreign_files(self) -> list[tuple[str, str]]:
        """Event files whose first line names another run than the manifest, with that run:
        a log copied in from another run, whose figures would be counted as this run's."""
        mine = self.manifest.get("run_id")
        out = []
        for scan in self.scans:
            theirs = first_run_id(self.path / scan.path)
            if isinstance(mine, str) and theirs is not None and theirs != mine:
                out.append((scan.path, theirs))
        return out


@dataclass(frozen=True)
class BeyondLog:
    """A shard's results (or dead-letter) file with more lines than its event log records."""

    path: str  # results/shard-NN.jsonl or dead/shard-NN.jsonl, relative to the run
    event_log: str  # events/shard-NN.jsonl
    lines: int  # whole lines in the file
    logged: int  # spans the log records as ended that way
    log_ends: float | None  # the last event the log holds: the answers beyond it came later
    written: float  # the file's mtime: the answers beyond the log came before it
    # The earliest and latest `last_token_at` of the lines beyond the log (the instant their
    # tokens count at), or None where they cannot be read (or are dead letters).
    answers: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "event_log": self.event_log, "lines": self.lines,
                "logged": self.logged, "log_ends": self.log_ends, "written": self.written,
                "answers": None if self.answers is None else list(self.answers)}

    def hides(self, minute: int) -> bool:
        """Whether answers beyond the log may have ended in `minute` (epoch minutes)."""
        if self.answers is not None:  # exact: as their own lines say, copied or not
            return int(self.answers[0] // 60) <= minute <= int(self.answers[1] // 60)
        return int((self.log_ends or 0.0) // 60) <= minute <= int(self.written // 60)

    def text(self) -> str:
        # Not a kill: a flush hands the log its lines before the results theirs (`flush`).
        what = "answer" if self.path.startswith("results/") else "dead letter"
        more = self.lines - self.logged
        return (f"{self.path} holds {counted(self.lines, what)} where its event log "
                f"{self.event_log} "
                f"records {self.logged:,}: the log was cut (by a full disk, which fails its write "
                f"first, or a power cut that lost its last writes but not the file's), so this "
                f"report's counts and throughput cover only the "
                f"logged part ({more:,} more {what if more == 1 else what + 's'} "
                f"{'is' if more == 1 else 'are'} kept; export and --resume see them)")


def first_run_id(path: Path) -> str | None:
    """The `run_id` of a file's first line, or None (no whole first line, or no run id)."""
    try:
        with open(path, "rb") as f:
            line = f.readline(1 << 16)
        rec = orjson.loads(line)
    except (OSError, orjson.JSONDecodeError):
        return None
    got = rec.get("run_id") if isinstance(rec, dict) else None
    return got if isinstance(got, str) else None


def where_it_went(rel: str, run_dir: Path) -> str:
    """A hint for an event file that is gone: a compressed copy of it beside, if any."""
    for ext in (".gz", ".zst", ".xz", ".bz2"):
        if (run_dir / (rel + ext)).exists():
            return (f"; {rel}{ext} is there: decompress it (keeping its name {Path(rel).name})"
                    " and run this again")
    return ""


def unlogged_text(rel: str, run_dir: Path) -> str:
    name = rel.removeprefix("events/")
    wrote = " and ".join(f"{sub}/{name}" for sub in ("results", "dead")
                         if (run_dir / sub / name).exists())
    return (f"{rel} is missing from the run directory, though its shard wrote {wrote}: its "
            "figures would be left out (a copy that left it out, or a deleted log; put it "
            f"back){where_it_went(rel, run_dir)}")


def foreign_text(rel: str, theirs: str, mine: Any) -> str:
    return (f"{rel} holds events of run {theirs!r}, not of run {mine!r} (its first line says "
            "so): a log copied in from another run; put back this run's own")


def shard_files(run_dir: Path) -> list[Path]:
    """`events/shard-NN.jsonl` and the resume passes' `shard-NN.rK.jsonl`, in path order."""
    return sorted((run_dir / "events").glob("shard-*.jsonl"))


def coordinator_files(run_dir: Path) -> list[Path]:
    """`events/coordinator.jsonl` and the resume passes' `coordinator.rK.jsonl`, by pass."""
    return sorted((run_dir / "events").glob("coordinator*.jsonl"), key=segment_of)


def segment_of(path: Path) -> int:
    """The pass that wrote an event file: 0, or K for `*.rK.jsonl`."""
    suffix = Path(path.stem).suffix
    return int(suffix[2:]) if suffix[:2] == ".r" and suffix[2:].isdecimal() else 0


def event_files(run_dir: Path) -> list[Path]:
    return coordinator_files(run_dir) + shard_files(run_dir)


@dataclass(frozen=True)
class Standing:
    """The dead letters that still stand, those of items answered too, and the lines that count
    could not read."""

    dead: int
    bad: list[str]  # 'PATH line N' of each line that is no record: the count may be off by it
    # Dead letters whose item has a result line too (a damaged run: a retry pass's put-back
    # cut, a hand edit): answered, as `retry-failed` counts them (`resume.Prior.answered`).
    answered: int = 0


def standing_dead_letters(run_dir: Path) -> Standing | None:
    """The dead letters that still stand (the lines of `dead/*.jsonl`, and those a retry pass
    set aside but has not reached, or was killed before it reached), or None while no retry
    pass has set any aside: until then every dead span is a dead item and the log's figures
    say it all. After one, a dead span may be an item that a later pass finished.

    The live files are read once, before the set-aside ones (`resume.set_aside_lines` says
    why): so while a pass writes, each item is counted once. A line that is no record is
    noted, not fatal: a report still reports."""
    since = first_set_aside_pass(run_dir)
    if since is None:
        return None
    bad: list[str] = []
    answers: set[str] = set()  # ids with a result line
    live_dead: list[str] = []
    earlier: list[Path] = []  # results before `since`: read only for a dead letter's answer
    dead = 0
    for sub in ("dead", "results"):
        for path in sorted((run_dir / sub).glob("*.jsonl")):
            if pass_of(path) < since:  # cannot hold a set-aside item: only dead/'s count
                if sub == "results":
                    earlier.append(path)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    dead += _line_count(path)
                continue
            unread = len(bad)
            try:
                ids = list(line_ids(path, whole_only=True, bad=bad))
            except FileNotFoundError:  # a starting pass moved it aside: read there, below
                continue
            if sub == "dead":  # a line that is no record still counts, as _line_count does
                live_dead += ids
                dead += len(bad) - unread
            else:
                answers.update(ids)
    aside = set_aside_lines(run_dir, bad)
    standing = live_dead + list(aside.keys() - answers - set(live_dead))
    answered = _answered(standing, answers, earlier, bad)
    return Standing(dead + len(standing) - answered, bad, answered)


def _answered(standing: list[str], answers: set[str], earlier: list[Path],
              bad: list[str]) -> int:
    """How many of the `standing` dead letters are of items with a result line: in `answers`,
    or in the `earlier` results files, read (the first pass's: millions of lines, often) only
    while a dead letter's item is not found answered yet."""
    unanswered = set(standing) - answers
    for path in earlier:
        if not unanswered:
            break
        with contextlib.suppress(FileNotFoundError):
            unanswered.difference_update(line_ids(path, whole_only=True, bad=bad))
    return sum(1 for item_id in standing if item_id not in unanswered)


def _last_tokens(path: Path, n: int) -> tuple[float, float] | None:
    """The earliest and latest `last_token_at` of the last `n` whole lines of a results file
    (a flush writes them in `released` order, so a cut log lacks the last ones), read from its
    end; None if one is no record with that time."""
    with path.open("rb") as f:
        end = f.seek(0, os.SEEK_END)
        data = b""
        while end > 0 and data.count(b"\n") <= n:  # one more: the line before theirs ends
            start = max(0, end - (1 << 20))
            f.seek(start)
            data = f.read(end - start) + data
            end = start
    lines = data[:data.rfind(b"\n")].split(b"\n")[-n:]  # a torn tail is no line
    try:
        times = [float(orjson.loads(line)["last_token_at"]) for line in lines]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    return min(times), max(times)


def _line_count(path: Path) -> int:
    count = 0
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
    return count


def default_cap(manifest: dict[str, Any]) -> int:
    effective = manifest.get("effective")
    entry = effective.get("concurrency") if isinstance(effective, dict) else None
    value = entry.get("value") if isinstance(entry, dict) else entry
    return value if isinstance(value, int) and value > 0 else 0


def fold_shard_file(path: Path, rel: str, idle_until: float, cap: int,
                    opts: FoldOptions) -> tuple[FileScan, ShardSummary]:
    """Scan and fold one shard's event file (a top-level function: it runs in workers).

    The C fold (`aggregate._fast`) where it is built and the file is in today's layout; the
    Python fold otherwise, and for the whole file whenever the C fold falls back.
    """
    if not opts.trace and fast.available():
        folder = fast.FastShardFold(idle_until=idle_until, cap=cap,
                                    minutes_only=opts.minutes_only, keep_lines=opts.keep_lines)
        try:
            scan = scan_file(path, rel, {}, folder=folder)
        except fast.Fallback:
            pass
        else:
            return scan, _named(folder.finish(), path)
    fold = ShardFold(idle_until=idle_until, cap=cap, minutes_only=opts.minutes_only,
                     keep_lines=opts.keep_lines, trace=opts.trace)
    wanted = MINUTES_ONLY_EVENTS if opts.minutes_only else None
    with _no_gc():  # millions of short-lived dicts, no cycles: collection only costs time
        scan = scan_file(path, rel, fold.handlers, wanted)
    return scan, _named(fold.finish(), path)


def _named(summary: ShardSummary, path: Path) -> ShardSummary:
    summary.name = path.name.removeprefix("shard-").removesuffix(".jsonl")
    summary.segment = segment_of(path)
    return summary


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def fold_coordinator_file(path: Path) -> tuple[FileScan, CoordinatorSummary]:
    fold = CoordinatorFold()
    handlers = {name: fold.feed for name in COORDINATOR_EVENTS}
    scan = scan_file(path, f"events/{path.name}", handlers)
    fold.summary.segment = segment_of(path)
    return scan, fold.summary


def load_run(run_dir: Path, opts: FoldOptions | None = None,
             workers: int | None = None) -> LoadedRun:
    """Read and fold every event file of `run_dir`."""
    opts = opts or FoldOptions()
    if problem := fast.setting_problem():
        raise RunDirError(problem)
    manifest = read_manifest(run_dir)
    for path in event_files(run_dir):  # a name the globs match is not yet a file to read
        if not path.is_file():
            what = ("a directory" if path.is_dir() else "a link to nothing" if path.is_symlink()
                    else "not a regular file")
            raise RunDirError(f"{path} is not a file ({what}); the run directory was edited or "
                              "damaged")
    coords = [fold_coordinator_file(p) for p in coordinator_files(run_dir)]
    paths = shard_files(run_dir)
    if not paths and not coords:
        raise RunDirError(f"{run_dir} has no event files under events/")
    ends = {c.segment: c.input_end for _, c in coords}
    jobs = [(p, f"events/{p.name}", _or_inf(ends.get(segment_of(p))), default_cap(manifest),
             opts) for p in paths]
    results = _fold_all(jobs, workers, sum(p.stat().st_size for p in paths))
    return LoadedRun(
        path=run_dir, manifest=manifest, coordinators=[c for _, c in coords],
        coordinator_scans=[s for s, _ in coords], shards=[r[1] for r in results],
        shard_scans=[r[0] for r in results],
        newest_mtime=max((p.stat().st_mtime for p in event_files(run_dir)), default=0.0),
    )  # fmt: skip


def _or_inf(t: float | None) -> float:
    return math.inf if t is None else t


def _workers() -> int | None:
    """`SHARDRUN_AGGREGATE_WORKERS`: worker processes for folding (default: one per CPU)."""
    raw = os.environ.get(WORKERS_VAR, "").strip()
    if not raw:
        return None
    if not raw.isdecimal() or int(raw) < 1:  # not isdigit: int("²") fails
        raise RunDirError(f"{WORKERS_VAR}={raw!r} is not a positive whole number; set it to "
                          "the worker processes to use (1 or more), or unset it for the default")
    return int(raw)


def _fold_all(jobs: list[tuple[Any, ...]], workers: int | None,
              total_bytes: int) -> list[tuple[FileScan, ShardSummary]]:
    return map_files(fold_shard_file, jobs, workers, total_bytes)


def map_files(read: Callable[..., T], jobs: list[tuple[Any, ...]], workers: int | None,
              total_bytes: int) -> list[T]:
    """`read(*job)` for each job (one file each), in job order: in `workers` processes (default
    `SHARDRUN_AGGREGATE_WORKERS`, else one per CPU once the files hold `PARALLEL_BYTES`)."""
    workers = workers if workers is not None else _workers()
    # Never more workers than files: each reads one file, and a process costs its start-up.
    n = min(workers if workers is not None else os.cpu_count() or 1, len(jobs))
    if n <= 1 or len(jobs) <= 1 or (workers is None and total_bytes < PARALLEL_BYTES):
        return [read(*job) for job in jobs]
    with ProcessPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(read, *job) for job in jobs]
        return [f.result() for f in futures]


def run_state(loaded: LoadedRun, now: float | None = None) -> tuple[str, str]:
    """`finished`, `running` or `crashed`, and why (see docs/METRICS.md, "Run state")."""
    status = loaded.manifest.get("status")
    ended_at = loaded.manifest.get("ended_at")
    unended = [s.name for s in loaded.shards if not s.ended]
    if status != "running" and ended_at:
        why = f"manifest status {status}, ended {ended_at}"
        # What stopped the pass (refused credentials, a used-up quota, an outage...), in the
        # sentence the run printed: else the work left below reads as a --limit or a user's stop.
        stop = newest_summary(loaded.manifest).get("fatal_reason")
        if isinstance(stop, str) and stop:
            # Its command rebuilt: the pass named paths as it was given them, where it ran.
            stop = restate_way_on(stop, loaded.path, loaded.manifest)
            why += f"; its last pass was stopped: {stop}"
        why += _work_left(loaded)
        if unended:
            why += f"; shard logs without shard_end: {_list(unended)}"
        return "finished", why
    # The gate is asked once: asked again below, a pass that ended between the two asks
    # would read as neither alive nor just ended, and be called crashed by its logs' age.
    lives = pass_lives(loaded.path)
    if not lives and in_use(loaded.path) is False:
        if (meanwhile := _finished_meanwhile(loaded, now)) is not None:
            return meanwhile
        # Every process of a pass holds the run's locks while it lives (the pass its gate for
        # its whole life, `resume.in_use`): none is left, however recently the logs were
        # written (a pass that could not write its manifest at the end, on a full disk, or one
        # killed a moment ago).
        return "crashed", ("manifest status running, but no process of the run holds its lock: "
                           "the run ended without closing its manifest"
                           + (f"; shard logs without shard_end: {_list(unended)}"
                              if unended else "") + _crashed_way_on(loaded))
    age = (time.time() if now is None else now) - loaded.newest_mtime
    alive = [s.name for s in loaded.shards if not s.ended and _alive(s)]
    if lives:
        # However long since its logs were written: at its end a pass hashes every file of
        # the run for its manifest, its shards gone and its logs closed (a while, in a big run).
        return "running", (f"manifest status running; its pass is alive (it holds {PASS_LOCK}); "
                           f"last log write {age:.1f} s ago"
                           + (f"; shard processes alive: {_list(alive)}" if alive else ""))
    if age < RUNNING_WINDOW_S or (alive and age < STALLED_WINDOW_S):
        return "running", (f"manifest status running; last log write {age:.1f} s ago"
                           + (f"; shard processes alive: {_list(alive)}" if alive else ""))
    if (meanwhile := _finished_meanwhile(loaded, now)) is not None:
        return meanwhile
    if not unended:
        return "crashed", ("every shard log ended but the manifest was never finalized"
                           + _crashed_way_on(loaded))
    return "crashed", (f"manifest status running, no log written for {age:.0f} s; shard logs "
                       f"without shard_end: {_list(unended)}{_crashed_way_on(loaded)}")


def _finished_meanwhile(loaded: LoadedRun, now: float | None) -> tuple[str, str] | None:
    """The run's state by its manifest as it is now, if that records an end the one read with
    the logs did not (see `_ended_since`); None if it does not."""
    if (ended := _ended_since(loaded)) is None:
        return None
    state, why = run_state(replace(loaded, manifest=ended), now)
    return state, (f"{why}; it ended while this report read the run, so the figures are of "
                   "the moment before: report again for all of it")


def _ended_since(loaded: LoadedRun) -> dict[str, Any] | None:
    """The manifest as it is now, if it records the end that the one read with the logs did
    not: the pass ended (closing its manifest, then letting go of its locks) while the logs
    were read, which no lock held now would otherwise tell from a crash."""
    try:
        manifest = read_manifest(loaded.path)
    except RunDirError:
        return None
    return manifest if manifest.get("status") != "running" and manifest.get("ended_at") else None


def _crashed_way_on(loaded: LoadedRun) -> str:
    """What continues a crashed run, by what its newest pass was (the way on its stop would
    have named, `runner.choose_way_on`): the next pass keeps every answer on disk, repairs torn
    lines and puts back the dead letters a retry pass set aside and did not reach."""
    newest = newest_pass(loaded.manifest)
    retry = _retry_command(loaded)
    if not newest.get("retry_failed"):
        if _all_answered(loaded):  # what a resume does then (`WorkSource` skips them all)
            return ("; every input item has a result or a dead letter: --resume only closes "
                    "the run (it sends no request, and records the run's end)")
        return "; --resume continues it (it keeps every answer on disk)"
    if newest.get("only_failed") or newest_read_before(loaded.manifest):
        return f"; {retry} continues it (its dead letters are for retry-failed, not --resume)"
    return (f"; --resume runs the input it left, and {retry} its dead letters (--resume does "
            "not retry them)")


def _all_answered(loaded: LoadedRun) -> bool:
    """Whether every item of the run's input has a result or a dead letter on disk, the input
    read as its last pass read it; False also when that cannot be told (the job file or the
    input gone or changed, an unreadable line: then --resume is the safe way on)."""
    from shardrun.export import run_input  # the input's reader: only for a crashed run

    # Before its input's end no pass can have answered its last item: most crashed runs, told
    # so from the log already read, not by reading every result id (7 s for 1M items).
    segment = len(loaded.manifest.get("resumes") or [])
    if not any(c.segment == segment and c.input_end is not None for c in loaded.coordinators):
        return False
    try:
        path, plan = run_input(loaded.path, loaded.manifest)
        # An input a resume refuses (not what an ended pass read) is no run a resume closes.
        check_input(loaded.manifest, path, job_name="the job file", run_id=loaded.path.name,
                    fmt=plan.format)
        # Whole lines only: a resume repairs a torn last line away, and runs its item again.
        done = DigestSet(id_digest(i) for sub in ("results", "dead")
                         for f in sorted((loaded.path / sub).glob("*.jsonl"))
                         for i in line_ids(f, whole_only=True, bad=[]))
        done.update(id_digest(i) for i in set_aside_lines(loaded.path, []))
        reader = InputReader(path, plan)
        try:
            return all(isinstance(entry, Reject) or id_digest(entry["id"]) in done
                       for entry in reader)
        finally:
            reader.close()
    except (ShardrunError, OSError):
        return False


def _work_left(loaded: LoadedRun) -> str:
    """What a finished run has not done yet, and the command that does it: items no pass has
    run (`--resume`), and dead letters a retry pass set aside but did not reach (`retry-failed`:
    to `--resume` they are finished items)."""
    # A --limit pass, or one stopped, is finished, not done, unless an earlier pass read the
    # whole input it found (then what it left is only the dead letters it did not retry, below).
    summary = newest_summary(loaded.manifest)
    work = work_left(summary, read_before=newest_read_before(loaded.manifest))
    left = ""
    line = summary.get("read_to_line")
    if work.unread and isinstance(line, int) and not work.not_reached:
        passed = f" (and the {work.left_out:,} it passed over)" if work.left_out else ""
        left += (f"; its last pass retried dead letters only and read no line after the last "
                 f"of them (line {line:,}): --resume runs the items no pass has run{passed}")
    elif work.unread:
        left += ("; its last pass did not read the input to its end (--limit, or a stop): "
                 "the items after it have not run, --resume runs them")
    elif work.left_out:
        left += (f"; {work.left_out:,} input items no pass has run (its last pass retried "
                 "dead letters only): --resume runs them")
    elif work.unfinished:
        left += (f"; {work.unfinished:,} items its last pass took were not finished (a stop): "
                 "--resume runs them")
    if work.unretried:
        # Each once: the ones it took and did not end are no unreached ones.
        where = f"dead/unretried-r{len(loaded.manifest.get('resumes') or [])}.jsonl"
        if not work.put_back:
            left += (f"; {work.not_reached:,} dead letters its last pass set aside to retry were "
                     f"not reached (--limit, or a stop; {where})")
        elif not work.not_reached:
            left += (f"; {work.put_back:,} dead letters its last pass took to retry were not "
                     f"finished (a stop; back in {where})")
        else:
            left += (f"; {work.not_reached:,} dead letters its last pass set aside to retry were "
                     f"not reached, and {work.put_back:,} it took were not finished (a stop; "
                     f"all back in {where})")
        left += f": {_retry_command(loaded)} runs them"
    return left


def _retry_command(loaded: LoadedRun) -> str:
    return retry_failed_command(loaded.path, loaded.manifest)


def _alive(s: ShardSummary) -> bool:
    if s.pid is None or s.host != socket.gethostname():
        return False
    try:
        os.kill(s.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list(shards: list[str]) -> str:
    return ", ".join(str(s) for s in shards)

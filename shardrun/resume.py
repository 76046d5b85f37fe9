"""Continuing a run in its own directory: find it, lock it, repair it, learn what is done.

Exactly-once across passes rests on four things: every process that writes into a run holds a
shared lock on `<run>/.lock` and a new pass takes it exclusively first (so it waits for the
shards of a killed coordinator to finish their grace period), holding `<run>/.pass.lock`
exclusively meanwhile and for its life (`RunLock`); torn last lines are cut; the ids
in the results and dead-letter files are the set of finished items; and a pass names items as
the run's first did (`ITEM_NAMING`, compared by `setting_changes`).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from shardrun._urls import masked_setting
from shardrun.digestset import DigestSet
from shardrun.errors import InputError, RunError, SpecError
from shardrun.manifest import (
    LATEST,
    STAGING,
    changed_results,
    fsync_dir,
    newest_job_path,
    pass_inputs,
    pass_reads,
    prefix_digests,
    run_on,
    write_atomic,
)
from shardrun.recovery import line_ids, repair_run_files
from shardrun.worksource import id_digest

LOCK_WAIT_S = 60.0
ITEM_NAMING = ("input.id_field",)
"""Settings a resume must keep: they say which item a line is, so a change would run every item
again under another id."""
ANSWER_SHAPING = ("endpoint.api", "endpoint.model", "endpoint.sim", "params", "input.prompt_field",
                  "input.messages_field", "input.template", "input.system_prompt")  # fmt: skip
"""Settings whose change makes a pass's answers differ from the earlier passes' (a resume warns
and records it)."""


def setting_changes(started: object, now: dict[str, dict[str, object]],
                    keys: tuple[str, ...]) -> list[tuple[str, Any, Any]]:  # fmt: skip
    """(key, value when the run started, value now) for each of `keys` whose effective value
    differs. `started` is the manifest's `effective` record; a key it lacks (a run started by an
    older version) is not compared. Params and a simulator key an older version recorded
    unmasked are masked as `effective` masks them now, so a key is neither a change nor printed."""
    changes = []
    for key in keys:
        entry = started.get(key) if isinstance(started, dict) else None
        if not isinstance(entry, dict) or "value" not in entry:
            continue
        value = orjson.loads(orjson.dumps(now[key]["value"]))  # as the manifest holds it
        old = masked_setting(key, entry["value"])
        if value != old:
            changes.append((key, old, value))
    return changes


def check_input(manifest: dict[str, Any], input_path: Path, *, job_name: str,
                run_id: str, fmt: str) -> list[str]:  # fmt: skip
    """Refuse (SpecError) a resume whose input is not the one the run read; return warnings
    where the manifest does not record enough to tell.

    Every pass that ended recorded the SHA-256 of the input's first `bytes_read` bytes, which
    hold each line it used; the file must still start with those bytes (one read, up to the
    longest), or answers already in the run would sit next to other lines. Lines added after
    them are the rest of the work, as everywhere a run reads its input again (export too),
    unless they run on from a last line the pass read without a line break (`run_on`).
    Another `input.path` is refused unless such a digest shows it holds the same bytes (a
    project copied or moved). A pass killed before it ended recorded only the file's size and
    modification time at its start; a pass that ended later was checked against them then.
    """
    passes = pass_inputs(manifest)
    paths = [rec["path"] for _, rec in passes if rec and isinstance(rec.get("path"), str)]
    # The newest pass's: an earlier resume may have gone on with a copy (the same bytes), and
    # that copy is then the file to restore, not the one the run first read.
    read = paths[-1] if paths else None
    moved = read is not None and Path(read) != input_path
    ended = pass_reads(manifest)
    if ended:
        try:
            got = prefix_digests(input_path, [size for _, _, size, _ in ended])
        except OSError as exc:
            raise InputError(f"cannot read input file {input_path}: {exc.strerror}") from None
        for _, name, size, sha in ended:
            if got[size] == sha:
                continue
            if moved:
                raise SpecError(
                    f"input.path names {input_path} in {job_name}, but run {run_id} read "
                    f"{read}, and {input_path} does not start with the {size:,} bytes {name} "
                    "read: a resume must read the run's input, or answers already in the run "
                    "would sit next to other lines; set input.path back, or start a new run "
                    "without --resume")
            why = "another SHA-256" if got[size] else "the file is shorter now"
            raise SpecError(
                f"the input {input_path} is not what run {run_id} read: its first {size:,} "
                f"bytes differ from those {name} read ({why}), so answers already in the run "
                "would sit next to other lines; restore the file as the run read it (lines "
                "added at its end are fine), or start a new run without --resume")
        if (joined := run_on(manifest, input_path, fmt)) is not None:
            raise SpecError(
                f"the input {input_path} grew in a way run {run_id} cannot go on with: "
                f"{joined.why}, so the items added would never run; {joined.fix}, "
                f"{'or start a new run without --resume' if joined.quote else 'then resume again'}")
    elif moved:
        raise SpecError(
            f"input.path names {input_path} in {job_name}, but run {run_id} read {read}, and "
            "no pass of the run ended to record the bytes it read, so nothing shows the two "
            "files hold the same lines; set input.path back, or start a new run without --resume")
    warnings = []
    if moved:
        size = max(size for _, _, size, _ in ended)
        warnings.append(f"input.path names {input_path}, but run {run_id} read {read}; it "
                        f"starts with the same {size:,} bytes, so the resume goes on with it")
    try:
        stat = input_path.stat()
        now: tuple[object, object] | None = (stat.st_size, stat.st_mtime_ns)
    except OSError:
        now = None
    after = ended[-1][0] + 1 if ended else 0
    for name, rec in passes[after:]:
        if rec is None or "mtime_ns" not in rec:
            warnings.append(f"{name} of run {run_id} recorded nothing of its input (a run of "
                            "an older shardrun, killed before that pass ended), so this resume "
                            f"cannot check that {input_path} still holds the lines it did")
        elif moved or now != (rec.get("bytes"), rec["mtime_ns"]):
            since = "is another file than it read" if moved else "was modified since it started"
            warnings.append(f"{name} of run {run_id} did not end, so it never recorded the "
                            f"bytes it read, and {input_path} {since}: this resume cannot check "
                            "that the lines it did are unchanged")
    return warnings


def check_results(manifest: dict[str, Any], run_path: Path, run_id: str) -> list[str]:
    """Warnings for result files the manifest lists that are gone or another size now.

    No pass writes to a file an ended pass listed, so any difference is a hand's: lines
    removed mean their items run again in this resume (and are paid for again). A warning, not
    a refusal: redoing some answers on purpose is a way to use a resume.
    """
    return [f"{path} of run {run_id} {_now(size)} where the run's last pass to end wrote "
            f"{listed:,}: items whose answers are no longer in it run again in this resume, "
            "and are paid for again" for path, listed, size in changed_results(manifest, run_path)]


def _now(size: int | None) -> str:
    return "is missing" if size is None else f"holds {size:,} bytes"


PASS_LOCK = ".pass.lock"
"""A pass holds it exclusively for its life, beside its shared hold on `.lock`."""


@dataclass
class RunLock:
    """A pass's hold on its run: `gate` (PASS_LOCK) exclusively, so that no other pass can
    begin while it lives, and `held` (`.lock`) shared, as its shards hold it.

    `held` alone would not do: a flock conversion is not atomic (Linux drops the old lock,
    then takes the new one), so while `alone_in_run` converts it, a pass starting in that
    moment could take `.lock` exclusively. The gate keeps it waiting all the same."""

    gate: IO[bytes]
    held: IO[bytes]

    def close(self) -> None:
        self.held.close()
        self.gate.close()


def lock_run(run_path: Path, *, wait_s: float = LOCK_WAIT_S) -> RunLock:
    """Take the run for a pass: its gate exclusively (waiting for another pass), then `.lock`
    exclusively (waiting for older writers: the shards of a killed pass), then share that."""
    deadline = time.monotonic() + wait_s
    gate = open(run_path / PASS_LOCK, "ab")  # noqa: SIM115 - held for the life of the pass
    try:
        # The gate is a live pass's alone (shards do not inherit it): a user who started a
        # resume or `retry-failed` on a run still going is told so, not of earlier processes.
        told = _take(gate, run_path, deadline, told=False, waiting=_in_progress(run_path, wait_s))
        held = open(run_path / ".lock", "ab")  # noqa: SIM115 - held for the life of the pass
        try:
            _take(held, run_path, deadline, told=told,
                  waiting=f"waiting for earlier processes of run {run_path.name} to exit")
        except BaseException:
            held.close()
            raise
    except BaseException:
        gate.close()
        raise
    fcntl.flock(held, fcntl.LOCK_SH)
    return RunLock(gate, held)


def _in_progress(run_path: Path, wait_s: float) -> str:
    return (f"run {run_path.name} has a pass in progress: waiting for it to end, {wait_s:g} s "
            "at the most (Ctrl-C stops the wait, with nothing sent)")


def await_first_pass(run_path: Path, *, wait_s: float = LOCK_WAIT_S) -> None:
    """Wait for the first pass of a run that holds its gate but has not written its manifest
    yet (its first instant), as `lock_run` waits for a pass whose manifest exists: a resume or
    `retry-failed` started then would else call the run no run at all. Once it ends, its
    manifest is there, or it was stopped first and the directory is gone or never begun."""
    if (run_path / "manifest.json").exists() or not pass_lives(run_path):
        return
    try:
        # Read-only: opening to write would make the gate again in a directory that a first
        # pass stopped before its manifest is removing.
        gate = open(run_path / PASS_LOCK, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return  # removed meanwhile: the caller says there is no run there
    with gate:
        _take(gate, run_path, time.monotonic() + wait_s, told=False,
              waiting=_in_progress(run_path, wait_s))


def _take(handle: IO[bytes], run_path: Path, deadline: float, *, told: bool,
          waiting: str) -> bool:
    """Lock `handle` exclusively, waiting until `deadline`; whether the wait has been said
    (`waiting`, once, on the first miss)."""
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return told
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise SpecError(
                    f"run {run_path.name} is in use by another shardrun process (a run or "
                    "shards still finishing); wait for it to end, then try again"
                ) from None
            if not told:
                print(waiting, file=sys.stderr, flush=True)
                told = True
            time.sleep(0.2)


def alone_in_run(lock: RunLock) -> bool:
    """Whether no other process holds the run's lock beside this pass (its shards have all
    exited); the hold is shared again either way. Linux drops a shared lock while converting
    it, so it is taken again rather than assumed kept, and no other pass can take the run in
    that moment: this one holds its gate (`RunLock`)."""
    try:
        fcntl.flock(lock.held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        alone = True
    except BlockingIOError:
        alone = False
    fcntl.flock(lock.held, fcntl.LOCK_SH)
    return alone


def in_use(run_path: Path) -> bool | None:
    """Whether a process of the run holds its locks: a pass (its gate, PASS_LOCK, which it
    holds for its whole life) or its shards (`.lock`) are still at work; None where that
    cannot be told (no lock file, no access to it).

    `.lock` alone would not do: while `alone_in_run` converts a pass's hold on it, no process
    holds it for a moment, and a live pass would read as gone (`report`: crashed)."""
    if pass_lives(run_path):
        return True
    return _held(run_path / ".lock")


def pass_lives(run_path: Path) -> bool:
    """Whether a pass of the run is alive: it holds the run's gate (PASS_LOCK), which it takes
    first and lets go last. False for a run of an older shardrun, which has none."""
    return _held(run_path / PASS_LOCK) is True


def _held(path: Path) -> bool | None:
    """Whether a process holds the lock file `path` (None: it cannot be opened). Probed by
    taking it and letting go at once: a pass about to start waits for it that moment."""
    try:
        with open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except OSError:
        return None


def share_lock(run_path: Path) -> IO[bytes]:
    """A shard's shared hold on the run (blocks while a new pass is taking over)."""
    handle = open(run_path / ".lock", "ab")  # noqa: SIM115 - held until the shard exits
    fcntl.flock(handle, fcntl.LOCK_SH)
    return handle


def find_run(runs_dir: Path, ref: str, job_path: Path | None = None, *,
             wait_s: float = LOCK_WAIT_S) -> Path:  # fmt: skip
    """The run directory named by `--resume`: a run id, or `latest`.

    `latest` is the newest run whose newest pass ran `job_path`, where one did: a runs
    directory shared by several jobs must not resume another job's run. Else the newest run
    of all (a job fixed in a new file resumes the run it fixes; the resume's checks and
    warnings say what differs). A run whose first pass is starting is waited for
    (`_await_starting`): it is the newest, but whose it is only its manifest says."""
    if ref == LATEST and runs_dir.is_dir():
        _await_starting(runs_dir, wait_s)
    runs = [p for p in runs_dir.iterdir() if (p / "manifest.json").is_file()] if (
        runs_dir.is_dir()) else []
    elsewhere = ("; a run made in another runs directory is resumed with the --runs-dir (or "
                 "SHARDRUN_RUNS_DIR) that made it")
    if ref == LATEST:
        begun = leftovers(runs_dir) if runs_dir.is_dir() else []
        if not runs:
            if begun:
                raise SpecError(f"--resume latest: there is no run in {runs_dir} to resume: "
                                f"{unbegun(begun[-1])}; remove it, and run the job again "
                                "without --resume")
            raise SpecError(f"--resume latest: there is no run in {runs_dir}{elsewhere}")
        own = [p for p in runs if job_path is not None and _ran(p, job_path)]
        latest = max(own or runs, key=lambda p: (_started(p), p.name))
        if begun and _mtime(begun[-1]) > _mtime(latest / "manifest.json"):
            print(f"warning: {unbegun(begun[-1])}, so --resume latest resumes run "
                  f"{latest.name}, the newest before it; remove {begun[-1]}", file=sys.stderr)
        return latest
    path = runs_dir / ref
    await_first_pass(path)
    if never_begun(path):
        raise SpecError(f"--resume {ref}: {unbegun(path)}; remove it, and run the job again "
                        "without --resume")
    if not (path / "manifest.json").is_file():
        # By start, as `latest` orders them: a name given with --run-id says nothing of when.
        newest = sorted(runs, key=lambda p: (_started(p), p.name))[-5:]
        known = ", ".join(p.name for p in newest) or "none"
        raise SpecError(f"--resume {ref}: no run {ref!r} in {runs_dir} (recent runs: {known})"
                        f"{elsewhere}")
    return path


def _await_starting(runs_dir: Path, wait_s: float) -> None:
    """Wait until no run in `runs_dir` is in its first instant: its first pass holds its gate
    but has not written its manifest (it starts the simulator first, for sim://). Passed
    over, the previous run would be resumed in its place; taken blind, another job's run
    sharing the runs directory could be. A pass stopped then removes its directory, and one
    killed lets go of its gate: neither is starting any longer."""
    deadline = time.monotonic() + wait_s
    told = False
    # A dot-name is a run still being made (`RunDir.create_held`): it has no run id yet.
    while starting := [p for p in runs_dir.iterdir() if not p.name.startswith(".")
                       and not (p / "manifest.json").exists() and pass_lives(p)]:
        name = starting[0].name
        if time.monotonic() > deadline:
            raise SpecError(f"--resume latest: run {name} in {runs_dir} has been starting for "
                            f"{wait_s:g} s without writing its manifest, so whether it is "
                            "this job's newest run is unknown; resume a run by its id, or try "
                            "again once it has begun")
        if not told:
            print(f"run {name} is starting: waiting for its manifest, to tell whether it is "
                  f"this job's newest run, {wait_s:g} s at the most", file=sys.stderr, flush=True)
            told = True
        time.sleep(0.1)


def leftovers(runs_dir: Path) -> list[Path]:
    """The directories in `runs_dir` first passes left, stopped before their runs began
    (`never_begun`), oldest first."""
    try:
        found = [p for p in runs_dir.iterdir() if never_begun(p)]
    except OSError:
        return []
    return sorted(found, key=lambda p: (_mtime(p), p.name))


_RUN_FOLDERS = frozenset({"events", "results", "dead", "logs"})
_LOCKS = frozenset({PASS_LOCK, ".lock"})


def never_begun(path: Path) -> bool:
    """Whether `path` is a directory a first pass left, stopped (a kill -9) before its run
    began: no manifest.json, no pass alive in it (its gate, PASS_LOCK, not held), nothing in
    it but the locks and the run's empty folders, and those made (`RunDir.create_held` makes
    them with the gate held, so the gate is there) or its hidden name, `STAGING`, one of a
    process gone. Nothing was
    sent from it: a pass starts its shards only once its manifest is written. Without folders
    and with its process alive, it may be a pass's first instant, before it took its gate."""
    try:
        inside = {p.name: p for p in path.iterdir()}
        folders = _RUN_FOLDERS & set(inside)
        if not set(inside) <= _RUN_FOLDERS | _LOCKS or any(
                not inside[name].is_dir() or any(inside[name].iterdir()) for name in folders):
            return False
    except OSError:  # not a directory, or not ours to read: nothing to say of it
        return False
    if pass_lives(path):
        return False
    made = STAGING.match(path.name)
    if folders == _RUN_FOLDERS:  # made with the gate taken first: a user's folders have none
        return PASS_LOCK in inside
    return made is not None and _gone(int(made["pid"]))


def _gone(pid: int) -> bool:
    """Whether no process `pid` runs here (one of another user's runs, as far as we know)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def unbegun(path: Path) -> str:
    """What a directory `never_begun` is, said as the start of a sentence."""
    return (f"{path} is a run whose first pass was stopped before it began (it has no "
            "manifest.json; nothing was sent)")


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def latest_of_another_job(run_path: Path, job_path: Path) -> str | None:
    """The warning for a run `--resume latest` chose though its newest pass ran another job
    file than `job_path` (none of the runs did: `find_run`), else None. A job fixed in a new
    file goes on with its run; another job's run in a shared runs directory must not be taken
    on without a word, its answers mixed with this job's."""
    if _ran(run_path, job_path):
        return None
    return (f"no run in {run_path.parent} was made or last resumed with {job_path}, so "
            f"--resume latest continues the newest run, {run_path.name}, of "
            f"{_job_of(run_path) or 'an unknown job file'}; if that is not the run to "
            "continue, stop this pass and resume by run id")


def _job_of(run_path: Path) -> Path | None:
    """The job file the newest pass of the run at `run_path` ran, None where none is known."""
    try:
        return newest_job_path(orjson.loads((run_path / "manifest.json").read_bytes()))
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return None


def _ran(run_path: Path, job_path: Path) -> bool:
    """Whether the newest pass of the run at `run_path` ran the job file `job_path`."""
    ran = _job_of(run_path)
    return ran is not None and ran.resolve() == job_path.resolve()


def _started(path: Path) -> str:
    try:
        manifest = orjson.loads((path / "manifest.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return ""
    # A damaged manifest (a list, say) sorts first; resuming it says what is wrong with it.
    return str(manifest.get("started_at", "")) if isinstance(manifest, dict) else ""


@dataclass(frozen=True)
class Prior:
    """What earlier passes of a run left: finished ids (as digests) and repair notes."""

    done: DigestSet
    notes: list[str]
    retried: int
    dead: int  # dead letters earlier passes left (they stay failed unless retried)
    retried_ids: DigestSet  # the digests of the `retried` items' ids
    # Of `retried`, the dead letters whose item has a result line too (a hand edit, a bug):
    # the pass skips a finished item, so these are never run, and no stop left them.
    answered: int = 0
    # Of `dead`, likewise: left in dead/ by a pass that sets none aside, answered, no failure.
    dead_answered: int = 0


def prepare(run_path: Path, segment: int, *, retry_failed: bool) -> Prior:
    """Repair the run's files and collect finished ids; `retry_failed` sets dead letters aside."""
    notes = repair_run_files(run_path)
    # An attempt at this same pass killed before the manifest recorded it ran nothing.
    undo_set_aside(run_path, segment)
    # A retry pass that ended early (killed, so it could not do it itself) left items aside.
    restore_unretried(run_path, segment)
    retried_ids = DigestSet()
    if retry_failed:
        retried_ids.update(_set_dead_letters_aside(run_path, segment))
    done = DigestSet()
    answered = DigestSet()
    for path in sorted((run_path / "results").glob("*.jsonl")):
        ids = [id_digest(i) for i in line_ids(path)]
        done.update(ids)
        answered.update(i for i in ids if i in retried_ids)
    dead = [id_digest(i) for path in sorted((run_path / "dead").glob("*.jsonl"))
            for i in line_ids(path)]
    dead_answered = sum(1 for i in dead if i in done)  # `done` holds the results' ids only
    done.update(dead)
    return Prior(done, notes, len(retried_ids), len(dead), retried_ids, len(answered),
                 dead_answered)


def _set_dead_letters_aside(run_path: Path, segment: int) -> list[int]:
    """Move dead-letter files under dead/superseded-rK/ so their items run again; the digests
    of their ids."""
    files = sorted((run_path / "dead").glob("*.jsonl"))
    digests = [id_digest(i) for path in files for i in line_ids(path)]
    if not digests:  # empty files only: nothing to retry, nothing to move
        return []
    target = run_path / "dead" / f"superseded-r{segment}"
    target.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.move(str(path), target / path.name)
    fsync_dir(target)
    fsync_dir(run_path / "dead")
    return digests


def undo_set_aside(run_path: Path, segment: int) -> int:
    """Move the dead-letter files pass `segment` set aside back into dead/; how many moved.

    Only for a pass the manifest never recorded (stopped between setting them aside and its
    start: a simulator that would not start, a manifest it could not write, a kill): nothing
    of it ran, so the files are the dead letters as they were, and left aside they would read
    as never run (export: pending) until the next pass. A file whose name is taken in dead/
    stays aside, for the next pass's `restore_unretried` to find.
    """
    aside = run_path / "dead" / f"superseded-r{segment}"
    if not aside.is_dir():
        return 0
    moved = 0
    for path in sorted(aside.glob("*.jsonl")):
        target = run_path / "dead" / path.name
        if not target.exists():
            os.replace(path, target)
            moved += 1
    fsync_dir(run_path / "dead")
    if not any(aside.iterdir()):
        aside.rmdir()
    return moved


def restore_unretried(run_path: Path, segment: int) -> int:
    """Put back, as dead letters, the items a retry pass set aside but never ran again (it was
    stopped, killed, or given --limit); returns how many.

    Such an item has no live result or dead-letter line, only set-aside ones: without this it
    would read as never run (export: pending), and the next `retry-failed` would not find it.
    Its newest set-aside line comes back, in `dead/unretried-rK.jsonl`, written whole or not
    at all; the set-aside copies stay as history.
    """
    aside = unreached_set_aside(run_path)
    if not aside:
        return 0
    lines = []
    for path, offset in aside.values():
        with open(path, "rb") as f:
            f.seek(offset)
            lines.append(f.readline().rstrip(b"\n") + b"\n")
    target = run_path / "dead" / f"unretried-r{segment}.jsonl"
    # A full disk here must name the file, and leave no half-written one in dead/.
    write_atomic(target, lines)
    return len(lines)


def unreached_set_aside(run_path: Path) -> dict[str, tuple[Path, int]]:
    """The items retry passes set aside that no live result or dead-letter line ended: id ->
    (set-aside file, offset of its newest line there).

    After a retry pass was stopped or killed, the ones it never reached, until the next pass
    puts them back (`restore_unretried`): dead letters still, not items no pass has run.
    For a pass that holds the run: one that may be writing it reads the other way round
    (`set_aside_lines`).
    """
    since = first_set_aside_pass(run_path)
    if since is None:
        return {}
    aside = set_aside_lines(run_path)
    for sub in ("results", "dead"):
        for path in sorted((run_path / sub).glob("*.jsonl")):
            if pass_of(path) >= since:
                for item_id in line_ids(path, whole_only=True):
                    aside.pop(item_id, None)
    return aside


def set_aside_lines(run_path: Path, bad: list[str] | None = None) -> dict[str, tuple[Path, int]]:
    """Every item retry passes set aside, whether a live line has ended it since or not: id ->
    (set-aside file, offset of its newest line there). `bad`: as `recovery.line_records`.

    `report` and `export` may read a run while a retry pass writes it: they read the live
    files first and these after, and let a live line win. An item the pass reaches between
    the two reads is then still here (the set-aside copies stay), and the dead letters a
    starting pass moves aside between them were in the live read. Read the other way round,
    or with the live files read a second time to leave out what they ended, either item is
    in neither read, and would show as never run.
    """
    aside: dict[str, tuple[Path, int]] = {}  # id -> where its newest set-aside line starts
    for folder in sorted(_set_aside_dirs(run_path), key=pass_of, reverse=True):
        for path in sorted(folder.glob("*.jsonl")):
            try:
                found = _ids_at(path, bad)
            except FileNotFoundError:  # a pass that never began moved it back (undo_set_aside)
                continue
            for item_id, offset in found:
                aside.setdefault(item_id, (path, offset))
    return aside


def first_set_aside_pass(run_path: Path) -> int | None:
    """The first pass that set dead letters aside, or None. An item it set aside can only have
    ended since: files of earlier passes cannot hold it, and skipping them spares reading the
    first pass's results (millions, often)."""
    return min((pass_of(d) for d in _set_aside_dirs(run_path)), default=None)


def _set_aside_dirs(run_path: Path) -> list[Path]:
    return [d for d in (run_path / "dead").glob("superseded-r*") if d.is_dir()]


def pass_of(path: Path) -> int:
    """The pass that wrote a file: K for `shard-NN.rK.jsonl`, `unretried-rK.jsonl` and
    `superseded-rK`, 0 for the first pass's `shard-NN.jsonl`."""
    found = re.search(r"[.-]r(\d+)$", path.name.removesuffix(".jsonl"))
    return int(found.group(1)) if found else 0


def _ids_at(path: Path, bad: list[str] | None = None) -> list[tuple[str, int]]:
    """(id, byte offset) of every line of a set-aside dead-letter file; `bad`: as
    `recovery.line_records`."""
    found, offset = [], 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    found.append((str(orjson.loads(line)["id"]), offset))
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    if bad is None:
                        raise RunError(f"{path}: a line at byte {offset:,} is not a valid "
                                       "record; the run directory was edited or damaged"
                                       ) from None
                    bad.append(f"{path} line {number}")
            offset += len(line)
    return found

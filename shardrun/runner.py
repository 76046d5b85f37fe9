"""`run()`: the library entry point behind `shardrun run`, `--resume` and `retry-failed`.

Loads the job, opens (or resumes) the run directory, starts the embedded simulator for `sim://`
(as its own process, so the client and the server never share an event loop), runs the
coordinator on uvloop and stops the simulator again, whatever happened.
"""

from __future__ import annotations

import asyncio
import functools
import shlex
import shutil
import signal
import sys
import threading
from argparse import ArgumentTypeError
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from shardrun import resume
from shardrun._ellipsis import ellipsize
from shardrun._env import ENV_BY_KEY
from shardrun.argtypes import ITEMS_TO_RUN, progress_seconds
from shardrun.coordinator import Coordinator
from shardrun.digestset import DigestSet
from shardrun.errors import (
    CONTINUE,
    CONTINUE_RETRYING,
    InputCut,
    InputError,
    RunError,
    ShardrunError,
    SpecError,
    continue_with,
    fix_for_write,
    run_dir_gone,
    stopped_writing,
)
from shardrun.inputs import InputReader, Reject, holds_more, make_reader
from shardrun.manifest import (
    LATEST,
    RunDir,
    finish_manifest,
    input_read_whole,
    new_run_id,
    newest_job_path,
    read_manifest,
    resume_manifest,
    start_manifest,
)
from shardrun.placement import exit_description
from shardrun.preflight import check_runs_dir, preflight
from shardrun.pricing import cost
from shardrun.progress import ProgressView, estimate_total
from shardrun.proxy import Proxy
from shardrun.shard_config import ShardConfig
from shardrun.spec import LoadedJob, load_job
from shardrun.summary import RunSummary
from shardrun.worksource import WorkSource, duplicate_reason, id_digest

if TYPE_CHECKING:
    from shardrun.sim.launcher import SimProcess

T = TypeVar("T")


class NothingToRetry(Exception):
    """`retry-failed` of a run without dead letters: said in one line, no pass started."""


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How to run, beyond the job file: CLI choices that are not job settings."""

    run_id: str | None = None
    resume: str | None = None
    retry_failed: bool = False
    # With retry_failed: run the dead-lettered items only, leaving items never run for
    # --resume (`shardrun retry-failed`); without it the pass also finishes the input.
    only_failed: bool = False
    strict: bool = False
    quiet: bool = False
    progress_interval: float = 10.0
    limit: int | None = None  # at most this many new items in this pass (--limit)

    def __post_init__(self) -> None:
        # `--limit`'s own check, so that an API caller's `limit=0` is told as the CLI's is.
        # The rule reads text: a str limit goes in quoted, or its `"5"` would pass as a 5.
        if self.limit is not None:
            try:
                ITEMS_TO_RUN(str(self.limit) if isinstance(self.limit, int) else repr(self.limit))
            except ArgumentTypeError as bad:
                raise ValueError(f"RunOptions limit {bad}") from None
        try:  # `--progress-interval`'s own floor, for an API caller too
            progress_seconds(repr(self.progress_interval))
        except ArgumentTypeError as bad:
            raise ValueError(f"RunOptions progress_interval {bad}") from None


@dataclass(frozen=True)
class Endpoint:
    """Where this pass sends requests: the URL (the simulator's, for sim://), key and proxy."""

    base_url: str
    api_key: str | None
    proxy: Proxy | None
    # Why it can never answer again, once that is so (see `_sim_ended`); None while it may.
    gone: Callable[[], str | None] | None = None


@dataclass
class Pass:
    """One pass over a run directory: a fresh run or a resume."""

    run_dir: RunDir
    segment: int
    done: DigestSet
    info: dict[str, Any]
    lock: resume.RunLock
    prior_dead: int = 0
    only: DigestSet | None = None  # run these items only (`retry-failed`: its dead letters)
    judged_lines: int = 0  # input lines whose rejects an earlier pass has recorded
    # An earlier pass read the whole input this one sees (`input_read_whole`).
    read_before: bool = False
    recorded: bool = False  # the manifest holds this pass (from then on, it is a pass of the run)
    # How this pass's stops end their sentence, and those that also dead-lettered items
    # (`choose_way_on`; the defaults are `ShardConfig`'s).
    way_on: str = CONTINUE
    way_on_retrying: str = CONTINUE_RETRYING
    retried: DigestSet | None = None  # the dead letters a retry pass set aside, to run again
    # Lines past those whose rejects a pass killed before it ended wrote (`_killed_rejects`).
    killed_rejects: DigestSet | None = None
    stops: HeldStops | None = None  # the stops `_hold_stops` held, if it did


_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class HeldStops:
    """The handlers `_hold_stops` replaced, and the stops that came meanwhile."""

    handlers: dict[signal.Signals, Any]
    came: list[int]


def _hold_stops() -> HeldStops:
    """Keep a Ctrl-C, SIGTERM or SIGHUP pending while a first pass makes its run directory
    and hands it to the clean-up that owns it: raised between two statements there, a stop
    left the directory without a manifest. Their Python handlers are replaced by one that
    notes the signal, not a blocked mask: a mask is one thread's, and with another thread in
    the process (an embedding program's) the stop went to it, and was raised here at once.
    Only the main thread's are replaced; a stop never raises in another."""
    held = HeldStops({}, [])
    if threading.current_thread() is not threading.main_thread():
        return held
    for sig in _STOPS:
        handler = signal.getsignal(sig)
        if callable(handler):  # not SIG_DFL nor SIG_IGN: nothing to raise here
            held.handlers[sig] = handler
            signal.signal(sig, lambda signum, frame: held.came.append(signum))
    return held


def _let_stops(held: HeldStops) -> None:
    """Put back the handlers `_hold_stops` replaced: a stop held meanwhile is raised now."""
    try:
        for sig, handler in held.handlers.items():
            signal.signal(sig, handler)
    finally:  # a stop raised by one put back, before the others are: put them back too
        for sig, handler in held.handlers.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
    for signum in held.came[:1]:  # the first: one stop, as if it came now
        held.handlers[signal.Signals(signum)](signum, None)


def run(
    job_path: Path,
    *,
    env: Mapping[str, str],
    flags: Mapping[str, object],
    options: RunOptions,
    argv: list[str],
) -> RunSummary:
    """Run (or resume) a job file to the end and return the summary of this pass."""
    if options.only_failed:
        job = _job_of_retry(job_path, env, flags)
    else:
        job = load_job(job_path, env=env, flags=flags)
    for warning in job.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    # The same checks as `validate`, for the shards this pass starts.
    checked = preflight(job, env, shards_started(job.spec.shards, options.limit))
    api_key, sim_config, proxy = checked.api_key, checked.sim_config, checked.proxy
    reader = make_reader(job)  # a missing input fails before any run directory exists
    if options.strict:
        check_strictly(make_reader(job))
    sim: SimProcess | None = None
    base_url = job.spec.endpoint.base_url
    # A first pass's comes with stops held (`_hold_stops`): one landing before the try would
    # skip the clean-up, and leave a run directory without a manifest.
    this = _open_pass(job, options)
    try:
        if this.stops is not None:
            _let_stops(this.stops)  # a stop held until now is raised here, owned
        if sim_config is not None:
            from shardrun.sim.launcher import start_sim

            # Each pass its own draws: with the seed of the first, a new simulator process would
            # fault the same requests again, and retry-failed could never succeed on it.
            try:
                sim = start_sim(replace(sim_config, seed=sim_config.seed + this.segment))
            except RunError as exc:
                raise RunError(_no_simulator(exc, this)) from None
            base_url = sim.base_url
        gone = None if sim is None else functools.partial(_sim_ended, sim, this.way_on)
        return _run_pass(job, this, reader, Endpoint(base_url, api_key, proxy, gone), argv,
                         options)
    except OSError as exc:  # a file of the pass (the simulator's start...): one sentence
        said = _said(exc, this.way_on if _leaves_a_run(this) else "run the same command again")
        if said is exc:
            raise
        raise said from None
    finally:
        if sim is not None:
            sim.stop()
        if this.segment > 0 and not this.recorded:
            # Under the lock still: no other pass may be preparing.
            _undo_unrecorded(this.run_dir.path, this.segment)
        if not _leaves_a_run(this):
            # Stopped before the run began (an early Ctrl-C, a simulator that would not start):
            # there is nothing to keep, and a directory without a manifest is no run to
            # resume or report on, yet would refuse its --run-id. Removed under the gate, so
            # that no resume finds it there, not held, and calls it a run never begun.
            shutil.rmtree(this.run_dir.path, ignore_errors=True)
        this.lock.close()


def _no_simulator(exc: RunError, this: Pass) -> str:
    """The simulator a sim:// pass starts would not start (`start_sim` says why): the pass
    stopped before any request, so its way on is as a stop's before it began."""
    way_on = this.way_on if _leaves_a_run(this) else "run the same command again"
    return (f"{exc}; the pass stopped before any request: fix what stopped the simulator, "
            f"then {way_on}")


def _undo_unrecorded(run_path: Path, segment: int) -> None:
    """A resume stopped before the manifest recorded it (the simulator would not start, the
    manifest could not be written, a Ctrl-C): put back the dead letters it set aside, so that
    `report` and `export` do not count them as never run. An error here is said, not raised:
    the one that stopped the pass is the one to see, and the next pass puts them back too."""
    try:
        resume.undo_set_aside(run_path, segment)
    except OSError as exc:
        print(f"warning: cannot put back the dead letters this pass set aside in "
              f"{exc.filename or run_path / 'dead'} ({exc.strerror or exc}); the next "
              "pass of the run puts them back", file=sys.stderr)


def _leaves_a_run(this: Pass) -> bool:
    """Whether a stop of this pass leaves a run to continue: a first pass stopped before its
    manifest exists leaves none (`run` removes its directory)."""
    return this.segment > 0 or (this.run_dir.path / "manifest.json").exists()


def _put_back_unreached(this: Pass, stopped: BaseException) -> None:
    """A retry pass that failed (its shards kept dying): put back the dead letters it set aside
    and did not reach, as its normal end does, or `report` and `export` would count them as
    never run until the next pass. Only once no shard of it holds the run any more: one that
    outlived the failure could still write a result for an item put back. Else, and on an
    error here, the next pass puts them back, under its own exclusive lock. An error the
    same as `stopped` (the put-back at the pass's end failed) is not said twice."""
    try:
        if resume.alone_in_run(this.lock):
            resume.restore_unretried(this.run_dir.path, this.segment)
    except (OSError, RunError) as exc:
        if (isinstance(exc, OSError) and isinstance(stopped, OSError)
                and (exc.errno, exc.filename) == (stopped.errno, stopped.filename)):
            return  # the pass's own error sentence names this file
        print(f"warning: cannot put back the dead letters this pass did not reach ({exc}); "
              "the next pass of the run puts them back", file=sys.stderr)


def _sim_ended(sim: SimProcess, way_on: str) -> str | None:
    """Why the simulator this run started can never answer again: it has exited (no one else
    restarts it, and a new one would listen on another port)."""
    code = sim.returncode
    if code is None:
        return None
    said = sim.stderr_tail(500).splitlines()[-1:]
    last = f"; its stderr ends with: {ellipsize(said[0], 200)}" if said else ""
    return (f"the simulator this run started for sim:// ended mid-run ({exit_description(code)}"
            f"{last}), so nothing can answer the items left; they are unfinished, not failed: "
            f"{way_on}, which starts a new simulator")


def _job_of_retry(job_path: Path, env: Mapping[str, str],
                  flags: Mapping[str, object]) -> LoadedJob:
    """`retry-failed`'s job, in the run's directory (the --runs-dir it passes, which no user
    gave: so a SHARDRUN_RUNS_DIR set elsewhere is left out, else a warning told the user to
    leave out a flag never typed); as the job file, the environment or the default give its
    runs directory where that is the run's, so the printed way on names --runs-dir only where
    it is needed (`resume_command`)."""
    runs_dir_var = ENV_BY_KEY["runs_dir"].name
    job = load_job(job_path, env={k: v for k, v in env.items() if k != runs_dir_var},
                   flags=flags)
    try:
        unflagged = load_job(job_path, env=env, flags={**flags, "runs_dir": None})
    except SpecError:  # the job's own runs_dir is unusable: the run's directory stands
        return job
    same = unflagged.runs_path.resolve() == job.runs_path.resolve()
    return unflagged if same else job



def _open_pass(job: LoadedJob, options: RunOptions) -> Pass:
    if options.resume is None:
        if options.retry_failed:
            raise SpecError("--retry-failed goes with --resume RUN_ID (or use `shardrun "
                            "retry-failed RUN_DIR`)")
        check_runs_dir(job)  # in the words `validate` uses for it
        stops = _hold_stops()  # let go in `run`'s try, whose clean-up owns the directory then
        try:
            # Its gate taken before the directory has its name (`RunDir.create_held`).
            run_dir, lock = RunDir.create_held(job.runs_path, options.run_id or new_run_id(),
                                               resume.lock_run)
        except SpecError as exc:
            _let_stops(stops)
            source = job.sources.get("runs_dir", "default")
            if source == "default" or not str(exc).startswith("cannot create"):
                raise
            raise SpecError(f"{exc} (runs_dir from {source})") from None
        except BaseException:
            _let_stops(stops)
            raise
        try:
            way_on, retrying = choose_way_on(job, run_dir, options, read_before=False)
            return Pass(run_dir, 0, DigestSet(), {}, lock, way_on=way_on,
                        way_on_retrying=retrying, stops=stops)
        except BaseException:
            # An error before `run` holds the pass: no run without a manifest may be left
            # behind (`run`'s own clean-up needs the pass it returns).
            shutil.rmtree(run_dir.path, ignore_errors=True)
            lock.close()  # after: a resume waiting for it then finds no directory, no run
            _let_stops(stops)
            raise
    run_dir = RunDir.existing(resume.find_run(job.runs_path, options.resume, job.job_path))
    lock = resume.lock_run(run_dir.path)
    segment: int | None = None  # known once the manifest is read
    try:
        manifest = read_manifest(run_dir.path)
        if isinstance(manifest.get("run_id"), str):  # a pass of a run renamed since logs as it
            run_dir = replace(run_dir, logged_id=manifest["run_id"])
        changes = _check_settings(job, manifest, run_dir.run_id)
        # Before the run is repaired or a request sent: the answers on disk belong to the lines
        # the run read, so another or an edited input would pair them with other lines.
        unchecked = resume.check_input(manifest, job.input_path, run_id=run_dir.run_id,
                                       job_name=str(job.origin or job.job_path),
                                       fmt=job.spec.input.format)
        results_changed = resume.check_results(manifest, run_dir.path, run_dir.run_id)
        segment = len(manifest.get("resumes", [])) + 1
        prior = resume.prepare(run_dir.path, segment, retry_failed=options.retry_failed)
        for note in prior.notes:
            print(f"repaired: {note}", file=sys.stderr)
        only_failed = options.retry_failed and options.only_failed
        if only_failed and not prior.retried:
            raise NothingToRetry(f"run {run_dir.run_id} has no dead letters: nothing to retry "
                                 f"({resume_command(job, run_dir)} runs the items no pass has "
                                 "run, if any)")
        # Once the pass is let through: a refusal says what is wrong in one sentence, and a
        # retry with nothing to retry warns of no pass.
        chosen = (resume.latest_of_another_job(run_dir.path, job.job_path)
                  if options.resume == LATEST else None)
        for warning in [*filter(None, [chosen]), *_changes_said(job, changes, run_dir.run_id),
                        *unchecked, *results_changed]:
            print(f"warning: {warning}", file=sys.stderr)
        changed = [key for key, _, _ in changes]
        # Lines appended since the pass that read the input whole are items no pass has run.
        read_before = input_read_whole(manifest, more_after=functools.partial(
            holds_more, job.input_path, fmt=job.spec.input.format))
        way_on, retrying = choose_way_on(job, run_dir, options, read_before)
        info = {"segment": segment, "retry_failed": options.retry_failed,
                "only_failed": only_failed, "input_read_before": read_before,
                # So that `report` on this pass, crashed, names the retry as its way on does.
                "carried_flags": carried_flags(job),
                "repaired": prior.notes, "dead_letters_retried": prior.retried,
                "dead_letters_answered": prior.answered,
                "earlier_dead_answered": prior.dead_answered,
                "already_done": len(prior.done), "answer_settings_changed": changed,
                "input_unchecked": unchecked, "results_changed": results_changed}
        # Lines an earlier pass read were judged then: their rejects are on record already.
        judged = _lines_read_before(manifest)
        # Dead letters of answered items are no failures: as `report` and retry-failed count.
        return Pass(run_dir, segment, prior.done, info, lock, prior.dead - prior.dead_answered,
                    prior.retried_ids if only_failed else None, judged,
                    read_before, way_on=way_on, way_on_retrying=retrying,
                    retried=prior.retried_ids if options.retry_failed else None,
                    killed_rejects=_killed_rejects(run_dir, manifest, judged))
    except BaseException:
        # A stop (Ctrl-C, SIGTERM) or an error before `run` holds the pass: the run stays
        # (earlier passes' work is in it), but the dead letters this pass set aside go back,
        # under the lock still (`run`'s own clean-up needs the pass this returns).
        if segment is not None:
            _undo_unrecorded(run_dir.path, segment)
        lock.close()
        raise


def choose_way_on(job: LoadedJob, run_dir: RunDir, options: RunOptions,
                  read_before: bool) -> tuple[str, str]:
    """What continues the run once this pass stops, chosen once, before it starts: every
    sentence of a stop (a shard's, the coordinator's, a write that failed) ends with it. It is
    a command in full (the run's id, its runs directory, the pass's flags), since an error
    ends the command with no summary after it to say more. The second is the way on of a stop
    that also dead-lettered items, which `--resume` would leave failed.

    A retry pass puts the dead letters it did not reach back in dead/, where `--resume` does
    not look (they are finished items to it): its way on is the retry's command, if that is
    all it leaves. `--resume --retry-failed` of a run whose input no pass read whole also runs
    the input, which `retry-failed` never does: its way on is `--resume`, as its summary's
    "to finish the run" and `report` say (`summary.work_left`), and they name the retry for
    the dead letters it did not reach."""
    if options.retry_failed and (options.only_failed or read_before):
        retry = continue_with(retry_command(job, run_dir))
        return retry, retry  # the retry's own command retries them anyway
    retrying = resume_command(job, run_dir, retry_failed=True)
    return (continue_with(resume_command(job, run_dir)),
            f"{continue_with(retrying)} (which also gives the items dead-lettered so far "
            "another pass)")


def _lines_read_before(manifest: dict[str, Any]) -> int:
    """The most input lines a finished earlier pass judged (a killed one recorded none).

    A pass of dead letters only reads every line but records no reject (`record_rejects`):
    its lines are not on record, so a later pass must judge them."""
    passes = [manifest, *(r for r in manifest.get("resumes") or []
                          if isinstance(r, dict) and r.get("only_failed") is not True)]
    counts = [p["input"].get("lines_read") for p in passes if isinstance(p.get("input"), dict)]
    return max((n for n in counts if isinstance(n, int)), default=0)


def _rejects_past(this: Pass, source: WorkSource) -> int:
    """The input lines earlier passes rejected after the line a retry pass stopped reading at
    (`WorkSource.rest_unread`), from their rejects files, each once: it counts them as a pass
    reading to the end does (`prior_rejects`), so its status stays the run's (a run with a
    rejected line has not succeeded), for lines it never read."""
    if not source.rest_unread:
        return 0
    past = DigestSet()
    for segment in range(this.segment):
        past.update(line for line in _recorded_reject_lines(this.run_dir, segment)
                    if line > source.reader.lines_read)
    return len(past)


def _recorded_reject_lines(run_dir: RunDir, segment: int) -> Iterator[int]:
    """The input lines pass `segment`'s rejects file records (none if it has none); a torn
    last line is no record."""
    try:
        with open(run_dir.rejects_path(segment), "rb") as f:
            for raw in f:
                try:
                    line = orjson.loads(raw).get("line")
                except (orjson.JSONDecodeError, AttributeError):
                    continue
                if isinstance(line, int):
                    yield line
    except FileNotFoundError:
        return


def _killed_rejects(run_dir: RunDir, manifest: dict[str, Any], judged: int) -> DigestSet:
    """The input lines past `judged` that a pass killed before it ended (kill -9, a crash: it
    recorded no lines read) set aside in its rejects file already. Its lines are judged again,
    and each such reject, written again, was on record twice (22 of 55 after a kill -9 at 4 s).
    A torn last line is no record: that reject is written again."""
    lines = DigestSet()
    for segment, entry in enumerate([manifest, *(manifest.get("resumes") or [])]):
        read = entry.get("input") if isinstance(entry, dict) else None
        if isinstance(read, dict) and isinstance(read.get("lines_read"), int):
            continue  # it ended: its rejects are lines up to `judged`
        lines.update(line for line in _recorded_reject_lines(run_dir, segment) if line > judged)
    return lines


def _check_settings(job: LoadedJob, manifest: dict[str, Any],
                    run_id: str) -> list[tuple[str, Any, Any]]:
    """Refuse a resume that names items otherwise than the run did; return the settings that
    make this pass's answers differ from earlier ones (key, the run's value, this pass's), for
    warnings once every check has let the resume through, and for the manifest."""
    now, started = job.effective(), manifest.get("effective")
    for key, old, new in resume.setting_changes(started, now, resume.ITEM_NAMING):
        raise SpecError(f"{key} is {_shown(new)} in {job.origin or job.job_path} but was "
                        f"{_shown(old)} when run {run_id} started: a resume must name items as "
                        "the run did, or every item would run again under another id; set it "
                        "back, or start a new run without --resume")  # fmt: skip
    return resume.setting_changes(started, now, resume.ANSWER_SHAPING)


def _changes_said(job: LoadedJob, changes: list[tuple[str, Any, Any]], run_id: str) -> list[str]:
    """A warning per answer-shaping setting changed since the run started (`_check_settings`),
    naming where the new value comes from: a model may come from SHARDRUN_MODEL."""
    said = []
    for key, old, new in changes:
        source = job.sources.get(key, "job file")
        where = f"in {job.origin or job.job_path}" if source == "job file" else f"({source})"
        said.append(f"{key} is {_shown(new)} {where} but was {_shown(old)} when run {run_id} "
                    "started, so this pass's answers may differ from the earlier ones (the "
                    "manifest, `report` and `export` say so); if that is not meant, stop this "
                    "pass and set it back")
    return said


def _shown(value: object) -> str:
    """A setting's value in a one-line message."""
    return ellipsize(orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode(), 80)


def _run_pass(job: LoadedJob, this: Pass, reader: InputReader, endpoint: Endpoint,
              argv: list[str], options: RunOptions) -> RunSummary:
    proxy = None if endpoint.proxy is None else endpoint.proxy.describe()
    spec = job.spec
    shards = shards_started(spec.shards, options.limit)
    effective = pass_effective(job, shards, options.limit)
    if this.segment == 0:
        manifest = start_manifest(job, this.run_dir, endpoint.base_url, argv, proxy,
                                  carried_flags(job), effective)
    else:
        manifest = resume_manifest(job, this.run_dir, endpoint.base_url, argv, this.info, proxy,
                                   effective)
    this.recorded = True
    source = WorkSource(reader, this.run_dir.rejects_path(this.segment), this.done,
                        options.limit, this.only, judged_lines=this.judged_lines,
                        record_rejects=this.only is None, retrying=this.retried,
                        on_record=this.killed_rejects,
                        # Results changed by hand since: their items are no dead letters, yet
                        # no pass has run them, anywhere in the input; counted, they are said.
                        read_past_only=bool(this.info.get("results_changed")))
    view = ProgressView(_left(None, this, options.limit), quiet=options.quiet,
                        interval=options.progress_interval,
                        count=_total_count(job, this, options.limit), limit=options.limit)
    coordinator = Coordinator(shard_template(job, this, endpoint), shards,
                              source, this.run_dir, view,
                              (spec.rate_limits.rpm, spec.rate_limits.tpm),
                              silence_s=spec.shard_silence_s, fork=spec.shard_start == "fork",
                              endpoint_gone=endpoint.gone)
    status = "failed"
    summary: RunSummary | None = None
    try:
        coordinator.prepare()  # forks: before the loop starts
        summary = run_loop(coordinator.run())
        # Dead letters this retry pass set aside but stopped before are dead letters still.
        unretried = (resume.restore_unretried(this.run_dir.path, this.segment)
                     if this.info.get("retry_failed") else 0)  # fmt: skip
        # Those it took and did not end are its unfinished items: not earlier failures too.
        put_back = _unfinished_put_back(summary, this, source, unretried)
        # Put back too, though their items have results: no failures, and no pass runs them.
        answered = int(this.info.get("dead_letters_answered") or 0)
        # What earlier passes finished, all of it: the work source counts only what it read
        # past, and a pass with --limit, or stopped early, reads part of the input.
        summary = replace(
            summary, segment=this.segment, skipped=len(this.done),
            prior_dead=this.prior_dead + unretried - put_back - answered,
            unretried=unretried, input_read_before=this.read_before,
            unfinished_put_back=put_back, retried=len(this.retried or ()),
            answered_dead=answered,
            prior_answered=int(this.info.get("earlier_dead_answered") or 0),
            dead_letters_only=bool(this.info.get("retry_failed")) and (
                this.only is not None or this.read_before),
            prior_rejects=source.prior_rejects + _rejects_past(this, source), cost=cost(
            spec.pricing, summary.prompt_tokens, summary.completion_tokens, summary.wall_s,
            successes=summary.succeeded, wasted_tokens=summary.wasted_tokens,
            cached_tokens=summary.cached_tokens),
            resume_command=resume_command(job, this.run_dir),
            retry_command=retry_command(job, this.run_dir))
        status = summary.status
        if spec.output.format == "openai-batch":
            from shardrun.batch_format import write_batch_files

            write_batch_files(this.run_dir.path, spec.endpoint.model, spec.endpoint.api,
                              run_id=this.run_dir.event_run_id)
    except BaseException as stopped:
        ended = _said(stopped, this.way_on)
        if this.info.get("retry_failed"):
            _put_back_unreached(this, stopped)
        try:
            finish_manifest(manifest, this.run_dir, status, reader, summary, _why(ended),
                            lines_judged=source.lines_judged)
        except OSError as exc:  # a full disk: the error that ended the pass is the one raised
            print(f"error: {_unclosed(exc, this.way_on)}", file=sys.stderr)
        if ended is stopped:
            raise
        raise ended from None
    try:
        finish_manifest(manifest, this.run_dir, status, reader, summary)
    except OSError as exc:
        # The pass has ended all the same (its processes are gone and its lock free, which
        # `report` reads): say what it did, and what could not be recorded.
        why = _unclosed(exc, this.way_on)
        if not this.run_dir.path.exists():  # no manifest is there to say anything
            why = run_dir_gone(this.run_dir.path, this.way_on)
            if summary.fatal_reason == why:  # said already: what stopped the run
                return summary
        return replace(summary, unrecorded=(*summary.unrecorded, why))
    return summary


def shards_started(shards: int, limit: int | None) -> int:
    """The shards a pass starts: the job's, but no more than `--limit` items can keep busy (a
    shard is a process with its own files, and `--shards 1024 --limit 1` would start 1,024)."""
    return shards if limit is None else min(shards, limit)


def pass_effective(job: LoadedJob, shards: int, limit: int | None) -> dict[str, Any]:
    """The job's effective values and sources as the pass's manifest records them: `shards`
    is the number started, its source why, when `--limit` held it below the job's. The way-on
    commands still carry the job's (`carried_flags`): the rest of the input is no such pass."""
    effective = job.effective()
    if shards != job.spec.shards:
        asked = f"{job.spec.shards} from {job.sources['shards']}"
        effective["shards"] = {"value": shards, "source": f"--limit {limit}: no more shards "
                                                          f"than items ({asked})"}
    return effective


def _left(total: int | None, this: Pass, limit: int | None) -> int | None:
    """The items this pass has to do, as the progress view's total, from the input's `total`
    (None: not counted yet)."""
    left = None if total is None else max(0, total - len(this.done))
    if this.only is not None:
        left = len(this.only)
    if limit is not None:
        left = limit if left is None else min(left, limit)
    return left


def _total_count(job: LoadedJob, this: Pass,
                 limit: int | None) -> Callable[[threading.Event], int | None] | None:
    """What the progress view counts, in its own thread while the run goes: the input's lines
    (a retry pass knows its items without)."""
    if this.only is not None:
        return None
    path, fmt = job.input_path, job.spec.input.format

    def count(stop: threading.Event) -> int | None:
        total = estimate_total(path, fmt, stop=stop)
        return None if total is None else _left(total, this, limit)

    return count


def _unfinished_put_back(summary: RunSummary, this: Pass, source: WorkSource,
                         unretried: int) -> int:
    """Of the items this pass took and did not end, the dead letters it retried: they are back
    in dead/ (`unretried` counts them, with those it never took), not left for --resume."""
    not_taken = len(this.retried or ()) - source.taken_retried
    return min(summary.unfinished, max(0, unretried - not_taken))


def _said(exc: BaseException, way_on: str) -> BaseException:
    """What ended a pass, as the user is to read it: a file the pass could not write or read
    (a full disk, a path in the way) becomes its one sentence, ending with the pass's way on.
    A broken pipe is our reader gone (the CLI's to handle)."""
    if isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError):
        return RunError(stopped_writing(exc, way_on))
    if isinstance(exc, InputCut):
        return RunError(f"{exc.what}; the run stopped at its last whole line: put the file back "
                        f"as it was (lines added at its end are fine), then {way_on}")
    return exc


def _why(exc: BaseException) -> str:
    """What ended a pass by an error, for its manifest record: our one sentence, else the
    exception (a Ctrl-C before the coordinator took over signals is `KeyboardInterrupt`)."""
    if isinstance(exc, ShardrunError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _unclosed(exc: OSError, way_on: str) -> str:
    """The manifest could not be written at the end of a pass: one sentence."""
    return (f"cannot write {exc.filename}: {(exc.strerror or str(exc)).lower()}, so the "
            "manifest still says the run is running, though it has ended; "
            f"{fix_for_write(exc)}, then {way_on}")


def resume_command(job: LoadedJob, run_dir: RunDir, *, retry_failed: bool = False) -> str:
    """The command that continues this run: the job file as the user named it, the runs
    directory unless the job file (or the default) gives it anyway, and the flags that set
    this pass's shards, concurrency and rate limits (pasted without them, a rate limit given
    as a flag would be dropped); with `--retry-failed` if asked."""
    words = ["shardrun", job.origin or str(job.job_path), "--resume", run_dir.run_id]
    if retry_failed:
        words.append("--retry-failed")
    if job.sources["runs_dir"] not in ("job file", "default"):
        words += ["--runs-dir", str(run_dir.path.parent)]
    return shlex.join([*words, *carried_flags(job)])


def retry_command(job: LoadedJob, run_dir: RunDir) -> str:
    """`shardrun retry-failed RUN_DIR` with the flags `resume_command` carries."""
    return shlex.join(["shardrun", "retry-failed", str(run_dir.path), *carried_flags(job)])


def carried_flags(job: LoadedJob) -> list[str]:
    """This pass's flags for shards, concurrency and rate limits, as a later pass takes them."""
    spec, words = job.spec, []
    for key, flag, value in (("shards", "--shards", spec.shards),
                             ("concurrency", "--concurrency", spec.concurrency),
                             ("rate_limits.rpm", "--rpm", spec.rate_limits.rpm),
                             ("rate_limits.tpm", "--tpm", spec.rate_limits.tpm)):  # fmt: skip
        if job.sources.get(key, "").startswith("flag "):
            words += [flag, "none" if value is None else _flag_number(value)]
    return words


def _flag_number(value: float) -> str:
    """A flag's value written back exactly (`:g` made --tpm 1234567 into 1.23457e+06)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop where it is installed, else on asyncio's default loop.

    The same as `_shard_main.run_loop`, kept apart on purpose: importing `_shard_main` imports
    the whole shard (aiohttp and its SSL set-up), which the coordinator never uses.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def shard_template(job: LoadedJob, this: Pass, endpoint: Endpoint) -> ShardConfig:
    """The configuration every shard of this pass gets (the coordinator sets `shard`)."""
    spec = job.spec
    proxy = endpoint.proxy
    return ShardConfig(
        shard=0,
        run_id=this.run_dir.event_run_id,
        out_dir=str(this.run_dir.path),
        base_url=endpoint.base_url,
        api=spec.endpoint.api,
        model=spec.endpoint.model,
        api_key=endpoint.api_key,
        api_key_env=spec.endpoint.api_key_env,
        api_key_header=spec.endpoint.api_key_header,
        headers=dict(spec.endpoint.headers),
        stream_usage=spec.endpoint.stream_usage,
        proxy=None if proxy is None else proxy.url,
        proxy_authorization=None if proxy is None else proxy.authorization,
        params=dict(spec.params),
        concurrency=spec.concurrency,
        retry=spec.retry.model_dump(),
        timeouts=spec.timeouts.model_dump(),
        grace_s=spec.shutdown_grace_s,
        fsync_interval_s=spec.fsync_interval_s,
        segment=this.segment,
        answered_before=len(this.done) > this.prior_dead,  # an earlier pass has results
        endpoint_watched=endpoint.gone is not None,
        way_on=this.way_on,
        way_on_retrying=this.way_on_retrying,
        set_outside={key: job.sources[key] for key in ("endpoint.base_url", "endpoint.model")
                     if job.sources[key].startswith(("env ", "flag "))},
    )


def check_strictly(reader: InputReader) -> None:
    """`--strict`: read the whole input first; the first bad line stops the run unsent."""
    seen = DigestSet()
    for entry in reader:
        if isinstance(entry, Reject):
            line, reason = entry.line, entry.reason
        elif not seen.add(id_digest(entry["id"])):
            line, reason = reader.line, duplicate_reason(entry["id"])
        else:
            continue
        reader.close()
        raise InputError(f"{reader.path} line {line}: {reason}; fix the line, or run without "
                         "--strict to set bad lines aside in rejects.jsonl")


def job_of_run(run_path: Path, given: Path | None = None) -> tuple[Path, Path]:
    """The job file and runs directory of an existing run (for `retry-failed RUN_DIR`): the
    file the newest pass ran, or `given` (`--job`) in its place."""
    resume.await_first_pass(run_path)
    manifest = read_manifest(run_path)
    if given is not None:
        return given, run_path.parent
    job = newest_job_path(manifest)
    if job is None or not job.is_file():
        what = f", {job}, no longer exists" if job else " is not in its manifest"
        raise SpecError(f"the job file of run {run_path.name}{what}; name it with "
                        f"`shardrun retry-failed {run_path} --job JOB.yaml`")
    return job, run_path.parent


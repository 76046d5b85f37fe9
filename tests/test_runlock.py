"""A pass's hold on its run (`resume.lock_run`): no other pass can take the run while it
lives, even in the moment `alone_in_run` converts its shared hold on `.lock`, which Linux
drops before it takes the new one, and `report` never calls it crashed in that moment. Real
processes hold the locks."""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import orjson
import pytest
from test_aggregate_fixtures import hand_shard, write_run

from shardrun import resume
from shardrun.report import load_report
from shardrun.report._rundir import load_run, run_state
from tests.conftest import (
    CLI_TIMEOUT_S,
    FAST_SIM,
    KILL_GUARD_S,
    end_run,
    only_run,
    run_cli,
    write_input,
    write_job,
)

TAKE = """
import sys
from pathlib import Path

import orjson
import pytest
from shardrun.errors import SpecError
from shardrun.resume import lock_run
try:
    lock_run(Path(sys.argv[1]), wait_s=0.5)
except SpecError as exc:
    print(exc, file=sys.stderr)
    sys.exit(1)
"""

SHARE = """
import sys
from pathlib import Path

import orjson
import pytest
from shardrun.resume import share_lock
with share_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


GAP = """
import fcntl
import sys
from pathlib import Path

import orjson
import pytest
from shardrun.resume import lock_run
lock = lock_run(Path(sys.argv[1]))
fcntl.flock(lock.held, fcntl.LOCK_UN)  # the moment inside alone_in_run's conversion
print("held", flush=True)
sys.stdin.read()
"""


END = """
import sys
from pathlib import Path

import orjson
import pytest
import orjson
from shardrun.resume import lock_run
run = Path(sys.argv[1])
lock = lock_run(run)
print("held", flush=True)
sys.stdin.read()
manifest = orjson.loads((run / "manifest.json").read_bytes())
manifest.update(status="succeeded", ended_at="2027-01-15T08:00:04.000Z")
(run / "manifest.json").write_bytes(orjson.dumps(manifest))  # a pass closes its manifest,
lock.close()  # then lets go of the run
"""


@contextmanager
def _holding(script: str, run: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """`script` (SHARE, GAP, END or FIRST) as a real process on `run`, from the moment it says it
    holds what it takes; on the way out its standard input is closed, for it to let go and
    end, and it must end well (30 s at the most)."""
    holder = subprocess.Popen([sys.executable, "-c", script, str(run), *args],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0


def another_pass(run: Path) -> subprocess.CompletedProcess[str]:
    """A second pass's attempt to take the run, giving up after half a second."""
    return subprocess.run([sys.executable, "-c", TAKE, str(run)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_no_other_pass_takes_the_run_while_a_pass_converts_its_hold(tmp_path: Path) -> None:
    """The moment inside `alone_in_run`'s conversion, with `.lock` held by no process, made
    to last: another pass still cannot take the run (the pass holds its gate); it can once
    the pass has ended."""
    run = tmp_path / "run"
    run.mkdir()
    lock = resume.lock_run(run)
    fcntl.flock(lock.held, fcntl.LOCK_UN)  # what the conversion does first
    refused = another_pass(run)
    assert refused.returncode == 1, refused.stderr
    assert f"run {run.name} is in use by another shardrun process" in refused.stderr
    lock.close()
    assert another_pass(run).returncode == 0


def test_a_pass_is_alone_in_its_run_once_its_shards_let_go(tmp_path: Path) -> None:
    """A shard's shared hold (a real process) makes `alone_in_run` false, and the pass keeps
    its hold either way: no other pass takes the run meanwhile; once the shard has exited the
    pass is alone."""
    run = tmp_path / "run"
    run.mkdir()
    lock = resume.lock_run(run)
    with _holding(SHARE, run):
        assert resume.alone_in_run(lock) is False
        assert another_pass(run).returncode == 1
    assert resume.alone_in_run(lock) is True
    assert another_pass(run).returncode == 1  # the pass holds its run still
    lock.close()


def test_report_calls_a_pass_in_its_conversion_running_not_crashed(tmp_path: Path) -> None:
    """A live pass (a real process) in the moment `alone_in_run` converts its hold, made to
    last: no process holds `.lock`, but the pass holds its gate, so the run is in use, and
    `report` on it, its manifest saying `running` and its logs fresh, says running, where it
    said crashed (it looked at `.lock` only). Once the pass is gone, crashed it is."""
    run = write_run(tmp_path / "run", {"00": hand_shard()[:-1]}, None, status="running")
    with _holding(GAP, run):
        assert resume.in_use(run) is True
        state = load_report(run)[0]["run"]
        assert state["state"] == "running", state["state_reason"]
    assert resume.in_use(run) is False
    state = load_report(run)[0]["run"]
    assert state["state"] == "crashed", state["state_reason"]
    assert "no process of the run holds its lock" in state["state_reason"]


def test_in_use_of_a_run_without_a_gate_reads_its_shards_lock(tmp_path: Path) -> None:
    """A run of an older shardrun has no `.pass.lock`: the shards' hold on `.lock` still says
    the run is in use; with no lock file at all, that cannot be told."""
    run = tmp_path / "run"
    run.mkdir()
    assert resume.in_use(run) is None
    with _holding(SHARE, run):
        assert not (run / resume.PASS_LOCK).exists()
        assert resume.in_use(run) is True
    assert resume.in_use(run) is False


def test_a_pass_that_ends_while_report_reads_the_run_is_finished_not_crashed(
        tmp_path: Path) -> None:
    """`report` reads the manifest (`running`) and then the logs; the pass (a real process
    holding the run's locks) closes its manifest and exits meanwhile, so that no process
    holds a lock when the report asks: the run is finished, as the manifest now says, not
    crashed, and the reason says that the figures are of the moment before."""
    run = write_run(tmp_path / "run", {"00": hand_shard()}, None, status="running")
    with _holding(END, run):
        loaded = load_run(run)
        assert loaded.manifest["status"] == "running"
    assert resume.in_use(run) is False
    state, why = run_state(loaded)
    assert state == "finished", why
    assert why.startswith("manifest status succeeded, ended 2027-01-15T08:00:04.000Z"), why
    assert why.endswith("; it ended while this report read the run, so the figures are of the "
                        "moment before: report again for all of it"), why


def _ending_pass_with_old_logs(tmp_path: Path) -> tuple[Path, subprocess.Popen[str]]:
    """A run whose manifest says `running` and whose shard logs all ended an hour ago, and its
    pass, a real process holding the run's locks, which closes the manifest and lets go once
    its standard input closes (as a pass at its end, hashing a big run's files)."""
    run = write_run(tmp_path / "run", {"00": hand_shard()}, None, status="running")
    past = time.time() - 3600
    for path in (run / "events").iterdir():
        os.utime(path, (past, past))
    return run, subprocess.Popen([sys.executable, "-c", END, str(run)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)  # fmt: skip


def test_report_calls_a_live_pass_running_however_long_since_its_logs_were_written(
        tmp_path: Path) -> None:
    """A pass at its end (a real process holding the run's locks), its shards' logs all ended
    and an hour old, its manifest still `running`, as while it hashes the run's files for
    the manifest: running, where it read as crashed ("the manifest was never finalized").
    Once it has closed its manifest and exited, finished."""
    run, holder = _ending_pass_with_old_logs(tmp_path)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        state = load_report(run)[0]["run"]
        assert state["state"] == "running", state["state_reason"]
        assert state["state_reason"].startswith(
            "manifest status running; its pass is alive (it holds .pass.lock); last log write "
        ), state["state_reason"]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    assert load_report(run)[0]["run"]["state"] == "finished"


def test_a_pass_that_ends_between_reports_looks_at_its_locks_is_not_called_crashed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass (a real process holding the run's locks) closes its manifest and exits right
    after `report` has found its gate held, its logs an hour old (as at a big run's end):
    the gate is asked once, so the run reads as running, as it was when asked. It was asked
    twice (in `in_use`, then on its own), and the second ask, finding no pass, let the logs'
    age call the run crashed ("the manifest was never finalized") with no look at the
    manifest, which by then said the run had succeeded."""
    run, holder = _ending_pass_with_old_logs(tmp_path)
    held = resume._held

    def held_then_the_pass_ends(path: Path) -> bool | None:
        answer = held(path)
        if path.name == resume.PASS_LOCK and holder.poll() is None:
            assert holder.stdin is not None
            holder.stdin.close()
            assert holder.wait(timeout=30) == 0
        return answer

    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        loaded = load_run(run)
        monkeypatch.setattr(resume, "_held", held_then_the_pass_ends)
        state, why = run_state(loaded)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
    assert holder.returncode == 0
    assert state == "running", why
    monkeypatch.undo()
    assert load_report(run)[0]["run"]["state"] == "finished"


def test_a_run_its_logs_age_would_call_crashed_is_looked_up_in_its_manifest_again(
        tmp_path: Path) -> None:
    """No pass holds the run's gate, but a process still holds `.lock` (a shard of a pass of
    an older shardrun, which had no gate), so only the logs' age can call the run crashed:
    its logs all ended an hour ago and the manifest `report` read says `running`. The pass
    closes its manifest after `report` read it: the run is finished, as the manifest now
    says, where the logs' age alone called it crashed ("the manifest was never finalized")."""
    run = write_run(tmp_path / "run", {"00": hand_shard()}, None, status="running")
    past = time.time() - 3600
    for path in (run / "events").iterdir():
        os.utime(path, (past, past))
    with _holding(SHARE, run):
        assert not (run / resume.PASS_LOCK).exists() and resume.in_use(run) is True
        loaded = load_run(run)
        state, why = run_state(loaded)
        assert (state, why) == ("crashed", "every shard log ended but the manifest was never "
                                "finalized; --resume continues it (it keeps every answer on "
                                "disk)")
        manifest = orjson.loads((run / "manifest.json").read_bytes())
        manifest.update(status="succeeded", ended_at="2027-01-15T08:00:04.000Z")
        (run / "manifest.json").write_bytes(orjson.dumps(manifest))
        state, why = run_state(loaded)
    assert loaded.manifest["status"] == "running"  # the one read with the logs
    assert state == "finished", why
    assert why.startswith("manifest status succeeded, ended 2027-01-15T08:00:04.000Z"), why
    assert why.endswith("; it ended while this report read the run, so the figures are of the "
                        "moment before: report again for all of it"), why


def _first_line(stream: IO[str], proc: subprocess.Popen[str], bound_s: float) -> str:
    """The first line of `proc`'s `stream`, waited for `bound_s` at the most (a hang guard):
    empty if it ended, or stayed silent, first."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if select.select([stream], [], [], 0.2)[0]:
            return stream.readline()
        if proc.poll() is not None:
            return ""
    return ""


def test_retry_failed_on_a_run_in_progress_says_at_once_that_it_waits_for_that_pass(
    tmp_path: Path,
) -> None:
    """`retry-failed RUN` while a pass of RUN runs (a real one, on a slow simulator) waits for
    it, since its dead letters are that pass's to write; its first word said "earlier
    processes", as for a killed pass's shards: it now names the pass in progress."""
    write_input(tmp_path / "input.jsonl", 20)
    write_job(tmp_path / "job.yaml", shards=1, concurrency=1,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                        "sim": {**FAST_SIM, "ttft_ms": 3000}})
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    command = [sys.executable, "-m", "shardrun"]
    first = subprocess.Popen([*command, "job.yaml", "--runs-dir", "runs", "--quiet"],
                             cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    retry: subprocess.Popen[str] | None = None
    try:
        # The pass holds its gate before it writes the manifest, which `retry-failed` reads
        # before it waits: both, or the retry says the run is no run directory yet.
        deadline = time.monotonic() + KILL_GUARD_S
        while not any(resume.pass_lives(run) and (run / "manifest.json").exists()
                      for run in (tmp_path / "runs").glob("*/")):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        run = only_run(tmp_path / "runs")
        retry = subprocess.Popen([*command, "retry-failed", str(run)], cwd=tmp_path, env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        assert retry.stderr is not None
        said = _first_line(retry.stderr, retry, KILL_GUARD_S)
        assert first.poll() is None  # the pass was in progress all along
        assert said == (f"run {run.name} has a pass in progress: waiting for it to end, 60 s "
                        "at the most (Ctrl-C stops the wait, with nothing sent)\n")
    finally:
        for proc in (retry, first):
            if proc is not None:
                end_run(proc)


FIRST = """
import shutil
import sys
from pathlib import Path

from shardrun.manifest import RunDir
from shardrun.resume import lock_run
made, lock = RunDir.create_held(Path(sys.argv[1]), sys.argv[2], lock_run)  # as a first pass
run = made.path
print("held", flush=True)  # and no manifest written yet
if len(sys.argv) > 3:  # then the manifest the pass writes, once told to
    sys.stdin.readline()
    (run / "manifest.json").write_bytes(Path(sys.argv[3]).read_bytes())
    print("begun", flush=True)
    sys.stdin.read()
else:
    sys.stdin.read()
    shutil.rmtree(run)  # as a first pass stopped before its manifest leaves it: removed
lock.close()
"""


@pytest.mark.parametrize("way", ["retry-failed", "--resume"])
def test_a_pass_started_in_a_runs_first_instant_waits_for_its_first_pass(
    tmp_path: Path, way: str,
) -> None:
    """`retry-failed RUN` or `--resume RUN` while RUN's first pass holds the run but has not yet
    written its manifest (a real process holds the gate there) waits for that pass, as it does
    once the manifest exists, instead of saying RUN is no run; the pass ended, removing the
    directory, the run is then no run, said in one line."""
    runs = tmp_path / "runs"
    runs.mkdir()
    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml")
    command = [sys.executable, "-m", "shardrun"]
    command += (["retry-failed", "runs/r1", "--job", "job.yaml"] if way == "retry-failed"
                else ["job.yaml", "--runs-dir", "runs", "--resume", "r1"])
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    late: subprocess.Popen[str] | None = None
    try:  # `late` ended on every way out: a failed wait, or a holder that did not end well
        with _holding(FIRST, runs, "r1") as first:
            assert not (runs / "r1" / "manifest.json").exists()
            assert resume.pass_lives(runs / "r1")
            late = subprocess.Popen(command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
            assert late.stderr is not None
            said = _first_line(late.stderr, late, KILL_GUARD_S)
            assert said == ("run r1 has a pass in progress: waiting for it to end, 60 s at the "
                            "most (Ctrl-C stops the wait, with nothing sent)\n")
            assert late.poll() is None and first.poll() is None
        _, rest = late.communicate(timeout=KILL_GUARD_S)
    finally:
        if late is not None:
            end_run(late)
    assert late.returncode != 0
    assert rest.count("\n") == 1 and "Traceback" not in rest, rest
    assert ("runs/r1 is not a run directory: nothing is there" in rest
            if way == "retry-failed" else "--resume r1: no run 'r1' in runs" in rest), rest


def test_resume_latest_in_a_new_runs_first_instant_waits_for_it_and_resumes_it(
    tmp_path: Path,
) -> None:
    """`--resume latest` while the job's newest run is in its first instant (a real process
    holds its gate, no manifest written yet) waits for its manifest, then for its pass, and
    resumes that run: it resumed the run before it, the only one with a manifest then."""
    runs = tmp_path / "runs"
    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    command = [sys.executable, "-m", "shardrun", "job.yaml", "--runs-dir", "runs"]
    old = subprocess.run([*command, "--run-id", "r1", "--quiet"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert old.returncode == 0, old.stderr
    # What the new run's first pass writes: r1's manifest, begun later, under r2's name.
    manifest = orjson.loads((runs / "r1" / "manifest.json").read_bytes())
    manifest.update(run_id="r2", started_at="2999-01-01T00:00:00.000Z")
    (tmp_path / "r2.json").write_bytes(orjson.dumps(manifest))
    late: subprocess.Popen[str] | None = None
    try:
        with _holding(FIRST, runs, "r2", str(tmp_path / "r2.json")) as first:
            late = subprocess.Popen([*command, "--resume", "latest"], cwd=tmp_path, env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            assert late.stderr is not None and first.stdin is not None
            assert _first_line(late.stderr, late, KILL_GUARD_S) == (
                "run r2 is starting: waiting for its manifest, to tell whether it is this "
                "job's newest run, 60 s at the most\n")
            first.stdin.write("write it\n")
            first.stdin.flush()
            assert first.stdout is not None and first.stdout.readline() == "begun\n"
            assert _first_line(late.stderr, late, KILL_GUARD_S) == (
                "run r2 has a pass in progress: waiting for it to end, 60 s at the most "
                "(Ctrl-C stops the wait, with nothing sent)\n")
        _, rest = late.communicate(timeout=KILL_GUARD_S)
    finally:
        if late is not None:
            end_run(late)
    assert late.returncode == 0, rest
    assert [p.name for p in (runs / "r1" / "results").glob("*.r1.jsonl")] == []
    assert sum(1 for p in (runs / "r2" / "results").glob("*.r1.jsonl")
               for _ in p.open()) == 3


def test_a_new_runs_directory_is_never_there_without_its_gate_held(tmp_path: Path) -> None:
    """From the moment a new run's directory has its name, its first pass holds its gate: a
    resume or `retry-failed` of it started at any moment of its making waits for that pass
    (`resume.await_first_pass`), where, in the moment between the directory's making and the
    gate's taking, it said the run was no run. Checked at every audited operation (each file
    opened, directory made, renamed...) of the pass's opening, by a second hold on the gate."""
    from shardrun import runner
    from shardrun.spec import load_job

    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml")
    run = tmp_path / "runs" / "r1"
    ungated: list[str] = []  # the operations that found the directory there, not held
    checking = {"on": False, "busy": False}

    def check(event: str, _: tuple[object, ...]) -> None:
        if not checking["on"] or checking["busy"]:
            return
        checking["busy"] = True  # the check's own opening of the gate is audited too
        try:
            if (run.exists() and not (run / "manifest.json").exists()
                    and not resume.pass_lives(run)):
                ungated.append(event)
        finally:
            checking["busy"] = False

    sys.addaudithook(check)  # for good, off once this test is done
    job = load_job(tmp_path / "job.yaml", env={}, flags={"runs_dir": str(tmp_path / "runs")})
    checking["on"] = True
    try:
        this = runner._open_pass(job, runner.RunOptions(run_id="r1"))
    finally:
        checking["on"] = False
    try:
        assert resume.pass_lives(run)
        assert ungated == []
    finally:
        this.lock.close()
        assert this.stops is not None
        runner._let_stops(this.stops)  # as `run` does, once its clean-up owns the pass


def test_a_new_runs_directory_in_its_making_never_reads_as_left_by_a_killed_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While `RunDir.create_held` makes a run's directory under its hidden name, no moment of
    it looks like a directory a pass killed before its manifest left (`resume.never_begun`:
    run folders, no manifest, no gate held), which `--resume latest` would tell the user to
    remove, and, with no other run there, call the only thing left. Checked after every
    directory made."""
    from shardrun.manifest import RunDir

    runs = tmp_path / "runs"
    seen: list[str] = []
    real_mkdir = os.mkdir

    def mkdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        real_mkdir(path, *args, **kwargs)  # type: ignore[arg-type]
        seen.extend(p.name for p in resume.leftovers(runs))

    monkeypatch.setattr(os, "mkdir", mkdir)
    made, lock = RunDir.create_held(runs, "r1", resume.lock_run)
    try:
        assert made.path == runs / "r1" and (made.path / "results").is_dir()
        assert seen == []
    finally:
        lock.close()


def test_of_two_runs_made_at_once_with_one_run_id_one_is_refused_and_the_other_kept(
    tmp_path: Path,
) -> None:
    """Two first passes given one --run-id at once, here of one pid (as two containers'
    shardruns, each pid 1, sharing a runs directory, or a pid reused after a kill -9 left its
    hidden directory): the run made first is whole, with what it wrote, and the other is
    refused with the one sentence that says the id is taken, leaving nothing behind."""
    from shardrun.errors import SpecError
    from shardrun.manifest import RunDir

    runs = tmp_path / "runs"
    other: list[resume.RunLock] = []

    def take(staging: Path) -> resume.RunLock:
        made, lock = RunDir.create_held(runs, "r1", resume.lock_run)  # made meanwhile
        other.append(lock)
        (made.path / "results" / "shard-00.jsonl").write_text("kept\n")
        return resume.lock_run(staging)

    try:
        with pytest.raises(SpecError, match=r"^run directory .*r1 already exists; choose "
                           r"another --run-id$"):
            RunDir.create_held(runs, "r1", take)
        assert [p.name for p in runs.iterdir()] == ["r1"]
        assert (runs / "r1" / "results" / "shard-00.jsonl").read_text() == "kept\n"
        assert resume.pass_lives(runs / "r1")
    finally:
        for lock in other:
            lock.close()


def test_a_stop_during_a_new_runs_rename_leaves_no_run_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C that comes while `RunDir.create_held` renames the new run's directory is raised
    as the rename returns, done: the directory, by then under the run's name, is removed with
    the rest, where it was left behind without a manifest, read as a run a killed pass left."""
    from shardrun.manifest import RunDir

    runs = tmp_path / "runs"
    real_rename = os.rename

    def rename(*args: object, **kwargs: object) -> None:
        real_rename(*args, **kwargs)  # type: ignore[arg-type]
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        RunDir.create_held(runs, "r1", resume.lock_run)
    assert list(runs.iterdir()) == []


MAKER = """
import sys
from pathlib import Path

from shardrun.manifest import RunDir
from shardrun.resume import lock_run


def take(staging):
    held = lock_run(staging)
    print(staging.name, flush=True)
    sys.stdin.read()  # held here: in `create_held`, its gate taken, before folders and rename
    return held


RunDir.create_held(Path(sys.argv[1]), "r1", take)
"""


def test_a_first_pass_killed_while_making_its_directory_leaves_one_every_command_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A first pass (a real process) killed with SIGKILL while `RunDir.create_held` holds its
    run's directory under the hidden name leaves that directory. While the pass lives, it is a
    run being made, no leftover; once killed, `report` and `verify` on it, `report` on the runs
    directory, and `--resume` (latest, or by its name) each say in one sentence that it is a
    run whose first pass was stopped before it began, nothing sent, and to remove it, where
    they said only that it had no manifest.json; `--resume latest` still resumes the run
    before it."""
    from shardrun.errors import SpecError

    runs = tmp_path / "runs"
    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml",
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": FAST_SIM})
    maker = subprocess.Popen([sys.executable, "-c", MAKER, str(runs)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert maker.stdout is not None
        name = maker.stdout.readline().strip()
        where = Path("runs") / name
        making = run_cli("report", str(where), cwd=tmp_path)
        assert making.stderr == (f"error: {where} is not a run directory yet: a first pass is "
                                 "making it, and names it runs/r1 once made; name that run\n")
        assert resume.leftovers(runs) == []
    finally:
        maker.kill()  # SIGKILL
        maker.communicate(timeout=KILL_GUARD_S)
    assert maker.returncode == -9
    assert sorted(p.name for p in (runs / name).iterdir()) == [".lock", resume.PASS_LOCK]
    said = (f"{where} is a run whose first pass was stopped before it began (it has no "
            "manifest.json; nothing was sent)")
    for command in (("report", str(where)), ("verify", str(where))):
        left = run_cli(*command, cwd=tmp_path)
        assert (left.returncode, left.stderr) == (2, f"error: {said}: remove it\n"), command
    listed = run_cli("report", "runs", cwd=tmp_path)
    assert listed.stderr == ("error: runs is not a run directory: it has no manifest.json; "
                             f"{said}: remove it\n")
    for ref, what in (("latest", f"there is no run in runs to resume: {said}"),
                      (name, said)):
        resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", ref, cwd=tmp_path)
        assert (resumed.returncode, resumed.stderr) == (2, (
            f"error: --resume {ref}: {what}; remove it, and run the job again without "
            "--resume\n"))
    (runs / "old" / "results").mkdir(parents=True)
    (runs / "old" / "manifest.json").write_bytes(b'{"started_at": "2026-01-01T00:00:00Z"}')
    os.utime(runs / "old" / "manifest.json", ns=(10**18, 10**18))  # written before the kill
    assert resume.find_run(runs, "latest") == runs / "old"
    assert capsys.readouterr().err == (
        f"warning: {runs / name} is a run whose first pass was stopped before it began (it has "
        "no manifest.json; nothing was sent), so --resume latest resumes run old, the newest "
        f"before it; remove {runs / name}\n")
    with pytest.raises(SpecError, match=r"no manifest\.json; nothing was sent"):
        resume.find_run(runs, name)


def test_only_an_emptied_leftover_of_a_pass_gone_is_called_one(tmp_path: Path) -> None:
    """On disk as a kill leaves it, a directory reads as a first pass's leftover only with
    nothing in it but the locks and empty run folders, and no pass holding its gate: under
    the hidden name with the run's folders made (whoever's pid it bears, as a container's pid
    1 is every pass's), or without them, its process gone. Not one without folders whose
    process lives (a pass in its first instant, before its gate), nor one with a file written
    or an unknown one in it, nor a folder of the user's that only looks like a run's."""
    runs = tmp_path / "runs"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()

    def made(name: str, *subs: str) -> Path:
        for sub in subs:
            (runs / name / sub).mkdir(parents=True)
        (runs / name).mkdir(parents=True, exist_ok=True)
        (runs / name / resume.PASS_LOCK).touch()
        return runs / name

    folders = ("events", "results", "dead", "logs")
    left = [made(f".r1.{os.getpid()}.0badc0de.new", *folders), made(f".r2.{gone}.0badc0de.new"),
            made("r3", *folders)]
    kept = [made(f".r4.{os.getpid()}.0badc0de.new"), made(f".r5.{gone}.0badc0de.new", *folders),
            made("r6", *folders), made("r7", *folders), made("project", *folders[1:]),
            made("mine", *folders)]
    (kept[-1] / resume.PASS_LOCK).unlink()  # folders of the user's, no gate ever taken
    (kept[1] / "results" / "shard-00.jsonl").write_text("{}\n")
    (kept[2] / "notes.txt").write_text("mine\n")
    (kept[3] / "manifest.json").write_text("{}")
    assert [resume.never_begun(p) for p in left + kept] == [True] * 3 + [False] * 6
    with open(left[0] / resume.PASS_LOCK, "ab") as gate:
        fcntl.flock(gate, fcntl.LOCK_EX)  # a live pass holds it
        assert not resume.never_begun(left[0])


@pytest.mark.parametrize("when", ["as its directory is made", "as it is handed over"])
def test_a_ctrl_c_while_a_first_pass_makes_its_run_leaves_no_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str,
) -> None:
    """A real SIGINT, sent to this process as `RunDir.create_held` looks at the directory it
    has just made (its `lstat`, outside its own clean-up), or just as it returns the run (before
    the pass's clean-up owns it), is held until `runner.run`'s clean-up owns the directory,
    then raised: the run is stopped and no directory is left, where the stop left one without
    a manifest (and, the first time, under the hidden name)."""
    import signal

    from shardrun import runner
    from shardrun.manifest import RunDir

    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml", runs_dir=str(tmp_path / "runs"))
    sent: list[int] = []

    def interrupt() -> None:
        if not sent:
            sent.append(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    if when == "as its directory is made":
        real_lstat = Path.lstat

        def lstat(self: Path) -> os.stat_result:
            if self.name.endswith(".new"):
                interrupt()
            return real_lstat(self)

        monkeypatch.setattr(Path, "lstat", lstat)
    else:
        real_create = RunDir.create_held

        def create_held(*args: object, **kwargs: object) -> object:
            made = real_create(*args, **kwargs)  # type: ignore[arg-type]
            interrupt()
            return made

        monkeypatch.setattr(RunDir, "create_held", create_held)
    with pytest.raises(KeyboardInterrupt):
        runner.run(tmp_path / "job.yaml", env={}, flags={}, argv=[],
                   options=runner.RunOptions(run_id="r1", quiet=True))
    assert sent and list((tmp_path / "runs").iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_a_ctrl_c_another_thread_takes_while_a_first_pass_makes_its_run_is_held_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A program that runs `runner.run` with a thread of its own: a SIGINT sent as the pass
    hands its new run over goes to that thread (it is the one that sends it, and blocks it
    not), whose handler has the main thread raise at once, where a blocked mask held it there
    only. It is held all the same, and raised once the pass's clean-up owns the directory."""
    import signal
    import threading

    from shardrun import runner
    from shardrun.manifest import RunDir

    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml", runs_dir=str(tmp_path / "runs"))
    go, sent = threading.Event(), threading.Event()

    def other() -> None:
        if go.wait(KILL_GUARD_S):
            os.kill(os.getpid(), signal.SIGINT)  # handled in this thread: it blocks none
            sent.set()

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    real_create = RunDir.create_held

    def create_held(*args: object, **kwargs: object) -> object:
        made = real_create(*args, **kwargs)  # type: ignore[arg-type]
        go.set()
        assert sent.wait(KILL_GUARD_S)
        return made

    monkeypatch.setattr(RunDir, "create_held", create_held)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run(tmp_path / "job.yaml", env={}, flags={}, argv=[],
                       options=runner.RunOptions(run_id="r1", quiet=True))
    finally:
        go.set()
        thread.join(KILL_GUARD_S)
    assert sent.is_set() and list((tmp_path / "runs").iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


HANG_UP_IN_THE_MAKING = """
import os, signal, sys
from shardrun.manifest import RunDir
real = RunDir.create_held.__func__

def create_held(cls, *args, **kwargs):
    made = real(cls, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGHUP)  # held, as Ctrl-C is, till the clean-up owns the run
    return made

RunDir.create_held = classmethod(create_held)
from shardrun.cli import main
sys.argv = ["shardrun", "job.yaml", "--runs-dir", "runs", "--run-id", "r1", "--quiet"]
sys.exit(main())
"""


def test_a_hang_up_while_a_first_pass_makes_its_run_leaves_no_run_directory(
    tmp_path: Path,
) -> None:
    """A SIGHUP (a dropped SSH session, `kill -HUP`) before the coordinator hears it stops the
    pass as SIGTERM does: held while the run directory is made, then a KeyboardInterrupt in
    `runner.run`'s clean-up, which removes the directory. Its default action ended the process
    there (129), leaving the run `r1` without a manifest."""
    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    proc = subprocess.run([sys.executable, "-c", HANG_UP_IN_THE_MAKING], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    assert (proc.returncode, proc.stderr) == (
        130, "error: stopped before the run started; nothing was sent\n")
    assert list((tmp_path / "runs").iterdir()) == []

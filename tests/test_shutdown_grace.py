"""shutdown_grace_s bounds a stop even when every slot holds a stalled stream.

The real CLI runs as a process against the embedded simulator (its own process, loopback).
"""

from __future__ import annotations

import os
import pty
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest

from shardrun import resume, runner
from shardrun.spec import load_job
from tests.conftest import FAST_SIM, Run, end_run, only_run, run_cli, write_input, write_job

GRACE_S = 2
STALL_S = 30  # far beyond the grace: a stop that waits for the stalls is plainly late
WAIT_GUARD_S = 120.0  # hang guard only
QUIET_S = 1.0  # no new result for this long: every slot holds a stalled stream
T = TypeVar("T")


def _result_lines(runs: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in runs.glob("*/results/*.jsonl"))


def _wait_until_every_slot_stalls(runs: Path, proc: subprocess.Popen[str]) -> int:
    """Wait for some results, then for results to stop coming (every slot stalled); bounded.

    Before the fix, a stop is only timed once some slot of the shard frees, so the stop must
    come when none will free before the stall ends.
    """
    deadline = time.monotonic() + WAIT_GUARD_S
    seen, since = 0, time.monotonic()
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it was stopped"
        lines = _result_lines(runs)
        if lines != seen:
            seen, since = lines, time.monotonic()
        elif seen and time.monotonic() - since >= QUIET_S:
            return seen
        time.sleep(0.05)
    raise AssertionError("results never stopped coming: the stalls did not hold the slots")


def _run_job(tmp_path: Path, *extra: str, **popen: Any) -> subprocess.Popen[str]:
    """`shardrun job.yaml --runs-dir runs EXTRA` as a process in `tmp_path`, its output piped
    as text unless `popen` says otherwise, no SHARDRUN_* variable of ours passed on."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    options: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE,
                               "text": True, **popen}
    return subprocess.Popen([sys.executable, "-m", "shardrun", "job.yaml", "--runs-dir", "runs",
                             *extra], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                            **options)


def _interrupted(tmp_path: Path, ready: Callable[[subprocess.Popen[str]], T], *,
                 group_sigterm: bool = False,
                 ) -> tuple[T, subprocess.Popen[str], str, float, float]:  # fmt: skip
    """Run the CLI on job.yaml, send SIGINT once `ready(process)` returns (it waits, bounded,
    and says what it saw), and wait for the end: (what `ready` returned, the process, its
    stderr, seconds from the signal to the end, wall-clock time of the signal).

    `group_sigterm`: the run starts as its own process group, and SIGTERM goes to the whole
    group, as `timeout`, systemd or `kill -TERM -PGID` send it."""
    proc = _run_job(tmp_path, start_new_session=group_sigterm)
    try:
        seen = ready(proc)
        stopped_at, wall = time.monotonic(), time.time()
        if group_sigterm:
            os.killpg(proc.pid, signal.SIGTERM)  # its own group: the test's process is not in it
        else:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=WAIT_GUARD_S)
        took = time.monotonic() - stopped_at
    finally:
        end_run(proc)
    return seen, proc, err, took, wall


def _wait_for(proc: subprocess.Popen[str], done: Callable[[], bool], what: str) -> None:
    """Poll `done` until it holds (the run must still be going), within WAIT_GUARD_S."""
    deadline = time.monotonic() + WAIT_GUARD_S
    while not done():
        assert proc.poll() is None, "the run ended before it was stopped"
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.05)


def _slow_job(tmp_path: Path, *, ttft_ms: int) -> None:
    """job.yaml and 400 items in `tmp_path`, on a simulator whose first tokens take `ttft_ms`."""
    write_input(tmp_path / "input.jsonl", 400)
    write_job(tmp_path / "job.yaml", endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                                               "sim": {**FAST_SIM, "ttft_ms": ttft_ms}})


def _a_request_sent(runs: Path) -> bool:
    """Whether some shard's event log has an `attempt_start` line yet."""
    return any(b'"attempt_start"' in f.read_bytes() for f in runs.glob("*/events/shard-*.jsonl"))


def test_sigint_cancels_stalled_in_flight_after_the_grace_period(tmp_path: Path) -> None:
    """Every slot busy with a stream stalled for 30 s: a SIGINT ends the run after the 2 s
    grace, not when the stalls end; the cancelled items get no line; --resume does each once."""
    ids = write_input(tmp_path / "input.jsonl", 80)
    stalling = {**FAST_SIM, "ttft_ms": 20, "itl_ms": 2, "stall_mid_stream": 0.5,
                "stall_s": STALL_S}
    job = {"shards": 2, "concurrency": 4, "shutdown_grace_s": GRACE_S,
           "timeouts": {"idle_s": 2 * STALL_S}}
    write_job(tmp_path / "job.yaml", **job, endpoint={"base_url": "sim://", "api": "chat",
                                                      "model": "m", "sim": stalling})
    runs = tmp_path / "runs"
    earned, proc, err, took, _ = _interrupted(tmp_path,
                                              lambda p: _wait_until_every_slot_stalls(runs, p))
    # Behaviour, not speed: the stop did not wait for the stalls (half of them is far above the
    # grace and whatever a busy machine adds to a flush and the simulator's stop).
    assert took < STALL_S / 2, f"the stop took {took:.1f} s (grace {GRACE_S} s)"
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "stopping: letting in-flight requests finish (Ctrl-C again to abort)" in err
    path = only_run(tmp_path / "runs")
    first = Run.load(path)
    assert first.manifest["status"] == "interrupted"
    assert not first.dead  # cancelled by the stop: no verdict on the item
    assert len(first.results) == earned  # nothing earned was lost, nothing new came
    _everything_started_ends_once(path, first)
    earned_ids = {r["id"] for r in first.results}
    # Continue without stalls (a changed endpoint.sim only warns) and check exactly once.
    write_job(tmp_path / "job.yaml", **job)
    resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "latest", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    run = Run.load(path)
    counts = Counter(r["id"] for r in run.results)
    assert not [i for i, c in counts.items() if c > 1], "an id has two results"
    assert sorted(counts) == sorted(ids)
    assert not run.dead
    assert earned_ids <= set(counts)
    for file in path.rglob("*.jsonl"):  # no torn line anywhere
        for line in file.read_bytes().splitlines():
            orjson.loads(line)


def _everything_started_ends_once(path: Path, run: Run) -> None:
    """The attempts the grace period cancelled mid-stream end with a `cancelled` line that
    keeps the tokens they had received, so the summary, the report's attempts and its count by
    status agree. Every span ends too: those queued or cancelled by the stop are released as
    abandoned, so the report has none still open and no backlog waiting out the grace."""
    def attempts(ev: str) -> list[tuple[str, int]]:
        return [(e["span"], e["attempt"]) for e in run.events if e["ev"] == ev]

    def spans(ev: str) -> list[str]:
        return [e["span"] for e in run.events if e["ev"] == ev]

    assert sorted(spans("queued")) == sorted(spans("released")) == sorted(spans("admitted"))
    abandoned = [e for e in run.events if e["ev"] == "released" and e["outcome"] == "abandoned"]
    assert len(abandoned) == len(spans("queued")) - len(run.results)

    started, ended = attempts("attempt_start"), attempts("attempt_end")
    assert sorted(started) == sorted(ended)
    cancelled = [e for e in run.events if e["ev"] == "attempt_end" and e["status"] == "cancelled"]
    assert cancelled, "no attempt was in flight at the end of the grace period"
    assert all(e["wasted_tokens"] > 0 and e["error"] for e in cancelled)
    report = run_cli("report", str(path), "--json", cwd=path)
    assert report.returncode == 0, report.stderr
    doc = orjson.loads(report.stdout)
    assert (doc["items"]["open"], doc["items"]["abandoned"]) == (0, len(abandoned))
    seen = doc["attempts"]
    assert seen["started"] == sum(seen["by_status"].values()) == len(started)
    assert seen["by_status"]["cancelled"] == len(cancelled)
    assert run.manifest["summary"]["attempts"] == len(started)


def test_sigterm_to_the_whole_process_group_is_a_graceful_stop(tmp_path: Path) -> None:
    """SIGTERM to every process of the run (coordinator, launcher, shards, simulator): only the
    coordinator heeds it, so the in-flight requests finish against a server still there, the
    shards end their logs, the manifest has its summary, and --resume does each id once."""
    ids = write_input(tmp_path / "input.jsonl", 40)
    # Answers of 3 s: longer than the 2 s a simulator that heeded SIGTERM would give the
    # requests it was serving before it closed their connections.
    slow = {**FAST_SIM, "ttft_ms": 3000}
    write_job(tmp_path / "job.yaml", shards=2, concurrency=4,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": slow})
    runs = tmp_path / "runs"

    def every_slot_sent() -> bool:  # eight requests out, each 3 s from its answer at most
        return sum(p.read_bytes().count(b'"ev":"attempt_start"')
                   for p in runs.glob("*/events/shard-*.jsonl")) >= 8

    _, proc, err, _, _ = _interrupted(tmp_path, lambda p: _wait_for(
        p, every_slot_sent, "every slot's first request"), group_sigterm=True)
    assert proc.returncode == 130, err
    assert "died" not in err and "Traceback" not in err, err
    assert "stopping (SIGTERM): letting in-flight requests finish (SIGTERM again to abort)" in err
    path = only_run(runs)
    first = Run.load(path)
    assert first.manifest["status"] == "interrupted" and "summary" in first.manifest
    assert sorted(e["shard"] for e in first.events if e["ev"] == "shard_end") == [0, 1]
    # The server outlived the signal: every attempt in flight at the stop ended with an answer.
    ends = [e for e in first.events if e["ev"] == "attempt_end"]
    assert ends and {e["status"] for e in ends} == {"ok"}
    assert not first.dead
    write_job(tmp_path / "job.yaml", shards=2, concurrency=4)  # the rest, answered at once
    resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "latest", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    counts = Counter(r["id"] for r in Run.load(path).results)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}


def test_a_stop_before_the_run_begins_leaves_no_half_made_run(tmp_path: Path) -> None:
    """SIGTERM while the embedded simulator starts, before the manifest exists: the run ends as
    on Ctrl-C (exit 130, one line) and leaves no directory without a manifest behind, which
    would be no run to resume or report on and would refuse its --run-id."""
    write_input(tmp_path / "input.jsonl", 10)
    write_job(tmp_path / "job.yaml")
    proc = _run_job(tmp_path, "--run-id", "early")
    run = tmp_path / "runs" / "early"
    _wait_for(proc, run.is_dir, "the run directory")
    assert not (run / "manifest.json").exists()  # the simulator takes far longer to start
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=WAIT_GUARD_S)
    assert (proc.returncode, err) == (
        130, "error: stopped before the run started; nothing was sent\n")
    assert not run.exists()
    again = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "early", cwd=tmp_path)
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("where", ["mkdir", "lock", "pass"])
def test_a_stop_while_the_run_directory_is_made_leaves_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """The test above sends its SIGTERM once the run directory exists, which now and then fell
    while the pass was still making it (its subfolders, its lock): the run said it stopped
    before it started and left the directory, with no manifest, taking its --run-id. The stop
    (SIGTERM is a KeyboardInterrupt until the coordinator takes over) is made to land there."""
    write_input(tmp_path / "input.jsonl", 10)
    write_job(tmp_path / "job.yaml")
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if where == "mkdir" and self.name == "results":
            raise KeyboardInterrupt
        real_mkdir(self, *args, **kwargs)

    def stop(*_: object, **__: object) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir)
    if where == "lock":
        monkeypatch.setattr(resume, "lock_run", stop)
    if where == "pass":  # the pass being made, after its lock: still before `run` holds it
        monkeypatch.setattr(runner, "Pass", stop)
    job = load_job(tmp_path / "job.yaml", env={}, flags={"runs_dir": str(tmp_path / "runs")})
    with pytest.raises(KeyboardInterrupt):
        runner._open_pass(job, runner.RunOptions(run_id="early"))
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_run_id_whose_directory_exists_is_refused_and_left_alone(tmp_path: Path) -> None:
    """--run-id naming a directory that exists (another run's, or one a stop left): exit 2,
    one sentence, and nothing in it touched."""
    write_input(tmp_path / "input.jsonl", 10)
    write_job(tmp_path / "job.yaml")
    taken = tmp_path / "runs" / "early"
    (taken / "results").mkdir(parents=True)
    (taken / "results" / "keep.txt").write_text("mine")
    proc = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "early", cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (
        2, f"error: run directory {Path('runs') / 'early'} already exists; choose another "
           "--run-id\n")
    assert sorted(p.name for p in taken.rglob("*")) == ["keep.txt", "results"]


@pytest.mark.parametrize(("marker", "sig"), [
    ("shardrun.cli", signal.SIGTERM),  # imported: the handler is being installed, or is
    ("shardrun.coordinator", signal.SIGTERM),  # the run's modules loading: it is installed
    ("shardrun.coordinator", signal.SIGINT),
])  # fmt: skip
def test_a_stop_while_the_modules_load_is_one_sentence(
        tmp_path: Path, marker: str, sig: signal.Signals) -> None:
    """A stop in a run's first moments, while its modules load (`-X importtime` says which):
    exit 130 with one sentence saying nothing was sent, never a traceback or a crash inside an
    extension module's start-up, and no run directory. Only a stop before the handler is
    installed may still end the process by the signal, silently."""
    write_input(tmp_path / "input.jsonl", 10)
    write_job(tmp_path / "job.yaml")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "shardrun", "job.yaml",
                             "--runs-dir", "runs"], cwd=tmp_path, env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:  # bounded: the process writes a few hundred lines, then ends
        if line.rsplit("|", 1)[-1].strip() == marker:
            proc.send_signal(sig)
            break
    else:
        raise AssertionError(f"{marker} was never imported")
    _, rest = proc.communicate(timeout=WAIT_GUARD_S)
    said = [line for line in rest.splitlines() if not line.startswith("import time:")]
    if marker == "shardrun.cli" and proc.returncode == -sig:
        assert said == []
    else:
        assert proc.returncode == 130, rest
        assert said == ["error: stopped before the "
                        f"{'run' if marker != 'shardrun.cli' else 'command'} started; nothing "
                        "was sent"], said
    assert not (tmp_path / "runs").exists()


def _terminal_job(tmp_path: Path, items: int) -> list[str]:
    """A job of `items` on 2 shards of 4 against sim:// answering in 100 ms; the input's ids."""
    ids = write_input(tmp_path / "input.jsonl", items)
    write_job(tmp_path / "job.yaml", shards=2, concurrency=4,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                        "sim": {**FAST_SIM, "ttft_ms": 100}})
    return ids


def _terminal_gone_at_20(proc: subprocess.Popen[Any], tmp_path: Path, terminal: int,
                         sig: signal.Signals | None) -> None:
    """Once the run has 20 results, close the terminal (writing to it fails from then on), send
    `sig` if any, and wait for the run's end."""
    try:
        _wait_for(proc, lambda: _result_lines(tmp_path / "runs") >= 20, "20 results")
        os.close(terminal)
        if sig is not None:
            proc.send_signal(sig)
        proc.wait(timeout=WAIT_GUARD_S)
    finally:
        end_run(proc)


def test_a_terminal_hang_up_stops_the_run_and_writes_its_files(tmp_path: Path) -> None:
    """The run's terminal goes away (a dropped SSH session: the terminal closes, SIGHUP comes):
    the run stops as on SIGTERM, its summary goes nowhere instead of failing on the dead
    terminal, the manifest is finished, and --resume does each id once. A stderr sent to a
    file says how to abort now that there is no Ctrl-C."""
    # The hang-up at 20 results leaves most undone, even on a loaded machine.
    ids = _terminal_job(tmp_path, 1000)
    terminal, side = pty.openpty()
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        # Heeded whatever the suite was started under: a run started ignoring SIGHUP (`nohup
        # pytest`) keeps ignoring it, as it should (the next test), and ran to its end here.
        proc = _run_job(tmp_path, stdout=side, stderr=stderr, text=False,
                        start_new_session=True,
                        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    os.close(side)
    _terminal_gone_at_20(proc, tmp_path, terminal, signal.SIGHUP)
    assert proc.returncode == 130, log.read_text()
    assert ("stopping (SIGHUP: a hang-up): letting in-flight requests finish (SIGTERM to "
            "abort)") in log.read_text()
    path = only_run(tmp_path / "runs")
    first = Run.load(path)
    assert first.manifest["status"] == "interrupted" and "summary" in first.manifest
    assert sorted(e["shard"] for e in first.events if e["ev"] == "shard_end") == [0, 1]
    resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "latest", "--concurrency",
                      "64", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    counts = Counter(r["id"] for r in Run.load(path).results)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}


@pytest.mark.parametrize("on_terminal", ["stdout", "stderr"])
def test_a_terminal_gone_with_no_hang_up_heard_fails_nothing(
        tmp_path: Path, on_terminal: str) -> None:
    """The terminal goes away and no SIGHUP comes (or comes after the run has ended): writing
    to it fails (EIO). The run ends as it would have, exit 0. With the summary's stdout on it,
    the summary is dropped with a warning; it was "error: input/output error; no request was
    sent", exit 1. With the live display's stderr on it (which prints stdout's lines through
    it while it runs), the summary still reaches stdout's file."""
    _terminal_job(tmp_path, 100)
    terminal, side = pty.openpty()
    other = tmp_path / "other.log"
    with other.open("wb") as file:
        streams = {"stdout": side, "stderr": file} if on_terminal == "stdout" else {
            "stdout": file, "stderr": side}
        proc = _run_job(tmp_path, **streams, text=False, start_new_session=True)
    os.close(side)
    _terminal_gone_at_20(proc, tmp_path, terminal, None)
    said = other.read_text()
    assert proc.returncode == 0, said
    assert only_run(tmp_path / "runs").joinpath("manifest.json").is_file()
    assert orjson.loads((only_run(tmp_path / "runs") / "manifest.json").read_bytes())[
        "status"] == "succeeded"
    if on_terminal == "stdout":
        assert said.splitlines()[-1] == (
            "warning: cannot write to standard output (Input/output error; a terminal that hung "
            "up?): what this command prints is dropped, its exit status stands"), said
    else:
        assert said.startswith("run succeeded: ") and "  succeeded          100\n" in said, said


def test_a_run_started_under_nohup_outlives_its_terminal(tmp_path: Path) -> None:
    """Started ignoring SIGHUP (as `nohup` starts it): a SIGHUP changes nothing, and the run
    finishes every item."""
    ids = write_input(tmp_path / "input.jsonl", 300)
    write_job(tmp_path / "job.yaml", shards=2, concurrency=4,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                        "sim": {**FAST_SIM, "ttft_ms": 50}})
    proc = _run_job(tmp_path,
                    preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        _wait_for(proc, lambda: _result_lines(tmp_path / "runs") >= 20, "20 results")
        proc.send_signal(signal.SIGHUP)
        _, err = proc.communicate(timeout=WAIT_GUARD_S)
    finally:
        end_run(proc)
    assert proc.returncode == 0, err
    counts = Counter(r["id"] for r in Run.load(only_run(tmp_path / "runs")).results)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}


def test_sigint_during_rate_limit_waits_ends_at_once(tmp_path: Path) -> None:
    """A job held back by its own rate limit (6 requests a minute), interrupted: nothing is in
    flight, so the stop does not wait out the grace period (30 s) nor the rate limit's waits;
    what waited is abandoned, and a --resume without the limit does every id exactly once."""
    ids = write_input(tmp_path / "input.jsonl", 12)
    write_job(tmp_path / "job.yaml", shards=1, concurrency=4, shutdown_grace_s=30,
              rate_limits={"rpm": 6})  # fmt: skip
    _, proc, err, took, _ = _interrupted(tmp_path, lambda p: _wait_for(
        p, lambda: _result_lines(tmp_path / "runs") > 0, "a first result"))
    # Behaviour, not speed: neither the 30 s grace nor a 10 s wait for the limit was sat out.
    assert took < 10, f"the stop took {took:.1f} s"
    assert proc.returncode == 130 and "Traceback" not in err, err
    path = only_run(tmp_path / "runs")
    assert not Run.load(path).dead
    resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "latest", "--rpm", "none",
                      cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    counts = Counter(r["id"] for r in Run.load(path).results)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}


def test_a_stop_during_a_retrys_wait_starts_no_attempt(tmp_path: Path) -> None:
    """Every request answered 429 with Retry-After 20 s: each item waits to be retried when the
    stop comes. The waits end at once, no attempt starts after the stop (a retry then would be
    no verdict on the item), nothing is dead-lettered, and the run ends at once."""
    write_input(tmp_path / "input.jsonl", 8)
    sim = {**FAST_SIM, "fail_429": 1.0, "retry_after_s": 20}
    write_job(tmp_path / "job.yaml", shards=1, concurrency=4, shutdown_grace_s=30,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim})

    def every_slot_got_a_429() -> bool:  # each slot's first attempt refused: all are waiting
        # (attempt ends, not `retry` lines: a retry's line is written when it is sent, 20 s on)
        logs = list((tmp_path / "runs").glob("*/events/shard-*.jsonl"))
        return bool(logs) and logs[0].read_bytes().count(b'"status":"http_429"') >= 4

    _, proc, err, took, wall = _interrupted(
        tmp_path, lambda p: _wait_for(p, every_slot_got_a_429, "every slot's first 429"))
    assert took < 10, f"the stop took {took:.1f} s"  # not the 20 s the server asked, nor 30
    assert proc.returncode == 130 and "Traceback" not in err, err
    run = Run.load(only_run(tmp_path / "runs"))
    late = [e for e in run.events if e.get("ev") == "attempt_start" and e["t"] > wall]
    assert late == [] and not run.dead and not run.results


def test_a_first_sigterm_stops_gracefully_after_the_reader_of_the_output_left(
        tmp_path: Path) -> None:
    """`shardrun job.yaml 2>&1 | head -2`, then SIGTERM: the line announcing the stop cannot be
    written, and the stop still happens, the in-flight requests finishing (none cancelled).
    The write's BrokenPipeError used to end the signal handler before it told the shards, so
    the run went on (for hours, under a rate limit) until a second signal aborted it."""
    _slow_job(tmp_path, ttft_ms=1500)
    # Items held for a rate limit, as in the incident where it was found: a request each
    # shard goes at once, the rest wait for hours unless the stop ends the pass.
    proc = _run_job(tmp_path, "--progress-interval", "0.2", "--tpm", "1.5",
                    stderr=subprocess.STDOUT)
    events = tmp_path / "runs"
    try:
        assert proc.stdout is not None
        for _ in range(2):  # two progress lines: the run is going
            assert proc.stdout.readline()
        proc.stdout.close()  # the reader leaves, as `head -2` does
        _wait_for(proc, lambda: _a_request_sent(events), "a request sent")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130  # a hang guard: the stop takes ~1.5 s
    finally:
        end_run(proc)
    run = only_run(events)
    ends = [r for f in (run / "events").glob("shard-*.jsonl") for r in map(
        orjson.loads, f.read_bytes().splitlines()) if r["ev"] == "attempt_end"]
    assert ends and Counter(r["status"] for r in ends) == {"ok": len(ends)}
    last = orjson.loads((run / "events" / "coordinator.jsonl").read_bytes().splitlines()[-2])
    assert last["ev"] == "run_end" and last["status"] == "interrupted"


def test_the_progress_line_of_a_stopping_run_says_so_and_shows_no_eta(tmp_path: Path) -> None:
    """A first SIGINT lets the requests in flight finish: the progress lines printed meanwhile
    say the run is stopping and how many requests it waits for, with no ETA (it ends with
    them, not at the total)."""
    # A stop of up to 4 s: lines at 0.2 s while requests are in flight, even on a loaded
    # machine that sees the first attempt_start late (the log is flushed 5 times a second).
    _slow_job(tmp_path, ttft_ms=4000)
    proc = _run_job(tmp_path, "--progress-interval", "0.2", stdout=subprocess.DEVNULL)
    try:
        _wait_for(proc, lambda: _a_request_sent(tmp_path / "runs"), "a request sent")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)  # a hang guard: the stop takes at most ~4 s
        assert proc.returncode == 130
    finally:
        end_run(proc)
    after_stop = err.split("stopping: letting in-flight requests finish", 1)[1]
    lines = [line for line in after_stop.splitlines() if line.startswith("[")]
    assert lines  # progress lines while the requests in flight finish
    assert all(", ETA " not in line for line in lines)
    assert re.search(r"; stopping: [1-9][0-9]* requests? in flight to finish$", lines[0])


def test_a_second_sigint_says_what_it_cancelled_what_is_kept_and_how_to_resume(
    tmp_path: Path,
) -> None:
    """A second Ctrl-C aborted the requests in flight without a word before the summary: now
    one line says they are cancelled, that what is written is kept, and the command that goes
    on; that command, as printed, finishes every item once."""
    ids = write_input(tmp_path / "input.jsonl", 60)
    # Half the requests wait 30 s for their first token: in flight at both signals, while the
    # other half have written results by then.
    slow = {**FAST_SIM, "slow_first_token": 0.5, "slow_first_token_s": 30}
    write_job(tmp_path / "job.yaml", shards=2, concurrency=4,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": slow})
    proc = _run_job(tmp_path, "--quiet")
    said: list[str] = []
    printed: list[str] = []
    # Both pipes read as they fill, each by its thread, and joined within a bound: a read
    # after the exit could wait on a pipe some process left behind still holds.
    readers = [threading.Thread(target=lambda: said.extend(proc.stderr or []), daemon=True),
               threading.Thread(target=lambda: printed.extend(proc.stdout or []), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        _wait_for(proc, lambda: _result_lines(tmp_path / "runs") >= 2, "results")
        proc.send_signal(signal.SIGINT)
        _wait_for(proc, lambda: any(line.startswith("stopping: ") for line in said),
                  "the stop's line")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=WAIT_GUARD_S)
        for reader in readers:
            reader.join(WAIT_GUARD_S)
        out = "".join(printed)
    finally:
        end_run(proc)
    assert proc.returncode == 130, said
    run = only_run(tmp_path / "runs")
    kept = Run.load(run).results
    assert 2 <= len(kept) < len(ids)
    [aborting] = [line for line in said if line.startswith("aborting")]
    assert aborting == ("aborting: the requests in flight are cancelled, their items left "
                        "unfinished; every result and dead letter already written is kept: "
                        f"continue with `shardrun job.yaml --resume {run.name} --runs-dir "
                        "runs`\n"), said
    assert "run interrupted" in out
    command = shlex.split(aborting.split("`")[1])
    write_job(tmp_path / "job.yaml", shards=2, concurrency=4,  # no slow requests left to wait
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": FAST_SIM})
    resumed = run_cli(*command[1:], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    whole = Run.load(run)
    assert sorted(r["id"] for r in whole.results) == sorted(ids)
    assert {r["id"]: r for r in whole.results} | {r["id"]: r for r in kept} == {
        r["id"]: r for r in whole.results}  # what was kept is still there, as it was

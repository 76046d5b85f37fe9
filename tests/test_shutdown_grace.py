"""shutdown_grace_s bounds a stop even when every slot holds a stalled stream.

The real CLI runs as a process against the embedded simulator (its own process, loopback).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson

from tests.conftest import FAST_SIM, Run, only_run, run_cli, write_input, write_job

GRACE_S = 2
STALL_S = 30  # far beyond the grace: a stop that waits for the stalls is plainly late
WAIT_GUARD_S = 120.0  # hang guard only
QUIET_S = 1.0  # no new result for this long: every slot holds a stalled stream


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
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDRUN_")}
    proc = subprocess.Popen([sys.executable, "-m", "shardrun", "job.yaml", "--runs-dir", "runs"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        earned = _wait_until_every_slot_stalls(tmp_path / "runs", proc)
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=WAIT_GUARD_S)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:  # only on a failure above: end the run we started
            proc.kill()
            proc.communicate(timeout=WAIT_GUARD_S)
    # Behaviour, not speed: the stop did not wait for the stalls (half of them is far above the
    # grace and whatever a busy machine adds to a flush and the simulator's stop).
    assert took < STALL_S / 2, f"the stop took {took:.1f} s (grace {GRACE_S} s)"
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    path = only_run(tmp_path / "runs")
    first = Run.load(path)
    assert first.manifest["status"] == "interrupted"
    assert not first.dead  # cancelled by the stop: no verdict on the item
    assert len(first.results) == earned  # nothing earned was lost, nothing new came
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

"""A shard's open-file limit: raised to what its cap needs, and a run that still runs out of
file descriptors stops with the numbers and loses nothing (`shardrun.fdlimit`)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

from conftest import CLI_TIMEOUT_S, FAST_SIM, Run, only_run, read_jsonl, write_input, write_job

from shardrun.sim.config import SimConfig
from shardrun.sim.launcher import start_sim


def test_the_soft_limit_is_raised_within_the_hard_one() -> None:
    """In a process started with 100 soft and 200 hard: a cap of 20 needs 84 (nothing to do),
    one of 50 needs 114, one of 1,000 gets the hard limit."""
    code = ("import resource\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 200))\n"
            "from shardrun.fdlimit import ensure_open_files as e\n"
            "print(e(20), e(50), e(1000), resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.split() == ["100", "114", "200", "(200,", "200)"]


def _limited(hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def test_running_out_of_file_descriptors_stops_the_run_and_loses_nothing(tmp_path: Path) -> None:
    """A shard whose cap (300) is above what the machine allows it (160 open files): the run
    stops with one sentence naming the limit, dead-letters nothing (the items were never the
    problem), and a resume at a lower concurrency, under the same limit, answers every item
    exactly once."""
    n = 600
    write_input(tmp_path / "input.jsonl", n)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    # The simulator runs apart, with this process's own limit: only the client is short.
    # Answers take 300 ms to start, so the first run's connections pile up to its cap.
    with start_sim(SimConfig.from_mapping({**FAST_SIM, "ttft_ms": 300})) as sim:
        write_job(tmp_path / "job.yaml", shards=1, concurrency=300,
                  endpoint={"base_url": sim.base_url, "api": "chat", "model": "m"})
        argv = [sys.executable, "-m", "shardrun", "job.yaml", "--runs-dir", "runs",
                "--run-id", "r1", "--quiet"]  # fmt: skip
        short = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL,
                               preexec_fn=lambda: _limited(160))  # fmt: skip
    assert short.returncode == 1, short.stdout + short.stderr
    assert "ran out of file descriptors" in short.stdout
    assert "a limit of 160 open files per process: raise it (ulimit -n)" in short.stdout
    assert "Traceback" not in short.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert run.dead == []
    assert len(run.results) < n
    # The rest from a simulator that answers at once (the 300 ms were for the pile-up only).
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as fast:
        again = subprocess.run([*argv[:-3], "--resume", "r1", "--concurrency", "20", "--quiet"],
                               cwd=tmp_path, env={**env, "SHARDRUN_BASE_URL": fast.base_url},
                               capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                               stdin=subprocess.DEVNULL, preexec_fn=lambda: _limited(160))
    assert again.returncode == 0, again.stdout + again.stderr
    ids = [r["id"] for r in Run.load(only_run(tmp_path / "runs")).results]
    assert sorted(ids) == sorted(r["id"] for r in read_jsonl(tmp_path / "input.jsonl"))


def test_too_many_shards_for_the_coordinators_file_limit_is_one_sentence(tmp_path: Path) -> None:
    """40 shards need about 264 descriptors in the coordinator while it starts them; a process
    allowed 100 says so before it makes a run directory, not with a traceback part-way through.
    Allowed 300, the coordinator raises its own soft limit (100) and the run goes through."""
    write_input(tmp_path / "input.jsonl", 50)
    write_job(tmp_path / "job.yaml", shards=40, concurrency=2)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    argv = [sys.executable, "-m", "shardrun", "job.yaml", "--runs-dir", "runs", "--quiet"]

    def run_with(soft: int, hard: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=CLI_TIMEOUT_S, stdin=subprocess.DEVNULL,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                    (soft, hard)))

    short = run_with(100, 100)
    assert (short.returncode, short.stderr) == (
        1, "error: 40 shards need about 264 open files in the coordinator, and this process may "
           "open 100 (ulimit -n): raise the limit, or run fewer shards\n")  # fmt: skip
    assert not (tmp_path / "runs").exists()
    enough = run_with(100, 300)
    assert enough.returncode == 0, enough.stdout + enough.stderr


def test_the_simulator_makes_room_for_its_connections(tmp_path: Path) -> None:
    """Started with a soft limit of 100 under a hard one of 20,000, the simulator raises its
    own (a run with hundreds in flight would otherwise see its connections reset)."""
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 20000))\n"
            "from shardrun.sim.launcher import start_sim\n"
            "from shardrun.sim.config import SimConfig\n"
            "with start_sim(SimConfig.from_mapping({})) as sim:\n"
            "    limits = open(f'/proc/{sim.pid}/limits').read()\n"
            "print([x.split()[3] for x in limits.splitlines() if x.startswith('Max open')])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "['16448']"  # 16,384 connections and 64 more

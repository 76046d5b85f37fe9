"""The whole run path through the real CLI, in a subprocess, against the simulator on loopback."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from shardrun.argtypes import with_close_flags
from shardrun.sim.config import SimConfig
from shardrun.sim.launcher import start_sim
from shardrun.spans import BUCKETS
from tests.conftest import FAST_SIM, Run, only_run, read_jsonl, run_cli, write_input, write_job
from tests.test_aggregate_fixtures import to_old_layout, write_records

SENTINEL_KEY = "sk-test-SENTINEL-0123456789"


def assert_exactly_once(run: Run, ids: list[str]) -> None:
    """Every input id has exactly one result line, and nothing else is there."""
    counts = Counter(r["id"] for r in run.results)
    assert not [i for i, c in counts.items() if c > 1], "duplicated results"
    assert set(counts) == set(ids)
    assert not run.dead


def assert_buckets_telescope(run: Run) -> None:
    """The six buckets of every span sum to its end-to-end time within 1 µs; t_retry is 0 for
    a first-try success (DESIGN §3): the loop's delay before an attempt is queueing."""
    for r in run.results:
        b = r["buckets"]
        assert set(b) == set(BUCKETS)
        assert all(v >= 0 for v in b.values()), r
        assert (b["t_retry"] == 0) == (r["attempts"] == 1), r
        assert abs(sum(b.values()) - r["e2e"]) < 1e-6
        assert r["e2e"] == pytest.approx(r["released_at"] - r["queued_at"], abs=1e-6)


LEGACY_EVENTS = {"conn_ready", "first_token", "last_token"}
END_FIELDS = ["run_id", "shard", "ev", "t", "span", "id", "attempt", "status", "http",
              "retry_after", "conn_ready_t", "reused", "resent", "first_token_t", "last_token_t",
              "tokens", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens",
              "usage_estimated", "wasted_tokens", "error", "itl_hist"]


def attempt_ends(run: Run) -> list[tuple[dict[str, Any], float]]:
    """Every attempt_end with the `t` of its attempt_start; checks the layout on the way."""
    starts = {(e["span"], e["attempt"]): e["t"] for e in run.events if e["ev"] == "attempt_start"}
    ends = [e for e in run.events if e["ev"] == "attempt_end"]
    assert not [e for e in run.events if e["ev"] in LEGACY_EVENTS]
    # `at_once` only on an answer whose first read held all of it (a client that fell behind)
    assert all(list(e) in (END_FIELDS, [*END_FIELDS, "at_once"]) for e in ends), \
        "attempt_end fields or their order"
    return [(e, starts[e["span"], e["attempt"]]) for e in ends]


def assert_attempt_ends_carry_the_instants(run: Run) -> None:
    """Each ok attempt_end holds the instants the result line's buckets were made from."""
    results = {r["span"]: r for r in run.results}
    ok = 0
    for end, start in attempt_ends(run):
        if end["status"] != "ok":
            continue
        ok += 1
        r = results[end["span"]]
        first, last = end["first_token_t"], end["last_token_t"]
        assert (r["first_token_at"], r["last_token_at"]) == (first, last)
        assert end["tokens"] == r["usage"]["completion_tokens"] >= 1  # the sim counts chunks
        conn = end["conn_ready_t"]
        assert start <= conn <= first <= last <= end["t"]
        assert r["buckets"]["t_conn"] == pytest.approx(conn - start, abs=1e-9)
        if end["reused"]:
            assert conn == start  # a pooled connection is ready when the attempt starts
    assert ok == len(run.results)


def test_sim_run_four_shards_2000_items(tmp_path: Path, no_stray_children: None) -> None:
    """4 shards on sim:// answer 2,000 items exactly once, buckets telescope, logs parse."""
    ids = write_input(tmp_path / "input.jsonl", 2000)
    write_job(tmp_path / "job.yaml",
              endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                        "api_key_env": "TEST_KEY", "sim": FAST_SIM})
    proc = run_cli("--shards", "4", "job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                   env={"TEST_KEY": SENTINEL_KEY})
    assert proc.returncode == 0, proc.stderr
    assert "succeeded          2,000" in proc.stdout
    run = Run.load(only_run(tmp_path / "runs"))
    assert_exactly_once(run, ids)
    assert_buckets_telescope(run)
    per_shard = Counter(r["shard"] for r in run.results)
    assert sorted(per_shard) == [0, 1, 2, 3] and min(per_shard.values()) > 0
    kinds = Counter(e["ev"] for e in run.events)
    assert kinds["queued"] == kinds["admitted"] == kinds["released"] == 2000
    assert kinds["attempt_end"] == kinds["attempt_start"] >= 2000
    assert_attempt_ends_carry_the_instants(run)
    reused = Counter(bool(e["reused"]) for e, _ in attempt_ends(run))
    assert reused[True] > 0 and reused[False] > 0
    assert all(e["run_id"] == run.manifest["run_id"] for e in run.events)
    for path in run.path.rglob("*"):
        if path.is_file():
            assert SENTINEL_KEY.encode() not in path.read_bytes(), f"API key leaked into {path}"


def test_a_small_input_is_split_evenly(tmp_path: Path) -> None:
    """200 items on 8 shards of 32: no batch holds more than an even part (25), whatever order
    the shards ask in. Before, the first four to ask got 64, 64, 64 and 8, the others none."""
    ids = write_input(tmp_path / "input.jsonl", 200)
    write_job(tmp_path / "job.yaml",
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": FAST_SIM})
    proc = run_cli("--shards", "8", "--concurrency", "32", "job.yaml", "--runs-dir", "runs",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert_exactly_once(run, ids)
    coordinator = read_jsonl(run.path / "events" / "coordinator.jsonl")
    batches = [e["n"] for e in coordinator if e["ev"] == "batch"]
    assert sum(batches) == 200 and max(batches) <= 200 // 8, batches


def test_manifest_lists_files_and_sources(tmp_path: Path) -> None:
    """The manifest records effective values with sources and every file with its hash."""
    write_input(tmp_path / "input.jsonl", 50)
    write_job(tmp_path / "job.yaml")
    proc = run_cli("job.yaml", "--runs-dir", "runs", "--concurrency", "3", "--run-id", "m1",
                   cwd=tmp_path, env={"SHARDRUN_SHARDS": "3"})
    assert proc.returncode == 0, proc.stderr
    run = Run.load(tmp_path / "runs" / "m1")
    eff = run.manifest["effective"]
    assert eff["shards"] == {"value": 3, "source": "env SHARDRUN_SHARDS"}
    assert eff["concurrency"] == {"value": 3, "source": "flag --concurrency"}
    assert eff["endpoint.model"]["source"] == "job file"
    assert run.manifest["status"] == "succeeded" and run.manifest["shards"] == 3
    listed = {f["path"]: f for f in run.manifest["files"]}
    assert {"events/shard-02.jsonl", "results/shard-02.jsonl"} <= set(listed)
    for rel, entry in listed.items():
        data = (run.path / rel).read_bytes()
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()


def test_separately_started_sim_over_http(tmp_path: Path, no_stray_children: None) -> None:
    """Against `shardrun sim` started on its own, the server sees each item once, within the cap."""
    ids = write_input(tmp_path / "input.jsonl", 2000)
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as sim:
        write_job(tmp_path / "job.yaml",
                  endpoint={"base_url": sim.base_url, "api": "chat", "model": "m"})
        proc = run_cli("--shards", "4", "--concurrency", "8", "job.yaml", "--runs-dir", "runs",
                       cwd=tmp_path)
        with urllib.request.urlopen(sim.base_url.removesuffix("/v1") + "/sim/stats") as resp:
            stats = orjson.loads(resp.read())
    assert proc.returncode == 0, proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert_exactly_once(run, ids)
    assert_buckets_telescope(run)
    assert stats["requests_total"] == 2000
    # The cap holds at the server (4 shards x 8); whether all 32 are there at one instant
    # depends on the machine (a loaded one saw 31), so that the cap is reached, with a backlog,
    # is read from each shard's own log: 8 spans admitted and not yet released.
    assert stats["max_in_flight"] <= 32
    assert _most_in_flight(run) == {shard: 8 for shard in range(4)}


def _most_in_flight(run: Run) -> dict[int, int]:
    """Per shard, the most spans admitted and not yet released at once, in log order."""
    now: dict[int, int] = {}
    most: dict[int, int] = {}
    for e in run.events:
        step = {"admitted": 1, "released": -1}.get(e["ev"], 0)
        if step:
            now[e["shard"]] = now.get(e["shard"], 0) + step
            most[e["shard"]] = max(most.get(e["shard"], 0), now[e["shard"]])
    return most


def test_base_url_from_the_environment_sets_a_sim_job_aside(tmp_path: Path) -> None:
    """SHARDRUN_BASE_URL points a job written for sim:// at another server: its `sim:` block
    is ignored with one warning, the requests reach that server, the manifest says so."""
    ids = write_input(tmp_path / "input.jsonl", 30)
    write_job(tmp_path / "job.yaml")  # base_url sim:// with a sim: block
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as sim:
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                       env={"SHARDRUN_BASE_URL": sim.base_url})
        with urllib.request.urlopen(sim.base_url.removesuffix("/v1") + "/sim/stats") as resp:
            stats = orjson.loads(resp.read())
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "endpoint.sim" in line]
    assert warnings == [f"warning: job.yaml: endpoint.sim is ignored: endpoint.base_url is "
                        f"{sim.base_url} from env SHARDRUN_BASE_URL, not sim://"]
    assert stats["requests_total"] == 30
    run = Run.load(only_run(tmp_path / "runs"))
    assert_exactly_once(run, ids)
    effective = run.manifest["effective"]
    assert effective["endpoint.base_url"] == {"value": sim.base_url,
                                              "source": "env SHARDRUN_BASE_URL"}
    assert effective["endpoint.sim"] == {
        "value": None, "source": "ignored: endpoint.base_url from env SHARDRUN_BASE_URL"}


def test_summary_client_cpu_is_the_whole_client_tree(tmp_path: Path) -> None:
    """The summary's client CPU covers the coordinator, the launcher and every shard: the kernel's
    account of the whole process tree (os.wait4) matches it, less what runs after the summary."""
    write_input(tmp_path / "input.jsonl", 3000)
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as sim:
        write_job(tmp_path / "job.yaml",
                  endpoint={"base_url": sim.base_url, "api": "chat", "model": "m"})
        with subprocess.Popen([sys.executable, "-m", "shardrun", "job.yaml", "--shards", "4",
                               "--runs-dir", "runs"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL) as proc:  # fmt: skip
            assert proc.stdout is not None
            out = proc.stdout.read().decode()
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    assert proc.returncode == 0, out
    tree = usage.ru_utime + usage.ru_stime
    reported = orjson.loads((only_run(tmp_path / "runs") / "manifest.json").read_bytes())[
        "summary"]["client_cpu_s"]
    line = next(x for x in out.splitlines() if x.startswith("  client CPU"))
    assert line.startswith("  client CPU         ") and " s  (" in line, line
    # The manifest holds the figure rounded to 1 ms, the line shows the unrounded one to 0.1 s
    # and divides it per attempt: each may round apart from the manifest's at its last digit.
    shown = float(line.split()[2].replace(",", ""))
    assert shown == pytest.approx(reported, abs=0.05 + 0.0005), (line, reported)
    per_attempt = float(line.split("(", 1)[1].split(" ms per attempt", 1)[0])
    assert per_attempt == pytest.approx(reported / 3000 * 1e3, abs=0.005 + 0.0005 / 3), line
    # Four shards do most of the work; the coordinator alone would be far below this.
    assert 0.8 * tree <= reported <= tree, (reported, tree)


BURN_S = 1.5


def test_client_cpu_leaves_out_what_a_shell_ran_before_exec_ing_shardrun(tmp_path: Path) -> None:
    """`sh -c 'pip install ...; exec shardrun ...'`: the shell's reaped children (here a child
    that burns BURN_S of CPU) pass their time down through exec; the summary must not count it."""
    write_input(tmp_path / "input.jsonl", 500)
    burn = (f"import time\nt = time.process_time()\nwhile time.process_time() - t < {BURN_S}:"
            "\n    pass")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as sim:
        write_job(tmp_path / "job.yaml",
                  endpoint={"base_url": sim.base_url, "api": "chat", "model": "m"})
        script = (f"{shlex.quote(sys.executable)} -c {shlex.quote(burn)} && exec "
                  f"{shlex.quote(sys.executable)} -m shardrun job.yaml --shards 2 --runs-dir runs")
        with subprocess.Popen(["sh", "-c", script], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL) as proc:  # fmt: skip
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0
    tree = usage.ru_utime + usage.ru_stime  # the burner, the shell and shardrun's whole tree
    reported = orjson.loads((only_run(tmp_path / "runs") / "manifest.json").read_bytes())[
        "summary"]["client_cpu_s"]
    assert 0 < reported <= tree - BURN_S + 0.05


def test_messages_field_and_completions_api(tmp_path: Path) -> None:
    """Chat message lists and the completions API both run end to end."""
    with open(tmp_path / "input.jsonl", "wb") as f:
        for i in range(40):
            msgs = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"Hello {i} héllo 世界"}]
            f.write(orjson.dumps({"id": i, "messages": msgs}) + b"\n")
        # Lists no server takes are rejects at read time (lines 41, 42), never requests.
        f.write(b'{"id": "x", "messages": [{"role": "user"}]}\n'
                b'{"id": "y", "messages": [{"role": "user", "content": "Q"}, {"content": "A"}]}\n')
    write_job(tmp_path / "job.yaml", input={"path": "input.jsonl", "messages_field": "messages"})
    assert run_cli("job.yaml", "--runs-dir", "a", cwd=tmp_path).returncode == 1  # rejects
    chat = Run.load(only_run(tmp_path / "a"))
    assert sorted(int(r["id"]) for r in chat.results) == list(range(40))
    assert len(attempt_ends(chat)) == 40
    rejects = [orjson.loads(x) for x in (chat.path / "rejects.jsonl").read_bytes().splitlines()]
    assert [(r["line"], r["id"], r["reason"]) for r in rejects] == [
        (41, "x", "messages[0] has no content"), (42, "y", "messages[1] has no role")]

    write_input(tmp_path / "plain.jsonl", 40)
    write_job(tmp_path / "c.yaml", input={"path": "plain.jsonl"},
              endpoint={"base_url": "sim://", "api": "completions", "model": "m", "sim": FAST_SIM})
    proc = run_cli("c.yaml", "--runs-dir", "c", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    completions = Run.load(only_run(tmp_path / "c"))
    assert len(completions.results) == 40
    assert all(r["output"] and r["usage"]["completion_tokens"] > 0 for r in completions.results)


def test_bad_job_file_is_one_error_line(tmp_path: Path) -> None:
    """An unknown key gives exit 2 and one `error:` line naming file and key, no traceback."""
    write_input(tmp_path / "input.jsonl", 5)
    write_job(tmp_path / "job.yaml", concurency=4)
    proc = run_cli("job.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: job.yaml"), proc.stderr
    assert "concurency" in lines[0] and "concurrency" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_missing_input_is_one_error_line(tmp_path: Path) -> None:
    """A missing input file gives exit 2, one `error:` line, and no run directory."""
    write_job(tmp_path / "job.yaml", input={"path": "nope.jsonl"})
    proc = run_cli("job.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "nope.jsonl" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_bad_environment_value_names_the_variable(tmp_path: Path) -> None:
    """A bad SHARDRUN_CONCURRENCY is an exit-2 error naming the variable."""
    write_input(tmp_path / "input.jsonl", 5)
    write_job(tmp_path / "job.yaml")
    proc = run_cli("job.yaml", cwd=tmp_path, env={"SHARDRUN_CONCURRENCY": "lots"})
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "SHARDRUN_CONCURRENCY" in proc.stderr
    # A runs directory that cannot be made names where it came from.
    (tmp_path / "a-file").write_text("")
    proc = run_cli("job.yaml", cwd=tmp_path, env={"SHARDRUN_RUNS_DIR": "a-file"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: cannot create run directory in a-file: ")
    assert " (runs_dir from env SHARDRUN_RUNS_DIR); set runs_dir" in proc.stderr


def test_a_variable_of_only_spaces_is_unset_as_an_empty_one_is(tmp_path: Path) -> None:
    """`SHARDRUN_SHARDS=" "` was an error ("must be an integer ..., got ' '") where
    `SHARDRUN_SHARDS=` is unset, though a value loses the spaces around it: both are unset now,
    for shardrun's variables and for the unknown-name check alike."""
    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml", shards=3)
    said = {}
    for blank in ("", " ", "\t  "):
        proc = run_cli("validate", "job.yaml", cwd=tmp_path,
                       env={"SHARDRUN_SHARDS": blank, "SHARDRUN_CONCURENCY": blank})
        assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
        said[blank] = [line.split() for line in proc.stdout.splitlines()
                       if line.split()[:1] in (["shards"], ["concurrency"])]
    assert said[" "] == said["\t  "] == said[""] == [["shards", "3", "job", "file"],
                                                   ["concurrency", "8", "job", "file"]]
    assert ("\na variable set to nothing, or to spaces only, counts as not set):\n"
            in run_cli("--help", cwd=tmp_path).stdout)


@pytest.mark.parametrize(("argv", "pointed"), [
    (["run", "job.yaml", "--limit", "x"], False), (["job.yaml", "--no-such-flag"], True),
    (["retry-failed"], True), (["validate", "job.yaml", "--show", "-1"], False),
    (["report"], True), (["publish", "r", "--peak", "--minute", "2026-01-01T00:00Z"], True),
    (["verify"], True), (["export", "r", "--format", "tsv"], False),
    (["sim", "--port", "x"], False),
])  # fmt: skip
def test_a_usage_error_is_one_error_line(tmp_path: Path, argv: list[str],
                                         pointed: bool) -> None:
    """What argparse cannot take is one `error:` line, exit 2, for every command (README: a
    bad flag is one `error:` line), not the usage block: pointing at the command's --help
    where the command was called wrong, and saying what the value must be for a bad value."""
    proc = run_cli(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    [line] = proc.stderr.splitlines()
    command = "shardrun " + ("run" if argv[0] == "job.yaml" else argv[0])
    assert line.startswith("error: ") and line.endswith(
        f"(`{command} --help` lists the arguments)") == pointed, line
    if argv[0] == "validate":  # a count below 0 would list "the first 0" rejected lines
        assert line == ("error: --show must be an integer of at least 0 (rejected lines to "
                        "list), got '-1'"), line


@pytest.mark.parametrize(("argv", "wants"), [
    (["job.yaml", "--shards", "abc"], "--shards must be an integer from 1 to 1024, got 'abc'"),
    (["job.yaml", "--concurrency", "2.5"],
     "--concurrency must be an integer from 1 to 100000, got '2.5'"),
    (["job.yaml", "--limit", "abc"], "--limit must be an integer of at least 1 (items to run), "
                                     "got 'abc'"),
    (["job.yaml", "--progress-interval", "abc"],
     "--progress-interval must be a number of seconds of at least 0.1 (a status line ten "
     "times a second at most), got 'abc'"),
    (["retry-failed", "r", "--progress-interval", "abc"],
     "--progress-interval must be a number of seconds of at least 0.1 (a status line ten "
     "times a second at most), got 'abc'"),
    (["validate", "job.yaml", "--shards", "abc"],
     "--shards must be an integer from 1 to 1024, got 'abc'"),
    (["validate", "job.yaml", "--show", "abc"],
     "--show must be an integer of at least 0 (rejected lines to list), got 'abc'"),
    # Written as --shards and SHARDRUN_SHARDS must be: Python's int() took `1_000`.
    (["job.yaml", "--limit", "1_000"],
     "--limit must be an integer of at least 1 (items to run), got '1_000'"),
    (["validate", "job.yaml", "--show", "1_0"],
     "--show must be an integer of at least 0 (rejected lines to list), got '1_0'"),
    (["job.yaml", "--shards", "1_0"], "--shards must be an integer from 1 to 1024, got '1_0'"),
    (["export", "r", "--progress-interval", "abc"],
     "--progress-interval must be a number of seconds of at least 0.1 (a status line ten "
     "times a second at most), got 'abc'"),
    # A line per row read or written: a floor, for every command that takes the flag.
    (["job.yaml", "--progress-interval", "1e-9"],
     "--progress-interval must be a number of seconds of at least 0.1"),
    (["validate", "job.yaml", "--progress-interval", "0.05"],
     "--progress-interval must be a number of seconds of at least 0.1"),
    (["export", "r", "--progress-interval", "1e-9"],
     "--progress-interval must be a number of seconds of at least 0.1"),
    (["sim", "--port", "abc"], "--port must be an integer, got 'abc'"),
    (["sim", "--ttft-ms", "abc"], "--ttft-ms must be a number, got 'abc'"),
    (["job.yaml", "--limit", "0"],
     "--limit must be an integer of at least 1 (items to run), got '0'"),
    # Not numbers, said the same way: a choice, and a true/false flag of the simulator.
    (["export", "r", "--format", "tsv"], "--format must be one of 'jsonl', 'csv', got 'tsv'"),
    (["sim", "--keepalive", "maybe"], "--keepalive must be true or false, got 'maybe'"),
])  # fmt: skip
def test_a_numeric_flag_says_what_it_wants_as_its_variable_does(
    tmp_path: Path, argv: list[str], wants: str
) -> None:
    """`--shards abc` said argparse's "invalid int value: 'abc'" where SHARDRUN_SHARDS=abc says
    what the knob takes: every numeric flag, of every command, now says what it wants in the
    variable's words, one `error:` line, exit 2."""
    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml")
    proc = run_cli(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"error: {wants}"), line
    # As the job's own checks say --shards abc: the sentence says what the value must be, and
    # --help, which a flag the command does not take is pointed at, would add nothing.
    assert "--help" not in line, line
    if argv[1] == "--shards":  # the variable's sentence, word for word
        env = run_cli("job.yaml", cwd=tmp_path, env={"SHARDRUN_SHARDS": argv[2]})
        assert env.stderr == proc.stderr.replace("--shards", "environment variable "
                                                 "SHARDRUN_SHARDS"), env.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("argv", "said"), [
    (["job.yaml", "--limit"], "argument --limit: expected one argument"),
    (["publish", "r", "--minute", "x", "--peak"],
     "argument --peak: not allowed with argument --minute"),
    (["sim", "--port"], "argument --port: expected one argument"),
])  # fmt: skip
def test_a_flag_given_in_the_wrong_shape_points_at_help(
    tmp_path: Path, argv: list[str], said: str
) -> None:
    """No value after a flag, or two flags that exclude each other: how the command is called
    is wrong, not a value, so --help is pointed at, as for a flag the command does not take."""
    proc = run_cli(*argv, cwd=tmp_path)
    command = "run" if argv[0] == "job.yaml" else argv[0]
    assert (proc.returncode, proc.stderr) == (2, (
        f"error: {said} (`shardrun {command} --help` lists the arguments)\n"))


def test_a_job_file_named_as_a_command_is_pointed_at_when_the_command_fails(
    tmp_path: Path,
) -> None:
    """`shardrun report` with a job file ./report: the command word wins, and its usage error
    says how to run the file instead."""
    (tmp_path / "report").write_text("endpoint: {base_url: sim://, model: m}\n")
    proc = run_cli("report", cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (2, (
        "error: the following arguments are required: RUN_DIR (`shardrun report --help` lists "
        "the arguments); to run the job file ./report, give `shardrun run report`\n"))
    proc = run_cli("verify", cwd=tmp_path)  # no file ./verify: no such note
    assert proc.stderr.endswith("(`shardrun verify --help` lists the arguments)\n")


@pytest.mark.parametrize(("argv", "bad", "command"), [
    (["--bogus"], "--bogus", "run"), (["--shards", "2", "--bogus=1"], "--bogus=1", "run"),
    (["run", "-x"], "-x", "run"), (["report", "--nope"], "--nope", "report"),
])  # fmt: skip
def test_an_unknown_option_alone_is_named_not_the_missing_argument(
    tmp_path: Path, argv: list[str], bad: str, command: str
) -> None:
    """`shardrun --bogus` said 'the following arguments are required: JOB.yaml': the flag is
    the mistake. Known flags (`--shards 2`) are not named."""
    proc = run_cli(*argv, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (2, (
        f"error: unrecognized arguments: {bad} (`shardrun {command} --help` lists the "
        "arguments)\n"))
    proc = run_cli("--shards", "2", "--concurrency", "-1", cwd=tmp_path)  # no unknown option
    assert proc.stderr == ("error: the following arguments are required: JOB.yaml (`shardrun "
                           "run --help` lists the arguments)\n")


@pytest.mark.parametrize(("argv", "bad", "command"), [
    (["job.yaml", "--con", "4"], "--con 4; did you mean --concurrency?", "run"),
    (["job.yaml", "--shard=2"], "--shard=2; did you mean --shards?", "run"),
    (["retry-failed", "runs/x", "--concurrenc", "2"], "--concurrenc 2; did you mean "
                                                      "--concurrency?", "retry-failed"),
    (["report", "runs/x", "--js"], "--js; did you mean --json?", "report"),
    (["export", "runs/x", "--with"], "--with; did you mean --with-input?", "export"),
    (["validate", "job.yaml", "--sho", "1"], "--sho 1; did you mean --show?", "validate"),
    (["sim", "--po", "0"], "--po 0; did you mean --port?", "sim"),
    # The command after the job file, and a flag after it: said what goes first.
    # Every flag given is kept, before or after the command word, in its place.
    (["job.yaml", "validate", "--ping"], "validate --ping; a command goes before the job file: "
                                        "`shardrun validate job.yaml --ping`", "run"),
    (["run", "--shards", "2", "job.yaml", "--show", "3", "validate"],
     "--show 3 validate; a command goes before the job file: "
     "`shardrun validate --shards 2 job.yaml --show 3`", "run"),
    # A flag's value that reads `validate` stays that flag's.
    (["--runs-dir", "validate", "job.yaml", "validate"], "validate; a command goes before the "
     "job file: `shardrun validate --runs-dir validate job.yaml`", "run"),
    (["my job.yaml", "validate"], "validate; a command goes before the job file: "
                                  "`shardrun validate 'my job.yaml'`", "run"),
    # Misspelt, not shortened: the closest flag; two unknown, each with its own.
    (["job.yaml", "--reseume", "latest"], "--reseume latest; did you mean --resume?", "run"),
    (["job.yaml", "--reseume=x", "--concurency=2"], "--reseume=x --concurency=2; did you mean "
                                                    "--resume for --reseume, --concurrency for "
                                                    "--concurency?", "run"),
])  # fmt: skip
def test_a_long_option_is_taken_only_in_full(
    tmp_path: Path, argv: list[str], bad: str, command: str
) -> None:
    """argparse read `--con 4` as --concurrency 4: a script written so would change meaning, or
    stop, the day a new flag shares the prefix. Every command, the simulator's included, names
    a shortened flag as unknown before it reads or starts anything, and the flag it shortens
    (or, misspelt, the closest one); `validate` after the job file is said to go before it."""
    write_job(tmp_path / argv[0] if argv[0].endswith(".yaml") else tmp_path / "job.yaml")
    proc = run_cli(*argv, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (2, (
        f"error: unrecognized arguments: {bad} (`shardrun {command} --help` lists the "
        "arguments)\n"))
    assert len(list(tmp_path.iterdir())) == 1  # the job file alone: nothing made


@pytest.mark.parametrize(("argv", "kept", "left_out"), [
    (["job.yaml", "--limit", "5", "validate"], "job.yaml", "--limit"),
    (["--runs-dir", "r", "--limit=5", "job.yaml", "--run-id", "x", "validate", "--ping",
      "--resume", "latest", "--retry-failed", "--limit", "2"], "--runs-dir r job.yaml --ping",
     "--limit, --run-id, --resume and --retry-failed"),
])  # fmt: skip
def test_validate_after_the_job_file_suggests_a_command_validate_takes(
    tmp_path: Path, argv: list[str], kept: str, left_out: str
) -> None:
    """`shardrun job.yaml --limit 5 validate`: the command suggested leaves out, with their
    values, the flags only a run takes (`validate` refuses them, so pasted as it was it failed
    too), says which it left out, and keeps every other word; pasted, it validates."""
    write_job(tmp_path / "job.yaml")
    write_input(tmp_path / "input.jsonl", 2)
    proc = run_cli(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    said = re.search(r"a command goes before the job file: `([^`]*)`, leaving out (.*), which "
                     r"only a run takes \(", proc.stderr)
    assert said is not None and said[2] == left_out, proc.stderr
    words = shlex.split(said[1])
    assert words == ["shardrun", "validate", *kept.split()]
    pasted = run_cli(*words[1:], cwd=tmp_path)
    assert pasted.returncode == 0, pasted.stderr
    assert "unrecognized" not in pasted.stderr


@pytest.mark.parametrize(("words", "meant"), [
    ("--re", "--re; did you mean --resume or --retry-failed?"),  # a prefix of two: both
    ("--resum=x", "--resum=x; did you mean --resume?"),
    ("--reseume", "--reseume; did you mean --resume?"),
    ("--json", "--json"),  # report's flag, not a misspelt --show (difflib's 0.6 took it so)
    ("--=x", "--=x"), ("--", "--"), ("-", "-"), ("---", "---"), ("-r x", "-r x"),
])  # fmt: skip
def test_an_unknown_flag_is_named_with_the_flag_meant_only_when_one_is_close(
    words: str, meant: str
) -> None:
    """A prefix of several flags was given difflib's closest spelling (`--re`: `--rpm`, which
    it does not shorten), and a flag of another command a loosely alike one (`--json` given
    to `validate`: `--show`); odd words (`--=x` shortens every flag) get no suggestion."""
    parser = argparse.ArgumentParser()
    for flag in ("--resume", "--retry-failed", "--rpm", "--show"):
        parser.add_argument(flag)
    said = with_close_flags(f"unrecognized arguments: {words}", parser)
    assert said == f"unrecognized arguments: {meant}"


@pytest.mark.parametrize(("argv", "name", "command"), [
    (["-"], "JOB.yaml", "run"), (["run", "-", "--shards", "1"], "JOB.yaml", "run"),
    (["validate", "-"], "JOB.yaml", "validate"),
    (["retry-failed", "runs/x", "--job", "-"], "--job", "retry-failed"),
    (["export", "runs/x", "--job", "-"], "--job", "export"),
])  # fmt: skip
def test_a_job_from_standard_input_is_refused_as_such(
    tmp_path: Path, argv: list[str], name: str, command: str
) -> None:
    """`shardrun -` said '-: job file not found': - is the usual word for standard input, which
    cannot hold a job (a resume reads the job file again). A file named - is `./-`."""
    proc = run_cli(*argv, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (2, (
        f"error: {name}: a job cannot be read from standard input (-): give the job "
        "file's path\n"))
    write_job(tmp_path / "-", shards=1)
    write_input(tmp_path / "input.jsonl", 2)
    proc = run_cli("validate", "./-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_sim_with_a_job_file_named_sim_says_which_one_runs(tmp_path: Path) -> None:
    """`shardrun sim` starts the simulator even when ./sim is a job file (the command word wins,
    as for every command); a note on standard error says how to run the file."""
    proc = run_cli("sim", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: shardrun sim")
    assert proc.stderr == ""
    write_job(tmp_path / "sim")
    proc = run_cli("sim", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: shardrun sim")
    assert proc.stderr == ("note: `shardrun sim` starts the simulator; to run the job file "
                           "./sim, give `shardrun run sim`\n")


@pytest.mark.parametrize("argv", [["job.yaml", "--runs-dir", ""], [""], ["report", " "],
                                  ["validate", "job.yaml", "--runs-dir", ""]])
def test_an_empty_path_argument_is_a_usage_error(tmp_path: Path, argv: list[str]) -> None:
    """`--runs-dir "$DIR"` with DIR unset: Path("") is the working directory, where the run was
    made; an empty path is refused as argparse refuses a bad number, before anything is made."""
    write_job(tmp_path / "job.yaml")
    proc = run_cli(*argv, cwd=tmp_path)
    [line] = proc.stderr.splitlines()
    name = "JOB.yaml" if argv == [""] else "RUN_DIR" if argv[0] == "report" else "--runs-dir"
    assert (proc.returncode, line) == (2, f"error: {name} is empty: give a path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


def test_a_stop_for_a_wrong_base_url_names_the_variable_that_set_it(tmp_path: Path) -> None:
    """SHARDRUN_BASE_URL without /v1 over a job file whose URL is right: the 404 stop said
    'check endpoint.base_url', and the file the user then reads holds a good one."""
    write_input(tmp_path / "input.jsonl", 20)
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as sim:
        wrong = sim.base_url.removesuffix("/v1")
        write_job(tmp_path / "job.yaml", shards=1,
                  endpoint={"base_url": sim.base_url, "api": "chat", "model": "m"})
        proc = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path,
                       env={"SHARDRUN_BASE_URL": wrong})
    assert proc.returncode == 1, proc.stderr
    assert ("before any request succeeded: check endpoint.base_url (from env "
            f"SHARDRUN_BASE_URL; OpenAI-compatible servers serve under /v1: likely "
            f"{sim.base_url}), endpoint.api and "
            "endpoint.model, then continue with ") in proc.stderr, proc.stderr


@pytest.mark.parametrize(("argv", "said"), [
    (["reprot", "runs/x"], "error: no command or job file named reprot (did you mean `shardrun "
                           "report`?); `shardrun --help` lists the commands"),
    (["help"], "error: no command or job file named help: `shardrun --help` gives it"),
    (["nothing"], "error: nothing: job file not found"),
])  # fmt: skip
def test_a_mistyped_command_is_named_as_one(tmp_path: Path, argv: list[str], said: str) -> None:
    """A first word that is no command is taken for a job file: `shardrun reprot RUN` said
    'unrecognized arguments: RUN (`shardrun run --help` ...)', `shardrun help` 'help: job file
    not found'. A word near no command still reads as a job file that is not there."""
    proc = run_cli(*argv, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (2, said + "\n")


def test_help_says_what_flags_take(tmp_path: Path) -> None:
    """--rpm and --tpm of run and retry-failed take `none`; export's -o refuses the table
    formats it does not write, each of which its help names."""
    from shardrun.export import _OTHER_FORMATS

    for command in ("run", "retry-failed"):
        text = " ".join(run_cli(command, "--help", cwd=tmp_path).stdout.split())
        for flag in ("--rpm X", "--tpm X"):
            assert "none lifts the job file's limit" in text.split(flag, 2)[2][:120], command
    text = " ".join(run_cli("export", "--help", cwd=tmp_path).stdout.split())
    assert "is refused (export writes JSON lines or CSV only)" in text
    for suffix in _OTHER_FORMATS:
        assert f"{suffix}," in text or f"{suffix} " in text, suffix


def test_help_gives_the_defaults_of_the_flags_that_override_the_job(tmp_path: Path) -> None:
    """run's and retry-failed's --shards and --concurrency, and run's --runs-dir, say what
    applies without them: the variable, the job file, then JobSpec's default, written out in
    `cli` (which loads no pydantic for --help) and checked here against JobSpec."""
    from shardrun._models import JobSpec

    fields = JobSpec.model_fields
    defaults = {"--shards N": fields["shards"].default,
                "--concurrency C": fields["concurrency"].default,
                "--runs-dir DIR": fields["runs_dir"].default}  # fmt: skip
    for command in ("run", "retry-failed"):
        text = " ".join(run_cli(command, "--help", cwd=tmp_path).stdout.split())
        for flag, default in defaults.items():
            if flag == "--runs-dir DIR" and command == "retry-failed":
                continue  # the run directory names its runs directory
            said = text.split(flag, 2)[2][:160]
            variable = "SHARDRUN_" + flag[2:].split()[0].replace("-", "_").upper()
            assert f"(default: {variable}, else the job file's " in said, (command, said)
            assert f"else {default}" in said, (command, said)


def _listed_as(action: argparse.Action) -> str:
    """How --help lists a flag at the head of its own line (the usage has `[--flag X]`)."""
    if action.nargs == 0:
        return action.option_strings[-1] + " "
    shown = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper())
    return f"{action.option_strings[-1]} {shown} " if action.nargs is None else (
        f"{action.option_strings[-1]} [{shown}] ")


def test_sim_help_gives_every_default(tmp_path: Path) -> None:
    """Each `shardrun sim` flag that takes a number or a word says its default in --help."""
    from shardrun.sim import _parser

    text = " ".join(run_cli("sim", "--help", cwd=tmp_path).stdout.split())
    text = text.split("until Ctrl-C.", 1)[1]  # past the usage
    actions = _parser("shardrun sim")._actions
    listed = [_listed_as(action) for action in actions]
    for action, here, after in zip(actions, listed, [*listed[1:], "\x00"], strict=True):
        said = text.split(here, 1)[1].split(after, 1)[0]
        value = action.default
        if isinstance(value, bool) or not isinstance(value, (int, float, str)) or value in (
                "", argparse.SUPPRESS):
            continue
        assert f"default {value}" in said or f"{value} (default)" in said, (here, said)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_endpoint_fails_every_item_with_cause(tmp_path: Path) -> None:
    """A refused endpoint: exit 1, every item dead-lettered with the cause, no traceback."""
    ids = write_input(tmp_path / "input.jsonl", 500)
    port = _closed_port()
    write_job(tmp_path / "job.yaml",
              endpoint={"base_url": f"http://127.0.0.1:{port}/v1", "api": "chat", "model": "m"})
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "unreachable" in proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert not run.results
    assert sorted(d["id"] for d in run.dead) == sorted(ids)
    assert all("unreachable" in d["reason"] for d in run.dead)
    assert f"\n    {len(ids)}  endpoint unreachable: " in proc.stdout, proc.stdout
    attempted = sum(len(d["attempts"]) for d in run.dead)
    # The endpoint was not hammered: far fewer attempts than items.
    assert attempted < len(ids) // 5
    # No connection, no token: the attempt's instants are null, `tokens` 0.
    ends = attempt_ends(run)
    assert len(ends) == attempted
    assert {(e["conn_ready_t"], e["reused"], e["first_token_t"], e["last_token_t"], e["tokens"])
            for e, _ in ends} == {(None, None, None, None, 0)}


def test_an_unreachable_url_from_the_environment_is_named_with_its_variable(
    tmp_path: Path,
) -> None:
    """SHARDRUN_BASE_URL set in an incident to a port nothing listens on: the stop named
    '127.0.0.1:PORT' only, and the job file the user then reads holds a good URL."""
    write_input(tmp_path / "input.jsonl", 20)
    write_job(tmp_path / "job.yaml", shards=1,
              endpoint={"base_url": "http://127.0.0.1:8000/v1", "api": "chat", "model": "m"})
    wrong = f"http://user:secret@127.0.0.1:{_closed_port()}/v1"
    proc = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path, timeout=60,
                   env={"SHARDRUN_BASE_URL": wrong})
    assert proc.returncode == 1, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: endpoint unreachable: "), line
    assert line.endswith(f" (endpoint.base_url {wrong.replace('user:secret', '***')} from env "
                         "SHARDRUN_BASE_URL)"), line
    assert "secret" not in proc.stdout + proc.stderr


def test_a_key_in_the_url_user_name_or_path_parameters_is_in_no_output_or_file(
    tmp_path: Path,
) -> None:
    """A proxy's key as the URL's user name alone, or as a path parameter (`;token=`), came
    back unmasked in the unreachable stop: on the terminal, in dead letters, events and the
    manifest (which held the user name even before)."""
    write_input(tmp_path / "input.jsonl", 20)
    write_job(tmp_path / "job.yaml", shards=1,
              endpoint={"base_url": "http://127.0.0.1:8000/v1", "api": "chat", "model": "m"})
    port = _closed_port()
    wrong = (f"http://sk-live-SECRET123@127.0.0.1:{port}/v1;token=SECRET456/SECRET457;SECRET458"
             "?code=SECRET789&a=1;key=SECRET790")
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path, timeout=60,
                   env={"SHARDRUN_BASE_URL": wrong, "SHARDRUN_OUTAGE_S": "2"})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    shown = f"http://***@127.0.0.1:{port}/v1;***?code=***&a=1;key=***"
    assert f" (endpoint.base_url {shown} from env SHARDRUN_BASE_URL)" in proc.stderr
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert any(p.name == "manifest.json" for p in files)
    assert any(p.parent.name == "dead" for p in files)
    for text in [proc.stdout, proc.stderr, *(p.read_text(errors="replace") for p in files)]:
        assert not re.search("SECRET", text), text


def test_run_cli_passes_on_no_shardrun_variable_of_the_callers_in_any_case(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lower-case shardrun_* variable is an error now: one exported in the developer's or
    CI's shell made every end-to-end run exit 2, as run_cli left out upper-case names only."""
    monkeypatch.setenv("shardrun_anything", "1")
    monkeypatch.setenv("Shardrun_Shards", "9")
    ids = write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml", shards=1)
    proc = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["id"] for r in Run.load(only_run(tmp_path / "runs")).results) == ids


def test_rejected_input_lines_are_counted(tmp_path: Path) -> None:
    """Malformed lines go to rejects.jsonl with their line numbers; the rest still runs."""
    lines = [b'{"id": "a", "prompt": "hi"}', b"{not json", b'{"id": "b"}',
             b'{"id": "c", "prompt": "yo"}']
    (tmp_path / "input.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    write_job(tmp_path / "job.yaml")
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 1
    run = Run.load(only_run(tmp_path / "runs"))
    assert sorted(r["id"] for r in run.results) == ["a", "c"]
    rejects = [orjson.loads(x) for x in (run.path / "rejects.jsonl").read_bytes().splitlines()]
    assert [r["line"] for r in rejects] == [2, 3]
    where = run.path.relative_to(tmp_path) / "rejects.jsonl"
    assert f"  rejected lines     {where}\n" in proc.stdout, proc.stdout


def _comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """A report document without what depends on the bytes of the files: their hashes, sizes,
    line counts and coverage (everything else must not move)."""
    doc = orjson.loads(orjson.dumps(doc))
    doc["run"]["dir"] = None
    for f in doc["integrity"]["files"]:
        for key in ("sha256", "bytes", "lines", "covered_lines", "covered_bytes"):
            f[key] = None
    return doc


def test_report_is_the_same_in_the_old_layout(tmp_path: Path) -> None:
    """A real run with faults (429s, dropped streams: retries, wasted tokens, new and reused
    connections), its shard logs rewritten in the layout of runs written before the change
    (separate conn_ready / first_token / last_token lines): `report --json` gives the same
    document, and a failed attempt's instants survive on its attempt_end."""
    write_input(tmp_path / "input.jsonl", 300)
    sim = {**FAST_SIM, "fail_429": 0.1, "retry_after_s": 0.01, "drop_mid_stream": 0.1}
    write_job(tmp_path / "job.yaml", endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                                               "sim": sim},
              retry={"backoff_s": 0.01, "backoff_max_s": 0.05, "max_attempts": 8})
    proc = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "new", cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stderr  # 1: some items dead-lettered (budget)
    new = tmp_path / "runs" / "new"
    run = Run.load(new)
    assert_attempt_ends_carry_the_instants(run)
    failed = [e for e, _ in attempt_ends(run) if e["status"] != "ok"]
    assert {e["status"] for e in failed} >= {"http_429"}
    cut = [e for e in failed if e["tokens"]]
    assert cut and all(e["wasted_tokens"] == e["tokens"] and e["last_token_t"] is not None
                       and e["conn_ready_t"] is not None for e in cut)

    old = tmp_path / "runs" / "old"
    shutil.copytree(new, old)
    manifest = orjson.loads((old / "manifest.json").read_bytes())
    listed = {f["path"]: f for f in manifest["files"]}
    grew = 0
    for path in sorted((old / "events").glob("shard-*.jsonl")):
        before = len(path.read_bytes().splitlines())
        write_records(path, to_old_layout(read_jsonl(path)))
        data = path.read_bytes()
        grew += len(data.splitlines()) - before
        entry = listed[f"events/{path.name}"]
        entry["sha256"], entry["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    (old / "manifest.json").write_bytes(orjson.dumps(manifest))
    assert grew >= 3 * 300  # at least conn_ready, first_token and last_token per success

    docs = []
    for which in (new, old):
        report = run_cli("report", str(which), "--json", cwd=tmp_path)
        assert report.returncode == 0, report.stderr
        docs.append(orjson.loads(report.stdout))
    assert docs[0]["integrity"]["ok"] and docs[1]["integrity"]["ok"]
    assert docs[0]["connections"]["reused"] > 0 and docs[0]["attempts"]["wasted_tokens"] > 0
    assert _comparable(docs[1]) == _comparable(docs[0])


def test_a_run_warns_once_of_an_id_field_its_records_lack(tmp_path: Path) -> None:
    """A real run of a job whose input.id_field ('qid') its records lack ('id'): every item
    runs under an id derived from its content, as before, and stderr says why, once."""
    write_input(tmp_path / "input.jsonl", 150)
    write_job(tmp_path / "job.yaml", input={"path": "input.jsonl", "id_field": "qid"})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "input.id_field 'qid'" in line]
    assert warned == ["warning: none of the first 100 records has input.id_field 'qid': their "
                      "ids are derived from their content, and results will not carry the "
                      "input's own ids; check the field's name"]
    results = Run.load(only_run(tmp_path / "runs")).results
    assert len(results) == 150 and all(r["id"].startswith("h") for r in results)

"""The whole run path through the real CLI, in a subprocess, against the simulator on loopback."""

from __future__ import annotations

import hashlib
import socket
import urllib.request
from collections import Counter
from pathlib import Path

import orjson
import pytest

from shardrun.sim.config import SimConfig
from shardrun.sim.launcher import start_sim
from shardrun.spans import BUCKETS
from tests.conftest import FAST_SIM, Run, only_run, run_cli, write_input, write_job

SENTINEL_KEY = "sk-test-SENTINEL-0123456789"


def assert_exactly_once(run: Run, ids: list[str]) -> None:
    """Every input id has exactly one result line, and nothing else is there."""
    counts = Counter(r["id"] for r in run.results)
    assert not [i for i, c in counts.items() if c > 1], "duplicated results"
    assert set(counts) == set(ids)
    assert not run.dead


def assert_buckets_telescope(run: Run) -> None:
    """The six buckets of every span sum to its end-to-end time within 1 µs."""
    for r in run.results:
        b = r["buckets"]
        assert set(b) == set(BUCKETS)
        assert all(v >= 0 for v in b.values()), r
        assert abs(sum(b.values()) - r["e2e"]) < 1e-6
        assert r["e2e"] == pytest.approx(r["released_at"] - r["queued_at"], abs=1e-6)


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
    assert all(e["run_id"] == run.manifest["run_id"] for e in run.events)
    for path in run.path.rglob("*"):
        if path.is_file():
            assert SENTINEL_KEY.encode() not in path.read_bytes(), f"API key leaked into {path}"


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
    # The cap holds (4 shards x 8) and, with a backlog, is reached.
    assert stats["max_in_flight"] == 32


def test_messages_field_and_completions_api(tmp_path: Path) -> None:
    """Chat message lists and the completions API both run end to end."""
    with open(tmp_path / "input.jsonl", "wb") as f:
        for i in range(40):
            msgs = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"Hello {i} héllo 世界"}]
            f.write(orjson.dumps({"id": i, "messages": msgs}) + b"\n")
    write_job(tmp_path / "job.yaml", input={"path": "input.jsonl", "messages_field": "messages"})
    assert run_cli("job.yaml", "--runs-dir", "a", cwd=tmp_path).returncode == 0
    chat = Run.load(only_run(tmp_path / "a"))
    assert sorted(int(r["id"]) for r in chat.results) == list(range(40))

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
    attempted = sum(len(d["attempts"]) for d in run.dead)
    # The endpoint was not hammered: far fewer attempts than items.
    assert attempted < len(ids) // 5


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

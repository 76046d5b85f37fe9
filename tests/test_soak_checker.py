"""The checker of scripts/soak_resume.py finds what it is there to find, and its trials leave
nothing running (it is no test itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import soak_resume
from soak_resume import Trial, check_files


def _write(path: Path, rows: list[dict[str, object]], tail: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows) + tail)


def test_the_soak_checker_names_each_way_a_run_can_lose_or_double_an_item(
        tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write(run / "results" / "shard-00.jsonl", [{"id": "a"}, {"id": "b"}])
    _write(run / "results" / "shard-00.r1.jsonl", [{"id": "b"}, {"id": "x"}])
    _write(run / "dead" / "shard-01.r1.jsonl", [{"id": "a"}])
    _write(run / "events" / "shard-00.jsonl", [{"ev": "released"}], tail=b'{"ev": "rel')
    manifest = {"summary": {"succeeded": 2, "dead": 0},
                "resumes": [{"segment": 1, "summary": {"succeeded": 1, "dead": 1}}]}
    (run / "manifest.json").write_bytes(orjson.dumps(manifest))
    problems, n_ok, n_dead = check_files(run, ["a", "b", "c"])
    assert (n_ok, n_dead) == (4, 1)
    assert problems == [
        "1 unparsable line(s) in events/shard-00.jsonl",
        "events/shard-00.jsonl ends in a torn line",
        "2 id(s) with more than one line, e.g. ['a', 'b']",
        "1 id(s) both in results and dead letters, e.g. ['a']",
        "1 input id(s) with no line, e.g. ['c']",
        "1 id(s) not in the input, e.g. ['x']",
        "pass 1's summary says succeeded 1, its results files hold 2 line(s)",
    ]
    # The same files made whole: nothing to say.
    _write(run / "results" / "shard-00.r1.jsonl", [{"id": "c"}])
    (run / "dead" / "shard-01.r1.jsonl").unlink()
    _write(run / "events" / "shard-00.jsonl", [{"ev": "released"}])
    manifest["resumes"] = [{"segment": 1, "summary": {"succeeded": 1, "dead": 0}}]
    (run / "manifest.json").write_bytes(orjson.dumps(manifest))
    assert check_files(run, ["a", "b", "c"]) == ([], 3, 0)


def test_a_mixed_trial_that_stops_early_still_ends_the_shards_it_left_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--mix` leaves a killed pass's shards running for the next pass to wait for; a trial
    that stops before its end (a hung pass, an error) must still end them, and say so."""
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def mixed(trial: Trial) -> None:
            trial.orphans.append(psutil.Process(left.pid))
            raise RuntimeError("a pass hung")

        monkeypatch.setattr(Trial, "mixed", mixed)
        monkeypatch.setattr(soak_resume, "ORPHAN_WAIT_S", 0.0)
        trial = Trial(0, 1, tmp_path / "t000", 3, mix=True)
        with pytest.raises(RuntimeError):
            trial.run()
        assert left.wait(timeout=10) is not None  # killed, not left to run on
        assert len(trial.problems) == 1, trial.problems
        assert trial.problems[0].startswith("processes outlived their pass"), trial.problems
    finally:
        left.kill()
        left.wait(timeout=10)

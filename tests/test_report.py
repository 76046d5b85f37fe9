"""`shardrun report` on run directories: fixtures on disk, damaged logs, run states, a real run."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import FAST_SIM, read_jsonl, run_cli, write_input, write_job
from test_aggregate_fixtures import (
    T0,
    ev,
    hand_coordinator,
    hand_shard,
    run_with_a_cut_log,
    steady_shard,
    write_log,
    write_run,
)

from shardrun import __version__
from shardrun.aggregate._segments import BUCKETS
from shardrun.aggregate._triage import (
    RETRY_RATE_LIMIT,
    SERVER_LIMIT_SHARE,
    TABLE,
    triage_section,
)
from shardrun.cli import main as cli_main
from shardrun.cli_analysis import main, register
from shardrun.report import format_report, integrity_problem, load_report


def _hand_run(tmp_path: Path, **manifest: Any) -> Path:
    return write_run(tmp_path / "run", {"00": hand_shard()}, hand_coordinator(), **manifest)


def _age(run: Path, seconds: float = 3600) -> None:
    past = time.time() - seconds
    for path in (run / "events").iterdir():
        os.utime(path, (past, past))


def test_fixture_run_on_disk_gives_the_hand_numbers(tmp_path: Path) -> None:
    """Read back through files and checkpoints, the hand fixture keeps its hand-worked numbers."""
    doc, _ = load_report(_hand_run(tmp_path))
    assert doc["schema"] == "shardrun.report/1"
    assert (doc["items"]["succeeded"], doc["items"]["dead"]) == (2, 1)
    assert doc["scheduler"]["overall"]["gap_fraction"] == round(1 / 6, 6)
    assert doc["scheduler"]["overall"]["occupancy_under_backlog"] == round(10 / 12, 6)
    assert doc["latency"]["all"]["e2e"]["sum"] == 14.0
    assert doc["run"]["state"] == "finished" and doc["integrity"]["ok"]
    files = {f["path"]: f for f in doc["integrity"]["files"]}
    shard = files["events/shard-00.jsonl"]
    assert shard["covered_lines"] == shard["lines"] and shard["checkpoints"] >= 6
    assert shard["shard_end"] is True and files["events/coordinator.jsonl"]["shard_end"] is None


def test_terminal_report_has_every_section(tmp_path: Path) -> None:
    """The text report shows items, TPM, latency, segments, attempts, scheduler, files, triage."""
    doc, _ = load_report(_hand_run(tmp_path))
    text = format_report(doc)
    for heading in ("Items", "Completion TPM", "Latency", "By prompt length", "Attempts",
                    "Scheduler", "Event files", "Triage", "dominant bucket: t_stream"):
        assert heading in text, heading
    assert "2027-01-15T07:59Z" in text and "partial" in text
    assert "retry causes: conn_reset 1" in text
    assert "client CPU: not in the log" in text  # the hand fixture's run_end records none
    sched = text[text.index("Scheduler"):]
    header = next(line for line in sched.splitlines() if "gap_fraction" in line)
    assert "occupancy" in header.split()
    assert "83.33%" in sched  # the hand fixture's occupancy under backlog, 10 / 12


def test_torn_last_line_is_reported_not_fatal(tmp_path: Path) -> None:
    """A crash mid-line: the torn tail is ignored and named; coverage stops at the checkpoint."""
    run = _hand_run(tmp_path, status="running")
    log = run / "events" / "shard-00.jsonl"
    data = log.read_bytes()
    cut = data.rfind(b'"ev":"shard_end"')  # keep everything before shard_end, plus half of it
    log.write_bytes(data[:cut + 10])
    _age(run)
    doc, _ = load_report(run)
    f = {f["path"]: f for f in doc["integrity"]["files"]}["events/shard-00.jsonl"]
    assert f["torn_tail_bytes"] > 0 and f["shard_end"] is False
    assert f["covered_lines"] < f["lines"]
    assert doc["run"]["state"] == "crashed"
    assert any("torn last line" in n for n in doc["notes"])
    assert any("checkpoints cover lines" in n for n in doc["notes"])


def test_unreadable_line_is_counted_with_its_number(tmp_path: Path) -> None:
    """Garbage in the middle of a log is skipped, counted, and its line number reported."""
    run = _hand_run(tmp_path)
    log = run / "events" / "shard-00.jsonl"
    lines = log.read_bytes().split(b"\n")
    lines[2] = b"{not json"
    log.write_bytes(b"\n".join(lines))
    doc, _ = load_report(run)
    f = {f["path"]: f for f in doc["integrity"]["files"]}["events/shard-00.jsonl"]
    assert f["bad_lines"] == 1 and f["first_bad"] == ["line 3: not valid JSON"]
    assert f["checkpoint_error"] is not None and not doc["integrity"]["ok"]
    assert doc["items"]["queued"] == 2  # one queued line lost, the rest still counted


def test_changed_after_the_run_ended(tmp_path: Path) -> None:
    """A log whose bytes differ from the manifest's record of them is flagged."""
    run = _hand_run(tmp_path)
    log = run / "events" / "shard-00.jsonl"
    files = [{"path": "events/shard-00.jsonl", "sha256": "0" * 64,
              "bytes": log.stat().st_size}]
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    (run / "manifest.json").write_bytes(orjson.dumps({**manifest, "files": files}))
    doc, _ = load_report(run)
    assert any("differs from the SHA-256 the manifest recorded" in n for n in doc["notes"])


def test_report_exit_code_says_whether_the_log_can_be_trusted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 0 for an intact log, also a crashed one (torn tail); 1, with the reason, for a
    flipped byte, a garbage line or a file changed since the manifest recorded it. The report
    is printed in every case."""
    intact = _hand_run(tmp_path / "intact")
    assert main(["report", str(intact)]) == 0
    assert capsys.readouterr().err == ""

    torn = _hand_run(tmp_path / "torn", status="running")
    log = torn / "events" / "shard-00.jsonl"
    data = log.read_bytes()
    log.write_bytes(data[:data.rfind(b'"ev":"shard_end"') + 10])
    _age(torn)
    assert main(["report", str(torn)]) == 0
    assert "CRASHED" in capsys.readouterr().out.upper()

    flipped = _hand_run(tmp_path / "flipped")
    log = flipped / "events" / "shard-00.jsonl"
    data = bytearray(log.read_bytes())
    at = data.index(b'"completion_tokens":') + len(b'"completion_tokens":')
    data[at] = ord("9") if data[at] != ord("9") else ord("8")  # still valid JSON
    log.write_bytes(bytes(data))
    assert main(["report", str(flipped)]) == 1
    captured = capsys.readouterr()
    assert "items" in captured.out  # the report still printed
    (err,) = captured.err.strip().splitlines()
    assert err.startswith(f"error: {flipped}: the event log fails its integrity check "
                          "(events/shard-00.jsonl: checkpoint check failed at line ")
    assert "a byte changed" in err

    garbage = _hand_run(tmp_path / "garbage")
    log = garbage / "events" / "shard-00.jsonl"
    lines = log.read_bytes().split(b"\n")
    lines[2] = b"{not json"
    log.write_bytes(b"\n".join(lines))
    assert main(["report", str(garbage), "--json"]) == 1
    assert orjson.loads(capsys.readouterr().out)["integrity"]["ok"] is False

    changed = _hand_run(tmp_path / "changed")
    manifest = orjson.loads((changed / "manifest.json").read_bytes())
    files = [{"path": "events/shard-00.jsonl", "sha256": "0" * 64, "bytes": 1}]
    (changed / "manifest.json").write_bytes(orjson.dumps({**manifest, "files": files}))
    assert main(["report", str(changed)]) == 1
    assert "events/shard-00.jsonl differs from the SHA-256 the manifest recorded" in \
        capsys.readouterr().err

    gone = _hand_run(tmp_path / "gone")  # a log the manifest lists, deleted: half the figures
    manifest = orjson.loads((gone / "manifest.json").read_bytes())
    log = gone / "events" / "shard-00.jsonl"
    files = [{"path": "events/shard-00.jsonl", "sha256": "0" * 64, "bytes": log.stat().st_size}]
    (gone / "manifest.json").write_bytes(orjson.dumps({**manifest, "files": files}))
    log.unlink()
    assert main(["report", str(gone)]) == 1
    assert ("events/shard-00.jsonl is listed in the manifest but missing from the run "
            "directory") in capsys.readouterr().err


@pytest.mark.parametrize(("key", "value", "what"), [
    ("files", "x", "files is not a list"), ("effective", "x", "effective is not an object"),
    ("resumes", {}, "resumes is not a list")])
def test_a_manifest_of_the_wrong_shape_is_one_sentence_for_every_reader(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: object,
        what: str) -> None:
    """A hand-edited manifest: report, publish and verify each say which key is wrong, never a
    traceback ('str' object has no attribute 'get' before)."""
    run = _hand_run(tmp_path)
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    (run / "manifest.json").write_bytes(orjson.dumps({**manifest, key: value}))
    for command in (["report", str(run)], ["publish", str(run)], ["verify", str(run)]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err == f"error: {run / 'manifest.json'}: {what}; the manifest was edited or " \
                      "damaged\n", (command, err)


def test_a_manifest_of_a_newer_schema_is_refused_by_every_command(tmp_path: Path) -> None:
    """A run whose manifest a newer shardrun wrote (schema 2): report, verify, publish, export,
    --resume and retry-failed each refuse it in one sentence naming the file, both schemas and
    the fix, and change nothing; each read it as if it were this version's before. A schema
    that is no number is an edited manifest; one with none (before it was written) reads."""
    write_input(tmp_path / "input.jsonl", 20)
    write_job(tmp_path / "job.yaml", shards=1, concurrency=4)
    assert run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=tmp_path).returncode == 0
    path = tmp_path / "runs" / "r1" / "manifest.json"
    manifest = orjson.loads(path.read_bytes())
    path.write_bytes(orjson.dumps({**manifest, "schema": 2}))
    before = sorted((p, p.stat().st_mtime_ns) for p in path.parent.rglob("*") if p.is_file())
    commands = [["report", "runs/r1"], ["verify", "runs/r1"], ["publish", "runs/r1"],
                ["export", "runs/r1"], ["job.yaml", "--runs-dir", "runs", "--resume", "r1"],
                ["retry-failed", "runs/r1"]]
    for command in commands:
        done = run_cli(*command, cwd=tmp_path)
        assert (done.returncode, done.stdout) == (2, ""), (command, done.stderr)
        assert done.stderr == (
            f"error: runs/r1/manifest.json has manifest schema 2 and this shardrun "
            f"({__version__}) reads schema 1: a newer shardrun wrote the run; upgrade shardrun "
            "to read it\n"), command
    after = sorted((p, p.stat().st_mtime_ns) for p in path.parent.rglob("*") if p.is_file())
    assert after == before
    path.write_bytes(orjson.dumps({**manifest, "schema": "2"}))
    assert run_cli("report", "runs/r1", cwd=tmp_path).stderr == (
        "error: runs/r1/manifest.json has manifest schema '2', not 1; the manifest was edited "
        "or damaged\n")
    path.write_bytes(orjson.dumps({k: v for k, v in manifest.items() if k != "schema"}))
    assert run_cli("report", "runs/r1", cwd=tmp_path).returncode == 0


def test_an_event_path_that_is_no_file_is_one_sentence(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory, or a link to nothing, named like a shard log: report and publish name it
    (IsADirectoryError and FileNotFoundError tracebacks before)."""
    run = _hand_run(tmp_path)
    (run / "events" / "shard-09.jsonl").mkdir()
    (run / "events" / "shard-08.jsonl").symlink_to(tmp_path / "nowhere")
    for command in (["report", str(run)], ["publish", str(run)]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err == (f"error: {run}/events/shard-08.jsonl is not a file (a link to nothing); "
                       "the run directory was edited or damaged\n"), (command, err)
    (run / "events" / "shard-08.jsonl").unlink()
    assert main(["report", str(run)]) == 2
    assert "shard-09.jsonl is not a file (a directory)" in capsys.readouterr().err


def test_result_files_changed_by_hand_are_noted_but_do_not_fail_the_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A result file the manifest lists, cut short, and another deleted: the report names both
    (text and JSON) and still exits 0, since its figures come from the event log alone."""
    run = _hand_run(tmp_path / "run")
    (run / "results").mkdir(exist_ok=True)
    (run / "results" / "shard-00.jsonl").write_bytes(b'{"id":"a"}\n')
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    files = [{"path": "results/shard-00.jsonl", "sha256": "0" * 64, "bytes": 22},
             {"path": "results/shard-01.jsonl", "sha256": "0" * 64, "bytes": 5}]
    files += [{"path": f"events/{p.name}", "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
               "bytes": p.stat().st_size} for p in run.glob("events/*")]  # as a run lists them
    (run / "manifest.json").write_bytes(orjson.dumps({**manifest, "files": files}))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert ("results/shard-00.jsonl: 11 bytes where the manifest recorded 22: answers were "
            "removed or changed by hand") in out
    assert "results/shard-01.jsonl: missing where the manifest recorded 5" in out
    assert main(["report", str(run), "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    assert doc["integrity"]["ok"] is True
    assert doc["integrity"]["results_changed"] == [
        {"path": "results/shard-00.jsonl", "bytes_listed": 22, "bytes_now": 11},
        {"path": "results/shard-01.jsonl", "bytes_listed": 5, "bytes_now": None}]


def test_run_states(tmp_path: Path) -> None:
    """Finished by the manifest; running while logs are fresh; crashed once they go stale."""
    finished, _ = load_report(_hand_run(tmp_path / "a"))
    assert finished["run"]["state"] == "finished"
    recs = hand_shard()[:-1]  # no shard_end
    running = write_run(tmp_path / "b", {"00": recs}, None, status="running")
    assert load_report(running)[0]["run"]["state"] == "running"
    _age(running)
    doc, _ = load_report(running)
    assert doc["run"]["state"] == "crashed" and "without shard_end: 00" in doc["run"][
        "state_reason"]
    assert doc["run"]["state_reason"].endswith("; --resume continues it (it keeps every answer "
                                               "on disk)")


WHOLE = {"summary": {"input_read": True, "left_out": 0, "unfinished": 0}}


@pytest.mark.parametrize(("first", "newest", "said"), [
    (WHOLE, None, "; --resume continues it"),
    (WHOLE, {"retry_failed": True, "only_failed": True}, "; shardrun retry-failed RUN continues"),
    (WHOLE, {"retry_failed": True, "only_failed": False}, "; shardrun retry-failed RUN continues"),
    ({"summary": {"input_read": False}}, {"retry_failed": True, "only_failed": False},
     "; --resume runs the input it left, and shardrun retry-failed RUN its dead letters"),
    # Read whole, but lines were appended before the retry pass began: as the pass judged it.
    (WHOLE, {"retry_failed": True, "only_failed": False, "input_read_before": False},
     "; --resume runs the input it left, and shardrun retry-failed RUN its dead letters"),
])
def test_a_crashed_runs_way_on_follows_its_newest_pass(
        tmp_path: Path, first: dict[str, Any], newest: dict[str, Any] | None, said: str) -> None:
    """A crashed retry pass is continued by the retry (its dead letters are finished items to
    --resume), unless it was `--resume --retry-failed` of a run whose input no pass read
    whole: then --resume reads the rest and the retry takes the dead letters."""
    recs = hand_shard()[:-1]  # no shard_end
    run = write_run(tmp_path / "run", {"00": recs}, None, status="running")
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    manifest.update(first)
    if newest is not None:
        manifest["resumes"] = [newest]
    (run / "manifest.json").write_bytes(orjson.dumps(manifest))
    _age(run)
    reason = load_report(run)[0]["run"]["state_reason"]
    assert said.replace("RUN", str(run)) in reason, reason


def test_resumed_passes_are_separate_windows(tmp_path: Path) -> None:
    """Files of a resume pass (`.r1`) form their own window; the gap between is not run time."""
    first = steady_shard(0, T0, minutes=1, per_minute=6)
    later = steady_shard(0, T0 + 3600, minutes=1, per_minute=6)
    run = write_run(tmp_path / "run", {"00": first, "00.r1": later}, None)
    doc, _ = load_report(run)
    assert len(doc["run"]["passes"]) == 2 and doc["run"]["duration_s"] < 130
    assert doc["tpm"]["shards"] == ["00", "00.r1"] and len(doc["tpm"]["minutes"]) <= 6


def _pass_statuses(doc: dict[str, Any]) -> list[str]:
    rows = format_report(doc).split("\nPasses (", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [row.split()[2] for row in rows]


@pytest.mark.parametrize(("newest_ended", "said"), [(True, ["crashed", "succeeded"]),
                                                    (False, ["crashed", "crashed"])])
def test_a_pass_that_logged_no_end_is_shown_crashed_not_as_a_question_mark(
        tmp_path: Path, newest_ended: bool, said: list[str]) -> None:
    """A coordinator killed (kill -9) logs no `run_end`: a pass that a later pass followed
    crashed, and so did the newest when the run reads as crashed. The table said "?"."""
    first = steady_shard(0, T0, minutes=1, per_minute=6)
    later = steady_shard(0, T0 + 3600, minutes=1, per_minute=6)
    coordinator = [ev("run_start", T0, shards=1, cap=4)]
    if newest_ended:
        coordinator += [ev("run_start", T0 + 3600, shards=1, cap=4),
                        ev("run_end", T0 + 3700, status="succeeded")]
    run = write_run(tmp_path / "run", {"00": first, "00.r1": later}, None,
                    status="succeeded" if newest_ended else "running")
    if newest_ended:
        write_log(run / "events" / "coordinator.r1.jsonl", coordinator[1:])
    write_log(run / "events" / "coordinator.jsonl", coordinator[:1])
    _age(run)
    doc, _ = load_report(run)
    assert doc["run"]["passes"][0]["status"] is None  # the JSON keeps what was logged
    assert _pass_statuses(doc) == said


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardrun")
    register(parser.add_subparsers(dest="command"))
    return parser


def test_register_adds_the_three_commands() -> None:
    """`register` adds report, publish and verify, each with a handler."""
    for argv in (["report", "R", "--json"], ["publish", "R", "--peak"], ["verify", "S.json"]):
        args = _parser().parse_args(argv)
        assert callable(args.handler)
    with pytest.raises(SystemExit):
        _parser().parse_args(["publish", "R", "--peak", "--minute", "2027-01-15T08:00Z"])


def test_missing_run_dir_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                           ) -> None:
    """A directory without manifest.json is a user error (exit 2), not a traceback."""
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path} is not a run directory: it has no manifest.json")
    (tmp_path / "a-file").write_text("")
    for name, why in (("20261127T000407Z-bdb3d9", "nothing is there"), ("a-file", "it is a file")):
        for command in ("report", "publish", "export"):
            assert cli_main([command, str(tmp_path / name)]) == 2
            assert capsys.readouterr().err.strip() == (
                f"error: {tmp_path / name} is not a run directory: {why}"), command
        retry = run_cli("retry-failed", name, cwd=tmp_path)  # in its own process: its signals
        assert (retry.returncode, retry.stderr) == (
            2, f"error: {name} is not a run directory: {why}\n")


def test_html_needs_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """Without plotly, --html fails with the install hint."""
    import importlib

    real = importlib.import_module

    def no_plotly(name: str, package: str | None = None) -> Any:
        if name.startswith("plotly"):
            raise ImportError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_plotly)
    assert main(["report", str(_hand_run(tmp_path)), "--html", str(tmp_path / "r.html")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --html needs the html extra: in shardrun's directory, .venv/bin/pip install -e "
        "'.[html]'")


def test_html_into_a_missing_directory_or_onto_one_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--html naming a file in a directory that does not exist, or a directory: exit 2 with one
    sentence, before anything is read or printed."""
    run = _hand_run(tmp_path / "run")
    missing = tmp_path / "nodir" / "r.html"
    assert main(["report", str(run), "--html", str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: --html {missing}: there is no directory "
                                 f"{missing.parent}; create it, or name a file in one that "
                                 "exists\n")
    assert main(["report", str(run), "--html", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: --html {tmp_path} is a directory; name the "
                                       "file to write\n")
    among = run / "events" / "r.html"  # verify would find a file its manifest does not list
    assert main(["report", str(run), "--html", str(among)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --html {among} is among the files of "
                                              f"run directory {run}")
    assert not among.exists()


def test_a_dash_for_a_written_file_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """report --html - and publish -o - made a file named '-' in the working directory, where
    export -o - writes to standard output; both print on standard output already."""
    run = _hand_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(run), "--html", "-"]) == 2
    assert capsys.readouterr().err == (
        "error: --html -: the text report goes to standard output, so '-' is no place for "
        "this file; give a file name\n")
    assert main(["publish", str(run), "-o", "-"]) == 2
    assert capsys.readouterr().err == (
        "error: -o -: the sample is printed on standard output as well, so '-' is no place "
        "for this file; give a file name\n")
    assert not (tmp_path / "-").exists()


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 300-item run on the simulator, with some 5xx faults so that retries happen."""
    root = tmp_path_factory.mktemp("real")
    write_input(root / "input.jsonl", 300)
    sim = {**FAST_SIM, "fail_500": 0.05, "drop_mid_stream": 0.03}
    write_job(root / "job.yaml", shards=2, concurrency=8,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim},
              retry={"backoff_s": 0.01, "backoff_max_s": 0.05})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=root)
    assert done.returncode in (0, 1), done.stderr
    return root / "runs" / "r1"


def test_report_of_dot_inside_a_stopped_run_names_its_id_and_runs_directory(
        tmp_path: Path) -> None:
    """`report .` inside a run the endpoint stopped (`..` from its results/) restates the way on
    the pass printed: the run directory given has no name of its own, and the command named
    `--resume ''` (or `--resume ..`) with the wrong runs directory. It names the run id and the
    runs directory, absolute, so that pasted anywhere it resumes this run."""
    write_input(tmp_path / "input.jsonl", 80)
    sim = {**FAST_SIM, "quota_after": 10}
    write_job(tmp_path / "job.yaml", shards=2, concurrency=4,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    run = tmp_path / "runs" / "r1"
    ours = (f"continue with `shardrun {(tmp_path / 'job.yaml').resolve()} --resume r1 "
            f"--runs-dir {run.resolve().parent}`")
    for given, cwd in ((".", run), ("..", run / "results")):
        report = run_cli("report", given, "--json", cwd=cwd)
        assert report.returncode == 0, report.stderr
        reason = orjson.loads(report.stdout)["run"]["state_reason"]
        assert "its last pass was stopped: " in reason, (given, reason)
        assert ours in reason, (given, reason)


def test_real_run_matches_its_result_files(real_run: Path) -> None:
    """On a real run, successes, tokens and every bucket sum equal those of the result lines."""
    results = [r for p in sorted((real_run / "results").glob("*.jsonl")) for r in read_jsonl(p)]
    doc, _ = load_report(real_run)
    assert doc["run"]["state"] == "finished" and doc["integrity"]["ok"]
    assert doc["items"]["succeeded"] == len(results)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    assert doc["tpm"]["total_completion_tokens"] == tokens == doc["items"]["completion_tokens"]
    for b in BUCKETS:
        exact = sum(r["buckets"][b] for r in results)
        assert doc["latency"]["all"][b]["sum"] == pytest.approx(exact, abs=1e-5), b
    assert doc["attempts"]["retries"] > 0 and "http_5xx" in doc["attempts"]["retry_causes"]


@pytest.fixture(scope="module")
def limited_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A real run against a simulator that lets 900 requests a minute through, one at a time
    (a burst of 1), and answers 429 with no Retry-After above it. The run's directory and its
    standard output (the end summary).

    What the tests need follows from counting, not from timing. The 24 items take 1.5 s at
    least to get through, one per 1/15 s, while a refused one is tried again within backoff_s
    (0.05 s): the 429s outnumber the items (some item is held twice). A shard's first window
    is judged at a 429 once it has sent 20 (LEARN_WINDOW_N, no time needed): all but those
    out (at most its cap, 4) and those let through (1 per 1/15 s) were refused, well over
    LEARN_SHARE of 20, so that judgement cuts its pace."""
    root = tmp_path_factory.mktemp("limited")
    write_input(root / "input.jsonl", 24)
    sim = {**FAST_SIM, "rpm_limit": 900, "rpm_burst": 1, "rpm_headers": "none"}
    write_job(root / "job.yaml", shards=2, concurrency=4,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim},
              retry={"backoff_s": 0.05, "backoff_max_s": 0.05})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=root)
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "runs" / "r1", done.stdout


def _server_limit_finding(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in doc["triage"]["findings"] if f["id"] == "server_rate_limit"]


def test_a_server_rate_limit_is_a_finding_with_the_numbers_of_its_log(
        limited_run: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The 429s, the retries they held and the items those were, and the pace the shards
    learned (each shard's last `rate_learned`, summed) are the event log's, counted here line
    by line; the time shares are the report's bucket shares; the C and the Python fold give
    the same; and the end summary says it in a line of the shards' own counts."""
    run, stdout = limited_run
    events = [orjson.loads(line) for path in sorted((run / "events").glob("shard-*.jsonl"))
              for line in path.read_bytes().splitlines()]
    refused = sum(e["ev"] == "attempt_end" and e["status"] == "http_429" for e in events)
    holds = [e for e in events if e["ev"] == "retry" and e["why"] == "rate_limited"]
    learned = {e["shard"]: e["rps"] for e in events if e["ev"] == "rate_learned"}  # the last
    assert refused and holds and learned  # the premise: the limit refused and taught a pace
    # and cut it: no header or words stated the limit (`limited_run`), so nothing seeded
    assert not any(e.get("seeded") or "tps" in e for e in events if e["ev"] == "rate_learned")
    doc, _ = load_report(run)
    found = _server_limit_finding(doc)
    assert len(found) == 1
    ev = found[0]["evidence"]
    assert (ev["http_429"], ev["held_retries"]) == (refused, len(holds))
    assert ev["held_items"] == len({e["span"] for e in holds}) < len(holds)
    pace = sum(learned.values())
    assert (ev["paced_rps"], ev["paced_rpm"]) == (round(pace, 3), round(pace * 60, 1))
    assert ev["paced_shards"] == len(learned)
    shares = doc["latency"]["bucket_share"]
    assert (ev["t_retry_share"], ev["t_queue_share"]) == (shares["t_retry"], shares["t_queue"])
    # What the server answered a minute of the run leads, and the advice's rpm is that one:
    # at most the limit (900), where the pace of the last cut need not be.
    answered = sum(e["ev"] == "attempt_start" for e in events) - refused
    duration = doc["run"]["duration_s"]  # the bucket let in 1 + 15 a second of it at most
    assert ev["answered_rpm"] == round(answered * 60 / duration, 1) <= 900 + 60 / duration
    assert next(iter(ev)) == "answered_rpm" and "rate_limits.rpm near answered_rpm" in (
        found[0]["control"])
    assert "the server's rate limit set the pace: SEEN; answered_rpm " in format_report(doc)
    monkeypatch.setenv("SHARDRUN_FAST_FOLD", "0")
    assert _server_limit_finding(load_report(run)[0]) == found
    summary = orjson.loads((run / "manifest.json").read_bytes())["summary"]
    assert summary["http_429s"] == refused  # every 429, held or not, as the log's
    said = re.search(r"^  server rate limit  ([\d,]+) 429s held, ([\d,]+) req/min answered on "
                     r"average, pace last cut to ([\d,]+) req/min \(", stdout, re.M)
    assert said is not None, stdout
    assert (said[1], said[3]) == (f"{len(holds):,}", f"{pace * 60:,.0f}"), stdout
    # Every 429 unanswered; the manifest's wall_s is rounded to the millisecond, the line's
    # rate is not, so it may round to the whole req/min on either side of this one's.
    lo, hi = ((summary["attempts"] - refused) * 60 / (summary["wall_s"] + d)
              for d in (0.0005, -0.0005))
    assert round(lo) <= int(said[2].replace(",", "")) <= round(hi), stdout


def test_a_token_limit_says_its_pace_in_tokens_set_from_the_stated_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulator that lets 24,000 tokens a minute through (a bucket of 60, so the shards'
    opening requests of about 40 tokens each are refused) and answers 429 in OpenAI's words
    for a token limit, with its x-ratelimit-*-tokens: each refused shard paces its tokens at
    its share of the stated limit and learns no pace of requests. The `rate_learned` lines say
    so (`tps`, `seeded`, no `rps` where 0 would say nothing was sent), and so do both folds'
    finding, the summary in the manifest and the summary's line: a pace in tokens a minute,
    set from the server's stated limit, not "0 req/min" cut."""
    write_input(tmp_path / "input.jsonl", 24)
    sim = {**FAST_SIM, "tpm_limit": 24_000, "tpm_burst": 60}
    write_job(tmp_path / "job.yaml", shards=2, concurrency=4,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    run = tmp_path / "runs" / "r1"
    events = [orjson.loads(line) for path in sorted((run / "events").glob("shard-*.jsonl"))
              for line in path.read_bytes().splitlines()]
    learned = [e for e in events if e["ev"] == "rate_learned"]
    assert learned, "no shard was refused: the premise"
    assert all("rps" not in e and e["seeded"] is True for e in learned), learned
    first = {e["shard"]: e["tps"] for e in learned[::-1]}  # each shard's first
    assert list(first.values()) == [pytest.approx(24_000 / 60 / 2)] * len(first)
    last = {e["shard"]: e["tps"] for e in learned}
    doc, _ = load_report(run)
    (found,) = _server_limit_finding(doc)
    ev = found["evidence"]
    assert (ev["paced_rps"], ev["paced_rpm"], ev["seeded_shards"]) == (None, None, len(last))
    assert ev["paced_tpm"] == round(sum(last.values()) * 60) > 0
    assert "rate_limits.tpm near paced_tpm" in found["control"]
    monkeypatch.setenv("SHARDRUN_FAST_FOLD", "0")
    assert _server_limit_finding(load_report(run)[0]) == [found]
    summary = orjson.loads((run / "manifest.json").read_bytes())["summary"]
    assert summary["paced_rps"] is None and summary["paced_seeded"] is True
    assert summary["paced_tps"] > 0
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("  server rate limit  ")]
    assert "pace set from the server's stated limit to " in line and "req/min (" not in line
    assert re.search(r"to [\d,]+ tokens/min \(", line), line


def test_rate_limit_holds_are_no_retry_storm_and_take_the_limits_advice(
        limited_run: tuple[Path, str]) -> None:
    """The holds for the server's rate limit are retries in the log, but no reason to "fix
    timeouts": the many-retries finding leaves them out (as it does the outage waits), and a
    dominant t_retry made of them takes the server limit's advice. A 429 retried on a backoff,
    as before holds (an older log: no hold counted), is a retry like any other."""
    doc, _ = load_report(limited_run[0])
    att = doc["attempts"]
    held = att["server_limit"]["held_retries"]
    assert held / att["first"] >= RETRY_RATE_LIMIT and att["retry_causes"] == {"http_429": held}
    assert "retries" not in {f["id"] for f in doc["triage"]["findings"]}
    doc["latency"]["bucket_share"] = {b: 0.9 if b == "t_retry" else 0.01 for b in BUCKETS}
    top = triage_section(doc)["dominant_bucket"]
    assert (top["bucket"], top["control"]) == ("t_retry", TABLE["server_rate_limit"][1])
    att["server_limit"]["held_retries"] = 0  # as an older log reads
    triage = triage_section(doc)
    assert triage["dominant_bucket"]["control"] == TABLE["t_retry"][1]
    (storm,) = [f for f in triage["findings"] if f["id"] == "retries"]
    assert storm["evidence"]["causes"] == {"http_429": held}


def test_a_few_held_429s_and_no_pace_are_no_finding_that_the_limit_set_the_pace(
        limited_run: tuple[Path, str]) -> None:
    """The rate-limited run's numbers, its pace cuts taken away: held retries under
    SERVER_LIMIT_SHARE of the attempts are only a smaller mention (`server_rate_limit_touched`)
    of them; from that share on, or with a pace cut or seeded however few the holds, the
    server's limit set the pace."""
    doc, _ = load_report(limited_run[0])
    limit = doc["attempts"]["server_limit"]
    started = doc["attempts"]["started"] = 1000
    limit |= {"pace_cuts": 0, "pace_seeds": 0, "held_retries": 1, "held_items": 1}

    def ids() -> list[str]:
        return [f["id"] for f in triage_section(doc)["findings"]
                if f["id"].startswith("server_rate_limit")]

    assert ids() == ["server_rate_limit_touched"]
    (touched,) = [f for f in triage_section(doc)["findings"] if f["id"] == ids()[0]]
    assert touched["evidence"]["held_share_of_attempts"] == 0.001
    limit["held_retries"] = round(SERVER_LIMIT_SHARE * started) - 1
    assert ids() == ["server_rate_limit_touched"]
    limit["held_retries"] += 1
    assert ids() == ["server_rate_limit"]
    limit["held_retries"] = 1
    for paced in ("pace_cuts", "pace_seeds"):
        assert ids() == ["server_rate_limit_touched"]
        limit[paced] = 1
        assert ids() == ["server_rate_limit"]
        limit[paced] = 0
    limit["held_retries"] = 0
    assert ids() == []


def test_a_dominant_t_retry_of_a_few_holds_takes_the_touched_findings_advice(
        limited_run: tuple[Path, str]) -> None:
    """A dominant t_retry made mostly of rate-limit holds takes the advice of the finding the
    holds earn: "set rate_limits near answered_rpm" only where the limit set the pace, and the
    touched finding's "nothing needed" where they were below SERVER_LIMIT_SHARE, no pace
    learned: the report must not advise in its bucket what its finding calls needless."""
    doc, _ = load_report(limited_run[0])
    att, limit = doc["attempts"], doc["attempts"]["server_limit"]
    att |= {"started": 1000, "retry_causes": {"http_429": 3, "timeout": 1}}
    limit |= {"pace_cuts": 0, "pace_seeds": 0, "held_retries": 3, "held_items": 3}
    doc["latency"]["bucket_share"] = {b: 0.9 if b == "t_retry" else 0.01 for b in BUCKETS}
    triage = triage_section(doc)
    assert [f["id"] for f in triage["findings"] if f["id"].startswith("server_rate_limit")] == [
        "server_rate_limit_touched"]
    top = triage["dominant_bucket"]
    assert (top["bucket"], top["meaning"], top["control"]) == (
        "t_retry", *TABLE["server_rate_limit_touched"])
    limit["pace_seeds"] = 1  # a pace learned: the limit set it, whatever the holds' share
    top = triage_section(doc)["dominant_bucket"]
    assert (top["meaning"], top["control"]) == TABLE["server_rate_limit"]


def _stated_limit_run(tmp_path: Path, fail_429: float) -> tuple[Path, str]:
    """A run of 400 items on 4 shards of 4 against a simulator whose answers state 600,000
    requests a minute and that answers a share `fail_429` of requests 429 anyway: the run's
    directory and its summary's "server rate limit" line."""
    write_input(tmp_path / "input.jsonl", 400)
    sim = {**FAST_SIM, "rpm_limit": 600_000, "fail_429": fail_429, "retry_after_s": 0.05}
    write_job(tmp_path / "job.yaml", shards=4, concurrency=4,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("  server rate limit  ")]
    return tmp_path / "runs" / "r1", line


def test_a_pace_seeded_from_a_stated_limit_sums_to_that_limit_as_shards_end(
        tmp_path: Path) -> None:
    """A server whose answers state 600,000 requests a minute and that answers some requests
    429 anyway: each of 4 shards seeds its pace at its share, 2,500 a second. As the input
    ends the shards finish one by one, and the survivors' paces are re-split up to the share
    of those gone (2,500, 3,333, 5,000, 10,000: summed, twice the limit); those re-splits are
    not what the limit left the run, so the summary's line and the report both say the pace
    the stated limit set, 600,000 a minute, not 1,250,000."""
    run, line = _stated_limit_run(tmp_path, 0.1)
    doc, _ = load_report(run)
    limit = doc["attempts"]["server_limit"]
    assert limit["paced_shards"] == limit["seeded_shards"] == 4, limit  # the premise
    assert limit["paced_rpm"] == 600_000, limit
    assert "pace set from the server's stated limit to 600,000 req/min (" in line, line


def test_stray_429s_far_below_a_stated_limit_did_not_set_the_pace(tmp_path: Path) -> None:
    """A server whose answers state a limit of 600,000 requests a minute (10,000 a second, more
    than 4 shards of 4 slots can send here) and that answers a few requests 429 anyway (2 %,
    under SERVER_LIMIT_SHARE), as a gateway's replica or a burst limit does: the shards set
    their pace from the stated limit (the premise), but the run sent far below it, so neither
    the end summary nor the report says the limit set the pace (nor advises a higher limit):
    a few requests met it."""
    run, line = _stated_limit_run(tmp_path, 0.02)
    summary = orjson.loads((run / "manifest.json").read_bytes())["summary"]
    # At 2 % of ~100 requests a shard may meet no 429 (1 run in 8 or so), nor seed a pace: at
    # least one shard's share, 2,500 a second, is seeded, far above what the run sends.
    assert summary["paced_seeded"] is True and summary["paced_rps"] >= 2_500, summary
    assert "pace set from the server's stated limit to " in line, line
    assert "(a few requests met the server's limit, held at no cost of attempts;" in line, line
    doc, _ = load_report(run)
    found = [f for f in doc["triage"]["findings"] if f["id"].startswith("server_rate_limit")]
    assert [f["id"] for f in found] == ["server_rate_limit_touched"], found
    assert found[0]["evidence"]["paced_rpm"] >= 150_000


def test_a_run_without_429s_has_no_server_limit_finding(real_run: Path) -> None:
    """A run the server never refused with 429: no finding, no line in the summary."""
    doc, _ = load_report(real_run)
    assert not _server_limit_finding(doc)
    assert doc["attempts"]["server_limit"] == {
        "http_429": 0, "held_retries": 0, "held_items": 0, "pace_cuts": 0, "pace_seeds": 0,
        "paced_shards": 0, "seeded_shards": 0, "paced_rps": None, "paced_rpm": None,
        "paced_tps": None, "paced_tpm": None}
    summary = orjson.loads((real_run / "manifest.json").read_bytes())["summary"]
    assert (summary["limited_429s"], summary["paced_rps"]) == (0, None)


def test_real_run_summary_and_report_give_one_run_average(real_run: Path) -> None:
    """The run's summary (printed, and in the manifest) and `report` both call it the run
    average: completion tokens over the same window, run_start to run_end. The summary timed
    from the coordinator's construction, before the launcher's fork (0.4 % apart on a 2 s
    run)."""
    summary = orjson.loads((real_run / "manifest.json").read_bytes())["summary"]
    doc, _ = load_report(real_run)
    start, end = doc["run"]["passes"][0]["start_t"], doc["run"]["passes"][0]["end_t"]
    assert summary["wall_s"] == round(end - start, 3)
    assert summary["completion_tpm_run"] == doc["tpm"]["run_average_tpm"]


def test_real_run_reports_the_client_cpu_from_its_log(real_run: Path) -> None:
    """`run_end` carries the client CPU the summary printed; the report reads it from the log
    and divides it by the log's attempts."""
    manifest = orjson.loads((real_run / "manifest.json").read_bytes())
    doc, _ = load_report(real_run)
    cpu = doc["client_cpu"]
    assert cpu["cpu_s"] == manifest["summary"]["client_cpu_s"] > 0
    assert (cpu["passes"], cpu["passes_recorded"]) == (1, 1)
    attempts = doc["attempts"]["started"]
    # cpu_s is rounded to the millisecond, the ratio is taken before that rounding
    assert cpu["ms_per_attempt"] == pytest.approx(cpu["cpu_s"] * 1e3 / attempts,
                                                  abs=0.5 / attempts + 1e-4)
    line = next(ln for ln in format_report(doc).splitlines() if "client CPU" in ln)
    assert f"{cpu['ms_per_attempt']:,.3f} ms per attempt" in line, line
    # A run under 5 s has no cores figure: the line leaves it out, as the summary does,
    # rather than say "- cores on average".
    cpu["cores"] = None
    line = next(ln for ln in format_report(doc).splitlines() if "client CPU" in ln)
    assert line.endswith(" s per 1k completion tokens"), line
    cpu["cores"] = 0.5
    line = next(ln for ln in format_report(doc).splitlines() if "client CPU" in ln)
    assert line.endswith(" s per 1k completion tokens, 0.50 cores on average"), line


def test_real_run_json_and_html(real_run: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints the schema'd document; --html writes one self-contained page."""
    assert main(["report", str(real_run), "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    assert doc["schema"] == "shardrun.report/1" and doc["run"]["run_id"] == "r1"
    pytest.importorskip("plotly")
    page = tmp_path / "report.html"
    assert main(["report", str(real_run), "--html", str(page)]) == 0
    html = page.read_text()
    assert "<script" in html and "<script src=" not in html  # plotly.js inlined: opens offline
    for title in ("Completion tokens per minute", "in_flight vs cap vs queue depth",
                  "Time-bucket percentiles", "TTFT distribution by prompt length",
                  "Retries by cause per minute"):
        assert title in html, title


def test_an_html_page_cut_short_by_a_full_disk_is_not_left_behind(real_run: Path,
                                                                   tmp_path: Path) -> None:
    """A write that fails part way (a file-size limit, as a full disk) leaves the earlier page
    as it was and no half page, which a browser would show as a whole one."""
    pytest.importorskip("plotly")
    page = tmp_path / "report.html"
    page.write_text("an earlier page\n")

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20,) * 2)  # plotly.js alone is more

    done = subprocess.run([sys.executable, "-m", "shardrun", "report", str(real_run), "--html",
                           str(page)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120, preexec_fn=limit)
    assert done.returncode == 1, done.stderr  # as publish -o's and export -o's
    assert done.stderr == (f"error: could not write {page}: file too large; nothing was "
                           "written (free some space, or name another file with --html)\n")
    assert page.read_text() == "an earlier page\n"
    assert [p.name for p in tmp_path.iterdir()] == [page.name]


@pytest.mark.parametrize("json", [True, False])
def test_a_report_cut_short_on_standard_output_by_a_full_disk_is_an_error(
        real_run: Path, tmp_path: Path, json: bool) -> None:
    """`report RUN > file` whose file meets a full disk (a file-size limit here): one sentence
    and exit 1, not a warning that a terminal may have hung up and exit 0 beside a half report
    (a JSON document cut short, which a script would then read)."""
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512,) * 2)

    with (tmp_path / "report.out").open("wb") as out:
        done = subprocess.run([sys.executable, "-m", "shardrun", "report", str(real_run),
                               *(["--json"] if json else [])], stdout=out,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                              timeout=120, preexec_fn=limit)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "error: could not write to standard output: file too large; what this command printed "
        "is cut short: free some space or send it elsewhere, then run the command again"
    ), done.stderr
    assert "Traceback" not in done.stderr


METRICS = Path(__file__).parent.parent / "docs" / "METRICS.md"
# Keys under these name things the run had (statuses, causes, buckets), not fixed fields.
OPEN_MAPS = frozenset({"by_status", "retry_causes", "causes", "dead_reasons", "pricing",
                       "shares", "evidence", "bucket_share", "all", "dists"})


def _schema_sections() -> dict[str, str]:
    """docs/METRICS.md's list of the JSON document: each top-level key and the text after it."""
    block = METRICS.read_text().split("## The JSON document", 1)[1]
    block = block.split("\n\n", 2)[2].split("\n\n", 1)[0]  # the indented list
    sections: dict[str, str] = {}
    name = ""
    for line in block.splitlines():
        head, _, rest = line[4:].partition(" ")
        if not line.startswith("     ") and rest.strip():
            name = head.rstrip(",")
        sections[name] = sections.get(name, "") + " " + (rest if line[4] != " " else line)
    sections["schema"] = sections.get("schema", "") + " schema generator method_version notes"
    return sections


def _undocumented(doc: Any, sections: dict[str, str], path: tuple[str, ...] = ()) -> set[str]:
    """The dotted paths of `doc` whose key METRICS' list of its section does not name."""
    found: set[str] = set()
    if isinstance(doc, list):
        for value in doc:
            found |= _undocumented(value, sections, path)
    elif isinstance(doc, dict):
        for key, value in doc.items():
            # A top-level key heads its own line of the list (or is on the first line).
            text = sections[path[0]] if path else " ".join(sections) + sections["schema"]
            if not re.search(rf"\b{re.escape(key)}\b", text):
                found.add(".".join((*path, key)))
            if key not in OPEN_MAPS:
                found |= _undocumented(value, sections, (*path, key))
    return found


def test_every_key_of_the_json_document_is_in_metrics(real_run: Path, tmp_path: Path) -> None:
    """docs/METRICS.md lists every key `report --json` writes, also those written only when
    they apply: a retry pass's `by_item`, `missing_files`, `added_files` and
    `results_changed`."""
    run = tmp_path / "r1"
    shutil.copytree(real_run, run)
    (run / "dead" / "superseded-r1").mkdir(parents=True)  # as a retry pass leaves it
    shutil.copy(run / "events" / "shard-00.jsonl", run / "events" / "shard-07.jsonl")
    (run / "events" / "shard-01.jsonl").unlink()
    with open(run / "results" / "shard-00.jsonl", "ab") as f:
        f.write(b'{"id": "by hand"}\n')
    doc, _ = load_report(run)
    assert {"by_item"} <= set(doc["items"])
    assert {"missing_files", "added_files", "results_changed"} <= set(doc["integrity"])
    assert doc["integrity"]["added_files"] == ["events/shard-07.jsonl"]
    assert not doc["integrity"]["ok"]
    del doc["integrity"]["missing_files"]  # named first; the copy is the next reason
    assert integrity_problem(doc) == ("events/shard-07.jsonl is not in the manifest's list of "
                                      "the run's files, though the pass that wrote it had "
                                      "ended: added since, or renamed")
    assert _undocumented(doc, _schema_sections()) == set()


def test_step_panels_are_titled_by_log_and_say_when_some_are_left_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed run has a log per shard and pass: each panel names its log ("00.r1"), and
    past the panel limit the title says how many logs are shown."""
    pytest.importorskip("plotly")
    import importlib

    from shardrun.report import _html

    logs = {"00": steady_shard(0, T0, minutes=1, per_minute=6),
            "00.r1": steady_shard(0, T0 + 600, minutes=1, per_minute=6),
            "01": steady_shard(1, T0, minutes=1, per_minute=6)}
    doc, loaded = load_report(write_run(tmp_path / "run", logs, None), trace=True)
    go, subplots = (importlib.import_module(m) for m in ("plotly.graph_objects", "plotly.subplots"))
    fig = _html.steps_figure(go, subplots, doc, loaded.shards)
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["shard log 00", "shard log 00.r1", "shard log 01"]
    assert "shard logs)" not in fig.layout.title.text
    monkeypatch.setattr(_html, "MAX_STEP_PANELS", 2)
    fig = _html.steps_figure(go, subplots, doc, loaded.shards)
    assert len(fig.layout.annotations) == 2
    assert "; the first 2 of 3 shard logs)" in fig.layout.title.text


@pytest.mark.parametrize("chunk", [64, 333, 4096])
def test_small_read_chunks_change_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          chunk: int) -> None:
    """Lines and checkpoints cut across read chunks give the same document as one big read."""
    import shardrun.report._scan as scan

    run = _hand_run(tmp_path)
    whole, _ = load_report(run)
    monkeypatch.setattr(scan, "CHUNK", chunk)
    pieces, _ = load_report(run)
    assert pieces == whole and pieces["integrity"]["ok"]


def test_many_change_points_become_envelopes() -> None:
    """Past the limit, the plot trace keeps per-second envelopes instead of every point."""
    from shardrun.aggregate import StepTrace, _steps

    trace = StepTrace()
    for i in range(_steps.TRACE_LIMIT + 1):
        trace.add(1000.0 + i / 1000, i % 7, i % 5)
    assert not trace.exact and trace.points == []
    assert trace.bins is not None and trace.bins[1000] == [6, 0, 4]
    assert len(trace.bins) == (_steps.TRACE_LIMIT + 1) // 1000 + 1


@pytest.mark.parametrize(("name", "value", "says"), [
    ("SHARDRUN_FAST_FOLD", "abc", "is neither 0 (fold event files in Python) nor 1"),
    ("SHARDRUN_AGGREGATE_WORKERS", "0", "is not a positive whole number; set it to the worker "
                                        "processes to use (1 or more), or unset it for the "
                                        "default"),
])
def test_a_bad_report_variable_is_one_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        name: str, value: str, says: str) -> None:
    run = _hand_run(tmp_path)
    monkeypatch.setenv(name, value)
    assert main(["report", str(run)]) == 2
    out = capsys.readouterr()
    assert out.err.startswith(f"error: {name}={value!r} {says}") and out.err.count("\n") == 1
    assert out.out == ""


def test_aggregate_workers_never_outnumber_the_event_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARDRUN_AGGREGATE_WORKERS=1000 on a run of two event files starts two workers, not a
    thousand processes for nothing (each fold is one file's)."""
    from shardrun.report import _rundir

    started: list[int] = []

    class Pool:
        def __init__(self, max_workers: int) -> None:
            started.append(max_workers)

        def __enter__(self) -> Pool:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def submit(self, fn: Any, *args: Any) -> Any:
            class Done:
                def result(self) -> Any:
                    return fn(*args)
            return Done()

    monkeypatch.setattr(_rundir, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(_rundir, "fold_shard_file", lambda *job: job)
    monkeypatch.setenv("SHARDRUN_AGGREGATE_WORKERS", "1000")
    assert _rundir._fold_all([("a",), ("b",)], None, 0) == [("a",), ("b",)]
    assert started == [2]


@pytest.mark.parametrize(("recorded", "rebuilt"), [
    ("continue with `shardrun job.yaml --resume R1 --shards 2`",
     "continue with `shardrun /p/job.yaml --resume R1 --runs-dir ../p/runs --shards 2`"),
    ("continue with `shardrun 'my job.yaml' --resume R1 --retry-failed --runs-dir runs "
     "--shards 2` (which also gives the items dead-lettered so far another pass)",
     "continue with `shardrun /p/job.yaml --resume R1 --retry-failed --runs-dir ../p/runs "
     "--shards 2` (which also gives the items dead-lettered so far another pass)"),
    ("then continue with `shardrun retry-failed runs/R1 --shards 2`",
     "then continue with `shardrun retry-failed ../p/runs/R1 --shards 2`"),
    ("run the same command again", "run the same command again"),
    ("continue with `shardrun report runs/R1`", "continue with `shardrun report runs/R1`"),
])
def test_a_recorded_way_on_is_named_from_the_run_directory_given(recorded: str,
                                                                 rebuilt: str) -> None:
    """The command a pass's stop named has the paths the pass was given, relative to where it
    ran: restated, it names the run directory as `report` was given it, the job file the
    manifest records (absolute) and the same flags, as `report` and `export` name theirs."""
    from shardrun.manifest import restate_way_on

    manifest = {"job": {"path": "/p/job.yaml"}, "carried_flags": ["--shards", "2"]}
    sentence = f"the endpoint is down: {recorded}"
    assert restate_way_on(sentence, Path("../p/runs/R1"), manifest) == (
        f"the endpoint is down: {rebuilt}")


def test_one_dead_letter_standing_and_one_more_minute_take_the_singular() -> None:
    """'1 dead letters standing' and '… 1 more minutes in --json' read as typos."""
    from shardrun.report._text import MAX_MINUTE_ROWS, format_items, format_tpm

    items = {"queued": 2, "succeeded": 1, "success_rate": 0.5, "dead": 1, "open": 0,
             "rejected_input_lines": 0, "abandoned": 0, "abandoned_at_restart": 0,
             "completion_tokens": 3, "prompt_tokens": 4,
             "by_item": {"succeeded": 1, "dead": 1, "success_rate": 0.5}}  # fmt: skip
    text = format_items({"items": items, "attempts": {"wasted_tokens": 0}})
    assert "1 succeeded, 1 dead letter standing, success rate" in text
    minutes = [{"minute": f"2026-01-01T00:{m:02d}Z", "completion_tokens": 1, "spans": 1,
                "per_shard": [1], "partial": False} for m in range(MAX_MINUTE_ROWS + 1)]
    text = format_tpm({"tpm": {"shards": [0], "per_shard_peak": [], "minutes": minutes,
                               "peak_full_minute": None, "best_minute_any": None,
                               "run_average_tpm": 1}})  # fmt: skip
    assert "… 1 more minute in --json" in text


def test_aggregate_workers_of_a_digit_that_is_no_number_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SHARDRUN_AGGREGATE_WORKERS=² passed str.isdigit and raised ValueError from int()."""
    from shardrun.errors import RunDirError
    from shardrun.report import _rundir

    monkeypatch.setenv("SHARDRUN_AGGREGATE_WORKERS", "²")
    with pytest.raises(RunDirError, match="is not a positive whole number"):
        _rundir._workers()


def test_an_html_page_to_dev_stdout_into_a_pipe_is_written(real_run: Path,
                                                          tmp_path: Path) -> None:
    """--html /dev/stdout, standard output a pipe: the page goes down the pipe, exit 0. The
    path resolves to /proc/PID/fd/pipe:[N], which does not exist, so it was taken for a file
    to write beside and rename over ('No such file or directory; nothing was written'). A link
    to a page is kept, the page it names written."""
    pytest.importorskip("plotly")
    done = subprocess.run([sys.executable, "-m", "shardrun", "report", str(real_run), "--html",
                           "/dev/stdout"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("<!DOCTYPE html>") and "</html>\n" in done.stdout
    page = tmp_path / "page.html"
    page.write_text("an earlier page\n")
    link = tmp_path / "link.html"
    link.symlink_to(page)
    assert main(["report", str(real_run), "--html", str(link)]) == 0
    assert link.is_symlink() and page.read_text().startswith("<!DOCTYPE html>")


def test_report_shows_each_pass_with_its_settings_their_source_and_its_throughput(
        tmp_path: Path) -> None:
    """A run resumed with a lower concurrency from SHARDRUN_CONCURRENCY: the report lists each
    pass with its shards and cap and where they came from (job file, flag, environment), its
    own successes, TPM and TTFT, and the share of its attempts the server throttled (429), so
    the reader sees what the change did; the blended run figures alone could not say it."""
    write_input(tmp_path / "input.jsonl", 60)
    sim = {**FAST_SIM, "fail_429": 0.3, "retry_after_s": 0.01}
    job = write_job(tmp_path / "job.yaml", endpoint={
        "base_url": "sim://", "api": "chat", "model": "m", "sim": sim},
        retry={"max_attempts": 10, "budget_ratio": 5})
    first = run_cli("run", str(job), "--limit", "20", "--shards", "3", "--quiet", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    # A slower server for the second pass, so that each pass's TTFT is its own.
    write_job(job, endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                             "sim": {**sim, "ttft_ms": 80}},
              retry={"max_attempts": 10, "budget_ratio": 5})
    second = run_cli("run", str(job), "--resume", "latest", "--quiet", cwd=tmp_path,
                     env={"SHARDRUN_CONCURRENCY": "2"})
    assert second.returncode == 0, second.stderr
    run_dir = next((tmp_path / "runs").iterdir())
    doc = orjson.loads(run_cli("report", str(run_dir), "--json", cwd=tmp_path).stdout)
    passes = doc["run"]["passes"]
    assert [(p["segment"], p["kind"], p["status"]) for p in passes] == [
        (0, "first", "succeeded"), (1, "resume", "succeeded")]
    assert [p["settings"]["shards"] for p in passes] == [
        {"value": 3, "source": "flag --shards"}, {"value": 2, "source": "job file"}]
    assert [p["settings"]["concurrency"] for p in passes] == [
        {"value": 8, "source": "job file"}, {"value": 2, "source": "env SHARDRUN_CONCURRENCY"}]
    assert [p["caps"] for p in passes] == [[8], [2]]
    assert [p["succeeded"] for p in passes] == [20, 40]
    for p in passes:
        assert p["attempts"] == p["succeeded"] + p["http_429"] and p["http_429"] > 0
        assert p["http_429_share"] == round(p["http_429"] / p["attempts"], 6)
        assert p["completion_tpm"] == round(
            p["completion_tokens"] * 60 / (p["end_t"] - p["start_t"]), 1)
    assert sum(p["completion_tokens"] for p in passes) == doc["items"]["completion_tokens"]
    # The median request TTFT of each pass's own answers (t_conn + t_first_token), to within
    # the quantile sketch's documented error; but of an answer whose first read held all of it
    # (a client that fell behind), which TTFT leaves out.
    for p, pattern in zip(passes, ("shard-??.jsonl", "shard-??.r1.jsonl"), strict=True):
        at_once = {(e["shard"], e["span"]) for f in (run_dir / "events").glob(pattern)
                   for e in read_jsonl(f) if e["ev"] == "attempt_end" and e.get("at_once")}
        results = [r for f in (run_dir / "results").glob(pattern) for r in read_jsonl(f)]
        assert len(results) == p["succeeded"]
        waits = sorted(r["buckets"]["t_conn"] + r["buckets"]["t_first_token"]
                       for r in results if (r["shard"], r["span"]) not in at_once)
        low, high = waits[(len(waits) - 1) // 2], waits[len(waits) // 2]
        assert low * (1 - 0.045) <= p["ttft_request_p50"] <= high * (1 + 0.045)
    text = run_cli("report", str(run_dir), cwd=tmp_path).stdout
    rows = text.split("\nPasses (", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    assert [row.split()[:6] for row in rows] == [
        ["0", "first", "succeeded", "3", "(flag", "--shards)"],
        ["1", "resume", "succeeded", "2", "(job", "file)"]]
    assert "2 (env SHARDRUN_CONCURRENCY)" in rows[1] and "8 (job file)" in rows[0]


def _as_killed(run: Path) -> None:
    """The manifest as a pass killed with kill -9 leaves it after its last answer was written:
    still running, with no end and no summary (the coordinator died before closing it)."""
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    for key in ("ended_at", "summary", "files"):
        manifest.pop(key, None)
    (run / "manifest.json").write_bytes(orjson.dumps({**manifest, "status": "running"}))


def test_a_crashed_run_with_every_item_accounted_for_says_a_resume_only_closes_it(
        tmp_path: Path) -> None:
    """Killed after every input item had its result or dead letter, a run was still said to be
    continued by --resume, as if items were left: it says that a resume only closes it, which
    is what a resume then does (nothing sent). With one answer gone, --resume runs it."""
    write_input(tmp_path / "input.jsonl", 6)
    write_job(tmp_path / "job.yaml", shards=1)
    for run_id in ("whole", "short"):
        first = run_cli("run", "job.yaml", "--run-id", run_id, "--quiet", cwd=tmp_path)
        assert first.returncode == 0, first.stderr
        _as_killed(tmp_path / "runs" / run_id)
    results = tmp_path / "runs" / "short" / "results" / "shard-00.jsonl"
    results.write_bytes(b"".join(results.read_bytes().splitlines(keepends=True)[:-1]))
    reason = load_report(tmp_path / "runs" / "whole")[0]["run"]["state_reason"]
    assert reason.endswith("; every input item has a result or a dead letter: --resume only "
                           "closes the run (it sends no request, and records the run's end)")
    short = load_report(tmp_path / "runs" / "short")[0]["run"]["state_reason"]
    assert short.endswith("; --resume continues it (it keeps every answer on disk)"), short
    resumed = run_cli("run", "job.yaml", "--resume", "whole", "--quiet", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "  attempts           0 (0 retries)" in resumed.stdout.splitlines()
    assert load_report(tmp_path / "runs" / "whole")[0]["run"]["state"] == "finished"


def test_a_crashed_run_whose_other_lines_are_answered_closes_despite_a_rejected_line(
        tmp_path: Path) -> None:
    """A rejected input line has no result or dead letter, and a resume sends nothing for it
    (it is rejected again): a run killed after every other item ended is one to close."""
    write_input(tmp_path / "input.jsonl", 4)
    with (tmp_path / "input.jsonl").open("ab") as f:
        f.write(b"{not json\n")
    write_job(tmp_path / "job.yaml", shards=1)
    first = run_cli("run", "job.yaml", "--run-id", "r1", "--quiet", cwd=tmp_path)
    assert first.returncode == 1 and "rejected" in first.stdout, first.stdout
    _as_killed(tmp_path / "runs" / "r1")
    reason = load_report(tmp_path / "runs" / "r1")[0]["run"]["state_reason"]
    assert reason.endswith("--resume only closes the run (it sends no request, and records "
                           "the run's end)"), reason
    resumed = run_cli("run", "job.yaml", "--resume", "r1", "--quiet", cwd=tmp_path)
    assert "  attempts           0 (0 retries)" in resumed.stdout.splitlines(), resumed.stdout


def test_a_crashed_run_before_its_input_end_is_said_to_continue_without_reading_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass whose log records no input end cannot have answered its last item: report says
    --resume continues it without reading every result id and the input (7 s for 1M items)."""
    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml", shards=1)
    first = run_cli("run", "job.yaml", "--run-id", "r1", "--quiet", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "runs" / "r1"
    _as_killed(run)
    log = run / "events" / "coordinator.jsonl"
    log.write_bytes(b"".join(line for line in log.read_bytes().splitlines(keepends=True)
                             if b'"input_end"' not in line))

    def unread(*_: object) -> None:
        raise AssertionError("the input and the results were read")

    monkeypatch.setattr("shardrun.export.run_input", unread)
    reason = load_report(run)[0]["run"]["state_reason"]
    assert reason.endswith("; --resume continues it (it keeps every answer on disk)"), reason


def test_a_crashed_run_whose_input_changed_is_not_said_to_be_closed_by_a_resume(
        tmp_path: Path) -> None:
    """Its answers cover every line of the input as it is now, but the input is no longer what
    an ended pass read (its first line edited, its last removed): a resume refuses it, so
    report does not say a resume only closes the run."""
    write_input(tmp_path / "input.jsonl", 4)
    write_job(tmp_path / "job.yaml", shards=1)
    first = run_cli("run", "job.yaml", "--run-id", "r1", "--quiet", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    _as_killed(tmp_path / "runs" / "r1")  # the pass's record of what it read stays
    lines = (tmp_path / "input.jsonl").read_bytes().splitlines(keepends=True)[:-1]
    (tmp_path / "input.jsonl").write_bytes(b"".join([lines[0].replace(b"0:", b"X:"),
                                                     *lines[1:]]))
    reason = load_report(tmp_path / "runs" / "r1")[0]["run"]["state_reason"]
    assert reason.endswith("; --resume continues it (it keeps every answer on disk)"), reason
    resumed = run_cli("run", "job.yaml", "--resume", "r1", "--quiet", cwd=tmp_path)
    assert resumed.returncode == 2 and "is not what run r1 read" in resumed.stderr


def test_answers_beyond_a_cut_log_hide_only_the_minutes_from_the_cut_to_the_file_s_last_write(
        ) -> None:
    """The answers a full disk left out of a log ended after its last event and before their
    file's last write: a minute outside those is whole in the log, and publishable."""
    from shardrun.report._rundir import BeyondLog

    cut = BeyondLog("results/shard-00.jsonl", "events/shard-00.jsonl", 9, 4,
                    log_ends=61 * 60 + 59.5, written=63 * 60 + 0.5)
    assert [m for m in range(59, 66) if cut.hides(m)] == [61, 62, 63]


def test_dead_letters_alone_beyond_a_cut_log_are_said_without_a_zero_count(
        tmp_path: Path) -> None:
    """Only dead letters lie beyond the log: the line under the items table names them
    alone, not "0 more succeeded and 1 dead letter"."""
    doc = load_report(run_with_a_cut_log(tmp_path / "run", "dead"))[0]
    assert doc["items"]["not_in_log"] == {"succeeded": 0, "dead": 1}
    assert ("  not in the event log: 1 dead letter on disk (a log cut by a full disk or a power "
            "cut; see Notes), in no figure here but still open where the log began their spans"
            ) in format_report(doc).splitlines()
    # The note counts one as one, not "1 dead letters ... 1 more dead letters are kept".
    assert ("dead/shard-01.jsonl holds 1 dead letter where its event log events/shard-01.jsonl "
            "records 0: ") in format_report(doc)
    assert "(1 more dead letter is kept; export and --resume see them)" in format_report(doc)

def test_answers_beyond_a_cut_log_hide_the_minutes_of_their_own_last_tokens(
        tmp_path: Path) -> None:
    """Tokens count at their last token, before the `released` the log lost, and a copy moves
    a file's mtime: the lines beyond the log say which minutes they fall in."""
    from shardrun.report._rundir import BeyondLog, _last_tokens

    path = tmp_path / "shard-00.jsonl"
    at = [61 * 60 + 1.0, 61 * 60 + 59.9, 62 * 60 + 0.5]  # the first is logged
    path.write_bytes(b"".join(orjson.dumps({"id": str(i), "last_token_at": t}) + b"\n"
                             for i, t in enumerate(at)) + b'{"id": "torn')
    answers = _last_tokens(path, 2)
    assert answers == (at[1], at[2])
    cut = BeyondLog("results/shard-00.jsonl", "events/shard-00.jsonl", 3, 1,
                    log_ends=62 * 60 + 0.2, written=65 * 60 + 1.0, answers=answers)
    assert [m for m in range(59, 67) if cut.hides(m)] == [61, 62]

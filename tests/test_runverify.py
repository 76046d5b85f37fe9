"""`shardrun verify RUN_DIR`: a whole run checked against its manifest, on real runs against
`sim://` (seconds each): untouched and multi-pass runs verify; an edited, cut, deleted or added
file is named with what differs; a live pass is refused, a crashed one checked as far as it can
be; a path that is neither a run nor a sample is exit 2."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import FAST_SIM, kill_tree, run_cli, write_input, write_job

from shardrun.cli_analysis import main
from shardrun.runverify import MAX_SHOWN

WAIT_GUARD_S = 60.0  # a hang guard, not a timing assertion
FAILING = {"base_url": "sim://", "api": "chat", "model": "m", "sim": {**FAST_SIM, "fail_500": 0.5}}
GOOD = {"base_url": "sim://", "api": "chat", "model": "m", "sim": FAST_SIM}
SLOW = {**GOOD, "sim": {**FAST_SIM, "ttft_ms": 300}}

HOLD = """
import sys
from pathlib import Path

import orjson
from shardrun.resume import lock_run
run = Path(sys.argv[1])
lock = lock_run(run)
manifest = orjson.loads((run / "manifest.json").read_bytes())
manifest["resumes"].append({"segment": 1, "retry_failed": True, "ended_at": None})
manifest.update(status="running", ended_at=None)  # as `resume_manifest` begins a pass
(run / "manifest.json").write_bytes(orjson.dumps(manifest))
print("held", flush=True)
sys.stdin.read()
"""


def _job(root: Path, endpoint: dict[str, Any], name: str = "job.yaml", **more: Any) -> None:
    write_job(root / name, endpoint=endpoint, retry={"max_attempts": 1}, **more)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run of 200 items, about half of them dead letters (HTTP 500, one attempt)."""
    root = tmp_path_factory.mktemp("finished")
    write_input(root / "input.jsonl", 200)
    _job(root, FAILING)
    done = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=root)
    assert done.returncode == 1, done.stderr  # items were dead-lettered
    run = root / "runs" / "r1"
    assert (run / "dead" / "shard-00.jsonl").stat().st_size > 0
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "r1"))


def _verify(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["verify", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("workers", ["", "2"])
def test_an_untouched_run_verifies_with_a_summary(finished: Path, workers: str,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every file the manifest lists, counted in the one line printed: files, bytes, lines;
    the same read by worker processes (`SHARDRUN_AGGREGATE_WORKERS`, as report folds)."""
    monkeypatch.setenv("SHARDRUN_AGGREGATE_WORKERS", workers)
    code, out, err = _verify(finished, capsys)
    assert code == 0, err
    listed = orjson.loads((finished / "manifest.json").read_bytes())["files"]
    size = sum(f["bytes"] for f in listed)
    lines = sum((finished / f["path"]).read_bytes().count(b"\n") for f in listed)
    assert out == (f"ok: run r1: {len(listed)} files ({size:,} bytes, {lines:,} lines) match the "
                   "SHA-256 and size its manifest records; the checkpoints of its 3 event "
                   "files verify; results/, events/ and dead/ hold no other file\n")


def _flip(run: Path) -> str:
    path = run / "results" / "shard-00.jsonl"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return "results/shard-00.jsonl differs from the manifest: SHA-256 "


def _truncate(run: Path) -> str:
    path = run / "dead" / "shard-01.jsonl"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    return (f"dead/shard-01.jsonl differs from the manifest: {size // 2:,} bytes where it "
            f"recorded {size:,}: cut short or rewritten")


def _append(run: Path) -> str:
    path = run / "results" / "shard-01.jsonl"
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b'{"id": "item-00000", "text": "another answer"}\n')
    return (f"47 bytes were appended to results/shard-01.jsonl after the manifest recorded its "
            f"{size:,}, though the run had ended; those {size:,} are as recorded")


def _delete(run: Path) -> str:
    (run / "events" / "shard-01.jsonl").unlink()
    return "events/shard-01.jsonl is listed in the manifest but missing from the run directory"


def _add(run: Path) -> str:
    (run / "dead" / "shard-02.jsonl").write_text('{"id": "forged"}\n')
    return "dead/shard-02.jsonl is in the run directory but not in the manifest (added, or renamed)"


def _rename(run: Path) -> str:
    (run / "results" / "shard-01.jsonl").rename(run / "results" / "shard-09.jsonl")
    return ("results/shard-01.jsonl is listed in the manifest but missing from the run "
            "directory\n  results/shard-09.jsonl is in the run directory but not in the manifest "
            "(it has the SHA-256 the manifest records for results/shard-01.jsonl, which is gone: "
            "renamed or moved)")


def _edit_event(run: Path) -> re.Pattern[str]:
    path = run / "events" / "shard-00.jsonl"
    data = path.read_bytes()
    at = data.index(b'"completion_tokens":') + len(b'"completion_tokens":')
    path.write_bytes(data[:at] + (b"9" if data[at:at + 1] != b"9" else b"8") + data[at + 1:])
    return re.compile(r"events/shard-00\.jsonl differs from the manifest: SHA-256 \w{12}… where "
                      r"it recorded \w{12}…, the same size \([\d,]+ bytes\): bytes were changed "
                      r"in place; its own checkpoints locate the change: line \d+: checkpoint "
                      r"SHA-256 \w{12}… does not match the bytes before it")


@pytest.mark.parametrize("tamper", [_flip, _truncate, _append, _delete, _add, _rename,
                                    _edit_event])
def test_each_tamper_is_named_with_what_differs(finished: Path, tmp_path: Path, tamper: Any,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A flipped byte in a result, a dead-letter file cut short, an event file deleted, a file
    added or renamed, an event edited: exit 1, and the file named with what differs."""
    run = _copy(finished, tmp_path)
    says = tamper(run)
    code, out, err = _verify(run, capsys)
    assert code == 1 and not out
    pattern = says if isinstance(says, re.Pattern) else re.compile(re.escape(says))
    problems = pattern.pattern.count("\n") + 1
    assert err.startswith(f"error: {run} does not match its manifest ({problems} problem"), err
    assert err.count("\n") == problems + 1 and re.search(":\n  " + pattern.pattern, err), err


def test_many_problems_are_named_up_to_a_bound(finished: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished, tmp_path)
    for i in range(MAX_SHOWN + 5):
        (run / "results" / f"added-{i:02d}.jsonl").write_text("{}\n")
    code, _, err = _verify(run, capsys)
    assert code == 1
    assert f"({MAX_SHOWN + 5} problems)" in err and err.endswith("\n  and 5 more\n"), err
    assert err.count("is in the run directory but not in the manifest") == MAX_SHOWN


def test_a_manifest_listing_a_path_outside_the_run_is_damaged(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _copy(finished, tmp_path)
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    manifest["files"].append({"path": "../outside", "sha256": "0" * 64, "bytes": 0})
    (run / "manifest.json").write_bytes(orjson.dumps(manifest))
    code, _, err = _verify(run, capsys)
    assert code == 1
    assert (f"the manifest's files[{len(manifest['files']) - 1}] is not a file of the run"
            in err), err


def _publish_into(run: Path, capsys: pytest.CaptureFixture[str]) -> list[Path]:
    """A sample where publish puts it (samples/) and one at the run's top level, as README
    says a sample or a report may go: files of the user's, not of the run."""
    written = []
    for out in ([], ["-o", str(run / "samples" / "mine.json")], ["-o", str(run / "top.json")]):
        assert main(["publish", str(run), *out]) == 0
        written.append(Path(capsys.readouterr().err.splitlines()[-1].removeprefix("wrote ")))
    return written


def test_samples_written_into_a_run_and_rewritten_after_a_pass_are_not_its_files(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Samples published into the run directory, a retry pass (whose end lists the run's
    files), the samples published again over them: the manifest lists none of them and verify
    passes. The list named every file under the run, so verify failed an untouched run with
    '... differs from the manifest ... rewritten'."""
    run = _copy(finished, tmp_path)
    before = [p.read_bytes() for p in _publish_into(run, capsys)]
    _job(tmp_path, GOOD, "good.yaml", input={"path": str(finished.parent.parent / "input.jsonl")})
    again = run_cli("retry-failed", str(run), "--job", "good.yaml", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    listed = {f["path"] for f in orjson.loads((run / "manifest.json").read_bytes())["files"]}
    assert not {p for p in listed if p.startswith("samples/") or p == "top.json"}, listed
    written = _publish_into(run, capsys)
    assert [p.read_bytes() for p in written] != before  # rewritten: the r1 files are in them
    code, out, err = _verify(run, capsys)
    assert code == 0 and out.startswith(f"ok: run r1: {len(listed)} files ("), err
    (run / "events" / "stray.jsonl").write_text("{}\n")  # the run's own folders: still checked
    code, _, err = _verify(run, capsys)
    assert code == 1 and "events/stray.jsonl is in the run directory but not" in err, err


def test_samples_an_older_manifest_lists_are_passed_over(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest an older shardrun wrote lists a sample and a report written into the run
    before a pass ended: rewritten since (or gone), they are no problem of the run's."""
    run = _copy(finished, tmp_path)
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    written = _publish_into(run, capsys)
    for path in written:
        manifest["files"].append({"path": path.relative_to(run).as_posix(), "sha256": "0" * 64,
                                  "bytes": 1})
    manifest["files"].append({"path": "report.html", "sha256": "0" * 64, "bytes": 1})
    (run / "manifest.json").write_bytes(orjson.dumps(manifest))
    code, out, err = _verify(run, capsys)
    assert code == 0, err
    assert out.startswith(f"ok: run r1: {len(manifest['files']) - 4} files ("), out


def test_a_run_after_retry_failed_verifies_clean(finished: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A retry pass moves the dead letters aside (dead/superseded-r1/) and writes files of its
    own: the manifest of its end lists each file of both passes at its last path and bytes."""
    run = _copy(finished, tmp_path)
    _job(tmp_path, GOOD, "good.yaml", input={"path": str(finished.parent.parent / "input.jsonl")})
    again = run_cli("retry-failed", str(run), "--job", "good.yaml", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    listed = {f["path"] for f in orjson.loads((run / "manifest.json").read_bytes())["files"]}
    assert {"dead/superseded-r1/shard-00.jsonl", "events/shard-00.r1.jsonl"} <= listed
    code, out, err = _verify(run, capsys)
    assert code == 0, err
    assert out.startswith(f"ok: run r1: {len(listed)} files (") and "6 event files" in out


def test_a_retry_pass_that_left_dead_letters_unreached_verifies_clean(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A retry pass that stops before it reaches every dead letter (--limit here, or a Ctrl-C)
    puts those back in dead/unretried-r1.jsonl, a file of the coordinator's, not a shard's:
    verify took it for a shard's and failed the run ("events/unretried-r1.jsonl is missing
    from the run directory, though its shard wrote dead/unretried-r1.jsonl")."""
    run = _copy(finished, tmp_path)
    _job(tmp_path, GOOD, "good.yaml", input={"path": str(finished.parent.parent / "input.jsonl")})
    some = run_cli("good.yaml", "--runs-dir", str(run.parent), "--resume", "r1",
                   "--retry-failed", "--limit", "3", cwd=tmp_path)  # fmt: skip
    assert some.returncode == 1, some.stderr  # dead letters are left
    assert (run / "dead" / "unretried-r1.jsonl").stat().st_size > 0
    code, out, err = _verify(run, capsys)
    assert code == 0, err
    assert out.startswith("ok: run r1: "), out


def _crash_a_retry_pass(run: Path, cwd: Path) -> None:
    """Start `retry-failed` against a slow simulator and kill -9 its coordinator once it has
    written a result; wait for its shards and simulator to exit by themselves."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    proc = subprocess.Popen([sys.executable, "-m", "shardrun", "retry-failed", str(run), "--job",
                             "slow.yaml"], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + WAIT_GUARD_S
        while not any(p.stat().st_size for p in run.glob("results/*.r1.jsonl")):
            assert time.monotonic() < deadline and proc.poll() is None, "no result written"
            time.sleep(0.02)
    finally:
        killed = kill_tree(proc, timeout=WAIT_GUARD_S)
    assert not killed.orphans, f"orphans: {killed.orphans}"


def test_a_crashed_retry_pass_is_checked_as_far_as_it_can_be(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A retry pass killed mid-run never listed its files: the files the pass before listed
    are checked against its list (the dead letters it set aside found unchanged where it put
    them), its event files up to their checkpoints, its results and dead letters not at all,
    each said; an edit to a file the list names is still caught."""
    run = _copy(finished, tmp_path)
    _job(tmp_path, SLOW, "slow.yaml", concurrency=2,
         input={"path": str(finished.parent.parent / "input.jsonl")})
    _crash_a_retry_pass(run, tmp_path)
    code, out, err = _verify(run, capsys)
    assert code == 0, err
    listed = orjson.loads((run / "manifest.json").read_bytes())["files"]
    assert out.startswith("ok, as far as a crashed run can be checked: resume 1 crashed before "
                          "it listed the run's files, so the list is the pass before's: the "
                          f"{len(listed)} files it names match it ("), out
    assert "; of the 7 files resume 1 wrote since, the 3 event files verify up to their " in out
    assert ("the 4 results or dead-letter files cannot be checked at all, having no checkpoints "
            "(dead/shard-00.r1.jsonl, ") in out
    for shard in ("00", "01"):
        assert (f"\n  dead/shard-{shard}.jsonl was set aside, unchanged, to "
                f"dead/superseded-r1/shard-{shard}.jsonl by a retry pass that did not end"
                in out), out
    # The launcher's log is shared by the passes: what the crashed one added is no change.
    with open(run / "logs" / "launcher.log", "ab") as f:
        f.write(b"a line the crashed pass's launcher wrote\n")
    code, out, err = _verify(run, capsys)
    assert code == 0, err
    assert ("\n  41 bytes were appended to logs/launcher.log after the manifest recorded its 0 "
            "(by the pass that crashed); those 0 are as recorded" in out), out
    # A listed event file grown since its list (no pass appends to another's) with a line
    # that breaks its checkpoints: the crash excuses the growth, not the broken chain.
    events = run / "events" / "shard-00.jsonl"
    kept = events.read_bytes()
    last = orjson.loads(kept.splitlines()[-1])
    with open(events, "ab") as f:
        f.write(orjson.dumps({**last, "t": last["t"] + 1, "lines": last["lines"] + 1,
                              "sha256": "0" * 64}) + b"\n")
    code, _, err = _verify(run, capsys)
    assert code == 1 and "appended to events/shard-00.jsonl" in err, err
    assert "fail its own checkpoints" in err, err
    events.write_bytes(kept)
    _flip(run)
    code, _, err = _verify(run, capsys)
    assert code == 1 and "results/shard-00.jsonl differs from the manifest" in err, err


def test_passes_that_all_crashed_are_checked_as_far_as_they_can_be(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first pass and a resume both killed: no list was ever written, and the first pass's
    files are no more 'added' than the resume's (verify named each of them a problem, 'in the
    run directory but not in the manifest', and exited 1)."""
    run = _copy(finished, tmp_path)
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    for key in ("files", "summary"):
        manifest.pop(key, None)
    manifest.update(status="running", ended_at=None, resumes=[{"started_at": "x"}])
    manifest["input"] = {"path": manifest["input"]["path"]}  # as a pass records it at start
    (run / "manifest.json").write_bytes(orjson.dumps(manifest))
    for name in ("shard-00", "coordinator"):  # what the killed resume wrote
        shutil.copy(run / "events" / f"{name}.jsonl", run / "events" / f"{name}.r1.jsonl")
    for path in run.rglob("*"):
        os.utime(path, (time.time() - 3600,) * 2)
    code, out, err = _verify(run, capsys)
    assert code == 0, err
    assert out.startswith("ok, as far as a crashed run can be checked: its first pass and "
                          "resume 1 crashed before any of them listed the run's files"), out


def test_dead_letters_set_aside_by_a_pass_that_never_began_are_found(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A retry pass killed after it set the dead letters aside and before its manifest entry
    was written leaves a finished run with them in dead/superseded-r1/ (the next pass puts
    them back): found there unchanged, and said; one edited there is not."""
    run = _copy(finished, tmp_path)
    aside = run / "dead" / "superseded-r1"
    aside.mkdir()
    for path in sorted((run / "dead").glob("*.jsonl")):
        path.rename(aside / path.name)
    code, out, err = _verify(run, capsys)
    assert code == 0, err
    assert out.endswith("\n  dead/shard-01.jsonl was set aside, unchanged, to "
                        "dead/superseded-r1/shard-01.jsonl by a retry pass that did not end\n")
    with open(aside / "shard-01.jsonl", "ab") as f:
        f.write(b'{"id": "forged"}\n')
    code, _, err = _verify(run, capsys)
    assert code == 1
    assert ("\n  dead/shard-01.jsonl is listed in the manifest but missing from the run "
            "directory\n") in err, err


def test_a_live_pass_is_refused(finished: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """A pass that holds the run (a real process holding its locks, its manifest entry begun):
    exit 2 and one sentence; once it is gone without closing its manifest, the run is a
    crashed one, and verified as such."""
    run = _copy(finished, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        code, out, err = _verify(run, capsys)
        assert code == 2 and not out
        assert err.startswith(f"error: {run} is still running (manifest status running; its "
                              "pass is alive (it holds .pass.lock)"), err
        assert err.endswith("so its files are still being written and its manifest lists "
                            "them as the previous pass left them; verify it once the pass has "
                            "ended\n"), err
        assert err.count("\n") == 1
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=WAIT_GUARD_S) == 0
    code, out, err = _verify(run, capsys)
    assert code == 0, err
    assert out.startswith("ok, as far as a crashed run can be checked: resume 1 crashed ")


def test_a_pass_starting_on_a_finished_run_is_refused(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A pass that holds the run's gate before its manifest entry says so (it is setting dead
    letters aside, say): refused too."""
    run = _copy(finished, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD.split("manifest = ")[0]
                               + "print('held', flush=True)\nsys.stdin.read()\n", str(run)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        code, _, err = _verify(run, capsys)
        assert code == 2
        assert err.startswith(f"error: {run} is still running (a process of the run holds its "
                              ".pass.lock or .lock)"), err
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=WAIT_GUARD_S) == 0
    assert _verify(run, capsys)[0] == 0


def test_a_path_that_is_neither_a_run_nor_a_sample_is_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gone = tmp_path / "gone"
    assert _verify(gone, capsys)[1:] == (
        "", f"error: {gone} is neither a run directory nor a sample file: nothing is there\n")
    assert _verify(gone, capsys)[0] == 2
    assert _verify(tmp_path, capsys) == (
        2, "", f"error: {tmp_path} is not a run directory: it has no manifest.json\n")
    text = tmp_path / "job.yaml"
    text.write_text("endpoint: {}\n")
    code, _, err = _verify(text, capsys)
    assert code == 2 and err.startswith(f"error: {text} is not valid JSON ("), err
    other = tmp_path / "other.json"
    other.write_text('{"schema": "shardrun.report/1"}')
    assert _verify(other, capsys)[0] == 2

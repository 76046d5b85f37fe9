"""The flush-before-finished rule of a shard's output files, and the event log's lines."""

from __future__ import annotations

import errno
import hashlib
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson

from shardrun.events import EventLog
from shardrun.shard_config import ShardConfig
from shardrun.shard_output import ShardOutput


def _output(tmp_path: Path, errors: list[Path]) -> ShardOutput:
    cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://x", api="chat",
                      model="m")
    return ShardOutput(cfg, lambda path, exc: errors.append(path))


def _full(*_: object, **__: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_flushed_lines_are_reported_once(tmp_path: Path) -> None:
    """Ids come out of take_finished after a flush, and only once."""
    out = _output(tmp_path, [])
    assert out.add_result("a", {"id": "a"}) and out.add_dead("b", {"id": "b"})
    assert out.flush()
    assert out.take_finished() == (["a"], ["b"])
    assert out.take_finished() == ([], [])
    out.close()
    assert (tmp_path / "results" / "shard-00.jsonl").read_bytes() == b'{"id":"a"}\n'


def test_failing_results_file_keeps_its_ids_back(tmp_path: Path) -> None:
    """When the results file cannot be flushed, its ids do not count as finished."""
    errors: list[Path] = []
    out = _output(tmp_path, errors)
    out.add_result("a", {"id": "a"})
    out.add_dead("b", {"id": "b"})
    out.results.flush = _full  # type: ignore[method-assign]
    assert not out.flush()
    assert out.take_finished() == ([], ["b"])
    assert errors == [out.results.path]


def test_failing_event_log_keeps_nothing_back(tmp_path: Path) -> None:
    """The event log is not the record of completion: its failure withholds no result id."""
    errors: list[Path] = []
    out = _output(tmp_path, errors)
    out.add_result("a", {"id": "a"})
    out.log.flush = _full  # type: ignore[method-assign]
    assert not out.flush()
    assert out.take_finished() == (["a"], [])
    assert errors == [out.log.path]


def test_lines_reach_their_files_only_when_flushed_events_first(tmp_path: Path) -> None:
    """However many lines are written, none is in its file before a flush (a shard killed
    meanwhile leaves nothing the coordinator was not told of), and a flush writes the event
    log before the results: a result line on disk always has its `released` event on disk."""
    out = _output(tmp_path, [])
    results_path = out.results.path
    record = {"id": "x", "output": "y" * 200}
    for n in range(1000):  # far beyond any file buffer (a buffered file wrote at 64 KB)
        out.log.emit("released", t=1.0, span=f"0-{n}", id=str(n), outcome="ok", reason=None)
        out.add_result(str(n), {**record, "id": str(n)})
    assert results_path.read_bytes() == b"" and out.log.path.read_bytes() == b""
    seen_with_results: list[int] = []
    flush_results = out.results.flush

    def flush_and_look() -> None:
        seen_with_results.append(out.log.path.read_bytes().count(b'"released"'))
        flush_results()

    out.results.flush = flush_and_look  # type: ignore[method-assign]
    assert out.flush()
    assert seen_with_results == [1000]  # every event was in its file before any result line
    assert results_path.read_bytes().count(b"\n") == 1000
    out.close()


def test_a_shard_killed_while_it_fsyncs_has_handed_every_line_to_the_os(tmp_path: Path) -> None:
    """A kill -9 during a flush's fsync finds every line already written: results and dead
    letters as well as their events (the event log's fsync came before the results' write, so
    a kill in it left answers whose events were on disk, run again and paid twice)."""
    script = textwrap.dedent("""
        import os, signal, sys
        from shardrun.shard_config import ShardConfig
        from shardrun.shard_output import ShardOutput
        cfg = ShardConfig(shard=0, run_id="r", out_dir=sys.argv[1], base_url="http://x",
                          api="chat", model="m")
        out = ShardOutput(cfg, lambda path, exc: None)
        for n in range(50):
            out.log.emit("released", t=1.0, span=f"0-{n}", id=str(n), outcome="ok", reason=None)
            out.add_result(str(n), {"id": str(n)})
        out.log.emit("released", t=1.0, span="0-50", id="50", outcome="dead", reason="x")
        out.add_dead("50", {"id": "50"})
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # killed in its first fsync
        out.flush(sync=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "events" / "shard-00.jsonl").read_bytes().count(b'"released"') == 51
    assert (tmp_path / "results" / "shard-00.jsonl").read_bytes().count(b"\n") == 50
    assert (tmp_path / "dead" / "shard-00.jsonl").read_bytes() == b'{"id":"50"}\n'


def test_event_log_lines_keys_and_checkpoints(tmp_path: Path) -> None:
    """Key order run_id, shard, ev, t, fields; nothing reaches the file before a flush; each
    checkpoint holds the line count and SHA-256 of every byte before it, across a reopen."""
    path = tmp_path / "e.jsonl"
    log = EventLog(path, run_id="r", shard=2)
    log.emit("released", t=1.5, span="2-1", id="a", outcome="ok", reason=None)
    log.emit("admitted", t=2.0, span="2-2", id="b")
    assert path.read_bytes() == b""
    log.checkpoint(2.5)
    log.checkpoint(2.6)  # nothing new since the last one: no line
    log.close()
    reopened = EventLog(path, run_id="r", shard=2)  # a resumed pass appends
    reopened.emit("queued", t=3.0, span="2-3", id="c", prompt_chars=4)
    reopened.checkpoint(3.5)
    reopened.close()
    lines = path.read_bytes().splitlines(keepends=True)
    first = orjson.loads(lines[0])
    assert list(first) == ["run_id", "shard", "ev", "t", "span", "id", "outcome", "reason"]
    assert (first["run_id"], first["shard"], first["ev"]) == ("r", 2, "released")
    assert [orjson.loads(x)["ev"] for x in lines] == [
        "released", "admitted", "checkpoint", "queued", "checkpoint"]
    for at in (2, 4):
        rec = orjson.loads(lines[at])
        assert rec["lines"] == at
        assert rec["sha256"] == hashlib.sha256(b"".join(lines[:at])).hexdigest()

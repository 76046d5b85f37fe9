"""Torn-line repair and the work source (duplicates, re-queued items, resume skipping)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import orjson
import pytest

from shardrun import manifest
from shardrun.inputs import FieldMap, InputReader
from shardrun.recovery import line_ids, repair_torn_tail
from shardrun.resume import setting_changes
from shardrun.worksource import WorkSource, id_digest

FIELDS = FieldMap("id", "prompt", None)


def test_torn_last_line_is_cut_and_complete_lines_stay(tmp_path: Path) -> None:
    """A last line without its newline is removed; the lines before it are untouched."""
    path = tmp_path / "r.jsonl"
    good = b'{"id": "a"}\n{"id": "b"}\n'
    path.write_bytes(good + b'{"id": "c", "outp')
    assert repair_torn_tail(path) == len(b'{"id": "c", "outp')
    assert path.read_bytes() == good
    assert list(line_ids(path)) == ["a", "b"]
    assert repair_torn_tail(path) == 0


def test_torn_only_line_leaves_an_empty_file(tmp_path: Path) -> None:
    """A file holding only a torn line becomes empty."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"id": "x"' * 10000)
    repair_torn_tail(path)
    assert path.read_bytes() == b""


def _input(tmp_path: Path, ids: list[str]) -> InputReader:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": i, "prompt": "p"}) + b"\n" for i in ids))
    return InputReader(path, FIELDS)


def test_duplicates_are_rejected_and_done_items_skipped(tmp_path: Path) -> None:
    """A repeated id goes to rejects with its line; ids done by an earlier pass are skipped."""
    reader = _input(tmp_path, ["a", "b", "a", "c", "d"])
    rejects = tmp_path / "rejects.jsonl"
    source = WorkSource(reader, rejects, done={id_digest("b")})
    assert [i["id"] for i in source.take(10)] == ["a", "c", "d"]
    assert source.exhausted and source.skipped == 1 and source.rejects == 1
    (reject,) = [orjson.loads(x) for x in rejects.read_bytes().splitlines()]
    assert reject["line"] == 3 and "duplicate id 'a'" in reject["reason"]


def test_requeued_items_come_first(tmp_path: Path) -> None:
    """Items given back by a dead shard are handed out before new input."""
    source = WorkSource(_input(tmp_path, ["a", "b", "c"]), tmp_path / "rej.jsonl")
    first = source.take(1)
    source.requeue(first)
    assert [i["id"] for i in source.take(2)] == ["a", "b"]
    assert [i["id"] for i in source.take(5)] == ["c"]
    assert source.empty


def test_setting_changes_compares_values_as_the_manifest_holds_them() -> None:
    """A value is compared after a JSON round trip (a tuple equals the list the manifest
    holds); a key an older manifest lacks, or a damaged record, is not compared."""
    now: dict[str, dict[str, object]] = {
        "params": {"value": {"stop": ("a", "b")}, "source": "job file"},
        "endpoint.model": {"value": "m2", "source": "job file"},
        "endpoint.api": {"value": "chat", "source": "default"},
    }
    started = {"params": {"value": {"stop": ["a", "b"]}, "source": "job file"},
               "endpoint.model": {"value": "m1", "source": "environment"}}  # fmt: skip
    keys = ("params", "endpoint.model", "endpoint.api")
    assert setting_changes(started, now, keys) == [("endpoint.model", "m1", "m2")]
    assert setting_changes(None, now, keys) == []
    assert setting_changes({"endpoint.model": "m1"}, now, keys) == []
    # A run started before params were masked in the manifest: its key is no change to warn of
    # (and print), nor shown when another param changed.
    now["params"]["value"] = {"api_key": "***", "stop": ["a"]}
    started["params"]["value"] = {"api_key": "sk-old-0123456789", "stop": ["a", "b"]}
    assert setting_changes(started, now, ("params",)) == [
        ("params", {"api_key": "***", "stop": ["a", "b"]}, {"api_key": "***", "stop": ["a"]})]
    now["params"]["value"] = {"api_key": "***", "stop": ["a", "b"]}
    assert setting_changes(started, now, ("params",)) == []


def test_an_atomic_write_syncs_the_file_then_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`manifest.write_atomic` (the manifest, dead/unretried-rK.jsonl) fsyncs the temporary
    file and, after the rename, the directory holding it: the rename is an entry of the
    directory, and unsynced a power loss can bring back the old file or none."""
    path = tmp_path / "manifest.json"
    path.write_bytes(b"old")
    synced: list[tuple[bool, int]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        synced.append((stat.S_ISDIR(st.st_mode), st.st_ino))
        real(fd)

    monkeypatch.setattr(manifest.os, "fsync", fsync)
    manifest.write_atomic(path, [b"a\n", b"b\n"])
    assert path.read_bytes() == b"a\nb\n"
    assert synced == [(False, path.stat().st_ino), (True, tmp_path.stat().st_ino)]
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_directory_that_cannot_be_synced_after_the_rename_is_no_failed_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """Once the temporary file has replaced `path`, a directory fsync that fails (EIO, or a file
    system that refuses it) is warned of once, not raised: the file holds the new bytes, and
    an error saying the write failed would send the caller to redo or report lost what is
    written."""
    path = tmp_path / "manifest.json"
    path.write_bytes(b"old")
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(manifest.os, "fsync", fsync)
    monkeypatch.setattr(manifest, "_dir_sync_warned", False)
    manifest.write_atomic(path, b"new")
    manifest.write_atomic(path, [b"newer\n"])
    assert path.read_bytes() == b"newer\n"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert f"{path} is written, but its directory could not be synced" in err


def test_a_simulator_key_an_older_manifest_holds_is_no_change() -> None:
    """A run started before `endpoint.sim.auth_required` was masked in the manifest: a resume
    with the same key warned that the simulator settings changed, printing the key; a change
    of another simulator setting is shown with the key masked."""
    sim = {"auth_required": "sk-sim-0123456789", "ttft_ms": 5}
    started = {"endpoint.sim": {"value": sim, "source": "job file"}}
    now: dict[str, dict[str, object]] = {
        "endpoint.sim": {"value": {"auth_required": "***", "ttft_ms": 5}, "source": "job file"}}
    assert setting_changes(started, now, ("endpoint.sim",)) == []
    now["endpoint.sim"]["value"] = {"auth_required": "***", "ttft_ms": 9}
    assert setting_changes(started, now, ("endpoint.sim",)) == [
        ("endpoint.sim", {"auth_required": "***", "ttft_ms": 5},
         {"auth_required": "***", "ttft_ms": 9})]
    assert sim["auth_required"] == "sk-sim-0123456789"  # the manifest read is not altered

"""The flush-before-finished rule of a shard's output files."""

from __future__ import annotations

import errno
from pathlib import Path

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

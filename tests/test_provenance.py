"""Minute samples: publish, verify, the canonical line hash, and the tamper matrix.

Runs are written in both event layouts: today's (the last-token instant on `attempt_end`) and
the older one (a `last_token` line per attempt), whose samples must stay verifiable.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import FAST_SIM, kill_tree, null_device, run_cli, write_input, write_job
from test_aggregate_fixtures import (
    RUN_ID,
    B,
    ev,
    run_with_a_cut_log,
    steady_shard,
    write_run,
)

from shardrun._urls import endpoint_kind
from shardrun.aggregate import minute_label, parse_minute
from shardrun.cli_analysis import main
from shardrun.provenance import (
    SAMPLE_SCHEMA,
    PublishError,
    VerifyError,
    _file_record,
    _load,
    figure,
    publish,
    verify,
)
from shardrun.report._rundir import load_run
from shardrun.runverify import verify_run

M = B // 60
WAIT_S = 60.0  # a hang guard, not a timing assertion


def _coordinator() -> list[dict[str, Any]]:
    return [ev("run_start", B - 31, shard=None, shards=2, cap=4),
            ev("input_end", B + 100, shard=None, lines=27, rejects=0),
            ev("run_end", B + 160, shard=None, status="succeeded")]


LAYOUTS = ("new", "old")


def _run(root: Path, status: str = "succeeded", layout: str = "new") -> Path:
    """Shard 00: 30 tokens in each of minutes M and M+1; shard 01: 15 more in M+1."""
    shards = {"00": steady_shard(0, B - 30, minutes=3, per_minute=6, layout=layout),
              "01": steady_shard(1, B + 59, minutes=1, per_minute=3, layout=layout)}
    return write_run(root, shards, _coordinator(), status=status)


@pytest.fixture(params=LAYOUTS)
def published(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    run = _run(tmp_path / "run", layout=request.param)
    _, path = publish(run)
    return run, path


def _lines_per_span(run: Path) -> int:
    """2 in today's layout (attempt_end, released), 3 in the older one (plus last_token)."""
    return 3 if b'"ev":"last_token"' in (run / "events" / "shard-00.jsonl").read_bytes() else 2


def test_publish_picks_the_peak_full_minute(published: tuple[Path, Path]) -> None:
    """The default sample is minute M+1: 45 tokens from 9 spans, split 30 / 15."""
    run, path = published
    sample = orjson.loads(path.read_bytes())
    assert path == run / "samples" / f"minute-{minute_label(M + 1).replace(':', '')}.json"
    assert (sample["minute"], sample["completion_tokens"], sample["spans"]) == (
        minute_label(M + 1), 45, 9)
    assert [(s["shard"], s["completion_tokens"], s["spans"]) for s in sample["per_shard"]] == [
        ("00", 30, 6), ("01", 15, 3)]
    assert sample["partial"] is False and sample["lines_counted"] == 9 * _lines_per_span(run)
    assert [f["path"] for f in sample["files"]] == [
        "events/coordinator.jsonl", "events/shard-00.jsonl", "events/shard-01.jsonl"]
    assert sample["schema"] == "shardrun.sample/1" and sample["run_id"] == RUN_ID
    assert sample["method"] == {"name": "completion_tokens_by_last_token_minute", "version": 1}



def test_publish_passes_over_a_peak_a_cut_log_may_leave_short(tmp_path: Path) -> None:
    """Answers beyond shard 01's cut log ended in the peak minute M+1: by default the sample
    is M, the busiest minute no cut hides, and a warning says why; M+1 asked for is refused."""
    run = run_with_a_cut_log(tmp_path / "run", "results")
    warnings: list[str] = []
    sample, _ = publish(run, warnings=warnings)
    assert (sample["minute"], sample["completion_tokens"], sample["partial"]) == (
        minute_label(M), 30, False)
    assert warnings == [
        f"minute {minute_label(M + 1)} has more tokens, but a cut event log may leave its "
        f"figure short (see `shardrun report`), so this is {minute_label(M)}, the busiest "
        "minute no cut does"]
    with pytest.raises(PublishError, match=(
            f"^minute {minute_label(M + 1)}: results/shard-01.jsonl holds 1 more line than its "
            r"event log .*; publish another with --minute, such as "
            f"{minute_label(M)}$")):
        publish(run, minute=minute_label(M + 1))


def test_dead_letters_beyond_a_cut_log_leave_the_minute_publishable(tmp_path: Path) -> None:
    """A dead letter adds no completion tokens and a sample counts no failures: one a cut log
    lacks leaves the figure of the minute it may have ended in whole, so M+1 is published."""
    run = run_with_a_cut_log(tmp_path / "run", "dead")
    [cut] = load_run(run).beyond_log()
    assert cut.path == "dead/shard-01.jsonl" and cut.hides(M + 1)
    for minute in (None, minute_label(M + 1)):
        warnings: list[str] = []
        sample, _ = publish(run, minute=minute, warnings=warnings)
        assert (sample["minute"], sample["completion_tokens"]) == (minute_label(M + 1), 45)
        assert warnings == []

METRICS = Path(__file__).resolve().parent.parent / "docs" / "METRICS.md"


def _outline_names(outline: str) -> list[str]:
    """The top-level names of an outline as METRICS writes one (`a (note), b{c}, d[{e}]`)."""
    outline = re.sub(r"(?<=\S) {3,}\S[^\n]*", "", outline)  # a note after a line's names
    inner = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]|\([^()]*\)")
    while inner.search(outline):
        outline = inner.sub("", outline)
    return re.findall(r"[a-z_0-9.]+", outline)


def test_the_sample_has_the_fields_metrics_lists_in_its_order(
        published: tuple[Path, Path]) -> None:
    """METRICS' outline of a sample names its keys, and those of its per-shard, file and pass
    entries, in the order `publish` writes them."""
    _, path = published
    sample = orjson.loads(path.read_bytes())
    block = METRICS.read_text().split("\n## Minute samples", 1)[1].split("\n\n")[1]
    assert _outline_names(block) == list(sample)
    for name in ("per_shard", "files", "passes"):
        entry = re.search(rf"\b{name}\[\{{(.*?)\}}\]", block, re.DOTALL)
        assert entry and _outline_names(entry[1]) == list(sample[name][0]), name


def test_verify_confirms_in_one_line(published: tuple[Path, Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """An untouched run verifies: exit 0 and one line naming the figure."""
    _, path = published
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"ok: run {RUN_ID} minute {minute_label(M + 1)}: 45 completion")
    assert "\n" not in out


def test_verify_given_the_run_directory_names_its_sample(
        published: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The library's sample check given a directory: one sentence naming the run's newest
    sample, or how to make one. (`shardrun verify RUN_DIR` checks the run itself, against its
    manifest: tests/test_runverify.py; this hand-made run's manifest lists no files.)"""
    run, path = published
    with pytest.raises(VerifyError) as caught:
        verify(run)
    assert str(caught.value) == (
        f"{run} is a directory, and verify takes a sample file that `shardrun publish` "
        f"wrote; the newest sample of this run is {path}")
    bare = _run(tmp_path / "bare")
    with pytest.raises(VerifyError, match=f"; `shardrun publish {bare} --peak` makes one$"):
        verify(bare)
    assert main(["verify", str(run)]) == 1
    assert capsys.readouterr().err == (
        f"error: {run}/manifest.json lists no files (a run of a shardrun older than the list, "
        "or a manifest edited by hand), so there is nothing to check the run against\n")


def test_lines_hash_is_the_documented_canonical_order(published: tuple[Path, Path]) -> None:
    """Per shard: the ok attempt_end and released lines of each counted span (before them its
    last_token line, in the older layout), in release order; overall: SHA-256 of
    "<file> <lines> <hash>" lines in file order."""
    run, path = published
    sample = orjson.loads(path.read_bytes())
    top = hashlib.sha256()
    for shard in sample["per_shard"]:
        pending: dict[str, list[bytes]] = {}
        sha, n = hashlib.sha256(), 0
        for line in (run / shard["file"]).read_bytes().splitlines():
            rec = orjson.loads(line)
            if rec["ev"] in ("last_token", "attempt_end"):
                pending.setdefault(rec["span"], []).append(line)
            elif rec["ev"] == "released":
                kept = [*pending.pop(rec["span"]), line]
                first = orjson.loads(kept[0])
                last_t = first["t"] if first["ev"] == "last_token" else first["last_token_t"]
                if int(last_t // 60) == M + 1:
                    sha.update(b"".join(k + b"\n" for k in kept))
                    n += len(kept)
        assert (shard["lines"], shard["lines_sha256"]) == (n, sha.hexdigest())
        top.update(f"{shard['file']} {n} {sha.hexdigest()}\n".encode())
    assert sample["lines_sha256"] == top.hexdigest()


def test_publish_a_chosen_minute(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--minute M gives shard 00's 30 tokens; a minute outside the run is refused."""
    run = _run(tmp_path / "run")
    assert main(["publish", str(run), "--minute", minute_label(M)]) == 0
    assert orjson.loads(capsys.readouterr().out)["completion_tokens"] == 30
    with pytest.raises(PublishError, match="outside the run"):
        publish(run, minute=minute_label(M + 60))
    with pytest.raises(PublishError, match="is not a minute"):
        publish(run, minute="yesterday")


def test_publish_of_a_run_without_a_success_says_where_to_look(tmp_path: Path) -> None:
    """An ended run in which nothing succeeded has no minute to publish: it says so, and names
    the report that tells why."""
    run = write_run(tmp_path / "run", {"00": steady_shard(0, B, minutes=0, per_minute=1)},
                    _coordinator(), status="failed")
    with pytest.raises(PublishError) as refused:
        publish(run)
    assert str(refused.value) == (
        f"{run} has no successful span, so no minute has completion tokens to publish "
        f"(`shardrun report {run}` shows why)")


def test_publish_refuses_running_or_altered_runs(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A run still being written, or a log failing its own checkpoints, is not published. The
    first is one to publish later (exit 2, as verify refuses it); the second a failed
    verification (exit 1, as verify's of that run), not a usage error."""
    running = _run(tmp_path / "a", status="running")
    with pytest.raises(PublishError, match="still running"):
        publish(running)
    assert main(["publish", str(running)]) == 2
    altered = _run(tmp_path / "b")
    _list_event_files(altered)
    log = altered / "events" / "shard-00.jsonl"
    log.write_bytes(log.read_bytes().replace(b'"tokens":5', b'"tokens":6', 1))
    with pytest.raises(PublishError, match="fails its own checkpoints"):
        publish(altered)
    capsys.readouterr()
    assert main(["publish", str(altered)]) == 1
    assert capsys.readouterr().err.endswith("; refusing to publish from altered files\n")
    assert main(["verify", str(altered)]) == 1
    assert "events/shard-00.jsonl differs from the manifest" in capsys.readouterr().err


def _list_event_files(run: Path) -> None:
    """The manifest's list of the run's files, as a pass writes it when it ends."""
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    manifest["files"] = [{"path": f"events/{p.name}", "sha256": hashlib.sha256(
        p.read_bytes()).hexdigest(), "bytes": p.stat().st_size} for p in run.glob("events/*")]
    (run / "manifest.json").write_bytes(orjson.dumps(manifest))


def test_a_listed_event_file_gone_is_refused_by_publish_and_failed_by_verify(
    tmp_path: Path,
) -> None:
    """The manifest lists every event file: with one deleted, publishing would count half the
    run, so publish refuses; a sample written for what is left (by hand) fails verify."""
    run = _run(tmp_path / "run")
    _list_event_files(run)
    _, sample = publish(run)
    (run / "events" / "shard-01.jsonl").unlink()
    with pytest.raises(PublishError, match=r"events/shard-01\.jsonl is listed in the manifest "
                                           "but missing from the run directory; refusing"):
        publish(run)
    forged = _forge(run, sample)
    with pytest.raises(VerifyError, match=r"^events/shard-01\.jsonl is listed in the manifest "
                                          "but missing from the run directory$"):
        verify(forged)


def test_an_event_file_added_to_an_ended_run_is_refused_by_publish_and_failed_by_verify(
    tmp_path: Path,
) -> None:
    """A copy of a shard log under a new name has checkpoints of its own that verify, and
    would count its spans twice (the figure 45 -> 60): the manifest's list, written when the
    run ended, does not name it, so publish refuses and verify fails a sample that counts it."""
    run = _run(tmp_path / "run")
    _list_event_files(run)
    _, sample = publish(run)
    # Under a shard's name, or as a resume's log (a pass the manifest has no record of).
    for name in ("shard-02.jsonl", "shard-01.r1.jsonl"):
        shutil.copy(run / "events" / "shard-01.jsonl", run / "events" / name)
        reason = (f"events/{re.escape(name)} is not in the manifest's list of the run's files, "
                  "though the pass that wrote it had ended: added since, or renamed")
        with pytest.raises(PublishError, match=reason + "; refusing"):
            publish(run)
        forged = _forge(run, sample)
        assert orjson.loads(forged.read_bytes())["completion_tokens"] == 60
        with pytest.raises(VerifyError, match=f"^{reason}$"):
            verify(forged)
        (run / "events" / name).unlink()


def test_spans_released_past_the_last_checkpoint_of_a_crashed_log_are_named(
        tmp_path: Path) -> None:
    """A crashed log's lines after its last checkpoint are hashed in the sample but proven by
    nothing the run wrote: an edit there (tokens 5 -> 5,000) verifies. publish warns and
    verify's confirmation says how many of the minute's spans and tokens lie there."""
    run = _run(tmp_path / "run", status="running")
    log = run / "events" / "shard-00.jsonl"
    lines = _lines(log)
    marks = [i for i, line in enumerate(lines) if b'"ev":"checkpoint"' in line]
    # A checkpoint falls between a span's attempt_end and its released line. Two of them
    # gone, the log cut after the next released line, as a kill leaves a log: three spans'
    # released lines lie past the last checkpoint, the first one's attempt_end before it.
    gone, cut = next((a, b) for last, a, b in zip(marks, marks[1:], marks[2:], strict=False)
                     if len({int(orjson.loads(line)["t"] // 60)
                             for line in lines[last:b + 2]}) == 1)
    lines = lines[:gone] + lines[gone + 1:cut] + [lines[cut + 1]]
    end = next(orjson.loads(line) for line in lines[gone:] if b'"ev":"attempt_end"' in line)
    at = lines.index(orjson.dumps(end) + b"\n")
    lines[at] = orjson.dumps({**end, "completion_tokens": 5000}) + b"\n"
    log.write_bytes(b"".join(lines))
    for path in run.glob("events/*"):
        os.utime(path, (time.time() - 3600,) * 2)  # crashed an hour ago
    minute = minute_label(int((end["last_token_t"] or end["t"]) // 60))
    warnings: list[str] = []
    _, sample = publish(run, minute=minute, warnings=warnings)
    said = ("3 of its spans (5,005 tokens or more) were released past the last good checkpoint "
            "of events/shard-00.jsonl (a shard or a run that crashed, or a log written "
            "without checkpoints): no checkpoint proves those lines, so an edit there would verify")
    assert warnings == [f"minute {minute}: {said}"]
    assert verify(sample).endswith(f"the figure and its counted lines recompute; but {said}")


def test_a_sample_forged_over_an_edited_log_fails_verify(tmp_path: Path) -> None:
    """An edited number, and a sample made anew from the edited files (hashes and figure
    match them): verify still fails, on the file's own checkpoints."""
    run = _run(tmp_path / "run")
    _, sample = publish(run)
    log = run / "events" / "shard-00.jsonl"
    log.write_bytes(log.read_bytes().replace(b'"tokens":5', b'"tokens":6', 1))
    with pytest.raises(VerifyError, match=r"^events/shard-00\.jsonl fails its own checkpoints"):
        verify(_forge(run, sample))


def _forge(run: Path, sample: Path) -> Path:
    """The sample a forger would write for the run's files as they are now: every hash and
    figure recomputed, as publish would without its checks."""
    loaded = _load(run, None)
    doc = orjson.loads(sample.read_bytes())
    doc.update(figure(loaded, parse_minute(doc["minute"])).as_dict(),
               files=[_file_record(s) for s in loaded.scans])
    forged = sample.with_name("forged.json")
    forged.write_bytes(orjson.dumps(doc))
    return forged


def _hashes_written_anew(run: Path, sample: Path) -> None:
    """A byte flipped, and the sample's SHA-256, size and lines written for the file as it is
    now (not its checkpoint counts): the file's own chain names the change, not a count."""
    _flip(run, sample)
    log = run / "events" / "shard-00.jsonl"
    doc = orjson.loads(sample.read_bytes())
    rec = next(f for f in doc["files"] if f["path"] == "events/shard-00.jsonl")
    data = log.read_bytes()
    rec.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data),
               lines=data.count(b"\n"))
    sample.write_bytes(orjson.dumps(doc))


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _flip(run: Path, sample: Path) -> None:
    log = run / "events" / "shard-00.jsonl"
    data = bytearray(log.read_bytes())
    at = data.index(b'"completion_tokens":5') + len(b'"completion_tokens":')
    data[at] = ord("7")
    log.write_bytes(bytes(data))


def _delete(run: Path, sample: Path) -> None:
    log = run / "events" / "shard-01.jsonl"
    lines = _lines(log)
    log.write_bytes(b"".join(lines[:9] + lines[10:]))


def _add(run: Path, sample: Path) -> None:
    log = run / "events" / "shard-01.jsonl"
    lines = _lines(log)
    log.write_bytes(b"".join([*lines[:10], lines[9], *lines[10:]]))


def _edit_sample(**changes: Any) -> Callable[[Path, Path], None]:
    def edit(run: Path, sample: Path) -> None:
        doc = orjson.loads(sample.read_bytes())
        for key, value in changes.items():
            if key == "spans_of_01":
                doc["per_shard"][1]["spans"] = value
            elif key == "file_sha":
                doc["files"][1]["sha256"] = value
            elif key == "file_of_01":
                doc["per_shard"][1]["file"] = value
            elif key == "covered_lines_of_00":
                doc["files"][1]["covered_lines"] = value
            else:
                doc[key] = value
        sample.write_bytes(orjson.dumps(doc))

    return edit


def _rename(run: Path, sample: Path) -> None:
    (run / "events" / "shard-01.jsonl").rename(run / "events" / "shard-05.jsonl")


def _remove(run: Path, sample: Path) -> None:
    (run / "events" / "shard-01.jsonl").unlink()


def _extra(run: Path, sample: Path) -> None:
    shutil.copy(run / "events" / "shard-01.jsonl", run / "events" / "shard-02.jsonl")


def _emptied(run: Path, sample: Path) -> None:
    (run / "events" / "shard-01.jsonl").write_bytes(b"")


def _resumed(run: Path, sample: Path) -> None:
    shutil.copy(run / "events" / "shard-01.jsonl", run / "events" / "shard-01.r1.jsonl")


def _swapped(run: Path, sample: Path) -> None:
    one, two = run / "events" / "shard-00.jsonl", run / "events" / "shard-01.jsonl"
    first = one.read_bytes()
    one.write_bytes(two.read_bytes())
    two.write_bytes(first)


def _torn(run: Path, sample: Path) -> None:
    log = run / "events" / "shard-01.jsonl"
    log.write_bytes(log.read_bytes() + b'{"run_id":"ba')


def _cut_after_a_checkpoint(run: Path, sample: Path) -> None:
    log = run / "events" / "shard-00.jsonl"
    lines = _lines(log)
    last = max(i for i, line in enumerate(lines[:-1]) if b'"ev":"checkpoint"' in line)
    log.write_bytes(b"".join(lines[:last + 1]))


def _sample_hash_edited_in_a_listed_run(run: Path, sample: Path) -> None:
    """The manifest lists the files as they are (a finished run does); the sample's hash of one
    is edited."""
    log = run / "events" / "shard-00.jsonl"
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    manifest["files"] = [{"path": "events/shard-00.jsonl", "bytes": log.stat().st_size,
                          "sha256": hashlib.sha256(log.read_bytes()).hexdigest()}]
    (run / "manifest.json").write_bytes(orjson.dumps(manifest))
    _edit_sample(file_sha="0" * 64)(run, sample)


def _listed_twice(run: Path, sample: Path) -> None:
    doc = orjson.loads(sample.read_bytes())
    doc["files"].append(doc["files"][1])
    sample.write_bytes(orjson.dumps(doc))


def _size_as_text(run: Path, sample: Path) -> None:
    doc = orjson.loads(sample.read_bytes())
    doc["files"][0]["bytes"] = str(doc["files"][0]["bytes"])
    sample.write_bytes(orjson.dumps(doc))


def _other_run(run: Path, sample: Path) -> None:
    manifest = orjson.loads((run / "manifest.json").read_bytes())
    (run / "manifest.json").write_bytes(orjson.dumps({**manifest, "run_id": "another-run"}))


def _last_line(run: Path, sample: Path) -> None:
    log = run / "events" / "shard-00.jsonl"
    data = log.read_bytes()
    log.write_bytes(data[:-10] + (b"0" if data[-10:-9] != b"0" else b"1") + data[-9:])


def _crlf(run: Path, sample: Path) -> None:
    log = run / "events" / "shard-00.jsonl"
    log.write_bytes(log.read_bytes().replace(b"\n", b"\r\n"))


TAMPERS = [
    ("flipped byte", _flip, "events/shard-00.jsonl does not match the sample",
     "a byte changed between line"),
    ("deleted line", _delete, "events/shard-01.jsonl does not match the sample",
     "a line was deleted between line"),
    ("added line", _add, "events/shard-01.jsonl does not match the sample",
     "a line was added between line"),
    ("flipped byte in the last line", _last_line, "events/shard-00.jsonl does not match",
     "checkpoint SHA-256"),
    ("hashes written anew", _hashes_written_anew, "events/shard-00.jsonl fails its own "
     "checkpoints (line ", "a byte changed between line"),
    ("edited figure", _edit_sample(completion_tokens=46), "completion_tokens: the sample says 46",
     "the events give 45"),
    ("edited split", _edit_sample(spans_of_01=4), "per_shard events/shard-01.jsonl spans",
     "the events give 3"),
    ("edited line hash", _edit_sample(lines_sha256="0" * 64), "lines_sha256: the sample says",
     "the events give"),
    ("edited minute", _edit_sample(minute=minute_label(M)),
     f"minute {minute_label(M)}: completion_tokens: the sample says 45", "the events give 30"),
    ("edited minute start", _edit_sample(minute_start_t=0), "minute_start_t: the sample says 0",
     "the events give"),
    ("figure as a float", _edit_sample(completion_tokens=45.0), "completion_tokens: the sample "
     "says 45.0", "the events give 45"),
    ("edited split's file", _edit_sample(file_of_01="events/shard-00.jsonl"), "per_shard events/"
     "shard-01.jsonl file: the sample says 'events/shard-00.jsonl'", ""),
    ("edited coverage", _edit_sample(covered_lines_of_00=1), "events/shard-00.jsonl: the sample "
     "says covered_lines 1 but the file has", ""),
    ("edited file hash", _edit_sample(file_sha="0" * 64), "events/shard-00.jsonl does not match",
     "checkpoints all verify: the sample's SHA-256 or size was changed, or the file was "
     "rewritten with checkpoints to match"),
    # How the file came to differ, where its bytes, the other files and the manifest tell.
    ("listed file hash", _sample_hash_edited_in_a_listed_run, "as the run's manifest recorded "
     "it, so the SHA-256 or size in the sample was changed", ""),
    ("size as text", _size_as_text, "files[0] lacks 'bytes' (a whole number)", ""),
    ("a file listed twice", _listed_twice, "files[3] names events/shard-00.jsonl again", ""),
    ("swapped files", _swapped, "records for events/shard-01.jsonl: the files were swapped", ""),
    ("torn tail", _torn, "ends in 13 bytes of a line cut short", ""),
    ("cut after a checkpoint", _cut_after_a_checkpoint, "checkpoints still verify: truncated", ""),
    ("renamed shard file", _rename, "events/shard-01.jsonl named in the sample is missing",
     "events/shard-05.jsonl has its SHA-256 (renamed?)"),
    ("missing shard file", _remove, "events/shard-01.jsonl named in the sample is missing", ""),
    ("added shard file", _extra, "events/shard-02.jsonl is in", "but not in the sample (an "
     "added or renamed event file)"),
    ("a resume since", _resumed, "events/shard-01.r1.jsonl is in", "(a resume of the run since "
     "it was published writes files of its own"),
    ("emptied file", _emptied, "events/shard-01.jsonl does not match the sample: SHA-256 ",
     "; the file is empty now: it was truncated or replaced"),
    ("line endings converted", _crlf, "events/shard-00.jsonl does not match the sample",
     "whose lines end in CR LF where the log wrote LF: a copy converted its line endings"),
    ("wrong run", _other_run, f"the sample is for run '{RUN_ID}'", "holds run 'another-run'"),
]


@pytest.mark.parametrize(("case", "tamper", "reason", "detail"), TAMPERS,
                         ids=[t[0] for t in TAMPERS])
def test_tamper_is_caught_with_its_reason(
    published: tuple[Path, Path], capsys: pytest.CaptureFixture[str], case: str,
    tamper: Callable[[Path, Path], None], reason: str, detail: str,
) -> None:
    """Each tampering makes verify exit 1 with a reason naming the file, line or number."""
    run, sample = published
    tamper(run, sample)
    assert main(["verify", str(sample)]) == 1, case
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert reason in err and detail in err, err


def test_sample_pointed_at_another_run(published: tuple[Path, Path], tmp_path: Path) -> None:
    """--run-dir naming a different run is caught before any file is read."""
    _, sample = published
    other = write_run(tmp_path / "other", {"00": steady_shard(0, B, 1, 2)}, None,
                      run_id="someone-else")
    with pytest.raises(VerifyError, match="holds run 'someone-else'"):
        verify(sample, other)


def test_unreadable_samples(published: tuple[Path, Path], tmp_path: Path) -> None:
    """A sample that is not JSON, has another schema or lacks a field is refused clearly."""
    bad = tmp_path / "s.json"
    bad.write_text("{")
    with pytest.raises(VerifyError, match="not valid JSON"):
        verify(bad, tmp_path)
    bad.write_text('{"schema": "other/9"}')
    with pytest.raises(VerifyError, match=r"expected 'shardrun\.sample/1'"):
        verify(bad, tmp_path)
    bad.write_text('{"schema": "shardrun.sample/1"}')
    with pytest.raises(VerifyError, match=r"lacks the field 'run_id'"):
        verify(bad, tmp_path)
    stray = tmp_path / "stray.json"
    shutil.copy(published[1], stray)
    with pytest.raises(VerifyError, match="name the run with --run-dir"):
        verify(stray)
    # Edited by hand: a file without its SHA-256, or no list of files at all.
    run_dir, sample = published
    good = orjson.loads(sample.read_bytes())
    for edited, says in (({**good, "files": [{**good["files"][0], "sha256": None}]},
                          r"files\[0\] lacks 'sha256' \(a string\)"),
                         ({**good, "files": None}, "files must be a list of objects"),
                         ({**good, "per_shard": [3]}, "per_shard must be a list of objects")):
        bad.write_bytes(orjson.dumps(edited))
        with pytest.raises(VerifyError, match=says):
            verify(bad, run_dir)


def test_real_run_publish_verify_and_a_flip(tmp_path: Path) -> None:
    """On a real 200-item run: publish, verify, then one flipped byte fails verification."""
    write_input(tmp_path / "input.jsonl", 200)
    write_job(tmp_path / "job.yaml", endpoint={"base_url": "sim://", "api": "chat",
                                               "model": "m", "sim": FAST_SIM})
    done = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "runs" / "r1"
    sample, path = publish(run)
    # A run of seconds may still straddle two UTC minutes: the sample counts the spans whose
    # last token came in its own minute.
    results = [orjson.loads(line) for p in sorted((run / "results").glob("*.jsonl"))
               for line in p.read_bytes().splitlines()]
    minute = parse_minute(sample["minute"])
    assert len(results) == 200 and sample["spans"] == sum(
        1 for r in results if int(r["last_token_at"] // 60) == minute) > 0
    assert verify(path).startswith("ok: run r1 minute ")
    # A run of a few seconds covers no whole minute: publishing and verifying its peak say so.
    cli = run_cli("publish", str(run), "-o", str(tmp_path / "peak.json"), cwd=tmp_path)
    assert cli.returncode == 0 and orjson.loads(cli.stdout)["partial"] is True, cli.stderr
    assert "is partial: the run did not cover all of it" in cli.stderr
    assert "(a partial minute: the run did not cover all of it)" in verify(tmp_path / "peak.json",
                                                                          run)
    log = run / "events" / "shard-01.jsonl"
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0x01
    log.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match=r"events/shard-01\.jsonl does not match the sample"):
        verify(path)


def test_publish_writes_where_asked_and_prints_it(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`publish -o FILE` writes the sample there, prints the same JSON, and verify accepts it."""
    run = _run(tmp_path / "run")
    out = tmp_path / "elsewhere" / "sample.json"
    assert main(["publish", str(run), "--peak", "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert orjson.loads(captured.out) == orjson.loads(out.read_bytes())
    assert captured.err.strip() == f"wrote {out}"
    assert main(["verify", str(out), "--run-dir", str(run)]) == 0
    capsys.readouterr()
    # Without --run-dir it cannot be checked at all: a usage error, not "differs" (exit 1).
    assert main(["verify", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: cannot tell which run {out} belongs to (it is "
                                       "not in a run's samples/): name the run with --run-dir "
                                       "RUN_DIR\n")


def test_publish_writes_no_file_among_the_runs_own(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`-o` into the run's events/ (or over its manifest) would leave a file verify RUN_DIR
    fails the run for, or lose its record: exit 2, nothing written. Its samples/ is fine."""
    run = _run(tmp_path / "run")
    manifest = (run / "manifest.json").read_bytes()
    for out in (run / "events" / "x.json", run / "manifest.json"):
        assert main(["publish", str(run), "-o", str(out)]) == 2, out
        assert "is among the files of run directory" in capsys.readouterr().err
    assert not (run / "events" / "x.json").exists()
    assert (run / "manifest.json").read_bytes() == manifest
    assert main(["publish", str(run), "-o", str(run / "samples" / "mine.json")]) == 0


def test_publish_refuses_an_output_path_no_file_can_have_as_export_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`-o` naming a directory, or a file inside a file: exit 2 before any work, in export's
    words, where the write failed with exit 1 ("could not write DIR: is a directory"). A
    folder not there yet is made, as the run's samples/ is."""
    run = _run(tmp_path / "run")
    (tmp_path / "a-file").write_text("kept\n")
    for out, said in [(tmp_path, f"-o {tmp_path} is a directory; name the file to write"),
                      (tmp_path / "a-file" / "s.json",
                       f"-o {tmp_path / 'a-file' / 's.json'}: {tmp_path / 'a-file'} is a file, "
                       "not a directory; name a file in a directory")]:
        assert main(["publish", str(run), "-o", str(out)]) == 2, out
        assert capsys.readouterr().err == f"error: {said}\n"
    assert (tmp_path / "a-file").read_text() == "kept\n"
    assert main(["publish", str(run), "-o", str(tmp_path / "new" / "s.json")]) == 0
    assert (tmp_path / "new" / "s.json").is_file()


def test_publish_writes_over_no_job_or_input_file_the_run_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`-o` naming a job file or an input file a pass of the run recorded (the first pass's, a
    resume's; by another name: a hard link): exit 2, one sentence, the file kept whole. It
    wrote the sample over it. Another existing file is still written over."""
    files = {name: tmp_path / name for name in ("job.yaml", "in.jsonl", "job2.yaml", "in2.jsonl")}
    for path in files.values():
        path.write_text(f"{path.name}\n")
    run = write_run(tmp_path / "run", {"00": steady_shard(0, B - 30, minutes=3, per_minute=6)},
                    _coordinator(), status="succeeded",
                    job={"path": str(files["job.yaml"])}, input={"path": str(files["in.jsonl"])},
                    resumes=[{"job_path": str(files["job2.yaml"]),
                              "input": {"path": str(files["in2.jsonl"])}}])
    os.link(files["in2.jsonl"], tmp_path / "linked")
    for out, what in [(files["job.yaml"], "job"), (files["in.jsonl"], "input"),
                      (files["job2.yaml"], "job"), (files["in2.jsonl"], "input"),
                      (tmp_path / "linked", "input")]:
        assert main(["publish", str(run), "-o", str(out)]) == 2, out
        also = f" ({files['in2.jsonl']}, by another name)" if out.name == "linked" else ""
        assert capsys.readouterr().err == (
            f"error: -o {out} is the run's {what} file{also}; writing there would destroy it, "
            "so name another file\n")
    assert all(path.read_text() == f"{path.name}\n" for path in files.values())
    (tmp_path / "other.json").write_text("an older sample\n")
    assert main(["publish", str(run), "-o", str(tmp_path / "other.json")]) == 0
    assert orjson.loads((tmp_path / "other.json").read_bytes())["schema"] == SAMPLE_SCHEMA


def test_a_recorded_path_with_a_nul_in_it_is_no_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged manifest whose recorded job or input path has a NUL byte in it names no file
    `-o` could destroy: publish -o writes its sample. It was a traceback (ValueError: embedded
    null byte, from the comparison by device and inode)."""
    run = write_run(tmp_path / "run", {"00": steady_shard(0, B - 30, minutes=3, per_minute=6)},
                    _coordinator(), status="succeeded",
                    job={"path": "job\x00.yaml"}, input={"path": "in\x00.jsonl"})
    assert main(["publish", str(run), "-o", str(tmp_path / "sample.json")]) == 0
    assert capsys.readouterr().err.endswith(f"wrote {tmp_path / 'sample.json'}\n")


def test_a_sample_cut_short_by_a_full_disk_is_not_left_behind(tmp_path: Path) -> None:
    """A write that fails part way (here a file-size limit, as a full disk) leaves the earlier
    sample of the minute whole and no half one: a half sample read as no sample at all."""
    run = _run(tmp_path / "run")
    _, sample = publish(run)
    before = sample.read_bytes()
    sample.write_bytes(before.replace(b'"generator"', b'"generator_was"'))  # an earlier one
    earlier = sample.read_bytes()

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2,) * 2)

    done = subprocess.run([sys.executable, "-m", "shardrun", "publish", str(run)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=60, preexec_fn=limit)
    # A failed write, as export's: exit 1, the usage errors' 2 being for a path refused before
    # any work.
    assert done.returncode == 1, done.stderr
    assert done.stderr == (f"error: could not write {sample}: file too large; nothing was "
                           "written (free some space, or name another file with -o)\n")
    assert sample.read_bytes() == earlier
    assert sorted(p.name for p in sample.parent.iterdir()) == [sample.name]


def test_report_and_sample_agree_on_every_minute(published: tuple[Path, Path]) -> None:
    """The report's TPM table and the sample of each minute give the same figure and flag."""
    from shardrun.report import load_report

    run, _ = published
    doc, _ = load_report(run)
    for row in doc["tpm"]["minutes"]:
        sample, _ = publish(run, minute=row["minute"], out=run / "samples" / "x.json")
        assert (sample["completion_tokens"], sample["spans"], sample["partial"]) == (
            row["completion_tokens"], row["spans"], row["partial"])
        assert [s["completion_tokens"] for s in sample["per_shard"]] == row["per_shard"]


def test_sample_published_before_the_layout_change_still_verifies(tmp_path: Path) -> None:
    """tests/data/sample-old-layout.json was published by the version that wrote separate
    last_token lines, from the old-layout run `_run` writes (byte for byte: the sample's file
    hashes check it). Today's verify accepts it, and today's publish gives the same figure and
    counted-line hashes from those files."""
    run = _run(tmp_path / "run", layout="old")
    stored = Path(__file__).parent / "data" / "sample-old-layout.json"
    shutil.copy(stored, tmp_path / "old.json")
    assert verify(tmp_path / "old.json", run).startswith("ok: run fixture-run minute ")
    fresh, _ = publish(run, out=tmp_path / "fresh.json")
    old = orjson.loads(stored.read_bytes())
    for key in ("minute", "completion_tokens", "spans", "lines_counted", "lines_sha256",
                "per_shard", "method", "files"):
        assert fresh[key] == old[key], key


def _read_fifo(fifo: Path, got: list[bytes]) -> threading.Thread:
    """A reader of `fifo` in a thread (its open waits for a writer, as `cat fifo` does)."""
    def read() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def test_a_sample_to_a_device_a_fifo_or_a_link_is_written_where_the_path_leads(
        tmp_path: Path) -> None:
    """-o through a temporary file renamed over the path replaced a device with a file (as
    root, -o /dev/null: here a node of its numbers, never the machine's), left a FIFO's reader
    with nothing, and replaced a symbolic link, never writing the file it names. A device and
    a FIFO are written in place; through a link, the file it names is replaced, the link kept."""
    run = _run(tmp_path / "run")
    (tmp_path / "fakedev").mkdir()
    null = null_device(tmp_path / "fakedev" / "null")
    publish(run, out=null)
    assert stat.S_ISCHR(null.stat().st_mode)

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = _read_fifo(fifo, got)
    sample, _ = publish(run, out=fifo)
    reader.join(WAIT_S)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert orjson.loads(got[0])["files"] == sample["files"]

    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "sample.json"
    real.write_text("an earlier sample\n")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    publish(run, out=link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert orjson.loads(real.read_bytes())["files"] == sample["files"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["sample.json"]


def test_a_sample_through_a_link_to_standard_output_reaches_the_pipe(tmp_path: Path) -> None:
    """-o a link to /proc/self/fd/1 (as /dev/stdout is), standard output a pipe: the sample
    goes down the pipe (after the copy publish prints there) and the link stays. (It
    resolves to /proc/PID/fd/pipe:[N], which no temporary file can be put beside nor renamed
    over.)"""
    run = _run(tmp_path / "run")
    (tmp_path / "fakedev").mkdir()
    out = tmp_path / "fakedev" / "stdout"
    out.symlink_to("/proc/self/fd/1")
    done = subprocess.run([sys.executable, "-m", "shardrun", "publish", str(run), "-o",
                           str(out)], capture_output=True, stdin=subprocess.DEVNULL,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.decode().split("\n{")  # printed, as ever, then written
    assert orjson.loads(first) == orjson.loads("{" + second)
    assert out.is_symlink() and os.readlink(out) == "/proc/self/fd/1"


def _killed_run(tmp_path: Path) -> Path:
    """A real run of two shards killed -9 mid-way: its manifest lists no files."""
    write_input(tmp_path / "input.jsonl", 400)
    write_job(tmp_path / "job.yaml")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    proc = subprocess.Popen([sys.executable, "-m", "shardrun", "job.yaml", "--runs-dir", "runs",
                             "--run-id", "killed", "--rpm", "1200", "--quiet"], cwd=tmp_path,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    run = tmp_path / "runs" / "killed"
    try:
        deadline = time.monotonic() + WAIT_S
        # Both shards have answered something, so each has its three files.
        while sum(p.stat().st_size > 0 for p in run.glob("results/shard-*.jsonl")) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, "the run never answered"
            time.sleep(0.05)
    finally:
        kill_tree(proc, timeout=WAIT_S)
    assert "files" not in orjson.loads((run / "manifest.json").read_bytes())
    return run


def test_a_killed_run_copied_without_a_shard_log_or_with_another_runs_is_refused(
        tmp_path: Path) -> None:
    """A killed run lists no files, so the manifest cannot say a log is gone or foreign. A
    copy that left a shard's log out (or gzip'ed it) would publish, verify and report half the
    run; one with another run's log copied in would pass that run's figure off as this one's.
    The shard's results file says its log was written; the log's lines name their run."""
    run = _killed_run(tmp_path)
    _, sample = publish(run)
    assert verify(sample).startswith("ok: run killed minute ")
    other = tmp_path / "other"
    other.mkdir()
    write_input(other / "input.jsonl", 20)
    write_job(other / "job.yaml")
    assert run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "other", "--quiet",
                   cwd=other).returncode == 0

    gone = tmp_path / "gone"
    shutil.copytree(run, gone)
    log = gone / "events" / "shard-01.jsonl"
    (gone / "events" / "shard-01.jsonl.gz").write_bytes(gzip.compress(log.read_bytes()))
    log.unlink()
    lacks = (r"events/shard-01\.jsonl is missing from the run directory, though its shard "
             r"wrote results/shard-01\.jsonl and dead/shard-01\.jsonl: its figures would be "
             r"left out \(a copy that left it out, or a deleted log; put it back\); "
             r"events/shard-01\.jsonl\.gz is there: decompress it")
    with pytest.raises(PublishError, match=f"^{lacks}"):
        publish(gone, out=tmp_path / "gone.json")
    with pytest.raises(VerifyError, match=r"^events/shard-01\.jsonl named in the sample is "
                                          r"missing from .*; events/shard-01\.jsonl\.gz is there"):
        verify(sample, gone)
    report = run_cli("report", str(gone), cwd=tmp_path)
    assert report.returncode == 1 and re.search(lacks, report.stdout), report.stdout
    with pytest.raises(VerifyError, match=f"does not match its manifest.*\n  {lacks}"):
        verify_run(gone)

    foreign = tmp_path / "foreign"
    shutil.copytree(run, foreign)
    shutil.copy(other / "runs" / "other" / "events" / "shard-00.jsonl",
                foreign / "events" / "shard-00.jsonl")
    theirs = (r"events/shard-00\.jsonl holds events of run 'other', not of run 'killed' \(its "
              r"first line says so\): a log copied in from another run; put back this run's own")
    with pytest.raises(PublishError, match=f"^{theirs}; refusing"):
        publish(foreign, out=tmp_path / "foreign.json")
    with pytest.raises(VerifyError, match=f"^{theirs}$"):
        verify(_forge(foreign, sample), foreign)
    report = run_cli("report", str(foreign), cwd=tmp_path)
    assert report.returncode == 1 and re.search(theirs, report.stdout), report.stdout
    with pytest.raises(VerifyError, match=f"does not match its manifest.*\n  {theirs}$"):
        verify_run(foreign)
    assert verify_run(run).startswith("ok, as far as a crashed run can be checked")


def test_a_run_copied_with_its_line_endings_converted_says_so_and_how_to_undo_it(
        tmp_path: Path) -> None:
    """A copy through Windows (or git's autocrlf) ends every line in CR LF: every hash differs,
    and verify says that is why, not 'a byte changed between line 1 and line N'; stripping the
    CRs, as it says, gives the run's bytes back and the sample verifies."""
    write_input(tmp_path / "input.jsonl", 40)
    write_job(tmp_path / "job.yaml")
    assert run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", "--quiet",
                   cwd=tmp_path).returncode == 0
    run = tmp_path / "runs" / "r1"
    _, sample = publish(run)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    logs = sorted(copy.glob("events/*.jsonl"))
    for log in logs:
        log.write_bytes(log.read_bytes().replace(b"\n", b"\r\n"))
    said = ("does not match the bytes before it, whose lines end in CR LF where the log wrote "
            "LF: a copy converted its line endings (a Windows copy, git's autocrlf); copy it "
            "again byte for byte, or strip the CRs (tr -d '\\r' < FILE > FILE.lf && mv FILE.lf "
            "FILE)")
    with pytest.raises(VerifyError, match=re.escape(said)):
        verify(sample, copy)
    with pytest.raises(PublishError, match=re.escape(said)):
        publish(copy, out=tmp_path / "copy.json")
    report = run_cli("report", str(copy), cwd=tmp_path)
    assert report.returncode == 1 and said in report.stderr, report.stderr
    for log in logs:
        log.write_bytes(log.read_bytes().replace(b"\r\n", b"\n"))
    assert verify(sample, copy).startswith("ok: run r1 minute ")


def test_a_run_of_one_item_publishes_its_one_span(tmp_path: Path) -> None:
    """One item: the sample's figure is that span's tokens, and verify says '1 span'."""
    write_input(tmp_path / "input.jsonl", 1)
    write_job(tmp_path / "job.yaml")
    assert run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "one", "--quiet",
                   cwd=tmp_path).returncode == 0
    run = tmp_path / "runs" / "one"
    [end] = [e for p in run.glob("events/shard-*.jsonl") for line in p.read_bytes().splitlines()
             if (e := orjson.loads(line))["ev"] == "attempt_end"]
    sample, path = publish(run)
    assert (sample["spans"], sample["completion_tokens"]) == (1, end["completion_tokens"])
    assert sample["minute"] == minute_label(int(end["last_token_t"] // 60))
    tokens = end["completion_tokens"]
    assert f": {tokens:,} completion token{'' if tokens == 1 else 's'} from 1 span on 2 " \
           "shards (concurrency 8 each, no rpm limit, no tpm limit, model sim-test, chat, " \
           "simulator); " in verify(path)


def test_a_resumed_runs_sample_is_its_passes_spans_counted_once(tmp_path: Path) -> None:
    """A run in three passes (--limit, --resume --limit, --resume) with retries: the sample's
    figure is what an independent count of every pass's raw lines gives (ok attempt_end by
    its last-token minute, its span released ok), and verify names the 2 shards of each pass
    the minute's spans came from, and only those."""
    write_input(tmp_path / "input.jsonl", 90)
    sim = {**FAST_SIM, "fail_500": 0.2, "drop_mid_stream": 0.1}
    write_job(tmp_path / "job.yaml", retry={"max_attempts": 4, "backoff_s": 0.001,
                                            "backoff_max_s": 0.002},
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim})
    for flags in (["--run-id", "res", "--limit", "30"], ["--resume", "res", "--limit", "30"],
                  ["--resume", "res"]):
        done = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", *flags, cwd=tmp_path)
        assert done.returncode in (0, 1), done.stderr
    run = tmp_path / "runs" / "res"
    tokens: dict[int, int] = {}
    spans: dict[int, int] = {}
    for log in run.glob("events/shard-*.jsonl"):
        ends: dict[str, dict[str, Any]] = {}
        for line in log.read_bytes().splitlines():
            rec = orjson.loads(line)
            if rec["ev"] == "attempt_end" and rec["status"] == "ok":
                ends[rec["span"]] = rec
            elif rec["ev"] == "released" and rec["outcome"] == "ok":
                end = ends[rec["span"]]
                m = int(end["last_token_t"] // 60)
                tokens[m] = tokens.get(m, 0) + end["completion_tokens"]
                spans[m] = spans.get(m, 0) + 1
    assert sum(spans.values()) == 90 - sum(  # every item once: answered, or dead
        len(p.read_bytes().splitlines()) for p in run.glob("dead/*.jsonl"))
    for m in tokens:
        sample, path = publish(run, minute=minute_label(m), out=tmp_path / f"{m}.json")
        assert (sample["completion_tokens"], sample["spans"]) == (tokens[m], spans[m])
        assert len(sample["per_shard"]) == 6
        producing = sorted({int(s["file"].split(".r")[1][0]) if ".r" in s["file"] else 0
                            for s in sample["per_shard"] if s["spans"]})
        assert [p["segment"] for p in sample["passes"]] == producing
        settings = " (concurrency 8 each, no rpm limit, no tpm limit, model m, chat, simulator)"
        named = " and ".join(f"2 of pass {seg}{settings}" for seg in producing)
        assert f" from {spans[m]:,} span{'s' if spans[m] != 1 else ''} on 2 shards of " \
               f"{named.removeprefix('2 of ')}; 9 event files " in verify(path, run)


def test_a_run_renamed_and_then_resumed_is_its_own_not_another_runs(tmp_path: Path) -> None:
    """A run directory renamed (a name of the user's own) and resumed under that name: its new
    pass's logs are the run's, so they carry the run's id, the manifest's, not the directory's
    new name, and report, verify RUN_DIR and publish take them as the run's own."""
    write_input(tmp_path / "input.jsonl", 30)
    write_job(tmp_path / "job.yaml")
    first = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "orig", "--limit", "10",
                    "--quiet", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "runs" / "orig").rename(tmp_path / "runs" / "mine")
    again = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "mine", "--quiet",
                    cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    run = tmp_path / "runs" / "mine"
    logs = sorted(run.glob("events/*.r1.jsonl"))
    assert len(logs) == 3  # the resumed pass's coordinator and two shards
    for log in logs:
        assert orjson.loads(log.read_bytes().split(b"\n", 1)[0])["run_id"] == "orig"
    report = run_cli("report", str(run), cwd=tmp_path)
    assert report.returncode == 0 and "another run" not in report.stdout, report.stdout
    verify_run(run)
    _, sample = publish(run)
    assert verify(sample).startswith("ok: run orig minute ")


def test_a_log_a_shard_opens_after_the_run_was_read_is_not_missing(tmp_path: Path) -> None:
    """A report reads a live run's event files, folds them, and only then looks at its results
    files: a shard that starts meanwhile (a resume's, a replacement's) opens its log and then
    its results. The log is there, so it is not 'missing from the run directory'; one that
    is truly gone still is."""
    run = _killed_run(tmp_path)
    loaded = load_run(run)
    assert loaded.unlogged_files() == []
    (run / "events" / "shard-00.r1.jsonl").write_bytes(b"")  # a new shard: its log first,
    (run / "results" / "shard-00.r1.jsonl").write_bytes(b"")  # then its results
    assert loaded.unlogged_files() == []
    (run / "events" / "shard-00.r1.jsonl").unlink()
    assert loaded.unlogged_files() == ["events/shard-00.r1.jsonl"]


class _CountedList(list[Any]):
    """A list that counts the times it is read through."""

    reads = 0

    def __iter__(self) -> Any:
        self.reads += 1
        return super().__iter__()


def test_the_manifests_list_is_read_once_not_once_per_file(tmp_path: Path) -> None:
    """Whether each event, results and dead-letter file is one the manifest should list is
    asked of every file of the run: a run of 1,024 shards and four passes has 12,288, and
    its list as many entries. Read once per file, that took 8 s for the added files alone
    (quadratic); the list is read a fixed number of times, however many files the run has."""
    write_input(tmp_path / "input.jsonl", 40)
    write_job(tmp_path / "job.yaml", shards=4)
    assert run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r", "--quiet",
                   cwd=tmp_path).returncode == 0
    loaded = load_run(tmp_path / "runs" / "r")
    listed = loaded.manifest["files"] = _CountedList(loaded.manifest["files"])
    assert len(loaded.scans) == 5 and loaded.unlisted_files() == []
    assert loaded.unlogged_files() == []
    assert listed.reads <= 2  # the list once, and once for the files it lists gone


def test_a_run_renamed_and_then_resumed_keeps_its_batch_request_ids(tmp_path: Path) -> None:
    """openai-batch output: the request ids of the answers an earlier pass earned are the run's
    own (its manifest's id), so a run renamed and resumed does not give them new ones."""
    def request_ids(run: Path) -> dict[str, str]:
        lines = (run / "batch_output.jsonl").read_bytes().splitlines()
        return {(rec := orjson.loads(line))["custom_id"]: rec["response"]["request_id"]
                for line in lines}

    write_input(tmp_path / "input.jsonl", 12)
    write_job(tmp_path / "job.yaml", output={"format": "openai-batch"})
    first = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "orig", "--limit", "4",
                    "--quiet", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = request_ids(tmp_path / "runs" / "orig")
    assert len(before) == 4
    (tmp_path / "runs" / "orig").rename(tmp_path / "runs" / "mine")
    again = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "mine", "--quiet",
                    cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    after = request_ids(tmp_path / "runs" / "mine")
    assert len(after) == 12 and {k: after[k] for k in before} == before


def test_a_sample_states_the_settings_of_the_pass_its_minute_came_from(tmp_path: Path) -> None:
    """A run whose first pass (3 shards of 4, --rpm) answered nothing and whose resume ran
    on SHARDRUN_SHARDS=2 and SHARDRUN_CONCURRENCY=2: every span of the published minute is
    the resume's, so the sample states that pass's settings and their sources, model, api and
    the kind of endpoint (no key, no URL), and verify says '2 shards of pass 1', not the 3 of
    the first pass. A sample edited to claim other settings fails in one sentence; one without
    them (an earlier version's) verifies as before."""
    write_input(tmp_path / "input.jsonl", 30)
    endpoint = {"base_url": "sim://", "api": "chat", "model": "m", "api_key_env": "SIM_KEY"}
    key = {"SIM_KEY": "sk-h10-never-published"}
    write_job(tmp_path / "job.yaml", retry={"max_attempts": 1},
              endpoint={**endpoint, "sim": {**FAST_SIM, "fail_500": 1.0}})
    first = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "two", "--limit", "10",
                    "--shards", "3", "--concurrency", "4", "--rpm", "6000", "--quiet",
                    cwd=tmp_path, env=key)
    assert first.returncode == 1 and len(list((tmp_path / "runs/two/dead").glob("*.jsonl")))
    write_job(tmp_path / "job.yaml", endpoint={**endpoint, "sim": FAST_SIM})
    second = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "two", "--quiet",
                     cwd=tmp_path, env={**key, "SHARDRUN_SHARDS": "2",
                                        "SHARDRUN_CONCURRENCY": "2"})
    # 1: the first pass's dead letters are still the run's
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr
    run = tmp_path / "runs" / "two"
    done = run_cli("publish", str(run), "-o", "sample.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    sample = orjson.loads((tmp_path / "sample.json").read_bytes())
    # The resume's seconds may straddle two UTC minutes: the sample counts the spans whose
    # last token came in its own minute, all of them the resume's.
    results = [orjson.loads(line) for p in sorted((run / "results").glob("*.jsonl"))
               for line in p.read_bytes().splitlines()]
    minute = parse_minute(sample["minute"])
    spans = sum(1 for r in results if int(r["last_token_at"] // 60) == minute)
    assert len(results) == 20 and sample["spans"] == spans > 0 and len(sample["per_shard"]) == 5
    default = {"value": None, "source": "default"}
    assert sample["passes"] == [{
        "segment": 1, "kind": "resume", "endpoint_kind": "simulator", "shard_logs": 2,
        "caps": [2], "settings": {
            "shards": {"value": 2, "source": "env SHARDRUN_SHARDS"},
            "concurrency": {"value": 2, "source": "env SHARDRUN_CONCURRENCY"},
            "rate_limits.rpm": default, "rate_limits.tpm": default,
            "endpoint.model": {"value": "m", "source": "job file"},
            "endpoint.api": {"value": "chat", "source": "job file"}}}]
    text = (tmp_path / "sample.json").read_text()
    assert "sk-h10" not in text and "127.0.0.1" not in text and "http" not in text
    done = run_cli("verify", "sample.json", "--run-dir", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (f" from {spans} spans on 2 shards of pass 1 (concurrency 2 each, no rpm limit, "
            "no tpm limit, model m, chat, simulator); ") in done.stdout
    # Without the field, as samples of earlier versions are: it verifies, and the wording
    # counts the shards of the pass the spans came from, from the shard logs' names.
    old = {k: v for k, v in sample.items() if k != "passes"}
    (tmp_path / "old.json").write_bytes(orjson.dumps(old))
    assert f" from {spans} spans on 2 shards of pass 1; " in verify(tmp_path / "old.json", run)

    def claimed(edit: Callable[[dict[str, Any]], None]) -> str:
        forged = orjson.loads(orjson.dumps(sample))
        edit(forged["passes"][0])
        (tmp_path / "forged.json").write_bytes(orjson.dumps(forged))
        done = run_cli("verify", "forged.json", "--run-dir", str(run), cwd=tmp_path)
        assert done.returncode == 1 and done.stdout == "", done.stdout
        [line] = done.stderr.splitlines()
        return line

    minute = f"minute {sample['minute']}: pass 1's "
    assert claimed(lambda p: p["settings"]["concurrency"].update(value=4)) == (
        f"error: {minute}concurrency: the sample says 4 (env SHARDRUN_CONCURRENCY) but the "
        "run's manifest records 2 (env SHARDRUN_CONCURRENCY)")
    assert claimed(lambda p: p["settings"]["shards"].update(source="job file")).endswith(
        "shards: the sample says 2 (job file) but the run's manifest records 2 (env "
        "SHARDRUN_SHARDS)")
    assert claimed(lambda p: p["settings"]["rate_limits.rpm"].update(value=6000.0)).endswith(
        "rate_limits.rpm: the sample says 6000.0 (default) but the run's manifest records "
        "null (default)")
    assert claimed(lambda p: p["settings"].pop("endpoint.model")).endswith(
        "endpoint.model: the sample says nothing but the run's manifest records \"m\" "
        "(job file)")
    assert claimed(lambda p: p.update(caps=[4])).endswith(
        "caps: the sample says [4] but its shard logs give [2]")
    assert claimed(lambda p: p.update(shard_logs=3)).endswith(
        "shard_logs: the sample says 3 but its shard logs give 2")
    assert claimed(lambda p: p.update(endpoint_kind="remote https")).endswith(
        "endpoint_kind: the sample says 'remote https' but the run's manifest records "
        "'simulator'")
    assert claimed(lambda p: p.update(segment=0)) == (
        f"error: minute {sample['minute']}: the sample names passes [0] but its counted spans "
        "come from passes [1]")


def test_a_samples_endpoint_kind_names_no_host() -> None:
    """The kind of endpoint a sample states says whether it was the simulator, this machine or
    another, and the scheme: never the host, user, path or query of a private URL."""
    assert endpoint_kind("sim://") == "simulator"
    assert endpoint_kind("http://127.0.0.1:8000/v1") == "loopback http"
    assert endpoint_kind("http://[::1]:8000/v1") == "loopback http"
    assert endpoint_kind("http://localhost/v1") == "loopback http"
    assert endpoint_kind("https://***@gpu-7.internal.corp:8443/v1;***?key=***") == "remote https"
    assert endpoint_kind("http://[::1") == "remote http"  # unparsable: no loopback claimed

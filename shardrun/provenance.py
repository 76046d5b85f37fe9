"""Hash-verified minute samples (DESIGN §5): `publish` writes one, `verify` re-derives it.

A sample names the run, one UTC minute, its figure (completion tokens, spans, per-shard split),
the method, every raw event file with SHA-256, size and line count, and `lines_sha256`: a hash
over exactly the event lines that were counted. Canonical order (docs/METRICS.md): per shard
file, the counted lines in the order of their spans' `released` lines hash to that file's
`lines_sha256`; the sample's `lines_sha256` is the SHA-256 of the text
`"<file> <lines> <file's lines_sha256>\\n"` over the shard files in path order.

`verify` re-reads every file, checks every hash (the files' own checkpoints locate a change),
recomputes the figure and names the first thing that disagrees. Files that match the sample
must also match their own checkpoints and the manifest's record (`_altered`): otherwise a
sample written anew over edited files would verify.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shardrun import __version__
from shardrun._ellipsis import counted
from shardrun.aggregate import METHOD_VERSION, is_full, minute_label, parse_minute
from shardrun.aggregate._metrics import windows
from shardrun.errors import RunDirError, ShardrunError, SpecError
from shardrun.manifest import read_manifest, recorded_sources
from shardrun.outpath import (
    check_not_a_run_file,
    check_not_a_source,
    replace_target,
    write_bytes_atomically,
)
from shardrun.report._rundir import (
    FoldOptions,
    LoadedRun,
    event_files,
    foreign_text,
    load_run,
    run_state,
    segment_of,
    unlogged_text,
    where_it_went,
)
from shardrun.report._scan import FileScan

SAMPLE_SCHEMA = "shardrun.sample/1"
METHOD = "completion_tokens_by_last_token_minute"
FIGURE_FIELDS = ("completion_tokens", "spans", "partial", "lines_counted", "lines_sha256")
SHARD_FIELDS = ("shard", "file", "completion_tokens", "spans", "lines", "lines_sha256")
FILE_FIELDS = ("lines", "checkpoints", "covered_lines")
"""What a sample says of each file besides its hash and size; checked when the sample has it
(samples of older versions may lack some)."""


class PublishError(ShardrunError):
    """A sample cannot be published from this run."""

    exit_code = 2


class VerifyError(ShardrunError):
    """A sample does not verify against its run."""


class NotASample(VerifyError):
    """The file given as a sample is none: not JSON, or of another schema."""

    exit_code = 2


@dataclass(frozen=True)
class Figure:
    """What the events say about one minute."""

    minute: int
    partial: bool
    per_shard: list[dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        top = hashlib.sha256()
        for s in self.per_shard:
            top.update(f"{s['file']} {s['lines']} {s['lines_sha256']}\n".encode())
        return {
            "minute": minute_label(self.minute), "minute_start_t": self.minute * 60,
            "partial": self.partial,
            "completion_tokens": sum(s["completion_tokens"] for s in self.per_shard),
            "spans": sum(s["spans"] for s in self.per_shard),
            "lines_counted": sum(s["lines"] for s in self.per_shard),
            "lines_sha256": top.hexdigest(), "per_shard": self.per_shard,
        }  # fmt: skip


def unproven(loaded: LoadedRun, minute: int) -> str | None:
    """What of the minute's figure no checkpoint proves, in one sentence, or None: spans whose
    `released` line lies past their log's last good checkpoint (a crashed run's last second;
    all of a log an older shardrun wrote without checkpoints). Per-span state lives from a
    span's ok attempt_end to its released line, as in the fold.
    The files' hashes cover those lines, but the run never vouched for them, so an edit there
    verifies; the sample can only say how much of its figure they are."""
    spans = tokens = 0
    files = []
    for scan in loaded.shard_scans:
        if scan.covered_bytes >= scan.bytes or scan.checkpoint_error:
            continue
        ends: dict[Any, Any] = {}
        found = 0
        with open(loaded.path / scan.path, "rb") as f:
            f.seek(scan.covered_bytes)
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # a torn tail is no line
                try:
                    rec = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(rec, dict):
                    continue
                if rec.get("ev") == "attempt_end" and rec.get("status") == "ok":
                    ends[rec.get("span")] = rec
                elif rec.get("ev") == "released":  # the span's state ends here
                    end = ends.pop(rec.get("span"), None)
                    if rec.get("outcome") != "ok":
                        continue
                    at = None if end is None else end.get("last_token_t") or end.get("t")
                    # Its attempt_end before the checkpoint: the minute is not read here, and
                    # the span is counted as possibly in it.
                    if not isinstance(at, int | float) or int(at // 60) == minute:
                        found += 1
                        got = None if end is None else end.get("completion_tokens")
                        tokens += got if type(got) is int else 0
        if found:
            spans += found
            files.append(scan.path)
    if not spans:
        return None
    return (f"{spans:,} of its spans ({tokens:,} tokens or more) were released past the last "
            f"good checkpoint of {', '.join(files)} (a shard or a run that crashed, or a log "
            "written without checkpoints): no checkpoint proves those lines, so an edit there "
            "would verify")


def _load(run_dir: Path, workers: int | None) -> LoadedRun:
    return load_run(run_dir, FoldOptions(minutes_only=True, keep_lines=True), workers)


def figure(loaded: LoadedRun, minute: int) -> Figure:
    """Recompute one minute's figure from folded shards."""
    empty_sha = hashlib.sha256().hexdigest()
    per_shard = []
    for s, scan in zip(loaded.shards, loaded.shard_scans, strict=True):
        cell = s.minutes.get(minute)
        per_shard.append({
            "shard": s.name, "file": scan.path,
            "completion_tokens": cell.tokens if cell else 0, "spans": cell.spans if cell else 0,
            "lines": cell.lines if cell else 0,
            "lines_sha256": cell.lines_sha256 if cell and cell.lines_sha256 else empty_sha,
        })  # fmt: skip
    spans = windows(loaded.coordinators, loaded.shards)
    return Figure(minute, not is_full(minute, spans), per_shard)


# -- publish -------------------------------------------------------------------------------------


def publish(run_dir: Path, *, minute: str | None = None, out: Path | None = None,
            workers: int | None = None,
            warnings: list[str] | None = None) -> tuple[dict[str, Any], Path]:
    """Build a sample for `minute` (default: the peak full minute) and write it; what the
    sample cannot prove goes to `warnings`."""
    if out is not None:
        try:
            check_not_a_run_file("-o", out)
            # Before the run's events are folded: the manifest alone names them.
            check_not_a_source("-o", out, recorded_sources(read_manifest(run_dir)))
        except SpecError as exc:
            raise PublishError(str(exc)) from None
    loaded = _load(run_dir, workers)
    _check_publishable(loaded)
    m = _pick_minute(loaded, minute)
    if warnings is not None and (tail := unproven(loaded, m)) is not None:
        warnings.append(f"minute {minute_label(m)}: {tail}")
    sample = {
        "schema": SAMPLE_SCHEMA, "run_id": loaded.manifest.get("run_id"),
        **figure(loaded, m).as_dict(),
        "method": {"name": METHOD, "version": METHOD_VERSION},
        "files": [_file_record(s) for s in loaded.scans],
        "generator": f"shardrun {__version__}",
    }  # fmt: skip
    name = "minute-" + str(sample["minute"]).replace(":", "") + ".json"
    path = out or run_dir / "samples" / name
    # Through a temporary file: a write that fails (a full disk) leaves no half sample, and an
    # earlier sample of the minute as it was; a device or a FIFO in place, a link's target.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(path, format_sample(sample).encode() + b"\n")
    except OSError as exc:
        kept = "; nothing was written" if replace_target(path) is not None else ""
        raise PublishError(f"cannot write {path}: {exc.strerror}{kept}") from None
    return sample, path


def _check_publishable(loaded: LoadedRun) -> None:
    """Refuse a run still being written, or one whose files were altered."""
    state, why = run_state(loaded)
    if state == "running":
        raise PublishError(f"{loaded.path} is still running ({why}); publish once it has "
                           "ended, when its files no longer change")
    problem = _altered(loaded)
    if problem is not None:
        raise PublishError(f"{problem}; refusing to publish from altered files")


def _altered(loaded: LoadedRun) -> str | None:
    """Why the run's event files are not as it wrote them, if they are not: a file that fails
    its own checkpoints, differs from the SHA-256 the manifest recorded when the run ended, is
    listed there and gone, or is not listed though its pass had ended (added: a copied log).
    `publish` refuses such a run; `verify` fails it."""
    for scan in loaded.scans:
        if scan.checkpoint_error:
            return f"{scan.path} fails its own checkpoints ({scan.checkpoint_error})"
    changed = loaded.manifest_mismatches()
    if changed:
        return (f"{changed[0]} differs from the SHA-256 the manifest recorded at the end of "
                "the run")
    missing = loaded.missing_files()
    if missing:
        return (f"{missing[0]} is listed in the manifest but missing from the run directory"
                + where_it_went(missing[0], loaded.path))
    if unlogged := loaded.unlogged_files():
        return unlogged_text(unlogged[0], loaded.path)
    if foreign := loaded.foreign_files():
        return foreign_text(*foreign[0], loaded.manifest.get("run_id"))
    added = loaded.unlisted_files()
    if added:
        return (f"{added[0]} is not in the manifest's list of the run's files, though the pass "
                "that wrote it had ended: added since, or renamed")
    return None


def format_sample(sample: dict[str, Any]) -> str:
    return orjson.dumps(sample, option=orjson.OPT_INDENT_2).decode()


def _file_record(scan: FileScan) -> dict[str, Any]:
    return {"path": scan.path, "sha256": scan.sha256, "bytes": scan.bytes, "lines": scan.lines,
            "checkpoints": scan.checkpoints, "covered_lines": scan.covered_lines}


def _pick_minute(loaded: LoadedRun, minute: str | None) -> int:
    spans = windows(loaded.coordinators, loaded.shards)
    totals: dict[int, int] = {}
    for s in loaded.shards:
        for m, cell in s.minutes.items():
            totals[m] = totals.get(m, 0) + cell.tokens
    if minute is not None:
        try:
            m = parse_minute(minute)
        except ValueError as exc:
            raise PublishError(f"--minute {exc}") from None
        if m not in totals and not any(s // 60 <= m <= e // 60 for s, e in spans):
            raise PublishError(f"--minute {minute} is outside the run ({_span_text(spans)})")
        return m
    if not totals:
        raise PublishError(f"{loaded.path} has no successful span, so no minute has completion "
                           f"tokens to publish (`shardrun report {loaded.path}` shows why)")
    full = [m for m in totals if is_full(m, spans)]
    return max(full or totals, key=lambda m: (totals[m], -m))


def _span_text(spans: list[tuple[float, float]]) -> str:
    if not spans:
        return "no events"
    return ", ".join(f"{minute_label(int(s // 60))} to {minute_label(int(e // 60))}"
                     for s, e in spans)


# -- verify --------------------------------------------------------------------------------------


def read_sample(path: Path) -> dict[str, Any]:
    if path.is_dir():  # most often the run directory itself
        samples = sorted((path / "samples").glob("*.json"), key=lambda p: p.stat().st_mtime)
        hint = (f"; the newest sample of this run is {samples[-1]}" if samples
                else f"; `shardrun publish {path} --peak` makes one")
        raise VerifyError(f"{path} is a directory, and verify takes a sample file that "
                          f"`shardrun publish` wrote{hint}")
    try:
        sample = orjson.loads(path.read_bytes())
    except OSError as exc:
        raise VerifyError(f"cannot read sample {path}: {exc.strerror}") from None
    except orjson.JSONDecodeError as exc:
        raise NotASample(f"{path} is not valid JSON ({exc}), so it is no sample (nor a run "
                         "directory)") from None
    if not isinstance(sample, dict) or sample.get("schema") != SAMPLE_SCHEMA:
        got = sample.get("schema") if isinstance(sample, dict) else None
        raise NotASample(f"sample {path} has schema {got!r}, expected {SAMPLE_SCHEMA!r}")
    for key in ("run_id", "minute", "files", "per_shard", "method", *FIGURE_FIELDS):
        if key not in sample:
            raise VerifyError(f"sample {path} lacks the field {key!r}")
    _check_shape(path, sample)
    return sample


def _check_shape(path: Path, sample: dict[str, Any]) -> None:
    """The lists verify walks hold what it reads: one sentence, never a traceback, for a sample
    someone edited by hand (or cut short)."""
    for key in ("files", "per_shard"):
        if not isinstance(sample[key], list) or not all(isinstance(x, dict) for x in sample[key]):
            raise VerifyError(f"sample {path}: {key} must be a list of objects")
    seen: set[str] = set()
    for i, rec in enumerate(sample["files"]):
        for name, kind, what in (("path", str, "string"), ("sha256", str, "string"),
                                 ("bytes", int, "whole number")):
            if not isinstance(rec.get(name), kind) or isinstance(rec.get(name), bool):
                raise VerifyError(f"sample {path}: files[{i}] lacks {name!r} (a {what})")
        if rec["path"] in seen:
            raise VerifyError(f"sample {path}: files[{i}] names {rec['path']} again (the sample "
                              "was edited: each event file is listed once)")
        seen.add(rec["path"])


def find_run_dir(sample_path: Path, run_dir: Path | None) -> Path:
    if run_dir is not None:
        return run_dir
    parent = sample_path.resolve().parent
    if parent.name == "samples" and (parent.parent / "manifest.json").exists():
        return parent.parent
    raise VerifyError(f"cannot tell which run {sample_path} belongs to: pass --run-dir")


def verify(sample_path: Path, run_dir: Path | None = None, workers: int | None = None) -> str:
    """Check a sample against its run; the one-line confirmation, or VerifyError."""
    try:
        return _verify(sample_path, run_dir, workers)
    except RunDirError as exc:
        raise VerifyError(str(exc)) from None


def _verify(sample_path: Path, run_dir: Path | None, workers: int | None) -> str:
    sample = read_sample(sample_path)
    run_dir = find_run_dir(sample_path, run_dir)
    manifest = read_manifest(run_dir)
    if manifest.get("run_id") != sample["run_id"]:
        raise VerifyError(f"the sample is for run {sample['run_id']!r} but {run_dir} holds run "
                          f"{manifest.get('run_id')!r}")
    if sample["method"] != {"name": METHOD, "version": METHOD_VERSION}:
        raise VerifyError(f"the sample's method {sample['method']} is not this version's "
                          f"({METHOD} v{METHOD_VERSION})")
    _check_file_set(sample, run_dir)
    loaded = _load(run_dir, workers)
    _check_files(sample, loaded)
    # Files that match the sample may still not be the run's: a forger who edits a line and
    # publishes anew fixes the sample's hashes, not the files' own checkpoints or the manifest.
    problem = _altered(loaded)
    if problem is not None:
        raise VerifyError(problem)
    _check_figure(sample, figure(loaded, _sample_minute(sample)).as_dict())
    size = sum(f["bytes"] for f in sample["files"])
    part = " (a partial minute: the run did not cover all of it)" if sample["partial"] else ""
    tail = unproven(loaded, _sample_minute(sample))
    return (f"ok: run {sample['run_id']} minute {sample['minute']}{part}: "
            f"{counted(sample['completion_tokens'], 'completion token')} from "
            f"{counted(sample['spans'], 'span')} on {_shards_text(sample['per_shard'])}; "
            f"{counted(len(sample['files']), 'event file')} ({size:,} bytes) match their "
            "SHA-256; the figure and its counted lines recompute"
            + ("" if tail is None else f"; but {tail}"))


def _shards_text(per_shard: list[dict[str, Any]]) -> str:
    """'2 shards', or for a resumed run, whose every pass has logs of its own, '2 shards
    (6 shard logs over its passes)'."""
    shards = {str(s.get("shard")).split(".")[0] for s in per_shard}
    logs = "" if len(shards) == len(per_shard) else (
        f" ({counted(len(per_shard), 'shard log')} over its passes)")
    return counted(len(shards), "shard") + logs


def _sample_minute(sample: dict[str, Any]) -> int:
    try:
        return parse_minute(str(sample["minute"]))
    except ValueError as exc:
        raise VerifyError(f"the sample's minute: {exc}") from None


def _check_file_set(sample: dict[str, Any], run_dir: Path) -> None:
    present = {f"events/{p.name}": p for p in event_files(run_dir)}
    named = {f["path"]: f for f in sample["files"]}
    for path, rec in named.items():
        if path not in present:
            twin = next((p for p, full in present.items() if p not in named
                         and _sha(full) == rec["sha256"]), None)
            hint = (f"; {twin} has its SHA-256 (renamed?)" if twin
                    else where_it_went(path, run_dir))
            raise VerifyError(f"{path} named in the sample is missing from {run_dir}{hint}")
    extra = sorted(set(present) - set(named))
    if extra:
        why = ("a resume of the run since it was published writes files of its own, so verify "
               "a sample published after the run's last pass" if segment_of(present[extra[0]])
               else "an added or renamed event file")
        raise VerifyError(f"{extra[0]} is in {run_dir} but not in the sample ({why})")


def _sha(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def _check_files(sample: dict[str, Any], loaded: LoadedRun) -> None:
    scans = {s.path: s for s in loaded.scans}
    listed = loaded.manifest.get("files")
    recorded = {f.get("path"): f for f in listed if isinstance(f, dict)} if isinstance(
        listed, list) else {}
    for rec in sample["files"]:
        scan = scans[rec["path"]]
        if scan.sha256 != rec["sha256"] or scan.bytes != rec["bytes"]:
            raise VerifyError(f"{scan.path} does not match the sample: {_diff(scan, rec)}; "
                              f"{_why_changed(scan, rec, sample['files'], recorded)}")
        if scan.checkpoint_error:  # before its counts, which a failed chain leaves short
            raise VerifyError(f"{scan.path} fails its own checkpoints ({scan.checkpoint_error}): "
                              "it was edited, and the sample's SHA-256 and size written to "
                              "match")
        found = _file_record(scan)
        for key in FILE_FIELDS:
            if key in rec and not _same(rec[key], found[key]):
                raise VerifyError(f"{scan.path}: the sample says {key} {rec[key]!r} but the file "
                                  f"has {found[key]!r}")


def _diff(scan: FileScan, rec: dict[str, Any]) -> str:
    parts = [f"SHA-256 {scan.sha256} instead of {rec['sha256']}"] if (
        scan.sha256 != rec["sha256"]) else []
    if scan.lines != rec.get("lines"):
        parts.append(f"{scan.lines:,} lines instead of {rec.get('lines')}")
    if scan.bytes != rec["bytes"]:
        parts.append(f"{scan.bytes:,} bytes instead of {rec['bytes']:,}")
    return ", ".join(parts)


def _why_changed(scan: FileScan, rec: dict[str, Any], files: list[dict[str, Any]],
                 recorded: dict[Any, Any]) -> str:
    """What the file's bytes, its own checkpoints, the sample's other files and the manifest's
    record of it say about how it came to differ from the sample."""
    if scan.bytes == 0:
        return "the file is empty now: it was truncated or replaced"
    for other in files:
        if other is not rec and other["sha256"] == scan.sha256:
            return (f"its bytes are those the sample records for {other['path']}: the files "
                    "were swapped or renamed")
    if scan.torn_tail_bytes:
        return (f"it ends in {scan.torn_tail_bytes:,} bytes of a line cut short: a copy or a "
                "write that did not finish")
    if scan.checkpoint_error:
        return scan.checkpoint_error
    if scan.first_bad:
        return f"{scan.first_bad[0]} ({scan.bad_lines} unreadable)"
    if scan.covered_lines < scan.lines:
        return f"the change is after line {scan.covered_lines:,}, its last good checkpoint"
    if isinstance(rec.get("lines"), int) and scan.lines < rec["lines"]:
        return (f"it was cut short after line {scan.lines:,}, where its own checkpoints still "
                "verify: truncated (a copy that did not finish?)")
    manifest = recorded.get(scan.path)
    if isinstance(manifest, dict) and manifest.get("sha256") == scan.sha256:
        return ("it is as the run's manifest recorded it, so the SHA-256 or size in the sample "
                "was changed")
    if isinstance(manifest, dict) and manifest.get("sha256") == rec["sha256"]:
        return ("the run's manifest recorded the sample's bytes, so the file was rewritten "
                "since (its own checkpoints were written anew to match)")
    return ("the file's own checkpoints all verify: the sample's SHA-256 or size was changed, "
            "or the file was rewritten with checkpoints to match")


def _same(given: Any, found: Any) -> bool:
    """Equal and of the same JSON type: 12274.0 is not the count 12274, nor true the 1."""
    return type(given) is type(found) and given == found


def _check_figure(sample: dict[str, Any], fresh: dict[str, Any]) -> None:
    at = f"minute {fresh['minute']}: "
    for key in (*FIGURE_FIELDS, *(["minute_start_t"] if "minute_start_t" in sample else [])):
        if not _same(sample[key], fresh[key]):
            raise VerifyError(f"{at}{key}: the sample says {sample[key]!r} but the events give "
                              f"{fresh[key]!r}")
    if len(sample["per_shard"]) != len(fresh["per_shard"]):
        raise VerifyError(f"{at}per_shard: the sample lists {len(sample['per_shard'])} shards but "
                          f"the run has {len(fresh['per_shard'])}")
    for mine, theirs in zip(sample["per_shard"], fresh["per_shard"], strict=True):
        for key in SHARD_FIELDS:
            if not _same(mine.get(key), theirs[key]):
                raise VerifyError(f"{at}per_shard {theirs['file']} {key}: the sample says "
                                  f"{mine.get(key)!r} but the events give {theirs[key]!r}")

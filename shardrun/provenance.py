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
from shardrun._urls import endpoint_kind
from shardrun.aggregate import METHOD_VERSION, is_full, minute_label, parse_minute
from shardrun.aggregate._metrics import windows
from shardrun.aggregate._passes import PASS_SETTINGS, recorded_passes
from shardrun.errors import RunDirError, ShardrunError, SpecError
from shardrun.manifest import read_manifest, recorded_sources
from shardrun.outpath import (
    cannot_write,
    check_not_a_run_file,
    check_not_a_source,
    check_output_file,
    write_bytes_atomically,
)
from shardrun.report._rundir import (
    BeyondLog,
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
ESTIMATED_FIELDS = ("estimated_spans", "estimated_completion_tokens")
"""Of the figure's spans and tokens, those whose token count the client made (the server sent
no usage: `usage_estimated` on the counted `attempt_end` lines, which the hashes cover).
Checked when the sample has them: samples published before them lack them."""
SHARD_FIELDS = ("shard", "file", "completion_tokens", "spans", "lines", "lines_sha256")
SAMPLE_SETTINGS = (*PASS_SETTINGS, "endpoint.model", "endpoint.api")
"""The settings a sample states for each pass its minute came from, by their manifest key."""
FILE_FIELDS = ("lines", "checkpoints", "covered_lines")
"""What a sample says of each file besides its hash and size; checked when the sample has it
(samples of older versions may lack some)."""


class PublishError(ShardrunError):
    """A sample cannot be published from this run."""

    exit_code = 2


class AlteredRun(PublishError):
    """The run's files are not as it wrote them: a failed verification, exit 1 as `verify`'s,
    not a usage error."""

    exit_code = 1


class VerifyError(ShardrunError):
    """A sample does not verify against its run."""


class NotASample(VerifyError):
    """The file given as a sample is none: not JSON, or of another schema."""

    exit_code = 2


class RunUnknown(VerifyError):
    """A sample outside its run's samples/ and no --run-dir: no verdict on it, a usage error
    (exit 2) as a file that is no sample is, not one that differs (exit 1)."""

    exit_code = 2


@dataclass(frozen=True)
class Figure:
    """What the events say about one minute."""

    minute: int
    partial: bool
    per_shard: list[dict[str, Any]]
    estimated_spans: int = 0
    estimated_tokens: int = 0

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
            "lines_sha256": top.hexdigest(),
            "estimated_spans": self.estimated_spans,
            "estimated_completion_tokens": self.estimated_tokens, "per_shard": self.per_shard,
        }  # fmt: skip

    def estimated_text(self) -> str | None:
        """That some of the figure's token counts are the client's, or None."""
        if not self.estimated_spans:
            return None
        spans = sum(s["spans"] for s in self.per_shard)
        return (f"the token counts of {self.estimated_spans:,} of its {counted(spans, 'span')} "
                f"({self.estimated_tokens:,} tokens) are estimated (the server sent no usage): "
                "its TPM is an estimate")


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
    est_spans = est_tokens = 0
    for s, scan in zip(loaded.shards, loaded.shard_scans, strict=True):
        cell = s.minutes.get(minute)
        if cell:
            est_spans += cell.estimated_spans
            est_tokens += cell.estimated_tokens
        per_shard.append({
            "shard": s.name, "file": scan.path,
            "completion_tokens": cell.tokens if cell else 0, "spans": cell.spans if cell else 0,
            "lines": cell.lines if cell else 0,
            "lines_sha256": cell.lines_sha256 if cell and cell.lines_sha256 else empty_sha,
        })  # fmt: skip
    spans = windows(loaded.coordinators, loaded.shards)
    return Figure(minute, not is_full(minute, spans), per_shard, est_spans, est_tokens)


def _segment(shard: object) -> int:
    """The pass of a shard log by its name: '03' is pass 0, '03.r2' pass 2."""
    _, _, resume = str(shard).partition(".r")
    return int(resume) if resume.isdigit() else 0


def _producing_segments(per_shard: list[dict[str, Any]]) -> list[int]:
    """The passes whose shard logs counted spans in the minute; all of them when none did."""
    found = sorted({_segment(s.get("shard")) for s in per_shard if s.get("spans")})
    return found or sorted({_segment(s.get("shard")) for s in per_shard})


def minute_passes(loaded: LoadedRun, fig: Figure) -> list[dict[str, Any]]:
    """What produced the minute, per pass its spans came from: the settings its manifest entry
    records ({value, source}: shards, concurrency, rpm and tpm limits, model, api), the kind
    of endpoint (never its URL, which may name a private host), and what its own shard logs
    say: how many there are and the caps they started with. A reader of the figure needs the
    settings of the passes behind it, not the run's first or last."""
    recorded = recorded_passes(loaded.manifest, SAMPLE_SETTINGS)
    out = []
    for seg in _producing_segments(fig.per_shard):
        logs = [s for s in loaded.shards if s.segment == seg]
        facts = recorded[seg] if seg < len(recorded) else {"kind": None, "settings": {}}
        effective = _effective_of(loaded.manifest, seg)
        url = effective.get("endpoint.base_url")
        out.append({
            "segment": seg, "kind": facts["kind"], "settings": facts["settings"],
            "endpoint_kind": endpoint_kind(url["value"]) if isinstance(url, dict)
            and isinstance(url.get("value"), str) else None,
            "shard_logs": len(logs), "caps": sorted({s.cap for s in logs if s.cap}),
        })  # fmt: skip
    return out


def _effective_of(manifest: dict[str, Any], segment: int) -> dict[str, Any]:
    """Pass `segment`'s recorded `effective` ({} when it has none)."""
    resumes = manifest.get("resumes") or []
    entry = manifest if segment == 0 else (
        resumes[segment - 1] if segment - 1 < len(resumes) else None)
    found = entry.get("effective") if isinstance(entry, dict) else None
    return found if isinstance(found, dict) else {}


# -- publish -------------------------------------------------------------------------------------


def publish(run_dir: Path, *, minute: str | None = None, out: Path | None = None,
            workers: int | None = None,
            warnings: list[str] | None = None) -> tuple[dict[str, Any], Path]:
    """Build a sample for `minute` (default: the peak full minute of those no cut event log
    leaves short) and write it; what the sample cannot prove goes to `warnings`."""
    if out is not None:
        try:
            check_output_file("-o", out, makes_folders=True)
            check_not_a_run_file("-o", out)
            # Before the run's events are folded: the manifest alone names them.
            check_not_a_source("-o", out, recorded_sources(read_manifest(run_dir)))
        except SpecError as exc:
            raise PublishError(str(exc)) from None
    loaded = _load(run_dir, workers)
    _check_publishable(loaded)
    # A dead letter adds no completion tokens and a sample counts no failures, so dead letters
    # beyond a cut log leave no minute's figure short: only answers do.
    cuts = [cut for cut in loaded.beyond_log() if cut.path.startswith("results/")]
    m = _pick_minute(loaded, minute, cuts)
    _check_not_cut(loaded, m, cuts)
    if warnings is not None and minute is None and (
            peak := _busiest(loaded, _minute_totals(loaded))) != m:  # passed over for a cut
        warnings.append(f"minute {minute_label(peak)} has more tokens, but a cut event log may "
                        f"leave its figure short (see `shardrun report`), so this is "
                        f"{minute_label(m)}, the busiest minute no cut does")
    if warnings is not None and (tail := unproven(loaded, m)) is not None:
        warnings.append(f"minute {minute_label(m)}: {tail}")
    fig = figure(loaded, m)
    if warnings is not None and (estimated := fig.estimated_text()) is not None:
        warnings.append(f"minute {minute_label(m)}: {estimated}")
    sample = {
        "schema": SAMPLE_SCHEMA, "run_id": loaded.manifest.get("run_id"),
        **fig.as_dict(),
        # Outside every hash (the hashes are of event lines and files), so samples without
        # it verify as before; verify checks it against the manifest and the logs when given.
        "passes": minute_passes(loaded, fig),
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
        raise cannot_write("-o", path, exc) from None
    return sample, path


def _check_publishable(loaded: LoadedRun) -> None:
    """Refuse a run still being written, or one whose files were altered."""
    state, why = run_state(loaded)
    if state == "running":
        raise PublishError(f"{loaded.path} is still running ({why}); publish once it has "
                           "ended, when its files no longer change")
    problem = _altered(loaded)
    if problem is not None:
        raise AlteredRun(f"{problem}; refusing to publish from altered files")


def _check_not_cut(loaded: LoadedRun, minute: int, cuts: list[BeyondLog]) -> None:
    """Refuse a minute whose figure would leave out answers a full disk kept out of the event
    log (`LoadedRun.beyond_log`): the sample would claim fewer tokens than the minute had."""
    for cut in cuts:
        if not cut.hides(minute):
            continue
        when = f"by {minute_label(int(cut.written // 60))}"
        if cut.answers is not None:  # the minutes their own lines name
            when = (f"from {minute_label(int(cut.answers[0] // 60))} to "
                    f"{minute_label(int(cut.answers[1] // 60))}")
        elif cut.log_ends is not None:
            when = f"from {minute_label(int(cut.log_ends // 60))} {when.replace('by', 'to')}"
        # The way on names a minute no cut leaves short, or says there is none.
        whole = _not_hidden(_minute_totals(loaded), cuts)
        way = (f"publish another with --minute, such as {minute_label(_busiest(loaded, whole))}"
               if whole else "no minute of this run with completion tokens lies outside such "
               "a span, so none can be published")
        more = counted(cut.lines - cut.logged, "more line")
        raise PublishError(
            f"minute {minute_label(minute)}: {cut.path} holds {more} than its event log "
            f"{cut.event_log} records (the log was cut by a full disk or a power cut), answers "
            f"that ended {when}, so this minute's figure would be short; {way}")


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


def _minute_totals(loaded: LoadedRun) -> dict[int, int]:
    """Completion tokens of each minute the shard logs counted any in."""
    totals: dict[int, int] = {}
    for s in loaded.shards:
        for m, cell in s.minutes.items():
            totals[m] = totals.get(m, 0) + cell.tokens
    return totals


def _not_hidden(totals: dict[int, int], cuts: list[BeyondLog]) -> dict[int, int]:
    """The minutes of `totals` in which no cut log may have left answers out."""
    return {m: n for m, n in totals.items() if not any(c.hides(m) for c in cuts)}


def _busiest(loaded: LoadedRun, totals: dict[int, int]) -> int:
    """The minute with the most tokens, a full one first (the earliest on a tie)."""
    spans = windows(loaded.coordinators, loaded.shards)
    full = [m for m in totals if is_full(m, spans)]
    return max(full or totals, key=lambda m: (totals[m], -m))


def _pick_minute(loaded: LoadedRun, minute: str | None, cuts: list[BeyondLog]) -> int:
    spans = windows(loaded.coordinators, loaded.shards)
    totals = _minute_totals(loaded)
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
    # The busiest minute a cut log leaves whole: the peak is not refused when another is
    # there to publish. With none, the peak, which `_check_not_cut` refuses, saying so.
    return _busiest(loaded, _not_hidden(totals, cuts) or totals)


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
    raise RunUnknown(f"cannot tell which run {sample_path} belongs to (it is not in a run's "
                     "samples/): name the run with --run-dir RUN_DIR")


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
    fig = figure(loaded, _sample_minute(sample))
    _check_figure(sample, fig.as_dict())
    # Said whether or not the sample says it (one published before the fields lacks them).
    estimated = fig.estimated_text()
    if "passes" in sample:  # samples of earlier versions have none
        _check_passes(sample, minute_passes(loaded, fig))
    size = sum(f["bytes"] for f in sample["files"])
    part = " (a partial minute: the run did not cover all of it)" if sample["partial"] else ""
    tail = unproven(loaded, _sample_minute(sample))
    return (f"ok: run {sample['run_id']} minute {sample['minute']}{part}: "
            f"{counted(sample['completion_tokens'], 'completion token')} from "
            f"{counted(sample['spans'], 'span')} on {_shards_text(sample)}; "
            f"{counted(len(sample['files']), 'event file')} ({size:,} bytes) match their "
            "SHA-256; the figure and its counted lines recompute"
            + ("" if estimated is None else f"; {estimated}")
            + ("" if tail is None else f"; but {tail}"))


def _shards_text(sample: dict[str, Any]) -> str:
    """'2 shards' for a run of one pass; for a resumed run, the shards of the passes the
    minute's spans came from, as their logs count them: '2 shards of pass 1', '3 shards of pass
    0 and 2 of pass 1'; with the settings the sample states for them, when it does."""
    per_shard = sample["per_shard"]
    segments = _producing_segments(per_shard)
    logs = {seg: sum(_segment(s.get("shard")) == seg for s in per_shard) for seg in segments}
    stated = {p.get("segment"): p for p in sample.get("passes") or [] if isinstance(p, dict)}
    if {_segment(s.get("shard")) for s in per_shard} == {0}:
        return counted(logs.get(0, 0), "shard") + _settings_text(stated.get(0))
    return " and ".join(
        f"{counted(logs[seg], 'shard') if at == 0 else f'{logs[seg]:,}'} of pass {seg}"
        + _settings_text(stated.get(seg)) for at, seg in enumerate(segments))


def _settings_text(stated: dict[str, Any] | None) -> str:
    """' (concurrency 2 each, rpm 600, no tpm limit, model m, chat, simulator)', from a pass
    the sample states."""
    if not stated or not isinstance(stated.get("settings"), dict):
        return ""
    settings = stated["settings"]

    def value(key: str) -> Any:
        found = settings.get(key)
        return found.get("value") if isinstance(found, dict) else None

    parts = [] if value("concurrency") is None else [f"concurrency {value('concurrency')} each"]
    for key, name in (("rate_limits.rpm", "rpm"), ("rate_limits.tpm", "tpm")):
        limit = value(key)
        parts.append(f"no {name} limit" if limit is None else f"{name} {limit:g}"
                     if isinstance(limit, int | float) else f"{name} {limit}")
    if value("endpoint.model") is not None:
        parts.append(f"model {value('endpoint.model')}")
    parts += [str(v) for v in (value("endpoint.api"), stated.get("endpoint_kind")) if v]
    return f" ({', '.join(parts)})"


def _check_passes(sample: dict[str, Any], fresh: list[dict[str, Any]]) -> None:
    """The passes the sample states are those the run's manifest and shard logs give for its
    minute, each field of the same value and JSON type."""
    at = f"minute {sample['minute']}: "
    given = sample["passes"]
    if not isinstance(given, list) or not all(isinstance(p, dict) for p in given):
        raise VerifyError(f"{at}passes must be a list of objects")
    want = [p["segment"] for p in fresh]
    if [p.get("segment") for p in given] != want:
        raise VerifyError(f"{at}the sample names passes {[p.get('segment') for p in given]} "
                          f"but its counted spans come from passes {want}")
    for mine, theirs in zip(given, fresh, strict=True):
        of = f"{at}pass {theirs['segment']}'s "
        settings = mine.get("settings") if isinstance(mine.get("settings"), dict) else {}
        for key in sorted(set(settings) | set(theirs["settings"])):
            if not _same_json(settings.get(key), theirs["settings"].get(key)):
                raise VerifyError(f"{of}{key}: the sample says {_stated(settings.get(key))} but "
                                  "the run's manifest records "
                                  f"{_stated(theirs['settings'].get(key))}")
        for key in ("kind", "endpoint_kind", "shard_logs", "caps"):
            if not _same_json(mine.get(key), theirs[key]):
                source = ("its shard logs give" if key in ("shard_logs", "caps")
                          else "the run's manifest records")
                raise VerifyError(f"{of}{key}: the sample says {mine.get(key)!r} but {source} "
                                  f"{theirs[key]!r}")
        if set(mine) - set(theirs):
            raise VerifyError(f"{of}{sorted(set(mine) - set(theirs))[0]}: the sample states it, "
                              "but the run records no such setting")


def _stated(setting: Any) -> str:
    """'2 (env SHARDRUN_CONCURRENCY)', or the JSON as given when it is no {value, source}."""
    if isinstance(setting, dict) and set(setting) == {"value", "source"}:
        return f"{orjson.dumps(setting['value']).decode()} ({setting['source']})"
    return "nothing" if setting is None else orjson.dumps(setting).decode()


def _same_json(given: Any, found: Any) -> bool:
    """Equal as JSON, types included: 2.0 is not the cap 2, nor true the 1."""
    return orjson.dumps(given, option=orjson.OPT_SORT_KEYS) == orjson.dumps(
        found, option=orjson.OPT_SORT_KEYS)


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
    optional = [k for k in ("minute_start_t", *ESTIMATED_FIELDS) if k in sample]
    for key in (*FIGURE_FIELDS, *optional):
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

"""The run directory and its manifest.

`manifest.json` is written when a run starts (status `running`) and rewritten atomically when it
ends, then listing every file the run wrote with its SHA-256 and size, so a figure computed
from the run can name exactly the bytes it came from.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import platform
import re
import secrets
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import orjson

from shardrun import __version__
from shardrun._ellipsis import ellipsize, in_words
from shardrun._urls import masked_url
from shardrun.errors import InputError, RunDirError, SpecError
from shardrun.outpath import is_run_file

if TYPE_CHECKING:
    from shardrun.inputs import InputReader
    from shardrun.spec import LoadedJob
    from shardrun.summary import RunSummary

MANIFEST_SCHEMA = 1
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
LATEST = "latest"  # `--resume latest`: the job's newest run, so no run may be named so
# The hidden name `RunDir.create_held` makes a run's directory under, until it renames it.
STAGING = re.compile(r"^\.(?P<run_id>[A-Za-z0-9][A-Za-z0-9._-]*)\.(?P<pid>\d+)\.[0-9a-f]{8}\.new$")
VERSIONED = ("aiohttp", "orjson", "uvloop", "tenacity", "structlog", "PyYAML", "pydantic")


class _Closable(Protocol):
    def close(self) -> None: ...


# What a first pass holds in its run directory as it is made (its gate), or None.
Held = TypeVar("Held", bound=_Closable | None)


@dataclass(frozen=True)
class RunDir:
    """Paths of one run: `<runs_dir>/<run_id>/`."""

    path: Path
    run_id: str  # the directory's name: what `--resume` names the run by
    # The run's own id, which its manifest records and every line of its event logs carries:
    # the directory's name when the run began, kept by a run renamed since ("" for that name).
    logged_id: str = ""

    @property
    def event_run_id(self) -> str:
        return self.logged_id or self.run_id

    @classmethod
    def create(cls, runs_dir: Path, run_id: str) -> RunDir:
        return cls.create_held(runs_dir, run_id, lambda _: None)[0]

    @classmethod
    def create_held(cls, runs_dir: Path, run_id: str,
                    take: Callable[[Path], Held]) -> tuple[RunDir, Held]:  # fmt: skip
        """Make the run's directory whole under a hidden name, `take` what a first pass holds
        there (its gate), then give it the run's name: a resume or `retry-failed` of the run
        started at any moment finds no directory, or one whose first pass holds it (and
        waits for that pass), never one not held yet, which would read as no run."""
        if not RUN_ID_PATTERN.match(run_id):
            raise SpecError(
                f"--run-id {run_id!r} is not a valid run id: use letters, digits, '.', '_' "
                "and '-' (at most 128, starting with a letter or digit)"
            )
        if run_id == LATEST:  # the run's printed resume command would resume another run
            raise SpecError(f"--run-id {LATEST} is the word --resume reads as the job's newest "
                            "run, so this run could not be resumed by its name; choose another")
        path = runs_dir / run_id
        taken = SpecError(f"run directory {path} already exists; choose another --run-id")
        if path.exists():
            raise taken
        # A dot first: no run id can be this name (RUN_ID_PATTERN). Random as well as the pid:
        # a pid is reused (a container's shardrun is often pid 1 every time), and a leftover
        # of a killed pass, or a pass in another container, must not make the name taken.
        staging = runs_dir / f".{run_id}.{os.getpid()}.{secrets.token_hex(4)}.new"  # STAGING
        try:
            runs_dir.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
            ours = staging.lstat()
        except OSError as exc:
            raise SpecError(f"cannot create run directory {path}: {exc.strerror}") from None
        held: Held | None = None
        try:
            # Held before the subdirectories are made: with them and no gate held, a directory
            # reads as one a killed pass left (`resume.never_begun`), which `--resume latest`
            # tells the user to remove.
            held = take(staging)
            for sub in ("events", "results", "dead", "logs"):
                (staging / sub).mkdir()
            # Fails on a directory made meanwhile: of two runs given one --run-id at once, one
            # fails (each renames a directory with files in it, which rename() never replaces).
            os.rename(staging, path)
        except BaseException as exc:  # a stop or an error half-way leaves no half-made run
            # A stop (SIGINT) that comes during the rename is raised as it returns, done: the
            # run has its name then, and, left there, would read as one a killed pass left.
            shutil.rmtree(path if _is_dir(path, ours) else staging, ignore_errors=True)
            if held is not None:
                held.close()  # after: removed under its gate, as `runner.run` removes a run
            if isinstance(exc, OSError) and exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise taken from None
            if isinstance(exc, OSError):
                raise SpecError(f"cannot create run directory {path}: {exc.strerror}") from None
            raise
        return cls(path, run_id), held

    @classmethod
    def existing(cls, path: Path) -> RunDir:
        return cls(path, path.name)

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def rejects_path(self, segment: int) -> Path:
        return self.path / ("rejects.jsonl" if segment == 0 else f"rejects.r{segment}.jsonl")

    @property
    def manifest_path(self) -> Path:
        return self.path / "manifest.json"


def _is_dir(path: Path, made: os.stat_result) -> bool:
    """Whether `path` is the directory `made` (not another run's of the same name)."""
    try:
        return os.path.samestat(path.lstat(), made)
    except OSError:
        return False


def new_run_id() -> str:
    """A sortable, unique run id: UTC time plus random hex."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def file_digest(path: Path, limit: int | None = None) -> tuple[str, int]:
    """SHA-256 hex and size of a file (of its first `limit` bytes, if given), read in chunks."""
    sha = hashlib.sha256()
    size = 0
    block = 1 << 20
    with open(path, "rb") as f:
        while chunk := f.read(block if limit is None else min(block, limit - size)):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


def prefix_digests(path: Path, sizes: Iterable[int]) -> dict[int, str | None]:
    """SHA-256 hex of the file's first `size` bytes for each of `sizes`, in one read up to the
    largest (the hash carries on from one size to the next); None for a size past its end."""
    found: dict[int, str | None] = {}
    sha = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        for size in sorted(set(sizes)):
            while done < size and (chunk := f.read(min(1 << 20, size - done))):
                sha.update(chunk)
                done += len(chunk)
            found[size] = sha.hexdigest() if done == size else None
    return found


def input_at_start(path: Path) -> dict[str, Any]:
    """What a pass records of its input when it starts: the resolved path, and the file's size
    and modification time, which let a later resume see that a pass killed before it recorded
    the bytes it read (`finish_manifest` replaces this record) left the file as it was."""
    found: dict[str, Any] = {"path": str(path)}
    try:
        stat = path.stat()
    except OSError:  # the reader, opened already, names the problem
        return found
    return {**found, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _passes(manifest: dict[str, Any]) -> list[tuple[str, object]]:
    """(which pass, its record) for the run's first pass and each resume, in order."""
    resumes = manifest.get("resumes")
    passes: list[tuple[str, object]] = [("the first pass", manifest)]
    passes += [(f"resume {n}", entry) for n, entry in
               enumerate(resumes if isinstance(resumes, list) else [], 1)]  # fmt: skip
    return passes


def pass_inputs(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None]]:
    """(which pass, what it recorded of its input) for the run's first pass and each resume, in
    order; None where a pass recorded nothing (a run of an older shardrun killed mid-pass)."""
    found: list[tuple[str, dict[str, Any] | None]] = []
    for name, record in _passes(manifest):
        got = record.get("input") if isinstance(record, dict) else None
        found.append((name, got if isinstance(got, dict) else None))
    return found


def recorded_sources(manifest: dict[str, Any]) -> list[tuple[str, Path]]:
    """("the run's job file" or "the run's input file", its absolute path) of every job file
    and input file the run's passes recorded: the files an output path must not be
    (`outpath.check_not_a_source`)."""
    found: list[tuple[str, Path]] = []
    for _, record in _passes(manifest):
        if not isinstance(record, dict):
            continue
        job = record.get("job") if record is manifest else {"path": record.get("job_path")}
        for what, held in (("job file", job), ("input file", record.get("input"))):
            named = held.get("path") if isinstance(held, dict) else None
            if isinstance(named, str) and named:
                found.append((f"the run's {what}", Path(named)))
    return found


@dataclass(frozen=True)
class RunOn:
    """An ended pass whose last record the file's end cut off, and text added to the file since
    that runs on into that record (`run_on`)."""

    name: str  # which pass
    line: int  # the last line it read
    quote: bool  # cut off inside a quoted CSV cell, not only before a line break

    @property
    def why(self) -> str:
        if self.quote:
            return (f"{self.name} read it to its end inside a quoted cell (line {self.line:,}: "
                    "a quote never closed), and the text added since is read as part of that row")
        return (f"its line {self.line:,} had no line break at its end when {self.name} read it, "
                "and the text added since runs on from it")

    @property
    def fix(self) -> str:
        if self.quote:
            return "restore the file as the run read it"
        return f"put a line break at the end of line {self.line:,}, before the added text"


def run_on(manifest: dict[str, Any], path: Path, fmt: str) -> RunOn | None:
    """The first ended pass whose last record ended where the input then ended, without a line
    break (or inside a quoted CSV cell), if text added to the file since runs on into it.

    The file still starts with the bytes that pass read (checked before), so its lines are
    numbered as then; but the record is now another, or no record, and the items appended after
    it are read as part of it: a line the pass judged already, so no pass would run them or
    record them as rejected. A line break alone, added at the end, only completes the line; so
    do spaces or tabs before it after a JSON line (`fmt`), whose record they leave the same,
    where in a CSV they would change its last cell."""
    for name, entry in _passes(manifest):
        record = entry.get("input") if isinstance(entry, dict) else None
        size = record.get("bytes_read") if isinstance(record, dict) else None
        if not (isinstance(entry, dict) and isinstance(record, dict) and isinstance(size, int)
                and size > 0):
            continue
        try:
            with open(path, "rb") as f:
                f.seek(size - 1)
                last, after = (got := f.read(_RUN_ON_READ))[:1], got[1:]
        except OSError as exc:
            raise InputError(f"cannot read input file {path}: {exc.strerror}") from None
        kind = _open_end(entry, record, last, fmt)
        if not after or kind is None or (kind == "line" and _completes(after, fmt)):
            continue
        line = record.get("lines_read")
        return RunOn(name, line if isinstance(line, int) else 0, kind == "quote")
    return None


_RUN_ON_READ = 1 << 16
"""How much of the text added after a line without a line break `run_on` reads (and 1)."""


def _completes(after: bytes, fmt: str) -> bool:
    """Whether text added after a last line without a line break only completes that line: a
    line break first (in a CSV a lone CR too, as the csv module reads one), or, after a JSON
    line, spaces, tabs and CRs (JSON whitespace) before it or up to the file's end. In a CSV
    they would be part of the row's last cell."""
    if fmt == "csv":
        return after.startswith((b"\n", b"\r"))
    rest = after.lstrip(b" \t\r")
    return rest.startswith(b"\n") or (not rest and len(after) < _RUN_ON_READ - 1)


def _open_end(entry: dict[str, Any], record: dict[str, Any], last: bytes,
              fmt: str) -> str | None:
    """How the file's end cut off the last record a pass read (`InputReader.open_end`)."""
    if "open_end" in record:
        kind = record["open_end"]
        return kind if kind in ("line", "quote") else None
    # Recorded by an older shardrun: a pass that read its input to the end and whose last byte
    # is not a line break read a last line without one (in a CSV a lone CR is one, as the
    # csv module and the reader read it).
    summary = entry.get("summary")
    read_all = isinstance(summary, dict) and summary.get("input_read") is True
    ends = (b"\n", b"\r") if fmt == "csv" else (b"\n",)
    return "line" if read_all and last not in ends else None


def pass_reads(manifest: dict[str, Any]) -> list[tuple[int, str, int, str]]:
    """(its place in `pass_inputs`, which pass, `bytes_read`, `sha256_of_bytes_read`) of each
    pass that ended and so recorded what it read of its input (a damaged record is skipped)."""
    found = []
    for at, (name, record) in enumerate(pass_inputs(manifest)):
        size, sha = (record or {}).get("bytes_read", 0), (record or {}).get("sha256_of_bytes_read")
        if isinstance(size, int) and size >= 0 and isinstance(sha, str):
            found.append((at, name, size, sha))
    return found


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write via a temporary file and rename, so a crash never leaves half a manifest
    (`write_atomic`)."""
    write_atomic(path, orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))


def write_atomic(path: Path, data: bytes | list[bytes]) -> None:
    """Write `data` (bytes, or lines to join) to `path` via a temporary file and rename:
    `path` holds all of it or what it held before.

    A write that fails (a full disk) leaves `path` as it was and no temporary file, and raises
    an OSError that names the file that failed: the temporary one, where it could not be
    made or written (a failed write names no file of its own), else `path`, which it could not
    replace. A directory that cannot be synced after the rename is no failed write (see
    `_sync_replaced`).
    """
    tmp = path.with_suffix(path.suffix + ".tmp")
    failed = tmp
    try:
        with open(tmp, "wb") as f:
            f.writelines([data] if isinstance(data, bytes) else data)
            f.flush()
            os.fsync(f.fileno())
        failed = path
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(exc.errno, exc.strerror or str(exc), str(failed)) from exc
    _sync_replaced(path)


_dir_sync_warned = False


def _sync_replaced(path: Path) -> None:
    """Sync the directory of `path`, just replaced: the rename is an entry of the directory,
    and unsynced a power loss can bring back the old file. Once replaced, `path` holds the new
    bytes for every reader, so a directory that cannot be synced (some network and FUSE file
    systems refuse) is warned of once a process, not raised as a write that failed: the caller
    would report lost what is written, and could do nothing better."""
    global _dir_sync_warned
    try:
        fsync_dir(path.parent)
    except OSError as exc:
        if not _dir_sync_warned:
            _dir_sync_warned = True
            print(f"warning: {path} is written, but its directory could not be synced "
                  f"({exc.strerror or exc}): a power loss before the system writes it back "
                  "may bring back the file's earlier version", file=sys.stderr)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (a file made, renamed or removed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def versions() -> dict[str, str]:
    found = {"shardrun": __version__, "python": sys.version.split()[0]}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def start_manifest(
    job: LoadedJob, run_dir: RunDir, base_url: str, argv: list[str],
    proxy: dict[str, str] | None = None, flags: list[str] | None = None,
    effective: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of a new run, written at once. `proxy`: the proxy's URL (no credentials)
    and the variable that named it, None for direct connections; `flags`: the pass's
    `carried_flags`, which the commands `report` and `export` print carry, as a resume
    entry's do; `effective`: the pass's values and sources (`runner.pass_effective`), else
    the job's."""
    effective = job.effective() if effective is None else effective
    job_sha, job_size = file_digest(job.job_path)
    manifest: dict[str, Any] = {
        "schema": MANIFEST_SCHEMA,
        "run_id": run_dir.run_id,
        "status": "running",
        "command": ["shardrun", *argv],
        "job": {"path": str(job.job_path), "sha256": job_sha, "bytes": job_size},
        "effective": effective,
        "input": input_at_start(job.input_path),
        "endpoint_url": masked_url(base_url),
        "proxy": proxy,
        "shards": effective["shards"]["value"],
        "carried_flags": flags or [],
        "versions": versions(),
        "host": {"name": socket.gethostname(), "platform": platform.platform(),
                 "cpus": os.cpu_count()},
        "started_at": iso(time.time()),
        "ended_at": None,
        "resumes": [],
    }
    write_json_atomic(run_dir.manifest_path, manifest)
    return manifest


def resume_manifest(
    job: LoadedJob, run_dir: RunDir, base_url: str, argv: list[str], pass_info: dict[str, Any],
    proxy: dict[str, str] | None = None, effective: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Record a resume pass in an existing manifest (status back to `running`); `effective` as
    `start_manifest`'s."""
    manifest = read_manifest(run_dir.path)
    job_sha, _ = file_digest(job.job_path)
    manifest.setdefault("resumes", []).append({
        **pass_info,
        "command": ["shardrun", *argv],
        "started_at": iso(time.time()),
        "ended_at": None,
        "job_path": str(job.job_path),
        "job_sha256": job_sha,
        "job_changed": job_sha != manifest.get("job", {}).get("sha256"),
        "effective": job.effective() if effective is None else effective,
        "input": input_at_start(job.input_path),
        "endpoint_url": masked_url(base_url),
        "proxy": proxy,
    })
    manifest["status"] = "running"
    manifest["ended_at"] = None
    write_json_atomic(run_dir.manifest_path, manifest)
    return manifest


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """A run's manifest, or a RunDirError saying in one sentence why there is none to read."""
    path = run_dir / "manifest.json"
    if not run_dir.is_dir():  # said as `verify` says it: a typo'd run id is the usual cause
        there = "it is a file" if run_dir.exists() else "nothing is there"
        if run_dir.name == "latest" and not run_dir.exists():  # `--resume latest`'s word
            there += (" (latest names a run for --resume only)"
                      f"{_which_run(run_dir.parent, of_parent=True)}")
        raise RunDirError(f"{run_dir} is not a run directory: {there}")
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise RunDirError(_no_manifest(run_dir)) from None
    except OSError as exc:
        raise RunDirError(f"{path} cannot be read: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise RunDirError(f"{path} is not valid JSON ({exc}); the run directory is "
                          "damaged") from None  # fmt: skip
    if not isinstance(data, dict):
        raise RunDirError(f"{path} is not a JSON object; the run directory is damaged")
    _check_schema(path, data.get("schema", MANIFEST_SCHEMA))  # none: a shardrun before it
    # What every reader walks: the wrong type there was a traceback in report and publish.
    for key, kind, what in (("files", list, "a list"), ("resumes", list, "a list"),
                            ("effective", dict, "an object")):
        if key in data and not isinstance(data[key], kind):
            raise RunDirError(f"{path}: {key} is not {what}; the manifest was edited or "
                              "damaged")
    return data


def _no_manifest(run_dir: Path) -> str:
    """Why a directory without manifest.json is no run to read, and what to do, in one sentence:
    a killed first pass's leftover is named so, as is a run its first pass is making now."""
    # Here, not at the top: resume reads this module's records, and its locks judge these.
    from shardrun.resume import never_begun, pass_lives, unbegun

    if never_begun(run_dir):
        return f"{unbegun(run_dir)}: remove it"
    made = STAGING.match(run_dir.name)
    if made and pass_lives(run_dir):
        run_id = made["run_id"]
        return (f"{run_dir} is not a run directory yet: a first pass is making it, and names it "
                f"{run_dir.parent / run_id} once made; name that run")
    return f"{run_dir} is not a run directory: it has no manifest.json{_which_run(run_dir)}"


def _check_schema(path: Path, schema: object) -> None:
    """Refuse a manifest of another schema than this shardrun writes: a newer one's may mean
    other things by the same keys, and a report read from it would be wrong, not refused."""
    if schema == MANIFEST_SCHEMA and type(schema) is int:
        return
    if type(schema) is int and schema > MANIFEST_SCHEMA:
        raise RunDirError(f"{path} has manifest schema {schema} and this shardrun "
                          f"({__version__}) reads schema {MANIFEST_SCHEMA}: a newer shardrun "
                          "wrote the run; upgrade shardrun to read it")
    raise RunDirError(f"{path} has manifest schema {ellipsize(repr(schema), 40)}, not "
                      f"{MANIFEST_SCHEMA}; the manifest was edited or damaged")


def _which_run(folder: Path, *, of_parent: bool = False) -> str:
    """For a folder given where a run directory was wanted: the run it is a folder of, or one
    of the runs it or its runs/ holds, as a clause ("it" the folder unless `of_parent`); else ''."""
    named = folder if folder.name not in ("", ".", "..") else folder.resolve()
    if named.name in ("results", "events", "dead", "logs") and (
            named.parent / "manifest.json").is_file():  # fmt: skip
        return f"; it is a folder of a run: name the run directory, {named.parent}"
    # The folder may be the runs directory, or, as often, the project's with the default one
    # in it (`shardrun report .` where the job was run).
    for runs in (folder, folder / "runs"):
        written: list[tuple[float, Path]] = []
        try:
            for child in itertools.islice(runs.iterdir(), 10_000):  # not a whole home directory
                with contextlib.suppress(OSError):
                    written.append(((child / "manifest.json").stat().st_mtime, child))
        except OSError:
            continue
        left = _left_in(runs)
        if written:
            holds = "it holds" if runs == folder and not of_parent else f"{runs}{os.sep} holds"
            return (f"; {holds} runs: name one, such as {max(written)[1]}, the one written last"
                    f"{left}")
        if left:
            return left
    return ""


def _left_in(runs: Path) -> str:
    """A clause naming the newest directory in `runs` a killed first pass left, or ''."""
    from shardrun.resume import leftovers, unbegun  # resume reads this module's records

    found = leftovers(runs)
    return f"; {unbegun(found[-1])}: remove it" if found else ""


def newest_pass(manifest: dict[str, Any]) -> dict[str, Any]:
    """The newest pass's record: its `resumes` entry, or the manifest for the first pass ({}
    where the entry is no object)."""
    resumes = manifest.get("resumes")
    record = resumes[-1] if isinstance(resumes, list) and resumes else manifest
    return record if isinstance(record, dict) else {}


def asked_otherwise(manifest: dict[str, Any]) -> str | None:
    """One sentence naming the passes that asked with answer-shaping settings other than the
    run's start (`answer_settings_changed` in their entries: the model, params...), or None.
    Their resumes warned once; `report` and `export` say it again to the reader of the answers,
    who may never have seen that warning and would take them all for one way of asking."""
    passes, keys = [], dict[str, None]()
    for k, entry in enumerate(manifest.get("resumes") or [], 1):
        changed = entry.get("answer_settings_changed") if isinstance(entry, dict) else None
        if isinstance(changed, list) and changed:
            passes.append(str(k))
            keys |= dict.fromkeys(str(key) for key in changed)
    if not passes:
        return None
    return (f"{'pass' if len(passes) == 1 else 'passes'} {in_words(passes)} of run "
            f"{manifest.get('run_id')} sent another {in_words(list(keys))} than pass 0 did, so "
            "its answers were not all asked the same way (each pass's `effective` in "
            "manifest.json says how)")


def newest_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """The summary the newest pass recorded, or {} when it recorded none (a pass killed before
    its end)."""
    summary = newest_pass(manifest).get("summary")
    return summary if isinstance(summary, dict) else {}


def input_read_whole(manifest: dict[str, Any], *, but_the_newest: bool = False,
                     more_after: Callable[[int], bool] | None = None) -> bool:
    """Whether a pass of the run (but its newest, with `but_the_newest`) read the input to its
    end and ended every item it read (a `retry-failed` pass passes over the items no pass has
    run, `left_out`; a stopped one leaves items `unfinished`). From then on `--resume` has
    nothing to run: what a later pass leaves are dead letters, for `retry-failed`.

    `more_after`: whether the input, as the pass asking sees it, holds more than blank lines
    past a number of bytes (`inputs.holds_more`). Lines appended since that earlier pass (a
    resume allows them, `resume.check_input`) are items no pass has run, so it counts only if
    nothing but blank lines lies past its `bytes_read` (one recorded without `bytes_read`
    counts, as before): a line break or blank lines added at the end hold no item."""
    records = [record for _, record in _passes(manifest)]
    for record in records[:-1] if but_the_newest else records:
        summary = record.get("summary") if isinstance(record, dict) else None
        if not isinstance(summary, dict) or summary.get("input_read") is not True:
            continue
        if summary.get("left_out") or summary.get("unfinished"):
            continue
        read = record.get("input") if isinstance(record, dict) else None
        got = read.get("bytes_read") if isinstance(read, dict) else None
        if more_after is None or not isinstance(got, int) or not more_after(got):
            return True
    return False


def newest_read_before(manifest: dict[str, Any]) -> bool:
    """Whether an earlier pass had read the whole input the newest pass saw
    (`input_read_whole`), as that pass judged it at its start and recorded in its entry
    (`input_read_before`; the first pass has no earlier one). An entry of an older shardrun
    lacks it: then as that shardrun judged it, by whether any earlier pass read the input to
    its end, however long the input is now."""
    newest = newest_pass(manifest)
    judged = newest.get("input_read_before")
    if isinstance(judged, bool):
        return judged
    return input_read_whole(manifest, but_the_newest=True)


def carried_flags(manifest: dict[str, Any]) -> list[str]:
    """The newest pass's flags for shards, concurrency and rate limits, as it recorded them
    for a later pass to take (`runner.carried_flags`); none for an entry of an older shardrun,
    which lacks them."""
    flags = newest_pass(manifest).get("carried_flags")
    if isinstance(flags, list) and all(isinstance(word, str) for word in flags):
        return flags
    return []


def retry_failed_command(run_path: Path, manifest: dict[str, Any], *more: str) -> str:
    """`shardrun retry-failed RUN_DIR` (then `more`) with the newest pass's `carried_flags`,
    as that pass's own way on and summary name it (`runner.retry_command`): what `report` and
    `export` print, so that a pasted retry keeps the pass's rate limits."""
    return shlex.join(["shardrun", "retry-failed", str(run_path), *more,
                       *carried_flags(manifest)])


def resume_command_of(run_path: Path, manifest: dict[str, Any], job: Path | None = None, *,
                      retry_failed: bool = False) -> str:
    """`shardrun JOB --resume RUN --runs-dir DIR` with the newest pass's `carried_flags`, built
    from the run directory as this command was given it and the job file the manifest names
    (resolved, or `job`): what `export` and `report`, run from anywhere, print for it. A run
    directory given as `.` or `..` (`report .` inside it) has no name of its own to take: it is
    made absolute first, so the command names the run id and its runs directory."""
    named = job or newest_job_path(manifest)
    if run_path.name in ("", ".."):
        run_path = run_path.resolve()
    words = ["shardrun", str(named or "JOB.yaml"), "--resume", run_path.name]
    if retry_failed:
        words.append("--retry-failed")
    return shlex.join([*words, "--runs-dir", str(run_path.parent), *carried_flags(manifest)])


_WAY_ON = re.compile(r"continue with `(shardrun [^`]*)`")


def restate_way_on(sentence: str, run_path: Path, manifest: dict[str, Any]) -> str:
    """A sentence the newest pass recorded (its stop), with the command of its way on
    (`runner.choose_way_on`) rebuilt as `report` names commands: the pass wrote the job file
    and runs directory as it was given them, relative to where it ran, which a command run
    elsewhere later cannot use. The resume or retry it named, with the same flags, from the
    run directory as this command was given it."""

    def rebuilt(match: re.Match[str]) -> str:
        try:
            words = shlex.split(match.group(1))
        except ValueError:
            return match.group(0)
        if words[1:2] == ["retry-failed"]:
            command = retry_failed_command(run_path, manifest)
        elif "--resume" in words:
            command = resume_command_of(run_path, manifest,
                                        retry_failed="--retry-failed" in words)
        else:
            return match.group(0)
        return f"continue with `{command}`"

    return _WAY_ON.sub(rebuilt, sentence)


def newest_job_path(manifest: dict[str, Any]) -> Path | None:
    """The job file the newest pass ran (a resume may name another file than the first pass),
    or None if the manifest names none."""
    resumes = manifest.get("resumes")
    for entry in reversed(resumes if isinstance(resumes, list) else []):
        if isinstance(entry, dict) and isinstance(entry.get("job_path"), str):
            return Path(entry["job_path"])
    job = manifest.get("job")
    path = job.get("path") if isinstance(job, dict) else None
    return Path(path) if isinstance(path, str) and path else None


def finish_manifest(
    manifest: dict[str, Any],
    run_dir: RunDir,
    status: str,
    reader: InputReader,
    summary: RunSummary | None,
    error: str | None = None,
    lines_judged: int | None = None,
) -> None:
    """Close the manifest: status, end time, input digest, summary, every file with its hash;
    for a pass that ended by an error instead of a summary, the error (`error`). Its lines read
    are those whose rejects are on record (`lines_judged`, when fewer than the reader read:
    `WorkSource.lines_judged`), the lines a resume takes as judged. Its bytes read still hold
    the line after them, read but not judged: how the file's end cut that line off is no
    judged record's (`run_on`), since the resume judges that line again, as it is then."""
    ended = iso(time.time())
    judged = reader.lines_read if lines_judged is None else min(lines_judged, reader.lines_read)
    record = manifest["resumes"][-1] if manifest.get("resumes") else manifest
    record["ended_at"] = manifest["ended_at"] = ended
    record["status"] = manifest["status"] = status
    if error is not None:
        record["error"] = error
    record["input"] = {
        "path": str(reader.path),
        "lines_read": judged,
        "bytes_read": reader.bytes_read,
        "sha256_of_bytes_read": reader.sha.hexdigest(),
        "open_end": reader.open_end if judged == reader.lines_read else None,
    }
    if summary is not None:
        record["summary"] = summary.as_dict()
    manifest["files"] = list_files(run_dir.path)
    write_json_atomic(run_dir.manifest_path, manifest)


def changed_results(manifest: dict[str, Any], run_path: Path) -> list[tuple[str, int, int | None]]:
    """(path, bytes listed, bytes now or None when gone) of every result file the manifest
    lists whose size is another now. Sizes only: hashing every result would read gigabytes."""
    changed = []
    for record in manifest.get("files") or []:
        if not isinstance(record, dict):
            continue
        path, listed = record.get("path"), record.get("bytes")
        if not (isinstance(path, str) and path.startswith("results/") and isinstance(listed, int)):
            continue
        try:
            size: int | None = (run_path / path).stat().st_size
        except OSError:
            size = None
        if size != listed:
            changed.append((path, listed, size))
    return changed


def listed_file(path: Path) -> bool:
    """Whether the manifest's list of a run's files names `path` (`list_files`): every file
    but the manifest itself, the locks and the temporary files of atomic writes."""
    skip = path.name in ("manifest.json", ".lock", ".pass.lock") or path.name.endswith(".tmp")
    return path.is_file() and not skip


def list_files(root: Path) -> list[dict[str, Any]]:
    """Every file of the run's own (`outpath.is_run_file`) with its SHA-256 and size: not a
    report or a sample written into the run directory, which a later report or publish
    rewrites and verify RUN_DIR would then take for tampering."""
    files = []
    for path in sorted(root.rglob("*")):
        if listed_file(path) and is_run_file(path.relative_to(root).as_posix()):
            sha, size = file_digest(path)
            files.append({"path": str(path.relative_to(root)), "sha256": sha, "bytes": size})
    return files

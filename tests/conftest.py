"""Shared helpers: write inputs and job files, run the real CLI in a subprocess, read a run."""

from __future__ import annotations

import compileall
import math
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest
import yaml

from shardrun import _chunks

# Fast simulator settings: the tests are about behaviour, not speed.
FAST_SIM = {"ttft_ms": 5, "itl_ms": 0.5, "tokens": "uniform:4:24", "seed": 3, "flush_ms": 5}
CLI_TIMEOUT_S = 240  # a hang guard, not a timing assertion
KILL_GUARD_S = 120.0  # how long a killed process tree may take to end: a hang guard


def pytest_configure(config: pytest.Config) -> None:
    """The tests' runs must hear the SIGINT the tests send them. A shell without job control
    starts a command put in the background (`pytest &`) with SIGINT ignored, the runs inherit
    that, and shardrun rightly keeps a SIGINT its caller chose to ignore: every Ctrl-C test
    would fail with exit 0 for no fault of the code. A handler of our own is reset to the
    default in each process the tests start."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not hasattr(config, "workerinput"):  # once, before any xdist worker starts
        _compile_shardrun()


def _compile_shardrun() -> None:
    """Byte-compile the package once for the thousands of processes the tests start (runs,
    shards, simulators). Under PYTHONDONTWRITEBYTECODE, as some CI machines set it, Python reads
    a .pyc but never writes one, so each of them compiled every module from source again: a
    fifth of the suite's time. Stale files are recompiled (a .pyc records its source's mtime);
    a tree it cannot write is left as it is."""
    compileall.compile_dir(Path(_chunks.__file__).parent, quiet=2)


def write_input(path: Path, n: int, *, prefix: str = "item") -> list[str]:
    """A JSONL input of `n` prompts; returns the ids in order."""
    ids = [f"{prefix}-{i:05d}" for i in range(n)]
    with open(path, "wb") as f:
        for i, item_id in enumerate(ids):
            f.write(orjson.dumps({"id": item_id, "prompt": f"Question {i}: say something."}))
            f.write(b"\n")
    return ids


def write_job(path: Path, **overrides: Any) -> Path:
    """A job file against sim:// with fast settings; `overrides` replace top-level sections."""
    job: dict[str, Any] = {
        "endpoint": {"base_url": "sim://", "api": "chat", "model": "sim-test", "sim": FAST_SIM},
        "input": {"path": "input.jsonl"},
        "params": {"max_tokens": 32},
        "shards": 2,
        "concurrency": 8,
    }
    job.update(overrides)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run `python -m shardrun ARGS` as a real process."""
    full_env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "shardrun", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@dataclass
class Killed:
    """What kill_tree found: the command lines of the processes below the killed one just
    before the kill, and of those of them still running `timeout` after it (then killed)."""

    below: list[list[str]]
    orphans: list[list[str]]


def _running(process: psutil.Process) -> bool:
    """A zombie has ended: whoever reaps an orphan (PID 1 here) may be slow at it or never."""
    try:
        return bool(process.is_running() and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def still_running(processes: list[psutil.Process], deadline: float) -> list[psutil.Process]:
    """Those of `processes` still running once they have all ended or `deadline` has come.
    Not psutil.wait_procs: it waits for a zombie nobody reaps as for a running process."""
    while any(map(_running, processes)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in processes if _running(p)]


def _command_line(process: psutil.Process) -> list[str]:
    try:
        return list(process.cmdline())
    except psutil.Error:  # it ended, or its command line cannot be read
        return [f"pid {process.pid}"]


def kill_tree(proc: subprocess.Popen[Any], *, group: bool = False,
              timeout: float = KILL_GUARD_S) -> Killed:
    """kill -9 of the process `proc` started (with `group`, of its process group: it must
    lead one, started with start_new_session or setsid), then wait for it and for every
    process below it as it was at the kill: a coordinator's shards and simulator, which are
    to end by themselves once it is gone, `timeout` at the most. Those still running then are
    the orphans: each is killed too and waited for, so that a test that finds some, or fails,
    leaves nothing behind; every wait is bounded. A `proc` already reaped is left alone (its
    PID may be another's by now): a test can call this again in a `finally`."""
    if proc.returncode is not None:
        return Killed([], [])
    below: list[psutil.Process] = []
    # Stopped, it starts no process while its tree is listed; unreaped, its PID is still its.
    # Whatever the listing raises (psutil.AccessDenied, a Ctrl-C), the kill follows the stop:
    # a process left stopped would never end, nor would the shards waiting on it.
    commands: list[list[str]] = []
    try:
        with suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGSTOP)
        with suppress(psutil.NoSuchProcess):
            below = psutil.Process(proc.pid).children(recursive=True)
        commands = [_command_line(p) for p in below]
    finally:
        with suppress(ProcessLookupError):
            (os.killpg if group else os.kill)(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    try:
        proc.wait(timeout=KILL_GUARD_S)
    finally:
        left = still_running(below, deadline)
        orphans = [_command_line(p) for p in left]
        for process in left:
            with suppress(psutil.NoSuchProcess):
                process.kill()  # psutil checks the start time: it signals no reused PID
        still_running(left, time.monotonic() + KILL_GUARD_S)
    return Killed(commands, orphans)


def end_run(proc: subprocess.Popen[Any]) -> None:
    """In a `finally` around a run a test started: a run still going (the test failed on the
    way) is killed at once with every process below it, and what is left in its pipes is read,
    so that nothing of it stays running or open. A run that ended is left as it is."""
    if proc.poll() is None:
        kill_tree(proc, timeout=0)
        proc.communicate(timeout=KILL_GUARD_S)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        return [orjson.loads(line) for line in f if line.strip()]


@dataclass
class Run:
    """The files of one finished run, parsed."""

    path: Path
    manifest: dict[str, Any]
    results: list[dict[str, Any]]
    dead: list[dict[str, Any]]
    events: list[dict[str, Any]]

    @classmethod
    def load(cls, path: Path) -> Run:
        def gather(sub: str) -> list[dict[str, Any]]:
            rows: list[dict[str, Any]] = []
            # Every live results and dead-letter file (a retry pass may add unretried-rK.jsonl);
            # the shards' event files only.
            pattern = "shard-*.jsonl" if sub == "events" else "*.jsonl"
            for file in sorted((path / sub).glob(pattern)):
                rows.extend(read_jsonl(file))
            return rows

        manifest = orjson.loads((path / "manifest.json").read_bytes())
        return cls(path, manifest, gather("results"), gather("dead"), gather("events"))


def busiest_second(run: Run) -> int:
    """The most requests the run's shards sent in one second (a window opening at a send),
    by their own log (attempt_start): the rate limit governs when a shard sends. A
    simulator's arrival times add its own delays, and under load one that lagged a
    twentieth of a second and caught up showed a request more than was sent."""
    sent = sorted(e["t"] for e in run.events if e["ev"] == "attempt_start")
    return max(sum(1 for t in sent[i:] if t < start + 1.0) for i, start in enumerate(sent))


def caught_up(run: Run, per_s: float) -> int:
    """Requests a rate limit of `per_s` may send at once after the loop woke late, by the worst
    event-loop lag the shards logged: pacing pays its debt by the clock, so requests due while
    a starved shard slept go together when it wakes (a busy 2-core machine once put 24 in a
    second of a 20/s limit, whose bound on time is 23)."""
    lag = max((e["lag"] for e in run.events if e["ev"] == "loop_lag"), default=0.0)
    return math.ceil(per_s * lag)


def free_port() -> int:
    """A loopback port nothing listens on (the OS chose it, and it was let go at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def null_device(path: Path) -> Path:
    """A character device with /dev/null's numbers made at `path`, for a test to write to. Only
    root may make one (CI often runs as another user): anyone else gets /dev/null itself, which
    they cannot replace, so a write that would replace the device fails there too."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        return Path("/dev/null")
    return path


def only_run(runs_dir: Path) -> Path:
    (run,) = [p for p in runs_dir.iterdir() if p.is_dir()]
    return run


_RESUME_WAY_ON = re.compile(r"continue with `(shardrun \S+ --resume [^`]*)`")


def error_lines(stderr: str, cwd: Path) -> list[str]:
    """The `error:` lines of a command run in `cwd`, each "continue with `shardrun JOB --resume
    RUN ...`" in them checked to name a run that exists there (in the `--runs-dir` it gives, or
    `runs`) and written as "continue with --resume" (plus " --retry-failed" if it has that
    flag), so that a test can spell the sentence without the run's id."""

    def plain(match: re.Match[str]) -> str:
        words = shlex.split(match.group(1))
        runs = words[words.index("--runs-dir") + 1] if "--runs-dir" in words else "runs"
        assert (cwd / runs / words[3] / "manifest.json").is_file(), words
        return "continue with --resume" + (" --retry-failed" if "--retry-failed" in words else "")

    return [_RESUME_WAY_ON.sub(plain, line) for line in stderr.splitlines()
            if line.startswith("error:")]


@dataclass
class PageServer:
    """tests/page_server.py as its own process: `served` is its request count once stopped."""

    base_url: str
    served: int = -1


@contextmanager
def page_server(*args: str) -> Iterator[PageServer]:
    """A server that answers every request with an HTML page (with `echo`, an error quoting
    the request's key); stopped by closing its stdin."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "page_server.py"), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        server = PageServer(f"http://127.0.0.1:{line.split()[-1]}/v1")
        yield server
    finally:
        proc.stdin.close()
        tail = proc.stdout.read().split()
        proc.wait(10)
    server.served = int(tail[-1])


@pytest.fixture(autouse=True, scope="session")
def _no_proxy_variables() -> Iterator[None]:
    """The tests talk to loopback servers directly: a developer's proxy variables would send
    their runs through the proxy (tests/test_proxy.py sets its own, per run)."""
    names = {f"{scheme}_proxy" for scheme in ("http", "https", "all", "no")}
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.lower() in names}
    yield
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="session")
def _no_terminal_variables() -> Iterator[None]:
    """The runs the tests start write to pipes and expect plain lines at argparse's and rich's
    default width: FORCE_COLOR or TTY_COMPATIBLE from a developer's shell or a CI service made
    them draw live displays (escape codes), and an exported COLUMNS rewrapped --help. Tests
    about those variables set them per run (tests/test_progress.py, tests/test_terminal.py)."""
    names = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "NO_COLOR", "COLUMNS", "LINES")
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    yield
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_secrets_of_other_tests() -> Iterator[None]:
    """`keep_secret` keeps what a test's client sends for the rest of the process: without this,
    a later test's message holding one of those words would show it as `***`."""
    saved = _chunks._secrets[:]
    yield
    _chunks._secrets[:] = saved


@pytest.fixture
def no_stray_children() -> Iterator[None]:
    """Fail a test that leaves child processes of this test process behind."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    leftover = [p for p in me.children(recursive=True) if p.pid not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftover, f"processes left running: {[p.cmdline() for p in leftover]}"

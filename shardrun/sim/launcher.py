"""Start the simulator as a separate process and learn its address.

A separate process, not a thread: the simulator must not share an event loop (or the GIL) with
the client it is measuring. It binds port 0 and prints its real address on one stdout line,
which `start_sim` waits for. Its stdin is a pipe held only by this process, so if the parent
dies without calling `stop`, the simulator sees EOF and exits instead of lingering.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from types import TracebackType
from typing import IO

from shardrun._ellipsis import ellipsize
from shardrun.errors import RunError
from shardrun.placement import exit_description
from shardrun.sim.config import SimConfig

_LISTENING = re.compile(r"shardrun sim listening on (http://\S+/v1)")


class SimProcess:
    """A running simulator process: its `base_url`, `pid`, and `stop()`."""

    def __init__(self, proc: subprocess.Popen[bytes], base_url: str, stderr: IO[bytes]) -> None:
        self._proc, self._stderr = proc, stderr
        self._final_tail = ""
        self.base_url = base_url

    @property
    def pid(self) -> int:
        """The simulator's process id (for CPU accounting or signals)."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """None while running, else the exit status as `subprocess` gives it (negative: a
        signal), without reaping the process: a reaped child's CPU time joins this process's
        RUSAGE_CHILDREN, which the run's summary reads as the client's CPU (`stop()` reaps it
        once the summary is made)."""
        try:
            info = os.waitid(os.P_PID, self._proc.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT)  # fmt: skip
        except ChildProcessError:  # reaped already
            return self._proc.poll()
        if info is None:
            return None
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        return -info.si_status if killed else info.si_status

    def stderr_tail(self, limit: int = 2000) -> str:
        """The last `limit` characters the simulator wrote to stderr (kept after `stop`)."""
        return self._final_tail[-limit:] if self._stderr.closed else _tail(self._stderr, limit)

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, wait up to `timeout` seconds, then SIGKILL; returns the exit status.

        Safe to call more than once. Closes the pipes and the stderr file, keeping its tail.
        """
        proc = self._proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        if not self._stderr.closed:
            self._final_tail = _tail(self._stderr, 2000)
            self._stderr.close()
        return proc.returncode

    def __enter__(self) -> SimProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.stop()


def _tail(f: IO[bytes], limit: int) -> str:
    """Last `limit` characters of a file we write through another process's descriptor."""
    size = os.fstat(f.fileno()).st_size
    f.seek(max(0, size - limit))
    return f.read().decode(errors="replace").strip()


def _read_line(fd: int, deadline: float) -> tuple[str, bool]:
    """Read until newline, EOF or deadline; returns (text so far, reached EOF)."""
    buf = b""
    while b"\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return buf.decode(errors="replace"), False
        ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                return buf.decode(errors="replace"), True
            buf += chunk
    return buf.decode(errors="replace"), False


def start_sim(cfg: SimConfig, host: str = "127.0.0.1", startup_timeout: float = 15.0, *,
              port: int = 0) -> SimProcess:
    """Spawn `python -m shardrun.sim` on `port` (0: a free one) and return once it listens.

    Raises RunError, with the tail of the simulator's stderr, if it exits or stays silent for
    `startup_timeout` seconds (the process is killed in that case).
    """
    argv = [sys.executable, "-m", "shardrun.sim", "--host", host, "--port", str(port),
            "--exit-on-stdin-eof", *cfg.to_args()]  # fmt: skip
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 -- owned by the returned SimProcess
    # Its own session: a stop signal sent to the run's process group (Ctrl-C, `timeout`) must
    # not take the server away from the in-flight requests the run lets finish. It ends when
    # told, or when its stdin closes with the process that started it.
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                            start_new_session=True)
    assert proc.stdout is not None
    line, eof = _read_line(proc.stdout.fileno(), time.monotonic() + startup_timeout)
    match = _LISTENING.search(line)
    if match:
        return SimProcess(proc, match.group(1), stderr)
    sim = SimProcess(proc, "", stderr)
    code = sim.stop(timeout=2.0)
    # Its last line says why (its own `error:` sentence, or an exception's last line): the
    # lines above it are no part of a sentence (a traceback, of a simulator stopped by Ctrl-C
    # or a signal sent to it while it imports).
    last = [line for line in sim.stderr_tail().splitlines() if line.strip()][-1:]
    tail = ellipsize(last[0].strip(), 300) if last else "(nothing)"
    if eof:
        ended = exit_description(code)
        why = f"{ended if code >= 0 else 'was ' + ended} before listening"
    elif line:
        why = f"printed {line.strip()!r} instead of its listening address"
    else:
        why = f"did not report a listening address within {startup_timeout:g} s"
    raise RunError(f"the simulator {why}; its stderr ends with: {tail}")

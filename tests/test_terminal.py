"""shardrun on a real terminal: a pseudo-terminal is its stdin, stdout and stderr.

The process is the leader of its own session with the pty as its controlling terminal, as in a
shell, so the live view must draw with rich (not print plain lines), and Ctrl-C typed at the
terminal reaches the coordinator, the shard launcher, the shards and the simulator at once (the
whole foreground process group), which is the case the shards' and launcher's SIGINT handling
exists for.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import FAST_SIM, only_run, read_jsonl, write_input, write_job

GUARD_S = 120.0  # hang guard only; nothing asserts on time
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")

pytestmark = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")


class Terminal:
    """`python -m shardrun ARGS` on a pty; collects everything it draws."""

    def __init__(self, cwd: Path, *args: str) -> None:
        master, slave = pty.openpty()
        # A wide terminal, so rich lays the shard table out in full.
        fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x00\x32\x00\xa0\x00\x00\x00\x00")
        env = {k: v for k, v in os.environ.items()
               if not k.upper().startswith("SHARDRUN_")
               and k not in ("TTY_COMPATIBLE", "FORCE_COLOR", "NO_COLOR", "TERM")}
        env["TERM"] = "xterm-256color"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardrun", *args], cwd=cwd, env=env,
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.master = master
        self.screen = bytearray()

    def read_until(self, pattern: bytes, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if pattern in self.screen:
                return True
            if not self._read(0.2):
                return pattern in self.screen
        return False

    def _read(self, wait: float) -> bool:
        """Read what is there; False once the terminal is closed on the other side."""
        ready, _, _ = select.select([self.master], [], [], wait)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError as exc:  # EIO: every process holding the slave has exited
            if exc.errno == errno.EIO:
                return False
            raise
        self.screen += data
        return bool(data)

    def finish(self) -> int:
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline and self._read(0.2):
            pass
        code = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        os.close(self.master)
        return code


def _job(tmp_path: Path, n: int, sim: dict[str, object]) -> list[str]:
    ids = write_input(tmp_path / "input.jsonl", n)
    write_job(tmp_path / "job.yaml", shards=2, concurrency=8,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim})
    return ids


def test_live_view_draws_on_a_terminal_and_the_summary_follows(tmp_path: Path) -> None:
    ids = _job(tmp_path, 1500, {**FAST_SIM, "ttft_ms": 20})
    term = Terminal(tmp_path, "job.yaml", "--runs-dir", "runs")
    assert term.finish() == 0, term.screen.decode(errors="replace")
    screen = bytes(term.screen)
    assert ANSI.search(screen), "no escape sequences: the view did not draw with rich"
    text = ANSI.sub(b"", screen).decode(errors="replace")
    assert "run succeeded" in text
    assert f"{len(ids):,}/{len(ids):,}" in text  # the last frame: every item done
    assert not re.search(r"\[\s*\d+\.\ds\] ", text), "plain progress lines on a terminal"
    assert "Traceback" not in text


def test_ctrl_c_at_the_terminal_stops_gracefully_and_resume_finishes(tmp_path: Path) -> None:
    """^C reaches the whole process group: in-flight work finishes, exit 130, nothing lost."""
    # Enough items that the ^C at 200 results leaves most unstarted, for --resume to do.
    ids = _job(tmp_path, 800, {**FAST_SIM, "ttft_ms": 40, "itl_ms": 2})
    term = Terminal(tmp_path, "job.yaml", "--runs-dir", "runs")
    deadline = time.monotonic() + GUARD_S
    results = tmp_path / "runs"
    while time.monotonic() < deadline:  # wait until work is under way
        term.read_until(b"\x00", time.monotonic() + 0.2)  # just drain the screen
        if sum(p.read_bytes().count(b"\n") for p in results.glob("*/results/*.jsonl")) >= 200:
            break
    os.write(term.master, b"\x03")  # what the terminal sends for Ctrl-C
    code = term.finish()
    text = ANSI.sub(b"", bytes(term.screen)).decode(errors="replace")
    assert code == 130, text
    assert "Traceback" not in text
    assert "died" not in text  # every shard (and the launcher) outlived the ^C and finished
    run = only_run(results)
    assert "Traceback" not in (run / "logs" / "launcher.log").read_text()
    done = [r["id"] for p in sorted((run / "results").glob("*.jsonl")) for r in read_jsonl(p)]
    assert 0 < len(done) < len(ids) and len(done) == len(set(done))

    resumed = subprocess.run(
        [sys.executable, "-m", "shardrun", "job.yaml", "--runs-dir", "runs", "--resume",
         "latest"], cwd=tmp_path, capture_output=True, text=True, timeout=GUARD_S,
        stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")})
    assert resumed.returncode == 0, resumed.stderr
    every = [r["id"] for p in sorted((run / "results").glob("*.jsonl")) for r in read_jsonl(p)]
    assert sorted(every) == sorted(ids)

"""Shared by the benchmark scripts: wait for a `shardrun sim` process to print its address."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time


def wait_for_base_url(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> str:
    """The simulator's `http://127.0.0.1:PORT/v1` from its first stdout line.

    Raises SystemExit (the caller stops the process) when it prints nothing usable within
    `timeout_s` or listens anywhere but on loopback: benchmarks send traffic to loopback only.
    """
    assert proc.stdout is not None
    line, deadline = b"", time.monotonic() + timeout_s
    while b"\n" not in line and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            line += chunk
    text = line.decode(errors="replace")
    if "listening on " not in text:
        raise SystemExit(f"simulator did not start: {text!r}")
    base_url = text.split("listening on ", 1)[1].split()[0]
    if not base_url.startswith("http://127.0.0.1:"):
        raise SystemExit(f"simulator is not on loopback: {base_url}")
    return base_url


def stop_sim(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the simulator we started (by PID), SIGKILL after 10 s; close its pipes."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()

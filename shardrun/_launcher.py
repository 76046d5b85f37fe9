"""Process entry of the shard launcher: import a shard's code once, then fork every shard from it.

    python -m shardrun._launcher INDEX:STDIN_FD:STDOUT_FD:STDERR_FD ...

Why: a shard's imports (aiohttp, uvloop, structlog, orjson and shardrun's own modules) cost
about 0.4 CPU-s per process, and eight shards starting at once on two cores spend more than a
second of wall time on nothing but imports. Forked children share the imported modules, so a
run pays for them once (docs/PERFORMANCE.md, "Start-up").

The coordinator creates each shard's pipes and passes their child ends as inherited descriptors;
a forked shard moves them onto its fds 0, 1 and 2, closes every other passed descriptor (a stray
copy of another shard's stdout would hide that shard's end from the coordinator) and runs
`_shard_main.main()`, exactly what a spawned shard runs. Forking happens here, in a process with
one thread and no event loop, never in the coordinator.

On stdout the launcher reports, one line each, `pid INDEX PID` after a fork and `exit INDEX CODE`
when it reaps a shard (CODE as `subprocess` gives it: negative for a signal), then exits when no
shard is left. It ignores SIGINT like the shards do: the coordinator decides how they stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from shardrun import _import_structlog_without_rich


@dataclass(frozen=True)
class Slot:
    """One shard to fork: its index and the descriptors that become its stdin, stdout, stderr."""

    index: int
    stdin: int
    stdout: int
    stderr: int

    @classmethod
    def parse(cls, arg: str) -> Slot:
        index, stdin, stdout, stderr = (int(part) for part in arg.split(":"))
        return cls(index, stdin, stdout, stderr)

    def arg(self) -> str:
        return f"{self.index}:{self.stdin}:{self.stdout}:{self.stderr}"

    def fds(self) -> tuple[int, int, int]:
        return self.stdin, self.stdout, self.stderr


def _report(line: str) -> None:
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        pass  # the coordinator is gone; its shards see EOF and stop by themselves


def _run_child(slot: Slot, passed: set[int], shard_main: Callable[[], int]) -> int:
    os.dup2(slot.stdin, 0)
    os.dup2(slot.stdout, 1)
    os.dup2(slot.stderr, 2)
    for fd in passed - {0, 1, 2}:
        os.close(fd)
    return shard_main()


def _fork(slot: Slot, passed: set[int], shard_main: Callable[[], int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _run_child(slot, passed, shard_main)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # never unwind into the launcher's own code


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Imported here, not at the top: the coordinator imports this module for `Slot` alone and
    # must not load a shard's libraries. Before anything imports the event log: a shard never
    # needs rich (see the function).
    _import_structlog_without_rich()
    from shardrun import _shard_main  # the whole shard: what the children share

    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401  (`_shard_main.run_loop` imports it on first use)

    slots = [Slot.parse(arg) for arg in argv]
    passed = {fd for slot in slots for fd in slot.fds()}
    children: dict[int, int] = {}
    for slot in slots:
        try:
            pid = _fork(slot, passed, _shard_main.main)
        except OSError as exc:  # the coordinator spawns this shard instead
            print(f"launcher: could not fork shard {slot.index}: {exc}", file=sys.stderr)
            _report(f"fail {slot.index} {exc}")
            continue
        children[pid] = slot.index
        _report(f"pid {slot.index} {pid}")
    for fd in passed:
        os.close(fd)  # from now on only the shards hold their ends
    while children:
        pid, status = os.wait()
        index = children.pop(pid, None)
        if index is not None:
            _report(f"exit {index} {os.waitstatus_to_exitcode(status)}")
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stderr.flush()  # stdout is flushed after every report
    # No interpreter teardown: freeing aiohttp's modules object by object costs about 0.02
    # CPU-s, billed to every run's client CPU, for memory the OS frees at once.
    os._exit(status)

"""The shard launcher: import a shard's code once, then fork every shard of the run from it.

Why: a shard's imports (aiohttp, uvloop, structlog, orjson and shardrun's own modules) cost
about 0.2 CPU-s per process, and eight shards starting at once on two cores spend more than a
second of wall time on nothing but imports. Forked children share the imported modules, so a
run pays for them once (docs/PERFORMANCE.md, "Start-up").

The launcher is itself a fork of the coordinator, made before the coordinator's event loop
starts (`launch.fork_launcher`), so it starts with everything the coordinator had already
imported (asyncio, structlog, orjson and a good part of shardrun) and adds only the client's
libraries. Where that fork is not safe (the process runs other threads, or a loop is already
running) the coordinator starts `python -m shardrun._launcher INDEX:STDIN:STDOUT:STDERR ...`
instead; both run `serve`.

The coordinator creates each shard's pipes; a slot names a shard's three descriptors as the
launcher holds them. A forked shard moves them onto its fds 0, 1 and 2, closes every other
slot's descriptors (a stray copy of another shard's stdout would hide that shard's end from the
coordinator) and runs `_shard_main.main()`, exactly what a spawned shard runs. Forking happens
in a process with one thread and no event loop, never in a running coordinator.

On fd 1 the launcher reports, one line each, `pid INDEX PID` after a fork, `fail INDEX REASON`
when a fork failed, and `exit INDEX CODE` when it reaps a shard (CODE as `subprocess` gives it:
negative for a signal), then exits when no shard is left. It ignores SIGINT and SIGTERM like
the shards do: the coordinator decides how they stop.
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
from shardrun._tls import ca_store_deferred

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
"""What a terminal's Ctrl-C or hang-up, `timeout`, `kill -TERM -PGID` or systemd send the whole
process group. Only the coordinator heeds them; it stops the shards gracefully (`stop`, then
`abort`)."""


def leave_stop_signals_to_the_coordinator() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    # A spawned shard or launcher starts with them blocked (`placement.spawn_holding_stop_signals`):
    # ignored now, any that came meanwhile is dropped, and they may be let through.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


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
    # os.write on fd 1, not sys.stdout: in a launcher forked from the coordinator, sys.stdout
    # may be anything the coordinator's caller put there.
    with contextlib.suppress(BrokenPipeError):  # the coordinator is gone: its shards see EOF
        os.write(1, (line + "\n").encode())


def import_shard(*, tls: bool) -> Callable[[], int]:
    """Import everything a shard runs, once, and return its entry point.

    Without `tls` (the endpoint is plain http), aiohttp's CA store is not loaded.
    """
    # Before anything imports the event log: a shard never needs rich (see the function).
    _import_structlog_without_rich()
    with contextlib.nullcontext() if tls else ca_store_deferred():
        from shardrun import _shard_main  # the whole shard: what the children share

        with contextlib.suppress(ImportError):
            import uvloop  # noqa: F401  (`_shard_main.run_loop` imports it on first use)
    # `socket.getaddrinfo` encodes the host name with the idna codec, which Python imports on
    # first use: once here rather than once in every shard.
    import encodings.idna  # noqa: F401
    return _shard_main.main


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


def serve(slots: list[Slot], *, tls: bool = True) -> int:
    """Fork a shard per slot, report each one, and reap them all; the launcher's whole life."""
    leave_stop_signals_to_the_coordinator()
    shard_main = import_shard(tls=tls)
    passed = {fd for slot in slots for fd in slot.fds()}
    children: dict[int, int] = {}
    for slot in slots:
        try:
            pid = _fork(slot, passed, shard_main)
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


def main(argv: list[str]) -> int:
    return serve([Slot.parse(arg) for arg in argv])


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stderr.flush()
    # No interpreter teardown: freeing aiohttp's modules object by object costs about 0.02
    # CPU-s, billed to every run's client CPU, for memory the OS frees at once.
    os._exit(status)

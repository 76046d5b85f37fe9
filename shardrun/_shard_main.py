"""Process entry of a shard: `python -m shardrun._shard_main`, driven over stdin/stdout.

Only the loop start and the pipe plumbing live here; the work is `shard.run_shard()`.
SIGINT and SIGTERM are ignored because Ctrl-C in a terminal (and `timeout`, systemd, a kill of
the process group) reaches the whole process group, and the coordinator decides how a shard
stops (it sends `stop`, then `abort`). When the coordinator dies, stdin reaches EOF and the
shard stops by itself, so a killed coordinator leaves no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import traceback
from collections.abc import Coroutine
from typing import Any, TypeVar

from shardrun import _import_structlog_without_rich

# Before anything imports the event log: a shard never needs rich (see the function).
_import_structlog_without_rich()

from shardrun import protocol  # noqa: E402
from shardrun._chunks import masked  # noqa: E402
from shardrun._launcher import leave_stop_signals_to_the_coordinator  # noqa: E402
from shardrun._title import set_title, shard_title  # noqa: E402
from shardrun.shard import ShardConfig, run_shard  # noqa: E402

T = TypeVar("T")

STDIN_LIMIT = 1 << 30  # a batch of long prompts is one line


async def _main() -> int:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=STDIN_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, sys.stdout.buffer)

    def send(message: protocol.Message) -> None:
        if not transport.is_closing():
            transport.write(protocol.encode(message))

    async def receive() -> protocol.Message | None:
        line = await reader.readline()
        return protocol.decode(line) if line else None

    first = await receive()
    if first is None or first["t"] != protocol.CONFIG:
        print("shard: expected a config message first", file=sys.stderr)
        return 2
    config = ShardConfig.from_message(first)
    # The run directory's name, as the launcher's title has it (a renamed run logs its own id).
    set_title(shard_title(config.shard, os.path.basename(config.out_dir.rstrip('/'))))
    await run_shard(config, receive, send)
    # Let the transport drain the final `done` message before the process exits.
    while transport.get_write_buffer_size():
        await asyncio.sleep(0.01)
    return 0


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop where it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def main() -> int:
    leave_stop_signals_to_the_coordinator()
    try:
        return run_loop(_main())
    except Exception:
        # The coordinator reports the shard's death and points at this log; the message may
        # quote a server's text, and so a credential.
        sys.stderr.write(masked(traceback.format_exc()))
        return 1


if __name__ == "__main__":
    status = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # the coordinator may be gone
            stream.flush()
    os._exit(status)  # no teardown, like a forked shard (see `_launcher.py`)

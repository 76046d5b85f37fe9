"""A loopback TCP relay whose listener outlives the server behind it, run as its own process:

    python tests/kept_listener.py UPSTREAM_PORT

It listens on a free loopback port and prints `listening on PORT`. Each connection it accepts
waits (up to 30 s) until the upstream port accepts one, then bytes go both ways; when either
side ends, both are cut. That is a server restarted behind a socket it does not own: systemd's
socket activation, a master process holding the socket, a balancer retrying its connects.
Connecting to it never fails while the server is away, and a request sent then is answered
by whatever server comes back (its model list included) before any request that was refused.

It exits when its standard input closes, so a test that dies leaves nothing running.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

from forward_proxy import relay  # run as a script: its own directory is on the path

WAIT_S = 30.0
RETRY_S = 0.05


async def _serve(upstream: int, client_r: asyncio.StreamReader,
                 client_w: asyncio.StreamWriter) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + WAIT_S
    while True:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream)
            break
        except OSError:
            if loop.time() > give_up:
                client_w.transport.abort()
                return
            await asyncio.sleep(RETRY_S)
    await relay_both(client_r, client_w, up_r, up_w)


async def relay_both(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter,
                     up_r: asyncio.StreamReader, up_w: asyncio.StreamWriter) -> None:
    """Bytes both ways until either side ends; then both are cut."""
    both = {asyncio.create_task(relay(client_r, up_w)),
            asyncio.create_task(relay(up_r, client_w))}
    await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
    for task in both:
        task.cancel()
    client_w.transport.abort()
    up_w.transport.abort()


async def listen_until_stdin_closes(
        serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> None:
    """Listen on a free loopback port, say which (`listening on PORT`), and serve each
    connection with `serve` until standard input closes."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    loop = asyncio.get_running_loop()
    stdin_closed = loop.run_in_executor(None, sys.stdin.read)
    async with server:
        await stdin_closed


if __name__ == "__main__":
    port = int(sys.argv[1])
    asyncio.run(listen_until_stdin_closes(lambda r, w: _serve(port, r, w)))

"""A loopback gateway that answers GET of the model list itself and relays every other request
to a server behind it, run as its own process:

    python tests/models_gateway.py UPSTREAM_PORT reset|502

It listens on a free loopback port and prints `listening on PORT`. A connection whose first
request is a GET of a path ending in `/models` gets a model list of the gateway's own, whether
the server behind is up or not (a gateway or balancer that serves the list from its config).
Any other connection is relayed to the upstream port, bytes both ways until either side ends;
when the upstream refuses the connection (the server is down, restarting), the gateway resets
the client's connection before any answer (`reset`) or answers 502 (`502`). Each refused
request prints `refused`, each list answered `models`, flushed, for the test to follow.

It exits when its standard input closes, so a test that dies leaves nothing running.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

from kept_listener import listen_until_stdin_closes, relay_both  # its directory is on the path

MODELS = b'{"object":"list","data":[{"id":"m","object":"model","owned_by":"gateway"}]}'
BAD_GATEWAY = b'{"error":{"message":"no server behind the gateway","type":"bad_gateway"}}'


def _answer(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Drop the connection with a TCP RST: the client sees ECONNRESET, no answer."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _serve(upstream: int, mode: str, client_r: asyncio.StreamReader,
                 client_w: asyncio.StreamWriter) -> None:
    try:
        head = await client_r.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        client_w.transport.abort()
        return
    method, target = head.split(b" ", 2)[:2]
    if method == b"GET" and target.rstrip(b"/").endswith(b"/models"):
        print("models", flush=True)
        client_w.write(_answer(b"200 OK", MODELS))
        await client_w.drain()
        client_w.close()
        return
    try:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream)
    except OSError:
        print("refused", flush=True)
        if mode == "502":
            client_w.write(_answer(b"502 Bad Gateway", BAD_GATEWAY))
            await client_w.drain()
            client_w.close()
        else:
            _reset(client_w)
        return
    up_w.write(head)
    await relay_both(client_r, client_w, up_r, up_w)


if __name__ == "__main__":
    port, how = int(sys.argv[1]), sys.argv[2]
    asyncio.run(listen_until_stdin_closes(lambda r, w: _serve(port, how, r, w)))

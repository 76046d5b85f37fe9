"""A loopback HTTP/1.1 server, written by hand, that kills its kept-alive connections as real
fronts do, run as its own process:

    python tests/keepalive_server.py fin|rst|late|over|short|header PER_CONN

It listens on a free loopback port and prints `listening on PORT`. Each connection answers
PER_CONN chat requests with a whole stream (Content-Length, keep-alive, no `Connection: close`),
then, when the next request arrives on it, reads that request and, answering nothing, closes the
connection (`fin`: nginx's keepalive_timeout or keepalive_requests racing a request sent on an
idle connection) or resets it (`rst`: a balancer that dropped the idle connection and resets it
when used); `late` works on that request for a second first, then closes it (a server that
crashed under the request). `over` and `short` answer that request with a whole JSON answer
(no stream) whose body does not match its Content-Length: `over` sends 8 bytes past it in the
same packet (`leftover`), then closes; `short` sends 8 bytes less, then closes; `header`
sends one of the right length with a malformed header (a space in its name). A GET (the
model list) is answered 200 at any time. Every request read counts, as `served` or as
`killed`; a line `GET /counts` answers them as JSON.

It exits when its standard input closes, so a test that dies leaves nothing running.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

from kept_listener import listen_until_stdin_closes  # run as a script: its own directory is on

ANSWER = (b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'
          b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
          b'"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
          b"data: [DONE]\n\n")
WHOLE = (b'{"choices":[{"index":0,"message":{"role":"assistant","content":"a"},'
         b'"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}')
COUNTS = {"served": 0, "killed": 0}


async def _request(reader: asyncio.StreamReader) -> bytes:
    """Read one request; its request line."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return head.split(b"\r\n", 1)[0]


def _reply(writer: asyncio.StreamWriter, ctype: bytes, body: bytes) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype
                 + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def _mislabelled(writer: asyncio.StreamWriter, extra: int, bad_header: bool = False) -> None:
    """A whole answer whose body is `extra` bytes longer than its Content-Length says (shorter
    where negative), written at once: a body past its length arrives in the same packet.
    `bad_header`: with a header whose name has a space in it."""
    body = WHOLE + b"leftover"[:max(extra, 0)]
    bad = b"Bad Header: x\r\n" if bad_header else b""
    writer.write(b"HTTP/1.1 200 OK\r\n" + bad + b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (len(WHOLE) - min(extra, 0)) + body)


async def _serve(kill: str, per_conn: int, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
    served = 0
    try:
        while True:
            line = await _request(reader)
            if line.startswith(b"GET /counts"):
                _reply(writer, b"application/json", str(COUNTS).replace("'", '"').encode())
            elif line.startswith(b"GET "):
                _reply(writer, b"application/json", b'{"object":"list","data":[]}')
            elif served < per_conn:
                served += 1
                COUNTS["served"] += 1
                _reply(writer, b"text/event-stream", ANSWER)
            else:
                COUNTS["killed"] += 1
                if kill in ("over", "short", "header"):
                    _mislabelled(writer, {"over": 8, "short": -8}.get(kill, 0), kill == "header")
                    await writer.drain()
                if kill == "late":
                    await asyncio.sleep(1.0)
                if kill == "rst":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.close()
                return
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        writer.transport.abort()


if __name__ == "__main__":
    mode, count = sys.argv[1], int(sys.argv[2])
    asyncio.run(listen_until_stdin_closes(lambda r, w: _serve(mode, count, r, w)))

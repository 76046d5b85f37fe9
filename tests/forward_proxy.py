"""A small HTTP forward proxy for the tests, run as its own process:

    python tests/forward_proxy.py LOG [--upstream HOST:PORT] [--require AUTH] [--tls PEM]

It listens on a free loopback port and prints `listening on PORT`. Per client connection it
reads the first request head and appends one JSON line to LOG: method, target, the
Proxy-Authorization header and all of the head's headers. With `--require`, a head whose
Proxy-Authorization is not exactly AUTH gets a 407 and the connection closes. Otherwise it
connects to the target the head names (host:port for CONNECT, the absolute URL's host and port
for plain HTTP), or to `--upstream` whatever the head names, and relays bytes both ways until
either side closes. A CONNECT is answered with 200 first; a plain-HTTP head is passed on as it
came, and so are later requests on the same connection (an HTTP/1.1 server must accept
absolute-form targets).

`--tls PEM` (a key and certificate chain) makes it the far end of every CONNECT tunnel itself:
it answers the TLS handshake, logs the first request head inside the tunnel (method `tunnel`:
its target and any Proxy-Authorization, which must never be there) and relays the decrypted
bytes to the upstream. That stands in for an https endpoint behind a proxy.

Loopback only; it exits when its standard input closes, so a test that dies leaves nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from urllib.parse import urlsplit

DENIED = (b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic\r\n"
          b"Content-Length: 0\r\nConnection: close\r\n\r\n")


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def read_head(args: argparse.Namespace, reader: asyncio.StreamReader,
                    as_method: str | None = None) -> tuple[bytes, str, str, str | None] | None:
    """The next request head, logged: (head, method, target, Proxy-Authorization)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    fields = [line.split(": ", 1) for line in lines[1:] if ": " in line]
    auth = next((value for name, value in fields if name.lower() == "proxy-authorization"), None)
    with open(args.log, "a") as log:
        log.write(json.dumps({"method": as_method or method, "target": target, "auth": auth,
                              "headers": dict(fields)}) + "\n")
    return head, method, target, auth


async def serve(args: argparse.Namespace, reader: asyncio.StreamReader,
                writer: asyncio.StreamWriter) -> None:
    first = await read_head(args, reader)
    if first is None:
        writer.close()
        return
    head, method, target, auth = first
    if args.require is not None and auth != args.require:
        writer.write(DENIED)
        await writer.drain()
        writer.close()
        return
    if args.upstream:
        host, port = args.upstream.rsplit(":", 1)
    elif method == "CONNECT":
        host, port = target.rsplit(":", 1)
    else:
        parts = urlsplit(target)
        host, port = parts.hostname or "", str(parts.port or 80)
    try:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
    except OSError:
        writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        writer.close()
        return
    if method == "CONNECT":
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if args.tls:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(args.tls)
            await writer.start_tls(context)
            inner = await read_head(args, reader, "tunnel")
            if inner is None:
                writer.close()
                up_writer.close()
                return
            up_writer.write(inner[0])
    else:
        up_writer.write(head)
    await asyncio.gather(relay(reader, up_writer), relay(up_reader, writer))


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("log")
    p.add_argument("--upstream")
    p.add_argument("--require")
    p.add_argument("--tls")
    args = p.parse_args()
    server = await asyncio.start_server(lambda r, w: serve(args, r, w), "127.0.0.1", 0)
    print(f"listening on {server.sockets[0].getsockname()[1]}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    server.close()


if __name__ == "__main__":
    asyncio.run(main())

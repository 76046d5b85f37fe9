"""A web server that is no OpenAI-compatible endpoint, for the tests, run as its own process:

    python tests/page_server.py [echo]

It listens on a free loopback port, prints `listening on PORT`, and answers every request with
200 and a small HTML page, as a login page, a proxy's notice or a web app at a wrong
`base_url` does; with `echo`, with 400 and an error that quotes the request's credentials
back ("Incorrect API key provided: ..."), as some servers do. It counts the requests and
prints the count when its standard input closes, then exits, so a test that dies leaves
nothing behind.
"""

from __future__ import annotations

import asyncio
import sys

from aiohttp import web

ECHO = sys.argv[1:] == ["echo"]
PAGE = "<html><body><h1>Sign in</h1><p>This page needs a login.</p></body></html>"


async def main() -> None:
    served = 0

    async def page(request: web.Request) -> web.Response:
        nonlocal served
        served += 1
        await request.read()
        if ECHO:
            said = f"Incorrect API key provided: {request.headers.get('Authorization')}"
            return web.json_response({"error": {"message": said}}, status=400)
        return web.Response(text=PAGE, content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"listening on {port}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    await runner.cleanup()
    print(f"served {served}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

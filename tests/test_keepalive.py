"""Kept-alive connections a real front kills under a request (tests/keepalive_server.py, its own
process, over loopback): a pooled connection that dies before any answer costs the item nothing,
the request goes again on a new one; a new connection that dies so is a failure as before."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest
from aiohttp import http_parser

from shardrun.client import AttemptOutcome, StreamingClient, make_session
from shardrun.clock import Clock
from tests.conftest import Run, only_run, run_cli, write_input, write_job
from tests.keepalive_server import WHOLE
from tests.test_client import FAST, run

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@contextmanager
def front(kill: str, per_conn: int) -> Iterator[str]:
    """The server's base URL while it runs."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("keepalive_server.py")),
                             kill, str(per_conn)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().removeprefix("listening on "))
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)


def counts(base: str) -> dict[str, int]:
    """The requests the server answered (`served`) and those it killed the connection under."""
    with urllib.request.urlopen(base.removesuffix("/v1") + "/counts", timeout=10) as resp:
        got: dict[str, int] = orjson.loads(resp.read())
    return got


async def _attempts(base: str, cap: int, together: int, after: int) -> list[AttemptOutcome]:
    """`together` attempts at once, then `after` one by one, on one session of `cap`."""
    session = make_session(cap, FAST)
    try:
        client = StreamingClient(session, base, "chat", {}, FAST, Clock())
        outs = list(await asyncio.gather(*(client.attempt(CHAT) for _ in range(together))))
        for _ in range(after):
            outs.append(await client.attempt(CHAT))
        return outs
    finally:
        await session.close()


@pytest.mark.parametrize("kill", ["fin", "rst"])
def test_a_pooled_connection_killed_under_the_request_is_replaced_within_the_attempt(
        kill: str) -> None:
    """Each connection answers one request; the next request sent on it meets a close (or a
    reset) and no answer. Each attempt after the first takes the pooled connection, finds it
    dead, and sends again on a new one: every attempt ends ok, on a new connection, and the
    server saw each request it killed once, which the attempt counts as sent again. It was
    conn_reset (reused), an attempt charged."""
    with front(kill, 1) as base:
        outs = run(_attempts(base, cap=1, together=1, after=3))
        seen = counts(base)
    assert [(o.status, o.conn_reused, o.text) for o in outs] == [("ok", False, "a")] * 4
    assert [o.resent for o in outs] == [0, 1, 1, 1]
    assert seen == {"served": 4, "killed": 3}


def test_a_pooled_connection_that_dies_while_the_server_works_is_a_failure() -> None:
    """A pooled connection that dies a second after the request went out died under a server
    that had the request (a crash): the attempt is conn_reset, and the request was not sent
    again unseen (it went once per pooled connection, each worked on by the server), so it
    counts none sent again."""
    with front("late", 1) as base:
        first, second = run(_attempts(base, cap=1, together=1, after=1))
        seen = counts(base)
    assert (first.status, second.status, second.conn_reused) == ("ok", "conn_reset", True)
    assert (first.resent, second.resent) == (0, 0)
    assert seen == {"served": 1, "killed": 1}


@pytest.mark.skipif(http_parser.HttpResponseParser is http_parser.HttpResponseParserPy,
                    reason="aiohttp's Python parser leaves the bytes past the body unread")
def test_a_body_past_its_content_length_is_named() -> None:
    """A whole answer (no stream) whose body runs 8 bytes past its Content-Length, in the same
    packet: aiohttp reads those bytes as the next answer's status line and drops the answer.
    The failure says the body ran past its length and shows the bytes; it said "invalid HTTP
    response: Bad status line" with the answer's text in it."""
    with front("over", 0) as base:
        (out,) = run(_attempts(base, cap=1, together=1, after=0))
    assert (out.status, out.error) == (
        "protocol_error", "invalid HTTP response: its body ran past its Content-Length (the "
        "server sent more than it said; where the next answer was looked for: 'leftover')")


def test_a_malformed_header_is_not_named_a_body_past_its_content_length() -> None:
    """A whole answer with a malformed header (a space in its name): aiohttp's message shows
    the header's line and a caret under the space, as a body past its length shows its bytes,
    but it is no bad status line. The failure names the header, not a body that ran past its
    Content-Length ("the bytes past it begin ' Header: x'")."""
    with front("header", 0) as base:
        (out,) = run(_attempts(base, cap=1, together=1, after=0))
    assert out.status == "protocol_error" and out.error is not None
    assert out.error.startswith("invalid HTTP response: ") and "Bad Header" in out.error
    assert "Content-Length" not in out.error


def test_a_body_short_of_its_content_length_is_cut_short() -> None:
    """A whole answer 8 bytes short of its Content-Length, then the connection's end: the
    failure is conn_reset and says the answer was cut short, at which byte of how many."""
    with front("short", 0) as base:
        (out,) = run(_attempts(base, cap=1, together=1, after=0))
    body = len(WHOLE)
    assert (out.status, out.error) == (
        "conn_reset", f"response cut short: the connection ended at byte {body} of the "
                      f"{body + 8} its Content-Length says (0 tokens)")


def test_every_dead_connection_in_the_pool_is_passed_over() -> None:
    """Three connections pooled, all dead (a balancer dropped them while idle): the next
    attempt meets each in turn, and the fourth try, on a new connection, is answered: it counts
    3 sent again, the next attempt 1 (the fourth connection). With one try again only, it failed
    on the second dead one."""
    with front("rst", 1) as base:
        outs = run(_attempts(base, cap=3, together=3, after=2))
        seen = counts(base)
    assert [(o.status, o.conn_reused) for o in outs] == [("ok", False)] * 5
    assert [o.resent for o in outs] == [0, 0, 0, 3, 1]
    assert seen == {"served": 5, "killed": 4}


@pytest.mark.parametrize("kill", ["fin", "rst"])
def test_a_new_connection_killed_under_the_request_is_a_failure(kill: str) -> None:
    """A new connection closed (or reset) with no answer is the server's doing, not a stale
    pool's: conn_reset, and the request went once."""
    with front(kill, 0) as base:
        (out,) = run(_attempts(base, cap=2, together=1, after=0))
        seen = counts(base)
    assert (out.status, out.conn_reused, out.http_status, out.resent) == (
        "conn_reset", False, None, 0)
    assert seen == {"served": 0, "killed": 1}


def test_a_send_again_that_gets_no_connection_is_not_counted() -> None:
    """The server went away: it closed the pooled connection under the request and stopped
    listening, so the try again on a new connection is refused. The attempt is conn_reset,
    and the request went once (it counted one sent again, which the server never read)."""
    from keepalive_server import ANSWER, _reply, _request

    async def go() -> tuple[list[AttemptOutcome], dict[str, int]]:
        seen = {"served": 0, "killed": 0}

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _request(reader)
            seen["served"] += 1
            _reply(writer, b"text/event-stream", ANSWER)
            await writer.drain()
            await _request(reader)
            seen["killed"] += 1
            server.close()  # no new connection from now on
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        return await _attempts(f"http://127.0.0.1:{port}/v1", cap=1, together=1, after=1), seen

    (first, second), seen = run(go())
    assert (first.status, first.resent) == ("ok", 0)
    assert (second.status, second.conn_ready_at, second.resent) == ("conn_reset", None, 0)
    assert "refused" in (second.error or "")
    assert seen == {"served": 1, "killed": 1}


def test_a_run_against_a_front_that_kills_kept_alive_connections_charges_nothing(
        tmp_path: Path) -> None:
    """A whole run, one attempt per item and no retry budget, against a front that answers one
    request per connection and kills the connection under the next: every item succeeds at its
    first attempt, and nothing is held as an outage or retried (a stale connection began an
    outage: the endpoint was blamed, and the items waited for a probe of its model list). Each
    request the front killed is in the log, as one its attempt sent again (`resent`), and in
    the report's connections."""
    ids = write_input(tmp_path / "input.jsonl", 30)
    with front("rst", 1) as base:
        write_job(tmp_path / "job.yaml", shards=1, concurrency=3,
                  retry={"max_attempts": 1, "budget_ratio": 0, "budget_floor": 0},
                  endpoint={"base_url": base, "api": "chat", "model": "m"})
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
        seen = counts(base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = Run.load(only_run(tmp_path / "runs"))
    assert sorted(r["id"] for r in result.results) == ids and not result.dead
    ends = [e for e in result.events if e["ev"] == "attempt_end"]
    assert [(e["status"], e["attempt"], e["reused"]) for e in ends] == [("ok", 1, False)] * 30
    assert not [e for e in result.events if e["ev"] == "retry"]
    assert seen["served"] == 30 and seen["killed"] > 0
    assert sum(e["resent"] for e in ends) == seen["killed"]
    report = run_cli("report", str(only_run(tmp_path / "runs")), "--json", cwd=tmp_path)
    assert orjson.loads(report.stdout)["connections"]["resent"] == seen["killed"]

"""Servers that refuse what the job asks or lack a feature, mostly through the real CLI against
the simulator's own process.

Three cases a user meets: a server that refuses `stream_options` (servers and API versions older
than the option), one that ignores `stream` and answers with one JSON body (the simulator
imitates both: `reject_stream_options`, `ignore_stream`), and a job whose parameters the server
refuses for every request alike.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from shardrun import protocol
from shardrun.aggregate._segments import overall
from shardrun.cli_validate import _ping_lines
from shardrun.client import AttemptOutcome, StreamingClient, Timeouts, make_session
from shardrun.items import API_PATHS
from shardrun.report._rundir import FoldOptions, fold_shard_file
from shardrun.shard import ABANDON, REFUSED_ALIKE_AFTER, Shard, ShardConfig
from shardrun.sim.config import SimConfig
from shardrun.sim.server import build_app
from shardrun.spec import load_job
from shardrun.validate import ping
from tests.conftest import (
    FAST_SIM,
    Run,
    error_lines,
    only_run,
    page_server,
    run_cli,
    write_input,
    write_job,
)
from tests.test_e2e import assert_buckets_telescope, assert_exactly_once

REFUSAL = ("error: the endpoint refused stream_options, which asks it to report usage in the "
           "stream (HTTP 400: Unrecognized request argument supplied: stream_options): set "
           "endpoint.stream_usage: false in the job file (completion tokens are then counted "
           "from the stream and marked estimated), then continue with --resume")  # fmt: skip


def endpoint(**settings: Any) -> dict[str, Any]:
    """A sim:// endpoint whose simulator has `settings` on top of the fast ones."""
    return {"base_url": "sim://", "api": "chat", "model": "m", "sim": {**FAST_SIM, **settings}}


def outputs(run: Run) -> dict[str, tuple[str, int]]:
    return {r["id"]: (r["output"], r["usage"]["completion_tokens"]) for r in run.results}


def test_a_server_that_ignores_stream_gives_the_same_answers(tmp_path: Path) -> None:
    """Whole JSON answers count as answers: the same texts and token counts as the same
    simulator streaming them, each attempt one piece (first token = last token, no gaps)."""
    ids = write_input(tmp_path / "input.jsonl", 300)
    runs, tpots = {}, {}
    for name, settings in (("streamed", {}), ("whole", {"ignore_stream": True})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "input.jsonl").write_bytes((tmp_path / "input.jsonl").read_bytes())
        write_job(tmp_path / name / "job.yaml", endpoint=endpoint(**settings))
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path / name)
        assert proc.returncode == 0, proc.stderr
        runs[name] = Run.load(only_run(tmp_path / name / "runs"))
        report = run_cli("report", "--json", str(only_run(tmp_path / name / "runs")),
                         cwd=tmp_path / name)
        assert report.returncode == 0, report.stderr
        tpots[name] = json.loads(report.stdout)["latency"]["all"]["tpot"]
    # No time passes between a whole answer's tokens: its TPOT is unknown (null), not 0.
    assert tpots["whole"] is None and tpots["streamed"]["p50"] > 0
    whole = runs["whole"]
    assert_exactly_once(whole, ids)
    assert_buckets_telescope(whole)
    assert outputs(whole) == outputs(runs["streamed"])
    assert all(r["attempts"] == 1 and r["usage"]["estimated"] is False for r in whole.results)
    assert all(r["first_token_at"] == r["last_token_at"] for r in whole.results)
    assert all(r["buckets"]["t_stream"] == 0 for r in whole.results)
    ends = [e for e in whole.events if e["ev"] == "attempt_end"]
    assert len(ends) == len(ids)
    assert all(e["status"] == "ok" and e["tokens"] == 1 for e in ends)
    # The streamed run saw the gaps between tokens; the whole answers have none to see.
    assert any(e["itl_hist"] for e in runs["streamed"].events if e["ev"] == "attempt_end")
    assert not any(e["itl_hist"] for e in ends)


def test_a_refused_stream_options_stops_the_run_and_resume_without_it_finishes(
    tmp_path: Path,
) -> None:
    """A 400 naming stream_options before any success: one sentence saying what to set,
    nothing dead-lettered, few requests spent; --resume with stream_usage: false runs every
    item once, with token counts marked estimated."""
    ids = write_input(tmp_path / "input.jsonl", 500)
    job = write_job(tmp_path / "job.yaml", endpoint=endpoint(reject_stream_options=True))
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 1
    assert error_lines(proc.stderr, tmp_path) == [REFUSAL]
    assert "Traceback" not in proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert not run.results and not run.dead
    sent = [e for e in run.events if e["ev"] == "attempt_end"]
    assert sent and all(e["http"] == 400 for e in sent) and len(sent) < len(ids) / 2

    spec = yaml.safe_load(job.read_text())
    spec["endpoint"]["stream_usage"] = False
    job.write_text(yaml.safe_dump(spec))
    resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "latest", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert_exactly_once(run, ids)
    assert all(r["usage"]["estimated"] is True and r["usage"]["completion_tokens"] >= 1
               for r in run.results)  # fmt: skip
    (last,) = run.manifest["resumes"][-1:]
    assert last["effective"]["endpoint.stream_usage"] == {"value": False, "source": "job file"}


def test_validate_ping_says_what_to_set_when_stream_options_is_refused(tmp_path: Path) -> None:
    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml", endpoint=endpoint(reject_stream_options=True))
    proc = run_cli("validate", "job.yaml", "--ping", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert ("  hint: this server does not take stream_options, which asks for usage in the "
            "stream; set endpoint.stream_usage: false") in proc.stdout.splitlines()
    write_job(tmp_path / "job.yaml", endpoint={**endpoint(reject_stream_options=True),
                                               "stream_usage": False})  # fmt: skip
    proc = run_cli("validate", "job.yaml", "--ping", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hint:" not in proc.stdout


def assert_refused_alike(proc: subprocess.CompletedProcess[str], answer: str, cwd: Path) -> None:
    """The run in `cwd` failed with the one sentence of a server that gave every request
    `answer`."""
    assert proc.returncode == 1
    errors = error_lines(proc.stderr, cwd)
    assert errors == [
        f"error: the endpoint refused {REFUSED_ALIKE_AFTER} requests in a row with the same "
        f"answer before any succeeded ({answer}): the job's params, endpoint.base_url, "
        "endpoint.model or endpoint.api do not suit this server; fix the job file, then "
        "continue with --resume --retry-failed (which also gives the items dead-lettered so "
        "far another pass)"], proc.stderr


def test_a_job_the_server_refuses_alike_stops_the_run_and_resume_finishes(tmp_path: Path) -> None:
    """Every request refused with the same 400 (a parameter the server does not take): the run
    stops after a few, with one sentence; --resume --retry-failed with the job fixed runs every
    item once, those dead-lettered before the stop included."""
    ids = write_input(tmp_path / "input.jsonl", 500)
    job = write_job(tmp_path / "job.yaml", params={"max_tokens": 0})
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert_refused_alike(proc, "HTTP 400: 'max_tokens' must be an integer >= 1, not 0.",
                         tmp_path)
    run = Run.load(only_run(tmp_path / "runs"))
    assert not run.results and run.dead
    sent = [e for e in run.events if e["ev"] == "attempt_end"]
    assert all(e["http"] == 400 for e in sent) and len(sent) < len(ids) / 2

    spec = yaml.safe_load(job.read_text())
    spec["params"]["max_tokens"] = 16
    job.write_text(yaml.safe_dump(spec))
    resumed = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "latest", "--retry-failed",
                      cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(r["id"] for r in Run.load(only_run(tmp_path / "runs")).results) == sorted(ids)


def test_a_web_page_instead_of_an_endpoint_stops_the_run(tmp_path: Path) -> None:
    """A base_url that answers every request with 200 and an HTML page (a login page, a web
    app): after a few alike, the run stops with one sentence naming the page's heading and
    content-type and endpoint.base_url, dead-letters only the few items it tried, and sends a
    few requests, not one or more per item."""
    ids = write_input(tmp_path / "input.jsonl", 500)
    with page_server() as server:
        write_job(tmp_path / "job.yaml", endpoint={"base_url": server.base_url, "api": "chat",
                                                   "model": "m"})
        proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert_refused_alike(proc, 'an HTML page that says "Sign in", not an event stream '
                               "(content-type text/html; charset=utf-8)", tmp_path)  # fmt: skip
    run = Run.load(only_run(tmp_path / "runs"))
    assert not run.results and len(run.dead) < len(ids) / 4
    assert 0 < server.served < len(ids) / 4


def refused(error: str, http: int = 400) -> AttemptOutcome:
    return AttemptOutcome(status="http_4xx", http_status=http, started_at=0.0,
                          conn_ready_at=0.0, error=error)  # fmt: skip


def test_refusals_stop_only_when_alike_in_a_row_and_before_any_success(tmp_path: Path) -> None:
    """Answers that differ (item-specific refusals) never stop the shard, nor do retryable
    4xx or refusals after a success; the same answer REFUSED_ALIKE_AFTER times in a row does."""

    async def go() -> None:
        sent: list[protocol.Message] = []
        cfg = ShardConfig(shard=0, run_id="r", out_dir=str(tmp_path), base_url="http://x",
                          api="chat", model="m")  # fmt: skip
        shard = Shard(cfg, sent.append)
        url = "http://x/chat/completions"
        for i in range(3 * REFUSED_ALIKE_AFTER):  # context lengths differ per prompt
            shard._note_failure(refused(f"HTTP 400: prompt of {1000 + i} tokens is too long"), url)
        for _ in range(3 * REFUSED_ALIKE_AFTER):  # retried, so no verdict on the job
            shard._note_failure(refused("HTTP 409: busy", 409), url)
        for _ in range(REFUSED_ALIKE_AFTER - 1):
            shard._note_failure(refused("HTTP 400: unsupported parameter"), url)
        assert shard.fatal_reason is None and not sent
        shard._note_failure(refused("HTTP 400: unsupported parameter"), url)
        assert shard.fatal_reason is not None and shard.fatal_mode == ABANDON
        assert [m["t"] for m in sent] == [protocol.FATAL]

        after_success = Shard(cfg, sent.append)
        after_success.ok_once = True
        for _ in range(3 * REFUSED_ALIKE_AFTER):
            after_success._note_failure(refused("HTTP 400: unsupported parameter"), url)
        assert after_success.fatal_reason is None

    asyncio.run(go())


async def _shard_through(base: str, out: Path, n: int = 12) -> protocol.Message:
    """`n` items through a real shard to `base`: its last progress report."""
    async with make_session(4, Timeouts()) as session:
        out.mkdir()
        shard = Shard(ShardConfig(shard=0, run_id="r", out_dir=str(out), base_url=base,
                                  api="chat", model="m", concurrency=4), [].append)
        shard.clients = {api: StreamingClient(session, base, api, {}, Timeouts(), shard.clock)
                         for api in API_PATHS}
        shard.on_message({"t": protocol.ITEMS, "items": [
            {"id": str(i), "prompt": f"p{i}"} for i in range(n)]})
        shard.on_message({"t": protocol.END})
        await shard.dispatch()
        await asyncio.gather(*shard.tasks)
        report = shard.report(protocol.PROGRESS)
        shard.close()
    assert report["ok"] == n, report
    return report


def test_a_whole_answer_counts_toward_no_first_token_figure(tmp_path: Path) -> None:
    """The live view's "server queueing" reads the successes' first tokens: a whole answer's
    first token is its body's end, so the longer its answers the later it would seem to come.
    The simulator streaming its answers counts each; ignoring `stream`, it counts none."""

    async def first_tokens(name: str, ignore_stream: bool) -> protocol.Message:
        cfg = SimConfig.from_mapping({**FAST_SIM, "ignore_stream": ignore_stream})
        async with TestServer(build_app(cfg), host="127.0.0.1", port=0) as server:
            return await _shard_through(str(server.make_url("/v1")), tmp_path / name)

    streamed = asyncio.run(first_tokens("streamed", False))
    assert streamed["first_tokens"] == 12 and streamed["first_token_chars"] > 0
    whole = asyncio.run(first_tokens("whole", True))
    assert (whole["first_tokens"], whole["first_token_ms"], whole["first_token_chars"]) == (
        0, 0, 0)


def _buffering_proxy(upstream: str) -> web.Application:
    """A gateway that reads the upstream's whole answer, then sends it in one write."""

    async def forward(request: web.Request) -> web.Response:
        async with aiohttp.ClientSession() as session, session.post(
                upstream + request.path, data=await request.read(),
                headers={"Content-Type": "application/json"}) as resp:
            body = await resp.read()
            return web.Response(body=body, status=resp.status,
                                content_type=resp.content_type)

    app = web.Application()
    app.router.add_post("/v1/{tail:.*}", forward)
    return app


def test_a_ping_through_a_buffering_proxy_says_its_ttft_is_the_answers_end(
        tmp_path: Path) -> None:
    """`validate --ping` shows a TTFT: behind a proxy that buffers streams it is the whole
    answer's time, which the ping now says; straight to the simulator it says nothing."""
    job = load_job(write_job(tmp_path / "job.yaml", endpoint=endpoint(tokens="8")), env={},
                   flags={})
    cfg = SimConfig.from_mapping({**FAST_SIM, "tokens": "8"})

    async def ping_lines(proxied: bool) -> list[str]:
        async with TestServer(build_app(cfg), host="127.0.0.1", port=0) as sim:
            base = str(sim.make_url(""))
            if not proxied:
                result = await ping(job, base + "/v1", None, None)
            else:
                async with TestServer(_buffering_proxy(base), host="127.0.0.1",
                                      port=0) as proxy:
                    result = await ping(job, str(proxy.make_url("/v1")), None, None)
        assert result.ok, result
        return _ping_lines(result, job)

    note = "  note: the answer came at once, not token by token"
    assert not any(line.startswith(note) for line in asyncio.run(ping_lines(False)))
    assert any(line.startswith(note) for line in asyncio.run(ping_lines(True)))


@pytest.mark.parametrize("tokens", ["uniform:4:24", "3000"], ids=["short", "long"])
def test_a_stream_a_proxy_buffered_counts_toward_no_first_token_figure(
        tmp_path: Path, tokens: str) -> None:
    """Behind a proxy that holds each stream back and sends it whole at its end, every
    answer's first token comes with its last: its time to first token would be the whole
    answer's and its TPOT 0. None counts in the live view's first tokens, each `attempt_end`
    says `at_once`, and the report's TTFT and TPOT leave them out (the buckets keep them).
    A long answer's burst (some 900 KiB) comes in several reads; the simulator streaming the
    same answers straight counts every one."""
    cfg = SimConfig.from_mapping({**FAST_SIM, "tokens": tokens})

    async def through(name: str, proxied: bool) -> protocol.Message:
        async with TestServer(build_app(cfg), host="127.0.0.1", port=0) as sim:
            base = str(sim.make_url(""))
            if not proxied:
                return await _shard_through(base + "/v1", tmp_path / name)
            async with TestServer(_buffering_proxy(base), host="127.0.0.1", port=0) as proxy:
                return await _shard_through(str(proxy.make_url("/v1")), tmp_path / name)

    for name, proxied in (("straight", False), ("proxied", True)):
        report = asyncio.run(through(name, proxied))
        log = tmp_path / name / "events" / "shard-00.jsonl"
        ends = [e for e in map(orjson.loads, log.read_bytes().splitlines())
                if e["ev"] == "attempt_end"]
        assert len(ends) == 12 and all(e["status"] == "ok" for e in ends)
        scan, summary = fold_shard_file(log, "log", math.inf, 4, FoldOptions())
        assert scan.bad_lines == 0
        dists = overall(summary.segments)
        assert dists["e2e"].n == dists["t_first_token"].n == 12
        counted = 0 if proxied else 12
        assert report["first_tokens"] == dists["ttft"].n == dists["tpot"].n == counted, name
        assert [e.get("at_once") for e in ends] == [True if proxied else None] * 12

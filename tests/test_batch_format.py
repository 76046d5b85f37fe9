"""Tests for the OpenAI Batch output files rebuilt from result and dead-letter lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from shardrun._chunks import ChunkReader, read_whole
from shardrun._responses import ResponsesReader, read_whole_response
from shardrun.batch_format import (
    batch_error_line,
    batch_output_line,
    request_id_for,
    write_batch_files,
)

# A results/ line as a run writes it (trimmed of timing fields the converter does not read).
RESULT: dict[str, Any] = {
    "id": "ex-000074", "output": " fur fat fap", "finish_reason": "stop",
    "usage": {"prompt_tokens": 9, "completion_tokens": 19, "estimated": False},
    "attempts": 1, "shard": 0, "span": "0-11", "released_at": 1795317470.0624537,
}  # fmt: skip
DEAD: dict[str, Any] = {
    "id": "ex-000075", "reason": "retries exhausted: HTTP 429: slow down", "shard": 1,
    "span": "1-4",
    "attempts": [
        {"attempt": 1, "status": "timeout_first_token", "http": None, "error": "no token",
         "started_at": 1.0, "ended_at": 2.0, "wait": 0.5},
        {"attempt": 2, "status": "http_429", "http": 429, "error": "HTTP 429: slow down",
         "started_at": 2.5, "ended_at": 2.6, "wait": None},
    ],
}  # fmt: skip


def test_chat_result_becomes_a_batch_output_line() -> None:
    """A chat result rebuilds a chat.completion body inside a 200 response."""
    line = batch_output_line(RESULT, "req_abc", model="sim-small")
    assert line == {
        "id": "batch_req_abc",
        "custom_id": "ex-000074",
        "response": {
            "status_code": 200,
            "request_id": "req_abc",
            "body": {
                "id": "chatcmpl-abc",
                "object": "chat.completion",
                "created": 1795317470,
                "model": "sim-small",
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": " fur fat fap"},
                    "logprobs": None,
                    "finish_reason": "stop",
                }],
                "usage": {"prompt_tokens": 9, "completion_tokens": 19, "total_tokens": 28},
            },
        },
        "error": None,
    }  # fmt: skip


def test_completions_result_follows_its_url_or_the_api() -> None:
    """A result from a /v1/completions line (or a completions job) is a text_completion."""
    for record, api in (({**RESULT, "url": "/v1/completions"}, "chat"), (RESULT, "completions")):
        body = batch_output_line(record, "req_1", model="m", api=api)["response"]["body"]
        assert body["object"] == "text_completion" and body["id"] == "cmpl-1"
        assert body["choices"][0]["text"] == " fur fat fap" and "message" not in body["choices"][0]
    chat = batch_output_line({**RESULT, "url": "/v1/chat/completions", "model": "own"}, "req_1",
                             model="m", api="completions")["response"]["body"]  # fmt: skip
    assert chat["object"] == "chat.completion" and chat["model"] == "own"


def test_unknown_prompt_tokens_leave_the_total_unknown() -> None:
    """A server that sent no usage gives null prompt and total tokens, not a guess."""
    record = {**RESULT, "usage": {"prompt_tokens": None, "completion_tokens": 4}}
    usage = batch_output_line(record, "req_1")["response"]["body"]["usage"]
    assert usage == {"prompt_tokens": None, "completion_tokens": 4, "total_tokens": None}


def test_usage_details_go_where_each_api_holds_them() -> None:
    """Cached and reasoning token counts, where the result has them, in chat's
    prompt/completion_tokens_details or the Responses API's input/output_tokens_details."""
    usage = {"prompt_tokens": 9, "completion_tokens": 19, "cached_tokens": 4,
             "reasoning_tokens": 7}  # fmt: skip
    chat = batch_output_line({**RESULT, "usage": usage}, "req_1")["response"]["body"]["usage"]
    assert chat == {"prompt_tokens": 9, "completion_tokens": 19, "total_tokens": 28,
                    "prompt_tokens_details": {"cached_tokens": 4},
                    "completion_tokens_details": {"reasoning_tokens": 7}}  # fmt: skip
    body = batch_output_line({**RESULT, "usage": {**usage, "cached_tokens": None}}, "req_1",
                             api="responses")["response"]["body"]  # fmt: skip
    assert body["usage"] == {"input_tokens": 9, "output_tokens": 19, "total_tokens": 28,
                             "output_tokens_details": {"reasoning_tokens": 7}}  # fmt: skip


def test_a_refusal_and_a_custom_call_round_trip_through_each_apis_body() -> None:
    """A result with a refusal and a custom tool's call: chat's message holds them as OpenAI's
    does (content null), a Responses body as a refusal part and a custom_tool_call item; the
    project's own readers read each body back to the same refusal and calls."""
    custom = {"id": "call_c", "type": "custom", "custom": {"name": "shell", "input": "ls"}}
    function = {"id": "call_f", "type": "function",
                "function": {"name": "get", "arguments": '{"x":1}'}}  # fmt: skip
    record = {**RESULT, "output": "", "refusal": "I can't.", "tool_calls": [custom, function]}
    chat = batch_output_line(record, "req_1")["response"]["body"]
    message = chat["choices"][0]["message"]
    assert (message["content"], message["refusal"]) == (None, "I can't.")
    reader = ChunkReader(chat=True)
    assert read_whole(orjson.dumps(chat), reader) == ""
    assert (reader.refusal, reader.tool_call_list()) == (["I can't."], [custom, function])

    body = batch_output_line(record, "req_1", api="responses")["response"]["body"]
    kinds = [item["type"] for item in body["output"]]
    assert kinds == ["custom_tool_call", "function_call", "message"]
    assert body["output"][-1]["content"] == [{"type": "refusal", "refusal": "I can't."}]
    responses = ResponsesReader()
    assert read_whole_response(orjson.dumps(body), responses) == ""
    assert (responses.refusal, responses.tool_call_list()) == (["I can't."], [custom, function])


def test_dead_letter_becomes_an_error_line() -> None:
    """The last attempt's HTTP status and status name the error; the reason is the message."""
    assert batch_error_line(DEAD, "req_9") == {
        "id": "batch_req_9",
        "custom_id": "ex-000075",
        "response": {"status_code": 429, "request_id": "req_9", "body": {"error": {
            "message": "HTTP 429: slow down", "type": "http_429", "code": "http_429"}}},
        "error": {"code": "http_429", "message": "retries exhausted: HTTP 429: slow down"},
    }  # fmt: skip


def test_dead_letter_without_http_status_or_attempts() -> None:
    """No HTTP status means a null response; no attempt at all is code not_sent."""
    timeout = {**DEAD, "attempts": DEAD["attempts"][:1], "reason": "gave up"}
    line = batch_error_line(timeout)
    assert line["response"] is None and line["error"] == {"code": "timeout_first_token",
                                                          "message": "gave up"}  # fmt: skip
    unsent = batch_error_line({"id": "x", "reason": "endpoint unreachable", "attempts": []})
    assert unsent["error"] == {"code": "not_sent", "message": "endpoint unreachable"}


def test_write_batch_files_streams_every_shard(tmp_path: Path) -> None:
    """Both files hold one line per result / dead letter, across shards; torn lines are
    skipped; ids are stable, so converting twice gives the same bytes."""
    run = tmp_path / "20260101T000000Z-abc123"
    for sub in ("results", "dead"):
        (run / sub).mkdir(parents=True)
    (run / "results" / "shard-00.jsonl").write_bytes(orjson.dumps(RESULT) + b"\n")
    second = {**RESULT, "id": "b", "span": "1-1"}
    (run / "results" / "shard-01.jsonl").write_bytes(orjson.dumps(second) + b'\n{"id": "torn')
    (run / "dead" / "shard-01.jsonl").write_bytes(orjson.dumps(DEAD) + b"\n\n")
    output, errors = write_batch_files(run, "sim-small")
    first_bytes = output.read_bytes(), errors.read_bytes()
    out_lines = [orjson.loads(x) for x in first_bytes[0].splitlines()]
    err_lines = [orjson.loads(x) for x in first_bytes[1].splitlines()]
    assert [x["custom_id"] for x in out_lines] == ["ex-000074", "b"]
    assert [x["custom_id"] for x in err_lines] == ["ex-000075"]
    assert out_lines[0]["response"]["request_id"] == request_id_for(run.name, "0-11")
    assert write_batch_files(run, "sim-small") == (output, errors)
    assert (output.read_bytes(), errors.read_bytes()) == first_bytes
    assert sorted(p.name for p in run.iterdir()) == [
        "batch_errors.jsonl", "batch_output.jsonl", "dead", "results"]  # fmt: skip


def test_request_ids_differ_by_run_and_span() -> None:
    """Request ids are stable per (run, span) and distinct otherwise."""
    ids = {request_id_for(r, s) for r in ("run1", "run2") for s in ("0-1", "0-2")}
    assert len(ids) == 4 and request_id_for("run1", "0-1") == request_id_for("run1", "0-1")
    assert all(i.startswith("req_") and len(i) == 28 for i in ids)

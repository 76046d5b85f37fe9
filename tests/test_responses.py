"""The OpenAI Responses API on the client's side: its event stream and whole response objects
(`shardrun._responses`), the request body, the job rules and the Batch output line."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardrun._chunks import BAD, DONE, ERROR, MORE, Unreadable, stream_error
from shardrun._responses import ResponsesReader, read_whole_response
from shardrun.batch_format import batch_output_line
from shardrun.errors import SpecError
from shardrun.items import build_request, prompt_chars
from shardrun.spec import load_job
from shardrun.sse import SSEDecoder

USAGE = {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
         "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 12}  # fmt: skip


def events(*bodies: dict[str, Any]) -> list[bytes]:
    """Payloads of a stream: each event with its type and the next sequence number."""
    return [orjson.dumps({**body, "sequence_number": n}) for n, body in enumerate(bodies)]


def response(status: str, output: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 1, "status": status,
            "model": "m", "output": output, "usage": USAGE, **extra}  # fmt: skip


def message(text: str) -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


def delta(kind: str, text: str, index: int = 0) -> dict[str, Any]:
    return {"type": kind, "item_id": f"item_{index}", "output_index": index, "content_index": 0,
            "delta": text}  # fmt: skip


ANSWER = events(
    {"type": "response.created", "response": response("in_progress", [], usage=None)},
    {"type": "response.output_item.added", "output_index": 0,
     "item": {"id": "rs_1", "type": "reasoning", "summary": []}},
    delta("response.reasoning_text.delta", "Let me"),
    delta("response.reasoning_summary_text.delta", " think."),
    {"type": "response.output_item.added", "output_index": 1,
     "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": []}},
    delta("response.output_text.delta", "Hé", 1),
    delta("response.output_text.delta", "llo 🙂\n\"q\"", 1),
    {"type": "response.output_text.done", "output_index": 1, "text": "Héllo 🙂\n\"q\""},
    {"type": "response.completed", "response": response("completed", [message("Héllo 🙂")])},
)  # fmt: skip


def read_all(reads: list[list[bytes]]) -> tuple[list[int], list[str], ResponsesReader]:
    reader, pieces, codes = ResponsesReader(), list[str](), []
    for payloads in reads:
        codes.append(reader.read(payloads, pieces))
        if codes[-1] != MORE:
            break
    return codes, pieces, reader


def test_a_stream_gives_the_answer_the_reasoning_and_the_usage() -> None:
    """Deltas make the answer and the reasoning (a thought's text or its summary); the last
    event ends the stream with usage, and finish_reason as chat says it."""
    codes, pieces, reader = read_all([ANSWER[:4], ANSWER[4:]])
    assert codes == [MORE, DONE]
    assert "".join(pieces) == 'Héllo 🙂\n"q"' and reader.reasoning == ["Let me", " think."]
    assert (reader.finish_reason, reader.prompt_tokens, reader.completion_tokens) == (
        "stop", 7, 5)  # fmt: skip
    assert (reader.cached_tokens, reader.reasoning_tokens) == (0, 2)
    assert reader.other_chunks == 2 and reader.tool_call_list() is None
    assert reader.error is None


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_any_split_of_the_bytes_reads_the_same(cuts: list[int]) -> None:
    """The SSE bytes (with `event:` lines, as the API sends them) cut anywhere, even inside a
    multi-byte character: the same answer, reasoning, usage and end."""
    wire = b"".join(b"event: " + orjson.loads(p)["type"].encode() + b"\ndata: " + p + b"\n\n"
                    for p in ANSWER)  # fmt: skip
    bounds = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts)})
    decoder, reads = SSEDecoder(), []
    for a, b in itertools.pairwise(bounds):
        reads.append(decoder.feed(wire[a:b]))
    reads.append(decoder.close())
    codes, pieces, reader = read_all([r for r in reads if r])
    assert codes[-1] == DONE and "".join(pieces) == 'Héllo 🙂\n"q"'
    assert "".join(reader.reasoning) == "Let me think." and reader.completion_tokens == 5


RECORDED = (Path(__file__).parent / "data" / "responses-gpt5-custom-tool.sse").read_bytes()
SQL_CALL = {"id": "call_2GHkSm2Jm0n7", "type": "custom",
            "custom": {"name": "execute_sql", "input": "SELECT * FROM users LIMIT 5;"}}


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(RECORDED)), max_size=12))
def test_a_recorded_openai_stream_cut_anywhere(cuts: list[int]) -> None:
    """OpenAI's wire shape (tests/data/responses-gpt5-custom-tool.sse: a comment, event lines,
    obfuscation padding, an encrypted reasoning item, a custom tool's call), cut anywhere: one
    call in chat's shape, its eight pieces counted as tokens, usage and its details, no
    reasoning text (OpenAI shows none unless a summary is asked for)."""
    bounds = sorted({0, len(RECORDED), *cuts})
    decoder, reads = SSEDecoder(), []
    for a, b in itertools.pairwise(bounds):
        reads.append(decoder.feed(RECORDED[a:b]))
    reads.append(decoder.close())
    codes, pieces, reader = read_all([r for r in reads if r])
    assert (codes[-1], pieces, reader.tool_call_list()) == (DONE, [], [SQL_CALL])
    assert (reader.finish_reason, reader.other_chunks, reader.reasoning) == ("tool_calls", 8, [])
    assert (reader.prompt_tokens, reader.completion_tokens) == (63, 151)
    assert (reader.cached_tokens, reader.reasoning_tokens) == (0, 128)


def test_function_calls_are_read_in_the_chat_shape() -> None:
    """Two calls, their argument pieces interleaved by output_index: each keeps its call_id
    and name, the calls come in output order, and the answer ends with "tool_calls"."""
    def call(index: int, name: str) -> dict[str, Any]:
        return {"type": "response.output_item.added", "output_index": index,
                "item": {"id": f"fc_{index}", "type": "function_call", "call_id": f"call_{index}",
                         "name": name, "arguments": ""}}  # fmt: skip

    args = "response.function_call_arguments.delta"
    stream = events(call(1, "put"), call(0, "get"), delta(args, '{"a":', 0),
                    delta(args, "{}", 1), delta(args, "1}", 0),
                    {"type": "response.completed", "response": response("completed", [])})
    codes, pieces, reader = read_all([stream])
    assert codes == [DONE] and pieces == [] and reader.finish_reason == "tool_calls"
    assert reader.tool_call_list() == [
        {"id": "call_0", "type": "function", "function": {"name": "get", "arguments": '{"a":1}'}},
        {"id": "call_1", "type": "function", "function": {"name": "put", "arguments": "{}"}}]
    assert reader.other_chunks == 3


def test_a_stream_without_deltas_is_read_from_its_last_event() -> None:
    """A server that sends the answer only in the final response: its message, reasoning and
    calls are taken from there, and a call the stream announced is not doubled."""
    called = {"id": "fc_1", "type": "function_call", "call_id": "call_9", "name": "f",
              "arguments": '{"x":1}'}  # fmt: skip
    thought = {"id": "rs", "type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}
    final = response("completed", [thought, message("all at once"), called])
    stream = events({"type": "response.output_item.added", "output_index": 2,
                     "item": {**called, "arguments": ""}},
                    {"type": "response.completed", "response": final})  # fmt: skip
    codes, pieces, reader = read_all([stream])
    assert codes == [DONE] and pieces == ["all at once"] and reader.reasoning == ["s"]
    assert reader.tool_call_list() == [{"id": "call_9", "type": "function",
                                        "function": {"name": "f", "arguments": '{"x":1}'}}]


def test_what_the_stream_did_not_send_as_deltas_comes_from_the_last_event() -> None:
    """Reasoning streamed, the answer and a call's arguments sent only whole: the answer and
    the arguments come from the final response, the reasoning is not taken twice."""
    called = {"id": "fc_1", "type": "function_call", "call_id": "call_9", "name": "f",
              "arguments": '{"x":1}'}  # fmt: skip
    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]}
    stream = events(delta("response.reasoning_text.delta", "hm"),
                    {"type": "response.output_item.added", "output_index": 2,
                     "item": {**called, "arguments": ""}},
                    {"type": "response.completed",
                     "response": response("completed", [thought, message("whole"), called])})
    codes, pieces, reader = read_all([stream])
    assert codes == [DONE] and pieces == ["whole"] and reader.reasoning == ["hm"]
    assert reader.tool_call_list() == [{"id": "call_9", "type": "function",
                                        "function": {"name": "f", "arguments": '{"x":1}'}}]
    # Streamed as deltas, the answer is not taken again from the last event.
    again = events(delta("response.output_text.delta", "whole"),
                   {"type": "response.completed",
                    "response": response("completed", [message("whole")])})
    assert read_all([again])[1] == ["whole"]


ARGS = "response.function_call_arguments.delta"
GET_X = {"id": "call_x", "type": "function", "function": {"name": "get", "arguments": '{"x":1}'}}


def test_a_call_named_only_by_item_id_as_llama_cpp_streams_it() -> None:
    """llama.cpp's items have no `id` and no `output_index`, its argument pieces only an
    `item_id` (the call id): the pieces still make one call, not doubled by the final
    response that holds it whole."""
    item = {"type": "function_call", "call_id": "call_x", "name": "get", "arguments": "",
            "status": "in_progress"}  # fmt: skip
    stream = events({"type": "response.output_item.added", "item": item},
                    {"type": ARGS, "item_id": "call_x", "delta": '{"x":'},
                    {"type": ARGS, "item_id": "call_x", "delta": "1}"},
                    {"type": "response.completed", "response": response("completed", [
                        {**item, "arguments": '{"x":1}', "status": "completed"}])})
    codes, _, reader = read_all([stream])
    assert codes == [DONE] and reader.tool_call_list() == [GET_X]
    assert (reader.finish_reason, reader.other_chunks) == ("tool_calls", 2)
    # Two such calls, their pieces interleaved: each piece goes to the call its item_id names.
    other = {**item, "call_id": "call_y", "name": "put"}
    stream = events({"type": "response.output_item.added", "item": item},
                    {"type": "response.output_item.added", "item": other},
                    {"type": ARGS, "item_id": "call_x", "delta": '{"x":'},
                    {"type": ARGS, "item_id": "call_y", "delta": "{}"},
                    {"type": ARGS, "item_id": "call_x", "delta": "1}"},
                    {"type": "response.completed", "response": response("completed", [])})
    assert read_all([stream])[2].tool_call_list() == [GET_X, {
        "id": "call_y", "type": "function", "function": {"name": "put", "arguments": "{}"}}]


def test_a_call_numbered_otherwise_in_the_final_response_is_not_doubled() -> None:
    """A server that numbers a call 1 in the stream and puts it first in the final output
    (SGLang did): the call is matched by its id, so the answer has it once. An item with no
    id at all is matched by its place, as before."""
    item = {"id": "fc_1", "type": "function_call", "call_id": "call_x", "name": "get",
            "arguments": ""}  # fmt: skip
    stream = events({"type": "response.output_item.added", "output_index": 1, "item": item},
                    {"type": ARGS, "item_id": "fc_1", "output_index": 1, "delta": '{"x":1}'},
                    {"type": "response.completed", "response": response("completed", [
                        {**item, "arguments": '{"x":1}'}])})
    assert read_all([stream])[2].tool_call_list() == [GET_X]
    # Two calls announced at 1 and 2, their arguments only in the final output, at 0 and 1:
    # each call's ids outrank the place, so the second does not take the first's.
    put = {"id": "fc_2", "type": "function_call", "call_id": "call_y", "name": "put",
           "arguments": ""}  # fmt: skip
    stream = events({"type": "response.output_item.added", "output_index": 1, "item": item},
                    {"type": "response.output_item.added", "output_index": 2, "item": put},
                    {"type": "response.completed", "response": response("completed", [
                        {**item, "arguments": '{"x":1}'}, {**put, "arguments": "{}"}])})
    assert read_all([stream])[2].tool_call_list() == [GET_X, {
        "id": "call_y", "type": "function", "function": {"name": "put", "arguments": "{}"}}]
    anonymous = {"type": "function_call", "name": "get", "arguments": ""}
    stream = events({"type": "response.output_item.added", "output_index": 0,
                     "item": anonymous},
                    {"type": ARGS, "output_index": 0, "delta": '{"x":1}'},
                    {"type": "response.completed", "response": response("completed", [
                        {**anonymous, "arguments": '{"x":1}'}])})
    assert read_all([stream])[2].tool_call_list() == [{**GET_X, "id": None}]


def test_pieces_that_name_no_call_extend_the_latest_one() -> None:
    """Argument pieces with neither item_id nor output_index go to the call started last;
    with no call started yet, they start one."""
    def added(index: int, name: str) -> dict[str, Any]:
        return {"type": "response.output_item.added", "output_index": index, "item": {
            "id": f"fc_{index}", "type": "function_call", "call_id": f"call_{index}",
            "name": name, "arguments": ""}}  # fmt: skip

    stream = events(added(0, "a"), {"type": ARGS, "delta": "{}"}, added(1, "b"),
                    {"type": ARGS, "delta": "[]"},
                    {"type": "response.completed", "response": response("completed", [])})
    calls = read_all([stream])[2].tool_call_list()
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []] == [
        ("a", "{}"), ("b", "[]")]  # fmt: skip
    orphan = events({"type": ARGS, "delta": "{}"},
                    {"type": "response.completed", "response": response("completed", [])})
    assert read_all([orphan])[2].tool_call_list() == [
        {"id": None, "type": "function", "function": {"name": "", "arguments": "{}"}}]


def test_a_custom_tool_call_is_read_in_the_chat_shape() -> None:
    """A custom tool's call (free text in `input`, streamed as custom_tool_call_input deltas,
    as gpt-5 sends it) is a tool call of type "custom", streamed or whole."""
    item = {"id": "ctc_1", "type": "custom_tool_call", "call_id": "call_c", "name": "shell",
            "input": ""}  # fmt: skip
    pieces = "response.custom_tool_call_input.delta"
    stream = events({"type": "response.output_item.added", "output_index": 1, "item": item},
                    {"type": pieces, "item_id": "ctc_1", "output_index": 1, "delta": "ls "},
                    {"type": pieces, "item_id": "ctc_1", "output_index": 1, "delta": "-l"},
                    {"type": "response.completed", "response": response("completed", [
                        {**item, "input": "ls -l"}])})
    expected = [{"id": "call_c", "type": "custom", "custom": {"name": "shell", "input": "ls -l"}}]
    codes, _, reader = read_all([stream])
    assert codes == [DONE] and reader.tool_call_list() == expected
    assert (reader.finish_reason, reader.other_chunks) == ("tool_calls", 2)
    whole = ResponsesReader()
    body = orjson.dumps(response("completed", [{**item, "input": "ls -l"}]))
    assert read_whole_response(body, whole) == "" and whole.tool_call_list() == expected


def test_a_refusal_is_kept_apart_from_the_answer() -> None:
    """A refusal streamed as deltas lands in `refusal` (generated tokens all the same) and is
    not taken again from the final message; sent only whole, it is taken from there."""
    part = {"type": "refusal", "refusal": "I can't help with that."}
    final = response("completed", [{**message(""), "content": [part]}])
    stream = events(delta("response.refusal.delta", "I can't"),
                    delta("response.refusal.delta", " help with that."),
                    {"type": "response.completed", "response": final})
    codes, pieces, reader = read_all([stream])
    assert (codes, pieces, reader.refusal) == ([DONE], [], ["I can't", " help with that."])
    assert reader.other_chunks == 2
    whole = ResponsesReader()
    assert read_whole_response(orjson.dumps(final), whole) == ""
    assert whole.refusal == ["I can't help with that."]


def test_the_older_reasoning_delta_name_is_reasoning_too() -> None:
    """`response.reasoning.delta`, a name older SDKs and some gateways use, is reasoning."""
    stream = events(delta("response.reasoning.delta", "hm"),
                    delta("response.output_text.delta", "ok", 1),
                    {"type": "response.completed", "response": response("completed", [])})
    codes, pieces, reader = read_all([stream])
    assert (codes, pieces, reader.reasoning) == ([DONE], ["ok"], ["hm"])


@pytest.mark.parametrize(("reason", "finish"), [("max_output_tokens", "length"),
                                                ("content_filter", "content_filter"),
                                                (None, "incomplete")])  # fmt: skip
@pytest.mark.parametrize("last", ["response.incomplete", "response.completed"])
def test_an_incomplete_response_says_why(reason: str | None, finish: str, last: str) -> None:
    """The response's status says it was cut, whichever event carries it: OpenAI ends with
    response.incomplete, vLLM with response.completed holding status "incomplete"."""
    details = {"incomplete_details": None if reason is None else {"reason": reason}}
    stream = events(delta("response.output_text.delta", "cut"),
                    {"type": last,
                     "response": response("incomplete", [message("cut")], **details)})
    codes, pieces, reader = read_all([stream])
    assert (codes, pieces, reader.finish_reason) == ([DONE], ["cut"], finish)


@pytest.mark.parametrize(("event", "status", "words"), [
    ({"type": "error", "code": "invalid_prompt", "message": "no"}, "http_4xx",
     "error invalid_prompt in stream after 1 token: no"),
    ({"type": "error", "message": "no code"}, "protocol_error",
     "error in stream after 1 token: no code"),
    ({"type": "error", "error": {"code": "rate_limit_exceeded", "message": "slow down"}},
     "http_429", "error rate_limit_exceeded in stream after 1 token: slow down"),
    ({"type": "error", "sequence_number": 2, "error": {
        "type": "too_many_requests", "code": "too_many_requests", "message": "busy"}},
     "http_429", "error too_many_requests in stream after 1 token: busy"),
    ({"type": "error", "error": {"type": "insufficient_quota", "code": "credit_balance_exhausted",
                                 "message": "top up"}}, "http_4xx",
     "error credit_balance_exhausted in stream after 1 token: top up"),
    ({"type": "response.failed", "response": response("failed", [], error={
        "code": "server_error", "message": "oops"})}, "http_5xx",
     "error server_error in stream after 1 token: oops"),
    ({"type": "response.failed", "response": response("failed", [], error={
        "code": "context_length_exceeded", "message": "too long"})}, "http_4xx",
     "error context_length_exceeded in stream after 1 token: too long"),
    ({"type": "response.failed", "response": response("failed", [], error={
        "code": "something_new", "message": "hm"})}, "protocol_error",
     "error something_new in stream after 1 token: hm"),
    ({"type": "response.failed", "response": {"status": "failed"}}, "protocol_error",
     "error in stream after 1 token: the response failed"),
    ({"error": {"object": "error", "message": "late", "type": "BadRequestError", "code": 400}},
     "http_4xx", "error 400 in stream after 1 token: late"),
    ({"error": {"message": "down", "type": "server_error"}}, "http_5xx",
     "error server_error in stream after 1 token: down"),
])  # fmt: skip
def test_errors_end_the_stream_as_retryable_or_not(event: dict[str, Any], status: str,
                                                   words: str) -> None:  # fmt: skip
    """An error event, a failed response or a bare error object (chat's shape): ERROR. Its
    code, else its type, classes it: a rate limit or a server fault as the HTTP status it
    means, so the attempt is retried as one; a request that cannot succeed as a 4xx, so it is
    not; anything else as a protocol error (retried)."""
    codes, _, reader = read_all([events(delta("response.output_text.delta", "a"), event)])
    assert codes == [ERROR]
    assert stream_error(reader.error, 1) == (status, words)


@pytest.mark.parametrize("payload", [b"not json", b"[1, 2]", b'"text"',
                                     b'{"type": "response.output_item.added"}',
                                     b'{"type": "response.function_call_arguments.delta", '
                                     b'"output_index": "0", "delta": "x"}',
                                     b'{"type": "response.completed", "response": 5}'])
def test_a_payload_that_is_no_event_is_bad(payload: bytes) -> None:
    codes, _, reader = read_all([[payload]])
    assert codes == [BAD] and reader.bad == payload


def test_done_ends_a_stream_and_other_events_are_passed_over() -> None:
    stream = events({"type": "response.in_progress"}, {"type": "response.content_part.added"},
                    {"type": "some.future.event", "delta": "x"})
    assert read_all([stream, [b"[DONE]"]])[:2] == ([MORE, DONE], [])
    assert read_all([stream, [b"[DONE] "]])[:2] == ([MORE, DONE], [])


def test_a_message_whose_content_is_a_string_is_read_as_its_text() -> None:
    """A message item whose `content` is a string (chat's shape, as a gateway that turns chat
    into this API may send it) where the API has a list of parts: the string is the answer. It
    was read as no text at all, an ok result with an empty answer, streamed or whole."""
    said = {**message("x"), "content": "Héllo"}
    stream = events({"type": "response.completed", "response": response("completed", [said])})
    codes, pieces, _ = read_all([stream])
    assert (codes, pieces) == ([DONE], ["Héllo"])
    assert read_whole_response(orjson.dumps(response("completed", [said])),
                               ResponsesReader()) == "Héllo"


def test_read_whole_response() -> None:
    """A whole response object: its output and usage; a failed one and an error body set the
    error; what is no response gives None."""
    reader = ResponsesReader()
    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}],
               "summary": [{"type": "summary_text", "text": "short"}]}  # fmt: skip
    body = orjson.dumps(response("completed", [thought, message("hi")]))
    assert read_whole_response(body, reader) == "hi"
    assert (reader.reasoning, reader.finish_reason, reader.completion_tokens) == (
        ["hm"], "stop", 5)  # fmt: skip
    failed = ResponsesReader()
    failed_body = response("failed", [], error={"code": "server_error", "message": "x"})
    assert read_whole_response(orjson.dumps(failed_body), failed) == ""
    assert stream_error(failed.error, 0)[0] == "http_5xx"
    error = ResponsesReader()
    assert read_whole_response(b'{"error": {"message": "bad", "code": 400}}', error) == ""
    assert error.error == {"code": 400, "message": "bad"}
    for body in (b"nope", b"[]"):
        assert read_whole_response(body, ResponsesReader()) is None, body
    for body in (b'{"id": 1}', b'{"object": "response", "output": [1]}'):
        with pytest.raises(Unreadable):
            read_whole_response(body, ResponsesReader())


def test_the_request_body_takes_the_prompt_or_messages_as_input() -> None:
    """A prompt or a message list goes as `input`; no stream_options (usage comes unasked);
    a Batch line's own body keeps its url's API."""
    api, body = build_request({"id": "a", "prompt": "hi"}, model="m",
                              params={"max_output_tokens": 9}, api="responses")  # fmt: skip
    assert (api, body) == ("responses", {"model": "m", "max_output_tokens": 9, "input": "hi",
                                         "stream": True})  # fmt: skip
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    _, body = build_request({"id": "a", "messages": messages}, model="m", params={},
                            api="responses")  # fmt: skip
    assert body["input"] == messages and "stream_options" not in body
    api, body = build_request({"id": "a", "body": {"input": "x"}, "url": "/v1/responses"},
                              model="m", params={}, api="chat")  # fmt: skip
    assert (api, body) == ("responses", {"input": "x", "model": "m", "stream": True})
    assert prompt_chars({"body": {"input": "four"}}) == 4
    assert prompt_chars({"body": {"input": messages}}) == len("be brief") + len("hi")


def _job(tmp_path: Path, **sections: Any) -> Path:
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    job = {"endpoint": {"base_url": "sim://", "api": "responses", "model": "m"},
           "input": {"path": "in.jsonl"}, **sections}  # fmt: skip
    path = tmp_path / "job.yaml"
    path.write_bytes(orjson.dumps(job))  # JSON is YAML
    return path


def test_the_job_names_the_token_limit_of_this_api(tmp_path: Path) -> None:
    """params.max_tokens would fail every request: refused before any, naming the key to
    use. A system prompt (a message list) is fine with this API."""
    with pytest.raises(SpecError) as info:
        load_job(_job(tmp_path, params={"max_tokens": 5}), env={}, flags={})
    assert str(info.value).endswith(
        "params.max_tokens does not apply to the Responses API (endpoint.api is 'responses'): "
        "give the token limit as params.max_output_tokens")
    job = load_job(_job(tmp_path, params={"max_output_tokens": 5},
                        input={"path": "in.jsonl", "system_prompt": "be brief"}), env={},
                   flags={})
    assert job.spec.endpoint.api == "responses"


def test_a_batch_output_line_holds_a_response_object() -> None:
    result = {"id": "q1", "output": "", "finish_reason": "length", "reasoning": "hm",
              "tool_calls": [{"id": "call_1", "type": "function",
                              "function": {"name": "f", "arguments": "{}"}}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 4}, "released_at": 9.5}
    line = batch_output_line(result, "req_abc", model="m", api="responses")
    body = line["response"]["body"]
    assert (line["custom_id"], body["object"], body["status"]) == ("q1", "response", "incomplete")
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in body["output"]] == ["reasoning", "function_call"]
    assert body["output"][1] == {"id": "fc_abc_0", "type": "function_call",
                                 "status": "completed", "call_id": "call_1", "name": "f",
                                 "arguments": "{}"}  # fmt: skip
    assert body["usage"] == {"input_tokens": 3, "output_tokens": 4, "total_tokens": 7}
    reader = ResponsesReader()
    assert read_whole_response(orjson.dumps(body), reader) == ""
    assert reader.tool_call_list() == result["tool_calls"] and reader.finish_reason == "length"

"""The simulator's Responses API (`POST /v1/responses`) over real loopback HTTP: the typed event
stream (order, sequence numbers, deltas against the final object), reasoning, function calls
with prose arguments, the max_output_tokens cut, whole answers, 400s, faults and the schedule."""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from typing import Any

import aiohttp
import orjson
import pytest

from shardrun.sim import SimConfig
from shardrun.sim.config import TEXT_WORDS, Plan, make_plan
from shardrun.sim.render import ResponseFrames, render_stream
from shardrun.sim.server import Sim
from tests.test_sim import Recorder, run, serving

BODY: dict[str, Any] = {"model": "m", "input": "Say something nice."}
TOOL = {"type": "function", "name": "shout", "parameters": {"type": "object"}}
FAST = SimConfig(ttft_ms=5, itl_ms=1, tokens="uniform:8:24", flush_ms=5)
URL = "/v1/responses"


def parse(raw: bytes) -> list[dict[str, Any]]:
    """The events of a Responses stream, checked for the wire format: each `event: TYPE` then
    `data: JSON` of that type, sequence numbers 0, 1, 2..., no [DONE]."""
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw
    events = []
    for block in raw.split(b"\n\n")[:-1]:
        head, data = block.split(b"\n")
        assert head.startswith(b"event: ") and data.startswith(b"data: "), block
        event = orjson.loads(data[len(b"data: "):])
        assert event["type"] == head[len(b"event: "):].decode()
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def stream(session: aiohttp.ClientSession, root: str, body: dict[str, Any]) -> bytes:
    """The raw body of a streamed Responses request (status 200, an event stream)."""
    async with session.post(root + URL, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return await resp.read()


def plan_of(body: dict[str, Any], cfg: SimConfig) -> Plan:
    return make_plan(orjson.dumps(body), "responses", cfg)


def texts(plan: Plan) -> tuple[str, str]:
    """(reasoning, answer) text of a plan."""
    words = TEXT_WORDS[plan.text]
    return ("".join(words[i] for i in plan.words[: plan.thinking]),
            "".join(words[i] for i in plan.words[plan.thinking :]))  # fmt: skip


def deltas(events: list[dict[str, Any]], kind: str) -> str:
    return "".join(e["delta"] for e in events if e["type"] == f"response.{kind}.delta")


def check_usage(response: dict[str, Any], plan: Plan) -> None:
    n, p = len(plan.words), plan.prompt_tokens
    assert response["usage"] == {
        "input_tokens": p, "input_tokens_details": {"cached_tokens": plan.cached},
        "output_tokens": n,
        "output_tokens_details": {"reasoning_tokens": plan.thinking},
        "total_tokens": p + n}  # fmt: skip


def types(events: list[dict[str, Any]]) -> list[str]:
    """Event types without the "response." prefix, runs of one delta type squeezed to one."""
    short = [e["type"].removeprefix("response.") for e in events]
    return [t for t, _ in itertools.groupby(short)]


MESSAGE_TYPES = ["output_item.added", "content_part.added", "output_text.delta",
                 "output_text.done", "content_part.done", "output_item.done"]  # fmt: skip
REASONING_TYPES = ["output_item.added", "reasoning_text.delta", "output_item.done"]


def test_plain_answer_streams_typed_events_that_add_up_to_the_final_response() -> None:
    """created, in_progress, a message item's events, completed: the deltas are the plan's
    words, one per token, and the final response holds the same text and the plan's usage."""
    plan = plan_of(BODY, FAST)

    async def go() -> list[dict[str, Any]]:
        async with serving(FAST) as (s, root):
            return parse(await stream(s, root, BODY))

    events = run(go())
    assert types(events) == ["created", "in_progress", *MESSAGE_TYPES, "completed"]
    text_deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    answer = texts(plan)[1]
    assert len(text_deltas) == len(plan.words) and 8 <= len(plan.words) <= 24
    assert deltas(events, "output_text") == answer and plan.thinking == 0
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None and created["id"].startswith("resp_")
    assert (final["id"], final["object"], final["model"]) == (created["id"], "response", "m")
    assert final["status"] == "completed" and "incomplete_details" not in final
    [message] = final["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "completed" and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "text": answer, "annotations": []}]
    assert events[-2]["item"] == message  # output_item.done
    assert {e["item_id"] for e in text_deltas} == {message["id"]}
    assert {(e["output_index"], e["content_index"]) for e in text_deltas} == {(0, 0)}
    assert [e["text"] for e in events if e["type"] == "response.output_text.done"] == [answer]
    check_usage(final, plan)


def test_a_summary_asked_for_comes_as_openai_sends_one() -> None:
    """`reasoning: {summary: auto}` in the request: the thought comes as a summary part's
    deltas (summary_index 0) between its added and done events, and the final reasoning item
    holds it as its summary, with no content; the project's reader takes it as reasoning."""
    from shardrun._responses import ResponsesReader

    cfg = dataclasses.replace(FAST, reasoning_tokens=4)
    body = {**BODY, "reasoning": {"summary": "auto"}}
    plan = plan_of(body, cfg)
    thought, answer = texts(plan)
    assert plan.summary and not plan_of(BODY, cfg).summary

    async def go() -> bytes:
        async with serving(cfg) as (s, root):
            return await stream(s, root, body)

    raw = run(go())
    events = parse(raw)
    assert types(events)[:8] == ["created", "in_progress", "output_item.added",
                                 "reasoning_summary_part.added", "reasoning_summary_text.delta",
                                 "reasoning_summary_text.done", "reasoning_summary_part.done",
                                 "output_item.done"]  # fmt: skip
    assert deltas(events, "reasoning_summary_text") == thought
    assert {e["summary_index"] for e in events if "summary_index" in e} == {0}
    item = events[-1]["response"]["output"][0]
    assert item["summary"] == [{"type": "summary_text", "text": thought}] and "content" not in item
    reader, pieces = ResponsesReader(), list[str]()
    reader.read([block.split(b"data: ", 1)[1] for block in raw.split(b"\n\n")[:-1]], pieces)
    assert ("".join(reader.reasoning), "".join(pieces)) == (thought, answer)


def test_a_custom_tool_is_called_with_the_words_as_its_input() -> None:
    """A custom tool first in `tools` (free-text input): a custom_tool_call item whose input
    deltas are the plan's words as text (escaped once, not as JSON inside JSON), its done
    event, and the item whole in the final response; finish as a call."""
    cfg = dataclasses.replace(FAST, text="prose")
    body = {**BODY, "tools": [{"type": "custom", "name": "shell"}]}
    plan = plan_of(body, cfg)
    _, answer = texts(plan)
    assert (plan.tool, plan.custom, plan.finish) == ("shell", True, "tool_calls")

    async def go() -> list[dict[str, Any]]:
        async with serving(cfg) as (s, root):
            return parse(await stream(s, root, body))

    events = run(go())
    assert types(events) == ["created", "in_progress", "output_item.added",
                             "custom_tool_call_input.delta", "custom_tool_call_input.done",
                             "output_item.done", "completed"]  # fmt: skip
    assert deltas(events, "custom_tool_call_input") == answer
    [item] = events[-1]["response"]["output"]
    assert (item["type"], item["name"], item["input"]) == ("custom_tool_call", "shell", answer)
    assert item["call_id"].startswith("call_") and events[-2]["item"] == item


@pytest.mark.parametrize("tools", [False, True])
def test_a_refusal_streams_as_refusal_events(tools: bool) -> None:
    """refusal: 1 makes the message a refusal: refusal deltas (the plan's words), its done
    event, and a refusal part in the final response, even where a tool would be called; the
    project's reader takes it as a refusal and no answer."""
    from shardrun._responses import ResponsesReader

    cfg = dataclasses.replace(FAST, refusal=1.0, reasoning_tokens=2)
    body = {**BODY, **({"tools": [TOOL]} if tools else {})}
    plan = plan_of(body, cfg)
    thought, refusal = texts(plan)
    assert plan.refused and plan.tool is None and plan.finish == "stop"

    async def go() -> bytes:
        async with serving(cfg) as (s, root):
            return await stream(s, root, body)

    raw = run(go())
    events = parse(raw)
    refusal_types = [t.replace("output_text", "refusal") for t in MESSAGE_TYPES]
    assert types(events) == ["created", "in_progress", *REASONING_TYPES, *refusal_types,
                             "completed"]  # fmt: skip
    assert deltas(events, "refusal") == refusal
    final = events[-1]["response"]
    assert final["output"][-1]["content"] == [{"type": "refusal", "refusal": refusal}]
    assert [e["refusal"] for e in events if e["type"] == "response.refusal.done"] == [refusal]
    reader, pieces = ResponsesReader(), list[str]()
    reader.read([block.split(b"data: ", 1)[1] for block in raw.split(b"\n\n")[:-1]], pieces)
    assert (pieces, "".join(reader.refusal), "".join(reader.reasoning)) == ([], refusal, thought)
    assert reader.finish_reason == "stop" and reader.tool_calls == {}


def test_reasoning_then_message() -> None:
    """reasoning_tokens: a reasoning item at output index 0 whose deltas are its text, then the
    message at index 1; usage counts the reasoning in the output tokens."""
    cfg = SimConfig(ttft_ms=5, itl_ms=1, tokens="10", flush_ms=5, reasoning_tokens=4)
    plan = plan_of(BODY, cfg)

    async def go() -> list[dict[str, Any]]:
        async with serving(cfg) as (s, root):
            return parse(await stream(s, root, BODY))

    events = run(go())
    assert types(events) == ["created", "in_progress", *REASONING_TYPES, *MESSAGE_TYPES,
                             "completed"]  # fmt: skip
    thought, answer = texts(plan)
    final = events[-1]["response"]
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": thought}]
    assert events[2]["item"] == {"id": reasoning["id"], "type": "reasoning", "summary": []}
    thought_deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    assert len(thought_deltas) == 4 and deltas(events, "reasoning_text") == thought
    assert {(e["item_id"], e["output_index"]) for e in thought_deltas} == {(reasoning["id"], 0)}
    assert message["content"][0]["text"] == answer == deltas(events, "output_text")
    assert {e["output_index"] for e in events if "output_text" in e["type"]} == {1}
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [(e["output_index"], e["item"]) for e in done] == [(0, reasoning), (1, message)]
    assert final["usage"]["output_tokens"] == 14
    check_usage(final, plan)


def test_reasoning_then_function_call_with_prose_arguments() -> None:
    """With tools (flat, as Responses sends them) the answer calls the first one: its argument
    pieces, JSON inside JSON with prose's quotes, breaks, backslashes and tabs, join to exactly
    {"text": TEXT}, the done event's and the item's arguments."""
    cfg = SimConfig(ttft_ms=5, itl_ms=1, tokens="40", flush_ms=5, text="prose",
                    reasoning_tokens=6)  # fmt: skip
    body = {**BODY, "tools": [TOOL, {**TOOL, "name": "other"}]}
    plan = plan_of(body, cfg)
    thought, answer = texts(plan)
    assert set(answer) & set('\n"\\\t') and set(thought + answer) - set('\n"\\\t')

    async def go() -> list[dict[str, Any]]:
        async with serving(cfg) as (s, root):
            return parse(await stream(s, root, body))

    events = run(go())
    assert types(events) == ["created", "in_progress", *REASONING_TYPES, "output_item.added",
                             "function_call_arguments.delta", "function_call_arguments.done",
                             "output_item.done", "completed"]  # fmt: skip
    added = events[3 + 6 + 1]
    assert added["output_index"] == 1 and added["item"]["status"] == "in_progress"
    assert (added["item"]["name"], added["item"]["arguments"]) == ("shout", "")
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) == 40 + 2 and pieces[0] == '{"text":"' and pieces[-1] == '"}'
    arguments = "".join(pieces)
    assert arguments == orjson.dumps({"text": answer}).decode()
    assert orjson.loads(arguments) == {"text": answer}
    [args_done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    final = events[-1]["response"]
    reasoning, call = final["output"]
    assert args_done["arguments"] == call["arguments"] == arguments
    assert call == {"id": added["item"]["id"], "type": "function_call", "status": "completed",
                    "call_id": added["item"]["call_id"], "name": "shout",
                    "arguments": arguments}  # fmt: skip
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert deltas(events, "reasoning_text") == thought == reasoning["content"][0]["text"]
    assert final["status"] == "completed"
    check_usage(final, plan)


def test_max_output_tokens_cuts_to_an_incomplete_response() -> None:
    """max_output_tokens caps reasoning and answer together: response.incomplete with reason
    max_output_tokens; a cap inside the reasoning leaves no answer item at all."""
    cfg = SimConfig(ttft_ms=1, itl_ms=0, tokens="50", reasoning_tokens=5)
    cut = {**BODY, "max_output_tokens": 8}
    thought_only = {**BODY, "max_output_tokens": 3, "tools": [TOOL]}

    async def go() -> tuple[list[dict[str, Any]], ...]:
        async with serving(cfg) as (s, root):
            return (parse(await stream(s, root, cut)), parse(await stream(s, root, thought_only)),
                    parse(await stream(s, root, BODY)))  # fmt: skip

    capped, short, free = run(go())
    final = capped[-1]
    assert final["type"] == "response.incomplete"
    response = final["response"]
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == 8
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": 5}
    assert len(deltas(capped, "output_text").split()) == 3
    assert deltas(free, "output_text").startswith(deltas(capped, "output_text"))  # cut, same words
    assert free[-1]["type"] == "response.completed"
    assert types(short) == ["created", "in_progress", *REASONING_TYPES, "incomplete"]
    [reasoning] = short[-1]["response"]["output"]
    assert reasoning["type"] == "reasoning" and len(reasoning["content"][0]["text"].split()) == 3
    check_usage(short[-1]["response"], plan_of(thought_only, cfg))


def without_ids(obj: Any) -> Any:
    """The object with its request id and timestamp stood for by placeholders."""
    text = re.sub(r'sim\d+"', 'RID"', orjson.dumps(obj).decode())
    return orjson.loads(re.sub(r'"created_at":\d+', '"created_at":0', text))


@pytest.mark.parametrize("reasoning", [0, 3])
@pytest.mark.parametrize("tools", [False, True])
def test_whole_answer_is_the_streamed_final_response(reasoning: int, tools: bool) -> None:
    """stream false, and stream true with ignore_stream, answer one JSON response object equal
    (ids and time aside) to the final event's response of the stream."""
    cfg = SimConfig(ttft_ms=5, itl_ms=1, flush_ms=5, text="prose", reasoning_tokens=reasoning,
                    cached_tokens=2)  # fmt: skip
    body = {**BODY, **({"tools": [TOOL]} if tools else {})}

    async def go() -> tuple[list[dict[str, Any]], Any, Any]:
        async with serving(cfg) as (s, root):
            events = parse(await stream(s, root, body))
            async with s.post(root + URL, json=body) as resp:
                assert resp.headers["Content-Type"].startswith("application/json")
                whole = await resp.json()
        async with serving(dataclasses.replace(cfg, ignore_stream=True)) as (s, root), s.post(
                root + URL, json={**body, "stream": True}) as resp:  # fmt: skip
            assert resp.headers["Content-Type"].startswith("application/json")
            ignored = await resp.json()
        return events, whole, ignored

    events, whole, ignored = run(go())
    final = events[-1]["response"]
    assert whole["id"] != final["id"] and whole["object"] == "response"
    assert without_ids(whole) == without_ids(final) == without_ids(ignored)
    assert len(final["output"]) == 1 + (reasoning > 0)
    assert final["output"][-1]["type"] == ("function_call" if tools else "message")
    check_usage(whole, plan_of(body, cfg))
    assert whole["usage"]["input_tokens_details"] == {"cached_tokens": 2}


def test_same_input_same_bytes_and_the_same_words_as_chat() -> None:
    """Two streams of one request differ only in ids and times; an input list of messages gives
    the words chat gives those messages; another input gives other words."""
    messages = [{"role": "user", "content": "Say something nice."}]
    body = {"input": messages}
    parts = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}

    async def go() -> tuple[bytes, bytes, bytes]:
        async with serving(FAST) as (s, root):
            return (await stream(s, root, body), await stream(s, root, body),
                    await stream(s, root, parts))  # fmt: skip

    a, b, other = run(go())
    assert a != b and re.sub(rb"sim\d+|\d{10}", b"X", a) == re.sub(rb"sim\d+|\d{10}", b"X", b)
    chat = make_plan(orjson.dumps({"messages": messages}), "chat", FAST)
    assert deltas(parse(a), "output_text") == "".join(TEXT_WORDS["words"][i] for i in chat.words)
    assert deltas(parse(other), "output_text") != deltas(parse(a), "output_text")
    assert plan_of(parts, FAST).prompt_tokens == 1  # "Hi": the parts' text is counted


def test_tool_choice_none_answers_with_a_message() -> None:
    """tool_choice "none" turns the tools down: a message, as chat does."""

    async def go() -> list[dict[str, Any]]:
        async with serving(FAST) as (s, root):
            return parse(await stream(s, root, {**BODY, "tools": [TOOL], "tool_choice": "none"}))

    events = run(go())
    assert [item["type"] for item in events[-1]["response"]["output"]] == ["message"]
    assert not any("function_call" in e["type"] for e in events)


def test_stream_options_is_not_this_apis_and_is_ignored() -> None:
    """stream_options, even of a bad shape or with reject_stream_options, changes nothing."""
    cfg = SimConfig(ttft_ms=1, itl_ms=0, tokens="6", reject_stream_options=True)

    async def go() -> list[dict[str, Any]]:
        async with serving(cfg) as (s, root):
            return parse(await stream(s, root, {**BODY, "stream_options": "no"}))

    events = run(go())
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["usage"]["output_tokens"] == 6


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"input": 5}, "input"),
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": ["hi"]}, "input"),
        ({"input": [{"role": "user"}]}, "input"),
        ({"input": [{"content": "hi"}]}, "input"),
        ({"input": [{"type": 5, "output": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": 3}]}, "input"),
        ({**BODY, "max_output_tokens": 0}, "max_output_tokens"),
        ({**BODY, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({**BODY, "stream": "yes"}, "stream"),
    ],
)
def test_bad_body_gives_400_naming_the_parameter(body: dict[str, Any], param: str) -> None:
    """A body no Responses server accepts is a 400 with an OpenAI error object naming it."""

    async def go() -> dict[str, Any]:
        async with serving(FAST) as (s, root), s.post(root + URL, json=body) as resp:
            assert resp.status == 400
            error: dict[str, Any] = (await resp.json())["error"]
            return error

    error = run(go())
    assert error["type"] == "invalid_request_error" and error["message"] and error["code"]
    assert error["param"] == param


def test_an_earlier_turns_items_are_taken_as_input() -> None:
    """A conversation that carries a tool's call and its output as typed items (no role), as
    a multi-turn job sends them: answered, and its output depends on those items too."""
    turn = [{"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "c1", "name": "weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "rain, 4 C"}]
    other = [*turn[:2], {**turn[2], "output": "sun, 20 C"}]

    async def go() -> list[dict[str, Any]]:
        async with serving(FAST) as (s, root):
            answers = []
            for items in (turn, other):
                async with s.post(root + URL, json={"model": "m", "input": items}) as resp:
                    assert resp.status == 200, await resp.text()
                    answers.append(await resp.json())
            return answers

    first, second = run(go())
    assert first["status"] == second["status"] == "completed"
    said = [[part["text"] for part in answer["output"][-1]["content"]]
            for answer in (first, second)]  # fmt: skip
    assert said[0] != said[1]
    assert plan_of({"model": "m", "input": turn}, FAST).prompt_tokens == (
        len("Weather in Oslo?") + len('{"city": "Oslo"}') + len("rain, 4 C") + 3) // 4


def test_faults_apply_to_responses() -> None:
    """fail_first_n: the first request gets a 503, the next streams; drop_mid_stream resets a
    stream after some token events and before the final one; /sim/stats counts the path."""
    drop = SimConfig(ttft_ms=1, itl_ms=2, tokens="100", flush_ms=5, drop_mid_stream=1.0)

    async def go() -> tuple[int, list[dict[str, Any]], bytes, BaseException | None, Any]:
        async with serving(SimConfig(ttft_ms=1, itl_ms=0, tokens="4", fail_first_n=1)) as (
                s, root):  # fmt: skip
            async with s.post(root + URL, json={**BODY, "stream": True}) as resp:
                status = resp.status
                assert (await resp.json())["error"]["type"] == "server_error"
            events = parse(await stream(s, root, BODY))
            async with s.get(root + "/sim/stats") as resp:
                st = await resp.json()
        raw, error = b"", None
        async with serving(drop) as (s, root):
            try:
                async with s.post(root + URL, json={**BODY, "stream": True}) as resp:
                    async for chunk in resp.content.iter_any():
                        raw += chunk
            except aiohttp.ClientError as e:
                error = e
        return status, events, raw, error, st

    status, events, raw, error, st = run(go())
    assert status == 503 and events[-1]["type"] == "response.completed"
    assert st["by_path"] == {URL: 2} and st["completed"] == 1
    assert st["completion_tokens_total"] == 4 and st["faults"]["fail_first_n"] == 1
    assert error is not None
    dropped = parse(raw[: raw.rindex(b"\n\n") + 2])
    assert 10 <= deltas(dropped, "output_text").count(" ") <= 90
    assert dropped[-1]["type"] == "response.output_text.delta"


def test_a_stall_splits_the_stream_without_breaking_its_numbering() -> None:
    """stall_mid_stream pauses after about half the tokens; the stream then finishes whole."""
    cfg = SimConfig(ttft_ms=1, itl_ms=0, tokens="9", reasoning_tokens=3, stall_mid_stream=1.0,
                    stall_s=0.2)  # fmt: skip

    async def go() -> tuple[float, list[dict[str, Any]]]:
        async with serving(cfg) as (s, root):
            t0 = time.monotonic()
            raw = await stream(s, root, BODY)
            return time.monotonic() - t0, parse(raw)

    elapsed, events = run(go())
    assert elapsed >= 0.2 and events[-1]["type"] == "response.completed"
    thought, answer = texts(plan_of(BODY, cfg))
    assert (deltas(events, "reasoning_text"), deltas(events, "output_text")) == (thought, answer)


CASES = [({}, 0), ({}, 3), ({"tools": [TOOL]}, 0), ({"tools": [TOOL]}, 3),
         ({"tools": [TOOL], "max_output_tokens": 2}, 3), ({"max_output_tokens": 3}, 3)]  # fmt: skip


@pytest.mark.parametrize(("extra", "reasoning"), CASES)
def test_events_are_the_same_however_the_writes_split_the_tokens(extra: dict[str, Any],
                                                                 reasoning: int) -> None:
    """Any run of writes (as the schedule or a stall cuts them) gives the same bytes: every
    framing event once, in order, next to its tokens, the numbering unbroken."""
    cfg = SimConfig(tokens="5", text="prose", reasoning_tokens=reasoning)
    plan = plan_of({**BODY, **extra}, cfg)
    frames = render_stream(plan, "sim1", 0)
    assert isinstance(frames, ResponseFrames)
    words = plan.words
    whole = frames.role + frames.tokens(words) + frames.end
    events = parse(whole)
    token_events = [e for e in events if e["type"].endswith(".delta") and not (
        e["type"].startswith("response.function_call") and e["delta"] in ('{"text":"', '"}'))]
    assert len(token_events) == len(words)  # fmt: skip
    for cuts in itertools.combinations(range(1, len(words)), 2):
        bounds = [0, *cuts, len(words)]
        parts = [frames.tokens(words[a:b], a) for a, b in itertools.pairwise(bounds)]
        assert frames.role + b"".join(parts) + frames.end == whole, cuts
        # Each write's events end at a token: framing never goes out on its own.
        assert all(p.rstrip(b"\n").endswith((b'"}', b"[]}")) for p in parts)


def test_emit_schedules_response_tokens_like_chat() -> None:
    """Sim.emit writes a Responses stream as chat's: one write when itl is 0, else several
    >= flush apart, the first carrying created and the last the final event."""
    plan = plan_of(BODY, SimConfig(tokens="60", reasoning_tokens=10))
    frames = render_stream(plan, "sim1", 0)

    async def emit(cfg: SimConfig) -> list[tuple[float, bytes]]:
        rec = Recorder()
        await Sim(cfg).emit(rec, frames, plan.words)  # type: ignore[arg-type]
        assert b"".join(d for _, d in rec.writes).removesuffix(b"<eof>") == (
            frames.role + frames.tokens(plan.words) + frames.end)  # fmt: skip
        return rec.writes

    assert len(run(emit(SimConfig(itl_ms=0)))) == 1
    writes = run(emit(SimConfig(itl_ms=5, flush_ms=40)))  # ~350 ms of tokens
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(writes)]
    assert 3 <= len(writes) <= 12 and min(gaps) >= 0.039
    assert writes[0][1].startswith(b"event: response.created\n")
    assert b"response.completed" in writes[-1][1] and writes[-1][1].endswith(b"<eof>")
    assert all(b"response.completed" not in d for _, d in writes[:-1])

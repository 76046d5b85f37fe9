"""OpenAI Batch API output files, rebuilt from a run's result and dead-letter lines.

A job whose input was an OpenAI Batch file (or any job with `output.format: openai-batch`) can
end with the two files the Batch API itself would return, so tools written for that API read
a shardrun run unchanged:

    batch_output.jsonl   one line per result: {id, custom_id, response: {status_code: 200,
                         request_id, body: chat.completion | text_completion | response},
                         error: null}
    batch_errors.jsonl   one line per dead letter: {id, custom_id, response: {status_code,
                         request_id, body: {error}} or null when no HTTP status came back,
                         error: {code, message}}

`custom_id` is the item id. `error.code` is the last attempt's shardrun status (`http_429`,
`timeout_total`, ... see docs/ARCHITECTURE.md), or `not_sent` when no attempt was made.
Ids are derived from the run id and the span, so converting a run twice gives identical files.
The converters are pure; `write_batch_files` streams, holding one line at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import orjson

__all__ = ["batch_error_line", "batch_output_line", "request_id_for", "write_batch_files"]

OUTPUT_NAME = "batch_output.jsonl"
ERRORS_NAME = "batch_errors.jsonl"
_COMPLETIONS_URL = "/v1/completions"
_RESPONSES_URL = "/v1/responses"


def request_id_for(run_id: str, span: str) -> str:
    """A stable `req_...` id for one span of one run."""
    digest = hashlib.blake2b(f"{run_id}/{span}".encode(), digest_size=12).hexdigest()
    return f"req_{digest}"


def batch_output_line(
    result: Mapping[str, Any], request_id: str, *, model: str = "", api: str = "chat"
) -> dict[str, Any]:
    """One Batch API output line from a results/ line.

    The object type follows the item's `url` when the result carries one (OpenAI Batch
    input), else `api`; the model is the result's own `model` when present, else `model`.
    """
    url = result.get("url")
    completions = url == _COMPLETIONS_URL if url is not None else api == "completions"
    responses = url == _RESPONSES_URL if url is not None else api == "responses"
    usage = result.get("usage") or {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    total = prompt + completion if isinstance(prompt, int) and isinstance(completion, int) else None
    suffix = request_id.removeprefix("req_")
    cached, spent = usage.get("cached_tokens"), usage.get("reasoning_tokens")
    if responses:
        counts = {"input_tokens": prompt, "output_tokens": completion, "total_tokens": total}
        _details(counts, cached, spent, "input_tokens_details", "output_tokens_details")
        body = _response_body(result, suffix, result.get("model") or model, counts)
        return _output_line(result, request_id, body)
    choice: dict[str, Any] = {"index": 0}
    if completions:
        choice["text"] = result.get("output", "")
    else:
        message = choice["message"] = {"role": "assistant", "content": result.get("output", "")}
        # As OpenAI's own message holds them: a call's answer has content null.
        if result.get("reasoning") is not None:
            message["reasoning_content"] = result["reasoning"]
        if result.get("tool_calls") is not None:
            message["tool_calls"] = result["tool_calls"]
            message["content"] = message["content"] or None
        if result.get("refusal") is not None:
            message["refusal"] = result["refusal"]
            message["content"] = message["content"] or None
        if result.get("function_call") is not None:  # the older `functions` form
            message["function_call"] = result["function_call"]
            message["content"] = message["content"] or None
    choice.update(logprobs=None, finish_reason=result.get("finish_reason"))
    body = {
        "id": f"{'cmpl' if completions else 'chatcmpl'}-{suffix}",
        "object": "text_completion" if completions else "chat.completion",
        "created": int(result.get("released_at") or 0),
        "model": result.get("model") or model,
        "choices": [choice],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total},
    }
    _details(body["usage"], cached, spent, "prompt_tokens_details", "completion_tokens_details")
    return _output_line(result, request_id, body)


def _details(usage: dict[str, Any], cached: object, spent: object, prompt: str,
             completion: str) -> None:  # fmt: skip
    """The server's counts of cached and reasoning tokens, where the result has them, in the
    usage object's details as the API holds them."""
    if cached is not None:
        usage[prompt] = {"cached_tokens": cached}
    if spent is not None:
        usage[completion] = {"reasoning_tokens": spent}


def _output_line(result: Mapping[str, Any], request_id: str,
                 body: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    return {
        "id": f"batch_{request_id}",
        "custom_id": str(result["id"]),
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def _response_body(result: Mapping[str, Any], suffix: str, model: str,
                   usage: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """A Responses API object for a result: its reasoning, function calls and message as
    output items, in that order; status "incomplete" when the token limit cut it."""
    output: list[dict[str, Any]] = []
    if result.get("reasoning") is not None:
        output.append({"id": f"rs_{suffix}", "type": "reasoning", "summary": [],
                       "content": [{"type": "reasoning_text", "text": result["reasoning"]}]})
    for i, call in enumerate(result.get("tool_calls") or []):
        if call.get("type") == "custom":
            custom = call.get("custom") or {}
            output.append({"id": f"ctc_{suffix}_{i}", "type": "custom_tool_call",
                           "status": "completed", "call_id": call.get("id"),
                           "name": custom.get("name"), "input": custom.get("input")})
            continue
        function = call.get("function") or {}
        output.append({"id": f"fc_{suffix}_{i}", "type": "function_call", "status": "completed",
                       "call_id": call.get("id"), "name": function.get("name"),
                       "arguments": function.get("arguments")})  # fmt: skip
    text, refusal = result.get("output", ""), result.get("refusal")
    if text or refusal is not None or not output:
        parts: list[dict[str, Any]] = []
        if text or refusal is None:
            parts.append({"type": "output_text", "text": text, "annotations": []})
        if refusal is not None:
            parts.append({"type": "refusal", "refusal": refusal})
        output.append({"id": f"msg_{suffix}", "type": "message", "status": "completed",
                       "role": "assistant", "content": parts})
    cut = result.get("finish_reason") == "length"
    body: dict[str, Any] = {
        "id": f"resp_{suffix}", "object": "response", "created_at": int(
            result.get("released_at") or 0),
        "status": "incomplete" if cut else "completed", "model": model, "output": output,
        "usage": usage,
    }  # fmt: skip
    if cut:
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


def batch_error_line(dead: Mapping[str, Any], request_id: str = "") -> dict[str, Any]:
    """One Batch API error-file line from a dead/ line (its last attempt decides the code)."""
    attempts = dead.get("attempts") or []
    last: Mapping[str, Any] = attempts[-1] if attempts else {}
    code = str(last.get("status") or "not_sent")
    message = str(dead.get("reason") or last.get("error") or code)
    http = last.get("http")
    response = None
    if isinstance(http, int):
        error_body = {"message": last.get("error") or message, "type": code, "code": code}
        response = {"status_code": http, "request_id": request_id, "body": {"error": error_body}}
    return {
        "id": f"batch_{request_id}" if request_id else None,
        "custom_id": str(dead["id"]),
        "response": response,
        "error": {"code": code, "message": message},
    }


def write_batch_files(run_dir: Path, model: str, api: str = "chat", *,
                      run_id: str | None = None) -> tuple[Path, Path]:
    """Stream results/*.jsonl and dead/*.jsonl into the two Batch files in `run_dir`.

    The request ids are the run's own (`run_id`, the manifest's): a run renamed and resumed
    keeps the ids its earlier passes gave (the directory's name when none is given).

    Each file is written under a temporary name and renamed into place, so a reader never
    sees half a file. Returns (batch_output.jsonl, batch_errors.jsonl).
    """
    run_id = run_id or run_dir.name
    output, errors = run_dir / OUTPUT_NAME, run_dir / ERRORS_NAME
    with _atomic(output) as out:
        for record in _records(run_dir / "results"):
            rid = request_id_for(run_id, str(record.get("span", record["id"])))
            out.write(orjson.dumps(batch_output_line(record, rid, model=model, api=api)) + b"\n")
    with _atomic(errors) as out:
        for record in _records(run_dir / "dead"):
            rid = request_id_for(run_id, str(record.get("span", record["id"])))
            out.write(orjson.dumps(batch_error_line(record, rid)) + b"\n")
    return output, errors


def _records(folder: Path) -> Iterator[dict[str, Any]]:
    """The JSON lines of every file in `folder`, file by file; blank and torn lines (a crash
    mid-write leaves at most one, at the end of a file) are skipped."""
    for path in sorted(folder.glob("*.jsonl")):
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(record, dict) and "id" in record:
                    yield record


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[IO[bytes]]:
    """Write `path.tmp`, then rename it to `path` on success (remove it on failure)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
        os.replace(tmp, path)
    except OSError as exc:
        if exc.filename is None:  # a write's error names no file: the message must
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    finally:
        tmp.unlink(missing_ok=True)

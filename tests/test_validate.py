"""Tests for `shardrun validate`: input checks, the configuration table, exit codes, --ping."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import tracemalloc
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from rich.console import Console

from shardrun import cli_validate
from shardrun._chunks import keep_secret
from shardrun._urls import under_v1
from shardrun.sim.config import SimConfig
from shardrun.sim.launcher import start_sim
from shardrun.spec import load_job
from shardrun.validate import PingResult, check_input, config_rows, ping, run_ping
from tests.conftest import FAST_SIM, page_server, run_cli, write_job

ESCAPE = re.compile(r"\x1b")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No SHARDRUN_* variable from the outer environment leaks into these tests."""
    for name in [n for n in os.environ if n.upper().startswith("SHARDRUN_")]:
        monkeypatch.delenv(name)
    yield


def make_job(tmp_path: Path, lines: list[bytes], **overrides: Any) -> Path:
    """A sim:// job over an input of the given raw lines."""
    (tmp_path / "input.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    return write_job(tmp_path / "job.yaml", **overrides)


GOOD = [b'{"id": "a", "prompt": "hello there"}', b'{"id": "b", "prompt": "abcd"}']
BAD = [b"{broken", b'{"id": "c"}']


def validate(*argv: str) -> tuple[int, str]:
    """Parse `validate ARGV` through a parser built by `register`, run it, return the output."""
    parser = argparse.ArgumentParser(prog="shardrun")
    cli_validate.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["validate", *argv])
    out = StringIO()
    code = args.handler(args, out)
    return code, out.getvalue()


def test_register_adds_the_subcommand() -> None:
    """`register` adds validate with its options and a handler taking the Namespace."""
    parser = argparse.ArgumentParser()
    cli_validate.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["validate", "j.yaml", "--ping", "--show", "3", "--rpm", "none"])
    assert (args.ping, args.show, args.strict, args.rpm) == (True, 3, False, "none")
    assert args.handler is cli_validate.handle


def test_check_input_counts_and_keeps_first_rejects(tmp_path: Path) -> None:
    """Items, rejects with line numbers (only the first N kept), prompt characters."""
    path = make_job(tmp_path, [*GOOD, *BAD, b"", b'{"prompt": 5}'])
    check = check_input(load_job(path, env={}, flags={}), show=2)
    assert (check.items, check.rejects, check.lines) == (2, 3, 6)
    assert [(r.line, r.reason[:14]) for r in check.first_rejects] == [
        (3, "not valid JSON"), (4, "prompt field '")]  # fmt: skip
    assert check.prompt_chars == 15 and check.prompt_tokens_estimate == 4
    assert check.first_item == {"id": "a", "prompt": "hello there"}


def test_a_repeated_id_is_a_reject_as_in_a_run(tmp_path: Path) -> None:
    """An id an earlier line has is a rejected line, as a run counts it (and `--strict` stops
    on it), with the run's reason; the first of the two is the item."""
    path = make_job(tmp_path, [*GOOD, b'{"id": "a", "prompt": "again"}'])
    check = check_input(load_job(path, env={}, flags={}))
    assert (check.items, check.rejects) == (2, 1)
    assert [(r.line, r.reason) for r in check.first_rejects] == [
        (3, "duplicate id 'a' (an earlier line has it)")]  # fmt: skip
    assert validate(str(path), "--strict")[0] == 1


def test_a_file_of_one_line_over_the_limit_is_checked_holding_about_a_block(
        tmp_path: Path) -> None:
    """A file of one line and no line break (191 MB of a dump) peaked validate at 173 MB: its
    reader read the line to the 64 MiB limit, which `readline` held twice (its blocks and
    their join), to reject it. It is read past in blocks: one rejected line, every byte read."""
    path = write_job(tmp_path / "job.yaml")
    with open(tmp_path / "input.jsonl", "wb") as f:
        f.write(b'{"id": "big", "prompt": "')
        for _ in range(65):
            f.write(b"x" * (1 << 20))
    job = load_job(path, env={}, flags={})
    tracemalloc.start()
    try:
        check = check_input(job)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = (65 << 20) + len(b'{"id": "big", "prompt": "')
    assert (check.items, check.rejects, check.lines, check.bytes_read) == (0, 1, 1, size)
    assert check.first_rejects[0].reason.startswith(f"line is {size:,} bytes, longer than the")
    assert peak < (8 << 20), peak  # was 129 MiB: twice the limit


def test_a_request_larger_than_a_minute_of_the_tpm_share_is_warned(tmp_path: Path) -> None:
    """One item charged more than a shard's share of rate_limits.tpm for a whole minute waits
    minutes for its turn, which looks like a hang: validate names its line."""
    long_prompt = orjson.dumps({"id": "big", "prompt": "x" * 40_000})  # ~10,000 tokens
    path = make_job(tmp_path, [*GOOD, long_prompt], rate_limits={"tpm": 6000}, shards=2)
    code, text = validate(str(path))
    assert code == 0
    assert ("warning: line 3 is charged about 10,032 tokens (prompt / 4 + its token limit), "
            "more than a shard's share of rate_limits.tpm for a whole minute (3,000): such a "
            "request waits about 3.3 min for its turn") in text
    roomy = make_job(tmp_path, [*GOOD, long_prompt], rate_limits={"tpm": 60_000}, shards=2)
    assert "rate_limits.tpm for a whole minute" not in validate(str(roomy))[1]


def test_an_id_field_no_record_has_is_warned(tmp_path: Path) -> None:
    """A JSON lines job naming an id field its records lack (a typo: `uid` for `id`) gets ids
    derived from content, silently in a run: validate says so. The default field, absent, is
    the documented content-hash mode, and one record with the field is enough."""
    path = make_job(tmp_path, GOOD, input={"path": "input.jsonl", "id_field": "uid"})
    code, text = validate(str(path))
    assert code == 0 and ("warning: no record has input.id_field 'uid': every item's id is "
                          "derived from its content") in text
    assert "ids are derived from content" not in text  # warned: not said twice
    named = make_job(tmp_path, [*GOOD, b'{"uid": 1, "prompt": "x"}'],
                     input={"path": "input.jsonl", "id_field": "uid"})
    assert "warning: no record" not in validate(str(named))[1]
    no_ids = make_job(tmp_path, [b'{"uid": "a", "prompt": "a"}', b'{"prompt": "b"}'])
    text = validate(str(no_ids))[1]
    assert "warning: no record" not in text
    # Said, not warned: ids under another key than the default `id` passed without a word.
    assert "2 items (no record has 'id': ids are derived from content), 0 rejected" in text
    assert "derived from content" not in validate(str(make_job(tmp_path, GOOD)))[1]


def test_a_repeated_record_without_an_id_says_to_give_ids(tmp_path: Path) -> None:
    """Records without an id are named by their content: a repeat is a duplicate whose id the
    user never wrote, so the reject says what happened and how to have repeats answered."""
    same = b'{"prompt": "Write a haiku"}'
    path = make_job(tmp_path, [same, same, b'{"id": "h0123456789abcdef01234", "prompt": "x"}',
                               b'{"id": "h0123456789abcdef01234", "prompt": "y"}'])
    check = check_input(load_job(path, env={}, flags={}))
    assert [(r.line, r.reason) for r in check.first_rejects] == [
        (2, "the same content as an earlier line, and no id: a record without one is named by "
            "its content, so give each record an id (input.id_field) to have repeats answered "
            "each"),
        (4, "duplicate id 'h0123456789abcdef01234' (an earlier line has it)")]  # fmt: skip


def test_a_message_list_a_run_rejects_is_reported_by_validate(tmp_path: Path) -> None:
    """validate reads with the run's reader: a chat message list without a role or a content is
    a rejected line there too, with the same reason (and `--strict` exits 1)."""
    path = make_job(tmp_path, [
        b'{"id": "a", "msgs": [{"role": "user", "content": "hi"}]}',
        b'{"id": "b", "msgs": [{"role": "system", "content": "S"}, {"content": "Q"}]}',
        b'{"id": "c", "msgs": [{"role": "user", "content": [{"text": "Q"}]}]}',
    ], input={"path": "input.jsonl", "messages_field": "msgs"})
    check = check_input(load_job(path, env={}, flags={}))
    assert (check.items, check.rejects) == (1, 2)
    assert [(r.line, r.reason, r.id) for r in check.first_rejects] == [
        (2, "msgs[1] has no role", "b"), (3, "msgs[0] content[0] has no type", "c")]
    code, text = validate(str(path))
    assert code == 0 and "  line 2: msgs[1] has no role" in text
    assert "  line 3: msgs[0] content[0] has no type" in text
    assert validate(str(path), "--strict")[0] == 1


def test_message_lists_real_servers_take_are_items_for_validate(tmp_path: Path) -> None:
    """A role vLLM knows and the check does not (ipython, developer), a null or missing content of
    an assistant (tool calls, reasoning only), tool or function message: validate counts each an
    item, as a run reads it; a user message without content is still a rejected line."""
    path = make_job(tmp_path, [
        b'{"id": "a", "msgs": [{"role": "developer", "content": "S"}, '
        b'{"role": "user", "content": "Q"}, {"role": "assistant", "content": null, '
        b'"tool_calls": [{"id": "c", "type": "function"}]}, {"role": "ipython", "content": "4"}]}',
        b'{"id": "b", "msgs": [{"role": "user", "content": "Q"}, '
        b'{"role": "assistant", "reasoning_content": "hm"}, {"role": "tool", "content": null}, '
        b'{"role": "function", "name": "f"}]}',
        b'{"id": "c", "msgs": [{"role": "user"}]}',
    ], input={"path": "input.jsonl", "messages_field": "msgs"})
    check = check_input(load_job(path, env={}, flags={}))
    assert (check.items, check.rejects) == (2, 1)
    assert [(r.line, r.reason, r.id) for r in check.first_rejects] == [
        (3, "msgs[0] has no content", "c")]
    code, text = validate(str(path))
    assert code == 0 and "  line 3: msgs[0] has no content" in text
    assert "line 1" not in text and "line 2" not in text


def test_config_rows_say_where_values_came_from(tmp_path: Path) -> None:
    """Every effective value with its source, as text."""
    job = load_job(make_job(tmp_path, GOOD), env={"SHARDRUN_RPM": "120"}, flags={"shards": 3})
    rows = {key: (value, source) for key, value, source in config_rows(job)}
    assert rows["shards"] == ("3", "flag --shards")
    assert rows["rate_limits.rpm"] == ("120.0", "env SHARDRUN_RPM")
    assert rows["params"] == ('{"max_tokens":32}', "job file")
    assert rows["input.format"] == ("jsonl", "default")
    assert rows["endpoint.api"] == ("chat", "job file")


def test_config_rows_of_a_batch_input_mark_what_its_lines_decide(tmp_path: Path) -> None:
    """OpenAI Batch lines carry their own id and url: those two settings are marked unused."""
    line = orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "x"}})
    path = make_job(tmp_path, [line], input={"path": "input.jsonl", "format": "openai-batch"})
    job = load_job(path, env={}, flags={})
    rows = {key: (value, source) for key, value, source in config_rows(job)}
    assert rows["input.id_field"] == ("id", "default (not used: each line's custom_id is its id)")
    assert rows["endpoint.api"] == ("chat", "job file (not used: each line's url names its API)")
    assert rows["input.path"] == ("input.jsonl", "job file")


def test_plain_report_and_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a terminal: plain text, no escape codes; rejects warn (exit 0) unless --strict."""
    path = make_job(tmp_path, [*GOOD, *BAD])
    monkeypatch.setenv("SHARDRUN_TPM", "9000")
    code, text = validate(str(path), "--shards", "3")
    assert code == 0 and not ESCAPE.search(text)
    assert f"job: {path} is valid" in text
    assert "(jsonl): 2 items, 2 rejected lines" in text
    assert "  line 3: not valid JSON" in text
    assert "  line 4: prompt field 'prompt' is missing" in text
    assert "estimated as characters / 4" in text
    assert re.search(r"  shards +3 +flag --shards", text)
    assert re.search(r"  rate_limits\.tpm +9000\.0 +env SHARDRUN_TPM", text)
    assert validate(str(path), "--strict")[0] == 1
    assert validate(str(path), "--show", "1")[1].count("  line ") == 1


def test_input_path_written_from_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    """A job in a folder of its own whose input.path was written from where the command is
    typed (`jobs/input.jsonl` for jobs/job.yaml) is refused saying how to write it, not only
    that jobs/jobs/input.jsonl does not exist."""
    folder = tmp_path / "jobs"
    folder.mkdir()
    make_job(folder, GOOD)
    job = write_job(folder / "job.yaml", input={"path": "jobs/input.jsonl"})
    monkeypatch.chdir(tmp_path)
    assert validate("jobs/job.yaml")[0] == 2
    err = capsys.readouterr().err
    assert "input.path 'jobs/input.jsonl' is read relative to the job file's folder" in err
    assert "write it as 'input.jsonl'" in err
    job.write_text(job.read_text().replace("jobs/input.jsonl", "input.jsonl"))
    assert validate("jobs/job.yaml")[0] == 0


def test_errors_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad job, flag or missing input is `error: ...` on stderr and exit 2."""
    path = make_job(tmp_path, GOOD)
    assert validate(str(path), "--rpm", "lots")[0] == 2
    assert "error: --rpm must be a number of at least 0.01" in capsys.readouterr().err
    (tmp_path / "input.jsonl").unlink()
    assert validate(str(path))[0] == 2
    assert "does not exist; check input.path" in capsys.readouterr().err
    named = write_job(tmp_path / "key.yaml", endpoint={"base_url": "sim://", "model": "m",
                                                        "api_key_env": "NO_SUCH_KEY_VAR"})
    assert validate(str(named))[0] == 2
    assert "NO_SUCH_KEY_VAR but that environment variable is not set" in capsys.readouterr().err


def test_an_input_of_which_no_line_is_an_item_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A typo in input.prompt_field rejects every line: that is no valid job (exit 2, one line
    naming the first reject), and the reject names the field the lines do have."""
    path = make_job(tmp_path, GOOD, input={"path": "input.jsonl", "prompt_field": "promt"})
    assert validate(str(path))[0] == 2
    assert capsys.readouterr().err == (
        f"error: no line of {tmp_path / 'input.jsonl'} is an item: all 2 were rejected, the "
        "first (line 1) because prompt field 'promt' is missing (the line has 'prompt': is that "
        "the field?); check the input section of the job file\n")
    assert validate(str(path), "--show", "0")[0] == 2  # no reject kept to name: still one line
    assert capsys.readouterr().err == (
        f"error: no line of {tmp_path / 'input.jsonl'} is an item: all 2 were rejected; check "
        "the input section of the job file\n")
    one = make_job(tmp_path, GOOD[:1], input={"path": "input.jsonl", "prompt_field": "promt"})
    assert validate(str(one))[0] == 2  # not "all 1 were rejected"
    assert "is an item: its only line was rejected (line 1) because prompt field" in (
        capsys.readouterr().err)
    # No line at all, or blank lines only: no line is an item either, not a valid job.
    for lines in ([], [b"", b"  "]):
        assert validate(str(make_job(tmp_path, lines)))[0] == 2
        assert capsys.readouterr().err == (
            f"error: {tmp_path / 'input.jsonl'} holds no records, so a run of it would send "
            "nothing; check input.path in the job file\n")
    mixed = make_job(tmp_path, [*GOOD, b'{"id": "z", "text": "t"}'])
    code, text = validate(str(mixed))
    assert code == 0 and "line 3: prompt field 'prompt' is missing\n" in text  # nothing close


@pytest.mark.parametrize(("env", "flags", "says"), [
    ({"all_proxy": "socks5://127.0.0.1:1"}, (),
     "error: environment variable all_proxy names a socks5 proxy"),
    ({"SHARDRUN_RUNS_DIR": "a-file"}, (), "a-file is not a directory (runs_dir from env "
                                          "SHARDRUN_RUNS_DIR)"),
    ({}, ("--runs-dir", "a-file/runs"), "a-file is not a directory (runs_dir from flag "
                                         "--runs-dir)"),
    ({"SHARDRUN_CONCURENCY": "4"}, (), "error: environment variable SHARDRUN_CONCURENCY (did "
                                       "you mean SHARDRUN_CONCURRENCY?) is not a shardrun"),
])  # fmt: skip
def test_validate_refuses_the_environment_a_run_refuses(
        tmp_path: Path, env: dict[str, str], flags: tuple[str, ...], says: str) -> None:
    """What `run` refuses before it sends anything (a socks proxy, a runs directory it cannot
    make), `validate` refuses too, with exit 2 and one line; a usable --runs-dir is left
    uncreated by validate."""
    (tmp_path / "input.jsonl").write_bytes(b"".join(line + b"\n" for line in GOOD))
    write_job(tmp_path / "job.yaml", endpoint={"base_url": "http://127.0.0.1:9/v1", "model": "m"})
    (tmp_path / "a-file").write_text("")
    for command in (["validate", "job.yaml"], ["job.yaml"]):
        proc = run_cli(*command, *flags, cwd=tmp_path, env=env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr)
        assert says in proc.stderr, (command, proc.stderr)
    proc = run_cli("validate", "job.yaml", "--runs-dir", "new/runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(("sim", "says"), [
    ({"ttft_ms": "abc"}, "endpoint.sim: ttft_ms must be a number, not 'abc'"),
    ({"seedx": 1}, "endpoint.sim: unknown simulator setting 'seedx' (did you mean 'seed'?)"),
    ({"ttft": 5}, "endpoint.sim: unknown simulator setting 'ttft' (did you mean 'ttft_ms'?)"),
    ({"zzz": 1}, "endpoint.sim: unknown simulator setting 'zzz'; known: auth_required, "),
    ({"tokens": "uniform:9:2"}, "endpoint.sim: tokens: LO must not exceed HI"),
])  # fmt: skip
def test_the_simulators_settings_are_checked_as_a_run_checks_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], sim: dict[str, Any],
        says: str) -> None:  # fmt: skip
    """validate refuses the `endpoint.sim` a run would refuse, without a ping; and a whole
    number of tokens (`tokens: 8`, as YAML reads it) is the fixed length it means."""
    endpoint = {"base_url": "sim://", "model": "m"}
    bad = make_job(tmp_path, GOOD, endpoint={**endpoint, "sim": sim})
    assert validate(str(bad))[0] == 2
    assert says in capsys.readouterr().err
    fixed = make_job(tmp_path, GOOD, endpoint={**endpoint, "sim": {"tokens": 8}})
    assert validate(str(fixed))[0] == 0
    assert load_job(fixed, env={}, flags={}).sim_config() == SimConfig(tokens="8")


def test_a_sim_block_set_aside_is_checked_by_validate_and_run(tmp_path: Path) -> None:
    """With SHARDRUN_BASE_URL pointing the job elsewhere, a typo in its `sim:` block still
    stops `validate` and `run` (exit 2, one line, no run directory), as it would without."""
    make_job(tmp_path, GOOD, endpoint={"base_url": "sim://", "model": "m",
                                       "sim": {"ttft_msx": 5}})  # fmt: skip
    env = {"SHARDRUN_BASE_URL": "http://127.0.0.1:9/v1", "SHARDRUN_RUNS_DIR": "runs"}
    for command in (["validate", "job.yaml"], ["run", "job.yaml"]):
        proc = run_cli(*command, cwd=tmp_path, env=env)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr)
        assert "job.yaml: endpoint.sim: unknown simulator setting 'ttft_msx'" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_terminal_report_uses_tables(tmp_path: Path) -> None:
    """On a terminal the configuration is a rich table."""
    job = load_job(make_job(tmp_path, GOOD), env={}, flags={})
    out = StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    result = PingResult("http://h/v1/chat/completions", "ok", 200, 0.25, 0.5, 7, "hi", None,
                        {"x-ratelimit-remaining-requests": "99"})  # fmt: skip
    cli_validate.print_report(console, job, check_input(job), result)
    text = out.getvalue()
    assert "┃ key" in text and "│ shards" in text and "configuration" in text
    assert "ping: ok (HTTP 200)" in text and "TTFT 0.250 s" in text
    assert "x-ratelimit-remaining-requests: 99" in text


def test_a_ping_reply_shows_no_escape_sequence(tmp_path: Path) -> None:
    """The model's reply and refusal and the rate-limit headers come from the server: an escape
    sequence in them reached the terminal as it was; it is shown as \\xNN. A header quoting
    the key the ping sent shows it masked."""
    job = load_job(make_job(tmp_path, GOOD), env={}, flags={})
    out = StringIO()
    console = Console(file=out, force_terminal=True, width=200, color_system=None)
    keep_secret("sk-ping-SECRET-0123456789")  # as the ping's request_headers does
    rate = {"x-ratelimit-note": "n \x1b]0;t\x07 for sk-ping-SECRET-0123456789"}
    result = PingResult("http://h/v1/chat/completions", "ok", 200, 0.25, 0.5, 7,
                        "hi \x1b]0;t\x07", None, rate, refusal="no \x9b2J")
    cli_validate.print_report(console, job, check_input(job), result)
    text = out.getvalue()
    assert "reply: hi \\x1b]0;t\\x07" in text and "declined): no \\x9b2J" in text
    assert "x-ratelimit-note: n \\x1b]0;t\\x07 for ***" in text, text
    assert "\x1b]" not in text and "\x9b" not in text


def test_failed_ping_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--ping that gets an error reports it and exits 1."""
    failed = PingResult("http://h/v1/chat/completions", "http_4xx", 401, None, 0.1, 0, "",
                        "HTTP 401: bad key")  # fmt: skip
    monkeypatch.setattr(cli_validate, "run_ping", lambda job, env, item: failed)
    code, text = validate(str(make_job(tmp_path, GOOD)), "--ping")
    assert code == 1
    assert "ping: http_4xx (HTTP 401)" in text and "  error: HTTP 401: bad key" in text


def test_a_refused_ping_is_labelled_refused(tmp_path: Path) -> None:
    """A port nothing listens on: the label says what the error line says (a run counts it as
    conn_reset, retried as a reset is). The socket is bound but not listening, so the port is
    ours and the kernel refuses the connection."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1"
        job = make_job(tmp_path, GOOD, endpoint={"base_url": url, "model": "m"})
        code, text = validate(str(job), "--ping")
    assert code == 1
    assert f"ping: conn_refused (no response) {url}/chat/completions" in text
    assert f"  error: connection refused by 127.0.0.1:{port}" in text


def test_https_to_a_plain_http_server_says_so(tmp_path: Path) -> None:
    """An https:// URL for the simulator (plain HTTP): not OpenSSL's 'wrong version number' alone
    but what it means and what to try."""
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as server:
        url = server.base_url.replace("http://", "https://")
        job = make_job(tmp_path, GOOD, endpoint={"base_url": url, "model": "m"})
        code, text = validate(str(job), "--ping")
    where = url.removeprefix("https://").removesuffix("/v1")
    assert code == 1
    assert (f"  error: cannot connect to {where}: it does not answer TLS (an https:// URL for a "
            "server that speaks plain HTTP? try http://)\n") in text, text


def test_connections_past_the_hard_open_file_limit_are_warned_of(tmp_path: Path) -> None:
    """A shard raises its soft limit, never the hard one: concurrency past it stops a run part
    way, out of descriptors, so validate says so up front; the items a shard gets bound it."""
    from shardrun.validate import open_files_warning

    job = load_job(make_job(tmp_path, GOOD * 1, shards=1, concurrency=100_000), env={},
                   flags={})  # fmt: skip
    check = check_input(job)
    assert open_files_warning(job, check, hard=1_000_000) is None
    assert open_files_warning(job, check, hard=60) == (
        "a shard would keep up to 2 connections open (concurrency 100,000), about 66 open "
        "files, above the hard limit of 60 (ulimit -Hn): a run would stop once its connections "
        "reach it; lower concurrency, run more shards or raise the limit")
    assert open_files_warning(job, check, hard=66) is None


def test_ping_to_a_base_url_without_v1_exits_1_with_a_hint(tmp_path: Path) -> None:
    """A real 404 (the simulator serves under /v1 only): exit 1, the error and what to check."""
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as server:
        wrong = server.base_url.removesuffix("/v1")
        job = make_job(tmp_path, GOOD, endpoint={"base_url": wrong, "api": "chat", "model": "m"})
        code, text = validate(str(job), "--ping")
    assert code == 1
    assert f"ping: http_4xx (HTTP 404) {wrong}/chat/completions" in text
    assert "  hint: a 404 means a wrong path, API or model: OpenAI-compatible servers serve under"\
           " /v1; check endpoint.base_url, endpoint.api and endpoint.model" in text


def test_ping_refused_credentials_names_the_key_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 401 to the ping gets the advice a run that stops for it prints: the variable to set,
    or that the job sends no key at all, where it showed the server's error alone."""
    sim = {**FAST_SIM, "auth_required": "sk-right"}
    monkeypatch.setenv("MY_KEY", "sk-wrong")
    for key_env, says in (("MY_KEY", "set the right key in MY_KEY (the variable "
                                     "endpoint.api_key_env names)"),
                          (None, "the job sends no key: name the variable that holds one in "
                                 "endpoint.api_key_env")):
        endpoint = {"base_url": "sim://", "model": "m", "sim": sim,
                    **({"api_key_env": key_env} if key_env else {})}
        code, text = validate(str(make_job(tmp_path, GOOD, endpoint=endpoint)), "--ping")
        assert code == 1 and "(HTTP 401)" in text, text
        assert f"  hint: the endpoint refused the credentials: {says}" in text


def test_ping_refused_with_403_names_the_key_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 403 to the ping (a key without access) gets the same advice as a 401: a run stops
    for a 403 before any success with that advice, so validate must not leave it out."""
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "no access"}}, status=403)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    monkeypatch.setenv("MY_KEY", "sk-some")
    job = load_job(make_job(tmp_path, GOOD, endpoint={"base_url": "http://127.0.0.1:9/v1",
                                                      "model": "m", "api_key_env": "MY_KEY"}),
                   env={}, flags={})

    async def one_ping() -> PingResult:
        async with TestServer(app, host="127.0.0.1", port=0) as server:
            return await ping(job, str(server.make_url("/v1")), "sk-some", None)

    result = asyncio.run(one_ping())
    assert result.http_status == 403 and not result.ok
    text = cli_validate.format_report(job, check_input(job), result)
    assert ("  hint: the endpoint refused the credentials: set the right key in MY_KEY (the "
            "variable endpoint.api_key_env names)") in text, text


def test_ping_to_a_web_page_exits_1_with_a_hint(tmp_path: Path) -> None:
    """A base_url that answers with an HTML page: the ping says what came back and what to
    check."""
    with page_server() as server:
        job = make_job(tmp_path, GOOD, endpoint={"base_url": server.base_url, "api": "chat",
                                                 "model": "m"})
        code, text = validate(str(job), "--ping")
    assert code == 1 and server.served == 1
    assert f"ping: protocol_error (HTTP 200) {server.base_url}/chat/completions" in text
    assert '  error: an HTML page that says "Sign in", not an event stream (content-type text/html'\
           in text
    assert "  hint: that is no OpenAI-compatible answer (a login page, a proxy's notice or a web "\
           "app?): check endpoint.base_url, which for OpenAI-compatible servers ends in /v1" in text


def test_ping_shows_a_refusal(tmp_path: Path) -> None:
    """A model that declines: the ping succeeds and shows the refusal, as the reply is empty."""
    job = make_job(tmp_path, GOOD, endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                                             "sim": {**FAST_SIM, "refusal": 1.0}})
    code, text = validate(str(job), "--ping")
    assert code == 0 and "  refusal (the model declined): " in text and "  reply:" not in text


def test_ping_against_the_simulator(tmp_path: Path, no_stray_children: None) -> None:
    """sim:// starts a simulator for one request and stops it; status and TTFT come back."""
    job = load_job(make_job(tmp_path, GOOD), env={}, flags={})
    result = run_ping(job, {}, check_input(job).first_item)
    assert result.ok and result.http_status == 200 and result.error is None
    assert result.ttft_s is not None and 0 < result.ttft_s <= result.total_s
    assert 0 < result.completion_tokens <= 16 and result.url.startswith("http://127.0.0.1:")
    assert FAST_SIM["ttft_ms"] == 5  # the fast settings the job used


def test_ping_of_the_responses_api_caps_its_token_limit(tmp_path: Path) -> None:
    """api: responses: the ping posts to /v1/responses, caps max_output_tokens like max_tokens,
    and reads the reply from the simulator's event stream."""
    job = load_job(make_job(tmp_path, GOOD, params={"max_output_tokens": 500}, endpoint={
        "base_url": "sim://", "api": "responses", "model": "m",
        "sim": {**FAST_SIM, "tokens": "40"}}), env={}, flags={})  # fmt: skip
    result = run_ping(job, {}, check_input(job).first_item)
    assert result.ok and result.error is None and result.url.endswith("/v1/responses")
    assert result.completion_tokens == 16 and result.reply


def test_ping_reports_rate_headers_and_caps_tokens(tmp_path: Path) -> None:
    """One request, max_tokens capped at 16, x-ratelimit-* headers reported."""
    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "x-ratelimit-remaining-requests": "59",
            "x-ratelimit-reset-tokens": "6m0s"})  # fmt: skip
        await resp.prepare(request)
        chunk = {"choices": [{"delta": {"content": "pong"}, "finish_reason": "stop"}]}
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    job = load_job(make_job(tmp_path, GOOD, params={"max_tokens": 500}), env={}, flags={})

    async def one_ping() -> PingResult:
        async with TestServer(app, host="127.0.0.1", port=0) as server:
            return await ping(job, str(server.make_url("/v1")), None, None)

    result = asyncio.run(one_ping())
    assert result.ok and result.reply == "pong"
    assert result.rate_headers == {"x-ratelimit-remaining-requests": "59",
                                   "x-ratelimit-reset-tokens": "6m0s"}  # fmt: skip
    assert len(seen) == 1 and seen[0]["max_tokens"] == 16 and seen[0]["stream"] is True


def test_reading_the_input_shows_progress_on_standard_error(tmp_path: Path) -> None:
    """With the least --progress-interval and standard error no terminal: plain lines saying
    how far the read has got, on standard error only; the report on standard output is the one
    --quiet gives. Lines enough for a read of a few tenths of a second."""
    lines = [orjson.dumps({"id": f"i{n}", "prompt": f"prompt {n}"}) for n in range(60_000)]
    make_job(tmp_path, lines)
    quiet = run_cli("validate", "job.yaml", "--quiet", cwd=tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    loud = run_cli("validate", "job.yaml", "--progress-interval", "0.1", cwd=tmp_path)
    assert loud.returncode == 0, loud.stderr
    assert loud.stdout == quiet.stdout
    assert "\x1b" not in loud.stderr and "\r" not in loud.stderr
    shown = [line for line in loud.stderr.splitlines() if "] reading " in line]
    assert shown and all(line.startswith("[") and " lines" in line for line in shown)
    assert "% of the input read)" in shown[-1]
    done = run_cli("validate", "job.yaml", "--progress-interval", "nan", cwd=tmp_path)
    assert done.returncode == 2 and "--progress-interval" in done.stderr


def test_a_base_url_with_no_path_is_warned_of_and_the_404_stop_names_the_fix(
    tmp_path: Path,
) -> None:
    """`http://127.0.0.1:PORT` where `/v1` was meant passed validate without a word, and the run
    stopped on its first 404: validate now warns (exit 0: some gateways serve at the root),
    naming the URL meant, as the run's stop does; not once a ping got an answer there, nor for
    a URL with a path."""
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as server:
        meant = server.base_url
        root = meant.removesuffix("/v1")
        make_job(tmp_path, GOOD, endpoint={"base_url": root, "model": "m"})
        checked = run_cli("validate", "job.yaml", cwd=tmp_path)
        ran = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
        make_job(tmp_path, GOOD, endpoint={"base_url": meant, "model": "m"})
        right = run_cli("validate", "job.yaml", "--ping", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    [warning] = [line for line in checked.stdout.splitlines() if line.startswith("warning:")]
    assert warning == ("warning: endpoint.base_url has no path, and OpenAI-compatible servers "
                       "serve under /v1: a run stops on its first 404 unless this server serves "
                       f"at its root (some gateways do); most want {meant} (`validate --ping` "
                       "tries one request)")
    assert ran.returncode == 1
    assert ("check endpoint.base_url (OpenAI-compatible servers serve under /v1: likely "
            f"{meant}), endpoint.api and endpoint.model") in ran.stderr, ran.stderr
    assert right.returncode == 0 and "warning:" not in right.stdout, right.stdout
    # A gateway that does serve at its root: a ping answered there leaves nothing to warn of.
    job = load_job(tmp_path / "job.yaml", env={"SHARDRUN_BASE_URL": "http://127.0.0.1:9"},
                   flags={})  # fmt: skip
    answered = PingResult("http://127.0.0.1:9/chat/completions", "ok", 200, 0.1, 0.2, 3, "hi",
                          None)  # fmt: skip
    assert "has no path" in cli_validate.format_report(job, check_input(job), None)
    assert "has no path" not in cli_validate.format_report(job, check_input(job), answered)


def test_the_terminal_report_colours_a_warning_and_shows_its_text_as_written(
    tmp_path: Path,
) -> None:
    """The terminal's report printed `[yellow]warning:[/yellow]` as it was (markup turned off
    for the whole line); the word is coloured now, and the warning's own text, here a URL with
    brackets (`[i]` is rich's italic), is shown as written, never read as markup."""
    job = load_job(make_job(tmp_path, GOOD, endpoint={"base_url": "http://[::1]:8000?q=[i]",
                                                      "model": "m"}), env={}, flags={})
    out = StringIO()
    console = Console(file=out, force_terminal=True, width=400, color_system="standard")
    cli_validate.print_report(console, job, check_input(job), None)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    assert "[yellow]" not in text
    assert "warning: endpoint.base_url has no path" in text
    assert "most want http://[::1]:8000/v1?q=[i] " in text
    assert "\x1b[33mwarning:" in out.getvalue()  # yellow


@pytest.mark.parametrize(("base_url", "meant"), [
    ("http://127.0.0.1:9", "http://127.0.0.1:9/v1"), ("http://127.0.0.1:9/", "http://127.0.0.1:9/v1"),
    ("http://127.0.0.1:9/v1", None), ("http://127.0.0.1:9/openai/deployments/x", None),
    ("https://gw.example/v1/acct/gw/openai", None), ("sim://", None),
])  # fmt: skip
def test_only_a_base_url_with_no_path_is_warned_of(
    tmp_path: Path, base_url: str, meant: str | None
) -> None:
    """A base_url with a path (`/v1`, a gateway's own) is as its server wants it: neither
    validate's warning nor the 404 stop's hint (both `under_v1`) names another URL for it."""
    job = load_job(make_job(tmp_path, GOOD, endpoint={"base_url": base_url, "model": "m"}),
                   env={}, flags={})
    report = cli_validate.format_report(job, check_input(job), None)
    assert under_v1(base_url) == meant
    assert ("has no path" in report) is (meant is not None), report

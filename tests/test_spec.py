"""Tests for the job specification: layering, sources, and one-sentence errors."""

from __future__ import annotations

import json
import os
import tempfile
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import PydanticCustomError

from shardrun import preflight
from shardrun._models import _json_value
from shardrun._urls import masked_url
from shardrun.errors import InputError, SpecError
from shardrun.inputs import InputPlan, InputReader
from shardrun.runner import carried_flags
from shardrun.spec import ENV_VARS, LEAF_KEYS, LoadedJob, flag_for, load_job

MINIMAL = """\
endpoint:
  base_url: sim://
  model: sim-small
input:
  path: data.jsonl
"""


@pytest.fixture
def jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Work in tmp_path so the job file is named as a user would type it: jobs/x.yaml."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobs").mkdir()
    return tmp_path / "jobs"


def write(jobs: Path, text: str, name: str = "x.yaml") -> Path:
    """Write a job file and return its path relative to the working directory."""
    (jobs / name).write_text(text)
    return Path("jobs") / name


def load(
    path: Path, env: Mapping[str, str] | None = None, flags: Mapping[str, object] | None = None
) -> LoadedJob:
    """load_job with empty env and flags unless given."""
    return load_job(path, env=env or {}, flags=flags or {})


def error_of(path: Path, **kw: object) -> str:
    """The SpecError message load_job raises."""
    with pytest.raises(SpecError) as info:
        load(path, **kw)  # type: ignore[arg-type]
    return str(info.value)


def test_defaults(jobs: Path) -> None:
    """A minimal job gets the documented defaults, each sourced 'default'."""
    job = load(write(jobs, MINIMAL))
    spec = job.spec
    assert (spec.shards, spec.concurrency, spec.runs_dir, spec.shutdown_grace_s) == (
        4,
        16,
        "runs",
        30.0,
    )
    assert spec.endpoint.api == "chat" and spec.endpoint.api_key_env is None
    assert spec.endpoint.sim is None and spec.params == {}
    assert (spec.input.id_field, spec.input.prompt_field, spec.input.messages_field) == (
        "id",
        "prompt",
        None,
    )
    assert spec.timeouts.model_dump() == {
        "connect_s": 10.0,
        "first_token_s": 60.0,
        "idle_s": 30.0,
        "total_s": 600.0,
    }
    assert spec.retry.model_dump() == {
        "max_attempts": 4,
        "backoff_s": 0.5,
        "backoff_max_s": 30.0,
        "budget_ratio": 0.2,
        "budget_floor": 10,
        "max_server_wait_s": 300.0,
        "outage_s": 600.0,
    }
    assert set(job.sources) == set(LEAF_KEYS)
    assert job.sources["shards"] == "default" and job.sources["input.prompt_field"] == "default"
    assert job.sources["endpoint.base_url"] == "job file"
    assert job.warnings == ()


def test_full_example_job_loads(jobs: Path) -> None:
    """The job shown in the brief, every key set, loads and keeps every value."""
    text = MINIMAL + (
        "  id_field: key\n"
        "  messages_field: null\n"
        "params: {max_tokens: 128, temperature: 0.7}\n"
        "shards: 8\nconcurrency: 32\n"
        "timeouts: {connect_s: 10, first_token_s: 60, idle_s: 30, total_s: 600}\n"
        "retry: {max_attempts: 4, backoff_s: 0.5, backoff_max_s: 30, budget_ratio: 0.2,"
        " budget_floor: 10}\n"
        "runs_dir: out\nshutdown_grace_s: 5\n"
    )
    text = text.replace(
        "  model: sim-small\n",
        "  model: sim-small\n  api: completions\n  api_key_env: OPENAI_API_KEY\n"
        "  sim: {ttft_ms: 100, tokens: 'uniform:16:96'}\n",
    )
    job = load(write(jobs, text))
    assert job.spec.endpoint.sim == {"ttft_ms": 100, "tokens": "uniform:16:96"}
    assert job.spec.params == {"max_tokens": 128, "temperature": 0.7}
    assert (job.spec.shards, job.spec.input.id_field, job.runs_path) == (8, "key", Path("out"))
    assert job.sources["input.messages_field"] == "job file"


@pytest.mark.parametrize(
    ("key", "env_name", "file_value", "env_value", "flag_value", "expected"),
    [
        ("shards", "SHARDRUN_SHARDS", "2", "3", 5, (2, 3, 5)),
        ("concurrency", "SHARDRUN_CONCURRENCY", "20", "30", "50", (20, 30, 50)),
        (
            "endpoint.base_url",
            "SHARDRUN_BASE_URL",
            "http://file:1/v1",
            "http://env:2/v1",
            "https://flag:3/v1",
            ("http://file:1/v1", "http://env:2/v1", "https://flag:3/v1"),
        ),
    ],
)
def test_precedence_flag_env_file_default(
    jobs: Path,
    key: str,
    env_name: str,
    file_value: str,
    env_value: str,
    flag_value: object,
    expected: tuple[object, object, object],
) -> None:
    """Flag beats environment beats job file beats default, and sources say which won."""
    base = MINIMAL.replace("sim://", "http://base:9/v1")
    if key == "endpoint.base_url":
        with_file = base.replace("http://base:9/v1", file_value)
    else:
        with_file = base + f"{key}: {file_value}\n"
    env, flags = {env_name: env_value}, {key: flag_value}
    expect_file, expect_env, expect_flag = expected
    cases: list[tuple[str, dict[str, str], dict[str, object], object, str]] = [
        (with_file, {}, {}, expect_file, "job file"),
        (with_file, env, {}, expect_env, f"env {env_name}"),
        (with_file, env, flags, expect_flag, f"flag {flag_for(key)}"),
        (base, env, flags, expect_flag, f"flag {flag_for(key)}"),
        (base, env, {key: None}, expect_env, f"env {env_name}"),
    ]
    for text, case_env, case_flags, value, source in cases:
        job = load(write(jobs, text), case_env, case_flags)
        assert job.effective()[key] == {"value": value, "source": source}
        assert job.sources[key] == source
    if key != "endpoint.base_url":
        assert load(write(jobs, base)).sources[key] == "default"


def test_text_from_the_environment_loses_the_spaces_around_it(jobs: Path) -> None:
    """An env file's `SHARDRUN_MODEL=gpt-4o ` sent 'gpt-4o ' (no such model), and
    `SHARDRUN_API_KEY_ENV=OPENAI_API_KEY ` was refused as 'not the key itself'."""
    env = {"SHARDRUN_MODEL": "gpt-4o ", "SHARDRUN_API_KEY_ENV": " OPENAI_API_KEY\t",
           "SHARDRUN_SHARD_START": "spawn "}
    job = load(write(jobs, MINIMAL), env)
    endpoint = job.spec.endpoint
    assert (endpoint.model, endpoint.api_key_env, job.spec.shard_start) == (
        "gpt-4o", "OPENAI_API_KEY", "spawn")
    assert job.sources["endpoint.model"] == "env SHARDRUN_MODEL"


def test_env_conversion_errors_name_the_variable(jobs: Path) -> None:
    """A bad environment value is blamed on the variable, quoted as the user typed it."""
    path = write(jobs, MINIMAL)
    assert error_of(path, env={"SHARDRUN_SHARDS": "lots"}) == (
        "environment variable SHARDRUN_SHARDS must be an integer from 1 to 1024, got 'lots'"
    )
    assert error_of(path, env={"SHARDRUN_SHARDS": "8.0"}) == (
        "environment variable SHARDRUN_SHARDS must be an integer from 1 to 1024, got '8.0'"
    )
    assert error_of(path, env={"SHARDRUN_IDLE_TIMEOUT_S": "0"}) == (
        "environment variable SHARDRUN_IDLE_TIMEOUT_S must be a number greater than 0, got '0'"
    )
    assert error_of(path, env={"SHARDRUN_FSYNC_INTERVAL_S": "0"}) == (  # 0 is out: say so
        "environment variable SHARDRUN_FSYNC_INTERVAL_S must be a number above 0 and at most "
        "60, got '0'"
    )
    assert "SHARDRUN_RETRY_BUDGET must be a number" in error_of(
        path, env={"SHARDRUN_RETRY_BUDGET": "nan"}
    )


def test_env_values_are_converted_and_empty_means_unset(jobs: Path) -> None:
    """Env text becomes the field's type; an empty variable is ignored."""
    env = {
        "SHARDRUN_SHARDS": " 8 ",
        "SHARDRUN_RETRY_BACKOFF_S": "1e-1",
        "SHARDRUN_MAX_ATTEMPTS": "",
        "SHARDRUN_RUNS_DIR": "/tmp/r",
    }
    job = load(write(jobs, MINIMAL), env)
    assert (job.spec.shards, job.spec.retry.backoff_s, job.spec.runs_dir) == (8, 0.1, "/tmp/r")
    assert job.sources["retry.max_attempts"] == "default"


def test_shard_silence_limit_from_file_and_env_with_a_floor(jobs: Path) -> None:
    """`shard_silence_s`, how long a shard may send nothing before it is killed: 60 s unless the
    job file or SHARDRUN_SHARD_SILENCE_S says otherwise, never under 2 s (reports come every
    0.2 s, so less would take a busy machine's hiccup for a hang)."""
    path = write(jobs, MINIMAL)
    job = load(path)
    assert (job.spec.shard_silence_s, job.sources["shard_silence_s"]) == (60.0, "default")
    job = load(write(jobs, MINIMAL + "shard_silence_s: 300\n"))
    assert job.effective()["shard_silence_s"] == {"value": 300.0, "source": "job file"}
    job = load(path, {"SHARDRUN_SHARD_SILENCE_S": "600"})
    assert job.effective()["shard_silence_s"] == {
        "value": 600.0, "source": "env SHARDRUN_SHARD_SILENCE_S"}
    assert error_of(path, env={"SHARDRUN_SHARD_SILENCE_S": "1"}) == (
        "environment variable SHARDRUN_SHARD_SILENCE_S must be a number from 2 to 86400, got '1'"
    )
    assert "shard_silence_s" in error_of(write(jobs, MINIMAL + "shard_silence_s: 0.5\n"))


def test_outage_and_server_wait_limits_from_the_environment(jobs: Path) -> None:
    """How long an endpoint may be down, and how long a server may ask to wait, are tuned
    during an incident, so each has a variable (DESIGN §7); a bad value names it."""
    path = write(jobs, MINIMAL)
    job = load(path, {"SHARDRUN_OUTAGE_S": "1800", "SHARDRUN_MAX_SERVER_WAIT_S": "30"})
    assert (job.spec.retry.outage_s, job.spec.retry.max_server_wait_s) == (1800.0, 30.0)
    assert job.effective()["retry.outage_s"] == {"value": 1800.0,
                                                 "source": "env SHARDRUN_OUTAGE_S"}
    assert load(path).sources["retry.outage_s"] == "default"
    assert error_of(path, env={"SHARDRUN_OUTAGE_S": "0"}).startswith(
        "environment variable SHARDRUN_OUTAGE_S must be")
    assert error_of(path, env={"SHARDRUN_MAX_SERVER_WAIT_S": "soon"}).startswith(
        "environment variable SHARDRUN_MAX_SERVER_WAIT_S must be")


def test_flag_errors_name_the_flag(jobs: Path) -> None:
    """A bad flag value is blamed on the flag; argparse's ints and Paths are accepted."""
    path = write(jobs, MINIMAL)
    assert error_of(path, flags={"shards": 0}) == (
        "--shards must be an integer from 1 to 1024, got 0"
    )
    assert error_of(path, flags={"concurrency": "x"}).startswith("--concurrency must be")
    job = load(path, flags={"runs_dir": Path("out")})
    assert (job.spec.runs_dir, job.sources["runs_dir"]) == ("out", "flag --runs-dir")


def test_unknown_flag_key_is_a_programming_error(jobs: Path) -> None:
    """A flag key the spec does not have is the caller's bug, not the user's."""
    with pytest.raises(ValueError, match="retyr"):
        load(write(jobs, MINIMAL), flags={"retyr.max_attempts": 3})


def test_unknown_key_with_suggestion(jobs: Path) -> None:
    """A misspelt key is an error with the nearest real key, nested keys dotted."""
    path = write(jobs, MINIMAL + "concurency: 3\n")
    assert error_of(path) == "jobs/x.yaml: unknown key 'concurency' (did you mean 'concurrency'?)"
    path = write(jobs, MINIMAL.replace("model:", "modle:") + "max_attempts: 2\n")
    message = error_of(path)
    assert "unknown key 'endpoint.modle' (did you mean 'endpoint.model'?)" in message
    assert "unknown key 'max_attempts' (did you mean 'retry.max_attempts'?)" in message
    # Inside a section, only that section's keys are near; a small section says what it takes.
    path = write(jobs, MINIMAL + "rate_limits: {foo: 1, requests_per_minute: 2}\n")
    message = error_of(path)
    assert "unknown key 'rate_limits.foo' (rate_limits takes: rpm, tpm)" in message
    assert "unknown key 'rate_limits.requests_per_minute' (rate_limits takes: rpm, tpm)" in (
        message)


def test_wrong_type_names_key_and_file(jobs: Path) -> None:
    """A wrong type names file and key; a quoted number is not silently accepted."""
    assert error_of(write(jobs, MINIMAL + "shards: eight\n")) == (
        "jobs/x.yaml: shards must be an integer from 1 to 1024, got 'eight'"
    )
    assert error_of(write(jobs, MINIMAL + "shards: '8'\n")).startswith(
        "jobs/x.yaml: shards must be an integer from 1 to 1024, got '8' (quoted"
    )
    assert error_of(write(jobs, MINIMAL.replace("sim-small", "[a]"))) == (
        "jobs/x.yaml: endpoint.model must be a non-empty string, got ['a']"
    )
    # A model named like a YAML boolean or a number: the value YAML made of it, and the cure.
    assert error_of(write(jobs, MINIMAL.replace("sim-small", "true"))) == (
        "jobs/x.yaml: endpoint.model must be a non-empty string, got true (YAML reads an "
        "unquoted true or false as a boolean; quote the value)"
    )
    assert error_of(write(jobs, MINIMAL.replace("sim-small", "3.5"))) == (
        "jobs/x.yaml: endpoint.model must be a non-empty string, got 3.5 (YAML reads it as a "
        "number; quote the value)"
    )
    text = MINIMAL.replace("model:", "api: chats\n  model:")
    assert error_of(write(jobs, text)) == (
        "jobs/x.yaml: endpoint.api must be 'chat', 'completions' or 'responses', got 'chats'"
    )


def test_yes_no_on_and_off_are_text_as_in_yaml_1_2(jobs: Path) -> None:
    """YAML 1.1 (PyYAML's) reads yes, no, on and off as booleans: `model: no` was an error and
    `stop: [no]` sent [false]. Job files read them as text, as YAML 1.2 does; a key that takes
    a number or a boolean refuses the text by name, and under params, which go to the server
    as JSON either way, an unquoted one is an error asking for a boolean or quotes."""
    job = load(write(jobs, MINIMAL.replace("sim-small", "no").replace(
        "path: data.jsonl", "{path: data.jsonl, id_field: y, prompt_field: on}")
        + "params: {stop: ['no', 'off'], logprobs: true, top_logprobs: 2}\n"))
    assert job.spec.endpoint.model == "no"
    assert (job.spec.input.id_field, job.spec.input.prompt_field) == ("y", "on")
    assert job.spec.params == {"stop": ["no", "off"], "logprobs": True, "top_logprobs": 2}
    assert error_of(write(jobs, MINIMAL + "params: {stop: [x, no]}\n")) == (
        "jobs/x.yaml: YAML error at line 6, column 20: params.stop[1] is an unquoted no, which "
        "YAML 1.1 reads as false and YAML 1.2 as text: write false for the boolean, or 'no' in "
        "quotes for the text")
    assert "params.logprobs is an unquoted On, which YAML 1.1 reads as true" in error_of(
        write(jobs, MINIMAL + "params:\n  logprobs: On\n"))
    assert error_of(write(jobs, MINIMAL + "shards: yes\n")) == (
        "jobs/x.yaml: shards must be an integer from 1 to 1024, got 'yes'")
    assert error_of(write(jobs, MINIMAL.replace("model:", "stream_usage: off\n  model:"))) == (
        "jobs/x.yaml: endpoint.stream_usage must be true or false, got 'off' (a job file reads "
        "yes, no, on and off as text, as YAML 1.2 does; write true or false)")
    assert load(write(jobs, MINIMAL.replace("model:", "stream_usage: FALSE\n  model:"))
                ).spec.endpoint.stream_usage is False


def test_a_word_a_tag_calls_text_under_params_is_text(jobs: Path) -> None:
    """`!!str no` names its type as plainly as quotes do: no YAML reads it as a boolean, so
    under params it is the text, not the error an unquoted no is."""
    job = load(write(jobs, MINIMAL + "params: {stop: [!!str no, !!str On], user: !!str yes}\n"))
    assert job.spec.params == {"stop": ["no", "On"], "user": "yes"}
    assert "params.stop[1] is an unquoted no" in error_of(
        write(jobs, MINIMAL + "params: {stop: [!!str no, no]}\n"))


@pytest.mark.parametrize("merged", [
    "x-base: &base\n  params: {logprobs: yes}\n<<: *base\n",
    "<<: [{shards: 2}, {params: {logprobs: yes}}]\n",
    "x-p: &p {logprobs: yes}\nparams: {<<: *p}\n",
])
def test_params_a_merge_key_brings_are_checked_for_yaml_1_1_words(jobs: Path,
                                                                  merged: str) -> None:
    """Params a merge key (`<<: *base`) brings in are the job's params: an unquoted yes there
    went to the server as the text "yes" without a word, where the same line written under
    `params:` itself is an error; the message names the key as the job has it."""
    assert "params.logprobs is an unquoted yes, which YAML 1.1 reads as true" in error_of(
        write(jobs, MINIMAL + merged))


def test_several_problems_in_one_sentence(jobs: Path) -> None:
    """Every problem is reported at once, joined by '; ', the file named once per run."""
    text = MINIMAL + "shards: 0\nconcurrency: -1\n"
    message = error_of(write(jobs, text), env={"SHARDRUN_MAX_ATTEMPTS": "many"})
    assert message == (
        "jobs/x.yaml: shards must be an integer from 1 to 1024, got 0; "
        "concurrency must be an integer from 1 to 100000, got -1; "
        "environment variable SHARDRUN_MAX_ATTEMPTS must be an integer from 1 to 100, got 'many'"
    )
    assert "\n" not in message


def test_missing_required_keys(jobs: Path) -> None:
    """A missing required key names the file, the key and the variable that could set it."""
    message = error_of(write(jobs, "endpoint: {base_url: sim://}\ninput: {path: a}\n"))
    assert message == (
        "jobs/x.yaml: endpoint.model is required (set it in the job file or with SHARDRUN_MODEL)"
    )
    job = load(
        write(jobs, "endpoint: {base_url: sim://}\ninput: {path: a}\n"), {"SHARDRUN_MODEL": "m"}
    )
    assert job.spec.endpoint.model == "m"


def test_yaml_syntax_error_has_line_number(jobs: Path) -> None:
    """Broken YAML is a SpecError with the file and the line."""
    message = error_of(write(jobs, "endpoint:\n  base_url: sim://\n model: x\n"))
    assert message.startswith("jobs/x.yaml: YAML error at line 3")


def test_a_tab_in_the_indentation_is_named_as_such(jobs: Path) -> None:
    """PyYAML says only that a tab 'cannot start any token': the sentence says what to do."""
    message = error_of(write(jobs, "endpoint:\n  base_url: sim://\n\tmodel: x\n"))
    assert message == ("jobs/x.yaml: YAML error at line 3, column 1: found character '\\t' "
                       "that cannot start any token (YAML indents with spaces, never tabs)")


def test_a_second_document_is_named_as_such(jobs: Path) -> None:
    """Two job files run together (`cat a.yaml b.yaml`): PyYAML's problem alone read 'but found
    another document'."""
    assert error_of(write(jobs, MINIMAL + "---\n" + MINIMAL)) == (
        "jobs/x.yaml: YAML error at line 6, column 1: a second YAML document starts here (after "
        "a '---'): a job file is one")


def test_a_quote_left_open_says_where_it_began(jobs: Path) -> None:
    """An unclosed quote is found out at the end of the file: the line where it was opened is
    the one to fix, so the sentence gives it too."""
    message = error_of(write(jobs, 'endpoint:\n  model: "m\n  base_url: sim://\n'))
    assert message == ("jobs/x.yaml: YAML error at line 4, column 1: found unexpected end of "
                       "stream (while scanning a quoted scalar begun at line 2, column 10)")


def test_nesting_too_deep_to_read_is_an_error_not_a_recursion(jobs: Path) -> None:
    """PyYAML reads nesting by recursion: a job file hundreds of levels deep raised
    RecursionError, a traceback."""
    path = write(jobs, MINIMAL + "params: {x: " + "[" * 2000 + "]" * 2000 + "}\n")
    assert error_of(path) == (f"{path}: its values nest too deeply for YAML to be read (lists "
                              "or mappings hundreds of levels deep)")


@pytest.mark.parametrize(("value", "why"), [
    ("!!int abc", "cannot read 'abc' as !!int"),
    ("!!bool maybe", "cannot read 'maybe' as !!bool"),
    ("!!timestamp soon", "cannot read 'soon' as !!timestamp"),
    ("!!map [1]", "cannot read as !!map"), ("!!float ''", "cannot read '' as !!float"),
    ("0x_", None), ("!!int 0x_", "cannot read '0x_' as !!int"),
])
def test_a_value_its_tag_cannot_make_is_an_error_at_its_line(
    jobs: Path, value: str, why: str | None
) -> None:
    """PyYAML's constructors raise ValueError, KeyError, AttributeError or TypeError for a tagged
    value they cannot make (and for 0x_, once a hex number to YAML 1.1): tracebacks, before."""
    path = write(jobs, MINIMAL + f"params: {{x: {value}}}\n")
    if why is None:  # no number to YAML 1.2: text, sent as such
        assert load(path).spec.params == {"x": value}
        return
    assert error_of(path) == f"{path}: YAML error at line 6, column 13: {why}"


def test_a_character_yaml_refuses_is_one_line_at_its_place(jobs: Path) -> None:
    """A NUL (or an escape) in the file: PyYAML's message ran over two lines ('in "<unicode
    string>", position 62'), which broke the one-line error."""
    assert error_of(write(jobs, MINIMAL + "shards: 2\x00\n")) == (
        "jobs/x.yaml: YAML error at line 6, column 10: the character U+0000 is not allowed in "
        "YAML (is this a job file?)")


def test_a_key_written_in_the_job_says_where_a_key_goes(jobs: Path) -> None:
    """`endpoint.api_key: sk-...` was met with "did you mean 'endpoint.api_key_env'?", and the
    key moved there was then refused as no variable's name: it says where the key goes, and
    the key itself is not shown."""
    path = write(jobs, MINIMAL.replace("  model: sim-small\n",
                                       "  model: sim-small\n  api_key: sk-secret123\n"))
    said = error_of(path)
    assert said == (f"{path}: unknown key 'endpoint.api_key' (a job file holds no key: put it in "
                    "an environment variable and name that variable in endpoint.api_key_env, "
                    "as api_key_env: OPENAI_API_KEY)")


@pytest.mark.parametrize("name", ["prompts.jsonl", "one.jsonl", "q.csv"])
def test_an_input_file_given_for_the_job_says_so(jobs: Path, name: str) -> None:
    """`shardrun prompts.jsonl`, the data where the job goes: it was a YAML error at line 2, or
    a job of unknown keys `id` and `prompt` for a one-line file; it says what was given."""
    text = {"prompts.jsonl": '{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n',
            "one.jsonl": '{"id": "a", "prompt": "x"}\n', "q.csv": "id,prompt\n1,x\n"}[name]
    path = write(jobs, text, name)
    assert error_of(path) == (f"{path} is an input file ({path.suffix}), not a job file: give "
                              "the job file (YAML) whose input.path names it")


def test_a_non_breaking_space_is_named(jobs: Path) -> None:
    """`shards:\u00a02` pasted from a web page: the colon is followed by no space YAML knows,
    and 'could not find expected :' alone sends the user looking for a colon that is there."""
    message = error_of(write(jobs, MINIMAL + "shards:\u00a02\n"))
    assert message.endswith("; line 6 holds a non-breaking space (U+00A0), which YAML does not "
                            "read as a space"), message


def test_duplicate_key_is_an_error(jobs: Path) -> None:
    """PyYAML would silently keep the last of two equal keys; we refuse."""
    message = error_of(write(jobs, MINIMAL + "shards: 2\nshards: 3\n"))
    assert message == (
        "jobs/x.yaml: YAML error at line 7, column 1:"
        " duplicate key 'shards' (first given on line 6)"
    )


def test_unreadable_or_misshapen_job_files(jobs: Path) -> None:
    """A missing file, a directory and a non-mapping top level are all SpecErrors."""
    assert error_of(Path("jobs/nope.yaml")) == "jobs/nope.yaml: job file not found"
    assert "is a directory" in error_of(Path("jobs"))
    assert error_of(write(jobs, "- a\n- b\n")).startswith(
        "jobs/x.yaml: the top level must be a mapping"
    )
    assert error_of(write(jobs, "")) == "jobs/x.yaml: endpoint is required; input is required"
    assert error_of(write(jobs, MINIMAL + "timeouts: 5\n")) == (
        "jobs/x.yaml: timeouts must be a mapping, got 5"
    )


def test_relative_input_path_resolution(jobs: Path, tmp_path: Path) -> None:
    """input.path is relative to the job file's directory (a flag's: to the cwd)."""
    job = load(write(jobs, MINIMAL))
    assert job.input_path == (tmp_path / "jobs" / "data.jsonl").resolve()
    assert job.job_path == (tmp_path / "jobs" / "x.yaml").resolve()
    absolute = tmp_path / "elsewhere" / "in.jsonl"
    job = load(write(jobs, MINIMAL.replace("data.jsonl", str(absolute))))
    assert job.input_path == absolute.resolve()
    job = load(write(jobs, MINIMAL), flags={"input.path": "cli.jsonl"})
    assert job.input_path == (tmp_path / "cli.jsonl").resolve()


def test_messages_field(jobs: Path) -> None:
    """messages_field replaces the default prompt_field; both at once is an error."""
    job = load(write(jobs, MINIMAL + "  messages_field: msgs\n"))
    assert (job.spec.input.prompt_field, job.spec.input.messages_field) == (None, "msgs")
    assert job.sources["input.prompt_field"] == "default"
    both = MINIMAL + "  messages_field: msgs\n  prompt_field: p\n"
    assert error_of(write(jobs, both)) == (
        "jobs/x.yaml: input.prompt_field and input.messages_field are both set;"
        " give exactly one of them"
    )
    completions = (MINIMAL + "  messages_field: msgs\n").replace(
        "model:", "api: completions\n  model:"
    )
    assert "input.messages_field needs endpoint.api 'chat'" in error_of(write(jobs, completions))


def test_sim_settings_only_with_sim_url(jobs: Path) -> None:
    """endpoint.sim must be a mapping and needs base_url sim:// in the job file; a base_url
    from the environment or a flag sets the block aside, with a warning, instead."""
    with_sim = MINIMAL.replace("model:", "sim: {ttft_ms: 5}\n  model:")
    assert load(write(jobs, with_sim)).spec.endpoint.sim == {"ttft_ms": 5}
    real_url = with_sim.replace("sim://", "'http://h:1/v1'")
    assert error_of(write(jobs, real_url)) == (
        "jobs/x.yaml: endpoint.sim is only allowed when endpoint.base_url is sim://,"
        " but base_url is 'http://h:1/v1'"
    )
    from_env = load(write(jobs, with_sim), env={"SHARDRUN_BASE_URL": "http://u:pw@h:1/v1"})
    assert from_env.spec.endpoint.sim is None and from_env.sim_config() is None
    assert from_env.warnings == (
        "jobs/x.yaml: endpoint.sim is ignored: endpoint.base_url is http://***@h:1/v1 from"
        " env SHARDRUN_BASE_URL, not sim://",
    )
    assert from_env.effective()["endpoint.sim"] == {
        "value": None, "source": "ignored: endpoint.base_url from env SHARDRUN_BASE_URL"}
    still_sim = load(write(jobs, with_sim), env={"SHARDRUN_BASE_URL": "sim://"})
    assert still_sim.spec.endpoint.sim == {"ttft_ms": 5} and still_sim.warnings == ()
    not_mapping = MINIMAL.replace("model:", "sim: fast\n  model:")
    assert error_of(write(jobs, not_mapping)) == (
        "jobs/x.yaml: endpoint.sim must be a mapping with string keys, got 'fast'"
    )


@pytest.mark.parametrize("block", ["{ttft_msx: 5}", "{ttft_ms: fast}", "{fail_503: 2}", "fast",
                                   "{1: 2}"])
def test_a_sim_block_set_aside_is_still_checked(jobs: Path, block: str) -> None:
    """SHARDRUN_BASE_URL sets the job's `sim:` aside, but a broken block is refused with the
    sentence it gets when used: else it would break the job once the variable is unset."""
    path = write(jobs, MINIMAL.replace("model:", f"sim: {block}\n  model:"))
    with pytest.raises(SpecError) as info:
        load(path).sim_config()  # what run and validate do with the block they use
    used = str(info.value)
    assert used.startswith("jobs/x.yaml: endpoint.sim"), used
    assert error_of(path, env={"SHARDRUN_BASE_URL": "http://h:1/v1"}) == used
    assert error_of(path, flags={"endpoint.base_url": "http://h:1/v1"}) == used


@pytest.mark.parametrize("url", ["ftp://h/v1", "http://", "sim://x", "localhost:8000",
                                 "http://127.0.0.1:99999/v1", "http://127.0.0.1:0/v1",
                                 "http://h:port/v1", "http://127.0.0.1:8000/v1 ",
                                 "http://h/v 1"])  # fmt: skip
def test_bad_base_url(jobs: Path, url: str) -> None:
    """Only http(s) URLs with a host (and a port a connection can use, and no spaces, which
    would end up in every request's path), or exactly sim://, are endpoints."""
    message = error_of(write(jobs, MINIMAL.replace("sim://", f"'{url}'")))
    assert message.startswith("jobs/x.yaml: endpoint.base_url must be a URL starting with http://")


def test_retry_backoff_order(jobs: Path) -> None:
    """backoff_max_s below backoff_s is an error that says where each value came from."""
    message = error_of(
        write(jobs, MINIMAL + "retry: {backoff_max_s: 1}\n"), env={"SHARDRUN_RETRY_BACKOFF_S": "5"}
    )
    assert message == (
        "jobs/x.yaml: retry.backoff_max_s must be at least retry.backoff_s"
        " ('5' from env SHARDRUN_RETRY_BACKOFF_S), got 1.0"
    )


def test_retry_backoff_order_against_a_default_first_backoff_says_it_is_the_default(
        jobs: Path) -> None:
    """A cap below the first backoff no one gave reads '(0.5, the default)', not '(0.5 from
    default)'."""
    message = error_of(write(jobs, MINIMAL), env={"SHARDRUN_RETRY_BACKOFF_MAX_S": "0.1"})
    assert message == (
        "environment variable SHARDRUN_RETRY_BACKOFF_MAX_S must be at least retry.backoff_s"
        " (0.5, the default), got '0.1'"
    )


def test_retry_backoff_order_against_the_default_says_where_to_raise_it(jobs: Path) -> None:
    """A first backoff above the default cap (30 s) blames a value no one gave: the message says
    it is the default and names the key and the variable that set it."""
    message = error_of(write(jobs, MINIMAL), env={"SHARDRUN_RETRY_BACKOFF_S": "60"})
    assert message == (
        "jobs/x.yaml: retry.backoff_max_s must be at least retry.backoff_s"
        " ('60' from env SHARDRUN_RETRY_BACKOFF_S), got 30.0 (the default: set"
        " retry.backoff_max_s or SHARDRUN_RETRY_BACKOFF_MAX_S)"
    )


def test_params_cannot_set_what_the_client_sends(jobs: Path) -> None:
    """params passes through, but may not override model, prompt, messages or stream."""
    assert "params must not set 'model', 'stream'" in error_of(
        write(jobs, MINIMAL + "params: {model: x, stream: false, top_p: 1}\n")
    )


@pytest.mark.parametrize("n", ["2", "0", "'3'"])
def test_params_n_other_than_one_is_refused(jobs: Path, n: str) -> None:
    """Several choices would stream interleaved into one answer; n: 1 is fine."""
    path = write(jobs, MINIMAL + f"params: {{n: {n}}}\n")
    got = repr(yaml.safe_load(n))
    assert error_of(path) == (f"{path}: params must not set n to {got}: a result holds one "
                              "answer, so to get several, give the input one record per answer")
    assert load(write(jobs, MINIMAL + "params: {n: 1}\n")) is not None


@pytest.mark.parametrize(("value", "why"), [
    ("{when: !!timestamp 2024-01-01}", "params.when is the date 2024-01-01 (tagged !!timestamp), "
                                       "which JSON has no form of; leave the tag out to send it "
                                       "as text"),
    ("{s: !!set {a: null}}", "params.s is set {'a'}, which JSON cannot carry"),
    ("{b: !!binary aGk=}", "params.b is bytes b'hi', which JSON cannot carry"),
    ("{stop: [x, .nan]}", "params.stop[1] is nan, which JSON cannot carry"),
    ("{x: {true: 1}}", "params.x has the key True, which JSON cannot carry (keys are text; "
                       "quote it)"),
    ("{x: {1: a, '1': b}}", "params.x has the key 1 twice, as a number and as text"),
])
def test_params_that_json_cannot_carry_are_named(jobs: Path, value: str, why: str) -> None:
    """Every request body is JSON: a value YAML reads as something else is one sentence naming
    it, not a traceback from the manifest's or the request's encoder."""
    path = write(jobs, MINIMAL + f"params: {value}\n")
    assert error_of(path) == f"{path}: {why}"


def test_integer_keys_in_params_are_sent_as_text(jobs: Path) -> None:
    """logit_bias's token ids are integers to YAML; JSON's keys are text, and the job file
    still supplies the value."""
    job = load(write(jobs, MINIMAL + "params: {logit_bias: {50256: -100}}\n"))
    assert job.spec.params == {"logit_bias": {"50256": -100}}
    assert job.effective()["params"] == {"value": {"logit_bias": {"50256": -100}},
                                         "source": "job file"}


def test_a_path_under_the_home_of_no_user_is_named(jobs: Path) -> None:
    """`~nouser/...` expands to nothing (Path.expanduser raises RuntimeError): one sentence
    naming the key, variable or flag, not a traceback from where the path is first used."""
    user = "~no-such-user-of-shardrun"
    path = write(jobs, MINIMAL.replace("data.jsonl", f"{user}/data.jsonl"))
    assert error_of(path) == (f"{path}: input.path starts with {user}, which names no home "
                              f"directory here, got '{user}/data.jsonl'")
    assert error_of(write(jobs, MINIMAL), env={"SHARDRUN_RUNS_DIR": user}) == (
        f"environment variable SHARDRUN_RUNS_DIR starts with {user}, which names no home "
        f"directory here, got '{user}'")


@pytest.mark.parametrize(("text", "read"), [
    ("shards: 010", 10), ("shards: 08", 8), ("shards: 0o10", 8), ("shards: 1_0", 10),
    ("params: {stop: '1:30'}", "1:30"), ("params: {stop: 1:30}", "1:30"),
    ("params: {since: 2024-01-01}", "2024-01-01"),
])
def test_numbers_and_dates_are_read_as_yaml_1_2_reads_them(
    jobs: Path, text: str, read: object
) -> None:
    """YAML 1.1 reads 010 as octal 8, 08 as text (then blamed on quotes never typed), 1:30 as
    base-60 90 and 2024-01-01 as a date: a job file is read as YAML 1.2 reads it."""
    job = load(write(jobs, MINIMAL + text + "\n"))
    key, _, _ = text.partition(":")
    value = job.spec.shards if key == "shards" else next(iter(job.spec.params.values()))
    assert value == read and type(value) is type(read)


def test_time_of_day_for_a_number_is_text_not_base_60(jobs: Path) -> None:
    """`shards: 1:30` is no number: an error showing it as typed, not a run of 90 shards."""
    path = write(jobs, MINIMAL + "shards: 1:30\n")
    assert error_of(path) == f"{path}: shards must be an integer from 1 to 1024, got '1:30'"


def test_a_section_left_empty_takes_its_defaults(jobs: Path) -> None:
    """`retry:` (or `params:`, `headers:`) with every key under it commented out is YAML's null:
    the defaults, not 'retry must be a mapping, got None'; and `endpoint:` so says which key it
    needs."""
    job = load(write(jobs, MINIMAL + "retry:\n  # max_attempts: 9\ntimeouts: ~\nparams:\n"))
    assert job.spec.retry.max_attempts == 4 and job.sources["retry.max_attempts"] == "default"
    assert (job.spec.params, job.sources["params"]) == ({}, "default")
    job = load(write(jobs, MINIMAL.replace("model:", "headers:\n  model:")))
    assert (job.spec.endpoint.headers, job.sources["endpoint.headers"]) == ({}, "default")
    path = write(jobs, "endpoint:\ninput: {path: data.jsonl}\n")
    assert error_of(path, env={"SHARDRUN_MODEL": "m"}) == (
        f"{path}: endpoint.base_url is required (set it in the job file or with "
        "SHARDRUN_BASE_URL)")


def test_null_and_booleans_are_shown_in_yaml_words(jobs: Path) -> None:
    """`shards:` with no value is null to YAML; the message says null, not Python's None."""
    path = write(jobs, MINIMAL + "shards:\n")
    assert error_of(path) == f"{path}: shards must be an integer from 1 to 1024, got null"
    path = write(jobs, MINIMAL + "shards: true\n")
    assert error_of(path) == f"{path}: shards must be an integer from 1 to 1024, got true"


def test_a_path_with_a_nul_character_is_named(jobs: Path) -> None:
    """A quoted "\\0" in a path: one sentence, not 'ValueError: embedded null byte' from the
    first OS call that meets it (validate even passed such a runs_dir)."""
    path = write(jobs, MINIMAL + 'runs_dir: "a\\0b"\n')
    assert error_of(path) == (
        f"{path}: runs_dir holds a NUL character, which no path can, got 'a\\x00b'")
    path = write(jobs, MINIMAL.replace("data.jsonl", '"a\\0b"'))
    assert "input.path holds a NUL character" in error_of(path)


def test_a_retry_budget_floor_past_what_json_holds_is_refused(jobs: Path) -> None:
    """budget_floor had no upper bound: 2**70 passed validation and crashed writing the
    manifest (orjson: Integer exceeds 64-bit range)."""
    path = write(jobs, MINIMAL + f"retry: {{budget_floor: {2**70}}}\n")
    assert error_of(path) == (f"{path}: retry.budget_floor must be an integer from 0 to "
                              f"1000000000, got {2**70}")


def test_an_api_key_with_a_control_character_is_refused_up_front(jobs: Path) -> None:
    """A key read with its line break inside (`KEY="$(cat a b)"`): aiohttp refuses the header
    at the first request, a traceback from validate --ping and a shard stopped 'on an
    unexpected ValueError' in a run. The sentence names the variable, never the value."""
    job = load(write(jobs, MINIMAL.replace("model:", "api_key_env: MY_KEY\n  model:")))
    with pytest.raises(SpecError) as info:
        job.api_key({"MY_KEY": "sk-one\nsk-two"})
    assert str(info.value) == (
        "jobs/x.yaml: environment variable MY_KEY (api_key_env) holds a control character "
        "inside the key, such as a line break, which no HTTP header can carry; set it to the "
        "key alone")
    assert job.api_key({"MY_KEY": " sk-one\n"}) == "sk-one"  # around it: stripped, as before


def test_a_key_pasted_as_api_key_env_is_not_echoed(jobs: Path) -> None:
    """api_key_env takes a variable's NAME; a key made only of letters, digits and underscores
    passes that rule, and the 'not set' error printed it into the terminal or the CI log."""
    key = "gsk8fQ2x7Lm0aPz3Wq9Ty4"
    job = load(write(jobs, MINIMAL.replace("model:", f"api_key_env: {key}\n  model:")))
    with pytest.raises(SpecError) as info:
        job.api_key({})
    assert key not in str(info.value)
    assert str(info.value).startswith(
        "jobs/x.yaml: the job names api_key_env of 22 characters (not shown: it looks like a "
        "key, not a variable's name) but that environment variable is not set")


def test_an_api_key_given_with_its_bearer_word_is_refused(jobs: Path) -> None:
    """MY_KEY='Bearer sk-...' went as 'Authorization: Bearer Bearer sk-...', a 401 stop; in
    another header the value goes as it is, so there it stays."""
    job = load(write(jobs, MINIMAL.replace("model:", "api_key_env: MY_KEY\n  model:")))
    with pytest.raises(SpecError) as info:
        job.api_key({"MY_KEY": "Bearer sk-one"})
    assert str(info.value) == (
        "jobs/x.yaml: environment variable MY_KEY (api_key_env) starts with 'Bearer ', which "
        "shardrun puts before the key itself; set it to the key alone")
    other = MINIMAL.replace("model:", "api_key_env: MY_KEY\n  api_key_header: api-key\n  model:")
    assert load(write(jobs, other)).api_key({"MY_KEY": "Bearer x"}) == "Bearer x"


def test_a_base_url_with_the_api_path_pasted_in_is_refused(jobs: Path) -> None:
    """The endpoint's whole URL pasted as base_url: every request went to
    .../chat/completions/chat/completions and the run stopped at its first 404."""
    path = write(jobs, MINIMAL.replace("sim://", "http://u:pw@h:8000/v1/chat/completions/"))
    assert error_of(path) == (
        f"{path}: endpoint.base_url ends in /chat/completions, which shardrun adds itself (the "
        "path of endpoint.api): give the URL before it, http://***@h:8000/v1")
    assert load(write(jobs, MINIMAL.replace("sim://", "http://h/v1"))) is not None


def test_api_key_handling(jobs: Path) -> None:
    """api_key reads the named variable; named-but-unset is an error; none named is None."""
    assert load(write(jobs, MINIMAL)).api_key({"OPENAI_API_KEY": "sk-x"}) is None
    named = MINIMAL.replace("model:", "api_key_env: OPENAI_API_KEY\n  model:")
    job = load(write(jobs, named))
    assert job.api_key({"OPENAI_API_KEY": "sk-x"}) == "sk-x"
    for env, state in (({}, "is not set"), ({"OPENAI_API_KEY": " "}, "is empty")):
        with pytest.raises(SpecError) as info:
            job.api_key(env)
        assert str(info.value) == (
            "jobs/x.yaml: the job names api_key_env OPENAI_API_KEY but that environment variable"
            f" {state}; export it or remove api_key_env"
        )
    via_env = load(write(jobs, MINIMAL), {"SHARDRUN_API_KEY_ENV": "MY_KEY"})
    assert via_env.api_key({"MY_KEY": "k"}) == "k"


def test_api_key_env_holding_a_key_is_refused_without_echoing_it(jobs: Path) -> None:
    """A key pasted where a variable name belongs is rejected, and never printed back."""
    secret = "sk-proj-abc.123/xyz"
    message = error_of(write(jobs, MINIMAL.replace("model:", f"api_key_env: '{secret}'\n  model:")))
    assert "endpoint.api_key_env must be the name of an environment variable" in message
    assert secret not in message


def test_effective_contains_no_secrets(jobs: Path) -> None:
    """The manifest view holds the key's variable name, never its value, nor URL passwords."""
    sentinel = "SENTINEL-sk-0123456789"
    text = MINIMAL.replace("sim://", "'https://user:pw-secret@h:8443/v1'").replace(
        "model:", "api_key_env: OPENAI_API_KEY\n  model:"
    )
    env = {"OPENAI_API_KEY": sentinel}
    # A key pasted into a misnamed variable: refused by name, its value never echoed.
    refused = error_of(write(jobs, text), env={**env, "SHARDRUN_API_KEY": sentinel})
    assert "SHARDRUN_API_KEY (did you mean SHARDRUN_API_KEY_ENV?)" in refused
    assert sentinel not in refused
    job = load(write(jobs, text), env)
    dumped = json.dumps(job.effective())
    assert sentinel not in dumped and "pw-secret" not in dumped
    assert job.effective()["endpoint.api_key_env"]["value"] == "OPENAI_API_KEY"
    assert job.effective()["endpoint.base_url"]["value"] == "https://***@h:8443/v1"
    assert set(job.effective()) == set(LEAF_KEYS)
    assert not any(sentinel in w for w in job.warnings)


def test_a_credential_in_params_is_masked_in_the_manifest_view(jobs: Path) -> None:
    """A key put in `params` (a gateway that reads it from the body), at any depth: the manifest
    (and so `validate`, a resume's warning of changed params, a published run) shows `***` for
    a value whose name says a key, a token, a secret or a password, and every other param as
    given, a name that only ends so (`max_tokens`, `prompt_cache_key`) included."""
    params = ("params:\n  api_key: sk-pk-0123456789\n  max_tokens: 8\n  prompt_cache_key: c1\n"
              "  extra_body:\n    access_token: at-0123456789\n    client_secret: cs-0123\n"
              "    items: [{Password: pw-0123}, {x: 1}]\n"
              # Not strings, so no credentials: a tool schema's property and a number.
              "    schema: {properties: {password: {type: string}}}\n    secret_level: 3\n")
    job = load(write(jobs, MINIMAL + params))
    assert job.effective()["params"]["value"] == {
        "api_key": "***", "max_tokens": 8, "prompt_cache_key": "c1",
        "extra_body": {"access_token": "***", "client_secret": "***",
                       "items": [{"Password": "***"}, {"x": 1}],
                       "schema": {"properties": {"password": {"type": "string"}}},
                       "secret_level": 3}}
    assert job.spec.params["api_key"] == "sk-pk-0123456789"  # sent as given


def test_the_simulators_key_is_masked_in_the_manifest_view(jobs: Path) -> None:
    """`endpoint.sim.auth_required` is the key the job's requests must carry: `***` in the
    manifest view, as given to the simulator."""
    job = load(write(jobs, MINIMAL.replace("model:", "sim: {auth_required: sk-sim-0123456789, "
                                           "ttft_ms: 5}\n  model:")))
    assert job.effective()["endpoint.sim"]["value"] == {"auth_required": "***", "ttft_ms": 5}
    sim = job.sim_config()
    assert sim is not None and sim.auth_required == "sk-sim-0123456789"
    # no key: none is claimed
    job = load(write(jobs, MINIMAL.replace("model:", "sim: {auth_required: null}\n  model:")))
    assert job.effective()["endpoint.sim"]["value"] == {"auth_required": None}


def test_a_url_password_and_an_api_key_cannot_both_authorize(jobs: Path) -> None:
    """Both would be an Authorization header: an error up front, naming both, never a request
    that fails in the shard. Either one alone is fine."""
    with_user = MINIMAL.replace("sim://", "'https://user:pw-secret@h/v1'")
    path = write(jobs, with_user.replace("model:", "api_key_env: KEY\n  model:"))
    with pytest.raises(SpecError) as caught:
        load(path).api_key({"KEY": "sk-1"})
    assert str(caught.value) == (
        f"{path}: endpoint.base_url carries a user name and password, and api_key_env names a "
        "key (KEY): a request sends one Authorization header, so keep only one of the two")
    assert load(write(jobs, with_user)).api_key({"KEY": "sk-1"}) is None
    plain = MINIMAL.replace("sim://", "'https://h/v1'").replace(
        "model:", "api_key_env: KEY\n  model:")
    assert load(write(jobs, plain)).api_key({"KEY": "sk-1"}) == "sk-1"


def test_unknown_shardrun_variables_are_an_error_with_suggestion(jobs: Path) -> None:
    """A misspelt SHARDRUN_* variable is an error naming the closest real one, so an operator's
    override during an incident is never silently dropped; report's variables and empty ones
    pass, and SHARDRUN_IGNORE_VARS lets a wrapper's own variables through (not shardrun's)."""
    path = write(jobs, MINIMAL)
    env = {"SHARDRUN_CONCURENCY": "4", "SHARDRUN_ZZZZZZ": "1", "OTHER": "x",
           "SHARDRUN_SHARDS": "2", "SHARDRUN_EMPTY": "", "SHARDRUN_FAST_FOLD": "0",
           "SHARDRUN_AGGREGATE_WORKERS": "2"}  # the last two: report's
    assert error_of(path, env=env) == (
        "environment variables SHARDRUN_CONCURENCY (did you mean SHARDRUN_CONCURRENCY?) and "
        "SHARDRUN_ZZZZZZ are not shardrun variables; rename or unset them, or add them to "
        "SHARDRUN_IGNORE_VARS if something else reads them (`shardrun --help` lists shardrun's)")
    assert error_of(path, env={"SHARDRUN_SHARD": "3"}) == (
        "environment variable SHARDRUN_SHARD (did you mean SHARDRUN_SHARDS?) is not a shardrun "
        "variable; rename or unset it, or add it to SHARDRUN_IGNORE_VARS if something else "
        "reads it (`shardrun --help` lists shardrun's)")
    wrapped = {**env, "SHARDRUN_IGNORE_VARS": "SHARDRUN_ZZZZZZ, SHARDRUN_CONCURENCY"}
    job = load(path, wrapped)
    assert job.spec.concurrency == 16 and job.spec.shards == 2 and job.warnings == ()
    # Names are case-sensitive: a lower-case one set in an incident was silently not read.
    assert error_of(path, env={"shardrun_concurrency": "4", "Shardrun_Shards": "2"}) == (
        "environment variables Shardrun_Shards (did you mean SHARDRUN_SHARDS?) and "
        "shardrun_concurrency (did you mean SHARDRUN_CONCURRENCY?) are not shardrun variables; "
        "rename or unset them, or add them to SHARDRUN_IGNORE_VARS if something else reads "
        "them (`shardrun --help` lists shardrun's)")
    # A wrapper's variable listed in one case passes in any other (the list matches names
    # without case); shardrun's own, listed in any case, is still an error that names the
    # real spelling: `shardrun_concurrency` listed let `shardrun_concurrency=1` run at 16.
    assert load(path, {"shardrun_job_name": "a", "Shardrun_Zz": "b", "SHARDRUN_IGNORE_VARS":
                       "SHARDRUN_JOB_NAME,shardrun_zz"}).warnings == ()
    assert error_of(path, env={"shardrun_concurrency": "1", "SHARDRUN_IGNORE_VARS":
                               "shardrun_concurrency"}) == (
        "SHARDRUN_IGNORE_VARS names shardrun_concurrency, which is shardrun's own variable "
        "SHARDRUN_CONCURRENCY in another case and cannot be ignored; remove it from "
        "SHARDRUN_IGNORE_VARS and spell the variable SHARDRUN_CONCURRENCY")
    assert error_of(path, env={"shardrun_model": "m", "SHARDRUN_IGNORE_VARS": "Shardrun_Model"}
                    ).startswith("SHARDRUN_IGNORE_VARS names Shardrun_Model, which is "
                                 "shardrun's own variable SHARDRUN_MODEL in another case")
    assert error_of(path, env={"SHARDRUN_IGNORE_VARS": "Shardrun_Shards"}) == (
        "SHARDRUN_IGNORE_VARS names Shardrun_Shards, which is shardrun's own variable "
        "SHARDRUN_SHARDS in another case and cannot be ignored; remove it from "
        "SHARDRUN_IGNORE_VARS and spell the variable SHARDRUN_SHARDS")
    assert error_of(path, env={"SHARDRUN_IGNORE_VARS": "SHARDRUN_SHARDS"}) == (
        "SHARDRUN_IGNORE_VARS names SHARDRUN_SHARDS, which is shardrun's own variable and "
        "cannot be ignored; remove it from SHARDRUN_IGNORE_VARS")
    # The job's own key variable is read, whatever its name: in the file or from a variable.
    keyed = write(jobs, MINIMAL.replace("sim://", "'https://h/v1'").replace(
        "model:", "api_key_env: SHARDRUN_KEY\n  model:"))
    assert load(keyed, {"SHARDRUN_KEY": "sk-1"}).api_key({"SHARDRUN_KEY": "sk-1"}) == "sk-1"
    named = {"SHARDRUN_API_KEY_ENV": "SHARDRUN_OTHER_KEY", "SHARDRUN_OTHER_KEY": "sk-2"}
    assert load(keyed, named).api_key(named) == "sk-2"


def test_yaml_exponent_without_dot_is_a_number(jobs: Path) -> None:
    """YAML 1.1 would read 1e-3 as text; a job file means the number."""
    job = load(write(jobs, MINIMAL + "retry: {backoff_s: 1e-3}\n"))
    assert job.spec.retry.backoff_s == 0.001


def test_env_var_table() -> None:
    """ENV_VARS covers DESIGN §7, points at real leaf keys, and names flags consistently."""
    names = [v.name for v in ENV_VARS]
    assert len(set(names)) == len(names) and all(n.startswith("SHARDRUN_") for n in names)
    assert all(v.key in LEAF_KEYS and v.help for v in ENV_VARS)
    assert {"SHARDRUN_SHARDS", "SHARDRUN_RETRY_BUDGET", "SHARDRUN_API_KEY_ENV"} <= set(names)
    assert flag_for("shards") == "--shards" and flag_for("runs_dir") == "--runs-dir"
    assert flag_for("retry.budget_ratio") == "--retry-budget"


def test_spec_is_frozen(jobs: Path) -> None:
    """A loaded spec cannot be changed after validation."""
    job = load(write(jobs, MINIMAL))
    with pytest.raises(Exception, match="frozen"):
        setattr(job.spec, "shards", 9)  # noqa: B010 - mypy cannot see pydantic frozen


LAYERS = st.fixed_dictionaries(
    {
        "flag": st.one_of(st.none(), st.integers(1, 1024)),
        "env": st.one_of(st.none(), st.integers(1, 1024)),
        "file": st.one_of(st.none(), st.integers(1, 1024)),
    }
)


@settings(max_examples=60, deadline=None)
@given(layers=LAYERS)
def test_highest_present_layer_wins(layers: dict[str, int | None]) -> None:
    """For any set of layers setting shards, the highest-precedence one present wins."""
    with tempfile.TemporaryDirectory() as tmp:
        text = MINIMAL + (f"shards: {layers['file']}\n" if layers["file"] is not None else "")
        path = Path(tmp) / "job.yaml"
        path.write_text(text)
        env = {} if layers["env"] is None else {"SHARDRUN_SHARDS": str(layers["env"])}
        job = load_job(path, env=env, flags={"shards": layers["flag"]})
    expected = {"flag": "flag --shards", "env": "env SHARDRUN_SHARDS", "file": "job file"}
    winner = next((k for k in ("flag", "env", "file") if layers[k] is not None), None)
    assert job.spec.shards == (4 if winner is None else layers[winner])
    assert job.sources["shards"] == ("default" if winner is None else expected[winner])


# -- issue #5: formats, templates, rate limits, prices, output --------------------------------


def test_new_sections_default_to_off(jobs: Path) -> None:
    """Rate limits unlimited, no prices, shardrun output, format from the extension."""
    job = load(write(jobs, MINIMAL))
    spec = job.spec
    assert (spec.rate_limits.rpm, spec.rate_limits.tpm) == (None, None)
    assert spec.pricing.model_dump() == {"input_per_1m": None, "output_per_1m": None,
                                         "cached_input_per_1m": None, "hourly": None}  # fmt: skip
    assert spec.output.format == "shardrun"
    assert (spec.input.format, spec.input.template, spec.input.system_prompt) == (
        "jsonl", None, None)  # fmt: skip
    for key in ("rate_limits.rpm", "pricing.hourly", "output.format", "input.format"):
        assert job.sources[key] == "default"


@pytest.mark.parametrize(
    ("path", "expected"),
    [("d.csv", "csv"), ("D.CSV", "csv"), ("x/d.parquet", "parquet"), ("d.jsonl", "jsonl"),
     ("d.txt", "jsonl"), ("data", "jsonl")],
)
def test_input_format_from_extension(jobs: Path, path: str, expected: str) -> None:
    """input.format follows the file name unless stated; openai-batch only when stated."""
    job = load(write(jobs, MINIMAL.replace("data.jsonl", path)))
    assert job.spec.input.format == expected
    stated = load(write(jobs, MINIMAL + "  format: openai-batch\n"))
    assert stated.spec.input.format == "openai-batch"
    assert stated.spec.input.prompt_field is None
    assert stated.sources["input.format"] == "job file"


def test_rate_limits_layering(jobs: Path) -> None:
    """rpm/tpm come from the file, SHARDRUN_RPM/TPM or --rpm/--tpm; 'none' lifts a limit."""
    path = write(jobs, MINIMAL + "rate_limits: {rpm: 600, tpm: 90000}\n")
    job = load(path, {"SHARDRUN_TPM": "none", "SHARDRUN_RPM": "1e3"})
    assert (job.spec.rate_limits.rpm, job.spec.rate_limits.tpm) == (1000.0, None)
    assert job.sources["rate_limits.tpm"] == "env SHARDRUN_TPM"
    job = load(path, {"SHARDRUN_RPM": "1e3"}, {"rate_limits.rpm": "30"})
    assert (job.spec.rate_limits.rpm, job.sources["rate_limits.rpm"]) == (30.0, "flag --rpm")
    rpm_must = ("must be a number of at least 0.01 (requests per minute: one request in 100 "
                "minutes), or none for no limit, got")
    assert error_of(path, env={"SHARDRUN_RPM": "fast"}) == (
        f"environment variable SHARDRUN_RPM {rpm_must} 'fast'")
    assert error_of(write(jobs, MINIMAL + "rate_limits: {tpm: 0}\n")).startswith(
        "jobs/x.yaml: rate_limits.tpm must be a number of at least 1 (tokens per minute), or "
        "none for no limit, got 0")
    # A limit no one means (a typo for 1e9) made a run that sat idle for years, looking hung.
    path = write(jobs, MINIMAL)
    assert error_of(path, flags={"rate_limits.rpm": "1e-9"}) == f"--rpm {rpm_must} '1e-9'"
    assert error_of(path, env={"SHARDRUN_TPM": "0.5"}).startswith(
        "environment variable SHARDRUN_TPM must be a number of at least 1 ")
    assert error_of(write(jobs, MINIMAL + "rate_limits: {rpm: 0.009}\n")) == (
        f"jobs/x.yaml: rate_limits.rpm {rpm_must} 0.009")
    floors = load(path, flags={"rate_limits.rpm": "0.01", "rate_limits.tpm": "1"})
    assert (floors.spec.rate_limits.rpm, floors.spec.rate_limits.tpm) == (0.01, 1.0)
    # The word the message offers works in the file too, as null does.
    unlimited = load(write(jobs, MINIMAL + "rate_limits: {rpm: none, tpm: Unlimited}\n"))
    assert (unlimited.spec.rate_limits.rpm, unlimited.spec.rate_limits.tpm) == (None, None)
    # ... and is the file's own setting, not the default's.
    assert unlimited.sources["rate_limits.rpm"] == unlimited.sources["rate_limits.tpm"] == (
        "job file")


def test_flags_a_later_pass_carries_keep_their_values_exactly(jobs: Path) -> None:
    """The command a stopped pass prints carries its flags: a large limit comes back as given
    (`:g` wrote --tpm 1234567 as 1.23457e+06, which the next pass then ran with), a fraction
    as given, `none` as `none`, and a value from the file or environment not at all."""
    path = write(jobs, MINIMAL + "rate_limits: {rpm: 600}\n")
    job = load(path, {"SHARDRUN_CONCURRENCY": "7"},
               {"rate_limits.tpm": "1234567", "shards": "3", "rate_limits.rpm": "0.5"})
    assert carried_flags(job) == ["--shards", "3", "--rpm", "0.5", "--tpm", "1234567"]
    assert carried_flags(load(path, {}, {"rate_limits.rpm": "none"})) == ["--rpm", "none"]


@pytest.mark.parametrize("url", ["http://[::1]:8000/v1", "http://h:/v1", "http://u:p@h:80/v1",
                                 "https://h/v1?api-version=2024-10-21"])  # fmt: skip
def test_good_base_url(jobs: Path, url: str) -> None:
    """IPv6 hosts, an empty port (the scheme's own), credentials, a query: all fine."""
    assert load(write(jobs, MINIMAL.replace("sim://", f"'{url}'"))).spec.endpoint.base_url == url


def test_pricing_one_basis(jobs: Path) -> None:
    """Per-token prices or an hourly price, both >= 0, never both."""
    job = load(write(jobs, MINIMAL + "pricing: {input_per_1m: 0.15, output_per_1m: 0.6}\n"))
    assert (job.spec.pricing.input_per_1m, job.spec.pricing.output_per_1m) == (0.15, 0.6)
    assert load(write(jobs, MINIMAL + "pricing: {hourly: 2}\n")).spec.pricing.hourly == 2.0
    assert error_of(write(jobs, MINIMAL + "pricing: {hourly: 2, output_per_1m: 1}\n")) == (
        "jobs/x.yaml: pricing.hourly cannot be combined with pricing.output_per_1m: give either"
        " an hourly price or per-token prices"
    )
    assert error_of(write(jobs, MINIMAL + "pricing: {hourly: 2, cached_input_per_1m: 1}\n")) == (
        "jobs/x.yaml: pricing.hourly cannot be combined with pricing.cached_input_per_1m: give"
        " either an hourly price or per-token prices"
    )
    cached = load(write(jobs, MINIMAL + "pricing: {input_per_1m: 1, cached_input_per_1m: 0.1}\n"))
    assert cached.spec.pricing.cached_input_per_1m == 0.1
    assert error_of(write(jobs, MINIMAL + "pricing: {hourly: -1}\n")) == (
        "jobs/x.yaml: pricing.hourly must be a number of at least 0, got -1"
    )


def test_template_and_system_prompt(jobs: Path) -> None:
    """A template needs no prompt_field; template and prompt_field together are an error; a
    bad placeholder is refused at load time with the reason."""
    job = load(write(jobs, MINIMAL + "  template: 'Sum up: {text}'\n  system_prompt: Be terse\n"))
    assert (job.spec.input.template, job.spec.input.prompt_field) == ("Sum up: {text}", None)
    both = MINIMAL + "  template: '{a}'\n  prompt_field: p\n"
    assert error_of(write(jobs, both)) == (
        "jobs/x.yaml: input.prompt_field and input.template are both set; give exactly one of them"
    )
    assert error_of(write(jobs, MINIMAL + "  template: 'x {a.b}'\n")) == (
        "jobs/x.yaml: input.template is not a valid template: placeholder {a.b} uses attribute"
        " access; name a field only"
    )
    with_messages = MINIMAL + "  messages_field: m\n  system_prompt: S\n"
    assert error_of(write(jobs, with_messages)) == (
        "jobs/x.yaml: input.system_prompt cannot be combined with input.messages_field: a"
        " message list carries its own system message"
    )
    completions = (MINIMAL + "  system_prompt: S\n").replace("model:", "api: completions\n  model:")
    assert "input.system_prompt needs endpoint.api 'chat'" in error_of(write(jobs, completions))
    template_completions = (MINIMAL + "  template: 'Q {q}'\n").replace(
        "model:", "api: completions\n  model:"
    )
    assert load(write(jobs, template_completions)).spec.input.template == "Q {q}"


def test_batch_format_takes_no_prompt_settings(jobs: Path) -> None:
    """openai-batch lines carry their own bodies: prompt settings are refused, not ignored."""
    text = MINIMAL + "  format: openai-batch\n  template: '{a}'\n"
    assert error_of(write(jobs, text)) == (
        "jobs/x.yaml: input.template does not apply to input.format 'openai-batch': each line"
        " carries its own request body"
    )
    assert error_of(write(jobs, MINIMAL + "  format: xml\n")).startswith(
        "jobs/x.yaml: input.format must be 'jsonl', 'csv', 'parquet' or 'openai-batch'"
    )


def test_output_format(jobs: Path) -> None:
    """output.format is shardrun or openai-batch; unknown keys in the new sections suggest."""
    job = load(write(jobs, MINIMAL + "output: {format: openai-batch}\n"))
    assert job.spec.output.format == "openai-batch"
    assert error_of(write(jobs, MINIMAL + "rate_limits: {rmp: 5}\n")) == (
        "jobs/x.yaml: unknown key 'rate_limits.rmp' (did you mean 'rate_limits.rpm'?)"
    )


@pytest.mark.parametrize(("endpoint", "message"), [
    ({"headers": {"Bad Name": "x"}}, "endpoint.headers has 'Bad Name', which is not an HTTP "
                                     "header name"),
    ({"headers": {"content-type": "text/plain"}}, "endpoint.headers must not set content-type: "
                                                  "shardrun sends it itself"),
    ({"headers": {"X-A": "a\nb"}}, "endpoint.headers has a line break in the value of X-A"),
    ({"headers": {"X-A": 5}}, "endpoint.headers must be a mapping of header names to text "
                              "(quote a number: X-Version: '2'), got 5"),
    ({"api_key_header": "two words"}, "endpoint.api_key_header must be an HTTP header name, "
                                      "such as Authorization or api-key, got 'two words'"),
    ({"api_key_env": "K", "api_key_header": "api-key", "headers": {"API-Key": "x"}},
     "endpoint.headers must not set 'api-key', the header endpoint.api_key_header names for the "
     "key of endpoint.api_key_env"),
    ({"base_url": "https://u:p@h/v1", "headers": {"Authorization": "Bearer x"}},
     "endpoint.headers must not set Authorization: endpoint.base_url carries a user name and "
     "password, which are sent as that header"),
])  # fmt: skip
def test_request_headers_are_checked_before_any_request(jobs: Path, endpoint: dict[str, Any],
                                                        message: str) -> None:
    """endpoint.headers and endpoint.api_key_header: one sentence per mistake, naming the key."""
    job = {"endpoint": {"base_url": "https://h/v1", "model": "m", **endpoint},
           "input": {"path": "data.jsonl"}}
    path = write(jobs, yaml.safe_dump(job))
    assert error_of(path) == f"{path}: {message}"


def test_request_headers_default_and_pass_through(jobs: Path) -> None:
    """No job headers and the key in Authorization by default; job headers reach the manifest
    view as given, but for values whose names say they are credentials."""
    job = load(write(jobs, MINIMAL))
    assert (job.spec.endpoint.headers, job.spec.endpoint.api_key_header) == ({}, "Authorization")
    text = MINIMAL.replace("  model: sim-small\n", "  model: sim-small\n  headers: {X-Org: acme, "
                           "Authorization: Bearer sk-1, X-Api-Key: k2, Cookie: c3}\n")
    job = load(write(jobs, text))
    assert job.spec.endpoint.headers["Authorization"] == "Bearer sk-1"  # sent as given
    assert job.effective()["endpoint.headers"] == {  # but masked where it is recorded
        "value": {"X-Org": "acme", "Authorization": "***", "X-Api-Key": "***", "Cookie": "***"},
        "source": "job file"}


def test_a_base_url_fragment_is_refused(jobs: Path) -> None:
    """A `#fragment` is never sent: a URL that has one is a mistake (a query is fine)."""
    path = write(jobs, MINIMAL.replace("sim://", "'https://h/v1#x'"))
    assert error_of(path) == (f"{path}: endpoint.base_url must be a URL starting with http:// "
                              "or https:// (a port from 1 to 65535 if any, no spaces, "
                              "no #fragment), or sim://, got 'https://h/v1#x'")
    assert load(write(jobs, MINIMAL.replace("sim://", "'https://h/v1?a=1'"))) is not None


def test_stream_usage_is_on_by_default_and_takes_only_true_or_false(jobs: Path) -> None:
    """endpoint.stream_usage: true unless the job says false; any other value is one sentence."""
    job = load(write(jobs, MINIMAL))
    assert job.spec.endpoint.stream_usage is True
    assert job.effective()["endpoint.stream_usage"] == {"value": True, "source": "default"}
    off = MINIMAL.replace("  model: sim-small\n", "  model: sim-small\n  stream_usage: false\n")
    job = load(write(jobs, off))
    assert job.spec.endpoint.stream_usage is False
    assert job.effective()["endpoint.stream_usage"] == {"value": False, "source": "job file"}
    path = write(jobs, MINIMAL.replace("  model: sim-small\n",
                                       "  model: sim-small\n  stream_usage: 'no'\n"))
    assert error_of(path) == (f"{path}: endpoint.stream_usage must be true or false, got 'no' "
                              "(a job file reads yes, no, on and off as text, as YAML 1.2 does; "
                              "write true or false)")


def test_masked_url_keeps_everything_but_the_userinfo_and_path_parameters() -> None:
    """A user name alone may be the key (`http://sk-...@proxy/v1`), and so may a path
    parameter's value (`/v1;token=...`): both are masked, as a password is."""
    assert masked_url("http://u:p@[::1]:8000/v1") == "http://***@[::1]:8000/v1"
    assert masked_url("https://User:s3cr%40t@Host.example/v1?api-version=1") == (
        "https://***@Host.example/v1?api-version=1")
    assert masked_url("https://sk-live-1@h/v1") == "https://***@h/v1"
    # All the path from its first parameter on: a value may hold a '/', a parameter no name.
    assert masked_url("https://h/v1;token=abc;v") == "https://h/v1;***"
    assert masked_url("https://h/a;k=1/v1") == "https://h/a;***"
    assert masked_url("https://h/v1;token=abc/def") == "https://h/v1;***"  # '/def' leaked
    assert masked_url("https://h/v1;sk-abc") == "https://h/v1;***"  # a nameless one was kept
    assert masked_url("http://u@h/v1;token=ab/cd/chat/completions?key=k") == (
        "http://***@h/v1;***?key=***")
    assert masked_url("https://h/v1") == "https://h/v1"
    assert masked_url("https://h/v1?") == "https://h/v1?"  # as written when nothing is hidden


def test_masked_url_hides_query_parameters_named_like_credentials(jobs: Path) -> None:
    """`?key=...` (some gateways take the key so) reached the manifest's endpoint_url and
    effective values as typed; parameters of other names are kept as they are."""
    assert masked_url("https://h/v1?api-version=2024-06-01&api_key=sk-1&x") == (
        "https://h/v1?api-version=2024-06-01&api_key=***&x")
    assert masked_url("http://u:p@h/v1?sig=abc&sv=2") == "http://***@h/v1?sig=***&sv=2"
    assert masked_url("https://f.example/api?code=abc") == "https://f.example/api?code=***"
    # Fields split at ';' too (`?a=1;key=s` leaked the key), a secret masked to the next '&'.
    assert masked_url("https://h/v1?a=1;key=s") == "https://h/v1?a=1;key=***"
    assert masked_url("https://h/v1?a=1&x=2;api_key=s;t&b=3") == (
        "https://h/v1?a=1&x=2;api_key=***&b=3")
    assert masked_url("https://h/v1?key=abc;def&b=3") == "https://h/v1?key=***&b=3"
    assert masked_url("https://h/v1?a=1;b=2&c") == "https://h/v1?a=1;b=2&c"  # nothing hidden
    url = "http://127.0.0.1:9/v1?key=sk-secret"
    job = load(write(jobs, MINIMAL), env={"SHARDRUN_BASE_URL": url})
    assert job.effective()["endpoint.base_url"]["value"] == "http://127.0.0.1:9/v1?key=***"


def test_a_price_for_one_side_only_warns(jobs: Path) -> None:
    """An input price without an output price (or the reverse) would count the other side's
    tokens as free: the job loads, with a warning naming the missing key; both prices, an
    hourly price or none at all load quietly."""
    half = load(write(jobs, MINIMAL + "pricing: {input_per_1m: 0.15}\n"))
    assert half.warnings == ("jobs/x.yaml: pricing has no output_per_1m, so output tokens count "
                             "as free in the spend; set it (0 if they are free)",)
    other = load(write(jobs, MINIMAL + "pricing: {output_per_1m: 0.6}\n"))
    assert [w.split(",")[0] for w in other.warnings] == ["jobs/x.yaml: pricing has no input_per_1m"]
    cached = load(write(jobs, MINIMAL + "pricing: {cached_input_per_1m: 0.075}\n"))
    assert [w.split(",")[0] for w in cached.warnings] == [
        "jobs/x.yaml: pricing has only cached_input_per_1m"]
    for pricing in ("{input_per_1m: 0.15, output_per_1m: 0.6}", "{hourly: 2.5}", "{}"):
        assert load(write(jobs, MINIMAL + f"pricing: {pricing}\n")).warnings == ()


def test_an_input_path_that_is_a_loop_of_symbolic_links_is_one_input_error(
        tmp_path: Path) -> None:
    """input.path naming a link in a loop of links (a -> b -> a) stopped the run with a
    traceback (pathlib's RuntimeError, resolving it); it is one sentence, from the job's load
    as from the reader's open (where a Python that resolves such a path leaves it)."""
    (tmp_path / "a.jsonl").symlink_to("b.jsonl")
    (tmp_path / "b.jsonl").symlink_to("a.jsonl")
    said = (f"input file {tmp_path / 'a.jsonl'} is a loop of symbolic links (each names the "
            "next); input.path in the job file must name a file")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"endpoint": {"base_url": "sim://", "model": "m"},
                                   "input": {"path": "a.jsonl"}}))
    with pytest.raises(InputError) as caught:
        load(job)
    assert str(caught.value) == said
    with pytest.raises(InputError) as caught:
        InputReader(tmp_path / "a.jsonl", InputPlan())
    assert str(caught.value) == said


def test_extension_keys_hold_anchors_and_are_left_alone(jobs: Path) -> None:
    """`x-` keys (docker compose's extension fields) at the top level and in a section are
    read and left out, so an anchor has a place; any other unknown key is still an error."""
    text = ("x-endpoint: &endpoint {base_url: sim://, model: shared}\n"
            "x-note: any value at all\n"
            "endpoint: {<<: *endpoint, api: completions}\n"
            "input: {path: data.jsonl}\n"
            "retry: {x-why: tuned in the incident of May, max_attempts: 2}\n")
    job = load(write(jobs, text))
    assert (job.spec.endpoint.model, job.spec.endpoint.api) == ("shared", "completions")
    assert job.spec.retry.max_attempts == 2
    assert "x-endpoint" not in json.dumps(job.effective())
    assert error_of(write(jobs, text + "y-note: 1\n")) == (
        "jobs/x.yaml: unknown key 'y-note'")
    assert error_of(write(jobs, text.replace("x-why", "why"))).startswith(
        "jobs/x.yaml: unknown key 'retry.why'")


def test_extension_keys_in_the_simulators_block_are_left_alone_and_sent_keys_kept(
    jobs: Path,
) -> None:
    """`endpoint.sim` names its settings as a section does: an `x-` key there (an anchor's
    holder) was 'unknown simulator setting'. In params and endpoint.headers, whose keys go to
    the server (`x-api-key`), an `x-` key is kept."""
    text = MINIMAL.replace("  model: sim-small\n", (
        "  model: sim-small\n"
        "  headers: {x-team: ml}\n"
        "  sim: {x-fast: &fast {ttft_ms: 0, itl_ms: 0}, <<: *fast, seed: 7}\n"
    )) + "params: {x-trace: t1}\n"
    job = load(write(jobs, text))
    assert job.spec.endpoint.sim == {"ttft_ms": 0, "itl_ms": 0, "seed": 7}
    sim = job.sim_config()
    assert sim is not None and (sim.seed, sim.ttft_ms) == (7, 0)
    assert job.spec.endpoint.headers == {"x-team": "ml"}
    assert job.spec.params == {"x-trace": "t1"}
    assert "x-fast" not in json.dumps(job.effective())
    with pytest.raises(SpecError) as caught:  # any other unknown name is still refused
        load(write(jobs, text.replace("x-fast", "fast"))).sim_config()
    assert str(caught.value).startswith(
        "jobs/x.yaml: endpoint.sim: unknown simulator setting 'fast'; known: ")


def test_surrogate_pair_escapes_are_the_character_and_half_a_pair_is_named(jobs: Path) -> None:
    """`"\\ud83d\\ude00"` (as JSON writes an emoji) came out of PyYAML as two lone surrogates:
    'endpoint.model has bytes that are not UTF-8', and a traceback for a params value. The pair
    is the character it stands for; half a pair is one sentence at its line."""
    job = load(write(jobs, MINIMAL.replace("sim-small", '"m-\\ud83d\\ude00"')
                     + 'params: {stop: ["\\uD83D\\uDE00 \\u00e9"], "\\ud83d\\ude00": 1}\n'))
    assert job.spec.endpoint.model == "m-\U0001F600"
    assert job.spec.params == {"stop": ["\U0001F600 \u00e9"], "\U0001F600": 1}
    json.dumps(job.effective(), ensure_ascii=False).encode()  # no surrogate is left to write
    half = MINIMAL + 'params:\n  stop: "a\\ude00\\ud83d"\n'  # in the wrong order: two halves
    assert error_of(write(jobs, half)) == (
        "jobs/x.yaml: YAML error at line 7, column 9: the escape \\ude00 is half of a UTF-16 "
        "surrogate pair, without its other half: write the character itself, or both halves of "
        "its pair")


def test_a_job_file_not_in_utf8_is_named_with_its_line(jobs: Path) -> None:
    """A job file saved as Latin-1: the file, the line and the byte, and what to do."""
    (jobs / "x.yaml").write_bytes(MINIMAL.replace("sim-small", "caf\xe9").encode("latin-1"))
    assert error_of(Path("jobs/x.yaml")) == (
        "jobs/x.yaml: not UTF-8 text (line 3, byte 42 of the file): save it as UTF-8")


def _laughs(levels: int) -> str:
    """params holding aliases nested `levels` deep, ten to a level: 10**levels values."""
    lines = ['  l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 10)}]" for n in range(1, levels)]
    return MINIMAL + "params:\n" + "\n".join(lines) + "\n"


def test_aliases_that_multiply_past_the_limit_are_refused(jobs: Path) -> None:
    """A 'billion laughs' job file (nine levels: a billion values, every one copied, checked
    and sent with every request) is one sentence, at once; one that shares a little loads."""
    said = error_of(write(jobs, _laughs(9)))
    assert said == ("jobs/x.yaml: its aliases (*name) would add more than 100,000 values to "
                    "those written in it, which no job needs (aliases inside aliases "
                    "multiply): write out what they share, or share less")
    assert error_of(write(jobs, _laughs(5))) == said  # 111,110 values
    job = load(write(jobs, _laughs(4)))  # 11,110 values: a big share, under the limit
    assert json.dumps(job.spec.params["l3"]).count("lol") == 10_000
    # The limit counts what aliases add, not what is written out: 120,000 plain values load.
    many = ", ".join(["1"] * 120_000)
    assert len(load(write(jobs, MINIMAL + f"params: {{logit_bias_ids: [{many}]}}\n"))
               .spec.params["logit_bias_ids"]) == 120_000


def test_an_alias_of_a_block_under_x_used_once_adds_nothing(jobs: Path) -> None:
    """A big logit_bias anchored under `x-` and used once was counted as added (the `x-`
    entry is left out of the job, so the alias is its only copy) and refused, while the same
    mapping written in place loaded. A billion laughs under `x-`, used, is still refused."""
    entries = ", ".join(f"{n}: -1" for n in range(50_001))
    shared = write(jobs, f"x-bias: &bias {{{entries}}}\n" + MINIMAL
                   + "params: {max_tokens: 32, logit_bias: *bias}\n")
    assert len(load(shared).spec.params["logit_bias"]) == 50_001
    inside = MINIMAL.replace("endpoint:\n", f"endpoint:\n  x-bias: &bias {{{entries}}}\n")
    job = load(write(jobs, inside + "params: {logit_bias: *bias}\n"))
    assert len(job.spec.params["logit_bias"]) == 50_001
    # So in endpoint.sim, whose `x-` keys are left out too: it was counted as kept there.
    in_sim = MINIMAL.replace("endpoint:\n", f"endpoint:\n  sim: {{x-bias: &bias {{{entries}}}}}\n")
    job = load(write(jobs, in_sim + "params: {logit_bias: *bias}\n"))
    assert len(job.spec.params["logit_bias"]) == 50_001 and job.spec.endpoint.sim == {}
    # Used twice, the second use is a copy: 100,003 values added.
    twice = write(jobs, f"x-bias: &bias {{{entries}}}\n" + MINIMAL
                  + "params: {logit_bias: *bias, also: *bias}\n")
    assert "would add more than 100,000 values" in error_of(twice)
    laughs = _laughs(6).replace("params:\n", "x-laughs:\n") + "params: {l: *l5}\n"
    assert "would add more than 100,000 values" in error_of(write(jobs, laughs))


def test_duplicate_key_texts_are_found_in_linear_comparisons() -> None:
    """`_json_value` counted each key's text over all of them (`texts.count`): a plain
    50,001-key logit_bias took 20 s to load. Counted here by the comparisons it makes."""
    compared = [0]

    class Text(str):
        def __eq__(self, other: object) -> bool:
            compared[0] += 1
            return str.__eq__(self, other)

        __hash__ = str.__hash__

        def __str__(self) -> str:
            return self

    value = {Text(f"k{n}"): 1 for n in range(2_000)}
    assert _json_value(value, "params.logit_bias") == {f"k{n}": 1 for n in range(2_000)}
    assert compared[0] < 20_000, compared[0]  # texts.count made 4 million
    with pytest.raises(PydanticCustomError, match="has the key 1 twice"):
        _json_value({1: 0, "1": 0, 2: 0}, "params.logit_bias")


@pytest.mark.parametrize(("written", "via", "said"), [
    ('"gpt-4o\\u200b"', "file", "endpoint.model holds the invisible character U+200B (ZERO "
                                "WIDTH SPACE): 'gpt-4o<U+200B>'"),
    ('" gpt-4o"', "file", "endpoint.model has spaces around it: ' gpt-4o'"),
    ('"gpt-4o\\t"', "file", "endpoint.model holds the invisible character U+0009: "
                             "'gpt-4o<U+0009>'"),
    ("\ufeffgpt-4o", "env", "environment variable SHARDRUN_MODEL holds the invisible character "
                            "U+FEFF (ZERO WIDTH NO-BREAK SPACE): '<U+FEFF>gpt-4o'"),
    ("gpt\xa04o", "env", "environment variable SHARDRUN_MODEL holds the invisible character "
                         "U+00A0 (NO-BREAK SPACE): 'gpt<U+00A0>4o'"),
])  # fmt: skip
def test_a_model_name_with_an_invisible_character_is_refused(
    jobs: Path, written: str, via: str, said: str
) -> None:
    """The name goes to the server as written: 'gpt-4o' plus a zero-width space is a 404 per
    item, each one paid for. The sentence names where it came from and shows the character."""
    if via == "file":
        path, env = write(jobs, MINIMAL.replace("sim-small", written)), {}
    else:
        path, env = write(jobs, MINIMAL), {"SHARDRUN_MODEL": written}
    origin = "jobs/x.yaml: " if via == "file" else ""
    assert error_of(path, env=env) == (f"{origin}{said}, and no server knows a model by that "
                                       "name; give the name alone")
    # Spaces around a variable's text go, as for every text; a plain one inside stays.
    spaced = load(write(jobs, MINIMAL), env={"SHARDRUN_MODEL": " org/my model-7b "})
    assert spaced.spec.endpoint.model == "org/my model-7b"


@pytest.mark.parametrize("name", [
    "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645\u200c\u0645\u062f\u0644",  # ZWNJ
    "model\U0001f468\u200d\U0001f469\u200d\U0001f467",  # an emoji family, joined by ZWJ
    "model-\U0001fae8",  # SHAKING FACE: Unicode 15, unassigned in Python 3.11's tables
])  # fmt: skip
def test_a_model_name_with_joiners_or_newer_characters_loads(jobs: Path, name: str) -> None:
    """Every format character (Cf) and every character unknown to this Python's Unicode tables
    (Cn) was refused as invisible: U+200C and U+200D spell Persian and Indic words and join
    emoji, and newer emoji are unknown to older tables. Such a name loads, from the file and
    from the environment, and so does a URL holding one; U+200B and U+FEFF are still refused."""
    assert load(write(jobs, MINIMAL.replace("sim-small", json.dumps(name, ensure_ascii=False))))\
        .spec.endpoint.model == name
    assert load(write(jobs, MINIMAL), env={"SHARDRUN_MODEL": name}).spec.endpoint.model == name
    url = f"http://h:8/v1/{name}"
    assert load(write(jobs, MINIMAL), env={"SHARDRUN_BASE_URL": url}).spec.endpoint.base_url \
        == url
    for odd in ("\u200b", "\ufeff", "\u202e"):
        assert "invisible character" in error_of(
            write(jobs, MINIMAL), env={"SHARDRUN_MODEL": name + odd})


@pytest.mark.parametrize("char", [
    "\U000e0041", "\U000e0001", "\U000e007f",  # tag characters (a hidden 'A', LANGUAGE TAG)
    "\u206a", "\u206f",  # deprecated format characters
    "\ufff9", "\ufffb",  # interlinear annotation marks
    "\ue000", "\U000f0000",  # private use (category Co), refused as before a12b6d3
])  # fmt: skip
@pytest.mark.parametrize("via", ["file", "env"])
def test_a_model_name_with_a_tag_annotation_or_private_use_character_is_refused(
        jobs: Path, char: str, via: str) -> None:
    """a12b6d3's fixed list let through characters that really show nothing (the tag
    characters, which spell a hidden text, U+206A-U+206F, U+FFF9-U+FFFB) and private use ones
    (refused before it): each went to the server as written and was printed raw. Each is
    refused with its code shown, from the job file and from the environment."""
    name = f"gpt{char}x"
    code = f"U+{ord(char):04X}"
    named = unicodedata.name(char, "")
    if via == "file":
        path, env = write(jobs, MINIMAL.replace("sim-small", json.dumps(
            name, ensure_ascii=False))), {}
        where = "jobs/x.yaml: endpoint.model"
    else:
        path, env = write(jobs, MINIMAL), {"SHARDRUN_MODEL": name}
        where = "environment variable SHARDRUN_MODEL"
    said = error_of(path, env=env)
    assert said == (f"{where} holds the invisible character {code}"
                    + (f" ({named})" if named else "") + f": 'gpt<{code}>x', and no server "
                    "knows a model by that name; give the name alone")
    assert char not in said
    url = f"http://h:8/v1/{name}"
    said = error_of(write(jobs, MINIMAL), env={"SHARDRUN_BASE_URL": url})
    assert f"holds the invisible character {code}" in said and char not in said, said


@pytest.mark.parametrize("via", ["file", "env", "flag"])
def test_a_runs_dir_with_a_control_character_is_refused(jobs: Path, via: str) -> None:
    """`--runs-dir "$(...)"` that caught a line break, or an escape pasted with it: the run
    would make that directory and print commands to continue it that break at the character."""
    bad = "runs\n2"
    path = write(jobs, MINIMAL + (f"runs_dir: {json.dumps(bad)}\n" if via == "file" else ""))
    env = {"SHARDRUN_RUNS_DIR": bad} if via == "env" else {}
    flags = {"runs_dir": bad} if via == "flag" else {}
    subject = {"file": "jobs/x.yaml: runs_dir", "env": "environment variable SHARDRUN_RUNS_DIR",
               "flag": "--runs-dir"}[via]
    assert error_of(path, env=env, flags=flags) == (
        f"{subject} holds the control character U+000A, which a directory shardrun makes should "
        "not have, got 'runs\\n2'; remove it")
    assert load(path, flags={"runs_dir": "runs/ünïcode 2"}).runs_path == Path("runs/ünïcode 2")


def test_a_base_url_with_an_invisible_character_is_refused(jobs: Path) -> None:
    """A zero-width character pasted with the URL went into every request's path or host, and
    the stop that followed printed a URL that looked right. The password stays masked."""
    said = error_of(write(jobs, MINIMAL), env={"SHARDRUN_BASE_URL": "http://h:8/v1\u200b"})
    assert said == ("environment variable SHARDRUN_BASE_URL holds the invisible character "
                    "U+200B (ZERO WIDTH SPACE): 'http://h:8/v1<U+200B>'; give the URL "
                    "without it")
    said = error_of(write(jobs, MINIMAL.replace("sim://", '"http://u:pw@h\\u2060:8/v1"')))
    assert said == ("jobs/x.yaml: endpoint.base_url holds the invisible character U+2060 "
                    "(WORD JOINER): 'http://***@h<U+2060>:8/v1'; give the URL without it")


def test_a_path_that_is_not_utf8_is_refused_at_load(jobs: Path, tmp_path: Path) -> None:
    """A job file (or its folder) named under another encoding: JSON cannot hold the name, and
    the run stopped with a traceback writing its manifest, its directory already made. Names
    in UTF-8, accents and all, load."""
    odd = tmp_path / os.fsdecode(b"caf\xe9")  # Latin-1
    odd.mkdir()
    (odd / "x.yaml").write_text(MINIMAL)
    said = error_of(odd / "x.yaml")
    shown = f"{tmp_path}/caf\\xe9"
    assert said == (f"the job file {shown}/x.yaml has bytes that are not UTF-8 in its path, "
                    "which the run's manifest cannot record; rename it (or its folder); the "
                    f"input file {shown}/data.jsonl has bytes that are not UTF-8 in its path, "
                    "which the run's manifest cannot record; rename it (or its folder)")
    assert error_of(write(jobs, MINIMAL), flags={"runs_dir": os.fsdecode(b"r\xff")}) == (
        "--runs-dir has bytes that are not UTF-8 (a name made under another encoding), which "
        "the run's files cannot record; give it in UTF-8")
    fine = tmp_path / "café ü"
    fine.mkdir()
    (fine / "x.yaml").write_text(MINIMAL)
    assert load(fine / "x.yaml").input_path == fine / "data.jsonl"


def test_a_runs_dir_on_a_read_only_mount_is_said_so_not_as_a_permission(
        jobs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Root passes every permission check, so a read-only mount was said as "a directory this
    user may not write in", sending the user to chmod. The mount flag is faked: a test cannot
    mount one without privileges."""
    loaded = load(write(jobs, MINIMAL), flags={"runs_dir": str(tmp_path)})
    monkeypatch.setattr(preflight.os, "access", lambda *_: False)
    with pytest.raises(SpecError, match="a directory this user may not write in"):
        preflight.check_runs_dir(loaded)
    real = os.statvfs(tmp_path)
    monkeypatch.setattr(preflight.os, "statvfs", lambda _: os.statvfs_result(
        (*real[:8], real.f_flag | os.ST_RDONLY, real.f_namemax)))
    with pytest.raises(SpecError, match=f"{tmp_path} is on a read-only file system "):
        preflight.check_runs_dir(loaded)

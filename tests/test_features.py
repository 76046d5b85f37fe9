"""What users expect around a run, end to end: progress output, validate, Batch files, limits."""

from __future__ import annotations

import csv
import io
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from shardrun._responses import ResponsesReader, read_whole_response
from shardrun.aggregate._triage import TABLE
from shardrun.sim.config import TEXT_WORDS, WORDS, SimConfig, make_plan
from shardrun.sim.launcher import start_sim
from tests.conftest import (
    FAST_SIM,
    Run,
    busiest_second,
    caught_up,
    only_run,
    read_jsonl,
    run_cli,
    write_input,
    write_job,
)

ESC = "\x1b["


def test_plain_progress_lines_without_escape_codes(tmp_path: Path) -> None:
    """Not on a terminal: periodic plain status lines, no escape codes; --quiet prints none."""
    write_input(tmp_path / "input.jsonl", 600)
    write_job(tmp_path / "job.yaml", endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                                               "sim": {**FAST_SIM, "ttft_ms": 20}})
    every = ("--progress-interval", "0.2")
    proc = run_cli("job.yaml", "--runs-dir", "a", *every, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert ESC not in proc.stderr and ESC not in proc.stdout
    status = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(status) >= 2, proc.stderr
    assert all("/600" in line for line in status), status
    # The same interval: at the default one (10 s) this run would print no line either.
    quiet = run_cli("job.yaml", "--runs-dir", "b", *every, "--quiet", cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_progress_total_is_what_the_pass_has_left(tmp_path: Path) -> None:
    """The total the status lines show is counted while the run goes (progress.ProgressView):
    a --limit pass shows its limit, and a resume the input's lines less those already done."""
    write_input(tmp_path / "input.jsonl", 700)
    write_job(tmp_path / "job.yaml", endpoint={"base_url": "sim://", "api": "chat", "model": "m",
                                               "sim": {**FAST_SIM, "ttft_ms": 40}})
    every = ("--progress-interval", "0.2")
    trial = run_cli("job.yaml", "--runs-dir", "runs", "--limit", "200", *every, cwd=tmp_path)
    assert trial.returncode == 0, trial.stderr
    status = [line for line in trial.stderr.splitlines() if line.strip()]
    assert all("/200 done" in line for line in status), status
    rest = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "latest", *every, cwd=tmp_path)
    assert rest.returncode == 0, rest.stderr
    status = [line for line in rest.stderr.splitlines() if " done" in line]
    assert status and all("/500 done" in line for line in status), rest.stderr


@pytest.mark.parametrize("how", ["python -m shardrun", "console script"])
def test_output_and_status_survive_the_exit_without_teardown(tmp_path: Path, how: str) -> None:
    """The command line ends with `os._exit` (`cli.entry`). Piped stdout is block-buffered when
    PYTHONUNBUFFERED is unset, so a missing flush would lose the summary: it must arrive whole,
    with the exit status, from both ways of starting shardrun."""
    write_input(tmp_path / "input.jsonl", 20)
    write_job(tmp_path / "job.yaml")
    script = shutil.which("shardrun", path=str(Path(sys.executable).parent))
    assert script is not None, "the console script is installed next to this interpreter"
    argv = [sys.executable, "-m", "shardrun"] if how.startswith("python") else [script]
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith("SHARDRUN_") and k != "PYTHONUNBUFFERED"}  # fmt: skip

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*argv, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)

    ok = cli("job.yaml", "--runs-dir", "runs", "--quiet")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("run succeeded: ")
    assert re.search(r"^  succeeded +20$", ok.stdout, re.M), ok.stdout
    assert re.search(r"^  items per shard +min \d+ / max \d+$", ok.stdout, re.M), ok.stdout
    missing = cli("nowhere.yaml")
    assert missing.returncode == 2
    assert missing.stderr == "error: nowhere.yaml: job file not found\n"


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path, unbuffered: str) -> None:
    """`shardrun job.yaml | head -3` and the like: the reader closes the pipe before the output
    is written. No command shows a traceback; a run's exit status is still the run's. Both with
    unbuffered output (PYTHONUNBUFFERED, where each print meets the closed pipe) and without."""
    write_input(tmp_path / "input.jsonl", 30)
    write_job(tmp_path / "job.yaml")
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith("SHARDRUN_") and k != "PYTHONUNBUFFERED"}  # fmt: skip
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered

    def closed_reader(*args: str) -> tuple[int, str]:
        proc = subprocess.Popen([sys.executable, "-m", "shardrun", *args], cwd=tmp_path,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.close()  # the reader is gone before anything is written
        _, err = proc.communicate(timeout=120)
        return proc.returncode, err

    assert closed_reader("job.yaml", "--runs-dir", "runs", "--run-id", "r", "--quiet") == (0, "")
    assert (tmp_path / "runs" / "r" / "manifest.json").is_file()
    for command in (["validate", "job.yaml"], ["report", "runs/r"], ["export", "runs/r"],
                    # argparse's own output (it ended in "Exception ignored ... BrokenPipeError"
                    # and exit 120 when buffered), and the simulator's one line (it was "cannot
                    # listen on 127.0.0.1:0: Broken pipe", exit 1, a simulator that listened).
                    ["--help"], ["--version"], ["report", "--help"],
                    ["sim", "--port", "0", "--exit-on-stdin-eof"]):
        code, err = closed_reader(*command)
        assert (code, err) == (0, ""), command
    # validate's verdict stands: --strict with a rejected line is still exit 1.
    (tmp_path / "bad.jsonl").write_bytes((tmp_path / "input.jsonl").read_bytes() + b"{oops\n")
    write_job(tmp_path / "bad.yaml", input={"path": "bad.jsonl"})
    assert closed_reader("validate", "--strict", "bad.yaml") == (1, "")
    # So does report's (it was exit 0, and no word, when the reader left before the report).
    with (tmp_path / "runs" / "r" / "events" / "shard-00.jsonl").open("ab") as events:
        events.write(b'{"ev": "x"}\n')
    code, err = closed_reader("report", "runs/r")
    assert code == 1 and err.startswith("error: runs/r: the event log fails its integrity "
                                        "check (events/shard-00.jsonl: 1 unreadable lines"), err


def test_validate_good_and_bad_inputs(tmp_path: Path) -> None:
    """validate counts items, lists bad lines with numbers, shows sources; spec errors exit 2."""
    lines = [b'{"id": "a", "prompt": "hello there"}', b"{oops", b'{"id": "b"}',
             b'{"id": "c", "prompt": "fine"}']
    (tmp_path / "input.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    write_job(tmp_path / "job.yaml")
    proc = run_cli("validate", "job.yaml", cwd=tmp_path, env={"SHARDRUN_CONCURRENCY": "5"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "line 2" in out and "line 3" in out
    assert "SHARDRUN_CONCURRENCY" in out
    assert ESC not in out
    strict = run_cli("validate", "job.yaml", "--strict", cwd=tmp_path)
    assert strict.returncode == 1
    write_job(tmp_path / "bad.yaml", shards="many")
    bad = run_cli("validate", "bad.yaml", cwd=tmp_path)
    assert bad.returncode == 2 and "shards" in bad.stderr


@pytest.mark.parametrize(("flags", "says"), [
    (["--run-id", " "], "error: --run-id is empty: name the run directory"),
    (["--run-id", "a", "--resume", "b"], "error: --run-id a names a new run and --resume b"),
    (["--progress-interval", "-1"], "error: --progress-interval must be a number of seconds"),
    (["--progress-interval", "nan"], "error: --progress-interval must be a number of seconds"),
])  # fmt: skip
def test_run_flags_a_run_cannot_use_are_refused(tmp_path: Path, flags: list[str],
                                                says: str) -> None:  # fmt: skip
    """Flags argparse takes but that would be silently ignored or misread: one error line,
    exit 2, no run directory."""
    write_input(tmp_path / "input.jsonl", 5)
    write_job(tmp_path / "job.yaml")
    proc = run_cli("job.yaml", "--runs-dir", "runs", *flags, cwd=tmp_path)
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [proc.stderr.strip()])
    assert proc.stderr.startswith(says), proc.stderr
    assert not (tmp_path / "runs").exists()


def test_resume_in_the_wrong_runs_directory_says_which_flag_finds_the_run(
        tmp_path: Path) -> None:
    """A run made with --runs-dir, resumed without it: the error names the directory looked in
    and says the run is found with the --runs-dir (or SHARDRUN_RUNS_DIR) that made it."""
    write_input(tmp_path / "input.jsonl", 5)
    write_job(tmp_path / "job.yaml")
    made = run_cli("job.yaml", "--runs-dir", "elsewhere", "--run-id", "r1", "--limit", "2",
                   "--quiet", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    for ref, says in (("latest", "--resume latest: there is no run in runs; "),
                      ("r1", "--resume r1: no run 'r1' in runs (recent runs: none); ")):
        proc = run_cli("job.yaml", "--resume", ref, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: {says}a run made in another runs directory is "
                                      "resumed with the --runs-dir (or SHARDRUN_RUNS_DIR) that "
                                      "made it"), proc.stderr
    resumed = run_cli("job.yaml", "--resume", "latest", "--runs-dir", "elsewhere", "--quiet",
                      cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "1e-9"])
def test_retry_failed_refuses_a_progress_interval_a_run_refuses(tmp_path: Path,
                                                                interval: str) -> None:
    """`retry-failed --progress-interval 0` was taken (and would print a line at every redraw)
    where `run` refuses it: the same error line, exit 2, and no pass starts."""
    write_input(tmp_path / "input.jsonl", 5)
    write_job(tmp_path / "job.yaml")
    assert run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path).returncode == 0
    run_dir = only_run(tmp_path / "runs")
    before = (run_dir / "manifest.json").read_bytes()
    proc = run_cli("retry-failed", str(run_dir), "--progress-interval", interval, cwd=tmp_path)
    assert (proc.returncode, proc.stderr.splitlines()) == (2, [proc.stderr.strip()])
    assert proc.stderr.startswith("error: --progress-interval must be a number of seconds")
    assert (run_dir / "manifest.json").read_bytes() == before


BATCH_URLS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
"""Line i of the Batch input asks the API BATCH_URLS[i % 3]."""


def _batch_line(i: int) -> bytes:
    url = BATCH_URLS[i % 3]
    body: dict[str, object] = {
        "/v1/completions": {"prompt": f"p {i}", "max_tokens": 20},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": f"q {i}"}],
                                 "max_tokens": 20},
        "/v1/responses": {"input": f"r {i}", "max_output_tokens": 20},
    }[url]  # fmt: skip
    body["model"] = f"model-{i % 2}"  # each line's own
    return orjson.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})


def test_openai_batch_file_round_trips(tmp_path: Path) -> None:
    """A Batch API input (chat, completions and Responses lines) comes back in Batch output
    shape, once each, every body the object its own line's URL answers with its model."""
    (tmp_path / "batch.jsonl").write_bytes(b"\n".join(_batch_line(i) for i in range(90)) + b"\n")
    write_job(tmp_path / "job.yaml", input={"path": "batch.jsonl", "format": "openai-batch"},
              output={"format": "openai-batch"}, params={})
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    path = only_run(tmp_path / "runs")
    out = read_jsonl(path / "batch_output.jsonl")
    assert Counter(o["custom_id"] for o in out) == Counter(f"req-{i}" for i in range(90))
    objects = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat.completion",
               "/v1/responses": "response"}  # fmt: skip
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
        i = int(line["custom_id"].removeprefix("req-"))
        body = line["response"]["body"]
        assert (body["object"], body["model"]) == (objects[BATCH_URLS[i % 3]], f"model-{i % 2}")
        if body["object"] == "response":
            [message] = body["output"]
            text = message["content"][0]["text"]
            assert body["usage"]["output_tokens"] > 0
        else:
            choice = body["choices"][0]
            text = choice.get("message", {}).get("content") or choice.get("text")
            assert body["usage"]["completion_tokens"] > 0
        assert text
    assert read_jsonl(path / "batch_errors.jsonl") == []
    events = Run.load(path).events
    paths = Counter(e["ev"] for e in events)
    assert paths["attempt_end"] == 90


def run_rate_limited(
    tmp_path: Path, items: int, rpm: int, shards: int, concurrency: int,
    flags: tuple[str, ...] = ()
) -> tuple[subprocess.CompletedProcess[str], list[float]]:
    """The CLI run under `rpm` against a simulator of its own; the run and when each request
    reached the simulator (sorted)."""
    write_input(tmp_path / "input.jsonl", items)
    with start_sim(SimConfig.from_mapping(FAST_SIM)) as sim:
        write_job(tmp_path / "job.yaml", rate_limits={"rpm": rpm}, shards=shards,
                  concurrency=concurrency,
                  endpoint={"base_url": sim.base_url, "api": "chat", "model": "m"})
        proc = run_cli("job.yaml", "--runs-dir", "runs", *flags, cwd=tmp_path)
        with urllib.request.urlopen(sim.base_url.removesuffix("/v1") + "/sim/arrivals") as r:
            arrivals = sorted(orjson.loads(r.read()))
    assert proc.returncode == 0, proc.stderr
    return proc, arrivals


def test_rate_limit_holds_over_every_second(tmp_path: Path) -> None:
    """rpm 1200 over 3 shards: no 1 s window above 20 + 3 requests; the average within 10%.
    Meanwhile the progress line says requests are waiting for the rate limit."""
    proc, arrivals = run_rate_limited(tmp_path, 120, rpm=1200, shards=3, concurrency=8,
                                      flags=("--progress-interval", "1"))
    held = [line for line in proc.stderr.splitlines() if "waiting for the rate limit" in line]
    assert held and all(re.search(r"; \d+ waiting for the rate limit$", line) for line in held)
    assert len(arrivals) == 120
    run = Run.load(only_run(tmp_path / "runs"))
    assert busiest_second(run) <= 20 + 3 + caught_up(run, 20)
    rate = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
    assert abs(rate - 20) <= 2, rate
    waits = [e for e in run.events if e["ev"] == "rate_wait"]
    assert waits and all(w["wait"] > 0 for w in waits)
    # The summary says the run was held back, and by how much (what the log's waits add up to).
    summary = run.manifest["summary"]
    assert summary["rate_waits"] == len(waits)
    assert summary["rate_wait_s"] == pytest.approx(sum(w["wait"] for w in waits),
                                                   abs=0.0005 * len(waits) + 0.001)  # ms each
    assert f"  rate-limit waits   {len(waits):,} (" in proc.stdout
    # The report's triage: the backlog waited for the rate limit, and its advice says so
    # (not "raise the cap", which would only add waiters).
    triage = orjson.loads(run_cli("report", str(run.path), "--json", cwd=tmp_path).stdout)[
        "triage"]
    assert "rate_limited" in [f["id"] for f in triage["findings"]]
    top = triage["dominant_bucket"]
    assert top["bucket"] == "t_queue" and top["control"] == TABLE["rate_limit"][1], top


def test_shards_first_requests_are_spread_over_the_job_wide_rate(tmp_path: Path) -> None:
    """rpm 240 over 4 shards: the first requests go out about 0.25 s apart, as one job-wide
    stream would send them, not four at once (each shard's share alone would allow that)."""
    _, arrivals = run_rate_limited(tmp_path, 12, rpm=240, shards=4, concurrency=4)
    assert len(arrivals) == 12
    # Shard k starts k/4 of an interval in: the first three span 0.375-0.5 s (a shard handed
    # no work ends, and the other three share its part), give or take the shards' start-up;
    # without the stagger they go out together. When the shards sent them, by their own log:
    # the simulator's arrival times add its lag (gaps of 0.13 s for 0.25 under load).
    run = Run.load(only_run(tmp_path / "runs"))
    sent = sorted(e["t"] for e in run.events if e["ev"] == "attempt_start")
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert sent[2] - sent[0] > 0.2, gaps


def test_template_with_missing_field_is_a_reject(tmp_path: Path) -> None:
    """A template placeholder missing from an item rejects that line with its reason."""
    rows = [{"id": "a", "topic": "tea"}, {"id": "b"}, {"id": "c", "topic": "jazz"}]
    (tmp_path / "input.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    write_job(tmp_path / "job.yaml",
              input={"path": "input.jsonl", "template": "Write about {topic}.",
                     "system_prompt": "Be brief."})
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 1
    run = Run.load(only_run(tmp_path / "runs"))
    assert sorted(r["id"] for r in run.results) == ["a", "c"]
    (reject,) = read_jsonl(run.path / "rejects.jsonl")
    assert reject["line"] == 2 and "topic" in reject["reason"]
    assert reject["id"] == "b"  # the line names its item, though it did not become one
    exported = run_cli("export", str(run.path), cwd=tmp_path)
    rows = [orjson.loads(line) for line in exported.stdout.splitlines()]
    assert [(r["id"], r["status"]) for r in rows] == [("a", "ok"), ("b", "rejected"),
                                                      ("c", "ok")]


def test_prices_show_spend_in_the_summary(tmp_path: Path) -> None:
    """Per-token prices give spend and cost per success in the summary and the manifest."""
    write_input(tmp_path / "input.jsonl", 30)
    write_job(tmp_path / "job.yaml", pricing={"input_per_1m": 1.0, "output_per_1m": 2.0})
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "spend" in proc.stdout and "per success" in proc.stdout
    summary = Run.load(only_run(tmp_path / "runs")).manifest["summary"]
    cost = summary["cost"]
    expected = (summary["prompt_tokens"] * 1.0 + summary["completion_tokens"] * 2.0) / 1e6
    assert abs(cost["spend"] - expected) < 1e-12


def test_refusals_are_answers_kept_apart_and_counted(tmp_path: Path) -> None:
    """A model that declines a share of prompts: those items succeed with an empty output and
    the model's words in `refusal`; the summary counts them, the report counts them from the
    event log alone, and the Batch output holds them where OpenAI's message does."""
    write_input(tmp_path / "input.jsonl", 60)
    write_job(tmp_path / "job.yaml",
              endpoint={"base_url": "sim://", "api": "chat", "model": "sim-test",
                        "sim": {**FAST_SIM, "refusal": 0.3}},
              output={"format": "openai-batch"})
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    refused = {r["id"]: r["refusal"] for r in run.results if "refusal" in r}
    assert 0 < len(refused) < 60 and all(refused.values())
    assert all(r["output"] == "" for r in run.results if r["id"] in refused)
    assert run.manifest["summary"]["refusals"] == len(refused)
    them = "a refusal" if len(refused) == 1 else "refusals"
    assert (f"  succeeded          60  ({len(refused)} of them {them}: the model declined; "
            "see `refusal` in the results)") in proc.stdout
    batch = {line["custom_id"]: line["response"]["body"]["choices"][0]["message"]
             for line in read_jsonl(run.path / "batch_output.jsonl")}  # fmt: skip
    assert {i: m["refusal"] for i, m in batch.items() if "refusal" in m} == refused
    report = run_cli("report", str(run.path), "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert orjson.loads(report.stdout)["items"]["refusals"] == len(refused)
    text = run_cli("report", str(run.path), cwd=tmp_path).stdout
    assert re.search(rf"of them refusals +{len(refused)}\b", text), text


def test_cached_prompt_tokens_are_priced_apart_and_the_report_agrees(tmp_path: Path) -> None:
    """A server with a prompt cache reports cached prompt tokens; `cached_input_per_1m` prices
    them apart in the summary, and the report, rebuilt from the event log alone, has the same
    cached count and spend."""
    write_input(tmp_path / "input.jsonl", 40)
    write_job(tmp_path / "job.yaml",
              endpoint={"base_url": "sim://", "api": "chat", "model": "sim-test",
                        "sim": {**FAST_SIM, "cached_tokens": 4}},
              pricing={"input_per_1m": 1.0, "output_per_1m": 2.0, "cached_input_per_1m": 0.25})
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = Run.load(only_run(tmp_path / "runs"))
    assert {r["usage"]["cached_tokens"] for r in run.results} == {4}
    summary = run.manifest["summary"]
    prompt, cached = summary["prompt_tokens"], summary["cached_tokens"]
    assert cached == 4 * 40 and prompt > cached
    assert f"cached prompt      {cached:,} of {prompt:,} prompt tokens" in proc.stdout
    expected = ((prompt - cached) * 1.0 + cached * 0.25 + summary["completion_tokens"] * 2.0) / 1e6
    assert summary["cost"]["spend"] == pytest.approx(expected, rel=1e-12)
    assert summary["cost"]["cached_tokens"] == cached

    report = run_cli("report", str(run.path), "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    doc = orjson.loads(report.stdout)
    assert (doc["items"]["prompt_tokens"], doc["items"]["cached_tokens"]) == (prompt, cached)
    assert doc["cost"]["spend"] == pytest.approx(expected, rel=1e-9)
    text = run_cli("report", str(run.path), cwd=tmp_path).stdout
    assert f"({cached:,} prompt tokens cached)" in text
    assert re.search(rf"cached of those +{cached:,}\b", text), text


# -- start-up: what each process imports (docs/PERFORMANCE.md, "Start-up") ---------------------

# Prints the loaded modules after the code in argv[1] ran; the environment is the test's own.
LIST_MODULES = """
import contextlib, io, sys, orjson
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    exec(sys.argv[1])
sys.stdout.write(orjson.dumps(sorted(sys.modules)).decode())
"""


def loaded_after(code: str, cwd: Path) -> set[str]:
    """Every module a fresh interpreter has loaded after running `code`."""
    proc = subprocess.run([sys.executable, "-c", LIST_MODULES, code], cwd=cwd,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={k: v for k, v in os.environ.items()
                               if not k.upper().startswith("SHARDRUN_")})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return set(orjson.loads(proc.stdout))


def packages(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_a_shard_imports_no_display_or_job_file_machinery(tmp_path: Path) -> None:
    """A shard gets its config as a message: no rich (structlog would pull it), pydantic, YAML,
    spec or input readers; and rich still imports normally afterwards in the same process."""
    mods = loaded_after("import shardrun._shard_main; import rich.console", tmp_path)
    assert {"aiohttp", "structlog", "orjson"} <= packages(mods)  # the test sees a real shard
    before_rich = loaded_after("import shardrun._shard_main", tmp_path)
    assert not packages(before_rich) & {"rich", "pygments", "pydantic", "yaml"}
    assert not before_rich & {"shardrun.spec", "shardrun._models", "shardrun.inputs",
                              "shardrun.coordinator", "shardrun.progress"}
    assert "rich.console" in mods


def test_the_coordinator_of_a_run_imports_no_http_client(tmp_path: Path) -> None:
    """`shardrun run` (not on a terminal) loads neither aiohttp, the shard, validate nor rich;
    the embedded simulator and the shards are other processes."""
    write_input(tmp_path / "input.jsonl", 20)
    write_job(tmp_path / "job.yaml")
    run = ("from shardrun.cli import main; "
           "assert main(['job.yaml', '--runs-dir', 'runs', '--quiet']) == 0")
    mods = loaded_after(run, tmp_path)
    assert {"pydantic", "yaml", "structlog"} <= packages(mods)
    assert "shardrun.coordinator" in mods
    assert not packages(mods) & {"aiohttp", "rich", "pygments", "tenacity"}
    assert not mods & {"shardrun.client", "shardrun.shard", "shardrun._shard_main",
                       "shardrun.validate", "shardrun.sim.server"}
    assert len(Run.load(only_run(tmp_path / "runs")).results) == 20


def test_help_lists_every_variable_without_loading_the_spec(tmp_path: Path) -> None:
    """`shardrun --help` lists every environment variable yet imports no pydantic or YAML."""
    from shardrun.spec import ENV_VARS

    proc = run_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert all(var.name in proc.stdout for var in ENV_VARS)
    mods = loaded_after("from shardrun.cli import main; main(['--help'])", tmp_path)
    assert not packages(mods) & {"pydantic", "yaml", "aiohttp", "rich", "structlog"}


def test_validate_without_ping_imports_no_http_client(tmp_path: Path) -> None:
    write_input(tmp_path / "input.jsonl", 3)
    write_job(tmp_path / "job.yaml")
    mods = loaded_after("from shardrun.cli import main; main(['validate', 'job.yaml'])",
                        tmp_path)
    assert "shardrun.validate" in mods and "aiohttp" not in packages(mods)


TOOL = {"type": "function", "function": {"name": "save_answer",
                                         "parameters": {"type": "object"}}}  # fmt: skip


def test_reasoning_and_tool_calls_reach_the_results_and_the_export(tmp_path: Path) -> None:
    """A reasoning model that answers with a tool call (the simulator, a separate process):
    reasoning that lasts longer than first_token_s does not time out (its tokens are tokens);
    each result holds the reasoning and the call exactly as the server generated them, and the
    export and the Batch output carry them. Lines of plain answers have neither key."""
    write_input(tmp_path / "input.jsonl", 40)
    # The reasoning lasts 1.5 s, past first_token_s (1 s), which is far above a busy
    # machine's delay of a first token (0.34 s under a load of 20 on 2 cores, where 0.3 s
    # was the limit: one attempt timed out is a dead letter here). All 40 go at once, and
    # the answers after the reasoning are short: the test took 18 s at 0.2 s a token.
    sim = {**FAST_SIM, "ttft_ms": 20, "itl_ms": 100, "flush_ms": 1, "reasoning_tokens": 15,
           "tokens": "uniform:17:20"}
    params = {"max_tokens": 64, "tools": [TOOL]}
    write_job(tmp_path / "job.yaml", params=params, timeouts={"first_token_s": 1.0},
              concurrency=20,
              retry={"max_attempts": 1}, output={"format": "openai-batch"},
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim})
    proc = run_cli("job.yaml", "--runs-dir", "runs", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(600 reasoning)" in proc.stdout  # 40 answers, 15 reasoning tokens each
    path = only_run(tmp_path / "runs")
    # The report counts them from the event log alone, as the summary did.
    report = run_cli("report", str(path), "--json", cwd=tmp_path)
    assert orjson.loads(report.stdout)["items"]["reasoning_tokens"] == 600, report.stderr
    text = run_cli("report", str(path), cwd=tmp_path).stdout
    assert re.search(r"reasoning of those +600\b", text), text
    prompts = {r["id"]: r["prompt"] for r in read_jsonl(tmp_path / "input.jsonl")}
    config = SimConfig.from_mapping(sim)
    results = Run.load(path).results
    assert len(results) == 40
    for result in results:
        body = {"model": "m", "messages": [{"role": "user", "content": prompts[result["id"]]}],
                **params}  # fmt: skip
        plan = make_plan(orjson.dumps(body), "chat", config)
        words = [WORDS[i].decode() for i in plan.words]
        assert result["reasoning"] == "".join(words[:15])
        [call] = result["tool_calls"]
        assert call["id"].startswith("call_") and call["type"] == "function"
        arguments = orjson.dumps({"text": "".join(words[15:])}).decode()
        assert call["function"] == {"name": "save_answer", "arguments": arguments}
        assert (result["output"], result["finish_reason"]) == ("", "tool_calls")
        assert result["usage"]["completion_tokens"] == len(words)
        assert result["usage"]["reasoning_tokens"] == 15 and "cached_tokens" not in result["usage"]
    by_id = {r["id"]: r for r in results}
    for row in read_jsonl_text(run_cli("export", str(path), cwd=tmp_path).stdout):
        assert (row["reasoning"], row["tool_calls"]) == (
            by_id[row["id"]]["reasoning"], by_id[row["id"]]["tool_calls"])
    exported = run_cli("export", str(path), "--format", "csv", cwd=tmp_path).stdout
    for row in csv.DictReader(io.StringIO(exported)):
        assert orjson.loads(row["tool_calls"]) == by_id[row["id"]]["tool_calls"]
        assert row["reasoning"] == by_id[row["id"]]["reasoning"]
    for line in read_jsonl(path / "batch_output.jsonl"):
        message = line["response"]["body"]["choices"][0]["message"]
        result = by_id[line["custom_id"]]
        assert message == {"role": "assistant", "content": None,
                           "reasoning_content": result["reasoning"],
                           "tool_calls": result["tool_calls"]}  # fmt: skip
    # Without tools and reasoning, a result line is as it always was.
    write_job(tmp_path / "plain.yaml")
    assert run_cli("plain.yaml", "--runs-dir", "plain", cwd=tmp_path).returncode == 0
    for result in Run.load(only_run(tmp_path / "plain")).results:
        assert "reasoning" not in result and "tool_calls" not in result
        assert "reasoning_tokens" not in result["usage"]


def batch_output_run(tmp_path: Path, params: dict[str, Any], api: str,
                     sim: dict[str, Any]) -> tuple[Path, dict[str, str]]:
    """30 items of job.yaml with `params` against an embedded simulator, Batch output on:
    (run directory, prompt of each id)."""
    write_input(tmp_path / "input.jsonl", 30)
    write_job(tmp_path / "job.yaml", params=params, output={"format": "openai-batch"},
              endpoint={"base_url": "sim://", "api": api, "model": "m", "sim": sim})
    proc = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prompts = {r["id"]: r["prompt"] for r in read_jsonl(tmp_path / "input.jsonl")}
    return only_run(tmp_path / "runs"), prompts


def test_a_call_in_the_older_functions_form_reaches_results_export_and_batch(
        tmp_path: Path) -> None:  # fmt: skip
    """A job that still names `functions` (the form `tools` replaced): the simulator, in its own
    process, answers with `function_call` deltas as OpenAI does; each result keeps the call as
    sent (not an empty answer), with finish_reason function_call, and the export and the Batch
    output carry it where OpenAI's message does."""
    params = {"max_tokens": 64, "functions": [{"name": "save_answer", "parameters": {}}]}
    path, prompts = batch_output_run(tmp_path, params, "chat", FAST_SIM)
    config = SimConfig.from_mapping(FAST_SIM)
    results = Run.load(path).results
    assert sorted(r["id"] for r in results) == sorted(prompts)
    for result in results:
        body = {"model": "m", "messages": [{"role": "user", "content": prompts[result["id"]]}],
                **params}  # fmt: skip
        words = [WORDS[i].decode() for i in make_plan(orjson.dumps(body), "chat", config).words]
        arguments = orjson.dumps({"text": "".join(words)}).decode()
        assert result["function_call"] == {"name": "save_answer", "arguments": arguments}
        assert (result["output"], result["finish_reason"]) == ("", "function_call")
        assert "tool_calls" not in result
    by_id = {r["id"]: r for r in results}
    for row in read_jsonl_text(run_cli("export", str(path), cwd=tmp_path).stdout):
        assert row["function_call"] == by_id[row["id"]]["function_call"]
    exported = run_cli("export", str(path), "--format", "csv", cwd=tmp_path).stdout
    for row in csv.DictReader(io.StringIO(exported)):
        assert orjson.loads(row["function_call"]) == by_id[row["id"]]["function_call"]
    for line in read_jsonl(path / "batch_output.jsonl"):
        message = line["response"]["body"]["choices"][0]["message"]
        assert message == {"role": "assistant", "content": None,
                           "function_call": by_id[line["custom_id"]]["function_call"]}


@pytest.mark.parametrize(("tools", "padded"), [(False, False), (True, False), (False, True),
                                               (True, True)])  # fmt: skip
def test_escaped_text_reaches_the_results_as_the_server_wrote_it(tmp_path: Path, tools: bool,
                                                                 padded: bool) -> None:  # fmt: skip
    """The simulator's prose (line breaks, quotes, backslashes, tabs, which JSON escapes), over
    loopback from its own process: each result's content or call arguments, and its
    reasoning, are the text the server generated, character for character; also when every
    chunk carries OpenAI's padding, whose length changes from chunk to chunk."""
    write_input(tmp_path / "input.jsonl", 40)
    sim = {**FAST_SIM, "tokens": "uniform:24:48", "text": "prose", "reasoning_tokens": 6,
           "obfuscation": padded}  # fmt: skip
    params = {"max_tokens": 64, **({"tools": [TOOL]} if tools else {})}
    write_job(tmp_path / "job.yaml", params=params,
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim})
    proc = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prompts = {r["id"]: r["prompt"] for r in read_jsonl(tmp_path / "input.jsonl")}
    config, prose = SimConfig.from_mapping(sim), TEXT_WORDS["prose"]
    results = Run.load(only_run(tmp_path / "runs")).results
    assert sorted(r["id"] for r in results) == sorted(prompts)
    escaped = 0
    for result in results:
        body = {"model": "m", "messages": [{"role": "user", "content": prompts[result["id"]]}],
                **params}  # fmt: skip
        words = [prose[i] for i in make_plan(orjson.dumps(body), "chat", config).words]
        answer = "".join(words[6:])
        escaped += bool(set(answer) & set('\n"\\\t'))
        assert result["reasoning"] == "".join(words[:6])
        if tools:
            [call] = result["tool_calls"]
            assert orjson.loads(call["function"]["arguments"]) == {"text": answer}
        else:
            assert result["output"] == answer and "tool_calls" not in result
    assert escaped >= 30  # nearly every answer has a word that JSON escapes


@pytest.mark.parametrize("tool", [None, "function", "custom"])
def test_the_responses_api_end_to_end(tmp_path: Path, tool: str | None) -> None:
    """api: responses against the simulator in its own process: a thinking model's answer, or
    a function's call, or a custom tool's (free-text input; its job asks for a summary of the
    reasoning, which comes as OpenAI's summary events), in prose (escapes); each result holds
    what the server generated, in the keys and shapes a chat run uses, with the server's usage;
    the Batch output holds response objects that read back to the same."""
    sim = {**FAST_SIM, "tokens": "uniform:8:24", "text": "prose", "reasoning_tokens": 5}
    tools = {"function": {"type": "function", "name": "save_answer",
                          "parameters": {"type": "object"}},
             "custom": {"type": "custom", "name": "save_answer"}}  # fmt: skip
    params = {"max_output_tokens": 64, **({"tools": [tools[tool]]} if tool else {}),
              **({"reasoning": {"summary": "auto"}} if tool == "custom" else {})}
    path, prompts = batch_output_run(tmp_path, params, "responses", sim)
    config, prose = SimConfig.from_mapping(sim), TEXT_WORDS["prose"]
    results = {r["id"]: r for r in Run.load(path).results}
    assert sorted(results) == sorted(prompts)
    for item_id, result in results.items():
        body = {"model": "m", "input": prompts[item_id], **params}
        words = [prose[i] for i in make_plan(orjson.dumps(body), "responses", config).words]
        answer = "".join(words[5:])
        assert result["reasoning"] == "".join(words[:5])
        assert result["usage"]["completion_tokens"] == len(words)
        assert (result["usage"]["reasoning_tokens"], result["usage"]["cached_tokens"]) == (5, 0)
        if tool is None:
            assert (result["output"], result["finish_reason"]) == (answer, "stop")
            continue
        [call] = result["tool_calls"]
        assert call["type"] == tool and call["id"].startswith("call_")
        assert (result["output"], result["finish_reason"]) == ("", "tool_calls")
        if tool == "function":
            assert call["function"]["name"] == "save_answer"
            assert orjson.loads(call["function"]["arguments"]) == {"text": answer}
        else:
            assert call["custom"] == {"name": "save_answer", "input": answer}
    exported = run_cli("export", str(path), "--format", "csv", cwd=tmp_path).stdout
    for row in csv.DictReader(io.StringIO(exported)):  # usage details in their own columns
        assert (row["cached_tokens"], row["reasoning_tokens"]) == ("0", "5")
        assert orjson.loads(row["tool_calls"] or "null") == results[row["id"]].get("tool_calls")
    for line in read_jsonl(path / "batch_output.jsonl"):
        reader = ResponsesReader()
        text = read_whole_response(orjson.dumps(line["response"]["body"]), reader)
        result = results[line["custom_id"]]
        assert (text, "".join(reader.reasoning), reader.tool_call_list()) == (
            result["output"], result["reasoning"], result.get("tool_calls"))


def test_limit_runs_the_first_items_and_the_printed_command_runs_the_rest(
    tmp_path: Path,
) -> None:
    """--limit 25 on 60 items (a bad line among the first ones): exactly the first 25 items of
    the input are answered, the input is read no further than the 25th, the manifest records
    the limit, and the command the summary prints answers the other 35, each once."""
    ids = write_input(tmp_path / "input.jsonl", 60)
    lines = (tmp_path / "input.jsonl").read_bytes().splitlines(keepends=True)
    lines.insert(3, b"not json\n")
    (tmp_path / "input.jsonl").write_bytes(b"".join(lines))
    write_job(tmp_path / "job.yaml")
    first = run_cli("job.yaml", "--limit", "25", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr  # the bad line is a reject
    path = only_run(tmp_path / "runs")
    assert sorted(r["id"] for r in Run.load(path).results) == ids[:25]
    record = orjson.loads((path / "manifest.json").read_bytes())
    assert record["summary"]["limit"] == 25 and record["summary"]["input_read"] is False
    assert record["input"]["bytes_read"] == sum(len(line) for line in lines[:26])
    assert "items              26  (--limit 25: the command below runs the rest" in first.stdout
    partial = "its last pass did not read the input to its end (--limit, or a stop)"
    report = run_cli("report", str(path), cwd=tmp_path)
    assert report.returncode == 0 and partial in report.stdout, report.stdout + report.stderr
    [hint] = [line for line in first.stdout.splitlines() if "to finish the run" in line]
    command = shlex.split(hint.split("to finish the run", 1)[1])
    rest = run_cli(*command[1:], "--quiet", cwd=tmp_path)
    # The bad line the first pass rejected still leaves the run failed (not counted again).
    assert rest.returncode == 1, rest.stdout + rest.stderr
    assert "earlier rejects    1 input line rejected by earlier passes" in rest.stdout
    results = Run.load(path).results
    assert sorted(r["id"] for r in results) == ids and len(results) == len(ids)
    assert "already done       25" in rest.stdout and "to finish the run" not in rest.stdout
    done = orjson.loads((path / "manifest.json").read_bytes())["resumes"][-1]["summary"]
    assert done["limit"] is None and done["input_read"] is True
    assert partial not in run_cli("report", str(path), cwd=tmp_path).stdout  # read to the end
    bad = run_cli("job.yaml", "--limit", "0", cwd=tmp_path)
    assert (bad.returncode, bad.stderr.strip()) == (
        2, "error: --limit must be an integer of at least 1 (items to run), got '0'")
    # A limit at the input's last item: the input was read to the end, nothing is left to run.
    (tmp_path / "exact").mkdir()
    write_input(tmp_path / "exact" / "input.jsonl", 5)
    write_job(tmp_path / "exact" / "job.yaml")
    whole = run_cli("job.yaml", "--limit", "5", "--runs-dir", "runs", cwd=tmp_path / "exact")
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "to finish the run" not in whole.stdout and "--limit" not in whole.stdout
    path = only_run(tmp_path / "exact" / "runs")
    summary = orjson.loads((path / "manifest.json").read_bytes())["summary"]
    assert summary["limit"] is None and summary["input_read"] is True


def test_a_limit_below_the_shards_starts_no_more_shards_than_items(tmp_path: Path) -> None:
    """`--shards 12 --limit 3` started 12 processes for three items (1,024 at most). The pass
    starts three; the manifest records 3 with why (the limit, and the 12 asked and where from),
    and the command printed to finish the run still carries --shards 12, whose pass starts 12
    for the rest."""
    ids = write_input(tmp_path / "input.jsonl", 30)
    write_job(tmp_path / "job.yaml", shards=2)
    first = run_cli("job.yaml", "--limit", "3", "--shards", "12", "--runs-dir", "runs",
                    "--quiet", cwd=tmp_path, env={"SHARDRUN_SHARDS": "7"})
    assert first.returncode == 0, first.stdout + first.stderr
    path = only_run(tmp_path / "runs")
    shard_files = sorted(p.name for p in (path / "events").glob("shard-*.jsonl"))
    assert shard_files == ["shard-00.jsonl", "shard-01.jsonl", "shard-02.jsonl"]
    manifest = orjson.loads((path / "manifest.json").read_bytes())
    assert manifest["shards"] == 3
    assert manifest["effective"]["shards"] == {"value": 3, "source": (
        "--limit 3: no more shards than items (12 from flag --shards)")}
    [hint] = [line for line in first.stdout.splitlines() if "to finish the run" in line]
    command = shlex.split(hint.split("to finish the run", 1)[1])
    assert command[-2:] == ["--shards", "12"], command
    rest = run_cli(*command[1:], "--quiet", cwd=tmp_path)
    assert rest.returncode == 0, rest.stdout + rest.stderr
    assert sorted(r["id"] for r in Run.load(path).results) == ids
    latest = orjson.loads((path / "manifest.json").read_bytes())["resumes"][-1]["effective"]
    assert latest["shards"] == {"value": 12, "source": "flag --shards"}
    assert len(list((path / "events").glob("shard-*.r1.jsonl"))) == 12


@pytest.mark.parametrize(("limit", "got"), [(0, "'0'"), (-3, "'-3'"), (2.5, "'2.5'"),
                                           (True, "'True'"), ("5", '"\'5\'"')])
def test_an_api_callers_limit_below_one_is_refused_by_the_clis_own_rule(
        limit: object, got: str) -> None:
    """`runner.run` kept a `limit < 1` check of its own that the CLI (whose --limit type refuses
    0 first) never reached: `RunOptions` now applies --limit's one rule, in its words. A str,
    though the CLI's rule reads its digits, is no limit: it would fail deep in the pass."""
    from shardrun.runner import RunOptions

    with pytest.raises(ValueError) as raised:
        RunOptions(limit=limit)  # type: ignore[arg-type]
    assert str(raised.value) == ("RunOptions limit must be an integer of at least 1 (items to "
                                 f"run), got {got}")
    assert RunOptions(limit=1).limit == 1


def test_an_api_callers_progress_interval_keeps_the_flags_floor() -> None:
    """`RunOptions(progress_interval=1e-9)` would print a status line at every redraw: refused
    in --progress-interval's words, and its floor taken."""
    from shardrun.runner import RunOptions

    with pytest.raises(ValueError, match=r"^RunOptions progress_interval must be a number of "
                                         r"seconds of at least 0\.1 .*, got '1e-09'$"):
        RunOptions(progress_interval=1e-9)
    assert RunOptions(progress_interval=0.1).progress_interval == 0.1


def read_jsonl_text(text: str) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in text.splitlines()]


def test_the_printed_commands_keep_the_flags_that_set_limits(tmp_path: Path) -> None:
    """A pass given --rpm and --concurrency as flags: the command printed to finish the run and
    the one printed to retry its dead letters carry them, so that pasting either keeps the
    rate limit (it was dropped: a pasted resume ran at full speed)."""
    write_input(tmp_path / "input.jsonl", 30)
    sim = {**FAST_SIM, "fail_500": 0.5}
    write_job(tmp_path / "job.yaml", retry={"max_attempts": 1},
              endpoint={"base_url": "sim://", "api": "chat", "model": "m", "sim": sim})
    first = run_cli("job.yaml", "--limit", "20", "--runs-dir", "runs", "--rpm", "60000",
                    "--concurrency", "3", "--quiet", cwd=tmp_path)  # fmt: skip
    assert first.returncode == 1, first.stdout + first.stderr  # some items failed
    path = only_run(tmp_path / "runs")

    def printed(label: str, out: str) -> list[str]:
        [line] = [line for line in out.splitlines() if label in line]
        return shlex.split(line.split(label, 1)[1].rstrip(")"))

    finish = printed("to finish the run", first.stdout)
    assert finish[-4:] == ["--concurrency", "3", "--rpm", "60000"], finish
    retry = printed("(another pass: ", first.stdout)
    assert retry[:2] == ["shardrun", "retry-failed"] and (tmp_path / retry[2]) == path
    assert retry[3:] == ["--concurrency", "3", "--rpm", "60000"]
    # export's notes name the same commands, with the same flags.
    exported = run_cli("export", str(path), "-o", "out.jsonl", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr

    def quoted(label: str) -> list[str]:
        found = re.search(label + r" `([^`]*)`", exported.stderr)
        assert found, exported.stderr
        return shlex.split(found.group(1))

    assert quoted("no answer yet:") == [
        "shardrun", str(tmp_path / "job.yaml"), "--resume", path.name, "--runs-dir",
        str(tmp_path / "runs"), "--concurrency", "3", "--rpm", "60000"]
    assert quoted("failed:") == ["shardrun", "retry-failed", str(path), "--concurrency", "3",
                                 "--rpm", "60000"]
    again = run_cli(*retry[1:], cwd=tmp_path)
    assert again.returncode in (0, 1), again.stdout + again.stderr
    effective = orjson.loads((path / "manifest.json").read_bytes())["resumes"][-1]["effective"]
    assert effective["rate_limits.rpm"] == {"value": 60000.0, "source": "flag --rpm"}
    assert effective["concurrency"] == {"value": 3, "source": "flag --concurrency"}


def test_a_retry_pass_stopped_part_way_counts_the_dead_letters_it_took(tmp_path: Path) -> None:
    """A `retry-failed` pass stopped part-way (the account's quota used up after 4 requests):
    its summary's items are the dead letters it took, of those it set aside, and the stop came
    before the others, which its earlier failures count; not "read so far: the run stopped
    before the end of the input", which read as input left for --resume."""
    write_input(tmp_path / "input.jsonl", 40)
    base = {"base_url": "sim://", "api": "chat", "model": "m"}
    write_job(tmp_path / "job.yaml", shards=1, concurrency=2, retry={"max_attempts": 1},
              endpoint={**base, "sim": {**FAST_SIM, "fail_500": 0.5}})
    first = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert first.returncode == 1, first.stdout + first.stderr
    path = only_run(tmp_path / "runs")
    dead = len(read_jsonl(path / "dead" / "shard-00.jsonl"))
    write_job(tmp_path / "job.yaml", shards=1, concurrency=2, retry={"max_attempts": 1},
              endpoint={**base, "sim": {**FAST_SIM, "quota_after": 4}})
    retry = run_cli("retry-failed", str(path), "--quiet", cwd=tmp_path)
    assert retry.returncode == 1, retry.stdout + retry.stderr
    assert "quota is used up" in retry.stdout, retry.stdout
    lines = retry.stdout.splitlines()
    [items] = [line for line in lines if line.startswith("  items              ")]
    [earlier] = [line for line in lines if line.startswith("  earlier failures ")]
    took = int(items.split()[1])
    left = int(earlier.split()[2])
    assert 0 < took < dead and took + left == dead, retry.stdout
    assert items.endswith(f"  (dead letters taken to retry, of {dead}: the pass stopped before "
                          f"the other {left})"), items
    assert "read so far" not in retry.stdout


def test_a_variable_a_flag_overrides_is_named_not_silently_dropped(tmp_path: Path) -> None:
    """The command printed to finish a run carries its --concurrency; an operator who then
    lowers SHARDRUN_CONCURRENCY for an incident and pastes it gets the flag's value (a flag
    wins), and is told so in one warning naming both, where the variable was dropped silently.
    A variable equal to the flag, or one no flag overrides, draws no warning."""
    ids = write_input(tmp_path / "input.jsonl", 12)
    write_job(tmp_path / "job.yaml")
    first = run_cli("job.yaml", "--limit", "4", "--runs-dir", "runs", "--concurrency", "6",
                    "--quiet", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    [hint] = [line for line in first.stdout.splitlines() if "to finish the run" in line]
    command = shlex.split(hint.split("to finish the run", 1)[1])
    assert command[-2:] == ["--concurrency", "6"], command
    rest = run_cli(*command[1:], "--quiet", cwd=tmp_path,
                   env={"SHARDRUN_CONCURRENCY": "2", "SHARDRUN_MAX_ATTEMPTS": "3"})
    assert rest.returncode == 0, rest.stdout + rest.stderr
    assert [line for line in rest.stderr.splitlines() if "SHARDRUN_" in line] == [
        "warning: SHARDRUN_CONCURRENCY=2 is not used: the flag --concurrency 6 overrides it "
        "(a flag wins over the environment); leave the flag out to use the variable"]
    path = only_run(tmp_path / "runs")
    assert sorted(r["id"] for r in Run.load(path).results) == ids
    effective = orjson.loads((path / "manifest.json").read_bytes())["resumes"][-1]["effective"]
    assert effective["concurrency"] == {"value": 6, "source": "flag --concurrency"}
    same = run_cli("validate", "job.yaml", "--concurrency", "6", cwd=tmp_path,
                   env={"SHARDRUN_CONCURRENCY": "6"})
    assert same.returncode == 0 and "warning" not in same.stdout + same.stderr, same.stderr
    # The printed --runs-dir is the variable's directory tidied: the same one, no warning.
    tidied = run_cli("validate", "job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                     env={"SHARDRUN_RUNS_DIR": "./runs/"})
    assert tidied.returncode == 0 and "warning" not in tidied.stdout + tidied.stderr
    # Nor is a variable naming it through a symbolic link (the run's directory found by either).
    (tmp_path / "linked").symlink_to(path.parent, target_is_directory=True)
    linked = run_cli("validate", "job.yaml", "--runs-dir", "runs", cwd=tmp_path,
                     env={"SHARDRUN_RUNS_DIR": "linked"})
    assert linked.returncode == 0 and "warning" not in linked.stdout + linked.stderr
    # A bad value a flag overrides is not an error (it is not used), but it is named.
    bad = run_cli("validate", "job.yaml", "--shards", "3", cwd=tmp_path,
                  env={"SHARDRUN_SHARDS": "lots"})
    assert bad.returncode == 0, bad.stdout + bad.stderr
    assert ("warning: SHARDRUN_SHARDS=lots is not used: the flag --shards 3 overrides it"
            in bad.stdout + bad.stderr)

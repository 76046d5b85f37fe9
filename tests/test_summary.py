"""The end-of-run summary: failure reasons merged across shards and shown with their counts,
and the command that finishes a run left unfinished."""

from __future__ import annotations

import html
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import read_jsonl, run_cli, write_input, write_job

from shardrun.manifest import RunDir
from shardrun.ratelimit import limit_set_pace
from shardrun.runner import resume_command
from shardrun.spec import load_job
from shardrun.summary import (
    CLOCK_FROM_S,
    CORES_MIN_WALL_S,
    RunSummary,
    WorkLeft,
    add_unreported,
    format_summary,
    work_left,
)


def summary_of(reports: list[dict[str, Any]], *, dead: int, rejects: int = 0) -> RunSummary:
    return RunSummary.from_shard_reports(
        run_dir=Path("runs/r1"), reports=reports, ok=10, dead=dead, taken=10 + dead,
        skipped=0, rejects=rejects, started_at=0.0, ended_at=2.0, interrupted=False,
        fatal_reason=None, rejects_file=Path("runs/r1/rejects.jsonl"),
    )  # fmt: skip


def test_reasons_are_added_up_across_shards_keeping_the_first_example() -> None:
    s = summary_of([
        {"dead_reasons": {"max_attempts http_5xx": [3, "max_attempts: HTTP 500: boom"]}},
        {"dead_reasons": {"max_attempts http_5xx": [4, "max_attempts: HTTP 503: later"],
                          "not_retryable http_4xx": [1, "not_retryable_http_4xx: HTTP 400: x"]}},
        {},  # a shard that dead-lettered nothing (or an older shard) sends no reasons
    ], dead=8)  # fmt: skip
    assert s.dead_reasons == {"max_attempts http_5xx": (7, "max_attempts: HTTP 500: boom"),
                              "not_retryable http_4xx": (1, "not_retryable_http_4xx: HTTP 400: x")}
    lines = format_summary(s).splitlines()
    at = lines.index("  failed             8  (8 dead-lettered, 0 rejected input lines)")
    assert lines[at + 1: at + 4] == [
        "    7  max_attempts: HTTP 500: boom",
        "    1  not_retryable_http_4xx: HTTP 400: x",
        "  dead letters       runs/r1/dead/  (another pass: shardrun retry-failed runs/r1)",
    ]
    assert s.as_dict()["dead_reasons"]["max_attempts http_5xx"] == {
        "count": 7, "example": "max_attempts: HTTP 500: boom"}


def test_beyond_three_kinds_the_rest_is_one_line_and_counts_still_add_up() -> None:
    reasons = {f"kind{i}": [i + 1, f"kind{i}: reason {i}\n  with a line break"] for i in range(5)}
    s = summary_of([{"dead_reasons": reasons}], dead=15, rejects=2)
    text = format_summary(s)
    shown = [line for line in text.splitlines() if line.startswith("    ")]
    assert shown == [
        "    5  kind4: reason 4 with a line break",
        "    4  kind3: reason 3 with a line break",
        "    3  kind2: reason 2 with a line break",
        "    3  other reasons (2 kinds; shardrun report runs/r1)",
    ]
    assert sum(int(line.split()[0]) for line in shown) == s.dead
    assert "  rejected lines     runs/r1/rejects.jsonl" in text


def test_a_fourth_kind_alone_is_shown_not_called_other_reasons() -> None:
    """Four kinds: the fourth takes the line an "other reasons (1 kinds; ...)" line would, and
    says what it is (seen after an incident: "2  other reasons (1 kinds; shardrun report ...)",
    where report's dead-letter reasons give only the text before the first colon)."""
    reasons = {f"kind{i}": [i + 1, f"kind{i}: reason {i}"] for i in range(4)}
    s = summary_of([{"dead_reasons": reasons}], dead=10)
    shown = [line for line in format_summary(s).splitlines() if line.startswith("    ")]
    assert shown == ["    4  kind3: reason 3", "    3  kind2: reason 2", "    2  kind1: reason 1",
                     "    1  kind0: reason 0"]


def test_a_clean_run_shows_no_failure_lines() -> None:
    text = format_summary(summary_of([{"dead_reasons": {}}], dead=0))
    assert "dead letters" not in text and "rejected lines" not in text
    assert "  items              10\n" in text  # the input was read to its end
    assert not [line for line in text.splitlines() if line.startswith("    ")]


def test_reasoning_and_cached_tokens_are_summed_and_shown_only_when_counted() -> None:
    """The shards' counts of reasoning and cached prompt tokens add up; a run whose server
    counted none shows no such words."""
    s = summary_of([{"completion_tokens": 900, "reasoning_tokens": 600, "cached_tokens": 0,
                     "prompt_tokens": 3000},
                    {"completion_tokens": 100, "reasoning_tokens": 40, "cached_tokens": 2048,
                     "prompt_tokens": 4000}], dead=0)  # fmt: skip
    lines = format_summary(s).splitlines()
    assert "  completion tokens  1,000 (640 reasoning)" in lines
    assert "  cached prompt      2,048 of 7,000 prompt tokens (the server's count)" in lines
    assert (s.as_dict()["reasoning_tokens"], s.as_dict()["cached_tokens"]) == (640, 2048)
    plain = format_summary(summary_of([{"completion_tokens": 5}], dead=0))
    assert "  completion tokens  5\n" in plain and "cached" not in plain


def test_dead_letters_no_shard_reported_are_shown_as_such() -> None:
    """A shard that died wrote dead letters the coordinator counted from its files."""
    s = summary_of([{"dead_reasons": {"max_attempts http_5xx": [2, "max_attempts: HTTP 500"]}}],
                   dead=5)
    shown = [line for line in format_summary(s).splitlines() if line.startswith("    ")]
    assert shown == ["    2  max_attempts: HTTP 500",
                     "    3  reason in the dead-letter lines (written by a shard that could not "
                     "report them)"]


def test_the_command_that_finishes_the_run_shows_only_when_something_is_left() -> None:
    command = "shardrun job.yaml --resume r1"
    done = replace(summary_of([{}], dead=0), resume_command=command)
    assert "to finish the run" not in format_summary(done)
    # Items taken but not ended (stopped mid-run) ...
    stopped = replace(done, items=15, interrupted=True)
    assert f"  to finish the run  {command}" in format_summary(stopped).splitlines()
    # ... or every item taken ended, but the input was not read to its end.
    unread = replace(done, input_read=False, interrupted=True)
    assert f"  to finish the run  {command}" in format_summary(unread).splitlines()


def test_after_a_pass_that_read_the_whole_input_only_dead_letters_are_left() -> None:
    """A retry pass with --limit stops before the input's end, but an earlier pass read it all:
    --resume would run nothing. The dead letters it did not reach are for retry-failed; with
    none, no command is named."""
    command = "shardrun job.yaml --resume r1"
    limited = replace(summary_of([{}], dead=0), resume_command=command, input_read=False,
                      limit=3, input_read_before=True)
    assert "to finish the run" not in format_summary(limited)
    assert "(--limit 3: an earlier pass read the whole input)" in format_summary(limited)
    unretried = replace(limited, unretried=4, prior_dead=4, retry_command="shardrun retry-failed"
                        " runs/r1")
    assert "  to finish the run  shardrun retry-failed runs/r1" in (
        format_summary(unretried).splitlines())
    # Without that earlier pass, the rest of the input comes first.
    unread = replace(unretried, input_read_before=False)
    assert f"  to finish the run  {command}" in format_summary(unread).splitlines()


def test_a_retry_pass_stopped_part_way_speaks_of_dead_letters() -> None:
    """A pass of dead letters only that stopped before its input's end: its items are dead
    letters it took, of those set aside, and the rest were not reached (by --limit or a stop);
    a pass that also ran the input still says it read only so far."""
    stopped = replace(summary_of([{}], dead=0), input_read=False, interrupted=True, retried=23,
                      dead_letters_only=True, unretried=16, prior_dead=16)
    note = "  items              10  (dead letters taken to retry, of 23: {} before the other 16)"
    assert note.format("the pass stopped") in format_summary(stopped).splitlines()
    limited = replace(stopped, interrupted=False, limit=10)
    assert note.format("--limit 10 stopped the pass") in format_summary(limited).splitlines()
    all_taken = replace(stopped, unretried=3, unfinished_put_back=3, prior_dead=0)
    assert ("  items              10  (dead letters taken to retry: all 23 set aside)" in
            format_summary(all_taken).splitlines())
    with_input = replace(stopped, dead_letters_only=False)
    assert "(read so far: the run stopped before the end of the input)" in format_summary(
        with_input)


def test_a_stop_that_left_nothing_undone_is_no_interruption() -> None:
    """A Ctrl-C once every item has ended and the input was read: the run's status is what its
    items say (exit 0 here); with an item unfinished, or the input not read to its end (not for
    --limit), it is interrupted (130)."""
    done = replace(summary_of([{}], dead=0), interrupted=True)
    assert (done.status, done.exit_code) == ("succeeded", 0)
    assert replace(done, dead=1, items=done.items + 1).status == "failed"
    assert replace(done, items=done.items + 1).exit_code == 130
    assert replace(done, input_read=False).status == "interrupted"
    assert replace(done, input_read=False, limit=10).status == "succeeded"


def test_a_pass_stopped_before_its_input_was_read_has_not_succeeded() -> None:
    """A fatal stop (the run's simulator ended) before the shards took any item: nothing
    failed and nothing they took is unfinished, but the input's items never ran, so the pass
    failed (exit 1) and says how to finish; it said `run succeeded`, exit 0."""
    why = "the simulator this run started for sim:// ended mid-run (exited with status 0)"
    stopped = RunSummary.from_shard_reports(
        run_dir=Path("runs/r1"), reports=[{}], ok=0, dead=0, taken=0, skipped=0, rejects=0,
        started_at=0.0, ended_at=2.0, interrupted=False, fatal_reason=why, input_read=False,
        rejects_file=Path("runs/r1/rejects.jsonl"))  # fmt: skip
    assert (stopped.items, stopped.failed, stopped.unfinished) == (0, 0, 0)
    assert (stopped.status, stopped.exit_code) == ("failed", 1)
    assert format_summary(stopped).splitlines()[0].startswith("run failed: ")


@pytest.mark.parametrize(("given", "env", "path_in_job", "words"), [
    ({}, {}, None, []),  # the default: the same job file finds the run again
    ({}, {}, "elsewhere", []),  # the job file names it
    ({"runs_dir": "flagged"}, {}, None, ["--runs-dir", "flagged"]),
    ({}, {"SHARDRUN_RUNS_DIR": "from env"}, None, ["--runs-dir", "from env"]),
])  # fmt: skip
def test_the_resume_command_names_the_runs_directory_only_when_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: dict[str, str],
    env: dict[str, str], path_in_job: str | None, words: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    extra = {} if path_in_job is None else {"runs_dir": path_in_job}
    write_job(tmp_path / "my job.yaml", **extra)
    job = load_job(Path("my job.yaml"), env=env, flags=given)  # as typed: a relative path
    run_dir = RunDir(job.runs_path / "r1", "r1")
    command = resume_command(job, run_dir)
    assert shlex.split(command) == ["shardrun", "my job.yaml", "--resume", "r1", *words]


def test_an_empty_input_is_pointed_out() -> None:
    empty = RunSummary.from_shard_reports(
        run_dir=Path("runs/r1"), reports=[{}], ok=0, dead=0, taken=0, skipped=0, rejects=0,
        started_at=0.0, ended_at=1.0, interrupted=False, fatal_reason=None)  # fmt: skip
    note = "  items              0  (the input holds no records: is it the right file?)"
    assert note in format_summary(empty).splitlines()
    # A resume with nothing left to do read records: it says how many were already done.
    assert note not in format_summary(replace(empty, skipped=5)).splitlines()
    # Every line rejected (a TSV read as JSON lines) is pointed out too, as validate does.
    rejected = replace(empty, items=3, rejects=3)
    assert ("  items              3  (every line was rejected, nothing was sent: is it the right "
            "file, in the input.format and fields the job names?)") in format_summary(
                rejected).splitlines()
    assert "every line was rejected" not in format_summary(replace(rejected, items=4))


def test_a_later_pass_calls_its_tpm_its_own_average() -> None:
    """A resume's or retry pass's summary counts that pass (its items, tokens, wall time):
    its TPM is not the run average `report` prints over every pass, and says so."""
    s = summary_of([{"completion_tokens": 5, "attempts": 4}], dead=0)

    def tpm(segment: int) -> str:
        text = format_summary(replace(s, segment=segment))
        return next(x for x in text.splitlines() if x.startswith("  completion TPM"))

    assert tpm(0) == "  completion TPM     150 (run average, all shards)"
    assert tpm(2) == ("  completion TPM     150 (this pass's average; report's run average "
                      "covers every pass, all shards)")


def test_a_long_wall_time_is_also_shown_as_a_clock_reads() -> None:
    """A run of a million items lasts hours: its wall time also reads as H:MM:SS (M:SS from
    CLOCK_FROM_S on), a short one in seconds alone."""
    s = summary_of([{"completion_tokens": 5, "attempts": 4}], dead=0)

    def wall(wall_s: float) -> str:
        text = format_summary(replace(s, wall_s=wall_s))
        return next(x for x in text.splitlines() if x.startswith("  wall time"))

    assert wall(207.5) == "  wall time          207.5 s"
    assert wall(CLOCK_FROM_S) == "  wall time          600.0 s (10:00)"
    assert wall(50_000.0) == "  wall time          50,000.0 s (13:53:20)"


def test_cores_on_average_only_for_runs_long_enough_to_mean_it() -> None:
    """Client CPU per attempt always; cores on average only from CORES_MIN_WALL_S of wall time
    on, as the CPU counts start-up that comes before the run's clock starts."""
    s = summary_of([{"completion_tokens": 5, "attempts": 4}], dead=0)
    short = replace(s, client_cpu_s=0.4, attempts=4, wall_s=0.1)
    line = next(x for x in format_summary(short).splitlines() if x.startswith("  client CPU"))
    assert line == "  client CPU         0.4 s  (100.00 ms per attempt)"
    long = replace(s, client_cpu_s=30.0, attempts=4, wall_s=CORES_MIN_WALL_S * 12)
    line = next(x for x in format_summary(long).splitlines() if x.startswith("  client CPU"))
    assert line == "  client CPU         30.0 s  (7,500.00 ms per attempt, 0.50 cores on average)"
    none = replace(s, client_cpu_s=0.4, attempts=0, wall_s=0.1)
    line = next(x for x in format_summary(none).splitlines() if x.startswith("  client CPU"))
    assert line == "  client CPU         0.4 s"


def test_counts_of_one_take_the_singular() -> None:
    """One retry, one rejected line, one item: '1 retries' read as a typo in the line most runs
    end on (a run with a single retry is common)."""
    s = summary_of([{"attempts": 11, "retries": 1, "budget_exhausted": 1}], dead=1, rejects=1)
    lines = format_summary(replace(s, shard_deaths=1, reassigned=1)).splitlines()
    assert "  attempts           11 (1 retry, retry budget spent for 1 item)" in lines
    assert "  failed             2  (1 dead-lettered, 1 rejected input line)" in lines
    assert "  shard deaths       1 (1 item handed to other shards)" in lines
    refused = format_summary(replace(s, refusals=1)).splitlines()
    assert "  succeeded          10  (1 of them a refusal: the model declined; see `refusal` in " \
           "the results)" in refused
    lines = format_summary(replace(s, retries=2, budget_exhausted=2, rejects=2)).splitlines()
    assert "  attempts           11 (2 retries, retry budget spent for 2 items)" in lines


def test_lines_a_dead_shard_never_reported_add_what_they_hold_to_its_last_report() -> None:
    """Their items, tokens, refusals, estimated token counts and spent retry budgets; of their
    attempts, those the report did not count (`tried`: the failed ones of spans then still open)."""
    report = {"ok": 5, "attempts": 9, "retries": 2, "wasted_tokens": 40}
    results = [{"id": "a", "span": "0-7", "attempts": 3, "refusal": "no",
                "usage": {"completion_tokens": 4, "prompt_tokens": 6, "cached_tokens": 2,
                          "reasoning_tokens": 1}},
               {"id": "b", "span": "0-8", "attempts": 1,
                "usage": {"completion_tokens": 5, "estimated": True}}]
    dead = [{"id": "c", "span": "0-9", "reason": "retry_budget_exhausted: HTTP 500",
             "attempts": [{"status": "http_5xx"}, {"status": "http_5xx"}]}]
    after = add_unreported(report, {"0-7": 2}, results, dead)
    assert {k: after.get(k, 0) for k in (
        "ok", "dead", "attempts", "retries", "completion_tokens", "prompt_tokens",
        "cached_tokens", "reasoning_tokens", "refusals", "budget_exhausted", "wasted_tokens",
        "estimated_ok",
    )} == {"ok": 7, "dead": 1, "attempts": 9 + 1 + 1 + 2, "retries": 2 + 1 + 0 + 1,
           "completion_tokens": 9, "prompt_tokens": 6, "cached_tokens": 2,
           "reasoning_tokens": 1, "refusals": 1, "budget_exhausted": 1, "wasted_tokens": 40,
           "estimated_ok": 1}


def test_a_dead_shards_attempts_out_at_its_last_report_count_once() -> None:
    """The attempts a shard had out at its last report (`sending`) went to the server, and the
    log holds their start: a dead shard's summary counts them. A retry among them is in the
    report's `retries` and in its span's `tried` already, so the span's line, written after the
    report, adds neither again."""
    report = {"attempts": 10, "retries": 4, "sending": 2}  # out: 0-1's first, 0-2's third
    results = [{"id": "b", "span": "0-2", "attempts": 3, "usage": {}}]
    after = add_unreported(report, {"0-2": 3}, results, [])
    assert (after["attempts"], after["retries"], after["ok"]) == (12, 4, 1)


def test_a_first_attempt_out_at_the_last_report_and_ended_in_a_line_counts_once() -> None:
    """`sending` at the report made at `at` holds the first attempts then out: a line of a span
    `tried` does not hold whose first attempt started before `at` adds its attempts less that
    one; a span admitted after the report adds them all. A dead letter's history gives its
    first attempt's start; a result's, its admission (queued_at + t_queue)."""
    report = {"at": 100.0, "attempts": 10, "retries": 4, "sending": 3}
    results = [  # out at the report; admitted after it
        {"id": "a", "span": "0-1", "attempts": 1, "queued_at": 99.0,
         "buckets": {"t_queue": 0.5, "t_retry": 0.0}, "usage": {}},
        {"id": "c", "span": "0-3", "attempts": 1, "queued_at": 99.0,
         "buckets": {"t_queue": 1.5, "t_retry": 0.0}, "usage": {}}]
    dead = [{"id": "b", "span": "0-2", "reason": "http_5xx",  # the first out, the second after
             "attempts": [{"status": "http_5xx", "started_at": 99.7},
                          {"status": "http_5xx", "started_at": 100.4}]}]
    after = add_unreported(report, {}, results, dead)
    # 3 out (0-1's, 0-2's first and another still out) + 0-3's one + 0-2's second.
    assert (after["attempts"], after["retries"], after["ok"], after["dead"]) == (15, 5, 2, 1)


def test_a_dead_shards_unreported_dead_letters_add_their_unreported_429s() -> None:
    """A dead letter written after the shard's last report adds the 429s that report did not
    count (its attempts' 429s less those `refused` counted for its span), beside those
    attempts: the req/min answered (attempts less 429s) read high by every 429 of them, as if
    the server had answered it."""
    report = {"attempts": 10, "http_429s": 4}
    dead = [{"id": "c", "span": "0-9", "reason": "rate_limited_too_long: refused with 429",
             "attempts": [{"status": "http_429"}, {"status": "http_5xx"},
                          {"status": "http_429"}, {"status": "http_429"}]}]
    # its first two were reported, one of them a 429
    after = add_unreported(report, {"0-9": 2}, [], dead, refused={"0-9": 1})
    assert (after["attempts"], after["http_429s"]) == (12, 6)


def test_a_429_of_a_retry_out_at_the_last_report_is_added_once_it_ends() -> None:
    """A retry is in `tried` once it is sent, its 429 in the counters only once it ends: with
    the second attempt out at the report (`tried` 2, one 429 counted), its 429 is the line's
    to add. Read off `tried`, the attempts after the second, it was lost; a result line, which
    holds its 429s' number, adds them likewise."""
    report = {"attempts": 10, "http_429s": 4, "sending": 1}
    history = [{"status": "http_429"}, {"status": "http_429"}, {"status": "http_5xx"}]
    dead = [{"id": "c", "span": "0-9", "reason": "max_attempts: HTTP 500", "attempts": history}]
    results = [{"id": "d", "span": "0-8", "attempts": 3, "http_429s": 2, "usage": {}}]
    tried, refused = {"0-9": 2, "0-8": 2}, {"0-9": 1, "0-8": 1}
    after = add_unreported(report, tried, results, dead, refused=refused)
    assert (after["attempts"], after["http_429s"]) == (13, 6)


def test_work_left_after_a_whole_read_counts_unfinished_items_not_put_back() -> None:
    """After a pass that read the input whole, what a later pass took and did not end is left
    for --resume, less the dead letters it retried (back in dead/); a summary of an older
    shardrun, which lacks that count, stays as it was judged: nothing for --resume."""
    recorded = {"input_read": False, "unfinished": 5, "unfinished_put_back": 3, "unretried": 4}
    assert work_left(recorded, read_before=True) == WorkLeft(
        unread=False, left_out=0, unfinished=2, unretried=4, put_back=3)
    assert work_left(recorded, read_before=True).not_reached == 1
    older = {key: value for key, value in recorded.items() if key != "unfinished_put_back"}
    assert work_left(older, read_before=True).for_resume is False
    assert work_left(older, read_before=False) == WorkLeft(
        unread=True, left_out=0, unfinished=5, unretried=4, put_back=0)


def test_a_retry_pass_that_read_up_to_its_last_dead_letter_says_so_not_a_count() -> None:
    """A pass of dead letters only that read no line past the last of them counts no items no
    pass has run there: it says where it stopped and that the command below runs them, unless
    an earlier pass read the whole input. It finished: no interruption, and it succeeds when
    every item did; a stop of it before it took every dead letter still says so."""
    command = "shardrun job.yaml --resume r1"
    found = replace(summary_of([{}], dead=0), resume_command=command, input_read=False,
                    read_to_line=40, retried=10, dead_letters_only=True)
    lines = format_summary(found).splitlines()
    assert ("  items              10  (dead letters only: the last is on line 40, and no line "
            "after it was read: the command below runs the items no pass has run)") in lines
    assert f"  to finish the run  {command}" in lines
    assert (found.status, found.exit_code) == ("succeeded", 0)
    assert replace(found, interrupted=True).status == "succeeded"
    passed = replace(found, left_out=5)
    assert ("(dead letters only: the last is on line 40, and no line after it was read; 5 items "
            "no pass has run lie before it: the command below runs them and those after it)") in (
        format_summary(passed))
    before = replace(found, input_read_before=True)
    assert ("  items              10  (dead letters only: the last is on line 40, and no line "
            "after it was read: an earlier pass ran the items there)") in format_summary(
        before).splitlines()
    assert "to finish the run" not in format_summary(before)
    cut = replace(found, interrupted=True, unretried=4, prior_dead=4)
    assert "(dead letters taken to retry, of 10: the pass stopped before the other 4)" in (
        format_summary(cut))
    assert found.as_dict()["read_to_line"] == 40


def test_a_dead_letter_of_an_answered_item_is_counted_as_answered_not_as_a_stop(
        tmp_path: Path) -> None:
    """A damaged run: a dead letter for an item that has a result line too. retry-failed sets
    it aside, and skips the item as finished: its summary said "the pass stopped before the
    other 1" and named itself again to finish the run, though nothing stopped."""
    write_input(tmp_path / "input.jsonl", 6)
    write_job(tmp_path / "job.yaml", shards=1)
    first = run_cli("run", "job.yaml", "--run-id", "r1", "--quiet", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "runs" / "r1"
    answered = read_jsonl(run / "results" / "shard-00.jsonl")[2]["id"]
    (run / "dead" / "shard-00.jsonl").write_bytes(orjson.dumps(
        {"id": answered, "reason": "written by hand", "attempts": [], "shard": 0}) + b"\n")
    retry = run_cli("retry-failed", "runs/r1", "--quiet", cwd=tmp_path)
    items = next(line for line in retry.stdout.splitlines() if line.startswith("  items "))
    assert "stopped" not in items, retry.stdout
    # Whether a note on how far the pass read comes first depends on how far its reader ran
    # ahead of the dispatcher before it found nothing to run: either way, this part ends it.
    assert items.endswith("1 of the dead letters set aside already answered (a result line "
                          "for the item too), so not run)"), retry.stdout
    assert "to finish the run" not in retry.stdout
    # Nor is it an earlier failure that another retry pass would run: every item has a result.
    assert "earlier failures" not in retry.stdout and "retry-failed" not in retry.stdout
    assert retry.returncode == 0 and retry.stdout.startswith("run succeeded"), retry.stdout


def _damaged_run(tmp_path: Path) -> Path:
    """A run of 6 answered items, one with a dead letter written back after retry-failed found
    it answered (as a retry pass's cut put-back leaves it): in dead/unretried-r1.jsonl."""
    write_input(tmp_path / "input.jsonl", 6)
    write_job(tmp_path / "job.yaml", shards=1)
    assert run_cli("run", "job.yaml", "--run-id", "r1", "--quiet", cwd=tmp_path).returncode == 0
    run = tmp_path / "runs" / "r1"
    answered = read_jsonl(run / "results" / "shard-00.jsonl")[2]["id"]
    (run / "dead" / "shard-00.jsonl").write_bytes(orjson.dumps(
        {"id": answered, "reason": "written by hand", "attempts": [], "shard": 0}) + b"\n")
    retry = run_cli("retry-failed", "runs/r1", "--quiet", cwd=tmp_path)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    assert [r["id"] for r in read_jsonl(run / "dead" / "unretried-r1.jsonl")] == [answered]
    return run


def test_report_counts_a_dead_letter_of_an_answered_item_as_answered(tmp_path: Path) -> None:
    """retry-failed counts a dead letter whose item has a result line as answered; report read
    '1 dead letter standing, success rate 85.71%' for it. Text, JSON and HTML now count it
    answered, in a line of its own."""
    run = _damaged_run(tmp_path)
    text = run_cli("report", str(run), cwd=tmp_path)
    assert text.returncode == 0, text.stdout + text.stderr
    said = ("  by item, after the retry passes: 6 succeeded, 0 dead letters standing, success "
            "rate 100.00%\n  1 dead letter is of an item answered later (a result line too), so "
            "counted as answered, not standing\n")
    assert said in text.stdout, text.stdout
    doc = orjson.loads(run_cli("report", str(run), "--json", cwd=tmp_path).stdout)
    assert doc["items"]["by_item"] == {"succeeded": 6, "dead": 0, "answered_dead": 1,
                                       "success_rate": 1.0}
    page = tmp_path / "r.html"
    assert run_cli("report", str(run), "--html", str(page), cwd=tmp_path).returncode == 0
    assert said in html.unescape(page.read_text())


def test_a_resume_counts_a_dead_letter_of_an_answered_item_as_no_failure(
        tmp_path: Path) -> None:
    """A plain --resume of that run counted the dead letter as an earlier failure: 'run
    failed', exit 1, while report and retry-failed count it answered. It succeeds now, and
    says the dead letter's item is answered."""
    _damaged_run(tmp_path)
    rest = run_cli("run", "job.yaml", "--resume", "r1", "--quiet", cwd=tmp_path)
    assert rest.returncode == 0 and rest.stdout.startswith("run succeeded"), rest.stdout
    assert "earlier failures" not in rest.stdout and "retry-failed" not in rest.stdout
    assert ("  answered later     1 dead letter (its item has a result line too: not failed)"
            in rest.stdout.splitlines()), rest.stdout


def test_a_retry_pass_stopped_part_way_counts_answered_dead_letters_apart() -> None:
    """Stopped part way, a retry pass's dead letters of answered items are no part of those the
    stop left: they are said apart, and the retry command is not named for them alone."""
    stopped = replace(summary_of([{}], dead=0), input_read=False, interrupted=True, retried=23,
                      dead_letters_only=True, unretried=16, prior_dead=14, answered_dead=2,
                      retry_command="shardrun retry-failed runs/r1")
    lines = format_summary(stopped).splitlines()
    assert ("  items              10  (dead letters taken to retry, of 23: the pass stopped "
            "before the other 14; 2 of the dead letters set aside already answered (a result "
            "line for the item too), so not run)") in lines
    assert "  to finish the run  shardrun retry-failed runs/r1" in lines
    answered_only = replace(stopped, unretried=2, prior_dead=0, retried=12)
    lines = format_summary(answered_only).splitlines()
    assert ("  items              10  (dead letters taken to retry: 10 of 12 set aside; 2 of the "
            "dead letters set aside already answered (a result line for the item too), so not "
            "run)") in lines
    assert not any(line.startswith("  to finish the run") for line in lines)


@pytest.mark.parametrize(("held", "pace", "seeded", "set_pace"), [
    (4, None, False, False), (5, None, False, True), (1, 2.0, False, True),
    (1, 100.0, False, True), (1, 60.0, True, True), (1, 100.0, True, False)])
def test_the_summary_says_the_server_limit_set_the_pace_by_the_reports_rule(
        held: int, pace: float | None, seeded: bool, set_pace: bool) -> None:
    """Of 100 attempts in 2 s (50 a second), 4 held for the server's rate limit with no pace
    learned only met the limit: the summary's line says so, as the report's
    `server_rate_limit_touched` does, not that the limit set the pace (5, 5 %, or a learned
    pace, does: `limit_set_pace`), unless that pace was only set from a stated limit the run
    stayed well below (100 a second; 60 is within SEEDED_PACE_NEAR of 50)."""
    s = summary_of([{"attempts": 100, "limited_429s": held, "paced_rps": pace,
                     "paced_seeded": seeded}], dead=0)
    (line,) = [x for x in format_summary(s).splitlines() if "server rate limit" in x]
    assert ("the server's limit set the pace;" in line) is set_pace, line
    assert ("a few requests met the server's limit" in line) is not set_pace, line
    assert limit_set_pace(held, 100, pace is not None, sent_rps=50.0,
                          seeded_rps=pace if seeded else None) is set_pace


def test_the_summary_counts_answered_without_any_429_as_the_report_does() -> None:
    """Of 100 attempts over 2 s, 30 answered 429, 10 of them held (the rest a quota's, one over
    the whole limit, or ended by a stop): the summary's requests answered a minute leave out
    all 30, as report's answered_rpm leaves out every attempt_end of status http_429; it said
    90 answered, counting the 429s that held nothing."""
    s = summary_of([{"attempts": 100, "limited_429s": 10, "http_429s": 30}], dead=0)
    (line,) = [x for x in format_summary(s).splitlines() if "server rate limit" in x]
    assert "10 429s held, 2,100 req/min answered on average" in line, line


def test_a_dead_shards_unreported_dead_letters_add_their_unreported_held_429s() -> None:
    """A dead letter written after the shard's last report adds the held retries of its 429s
    that report did not count (its attempts marked `held`, less those the report's `held`
    counted for its span), as `report` counts each from its `retry` line: `limited_429s` was
    left as reported while `http_429s` was amended, so the summary and `report` disagreed."""
    report = {"attempts": 10, "http_429s": 4, "limited_429s": 3}
    dead = [{"id": "c", "span": "0-9", "reason": "rate_limited_too_long: refused with 429",
             "attempts": [{"status": "http_429", "held": True},
                          {"status": "http_429", "held": True},
                          {"status": "http_429", "held": True}, {"status": "http_429"}]},
            {"id": "d", "span": "0-4", "reason": "rate_limited_too_long: refused with 429",
             "attempts": [{"status": "http_429", "held": True}, {"status": "http_429"}]}]
    # Of 0-9, the report counted two attempts ended and one hold sent (the second's was
    # decided but not yet sent); 0-4 began after it.
    after = add_unreported(report, {"0-9": 2}, [], dead, {"0-9": 1}, {"0-9": 2})
    assert (after["attempts"], after["http_429s"], after["limited_429s"]) == (14, 8, 6)

"""Token counts the client estimated (the server sent no usage) are said to be estimates wherever
a throughput is built on them: the run's summary, `report` (text, JSON, HTML), a published
sample (which `verify` checks), and the C fold counts them as the Python fold does.

One real run against the simulator in two passes: the first with usage in the stream (--limit
60), the resume with `endpoint.stream_usage: false`, so the simulator sends none and the
client counts content chunks. The figures are checked against the result lines themselves.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from conftest import FAST_SIM, Run, run_cli, write_input, write_job
from test_fastfold import MODES, both, c_fold

from shardrun.aggregate import _fast as fast
from shardrun.report._text import format_tpm

ITEMS, FIRST = 200, 60


@dataclass
class Mixed:
    root: Path
    run_dir: Path
    passes: list[subprocess.CompletedProcess[str]]
    run: Run


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Mixed:
    root = tmp_path_factory.mktemp("estimated")
    write_input(root / "input.jsonl", ITEMS)
    job = write_job(root / "job.yaml", endpoint={"base_url": "sim://", "api": "chat",
                                                 "model": "m", "sim": FAST_SIM})
    first = run_cli("job.yaml", "--runs-dir", "runs", "--run-id", "r1", "--limit", str(FIRST),
                    cwd=root)
    assert first.returncode == 0, first.stderr
    spec = yaml.safe_load(job.read_text())
    spec["endpoint"]["stream_usage"] = False  # the simulator then sends no usage
    job.write_text(yaml.safe_dump(spec))
    second = run_cli("job.yaml", "--runs-dir", "runs", "--resume", "r1", cwd=root)
    assert second.returncode == 0, second.stderr
    run_dir = root / "runs" / "r1"
    return Mixed(root, run_dir, [first, second], Run.load(run_dir))


def estimated_results(m: Mixed) -> list[dict[str, Any]]:
    """The result lines whose usage the client counted, checked to be the resumed pass's."""
    assert len(m.run.results) == ITEMS
    found = [r for r in m.run.results if r["usage"]["estimated"] is True]
    assert len(found) == ITEMS - FIRST
    return found


def sentence(n: int, of: int) -> str:
    return (f"across the run, {n:,} of {of:,} successes' token counts are estimated (the server "
            "sent no usage)")


def peak_sentence(m: Mixed, found: list[dict[str, Any]]) -> str:
    """What the TPM table says under it, from the result lines: how much of the busiest minute
    (none is full in a run this short) the client counted."""
    tokens = Counter[int]()
    estimated = Counter[int]()
    for r in m.run.results:
        minute = int(r["last_token_at"] // 60)
        tokens[minute] += r["usage"]["completion_tokens"]
        estimated[minute] += r["usage"]["completion_tokens"] if r in found else 0
    [(busiest, most)] = tokens.most_common(1)
    return (f"{sentence(len(found), ITEMS)}; in the best partial minute, {estimated[busiest]:,} "
            f"of its {most:,} tokens: its TPM is partly an estimate")


def test_the_closing_summary_says_how_many_successes_are_estimated(mixed: Mixed) -> None:
    first, second = (p.stdout.splitlines() for p in mixed.passes)
    assert not [line for line in first if "estimated" in line]
    n = ITEMS - FIRST
    assert (f"  estimated          {n:,} of {n:,} successes' token counts (the server sent no "
            "usage): TPM is an estimate") in second


def test_report_text_and_json_count_the_estimated_successes(mixed: Mixed) -> None:
    found = estimated_results(mixed)
    tokens = sum(int(r["usage"]["completion_tokens"]) for r in found)
    proc = run_cli("report", str(mixed.run_dir), "--json", cwd=mixed.root)
    assert proc.returncode == 0, proc.stderr
    doc = orjson.loads(proc.stdout)
    assert doc["items"]["succeeded"] == ITEMS
    assert doc["items"]["estimated_successes"] == len(found)
    assert doc["items"]["estimated_completion_tokens"] == tokens
    assert 0 < tokens < doc["items"]["completion_tokens"]  # the first pass's the server counted
    assert doc["tpm"]["estimated_completion_tokens"] == tokens
    by_minute = Counter[int]()
    for r in found:
        by_minute[int(r["last_token_at"] // 60)] += r["usage"]["completion_tokens"]
    assert {row["start"] // 60: row["estimated_completion_tokens"] for row in doc["tpm"]["minutes"]
            if row["estimated_completion_tokens"]} == dict(by_minute)
    text = run_cli("report", str(mixed.run_dir), cwd=mixed.root)
    assert text.returncode == 0, text.stderr
    # Under the items' completion tokens, run-wide; under the TPM table, with the peak's part.
    assert text.stdout.splitlines().count(f"  {sentence(len(found), ITEMS)}") == 1
    assert doc["tpm"]["peak_full_minute"] is None  # a run of seconds: no minute is full
    assert f"  {peak_sentence(mixed, found)}" in text.stdout.splitlines()


def test_the_tpm_table_says_whether_its_peak_minute_is_estimated(mixed: Mixed) -> None:
    """"TPM is an estimate" showed whenever any success was estimated, though the peak minute
    may hold none of them: the peak minute's own share is said, and it may be none."""
    proc = run_cli("report", str(mixed.run_dir), "--json", cwd=mixed.root)
    assert proc.returncode == 0, proc.stderr
    doc = orjson.loads(proc.stdout)
    row = next(r for r in doc["tpm"]["minutes"] if r["completion_tokens"])
    run_wide = sentence(ITEMS - FIRST, ITEMS)
    tokens = row["completion_tokens"]
    assert tokens > 5
    for estimated, said in [(0, "none: its TPM is the server's count"),
                            (5, f"5 of its {tokens:,} tokens: its TPM is partly an estimate"),
                            # Not "partly": the whole minute is the client's count.
                            (tokens, f"all {tokens:,} of its tokens: its TPM is an estimate")]:
        peak = {**row, "estimated_completion_tokens": estimated}
        doc["tpm"]["peak_full_minute"] = peak
        assert f"  {run_wide}; in the peak full minute, {said}" in format_tpm(doc).splitlines()
    del peak["estimated_completion_tokens"]  # a report made before the peak counted them
    assert f"  {run_wide}" in format_tpm(doc).splitlines()


def test_report_html_says_so_on_the_tpm_plot(mixed: Mixed, tmp_path: Path) -> None:
    pytest.importorskip("plotly")
    out = tmp_path / "r.html"
    proc = run_cli("report", str(mixed.run_dir), "--html", str(out), cwd=mixed.root)
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    words = sentence(ITEMS - FIRST, ITEMS)
    # In the TPM plot's title (plotly's JSON escapes its markup) and in the text under the plots.
    plain = page.replace("\\u003c", "<").replace("\\u003e", ">").replace("\\u002f", "/")
    assert f"<br><sup>{peak_sentence(mixed, estimated_results(mixed))}</sup>" in plain
    assert page.count(words.replace("'", "&#x27;")) == 2


def test_a_sample_says_how_much_of_its_minute_is_estimated_and_verify_checks_it(
    mixed: Mixed, tmp_path: Path,
) -> None:
    found = estimated_results(mixed)
    out = tmp_path / "sample.json"
    proc = run_cli("publish", str(mixed.run_dir), "-o", str(out), cwd=mixed.root)
    assert proc.returncode == 0, proc.stderr
    sample = orjson.loads(out.read_bytes())
    minute = sample["minute_start_t"] // 60
    mine = [r for r in found if int(r["last_token_at"] // 60) == minute]
    assert mine, "the busiest minute holds answers of the resumed pass"
    spans = sample["spans"]
    tokens = sum(r["usage"]["completion_tokens"] for r in mine)
    assert (sample["estimated_spans"], sample["estimated_completion_tokens"]) == (len(mine),
                                                                                  tokens)
    said = (f"the token counts of {len(mine):,} of its {spans:,} spans ({tokens:,} tokens) are "
            "estimated (the server sent no usage): its TPM is an estimate")
    assert [line for line in proc.stderr.splitlines() if "estimated" in line] == [
        f"warning: minute {sample['minute']}: {said}"]
    ok = run_cli("verify", str(out), "--run-dir", str(mixed.run_dir), cwd=mixed.root)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.rstrip().endswith(f"; {said}")

    edited = {**sample, "estimated_spans": 0}
    out.write_bytes(orjson.dumps(edited))
    bad = run_cli("verify", str(out), "--run-dir", str(mixed.run_dir), cwd=mixed.root)
    assert bad.returncode == 1
    assert (f"minute {sample['minute']}: estimated_spans: the sample says 0 but the events give "
            f"{len(mine)}") in bad.stderr

    # A sample published before the fields existed lacks them: it verifies, and verify says it.
    old = {k: v for k, v in sample.items() if not k.startswith("estimated_")}
    out.write_bytes(orjson.dumps(old))
    older = run_cli("verify", str(out), "--run-dir", str(mixed.run_dir), cwd=mixed.root)
    assert older.returncode == 0, older.stderr
    assert older.stdout.rstrip().endswith(f"; {said}")


@pytest.mark.parametrize(("minutes_only", "keep_lines"), MODES)
def test_the_c_fold_counts_estimated_successes_as_the_python_fold(
    mixed: Mixed, minutes_only: bool, keep_lines: bool,
) -> None:
    """test_fastfold's comparison (every field, each minute's cell included) on these logs."""
    if fast._fastfold is None:
        pytest.skip("the C fold is not built here (no C compiler at install time)")
    estimated = []
    for path in sorted((mixed.run_dir / "events").glob("shard-*.jsonl")):
        both(path, minutes_only, keep_lines)
        _, got = c_fold(path, minutes_only, keep_lines)
        estimated.append((got.estimated_ok, sum(c.estimated_spans for c in got.minutes.values())))
    assert [sum(n) for n in zip(*estimated, strict=True)] == [ITEMS - FIRST] * 2

"""The README against the code: every `SHARDRUN_*` variable, job key and flag it names exists,
and every one the code takes is named where a user looks (the README, `--help`).

These read the texts as a user does (code blocks, backticked names, the variable table) and
ask the real parsers, so a name removed or renamed on either side fails here.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import operator
import re
import shlex
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardrun._env import ANALYSIS_VARS, ENV_VARS, IGNORE_VAR, unknown_env_errors
from shardrun._models import FIELDS, SECTION_KEYS
from shardrun.cli import SUBCOMMANDS, build_parser
from shardrun.coordinator import START_SILENCE_MIN_S
from shardrun.event_names import ALL_EVENTS, LEGACY_ATTEMPT_EVENTS
from shardrun.shard_config import Counters
from shardrun.sim import _parser as sim_parser
from shardrun.sim.config import SimConfig
from shardrun.spec import load_job
from tests.conftest import FAST_SIM, only_run, run_cli, write_input, write_job

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
VAR = re.compile(r"SHARDRUN_[A-Z0-9_]*[A-Z0-9]")

# Names the README shows as what is NOT shardrun's: the typo it refuses, a wrapper's variable.
NOT_OURS = {"SHARDRUN_CONCURENCY", "SHARDRUN_JOB_NAME"}
# Free-form mappings: what is under them is the server's or the simulator's, not a job key.
FREE = ("params", "endpoint.headers", "endpoint.sim")
# Flags in prose that belong to other programs (a benchmark script, another server).
FOREIGN_FLAGS = {"--a", "--send-done"}


def our_vars() -> set[str]:
    return {v.name for v in ENV_VARS} | set(ANALYSIS_VARS) | {IGNORE_VAR}


def test_every_variable_named_is_ours_and_every_one_of_ours_is_named() -> None:
    """README and `--help` name exactly the variables the code reads; the README's examples of
    foreign names are ones a run refuses."""
    named = set(VAR.findall(README))
    assert named - NOT_OURS == our_vars()
    assert unknown_env_errors(dict.fromkeys(NOT_OURS, "1"))  # refused, as the README says
    help_text = build_parser().format_help()
    assert set(VAR.findall(help_text)) == our_vars()


def test_the_code_reads_no_variable_its_tables_leave_out() -> None:
    """A `SHARDRUN_*` name written as a string anywhere in the package is in the tables above
    (which the README and `--help` are checked against), not read on the side."""
    literals = {
        name
        for source in (ROOT / "shardrun").rglob("*.py")
        for name in re.findall(r"[\"'](SHARDRUN_[A-Z0-9_]*[A-Z0-9])[\"']", source.read_text())
    }
    assert literals and literals <= our_vars()


def test_the_variable_table_maps_each_variable_to_its_job_key() -> None:
    """The table of "Environment variables" ("`shardrun --help` prints the same list"): each
    row's key is the one the loader sets from that variable, in the order `--help` lists."""
    start = README.index("\n## Environment variables")
    section = README[start:README.index("\n## ", start + 1)]
    rows = re.findall(r"^\| `(SHARDRUN_\w+)` \| `([\w.]+)`", section, re.MULTILINE)
    assert rows == [(v.name, v.key) for v in ENV_VARS]


def test_the_start_up_silence_in_the_docs_is_the_coordinators() -> None:
    """A shard not heard from yet may be silent START_SILENCE_MIN_S whatever shard_silence_s
    says: the README's row and `--help` give that figure, as written where the limit is."""
    row = next(line for line in README.splitlines() if line.startswith("| `SHARDRUN_SHARD_SIL"))
    help_text = next(v.help for v in ENV_VARS if v.name == "SHARDRUN_SHARD_SILENCE_S")
    figure = f"{START_SILENCE_MIN_S:g}"
    assert f"{figure} before its first word" in row
    assert f"still starting: {figure} at least" in help_text


def test_the_progress_lines_the_readme_quotes_are_the_views() -> None:
    """"Live progress" quotes the view's words for a hung endpoint and for a pass reading up
    to its first item; each is the text `progress` writes for those figures."""
    from shardrun.progress import _silent_text, _skipping_text

    flat = " ".join(README.split())
    reading = _skipping_text(2_300_000, 0)
    quoted = [_silent_text(30, 14).removeprefix("; "), reading,
              _skipping_text(2_300_000, 955_000).removeprefix(reading)]
    assert [text for text in quoted if f'"{text}"' not in flat] == []


def yaml_blocks(text: str) -> Iterator[Any]:
    """Each ```yaml block, and each commented-out top-level line in one (`# pricing: {...}`),
    which shows a key as an alternative."""
    for block in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL):
        yield yaml.safe_load(block)
        for line in re.findall(r"^# ?([a-z_]+: .*)$", block, re.MULTILINE):
            yield yaml.safe_load(line)


def dotted(tree: Any, prefix: str = "") -> Iterator[str]:
    for key, value in tree.items():
        name = prefix + str(key)
        yield name
        if isinstance(value, dict) and name not in FREE:
            yield from dotted(value, name + ".")


FILE_SUFFIXES = (".jsonl", ".json", ".py", ".csv", ".tsv", ".yaml", ".yml", ".md", ".parquet",
                 ".txt", ".html", ".log")


def backticked_keys(text: str, sections: set[str]) -> set[str]:
    """Dotted names in backticks whose first part is a job section: a whole backticked name,
    or one with its value (`retry.max_attempts: 3`); a file name (`input.jsonl`, `retry.py`)
    is no key."""
    return {
        name for name in re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)+)(?:[:= ][^`\n]*)?`", text)
        if name.partition(".")[0] in sections and not name.endswith(FILE_SUFFIXES)
    }


def test_file_names_in_backticks_are_no_job_keys() -> None:
    text = ("`input.path`, `retry.max_attempts: 3`, `input.jsonl`, `retry.py`, `output.csv`, "
            "`endpoint.model`s and `input.prompt_field` too")
    assert backticked_keys(text, {"input", "retry", "output", "endpoint"}) == {
        "input.path", "retry.max_attempts", "endpoint.model", "input.prompt_field"}


def documented_job_keys() -> tuple[set[str], set[str]]:
    """(keys the README's job-file examples use, keys it names in backticks as `a.b`)."""
    in_yaml = {key for tree in yaml_blocks(README) for key in dotted(tree)}
    sections = {key.partition(".")[0] for key in FIELDS}
    named = backticked_keys(README, sections)
    table = {v.key for v in ENV_VARS}
    return in_yaml, named | table


def test_every_job_key_shown_exists_and_every_one_is_shown() -> None:
    in_yaml, named = documented_job_keys()
    free = tuple(prefix + "." for prefix in FREE)
    assert {key for key in in_yaml | named if not key.startswith(free)} - set(FIELDS) == set()
    assert set(FIELDS) - SECTION_KEYS - in_yaml - named == set()


def test_the_example_job_file_uses_only_real_keys() -> None:
    tree = yaml.safe_load((ROOT / "jobs" / "example.yaml").read_text())
    assert set(dotted(tree)) - set(FIELDS) == set()
    assert set(tree["endpoint"]["sim"]) <= set(SimConfig.__dataclass_fields__)


def test_every_simulator_setting_the_readme_names_exists() -> None:
    """The `endpoint.sim` paragraph names settings in backticks; each is a SimConfig field."""
    start = README.index("simulator settings go under `endpoint.sim`")
    paragraph = README[start:README.index("\n\n", start)]
    # `sim://`, and the request's `max_tokens` that tpm_limit charges
    named = set(re.findall(r"`([a-z_]+)(?:: \w+)?`", paragraph)) - {"sim", "max_tokens"}
    assert {"ttft_ms", "flush_ms", "ignore_stream"} <= named
    assert named <= set(SimConfig.__dataclass_fields__)


def parsers() -> dict[str, argparse.ArgumentParser]:
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    found = {name: parser for name, parser in sub.choices.items() if name != "sim"}
    return {"": top, **found, "sim": sim_parser("shardrun sim")}


def readme_commands() -> list[str]:
    """Every `shardrun ...` line of the README's bash blocks, without its comment; the ones the
    example job's comments give; and each `shardrun COMMAND ARG...` written in the docs' text
    (`RUN_ID|latest` as its first choice)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.DOTALL):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            line = line.split("&& ")[-1].removeprefix(".venv/bin/")
            if line.startswith("shardrun "):
                lines.append(line)
    example = (ROOT / "jobs" / "example.yaml").read_text()
    lines += re.findall(r"\bshardrun [^\n]+", example)
    for doc in ("README.md", "docs/ARCHITECTURE.md", "docs/METRICS.md", "runs/README.md"):
        for text in re.findall(r"`(shardrun [^`]+)`", (ROOT / doc).read_text()):
            if len(text.split()) > 2 and "--help" not in text:
                lines.append(text.replace("|latest", ""))
    return lines


@pytest.mark.parametrize("command", readme_commands())
def test_every_command_shown_parses(command: str) -> None:
    """Each command in the README is one its command's parser takes, flag by flag."""
    words = shlex.split(command.replace("<", "").replace(">", ""))[1:]
    if words[0] == "sim":
        sim_parser("shardrun sim").parse_args(words[1:])
        return
    if words[0] not in SUBCOMMANDS:
        words.insert(0, "run")
    args = build_parser().parse_args(words)
    assert args.command == words[0]


def test_readme_commands_are_found() -> None:
    """The parametrized test above would pass on no commands at all."""
    shown = readme_commands()
    assert len(shown) >= 25
    assert "shardrun --shards 8 jobs/example.yaml" in shown
    assert {line.split()[1] for line in shown} >= {"sim", "validate", "report", "export"}


def test_every_flag_in_the_docs_exists_and_every_flag_has_help() -> None:
    """A `--flag` in the user's docs is one some command takes; every flag any command takes
    is described in that command's `--help`."""
    taken = {
        option: action
        for parser in parsers().values()
        for action in parser._actions
        for option in action.option_strings
    }
    for doc in ("README.md", "docs/ARCHITECTURE.md", "docs/METRICS.md", "runs/README.md",
                "jobs/example.yaml"):
        text = (ROOT / doc).read_text()
        named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text)) - FOREIGN_FLAGS
        assert named - set(taken) == set(), doc
    undescribed = {o for o, a in taken.items() if not a.help or a.help == argparse.SUPPRESS}
    assert undescribed == set()


ARCHITECTURE = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
LINE_HEAD = ["run_id", "shard", "ev", "t"]


def documented_events() -> dict[str, list[str]]:
    """docs/ARCHITECTURE.md's tables of events (a shard's and the coordinator's): each `ev`
    and the fields it lists in order, words in parentheses (values, notes) left out; a
    shard_end's `counters` are those of `shard_config.Counters`."""
    start = ARCHITECTURE.index("\n## Event log")
    section = ARCHITECTURE[start:ARCHITECTURE.index("\nAttempt statuses:", start)]
    tables = [part.split("\n\n")[0] for part in section.split("| `ev` | extra fields | when |")[1:]]
    assert len(tables) == 2  # a shard's events, the coordinator's
    events: dict[str, list[str]] = {}
    for name, cells in re.findall(r"^\| `(\w+)` \| ([^|]*) \|", "\n".join(tables), re.M):
        while re.search(r"\([^()]*\)", cells):
            cells = re.sub(r"\([^()]*\)", "", cells)
        fields = re.findall(r"`(\w+)`", cells)
        events[name] = [f.name for f in dataclasses.fields(Counters)] if cells == "counters" \
            else fields
    return events


def test_the_event_tables_name_every_event_the_code_has() -> None:
    assert set(documented_events()) == ALL_EVENTS - LEGACY_ATTEMPT_EVENTS


Outline = dict[str, "Outline | None"]


def outline(text: str) -> Outline:
    """`{"a", "b": {"c"}, "d": [{"e"}]}`, as the docs write a line's shape: each key, and the
    keys of the object (or of each object in the list) under it."""
    tokens = re.findall(r'"\w+"|[{}\[\]:]', text)
    pos = 0

    def obj() -> Outline:
        nonlocal pos
        assert tokens[pos] == "{"
        pos += 1
        keys: Outline = {}
        while tokens[pos] != "}":
            name = tokens[pos].strip('"')
            pos += 1
            keys[name] = None
            if tokens[pos] == ":":
                pos += 1
                wrapped = tokens[pos] == "["
                pos += wrapped
                keys[name] = obj()
                pos += wrapped
        pos += 1
        return keys

    return obj()


def documented_lines() -> tuple[Outline, Outline]:
    """The shapes ARCHITECTURE gives a result line and a dead-letter line."""
    def block(after: str) -> str:
        start = ARCHITECTURE.index(after) + len(after)
        return ARCHITECTURE[start:ARCHITECTURE.index("\n\n", ARCHITECTURE.index("{", start))]

    return (outline(block("`results/shard-NN.jsonl`, one line per successful item:")),
            outline(block("`dead/shard-NN.jsonl`, one line per item that ended without a "
                          "result:")))


def in_order(record: dict[str, Any], shape: Outline) -> bool:
    """`record`'s keys are keys of `shape` in its order (some left out), and so down."""
    keys = list(record)
    if keys != [name for name in shape if name in record]:
        return False
    for name, inner in shape.items():
        values = record.get(name)
        values = values if isinstance(values, list) else [values]
        if inner is not None and not all(in_order(v, inner) for v in values if v is not None):
            return False
    return True


def test_the_line_shapes_are_read_from_the_docs() -> None:
    result, dead = documented_lines()
    assert result["usage"] is not None and "t_post" in (result["buckets"] or {})
    assert dead["attempts"] is not None and "wait" in dead["attempts"]
    assert not in_order({"output": "", "id": "x"}, result)  # a swap is seen


def test_every_line_a_run_writes_has_the_fields_the_docs_list_in_their_order(
    tmp_path: Path,
) -> None:
    """A real run with retries, dead letters and a rate limit. Each line of its event logs is
    `run_id`, `shard`, `ev`, `t`, then fields its event's row lists, in that order (one that
    applies only sometimes may be left out), and nothing else; its result and dead-letter
    lines have the shapes ARCHITECTURE gives them."""
    write_input(tmp_path / "input.jsonl", 60)
    write_job(tmp_path / "job.yaml",
              endpoint={"base_url": "sim://", "model": "m",
                        "sim": {**FAST_SIM, "fail_500": 0.5, "cached_tokens": 2,
                                "reasoning_tokens": 2, "refusal": 0.2}},
              retry={"max_attempts": 2, "backoff_s": 0.01, "backoff_max_s": 0.02},
              rate_limits={"rpm": 3000})
    proc = run_cli("job.yaml", "--runs-dir", "runs", "--quiet", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    run = only_run(tmp_path / "runs")
    result, dead = documented_lines()
    for shape, folder in ((result, "results"), (dead, "dead")):
        lines = [json.loads(line) for f in (run / folder).glob("*.jsonl")
                 for line in f.read_bytes().splitlines()]
        assert lines and all(in_order(line, shape) for line in lines), folder
    documented = documented_events()
    seen: set[str] = set()
    for log in sorted((run / "events").glob("*.jsonl")):
        for line in log.read_bytes().splitlines():
            keys = list(json.loads(line))
            ev = json.loads(line)["ev"]
            seen.add(ev)
            assert keys[:4] == LINE_HEAD, (log.name, line)
            rest = keys[4:]
            assert rest == [name for name in documented[ev] if name in rest], (log.name, line)
    assert {"retry", "rate_wait", "attempt_end", "shard_end", "run_end", "shard_exit"} <= seen


def test_the_module_table_names_every_module_and_only_real_ones() -> None:
    """ARCHITECTURE's "Modules" table: each module of the package (a subpackage by its
    folder) has a row, and each file or folder a row names exists."""
    start = ARCHITECTURE.index("\n## Modules")
    table = ARCHITECTURE[start:ARCHITECTURE.index("\n## ", start + 1)]
    named = set(re.findall(r"^\| `([^`]+)`", table, re.MULTILINE))
    named |= {name for row in re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
              for name in re.findall(r"`([\w/.]+)`", row)}
    package = ROOT / "shardrun"
    real = {p.name for p in package.glob("*.py")} - {"__init__.py", "__main__.py"}
    real |= {p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert real - named == set()
    sim = {p.name for p in (package / "sim").glob("*.py")}
    assert all((package / name).exists() or name in sim for name in named), named
    # A subpackage's modules are named in its row (`_shard.py`) or in a row of their own
    # (`aggregate/_fast.py`).
    for folder in ("aggregate", "report", "sim"):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{folder}/` |"))
        cited = set(re.findall(r"`([\w.]+\.py)`", row))
        cited |= set(re.findall(rf"`{folder}/([\w.]+\.py)`", table))
        inside = {p.name for p in (package / folder).glob("*.py")} - {"__init__.py"}
        assert inside - cited == set(), folder
        assert cited <= inside | {"__init__.py"}, folder


def test_the_job_files_the_readme_shows_load(tmp_path: Path) -> None:
    """The README's job file, and each of its other job-file pieces put in it in place of the
    sections they give, loads as a job (strict: an unknown key or a bad value is an error)."""
    blocks = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", README,
                                                            re.DOTALL)]
    job = blocks[0]
    assert {"endpoint", "input", "params", "retry"} <= set(job)
    for n, piece in enumerate(blocks):
        whole = {**job, **piece}
        (tmp_path / whole["input"]["path"]).touch()
        path = tmp_path / f"job{n}.yaml"
        path.write_text(yaml.safe_dump(whole))
        loaded = load_job(path, env={"OPENAI_API_KEY": "k"}, flags={})
        assert loaded.spec.endpoint.model == job["endpoint"]["model"]
    assert n >= 5


METRICS = (ROOT / "docs" / "METRICS.md").read_text()
DESIGN_DOCS = {"ARCHITECTURE.md": ARCHITECTURE, "METRICS.md": METRICS}


def test_every_source_file_the_design_docs_name_exists() -> None:
    """A `shardrun/x.py`, `tests/x.py` or `scripts/x.py` in ARCHITECTURE or METRICS, a
    subpackage's `report/_scan.py` and a bare `retry.py` in backticks, is a file of the
    repository (PERFORMANCE keeps the names of files it measured and removed since)."""
    everywhere = {p.name for d in ("shardrun", "tests", "scripts") for p in (ROOT / d).rglob("*")}
    gone, checked = [], 0
    for name, text in DESIGN_DOCS.items():
        for path in re.findall(r"\b((?:shardrun|tests|scripts)/[\w/]+\.(?:py|c))\b", text):
            gone += [] if (ROOT / path).exists() else [(name, path)]
            checked += 1
        for path in re.findall(r"(?<![\w/])((?:aggregate|report|sim)/\w+\.(?:py|c))\b", text):
            gone += [] if (ROOT / "shardrun" / path).exists() else [(name, path)]
            checked += 1
        for file in re.findall(r"`(\w+\.(?:py|c))`", text):
            gone += [] if file in everywhere else [(name, file)]
            checked += 1
    assert checked >= 50  # some 110 today: a pattern that stopped matching would pass on none
    assert gone == []


def emitted_events() -> set[str]:
    """The event names the package writes: the first argument of every `.emit(NAME, ...)`
    (`events.QUEUED` or `CHECKPOINT`), looked up in `event_names`, or a string given there."""
    from shardrun import event_names

    found = set()
    for source in (ROOT / "shardrun").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "emit" and node.args):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value)  # a name spelled out, not `event_names`': held to it too
                continue
            const = first.attr if isinstance(first, ast.Attribute) else getattr(first, "id", "")
            if const.isupper():  # the simulator's `emit(resp, frames, ...)` is no event
                found.add(getattr(event_names, const))
    return found


def test_every_event_the_code_writes_is_named_and_documented() -> None:
    """Each event an `emit` call writes is one of `event_names` and named in backticks in
    ARCHITECTURE or METRICS; each current name of `event_names` is one some call writes (the
    older layout's are read only)."""
    emitted = emitted_events()
    assert len(emitted) >= 15
    assert emitted == ALL_EVENTS - LEGACY_ATTEMPT_EVENTS
    both = ARCHITECTURE + METRICS
    assert {ev for ev in emitted if f"`{ev}`" not in both} == set()


def test_the_message_table_names_every_message_of_the_protocol() -> None:
    """ARCHITECTURE's table of messages between coordinator and shard: a row per message type
    `protocol` defines, and none for a type it does not."""
    from shardrun import protocol

    types = {v for k, v in vars(protocol).items() if k.isupper() and isinstance(v, str)}
    start = ARCHITECTURE.index("| direction | `t` | fields | meaning |")
    table = ARCHITECTURE[start:ARCHITECTURE.index("\n\n", start)]
    rows = set(re.findall(r"^\| (?:coord|shard) → \w+ \| `(\w+)` \|", table, re.MULTILINE))
    assert len(types) >= 10 and rows == types


def test_the_variables_the_design_docs_name_are_ours() -> None:
    """A `SHARDRUN_*` variable in ARCHITECTURE or METRICS is one the code reads (the README's
    test holds the README and `--help` to the full list)."""
    named = set(VAR.findall(ARCHITECTURE + METRICS))
    assert len(named) >= 5 and named <= our_vars()


ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.Pow: operator.pow, ast.LShift: operator.lshift}


def figure_of(node: ast.expr, known: Mapping[str, float]) -> float | None:
    """The number an expression of numbers makes (`64 * 1024`, `1 << 20`, `-1`, an earlier
    constant of its module), or None (a call, a string)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        return known.get(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = figure_of(node.operand, known)
        return None if value is None else -value
    if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        left, right = figure_of(node.left, known), figure_of(node.right, known)
        if left is not None and right is not None:
            with contextlib.suppress(TypeError, ZeroDivisionError):  # a float shifted
                result: float = ARITHMETIC[type(node.op)](left, right)
                return result
    return None


def module_constants() -> dict[str, set[float]]:
    """Each module-level `NAME = number` of the package: name -> the values it has (two
    modules may each have a `RECHECK_S`)."""
    found: dict[str, set[float]] = {}
    for source in (ROOT / "shardrun").rglob("*.py"):
        known: dict[str, float] = {}
        for node in ast.parse(source.read_text()).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name):
                values = found.setdefault(target.id, set())
                if (value := figure_of(node.value, known)) is not None:
                    known[target.id] = value
                    values.add(value)
    return found


# A figure's unit as the docs write it, as a factor to the code's (seconds, bytes): exact, so
# that "9 ms" reads as the code's 0.009 (9 * 0.001 is 0.009000000000000001).
UNITS = {"": Fraction(1), "s": Fraction(1), "ms": Fraction(1, 1000), "KiB": Fraction(1 << 10),
         "MiB": Fraction(1 << 20), "GiB": Fraction(1 << 30)}


def figures_given(text: str) -> list[tuple[str, float]]:
    """Constants the text gives with their value: "`SETTLE_LINES` (50,000)", "`LOOKAHEAD_MAX`,
    4,096", "every 0.75 s (`LIST_PROBE_S`)", "16 MiB (`_UNENDED_MAX`)"."""
    flat = " ".join(text.split())
    figure, unit, name = r"(\d[\d,.]*\d|\d)", r"(?: (ms|s|[KMG]iB)\b)?", r"`(_?[A-Z][A-Z0-9_]+)`"
    after = re.findall(rf"{name}(?:,| \()\s?{figure}{unit}", flat)
    before = [(n, f, u) for f, u, n in re.findall(rf"{figure}{unit} \({name}", flat)]
    return [(n, float(Fraction(f.replace(",", "")) * UNITS[u])) for n, f, u in after + before]


def test_figures_are_read_in_the_code_s_units() -> None:
    """A size in MiB and a time in ms are compared in bytes and seconds; "429s" is no figure."""
    text = ("`LINE_MAX` (64 MiB), `SWEEP_S` (100 ms), `TICK_S` (9 ms), every 2 s (`KILL_S`), "
            "its 429s (`SHARE`)")
    assert figures_given(text) == [("LINE_MAX", 64 << 20), ("SWEEP_S", 0.1), ("TICK_S", 0.009),
                                   ("KILL_S", 2)]
    known = {"BASE": 1024}
    assert figure_of(ast.parse("BASE * 64 << 2", mode="eval").body, known) == 1 << 18
    assert figure_of(ast.parse("1.0 << 2", mode="eval").body, known) is None


def test_the_constants_the_design_docs_quote_have_those_values() -> None:
    """A constant the docs give with its figure exists and has that figure in the code."""
    constants = module_constants()
    given = [pair for text in DESIGN_DOCS.values() for pair in figures_given(text)]
    assert len(given) >= 12
    assert [(name, figure) for name, figure in given
            if figure not in constants.get(name, set())] == []


def section_names(text: str) -> list[str]:
    """What a reference may point at: headings, bold and italic leads, a paragraph's lead
    ("Pull-based hand-out: ...")."""
    return [name.strip() for name in
            re.findall(r"^#+ (.+)$", text, re.M) + re.findall(r"\*\*([^*]+?)\.?\*\*", text)
            + re.findall(r"(?<!\*)\*([^*\n]+)\*(?!\*)", text)
            + re.findall(r"^([A-Z][^:\n]{2,60}):", text, re.M)]


def test_every_section_a_doc_points_to_is_there() -> None:
    """`ARCHITECTURE.md, "Event log"` and the like, in any of the docs, name a section of that
    page (a heading or a lead it starts with), not one renamed or gone."""
    pages = {name: (ROOT / "docs" / name).read_text()
             for name in ("ARCHITECTURE.md", "METRICS.md", "PERFORMANCE.md")}
    pages["README.md"] = README
    refs = [(name, page, section) for name, text in pages.items()
            for page, section in re.findall(r"\b(ARCHITECTURE\.md|METRICS\.md|PERFORMANCE\.md"
                                            r"|README\.md)\)?,? \"([^\"]+)\"",
                                            " ".join(text.split()))]
    assert len(refs) >= 10
    assert [ref for ref in refs
            if not any(s.startswith(ref[2]) for s in section_names(pages[ref[1]]))] == []


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(number, line) of each line of prose: not in a fenced block, nor in an indented one (a
    block begun by a line of four spaces after a blank line), nor a table row."""
    fenced = indented = False
    blank = True
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced, blank = not fenced, False
            continue
        if fenced:
            continue
        if not line.strip():
            blank = True
            continue
        code = line.startswith("    ")
        indented = code if blank else indented and code
        blank = False
        if not indented and not line.lstrip().startswith("|"):
            yield number, line
    # A fence left open would make the rest of the file code, exempt from the line test.
    assert not fenced, "a ``` fence that never closes"


def test_prose_lines_are_told_from_code_and_tables() -> None:
    text = ("para\n    list continuation\n\n    code, however long\n    more code\n\n"
            "```\nfenced\n```\n| row |\n- item\n  more")
    assert [n for n, _ in prose_lines(text)] == [1, 2, 11, 12]
    with pytest.raises(AssertionError, match="never closes"):
        list(prose_lines("para\n```\ncode"))


@pytest.mark.parametrize("doc", ["README.md", "docs/ARCHITECTURE.md", "docs/METRICS.md",
                                 "docs/PERFORMANCE.md"])
def test_the_prose_keeps_to_100_characters_a_line(doc: str) -> None:
    """Lines of prose past 100 characters (about 25 had grown so in the README, 31 in
    ARCHITECTURE, 7 in METRICS and 14 in PERFORMANCE) read badly in a terminal and in a diff;
    a code block or a table row, which cannot wrap, may be longer."""
    lines = list(prose_lines((ROOT / doc).read_text()))
    assert len(lines) >= 200  # 380 to 1,370 today: none found would pass vacuously
    long = [number for number, line in lines if len(line) > 100]
    assert not long, f"{doc} lines over 100 characters: {long}"

"""Soak "lose nothing": random signals at random moments, then --resume until the run ends.

    .venv/bin/python scripts/soak_resume.py                     # 12 trials, 3,000 items each
    .venv/bin/python scripts/soak_resume.py --trials 40 --jobs 4 --seed 7
    .venv/bin/python scripts/soak_resume.py --seed 7 --only 13  # one trial again, as it ran
    .venv/bin/python scripts/soak_resume.py --spawn             # shards as fresh interpreters
    .venv/bin/python scripts/soak_resume.py --retry-failed      # then retry-failed, stopped too
    .venv/bin/python scripts/soak_resume.py --mix               # passes of every kind, mixed

Each trial runs in its own temporary directory, on the embedded simulator (`sim://`) with a few
of its faults drawn at random (429s, 500s, 503s, resets, cut streams), and with a seeded job of
`--items` prompts on 2 to 4 shards. Its first pass, and at random some of the resumes after it,
get a signal (SIGKILL, SIGTERM or SIGINT, now and then a second one) at a random moment, sent
to a random target: the coordinator, one shard, the shard launcher, the simulator, or the
coordinator's whole process group (as a terminal or `timeout` sends it). Then `--resume latest`
(at a random shard count) until every input item has ended, at most `MAX_PASSES` passes. At the
end it checks the run (`check_run`):

- exactly one result or dead-letter line per input id, over every results and dead file (no
  id in both, none missing, none not in the input);
- every line of every event, result and dead-letter file parses;
- `shardrun verify RUN` exits 0, `shardrun report RUN` exits 0, and `report --json` counts
  the succeeded and dead-lettered items the files hold;
- the summary each pass recorded in the manifest counts the result and dead-letter lines of
  its own segment (a pass killed with the coordinator recorded none);
- the last pass exits 0 when the run has no dead letter, else 1, and the manifest agrees;
- no pass printed a Traceback, no shard log holds one, no pass hung, and no process a pass
  started outlived it (after a kill -9 of the coordinator, its shards and simulator get
  `ORPHAN_WAIT_S` to exit).

With `--mix`, the first pass is followed by six passes drawn at random, each signalled half
the time: `--resume` (with `--limit`, `--retry-failed`, or both), `retry-failed`, a resume
under a file-size limit after input lines were appended (a full disk mid-pass; a first pass
meets one too, now and then), two passes started at once (one waits for the run's lock), or
input lines appended; after a kill -9 of a coordinator the next pass starts at once, half the
time, while its shards still finish (they must exit all the same). Then `--resume latest`
until every item has a line. After a full disk, `report`, which counts events, counts fewer
items than the files hold (the event log, written first and the largest file, met the limit
before the results did) and the rest apart (`items.not_in_log`): together exactly theirs.

A trial is a pure function of `--seed` and its number (which fault, signal, target, moment,
shard counts), so a failing one can be run again alone with `--only`; the moment is a time
after the pass started, so on a loaded machine it falls on other work than on an idle one.
It prints a table of trials and outcomes on stdout (progress on stderr) and exits 1 when any
trial found a problem. Only loopback traffic; every wait is bounded; every process this script
ends is one it started, or a descendant of one, by PID. It is no test: run it while the
machine is busy, that is where the races are.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fault_table as ft  # the fault table's helpers: snapshot, reading lines, killing

PASS_TIMEOUT_S = 180.0  # a hang guard per pass, never a timing assertion
ORPHAN_WAIT_S = 60.0  # how long what a killed pass started may take to exit by itself
MAX_PASSES = 8
# Items a trial's first pass ends per second, about (2-4 shards of 16 against the simulator's
# fast settings and its faults' retries, seen here): it bounds when a pass's signal is sent.
PASS_ITEMS_PER_S = 400
SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
TARGETS = ("coordinator", "shard", "launcher", "simulator", "group")
SIM = {"ttft_ms": 40, "itl_ms": 1.5, "tokens": "uniform:4:24", "flush_ms": 5}
FAULTS: dict[str, dict[str, Any]] = {
    "429": {"fail_429": 0.03, "retry_after_s": 0.05},
    "500": {"fail_500": 0.03},
    "503": {"fail_503": 0.03},
    "reset": {"reset_before_headers": 0.03},
    "cut": {"drop_mid_stream": 0.03},
    "reset-after": {"reset_after_headers": 0.02},
    "500-heavy": {"fail_500": 0.15},  # some items fail all 3 attempts: dead letters
}
# --mix: the kinds of pass drawn after a run's first pass has ended, each signalled at random.
MIX = ("resume", "resume-limit", "resume-retry", "resume-retry-limit", "retry", "disk",
       "race", "grow")
MIX_PASSES = 6
RETRY = {"max_attempts": 3, "backoff_s": 0.01, "backoff_max_s": 0.05,
         "budget_ratio": 1.0, "budget_floor": 50}  # fmt: skip


# -- checking a run's files ---------------------------------------------------------------------


def _lines(path: Path, problems: list[str], where: str) -> list[dict[str, Any]]:
    rows, bad = ft.read_lines(path)
    if bad:
        problems.append(f"{bad} unparsable line(s) in {where}/{path.name}")
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        problems.append(f"{where}/{path.name} ends in a torn line")
    return rows


def _count_lines(paths: list[Path]) -> int:
    return sum(len(ft.read_lines(p)[0]) for p in paths)


def check_files(run: Path, ids: list[str]) -> tuple[list[str], int, int]:
    """Problems with a finished run's files against its input ids; its result and dead counts.

    Pure over the files: exactly one line per id over results/ and the live dead/ files, every
    line of every event, result and dead-letter file parses, and the summary each pass
    recorded in the manifest counts the lines of its own segment.
    """
    problems: list[str] = []
    seen: Counter[str] = Counter()
    ok_ids: set[str] = set()
    dead_ids: set[str] = set()
    for sub, into in (("results", ok_ids), ("dead", dead_ids)):
        for path in sorted((run / sub).glob("*.jsonl")):
            for row in _lines(path, problems, sub):
                item = str(row.get("id"))
                seen[item] += 1
                into.add(item)
    for path in sorted((run / "events").glob("*.jsonl")):
        _lines(path, problems, "events")
    inputs = set(ids)
    twice = sorted(i for i, c in seen.items() if c > 1)
    if twice:
        problems.append(f"{len(twice)} id(s) with more than one line, e.g. {twice[:3]}")
    both = sorted(ok_ids & dead_ids)
    if both:
        problems.append(f"{len(both)} id(s) both in results and dead letters, e.g. {both[:3]}")
    missing = sorted(inputs - set(seen))
    if missing:
        problems.append(f"{len(missing)} input id(s) with no line, e.g. {missing[:3]}")
    strangers = sorted(set(seen) - inputs)
    if strangers:
        problems.append(f"{len(strangers)} id(s) not in the input, e.g. {strangers[:3]}")
    n_ok = _count_lines(sorted((run / "results").glob("*.jsonl")))
    n_dead = _count_lines(sorted((run / "dead").glob("*.jsonl")))
    problems += _check_pass_summaries(run)
    return problems, n_ok, n_dead


def _check_pass_summaries(run: Path) -> list[str]:
    try:
        manifest = orjson.loads((run / "manifest.json").read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        return [f"manifest.json unreadable: {exc}"]
    passes = [(0, manifest.get("summary"))]
    passes += [(int(r.get("segment", k + 1)), r.get("summary"))
               for k, r in enumerate(manifest.get("resumes") or [])]  # fmt: skip
    problems = []
    for segment, summary in passes:
        if not summary:
            continue  # a pass killed with its coordinator records none
        suffix = "" if segment == 0 else rf"\.r{segment}"
        pattern = re.compile(rf"shard-\d+{suffix}\.jsonl")
        for key, sub in (("succeeded", "results"), ("dead", "dead")):
            # retry-failed moves the dead letters it retries to dead/superseded-rK/
            files = [p for p in (run / sub).rglob("*.jsonl") if pattern.fullmatch(p.name)]
            on_disk = _count_lines(files)
            if summary.get(key) != on_disk:
                problems.append(f"pass {segment}'s summary says {key} {summary.get(key)}, "
                                f"its {sub} files hold {on_disk} line(s)")  # fmt: skip
    return problems


def check_run(run: Path, ids: list[str], last_code: int | str, *,
              disk: bool = False) -> list[str]:
    """check_files, plus what the CLI says of the run: verify, report, the last exit status.
    `disk`: a pass met a full disk, whose event log (written first, and the largest file) may
    lack the events of lines written after it: `report` counts those apart (`not_in_log`), so
    its counts and those add up to the files' exactly."""
    problems, n_ok, n_dead = check_files(run, ids)
    verify = _cli("verify", str(run), cwd=run.parent.parent)
    if verify.returncode != 0:
        problems.append(f"verify exited {verify.returncode}: "
                        f"{(verify.stdout + verify.stderr).strip()[-300:]}")  # fmt: skip
    report = _cli("report", str(run), cwd=run.parent.parent)
    if report.returncode != 0:
        problems.append(f"report exited {report.returncode}: {report.stderr.strip()[-300:]}")
    as_json = _cli("report", "--json", str(run), cwd=run.parent.parent)
    for out in (verify, report, as_json):
        if "Traceback" in out.stdout + out.stderr:
            problems.append(f"Traceback from {out.args[3:]}: {out.stderr[-300:]}")
    try:
        doc = orjson.loads(as_json.stdout)["items"]
        items = doc.get("by_item") or doc  # spans are not items after retry-failed
        # Lines a full disk kept out of a log are counted apart; by_item's dead are the files'.
        beyond = doc.get("not_in_log") or {"succeeded": 0, "dead": 0}
        ok = items["succeeded"] + beyond["succeeded"]
        dead = items["dead"] + (0 if "by_item" in doc else beyond["dead"])
        if (ok, dead) != (n_ok, n_dead):
            problems.append(f"report counts {items['succeeded']} succeeded, {items['dead']} "
                            f"dead ({beyond['succeeded']} and {beyond['dead']} more beyond "
                            f"the logs); the files hold {n_ok} and {n_dead}")  # fmt: skip
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        problems.append(f"report --json unreadable: {exc}")
    want = 1 if n_dead else 0
    if last_code != want:
        problems.append(f"the last pass exited {last_code}, expected {want} "
                        f"({n_dead} dead letter(s))")  # fmt: skip
    status = orjson.loads((run / "manifest.json").read_bytes()).get("status")
    if status != ("failed" if n_dead else "succeeded"):
        problems.append(f"manifest status {status!r} with {n_dead} dead letter(s)")
    for log_file in sorted((run / "logs").glob("*.log")):
        if b"Traceback" in log_file.read_bytes():
            problems.append(f"a Traceback in logs/{log_file.name}")
    return problems


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ft.PY, "-m", "shardrun", *args], cwd=cwd, env=ft.ENV,
                          capture_output=True, text=True, timeout=PASS_TIMEOUT_S)  # fmt: skip


# -- one trial ----------------------------------------------------------------------------------


@dataclass
class Trial:
    number: int
    seed: int
    dir: Path
    items: int
    rng: random.Random = field(init=False)
    ids: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)  # per pass: what was sent, and the exit
    problems: list[str] = field(default_factory=list)
    last_code: int | str = "?"
    n_ok: int = 0
    n_dead: int = 0
    spawn: bool = False
    retry: bool = False  # a run that ends with dead letters then gets `retry-failed` passes
    mix: bool = False  # passes of every kind in a random order after the first (`mixed`)
    disk: bool = False  # a pass met a file-size limit: its event log may lack lines it wrote
    # Processes of killed passes not waited for: the next pass starts while they finish (it
    # waits for the run's lock); they must still exit, checked at the trial's end.
    orphans: list[psutil.Process] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed * 100_003 + self.number)

    def write(self) -> None:
        self.dir.mkdir(parents=True)
        self.ids = [f"t{self.number}-{i:06d}" for i in range(self.items)]
        with open(self.dir / "input.jsonl", "wb") as f:
            for i, item_id in enumerate(self.ids):
                f.write(orjson.dumps({"id": item_id, "prompt": f"Question {i}: say something."}))
                f.write(b"\n")
        self.faults = sorted(self.rng.sample(sorted(FAULTS), self.rng.randint(0, 3)))
        if (self.retry or self.mix) and "500-heavy" not in self.faults:  # dead letters to retry
            self.faults.append("500-heavy")
        sim: dict[str, Any] = {**SIM, "seed": self.rng.randint(1, 10_000)}
        for name in self.faults:
            sim.update(FAULTS[name])
        spec = {"endpoint": {"base_url": "sim://", "api": "chat", "model": "m", "sim": sim},
                "input": {"path": "input.jsonl"}, "params": {"max_tokens": 32},
                "shards": self.rng.randint(2, 4), "concurrency": 16, "retry": RETRY,
                "shutdown_grace_s": self.rng.choice([0.5, 1, 2])}  # fmt: skip
        if self.spawn:  # shards as fresh interpreters: slower to start, other moments hit
            spec["shard_start"] = "spawn"
        (self.dir / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))

    def run(self) -> None:
        self.write()
        if self.mix:
            try:
                self.mixed()
            finally:  # also after a hung pass or an error: none may outlive the trial
                self.problems += self.outlived(self.orphans)
            return
        for k in range(MAX_PASSES):
            # A stop before the manifest is written leaves no run (at most a directory without
            # a manifest, after a kill -9): the job starts again, as its user would start it.
            shards = str(self.rng.randint(1, 4))
            args = [] if self.run_dir() is None else ["--resume", "latest", "--shards", shards]
            signalled = k == 0 or (k < MAX_PASSES - 2 and self.rng.random() < 0.35)
            code = self.one_pass(k, ["job.yaml", "--runs-dir", "runs", *args], signalled,
                                 latest=self.pass_s())
            self.last_code = code
            done = self.finished()
            if code == 0 and not done:  # exit 0 says every item succeeded
                self.problems.append(f"pass {k} exited 0 with input items left without a line")
            if code == "hung" or done:
                break
        else:
            self.problems.append(f"not finished after {MAX_PASSES} passes")
        if (run := self.ended_run()) is None:
            return
        if self.retry and self.last_code == 1 and not self.problems:
            self.retry_failed(run)
        self.problems += check_run(run, self.ids, self.last_code)
        _, self.n_ok, self.n_dead = check_files(run, self.ids)

    def mixed(self) -> None:
        """A first pass signalled as in `run`, then `MIX_PASSES` passes drawn from `MIX`, each
        signalled at random: `--resume` (with `--limit` at times, or `--retry-failed`),
        `retry-failed`, a resume under a file-size limit (a full disk), two passes started at
        once (the second waits for the run's lock), or input lines appended between passes.
        Then `--resume latest` unsignalled until every input item has a line."""
        full = self.rng.random() < 0.25  # a first pass that meets a full disk
        self.one_pass(0, ["job.yaml", "--runs-dir", "runs"], True, latest=self.pass_s(),
                      fsize=self.rng.randint(6_000, 80_000) if full else None)
        self.plan[-1] = f"{'disk ' if full else ''}{self.plan[-1]}"
        self.disk = full
        resume = ["job.yaml", "--runs-dir", "runs", "--resume", "latest"]
        for k in range(1, 1 + MIX_PASSES):
            run = self.run_dir()
            kind = self.rng.choice(MIX) if run is not None else "first"
            shards = ["--shards", str(self.rng.randint(1, 4))]
            retry = ["retry-failed", str(run.relative_to(self.dir))] if run else []
            argv = {"first": ["job.yaml", "--runs-dir", "runs"],
                    "resume-limit": [*resume, "--limit", str(self.rng.randint(1, self.items))],
                    "resume-retry": [*resume, "--retry-failed"], "retry": retry,
                    "resume-retry-limit": [*resume, "--retry-failed", "--limit",
                                           str(self.rng.randint(1, 20))],
                    }.get(kind, resume) + shards
            signalled = self.rng.random() < 0.5
            fsize = None
            if kind == "grow":
                self.grow(self.rng.randint(1, self.items // 4))
            elif kind == "disk":  # room for the manifest, and up to a few hundred lines a file
                self.grow(self.rng.randint(1, self.items // 2))  # work to fill the disk with
                fsize = (run / "manifest.json").stat().st_size + self.rng.randint(2_000, 60_000)
            elif kind == "race":
                other = self.rng.choice([resume, retry])
                racer = threading.Thread(target=self.one_pass, args=(100 + k, other, False))
                racer.start()
            code = self.one_pass(k, argv, signalled, latest=2.0, fsize=fsize)
            if kind == "race":
                racer.join()
            self.disk = self.disk or fsize is not None
            self.plan[-1] = f"{kind} {self.plan[-1]}"
            self.last_code = code
            if code == "hung":
                return
        for k in range(1 + MIX_PASSES, 1 + MIX_PASSES + MAX_PASSES):
            self.last_code = self.one_pass(k, resume, False)
            self.plan[-1] = f"end {self.plan[-1]}"
            if self.last_code == "hung" or self.finished():
                break
        else:
            self.problems.append(f"not finished after {MAX_PASSES} passes at the end")
        if (run := self.ended_run()) is None:
            return
        self.problems += check_run(run, self.ids, self.last_code, disk=self.disk)
        _, self.n_ok, self.n_dead = check_files(run, self.ids)

    def ended_run(self) -> Path | None:
        """The run directory to check at the trial's end; none is a problem."""
        run = self.run_dir()
        if run is None:
            self.problems.append("no run directory")
        return run

    def grow(self, n: int) -> None:
        """Append `n` input lines of new ids (items no pass has run)."""
        start = len(self.ids)
        new = [f"t{self.number}-{i:06d}" for i in range(start, start + n)]
        with open(self.dir / "input.jsonl", "ab") as f:
            for i, item_id in enumerate(new, start):
                f.write(orjson.dumps({"id": item_id, "prompt": f"Question {i}: say more."}))
                f.write(b"\n")
        self.ids += new

    def pass_s(self) -> float:
        """About how long a first pass of this trial's items runs: a signal is sent at a
        moment drawn up to it. Drawn up to 8 s whatever the items, most signals to passes of
        800-2,000 items came after the pass had ended, and tested nothing."""
        return min(8.0, max(1.0, self.items / PASS_ITEMS_PER_S))

    def retry_failed(self, run: Path) -> None:
        """`retry-failed` of the dead letters, its first pass stopped as a run's is, until a
        pass ends with every item's line in the live files (a killed retry pass leaves those
        it set aside and did not reach for the next pass to put back)."""
        first = len(self.plan)
        for k in range(first, first + MAX_PASSES):
            shards = str(self.rng.randint(1, 4))
            argv = ["retry-failed", str(run.relative_to(self.dir)), "--shards", shards]
            code = self.one_pass(k, argv, signalled=k == first, latest=2.0)  # a short pass
            self.last_code = code
            self.plan[-1] = "retry " + self.plan[-1]
            if code == "hung" or (code in (0, 1) and self.finished()):
                return
        self.problems.append(f"retry-failed not finished after {MAX_PASSES} passes")

    def run_dir(self) -> Path | None:
        """The run directory (one with a manifest: a kill -9 before it leaves one without)."""
        dirs = [p for p in (self.dir / "runs").glob("*") if (p / "manifest.json").exists()]
        if len(dirs) > 1:
            self.problems.append(f"{len(dirs)} run directories")
        return dirs[0] if dirs else None

    def finished(self) -> bool:
        """Every input id has a line, and the last pass ended the run."""
        run = self.run_dir()
        if run is None or self.last_code not in (0, 1):
            return False
        seen: set[str] = set()
        for path in [*(run / "results").glob("*.jsonl"), *(run / "dead").glob("*.jsonl")]:
            seen.update(str(r.get("id")) for r in ft.read_lines(path)[0])
        return seen >= set(self.ids)

    def one_pass(self, k: int, argv: list[str], signalled: bool, latest: float = 8.0,
                 fsize: int | None = None) -> int | str:
        out = open(self.dir / f"pass{k}.out", "wb")  # noqa: SIM115 -- closed below
        err = open(self.dir / f"pass{k}.err", "wb")  # noqa: SIM115
        proc = subprocess.Popen([ft.PY, "-m", "shardrun", *argv], cwd=self.dir, env=ft.ENV,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True, preexec_fn=_file_size(fsize))
        seen: dict[int, psutil.Process] = {}
        note = "-"
        try:
            if signalled:
                note = self.send(proc, seen, latest)
            code = self.wait(proc, seen)
        finally:
            out.close()
            err.close()
        self.plan.append(f"{note}→{code}")
        text = ((self.dir / f"pass{k}.out").read_text(errors="replace")
                + (self.dir / f"pass{k}.err").read_text(errors="replace"))  # fmt: skip
        if "Traceback" in text:
            tail = text[text.find("Traceback"):].strip().splitlines()[-1][:200]
            self.problems.append(f"pass {k} printed a Traceback: {tail}")
        allowed = {0, 1, 130, -signal.SIGKILL, "hung"}
        if code not in allowed:
            self.problems.append(f"pass {k} exited {code}: {text.strip()[-300:]}")
        run = self.run_dir()
        if run is not None and code not in (0, 1, "hung"):
            report = _cli("report", str(run), cwd=self.dir)
            if "Traceback" in report.stdout + report.stderr or report.returncode not in (0, 1):
                self.problems.append(f"report after pass {k} exited {report.returncode}: "
                                     f"{report.stderr.strip()[-300:]}")  # fmt: skip
        return code

    def _watch(self, proc: subprocess.Popen[bytes], seen: dict[int, psutil.Process]) -> None:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p)

    def send(self, proc: subprocess.Popen[bytes], seen: dict[int, psutil.Process],
             latest: float) -> str:  # fmt: skip
        sig = self.rng.choice(SIGNALS)
        target = self.rng.choice(TARGETS)
        at = self.rng.uniform(0.05, latest)
        twice = sig != signal.SIGKILL and self.rng.random() < 0.3
        deadline = time.monotonic() + at
        while time.monotonic() < deadline and proc.poll() is None:
            self._watch(proc, seen)
            time.sleep(0.02)
        if proc.poll() is not None:
            return f"late {sig.name[3:]} {target}@{at:.1f}"
        self._watch(proc, seen)
        pid = self.target_pid(proc, target)
        label = f"{sig.name[3:]}{'×2' if twice else ''} {target}@{at:.1f}"
        if pid is None:
            label = f"{sig.name[3:]}{'×2' if twice else ''} coordinator({target} absent)@{at:.1f}"
            pid = proc.pid
        for n in range(2 if twice else 1):
            if n:
                time.sleep(self.rng.uniform(0.0, 0.5))
            with contextlib.suppress(ProcessLookupError):
                if target == "group" and pid == proc.pid:
                    os.killpg(proc.pid, sig)
                else:
                    os.kill(pid, sig)
        return label

    def target_pid(self, proc: subprocess.Popen[bytes], target: str) -> int | None:
        if target in ("coordinator", "group"):
            return proc.pid
        try:
            kids = psutil.Process(proc.pid).children()
        except psutil.Error:
            return None
        for p in kids:
            with contextlib.suppress(psutil.Error):
                line = " ".join(p.cmdline())
                if target == "simulator" and "shardrun.sim" in line:
                    return int(p.pid)
                if target == "launcher" and "launcher" in line:
                    return int(p.pid)
        if target == "shard":
            shards = ft.shard_pids(proc.pid)
            return self.rng.choice(shards) if shards else None
        return None

    def wait(self, proc: subprocess.Popen[bytes], seen: dict[int, psutil.Process]) -> int | str:
        deadline = time.monotonic() + PASS_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            self._watch(proc, seen)
            time.sleep(0.05)
        if proc.poll() is None:
            ft.kill_tree(proc.pid)
            proc.wait(10)
            self.problems.append(f"a pass hung (> {PASS_TIMEOUT_S:.0f} s), killed")
            code: int | str = "hung"
        else:
            code = proc.returncode
        if self.mix and code == -signal.SIGKILL and self.rng.random() < 0.5:
            self.orphans += seen.values()  # the next pass starts while they finish
            return code
        self.problems += self.outlived(list(seen.values()))
        return code

    @staticmethod
    def outlived(procs: list[psutil.Process]) -> list[str]:
        """Those of `procs` still alive after `ORPHAN_WAIT_S`, killed, as a problem."""
        alive = ft.wait_exit(procs, ORPHAN_WAIT_S)
        if not alive:
            return []
        names = []
        for p in alive:
            with contextlib.suppress(psutil.Error):
                names.append(" ".join(p.cmdline())[:60])
                p.kill()
        return [f"processes outlived their pass by {ORPHAN_WAIT_S:.0f} s: {names}"]


def _file_size(limit: int | None) -> Callable[[], None] | None:
    """A pass's file-size limit: writes past it fail (EFBIG), as a full disk's do (ENOSPC)."""
    if limit is None:
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def late_share(trials: list[Trial]) -> str:
    """How many of the signals sent came after their pass had ended (they tested nothing)."""
    notes = [note for t in trials for note in t.plan if not note.startswith(("-", "retry -"))]
    late = sum("late " in note for note in notes)
    return f"{late} of {len(notes)} signal(s) came after their pass had ended"


def run_trial(number: int, seed: int, items: int, work: Path, spawn: bool,
              retry: bool, mix: bool) -> Trial:  # fmt: skip
    trial = Trial(number, seed, work / f"t{number:03d}", items, spawn=spawn, retry=retry,
                  mix=mix)
    try:
        trial.run()
    except Exception as exc:  # a broken trial is a row with its error, not a crash of the table
        trial.problems.append(f"soak error: {type(exc).__name__}: {exc}")
    return trial


def table(trials: list[Trial]) -> str:
    out = ["| trial | faults | passes: signal target@s → exit | ok | dead | outcome |",
           "| ---: | --- | --- | ---: | ---: | --- |"]
    for t in trials:
        outcome = "ok" if not t.problems else "; ".join(t.problems)[:400]
        out.append(f"| {t.number} | {','.join(t.faults) or '-'} | {' ; '.join(t.plan)} | "
                   f"{t.n_ok:,} | {t.n_dead:,} | {outcome} |")  # fmt: skip
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=12, help="how many trials (default 12)")
    ap.add_argument("--items", type=int, default=3000, help="items per trial (default 3000)")
    ap.add_argument("--seed", type=int, default=1, help="seed of every random choice")
    ap.add_argument("--jobs", type=int, default=2, help="trials at once (default 2)")
    ap.add_argument("--only", type=int, action="append", help="run this trial number alone")
    ap.add_argument("--spawn", action="store_true",
                    help="start shards as fresh interpreters (shard_start: spawn)")
    ap.add_argument("--retry-failed", action="store_true",
                    help="a run that ends with dead letters gets retry-failed passes, the "
                         "first stopped too")  # fmt: skip
    ap.add_argument("--mix", action="store_true",
                    help="after the first pass, resumes, retries, --limit passes, full disks, "
                         "racing passes and appended input in a random order")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    if not 1 <= args.trials <= 1000 or not 1 <= args.items <= 1_000_000:
        ap.error("--trials must be 1..1000 and --items 1..1,000,000")
    if not 1 <= args.jobs <= 16:
        ap.error("--jobs must be 1..16")
    numbers = args.only or list(range(args.trials))
    work = Path(tempfile.mkdtemp(prefix="shardrun-soak-"))
    ft.log(f"# code under test: {ft.snapshot(work)}")
    ft.log(f"# soak: {len(numbers)} trial(s) × {args.items:,} items, seed {args.seed}, "
           f"{args.jobs} at once, load {os.getloadavg()[0]:.2f}; work dir {work}")
    trials: list[Trial] = []
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_trial, n, args.seed, args.items, work, args.spawn,
                                   args.retry_failed, args.mix) for n in numbers]  # fmt: skip
            for fut in futures:
                t = fut.result()
                trials.append(t)
                ft.log(f"  trial {t.number:3}: {' ; '.join(t.plan)}  ok {t.n_ok} dead "
                       f"{t.n_dead}  {'ok' if not t.problems else 'PROBLEMS'}")  # fmt: skip
                for p in t.problems:
                    ft.log(f"      - {p}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(trials))
    print(f"\n{late_share(trials)}")
    bad = [t.number for t in trials if t.problems]
    if bad:
        print(f"\n{len(bad)} trial(s) with problems (seed {args.seed}): {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fault table: every fault scenario end to end through the real CLI, checked for exactly-once.

    .venv/bin/python scripts/fault_table.py               # all scenarios, 2,000 items each
    .venv/bin/python scripts/fault_table.py --quick       # 300 items each
    .venv/bin/python scripts/fault_table.py --items 5000 --only "baseline,kill -9"

Each scenario runs in its own temporary directory: it writes N prompts, a job file, and runs
`python -m shardrun job.yaml --runs-dir runs` as a process (one or more passes: a kill, an
interrupt, a full disk or a refused key, then `--resume latest`). At the END of all its passes
it reads every result and dead-letter segment (`results/shard-NN[.rK].jsonl`,
`dead/shard-NN[.rK].jsonl`) and compares the multiset of ids with the input ids:

    duplicated = lines beyond the first for an id (plus lines for ids not in the input)
    lost       = input ids with no line at all

and counts `attempt_end` and `retry` events over every `events/*.jsonl`. It prints a markdown
table on stdout (progress and notes on stderr, the notes also under the table) and exits 1 when
any scenario has duplicated > 0 or lost > 0 (or a pass hung), else 0.

Extra checks, reported as notes (they do not change the exit status, they point at bugs):
no `Traceback` in any pass's stderr, every line in results/dead parses, the manifest's final
status, no process left running after a scenario, for single-pass scenarios with an external
simulator: injected faults (`/sim/stats`) equal the failed attempts of the matching status,
the simulator's request count equals the attempts in the log plus their requests sent again
(`resent`, counted with the conn_reset attempts against the injected resets), and retries
equal failed attempts minus dead letters; for the endpoint failing everything: its request
count and the dead letters after its pass (the items are held, not dead-lettered); each pass's
printed "succeeded"/"failed" against the result/dead lines of its own segment; a last pass
exiting 0 while the run holds dead letters (from any segment); no empty
coordinator event log; and `rate_wait` events (no job here sets a rate limit, so any are pauses
the server's rate-limit headers asked for).

The code under test is a snapshot: `shardrun/` is copied to the work directory at start and
the CLI runs with PYTHONPATH pointing at the copy, so concurrent edits of the tree do not mix
versions between scenarios. Only loopback traffic; every wait is bounded in time; every process
this script ends is one it started (or a descendant of one), by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
ENV: dict[str, str] = {k: v for k, v in os.environ.items() if not k.upper().startswith("SHARDRUN_")}
PASS_TIMEOUT_S = 240.0  # a hang guard per CLI pass, never a timing assertion
ORPHAN_WAIT_S = 60.0  # how long the shards of a killed coordinator may take to exit
SIM_BASE = {"ttft_ms": 30, "itl_ms": 1.5, "tokens": "uniform:4:24", "seed": 3, "flush_ms": 5}
SIM_SLOW = {**SIM_BASE, "itl_ms": 2}  # the kill / interrupt scenarios: a little more runway
RETRY_FAST = {"max_attempts": 6, "backoff_s": 0.01, "backoff_max_s": 0.05,
              "budget_ratio": 1.0, "budget_floor": 50}  # fmt: skip
# Bytes per input item a file may reach in the disk-full scenario (200 KB at 2,000 items):
# writes past it fail with EFBIG, as a full disk fails with ENOSPC. Scaled with the items so
# the limit is reached whatever --items is (a shard's event log is about 600 B per item).
FSIZE_PER_ITEM = 100

# (scenario, simulator faults, attempt status the fault shows as, job timeouts)
FAULT_CLASSES: list[tuple[str, dict[str, Any], tuple[str, ...], dict[str, float]]] = [
    ("fail_429", {"fail_429": 0.15, "retry_after_s": 0.05}, ("http_429",), {}),
    ("fail_500", {"fail_500": 0.15}, ("http_5xx",), {}),
    ("fail_503", {"fail_503": 0.15}, ("http_5xx",), {}),
    ("reset_before_headers", {"reset_before_headers": 0.15}, ("conn_reset",), {}),
    # a drop mid-stream may surface as a reset or as a stream that ended before [DONE]
    ("drop_mid_stream", {"drop_mid_stream": 0.15}, ("conn_reset", "protocol_error"), {}),
    ("stall_mid_stream", {"stall_mid_stream": 0.1, "stall_s": 3}, ("timeout_idle",),
     {"idle_s": 0.3}),
    ("slow_first_token", {"slow_first_token": 0.1, "slow_first_token_s": 3},
     ("timeout_first_token",), {"first_token_s": 0.4}),
]  # fmt: skip
MIX_FAULTS = {"fail_429": 0.03, "fail_500": 0.03, "fail_503": 0.03, "reset_before_headers": 0.03,
              "drop_mid_stream": 0.03, "stall_mid_stream": 0.03, "slow_first_token": 0.03,
              "retry_after_s": 0.05, "stall_s": 3, "slow_first_token_s": 3}  # fmt: skip
MIX_TIMEOUTS = {"idle_s": 0.3, "first_token_s": 0.4}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- the code under test ------------------------------------------------------------------------


def snapshot(work: Path) -> str:
    """Copy shardrun/ to work/src, point PYTHONPATH (ours and the children's) at it; describe it."""
    src = work / "src"
    shutil.copytree(ROOT / "shardrun", src / "shardrun",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    h = hashlib.sha256()
    for path in sorted((src / "shardrun").rglob("*.py")):
        h.update(path.relative_to(src).as_posix().encode() + b"\0" + path.read_bytes())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    ENV["PYTHONPATH"] = str(src)
    os.environ["PYTHONPATH"] = str(src)  # start_sim spawns with our environment
    sys.path.insert(0, str(src))
    check = subprocess.run([PY, "-c", "import shardrun.runner, shardrun._shard_main"],
                           cwd=work, env=ENV, capture_output=True, text=True)  # fmt: skip
    if check.returncode != 0:
        raise SystemExit(f"the snapshot of shardrun/ does not import:\n{check.stderr[-1500:]}")
    return f"working tree (HEAD {head or '?'}), shardrun/*.py sha256 {h.hexdigest()[:12]}"


@contextlib.contextmanager
def external_sim(**settings: Any) -> Iterator[Any]:
    """The simulator as its own process (for /sim/stats); stopped on exit."""
    from shardrun.sim.config import SimConfig
    from shardrun.sim.launcher import start_sim

    with start_sim(SimConfig.from_mapping({**SIM_BASE, **settings})) as proc:
        yield proc


def sim_stats(proc: Any) -> dict[str, Any]:
    url = proc.base_url.removesuffix("/v1") + "/sim/stats"
    with urllib.request.urlopen(url, timeout=10) as resp:
        stats: dict[str, Any] = orjson.loads(resp.read())
    return stats


# -- one scenario's directory, passes and files -------------------------------------------------


@dataclass
class Pass:
    args: list[str]
    code: int | str  # exit status, or "hung"
    stdout: str
    stderr: str


@dataclass
class Scenario:
    """A temporary directory with an input, a job file and the passes run in it."""

    name: str
    dir: Path
    n: int
    ids: list[str] = field(default_factory=list)
    passes: list[Pass] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hung: bool = False
    post: Callable[[Tally], None] | None = None  # checks run on the tally of the last pass

    def write(self, endpoint: dict[str, Any], **job: Any) -> None:
        self.dir.mkdir(parents=True)
        self.ids = [f"item-{i:06d}" for i in range(self.n)]
        with open(self.dir / "input.jsonl", "wb") as f:
            for i, item_id in enumerate(self.ids):
                f.write(orjson.dumps({"id": item_id, "prompt": f"Question {i}: say something."}))
                f.write(b"\n")
        spec: dict[str, Any] = {"endpoint": {"api": "chat", "model": "m", **endpoint},
                                "input": {"path": "input.jsonl"}, "params": {"max_tokens": 32},
                                "shards": 2, "concurrency": 8}  # fmt: skip
        spec.update(job)
        (self.dir / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))

    # processes

    def start(self, *extra: str, env: dict[str, str] | None = None,
              preexec: Callable[[], None] | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
        k = len(self.passes)
        args = ["job.yaml", "--runs-dir", "runs", *extra]
        proc = subprocess.Popen([PY, "-m", "shardrun", *args], cwd=self.dir,
                                env={**ENV, **(env or {})}, stdin=subprocess.DEVNULL,
                                stdout=open(self.dir / f"pass{k}.stdout", "wb"),  # noqa: SIM115
                                stderr=open(self.dir / f"pass{k}.stderr", "wb"),  # noqa: SIM115
                                preexec_fn=preexec)  # fmt: skip
        proc.args = args  # remembered for the report
        return proc

    def finish(self, proc: subprocess.Popen[bytes], timeout: float = PASS_TIMEOUT_S) -> Pass:
        """Wait for a pass (killing its whole tree by PID if it hangs) and record it."""
        code: int | str
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait(10)
            code, self.hung = "hung", True
            self.notes.append(f"pass {len(self.passes)} hung (> {timeout:.0f} s), killed")
        k = len(self.passes)
        out = (self.dir / f"pass{k}.stdout").read_text(errors="replace")
        err = (self.dir / f"pass{k}.stderr").read_text(errors="replace")
        if "Traceback" in err or "Traceback" in out:
            self.notes.append(f"pass {k}: Traceback in output: "
                              f"{_tail_lines(err or out, 'Traceback')}")  # fmt: skip
        p = Pass(list(proc.args), code, out, err)  # type: ignore[arg-type]
        self.passes.append(p)
        return p

    def run(self, *extra: str, env: dict[str, str] | None = None,
            preexec: Callable[[], None] | None = None) -> Pass:  # fmt: skip
        return self.finish(self.start(*extra, env=env, preexec=preexec))

    def wait_results(self, at_least: int, proc: subprocess.Popen[bytes]) -> bool:
        """Block until `at_least` result lines exist; False if the pass ended first."""
        deadline = time.monotonic() + PASS_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            lines = sum(p.read_bytes().count(b"\n")
                        for p in self.dir.glob("runs/*/results/*.jsonl"))  # fmt: skip
            if lines >= at_least:
                return True
            time.sleep(0.02)
        self.notes.append(f"the pass ended (or {PASS_TIMEOUT_S:.0f} s passed) before "
                          f"{at_least} results: the fault came too late")  # fmt: skip
        return False

    @property
    def run_dir(self) -> Path | None:
        dirs = [p for p in (self.dir / "runs").glob("*") if p.is_dir()]
        if len(dirs) != 1:
            self.notes.append(f"{len(dirs)} run directories")
        return dirs[0] if dirs else None


def _tail_lines(text: str, marker: str) -> str:
    lines = text[text.find(marker):].strip().splitlines()
    return " | ".join(lines[-2:])[:300]


def kill_tree(pid: int) -> None:
    """SIGKILL a process we started and its descendants, by PID."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def shard_pids(coordinator: int) -> list[int]:
    """Spawned shards run `_shard_main`; forked ones are the shard launcher's children."""
    try:
        kids = psutil.Process(coordinator).children()
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in kids:
        with contextlib.suppress(psutil.Error):
            title = " ".join(p.cmdline()).strip()
            # a spawned shard is titled `shardrun: shard N of RUN` once it has its config
            if title.startswith("shardrun: shard") or "shardrun._shard_main" in title:
                out.append(p.pid)
            # the launcher: `shardrun: launcher of RUN` (a fork), or `shardrun._launcher`
            elif title.startswith("shardrun: launcher") or "shardrun._launcher" in title:
                out += [child.pid for child in p.children()]
    return out


def wait_exit(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Poll every 10 ms until all of `procs` have exited (or are zombies); return the rest."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        still = []
        for p in alive:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    still.append(p)
        alive = still
        if alive:
            time.sleep(0.01)
    return alive


def stray_children(before: set[int]) -> list[psutil.Process]:
    alive = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


# -- reading a run ------------------------------------------------------------------------------


def read_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Parsed lines of a JSONL file and the number of lines that do not parse."""
    rows, bad = [], 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            bad += 1
    return rows, bad


@dataclass
class Tally:
    succeeded: int = 0
    dead: int = 0
    duplicated: int = 0
    lost: int = 0
    attempts: int = 0
    resent: int = 0  # requests sent again within their attempt (attempt_end `resent`)
    retries: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    dead_rows: list[dict[str, Any]] = field(default_factory=list)
    result_rows: list[dict[str, Any]] = field(default_factory=list)
    status: str = "?"
    rate_waits: list[float] = field(default_factory=list)


def tally(sc: Scenario) -> Tally:
    t = Tally()
    run = sc.run_dir
    if run is None:
        t.lost = len(sc.ids)
        return t
    seen: Counter[str] = Counter()
    for sub, rows in (("results", t.result_rows), ("dead", t.dead_rows)):
        for path in sorted((run / sub).glob("shard-*.jsonl")):
            got, bad = read_lines(path)
            if bad:
                sc.notes.append(f"{bad} unparsable line(s) in {sub}/{path.name}")
            rows.extend(got)
            seen.update(str(r.get("id")) for r in got)
    t.succeeded, t.dead = len(t.result_rows), len(t.dead_rows)
    inputs = set(sc.ids)
    t.duplicated = sum(c - 1 for c in seen.values() if c > 1)
    strangers = [i for i in seen if i not in inputs]
    if strangers:
        t.duplicated += sum(seen[i] for i in strangers)
        sc.notes.append(f"{len(strangers)} id(s) not in the input, e.g. {strangers[:3]}")
    both = {r["id"] for r in t.result_rows} & {d["id"] for d in t.dead_rows}
    if both:
        sc.notes.append(f"{len(both)} id(s) both succeeded and dead-lettered, "
                        f"e.g. {sorted(both)[:3]}")  # fmt: skip
    twice = sorted(i for i, c in seen.items() if c > 1 and i in inputs)
    if twice:
        sc.notes.append(f"duplicated ids, e.g. {twice[:5]}")
    missing = sorted(inputs - set(seen))
    t.lost = len(missing)
    if missing:
        sc.notes.append(f"lost ids, e.g. {missing[:5]}")
    bad_events = 0
    for path in sorted((run / "events").glob("*.jsonl")):
        rows, bad = read_lines(path)
        bad_events += bad
        t.events.extend(rows)
    if bad_events:
        sc.notes.append(f"{bad_events} unparsable event line(s) (torn by a kill or a full disk)")
    ends = [e for e in t.events if e.get("ev") == "attempt_end"]
    t.attempts = len(ends)
    t.resent = sum(e.get("resent") or 0 for e in ends)
    t.retries = sum(1 for e in t.events if e.get("ev") == "retry")
    try:
        t.status = str(orjson.loads((run / "manifest.json").read_bytes()).get("status"))
    except (OSError, orjson.JSONDecodeError) as exc:
        t.status = f"unreadable ({exc})"
    return t


def failed_attempts(t: Tally, statuses: tuple[str, ...]) -> int:
    return sum(1 for e in t.events if e.get("ev") == "attempt_end" and e.get("status") in statuses)


def check_single_pass(sc: Scenario, t: Tally, stats: dict[str, Any] | None,
                      kinds: dict[str, tuple[str, ...]]) -> None:  # fmt: skip
    """Consistency of one uninterrupted pass: the log against the simulator and itself."""
    failed = sum(1 for e in t.events if e.get("ev") == "attempt_end" and e.get("status") != "ok")
    if t.retries != failed - t.dead:
        sc.notes.append(f"retries {t.retries} != failed attempts {failed} - dead {t.dead}")
    per_item = sum(int(r.get("attempts", 0)) for r in t.result_rows) + sum(
        len(d.get("attempts", [])) for d in t.dead_rows)
    if per_item != t.attempts:
        sc.notes.append(f"attempts in result/dead lines {per_item} != attempt_end events "
                        f"{t.attempts}")  # fmt: skip
    if stats is None:
        return
    if stats.get("requests_total") != t.attempts + t.resent:
        sc.notes.append(f"simulator saw {stats.get('requests_total')} requests, the log has "
                        f"{t.attempts} attempts and {t.resent} sent again")  # fmt: skip
    injected: dict[str, int] = stats.get("faults", {})
    # Faults that show as the same attempt statuses are compared as one group.
    groups: dict[tuple[str, ...], list[str]] = {}
    for kind, statuses in kinds.items():
        groups.setdefault(tuple(sorted(set(statuses))), []).append(kind)
    merged = {s: key for key in groups for s in key}
    for key, members in groups.items():
        full = tuple(sorted({s for k2 in groups if set(k2) & set(key) for s in k2}))
        if full != key:
            continue  # overlapping groups: compared under the wider one
        want = sum(injected.get(k, 0) for k2 in groups if set(k2) <= set(full)
                   for k in groups[k2])  # fmt: skip
        # A reset before any answer on a pooled connection went again within its attempt:
        # no failed attempt, but one `resent`.
        seen = failed_attempts(t, full) + (t.resent if "conn_reset" in full else 0)
        if any(injected.get(k, 0) == 0 for k in members):
            sc.notes.append(f"the simulator injected no {'/'.join(members)}")
        elif seen != want:
            sc.notes.append(f"{'+'.join(members)}: injected {want}, the log has {seen} "
                            f"attempts with status {'/'.join(full)}")  # fmt: skip
    other = {str(e.get("status")) for e in t.events
             if e.get("ev") == "attempt_end" and e.get("status") != "ok"}  # fmt: skip
    if unexpected := sorted(other - set(merged)):
        sc.notes.append(f"unexpected attempt statuses: {unexpected}")
    if kinds:
        sc.notes.append("injected: " + ", ".join(f"{k} {injected.get(k, 0):,}" for k in kinds))


def check_passes(sc: Scenario, t: Tally) -> None:
    """Each pass's printed counts against the lines its segment wrote; telemetry sanity."""
    run = sc.run_dir
    if run is None:
        return
    for k, p in enumerate(sc.passes):
        seg = "" if k == 0 else f".r{k}"
        for label, sub in (("succeeded", "results"), ("failed", "dead")):
            m = re.search(rf"^\s+{label}\s+([\d,]+)", p.stdout, re.M)
            if not m:
                continue
            printed = int(m.group(1).replace(",", ""))
            on_disk = sum(len(read_lines(f)[0]) for f in (run / sub).glob(f"shard-??{seg}.jsonl"))
            if printed != on_disk:
                sc.notes.append(f"pass {k} printed '{label} {printed:,}' but its segment has "
                                f"{on_disk:,} {sub} lines")  # fmt: skip
    last = sc.passes[-1] if sc.passes else None
    if last is not None and last.code == 0 and t.dead:
        sc.notes.append(f"the last pass exited 0 (\"every item succeeded\") but the run has "
                        f"{t.dead:,} dead-letter lines")  # fmt: skip
    for f in sorted((run / "events").glob("coordinator*.jsonl")):
        if f.stat().st_size == 0:
            sc.notes.append(f"events/{f.name} is empty")
    # No scenario sets rate_limits, so a rate_wait event is telemetry noise (reported once).
    t.rate_waits = [float(e.get("wait") or 0) for e in t.events if e.get("ev") == "rate_wait"]


# -- scenarios ----------------------------------------------------------------------------------


def sc_baseline(sc: Scenario) -> None:
    with external_sim() as server:
        sc.write({"base_url": server.base_url})
        sc.run()
        stats = sim_stats(server)
    sc.post = lambda t: check_single_pass(sc, t, stats, {})


def make_fault_class(faults: dict[str, Any], statuses: tuple[str, ...], kind: str,
                     timeouts: dict[str, float]) -> Callable[[Scenario], None]:  # fmt: skip
    def scenario(sc: Scenario) -> None:
        with external_sim(**faults) as server:
            sc.write({"base_url": server.base_url}, retry=RETRY_FAST, timeouts=timeouts)
            sc.run()
            stats = sim_stats(server)
        sc.post = lambda t: check_single_pass(sc, t, stats, {kind: statuses})

    return scenario


def sc_mix(sc: Scenario) -> None:
    with external_sim(**MIX_FAULTS) as server:
        sc.write({"base_url": server.base_url}, retry=RETRY_FAST, timeouts=MIX_TIMEOUTS)
        sc.run()
        stats = sim_stats(server)
    kinds = {k: s for k, _, s, _ in FAULT_CLASSES}
    sc.post = lambda t: check_single_pass(sc, t, stats, kinds)


def sc_failing_endpoint(sc: Scenario) -> None:
    """Every request answered 503: the shards hold the items (one probe per shard at a time)
    instead of dead-lettering them once the retry budget is spent; after `outage_s` the pass
    stops, and a resume against a healthy simulator finishes the run."""
    with external_sim(fail_503=1.0) as bad:
        sc.write({"base_url": bad.base_url}, retry={"outage_s": 3})
        p = sc.run()
        sent = sim_stats(bad)["requests_total"]
    if "none of this run has succeeded" not in p.stderr:
        sc.notes.append("the failing pass does not say 'none of this run has succeeded'")
    first = sum(path.read_bytes().count(b"\n") for path in (sc.dir / "runs").glob("*/dead/*"))
    sc.notes.append(f"{sent} requests to the failing endpoint, {first} dead letters after it")
    with external_sim() as good:
        sc.run("--resume", "latest", env={"SHARDRUN_BASE_URL": good.base_url})


def sc_storm(sc: Scenario) -> None:
    """Every request answered 503 for 3 s, from a quarter of the items on: held, not
    dead-lettered, with the default retry budget."""
    with external_sim(storm_after_n=max(1, sc.n // 4), storm_s=3) as server:
        sc.write({"base_url": server.base_url})
        sc.run()
        stats = sim_stats(server)
    sc.notes.append(f"{stats['faults']['storm']} requests answered 503 by the storm")


def sc_kill_shard(sc: Scenario) -> None:
    sc.write({"base_url": "sim://", "sim": SIM_SLOW})
    proc = sc.start()
    if sc.wait_results(max(1, sc.n // 4), proc):
        pids = shard_pids(proc.pid)
        if pids:
            os.kill(pids[0], signal.SIGKILL)
        else:
            sc.notes.append("no shard process found to kill")
    p = sc.finish(proc)
    if "died (killed by signal SIGKILL)" not in p.stderr:
        sc.notes.append("stderr does not report the shard's death")
    if "shard deaths       1" not in p.stdout:
        sc.notes.append("the summary does not report 1 shard death")


def sc_kill_coordinator(sc: Scenario) -> None:
    sc.write({"base_url": "sim://", "sim": SIM_SLOW}, shutdown_grace_s=2)
    proc = sc.start()
    if sc.wait_results(max(1, sc.n // 4), proc):
        children = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        sc.finish(proc)
        t0 = time.monotonic()
        alive = wait_exit(children, ORPHAN_WAIT_S)
        waited = time.monotonic() - t0
        sc.notes.append(f"{len(children)} children (shards + simulator) exited "
                        f"{waited:.1f} s after the kill")  # fmt: skip
        if alive:
            sc.notes.append(f"orphans still running after {ORPHAN_WAIT_S:.0f} s: "
                            f"{[p.pid for p in alive]} (killed)")  # fmt: skip
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
    else:
        sc.finish(proc)
    p = sc.run("--resume", "latest")
    if "already done" not in p.stdout:
        sc.notes.append("the resume pass does not say 'already done'")


def sc_sigint(sc: Scenario) -> None:
    sc.write({"base_url": "sim://", "sim": SIM_SLOW})
    proc = sc.start()
    if sc.wait_results(max(1, sc.n // 4), proc):
        proc.send_signal(signal.SIGINT)
    sc.finish(proc)
    run = sc.run_dir
    if run is not None:
        for f in run.rglob("*.jsonl"):
            data = f.read_bytes()
            if data and not data.endswith(b"\n"):
                sc.notes.append(f"torn last line after SIGINT in {f.relative_to(run)}")
        status = orjson.loads((run / "manifest.json").read_bytes()).get("status")
        if status != "interrupted":
            sc.notes.append(f"manifest status after SIGINT: {status}")
    sc.run("--resume", "latest")


def _file_size_limit(n: int) -> Callable[[], None]:
    limit = FSIZE_PER_ITEM * n

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def sc_disk_full(sc: Scenario) -> None:
    sc.write({"base_url": "sim://", "sim": SIM_BASE})
    p = sc.run(preexec=_file_size_limit(sc.n))
    if "cannot write" not in p.stderr:
        sc.notes.append("the full-disk pass does not say 'cannot write'")
    sc.run("--resume", "latest")
    if "removed a torn last line" in sc.passes[-1].stderr:
        sc.notes.append("resume removed torn last line(s)")


def sc_refused_key(sc: Scenario) -> None:
    with external_sim(auth_required="right-key") as server:
        sc.write({"base_url": server.base_url, "api_key_env": "FAULT_TABLE_KEY"})
        p = sc.run(env={"FAULT_TABLE_KEY": "wrong-key"})
        if "refused the credentials (HTTP 401" not in p.stderr:
            sc.notes.append("the refused pass does not say 'refused the credentials (HTTP 401'")
        refused = sim_stats(server)["requests_total"]
        sc.notes.append(f"{refused} requests sent with the wrong key")
        sc.run("--resume", "latest", env={"FAULT_TABLE_KEY": "right-key"})


def sc_wrong_path(sc: Scenario) -> None:
    with external_sim() as server:
        sc.write({"base_url": server.base_url.removesuffix("/v1")})
        p = sc.run()
        if "answered HTTP 404" not in p.stderr:
            sc.notes.append("the 404 pass does not say 'answered HTTP 404'")
        sc.run("--resume", "latest", env={"SHARDRUN_BASE_URL": server.base_url})


SCENARIOS: list[tuple[str, Callable[[Scenario], None], str]] = [
    ("baseline", sc_baseline, "0"),
    *[(f"{kind} {next(v for k, v in f.items() if k == kind):g}",
       make_fault_class(f, st, kind, to), "0") for kind, f, st, to in FAULT_CLASSES],
    ("mix of all 7 at 0.03", sc_mix, "0"),
    ("endpoint failing everything (fail_503 1.0) → resume", sc_failing_endpoint, "1 → 0"),
    ("storm of 503s for 3 s mid-run", sc_storm, "0"),
    ("kill -9 one shard", sc_kill_shard, "0"),
    ("kill -9 coordinator → resume", sc_kill_coordinator, "-9 → 0"),
    ("SIGINT → resume", sc_sigint, "130 → 0"),
    ("disk full (RLIMIT_FSIZE 100 B per item) → resume", sc_disk_full, "1 → 0"),
    ("refused key (401) → resume with the right key", sc_refused_key, "1 → 0"),
    ("base_url without /v1 (404) → resume with the right one", sc_wrong_path, "1 → 0"),
]  # fmt: skip


@dataclass
class Row:
    name: str
    n: int
    t: Tally
    wall: float
    codes: str
    expected: str
    notes: list[str]
    hung: bool


def run_scenario(name: str, fn: Callable[[Scenario], None], expected: str, n: int,
                 work: Path, index: int) -> Row:  # fmt: skip
    sc = Scenario(name, work / f"s{index:02d}", n)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.monotonic()
    try:
        fn(sc)
    except Exception as exc:  # a broken scenario is a row with a note, not a crash of the table
        sc.notes.append(f"scenario error: {type(exc).__name__}: {exc}")
    wall = time.monotonic() - t0
    strays = stray_children(before)
    if strays:
        sc.notes.append(f"processes left running: {[p.pid for p in strays]} (killed)")
        for p in strays:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    t = tally(sc) if sc.dir.exists() else Tally(lost=n)
    if sc.post is not None:
        sc.post(t)
    if sc.dir.exists():
        check_passes(sc, t)
    codes = " → ".join(str(p.code) for p in sc.passes)
    if codes != expected:
        sc.notes.append(f"exit codes {codes}, expected {expected}")
    want_status = "failed" if expected.endswith("1") else "succeeded"
    if t.status != want_status:
        sc.notes.append(f"final manifest status {t.status!r}")
    return Row(name, n, t, wall, codes, expected, sc.notes, sc.hung)


def table(rows: list[Row]) -> str:
    out = ["| scenario | items | succeeded | dead-lettered | duplicated | lost | attempts | "
           "retries | wall time (s) | exit code(s) |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    for r in rows:
        attempts = f"{r.t.attempts:,}"
        out.append(f"| {r.name} | {r.n:,} | {r.t.succeeded:,} | {r.t.dead:,} | "
                   f"{r.t.duplicated:,} | {r.t.lost:,} | {attempts} | {r.t.retries:,} | "
                   f"{r.wall:.1f} | {r.codes} |")  # fmt: skip
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=None, help="items per scenario (default 2000)")
    ap.add_argument("--quick", action="store_true", help="300 items per scenario")
    ap.add_argument("--only", help="comma-separated scenario name prefixes")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    n = args.items or (300 if args.quick else 2000)
    if not 1 <= n <= 1_000_000:
        ap.error("--items must be 1..1,000,000")
    chosen = SCENARIOS
    if args.only:
        prefixes = [p.strip() for p in args.only.split(",") if p.strip()]
        chosen = [s for s in SCENARIOS if any(s[0].startswith(p) for p in prefixes)]
        if not chosen:
            ap.error(f"no scenario matches {args.only!r}")
    work = Path(tempfile.mkdtemp(prefix="shardrun-faults-"))
    code = snapshot(work)
    log(f"# code under test: {code}")
    log(f"# fault table: {len(chosen)} scenarios × {n:,} items, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load {os.getloadavg()[0]:.2f}; work dir {work}")
    rows: list[Row] = []
    t_all = time.monotonic()
    try:
        for i, (name, fn, expected) in enumerate(chosen):
            row = run_scenario(name, fn, expected, n, work, i)
            rows.append(row)
            flag = "" if row.t.duplicated == 0 and row.t.lost == 0 and not row.hung else "  <<<"
            log(f"  {name:46} ok {row.t.succeeded:6,} dead {row.t.dead:6,} dup "
                f"{row.t.duplicated} lost {row.t.lost} attempts {row.t.attempts:,} exit "
                f"{row.codes}  {row.wall:.1f}s [{time.monotonic() - t_all:.0f}s]{flag}")
            for note in row.notes:
                log(f"      - {note}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    print()
    for r in rows:
        for note in r.notes:
            print(f"- {r.name}: {note}")
    for r in rows:
        if r.t.rate_waits:  # no job sets a rate limit: these are pauses the server asked for
            print(f"- {r.name}: {len(r.t.rate_waits):,} `rate_wait` events (longest "
                  f"{max(r.t.rate_waits) * 1e3:.1f} ms) with no job rate limit: server-asked "
                  "pauses")  # fmt: skip
    bad = [r.name for r in rows if r.t.duplicated or r.t.lost or r.hung]
    if bad:
        log(f"# FAILED exactly-once (or hung): {', '.join(bad)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

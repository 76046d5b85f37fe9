"""The short summary printed at the end of a run, built from the shards' final reports."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shardrun._ellipsis import counted, ellipsize
from shardrun.progress import clock_text, limit_clause, summed_paces
from shardrun.ratelimit import limit_set_pace


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What a run did, in the numbers an operator asks for first."""

    run_dir: Path
    items: int
    succeeded: int
    dead: int
    rejects: int
    skipped: int = 0
    left_out: int = 0  # input items `retry-failed` passed over: never run, left for --resume
    shard_deaths: int = 0
    reassigned: int = 0
    budget_exhausted: int = 0
    completion_tokens: int
    attempts: int
    retries: int
    wall_s: float
    started_at: float
    ended_at: float
    minute_tokens: dict[int, int] = field(default_factory=dict)
    per_shard: list[dict[str, int]] = field(default_factory=list)
    interrupted: bool = False
    fatal_reason: str | None = None
    prompt_tokens: int = 0
    wasted_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens (every attempt's), as the server counted them
    reasoning_tokens: int = 0  # of the successes' completion tokens, likewise
    # Of succeeded: those whose completion tokens the client counted (the server sent no usage).
    estimated_ok: int = 0
    refusals: int = 0  # successes whose answer was a refusal (the model declined)
    rate_waits: int = 0  # waits for a rate limit before an attempt (ours, or the server's)
    rate_wait_s: float = 0.0  # their time, summed over slots
    # 429s of the server's rate limit, each holding its item, and the pace the shards learned
    # of that limit (requests a second, summed over the shards that learned one; None: none).
    limited_429s: int = 0
    http_429s: int = 0  # attempts answered 429, held or not
    paced_rps: float | None = None
    paced_tps: float | None = None  # tokens a second, where a 429 on tokens taught a pace
    paced_seeded: bool = False  # every pace as the server's 429 stated it, none cut
    # Dead letters left by earlier passes of a resumed run that this pass did not take: those
    # it took and did not end are counted in `unfinished`, not here too.
    prior_dead: int = 0
    # The dead letters this retry pass put back in dead/unretried-rK.jsonl: those it set aside
    # and did not reach (--limit, a stop; in prior_dead) and those it took and did not end
    # (`unfinished_put_back`); `retry-failed` runs them, not `--resume`.
    unretried: int = 0
    # Of unfinished (and of unretried): the dead letters this retry pass took and did not end,
    # back in dead/: what is left for --resume is the rest (`work_left`).
    unfinished_put_back: int = 0
    # The dead letters this pass set aside to retry, and whether it ran them only (`retry-failed`,
    # or --resume --retry-failed after a whole read): then what it took are dead letters.
    retried: int = 0
    dead_letters_only: bool = False
    # Of `retried`, those whose item has a result line too (`resume.Prior.answered`): skipped
    # as finished, so back in dead/ (in `unretried`) though no stop left them.
    answered_dead: int = 0
    # Dead letters earlier passes left in dead/ whose item has a result line too (a damaged
    # run: a retry pass's put-back cut, a hand edit): answered, so not in prior_dead.
    prior_answered: int = 0
    prior_rejects: int = 0  # input lines earlier passes rejected (this one read them again)
    cost: dict[str, Any] | None = None  # from pricing.cost(), when the job has prices
    # Why this pass dead-lettered items: {kind: (count, first reason)}, from the shards' reports
    # (a shard that died before reporting leaves its dead letters uncounted here).
    dead_reasons: dict[str, tuple[int, str]] = field(default_factory=dict)
    rejects_file: Path | None = None  # where this pass set aside bad input lines
    input_read: bool = True  # False: the run stopped before reading its input to the end
    # An earlier pass read the input to its end, as long as this pass found it (lines appended
    # since are new items), and ended every item it read (see `manifest.input_read_whole`): a
    # --limit on this pass left no input unread.
    input_read_before: bool = False
    limit: int | None = None  # --limit, when it ended this pass's input early
    # A pass of dead letters only that found the last of them on this line and read no further
    # (the rest can hold none of them): `input_read` is False, as after a --limit.
    read_to_line: int | None = None
    client_cpu_s: float | None = None  # user+sys of the coordinator, launcher and shards
    client_cpu_unknown: str | None = None  # why client_cpu_s is None, when it is unknown
    resume_command: str | None = None  # the command that finishes what this pass left undone
    retry_command: str | None = None  # the command that gives the dead letters another pass
    # What this pass could not record at its end (its manifest, the coordinator's event log),
    # one sentence each: the run still ended, and the CLI prints them as errors.
    unrecorded: tuple[str, ...] = ()
    segment: int = 0  # the pass: 0 the first, K the run's Kth resume or retry pass

    @classmethod
    def from_shard_reports(
        cls,
        *,
        run_dir: Path,
        reports: Sequence[dict[str, Any]],
        ok: int,
        dead: int,
        taken: int,
        skipped: int,
        rejects: int,
        left_out: int = 0,
        started_at: float,
        ended_at: float,
        interrupted: bool,
        fatal_reason: str | None,
        shard_deaths: int = 0,
        reassigned: int = 0,
        rejects_file: Path | None = None,
        input_read: bool = True,
        limit: int | None = None,
        read_to_line: int | None = None,
        client_cpu_s: float | None = None,
        client_cpu_unknown: str | None = None,
    ) -> RunSummary:
        """Counts come from the coordinator (exact across crashes); tokens from shard reports."""
        minutes: Counter[int] = Counter()
        reasons: dict[str, tuple[int, str]] = {}
        for report in reports:
            minutes.update({int(k): v for k, v in report.get("minutes", {}).items()})
            for kind, (count, example) in report.get("dead_reasons", {}).items():
                earlier, first_example = reasons.get(kind, (0, example))
                reasons[kind] = (earlier + count, first_example)
        total = {k: sum(int(r.get(k, 0)) for r in reports)
                 for k in ("completion_tokens", "attempts", "retries", "budget_exhausted",
                           "prompt_tokens", "wasted_tokens", "cached_tokens",
                           "reasoning_tokens", "estimated_ok", "refusals", "rate_waits",
                           "rate_wait_ms", "limited_429s", "http_429s")}  # fmt: skip
        paced_rps, paced_tps, paced_seeded = summed_paces(reports)
        return cls(
            run_dir=run_dir,
            items=taken + rejects,
            succeeded=ok,
            dead=dead,
            rejects=rejects,
            skipped=skipped,
            left_out=left_out,
            shard_deaths=shard_deaths,
            reassigned=reassigned,
            budget_exhausted=total["budget_exhausted"],
            prompt_tokens=total["prompt_tokens"],
            wasted_tokens=total["wasted_tokens"],
            cached_tokens=total["cached_tokens"],
            reasoning_tokens=total["reasoning_tokens"],
            estimated_ok=total["estimated_ok"],
            refusals=total["refusals"],
            rate_waits=total["rate_waits"],
            rate_wait_s=total["rate_wait_ms"] / 1000,
            limited_429s=total["limited_429s"], http_429s=total["http_429s"],
            paced_rps=paced_rps, paced_tps=paced_tps, paced_seeded=paced_seeded,
            completion_tokens=total["completion_tokens"],
            attempts=total["attempts"],
            retries=total["retries"],
            wall_s=ended_at - started_at,
            started_at=started_at,
            ended_at=ended_at,
            minute_tokens=dict(minutes),
            per_shard=[{"shard": i, "ok": int(r.get("ok", 0)), "dead": int(r.get("dead", 0)),
                        "abandoned": int(r.get("abandoned", 0))} for i, r in enumerate(reports)],
            interrupted=interrupted,
            fatal_reason=fatal_reason,
            dead_reasons=reasons,
            rejects_file=rejects_file,
            input_read=input_read,
            limit=limit,
            read_to_line=read_to_line,
            client_cpu_s=client_cpu_s,
            client_cpu_unknown=client_cpu_unknown,
        )

    @property
    def failed(self) -> int:
        return self.dead + self.rejects

    @property
    def unfinished(self) -> int:
        return self.items - self.succeeded - self.failed

    @property
    def tpm(self) -> float:
        """Completion tokens per minute over the whole run's wall time."""
        return self.completion_tokens / self.wall_s * 60 if self.wall_s > 0 else 0.0

    @property
    def peak_full_minute(self) -> tuple[int, int] | None:
        """(minute, tokens) of the best UTC minute lying wholly inside the run, if any."""
        full = {m: t for m, t in self.minute_tokens.items()
                if m * 60 >= self.started_at and (m + 1) * 60 <= self.ended_at}
        if not full:
            return None
        best = max(full, key=lambda m: full[m])
        return best, full[best]

    @property
    def work_left(self) -> WorkLeft:
        return work_left(self.as_dict(), read_before=self.input_read_before)

    @property
    def status(self) -> str:
        # A stop that came once every item had ended and the input was read stopped nothing:
        # the run is what its items say (a Ctrl-C in the last moments read "interrupted").
        left = self.unfinished > 0 or (not self.input_read and self.limit is None
                                       and self.read_to_line is None)
        if self.interrupted and left:
            return "interrupted"
        # Nor has a pass succeeded that stopped (a fatal stop) before it read its input to the
        # end, though no item it took was left: a simulator ended before any shard took one
        # said `run succeeded`, exit 0, with all 3,000 items of its input unrun.
        clean = (self.failed == 0 and not left and self.prior_dead == 0
                 and self.prior_rejects == 0)
        return "succeeded" if clean else "failed"

    @property
    def exit_code(self) -> int:
        code = {"interrupted": 130, "succeeded": 0}.get(self.status, 1)
        return code or int(bool(self.unrecorded))

    def as_dict(self) -> dict[str, Any]:
        peak = self.peak_full_minute
        return {
            "items": self.items, "succeeded": self.succeeded, "dead": self.dead,
            "rejects": self.rejects, "unfinished": self.unfinished, "skipped": self.skipped,
            "left_out": self.left_out,
            "prior_dead": self.prior_dead, "unretried": self.unretried,
            "answered_dead": self.answered_dead, "prior_answered": self.prior_answered,
            "unfinished_put_back": self.unfinished_put_back,
            "prior_rejects": self.prior_rejects,
            "shard_deaths": self.shard_deaths, "reassigned": self.reassigned,
            "budget_exhausted": self.budget_exhausted,
            "completion_tokens": self.completion_tokens, "attempts": self.attempts,
            "retries": self.retries, "wall_s": round(self.wall_s, 3),
            "completion_tpm_run": round(self.tpm, 1),
            "peak_full_minute": None if peak is None else {"minute": _minute(peak[0]),
                                                            "completion_tokens": peak[1]},
            "prompt_tokens": self.prompt_tokens, "wasted_tokens": self.wasted_tokens,
            "cached_tokens": self.cached_tokens, "reasoning_tokens": self.reasoning_tokens,
            "estimated_successes": self.estimated_ok,
            "refusals": self.refusals, "cost": self.cost, "rate_waits": self.rate_waits,
            "rate_wait_s": round(self.rate_wait_s, 3), "limited_429s": self.limited_429s,
            "http_429s": self.http_429s,  # what its req/min answered leaves out
            "paced_rps": None if self.paced_rps is None else round(self.paced_rps, 3),
            "paced_tps": None if self.paced_tps is None else round(self.paced_tps, 1),
            "paced_seeded": self.paced_seeded,
            "per_shard": self.per_shard, "status": self.status,
            "fatal_reason": self.fatal_reason, "input_read": self.input_read, "limit": self.limit,
            "read_to_line": self.read_to_line,
            "client_cpu_s": None if self.client_cpu_s is None else round(self.client_cpu_s, 3),
            "client_cpu_unknown": self.client_cpu_unknown,
            "dead_reasons": {kind: {"count": n, "example": example}
                             for kind, (n, example) in self.dead_reasons.items()},
        }


@dataclass(frozen=True, kw_only=True)
class WorkLeft:
    """What a pass left for a later one: `--resume` runs the first three, `retry-failed` the
    dead letters it set aside to retry but did not reach."""

    unread: bool  # input after where the pass stopped reading, that no pass has read
    left_out: int  # items a pass of dead letters only passed over
    unfinished: int  # items handed out and not ended (a stop), less the dead letters among them
    unretried: int  # the dead letters put back in dead/: not reached, or taken and not ended
    put_back: int  # of unretried: those it took and did not end (a stop)
    # Put back too, not in `unretried`: dead letters of items with a result line, which no
    # pass runs (they are finished), so neither a stop nor the retry command concerns them.
    answered: int = 0

    @property
    def for_resume(self) -> bool:
        return self.unread or self.left_out > 0 or self.unfinished > 0

    @property
    def not_reached(self) -> int:
        """The dead letters the pass set aside and never took."""
        return self.unretried - self.put_back


def work_left(summary: Mapping[str, Any], *, read_before: bool) -> WorkLeft:
    """What the pass whose summary (`RunSummary.as_dict()`, as the manifest records it) this is
    left undone; `read_before`: whether an earlier pass read the whole input this pass found
    and ended all it read (`manifest.input_read_whole`; lines appended since it are items no
    pass has run). Then the input this pass left unread holds no item --resume would run.

    Its items are not all dead letters, though: one whose result was removed by hand runs
    again, in --resume and in --resume --retry-failed, and `retry-failed` passes it over
    (`left_out`). So what it took and did not end counts, less the dead letters among them,
    which are back in dead/ (`unfinished_put_back`; a summary of an older shardrun lacks it,
    and its count stays as it was judged then)."""
    answered = int(summary.get("answered_dead") or 0)
    unretried = max(0, int(summary.get("unretried") or 0) - answered)
    unfinished = int(summary.get("unfinished") or 0)
    put_back = min(unretried, int(summary.get("unfinished_put_back") or 0))
    if "unfinished_put_back" in summary:
        unfinished -= put_back
    elif read_before:
        unfinished = 0
    return WorkLeft(unread=not read_before and summary.get("input_read") is False,
                    left_out=int(summary.get("left_out") or 0), unfinished=unfinished,
                    unretried=unretried, put_back=put_back, answered=answered)


def add_unreported(report: dict[str, Any], tried: Mapping[str, int],
                   results: Iterable[dict[str, Any]],
                   dead: Iterable[dict[str, Any]], held: Mapping[str, int] | None = None,
                   refused: Mapping[str, int] | None = None) -> dict[str, Any]:
    """A dead shard's last report plus what the lines it wrote after that report hold.

    The attempts the shard had out at that report (`sending`) count: each went to the server,
    and its `attempt_start` line (a retry's `retry` line too) is in the log, which `report`
    reads. The lines were written after the report's counters were read: their item, its
    tokens and its last attempt are not in them. Earlier attempts of the same span may be:
    `tried` (the reports' changes to it applied up to this one) holds how many attempts each
    span still open then had counted (ended, every one a failure, and a retry out then; all
    but the first of them retries), so that they are not counted twice. A line's 429s count
    too, or the req/min answered (attempts less 429s) would read high: a dead letter's attempts
    carry their status, a result line their number (`http_429s`), less those `refused` says the
    reports counted for its span; so do the held retries of its 429s (`limited_429s`): a dead
    letter's attempts marked `held`, a result line's `held_429s`, less those `held` says the
    reports counted, or the summary would count fewer than `report` reads from their `retry`
    lines. What the lines do not hold stays as reported: the tokens wasted by earlier attempts
    and rate-limit waits. A span's attempt out at that report is among `sending`, or, a retry, in
    `tried` too (counted as it is sent): one out and not in `tried` is its first, which a line
    of a span `tried` does not hold adds again unless it started after the report's `at`.
    """
    add: Counter[str] = Counter({"attempts": int(report.get("sending") or 0)})
    at = report.get("at")
    held, refused = held or {}, refused or {}

    def add_429s(span: str, n_429s: int, n_held: int) -> None:
        add["http_429s"] += max(0, n_429s - refused.get(span, 0))
        add["limited_429s"] += max(0, n_held - held.get(span, 0))

    for line in results:
        usage = line.get("usage") or {}
        add["ok"] += 1
        add["completion_tokens"] += usage.get("completion_tokens") or 0
        add["reasoning_tokens"] += usage.get("reasoning_tokens") or 0
        add["prompt_tokens"] += usage.get("prompt_tokens") or 0  # the last attempt's
        add["cached_tokens"] += usage.get("cached_tokens") or 0
        add["refusals"] += line.get("refusal") is not None
        add["estimated_ok"] += usage.get("estimated") is True
        attempts, reported = int(line.get("attempts") or 0), tried.get(line.get("span", ""), 0)
        _add_attempts(add, attempts, reported)
        if attempts and not reported and _out_at(at, _first_start(line)):
            add["attempts"] -= 1
        add_429s(line.get("span", ""), int(line.get("http_429s") or 0),
                 int(line.get("held_429s") or 0))
    for line in dead:
        add["dead"] += 1
        add["budget_exhausted"] += str(line.get("reason", "")).startswith(
            "retry_budget_exhausted")
        history = line.get("attempts") or []
        reported = tried.get(line.get("span", ""), 0)
        _add_attempts(add, len(history), reported)
        if history and not reported and _out_at(at, history[0].get("started_at")):
            add["attempts"] -= 1
        add_429s(line.get("span", ""), sum(a.get("status") == "http_429" for a in history),
                 sum(a.get("held") is True for a in history))
    return {**report, **{k: int(report.get(k, 0)) + n for k, n in add.items()}}


def _first_start(line: dict[str, Any]) -> float | None:
    """When a result line's first attempt started: at its admission (`Shard._attempt`), its
    queued time and t_queue (DESIGN §3)."""
    try:
        return float(line["queued_at"]) + float(line["buckets"]["t_queue"])
    except (KeyError, TypeError, ValueError):
        return None


def _out_at(at: Any, started: Any) -> bool:
    """Whether an attempt that started at `started` was out at a report made at `at`: it
    ended after that report (its line came after it), so, started before it, it was out."""
    return isinstance(at, (int, float)) and isinstance(started, (int, float)) and started < at


def _add_attempts(add: Counter[str], attempts: int, reported: int) -> None:
    """A finished span's attempts, and its retries (one fewer), less those already reported
    (a retry is counted as it is sent, its attempt once it has ended or, out at the report,
    from `sending`)."""
    add["attempts"] += max(0, attempts - reported)
    add["retries"] += max(0, attempts - 1 - max(0, reported - 1))


def _minute(m: int) -> str:
    return datetime.fromtimestamp(m * 60, UTC).strftime("%Y-%m-%dT%H:%MZ")


def _answered_rpm(s: RunSummary) -> float | None:
    """The requests the server answered (not with a 429, held or not, as `report` counts its
    answered_rpm) a minute of wall time, on average: at most its limit, where the pace the
    shards last cut to may be above it."""
    return (s.attempts - s.http_429s) * 60 / s.wall_s if s.wall_s > 0 else None


def _limit_text(s: RunSummary) -> str:
    return limit_clause(s.limited_429s, s.paced_rps, _answered_rpm(s), s.paced_tps,
                        s.paced_seeded)


def _limit_verdict(s: RunSummary) -> str:
    """What the holds say, by the report's rule (`limit_set_pace`): the limit set the pace, or
    a few requests only met it."""
    paced = s.paced_rps is not None or s.paced_tps is not None
    seeded = s.paced_rps if s.paced_seeded and s.paced_tps is None else None
    sent = s.attempts / s.wall_s if s.wall_s > 0 else None
    said = ("the server's limit set the pace"
            if limit_set_pace(s.limited_429s, s.attempts, paced, seeded_rps=seeded, sent_rps=sent)
            else "a few requests met the server's limit, held at no cost of attempts")
    return f" ({said}; `shardrun report` says more)"


def format_summary(s: RunSummary) -> str:
    """The end-of-run block printed to the terminal."""
    lines = [f"run {s.status}: {s.run_dir}"]
    if s.skipped:
        lines.append(f"  already done       {s.skipped:,} (skipped: finished by an earlier pass)")
    lines += [
        f"  items              {s.items:,}" + _items_note(s),
        f"  succeeded          {s.succeeded:,}"
        + (f"  ({s.refusals:,} of them {'a refusal' if s.refusals == 1 else 'refusals'}: the "
           "model declined; see `refusal` in the results)" if s.refusals else ""),
        f"  failed             {s.failed:,}"
        + (f"  ({s.dead:,} dead-lettered, {counted(s.rejects, 'rejected input line')})"
           if s.failed else ""),
    ]
    lines += _failure_lines(s)
    work = s.work_left
    resume = bool(s.resume_command and work.for_resume)
    if s.unfinished:
        lines.append(f"  not finished       {s.unfinished:,}" + _put_back_note(s, work, resume))
    if resume:
        lines.append(f"  to finish the run  {s.resume_command}")
    elif work.unretried:
        lines.append(f"  to finish the run  {_retry(s)}")
    if s.prior_dead:
        # The command once is enough: a line above may have named it.
        named = lines[-1].endswith(_retry(s)) or (resume and work.put_back > 0)
        again = "" if named else f" (another pass: {_retry(s)})"
        lines.append(f"  earlier failures   {s.prior_dead:,} dead-lettered by earlier "
                     f"passes{again}")
    if s.prior_answered:
        whose = "its item has" if s.prior_answered == 1 else "their items have"
        lines.append(f"  answered later     {counted(s.prior_answered, 'dead letter')} ({whose} "
                     "a result line too: not failed)")
    if s.prior_rejects:
        lines.append(f"  earlier rejects    {counted(s.prior_rejects, 'input line')} "
                     "rejected by earlier passes "
                     "(rejects*.jsonl)")
    spent = f" ({s.reasoning_tokens:,} reasoning)" if s.reasoning_tokens else ""
    lines.append(f"  completion tokens  {s.completion_tokens:,}{spent}")
    if s.estimated_ok:  # counted by the client: a throughput built on them is an estimate
        lines.append(f"  estimated          {s.estimated_ok:,} of {s.succeeded:,} successes' "
                     "token counts (the server sent no usage): TPM is an estimate")
    if s.cached_tokens:
        lines.append(f"  cached prompt      {s.cached_tokens:,} of {s.prompt_tokens:,} "
                     "prompt tokens (the server's count)")
    lines += [
        f"  attempts           {s.attempts:,} ({counted(s.retries, 'retry', 'retries')}"
        + (f", retry budget spent for {counted(s.budget_exhausted, 'item')}"
           if s.budget_exhausted else "")
        + ")",
        *([f"  rate-limit waits   {s.rate_waits:,} ({s.rate_wait_s:,.1f} s of slot time, for "
           "the job's rate_limits or the server's x-ratelimit headers)"] if s.rate_waits else []),
        *([f"  server rate limit  {_limit_text(s)}{_limit_verdict(s)}"] if s.limited_429s
          else []),
        f"  wall time          {s.wall_s:,.1f} s{_as_clock(s.wall_s)}",
        f"  completion TPM     {s.tpm:,.0f} ("
        + ("run average" if s.segment == 0 else "this pass's average; report's run average "
           "covers every pass") + ", all shards)",
    ]
    peak = s.peak_full_minute
    if peak is not None:
        lines.append(f"  peak full minute   {peak[1]:,} tokens at {_minute(peak[0])}")
    if s.client_cpu_s is not None:
        lines.append(_cpu_line(s.client_cpu_s, s.attempts, s.wall_s))
    elif s.client_cpu_unknown:
        lines.append(f"  client CPU         unknown: {s.client_cpu_unknown}")
    if s.cost is not None and s.cost.get("basis") is not None:
        per = s.cost["cost_per_success"]
        lines.append(f"  spend              {s.cost['spend']:,.4f}"
                     + ("" if per is None else f"  ({per:,.6f} per success)")
                     + f", wasted tokens {s.wasted_tokens:,} cost {s.cost['wasted_cost']:,.4f}")
    if s.per_shard:
        lines.append(_per_shard_line(s.per_shard))
    if s.shard_deaths:
        lines.append(f"  shard deaths       {s.shard_deaths} ({counted(s.reassigned, 'item')} "
                     "handed to other shards)")
    if s.fatal_reason:
        lines.append(f"  stopped early      {s.fatal_reason}")
    return "\n".join(lines)


def _put_back_note(s: RunSummary, work: WorkLeft, resume: bool) -> str:
    """Which of the items a retry pass took and did not end are dead letters again (back in
    dead/; the earlier failures below do not count them a second time), and the retry that
    runs them, when "to finish the run" names --resume instead."""
    if not work.put_back:
        return ""
    which = "all of them" if work.put_back == s.unfinished else f"{work.put_back:,} of them"
    retry = f"; another pass: {_retry(s)}" if resume else ", for the retry below"
    return f"  ({which} dead letters it took to retry: back in dead/{retry})"


def _per_shard_line(per_shard: list[dict[str, int]]) -> str:
    """The items each shard took. Those a stop left unfinished count too: a run stopped in a
    storm or an outage has most of its shards' items held, and counting only the ended ones
    read as if the shards had taken a handful each."""
    left = sum(p.get("abandoned", 0) for p in per_shard)
    took = [p["ok"] + p["dead"] + p.get("abandoned", 0) for p in per_shard]
    line = f"  items per shard    min {min(took):,} / max {max(took):,}"
    return line + (f" ({left:,} of them left unfinished)" if left else "")  # "to finish" says how


def _items_note(s: RunSummary) -> str:
    """Why the items count is what it is, and the dead letters set aside it has no room for
    because their items were answered already."""
    note = _items_why(s)
    if not (answered := s.work_left.answered):
        return note
    said = (f"{answered:,} of the dead letters set aside already answered (a result line for "
            "the item too), so not run")
    return f"{note[:-1]}; {said})" if note else f"  ({said})"


def _items_why(s: RunSummary) -> str:
    if s.read_to_line is not None and not s.work_left.not_reached:
        return _read_to_note(s, s.read_to_line)
    if s.left_out:
        return (f"  (dead letters only: {s.left_out:,} items no pass has run are left for the "
                "command below)")
    if s.dead_letters_only and s.retried and not s.input_read:
        return _retried_note(s)
    if s.limit is not None and s.input_read_before:
        return f"  (--limit {s.limit:,}: an earlier pass read the whole input)"
    if s.limit is not None:
        return f"  (--limit {s.limit:,}: the command below runs the rest of the input, if any)"
    if not s.input_read:
        return "  (read so far: the run stopped before the end of the input)"
    if s.items == 0 and s.skipped == 0:
        return "  (the input holds no records: is it the right file?)"
    if s.rejects and s.items == s.rejects and s.skipped == 0 and not s.prior_rejects:
        # A TSV read as JSON lines, a wrong prompt_field: as validate says it, so does the run.
        return ("  (every line was rejected, nothing was sent: is it the right file, in the "
                "input.format and fields the job names?)")
    return ""


def _read_to_note(s: RunSummary, line: int) -> str:
    """A pass of dead letters only that read its input up to the last of them, and no line
    after it: what no pass has run is not counted there (that took reading all of it), but
    said to be left for --resume, unless an earlier pass read the whole input."""
    last = f"the last is on line {line:,}, and no line after it was read"
    if s.input_read_before:
        return f"  (dead letters only: {last}: an earlier pass ran the items there)"
    if s.left_out:
        return (f"  (dead letters only: {last}; {s.left_out:,} items no pass has run lie before "
                "it: the command below runs them and those after it)")
    return f"  (dead letters only: {last}: the command below runs the items no pass has run)"


def _retried_note(s: RunSummary) -> str:
    """A pass of dead letters only that stopped before its input's end (--limit, a stop): what
    it took are dead letters, and those it did not reach are back in dead/ (the earlier
    failures below)."""
    why = "the pass stopped" if s.limit is None else f"--limit {s.limit:,} stopped the pass"
    if not (left := s.work_left.not_reached):
        if answered := s.work_left.answered:  # not taken: the note's next clause says why
            return (f"  (dead letters taken to retry: {s.retried - answered:,} of "
                    f"{s.retried:,} set aside)")
        return f"  (dead letters taken to retry: all {s.retried:,} set aside)"
    return f"  (dead letters taken to retry, of {s.retried:,}: {why} before the other {left:,})"


CLOCK_FROM_S = 600.0
"""Shortest wall time also shown as a clock reads: a run of a million items lasts hours, and
'50,000.0 s' alone asks the reader to divide."""


def _as_clock(wall_s: float) -> str:
    return f" ({clock_text(wall_s)})" if wall_s >= CLOCK_FROM_S else ""


CORES_MIN_WALL_S = 5.0
"""Shortest run whose client CPU is shown as cores on average: the CPU counts the processes'
start-up (imports, forking the shards), which comes before the run's wall time starts, so a
run of a second would read as more cores than the machine has."""


def _cpu_line(cpu_s: float, attempts: int, wall_s: float) -> str:
    per = f"{cpu_s / attempts * 1e3:,.2f} ms per attempt" if attempts else ""
    cores = f"{cpu_s / wall_s:.2f} cores on average" if wall_s >= CORES_MIN_WALL_S else ""
    detail = ", ".join(part for part in (per, cores) if part)
    return f"  client CPU         {cpu_s:,.1f} s" + (f"  ({detail})" if detail else "")


SHOWN_REASONS = 3


def _retry(s: RunSummary) -> str:
    """The command that gives dead letters another pass (with this pass's carried flags)."""
    return s.retry_command or f"shardrun retry-failed {s.run_dir}"


def _failure_lines(s: RunSummary) -> list[str]:
    """Why items failed (the commonest kinds, each with its first reason) and where they are."""
    ranked = sorted(s.dead_reasons.items(), key=lambda kv: (-kv[1][0], kv[0]))
    # Dead letters a shard wrote but could not report (it died, or the disk filled up) were
    # counted from its files; their reasons are in those lines only.
    unreported = s.dead - sum(n for n, _ in s.dead_reasons.values())
    width = len(f"{max([n for _, (n, _) in ranked] + [unreported, 0]):,}")
    # A fourth kind alone takes the line that "other reasons" would, and says what it is.
    shown = len(ranked) if len(ranked) == SHOWN_REASONS + 1 else SHOWN_REASONS
    lines = [f"    {count:>{width},}  {ellipsize(' '.join(example.split()), 100)}"
             for _, (count, example) in ranked[:shown]]
    if len(ranked) > shown:
        rest = sum(n for _, (n, _) in ranked[shown:])
        lines.append(f"    {rest:>{width},}  other reasons ({len(ranked) - shown} kinds; "
                     f"shardrun report {s.run_dir})")
    if unreported > 0:
        lines.append(f"    {unreported:>{width},}  reason in the dead-letter lines (written by a "
                     "shard that could not report them)")
    if s.dead:
        lines.append(f"  dead letters       {s.run_dir / 'dead'}/  (another pass: {_retry(s)})")
    if s.rejects and s.rejects_file is not None:
        lines.append(f"  rejected lines     {s.rejects_file}")
    return lines

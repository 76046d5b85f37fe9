"""An experimental vectorised reader for one shard's event file (polars), off by default.

`fold_shard_file_vector` reads the file in the same chunks as `_scan.scan_file`, hashes and
checks checkpoints with the same `_Hasher`, parses each chunk with `polars.read_ndjson` into
the columns the report needs (explicit schema: a value of another type is an error, not a
guess), and computes the `ShardSummary` that `ShardFold` would compute, with column operations.

The pure-Python `ShardFold` stays the reference. This path returns None (and the caller folds
the file the reference way) whenever the file is outside what it handles exactly: polars is
missing, the options ask for line hashes, minutes only or a plot trace, a line does not parse
or has a field of an unexpected type, a field an event needs is missing, an integer `t`, more
than one `shard_start` (or not on line 1), a span whose lines fall outside its
`queued`..`released` lifetime or that is queued or released twice, too many dead reasons.
Floating-point sums are taken in the reference's order (sequential for the scheduler and rate
waits; the same 4,096-span batches, sorted, for the distributions), so the numbers are equal,
not merely close. Memory: the parsed columns of the whole file (about 0.6 × its size).
"""

from __future__ import annotations

import io
import operator
import os
import re
import sys
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardrun.aggregate import ShardSummary
from shardrun.aggregate._minutes import MinuteCell
from shardrun.aggregate._segments import FLUSH_AT, PENDING, TPOT, Segment
from shardrun.aggregate._shard import MAX_TRACKED_REASONS
from shardrun.aggregate._summary import reason_key
from shardrun.report._scan import CHUNK, FileScan, _Hasher

if TYPE_CHECKING:
    import polars as pl


HANDLED = ("shard_start", "queued", "admitted", "attempt_start", "conn_ready", "first_token",
           "last_token", "attempt_end", "retry", "released", "rate_wait", "loop_lag",
           "checkpoint", "shard_end")
STATE_EVENTS = ("queued", "admitted", "attempt_start", "conn_ready", "first_token",
                "last_token", "attempt_end", "released")
SEEN_EVENTS = ("shard_start", "shard_end", "loop_lag", "checkpoint")
INT_T = re.compile(rb'"t":-?[0-9]+[,}]')


def _schema() -> dict[str, Any]:
    import polars as pl

    return {
        "ev": pl.String, "t": pl.Float64, "span": pl.String, "attempt": pl.Int64,
        "status": pl.String, "completion_tokens": pl.Int64, "prompt_tokens": pl.Int64,
        "wasted_tokens": pl.Int64, "reused": pl.Boolean, "prompt_chars": pl.Int64,
        "outcome": pl.String, "reason": pl.String, "cause": pl.String, "lag": pl.Float64,
        "wait": pl.Float64, "cap": pl.Int64, "pid": pl.Int64, "host": pl.String,
        "shard": pl.Int64, "itl_hist": pl.String,
    }  # fmt: skip


class _Unsupported(Exception):
    """The file is outside what this path reproduces exactly: fold it the reference way."""


def fold_shard_file_vector(path: Path, rel: str, idle_until: float,
                           cap: int) -> tuple[FileScan, ShardSummary] | None:
    """`fold_shard_file` for a full report (no trace, no line hashes), or None to fall back."""
    if "polars" not in sys.modules:  # one thread each: the worker processes are the parallelism
        os.environ.setdefault("POLARS_MAX_THREADS", "1")
    try:
        import polars  # noqa: F401
    except ImportError:
        return None
    try:
        scan, df = _read(path, rel)
        return scan, _fold(df, idle_until, cap, scan)
    except _Unsupported:
        return None


def _read(path: Path, rel: str) -> tuple[FileScan, pl.DataFrame]:
    import polars as pl

    schema = _schema()
    scan = FileScan(rel)
    hasher = _Hasher(scan)
    frames: list[pl.DataFrame] = []
    carry = b""
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            data = carry + block if carry else block
            cut = data.rfind(b"\n") + 1
            carry = data[cut:]
            if cut:
                body = data[:cut]
                hasher.body(body, scan.lines, scan.bytes)
                n = body.count(b"\n")
                frames.append(_parse(body, n, scan.lines, schema))
                scan.lines += n
                scan.bytes += cut
    hasher.sha.update(carry)
    scan.bytes += len(carry)
    scan.torn_tail_bytes = len(carry)
    scan.sha256 = hasher.sha.hexdigest()
    if not frames:
        raise _Unsupported
    return scan, pl.concat(frames)


def _parse(body: bytes, n: int, base: int, schema: dict[str, Any]) -> pl.DataFrame:
    import polars as pl

    if body.startswith(b"\n") or b"\n\n" in body:
        raise _Unsupported
    try:
        df = pl.read_ndjson(io.BytesIO(body), schema=schema)
    except Exception as exc:  # polars raises several types for a line it cannot take
        raise _Unsupported from exc
    if df.height != n:  # a blank or whitespace line: the reference counts it as bad
        raise _Unsupported
    t = df["t"]
    if (t == t.floor()).any() and INT_T.search(body):  # an integer `t` stays an int there
        raise _Unsupported
    return df.with_columns(pl.int_range(base, base + n, dtype=pl.Int64).alias("row"))


def _seq(values: pl.Series, start: float = 0.0) -> float:
    """`start + v0 + v1 + ...` left to right, as the reference's `+=` loop adds them."""
    return float(reduce(operator.add, values.to_list(), start))


def _fold(df: pl.DataFrame, idle_until: float, cap: int, scan: FileScan) -> ShardSummary:
    ev = df["ev"]
    if ev.null_count():
        raise _Unsupported
    handled = ev.is_in(HANDLED)
    scan.unknown_events = int((~handled).sum())
    t = df["t"]
    if t.filter(handled).null_count():
        raise _Unsupported
    s = ShardSummary()
    starts = (ev == "shard_start").arg_true().to_list()
    if starts != [0]:
        raise _Unsupported
    head = df.row(0, named=True)
    s.shard, s.pid, s.host = head["shard"], head["pid"], head["host"]
    s.cap = int(head["cap"] or cap)
    s.starts = 1
    s.ended = bool((ev == "shard_end").any())
    seen = ev.is_in(SEEN_EVENTS)
    s.first_t = float(t.filter(seen).min())  # type: ignore[arg-type]
    s.last_t = float(t.filter(seen | (ev == "released")).max())  # type: ignore[arg-type]
    s.queued = int((ev == "queued").sum())
    parts = _Parts(df)
    _counters(parts, s)
    _scheduler(df, s, idle_until)
    _spans(df, s)
    return s


class _Parts:
    """The rows of each event, split once."""

    def __init__(self, df: pl.DataFrame) -> None:
        self.by_ev = {k[0]: v for k, v in df.partition_by("ev", as_dict=True).items()}
        self.empty = df.clear()

    def __call__(self, ev: str) -> pl.DataFrame:
        return self.by_ev.get(ev, self.empty)


def _counters(parts: _Parts, s: ShardSummary) -> None:
    import polars as pl

    lags = parts("loop_lag")["lag"]
    if lags.null_count():
        raise _Unsupported
    for x in lags.to_list():
        s.loop_lag.add(max(0.0, float(x)))

    starts = parts("attempt_start")
    s.attempts = starts.height
    s.first_attempts = int((starts["attempt"] == 1).fill_null(False).sum())
    conns = parts("conn_ready")["reused"].fill_null(False)
    s.reused_conns = int(conns.sum())
    s.new_conns = len(conns) - s.reused_conns

    ends = parts("attempt_end")
    if ends.filter(pl.col("status") == "ok")["span"].null_count():
        raise _Unsupported
    for status, n in ends.group_by("status", maintain_order=True).len().iter_rows():
        s.by_status[status] = n
    s.wasted_tokens = int(ends["wasted_tokens"].fill_null(0).sum())
    s.prompt_tokens = int(ends["prompt_tokens"].fill_null(0).sum())

    waits = parts("rate_wait")
    if waits["wait"].null_count():
        raise _Unsupported
    s.rate_waits = waits.height
    first = (waits["attempt"] == 1).fill_null(False)
    s.rate_wait_first_s = _seq(waits["wait"].filter(first))
    s.rate_wait_retry_s = _seq(waits["wait"].filter(~first))

    retries = parts("retry")
    for cause_raw, rt in zip(retries["cause"].to_list(), retries["t"].to_list(), strict=True):
        cause = str(cause_raw)
        s.retries[cause] = s.retries.get(cause, 0) + 1
        per_minute = s.retry_minutes.setdefault(int(rt // 60), {})
        per_minute[cause] = per_minute.get(cause, 0) + 1

    rel = parts("released")
    if rel["span"].null_count():
        raise _Unsupported
    outcome = rel["outcome"]
    s.abandoned = int((outcome == "abandoned").fill_null(False).sum())
    dead = rel.filter(pl.col("outcome") == "dead")["reason"].to_list()
    s.dead = len(dead)
    ok = int((outcome == "ok").fill_null(False).sum())
    s.other_outcomes = rel.height - s.abandoned - s.dead - ok
    for reason in dead:
        key = reason_key(reason)
        if key not in s.dead_reasons and len(s.dead_reasons) >= MAX_TRACKED_REASONS:
            raise _Unsupported
        s.dead_reasons[key] = s.dead_reasons.get(key, 0) + 1


def _scheduler(df: pl.DataFrame, s: ShardSummary, idle_until: float) -> None:
    """The step function of `_steps.Scheduler`, integrated with column operations.

    Row i of `m` is the i-th move plus, last, the final `advance(last_t)` (a move that changes
    nothing); `last` is the time integrated up to before it, `q` and `f` the state before it.
    """
    import polars as pl

    c, e = pl.col, pl.col("ev")
    t0 = float(df["t"][0])
    end = s.last_t if s.last_t is not None else t0
    moves = df.slice(1).filter(e.is_in(("queued", "admitted", "released"))).select(
        "t",
        dq=(e == "queued").cast(pl.Int64) - (e == "admitted").cast(pl.Int64),
        df=(e == "admitted").cast(pl.Int64) - (e == "released").cast(pl.Int64),
    )
    tail = pl.DataFrame({"t": [end], "dq": [0], "df": [0]},
                        schema={"t": pl.Float64, "dq": pl.Int64, "df": pl.Int64})
    m = pl.concat([moves, tail]).with_columns(
        last=c("t").shift(1, fill_value=t0).cum_max().clip(lower_bound=t0),
        q=c("dq").cum_sum().shift(1, fill_value=0),
        f=c("df").cum_sum().shift(1, fill_value=0),
    )
    step = c("t") > c("last")
    busy = step & (c("q") > 0)
    idle = step & (c("q") <= 0) & (c("f") <= 0) & (c("last") < idle_until)
    dt = c("t") - c("last")
    s.backlog_s = _seq(m.filter(busy).select(dt).to_series())
    s.gap_s = _seq(m.filter(busy & (c("f") < s.cap)).select(dt).to_series())
    s.idle_s = _seq(m.filter(idle).select(
        pl.min_horizontal(c("t"), pl.lit(idle_until)) - c("last")).to_series())
    s.queue_depth = int(moves["dq"].sum())
    s.in_flight = int(moves["df"].sum())


def _spans(df: pl.DataFrame, s: ShardSummary) -> None:
    import polars as pl

    c, e = pl.col, pl.col("ev")
    ok_end = (e == "attempt_end") & (c("status") == "ok")
    sp = df.filter(e.is_in(STATE_EVENTS) & ((e != "attempt_end") | ok_end.fill_null(False)))
    if sp["span"].null_count():
        raise _Unsupported

    def at(col: str, ev: str) -> pl.Expr:
        return c(col).filter(e == ev)

    g = sp.group_by("span").agg(
        nq=(e == "queued").sum(), nr=(e == "released").sum(),
        qrow=at("row", "queued").first(), rrow=at("row", "released").first(),
        minrow=c("row").min(), maxrow=c("row").max(),
        q=at("t", "queued").first(), pc=at("prompt_chars", "queued").first(),
        a=at("t", "admitted").last(),
        st=at("t", "attempt_start").last(), srow=at("row", "attempt_start").last(),
        cn=at("t", "conn_ready").last(), crow=at("row", "conn_ready").last(),
        ft=at("t", "first_token").last(), frow=at("row", "first_token").last(),
        lt=at("t", "last_token").last(), la=at("attempt", "last_token").last(),
        has_la=(e == "last_token").any(),
        et=at("t", "attempt_end").last(), etok=at("completion_tokens", "attempt_end").last(),
        ept=at("prompt_tokens", "attempt_end").last(), eatt=at("attempt", "attempt_end").last(),
        erow=at("row", "attempt_end").last(), itl=at("itl_hist", "attempt_end").last(),
        rt=at("t", "released").first(), outcome=at("outcome", "released").first(),
    )  # fmt: skip
    bad = g.filter((c("nq") != 1) | (c("qrow") != c("minrow")) | (c("nr") > 1)
                   | ((c("nr") == 1) & (c("rrow") != c("maxrow"))))
    if bad.height:
        raise _Unsupported
    s.open_spans = int((g["nr"] == 0).sum())
    ok = g.filter((c("nr") == 1) & (c("outcome") == "ok")).sort("rrow")
    s.ok_without_attempt = int(ok["erow"].is_null().sum())
    ok = ok.filter(c("erow").is_not_null())
    if ok.height == 0:
        return
    # the final attempt's last_token when it is that attempt's (`span[LA] == attempt`, where
    # two missing attempts are equal too), else the attempt_end
    same = (c("la") == c("eatt")).fill_null(False) | (c("la").is_null() & c("eatt").is_null())
    ok = ok.with_columns(last=pl.when(c("has_la") & same).then(c("lt")).otherwise(c("et")),
                         tokens=c("etok").fill_null(0))
    s.ok = ok.height
    s.completion_tokens = int(ok["tokens"].sum())
    # int(last // 60) as Python computes it: the true floor, which last / 60 may round past
    m = (c("last") / 60).floor().cast(pl.Int64)
    m = pl.when(m.cast(pl.Float64) * 60 > c("last")).then(m - 1).otherwise(m)
    cells = ok.group_by(m.alias("m")).agg(c("tokens").sum(), pl.len()).sort("m")
    s.minutes = {mm: MinuteCell(tok, n, 0, None) for mm, tok, n in cells.iter_rows()}

    full = ok.filter(c("a").is_not_null() & c("st").is_not_null())
    s.ok_incomplete = ok.height - full.height
    if full.height == 0:
        return
    n_tok = pl.when(c("ept").is_null()).then(-((-c("pc").fill_null(0)) // 4)).otherwise(c("ept"))
    cn = pl.when((c("crow") > c("srow")).fill_null(False)).then(c("cn")).otherwise(c("st"))
    ft = pl.when((c("frow") > c("srow")).fill_null(False)).then(c("ft")).otherwise(c("last"))
    full = full.with_columns(n_tok=n_tok, cn2=cn, ft2=ft)
    q, a, st, cn, ft = c("q"), c("a"), c("st"), c("cn2"), c("ft2")
    last, rt = c("last"), c("rt")
    seg = (pl.when(c("n_tok") < 64).then(0).when(c("n_tok") < 256).then(1)
           .when(c("n_tok") < 1024).then(2).when(c("n_tok") < 4096).then(3)
           .when(c("n_tok") < 16384).then(4).otherwise(5))
    vals = full.select(
        seg=seg, itl=c("itl"), v0=a - q, v1=st - a, v2=cn - st, v3=ft - cn, v4=last - ft,
        v5=rt - last, v6=ft - q, v7=ft - st, v8=rt - q,
        tpot=pl.when(c("tokens") >= 2).then((last - ft) / (c("tokens") - 1)),
    )  # fmt: skip
    order = list(dict.fromkeys(vals["seg"].to_list()))  # in order of first appearance
    names = [f"v{k}" for k in range(len(PENDING))]
    for i in order:
        mine = vals.filter(c("seg") == i)
        segment = s.segments[i] = Segment()
        segment.spans = mine.height
        for lo in range(0, mine.height, FLUSH_AT):
            chunk = mine.slice(lo, FLUSH_AT)
            for j, name in zip(PENDING, names, strict=True):
                segment.dists[j].add_many(chunk[name].to_list())
            segment.dists[TPOT].add_many(chunk["tpot"].drop_nulls().to_list())
    _itl(vals, s)


def _itl(vals: pl.DataFrame, s: ShardSummary) -> None:
    """Merge the final attempts' `itl_hist` into their segments' counts, keys in order of
    first appearance (as the reference's dict inserts them)."""
    import polars as pl

    c = pl.col
    hists = vals.select("seg", "itl").filter(c("itl").is_not_null() & (c("itl") != "{}"))
    if hists.height == 0:
        return
    pairs = hists.with_columns(
        kv=c("itl").str.extract_all(r'"[^"]*": ?-?[0-9]+'),
        colons=c("itl").str.count_matches(":"),
    )
    if (pairs["kv"].list.len() != pairs["colons"]).any():
        raise _Unsupported  # a key or count of another shape: leave it to the reference
    flat = pairs.select("seg", "kv").explode("kv").select(
        "seg",
        key=c("kv").str.extract(r'^"([^"]*)"', 1),
        n=c("kv").str.extract(r"(-?[0-9]+)$", 1).cast(pl.Int64),
    )
    merged = flat.group_by("seg", "key", maintain_order=True).agg(c("n").sum())
    for seg, key, n in merged.iter_rows():
        counts = s.segments[seg].itl
        counts[key] = counts.get(key, 0) + n

"""`CoordinatorFold`: the coordinator's own log (`events/coordinator.jsonl`). Pure.

It matters for four numbers: the run's first and last instants (which minutes are full), the
instant of `input_end` (before it, an idle shard is cross-shard idle), how the run ended and the
client's CPU time that `run_end` records.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardrun.aggregate._summary import CoordinatorSummary


class CoordinatorFold:
    """Feed the coordinator's records in file order, then read `summary`."""

    def __init__(self) -> None:
        self.summary = CoordinatorSummary()

    def feed(self, rec: Mapping[str, Any], raw: bytes = b"") -> None:
        s = self.summary
        ev, t = rec.get("ev"), rec.get("t")
        if isinstance(t, int | float):
            s.first_t = t if s.first_t is None else min(s.first_t, t)
            s.last_t = t if s.last_t is None else max(s.last_t, t)
        if ev == "run_start":
            s.run_start = t
            s.shards = rec.get("shards")
            s.cap = rec.get("cap")
        elif ev == "batch":
            s.batches += 1
            to = int(rec.get("to") or 0)
            s.handed[to] = s.handed.get(to, 0) + int(rec.get("n") or 0)
        elif ev == "input_end":
            s.input_end = t
            s.input_lines = rec.get("lines")
            s.rejects = rec.get("rejects")
        elif ev == "shard_exit":
            s.shard_exits[int(rec.get("to") or 0)] = str(rec.get("status"))
        elif ev == "run_end":
            s.run_end = t
            s.run_status = rec.get("status")
            cpu = rec.get("client_cpu_s")
            if isinstance(cpu, int | float) and not isinstance(cpu, bool) and cpu >= 0:
                s.client_cpu_s = float(cpu)
            elif isinstance(why := rec.get("client_cpu_unknown"), str):
                s.client_cpu_unknown = why
            if isinstance(cause := rec.get("stopped_by"), str):
                s.stopped_by = cause

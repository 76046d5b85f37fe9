"""A shard's scheduler state as an exact step function, integrated while the log streams past.

Queue depth and in_flight change only at `queued` (+1 queue), `admitted` (-1 queue, +1 in
flight) and `released` (-1 in flight), so between two such events they are constant and every
time integral below is exact: no sampling.

    backlog_s    time with queue depth > 0
    gap_s        time with queue depth > 0 and in_flight < cap     (gap_fraction = gap / backlog)
    busy_slot_s  integral of in_flight (counted from 0 up to cap) over the backlog time
    cap_slot_s   integral of cap over the backlog time    (occupancy_under_backlog = busy / cap)
    idle_s       time with queue depth = 0 and in_flight = 0, before the coordinator's
                 `input_end` (it still held unassigned work then: cross-shard idle)
    sending_slot_s  integral of the requests out (from `attempt_start` to `attempt_end`, up
                 to cap) over the backlog time: a slot whose item waits for its retry (a
                 backoff, a storm's or an outage's hold) is in flight, but sends nothing

`StepTrace` keeps the change points for plots: exactly, up to `TRACE_LIMIT` points per shard;
past that, per-second envelopes (max queue, min and max in_flight), so memory stays bounded by
the run's duration rather than its number of spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TRACE_LIMIT = 50_000


@dataclass(slots=True)
class StepTrace:
    """Change points `(t, queue, in_flight)`, or per-second `[q_max, f_min, f_max]` envelopes."""

    points: list[tuple[float, int, int]] = field(default_factory=list)
    bins: dict[int, list[int]] | None = None

    def add(self, t: float, q: int, f: int) -> None:
        if self.bins is None:
            self.points.append((t, q, f))
            if len(self.points) > TRACE_LIMIT:
                self._coarsen()
            return
        _bin(self.bins, t, q, f)

    def _coarsen(self) -> None:
        bins: dict[int, list[int]] = {}
        for t, q, f in self.points:
            _bin(bins, t, q, f)
        self.bins = bins
        self.points = []

    @property
    def exact(self) -> bool:
        return self.bins is None


def _bin(bins: dict[int, list[int]], t: float, q: int, f: int) -> None:
    sec = math.floor(t)
    env = bins.get(sec)
    if env is None:
        bins[sec] = [q, f, f]
        return
    env[0] = max(env[0], q)
    env[1] = min(env[1], f)
    env[2] = max(env[2], f)


class Scheduler:
    """Queue depth and in_flight of one shard, with their time integrals."""

    __slots__ = ("backlog", "busy_slots", "cap", "cap_slots", "f", "gap", "idle", "idle_until",
                 "last", "o", "q", "sending_slots", "sent_last", "trace")

    def __init__(self, cap: int, idle_until: float, trace: StepTrace | None = None) -> None:
        self.cap = cap
        self.idle_until = idle_until
        self.trace = trace
        self.q = 0
        self.f = 0
        self.last: float | None = None
        self.backlog = 0.0
        self.gap = 0.0
        self.busy_slots = 0.0
        self.cap_slots = 0.0
        self.idle = 0.0
        # Requests out, integrated on a clock of their own (`sending`), so that the other
        # integrals are cut at the scheduler's events alone, as before.
        self.o = 0
        self.sent_last: float | None = None
        self.sending_slots = 0.0

    def restart(self, t: float, cap: int) -> None:
        """A (re)started shard process: empty queue, nothing in flight, observed from `t`."""
        self.cap = cap
        self.q = 0
        self.f = 0
        self.last = t
        self.o = 0
        self.sent_last = t
        if self.trace is not None:
            self.trace.add(t, 0, 0)

    def advance(self, t: float) -> None:
        """Integrate the current state up to `t` (a `t` in the past changes nothing)."""
        self.move(t, 0, 0, record=False)

    def move(self, t: float, dq: int, df: int, *, record: bool = True) -> None:
        """A scheduler event at `t`: integrate up to it, then apply the change."""
        self._send_to(t)
        last = self.last
        if last is not None and t > last:
            if self.q > 0:
                dt = t - last
                self.backlog += dt
                cap = max(self.cap, 0)
                self.cap_slots += cap * dt
                self.busy_slots += min(max(self.f, 0), cap) * dt
                if self.f < self.cap:
                    self.gap += dt
            elif self.f <= 0 and last < self.idle_until:
                self.idle += min(t, self.idle_until) - last
            self.last = t
        elif last is None:
            self.last = t
        self.q += dq
        self.f += df
        if record and self.trace is not None:
            self.trace.add(t, self.q, self.f)

    def sending(self, t: float, do: int) -> None:
        """An attempt started (+1) or ended (-1) at `t`."""
        self._send_to(t)
        self.o += do

    def _send_to(self, t: float) -> None:
        last = self.sent_last
        if last is not None and t > last:
            if self.q > 0:
                self.sending_slots += min(max(self.o, 0), max(self.cap, 0)) * (t - last)
            self.sent_last = t
        elif last is None:
            self.sent_last = t

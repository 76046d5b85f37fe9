"""A shard's three output files and the rule that makes re-assignment safe.

An item counts as finished for the coordinator only once its line has been handed to the OS:
ids go into `fin_*` when their line is written to the buffer, and leave in a report only after
a successful flush. Nothing reaches the files between flushes, and a flush writes the event log
before the results and dead letters, so a line the OS holds has its events there too (unless
the event log's write failed: a full disk), whatever kills the process. The fsyncs come after
all three writes (and after the report that follows them, `sync`), so after a power cut a
results line may have reached the disk without its events; a resume still counts its item once
(by the results line). A write or flush that fails calls `on_error` and keeps those ids back,
so the coordinator still holds their items.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardrun.events import EventLog, JsonlWriter
from shardrun.shard_config import ShardConfig

OnError = Callable[[Path, OSError], None]


class ShardOutput:
    """events/, results/ and dead/ files of one shard in one pass."""

    def __init__(self, cfg: ShardConfig, on_error: OnError) -> None:
        out = Path(cfg.out_dir)
        for sub in ("events", "results", "dead"):
            (out / sub).mkdir(parents=True, exist_ok=True)
        self.log = EventLog(out / "events" / cfg.file_name, run_id=cfg.run_id, shard=cfg.shard)
        self.results = JsonlWriter(out / "results" / cfg.file_name)
        self.dead = JsonlWriter(out / "dead" / cfg.file_name)
        self.on_error = on_error
        self.fin_ok: list[str] = []
        self.fin_dead: list[str] = []

    def add_result(self, item_id: str, record: dict[str, Any]) -> bool:
        return self._add(self.results, self.fin_ok, item_id, record)

    def add_dead(self, item_id: str, record: dict[str, Any]) -> bool:
        return self._add(self.dead, self.fin_dead, item_id, record)

    def _add(self, writer: JsonlWriter, fin: list[str], item_id: str,
             record: dict[str, Any]) -> bool:
        try:
            writer.write(record)
        except OSError as exc:
            self.on_error(writer.path, exc)
            return False
        fin.append(item_id)
        return True

    def flush(self, *, sync: bool = False) -> bool:
        """Hand buffered lines to the OS (and fsync when `sync`); False if a write failed.

        Lines that may not have reached their file must not count as finished, so a failing
        results or dead-letter file keeps back its own ids; the event log is not the record
        of completion and keeps back nothing.
        """
        # The event log first: a result line must not reach the file before its `released`
        # event, or a shard killed in between leaves an item that `report` counts as still
        # open. A kill between these very writes leaves the other way round, events of a line
        # not written: the item runs again elsewhere, and `report` counts both spans.
        writers = ((self.log, None), (self.results, self.fin_ok), (self.dead, self.fin_dead))
        failed = [w for w, fin in writers if not self._do(w.flush, w.path, fin)]
        # Every file has its lines before any fsync: an fsync takes milliseconds (tens on a
        # busy disk), and the event log's used to come before the results' write, so a kill
        # meanwhile left up to a flush's worth of answers unwritten whose events were on disk
        # (run again on resume, paid twice; 39 in one kill of scripts/soak_resume.py).
        if sync:
            failed += [w for w, fin in writers
                       if w not in failed and not self._do(w.sync, w.path, fin)]  # fmt: skip
        return not failed

    def sync(self) -> bool:
        """Fsync the three files; False if one failed. The ticker calls it after the report
        that follows a flush: the ids reported are handed to the OS, which is what finished
        means, and a shard killed in an fsync's milliseconds has reported every line it wrote
        (before, its last lines and failed attempts were in the files and the log but in no
        report, and the summary missed or, from `sending`, doubled some of their counts)."""
        return all([self._do(w.sync, w.path, None) for w in (self.log, self.results, self.dead)])

    def _do(self, step: Callable[[], None], path: Path, fin: list[str] | None) -> bool:
        try:
            step()
        except OSError as exc:
            self.on_error(path, exc)
            if fin is not None:
                fin.clear()
            return False
        return True

    def take_finished(self) -> tuple[list[str], list[str]]:
        """Ids whose lines are flushed since the last call: (results, dead letters)."""
        ok, dead = self.fin_ok, self.fin_dead
        self.fin_ok, self.fin_dead = [], []
        return ok, dead

    def close(self) -> None:
        self.flush(sync=True)
        for writer in (self.log, self.results, self.dead):
            with contextlib.suppress(OSError):
                writer.close()

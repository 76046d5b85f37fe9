"""Where shards' work comes from: the input, minus what is already done, plus re-queued items.

Items taken from a shard that died come back first. Duplicate ids and items finished by an
earlier pass of the run (resume) are skipped here, remembered as 8-byte digests in a flat
table (`DigestSet`), so that memory stays near 11-21 bytes per distinct id rather than the size
of the items.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import re
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from shardrun.digestset import DigestSet

if TYPE_CHECKING:
    # Imported where used instead: every shard imports this module (through resume.py, for
    # `id_digest`) but never reads input, and inputs.py brings csv and the tabular and
    # template parsers with it; export and validate import it and run no event loop.
    import asyncio

    from shardrun.inputs import InputReader, Reject


def id_digest(item_id: str) -> int:
    """A 64-bit digest of an item id (collisions are negligible below billions of ids)."""
    return int.from_bytes(hashlib.blake2b(item_id.encode(), digest_size=8).digest(), "little")


_DERIVED_ID = re.compile(r"h[0-9a-f]{20}")  # `inputs._item_id` of a record without an id


def derived(item_id: str) -> bool:
    """Whether an id is one `inputs._item_id` derived from a record's content (it has no id)."""
    return _DERIVED_ID.fullmatch(item_id) is not None


ID_CHECK_ITEMS = 100
"""Items a pass reads, none with the job's named id field, before it warns of that field."""


def id_field_warning(id_field: str, first: int | None = None) -> str:
    """The warning for a named id field (input.id_field) no record read has: all the input's
    (`validate`), or the `first` a run read (it warns as it starts, not at its end)."""
    field = f"input.id_field '{id_field}'"
    said = (f"no record has {field}: every item's id is derived from its content" if first is None
            else f"none of the first {first:,} records has {field}: their ids are derived from "
                 "their content")  # fmt: skip
    return f"{said}, and results will not carry the input's own ids; check the field's name"


def duplicate_reason(item_id: str) -> str:
    if derived(item_id):
        # The user never wrote this id: say what it is and how to run such records each.
        return ("the same content as an earlier line, and no id: a record without one is "
                "named by its content, so give each record an id (input.id_field) to have "
                "repeats answered each")
    return f"duplicate id {item_id!r} (an earlier line has it)"


def fair_share(asked: int, left: int, holds: int, held: int, shards: int) -> int:
    """How many items a shard that asks for `asked` gets when only `left` are left to hand out.

    `holds` is what this shard holds (handed out, not yet reported finished), `held` what all
    `shards` running shards hold together, this one included. The aim is that every shard ends
    up holding an even part of the work still to do, so that the last items never wait in one
    shard's queue while another shard has free slots: a small job would otherwise land on the
    first shards to ask, and every job's last stretch would queue behind a few shards.
    A shard that already holds its part still gets one item: every request is answered with
    items or with the end of the input, which keeps the protocol free of waiting states.
    """
    # Rounded down: the remainder (fewer items than shards) goes out one at a time to whoever
    # asks next, rather than as an extra item each to the first askers, leaving the last none.
    part = (left + held) // max(1, shards)
    return max(1, min(asked, left, part - holds))


SKIP_SLICE_LINES = 5_000
"""Input lines `WorkSource.fill` reads between yields to its event loop: about 20 ms."""

SETTLE_LINES = 50_000
"""Input lines a hand-out's read ahead goes on for, once it holds an item, before it settles for
what it found: about 0.2 s. Reading ahead until the look-ahead was full (up to 4,096 items) kept a
sparse pass's shards idle while it read: a retry of a few dead letters among ten million lines
sent nothing until it had read them all."""


class WorkSource:
    """Hands out items in input order, re-queued items first.

    It can read a bounded stretch of the input ahead of what it hands out (`remaining`), so that
    the coordinator knows when the input is about to run out and can split what is left evenly.
    With a `limit` it takes at most that many new items from the input and reads no line past
    the last of them: for this pass the input ends there (`limit_reached`, unless the reader
    knows that nothing follows), and a resume runs the rest. With `only` it takes just the
    items whose id digests it holds and counts the others it passes over (`left_out`); once it
    has found them all, the input ends there too (`rest_unread`), unless `read_past_only`.
    """

    def __init__(self, reader: InputReader, rejects_path: Path,
                 done: DigestSet | None = None, limit: int | None = None,
                 only: DigestSet | None = None, *, judged_lines: int = 0,
                 record_rejects: bool = True, retrying: DigestSet | None = None,
                 on_record: DigestSet | None = None, read_past_only: bool = False) -> None:
        self.reader = reader
        # A None for each blank line: `fill`'s budget counts the lines it passes over too.
        self._items: Iterator[dict[str, Any] | Reject | None] = reader.entries(blanks=True)
        self._requeued: deque[dict[str, Any]] = deque()
        # Read and accepted, not handed out yet; each with whether it is a dead letter being
        # retried (`retrying`), known where its digest is computed, so nothing hashes it again.
        self._ahead: deque[tuple[dict[str, Any], bool]] = deque()
        self._read_all = False  # the input iterator has ended
        self._unyielded = 0  # entries `fill` read since it last yielded to the event loop
        self._filling: asyncio.Lock | None = None  # made by the first `fill`
        self._settled = False  # the last read settled for the items it found (`fill`)
        self._seen = DigestSet()
        self._done = DigestSet() if done is None else done
        self._only = only
        # The items of `only` not found yet: at none, no later line can hold one of them. A
        # retry of the dead letters of a --limit trial read the millions of lines after its
        # last one only to count what no pass has run, its shards idle for 40 % of the pass.
        self._to_find = None if read_past_only else only
        self._unfound = 0 if only is None else len(only)
        self.rest_unread = False  # every item of `only` found, and lines after the last unread
        self._rejects_path = rejects_path
        self._rejects_file: IO[bytes] | None = None  # opened at the first reject (`reject`)
        self._rejects_size = 0  # its size after the last whole reject written
        # Rejects of lines up to here are an earlier pass's record already: counted apart
        # (`prior_rejects`), not written again. A pass of dead letters only judges no line.
        self._judged_lines = judged_lines
        # Lines past those whose rejects a killed pass wrote: on record too, as earlier rejects.
        self._on_record = on_record
        self._record_rejects = record_rejects
        self.prior_rejects = 0
        self.on_input_end: Callable[[], None] | None = None  # called once, when input runs out
        self.exhausted = False  # every input item has been handed out
        self.limit = limit
        self.limit_reached = False  # the limit ended the input early (there may be more)
        self._accepted = 0  # new items read from the input
        self.taken = 0
        # Dead letters a retry pass set aside (`retrying`), and how many of them it took: one
        # it does not end goes back to dead/ (`resume.restore_unretried`), not to --resume.
        self._retrying = retrying
        self.taken_retried = 0
        self.skipped = 0
        self.left_out = 0  # items neither done nor in `only`: left for a later pass
        self.rejects = 0
        # The line of the first reject the rejects file had no room for (a full disk), if one
        # had none: the pass stopped there, and the lines it judged end before it
        # (`lines_judged`). The error is kept (`_failed`): from then on every read and every
        # reject raises it again, so that no line past the gap is read or written (another
        # shard's hand-out read on, and a shorter reject fit where the failed one did not).
        self._unrecorded: int | None = None
        self._failed: OSError | None = None
        # A named id field (not the default `id`, which a record may lack: its id is then
        # derived, as documented) that no item read so far has had: a typo gives every item a
        # derived id without a word (validate warns; a run did not). Warned of once, on stderr.
        plan = reader.fields
        self._id_field = (plan.id_field if plan.id_field != "id" and plan.format != "openai-batch"
                          else None)  # fmt: skip
        self._unnamed = 0  # items read, none with the named id field

    @property
    def rejects_path(self) -> Path:
        """Where this pass writes the input lines it sets aside."""
        return self._rejects_path

    @property
    def empty(self) -> bool:
        return self.exhausted and not self._requeued

    @property
    def read_to_end(self) -> bool:
        """Every item of the input has been handed out, none left unread."""
        return self.exhausted and not self.limit_reached and not self.rest_unread

    @property
    def ready(self) -> int:
        """Items read and waiting to be handed out, re-queued ones included."""
        return len(self._requeued) + len(self._ahead)

    def read_ahead(self, limit: int) -> bool:
        """Whether `limit` items wait to be handed out or the input has been read to its end:
        then `remaining(limit)` reads nothing."""
        return self._read_all or len(self._ahead) >= limit

    def remaining(self, limit: int) -> int | None:
        """How many items are left to hand out, if that is at most `limit`; else None.

        Reads ahead up to `limit` items to find out; they are handed out later, in order.
        What `fill` has not read ahead it reads in one piece (an event loop fills first)."""
        if not self._read_all and len(self._ahead) < limit:
            self._read(limit - len(self._ahead))
        if not self._read_all:
            return None
        left = len(self._requeued) + len(self._ahead)
        return left if left <= limit else None

    def take(self, n: int) -> list[dict[str, Any]]:
        """Up to `n` items; rejects go to rejects.jsonl on the way. What `fill` has not read
        ahead it reads in one piece (an event loop fills first)."""
        self._check_failed()
        batch: list[dict[str, Any]] = []
        while self._requeued and len(batch) < n:
            batch.append(self._requeued.popleft())
        fresh = len(batch)
        if len(self._ahead) < n - fresh and not self._read_all:
            self._read(n - fresh - len(self._ahead))
        while self._ahead and len(batch) < n:
            item, retried = self._ahead.popleft()
            batch.append(item)
            self.taken_retried += retried
        self.taken += len(batch) - fresh
        if self._read_all and not self._ahead and not self.exhausted:
            self.exhausted = True
            if self.on_input_end is not None:
                self.on_input_end()
        return batch

    async def fill(self, n: int, keep_going: Callable[[], bool] = lambda: True,
                   lines: int = SKIP_SLICE_LINES, settle: int | None = None) -> None:
        """Read ahead until `n` items wait to be handed out or the input has ended, while
        `keep_going()` (a stop ends the read: the items not reached are left for --resume).
        With `settle`, stop too once this call has read that many entries and an item waits
        (`SETTLE_LINES`): a sparse stretch is handed out as it is found.

        It reads at most `lines` input entries between yields to the event loop, counted over
        calls: where most lines hold no item to hand out (finished by an earlier pass, left
        out of a retry, rejected, duplicated) a read that reached `n` items in one piece held
        the coordinator's loop for about 3.5 us a line (3 s at 452,722 lines finished, a minute
        at ten million), the display frozen, the shards unanswered and Ctrl-C unheard. Then
        `take(n)` and `remaining(n)` hand out what was read, reading nothing themselves."""
        import asyncio

        if self._filling is None:
            self._filling = asyncio.Lock()
        # One fill reads at a time, the others waiting their turn: two that each read a slice
        # in one turn of the loop would hold it for both.
        self._check_failed()
        async with self._filling:
            self._check_failed()  # a fill that held the lock may have failed meanwhile
            if settle is not None and self._settled and self.ready:
                # What an earlier read settled for goes out first: reading another stretch for
                # each shard that asks kept the items found waiting (the last of ten dead
                # letters found in a retry's first lines went out after 250,000 more).
                return
            read_here = 0
            while not self._read_all and len(self._ahead) < n:
                if settle is not None and read_here >= settle and self.ready:
                    self._settled = True
                    return
                if self._unyielded >= lines:
                    await asyncio.sleep(0)
                    self._unyielded = 0
                    continue  # asked again: an earlier fill may have read the items
                if not keep_going():
                    return
                read = self._read(n - len(self._ahead), budget=lines - self._unyielded)
                self._unyielded += read
                read_here += read
            self._settled = False  # filled, or read to the end: not a sparse stretch now

    def _read(self, n: int, budget: int | None = None) -> int:
        """Append up to `n` new items from the input to `_ahead`, skipping rejects, duplicates
        and items an earlier pass finished; with a `budget`, reading at most that many entries
        (input lines, blank ones too). Returns how many it read."""
        from shardrun.inputs import Reject

        self._check_failed()
        into = self._ahead
        wanted = len(into) + n
        entries = self._items if budget is None else itertools.islice(self._items, budget)
        read = 0
        for entry in entries:
            read += 1
            if entry is None:  # a blank line
                continue
            if isinstance(entry, Reject):
                self.reject(entry)
                continue
            if self._id_field is not None:
                self._check_id(entry["id"])
            digest = id_digest(entry["id"])
            if not self._seen.add(digest):
                self.reject(Reject(self.reader.line, duplicate_reason(entry["id"]),
                                   entry["id"]))
                continue
            if digest in self._done:
                self.skipped += 1
                # One finished since it was dead-lettered is found all the same.
                if self._to_find is not None and digest in self._to_find and self._found():
                    return read
                continue
            if self._only is not None and digest not in self._only:
                self.left_out += 1
                continue
            into.append((entry, self._retrying is not None and digest in self._retrying))
            self._accepted += 1
            if self._accepted == self.limit:  # no line past the last item is read
                self._read_all = True
                self._ids_read_to(None)
                self.limit_reached = not self.reader.at_end()
                return read
            if self._to_find is not None and self._found():
                return read
            if len(into) >= wanted:
                return read
        if budget is not None and read == budget:
            return read  # the budget ran out, not the input (islice takes no entry past it)
        self._read_all = True
        self._ids_read_to(None)
        return read

    def _found(self) -> bool:
        """Note one more item of `only` found; once all are, for this pass the input ends here
        (True). What follows is read by the next pass that runs new work (--resume)."""
        self._unfound -= 1
        if self._unfound:
            return False
        self._read_all = True
        self._ids_read_to(None)
        self.rest_unread = not self.reader.at_end()
        return True

    def _check_id(self, item_id: str) -> None:
        """Note whether an item read has the named id field; warn at ID_CHECK_ITEMS without."""
        if not derived(item_id):
            self._id_field = None  # one record has it: no typo
            return
        self._unnamed += 1
        if self._unnamed == ID_CHECK_ITEMS:
            self._ids_read_to(ID_CHECK_ITEMS)

    def _ids_read_to(self, first: int | None) -> None:
        """Warn, once, that the items read so far (the `first` ones; None: all there are for
        this pass) lack the named id field, if they do."""
        if self._id_field is not None and self._unnamed:
            print(f"warning: {id_field_warning(self._id_field, first)}", file=sys.stderr)
        self._id_field = None

    def requeue(self, items: Iterable[dict[str, Any]]) -> None:
        """Give items back (their shard died before finishing them); served before new ones."""
        self._requeued.extend(items)

    def _check_failed(self) -> None:
        """Raise the error of the reject the rejects file had no room for, if one had none."""
        if self._failed is not None:
            raise self._failed

    def reject(self, reject: Reject) -> None:
        self._check_failed()
        if reject.line <= self._judged_lines or (
                self._on_record is not None and reject.line in self._on_record):
            self.prior_rejects += 1
            return
        if not self._record_rejects:  # a line for the pass that runs new work to judge
            return
        record = {"line": reject.line, "reason": reject.reason, "path": str(self.reader.path)}
        if reject.id is not None:  # the item the line names, though it did not become one
            record["id"] = reject.id
        try:
            # An open that fails (a directory in its place, no permission, no room to create
            # it) is a reject not written, as a write that fails is.
            self._write_reject(self._opened_rejects(), orjson.dumps(record) + b"\n")
        except OSError as exc:
            self._unrecorded = reject.line
            self._failed = exc
            raise
        self.rejects += 1  # counted once on disk

    def _opened_rejects(self) -> IO[bytes]:
        """The rejects file, opened at the first reject.

        Opened once, not per reject (a file of a million bad lines cost a million opens:
        108k lines/s against 375k for good ones), and unbuffered: each reject is on disk as
        soon as it is judged, as it was when each had its own open; a kill leaves no line half
        written by a buffer's flush."""
        if self._rejects_file is None:
            file = open(self._rejects_path, "ab", buffering=0)  # noqa: SIM115
            try:
                self._rejects_size = file.seek(0, os.SEEK_END)
            except BaseException:
                file.close()
                raise
            self._rejects_file = file
        return self._rejects_file

    @property
    def lines_judged(self) -> int:
        """The input lines read whose rejects are on record: all of them, unless a reject's
        write failed (a full disk), which stopped the pass; then those before its line, so
        that a resume judges that line again (`runner._lines_read_before`) rather than count a
        reject no file holds as an earlier pass's."""
        read = self.reader.lines_read
        return read if self._unrecorded is None else min(read, self._unrecorded - 1)

    def _write_reject(self, file: IO[bytes], line: bytes) -> None:
        """Write one reject's line whole, or raise with the file as it was. An unbuffered file's
        write may write part of the line and raise nothing (a full disk, a file size limit):
        the rest is written on, so that a short write raises where it cannot go on, and the
        file is cut back to its size before the line, so that it never holds a torn one."""
        view = memoryview(line)
        try:
            while view:
                wrote = file.write(view)
                if not wrote:
                    # A write of nothing (0, or None: a non-blocking file that would block)
                    # would be asked again forever: the line cannot go on.
                    code = errno.ENOSPC if wrote == 0 else errno.EAGAIN
                    raise OSError(code, "a write wrote nothing" if wrote == 0
                                  else os.strerror(code))
                view = view[wrote:]
        except OSError as exc:
            with contextlib.suppress(OSError):  # cut back if it can be; the error is the news
                file.truncate(self._rejects_size)
            if exc.filename is None:  # a write's error names no file: the sentence should
                raise OSError(exc.errno, exc.strerror, str(self._rejects_path)) from exc
            raise
        self._rejects_size += len(line)

    def close(self) -> None:
        """Close the input and the rejects file, at a pass's end (nothing is read after)."""
        try:
            self.reader.close()
        finally:
            if self._rejects_file is not None:
                self._rejects_file.close()
                self._rejects_file = None

"""A shard's open-file limit: every connection it keeps is a file descriptor.

Many machines start processes with a soft limit of 1,024 descriptors and a much higher hard
limit. A shard with a cap near that would run out of descriptors, and its connections would
fail as if the endpoint were down. So each shard raises its own soft limit to what its cap
needs, within the hard limit (no privilege needed), and an attempt that still fails for want
of a descriptor stops the run with the numbers (`OUT_OF_FILES`), instead of failing items.
"""

from __future__ import annotations

import errno
import resource

__all__ = [
    "FILES_BESIDES_CONNECTIONS",
    "OUT_OF_FILES",
    "coordinator_file_problem",
    "ensure_open_files",
    "out_of_files",
]

FILES_BESIDES_CONNECTIONS = 64
"""Descriptors a shard holds besides its connections: logs, results, pipes, the interpreter's."""
OUT_OF_FILES = "out_of_files"
"""`AttemptOutcome.error_code` of an attempt that failed for want of a file descriptor here."""


def ensure_open_files(cap: int) -> int:
    """Raise this process's soft open-file limit to what `cap` connections need, within the
    hard limit; the soft limit now (what a user would raise with `ulimit -n`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = cap + FILES_BESIDES_CONNECTIONS
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):  # a platform that refuses: keep what there is
        return soft
    return new


COORDINATOR_FILES_PER_SHARD = 5
"""The coordinator's descriptors per shard while it starts them: two pipes and a log file."""


def coordinator_file_problem(shards: int) -> str | None:
    """Raise the coordinator's own limit for `shards` shards; what to tell the user when the
    hard limit does not allow it (else the run would fail part-way through starting them)."""
    need = COORDINATOR_FILES_PER_SHARD * shards + FILES_BESIDES_CONNECTIONS
    have = ensure_open_files(need - FILES_BESIDES_CONNECTIONS)
    if have == resource.RLIM_INFINITY or have >= need:
        return None
    return (f"{shards} shards need about {need:,} open files in the coordinator, and this "
            f"process may open {have:,} (ulimit -n): raise the limit, or run fewer shards")


def out_of_files(exc: BaseException) -> bool:
    """Whether an error (or the OS error inside a connection error) means this process or the
    machine has no file descriptor left (EMFILE, ENFILE)."""
    err = getattr(exc, "os_error", exc)
    return isinstance(err, OSError) and err.errno in (errno.EMFILE, errno.ENFILE)

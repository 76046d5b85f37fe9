"""Process titles: what `ps`, `top` and `pgrep` show for a run's launcher and shards.

A forked launcher and its shards would otherwise all show the coordinator's own command line,
so in an incident nobody could tell which process is which. `setproctitle` rewrites the title;
without it (an install that lacks it) processes keep their command line.
"""

from __future__ import annotations

try:
    import setproctitle as _setproctitle
except ImportError:  # a dependency, but only a nicety: never a reason for a shard to fail
    _setproctitle = None  # type: ignore[assignment]


def set_title(title: str) -> None:
    if _setproctitle is not None:
        _setproctitle.setproctitle(title)


def launcher_title(run_id: str) -> str:
    return f"shardrun: launcher of {run_id}"


def shard_title(shard: int, run_id: str) -> str:
    return f"shardrun: shard {shard} of {run_id}"

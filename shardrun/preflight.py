"""What a run checks of its environment before it creates anything or sends a request.

`run` and `validate` both call `preflight`, so a job that `validate` calls valid is not then
refused by `run` for its key, its simulator settings, its proxy, its file limit or its runs
directory. Nothing here writes a file or opens a connection.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardrun.errors import RunError, SpecError
from shardrun.fdlimit import coordinator_file_problem
from shardrun.proxy import Proxy, proxy_for
from shardrun.spec import LoadedJob

if TYPE_CHECKING:
    from shardrun.sim.config import SimConfig


@dataclass(frozen=True)
class Preflight:
    """What the checks found that a run goes on to use."""

    api_key: str | None
    sim_config: SimConfig | None
    proxy: Proxy | None


def preflight(job: LoadedJob, env: Mapping[str, str], shards: int | None = None) -> Preflight:
    """The key, the simulator's settings and the proxy; a SpecError or RunError for the first
    of them (or the coordinator's open-file limit for `shards`, the job's unless given: a pass
    with --limit starts fewer) that would stop the run."""
    api_key = job.api_key(env)  # a named but unset key variable fails here, not per item
    sim_config = job.sim_config()
    # The embedded simulator is a process of this run on loopback: never through a proxy.
    proxy = None if sim_config is not None else proxy_for(job.spec.endpoint.base_url, env)
    if problem := coordinator_file_problem(job.spec.shards if shards is None else shards):
        raise RunError(problem)
    return Preflight(api_key, sim_config, proxy)


def check_runs_dir(job: LoadedJob) -> None:
    """A SpecError when no run directory could be made in `runs_dir`, found without making one:
    the nearest part of the path that exists must be a directory this process may write in."""
    runs = job.runs_path
    path = Path(os.path.abspath(runs))
    while not os.path.lexists(path):  # ends at the root, which exists
        path = path.parent
    if path.is_dir() and os.access(path, os.W_OK | os.X_OK):
        return
    why = ("not a directory" if not path.is_dir() else
           # Root passes every permission check: a read-only mount was said as a permission.
           "on a read-only file system" if _read_only(path) else
           "a directory this user may not write in")
    source = job.sources.get("runs_dir", "default")
    note = "" if source == "default" else f" (runs_dir from {source})"
    raise SpecError(f"cannot create run directory in {runs}: {path} is {why}{note}; set "
                    "runs_dir (or SHARDRUN_RUNS_DIR, --runs-dir) to a directory you can write in")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False

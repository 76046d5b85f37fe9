"""`run()`: the library entry point behind `shardrun run`.

Loads the job, creates the run directory, starts the embedded simulator for `sim://` (as its own
process, so the client and the server never share an event loop), runs the coordinator on
uvloop and stops the simulator again, whatever happened.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from shardrun._shard_main import run_loop
from shardrun.coordinator import open_input, run_job
from shardrun.errors import SpecError
from shardrun.manifest import RunDir, new_run_id
from shardrun.sim.config import SimConfig
from shardrun.sim.launcher import SimProcess, start_sim
from shardrun.spec import LoadedJob, load_job
from shardrun.summary import RunSummary

SIM_SCHEME = "sim://"


def run(
    job_path: Path,
    *,
    env: Mapping[str, str],
    flags: Mapping[str, object],
    run_id: str | None,
    argv: list[str],
) -> RunSummary:
    """Run a job file to the end and return its summary."""
    job = load_job(job_path, env=env, flags=flags)
    api_key = job.api_key(env)
    sim_config = _sim_config(job)
    reader = open_input(job)  # a missing input fails before any run directory exists
    run_dir = RunDir.create(job.runs_path, run_id or new_run_id())
    sim: SimProcess | None = None
    base_url = job.spec.endpoint.base_url
    try:
        if sim_config is not None:
            sim = start_sim(sim_config)
            base_url = sim.base_url
        summary: RunSummary = run_loop(run_job(job, reader, run_dir, base_url, api_key, argv))
        return summary
    finally:
        if sim is not None:
            sim.stop()


def _sim_config(job: LoadedJob) -> SimConfig | None:
    endpoint = job.spec.endpoint
    if not endpoint.base_url.startswith(SIM_SCHEME):
        return None
    try:
        return SimConfig.from_mapping(dict(endpoint.sim or {}))
    except ValueError as exc:
        raise SpecError(f"{job.origin}: endpoint.sim: {exc}") from None

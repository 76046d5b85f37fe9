"""`python -m shardrun.sim` runs the simulator (the launcher starts it this way)."""

from shardrun._tls import ca_store_deferred

# A process of its own that only serves plain HTTP: aiohttp's client SSL contexts are never
# used here, so its import skips loading the CA store into them (about 0.04 s of every start).
with ca_store_deferred():
    import aiohttp  # noqa: F401

from shardrun.sim import main

raise SystemExit(main(prog="python -m shardrun.sim"))

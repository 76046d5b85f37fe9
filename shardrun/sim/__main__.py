"""`python -m shardrun.sim` runs the simulator (the launcher starts it this way)."""

from shardrun.sim import main

raise SystemExit(main(prog="python -m shardrun.sim"))

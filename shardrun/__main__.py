"""`python -m shardrun` runs the command line."""

from shardrun.cli import entry

entry()

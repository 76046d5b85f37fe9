"""`python -m shardrun` runs the command line."""

from shardrun.cli import main

raise SystemExit(main())

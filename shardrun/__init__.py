"""shardrun: bulk LLM generation across sharded asyncio worker processes.

The public face is the command line (`shardrun --help`); the library entry points below are
what the CLI calls, so a test or a notebook can call them too.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

"""shardrun: bulk LLM generation across sharded asyncio worker processes.

The public face is the command line (`shardrun --help`); the library entry points below are
what the CLI calls, so a test or a notebook can call them too.
"""

import sys

__version__ = "0.1.0"

__all__ = ["__version__"]


def _import_structlog_without_rich() -> None:
    """Import structlog with rich hidden from it, unless either is already loaded.

    structlog's `__init__` imports `structlog.dev`, which imports rich (and through it pygments)
    whenever rich is installed: about 0.08 CPU-s per process, paid by every shard. shardrun
    renders events with orjson and never uses structlog's console renderer or its rich
    tracebacks, so a shard has no use for rich. A `None` entry in `sys.modules` makes
    `import rich` raise ImportError (documented import-system behaviour), which structlog
    handles as "rich is not installed". The entry is removed again at once, so a later
    `import rich` in the same process (the coordinator's progress display) works as usual.
    """
    if "structlog" in sys.modules or "rich" in sys.modules:
        return
    sys.modules["rich"] = None  # type: ignore[assignment]
    try:
        import structlog  # noqa: F401
    finally:
        if sys.modules.get("rich", 0) is None:
            del sys.modules["rich"]

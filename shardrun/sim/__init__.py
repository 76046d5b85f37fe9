"""The embedded simulator: an OpenAI-compatible streaming server for examples, tests, benchmarks.

    from shardrun.sim import SimConfig, start_sim
    with start_sim(SimConfig(ttft_ms=50, tokens="64")) as sim:
        ...  # point a client at sim.base_url

`main(argv)` is what `shardrun sim ...` and `python -m shardrun.sim` run. The aiohttp server
(`shardrun.sim.server`) is imported only when a server is actually started, so importing this
package (the coordinator does, to launch the simulator) stays cheap.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from shardrun.sim.config import SimConfig, TokenSpec, parse_tokens
from shardrun.sim.launcher import SimProcess, start_sim

__all__ = ["SimConfig", "SimProcess", "TokenSpec", "main", "parse_tokens", "start_sim"]


class _UsageError(Exception):
    """A bad flag; reported as one `error:` line instead of argparse's usage dump and exit."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def _parser(prog: str) -> argparse.ArgumentParser:
    d = SimConfig()
    p = _Parser(prog=prog, description="Run the OpenAI-compatible simulator until Ctrl-C.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    p.add_argument("--ttft-ms", type=float, default=d.ttft_ms, help="first-token delay")
    p.add_argument("--itl-ms", type=float, default=d.itl_ms, help="inter-token delay")
    p.add_argument("--tokens", default=d.tokens,
                   help="output length: N, uniform:LO:HI or lognormal:MEDIAN:SIGMA")  # fmt: skip
    p.add_argument("--capacity", type=int, default=d.capacity,
                   help="requests served at once, the rest queue (0 = unlimited)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the deterministic output")
    p.add_argument("--flush-ms", type=float, default=d.flush_ms,
                   help="least time between two writes of one stream")  # fmt: skip
    p.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="stop when stdin closes, so a dead launcher leaves no orphan")  # fmt: skip
    return p


def main(argv: list[str] | None = None, prog: str = "shardrun sim") -> int:
    """Parse flags and serve until SIGINT/SIGTERM; 0 on a clean stop, 2 on bad flags."""
    try:
        args = _parser(prog).parse_args(argv)
        cfg = SimConfig(ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, tokens=args.tokens,
                        capacity=args.capacity, seed=args.seed, flush_ms=args.flush_ms)  # fmt: skip
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, not {args.port}.")
    except (_UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    from shardrun.sim.server import serve

    try:
        serve(cfg, args.host, args.port, exit_on_stdin_eof=args.exit_on_stdin_eof)
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        where = f"{args.host}:{args.port}"
        print(f"error: cannot listen on {where}: {e.strerror or e}.", file=sys.stderr)
        return 1
    return 0

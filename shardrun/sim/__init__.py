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
import dataclasses
import errno
import re
import socket
import sys
from typing import Any, NoReturn

from shardrun.argtypes import bad_value, with_close_flags
from shardrun.sim.config import (
    FAULT_KINDS,
    LIMIT_HEADERS,
    TEXTS,
    SimConfig,
    TokenSpec,
    parse_tokens,
)
from shardrun.sim.launcher import SimProcess, start_sim

__all__ = ["FAULT_KINDS", "SimConfig", "SimProcess", "TokenSpec", "config_from_argv", "main",
           "parse_tokens", "start_sim"]  # fmt: skip


class _UsageError(Exception):
    """A bad flag; reported as one `error:` line instead of argparse's usage dump and exit."""


class _Parser(argparse.ArgumentParser):
    """Long options only in full (as `shardrun`'s own, `cli.UsageParser`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if (said := bad_value(message)) is not None:  # as SimConfig's own checks say theirs
            raise ValueError(said)
        raise _UsageError(with_close_flags(message, self))


class _DefaultsShown(argparse.HelpFormatter):
    """Each flag that takes a number or a word says its default, unless its help says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = isinstance(action.default, (int, float, str)) and not isinstance(
            action.default, bool) and action.default not in ("", argparse.SUPPRESS)
        if not shown or "default" in text:
            return text
        return text[:-1] + "; default %(default)s)" if text.endswith(")") else (
            text + " (default %(default)s)")


def _bool(text: str) -> bool:
    """A true/false flag value. An ArgumentTypeError, so that its words are said: argparse
    says a ValueError as "invalid _bool value", naming this function."""
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")
    return value in ("true", "1", "yes", "on")


_FAULT_HELP = {
    "fail_429": "answer 429 with Retry-After and x-ratelimit-* headers",
    "fail_500": "answer 500",
    "fail_503": "answer 503",
    "reset_before_headers": "reset the connection before any response byte",
    "drop_mid_stream": "reset the connection after about half the tokens",
    "stall_mid_stream": "pause --stall-s after about half the tokens, then finish",
    "slow_first_token": "add --slow-first-token-s to the first-token delay",
    "reset_after_headers": "answer 200 and its headers, then reset the connection before any "
                           "body byte",
}


def _fault_flags(p: argparse.ArgumentParser, d: SimConfig) -> None:
    """Flags of the fault-injection fields (issue #3; see shardrun.sim.faults)."""
    g = p.add_argument_group("fault injection (shares of requests, each 0..1, sum <= 1)")
    for kind in FAULT_KINDS:
        g.add_argument("--" + kind.replace("_", "-"), type=float, default=getattr(d, kind),
                       metavar="FRACTION", help=_FAULT_HELP[kind])  # fmt: skip
    g.add_argument("--retry-after-s", type=float, default=d.retry_after_s,
                   help="Retry-After (and x-ratelimit-reset-requests) of a 429, in seconds")
    g.add_argument("--retry-after-503", type=_bool, nargs="?", const=True, metavar="BOOL",
                   default=d.retry_after_503, help="503s carry Retry-After too")  # fmt: skip
    g.add_argument("--stall-s", type=float, default=d.stall_s,
                   help="how long stall_mid_stream pauses halfway through")  # fmt: skip
    g.add_argument("--slow-first-token-s", type=float, default=d.slow_first_token_s,
                   help="what slow_first_token adds to the first-token delay")  # fmt: skip
    g.add_argument("--fail-first-n", type=int, default=d.fail_first_n,
                   help="the first N requests all get 503")  # fmt: skip
    g.add_argument("--storm-s", type=float, default=d.storm_s, metavar="SECONDS",
                   help="a storm: every request gets --storm-status for this long (0 = none)")
    g.add_argument("--storm-after-n", type=int, default=d.storm_after_n, metavar="N",
                   help="the storm starts when request N+1 arrives")  # fmt: skip
    g.add_argument("--storm-status", type=int, default=d.storm_status, metavar="STATUS",
                   help="what the storm answers: 500, 502, 503 (default) or 504")  # fmt: skip
    g.add_argument("--quota-after", type=int, default=d.quota_after, metavar="N",
                   help="after N requests served, every request gets 429 insufficient_quota, "
                        "as an account whose credit ran out does (0 = never)")  # fmt: skip
    g.add_argument("--reset-when", default=d.reset_when, metavar="TEXT",
                   help="reset the connection of every request whose body holds TEXT, before "
                        "any answer (a prompt that crashes the server's worker)")  # fmt: skip
    g.add_argument("--auth-required", default=d.auth_required, metavar="KEY",
                   help="answer 401 unless `Authorization: Bearer KEY` (a made-up test key)")
    _limit_flags(p, d)
    c = p.add_argument_group("compatibility (behave like servers that lack a feature)")
    c.add_argument("--reject-stream-options", type=_bool, nargs="?", const=True, metavar="BOOL",
                   default=d.reject_stream_options,
                   help="answer 400 to a request with stream_options, as older API versions do")
    c.add_argument("--ignore-stream", type=_bool, nargs="?", const=True, metavar="BOOL",
                   default=d.ignore_stream,
                   help="answer with one JSON body even when the request asks to stream")
    c.add_argument("--keepalive", type=_bool, nargs="?", const=True, metavar="BOOL",
                   default=d.keepalive,
                   help="false: close every connection after its answer (Connection: close), "
                        "as servers with keep-alive off do")  # fmt: skip


def _limit_flags(p: argparse.ArgumentParser, d: SimConfig) -> None:
    """Flags of the enforced request limit (see shardrun.sim.limit)."""
    g = p.add_argument_group("enforced rate limit (a token bucket, as hosted APIs keep per key)")
    g.add_argument("--rpm-limit", type=int, default=d.rpm_limit, metavar="N",
                   help="requests a minute; over it, 429 rate_limit_exceeded (0 = no limit)")
    g.add_argument("--rpm-burst", type=int, default=d.rpm_burst, metavar="N",
                   help="requests the bucket holds (0 = one second's worth, ceil(N/60))")
    g.add_argument("--rpm-headers", choices=LIMIT_HEADERS, default=d.rpm_headers,
                   help="openai: x-ratelimit-*-requests on every answer and Retry-After on a "
                        "429; retry_after: a 429's Retry-After only; none: no headers")
    g.add_argument("--rpm-count-rejected", type=_bool, nargs="?", const=True, metavar="BOOL",
                   default=d.rpm_count_rejected,
                   help="a rejected request counts against the limit too, as OpenAI's do")
    g.add_argument("--tpm-limit", type=int, default=d.tpm_limit, metavar="N",
                   help="tokens a minute (prompt + max_tokens, else the answer's, per request); "
                        "over it, 429 rate_limit_exceeded on tokens (0 = no limit)")
    g.add_argument("--tpm-burst", type=int, default=d.tpm_burst, metavar="N",
                   help="tokens the bucket holds (0 = one second's worth, ceil(N/60))")
    for kind in ("rpm", "tpm"):
        g.add_argument(f"--{kind}-stated", type=int, default=getattr(d, f"{kind}_stated"),
                       metavar="N", help=f"the {kind} limit the answers state, not the one "
                                         "enforced (0 = the enforced one)")


def _parser(prog: str) -> argparse.ArgumentParser:
    d = SimConfig()
    p = _Parser(prog=prog, description="Run the OpenAI-compatible simulator until Ctrl-C.",
                formatter_class=_DefaultsShown)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    p.add_argument("--ttft-ms", type=float, default=d.ttft_ms, help="first-token delay, ms")
    p.add_argument("--itl-ms", type=float, default=d.itl_ms, help="inter-token delay, ms")
    p.add_argument("--tokens", default=d.tokens,
                   help="output length: N, uniform:LO:HI or lognormal:MEDIAN:SIGMA")  # fmt: skip
    p.add_argument("--text", choices=TEXTS, default=d.text,
                   help="words: plain words; prose: every fourth word holds a line break, "
                        "quotes, a backslash or a tab, which JSON escapes")  # fmt: skip
    p.add_argument("--capacity", type=int, default=d.capacity,
                   help="requests served at once, the rest queue (0 = unlimited)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the deterministic output")
    p.add_argument("--flush-ms", type=float, default=d.flush_ms,
                   help="least time between two writes of one stream, ms")  # fmt: skip
    p.add_argument("--reasoning-tokens", type=int, default=d.reasoning_tokens, metavar="N",
                   help="chat answers start with N reasoning tokens (delta.reasoning_content), "
                        "as a reasoning model's do")  # fmt: skip
    p.add_argument("--refusal", type=float, default=d.refusal, metavar="SHARE",
                   help="share of chat and Responses answers that are refusals (the words "
                        "come as `refusal` pieces)")  # fmt: skip
    p.add_argument("--cached-tokens", type=int, default=d.cached_tokens, metavar="N",
                   help="usage counts the first N prompt tokens (at most all) as read from a "
                        "prompt cache, as servers that cache a shared prefix do")  # fmt: skip
    p.add_argument("--obfuscation", type=_bool, nargs="?", const=True, metavar="BOOL",
                   default=d.obfuscation,
                   help="pad every chat and completions chunk with an `obfuscation` member of "
                        "changing length, as OpenAI does unless stream_options."
                        "include_obfuscation is false")  # fmt: skip
    p.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="stop when stdin closes, so a dead launcher leaves no orphan")  # fmt: skip
    _fault_flags(p, d)
    return p


def _config(args: argparse.Namespace) -> SimConfig:
    """The SimConfig of parsed flags: every field has a flag whose dest is the field's name."""
    return SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})


def config_from_argv(argv: list[str]) -> SimConfig:
    """Parse simulator flags (as `SimConfig.to_args` writes them) back into a SimConfig."""
    try:
        return _config(_parser("shardrun sim").parse_args(argv))
    except _UsageError as e:
        raise ValueError(str(e)) from None


def main(argv: list[str] | None = None, prog: str = "shardrun sim") -> int:
    """Parse flags and serve until SIGINT/SIGTERM; 0 on a clean stop, 2 on bad flags or an
    address that cannot be bound (port in use, --host not local), 1 on another OS error."""
    try:
        args = _parser(prog).parse_args(argv)
        cfg = _config(args)
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, not {args.port}")
        if not args.host.strip():  # '' would listen on every interface, at http://:PORT/v1
            raise ValueError("--host is empty: give the address to listen on (default "
                             "127.0.0.1)")
    except _UsageError as e:  # worded as the other commands' usage errors (cli.UsageParser)
        print(f"error: {e} (`{prog} --help` lists the arguments)", file=sys.stderr)
        return 2
    except ValueError as e:  # SimConfig names its fields: say the flags that set them
        print(f"error: {_FIELD_AT_START.sub(_as_flag, str(e))}", file=sys.stderr)
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
        why = _BIND_ERRORS.get(e.errno or 0)
        if isinstance(e, socket.gaierror):
            why = f"no address is known for {args.host}; give one of this machine's in --host"
        print(f"error: cannot listen on {where}: {why or e.strerror or e}", file=sys.stderr)
        return 1 if why is None else 2  # a bind refused for a flag's value: a usage error
    return 0


_BIND_ERRORS = {
    errno.EADDRINUSE: "the port is in use (another server, or another simulator, listens on "
                      "it); give another --port, or --port 0 for any free one",
    errno.EACCES: "permission denied (a port below 1024 needs privileges); give another --port",
    errno.EADDRNOTAVAIL: "the address is not one of this machine's; check --host",
}
"""What a refused bind means, by errno, for the flag that chose the address."""

_FIELD_AT_START = re.compile(r"^[a-z][a-z0-9_]*\b")


def _as_flag(match: re.Match[str]) -> str:
    """A SimConfig field name as the flag that sets it (`ttft_ms` -> `--ttft-ms`)."""
    name = match[0]
    known = name in {f.name for f in dataclasses.fields(SimConfig)}
    return "--" + name.replace("_", "-") if known else name

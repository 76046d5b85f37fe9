"""The two string-typed override layers over the job file: environment variables and flags.

Operators tune a run during an incident without editing the job file (DESIGN §7), so every
knob they reach for has a `SHARDRUN_*` variable, and the CLI's flag for the same knob is
derived from the variable's name (`SHARDRUN_RETRY_BUDGET` -> `--retry-budget`). Keeping both
tables here, in one place, is what lets `--help`, the README and the loader agree.

Values arriving from these layers are text; they are converted here per field kind *before*
the strict pydantic validation, so the job file stays strict (`shards: "8"` is an error there)
while `SHARDRUN_SHARDS=8` works.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Literal

PREFIX = "SHARDRUN_"

Kind = Literal["int", "float", "optional_float", "str", "other"]
"""How a leaf value is written as text: what an env var or a string flag must be parsed into.

`optional_float` is a number or a word meaning "no value" (`none`, `null`, `unlimited`, `off`),
so an operator can lift a rate limit the job file sets without editing it.
"""

NONE_WORDS = frozenset({"none", "null", "unlimited", "off"})

_INT_TEXT = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its name, the dotted job key it sets and a one-line help."""

    name: str
    key: str
    help: str

    @property
    def flag(self) -> str:
        """The CLI flag for the same key, named after the variable so the two never drift."""
        return "--" + self.name.removeprefix(PREFIX).lower().replace("_", "-")


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("SHARDRUN_SHARDS", "shards", "number of shard processes (1..1024)"),
    EnvVar("SHARDRUN_CONCURRENCY", "concurrency", "requests in flight per shard (1..100000)"),
    EnvVar(
        "SHARDRUN_MAX_ATTEMPTS", "retry.max_attempts", "attempts per item, first included (1..100)"
    ),
    EnvVar("SHARDRUN_RETRY_BACKOFF_S", "retry.backoff_s", "first retry backoff in seconds (>= 0)"),
    EnvVar(
        "SHARDRUN_RETRY_BACKOFF_MAX_S", "retry.backoff_max_s", "longest retry backoff in seconds"
    ),
    EnvVar(
        "SHARDRUN_RETRY_BUDGET", "retry.budget_ratio", "retries allowed per first attempt (>= 0)"
    ),
    EnvVar(
        "SHARDRUN_MAX_SERVER_WAIT_S", "retry.max_server_wait_s",
        "longest wait a server may ask for (Retry-After) before the item is dead-lettered",
    ),
    EnvVar(
        "SHARDRUN_OUTAGE_S", "retry.outage_s",
        "seconds the endpoint may be down before the run stops for --resume",
    ),
    EnvVar("SHARDRUN_CONNECT_TIMEOUT_S", "timeouts.connect_s", "seconds to open a connection"),
    EnvVar(
        "SHARDRUN_FIRST_TOKEN_TIMEOUT_S", "timeouts.first_token_s", "seconds to the first token"
    ),
    EnvVar("SHARDRUN_IDLE_TIMEOUT_S", "timeouts.idle_s", "longest silence between tokens, seconds"),
    EnvVar("SHARDRUN_TOTAL_TIMEOUT_S", "timeouts.total_s", "seconds for one whole attempt"),
    EnvVar(
        "SHARDRUN_BASE_URL", "endpoint.base_url", "endpoint URL (http(s)://host:port/v1 or sim://)"
    ),
    EnvVar("SHARDRUN_MODEL", "endpoint.model", "model name sent to the endpoint"),
    EnvVar(
        "SHARDRUN_API_KEY_ENV", "endpoint.api_key_env", "NAME of the variable holding the API key"
    ),
    EnvVar("SHARDRUN_RUNS_DIR", "runs_dir", "where run directories are created"),
    EnvVar("SHARDRUN_SHUTDOWN_GRACE_S", "shutdown_grace_s", "seconds in-flight work gets on stop"),
    EnvVar(
        "SHARDRUN_SHARD_START", "shard_start", "fork (shards share one import) or spawn"
    ),
    EnvVar("SHARDRUN_FSYNC_INTERVAL_S", "fsync_interval_s", "seconds between fsyncs of results"),
    EnvVar(
        "SHARDRUN_SHARD_SILENCE_S", "shard_silence_s",
        "seconds a shard may send nothing before it is killed and replaced (>= 2; one not "
        "heard from yet, still starting: 30 at least)",
    ),
    EnvVar(
        "SHARDRUN_RPM", "rate_limits.rpm", "requests per minute, whole job (none: unlimited)"
    ),
    EnvVar(
        "SHARDRUN_TPM", "rate_limits.tpm",
        "prompt+completion tokens per minute, whole job (none: unlimited)",
    ),
)

ENV_BY_KEY: Mapping[str, EnvVar] = {v.key: v for v in ENV_VARS}

# Variables of `report`, `publish` and `verify`, not of a job: no job key, no flag.
ANALYSIS_VARS: Mapping[str, str] = {
    "SHARDRUN_AGGREGATE_WORKERS": "worker processes that fold event files, or that verify reads "
                                  "a run's files with (default: one per CPU for a run of 64 MiB "
                                  "or more, else one)",
    "SHARDRUN_FAST_FOLD": "0 folds event files in Python even where the C fold is built",
}


def flag_for(key: str) -> str:
    """The flag that sets dotted `key`: named after its env var, else after the key itself."""
    var = ENV_BY_KEY.get(key)
    if var is not None:
        return var.flag
    return "--" + key.replace(".", "-").replace("_", "-")


def is_set(value: str | None) -> bool:
    """A variable holding text. An empty one is unset (the `FOO= cmd` idiom), and so is one of
    only spaces: a value loses the spaces around it (`parse_text`), which leaves it empty, and
    `SHARDRUN_SHARDS=" "` meant no more than `SHARDRUN_SHARDS=` (as the analysis variables
    already read it)."""
    return bool(value and value.strip())


def env_values(env: Mapping[str, str]) -> dict[str, tuple[EnvVar, str]]:
    """The set variables by dotted key (`is_set`)."""
    return {v.key: (v, env[v.name]) for v in ENV_VARS if is_set(env.get(v.name))}


IGNORE_VAR = "SHARDRUN_IGNORE_VARS"
IGNORE_HELP = ("names (comma-separated) of SHARDRUN_* variables that are not shardrun's, such as "
               "a wrapper's; any other unknown one is an error")


def unknown_env_errors(env: Mapping[str, str],
                       also_known: Set[str] = frozenset()) -> tuple[str, ...]:
    """What is wrong with the `SHARDRUN_*` names: one we do not read is an error, since a typo
    (SHARDRUN_CONCURENCY) would silently run with the default during the very incident it was
    set for.

    `also_known`: names the job reads besides ours (its api_key_env). Names listed in
    SHARDRUN_IGNORE_VARS are left alone (a wrapper's own variables); a value that is not
    `is_set` sets nothing whatever the name. Only names are reported, never values: a misspelt
    variable may well hold a secret.
    """
    known = {v.name for v in ENV_VARS} | set(ANALYSIS_VARS) | {IGNORE_VAR}
    ignored = {name.strip() for name in env.get(IGNORE_VAR, "").split(",")}
    # The list matches names without case (below), so shardrun's own is refused in any case
    # too: `shardrun_concurrency` listed hid `shardrun_concurrency=1`, never read, and the
    # run went at the default concurrency. Another spelling is named with the real one.
    errors = [f"{IGNORE_VAR} names {name}, which is shardrun's own variable"
              + (" and cannot be ignored; remove it from " + IGNORE_VAR if name in known else
                 f" {name.upper()} in another case and cannot be ignored; remove it from "
                 f"{IGNORE_VAR} and spell the variable {name.upper()}")
              for name in sorted(ignored) if name.upper() in known]  # fmt: skip
    # Case counts too: `export shardrun_concurrency=4` is no variable shardrun reads either.
    # A wrapper's variable is ignored in whatever case it is listed or set (one listed that is
    # shardrun's own in another case is the error above, enough to say).
    ignored_upper = {name.upper() for name in ignored}
    unknown = [name for name in sorted(env) if name.upper().startswith(PREFIX)
               and name not in known | also_known and name.upper() not in ignored_upper
               and is_set(env[name])]  # fmt: skip
    if unknown:
        errors.append(_unknown_sentence(unknown, sorted(known)))
    return tuple(errors)


def _unknown_sentence(unknown: list[str], known: list[str]) -> str:
    """One sentence for all the unknown names, each with the closest known one, if any."""
    suffixes = [name.removeprefix(PREFIX) for name in known]
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name.upper().removeprefix(PREFIX), suffixes, n=1,
                                          cutoff=0.6)
        named.append(f"{name} (did you mean {PREFIX}{close[0]}?)" if close else name)
    them = "them" if len(named) > 1 else "it"
    listed = ", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else named[0]
    are = "variables {} are not shardrun variables" if len(named) > 1 else (
        "variable {} is not a shardrun variable")
    return (f"environment {are.format(listed)}; rename or unset {them}, or add {them} to "
            f"{IGNORE_VAR} if something else reads {them} (`shardrun --help` lists shardrun's)")


def parse_text(text: str, kind: Kind) -> object:
    """Convert an env/flag string to the field's kind; ValueError says only that it failed.

    Integers must be written as integers ("8", not "8.0"), because a silently truncated
    "2.5 shards" would be worse than an error. Text loses the spaces around it, as a plain
    YAML value does: `SHARDRUN_MODEL=gpt-4o ` from an env file would name no model the server
    knows, and `SHARDRUN_API_KEY_ENV=OPENAI_API_KEY ` is no variable name.
    """
    if kind == "int":
        return parse_int(text)
    if kind == "float":
        return float(text.strip())
    if kind == "optional_float":
        stripped = text.strip()
        return None if stripped.lower() in NONE_WORDS else float(stripped)
    return text.strip() if kind == "str" else text


def parse_int(text: str) -> int:
    """An integer as `parse_text` reads one: digits 0-9 and a sign, spaces around; not Python's
    `1_000` or other scripts' digits, which `int()` also takes."""
    stripped = text.strip()
    if not _INT_TEXT.fullmatch(stripped):
        raise ValueError(text)
    return int(stripped)


def coerce_flag(value: object, kind: Kind) -> object:
    """Bring a flag value to the field's kind; argparse may hand over text, numbers or Paths."""
    if isinstance(value, str):
        return parse_text(value, kind)
    if kind == "str" and isinstance(value, os.PathLike):
        return os.fspath(value)
    return value

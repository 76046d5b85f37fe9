"""The job specification: job file + environment + flags -> one frozen, validated `LoadedJob`.

Precedence is flag > environment > job file > default (DESIGN §6-7), and `LoadedJob.sources`
records which layer won for every leaf key, so the run manifest can say *why* a run used 8
shards. The job file is validated strictly, env and flag text is converted per field first
(`_env`), and every problem becomes one `SpecError` sentence naming its source (`_blame`).

    JobSpec tree and defaults ... `_models`     YAML reading ........ `_jobfile`
    env table, flag names ....... `_env`        error sentences ..... `_blame`
"""

from __future__ import annotations

import copy
import os
import typing
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from shardrun._blame import Blame, Problem, render, translate, unknown_key_problem
from shardrun._env import (
    ENV_VARS,
    NONE_WORDS,
    EnvVar,
    coerce_flag,
    env_values,
    flag_for,
    parse_text,
    unknown_env_errors,
)
from shardrun._jobfile import read_job_file
from shardrun._models import (
    FIELDS,
    LEAF_KEYS,
    SECTION_KEYS,
    EndpointSpec,
    InputSpec,
    JobSpec,
    OutputSpec,
    PricingSpec,
    RateLimitsSpec,
    RetrySpec,
    TimeoutsSpec,
    kind_of,
)
from shardrun._urls import SECRET_HEADER, masked_setting, masked_url
from shardrun.errors import InputError, SpecError

if TYPE_CHECKING:
    from shardrun.sim.config import SimConfig

__all__ = [
    "ENV_VARS",
    "LEAF_KEYS",
    "EndpointSpec",
    "EnvVar",
    "InputSpec",
    "JobSpec",
    "LoadedJob",
    "OutputSpec",
    "PricingSpec",
    "RateLimitsSpec",
    "RetrySpec",
    "TimeoutsSpec",
    "flag_for",
    "load_job",
]

_MISSING = object()
_BOOL_KEY_HINT = "YAML reads an unquoted true or false as a boolean; quote the key"


@dataclass(frozen=True)
class LoadedJob:
    """A validated job plus where it lives and where each effective value came from."""

    spec: JobSpec
    job_path: Path
    input_path: Path
    sources: Mapping[str, str]
    warnings: tuple[str, ...] = ()
    origin: str = ""
    """The job file path as the user gave it, for messages that should match their command."""

    @property
    def runs_path(self) -> Path:
        """`runs_dir` as a Path; a relative one is relative to the working directory."""
        return Path(self.spec.runs_dir).expanduser()

    def effective(self) -> dict[str, dict[str, object]]:
        """Every leaf's value and source, for the manifest. Holds no secret: the API key is
        never read here, only the *name* of its variable; URL passwords are masked, and so are
        job headers and params whose names say they hold a credential."""
        out: dict[str, dict[str, object]] = {}
        for key in LEAF_KEYS:
            value = copy.deepcopy(_leaf(self.spec, key))
            if key == "endpoint.base_url":
                value = masked_url(str(value))
            elif key == "endpoint.headers":  # secrets belong in api_key_env, but a pasted
                # `Authorization: Bearer ...` must not end up in a published manifest
                value = {name: "***" if SECRET_HEADER.search(name) else text
                         for name, text in self.spec.endpoint.headers.items()}  # fmt: skip
            else:  # likewise a key a gateway reads from the body, the simulator's key
                value = masked_setting(key, value)
            out[key] = {"value": value, "source": self.sources[key]}
        return out

    def sim_config(self) -> SimConfig | None:
        """The embedded simulator's settings (`endpoint.sim`) for a `sim://` job, else None; a
        bad setting is a SpecError naming it, the same for `run` and `validate`."""
        endpoint = self.spec.endpoint
        if endpoint.base_url != "sim://":
            return None
        return _sim_settings(endpoint.sim or {}, self.origin)

    def api_key(self, env: Mapping[str, str]) -> str | None:
        """The API key from the variable the job names, or None when it names none.

        Naming a variable that is unset is an error rather than an anonymous request: the
        endpoint's 401 would arrive once per item instead of once, up front.
        """
        name = self.spec.endpoint.api_key_env
        if name is None:
            return None
        value = env.get(name, "").strip()
        endpoint = self.spec.endpoint
        if (value and endpoint.api_key_header.lower() == "authorization"
                and urlsplit(endpoint.base_url).username is not None):
            # aiohttp turns a URL's user and password into an Authorization header, and one
            # request cannot carry both that and the key's.
            raise SpecError(
                f"{self.origin or self.job_path}: endpoint.base_url carries a user name and "
                f"password, and api_key_env names a key ({name}): a request sends one "
                "Authorization header, so keep only one of the two"
            )
        if any(ord(c) < 32 or ord(c) == 127 for c in value):  # never echoed: it is the key
            raise SpecError(
                f"{self.origin or self.job_path}: environment variable {name} (api_key_env) "
                "holds a control character inside the key, such as a line break, which no HTTP "
                "header can carry; set it to the key alone")
        if value.lower().startswith("bearer ") and endpoint.api_key_header.lower() == (
                "authorization"):  # it would go as `Bearer Bearer KEY`: a 401 per item
            raise SpecError(
                f"{self.origin or self.job_path}: environment variable {name} (api_key_env) "
                "starts with 'Bearer ', which shardrun puts before the key itself; set it to "
                "the key alone")
        if value:
            return value
        source = self.sources.get("endpoint.api_key_env", "job file")
        where = "" if source == "job file" else f" (api_key_env comes from {source})"
        state = "is empty" if name in env else "is not set"
        raise SpecError(
            f"{self.origin or self.job_path}: the job names api_key_env {_key_shaped(name)} but"
            f" that environment variable {state}; export it or remove api_key_env{where}"
        )


def _key_shaped(name: str) -> str:
    """An api_key_env name as a message shows it: one that looks like a pasted key (long, not
    in capitals, with digits: `api_key_env: gsk8f...`) is not printed into a terminal or a CI
    log; the name a variable usually has is."""
    if len(name) < 20 or name.isupper() or not any(c.isdigit() for c in name):
        return name
    return f"of {len(name)} characters (not shown: it looks like a key, not a variable's name)"


def load_job(path: Path, *, env: Mapping[str, str], flags: Mapping[str, object]) -> LoadedJob:
    """Read, layer and validate a job; raise one SpecError listing everything that is wrong."""
    origin = str(path)
    problems: list[Problem] = []
    raw = _drop_unknown_keys(read_job_file(path, origin), origin, problems)
    given_flags = _given_flags(flags)
    set_env = env_values(env)
    sources = _sources(raw, set_env, given_flags)
    shown = {k: text for k, (_, text) in set_env.items() if k not in given_flags}
    shown.update({k: v for k, v in given_flags.items() if isinstance(v, str)})
    blame = Blame(origin, sources, shown, FIELDS)
    merged = _merge(raw, _overrides(set_env, given_flags))
    endpoint = merged.get("endpoint")
    key_var = endpoint.get("api_key_env") if isinstance(endpoint, dict) else None
    # The job's own key variable may be a SHARDRUN_ name: shardrun reads it, so it is known.
    problems[:0] = [(None, text) for text in unknown_env_errors(
        env, also_known={key_var} if isinstance(key_var, str) else set())]
    sim_ignored = _drop_shadowed_sim(merged, sources, origin, problems)
    spec = _validate(merged, blame, problems)
    unusable = _unusable_paths(spec, blame)
    if unusable:
        raise SpecError(render(unusable))
    loaded = _loaded(spec, path, origin, _settle_sources(spec, raw, sources))
    unrecordable = _not_utf8_paths(loaded)
    if unrecordable:
        raise SpecError("; ".join(unrecordable))
    overridden = _overridden_vars(set_env, given_flags)
    if overridden:
        loaded = replace(loaded, warnings=(*overridden, *loaded.warnings))
    if not sim_ignored:
        return loaded
    url, source = masked_url(spec.endpoint.base_url), sources["endpoint.base_url"]
    ignored = (f"{origin}: endpoint.sim is ignored: endpoint.base_url is {url} from {source}, "
               "not sim://")
    return replace(loaded, warnings=(ignored, *loaded.warnings))


def _sim_settings(block: Mapping[str, Any], origin: str) -> SimConfig:
    """The simulator's settings from an `endpoint.sim` mapping; a bad one is a SpecError."""
    from shardrun.sim.config import SimConfig  # the simulator's code only for jobs that use it

    try:
        return SimConfig.from_mapping(dict(block))
    except ValueError as exc:
        raise SpecError(f"{origin}: endpoint.sim: {exc}") from None


def _drop_shadowed_sim(
    merged: dict[str, Any], sources: dict[str, str], origin: str, problems: list[Problem]
) -> bool:
    """Leave out the job's `endpoint.sim` when a variable or flag points the job elsewhere.

    The operator who sets SHARDRUN_BASE_URL during an incident means that endpoint, not the
    simulator the file was written for; refusing would force an edit of the job file. A file
    that itself pairs `sim:` with a real URL stays an error (the model's rule). The block set
    aside is still checked, with the error it gets when used: else a typo in it passes every
    run under the override and breaks the job once the variable is gone. Marks the key's
    source so the manifest says why it holds no settings; True when it dropped them."""
    endpoint = merged.get("endpoint")
    source = sources["endpoint.base_url"]
    if not isinstance(endpoint, dict) or endpoint.get("sim") is None:
        return False
    if source in ("job file", "default") or endpoint.get("base_url") == "sim://":
        return False
    block = endpoint["sim"]
    if not isinstance(block, dict) or not all(isinstance(key, str) for key in block):
        return False  # kept for the model, which says what a block must be (as when it is used)
    try:
        _sim_settings(block, origin)
    except SpecError as exc:
        problems.append((None, str(exc)))
    del endpoint["sim"]
    sources["endpoint.sim"] = f"ignored: endpoint.base_url from {source}"
    return True


def _validate(merged: dict[str, Any], blame: Blame, problems: list[Problem]) -> JobSpec:
    """Validate the layered tree; raise every problem found so far as one sentence."""
    try:
        spec = JobSpec.model_validate(merged)
    except ValidationError as exc:
        problems.extend(translate(exc.errors(include_url=False), blame))
    if problems:
        raise SpecError(render(problems))
    return spec


def _unusable_paths(spec: JobSpec, blame: Blame) -> list[Problem]:
    """Paths no file can have: a NUL character (a quoted "\\0" in YAML), or a start `~user`
    naming no home directory here (no such user, or `~` with no HOME). The OS calls, or
    Path.expanduser, raise for them where the path is first used. And a runs_dir with a control
    character (a line break, an escape), which a file may have but no one means to make: it
    would be made, and break every command the run prints to continue it."""
    problems: list[Problem] = []
    for key in ("input.path", "runs_dir"):
        text = str(_leaf(spec, key))
        origin, subject = blame.subject(key)
        if "\0" in text:
            problems.append((origin, f"{subject} holds a NUL character, which no path can, "
                                     f"got {text!r}"))
            continue
        control = next((c for c in text if unicodedata.category(c) == "Cc"), None)
        if key == "runs_dir" and control is not None:  # `--runs-dir "$(cmd)"` with a line break
            problems.append((origin, f"{subject} holds the control character "
                                     f"U+{ord(control):04X}, which a directory shardrun makes "
                                     f"should not have, got {text!r}; remove it"))
            continue
        try:
            Path(text).expanduser()
        except RuntimeError:
            home = text.split("/", 1)[0]
            problems.append((origin, f"{subject} starts with {home}, which names no home "
                                     f"directory here, got {text!r}"))
    return problems


def _not_utf8_paths(loaded: LoadedJob) -> list[str]:
    """The job file's or the input's full path with bytes that are not UTF-8 (a name made under
    another encoding): the run's manifest, JSON, cannot record it, and the run stopped with a
    traceback once its directory was made."""
    problems = []
    for what, path in (("the job file", loaded.job_path), ("the input file", loaded.input_path)):
        try:
            str(path).encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(path).decode("utf-8", "backslashreplace")
            problems.append(f"{what} {shown} has bytes that are not UTF-8 in its path, which "
                            "the run's manifest cannot record; rename it (or its folder)")
    return problems


def _loaded(spec: JobSpec, path: Path, origin: str, sources: dict[str, str]) -> LoadedJob:
    """Resolve paths: the input relative to the job file (it ships with it) unless a flag
    gave it, in which case relative to where the user typed the command."""
    job_dir = Path(os.path.abspath(path)).parent
    base = Path.cwd() if sources["input.path"].startswith("flag ") else job_dir
    named = base / Path(spec.input.path).expanduser()
    if base == job_dir:
        _refuse_cwd_relative(spec.input.path, named, job_dir, origin)
    try:
        input_path = named.resolve()
    except (RuntimeError, OSError):  # a loop of links: RuntimeError before Python 3.13
        from shardrun.inputs import symlink_loop  # here: a shard loads no input reader

        raise InputError(symlink_loop(named)) from None
    return LoadedJob(
        spec=spec,
        job_path=path.resolve(),
        input_path=input_path,
        sources=MappingProxyType(sources),
        warnings=tuple(_half_priced(spec, origin)),
        origin=origin,
    )


def _refuse_cwd_relative(text: str, named: Path, job_dir: Path, origin: str) -> None:
    """An InputError when a relative input.path names no file beside the job file but does name
    one from the working directory: the path was written for where the command is typed, the
    commonest slip with a job kept in a folder of its own; say how to write it instead."""
    if Path(text).expanduser().is_absolute() or os.path.lexists(named):
        return
    meant = Path.cwd() / text
    if meant.is_file():
        rel = os.path.relpath(meant, job_dir)
        raise InputError(f"{origin}: input.path {text!r} is read relative to the job file's "
                         f"folder, where {named} does not exist; it names a file from the "
                         f"current directory only, so write it as {rel!r} (or give the full "
                         "path)")


def _half_priced(spec: JobSpec, origin: str) -> list[str]:
    """A token price for one side only: the other side's tokens would count as free in the
    spend, which is a forgotten key far more often than a free side."""
    pricing = spec.pricing
    if pricing is None or pricing.hourly is not None:
        return []
    given = {"input_per_1m": pricing.input_per_1m, "output_per_1m": pricing.output_per_1m}
    missing = [key for key, value in given.items() if value is None]
    if len(missing) == 2 and pricing.cached_input_per_1m is not None:  # a cached price alone
        return [f"{origin}: pricing has only cached_input_per_1m, so prompt tokens not read "
                "from a cache and output tokens count as free in the spend; set "
                "input_per_1m and output_per_1m (0 if they are free)"]
    if len(missing) != 1:
        return []
    free = "output" if missing[0] == "output_per_1m" else "prompt"
    return [f"{origin}: pricing has no {missing[0]}, so {free} tokens count as free in the "
            f"spend; set it (0 if they are free)"]


def _given_flags(flags: Mapping[str, object]) -> dict[str, object]:
    """Flags actually given (None means absent). An unknown key is a bug in the caller."""
    unknown = sorted(k for k, v in flags.items() if v is not None and k not in LEAF_KEYS)
    if unknown:
        raise ValueError(f"load_job: unknown flag keys {unknown}; expected some of {LEAF_KEYS}")
    return {k: v for k, v in flags.items() if v is not None}


def _overrides(
    set_env: Mapping[str, tuple[EnvVar, str]], flags: Mapping[str, object]
) -> dict[str, object]:
    """Env then flag values by dotted key, converted to each field's type where they parse.

    Text that does not parse is kept as text: the strict model then rejects it, and the
    error is blamed on the variable or flag that supplied it.
    """
    out: dict[str, object] = {}
    for key, (_, text) in set_env.items():
        out[key] = _parse_or_keep(text, key)
    for key, value in flags.items():
        try:
            out[key] = coerce_flag(value, kind_of(key))
        except ValueError:
            out[key] = value
    return out


def _overridden_vars(
    set_env: Mapping[str, tuple[EnvVar, str]], flags: Mapping[str, object]
) -> list[str]:
    """A variable set to another value than a flag given for the same key: the flag wins, and
    the operator who set the variable during an incident and pasted the printed command (it
    carries the pass's --concurrency, --shards, --rpm and --tpm) is told that it is not used."""
    warnings = []
    for key, (var, text) in set_env.items():
        if key not in flags:
            continue
        flag, value = _overrides({}, {key: flags[key]})[key], _parse_or_keep(text, key)
        shown = flags[key] if isinstance(flags[key], str) else flag  # as typed, where text
        unused = (f"{var.name}={text} is not used: the flag {flag_for(key)} {shown} overrides "
                  "it (a flag wins over the environment)")
        if key != "runs_dir":
            if value != flag:
                warnings.append(f"{unused}; leave the flag out to use the variable")
        # One directory however spelt or linked: the printed --runs-dir is tidied, and may
        # name the run's directory by another path than the variable.
        elif _real_dir(flag) != _real_dir(value):
            # Not "leave the flag out": a pasted resume's --runs-dir is where its run is.
            warnings.append(f"{unused}, so runs are made and resumed in {shown}")
    return warnings


def _real_dir(path: object) -> str:
    """A runs directory as the file system finds it: home expanded, links resolved."""
    return os.path.realpath(os.path.expanduser(str(path)))


def _parse_or_keep(text: str, key: str) -> object:
    """`parse_text`, falling back to the original text (see `_overrides`)."""
    try:
        return parse_text(text, kind_of(key))
    except ValueError:
        return text


def _merge(raw: dict[str, Any], overrides: Mapping[str, object]) -> dict[str, Any]:
    """The job file's tree with overrides written into it. A section that is not a mapping
    is left alone: validation reports it against the file."""
    merged = copy.deepcopy(raw)
    for key, value in overrides.items():
        *sections, leaf = key.split(".")
        node: Any = merged
        for name in sections:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                break
        else:
            node[leaf] = value
    return merged


def _sources(
    raw: Mapping[str, Any], set_env: Mapping[str, tuple[EnvVar, str]], flags: Mapping[str, object]
) -> dict[str, str]:
    """Which layer supplies each leaf, before validation (so errors can be blamed)."""
    sources = {}
    for key in LEAF_KEYS:
        if key in flags:
            sources[key] = f"flag {flag_for(key)}"
        elif key in set_env:
            sources[key] = f"env {set_env[key][0].name}"
        elif _get(raw, key) is not _MISSING:
            sources[key] = "job file"
        else:
            sources[key] = "default"
    return sources


def _settle_sources(
    spec: JobSpec, raw: Mapping[str, Any], sources: dict[str, str]
) -> dict[str, str]:
    """A file value the model replaced (`prompt_field: null` -> "prompt") is a default; a
    word for no limit (`rpm: none`) is the file's own value, and so are params whose integer
    keys became text (`logit_bias: {50256: -100}`)."""
    for key, source in sources.items():
        given, value = _get(raw, key), _leaf(spec, key)
        said_none = isinstance(given, str) and given.strip().lower() in NONE_WORDS
        if key == "params" or (said_none and value is None):
            continue
        if source == "job file" and given != value:
            sources[key] = "default"
    return sources


EXTENSION_PREFIX = "x-"
"""Keys shardrun leaves alone at the top level, in a section and in `endpoint.sim` (settings
with names, as a section's), as docker compose does: a place for an anchor (`x-defaults: &d
{...}`, then `<<: *d`) or a note. Not in `params` or `endpoint.headers`, whose keys are sent."""
SIM_KEY = "endpoint.sim"


def _extension(name: object) -> bool:
    return isinstance(name, str) and name.startswith(EXTENSION_PREFIX)


def _drop_unknown_keys(raw: dict[Any, Any], origin: str, problems: list[Problem]) -> dict[str, Any]:
    """Report keys the model does not know, with a suggestion, and leave them out (and leave
    out `x-` keys without a word)."""
    cleaned: dict[str, Any] = {}
    for name, value in raw.items():
        if _extension(name):
            continue
        if isinstance(name, bool):
            problems.append((origin, f"unknown key {name} ({_BOOL_KEY_HINT})"))
        elif not isinstance(name, str) or name not in JobSpec.model_fields:
            problems.append(unknown_key_problem(origin, str(name), list(FIELDS)))
        elif isinstance(value, dict) and name in SECTION_KEYS:
            cleaned[name] = _drop_unknown_in_section(name, value, origin, problems)
        elif value is None and name in SECTION_KEYS:  # `retry:` with every key commented out
            cleaned[name] = {}
        elif not _empty_mapping(name, value):  # `params:` so is left out: the default
            cleaned[name] = value
    return cleaned


def _drop_unknown_in_section(
    section: str, value: dict[Any, Any], origin: str, problems: list[Problem]
) -> dict[str, Any]:
    """`_drop_unknown_keys` one level down, reporting keys as `section.key`."""
    cleaned: dict[str, Any] = {}
    for name, item in value.items():
        key = f"{section}.{name}"
        if _extension(name):
            continue
        if not isinstance(name, str) or key not in FIELDS:
            problems.append(unknown_key_problem(origin, key, list(FIELDS)))
        elif key == SIM_KEY and isinstance(item, dict):  # settings with names, as a section's
            cleaned[name] = {k: v for k, v in item.items() if not _extension(k)}
        elif not _empty_mapping(key, item):
            cleaned[name] = item
    return cleaned


def _empty_mapping(key: str, value: object) -> bool:
    """A mapping-valued key given no value (`params:` or `headers:` with every entry commented
    out, YAML's null), where null is no value the key takes: it is read as not given."""
    return value is None and typing.get_origin(FIELDS[key].annotation) is dict


def _get(tree: Mapping[str, Any], key: str) -> Any:
    """The value at dotted `key` in a raw tree, or _MISSING."""
    node: Any = tree
    for name in key.split("."):
        if not isinstance(node, Mapping) or name not in node:
            return _MISSING
        node = node[name]
    return node


def _leaf(spec: JobSpec, key: str) -> object:
    """The validated value at dotted `key`."""
    node: object = spec
    for name in key.split("."):
        node = getattr(node, name)
    return node

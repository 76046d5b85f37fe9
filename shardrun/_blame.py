"""Turning validation failures into one sentence that names who set the bad value.

A bad value is fixed where it was set, so every problem is phrased against its source:
`jobs/x.yaml: shards must be ...`, `environment variable SHARDRUN_SHARDS must be ...` or
`--shards must be ...`. Pydantic's own multi-line text never reaches the user.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from shardrun._ellipsis import ellipsize
from shardrun._env import ENV_BY_KEY

Problem = tuple[str | None, str]
"""(job file origin or None, text); the origin is printed once before a run of its problems."""

_SECRET_SHAPED = frozenset({"endpoint.api_key_env"})
"""Keys whose rejected value may be a pasted secret: never echoed back."""

_MUST_BE_OVERRIDES: Mapping[str, str] = {
    "endpoint.base_url": ("a URL starting with http:// or https:// (a port from 1 to 65535 if "
                          "any, no spaces, no #fragment), or sim://"),
    "endpoint.api_key_env": (
        "the name of an environment variable (like OPENAI_API_KEY), not the key itself"
    ),
    "endpoint.api_key_header": "an HTTP header name, such as Authorization or api-key",
    "endpoint.headers": "a mapping of header names to text (quote a number: X-Version: '2')",
    "rate_limits.rpm": ("a number of at least 0.01 (requests per minute: one request in 100 "
                        "minutes), or none for no limit"),
    "rate_limits.tpm": "a number of at least 1 (tokens per minute), or none for no limit",
}

_CROSS_FIELD: Mapping[str, str] = {
    "backoff_order": (
        "{subject} must be at least {other} ({other_value}{other_src}), got {got}{got_src}"
    ),
    "sim_needs_sim_url": (
        "{subject} is only allowed when endpoint.base_url is sim://,"
        " but base_url is {other_value}{other_src}"
    ),
    "one_input_field": "{subject} and {other} are both set; give exactly one of them",
    "messages_need_chat": (
        "{subject} needs endpoint.api 'chat' or 'responses' (the completions API takes no"
        " message lists), but endpoint.api is {other_value}{other_src}"
    ),
    "responses_limit": (
        "{subject} does not apply to the Responses API (endpoint.api is"
        " {other_value}{other_src}): give the token limit as params.max_output_tokens"
    ),
    "system_with_messages": (
        "{subject} cannot be combined with {other}: a message list carries its own system"
        " message"
    ),
    "batch_needs_no_prompt": (
        "{subject} does not apply to input.format 'openai-batch': each line carries its own"
        " request body"
    ),
    "pricing_basis": (
        "{subject} cannot be combined with {other}: give either an hourly price or per-token"
        " prices"
    ),
    "key_header_in_headers": (
        "{subject} must not set {other_value}, the header {other} names for the key of"
        " endpoint.api_key_env"
    ),
    "url_auth_in_headers": (
        "{subject} must not set Authorization: {other} carries a user name and password,"
        " which are sent as that header"
    ),
    "params_reserved": (
        "{subject} must not set {got}: shardrun sends the model, the prompt, messages or"
        " input, and stream itself"
    ),
    "params_n": (
        "{subject} must not set n to {got}: a result holds one answer, so to get several,"
        " give the input one record per answer"
    ),
}

_VALUE_RULES: Mapping[str, str] = {
    "template_syntax": "{subject} is not a valid template: {why}",
    "header_rule": "{subject} {why}",
    "json_value": "{subject}{path} {why}",
    "url_rule": "{subject} {why}",
    "model_rule": "{subject} {why}",
    "string_unicode": ("{subject} has bytes that are not UTF-8 (a name made under another "
                       "encoding), which the run's files cannot record; give it in UTF-8"),
}
"""Single-field rules whose reason is more useful than 'must be <type>'."""

_NUMBER_TEXT = re.compile(r"\s*[-+]?[0-9][0-9_]*(\.[0-9_]*)?([eE][-+]?[0-9]+)?\s*")


@dataclass(frozen=True)
class Blame:
    """What a message needs to know: the file as given, each key's source and typed text."""

    origin: str
    sources: Mapping[str, str]
    shown: Mapping[str, str]
    fields: Mapping[str, FieldInfo]

    def subject(self, key: str) -> Problem:
        """Who to blame for `key`: the flag, the variable, or the job file and the key."""
        source = self.sources.get(key, "job file")
        if source.startswith("flag "):
            return None, source.removeprefix("flag ")
        if source.startswith("env "):
            return None, f"environment variable {source.removeprefix('env ')}"
        return self.origin, key

    def source_note(self, key: str) -> str:
        """', from env X' when a related value did not come from the file the user is reading."""
        source = self.sources.get(key, "job file")
        if source == "default":
            return ", the default"
        return "" if source == "job file" else f" from {source}"

    def default_note(self, key: str) -> str:
        """' (the default: ...)' for a value no one gave, saying where one is given."""
        if self.sources.get(key) != "default":
            return ""
        var = ENV_BY_KEY.get(key)
        return f" (the default: set {key}" + (f" or {var.name})" if var else ")")


def render(problems: Sequence[Problem], limit: int = 8) -> str:
    """Join problems with '; ', printing a file origin only when it changes."""
    parts: list[str] = []
    last_origin: str | None = None
    for origin, text in problems[:limit]:
        parts.append(f"{origin}: {text}" if origin is not None and origin != last_origin else text)
        last_origin = origin
    if len(problems) > limit:
        parts.append(f"and {len(problems) - limit} more")
    return "; ".join(parts)


def must_be(key: str, field: FieldInfo) -> str:
    """What an acceptable value looks like, derived from the field's type and constraints."""
    if key in _MUST_BE_OVERRIDES:
        return _MUST_BE_OVERRIDES[key]
    annotation = _without_none(field.annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping"
    if typing.get_origin(annotation) is typing.Literal:
        *first, last = (repr(choice) for choice in typing.get_args(annotation))
        return f"{', '.join(first)} or {last}" if first else last
    if typing.get_origin(annotation) is dict:
        return "a mapping with string keys"
    if annotation is str:
        return "a non-empty string"
    if annotation is bool:
        return "true or false"
    noun = "an integer" if annotation is int else "a number"
    return noun + _bounds(field.metadata)


def _without_none(annotation: Any) -> Any:
    """`X | None` -> X, so optional fields are described by what they hold when set."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) is not None and len(args) == 1 else annotation


def _bounds(metadata: Iterable[object]) -> str:
    """' from 1 to 1024', ' above 0 and at most 60', ' greater than 0', ' of at least 0' or ''
    from annotated_types."""
    lo: object = None
    hi: object = None
    strict_lo = False
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            lo = item.ge
        elif isinstance(item, annotated_types.Gt):
            lo, strict_lo = item.gt, True
        elif isinstance(item, annotated_types.Le):
            hi = item.le
    if lo is not None and hi is not None:
        return f" above {lo} and at most {hi}" if strict_lo else f" from {lo} to {hi}"
    if lo is not None:
        return f" greater than {lo}" if strict_lo else f" of at least {lo}"
    return ""


def show(key: str, value: object, blame: Blame) -> str:
    """The rejected value as the user wrote it: their text for env/flags, else a short repr,
    with YAML's words for null, true and false (a file never says None)."""
    if key in blame.shown:
        value = blame.shown[key]
    elif value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return ellipsize(repr(value), 60)


_YAML11_WORDS = ("yes", "no", "on", "off")
"""Words YAML 1.1 reads as booleans, and job files (YAML 1.2) as text."""


def value_problem(key: str, value: object, blame: Blame, loc_rest: Sequence[object]) -> Problem:
    """'<subject> must be <what>, got <value>', with a hint for quoted numbers in YAML."""
    origin, subject = blame.subject(key)
    text = f"{subject} must be {must_be(key, blame.fields[key])}"
    if key in _SECRET_SHAPED:
        return origin, text
    if loc_rest and loc_rest[-1] == "[key]":
        return origin, f"{text}, got the key {value!r}"
    text += f", got {show(key, value, blame)}"
    quoted_number = isinstance(value, str) and _NUMBER_TEXT.fullmatch(value)
    if origin is not None and quoted_number and "a mapping" not in text:
        text += " (quoted, so YAML reads it as text; remove the quotes)"
    elif origin is not None and "string" in text and isinstance(value, bool):
        text += " (YAML reads an unquoted true or false as a boolean; quote the value)"
    elif (origin is not None and "true or false" in text and isinstance(value, str)
          and value.lower() in _YAML11_WORDS):
        # Read as text (YAML 1.2, `_jobfile`): a reader of YAML 1.1 took it for a boolean.
        text += (" (a job file reads yes, no, on and off as text, as YAML 1.2 does; write true "
                 "or false)")
    elif origin is not None and "string" in text and isinstance(value, int | float):
        text += " (YAML reads it as a number; quote the value)"
    return origin, text


def missing_problem(key: str, blame: Blame) -> Problem:
    """'<file>: endpoint.model is required', naming the variable that could also set it."""
    var = ENV_BY_KEY.get(key)
    hint = f" (set it in the job file or with {var.name})" if var is not None else ""
    return blame.origin, f"{key} is required{hint}"


def unknown_key_problem(origin: str, key: str, candidates: Sequence[str]) -> Problem:
    """'<file>: unknown key 'concurency' (did you mean 'concurrency'?)'.

    A key inside a section is matched against that section's keys only (`rate_limits.foo` is
    not close to `rate_limits`); with no close one, a small section lists what it takes."""
    if key == "endpoint.api_key":  # the key itself, pasted where only its variable is read
        return origin, (f"unknown key '{key}' (a job file holds no key: put it in an "
                        "environment variable and name that variable in endpoint.api_key_env, "
                        "as api_key_env: OPENAI_API_KEY)")
    parent, _, leaf = key.rpartition(".")
    siblings = [c for c in candidates if c.rpartition(".")[0] == parent]
    by_leaf = {c.rpartition(".")[2]: c for c in siblings}
    close = [by_leaf[n] for n in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    if not close:  # the right name in the wrong section: `retry.rpm`
        close = [c for c in candidates if c.rpartition(".")[2] == leaf][:1]
    if close:
        hint = f" (did you mean '{close[0]}'?)"
    elif parent and len(siblings) <= SECTION_LIST_MAX:
        names = ", ".join(c.rpartition(".")[2] for c in siblings)
        hint = f" ({parent} takes: {names})"
    else:
        hint = ""
    return origin, f"unknown key '{key}'{hint}"


SECTION_LIST_MAX = 8
"""A section with at most this many keys is listed when an unknown key in it is near none."""


def translate(errors: Iterable[ErrorDetails], blame: Blame) -> list[Problem]:
    """One Problem per pydantic error, attributed to the layer that set the value."""
    return [_one(error, blame) for error in errors]


def _one(error: ErrorDetails, blame: Blame) -> Problem:
    """Dispatch on the pydantic error type: missing, cross-field, or a bad single value."""
    key, rest = _key_of(error["loc"], blame.fields)
    ctx = error.get("ctx") or {}
    if error["type"] in _CROSS_FIELD:
        return _cross_field(error["type"], key, ctx, blame)
    if error["type"] == "missing":
        return missing_problem(key, blame)
    if error["type"] in _VALUE_RULES:
        origin, subject = blame.subject(key)
        return origin, _VALUE_RULES[error["type"]].format(subject=subject, **ctx)
    if key not in blame.fields:
        return blame.origin, f"{key or 'the job'}: {error['msg']}"
    return value_problem(key, error["input"], blame, rest)


def _key_of(loc: Sequence[object], fields: Mapping[str, FieldInfo]) -> tuple[str, list[object]]:
    """The longest dotted prefix of `loc` that names a field, and what is left over."""
    parts = [str(p) for p in loc]
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in fields:
            return key, list(loc[n:])
    return ".".join(parts), []


def _cross_field(kind: str, base: str, ctx: Mapping[str, Any], blame: Blame) -> Problem:
    """A rule over two fields: blame the first, and say where the other one's value came from."""
    key = _join(base, ctx["field"])
    other = _join(base, ctx.get("other", ""))
    origin, subject = blame.subject(key)
    text = _CROSS_FIELD[kind].format(
        subject=subject,
        other=other,
        other_value=show(other, ctx.get("other_value"), blame),
        other_src=blame.source_note(other),
        got=ctx["got"] if kind.startswith("params_") else show(key, ctx.get("value"), blame),
        got_src=blame.default_note(key),
    )
    return origin, text


def _join(base: str, name: str) -> str:
    """Dotted path of `name` inside the model at `base` ('' is the top level)."""
    return f"{base}.{name}" if base and name else base or name

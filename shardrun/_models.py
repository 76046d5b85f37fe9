"""The job model: the validated, frozen tree a job file describes (see `spec` for loading).

Defaults live here and nowhere else. The models are strict (no str->int coercion: a quoted
number in YAML is usually a mistake) and reject unknown keys; rules that span two fields raise
`PydanticCustomError`s whose ctx names both fields, so `_blame` can say where each value came
from.
"""

from __future__ import annotations

import datetime
import math
import re
import unicodedata
from collections import Counter
from collections.abc import Mapping
from pathlib import PurePath
from types import MappingProxyType
from typing import Any, Literal, get_origin
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from shardrun._ellipsis import ellipsize
from shardrun._env import NONE_WORDS, Kind
from shardrun._template import TemplateError, parse_template
from shardrun._urls import masked_url

_NON_BLANK = r"\S"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_RESERVED_PARAMS = ("model", "prompt", "messages", "input", "stream")
_API_PATHS = ("/chat/completions", "/completions", "/responses")  # what the client appends
_HEADER_NAME = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$"  # an HTTP token (RFC 9110)
# Headers the client sets itself or that HTTP's framing owns: a job may not replace them.
_RESERVED_HEADERS = frozenset({"accept", "connection", "content-length", "content-type", "host",
                               "proxy-authorization", "transfer-encoding"})  # fmt: skip


class _Frozen(BaseModel):
    """Shared config: immutable, no unknown keys, no silent str->int coercion, finite floats."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class EndpointSpec(_Frozen):
    """Where requests go. `sim` (simulator settings) is only meaningful with `sim://`."""

    base_url: str
    api: Literal["chat", "completions", "responses"] = "chat"
    model: str = Field(pattern=_NON_BLANK)
    api_key_env: str | None = Field(default=None, pattern=_ENV_NAME)
    # The header that carries the key: `Authorization` sends `Bearer KEY`; any other header
    # (`api-key`, `x-api-key`, as some servers and gateways want) sends the key as it is.
    api_key_header: str = Field(default="Authorization", pattern=_HEADER_NAME)
    headers: dict[str, str] = Field(default_factory=dict)  # sent with every request, as given
    # Ask for usage in the stream (stream_options.include_usage). Servers and API versions that
    # predate the option answer 400; without it, completion tokens are counted from the stream.
    stream_usage: bool = True
    sim: dict[str, Any] | None = None

    @field_validator("model")
    @classmethod
    def _model_as_written(cls, name: str) -> str:
        """A name with an invisible character (a zero-width space pasted with it) or spaces
        around it (a quoted YAML value) is sent as it is, and the server knows no such model:
        every item would be a paid 404."""
        odd = next((c for c in name if invisible(c)), None)
        if odd is not None:
            why = (f"holds the invisible character {char_name(odd)}: "
                   f"'{ellipsize(visible(name), 60)}'")
        elif name != name.strip():
            why = f"has spaces around it: {ellipsize(repr(name), 60)}"
        else:
            return name
        raise PydanticCustomError("model_rule", "bad model name: {why}", {"why": (
            f"{why}, and no server knows a model by that name; give the name alone")})

    @field_validator("headers")
    @classmethod
    def _usable_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            why = None
            if not re.match(_HEADER_NAME, name):
                why = f"has {name!r}, which is not an HTTP header name"
            elif name.lower() in _RESERVED_HEADERS:
                why = f"must not set {name}: shardrun sends it itself"
            elif "\r" in value or "\n" in value:
                why = f"has a line break in the value of {name}"
            if why is not None:
                raise PydanticCustomError("header_rule", "bad header: {why}", {"why": why})
        return headers

    @field_validator("base_url")
    @classmethod
    def _known_scheme(cls, url: str) -> str:
        """Only HTTP(S) endpoints with a host, or exactly sim:// for the embedded simulator."""
        if url == "sim://":
            return url
        odd = next((c for c in url if invisible(c) and not c.isspace()), None)
        if odd is not None:  # a zero-width space pasted with it: the URL looks right in a stop
            raise PydanticCustomError("url_rule", "base_url holds an invisible character", {
                "why": (f"holds the invisible character {char_name(odd)}: "
                        f"'{ellipsize(visible(masked_url(url)), 80)}'; give the URL without it")})
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError("base_url must start with http:// or https://, or be sim://")
        if parts.fragment or url != "".join(url.split()):  # a space would end up in every path
            raise ValueError("base_url must start with http:// or https://, or be sim://")
        try:
            port = parts.port  # raises for a port out of range or not a number
        except ValueError:
            port = 0
        if port == 0 and parts.netloc.rpartition("]")[2].count(":"):  # "host:" or "host:0"
            raise ValueError("base_url has no valid port")
        path = parts.path.rstrip("/")
        pasted = next((tail for tail in _API_PATHS if path.endswith(tail)), None)
        if pasted is not None:  # the whole endpoint pasted: every request would be a 404
            base = masked_url(urlunsplit(parts._replace(path=path.removesuffix(pasted))))
            raise PydanticCustomError("url_rule", "base_url ends in an API path", {"why": (
                f"ends in {pasted}, which shardrun adds itself (the path of endpoint.api): give "
                f"the URL before it, {base}")})
        return url

    @model_validator(mode="after")
    def _one_source_per_header(self) -> EndpointSpec:
        """A job header must not stand for the key's header (one would replace the other), nor
        for Authorization when the URL has a user and password (aiohttp sends those as it)."""
        names = {name.lower() for name in self.headers}
        if self.api_key_env is not None and self.api_key_header.lower() in names:
            raise PydanticCustomError(
                "key_header_in_headers",
                "endpoint.headers sets the header that carries the key",
                {"field": "headers", "other": "api_key_header",
                 "other_value": self.api_key_header},
            )
        if "authorization" in names and urlsplit(self.base_url).username is not None:
            raise PydanticCustomError(
                "url_auth_in_headers",
                "endpoint.headers sets Authorization and base_url has credentials",
                {"field": "headers", "other": "base_url"},
            )
        return self

    @model_validator(mode="after")
    def _sim_needs_sim_url(self) -> EndpointSpec:
        """Simulator settings with a real URL mean the user thinks they are simulating: refuse."""
        if self.sim is not None and self.base_url != "sim://":
            raise PydanticCustomError(
                "sim_needs_sim_url",
                "endpoint.sim is only allowed when endpoint.base_url is sim://",
                {"field": "sim", "other": "base_url", "other_value": self.base_url},
            )
        return self


_INVISIBLE = frozenset(
    "\u200b\u2060\ufeff\u00ad\u180e\u2061\u2062\u2063\u2064"  # zero-width, soft hyphen
    "\u200e\u200f\u061c\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"  # direction
    "\u206a\u206b\u206c\u206d\u206e\u206f"  # deprecated shaping and digit controls
    "\ufff9\ufffa\ufffb"  # interlinear annotation marks
    + "".join(map(chr, range(0xE0000, 0xE0080)))  # tag characters (U+E0000-U+E007F)
)
"""Format characters that show nothing and have no place in a name or URL: a zero-width space,
word joiner, byte-order mark, soft hyphen, invisible operators, direction marks, the deprecated
format characters U+206A-U+206F, the interlinear annotation marks U+FFF9-U+FFFB and the tag
characters U+E0000-U+E007F (which can spell a hidden text: 'gpt<U+E0041>x' shows as 'gptx').
Not every format character (category Cf): U+200C and U+200D (zero-width non-joiner and joiner)
spell Persian and Indic words and join emoji; and a character this Python's Unicode tables do
not know yet (a newer emoji) is not refused for that."""


def invisible(char: str) -> bool:
    """A character no one sees in a terminal: a control character, one of _INVISIBLE (U+200B,
    U+FEFF, U+00AD, the direction marks, the tag characters), a private-use character (category
    Co: no font shows it the same, most none at all), a line or paragraph separator, or a space
    other than the plain one (U+00A0)."""
    if char in _INVISIBLE:
        return True
    category = unicodedata.category(char)
    return category in ("Cc", "Co", "Zl", "Zp") or (category == "Zs" and char != " ")


def char_name(char: str) -> str:
    """'U+200B (ZERO WIDTH SPACE)', or the code alone for a character with no name."""
    name = unicodedata.name(char, "")
    return f"U+{ord(char):04X}" + (f" ({name})" if name else "")


def visible(text: str) -> str:
    """`text` with each invisible character written as <U+XXXX>."""
    return "".join(f"<U+{ord(c):04X}>" if invisible(c) else c for c in text)


InputFormat = Literal["jsonl", "csv", "parquet", "openai-batch"]
_FORMAT_BY_SUFFIX: Mapping[str, InputFormat] = {".csv": "csv", ".parquet": "parquet"}
_PROMPT_SOURCES = ("prompt_field", "messages_field", "template")
_BATCH_UNUSED = (*_PROMPT_SOURCES, "system_prompt")


def format_for_path(path: str) -> InputFormat:
    """The input format a file name implies: `.csv`, `.parquet`, else JSON lines."""
    return _FORMAT_BY_SUFFIX.get(PurePath(path).suffix.lower(), "jsonl")


class InputSpec(_Frozen):
    """Which input file, in which format, and how each record becomes a request.

    A record's prompt comes from exactly one of `prompt_field` (a string), `messages_field`
    (a chat message list) or `template` (a user message filled from the record's fields);
    `system_prompt` adds a system message to the first and the last. `openai-batch` lines
    carry their own request body, so none of these apply to them.
    """

    path: str = Field(pattern=_NON_BLANK)
    format: InputFormat
    id_field: str = Field(default="id", pattern=_NON_BLANK)
    prompt_field: str | None = Field(default=None, pattern=_NON_BLANK)
    messages_field: str | None = Field(default=None, pattern=_NON_BLANK)
    template: str | None = Field(default=None, pattern=_NON_BLANK)
    system_prompt: str | None = Field(default=None, pattern=_NON_BLANK)

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        """The format from the file name; with no prompt source, the field "prompt"."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("format") is None and isinstance(data.get("path"), str):
            data["format"] = format_for_path(data["path"])
        none_given = all(data.get(name) is None for name in _PROMPT_SOURCES)
        if none_given and data.get("format") != "openai-batch":
            data["prompt_field"] = "prompt"
        return data

    @field_validator("template")
    @classmethod
    def _template_parses(cls, text: str | None) -> str | None:
        """A template is checked once, here, so no record can make it fail later."""
        if text is not None:
            try:
                parse_template(text)
            except TemplateError as exc:
                raise PydanticCustomError(
                    "template_syntax", "bad template: {why}", {"why": str(exc)}
                ) from None
        return text

    @model_validator(mode="after")
    def _one_input_field(self) -> InputSpec:
        """Each item is a text prompt, a message list or a filled template; two is ambiguous."""
        given = [name for name in _PROMPT_SOURCES if getattr(self, name) is not None]
        if self.format == "openai-batch":
            return self._nothing_for_batch()
        if len(given) > 1:
            raise PydanticCustomError(
                "one_input_field",
                "give exactly one of input.prompt_field, input.messages_field, input.template",
                {"field": given[0], "other": given[1]},
            )
        if self.system_prompt is not None and self.messages_field is not None:
            raise PydanticCustomError(
                "system_with_messages",
                "input.system_prompt cannot be combined with input.messages_field",
                {"field": "system_prompt", "other": "messages_field"},
            )
        return self

    def _nothing_for_batch(self) -> InputSpec:
        """OpenAI Batch lines hold whole request bodies: prompt settings would be ignored."""
        for name in _BATCH_UNUSED:
            if getattr(self, name) is not None:
                raise PydanticCustomError(
                    "batch_needs_no_prompt",
                    "input.{name} does not apply to input.format openai-batch",
                    {"field": name, "name": name},
                )
        return self


class TimeoutsSpec(_Frozen):
    """Per-attempt deadlines in seconds; each one maps to its own attempt status."""

    connect_s: float = Field(default=10.0, gt=0)
    first_token_s: float = Field(default=60.0, gt=0)
    idle_s: float = Field(default=30.0, gt=0)
    total_s: float = Field(default=600.0, gt=0)


class RetrySpec(_Frozen):
    """Exponential backoff bounded per item (max_attempts) and per run (the retry budget)."""

    max_attempts: int = Field(default=4, ge=1, le=100)
    backoff_s: float = Field(default=0.5, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)
    budget_ratio: float = Field(default=0.2, ge=0)
    # At most 1e9, which JSON and the manifest hold: a floor above the items is unlimited anyway.
    budget_floor: int = Field(default=10, ge=0, le=1_000_000_000)
    # A server asking for a longer wait dead-letters the item rather than parking it for hours.
    max_server_wait_s: float = Field(default=300.0, gt=0)
    # An endpoint down (requests getting no answer at all, or a gateway's 502/504) waited for
    # this long stops the run for --resume, rather than dead-letter every item it meets.
    outage_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _backoff_order(self) -> RetrySpec:
        """A cap below the first backoff is a typo, not a policy."""
        if self.backoff_max_s < self.backoff_s:
            raise PydanticCustomError(
                "backoff_order",
                "retry.backoff_max_s must be at least retry.backoff_s",
                {
                    "field": "backoff_max_s",
                    "value": self.backoff_max_s,
                    "other": "backoff_s",
                    "other_value": self.backoff_s,
                },
            )
        return self


RPM_FLOOR, TPM_FLOOR = 0.01, 1.0


class RateLimitsSpec(_Frozen):
    """Job-wide limits shared by all shards (each gets 1/N); None means no limit."""

    # Floors that no real limit is under: below them (`--rpm 1e-9`, a typo for 1e9) a run
    # sends one request and then sits idle for years, looking hung.
    rpm: float | None = Field(default=None, ge=RPM_FLOOR)  # one request in 100 minutes
    tpm: float | None = Field(default=None, ge=TPM_FLOOR)  # a token, the smallest cost

    @field_validator("rpm", "tpm", mode="before")
    @classmethod
    def _no_limit_word(cls, value: object) -> object:
        """`none` (or another word the environment variables take for it) means no limit in
        the job file too, as null does."""
        if isinstance(value, str) and value.strip().lower() in NONE_WORDS:
            return None
        return value


class PricingSpec(_Frozen):
    """Prices for the cost report: per million tokens, or per hour of a dedicated server."""

    input_per_1m: float | None = Field(default=None, ge=0)
    output_per_1m: float | None = Field(default=None, ge=0)
    # Prompt tokens the server read from its prompt cache (usage's cached_tokens); providers
    # bill them at a discount. Unset: they cost the input rate.
    cached_input_per_1m: float | None = Field(default=None, ge=0)
    hourly: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one_basis(self) -> PricingSpec:
        """An hourly price and token prices describe two different bills: pick one."""
        token_key = next(
            (k for k in ("input_per_1m", "output_per_1m", "cached_input_per_1m")
             if getattr(self, k) is not None),
            None,
        )
        if self.hourly is not None and token_key is not None:
            raise PydanticCustomError(
                "pricing_basis",
                "pricing.hourly cannot be combined with pricing.{other}",
                {"field": "hourly", "other": token_key},
            )
        return self


class OutputSpec(_Frozen):
    """What the run writes besides its own files: `openai-batch` adds Batch API files."""

    format: Literal["shardrun", "openai-batch"] = "shardrun"


class JobSpec(_Frozen):
    """The whole validated job. `params` is passed through into every request body."""

    endpoint: EndpointSpec
    input: InputSpec
    params: dict[str, Any] = Field(default_factory=dict)
    shards: int = Field(default=4, ge=1, le=1024)
    concurrency: int = Field(default=16, ge=1, le=100_000)
    timeouts: TimeoutsSpec = Field(default_factory=lambda: TimeoutsSpec())
    retry: RetrySpec = Field(default_factory=lambda: RetrySpec())
    runs_dir: str = Field(default="runs", pattern=_NON_BLANK)
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # fork: one launcher imports a shard's code once and forks the shards (placement.py);
    # spawn: a fresh interpreter per shard, for platforms or libraries where fork is unsafe.
    shard_start: Literal["fork", "spawn"] = "fork"
    # How often results are fsync'ed: the most a machine crash can lose (a kill -9 loses nothing).
    fsync_interval_s: float = Field(default=1.0, gt=0, le=60)
    # A running shard reports every 0.2 s, busy or idle; one silent this long is killed and
    # replaced. The floor of 2 s keeps a loaded machine's hiccups from passing for a hang.
    shard_silence_s: float = Field(default=60.0, ge=2, le=86_400)
    rate_limits: RateLimitsSpec = Field(default_factory=lambda: RateLimitsSpec())
    pricing: PricingSpec = Field(default_factory=lambda: PricingSpec())
    output: OutputSpec = Field(default_factory=lambda: OutputSpec())

    @field_validator("params")
    @classmethod
    def _no_reserved_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Keys the client sets itself would be silently overwritten (or break streaming)."""
        clash = [name for name in _RESERVED_PARAMS if name in params]
        if clash:
            names = ", ".join(repr(name) for name in clash)
            raise PydanticCustomError(
                "params_reserved", "params must not set {got}", {"field": "", "got": names}
            )
        # Several choices stream interleaved into one answer's text: refuse rather than mix.
        if params.get("n", 1) != 1:
            raise PydanticCustomError(
                "params_n", "params.n must be 1", {"field": "", "got": repr(params["n"])}
            )
        return {name: _json_value(value, f".{name}") for name, value in params.items()}

    @model_validator(mode="after")
    def _messages_need_chat(self) -> JobSpec:
        """Message lists only make sense for the chat and Responses APIs; completions takes a
        prompt string.

        A system prompt makes a message list too; a template alone does not (with the
        completions API the filled template is the prompt).
        """
        for name in ("messages_field", "system_prompt"):
            if getattr(self.input, name) is not None and self.endpoint.api == "completions":
                raise PydanticCustomError(
                    "messages_need_chat",
                    "input.{name} needs endpoint.api 'chat'",
                    {
                        "field": f"input.{name}",
                        "name": name,
                        "other": "endpoint.api",
                        "other_value": self.endpoint.api,
                    },
                )
        return self

    @model_validator(mode="after")
    def _responses_limit(self) -> JobSpec:
        """The Responses API names its token limit max_output_tokens and refuses the chat
        names, which would fail every request of the run: say so before any."""
        for name in ("max_tokens", "max_completion_tokens"):
            if self.endpoint.api == "responses" and name in self.params:
                raise PydanticCustomError(
                    "responses_limit",
                    "params.{name} does not apply to endpoint.api 'responses'",
                    {"field": f"params.{name}", "name": name, "other": "endpoint.api",
                     "other_value": self.endpoint.api},
                )  # fmt: skip
        return self


def _json_value(value: Any, path: str) -> Any:
    """`value` as the JSON every request body carries it as; YAML's other types are an error
    naming where they are (`params.s` a set, binary, nan, a !!timestamp), as the body's encoder
    would fail on them at the first request (or send nan as null). An integer key becomes its
    text, the only form JSON has for it: `logit_bias: {50256: -100}`."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        why = f"is {value}, which JSON cannot carry"
    elif isinstance(value, list):
        return [_json_value(item, f"{path}[{n}]") for n, item in enumerate(value)]
    elif isinstance(value, dict):
        bad = next((k for k in value if isinstance(k, bool) or not isinstance(k, str | int)), None)
        texts = [str(k) for k in value]
        counts = Counter(texts)  # texts.count per key was quadratic: 50,001 keys took 20 s
        twice = next((k for k in texts if counts[k] > 1), None)
        if bad is None and twice is None:
            return {str(k): _json_value(item, f"{path}.{k}") for k, item in value.items()}
        why = (f"has the key {bad!r}, which JSON cannot carry (keys are text; quote it)"
               if bad is not None else f"has the key {twice} twice, as a number and as text")
    elif isinstance(value, datetime.date):
        why = (f"is the date {value.isoformat()} (tagged !!timestamp), which JSON has no form "
               "of; leave the tag out to send it as text")
    else:
        why = f"is {type(value).__name__} {ellipsize(repr(value), 40)}, which JSON cannot carry"
    raise PydanticCustomError("json_value", "not JSON: {why}", {"path": path, "why": why})


def _fields(model: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    """Every dotted key of the tree (sections and leaves) with its FieldInfo."""
    out: dict[str, FieldInfo] = {}
    for name, info in model.model_fields.items():
        out[prefix + name] = info
        if _section(info) is not None:
            out.update(_fields(_section_model(info), prefix + name + "."))
    return out


def _section(info: FieldInfo) -> type[BaseModel] | None:
    """The nested model of a section field, or None for a leaf."""
    ann = info.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _section_model(info: FieldInfo) -> type[BaseModel]:
    """The nested model of a field already known to be a section."""
    model = _section(info)
    assert model is not None
    return model


FIELDS: Mapping[str, FieldInfo] = MappingProxyType(_fields(JobSpec))
SECTION_KEYS: frozenset[str] = frozenset(k for k, info in FIELDS.items() if _section(info))
LEAF_KEYS: tuple[str, ...] = tuple(k for k, info in FIELDS.items() if _section(info) is None)


def kind_of(key: str) -> Kind:
    """How env/flag text for `key` is parsed; optional fields are parsed as what they hold."""
    ann = FIELDS[key].annotation
    if ann is int:
        return "int"
    if ann is float:
        return "float"
    if ann == float | None:
        return "optional_float"
    if ann in (str, str | None) or get_origin(ann) is Literal:
        return "str"
    return "other"

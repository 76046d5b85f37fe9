"""The simulated model without I/O: its knobs (`SimConfig`) and what it answers (`make_plan`).

`SimConfig` is frozen and validated once, so the server's hot path never re-checks it. It
travels three ways: built in code (tests, benchmarks), from a job file's mapping
(`from_mapping`), and as command-line flags (`to_args`) for the launcher's separate process.
`make_plan` turns a request body into its whole answer up front; the answer depends only on
the seed and the prompt, messages or input, never on arrival order, so reruns compare equal.

Fault injection (issue #3): the `FAULT_KINDS` fractions (each in [0, 1], summing to at most 1)
say what share of requests meet each fault; `shardrun.sim.faults` explains how one is drawn.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

#: Hard ceiling on a sampled output length, so a wide lognormal cannot ask for a million tokens.
MAX_SAMPLED_TOKENS = 65536

TokenKind = Literal["fixed", "uniform", "lognormal"]
Kind = Literal["chat", "completions", "responses"]
TEXTS = ("words", "prose")
"""What the words look like (`SimConfig.text`): plain, or prose with bytes JSON escapes."""
#: What the answers of an enforced limit say of it (`SimConfig.rpm_headers`, sim/limit.py).
LIMIT_HEADERS = ("openai", "retry_after", "none")

#: 256 distinct three-letter words; byte i of a per-request random string picks word i.
_C, _V = "bdfgklmnprstvz", "aeiou"
WORDS: tuple[bytes, ...] = tuple(f" {a}{v}{b}".encode() for a in _C for v in _V for b in _C)[:256]


def _prose(i: int, word: str) -> str:
    """Word i as prose: every fourth ends a line, is quoted, ends in a backslash or starts
    with a tab, the bytes a JSON string holds only escaped (as prose, code and JSON output do)."""
    if i % 4 != 3:
        return word
    return (word + ".\n", ' "' + word[1:] + '"', word + "\\", "\t" + word[1:])[i // 4 % 4]


#: The words as text, by `SimConfig.text` (text mode "words": WORDS decoded).
TEXT_WORDS: dict[str, tuple[str, ...]] = {
    "words": tuple(w.decode() for w in WORDS),
    "prose": tuple(_prose(i, w.decode()) for i, w in enumerate(WORDS)),
}


@dataclass(frozen=True, slots=True)
class TokenSpec:
    """A parsed output-length distribution; `sample` draws from a per-request generator."""

    kind: TokenKind
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        """Draw one output length (at least 1, at most MAX_SAMPLED_TOKENS)."""
        if self.kind == "fixed":
            n = int(self.a)
        elif self.kind == "uniform":
            n = rng.randint(int(self.a), int(self.b))
        else:
            n = round(rng.lognormvariate(math.log(self.a), self.b))
        return max(1, min(n, MAX_SAMPLED_TOKENS))


def _number(text: str, what: str, spec: str) -> float:
    """Parse one number of a distribution string, naming the spec when it is not a number."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"tokens: {what} in {spec!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"tokens: {what} in {spec!r} must be finite")
    return value


def _integer(text: str, what: str, spec: str) -> int:
    """Parse a positive whole number of a distribution string."""
    value = _number(text, what, spec)
    if value != int(value) or value < 1:
        raise ValueError(f"tokens: {what} in {spec!r} must be a whole number of at least 1")
    return int(value)


def parse_tokens(spec: str) -> TokenSpec:
    """Parse "64", "uniform:LO:HI" or "lognormal:MEDIAN:SIGMA" into a TokenSpec.

    Raises ValueError with one sentence naming the `tokens` field, so a job-file typo reads as a
    configuration error rather than a crash inside a request handler.
    """
    if not isinstance(spec, str):
        raise ValueError(f"tokens must be a string such as '64' or 'uniform:16:96', not {spec!r}")
    parts = spec.strip().split(":")
    if len(parts) == 1:
        return TokenSpec("fixed", _integer(parts[0], "the length", spec))
    if parts[0] == "uniform" and len(parts) == 3:
        lo = _integer(parts[1], "LO", spec)
        hi = _integer(parts[2], "HI", spec)
        if lo > hi:
            raise ValueError(f"tokens: LO must not exceed HI in {spec!r}")
        return TokenSpec("uniform", lo, hi)
    if parts[0] == "lognormal" and len(parts) == 3:
        median = _number(parts[1], "MEDIAN", spec)
        sigma = _number(parts[2], "SIGMA", spec)
        if median <= 0 or sigma < 0:
            raise ValueError(f"tokens: MEDIAN must be > 0 and SIGMA >= 0 in {spec!r}")
        return TokenSpec("lognormal", median, sigma)
    raise ValueError(
        f"tokens must be an integer, 'uniform:LO:HI' or 'lognormal:MEDIAN:SIGMA', not {spec!r}"
    )


#: Fault fractions, in the order their shares are stacked on [0, 1) for the per-request draw.
#: reset_after_headers comes last, so that adding it moved no other fault's draws.
FAULT_KINDS = ("fail_429", "fail_500", "fail_503", "reset_before_headers", "drop_mid_stream",
               "stall_mid_stream", "slow_first_token", "reset_after_headers")  # fmt: skip
_FLOATS = ("ttft_ms", "itl_ms", "flush_ms", "retry_after_s", "stall_s", "slow_first_token_s",
           "refusal", "storm_s")  # fmt: skip
_INTS = ("capacity", "seed", "fail_first_n", "quota_after", "reasoning_tokens", "cached_tokens",
         "storm_after_n", "storm_status", "rpm_limit", "rpm_burst", "tpm_limit",
         "tpm_burst", "rpm_stated", "tpm_stated")  # fmt: skip
#: What a storm may answer every request with: a server's own error or a gateway's.
STORM_STATUSES = (500, 502, 503, 504)
_BOOLS = ("retry_after_503", "reject_stream_options", "ignore_stream", "obfuscation",
          "keepalive", "rpm_count_rejected")  # fmt: skip
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """How the simulated model behaves: latency, output length, capacity, seed and faults."""

    ttft_ms: float = 100.0
    itl_ms: float = 2.0
    tokens: str = "uniform:16:96"
    text: str = "words"  # one of TEXTS
    capacity: int = 0
    seed: int = 0
    flush_ms: float = 20.0
    # Shares of requests that meet each fault (see shardrun.sim.faults).
    fail_429: float = 0.0
    fail_500: float = 0.0
    fail_503: float = 0.0
    reset_before_headers: float = 0.0
    drop_mid_stream: float = 0.0
    stall_mid_stream: float = 0.0
    slow_first_token: float = 0.0
    reset_after_headers: float = 0.0
    retry_after_s: float = 1.0  # Retry-After of a 429 (and of a 503 with retry_after_503)
    retry_after_503: bool = False
    stall_s: float = 5.0  # pause in the middle of a stall_mid_stream answer
    slow_first_token_s: float = 5.0  # added to the first-token delay of slow_first_token
    fail_first_n: int = 0  # the first N requests, in arrival order, all get 503
    # A storm: for `storm_s` seconds from the arrival of request `storm_after_n` + 1, every
    # request gets `storm_status` (an overloaded server's 503, a broken one's 500, a gateway's
    # 502 or 504 with nothing behind it). 0 s: none.
    storm_s: float = 0.0
    storm_after_n: int = 0
    storm_status: int = 503
    # An account whose credit runs out: after N requests served (0: never), every request
    # gets 429 `insufficient_quota`, which no retry cures.
    quota_after: int = 0
    # An enforced limit of N requests a minute (0: none), a token bucket of `rpm_burst`
    # requests (0: one second's worth); over it, 429 `rate_limit_exceeded`. `rpm_headers`: what
    # the answers say of it; `rpm_count_rejected`: a rejected request counts against it too.
    # See shardrun.sim.limit.
    rpm_limit: int = 0
    rpm_burst: int = 0
    rpm_headers: str = "openai"  # one of LIMIT_HEADERS
    rpm_count_rejected: bool = False
    # The limit the answers state (x-ratelimit-limit-*, a token 429's words) where it is not
    # the one enforced (0: the enforced one), as a gateway replica stating its own.
    rpm_stated: int = 0
    tpm_stated: int = 0
    # An enforced limit of N tokens a minute (0: none), charged per request its prompt tokens
    # plus max_tokens (else the answer's tokens), a bucket of `tpm_burst` tokens (0: one
    # second's worth); its headers are those `rpm_headers` says. See shardrun.sim.limit.
    tpm_limit: int = 0
    tpm_burst: int = 0
    # Behave like servers that lack a feature: refuse `stream_options` with a 400 (servers and
    # API versions that predate it), or answer with one JSON body when asked to stream.
    reject_stream_options: bool = False
    ignore_stream: bool = False
    # False: close every connection after its answer (`Connection: close`), as servers and
    # gateways with keep-alive off do; each request then comes on a new connection.
    keepalive: bool = True
    # A reasoning model: the first N tokens of a chat answer are reasoning, sent as
    # `delta.reasoning_content` (in a whole answer, `message.reasoning_content`); of a Responses
    # answer, a reasoning item. They count in usage, and `max_tokens` (`max_output_tokens`)
    # caps them together with the content, as real servers do.
    reasoning_tokens: int = 0
    # A prompt cache: usage counts the first N prompt tokens (at most all of them) as cached,
    # in prompt_tokens_details (input_tokens_details for Responses), as servers that cache a
    # shared prefix report it. 0 leaves chat and completions usage without the details.
    cached_tokens: int = 0
    # The share of chat and Responses answers that are refusals (OpenAI's models declining a
    # structured output): the words come as `refusal` pieces instead of the answer's (or a
    # call's), decided per prompt like the words.
    refusal: float = 0.0
    # Pad every chat and completions chunk as OpenAI does, with an `obfuscation` member whose
    # length changes from chunk to chunk, unless the request's `stream_options` say
    # `include_obfuscation: false`.
    obfuscation: bool = False
    auth_required: str | None = dataclasses.field(default=None, repr=False)
    # A request whose body holds this text has its connection reset before any answer, every
    # time: a prompt that crashes the server's worker, or one a proxy in front refuses.
    reset_when: str | None = None

    def __post_init__(self) -> None:
        """Reject bad values at construction, naming the field in one sentence."""
        self._check_numbers()
        _check_faults(self)
        parse_tokens(self.tokens)
        if self.text not in TEXTS:
            raise ValueError(f"text must be one of {', '.join(TEXTS)}, not {self.text!r}")
        if self.rpm_headers not in LIMIT_HEADERS:
            raise ValueError(f"rpm_headers must be one of {', '.join(LIMIT_HEADERS)}, "
                             f"not {self.rpm_headers!r}")

    def _check_numbers(self) -> None:
        for name in _FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, not {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")
        for name in _INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, not {value!r}")
            if not 0 <= value < 2**63:
                raise ValueError(f"{name} must be >= 0 (and below 2**63), not {value!r}")
        if self.storm_status not in STORM_STATUSES:
            raise ValueError(f"storm_status must be one of {', '.join(map(str, STORM_STATUSES))}, "
                             f"not {self.storm_status!r}")  # fmt: skip
        if not self.refusal <= 1:
            raise ValueError(f"refusal must be a fraction between 0 and 1, not {self.refusal!r}")
        if self.reasoning_tokens > MAX_SAMPLED_TOKENS:
            raise ValueError(f"reasoning_tokens must be at most {MAX_SAMPLED_TOKENS}, "
                             f"not {self.reasoning_tokens!r}")  # fmt: skip

    @functools.cached_property
    def token_spec(self) -> TokenSpec:
        """The parsed `tokens` distribution (parsed once, not per request)."""
        return parse_tokens(self.tokens)

    @functools.cached_property
    def fault_table(self) -> tuple[tuple[str, float], ...]:
        """(kind, cumulative share) of each fault with a share > 0; empty when none is on."""
        table, acc = [], 0.0
        for kind in FAULT_KINDS:
            if share := getattr(self, kind):
                acc += share
                table.append((kind, acc))
        return tuple(table)

    def to_args(self) -> list[str]:
        """Command-line flags (always in pairs) that make `python -m shardrun.sim` run this.

        `auth_required` travels on the command line, so it is visible to `ps`: it is meant for a
        made-up test key, never a real one.
        """
        args = [
            "--ttft-ms", repr(float(self.ttft_ms)),
            "--itl-ms", repr(float(self.itl_ms)),
            "--tokens", self.tokens,
            "--text", self.text,
            "--capacity", str(self.capacity),
            "--seed", str(self.seed),
            "--flush-ms", repr(float(self.flush_ms)),
        ]  # fmt: skip
        for name in (*FAULT_KINDS, "retry_after_s", "stall_s", "slow_first_token_s", "refusal"):
            args += [_flag(name), repr(float(getattr(self, name)))]
        for name in _BOOLS:
            args += [_flag(name), "true" if getattr(self, name) else "false"]
        args += ["--fail-first-n", str(self.fail_first_n)]
        args += ["--storm-s", repr(float(self.storm_s)), "--storm-after-n", str(self.storm_after_n),
                 "--storm-status", str(self.storm_status)]
        args += ["--quota-after", str(self.quota_after)]
        args += ["--rpm-limit", str(self.rpm_limit), "--rpm-burst", str(self.rpm_burst),
                 "--rpm-headers", self.rpm_headers, "--rpm-stated", str(self.rpm_stated)]
        args += ["--tpm-limit", str(self.tpm_limit), "--tpm-burst", str(self.tpm_burst),
                 "--tpm-stated", str(self.tpm_stated)]
        args += ["--reasoning-tokens", str(self.reasoning_tokens)]
        args += ["--cached-tokens", str(self.cached_tokens)]
        if self.auth_required is not None:
            args += ["--auth-required", self.auth_required]
        if self.reset_when is not None:
            args += ["--reset-when", self.reset_when]
        return args

    @classmethod
    def from_mapping(cls, d: Mapping[str, object]) -> SimConfig:
        """Build from a job file's `sim:` mapping; unknown keys are an error, not ignored.

        Whole-number floats (``seed: 3.0``) and numeric strings from environment variables are
        accepted; anything else is left to `__post_init__` to reject with its own message.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, object] = {}
        for key, value in d.items():
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
                raise ValueError(f"unknown simulator setting {key!r}" + (
                    f" (did you mean {close[0]!r}?)" if close else
                    f"; known: {', '.join(sorted(known))}"))
            kwargs[key] = _coerce(key, value)
        return cls(**kwargs)  # type: ignore[arg-type]


def _flag(name: str) -> str:
    """The command-line flag of a field: fail_429 -> --fail-429."""
    return "--" + name.replace("_", "-")


def _check_faults(cfg: SimConfig) -> None:
    """Each fault share a number in [0, 1], their sum at most 1; auth_required a clean token."""
    for name in FAULT_KINDS:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name} must be a number, not {value!r}")
        if not 0 <= value <= 1:  # also rejects NaN
            raise ValueError(f"{name} must be a fraction between 0 and 1, not {value!r}")
    on = [name for name in FAULT_KINDS if getattr(cfg, name)]
    total = sum(getattr(cfg, name) for name in on)
    if total > 1 + 1e-9:
        parts = " + ".join(f"{name} ({getattr(cfg, name):g})" for name in on)
        raise ValueError(f"fault fractions must sum to at most 1, but {parts} = {total:g}")
    for name in _BOOLS:
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false, not {getattr(cfg, name)!r}")
    if cfg.reset_when is not None and not (isinstance(cfg.reset_when, str) and cfg.reset_when):
        raise ValueError(f"reset_when must be a non-empty string, not {cfg.reset_when!r}")
    token = cfg.auth_required
    if token is not None and not (isinstance(token, str) and token.isascii() and token.isprintable()
                                  and token and " " not in token):  # fmt: skip
        raise ValueError("auth_required must be a non-empty string of printable ASCII without "
                         "spaces, or null")  # fmt: skip


def _coerce(key: str, value: object) -> object:
    """Turn numeric strings and whole floats into the field's type; leave the rest alone."""
    if isinstance(value, bool):
        return value
    if key == "tokens" and isinstance(value, int):  # `tokens: 64` in YAML is a fixed length
        return str(value)
    if key in _BOOLS and isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    try:
        if (key in _FLOATS or key in FAULT_KINDS) and isinstance(value, str | int):
            return float(value)
        if key in _INTS and isinstance(value, str):
            return int(value.strip())
        if key in _INTS and isinstance(value, float) and value.is_integer():
            return int(value)
    except ValueError:
        raise ValueError(f"{key} must be a number, not {value!r}") from None
    return value


class BadRequest(Exception):
    """The body cannot be served; becomes a 400 with an OpenAI-style error object."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a request will produce, decided up front from (seed, content)."""

    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    words: bytes  # one byte per output token, indexing WORDS (and TEXT_WORDS[text])
    finish: str
    prompt_tokens: int
    thinking: int = 0  # how many of the words are reasoning (they come first)
    tool: str | None = None  # the function the answer calls, with {"text": content} as arguments
    text: str = "words"  # how the words read (TEXT_WORDS)
    cached: int = 0  # of prompt_tokens, those usage counts as read from the prompt cache
    refused: bool = False  # the answer's words are a refusal (then no tool is called)
    custom: bool = False  # the tool called is a custom one: its input is the words as text
    # The function is called in the older `functions` form (`function_call`), as OpenAI
    # answers a chat request that names `functions` instead of `tools`.
    legacy: bool = False
    # A Responses request that asks for a summary of the reasoning (`reasoning: {summary}`)
    # gets it as OpenAI sends one (summary parts and deltas), not as the thought itself.
    summary: bool = False
    padded: bool = False  # chunks carry OpenAI's `obfuscation` padding (SimConfig.obfuscation)
    # What a token limit charges it (`tpm_limit`): prompt tokens + its cap, else its answer's.
    requested: int = 0


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    """A positive integer field or None, else BadRequest naming it."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{key}' must be an integer >= 1, not {value!r}.", key)
    return value


def _chat_text_len(messages: object, key: str = "messages") -> int:
    """Total characters of the messages' text; rejects shapes no OpenAI server accepts."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"'{key}' must be a non-empty list.", key)
    total = 0
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest("each message must be an object with a string 'role'.", key)
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            texts = (p.get("text") for p in content if isinstance(p, dict))
            total += sum(len(t) for t in texts if isinstance(t, str))
        elif content is not None:
            raise BadRequest("message 'content' must be a string or a list.", key)
    return total


def _input_len(value: object) -> int:
    """Characters of a Responses `input`: a string, or a list of items. An item is a message
    as chat's, with content (a string or a list of parts such as {"type": "input_text", "text":
    ...}), or a typed item of an earlier turn, such as a `function_call` (its `arguments`) and
    its `function_call_output` (its `output`)."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' must be a string or a non-empty list of items.", "input")
    total = 0
    for item in value:
        if isinstance(item, dict) and "role" in item and item.get("content") is not None:
            total += _chat_text_len([item], "input")
        elif isinstance(item, dict) and "role" not in item and isinstance(item.get("type"), str):
            total += sum(len(text) for key in ("arguments", "output", "input")
                         if isinstance(text := item.get(key), str))  # fmt: skip
        else:
            raise BadRequest("each 'input' item must be a message {role, content} or an item "
                             "with a string 'type'.", "input")  # fmt: skip
    return total


def _prompt_len(prompt: object) -> int:
    """Characters (or token ids) in a completions prompt."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return sum(len(p) for p in prompt)
        if all(isinstance(p, int) for p in prompt):
            return 4 * len(prompt)
    raise BadRequest("'prompt' must be a string or a non-empty list of strings.", "prompt")


def make_plan(raw: bytes, kind: Kind, cfg: SimConfig) -> Plan:
    """Validate a request body and decide its output (pure: same inputs, same plan)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("the request body is not valid JSON.", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object.", None, "invalid_json")
    key = _CONTENT_KEYS[kind]
    if key not in body:
        raise BadRequest(f"'{key}' is required.", key, "missing_required_parameter")
    content = body[key]
    chars = _TEXT_LENS[kind](content)
    model = body.get("model", "sim")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string.", "model")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean.", "stream")
    # Responses has no stream_options (usage always comes) and caps with max_output_tokens.
    include_usage = kind == "responses" or _include_usage(body, cfg)
    tool, custom = _tool_called(body, kind) if kind != "completions" else (None, False)
    legacy = False
    if tool is None and kind == "chat":
        tool = _function_called(body)
        legacy = tool is not None
    if kind == "responses":
        cap = _opt_int(body, "max_output_tokens")
    else:
        cap = _opt_int(body, "max_completion_tokens") or _opt_int(body, "max_tokens")
    digest = hashlib.blake2b(
        orjson.dumps(content, option=orjson.OPT_SORT_KEYS),
        digest_size=16,
        key=cfg.seed.to_bytes(8, "little"),
    ).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    n = cfg.token_spec.sample(rng)
    thinking = cfg.reasoning_tokens if kind != "completions" else 0
    n += thinking  # the reasoning comes on top of the sampled answer
    finish = "length" if cap is not None and n >= cap else "tool_calls" if tool else "stop"
    words = rng.randbytes(n)[:cap]  # draw all, then cut: a cap truncates, it never resamples
    # Drawn last, and only when asked for, so that every other plan stays as it was.
    refused = kind != "completions" and cfg.refusal > 0 and rng.random() < cfg.refusal
    if refused and tool is not None:
        tool, custom, legacy = None, False, False
        finish = "stop" if finish == "tool_calls" else finish
    if legacy and finish == "tool_calls":
        finish = "function_call"
    prompt = max(1, (chars + 3) // 4)
    reasoning = body.get("reasoning")
    summary = kind == "responses" and isinstance(reasoning, dict) and bool(reasoning.get("summary"))
    padded = cfg.obfuscation and kind != "responses" and _include_obfuscation(body)
    return Plan(kind, model, stream and not cfg.ignore_stream, include_usage,
                words, finish, prompt, min(thinking, len(words)),
                tool, cfg.text, min(cfg.cached_tokens, prompt), refused, custom, legacy,
                summary, padded, prompt + (len(words) if cap is None else cap))  # fmt: skip


#: By kind: the field that holds the prompt, and how many characters of text it has.
_CONTENT_KEYS: dict[Kind, str] = {"chat": "messages", "completions": "prompt",
                                  "responses": "input"}  # fmt: skip
_TEXT_LENS: dict[Kind, Callable[[object], int]] = {
    "chat": _chat_text_len, "completions": _prompt_len, "responses": _input_len}  # fmt: skip


def _include_usage(body: dict[str, Any], cfg: SimConfig) -> bool:
    """Whether chat or completions `stream_options` ask for a usage chunk (or a 400)."""
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object.", "stream_options")
    if cfg.reject_stream_options and "stream_options" in body:
        # The wording of an API version that predates the option.
        raise BadRequest("Unrecognized request argument supplied: stream_options",
                         None, "unrecognized_argument")  # fmt: skip
    return opts.get("include_usage") is True


def _include_obfuscation(body: dict[str, Any]) -> bool:
    """Whether a request leaves OpenAI's padding on (`stream_options.include_obfuscation`,
    true unless false; `_include_usage` has checked that the options are an object)."""
    opts = body.get("stream_options") or {}
    return opts.get("include_obfuscation") is not False


def _function_called(body: dict[str, Any]) -> str | None:
    """The function a chat answer calls in the older `functions` form: the first of
    `functions` ({name, ...}), unless `function_call` is "none"."""
    functions = body.get("functions")
    if functions is None or body.get("function_call") == "none":
        return None
    first = functions[0] if isinstance(functions, list) and functions else None
    name = first.get("name") if isinstance(first, dict) else None
    if not isinstance(name, str) or not name:
        raise BadRequest("'functions' must be a non-empty list of {name, ...}.", "functions")
    return name


def _tool_called(body: dict[str, Any], kind: Kind) -> tuple[str | None, bool]:
    """The tool an answer calls, and whether it is a custom one (Responses only: free-text
    input, `{"type": "custom", "name"}`): the first of `tools`, unless `tool_choice` is "none".
    Chat nests the name ({type, function: {name}}); Responses tools are flat ({type, name})."""
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None, False
    first = tools[0] if isinstance(tools, list) and tools and isinstance(tools[0], dict) else None
    function = first if kind == "responses" or first is None else first.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        shape = "{type, name}" if kind == "responses" else "{type, function: {name}}"
        raise BadRequest(f"'tools' must be a non-empty list of {shape}.", "tools")
    return name, kind == "responses" and first is not None and first.get("type") == "custom"

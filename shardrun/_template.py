"""User-message templates: `"Summarize: {text}"` filled from an input record's fields.

A template is parsed once, when the job is loaded, with `string.Formatter().parse`, into
literal text and plain field names. Filling it joins those pieces; it never calls
`str.format`, so a placeholder cannot reach an attribute (`{x.__class__}`), an index
(`{x[0]}`), a conversion (`{x!r}`) or a format spec (`{x:>10}`): all four are refused when the
job is loaded, and a record that lacks a field becomes a reject, never an exception.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson

_FORBIDDEN = {".": "attribute access", "[": "index access"}


class TemplateError(ValueError):
    """The template text is not a template shardrun accepts; the message says why."""


@dataclass(frozen=True, slots=True)
class Template:
    """A parsed template: alternating literal text and field names (None after the last)."""

    pieces: tuple[tuple[str, str | None], ...]
    # The distinct field names, in order of first use: made once, as each input line reads them
    # (made per line, they cost a reader as much as the template's filling).
    fields: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = tuple(dict.fromkeys(name for _, name in self.pieces if name is not None))
        object.__setattr__(self, "fields", names)

    def fill(self, record: Mapping[str, object]) -> str:
        """The filled text; raises MissingField for the first field the record lacks."""
        out: list[str] = []
        for literal, name in self.pieces:
            out.append(literal)
            if name is None:
                continue
            value = record.get(name)
            if value is None:
                raise MissingField(name)
            out.append(as_text(value))
        return "".join(out)


class MissingField(KeyError):
    """A record has no value for a field the template names."""

    @property
    def field(self) -> str:
        return str(self.args[0])


def parse_template(text: str) -> Template:
    """Parse and check a template; TemplateError names the first bad placeholder."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise TemplateError(f"{exc} (write {{{{ and }}}} for literal braces)") from None
    pieces: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in parsed:
        if name is None:
            pieces.append((literal, None))
            continue
        _check_placeholder(name, spec, conversion)
        pieces.append((literal, name))
    return Template(tuple(pieces))


def _check_placeholder(name: str, spec: str | None, conversion: str | None) -> None:
    """Only `{field_name}`: no positional, attribute, index, conversion or format spec."""
    if name == "" or name.isdigit():
        raise TemplateError("placeholders must name a field, like {text}, not {} or {0}")
    for char, what in _FORBIDDEN.items():
        if char in name:
            raise TemplateError(f"placeholder {{{name}}} uses {what}; name a field only")
    if conversion or spec:
        raise TemplateError(
            f"placeholder {{{name}}} has a conversion or format spec; write {{{name}}} only"
        )


def as_text(value: object) -> str:
    """A field value as prompt text: strings as they are, other values as compact JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return orjson.dumps(value).decode()
    try:
        return orjson.dumps(value, default=str).decode()
    except TypeError:
        return str(value)

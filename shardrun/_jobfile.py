"""Reading a job file into a plain mapping, with YAML's sharp edges filed off.

PyYAML behaviours that would otherwise surprise operators are handled here:
- a repeated key silently keeps the last value (`shards: 8` ... `shards: 2`): it is an error;
- YAML 1.1 reads `1e-3` (no dot) as a *string*, which the strict model would then reject with
  a baffling message: it is read as the number the user meant, as YAML 1.2 does;
- YAML 1.1 reads `010` as octal (8), `1:30` as base 60 (90) and `2024-01-01` as a date, which
  no field and no JSON request body takes: as in YAML 1.2, `010` is ten (`0o10` is octal),
  and `1:30` and `2024-01-01` are text;
- aliases (`*name`) share one value however often it is repeated, and a file of nested ones
  (a "billion laughs") grows to billions of values once copied, validated and sent with every
  request: a file whose aliases add more than EXPANSION_LIMIT values is an error. `x-` entries
  are left out of the job (spec.py), so a block anchored there and used once adds nothing;
- YAML 1.1 reads `yes`, `no`, `on` and `off` as booleans, so `model: no` was false and
  `stop: [no]` sent `[false]`: as in YAML 1.2, only `true` and `false` are booleans and those
  words are text, which a key that takes a number or a boolean refuses by name. Under `params`,
  sent as JSON, which takes either reading, an unquoted one is an error asking for `true`/`false`
  or the word in quotes;
- `"\\ud83d\\ude00"` (a UTF-16 surrogate pair, as JSON escapes an emoji) is two lone surrogates,
  which no file or request body can carry: it is the character the pair stands for, and half
  a pair alone is an error at its line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from shardrun._models import SECTION_KEYS
from shardrun.errors import SpecError

_MERGE_TAG = "tag:yaml.org,2002:merge"
EXPANSION_LIMIT = 100_000
"""Values aliases may add to a job file: far more than sharing a few blocks ever adds, far
fewer than take a noticeable time to copy and check (a million take about two seconds)."""


class _AliasesExpandTooFar(Exception):
    """A job file whose aliases would add more than EXPANSION_LIMIT values."""


class _JobLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads exponent floats without a dot."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.tagged: set[int] = set()  # ids of the scalars a tag gave their type

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """A value its tag cannot make (`!!int abc`, `!!bool maybe`) is a ConstructorError at
        the value's line: PyYAML's constructors raise ValueError, KeyError and the like."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            shown = f" {node.value!r}" if isinstance(node, yaml.ScalarNode) else ""
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read{shown} as {_short_tag(node.tag)}", node.start_mark
            ) from None

    def construct_scalar(self, node: yaml.Node) -> Any:
        """A string with its `\\ud83d\\ude00` escapes joined into the character they stand for,
        as JSON reads them (PyYAML keeps two lone surrogates, which no file or request can
        carry); half of such a pair alone is a ConstructorError at the value's line."""
        value = super().construct_scalar(node)  # type: ignore[arg-type]
        if isinstance(value, str) and _SURROGATE.search(value):
            value = _PAIR.sub(_joined, value)
            if (alone := _SURROGATE.search(value)) is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the escape \\u{ord(alone[0]):04x} is half of a UTF-16 "
                    "surrogate pair, without its other half: write the character itself, or "
                    "both halves of its pair", node.start_mark)
        return value

    def compose_scalar_node(self, anchor: Any) -> yaml.ScalarNode:
        """A scalar, its id noted when a tag (`!!str no`) names its type, which no YAML reads
        otherwise: `_refuse_yaml11_words` takes such a word as the text it says it is."""
        tagged = self.peek_event().tag not in (None, "!")  # type: ignore[no-untyped-call]
        node = super().compose_scalar_node(anchor)
        if tagged:
            self.tagged.add(id(node))
        return node

    def construct_document(self, node: yaml.Node) -> Any:
        """Refuse a document its aliases would blow up before building anything of it, and
        one whose `params` hold a word YAML 1.1 reads as a boolean (`_refuse_yaml11_words`)."""
        if _kept_size(node) - _distinct_size(node, set()) > EXPANSION_LIMIT:
            raise _AliasesExpandTooFar
        for params in _params_of(node, set()):
            _refuse_yaml11_words(params, "params", set(self.tagged))
        return super().construct_document(node)


def _params_of(node: yaml.Node, seen: set[int]) -> Iterator[yaml.Node]:
    """The `params` values of the top-level mapping `node` and of the mappings it merges in
    (`<<: *base`), whose params the job takes as its own."""
    if id(node) in seen or not isinstance(node, yaml.MappingNode):
        return
    seen.add(id(node))
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag == _MERGE_TAG:
            for mapping in _merged(value):
                yield from _params_of(mapping, seen)
        elif isinstance(key, yaml.ScalarNode) and key.value == "params":
            yield value


def _merged(value: yaml.Node) -> list[yaml.Node]:
    """The mappings a merge key (`<<`) brings in: one alias, or a list of them."""
    return value.value if isinstance(value, yaml.SequenceNode) else [value]


_YAML11_ONLY_BOOL = re.compile(r"^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)$")
_STR_TAG = "tag:yaml.org,2002:str"


def _refuse_yaml11_words(node: yaml.Node, path: str, seen: set[int]) -> None:
    """A ConstructorError for an unquoted yes, no, on or off among the values under `node`
    (`path`): `params` go to the server as JSON, which takes text and booleans alike, so
    reading the word as text (YAML 1.2) where it was written for true (YAML 1.1, `logprobs:
    yes`) would change every request without a word. Keys are text either way. `seen` starts
    with the ids of the scalars a tag named the type of (`!!str no`): text as written."""
    if id(node) in seen:  # an alias: its anchor's values are checked once
        return
    seen.add(id(node))
    if isinstance(node, yaml.ScalarNode):
        if node.style is None and node.tag == _STR_TAG and _YAML11_ONLY_BOOL.match(node.value):
            word = node.value
            truth = "true" if word.lower() in ("yes", "on") else "false"
            raise yaml.constructor.ConstructorError(
                None, None, f"{path} is an unquoted {word}, which YAML 1.1 reads as {truth} and "
                f"YAML 1.2 as text: write {truth} for the boolean, or '{word}' in quotes for the "
                "text", node.start_mark)
    elif isinstance(node, yaml.SequenceNode):
        for n, item in enumerate(node.value):
            _refuse_yaml11_words(item, f"{path}[{n}]", seen)
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.tag == _MERGE_TAG:  # `<<: *base` (or a list of them): keys of this mapping
                for merged in _merged(value):
                    _refuse_yaml11_words(merged, path, seen)
                continue
            name = key.value if isinstance(key, yaml.ScalarNode) else "?"
            _refuse_yaml11_words(value, f"{path}.{name}", seen)


def _kept_size(document: yaml.Node) -> int:
    """`_expanded_size` of the document without its `x-` entries (at the top level, in a
    section and in `endpoint.sim`), which spec.py leaves out: what the job keeps, every alias
    written out. An anchor under `x-` used once so counts once, as it would written in place."""
    sizes: dict[int, int] = {}

    def kept(node: yaml.Node, inner: Mapping[str, Any]) -> int:
        if not isinstance(node, yaml.MappingNode):
            return _expanded_size(node, sizes)
        size = 1
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            if isinstance(name, str) and name.startswith("x-") and key.tag != _MERGE_TAG:
                continue
            size += _expanded_size(key, sizes)
            if isinstance(name, str) and name in inner:  # a mapping whose `x-` keys go
                size += kept(value, inner[name])
            else:
                size += _expanded_size(value, sizes)
        return size

    return kept(document, _WITH_EXTENSIONS)


_WITH_EXTENSIONS: dict[str, Any] = {section: {} for section in SECTION_KEYS}
_WITH_EXTENSIONS["endpoint"] = {"sim": {}}
"""The mappings below the top level whose `x-` keys spec.py leaves out, by name, each with
its own (`_kept_size`): the sections, and `endpoint.sim`."""


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values `node` stands for with every alias written out (memoised by node: an
    alias is the same node object as its anchor). A node that holds itself (`&a [*a]`) is
    counted once, as the constructor refuses it with its own message."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = 1  # a cycle back here counts as one value
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(item, sizes) for item in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(key, sizes) + _expanded_size(value, sizes)
                    for key, value in node.value)
    sizes[id(node)] = size
    return size


def _distinct_size(node: yaml.Node, seen: set[int]) -> int:
    """How many values `node` holds, each alias counted once, where its anchor is."""
    if id(node) in seen:
        return 0
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        return 1 + sum(_distinct_size(item, seen) for item in node.value)
    if isinstance(node, yaml.MappingNode):
        return 1 + sum(_distinct_size(key, seen) + _distinct_size(value, seen)
                       for key, value in node.value)
    return 1


_SURROGATE = re.compile("[\ud800-\udfff]")
_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def _joined(pair: re.Match[str]) -> str:
    """The character a UTF-16 surrogate pair stands for."""
    high, low = (ord(c) for c in pair[0])
    return chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))


def _short_tag(tag: str) -> str:
    return "!!" + tag.removeprefix("tag:yaml.org,2002:") if tag.startswith("tag:yaml") else tag


def _construct_mapping(loader: _JobLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """Build a mapping, failing on the second occurrence of a key (merge keys excepted)."""
    seen: dict[tuple[str, str], int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
            continue
        ident = (key_node.tag, key_node.value)
        if ident in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key '{key_node.value}' (first given on line {seen[ident]})",
                key_node.start_mark,
            )
        seen[ident] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=True)


def _construct_int(loader: _JobLoader, node: yaml.ScalarNode) -> int:
    """A decimal integer, leading zeros and all, or one with a 0x, 0o or 0b prefix."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    prefixed = text.lstrip("+-")[:2].lower() in ("0x", "0o", "0b")
    return int(text, 0 if prefixed else 10)


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_JobLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_JobLoader.add_constructor(_INT_TAG, _construct_int)
_JobLoader.yaml_implicit_resolvers = {  # SafeLoader's, without YAML 1.1's numbers, dates, bools
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (
        _INT_TAG, _FLOAT_TAG, _BOOL_TAG, "tag:yaml.org,2002:timestamp")]
    for first, resolvers in _JobLoader.yaml_implicit_resolvers.items()
}
_JobLoader.add_implicit_resolver(  # YAML 1.2's booleans: yes, no, on and off are text
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_JobLoader.add_implicit_resolver(
    _INT_TAG,
    re.compile(r"^[-+]?(?:[0-9][0-9_]*|0x_*[0-9a-fA-F][0-9a-fA-F_]*|0o_*[0-7][0-7_]*"
               r"|0b_*[01][01_]*)$"),
    list("-+0123456789"),
)
_JobLoader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
                   |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                   |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X),
    list("-+.0123456789"),
)


INPUT_SUFFIXES = (".jsonl", ".ndjson", ".csv", ".tsv", ".parquet")
"""Names of input files, which a job file never has."""


def read_job_file(path: Path, origin: str) -> dict[Any, Any]:
    """Parse the job file at `path`; every failure is a SpecError naming `origin` (as given)."""
    if path.suffix.lower() in INPUT_SUFFIXES and path.is_file():
        # The data given where the job goes (`shardrun prompts.jsonl`): as YAML, it read as a
        # YAML error at line 2, or a one-line record as a job of unknown keys.
        raise SpecError(f"{origin} is an input file ({path.suffix}), not a job file: give the "
                        "job file (YAML) whose input.path names it")
    text = _read_text(path, origin)
    try:
        data = yaml.load(text, Loader=_JobLoader)  # a SafeLoader subclass: no object tags
    except yaml.MarkedYAMLError as exc:
        raise SpecError(f"{origin}: {_describe_yaml_error(exc, text)}") from None
    except yaml.reader.ReaderError as exc:  # its own text runs over two lines
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - text.rfind("\n", 0, exc.position)
        char = exc.character  # a code point (str input) or a byte
        code = char if isinstance(char, int) else ord(char[:1] or "\0")
        raise SpecError(f"{origin}: YAML error at line {line}, column {column}: the character "
                        f"U+{code:04X} is not allowed in YAML (is this a job file?)") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{origin}: invalid YAML: {' '.join(str(exc).split())}") from None
    except (ValueError, TypeError, LookupError, AttributeError):  # a constructor beyond that
        raise SpecError(f"{origin}: a value cannot be read as the type its tag names (such as "
                        "!!map on a list)") from None
    except _AliasesExpandTooFar:
        raise SpecError(f"{origin}: its aliases (*name) would add more than "
                        f"{EXPANSION_LIMIT:,} values to those written in it, which no job "
                        "needs (aliases inside aliases multiply): write out what they share, "
                        "or share less") from None
    except RecursionError:  # PyYAML reads nesting by recursion: some 200 levels are its end
        raise SpecError(f"{origin}: its values nest too deeply for YAML to be read (lists or "
                        "mappings hundreds of levels deep)") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError(
            f"{origin}: the top level must be a mapping (keys like endpoint:, input:, shards:),"
            f" got {_kind_of(data)}"
        )
    return data


def _read_text(path: Path, origin: str) -> str:
    """The file's text, or one sentence saying why it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{origin}: job file not found") from None
    except IsADirectoryError:
        raise SpecError(f"{origin}: is a directory, not a job file") from None
    except UnicodeDecodeError as exc:  # a file saved as Latin-1, Windows-1252 or UTF-16
        line = exc.object[:exc.start].count(b"\n") + 1
        raise SpecError(f"{origin}: not UTF-8 text (line {line}, byte {exc.start + 1} of the "
                        "file): save it as UTF-8") from None
    except OSError as exc:
        raise SpecError(f"{origin}: cannot read the job file ({exc.strerror})") from None


def _describe_yaml_error(exc: yaml.MarkedYAMLError, text: str = "") -> str:
    """'YAML error at line L, column C: problem', 1-based like every editor, and where what
    it happened in began when that is elsewhere: a quote or a brace left open is found out
    lines later, at the end of the file or at the next key."""
    mark, begun = exc.problem_mark or exc.context_mark, exc.context_mark
    problem = exc.problem or exc.context or "invalid YAML"
    if "'\\t'" in problem:  # PyYAML's words for a tab where YAML allows none
        problem += " (YAML indents with spaces, never tabs)"
    elif problem == "but found another document":  # its context says what was expected
        problem = "a second YAML document starts here (after a '---'): a job file is one"
    elif exc.problem and exc.context and begun is not None and mark is not None and (
            (begun.line, begun.column) != (mark.line, mark.column)):
        problem += f" ({exc.context} begun at {_at(begun)})"
    lines = text.splitlines()
    spaced = [m.line + 1 for m in (begun, mark) if m is not None and m.line < len(lines)
              and "\xa0" in lines[m.line]]  # fmt: skip
    if spaced:  # pasted from a web page: it looks like a space and is none to YAML
        problem += (f"; line {spaced[0]} holds a non-breaking space (U+00A0), which YAML does "
                    "not read as a space")
    return f"YAML error{'' if mark is None else ' at ' + _at(mark)}: {problem}"


def _at(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _kind_of(value: object) -> str:
    """A short noun for a YAML value's type, for 'got a list'-style messages."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"{value!r}"[:40]

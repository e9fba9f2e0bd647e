"""A fleet file decoded into ``fleet_file``'s types, or a ConfigError that says where
and what, in YAML's words: ``destinations[0].wieght: unknown field (expected one of
...)``, ``router.block_bytes: expected an integer >= 16, got 8``. msgspec finds the
first thing wrong and its path (``$.destinations[0]``); this turns its message into one
for people who write YAML, with the value found there and, for an unknown key, the
nearest known one."""

from __future__ import annotations

import difflib
import re
from typing import Any, TypeVar

import msgspec

from ace_extproc.fleet_file import PATTERN_WORDS, ConfigError

# Keys that were once read and are refused now, with why (path pattern -> message).
REFUSED = {
    r"destinations\[\d+\]\.weight": (
        "not supported on a destination: pods' weight shares new prefixes within a "
        "destination, and when several destinations serve a model the first listed "
        "serves it"
    ),
}

T = TypeVar("T")
_ERROR = re.compile(r"(?P<text>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?", re.S)
_FIELD = re.compile(r"Object (contains unknown|missing required) field `(?P<name>[^`]*)`")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]|(\[\.\.\.\])")
_WORDS = {
    "object": "a mapping",
    "array": "a list",
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "null": "null",
}


def decode(raw: Any, kind: type[T], where: str = "") -> T:
    """``raw`` (as YAML loads it) as ``kind``, or a ConfigError naming the path of the
    first thing wrong: ``where`` (the path of ``raw`` itself) then msgspec's."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(_message(str(exc), raw, kind, where)) from None


def _message(error: str, raw: Any, kind: Any, where: str) -> str:
    m = _ERROR.fullmatch(error)
    assert m is not None  # the pattern matches any text
    text, steps = m["text"], _steps(m["path"] or "")
    if field := _FIELD.match(text):
        name = field["name"]
        path = _join(where, [*steps, name])
        if field[1] == "missing required":
            return f"{path}: missing required field"
        for pattern, why in REFUSED.items():
            if re.fullmatch(pattern, _join("", [*steps, name])):
                return f"{path}: {why}"
        known = _fields(kind, raw, steps)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"expected one of {', '.join(known)}"
        return f"{path}: unknown field ({hint})"
    path = _join(where, steps) or "fleet"
    if m["key"]:
        return f"{path}: a key: {_plain(text)}"
    choices = _choices(kind, steps)
    regex = re.search(r"matching regex '(.*)'$", text)
    if text.startswith("Invalid") and choices:
        text = f"expected one of {', '.join(choices)}"
    elif regex and regex[1] in _PATTERN_WORDS:
        words = _PATTERN_WORDS[regex[1]]
        text = f"expected {'an' if words[0] in 'aeiou' else 'a'} {words}"
    else:
        text = _plain(text)
    value = _lookup(raw, steps)
    if value is not _NOWHERE and not (value is None and "got null" in text):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        text += f" ({shown})" if ", got " in text else f", got {shown}"
    return f"{path}: {text}"


# msgspec quotes a pattern as Python would (backslashes doubled).
_PATTERN_WORDS = {repr(p)[1:-1]: words for p, words in PATTERN_WORDS.items()}
_VALUE = "[...]"  # msgspec's step to a mapping's value
_NOWHERE = object()


def _words(m: re.Match[str]) -> str:
    return " or ".join(_WORDS.get(w, w) for w in m[1].split(" | "))


def _plain(text: str) -> str:
    """msgspec's wording with YAML's names for types: ``a list``, not `array`."""
    text = re.sub(r"`([^`]*)`", _words, text)
    text = text.replace("a list of length >= 1", "a non-empty list")
    return text[:1].lower() + text[1:]


def _steps(path: str) -> list[str | int]:
    return [int(index) if index else name or _VALUE for name, index, _ in _STEP.findall(path)]


def _join(where: str, steps: list[str | int]) -> str:
    out = where
    for step in steps:
        if step == _VALUE:
            out += " (a value)"
        else:
            out += f"[{step}]" if isinstance(step, int) else f".{step}" if out else step
    return out


def _lookup(raw: Any, steps: list[str | int]) -> Any:
    for step in steps:
        try:
            raw = raw[step]
        except (KeyError, IndexError, TypeError):
            return _NOWHERE
    return raw


_SEQUENCES = (msgspec.inspect.ListType, msgspec.inspect.VarTupleType)


def _at(kind: Any, steps: list[str | int]) -> list[msgspec.inspect.Type]:
    """The types that may stand at ``steps`` below ``kind`` (several in a union)."""
    found = _flat([msgspec.inspect.type_info(kind)])
    for step in steps:
        here: list[msgspec.inspect.Type] = []
        for t in found:
            if isinstance(step, int) and isinstance(t, _SEQUENCES):
                here.append(t.item_type)
            elif step == _VALUE and isinstance(t, msgspec.inspect.DictType):
                here.append(t.value_type)
            elif isinstance(step, str) and isinstance(t, msgspec.inspect.StructType):
                here += [f.type for f in t.fields if f.encode_name == step]
                if step == t.tag_field and t.tag is not None:
                    here.append(msgspec.inspect.LiteralType((t.tag,)))
        found = _flat(here)
    return found


def _flat(types: list[msgspec.inspect.Type]) -> list[msgspec.inspect.Type]:
    out: list[msgspec.inspect.Type] = []
    for t in types:
        if isinstance(t, msgspec.inspect.UnionType):
            out += _flat(list(t.types))
        elif isinstance(t, msgspec.inspect.Metadata):
            out += _flat([t.type])
        else:
            out.append(t)
    return out


def _fields(kind: Any, raw: Any, steps: list[str | int]) -> list[str]:
    """The keys the mapping at ``steps`` may hold: of its ``type:``'s kind, in a
    tagged union such as ``discovery``."""
    here = _lookup(raw, steps)
    return [
        f.encode_name
        for t in _at(kind, steps)
        if isinstance(t, msgspec.inspect.StructType)
        if not (t.tag_field and isinstance(here, dict) and here.get(t.tag_field) != t.tag)
        for f in t.fields
    ]


def _choices(kind: Any, steps: list[str | int]) -> list[str]:
    out: list[str] = []
    for t in _at(kind, steps):
        if isinstance(t, msgspec.inspect.LiteralType):
            out += [str(v) for v in t.values]
        elif isinstance(t, msgspec.inspect.EnumType):
            out += [str(m.value) for m in t.cls]
    return out

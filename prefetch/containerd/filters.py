"""containerd's filter language, for the snapshots API's ``List`` (Walk) filters.

Hand-written because no maintained Python implementation exists; this follows containerd's
own scanner and parser (``filters/`` in containerd 1.x, ``pkg/filters`` in 2.x), read from
its source, not translated from it:

    filter    := selector ("," selector)*          every selector must match
    selector  := fieldpath [operator value]         no operator: the field is present
    fieldpath := field ("." field)*
    field     := '"'-quoted | [A-Za-z0-9_-]+
    operator  := "==" | "!=" | "~="                 ~= is a regular-expression search
    value     := quoted | a run of printable characters other than whitespace and ","
                 (it may not start with "," "." "=" "!" "~" or a quote)
    quoted    := a Go double-quoted string: \\a \\b \\f \\n \\r \\t \\v \\\\ \\" \\NNN \\xHH
                 \\uHHHH \\UHHHHHHHH; after "~=" also /.../ or |...| (escape the delimiter)

A request's list of filter strings matches an item when ANY string matches; "|" is not an
"or" inside one string (it only delimits a regular expression, as above), and an empty
string matches everything, as in containerd. ``!=`` is true for an absent field (it compares
the empty value), also as in containerd.

Where this differs from containerd, on purpose: whitespace is skipped between any two tokens
(containerd rejects it before "," and at the end); a ``~=`` pattern is compiled when parsed,
so a bad pattern is an InvalidArgumentError rather than a filter that silently matches
nothing; patterns use Python's ``re`` (RE2's common syntax is the same); error positions
count characters, not UTF-8 bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefetch.containerd.errors import InvalidArgumentError

Adaptor = Callable[[list[str]], tuple[str, bool]]
"""Maps a fieldpath to (value, present), like containerd's ``filters.Adaptor``."""

_OPERATORS = ("==", "!=", "~=")
_OPERATOR_CHARS = frozenset("=!~")
_QUOTES = frozenset('"/|')
_SIMPLE_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_HEXDIGITS = frozenset("0123456789abcdefABCDEF")


def _is_field_char(ch: str) -> bool:
    return ch.isascii() and (ch.isalnum() or ch in "_-")


def _is_value_char(ch: str) -> bool:
    return ch != "," and not ch.isspace() and ch.isprintable()


@dataclass(frozen=True)
class Selector:
    """One ``fieldpath[op value]`` test; ``operator`` is None for a presence test."""

    fieldpath: tuple[str, ...]
    operator: str | None = None
    value: str = ""
    pattern: re.Pattern[str] | None = None

    def match(self, adaptor: Adaptor) -> bool:
        value, present = adaptor(list(self.fieldpath))
        if self.operator is None:
            return present
        if self.operator == "==":
            return present and value == self.value
        if self.operator == "!=":
            return value != self.value
        assert self.pattern is not None
        return self.pattern.search(value) is not None


@dataclass(frozen=True)
class Filter:
    """Any of ``alternatives`` (one per filter string), each a conjunction of selectors.

    No alternatives, or an empty one (from an empty string), matches everything.
    """

    alternatives: tuple[tuple[Selector, ...], ...] = ()

    def match(self, adaptor: Adaptor) -> bool:
        if not self.alternatives:
            return True
        return any(all(s.match(adaptor) for s in alt) for alt in self.alternatives)


def parse(filters: Sequence[str]) -> Filter:
    """Parse a request's filter strings; InvalidArgumentError names the string and position."""
    if isinstance(filters, str):  # parse("a==b") would otherwise parse each character
        raise TypeError("parse() takes a sequence of filter strings, not one string")
    return Filter(tuple(_Parser(text).selectors() for text in filters))


class _Parser:
    """Recursive descent over one filter string; ``pos`` is the next unread character."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def error(self, pos: int, message: str) -> InvalidArgumentError:
        text = self.text
        if pos < len(text):
            where = f"[{text[:pos]} >|{text[pos]}|< {text[pos + 1 :]}]"
        else:
            where = "(end of input)"
        return InvalidArgumentError(f"invalid filter {text!r}: {message} at position {pos} {where}")

    def peek(self) -> str:
        """Skip whitespace; the next character ("" at the end), not consumed."""
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def selectors(self) -> tuple[Selector, ...]:
        if not self.text:
            return ()
        found = [self.selector()]
        while (ch := self.peek()) != "":
            if ch != ",":
                raise self.error(self.pos, f"unexpected input {ch!r}, expected ',' or the end")
            self.pos += 1
            found.append(self.selector())
        return tuple(found)

    def selector(self) -> Selector:
        fieldpath = [self.field()]
        while self.peek() == ".":
            self.pos += 1
            fieldpath.append(self.field())
        if self.peek() in ("", ","):
            return Selector(tuple(fieldpath))
        operator = self.operator()
        value_pos = self.pos
        value = self.value(operator)
        pattern = None
        if operator == "~=":
            try:
                pattern = re.compile(value)
            except re.error as e:
                raise self.error(value_pos, f"bad regular expression {value!r}: {e}") from None
        return Selector(tuple(fieldpath), operator, value, pattern)

    def field(self) -> str:
        ch = self.peek()
        start = self.pos
        if ch == '"':
            return self.quoted()
        if ch in _QUOTES:
            raise self.error(
                start, f'{ch}...{ch} quotes only a ~= regular expression; quote a field with "..."'
            )
        if ch == "" or not _is_field_char(ch):
            raise self.error(start, "expected a field or a quoted field")
        while self.pos < len(self.text) and _is_field_char(self.text[self.pos]):
            self.pos += 1
        return self.text[start : self.pos]

    def operator(self) -> str:
        self.peek()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _OPERATOR_CHARS:
            self.pos += 1
        op = self.text[start : self.pos]
        if not op:
            hint = " (quote a field containing it)" if self.text[start] in "/|" else ""
            raise self.error(start, f'expected an operator ("==", "!=" or "~="){hint}')
        if op not in _OPERATORS:
            raise self.error(start, f"unsupported operator {op!r}")
        return op

    def value(self, operator: str) -> str:
        ch = self.peek()
        start = self.pos
        if ch == '"' or (ch in _QUOTES and operator == "~="):
            return self.quoted()
        if ch in _QUOTES:
            raise self.error(
                start,
                f'{ch}...{ch} quotes only a ~= regular expression; quote the value with "..."',
            )
        if ch == "" or ch in ".," or ch in _OPERATOR_CHARS or not _is_value_char(ch):
            raise self.error(start, "expected a value or a quoted value")
        while self.pos < len(self.text) and _is_value_char(self.text[self.pos]):
            self.pos += 1
        return self.text[start : self.pos]

    def quoted(self) -> str:
        """Decode the quoted string at ``pos`` (Go escapes; ``\\x`` and octal give bytes)."""
        text = self.text
        start = self.pos
        quote = text[start]
        out = bytearray()
        i = start + 1
        while True:
            if i >= len(text) or text[i] == "\n":
                raise self.error(start, "quoted literal not terminated")
            ch = text[i]
            if ch == quote:
                break
            if ch != "\\":
                out += ch.encode("utf-8", "surrogateescape")
                i += 1
                continue
            esc = text[i + 1] if i + 1 < len(text) else ""
            if not esc:
                raise self.error(start, "quoted literal not terminated")
            if esc in _SIMPLE_ESCAPES or esc == quote:
                out += _SIMPLE_ESCAPES.get(esc, esc).encode()
                i += 2
            elif esc in _HEX_ESCAPES:
                digits = text[i + 2 : i + 2 + _HEX_ESCAPES[esc]]
                if len(digits) < _HEX_ESCAPES[esc] or not set(digits) <= _HEXDIGITS:
                    raise self.error(
                        i, f"illegal escape \\{esc}: expected {_HEX_ESCAPES[esc]} hex digits"
                    )
                code = int(digits, 16)
                if esc == "x":
                    out.append(code)  # a byte, as in Go
                elif code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                    raise self.error(i, f"illegal escape \\{esc}{digits}: not a character")
                else:
                    out += chr(code).encode()
                i += 2 + len(digits)
            elif esc in "01234567":
                digits = text[i + 1 : i + 4]
                if len(digits) < 3 or not set(digits) <= set("01234567") or int(digits, 8) > 255:
                    raise self.error(i, "illegal octal escape: expected 3 octal digits, <= \\377")
                out.append(int(digits, 8))
                i += 4
            else:
                raise self.error(i, f"illegal escape sequence \\{esc}")
        self.pos = i + 1
        return out.decode("utf-8", "surrogateescape")


_KIND_NAMES = {1: "view", 2: "active", 3: "committed"}


def snapshot_adaptor(info: Any) -> Adaptor:
    """An adaptor over a snapshot info (``name``, ``parent``, ``kind``, ``labels``), as
    containerd's: ``kind`` reads view/active/committed, ``parent`` is always present (empty for
    a root snapshot: containerd's remote-snapshot handshake filters on ``parent==""``),
    and ``labels.<rest>`` looks up the rest of the fieldpath joined with "." (so
    ``labels.a.b`` and ``labels."a.b"`` name the same label). ``kind`` may be containerd's
    enum number (metadata.Kind, the proto enum) or its name."""

    def field(fieldpath: list[str]) -> tuple[str, bool]:
        if not fieldpath:
            return "", False
        head = fieldpath[0]
        if head == "name":
            return info.name, True
        if head == "parent":
            return info.parent, True
        if head == "kind":
            kind = info.kind
            name = kind.lower() if isinstance(kind, str) else _KIND_NAMES.get(int(kind), "")
            return name, name in _KIND_NAMES.values()
        if head == "labels":
            labels = info.labels
            key = ".".join(fieldpath[1:])
            if labels and key in labels:
                return labels[key], True
        return "", False

    return field

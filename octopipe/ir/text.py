"""Shared pieces of the IR text forms: `key=value` fields on one line, values that round-trip.

Every IR type prints one record per line: a keyword, then `key=value` fields. A value is printed
bare when it is a plain token (letters, digits and `_ . : + - * / ,`) and JSON-quoted otherwise,
floats use `repr` (exact round trip) and an absent value is `-`.
"""

from __future__ import annotations

import builtins
import json
import re
from collections.abc import Callable, Iterable
from typing import TypeVar

from octopipe.errors import ParseError

_T = TypeVar("_T")

_BARE = re.compile(r"^[A-Za-z0-9_.:+\-*/,\[\]|<>@#]+$")
ABSENT = "-"


def format_value(value: object) -> str:
    """One field value as text: bare token when safe, else a JSON string."""
    if value is None:
        return ABSENT
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if text and text != ABSENT and _BARE.fullmatch(text):
        return text
    return json.dumps(text)


def format_fields(fields: Iterable[tuple[str, object]]) -> str:
    return " ".join(f"{key}={format_value(value)}" for key, value in fields)


def split_tokens(line: str, where: str) -> list[str]:
    """Split on spaces, keeping JSON-quoted values (which may contain spaces) whole."""
    tokens: list[str] = []
    i, n = 0, len(line)
    while i < n:
        if line[i] == " ":
            i += 1
            continue
        start = i
        while i < n and line[i] != " ":
            if line[i] == '"':
                i += 1
                while i < n and line[i] != '"':
                    i += 2 if line[i] == "\\" else 1
                if i >= n:
                    raise ParseError(f"{where}: unterminated quoted value in {line!r}")
            i += 1
        tokens.append(line[start:i])
    return tokens


def parse_fields(tokens: Iterable[str], where: str) -> dict[str, str | None]:
    """`key=value` tokens to a dict of raw (unquoted) strings; a bare `-` (absent) becomes None,
    a quoted "-" stays the string "-"."""
    fields: dict[str, str | None] = {}
    for token in tokens:
        key, sep, raw = token.partition("=")
        if not sep or not key:
            raise ParseError(f"{where}: expected key=value, got {token!r}")
        if key in fields:
            raise ParseError(f"{where}: field {key!r} given twice")
        value: str | None = raw
        if raw.startswith('"'):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ParseError(f"{where}: bad quoted value for {key!r}: {exc}") from None
        elif raw == ABSENT:
            value = None
        fields[key] = value
    return fields


class FieldReader:
    """Typed access to the fields of one text record, with errors that name the line. A field
    that is missing or absent (`-`) reads as the default (or fails when required)."""

    def __init__(self, fields: dict[str, str | None], where: str) -> None:
        self.fields = dict(fields)
        self.where = where

    def _take(self, key: str, required: bool) -> str | None:
        value = self.fields.pop(key, None)  # missing and absent (`-`) read the same
        if value is None and required:
            raise ParseError(f"{self.where}: missing field {key!r}")
        return value

    def _default(self, key: str, default: _T | None) -> _T:
        """The default of an optional field that is missing (a required one made `_take` raise)."""
        if default is None:
            raise ParseError(f"{self.where}: missing field {key!r}")
        return default

    def _convert(self, key: str, raw: str, kind: Callable[[str], _T], what: str) -> _T:
        try:
            if not raw.isascii() or "_" in raw:  # Python's int/float also read 1_0 and non-ASCII digits
                raise ValueError(raw)
            return kind(raw)
        except ValueError:
            raise ParseError(f"{self.where}: field {key!r} must be {what}, got {raw!r}") from None

    def str(self, key: str, default: str | None = None, required: bool = True) -> str:
        raw = self._take(key, required and default is None)
        if raw is None:
            return default if default is not None else ""
        return raw

    def int(self, key: builtins.str, default: builtins.int | None = None) -> builtins.int:
        raw = self._take(key, default is None)
        return self._default(key, default) if raw is None else self._convert(key, raw, int, "an integer")

    def optional_int(self, key: builtins.str) -> builtins.int | None:
        raw = self._take(key, False)
        return None if raw is None else self._convert(key, raw, int, "an integer")

    def float(self, key: builtins.str, default: builtins.float | None = None) -> builtins.float:
        raw = self._take(key, default is None)
        return self._default(key, default) if raw is None else self._convert(key, raw, float, "a number")

    def optional_float(self, key: builtins.str) -> builtins.float | None:
        raw = self._take(key, False)
        return None if raw is None else self._convert(key, raw, float, "a number")

    def ints(self, key: builtins.str) -> tuple[builtins.int, ...]:
        raw = self._take(key, False)
        if not raw:
            return ()
        try:
            return tuple(int(part) for part in raw.split(","))
        except ValueError:
            raise ParseError(f"{self.where}: field {key!r} must be comma-separated integers, got {raw!r}") from None

    def strs(self, key: builtins.str) -> tuple[builtins.str, ...]:
        raw = self._take(key, False)
        if raw is None or raw == "":
            return ()
        if raw.startswith("["):
            try:
                return tuple(json.loads(raw))
            except json.JSONDecodeError:
                raise ParseError(f"{self.where}: field {key!r} is not a valid JSON list: {raw!r}") from None
        return tuple(raw.split(","))

    def rest(self) -> dict[builtins.str, builtins.str | None]:
        """Fields not read yet (for records with open-ended extras)."""
        rest, self.fields = self.fields, {}
        return rest

    def done(self) -> None:
        if self.fields:
            raise ParseError(f"{self.where}: unknown field(s) {sorted(self.fields)}")


def format_strs(items: tuple[str, ...]) -> str:
    """A tuple of names as one value: comma-joined, or a JSON list when a name needs it."""
    if all(item and item != ABSENT and "," not in item and _BARE.fullmatch(item) and not item.startswith("[")
           for item in items):
        return ",".join(items)
    return json.dumps(list(items), separators=(",", ":"))


def record(keyword: str, line: str, number: int) -> tuple[str, list[str], str]:
    """Split a line into (keyword, field tokens, where-text for errors)."""
    where = f"line {number}"
    tokens = split_tokens(line.strip(), where)
    if not tokens:
        raise ParseError(f"{where}: empty line where {keyword!r} was expected")
    return tokens[0], tokens[1:], where

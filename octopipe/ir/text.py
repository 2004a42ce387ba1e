"""Shared pieces of the IR text forms: `key=value` fields on one line, values that round-trip.

Every IR type prints one record per line: a keyword, then `key=value` fields. A value is printed
bare when it is a plain token (letters, digits and `_ . : + - * / ,`) and JSON-quoted otherwise,
floats use `repr` (exact round trip) and an absent value is `-`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from octopipe.errors import ParseError

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
    if text and text != ABSENT and _BARE.match(text):
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


def parse_fields(tokens: Iterable[str], where: str) -> dict[str, str]:
    """`key=value` tokens to a dict of raw (unquoted) strings; `-` stays `-`."""
    fields: dict[str, str] = {}
    for token in tokens:
        key, sep, raw = token.partition("=")
        if not sep or not key:
            raise ParseError(f"{where}: expected key=value, got {token!r}")
        if key in fields:
            raise ParseError(f"{where}: field {key!r} given twice")
        if raw.startswith('"'):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ParseError(f"{where}: bad quoted value for {key!r}: {exc}") from None
        fields[key] = raw
    return fields


class FieldReader:
    """Typed access to the fields of one text record, with errors that name the line."""

    def __init__(self, fields: dict[str, str], where: str) -> None:
        self.fields = dict(fields)
        self.where = where

    def _take(self, key: str, required: bool) -> str | None:
        if key not in self.fields:
            if required:
                raise ParseError(f"{self.where}: missing field {key!r}")
            return None
        return self.fields.pop(key)

    def str(self, key: str, default: str | None = None, required: bool = True) -> str:
        raw = self._take(key, required and default is None)
        if raw is None:
            return default if default is not None else ""
        return raw

    def int(self, key: str, default: int | None = None) -> int:
        raw = self._take(key, default is None)
        if raw is None:
            assert default is not None
            return default
        try:
            return int(raw)
        except ValueError:
            raise ParseError(f"{self.where}: field {key!r} must be an integer, got {raw!r}") from None

    def optional_int(self, key: str) -> int | None:
        raw = self._take(key, False)
        if raw is None or raw == ABSENT:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ParseError(f"{self.where}: field {key!r} must be an integer, got {raw!r}") from None

    def float(self, key: str, default: float | None = None) -> float:
        raw = self._take(key, default is None)
        if raw is None:
            assert default is not None
            return default
        try:
            return float(raw)
        except ValueError:
            raise ParseError(f"{self.where}: field {key!r} must be a number, got {raw!r}") from None

    def optional_float(self, key: str) -> float | None:
        raw = self._take(key, False)
        if raw is None or raw == ABSENT:
            return None
        try:
            return float(raw)
        except ValueError:
            raise ParseError(f"{self.where}: field {key!r} must be a number, got {raw!r}") from None

    def ints(self, key: str) -> tuple[int, ...]:
        raw = self._take(key, False)
        if raw is None or raw in ("", ABSENT):
            return ()
        try:
            return tuple(int(part) for part in raw.split(","))
        except ValueError:
            raise ParseError(f"{self.where}: field {key!r} must be comma-separated integers, got {raw!r}") from None

    def strs(self, key: str) -> tuple[str, ...]:
        raw = self._take(key, False)
        if raw is None or raw in ("", ABSENT):
            return ()
        return tuple(json.loads(raw)) if raw.startswith("[") else tuple(raw.split(","))

    def rest(self) -> dict[str, str]:
        """Fields not read yet (for records with open-ended extras)."""
        rest, self.fields = self.fields, {}
        return rest

    def done(self) -> None:
        if self.fields:
            raise ParseError(f"{self.where}: unknown field(s) {sorted(self.fields)}")


def format_strs(items: tuple[str, ...]) -> str:
    """A tuple of names as one value: comma-joined, or a JSON list when a name needs it."""
    if all(item and "," not in item and _BARE.match(item) and not item.startswith("[") for item in items):
        return ",".join(items)
    return json.dumps(list(items), separators=(",", ":"))


def record(keyword: str, line: str, number: int) -> tuple[str, list[str], str]:
    """Split a line into (keyword, field tokens, where-text for errors)."""
    where = f"line {number}"
    tokens = split_tokens(line.strip(), where)
    if not tokens:
        raise ParseError(f"{where}: empty line where {keyword!r} was expected")
    return tokens[0], tokens[1:], where

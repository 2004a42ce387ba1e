"""Reading the IR's files: UTF-8 text, JSON and YAML, every failure an OctopipeError of the
caller's kind that names the file.

Hostile or broken files are refused before they cost much: text that is not UTF-8 (PowerShell's
`>` writes UTF-16), JSON nested too deeply for Python's parser, and YAML aliases (`*name`), which
an IR file never needs and a "billion laughs" document uses to expand a few hundred bytes into
billions of values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from octopipe.errors import OctopipeError

MAX_FILE_BYTES = 256 * 2**20
"""The largest IR file read (a paper-size cost table with formulas is under 1 MiB)."""


def read_text(path: Path, error: type[OctopipeError], what: str) -> str:
    """The UTF-8 text of `path` (a `what`, for the message), or `error`."""
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise error(f"{path}: the {what} is larger than {MAX_FILE_BYTES // 2**20} MiB; is it the right file?")
        return data.decode("utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise error(f"{path}: the {what} is not UTF-8 text (saved as UTF-16, as PowerShell's > writes?); save it as "
                    "UTF-8") from None


def parse_json(text: str, where: str, error: type[OctopipeError]) -> Any:
    """`text` as JSON, or `error` saying where it fails."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to read") from None


def parse_yaml(text: str, where: str, error: type[OctopipeError]) -> Any:
    """`text` as YAML (the safe subset, no aliases), or `error` saying where it fails."""
    import yaml

    class _NoAliases(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in OctoPipe files; "
                                                  "write the value out", event.start_mark)
            return super().compose_node(parent, index)

    try:
        return yaml.load(text, Loader=_NoAliases)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise error(f"{where}: not valid YAML: {exc}") from None
    except RecursionError:
        raise error(f"{where}: YAML nested too deeply to read") from None

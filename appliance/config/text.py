"""The merged config as TOML text, for `appliance config check`: `load` reads it back to an equal Config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from appliance.config import SECTIONS, Config


def to_toml(config: Config) -> str:
    """The merged config as TOML, for `appliance config check`; `load` reads it back to an equal Config."""
    merged = ", ".join(str(p) for p in config.sources).replace("\n", "\\n").replace("\r", "\\r")
    lines = [f"# merged from: {merged or 'defaults only'}"]
    for section in SECTIONS:
        lines.append(f"\n[{section}]")
        tables: list[str] = []  # a field of tables ([engine.models.NAME]) goes after the section's keys
        for f in dataclasses.fields(getattr(config, section)):
            value = getattr(getattr(config, section), f.name)
            if isinstance(value, dict):
                for name, table in value.items():
                    tables += [f"\n[{section}.{f.name}.{_toml_key(name)}]", *_keys(table)]
            else:
                lines += _keys(getattr(config, section), f.name)
        lines += tables
    return "\n".join(lines) + "\n"


def _keys(table: Any, only: str = "") -> list[str]:
    """A table's keys as TOML lines (`only`: that one); TOML has no null: an unset optional value is
    left out, as in the files."""
    out = []
    for f in dataclasses.fields(table):
        value = getattr(table, f.name)
        if only and f.name != only:
            continue
        out.append(f"# {f.name} is not set" if value is None else f"{f.name} = {_toml_value(value)}")
    return out


def _toml_key(name: str) -> str:
    return name if name and all(c.isascii() and (c.isalnum() or c in "-_") for c in name) else _toml_string(name)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # the shortest text that reads back as the same float ("30.0", "1e-07")
    if isinstance(value, Path):
        return _toml_string("" if value == Path("") else str(value))  # Path("") is unset, not "."
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'

"""Reading the daemon's Prometheus text: a sample's value by its name and (some of) its labels."""

from __future__ import annotations

import re

SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str, **labels: str) -> list[float]:
    """The values of every `name` sample whose labels include `labels` (others may be there too)."""
    found = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or match["name"] != name:
            continue
        have = dict(LABEL.findall(match["labels"] or ""))
        if all(have.get(key) == value for key, value in labels.items()):
            found.append(float(match["value"]))
    return found


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one `name` sample with `labels`; an assertion error when there is not exactly one."""
    found = samples(text, name, **labels)
    assert len(found) == 1, f"{len(found)} samples of {name} {labels} in:\n{text}"
    return found[0]


def total(text: str, name: str, **labels: str) -> float:
    """The sum of every `name` sample with `labels` (0 where there is none yet)."""
    return sum(samples(text, name, **labels))

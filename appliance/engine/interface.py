"""The one small interface every engine implements: run a graph once on a batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np


class Engine(Protocol):
    name: str

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        """Run the graph once on a batch of `batch` sequences; feeds and results keyed by tensor name."""
        ...


class GpuOutOfMemory(Exception):
    """A GPU engine ran out of device memory on a batch; the batch can run elsewhere."""

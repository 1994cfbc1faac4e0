"""CUDA libraries for CTranslate2's CUDA build, from the `gpu` extra's PyPI wheels.

CTranslate2 opens libcublas.so.12 and cuDNN 9 by name when a model goes onto a CUDA device; a box
with only the NVIDIA driver has neither on the loader's path. The wheels nvidia-cublas-cu12 and
nvidia-cudnn-cu12 (as faster-whisper documents) put them under site-packages/nvidia/*/lib: loading
them once with RTLD_GLOBAL makes the later open by name find them, with no LD_LIBRARY_PATH to set.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

PACKAGES = ("nvidia.cublas", "nvidia.cudnn")  # cuBLAS first: cuDNN's libraries need it


def library_files() -> list[Path]:
    """The wheels' shared libraries, dependencies first (cuBLAS Lt before cuBLAS, cuDNN's core last)."""
    found: list[Path] = []
    for name in PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            continue
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        for root in roots:
            found += sorted((Path(root) / "lib").glob("lib*.so.*"), key=lambda p: ("Lt" not in p.name, p.name))
    return found


def preload() -> tuple[list[str], list[str]]:
    """Load what the wheels hold; (loaded names, 'name: reason' for each that did not load). A library
    whose dependency is not loaded yet is retried once the others are."""
    loaded: list[str] = []
    waiting = library_files()
    errors: dict[str, str] = {}
    while waiting:
        failed = []
        for path in waiting:
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                loaded.append(path.name)
            except OSError as exc:
                failed.append(path)
                errors[path.name] = str(exc).splitlines()[0]
        if len(failed) == len(waiting):
            break
        waiting = failed
    return loaded, [f"{p.name}: {errors[p.name]}" for p in waiting]

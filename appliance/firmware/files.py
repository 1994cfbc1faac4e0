"""Reading, hashing and copying a bundle's files block by block, so a progress bar can follow them."""

from __future__ import annotations

import hashlib
from pathlib import Path

from appliance.progress import Advance, Progress, ignore


def sha256_file(path: Path, advance: Advance = ignore) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            advance(len(block))
    return digest.hexdigest()


def copy_file(source: Path, dest: Path, advance: Advance = ignore) -> None:
    """shutil.copyfile, block by block, so that a progress bar can follow it."""
    with source.open("rb") as src, dest.open("wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            dst.write(block)
            advance(len(block))


def hash_files(directory: Path, relatives: list[str], progress: Progress, desc: str) -> dict[str, str]:
    """The sha256 of each file under directory, as one progress phase."""
    total = sum((directory / r).stat().st_size for r in relatives)
    with progress.phase(desc, total) as advance:
        return {r: sha256_file(directory / r, advance) for r in relatives}

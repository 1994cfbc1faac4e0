"""Reading, hashing and copying a bundle's files block by block, so a progress bar can follow them.

Files of update media (a bundle being verified or installed) come as `keys.Medium` blocks, opened by
`keys.open_medium`; plain paths are only for what the build itself was given or made."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from appliance.durable import create_file
from appliance.progress import Advance, Progress, ignore


def file_blocks(path: Path) -> Iterator[bytes]:
    """A file the build was given or made, in blocks (never update media: see keys.open_medium)."""
    with path.open("rb") as f:
        yield from iter(lambda: f.read(1 << 20), b"")


def sha256_blocks(blocks: Iterable[bytes], advance: Advance = ignore) -> str:
    digest = hashlib.sha256()
    for block in blocks:
        digest.update(block)
        advance(len(block))
    return digest.hexdigest()


def sha256_file(path: Path, advance: Advance = ignore) -> str:
    return sha256_blocks(file_blocks(path), advance)


def write_blocks(blocks: Iterable[bytes], dest: Path, advance: Advance = ignore) -> None:
    """A new file (mode 0644 whatever the umask) made of blocks, so that a progress bar can follow it."""
    with os.fdopen(create_file(dest), "wb") as dst:
        for block in blocks:
            dst.write(block)
            advance(len(block))


def copy_file(source: Path, dest: Path, advance: Advance = ignore) -> None:
    write_blocks(file_blocks(source), dest, advance)


def hash_files(directory: Path, relatives: list[str], progress: Progress, desc: str) -> dict[str, str]:
    """The sha256 of each file under directory, as one progress phase."""
    total = sum((directory / r).stat().st_size for r in relatives)
    with progress.phase(desc, total) as advance:
        return {r: sha256_file(directory / r, advance) for r in relatives}

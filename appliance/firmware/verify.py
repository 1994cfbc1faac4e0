"""The one verify: a bundle is used only once its signature checks against a trusted key and every
artifact's sha256 matches. The daemon imports this, never the build.

A bundle is update media until verified: every file of it is read through `keys.open_medium` (regular
files reached without links, sizes bounded before reading), and a bundle with a link, a FIFO or a device
anywhere in it is refused outright, listed in the manifest or not."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from appliance import keys
from appliance.errors import ApplianceError
from appliance.firmware.files import sha256_blocks
from appliance.firmware.manifest import ARTIFACT_MAX, MANIFEST, Bundle, manifest_from_data
from appliance.progress import QUIET, Progress

TREE_ENTRIES_MAX = 4096  # files and directories in a bundle (the default has 4)
TREE_DEPTH_MAX = 8


def check_tree(bundle_dir: Path) -> None:
    """Every entry of the bundle is a directory or a regular file: a symbolic link anywhere in it (one the
    manifest does not list too), a FIFO, a device or a socket is refused; so is an oversized tree.
    The bundle directory itself may be reached through a link (the store's `current`)."""
    if not bundle_dir.is_dir():
        raise ApplianceError(f"{bundle_dir}: not a firmware bundle directory")
    pending, seen = [(bundle_dir, 0)], 0
    while pending:
        directory, depth = pending.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    seen += 1
                    if seen > TREE_ENTRIES_MAX:
                        raise ApplianceError(f"{bundle_dir}: more than {TREE_ENTRIES_MAX} files (not a bundle)")
                    mode = entry.stat(follow_symlinks=False).st_mode
                    if stat.S_ISDIR(mode):
                        if depth + 1 >= TREE_DEPTH_MAX:
                            raise ApplianceError(f"{entry.path}: nested more than {TREE_DEPTH_MAX} deep in the bundle")
                        pending.append((Path(entry.path), depth + 1))
                    elif not stat.S_ISREG(mode):
                        raise keys.not_regular(Path(entry.path), mode)
        except OSError as exc:
            raise ApplianceError(f"{exc.filename or directory}: cannot read: {exc.strerror}") from None


def verify(bundle_dir: Path, trust_dir: Path, progress: Progress = QUIET) -> Bundle:
    """Return the bundle if its signature verifies against a trusted key and every hash matches.

    Every failure is one ApplianceError naming the file and the reason.
    """
    manifest_path = bundle_dir / MANIFEST
    check_tree(bundle_dir)
    data = keys.read_signed(bundle_dir, trust_dir, "a firmware")
    manifest = manifest_from_data(data, str(manifest_path))
    artifacts = sorted(manifest.artifacts.items())
    total = 0
    for relative, _ in artifacts:
        if not os.path.lexists(bundle_dir / relative):
            raise ApplianceError(f"{bundle_dir / relative}: artifact listed in the manifest is missing")
        with keys.open_medium(bundle_dir, relative, ARTIFACT_MAX, "firmware artifact") as medium:
            total += medium.size
    with progress.phase(f"verify {bundle_dir}", total) as advance:
        for relative, expected in artifacts:
            with keys.open_medium(bundle_dir, relative, ARTIFACT_MAX, "firmware artifact") as medium:
                if sha256_blocks(medium.blocks(), advance) != expected:
                    raise ApplianceError(f"{medium.path}: sha256 does not match the manifest (file altered)")
    for model in manifest.models:
        inside = model.file + "/"  # a directory model: its files are the artifacts
        if (
            model.file
            and model.file not in manifest.artifacts
            and not any(a.startswith(inside) for a in manifest.artifacts)
        ):
            raise ApplianceError(f"{manifest_path}: model {model.name} file {model.file} is not a hashed artifact")
    return Bundle(bundle_dir, manifest)


def read_unverified_name(bundle_dir: Path) -> str | None:
    """The firmware name, for error messages only (never to decide anything); read like any update media."""
    try:
        _, document = keys.read_manifest(bundle_dir)
        name = document["name"]
    except (ApplianceError, KeyError, TypeError):
        return None
    return name[:80] if isinstance(name, str) else None

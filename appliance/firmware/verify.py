"""The one verify: a bundle is used only once its signature checks against a trusted key and every
artifact's sha256 matches. The daemon imports this, never the build."""

from __future__ import annotations

import json
from pathlib import Path

from appliance import keys
from appliance.errors import ApplianceError
from appliance.firmware.files import sha256_file
from appliance.firmware.manifest import MANIFEST, Bundle, manifest_from_data
from appliance.progress import QUIET, Progress


def verify(bundle_dir: Path, trust_dir: Path, progress: Progress = QUIET) -> Bundle:
    """Return the bundle if its signature verifies against a trusted key and every hash matches.

    Every failure is one ApplianceError naming the file and the reason.
    """
    manifest_path = bundle_dir / MANIFEST
    data = keys.read_signed(bundle_dir, trust_dir, "a firmware")
    manifest = manifest_from_data(data, str(manifest_path))
    artifacts = sorted(manifest.artifacts.items())
    for relative, _ in artifacts:
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise ApplianceError(f"{manifest_path}: artifact path {relative!r} leaves the bundle")
        if not (bundle_dir / relative).is_file():
            raise ApplianceError(f"{bundle_dir / relative}: artifact listed in the manifest is missing")
    total = sum((bundle_dir / relative).stat().st_size for relative, _ in artifacts)
    with progress.phase(f"verify {bundle_dir}", total) as advance:
        for relative, expected in artifacts:
            if sha256_file(bundle_dir / relative, advance) != expected:
                raise ApplianceError(f"{bundle_dir / relative}: sha256 does not match the manifest (file altered)")
    for model in manifest.models:
        if model.file not in manifest.artifacts:
            raise ApplianceError(f"{manifest_path}: model {model.name} file {model.file} is not a hashed artifact")
    return Bundle(bundle_dir, manifest)


def read_unverified_name(bundle_dir: Path) -> str | None:
    """The firmware name, for error messages only (never to decide anything)."""
    try:
        return str(json.loads((bundle_dir / MANIFEST).read_bytes())["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return None

"""`appliance firmware inspect`: a bundle's manifest as one document, with whether and against what it verified."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.firmware.manifest import MANIFEST
from appliance.firmware.verify import verify


def inspect(bundle: Path, trust_dir: Path) -> dict[str, Any]:
    """{"bundle", "trusted_keys", "verified", "error", "manifest"}: the manifest as read (None when it cannot
    be read as JSON) and, when it does not verify, the reason."""
    manifest_path = bundle / MANIFEST
    doc: dict[str, Any] = {
        "bundle": str(bundle),
        "trusted_keys": str(trust_dir),
        "verified": False,
        "error": None,
        "manifest": None,
    }
    try:
        doc["manifest"] = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        doc["error"] = f"{manifest_path}: cannot read the manifest: {exc}"
    if doc["error"] is None:
        try:
            verify(bundle, trust_dir)
            doc["verified"] = True
        except (ApplianceError, OSError) as exc:
            doc["error"] = str(exc)
    return doc

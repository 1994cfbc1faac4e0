"""`appliance firmware inspect`: a bundle's manifest as one document, with whether and against what it verified."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance import keys
from appliance.errors import ApplianceError
from appliance.firmware.verify import verify


def inspect(bundle: Path, trust_dir: Path) -> dict[str, Any]:
    """{"bundle", "trusted_keys", "verified", "error", "manifest"}: the manifest as read (None when it cannot
    be read as JSON) and, when it does not verify, the reason. The manifest is read as update media
    (keys.read_manifest: a regular file within its size limit, JSON of bounded nesting)."""
    doc: dict[str, Any] = {
        "bundle": str(bundle),
        "trusted_keys": str(trust_dir),
        "verified": False,
        "error": None,
        "manifest": None,
    }
    try:
        _, doc["manifest"] = keys.read_manifest(bundle)
    except ApplianceError as exc:
        doc["error"] = str(exc)
    if doc["error"] is None:
        try:
            verify(bundle, trust_dir)
            doc["verified"] = True
        except (ApplianceError, OSError) as exc:
            doc["error"] = str(exc)
    return doc

"""Triton's model repository extension where the signed firmware is the repository: the index lists
what it serves; load and unload are refused, since only a new firmware changes what is served."""

from __future__ import annotations

from typing import Any

from appliance.errors import ApiError, BadRequest
from appliance.firmware import Manifest
from appliance.protocol.json_reader import BeyondBounds, JsonReader


def index(body: bytes, models: list[str], version: str, ready: bool) -> list[dict[str, Any]]:
    """Triton's $repository_index_response; the request body is empty or `{"ready": bool}` (only ready ones)."""
    if _ready_only(body) and not ready:
        return []
    state, reason = ("READY", "") if ready else ("UNAVAILABLE", "starting or shutting down")
    return [{"name": name, "version": version, "state": state, "reason": reason} for name in models]


def refusal(action: str, model: str, manifest: Manifest, models: list[str]) -> ApiError:
    return ApiError(
        f"cannot {action} model {model!r}: the signed firmware decides which models are served (this one, "
        f"{manifest.name} {manifest.version}, serves: {', '.join(models)}); install another firmware with "
        "`appliance update`",
        403,
    )


def _ready_only(body: bytes) -> bool:
    if not body.strip():
        return False
    try:
        doc = JsonReader.read(body, tensors=False)  # bounded: depth and values
    except BeyondBounds as exc:
        raise BadRequest(f"repository index request: {exc.message}") from None
    except BadRequest:
        raise BadRequest("repository index request: the body is not JSON") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("ready", False), bool):
        raise BadRequest('repository index request: the body must be an object like {"ready": true}')
    return bool(doc.get("ready", False))

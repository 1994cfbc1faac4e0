"""The operator routes' rule and /status's document: what maps the box for an attacker (every peer's
address, connection IDs, worker pids) or tells its load is for operators only."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

from appliance.kinds.base import ServedModel
from appliance.protocol.peers import PeerTable

OPERATOR_ROUTES = frozenset({"status", "metrics", "rooms", "fleet", "fleet_drain", "fleet_resume"})
OPERATORS_ARE = (
    "on the Unix socket, a member of the socket's group; over QUIC or HTTPS, a client whose certificate "
    "the operator CA (quic.operator_ca) signed"
)


def status_document(
    firmware: dict[str, Any],
    ready: bool,
    models: Iterable[ServedModel],
    workers: list[dict[str, Any]] | None,
    quic: dict[str, Any] | None,
    tls: dict[str, Any] | None,
    peer_table: PeerTable | None,
) -> dict[str, Any]:
    """What `appliance status` shows: firmware, engines, sequences, workers, and the QUIC peers."""
    now = time.monotonic()
    return {
        "firmware": firmware,
        "ready": ready,
        "models": [{"name": m.name, "engine": m.engine_name, "live_sequences": len(m.sequences)} for m in models],
        "workers": workers,
        "quic": quic,
        "tls": tls,
        "conncache": None
        if peer_table is None
        else {
            "backend": peer_table.backend,
            "reason": peer_table.reason,
            "totals": dataclasses.asdict(peer_table.totals()),
            "peers": sorted((p.as_dict(now) for p in peer_table.peers().values()), key=lambda p: p["peer"]),
        },
    }

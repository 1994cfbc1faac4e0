"""`appliance fleet targets`: the boxes that announce themselves on the LAN (the Wyoming announcement,
_wyoming._tcp.local., whose TXT record carries the HTTPS port), written in Prometheus' file_sd format
so that a scrape job follows the fleet as boxes come and go (docs/operations.md, image/prometheus.yml).

    [{"targets": ["10.0.0.11:8443"], "labels": {"box": "appliance-hall-a"}}, ...]

A box announces only where [wyoming] tcp is set; one without [https] is listed by name with no
target (it serves no /metrics on the network).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

SERVICE = "_wyoming._tcp.local."
ANSWER_MS = 3000  # how long one box's details are waited for


def file_sd(boxes: dict[str, tuple[list[str], str | None]]) -> list[dict[str, Any]]:
    """Prometheus' file_sd groups: one per box, its HTTPS address as the target, its name as a label."""
    return [
        {"targets": [f"{address}:{port}" for address in addresses], "labels": {"box": name}}
        for name, (addresses, port) in sorted(boxes.items())
        if port is not None
    ]


async def browse(seconds: float, interfaces: list[str] | None) -> dict[str, tuple[list[str], str | None]]:
    """The boxes heard within `seconds`: instance name -> (IPv4 addresses, HTTPS port or None)."""
    zeroconf = AsyncZeroconf(interfaces=interfaces or InterfaceChoice.All, ip_version=IPVersion.V4Only)
    try:
        names: set[str] = set()

        def seen(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
            if state_change is not ServiceStateChange.Removed:
                names.add(name)

        browser = AsyncServiceBrowser(zeroconf.zeroconf, SERVICE, handlers=[seen])
        await asyncio.sleep(seconds)
        await browser.async_cancel()
        boxes = {}
        for name in sorted(names):
            info = AsyncServiceInfo(SERVICE, name)
            if not await info.async_request(zeroconf.zeroconf, ANSWER_MS):
                continue  # gone meanwhile
            https = info.properties.get(b"https")
            boxes[name.removesuffix("." + SERVICE)] = (info.parsed_addresses(), https.decode() if https else None)
        return boxes
    finally:
        await zeroconf.async_close()


def write_targets(out: Path, seconds: float, interfaces: list[str] | None) -> dict[str, tuple[list[str], str | None]]:
    """Browse, then replace `out` whole (Prometheus re-reads the file when it changes: never a half)."""
    boxes = asyncio.run(browse(seconds, interfaces))
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(json.dumps(file_sd(boxes), indent=2) + "\n")
    os.replace(partial, out)
    return boxes

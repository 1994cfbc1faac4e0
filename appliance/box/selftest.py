"""The boot self-test (appliance-selftest.service, required by boot-complete.target): wait for the daemon,
run a real inference over the Unix socket; a pass commits firmware left on trial."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from appliance.box.slots import Box, slot_name
from appliance.client import Client, ClientError
from appliance.errors import ApplianceError
from appliance.firmware import store as firmware_store


def selftest(socket_path: str, timeout_s: float = 180.0, box: Box = Box()) -> str:
    """Wait for the daemon to be ready, then run a real inference; the line to log, or an error."""
    deadline = time.monotonic() + timeout_s
    last_error = "not ready"
    while time.monotonic() < deadline:
        try:
            with Client(socket_path, timeout=30.0) as client:
                if client.health()["ready"]:
                    seconds = np.arange(16000, dtype=np.float32) / 16000
                    probs = client.speech_probs((0.3 * np.sin(2 * np.pi * 220 * seconds)).astype(np.float32))
                    frames = -(-16000 // 512)  # the last frame is padded
                    if probs.size != frames or not np.all((probs >= 0) & (probs <= 1)):
                        raise ApplianceError(
                            f"self-test inference returned {probs.size} values, not {frames} in [0, 1]"
                        )
                    firmware = client.status()["firmware"]
                    return (
                        f"appliance-selftest: ok {slot_name(box)}{probs.size} probabilities, "
                        f"firmware {firmware['name']} {firmware['version']}"
                    )
        except (OSError, ClientError) as exc:
            last_error = str(exc)
        time.sleep(1.0)
    raise ApplianceError(
        f"self-test: the daemon on {socket_path} did not serve an inference within {timeout_s:.0f} s ({last_error})"
    )


def boot_selftest(socket_path: str, timeout_s: float, store: firmware_store.Store, tell: Callable[[str], None]) -> None:
    """`appliance image selftest`: the self-test, then the store's trial (if any) committed."""
    tell(selftest(socket_path, timeout_s))
    if store.on_trial:
        firmware_store.commit(store)
        tell(f"appliance-selftest: firmware {firmware_store.describe(store.current)} committed")

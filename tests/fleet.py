"""What the fleet tests share: HAProxy's agent read as HAProxy reads it, a bounded wait, one VAD frame."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import numpy as np

from appliance.client import infer_call

FRAME = (np.sin(np.arange(512) / 8) * 0.1).astype(np.float32)  # one VAD frame: a stateless infer
ONE_FRAME = infer_call("silero_vad", FRAME)


def agent_says(host: str, port: int) -> str:
    """The line the box's agent answers (HAProxy's agent-check connects, reads a line, closes)."""
    with socket.create_connection((host, port), timeout=10) as s:
        answer = b""
        while chunk := s.recv(100):
            answer += chunk
    return answer.decode()


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 120.0) -> None:
    """A bounded wait: fails only when `condition` never holds (no verdict from the clock)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def answers(host: str, port: int) -> bool:
    try:
        agent_says(host, port)
    except OSError:
        return False
    return True

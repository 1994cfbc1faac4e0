"""`appliance drain`, and the drain `appliance update` makes before it switches: ask the daemon on its
socket (POST /v2/fleet/drain), then follow it (GET /v2/fleet) until the work under way has finished
or the deadline passed, and, with `then = "stop"`, until the daemon is gone."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from appliance.client import Call, Client, ClientError, SocketUnreachable, checked

POLL_S = 0.05
MARGIN_S = 30.0  # past the daemon's own deadline: it stops waiting by then, so this only bounds a wedged one


def drain(socket_path: str, then: str, update: bool, deadline_s: float | None, tell: Callable[[str], None]) -> None:
    """Drain the daemon on `socket_path`; `then`: hold (keep refusing), stop, or resume."""
    order: dict[str, Any] = {"then": then, "update": update}
    if deadline_s is not None:
        order["deadline_s"] = deadline_s
    body = json.dumps(order).encode()
    with Client(socket_path, timeout=30) as client:
        started = checked(client.send(Call("POST", "/v2/fleet/drain", body, (("content-type", "application/json"),))))
    doc = started.json()
    tell(
        f"draining: {doc['in_flight']} requests and {doc['sessions']} sessions under way; the agent says {doc['agent']}"
    )
    give_up = time.monotonic() + (deadline_s if deadline_s is not None else 3600.0) + MARGIN_S
    drained = None
    while drained is None and time.monotonic() < give_up:
        try:
            with Client(socket_path, timeout=30) as client:
                drained = client.get("/v2/fleet")["drained"]
        except SocketUnreachable:  # then = stop: it stopped between two looks
            break
        except ClientError:  # its connection closed by the stop under way: look again
            pass
        time.sleep(POLL_S)
    if drained is not None:
        left = drained["in_flight"] + drained["sessions"]
        tell(
            "drained: all work under way finished"
            if not left
            else f"deadline passed: {drained['in_flight']} requests and {drained['sessions']} sessions left"
        )
    if then == "stop":
        _wait_gone(socket_path, give_up)
        tell("stopped")
    elif then == "resume":
        tell("taking new work again")


def resume(socket_path: str, tell: Callable[[str], None]) -> None:
    with Client(socket_path, timeout=30) as client:
        doc = checked(client.send(Call("POST", "/v2/fleet/resume"))).json()
    tell(f"taking new work again; the agent says {doc['agent']}")


def _wait_gone(socket_path: str, give_up: float) -> None:
    while time.monotonic() < give_up:
        try:
            with Client(socket_path, timeout=30) as client:
                client.send(Call("GET", "/v2/health/live"))
        except SocketUnreachable:
            return
        except ClientError:  # closed by the stop under way
            pass
        time.sleep(POLL_S)

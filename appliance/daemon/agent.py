"""HAProxy's agent check on a port of its own ([fleet] agent_address): each connection gets one line,
the box's state as api/fleet.py words it, and is closed. Nothing is read from the balancer.

It runs on a thread of its own, not the event loop: while models load and warm up the loop is busy
for seconds (the interpreter firmware: 5 s on 2 cores), and the balancer should hear "down" then,
not a timeout. A loop wedged later is HAProxy's HTTP check's to see (/v2/health/ready stops answering)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from appliance.networks import tcp_listener

log = logging.getLogger("appliance.fleet")
SEND_TIMEOUT_S = 5.0  # a peer that does not take one short line in this long is dropped


class Agent:
    def __init__(self, address: str, reply: Callable[[], bytes]) -> None:
        host, _, port = address.rpartition(":")
        self.reply = reply
        self.sock = tcp_listener("fleet.agent_address", host, int(port), backlog=64)
        threading.Thread(target=self._serve, name="agent", daemon=True).start()
        log.info("HAProxy's agent check on %s", address)

    def _serve(self) -> None:
        while True:
            try:
                peer, _ = self.sock.accept()
            except OSError:  # closed: the daemon stops
                return
            with peer, contextlib.suppress(OSError):
                peer.settimeout(SEND_TIMEOUT_S)
                try:
                    line = self.reply()
                except Exception:  # a bug of ours must not end the agent: this check gets no line (logged)
                    log.exception("the agent's answer failed")
                    continue
                peer.sendall(line)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

"""The fleet tests' clients: three boxes behind HAProxy (a `Fleet`), and what they send through it:
stateless infers counted by answer and box (`Load`), KServe sequences counted as finished, refused
before they start, or broken (`Sessions`)."""

from __future__ import annotations

import http.client
import ssl
import threading
import time
from collections import Counter
from pathlib import Path

from fleet import ADDRESSES, FRAME, ONE_FRAME, Box, HAProxy, Ports, fleet_ca, port_free_on_all
from waits import wait_until

from appliance.client import tensors_call


class Fleet:
    """Three boxes (tests/fleet.py `Box`) on 127.0.0.2, .3 and .4 behind HAProxy on 127.0.0.1, each serving
    `bundle` with `extra` config lines (and `wyoming`'s in [wyoming]); `api()` and `session()` dial its
    stateless and sessions fronts."""

    def __init__(
        self, base: Path, bundle: Path, trusted: Path, tls: tuple[Path, Path], extra: str = "", wyoming: str = ""
    ) -> None:
        self.ca, identities = fleet_ca(base)
        self.ports = Ports(*(port_free_on_all(ADDRESSES) for _ in range(3)))
        operator_ca = tls[0].parent / "operator-ca.pem"
        self.operator = tuple(str(tls[0].parent / f"operator-{n}") for n in ("client.pem", "client.key"))
        self.boxes = [
            Box(base / f"box-{a}", a, self.ports, identities[a], operator_ca, trusted, extra, wyoming)
            for a in ADDRESSES
        ]
        self.haproxy: HAProxy | None = None
        self.context = ssl.create_default_context(cafile=str(self.ca))
        try:
            for box in self.boxes:  # one after another: boxes that start at once on one host take one
                box.start(bundle).wait_ready()  # zeroconf name (their probes' unicast answers go astray)
            self.haproxy = HAProxy(base, self.ca, base / "balancer-combined.pem", self.ports)
            self.wait_serving(self.boxes)
        except BaseException:  # a failed start leaves nothing running
            self.close()
            raise

    @property
    def balancer(self) -> HAProxy:
        assert self.haproxy is not None
        return self.haproxy

    def wait_serving(self, boxes: list[Box], full: bool = True) -> None:
        """Every backend has these boxes UP (and at their full weight, the agent's "up ready 100%": idle)."""
        names = {f"box{ADDRESSES.index(b.address) + 1}" for b in boxes}

        def serving() -> bool:
            for backend in ("stateless", "sessions", "wyoming"):
                servers = self.balancer.servers(backend)
                if any(servers[n]["status"] != "UP" or (full and servers[n]["weight"] != "100") for n in names):
                    return False
            return True

        wait_until(serving, f"HAProxy serves {sorted(names)}")

    def api(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.balancer.api_port, context=self.context, timeout=120)

    def session(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.balancer.sessions_port, context=self.context, timeout=120)

    def what_happened(self) -> str:
        """For a failure's message: the boxes' warnings and errors, and HAProxy's last lines (each
        connection's box, timings and termination state)."""
        parts = []
        for box in self.boxes:
            lines = box.log.read_text(errors="replace").splitlines() if box.starts else []
            said = [line for line in lines if ": WARNING: " in line or ": ERROR: " in line]
            parts.append(f"box {box.address}: " + ("\n".join(said[-20:]) or "no warning or error"))
        if self.haproxy is not None:
            parts.append("HAProxy:\n" + "\n".join(self.haproxy.log.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    def close(self) -> None:
        if self.haproxy is not None:
            self.haproxy.stop()
        for box in self.boxes:
            box.stop()


def infer(connection: http.client.HTTPSConnection, call=ONE_FRAME) -> tuple[int, str]:
    """One KServe infer on a kept connection: its status and the box that answered (X-Served-By)."""
    connection.request(call.method, call.target, call.body, dict(call.headers))
    response = connection.getresponse()
    response.read()
    return response.status, response.getheader("x-served-by", "")


def box_of(connection: http.client.HTTPSConnection) -> str:
    """The box a passed-through TLS connection reached: its certificate names it."""
    subject = dict(item[0] for item in connection.sock.getpeercert()["subject"])  # type: ignore[union-attr]
    return str(subject["commonName"])


class Load(threading.Thread):
    """Stateless infers through HAProxy, back to back on kept connections, until stopped: every status counted."""

    def __init__(self, fleet: Fleet, clients: int = 3) -> None:
        super().__init__(daemon=True)
        self.fleet, self.clients = fleet, clients
        self.statuses: Counter[int] = Counter()
        self.served: Counter[str] = Counter()
        self.errors: list[str] = []
        self.replays = 0  # requests the client sent again after HAProxy closed its kept connection
        self.stopping = threading.Event()

    def run(self) -> None:
        threads = [threading.Thread(target=self.client, daemon=True) for _ in range(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def client(self) -> None:
        connection = self.fleet.api()
        while not self.stopping.is_set():
            try:
                status, box = infer(connection)
            except http.client.RemoteDisconnected:
                # HAProxy closes a kept client connection without a byte when the box under its request
                # died, so that the client replays it (HTTP/1.1's rule, RFC 9112 9.3.1; browsers, httpx
                # and openai's client do): replayed once here on a new connection, and counted
                self.replays += 1
                connection.close()
                connection = self.fleet.api()
                try:
                    status, box = infer(connection)
                except (OSError, http.client.HTTPException) as exc:
                    self.failed(exc)
                    connection = self.fleet.api()
                    continue
            except (OSError, http.client.HTTPException) as exc:
                self.failed(exc)
                connection = self.fleet.api()
                continue
            self.statuses[status] += 1
            self.served[box] += 1

    def failed(self, exc: BaseException) -> None:
        self.errors.append(f"{time.strftime('%H:%M:%S')} {exc!r}")

    def until(self, count: int) -> None:
        wait_until(lambda: sum(self.statuses.values()) >= count, f"{count} requests answered")

    def stop(self) -> None:
        self.stopping.set()
        self.join(300)


def sequence_step(connection: http.client.HTTPSConnection, sequence_id: int, start=False, end=False) -> int:
    call = tensors_call("silero_vad", {"audio": FRAME}, sequence_id=sequence_id, start=start, end=end)
    return infer(connection, call)[0]


def spread(fleet: Fleet, count: int) -> Counter[str]:
    """`count` one-frame infers through HAProxy on one kept connection: the box that answered each (all 200)."""
    connection, served = fleet.api(), Counter[str]()
    for _ in range(count):
        status, box = infer(connection)
        assert status == 200
        served[box] += 1
    connection.close()
    return served


class Sessions(threading.Thread):
    """KServe sequences through HAProxy's sessions front, one after another (start, 3 steps, end on one
    passed-through connection): each finishes on its box, is refused before it starts (a 503 or no
    connection), or fails once started. Counted."""

    def __init__(self, fleet: Fleet, first_id: int) -> None:
        super().__init__(daemon=True)
        self.fleet, self.sequence = fleet, first_id
        self.finished: Counter[str] = Counter()
        self.refused: list[str] = []
        self.failed: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.sequence += 1
            connection = self.fleet.session()
            try:
                status = sequence_step(connection, self.sequence, start=True)
            except (OSError, http.client.HTTPException) as exc:
                status, refusal = 0, repr(exc)
            else:
                refusal = str(status)
            if status != 200:
                self.refused.append(refusal)
                connection.close()
                time.sleep(0.05)  # not a hot loop while the fleet turns it away
                continue
            box = box_of(connection)
            try:
                steps = [sequence_step(connection, self.sequence) for _ in range(3)]
                steps.append(sequence_step(connection, self.sequence, end=True))
            except (OSError, http.client.HTTPException) as exc:
                steps = [repr(exc)]  # type: ignore[list-item]
            if steps == [200] * 4:
                self.finished[box] += 1
            else:
                self.failed.append(f"{box}: {steps}")
            connection.close()

    def stop(self) -> None:
        self.stopping.set()
        self.join(300)

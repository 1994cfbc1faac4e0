"""Three boxes behind Debian's HAProxy running image/haproxy.cfg as shipped: each box a daemon with its own
config, sockets, certificate (the fleet CA's) and loopback address (127.0.0.2, .3, .4), HAProxy on
127.0.0.1. The VAD firmware serves what these tests send: one-frame KServe infers (stateless, retried
by HAProxy), KServe sequences (sessions, TLS passed through to one box) and Wyoming connections (TCP).
Verdicts are counts and orders of events: requests answered, sessions finished, refused or closed."""

from __future__ import annotations

import asyncio
import http.client
import signal
import ssl
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import needs
from fleet import ADDRESSES, FRAME, ONE_FRAME, Box, HAProxy, Ports, fleet_ca, port_free_on_all, wait_until
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info

from appliance.client import tensors_call

pytestmark = needs(not Path("/usr/sbin/haproxy").exists(), "Debian's haproxy (apt-get install haproxy)")


class Fleet:
    def __init__(self, base: Path, bundle: Path, trusted: Path, tls: tuple[Path, Path], extra: str = "") -> None:
        self.ca, identities = fleet_ca(base)
        self.ports = Ports(*(port_free_on_all(ADDRESSES) for _ in range(3)))
        operator_ca = tls[0].parent / "operator-ca.pem"
        self.operator = tuple(str(tls[0].parent / f"operator-{n}") for n in ("client.pem", "client.key"))
        self.boxes = [
            Box(base / f"box-{a}", a, self.ports, identities[a], operator_ca, trusted, extra) for a in ADDRESSES
        ]
        for box in self.boxes:
            box.start(bundle)
        for box in self.boxes:
            box.wait_ready()
        self.haproxy = HAProxy(base, self.ca, base / "balancer-combined.pem", self.ports)
        self.context = ssl.create_default_context(cafile=str(self.ca))
        self.wait_serving(self.boxes)

    def wait_serving(self, boxes: list[Box]) -> None:
        """Every backend has these boxes UP at their full weight (the agent's "up ready 100%" heard)."""
        names = {f"box{ADDRESSES.index(b.address) + 1}" for b in boxes}

        def serving() -> bool:
            for backend in ("stateless", "sessions", "wyoming"):
                servers = self.haproxy.servers(backend)
                if any(servers[n]["status"] != "UP" or servers[n]["weight"] != "100" for n in names):
                    return False
            return True

        wait_until(serving, f"HAProxy serves {sorted(names)}")

    def api(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.haproxy.api_port, context=self.context, timeout=120)

    def session(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", self.haproxy.sessions_port, context=self.context, timeout=120)

    def close(self) -> None:
        self.haproxy.stop()
        for box in self.boxes:
            box.stop()


@pytest.fixture
def fleet(tmp_path: Path, bundle: Path, keys, tls) -> Iterator[Fleet]:
    f = Fleet(tmp_path, bundle, keys.trusted, tls)
    yield f
    f.close()


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
        super().__init__()
        self.fleet, self.clients = fleet, clients
        self.statuses: Counter[int] = Counter()
        self.served: Counter[str] = Counter()
        self.errors: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        threads = [threading.Thread(target=self.client) for _ in range(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def client(self) -> None:
        connection = self.fleet.api()
        while not self.stopping.is_set():
            try:
                status, box = infer(connection)
            except (OSError, http.client.HTTPException) as exc:  # HAProxy itself failed us: counted
                self.errors.append(f"{time.strftime('%H:%M:%S')} {exc!r}")
                connection.close()
                connection = self.fleet.api()
                continue
            self.statuses[status] += 1
            self.served[box] += 1

    def until(self, count: int) -> None:
        wait_until(lambda: sum(self.statuses.values()) >= count, f"{count} requests answered")

    def stop(self) -> None:
        self.stopping.set()
        self.join(300)


def sequence_step(connection: http.client.HTTPSConnection, sequence_id: int, start=False, end=False) -> int:
    call = tensors_call("silero_vad", {"audio": FRAME}, sequence_id=sequence_id, start=start, end=end)
    return infer(connection, call)[0]


async def wyoming_sessions(port: int, count: int) -> list[AsyncTcpClient]:
    clients = []
    for _ in range(count):
        client = AsyncTcpClient("127.0.0.1", port)
        await client.connect()
        await client.write_event(Describe().event())
        event = await asyncio.wait_for(client.read_event(), 60)
        assert event is not None and Info.is_type(event.type), event
        clients.append(client)
    return clients


async def still_served(client: AsyncTcpClient) -> bool:
    """A Wyoming session's next describe: answered (True) or ended with a close or error (False); never a hang."""
    try:
        await client.write_event(Describe().event())
        event = await asyncio.wait_for(client.read_event(), 60)
    except (ConnectionError, OSError):
        return False
    return event is not None and Info.is_type(event.type)


async def each_still_served(clients: list[AsyncTcpClient]) -> list[bool]:
    return list(await asyncio.gather(*(still_served(c) for c in clients)))


def test_a_box_killed_under_load_fails_no_stateless_request_and_its_sessions_close(fleet: Fleet) -> None:
    """Three clients send one-frame infers through HAProxy back to back; a KServe sequence is open on each
    box (TLS passed through) and a Wyoming connection on each. Box 127.0.0.2 gets SIGKILL mid-load. Every
    stateless request is answered 200 (HAProxy retries the ones the dead box dropped); the sequence and
    the Wyoming session on the dead box end with a close, the others go on; new sequences all open on
    the two living boxes."""
    sessions: dict[str, tuple[http.client.HTTPSConnection, int]] = {}
    for sequence in range(101, 104):  # leastconn spreads them: one per box
        connection = fleet.session()
        assert sequence_step(connection, sequence, start=True) == 200
        sessions[box_of(connection)] = (connection, sequence)
    assert sorted(sessions) == list(ADDRESSES)
    loop = asyncio.new_event_loop()
    wyoming = loop.run_until_complete(wyoming_sessions(fleet.haproxy.wyoming_port, 3))
    load = Load(fleet)
    load.start()
    load.until(60)
    victim = fleet.boxes[0]
    assert victim.proc is not None
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(60)
    answered = sum(load.statuses.values())
    load.until(answered + 60)  # HAProxy goes on across the death, and after it
    load.stop()
    assert load.errors == [] and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
    assert set(load.served) <= {"box1", "box2", "box3"} and load.served["box2"] and load.served["box3"]

    ended = []
    for box, (connection, sequence) in sessions.items():
        try:
            ended.append((box, sequence_step(connection, sequence, end=True)))
        except (OSError, http.client.HTTPException):
            ended.append((box, "closed"))
    assert dict(ended) == {"127.0.0.2": "closed", "127.0.0.3": 200, "127.0.0.4": 200}, ended
    served = loop.run_until_complete(each_still_served(wyoming))
    assert sorted(served) == [False, True, True], served
    loop.close()

    fresh: Counter[str] = Counter()
    for n in range(6):
        connection = fleet.session()
        assert sequence_step(connection, 500 + n, start=True) == 200
        fresh[box_of(connection)] += 1
        assert sequence_step(connection, 500 + n, end=True) == 200
        connection.close()
    assert set(fresh) <= {"127.0.0.3", "127.0.0.4"} and sum(fresh.values()) == 6, fresh

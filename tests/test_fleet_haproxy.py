"""Three boxes behind Debian's HAProxy running image/haproxy.cfg as shipped: each box a daemon with its own
config, sockets, certificate (the fleet CA's) and loopback address (127.0.0.2, .3, .4), HAProxy on
127.0.0.1. The VAD firmware serves what these tests send: one-frame KServe infers (stateless, retried
by HAProxy), KServe sequences (sessions, TLS passed through to one box) and Wyoming connections (TCP).
Verdicts are counts and orders of events: requests answered, sessions finished, refused or closed."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import APPLIANCE, ROOT, needs
from fleet import ADDRESSES, FRAME, Prometheus, agent_says
from fleet_clients import Fleet, Load, Sessions, box_of, sequence_step, spread
from waits import wait_until
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import ClientConnection, connect
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info

from appliance.client import Client

pytestmark = needs(
    not (Path("/usr/sbin/haproxy").exists() and Path("/usr/bin/prometheus").exists()),
    "Debian's haproxy and prometheus (apt-get install haproxy prometheus)",
)


@pytest.fixture
def fleet(tmp_path: Path, bundle: Path, keys, tls) -> Iterator[Fleet]:
    f = Fleet(tmp_path, bundle, keys.trusted, tls)
    yield f
    f.close()


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
    wyoming = loop.run_until_complete(wyoming_sessions(fleet.balancer.wyoming_port, 3))
    load = Load(fleet)
    load.start()
    try:
        load.until(60)
        victim = fleet.boxes[0]
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(60)
        answered = sum(load.statuses.values())
        load.until(answered + 60)  # HAProxy goes on across the death, and after it
    finally:
        load.stop()
    assert load.errors == [] and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
    assert set(load.served) <= {"box1", "box2", "box3"} and load.served["box2"] and load.served["box3"]
    print(f"stateless: {sum(load.statuses.values())} answered 200, {load.replays} replayed by the client")

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


def test_weights_follow_load_a_box_at_its_bound_gets_no_new_work(tmp_path: Path, bundle: Path, keys, tls) -> None:
    """sequences.max_live = 4 on each box. Box 127.0.0.2 holds 2 open sequences: its agent says 50%, HAProxy
    weighs it 50 against 100 and 100, and of 60 requests it gets fewer than either other box. At 4 of 4 it
    is full: weight 1%, readiness fails, HAProxy takes it out and it gets none of 30. Its sequences ended,
    it is back at 100 and gets its share again."""
    fleet = Fleet(tmp_path, bundle, keys.trusted, tls, "[sequences]\nmax_live = 4\nidle_timeout_s = 600.0\n")
    try:
        box = fleet.boxes[0]
        with Client(str(box.socket), timeout=60) as client:
            for sequence in (1, 2):
                client.infer("silero_vad", {"audio": FRAME}, sequence_id=sequence, start=True)
            assert agent_says(box.address, fleet.ports.agent) == "up ready 50%\n"
            wait_until(lambda: fleet.balancer.servers("stateless")["box1"]["weight"] == "50", "HAProxy weighs it 50")
            half = spread(fleet, 60)
            assert half["box1"] < half["box2"] and half["box1"] < half["box3"], half
            for sequence in (3, 4):
                client.infer("silero_vad", {"audio": FRAME}, sequence_id=sequence, start=True)
            assert agent_says(box.address, fleet.ports.agent) == "up ready 1%\n"
            wait_until(lambda: fleet.balancer.servers("stateless")["box1"]["status"] == "DOWN", "HAProxy takes it out")
            full = spread(fleet, 30)
            assert full["box1"] == 0 and sum(full.values()) == 30, full
            for sequence in (1, 2, 3, 4):
                client.infer("silero_vad", {"audio": FRAME}, sequence_id=sequence, end=True)
        fleet.wait_serving([box])
        again = spread(fleet, 30)
        assert min(again[b] for b in ("box1", "box2", "box3")) > 0, again
    finally:
        fleet.close()


def test_a_rolling_update_under_load_fails_no_request_and_prometheus_sees_each_version(
    tmp_path: Path, bundle: Path, firmware_of, keys, tls
) -> None:
    """`appliance fleet targets` lists the three boxes from their zeroconf announcements; Prometheus scrapes
    them with the operator's certificate. Under three clients of stateless infers and three of sessions,
    each box in turn: `appliance drain --update --then stop` (the agent says maint), started again on
    firmware 1.1.0. Not one stateless request fails; every session finishes on its box or is refused
    before it starts; after each box, Prometheus shows it at 1.1.0 while the boxes not yet updated
    still show 1.0.0."""
    newer = firmware_of("default", version="1.1.0")
    fleet = Fleet(tmp_path, bundle, keys.trusted, tls)
    prometheus, workers = None, []
    try:
        targets = tmp_path / "boxes.json"
        instance = {box.address: f"{box.address}:{fleet.ports.https}" for box in fleet.boxes}

        def listed_all() -> bool:
            """`appliance fleet targets` hears our three boxes (on a loaded machine an answer may miss one listen)."""
            listed = subprocess.run(
                [*APPLIANCE, "fleet", "targets", "--out", str(targets), "--interface", "127.0.0.1"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert listed.returncode == 0, listed
            found = [t for g in json.loads(targets.read_text()) for t in g["targets"] if t in instance.values()]
            return sorted(found) == sorted(instance.values())

        wait_until(listed_all, "the three boxes listed", 300)
        ours = [g for g in json.loads(targets.read_text()) if set(g["targets"]) & set(instance.values())]
        assert all(len(g["targets"]) == 1 for g in ours), ours
        targets.write_text(json.dumps(ours))  # other sessions' boxes announce on this loopback too
        prometheus = Prometheus(tmp_path, fleet.ca, fleet.operator, targets)
        wait_until(lambda: prometheus.versions() == dict.fromkeys(instance.values(), "1.0.0"), "the first scrapes")
        load, sessions = Load(fleet), [Sessions(fleet, 1000 * n) for n in range(1, 4)]
        workers = [load, *sessions]
        for worker in workers:
            worker.start()
        load.until(30)
        for n, box in enumerate(fleet.boxes):
            drain = subprocess.run(
                [*APPLIANCE, "drain", "--socket", str(box.socket), "--update", "--then", "stop", "--deadline", "120"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert drain.returncode == 0 and "the agent says maint" in drain.stdout, drain
            assert box.proc is not None and box.proc.wait(120) == 0, box.log.read_text()
            box.start(newer).wait_ready()
            fleet.wait_serving([box], full=False)
            wait_until(lambda: prometheus.versions().get(instance[box.address]) == "1.1.0", f"{box.address} at 1.1.0")
            seen = prometheus.versions()
            assert all(seen.get(instance[b.address]) == "1.0.0" for b in fleet.boxes[n + 1 :]), seen
            answered = sum(load.statuses.values())
            load.until(answered + 20)  # the fleet serves on, this box among them
        for worker in workers:
            worker.stop()
        assert load.errors == [] and set(load.statuses) == {200}, (load.statuses, load.errors[:3])
        failed = [f for s in sessions for f in s.failed]
        finished = sum((s.finished for s in sessions), Counter[str]())
        refused = [r for s in sessions for r in s.refused]
        assert failed == [], failed
        assert sum(finished.values()) > 0, (finished, refused)
        print(f"stateless: {sum(load.statuses.values())} answered 200, {load.replays} replayed by the client")
        print(f"sessions: {sum(finished.values())} finished {dict(finished)}, {len(refused)} refused before start")
    finally:
        for worker in workers:  # a failed assertion above leaves them running
            worker.stop()
        if prometheus is not None:
            prometheus.stop()
        fleet.close()


def realtime(fleet: Fleet) -> ClientConnection:
    """A Realtime transcription session through HAProxy's sessions front (TLS passed through to a box)."""
    uri = f"wss://127.0.0.1:{fleet.balancer.sessions_port}/v1/realtime?intent=transcription"
    try:
        ws = connect(uri, ssl=fleet.context, open_timeout=60)
    except (OSError, EOFError, InvalidHandshake) as exc:
        raise AssertionError(f"a Realtime session did not open: {exc!r}\n{fleet.what_happened()}") from exc
    assert json.loads(ws.recv(timeout=60))["type"] == "session.created"
    return ws


def realtime_box(ws: ClientConnection) -> str:
    subject = dict(item[0] for item in ws.socket.getpeercert()["subject"])  # type: ignore[attr-defined]
    return str(subject["commonName"])


def still_answers(ws: ClientConnection) -> str:
    """A session's next exchange: "answered", or "closed" (a close, never a hang: a hang fails the recv's bound)."""
    try:
        ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        event = json.loads(ws.recv(timeout=60))
    except ConnectionClosed:
        return "closed"
    return "answered" if event["type"] == "input_audio_buffer.cleared" else event["type"]


def test_realtime_sessions_on_a_killed_box_close_and_new_ones_go_to_the_others(
    tmp_path: Path, firmware_of, keys, tls
) -> None:
    """The voice firmware (the VAD and Whisper: the lightest that serves Realtime) on each box. One Realtime
    session per box through HAProxy; box 127.0.0.2 gets SIGKILL: its session ends with a close, the two
    others still answer, and 4 new sessions all open on the living boxes."""
    fleet = Fleet(tmp_path, firmware_of("voice"), keys.trusted, tls)
    try:
        sessions = [realtime(fleet) for _ in range(3)]
        boxes = [realtime_box(ws) for ws in sessions]
        assert sorted(boxes) == list(ADDRESSES), boxes
        victim = fleet.boxes[0]
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(60)
        after = {box: still_answers(ws) for box, ws in zip(boxes, sessions, strict=True)}
        assert after == {"127.0.0.2": "closed", "127.0.0.3": "answered", "127.0.0.4": "answered"}, after
        fresh = [realtime(fleet) for _ in range(4)]
        assert {realtime_box(ws) for ws in fresh} <= {"127.0.0.3", "127.0.0.4"}
        for ws in (*sessions, *fresh):
            ws.close()
    finally:
        fleet.close()


async def satellite_through(port: int, source: str) -> AsyncTcpClient | str:
    """A Wyoming satellite at `source` that dials HAProxy's Wyoming front: connected and described, or
    the error it got instead."""
    client = AsyncTcpClient("127.0.0.1", port)
    client._reader, client._writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    await client.write_event(Describe().event())
    event = await asyncio.wait_for(client.read_event(), 60)
    if event is not None and Info.is_type(event.type):
        return client
    await client.disconnect()
    return "closed" if event is None else str(event.data.get("text"))


def test_behind_haproxy_a_box_sees_each_satellite_by_its_own_address(tmp_path: Path, bundle: Path, keys, tls) -> None:
    """HAProxy opens each connection to a box with a PROXY v2 header (send-proxy-v2), so a box's share per
    host and wyoming.allow are each satellite's: twelve satellites from six addresses all connect,
    where every box has a share of 2 per host (the balancer's one address would have had 2 at each box
    of the 12), and one from outside wyoming.allow is refused by its own address."""
    fleet = Fleet(tmp_path, bundle, keys.trusted, tls, wyoming='max_connections_per_peer = 2\nallow = "127.0.0.0/28"\n')
    port = fleet.balancer.wyoming_port

    async def run() -> tuple[list[AsyncTcpClient | str], AsyncTcpClient | str]:
        connected = [await satellite_through(port, f"127.0.0.{10 + i % 6}") for i in range(12)]
        outsider = await satellite_through(port, "127.0.0.20")
        for client in [*connected, outsider]:
            if isinstance(client, AsyncTcpClient):
                await client.disconnect()
        return connected, outsider

    try:
        connected, outsider = asyncio.run(run())
    finally:
        fleet.close()
    assert all(isinstance(c, AsyncTcpClient) for c in connected), connected
    assert outsider == "address 127.0.0.20 may not use Wyoming here (wyoming.allow)", outsider

"""Protocol workers (server.workers = 2): QUIC connections steered to their worker in the kernel, a
killed worker replaced while the other one's clients carry on, sequences that outlive the worker that
opened them, SIGHUP and SIGTERM reaching every worker. The transports' own tests run under both 1 and
2 workers through conftest's `daemon` fixture."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import Bystander, Daemon, cli, root_can
from waits import wait_until

from appliance.client import Client

CHUNK = 512


class UnixConnection(http.client.HTTPConnection):
    """One keep-alive HTTP/1.1 connection to the daemon's Unix socket, whose worker we can name."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)

    def call(self, method: str, target: str, doc: object | None = None) -> tuple[int, dict]:
        body = None if doc is None else json.dumps(doc).encode()
        self.request(method, target, body=body, headers={"Content-Type": "application/json"})
        response = self.getresponse()
        return response.status, json.loads(response.read() or b"{}")

    def __enter__(self) -> UnixConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def worker_pid(self) -> int:
        """The pid of the process holding the server side of this connection (ss knows it)."""
        if self.sock is None:
            self.connect()
        inode = os.fstat(self.sock.fileno()).st_ino
        # until a worker has accepted it: before, the server side is in the listen queue, held by no process
        for _ in range(100):
            out = subprocess.run(["ss", "-xpnH"], capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                fields = line.split()
                # Netid State Recv-Q Send-Q Local-Address Local-inode Peer-Address Peer-inode Process
                held = re.search(r"pid=(\d+)", line)
                if len(fields) >= 9 and fields[7] == str(inode) and fields[4] == self.path and held:
                    return int(held[1])
            time.sleep(0.1)
        raise AssertionError(f"no server side for inode {inode} in ss:\n{out}")


def vad_step(sequence_id: int, audio: np.ndarray, start: bool = False, end: bool = False) -> dict:
    return {
        "parameters": {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end},
        "inputs": [{"name": "audio", "shape": [len(audio)], "datatype": "FP32", "data": audio.tolist()}],
    }


def workers_status(daemon: Daemon) -> list[dict]:
    with daemon.client() as client:
        return client.status()["workers"]


def quic_hosts(daemon: Daemon) -> dict[str, int]:
    """Client address -> the pid of the worker holding its QUIC connection, as the workers last reported."""
    return {p.rsplit(":", 1)[0]: w["pid"] for w in workers_status(daemon) if w["up"] for p in w["quic_peers"]}


def connection_on(daemon: Daemon, pid: int) -> UnixConnection:
    """A Unix connection that the worker `pid` accepted (connections land where a worker accepts first)."""
    for _ in range(200):
        connection = UnixConnection(str(daemon.socket))
        connection.connect()
        if connection.worker_pid() == pid:
            return connection
        connection.close()
    raise AssertionError(f"no connection landed on worker pid {pid} in 200 tries")


@pytest.fixture
def two_workers(start_daemon, tls) -> Daemon:
    daemon = start_daemon(tls=tls, workers=2)
    wait_until(lambda: all(w["up"] for w in workers_status(daemon)), "both workers to report")
    return daemon


def test_each_quic_connection_stays_on_one_worker_and_connections_spread(two_workers: Daemon) -> None:
    daemon = two_workers
    with daemon.client() as client:
        status = client.status()
    if status["quic"]["workers"] < 2:
        root_can(f"QUIC runs in one worker here: {status['quic']['reason']}")
    hosts = [f"127.0.0.{n}" for n in range(2, 18)]
    clients = [
        Client(quic=f"127.0.0.1:{daemon.quic_port}", cafile=daemon.cafile, timeout=30, local_host=h) for h in hosts
    ]
    try:
        for _ in range(5):
            for client in clients:
                assert client.speech_probs(np.zeros(CHUNK, np.float32)).shape == (1,)
        wait_until(lambda: len(quic_hosts(daemon)) == len(hosts), "the workers' next reports")
        workers = workers_status(daemon)
    finally:
        for client in clients:
            client.close()
    where = {peer.rsplit(":", 1)[0]: w["worker"] for w in workers for peer in w["quic_peers"]}
    held = [peer.rsplit(":", 1)[0] for w in workers for peer in w["quic_peers"]]
    assert sorted(held) == sorted(hosts), workers  # each connection is held by exactly one worker
    assert len(set(where.values())) == 2, f"16 connections all on one worker: {workers}"
    for worker in workers:  # every datagram of a connection reached the worker that holds it
        assert worker["quic_datagrams"] > 0 and worker["quic_stray_datagrams"] == 0, workers
    shown = cli("status", "--socket", daemon.socket).stdout  # and `appliance status` shows them
    for worker in workers:
        assert f"worker {worker['worker']} pid {worker['pid']}: " in shown, shown
    assert "quic: 2 QUIC workers" in shown, shown


def test_a_killed_worker_is_replaced_and_the_other_workers_clients_see_no_error(two_workers: Daemon) -> None:
    daemon = two_workers
    before = workers_status(daemon)
    victim, survivor = before[0], before[1]
    kept = connection_on(daemon, survivor["pid"])
    assert kept.call("GET", "/v2/health/ready")[0] == 200
    with daemon.client() as client:
        quic = client.status()["quic"]
    bystanders: list[Bystander] = []
    try:
        # the kernel's reuseport hash of the 4-tuple places each new connection (8 can all land on the
        # victim, 1 run in 256): QUIC clients are added, 8 at a time, until the survivor holds one
        for first in range(20, 52, 8):
            for n in range(first, first + 8):
                bystanders.append(Bystander(daemon, local_host=f"127.0.0.{n}", pause_s=0.02))
                bystanders[-1].__enter__()
            wait_until(lambda: len(quic_hosts(daemon)) == len(bystanders), "QUIC clients to be reported")
            quic_on = quic_hosts(daemon)
            if quic["workers"] != 2 or survivor["pid"] in quic_on.values():
                break
        os.kill(victim["pid"], signal.SIGKILL)
        for _ in range(20):  # the survivor's Unix client carries on while the victim is replaced
            status, doc = kept.call("GET", "/v2/health/ready")
            assert status == 200, doc
            time.sleep(0.05)
        wait_until(
            lambda: (w := workers_status(daemon)[0])["up"] and w["pid"] != victim["pid"], "worker 0 to be replaced"
        )
    finally:
        for bystander in bystanders:
            bystander.__exit__()
    after = workers_status(daemon)
    assert after[0]["restarts"] == 1 and after[1]["pid"] == survivor["pid"] and after[1]["restarts"] == 0
    log = daemon.log.read_text()
    assert f"worker 0 (pid {victim['pid']}) exited with signal SIGKILL; restarting it" in log
    with daemon.client() as client:  # and the replacement serves; the metrics say what happened
        assert client.speech_probs(np.zeros(CHUNK, np.float32)).shape == (1,)
        metrics = client.metrics()
    assert 'appliance_worker_restarts_total{worker="0"} 1' in metrics
    assert 'appliance_worker_restarts_total{worker="1"} 0' in metrics
    if quic["workers"] != 2:  # the QUIC half needs the kernel's steering: a skip as a user, never silently dropped
        root_can(f"QUIC runs in one worker here: {quic['reason']}")
    spared = [b for b in bystanders if quic_on.get(b.local_host) == survivor["pid"]]  # saw no error at all
    assert spared, f"no QUIC client was on the surviving worker: {quic_on}"
    for bystander in spared:
        assert not bystander.errors and bystander.answered > 5, (bystander.errors, bystander.answered)


def test_a_sequence_opened_through_one_worker_continues_through_another(two_workers: Daemon) -> None:
    daemon = two_workers
    rng = np.random.default_rng(7)
    audio = [rng.standard_normal(CHUNK).astype(np.float32) * 0.3 for _ in range(6)]
    with UnixConnection(str(daemon.socket)) as reference:  # the same audio as one uninterrupted sequence
        expected = [
            reference.call("POST", "/v2/models/silero_vad/infer", vad_step(1, a, i == 0, i == 5))[1]["outputs"]
            for i, a in enumerate(audio)
        ]
    workers = workers_status(daemon)
    first = connection_on(daemon, workers[0]["pid"])
    got = [
        first.call("POST", "/v2/models/silero_vad/infer", vad_step(2, a, i == 0))[1]["outputs"]
        for i, a in enumerate(audio[:3])
    ]
    os.kill(workers[0]["pid"], signal.SIGKILL)  # the worker that opened it dies; the sequence lives on
    second = connection_on(daemon, workers[1]["pid"])
    for i, a in enumerate(audio[3:], start=3):
        status, doc = second.call("POST", "/v2/models/silero_vad/infer", vad_step(2, a, end=i == 5))
        assert status == 200, doc
        got.append(doc["outputs"])
    assert got == expected


def test_sighup_and_sigterm_reach_every_worker(two_workers: Daemon) -> None:
    daemon = two_workers
    workers = workers_status(daemon)
    text = daemon.config.read_text().replace("max_body_bytes = 8388608", "max_body_bytes = 4096")
    daemon.config.write_text(text)
    daemon.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: daemon.log.read_text().count("reload: applied server.max_body_bytes") >= 3, "reloads")
    big = vad_step(3, np.zeros(4096, np.float32), start=True)
    for worker in workers:  # each worker now refuses what it accepted before
        with connection_on(daemon, worker["pid"]) as connection:
            status, doc = connection.call("POST", "/v2/models/silero_vad/infer", big)
            assert status == 413, doc
    # SIGTERM: an open sequence keeps its connection through the drain, then every process exits
    connection = connection_on(daemon, workers[1]["pid"])
    small = np.zeros(CHUNK, np.float32)
    assert connection.call("POST", "/v2/models/silero_vad/infer", vad_step(4, small, start=True))[0] == 200
    daemon.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping: " in daemon.log.read_text(), "the stop begun")
    assert daemon.proc.poll() is None  # draining: the sequence is still open
    assert connection.call("POST", "/v2/models/silero_vad/infer", vad_step(4, small, end=True))[0] == 200
    assert daemon.proc.wait(20) == 0, daemon.log.read_text()
    for worker in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(worker["pid"], 0)


def test_large_bodies_cross_through_shared_memory_whole(two_workers: Daemon) -> None:
    """A body larger than a message goes through shared memory and comes back whole."""
    daemon = two_workers
    audio = np.random.default_rng(3).standard_normal(16000 * 20).astype(np.float32) * 0.1
    with daemon.client() as unix, daemon.client("quic") as quic:
        a = unix.speech_probs(audio)
        b = quic.speech_probs(audio)
    np.testing.assert_array_equal(a, b)
    assert len(a) == len(audio) // CHUNK
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("appliance-")]


def test_a_protocol_worker_loads_no_model_code() -> None:
    """A worker serves the transports that need no model (the listener table's Wyoming entries run in the
    engine process): importing it loads no engine, no kind and no audio decoder, so each worker costs
    neither their import time nor their memory."""
    heavy = ["onnxruntime", "ctranslate2", "av", "soxr", "appliance.kinds", "appliance.engine"]
    heavy += ["appliance.api.wyoming", "appliance.api.wyoming_handler"]  # the codec alone is light
    probe = (
        f"import sys, appliance.front.worker; heavy = {heavy!r}; "
        "print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy)))"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert found == "[]", found

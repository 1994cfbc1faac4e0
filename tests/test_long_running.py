"""A box that listens all day (docs/long-running.md): flow control from the client to the engine and
back, abandoned work cancelled, crashed engine loops failing fast, bounded queues, a quick stop. Real
daemons (workers 1 and 2), real clients on both transports, the real Piper voice."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, Daemon, Keys
from waits import wait_until

from appliance.client import Call, Client
from appliance.engine.failpoints import HANG_FAILPOINT, SLOWDOWN_FAILPOINT
from appliance.kinds.speech import SHARDS_AHEAD

VAD = "silero_vad"
SENTENCES = [
    "The morning train to the coast leaves from the second platform at half past seven.",
    "Please remember to take your ticket and your luggage with you when you leave.",
    "A light rain is expected in the afternoon, so an umbrella may be useful today.",
    "The museum opens its new exhibition of old maps and travel journals next week.",
]
LONG_TEXT = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(800))[:60_000]  # 60,000 characters
WINDOW = 256 << 10  # server.stream_window_bytes, its default
RSS_GROWTH_KIB = 96 << 10  # what a process may grow by while one client holds a 60,000-character answer


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def speech_daemon(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, keys: Keys, speech_bundle: Path, tls
):
    # a QUIC client that stops is not dropped for idleness while a test watches the engine stall
    quic = "idle_timeout_s = 300.0\n"
    d = Daemon(
        tmp_path_factory.mktemp("speechd"), speech_bundle, keys.trusted, tls=tls, workers=request.param, extra_quic=quic
    )
    d.wait_ready(180)
    yield d
    assert d.stop() == 0, d.log.read_text()


def metrics(daemon: Daemon) -> dict[str, float]:
    with daemon.client() as client:
        text = client.metrics()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


PENDING = 'nv_inference_pending_request_count{{model="{model}",version="1.0.0"}}'


def pending(daemon: Daemon, model: str = "joe") -> float:
    """Shards waiting for the voice or in its engine call (Triton's pending count is the queue's depth)."""
    return metrics(daemon)[PENDING.format(model=model)]


def shards_run(daemon: Daemon, model: str = "joe") -> float:
    return metrics(daemon)[f'nv_inference_count{{model="{model}",version="1.0.0"}}']


def process_tree_rss_kib(daemon: Daemon, field: str = "VmRSS") -> dict[int, int]:
    """Resident memory of the daemon and each of its protocol workers (`field`: VmHWM, its peak)."""
    pids = [daemon.proc.pid]
    children = Path(f"/proc/{daemon.proc.pid}/task/{daemon.proc.pid}/children")
    pids += [int(p) for p in children.read_text().split()] if children.exists() else []
    out = {}
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                out[pid] = int(line.split()[1])
    return out


def stalled_shards(daemon: Daemon, answers: int = 1) -> float:
    """The voice's shard count once the synthesis has stopped for `answers` clients that do not read:
    each answer waits for its client (held past the window, so no sentence of it is asked for) and the
    voice has nothing queued or running. A synthesis that went on regardless ends with its whole text
    run (no verdict from the clock: the order of events)."""

    def stalled() -> bool:
        now = metrics(daemon)  # one scrape: both figures at one moment
        return now["appliance_streams_waiting_for_client"] >= answers and now[PENDING.format(model="joe")] == 0

    wait_until(stalled, "the answers waiting for their clients, the voice idle", timeout_s=300)
    return shards_run(daemon)


def unix_request(path: Path, method: str, target: str, body: bytes = b"") -> socket.socket:
    """An HTTP/1.1 request sent on a raw Unix socket, its answer left unread."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the client holds little
    sock.connect(str(path))
    head = f"{method} {target} HTTP/1.1\r\nhost: box\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


def speech_body(text: str = LONG_TEXT, audio_format: str = "pcm") -> bytes:
    return json.dumps({"model": "joe", "voice": "joe", "input": text, "response_format": audio_format}).encode()


def warmed_rss(daemon: Daemon, clients: int = 1) -> dict[int, int]:
    """Every process's peak resident memory once the voice has run sentences like those of LONG_TEXT for
    as many clients at once as the test has: what serving them takes (the engine's arenas grow on the
    first ones, its lanes' sessions once two requests' sentences meet in a batch), which a slow client
    must not add to. The peak, not the memory at rest: the speech daemon was at 342 MiB after two
    clients' sentences and 528 MiB at its peak while it made them, so a measure taken while a sentence
    was being made looked like growth (148 MB over the memory at rest, once in a full run)."""

    def speak(_: int) -> None:
        with daemon.client() as client:
            client.speech(" ".join(SENTENCES * 3), voice="joe", model="joe", response_format="pcm")

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(speak, range(clients)))
    return process_tree_rss_kib(daemon, "VmHWM")


def held_bound_checked(daemon: Daemon, before: dict[int, int]) -> None:
    after = process_tree_rss_kib(daemon)
    grown = {pid: after[pid] - before.get(pid, after[pid]) for pid in after}
    assert all(g < RSS_GROWTH_KIB for g in grown.values()), f"RSS grew (KiB, by pid): {grown}"
    samples = metrics(daemon)
    largest = max(
        v
        for k, v in samples.items()
        if k.startswith(("appliance_stream_held_bytes_max", "appliance_worker_stream_held_bytes_max"))
    )
    assert largest <= WINDOW + (1 << 20), f"{largest} bytes held for one answer"


def test_a_slow_reader_over_the_unix_socket_stops_the_synthesis(speech_daemon: Daemon) -> None:
    """A client that reads a few bytes of a 60,000-character answer and then nothing: the engine runs
    a bounded number of sentences for it, every process's memory stays within the bound, and its
    leaving is counted as a cancellation."""
    before_rss, before_shards = warmed_rss(speech_daemon), shards_run(speech_daemon)
    sock = unix_request(speech_daemon.socket, "POST", "/v1/audio/speech", speech_body())
    try:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        for _ in range(20):  # a slow reader: a few bytes a while
            sock.recv(64)
            time.sleep(0.05)
        stalled = stalled_shards(speech_daemon)
        # 800 sentences asked for: only those the windows hold (and SHARDS_AHEAD) ran
        assert stalled - before_shards < 40, stalled - before_shards
        held_bound_checked(speech_daemon, before_rss)
        assert shards_run(speech_daemon) == stalled, "the engine went on synthesising for a client that does not read"
        cancelled = metrics(speech_daemon)["appliance_requests_cancelled_total"]
    finally:
        sock.close()
    wait_until(lambda: metrics(speech_daemon)["appliance_requests_cancelled_total"] > cancelled, "cancel counted")


QUIC_READER = """
import os, signal, sys
from appliance.client import Client
with Client(quic=sys.argv[1], cafile=sys.argv[2], timeout=60) as client:
    pieces = client.stream_speech(sys.argv[3], voice="joe", model="joe", response_format="pcm")
    next(pieces)
    print("reading", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # a client that stops reading (and acknowledging) altogether
"""


def test_an_http3_client_that_stops_reading_stops_the_synthesis(speech_daemon: Daemon) -> None:
    before_rss, before_shards = warmed_rss(speech_daemon), shards_run(speech_daemon)
    reader = subprocess.Popen(
        [sys.executable, "-c", QUIC_READER, f"127.0.0.1:{speech_daemon.quic_port}", speech_daemon.cafile, LONG_TEXT],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline() == b"reading\n"
        stalled = stalled_shards(speech_daemon)
        assert stalled - before_shards < 40, stalled - before_shards
        held_bound_checked(speech_daemon, before_rss)
        assert shards_run(speech_daemon) == stalled, "the engine went on synthesising for a client that does not read"
    finally:
        reader.kill()
        reader.wait()


@pytest.mark.parametrize("transport", ["unix", "quic"])
def test_a_client_that_leaves_a_long_request_cancels_it(speech_daemon: Daemon, transport: str) -> None:
    """A 60,000-character KServe infer (answered whole, at the end) whose client leaves after 2 s: the
    request is cancelled (counted), and once the voice's queue is empty it has run at most the
    sentences that were queued when the cancel came (no verdict from the clock: how many sentences a
    machine makes in 2 s is its speed)."""
    doc = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": [LONG_TEXT]}]}
    before = metrics(speech_daemon)
    call = Call("POST", "/v2/models/joe/infer", json.dumps(doc).encode(), (("content-type", "application/json"),))
    client = (
        Client(str(speech_daemon.socket), timeout=2)
        if transport == "unix"
        else Client(quic=f"127.0.0.1:{speech_daemon.quic_port}", cafile=speech_daemon.cafile, timeout=2)
    )
    with pytest.raises(Exception):  # noqa: B017 - the client gives up: NoAnswer, whatever its transport
        client.send(call)
    client.close()  # the connection goes: the daemon hears the client left
    wait_until(
        lambda: (
            metrics(speech_daemon)["appliance_requests_cancelled_total"] > before["appliance_requests_cancelled_total"]
        ),
        "cancelled",
    )
    cancelled = shards_run(speech_daemon)
    wait_until(lambda: pending(speech_daemon) == 0, "the voice's queue empty")
    stopped = shards_run(speech_daemon)
    assert stopped - cancelled <= SHARDS_AHEAD, "the engine went on for a client that left"


def vad_step(sequence_id: int, start: bool = False) -> dict:
    audio = np.zeros(512, np.float32)
    return {
        "parameters": {"sequence_id": sequence_id, "sequence_start": start},
        "inputs": [{"name": "audio", "shape": [512], "datatype": "FP32", "data": audio.tolist()}],
    }


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_with_32_idle_sequences_exits_at_once(start_daemon, workers: int) -> None:
    """Idle sequences do not hold the stop: it ends them at once. The grace time is an hour here, so a
    stop that waited for them would still be waiting when the test gives up (no clock judges this)."""
    daemon = start_daemon(workers=workers, shutdown_grace_s=3600.0)
    with daemon.client() as client:
        for sequence_id in range(1, 33):
            response = client.send(
                Call("POST", f"/v2/models/{VAD}/infer", json.dumps(vad_step(sequence_id, True)).encode())
            )
            assert response.status == 200, response.body
        assert client.status()["models"][0]["live_sequences"] == 32
    time.sleep(1.2)  # no request for a second: idle
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(300) == 0, daemon.log.read_text()
    log = daemon.log.read_text()
    assert "32 idle sequences ended" in log and "grace time over" not in log, log


@pytest.mark.parametrize("workers", [1, 2])
def test_a_crashed_engine_loop_fails_its_requests_at_once_and_recovers(start_daemon, workers: int) -> None:
    daemon = start_daemon(workers=workers, env={"APPLIANCE_TEST_FAILPOINTS": f"engine_loop:{VAD}"})
    with daemon.client() as client:
        call = Call("POST", f"/v2/models/{VAD}/infer", json.dumps(vad_step(0)).encode())
        failed = client.send(call)  # answered, not left to the client's timeout
        assert failed.status == 500 and VAD in failed.json()["error"], failed.body
        assert "engine loop crashed" in failed.json()["error"]
        assert client.send(call).status == 200  # a new loop serves
        assert metrics(daemon)[f'appliance_engine_loop_crashes_total{{model="{VAD}"}}'] == 1
    log = daemon.log.read_text()
    assert f"the engine loop of model {VAD} crashed" in log and "Traceback" in log
    assert f"failpoint engine_loop:{VAD}" in log


def long_noise_wav(seconds: float) -> bytes:
    import io

    import soundfile

    rng = np.random.default_rng(7)
    out = io.BytesIO()
    soundfile.write(
        out, (rng.standard_normal(int(seconds * 16000)) * 0.1).astype(np.float32), 16000, format="WAV", subtype="PCM_16"
    )
    return out.getvalue()


@pytest.mark.parametrize(
    ("workers", "bound"),
    [
        (1, "[engine]\nmax_queue_size = 1\n"),
        (2, "[engine]\nmax_queue_size = 1\n"),
        (1, f"[engine.models.{VAD}]\nmax_queue_size = 1\n"),
    ],
    ids=["workers1", "workers2", "the-models-own"],
)
def test_overload_past_max_queue_size_is_refused_with_retry_after(start_daemon, workers: int, bound: str) -> None:
    """With a max_queue_size of 1 (the engine's, or the model's own under an engine bound of 128),
    concurrent recordings past the bound get a 503 with Retry-After at once, the others their answer,
    nothing else; a good client is still served afterwards."""
    daemon = start_daemon(bound, workers=workers, max_body_bytes=32 << 20)
    wav = long_noise_wav(120)
    statuses: list[tuple[int, dict[str, str]]] = []

    def upload() -> None:
        with Client(str(daemon.socket), timeout=120) as client:
            response = client.send(Call("POST", f"/v2/models/{VAD}/segments", wav, (("content-type", "audio/wav"),)))
            statuses.append((response.status, response.headers))

    threads = [threading.Thread(target=upload) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    codes = sorted(s for s, _ in statuses)
    assert len(codes) == 12 and set(codes) <= {200, 503}, codes
    assert 200 in codes and 503 in codes, codes
    assert all(h.get("retry-after") == "1" for s, h in statuses if s == 503), statuses
    samples = metrics(daemon)
    assert samples[f'appliance_queue_refused_total{{model="{VAD}"}}'] == codes.count(503)
    with daemon.client() as client:
        assert client.speech_probs(np.zeros(512, np.float32)).shape == (1,)


def test_the_queue_policy_is_in_the_models_triton_config(speech_daemon: Daemon) -> None:
    with speech_daemon.client() as client:
        policy = client.get("/v2/models/joe/config")["dynamic_batching"]["default_queue_policy"]
    assert policy == {
        "timeout_action": "REJECT",
        "default_timeout_microseconds": 0,
        "allow_timeout_override": False,
        "max_queue_size": 128,
    }


def test_a_stop_during_start_up_stops_at_once(start_daemon, tmp_path: Path) -> None:
    """SIGTERM while the models load or warm up: exit 0, no waiting for the warm-up to end nor the
    grace time (an hour here). The engine is held in its warm-up call (the hang failpoint, armed
    before the start), so the stop comes during start-up on a machine of any speed."""
    hold = tmp_path / "hold-engine"
    hold.write_text("0")
    daemon = start_daemon(wait=False, env={HANG_FAILPOINT: str(hold)}, shutdown_grace_s=3600.0)
    wait_until(lambda: "verified" in daemon.log.read_text(), "the start began")
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(300) == 0, daemon.log.read_text()
    log = daemon.log.read_text()
    assert "stopped during start-up" in log and "ready: serving" not in log, log


@pytest.mark.parametrize("held", ["on-the-loop", "in-a-thread"])
def test_a_second_stop_signal_stops_now_saying_what_it_abandons(
    start_daemon, speech_bundle: Path, tmp_path: Path, held: str
) -> None:
    """Ctrl-C twice: the first stop waits for the engine call a test holds (wedged, as a driver call may
    be), for as long as its deadline (the grace time is an hour here); the second exits 1 at once, saying
    what it abandoned. The VAD's call holds the event loop; the voice's runs in a thread, so the first
    stop's drain goes on (it marked the daemon not ready, which the second took for a stop during
    start-up: that line, and exit 0). Without it the test gives up waiting (no clock judges this)."""
    hold = tmp_path / "hold-engine"
    bundle = {"bundle_dir": speech_bundle} if held == "in-a-thread" else {}
    daemon = start_daemon(env={HANG_FAILPOINT: str(hold)}, shutdown_grace_s=3600.0, **bundle)
    hold.write_text("0")
    call = (
        Call("POST", "/v1/audio/speech", speech_body(SENTENCES[0]), ())
        if held == "in-a-thread"
        else Call("POST", f"/v2/models/{VAD}/infer", json.dumps(vad_step(0)).encode())
    )

    def held_request() -> None:
        with contextlib.suppress(OSError), Client(str(daemon.socket), timeout=300) as client:
            client.send(call)

    threading.Thread(target=held_request, daemon=True).start()
    try:
        wait_until(lambda: "held by the test's hang failpoint" in daemon.log.read_text(), "the engine held")
        daemon.proc.send_signal(signal.SIGINT)
        wait_until(lambda: "a second stop signal (Ctrl-C again) stops now" in daemon.log.read_text(), "stopping")
        if held == "in-a-thread":
            wait_until(lambda: "stopping: 1 requests in flight" in daemon.log.read_text(), "the drain")
        daemon.proc.send_signal(signal.SIGINT)
        code = daemon.proc.wait(300)
    finally:
        hold.unlink()
    log = daemon.log.read_text()
    assert "stopping: a second stop signal; abandoned 1 requests in flight" in log, log
    assert "stopped during start-up" not in log and code == 1, (code, log)


@pytest.mark.parametrize("slowdown", [1, 3], ids=["engine-as-is", "engine-3x-slower"])
def test_a_request_waiting_past_queue_timeout_s_is_refused_and_one_under_way_is_not(
    start_daemon, speech_bundle: Path, tmp_path: Path, slowdown: int
) -> None:
    """engine.queue_timeout_s = 5 on the voice. A long answer (24 short sentences, one per batch) is under
    way when the test holds the engine (the hang failpoint); 16 one-sentence requests arrive and wait
    past the timeout behind the held call, then 8 more arrive and the test lets the engine go. The 16
    get a 503 with Retry-After naming the setting (counted); the 8, which waited only for the held call
    to finish (one short sentence), their speech; the long answer, whose later sentences waited as long
    as the 16, is never refused mid-answer. The engine is held, not timed: as it is and slowed 3x (a
    slower machine, by a test hook), the outcome is the same, and a faster engine only shortens the
    one wait that must stay under the timeout."""
    hold = tmp_path / "hold-engine"
    env = {HANG_FAILPOINT: str(hold), SLOWDOWN_FAILPOINT: str(slowdown)}
    daemon = start_daemon("[engine]\nqueue_timeout_s = 5.0\n", bundle_dir=speech_bundle, env=env)
    long_text = " ".join(f"Item {n}." for n in range(1, 25))
    answers: dict[str, tuple[int, dict[str, str], bytes]] = {}

    def speak(name: str, text: str) -> threading.Thread:
        def run() -> None:
            with Client(str(daemon.socket), timeout=300) as client:
                response = client.send(Call("POST", "/v1/audio/speech", speech_body(text), ()))
                answers[name] = (response.status, response.headers, response.body)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    before = shards_run(daemon)
    threads = [speak("long", long_text)]
    wait_until(lambda: shards_run(daemon) > before, "the long answer began")
    hold.write_text("0")  # the engine's next call stalls
    wait_until(lambda: "held by the test's hang failpoint" in daemon.log.read_text(), "the engine held")
    held_depth = pending(daemon)
    threads += [speak(f"early{i}", SENTENCES[i % 4]) for i in range(16)]
    wait_until(lambda: pending(daemon) >= held_depth + 16, "the 16 queued")
    time.sleep(5.5)  # the 16 wait past the timeout behind the held call
    threads += [speak(f"fresh{i}", SENTENCES[i % 4]) for i in range(8)]
    wait_until(lambda: pending(daemon) >= held_depth + 24, "the 8 queued")
    hold.unlink()
    for thread in threads:
        thread.join(300)
    status, _, body = answers["long"]
    assert status == 200 and len(body) / 2 / 22050 > 10, (status, len(body))  # 24 sentences, each ~0.7 s
    early = [answers[f"early{i}"] for i in range(16)]
    assert [s for s, _, _ in early] == [503] * 16, [(s, b[:100]) for s, _, b in early]
    assert all(h.get("retry-after") == "1" and b"engine.queue_timeout_s" in b for _, h, b in early), early[:1]
    fresh = [answers[f"fresh{i}"] for i in range(8)]
    assert [s for s, _, _ in fresh] == [200] * 8, [(s, b[:100]) for s, _, b in fresh]
    assert all(len(b) / 2 / 22050 > 2 for _, _, b in fresh)
    assert metrics(daemon)['appliance_queue_timed_out_total{model="joe"}'] == 16


@pytest.mark.parametrize("workers", [1, 2])
def test_200_simultaneous_uploads_are_answered_or_refused_within_the_bounds(start_daemon, workers: int) -> None:
    """200 clients of one local user (its connection share raised to 512: each of two workers holds half
    of it, and the kernel may hand most of a burst to one of them) upload a 30 s recording each at once
    (192 MB of bodies, under the 256 MiB body budget), engine.max_queue_size = 32: each is answered 200
    with its segments or refused 503 with Retry-After (before its upload is decoded), nothing else: a
    refusal for the queue, or for the body budget where the kernel hands one of two workers more
    uploads than its half of the budget holds (about 139). The daemon's processes together grow by
    less than twice the body budget (the bodies as read, and the copy each takes as it is handed over
    whole) and 128 MiB; a client afterwards is served at once."""
    daemon = start_daemon(
        "[engine]\nmax_queue_size = 32\n", workers=workers, extra_server="max_connections_per_peer = 512\n"
    )
    wav = long_noise_wav(30)
    before = sum(process_tree_rss_kib(daemon).values())
    statuses: list[tuple[int, dict[str, str], bytes]] = []
    peak = [0]
    start = threading.Barrier(200)

    def upload() -> None:
        with Client(str(daemon.socket), timeout=300) as client:
            start.wait()
            response = client.send(Call("POST", f"/v2/models/{VAD}/segments", wav, (("content-type", "audio/wav"),)))
            statuses.append((response.status, response.headers, response.body))

    def watch() -> None:
        while len(statuses) < 200:
            peak[0] = max(peak[0], sum(process_tree_rss_kib(daemon).values()))
            time.sleep(0.05)

    threads = [threading.Thread(target=upload) for _ in range(200)]
    watcher = threading.Thread(target=watch)
    for thread in [*threads, watcher]:
        thread.start()
    for thread in threads:
        thread.join(300)
    watcher.join(10)
    codes = sorted(s for s, _, _ in statuses)
    assert len(codes) == 200 and set(codes) == {200, 503}, codes
    assert all(h.get("retry-after") == "1" for s, h, _ in statuses if s == 503)
    assert all(json.loads(b)["duration"] == 30.0 for s, _, b in statuses if s == 200)
    refusals = [json.loads(b)["error"] for s, _, b in statuses if s == 503]
    queue_full = [r for r in refusals if "engine.max_queue_size" in r]
    assert all(r in queue_full or r.startswith("busy: request bodies held") for r in refusals), set(refusals)
    assert metrics(daemon)[f'appliance_queue_refused_total{{model="{VAD}"}}'] == len(queue_full), set(refusals)
    grown_mib = (peak[0] - before) / 1024
    assert grown_mib < 2 * 256 + 128, f"the daemon grew by {grown_mib:.0f} MiB"
    with daemon.client() as client:
        assert client.speech_probs(np.zeros(512, np.float32)).shape == (1,)
    print(
        f"200 uploads, workers {workers}: {codes.count(200)} answered, {codes.count(503)} refused, peak growth {grown_mib:.0f} MiB"
    )

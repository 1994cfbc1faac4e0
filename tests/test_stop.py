"""A stop that stops (issue 42), tried as a user would with a Realtime or Wyoming client open: the
daemon's stop closes a session that only listens at once with its protocol's goodbye (a WebSocket close
1001, a Wyoming error event), and lets a turn or recording under way end with its transcript first. The grace time is an hour: where a session held the stop for its
grace, the daemon would not exit within the test's wait."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from promtext import sample
from speech import RATE, recording
from test_realtime import URI, configure, pcm
from test_speech_to_text import ENGLISH, wer
from waits import wait_until
from websockets.asyncio.client import unix_connect
from websockets.exceptions import ConnectionClosed
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncUnixClient
from wyoming.info import Describe, Info

from appliance.client import Client, ConnectError, speech_call
from appliance.engine.failpoints import HANG_FAILPOINT
from appliance.front.supervisor import REPORT_STALE_S
from appliance.front.worker import START_HOLD_FAILPOINT

COMPLETED = "conversation.item.input_audio_transcription.completed"
APPEND_S = 0.1
HOUR = 3600.0


def session_through_stop(  # type: ignore[no-untyped-def]
    daemon, samples: np.ndarray, stop_after: str | None, uri: str = URI
) -> list[tuple[str, object]]:
    """`samples` then silence sent at real-time pace until the daemon closes the session; SIGTERM once
    the event `stop_after` came (None: once the session is set up). The events in order: each event's
    type, ("stop", None) where the signal went, then ("close", "CODE REASON")."""
    events: list[tuple[str, object]] = []

    def stop() -> None:
        events.append(("stop", None))
        daemon.proc.send_signal(signal.SIGTERM)

    def listening() -> bool:
        """Whether the session's live sequences are open on the VAD (its silence being heard)."""
        with Client(str(daemon.socket)) as client:
            return sample(client.metrics(), "appliance_live_sequences", model="silero_vad") > 0

    async def run() -> None:
        async with unix_connect(str(daemon.socket), uri, max_size=None) as ws:
            if uri == URI:
                await configure(ws, RATE)
            else:  # the interpreter's session, as the room page opens it: its defaults
                assert json.loads(await ws.recv())["type"] == "session.created"

            async def send() -> None:
                step = int(APPEND_S * RATE)
                audio = np.concatenate([samples, np.zeros(int(HOUR * RATE) // 60, np.float32)])
                for at in range(0, len(audio), step):
                    chunk = pcm(audio[at : at + step], RATE)
                    event = {"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}
                    await ws.send(json.dumps(event))
                    await asyncio.sleep(APPEND_S)

            sender = asyncio.create_task(send())
            if stop_after is None:
                while not await asyncio.to_thread(listening):
                    await asyncio.sleep(APPEND_S)
                stop()
            try:
                while True:
                    event = json.loads(await asyncio.wait_for(ws.recv(), 120))
                    events.append((event["type"], event.get("transcript")))
                    if event["type"] == stop_after and ("stop", None) not in events:
                        stop()
            except ConnectionClosed as closed:
                events.append(("close", f"{closed.rcvd.code} {closed.rcvd.reason}" if closed.rcvd else None))
            finally:
                sender.cancel()

    asyncio.run(run())
    assert daemon.proc.wait(300) == 0, daemon.log.read_text()[-2000:]
    logged = daemon.log.read_text()
    assert "ERROR" not in logged and "Traceback" not in logged, logged[-3000:]  # a goodbye is not a failure
    return events


def test_a_stop_closes_an_interpreter_session_that_only_listens_at_once(start_daemon, interpreter_bundle: Path) -> None:
    """The room page's session, sending silence: its two live sequences (the VAD's, Whisper's) held the
    stop for its whole grace time (measured with a grace of 60 s: closed after 60.3 s, now 0.004 s)."""
    daemon = start_daemon(bundle_dir=interpreter_bundle, shutdown_grace_s=HOUR)
    events = session_through_stop(
        daemon, np.zeros(RATE, np.float32), None, "ws://appliance/v1/realtime?model=interpreter"
    )
    assert events == [("stop", None), ("close", "1001 the box is stopping")], events


def test_a_turn_being_heard_at_the_stop_ends_with_its_transcript_then_the_close(
    start_daemon, voice_bundle: Path
) -> None:
    daemon = start_daemon(bundle_dir=voice_bundle, shutdown_grace_s=HOUR)
    samples, _ = recording([ENGLISH[0]], lead_s=0.5)
    events = session_through_stop(daemon, samples, "input_audio_buffer.speech_started")
    kinds = [kind for kind, _ in events]
    assert kinds.index("stop") < kinds.index(COMPLETED) < kinds.index("close"), events
    transcript = next(text for kind, text in events if kind == COMPLETED)
    assert wer(ENGLISH[0], str(transcript)) <= 0.25, transcript
    assert events[-1] == ("close", "1001 the box is stopping"), events


def wyoming_through_stop(daemon, samples: np.ndarray | None) -> list[tuple[str, object]]:  # type: ignore[no-untyped-def]
    """A Wyoming client on the Unix socket: with `samples`, a recording of them sent at the pace of
    speech, SIGTERM half a second in, the rest and audio-stop sent after it; without, SIGTERM once it was described. Every
    event it reads until the close: (type, its text or code), ("stop", None) where the signal went."""
    events: list[tuple[str, object]] = []

    def stop() -> None:
        events.append(("stop", None))
        daemon.proc.send_signal(signal.SIGTERM)

    async def run() -> None:
        async with AsyncUnixClient(str(daemon.socket.with_name("wyoming.sock"))) as client:
            await client.write_event(Describe().event())
            assert Info.is_type((await client.read_event()).type)
            if samples is None:
                stop()
            else:
                await client.write_event(Transcribe(name="whisper_tiny_en", language="en").event())
                await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
                step = RATE * 2 // 10
                pcm16 = pcm(samples, RATE)
                for at in range(0, len(pcm16), step):  # at the pace of speech, as a microphone sends it
                    chunk = AudioChunk(rate=RATE, width=2, channels=1, audio=pcm16[at : at + step])
                    await client.write_event(chunk.event())
                    await asyncio.sleep(APPEND_S)
                    if at == 5 * step:  # half a second in: the recording is under way on the box
                        stop()
                await client.write_event(AudioStop().event())
            while (event := await asyncio.wait_for(client.read_event(), 120)) is not None:
                if Transcript.is_type(event.type):
                    events.append((event.type, Transcript.from_event(event).text))
                else:
                    events.append((event.type, event.data.get("code")))

    asyncio.run(run())
    assert daemon.proc.wait(300) == 0, daemon.log.read_text()[-2000:]
    logged = daemon.log.read_text()
    assert "ERROR" not in logged and "Traceback" not in logged, logged[-3000:]  # a goodbye is not a failure
    return events


def test_a_stop_closes_an_idle_wyoming_connection_with_an_error_event(start_daemon, voice_bundle: Path) -> None:
    daemon = start_daemon(bundle_dir=voice_bundle, shutdown_grace_s=HOUR)
    assert wyoming_through_stop(daemon, None) == [("stop", None), ("error", "stopping")]


def test_a_wyoming_recording_under_way_at_the_stop_gets_its_transcript_first(start_daemon, voice_bundle: Path) -> None:
    daemon = start_daemon(bundle_dir=voice_bundle, shutdown_grace_s=HOUR)
    samples, _ = recording([ENGLISH[0]], lead_s=0.5)
    events = wyoming_through_stop(daemon, samples)
    kinds = [kind for kind, _ in events]
    assert kinds.index("stop") < kinds.index("transcript") < kinds.index("error"), events
    assert events[-1] == ("error", "stopping"), events
    assert wer(ENGLISH[0], str(next(text for kind, text in events if kind == "transcript"))) <= 0.25, events


def speak_held(daemon, client: Client, hold: Path, statuses: list[int]) -> threading.Thread:  # type: ignore[no-untyped-def]
    """A speech request under way, held in the engine (the hang failpoint's file `hold`) until the test
    removes it; its status goes to `statuses`."""
    hold.write_text("0")  # the engine's next call stalls until the file goes
    speak = lambda: statuses.append(client.send(speech_call("One sentence.", "tts-1", "joe")).status)  # noqa: E731
    under_way = threading.Thread(target=speak)
    under_way.start()
    wait_until(lambda: "held by the test's hang failpoint" in daemon.log.read_text(), "the engine held", log=daemon.log)
    return under_way


@pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])
def test_at_the_stop_quic_takes_no_new_connection_and_answers_the_open_one(
    start_daemon, tls, speech_bundle: Path, tmp_path: Path, workers: int
) -> None:
    """QUIC stops accepting at the stop as the stream listeners do (transport/listening.py's table,
    in the engine process or in each protocol worker): a client that connects once the stop began gets
    no handshake, while a request under way on a connection opened before it is answered (the speech
    engine, which runs off the event loop, held by the hang failpoint until the late client gave up),
    and the daemon exits 0."""
    hold = tmp_path / "hold"
    env = {HANG_FAILPOINT: str(hold)}
    daemon = start_daemon(bundle_dir=speech_bundle, tls=tls, workers=workers, shutdown_grace_s=HOUR, env=env)
    workers_stop = [rf"appliance worker {n}: INFO: stop signal" for n in range(workers)] if workers > 1 else []
    stopping = [r"stopping: [1-9]\d* requests in flight", *workers_stop]  # where QUIC is served, the stop began
    statuses: list[int] = []
    with daemon.client("quic") as early:
        assert early.health()["ready"]
        under_way = speak_held(daemon, early, hold, statuses)
        daemon.proc.send_signal(signal.SIGTERM)
        began = lambda: all(re.search(line, daemon.log.read_text()) for line in stopping)  # noqa: E731
        wait_until(began, "the stop began", log=daemon.log)
        late = Client(quic=f"127.0.0.1:{daemon.quic_port}", cafile=daemon.cafile, timeout=10, connect_timeout=5)
        with pytest.raises(ConnectError, match="QUIC"), late:
            late.health()
        hold.unlink()
        under_way.join(120)
    assert statuses == [200]
    assert daemon.proc.wait(60) == 0, daemon.log.read_text()[-2000:]


def test_a_stop_while_a_worker_still_starts_drains_what_the_started_one_serves(
    start_daemon, speech_bundle: Path, tmp_path: Path
) -> None:
    """Health is ready once one protocol worker serves; a stop that comes before the others have
    started is a stop of a serving daemon: the request that worker took is answered (it was abandoned
    with the start), and the daemon exits 0. Worker 1's start is held by a failpoint past the silence
    that marks a serving worker wedged (it was killed then, and the start failed); the engine holds the
    request until the stop has begun."""
    engine_hold, start_hold = tmp_path / "engine-hold", tmp_path / "start-hold"
    start_hold.touch()
    env = {HANG_FAILPOINT: str(engine_hold), START_HOLD_FAILPOINT: str(start_hold)}
    daemon = start_daemon(bundle_dir=speech_bundle, workers=2, shutdown_grace_s=HOUR, env=env, wait=False)
    wait_until(lambda: "start held by the test's failpoint" in daemon.log.read_text(), "worker 1 held", log=daemon.log)
    statuses: list[int] = []
    with daemon.client("unix") as early:  # the Unix socket: only a worker that started accepts on it
        wait_until(lambda: daemon.socket.exists() and early.health()["ready"], "ready on worker 0", log=daemon.log)
        under_way = speak_held(daemon, early, engine_hold, statuses)
        time.sleep(REPORT_STALE_S + 2)  # the subject: a worker still starting is not killed as wedged
        assert ": ready: serving " not in daemon.log.read_text()  # the start is not over
        daemon.proc.send_signal(signal.SIGTERM)
        began = lambda: re.search(r"stopping: 1 requests in flight", daemon.log.read_text())  # noqa: E731
        wait_until(began, "the stop began with the request in flight", log=daemon.log)
        engine_hold.unlink()
        under_way.join(120)
    assert statuses == [200], daemon.log.read_text()[-3000:]
    assert daemon.proc.wait(60) == 0, daemon.log.read_text()[-2000:]
    logged = daemon.log.read_text()
    assert "ERROR" not in logged and "Traceback" not in logged, logged[-3000:]

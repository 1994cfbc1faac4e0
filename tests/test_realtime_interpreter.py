"""The interpreter session of /v1/realtime (`?model=` the speech pipeline, `&target=` its language):
real espeak-ng speech streamed at real-time pace, each turn answered with the translated speech as
response.output_audio.delta chunks at the session's output rate, and its transcript events."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import Iterator

import numpy as np
import pytest
import soxr
from conftest import ROOT, Daemon, Keys, build_bundle
from speech import RATE, recording
from test_realtime import TURN_DETECTION, next_event, pcm
from test_speech_to_text import words
from websockets.asyncio.client import unix_connect

from appliance.audio import encode_wav
from appliance.client import Call
from appliance.client.http import checked

SENTENCES = ["The train leaves at three in the afternoon.", "My brother works at the hospital."]
KEY_WORDS = [{"afternoon"}, {"brother", "hospital"}]  # what Whisper base hears of espeak-ng reliably


@pytest.fixture(scope="module")
def daemon(keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    bundle = build_bundle(keys, tmp_path_factory.mktemp("fw") / "interp", spec=ROOT / "firmware" / "interpreter.toml")
    d = Daemon(tmp_path_factory.mktemp("daemon"), bundle, keys.trusted, workers=2).wait_ready(240)
    yield d
    assert d.stop() == 0, d.log.read_text()


def test_interpreter_session_speaks_each_turn(daemon: Daemon) -> None:
    samples, _ = recording(SENTENCES, gap_s=1.2, lead_s=0.5)
    audio = pcm(np.concatenate([samples, np.zeros(RATE, np.float32)]), 24000)

    async def run() -> list[dict]:
        uri = "ws://appliance/v1/realtime?model=interpreter&target=en"
        async with unix_connect(str(daemon.socket), uri, max_size=None) as ws:
            created = await next_event(ws, "session.created")
            assert created["session"]["type"] == "realtime", created
            session = {
                "type": "realtime",
                "audio": {
                    "input": {"turn_detection": TURN_DETECTION},
                    "output": {"format": {"type": "audio/pcm", "rate": 24000}},
                },
            }
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            await next_event(ws, "session.updated")
            events: list[dict] = []

            async def receive() -> None:
                while sum(e["type"] == "response.done" for e in events) < len(SENTENCES):
                    events.append(json.loads(await ws.recv()))

            receiver = asyncio.create_task(receive())
            step, began = 24000 * 2 // 10, time.monotonic()
            for index, offset in enumerate(range(0, len(audio), step)):
                piece = base64.b64encode(audio[offset : offset + step]).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece}))
                await asyncio.sleep(max(0.0, began + (index + 1) * 0.1 - time.monotonic()))
            try:
                await asyncio.wait_for(receiver, 120)
            except TimeoutError:
                raise AssertionError([(e["type"], e.get("error"), e.get("transcript")) for e in events]) from None
            return events

    events = asyncio.run(run())
    assert not [e for e in events if e["type"] == "error"], events
    for keys, done in zip(KEY_WORDS, [e for e in events if e["type"] == "response.done"], strict=True):
        rid = done["response"]["id"]
        spoken = b"".join(
            base64.b64decode(e["delta"])
            for e in events
            if e["type"] == "response.output_audio.delta" and e["response_id"] == rid
        )
        transcript = next(
            e for e in events if e["type"] == "response.output_audio_transcript.done" and e["response_id"] == rid
        )
        assert keys <= set(words(transcript["transcript"]).split()), transcript
        assert len(spoken) / 2 / 24000 > 1.0
        # what the voice said, heard back by the English Whisper (resampled to 16 kHz)
        heard_audio = soxr.resample(np.frombuffer(spoken, "<i2").astype(np.float32) / 32768, 24000, RATE)
        call = Call(
            "POST",
            "/v2/models/whisper_tiny_en/transcribe",
            encode_wav(heard_audio, RATE),
            (("content-type", "audio/wav"),),
        )
        with daemon.client() as client:
            heard = checked(client.send(call)).json()["text"]
        assert keys <= set(words(heard).split()), heard
    with daemon.client() as client:
        metrics = client.metrics()
    first = re.search(
        r'appliance_live_latency_seconds_count\{model="interpreter",protocol="realtime",until="first_audio"\} (\d+)',
        metrics,
    )
    total = re.search(
        r'appliance_live_latency_seconds_sum\{model="interpreter",protocol="realtime",until="first_audio"\} ([0-9.]+)',
        metrics,
    )
    assert first and total and int(first[1]) >= len(SENTENCES), metrics[-2000:]
    print(f"interpreter: end of sentence to first translated audio, mean {float(total[1]) / int(first[1]):.3f} s")

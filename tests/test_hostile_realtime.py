"""OpenAI's Realtime API under attack, on a real daemon serving the interpreter firmware, driven by a
`websockets` client on the Unix socket: JSON nested past the stack. Each attack gets OpenAI's `error`
event (never a close 1011 and a traceback in the log), and a good session is served after it."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Daemon
from speech import recording
from test_speech_to_text import CLEAR, wer
from websockets.asyncio.client import ClientConnection, unix_connect

from appliance.audio import to_pcm16

TINY = "whisper_tiny_en"
URI = "ws://appliance/v1/realtime?intent=transcription"
MANUAL = {"type": "transcription", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}
MANUAL["audio"]["input"] |= {"transcription": {"model": TINY, "language": "en"}, "turn_detection": None}


@pytest.fixture(scope="module")
def daemon(interpreter_bundle, keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon"), interpreter_bundle, keys.trusted).wait_ready(240)
    yield d
    assert d.stop() == 0, d.log.read_text()
    assert "Traceback" not in d.log.read_text(), d.log.read_text()[-3000:]


async def next_event(ws: ClientConnection, kind: str, timeout: float = 60.0) -> dict[str, Any]:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if event["type"] in (kind, "error"):
            return event


async def manual_turn(ws: ClientConnection, pcm: bytes) -> dict[str, Any]:
    """One turn committed by hand: the completed transcription, or the error the box answered with."""
    await ws.send(json.dumps({"type": "session.update", "session": MANUAL}))
    assert (await next_event(ws, "session.updated"))["type"] == "session.updated"
    for at in range(0, len(pcm), 32000):
        piece = base64.b64encode(pcm[at : at + 32000]).decode()
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece}))
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    return await next_event(ws, "conversation.item.input_audio_transcription.completed")


def good_session(daemon: Daemon) -> str:
    """A good client's session: one sentence committed by hand, its transcript."""
    samples, _ = recording(CLEAR[:1], gap_s=0.3, lead_s=0.3)

    async def run() -> dict[str, Any]:
        async with unix_connect(str(daemon.socket), URI) as ws:
            return await manual_turn(ws, to_pcm16(samples))

    completed = asyncio.run(run())
    assert completed["type"] != "error", completed
    return completed["transcript"]


def test_json_nested_past_the_stack_is_an_error_event_and_the_session_goes_on(daemon: Daemon) -> None:
    """A 100 KB message of nested lists (under the 1 MiB message bound) closed the session with 1011
    and wrote a traceback to the log every time (245 KB/s of log from one client). Each is one
    `error` event in OpenAI's shape, the session goes on, and the log has one `limit:` line per 10 s."""

    def logged() -> int:
        return sum("nests lists and objects deeper" in line for line in daemon.log.read_text().splitlines())

    before = logged()
    nested = ["[" * 100_000, '{"type": "session.update", "session": ' + '{"a": ' * 50_000]

    async def run() -> list[dict[str, Any]]:
        async with unix_connect(str(daemon.socket), URI) as ws:
            await next_event(ws, "session.created")
            errors = []
            for _ in range(10):
                for message in nested:
                    await ws.send(message)
                    errors.append(await next_event(ws, "error"))
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription"}}))
            assert (await next_event(ws, "session.updated"))["type"] == "session.updated"  # served on
            return errors

    errors = asyncio.run(run())
    assert len(errors) == 20
    for error in errors:
        assert error["type"] == "error" and error["event_id"].startswith("event_"), error
        detail = error["error"]
        assert detail["type"] == "invalid_request_error" and detail["code"] == "invalid_json", detail
        assert "nests lists and objects deeper" in detail["message"] and detail["param"] is None, detail
    assert logged() >= 1 and logged() - before <= 1  # none where an earlier line is under 10 s old
    assert wer(CLEAR[0], good_session(daemon)) <= 0.10

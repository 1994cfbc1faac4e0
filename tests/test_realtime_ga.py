"""/v1/realtime as OpenAI's GA clients use it, with the `openai` package's own realtime client
(`client.realtime.connect`) against a real daemon: G.711 μ-law and A-law in and out (encoded and
decoded here by Python's own audioop, not the box's codec), semantic_vad, `response.create` and
`response.cancel`, conversation items (text and audio, `.truncate`, `.delete`, `.retrieve`), barge-in.
The box's spoken answers are judged by an independent faster-whisper run (conftest's judge)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import openai
import pytest
import soxr
from conftest import Daemon
from faster_whisper import WhisperModel
from speech import RATE, recording
from tcp_forward import tcp_to_unix
from test_long_running import metrics, shards_run
from test_speech_to_text import CLEAR, wer, words
from waits import wait_until

with warnings.catch_warnings():  # deprecated since 3.11, gone in 3.13: here while the box runs 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

DELTA = "response.output_audio.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"
# seven sentences: the answer's voice (joe, a sentence an engine shard) runs well past its first delta
LONG = [
    "The morning train to the coast leaves from the second platform at half past seven.",
    "Please be early, because the station is busy on a Monday.",
    "A light rain is expected in the afternoon.",
    "An umbrella may be useful when you walk to the museum.",
    "The museum closes at six, and the shop closes a little earlier.",
    "There is a small cafe on the corner where you can wait.",
    "We will meet again at the hotel for dinner at eight.",
]
ENCODE = {"audio/pcmu": audioop.lin2ulaw, "audio/pcma": audioop.lin2alaw}
DECODE = {"audio/pcmu": audioop.ulaw2lin, "audio/pcma": audioop.alaw2lin}


def g711(samples: np.ndarray, law: str) -> bytes:
    """16 kHz float samples as 8 kHz G.711 bytes (audioop's encoder)."""
    narrow = soxr.resample(samples, RATE, 8000)
    return ENCODE[law](np.clip(np.round(narrow * 32768), -32768, 32767).astype("<i2").tobytes(), 2)


def pcm24(samples: np.ndarray) -> bytes:
    return np.clip(np.round(soxr.resample(samples, RATE, 24000) * 32768), -32768, 32767).astype("<i2").tobytes()


@contextlib.asynccontextmanager
async def realtime(daemon: Daemon, **query: str) -> AsyncIterator[Any]:
    """The openai package's realtime connection to the box (over a TCP bridge to its Unix socket)."""
    with tcp_to_unix(daemon.socket) as address:
        client = openai.AsyncOpenAI(api_key="on-box", base_url=f"http://{address}/v1", max_retries=0)
        model = query.pop("model", None)
        async with client.realtime.connect(model=model or "", extra_query=query) as connection:
            yield connection


async def until(connection: Any, done: Callable[[Any], bool], events: list[Any], timeout: float = 180) -> Any:
    """Read events into `events` until one satisfies `done`; that one."""
    async with asyncio.timeout(timeout):
        async for event in connection:
            events.append(event)
            if done(event):
                return event
    raise AssertionError(f"the connection closed: {[e.type for e in events]}")


async def append(connection: Any, audio: bytes, step: int, paced_s: float | None = None) -> None:
    """`audio` in appends of `step` bytes, each `paced_s` apart (real-time pace) or as fast as it goes."""
    began = time.monotonic()
    for index, offset in enumerate(range(0, len(audio), step)):
        await connection.input_audio_buffer.append(audio=base64.b64encode(audio[offset : offset + step]).decode())
        if paced_s is not None:
            await asyncio.sleep(max(0.0, began + (index + 1) * paced_s - time.monotonic()))


def judged(judge: WhisperModel, audio: bytes, law: str | None) -> str:
    """What an independent faster-whisper hears in the box's answer (PCM16 at 24 kHz, or G.711)."""
    pcm, rate = (DECODE[law](audio, 2), 8000) if law else (audio, 24000)
    samples = soxr.resample(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768, rate, RATE)
    segments, _ = judge.transcribe(samples, language="en", beam_size=5)
    return " ".join(s.text for s in segments)


@pytest.mark.parametrize("law", ["audio/pcmu", "audio/pcma"])
def test_g711_transcription_session_with_semantic_vad(voice_daemon: Daemon, law: str) -> None:
    """A telephony bridge's session: 8 kHz G.711 in 20 ms appends at real-time pace, semantic_vad's
    eagerness as the turns' silence; each sentence is one turn, its transcript the known text."""
    sentences = CLEAR[:2]
    samples, _ = recording(sentences, gap_s=1.5, lead_s=0.5)
    audio = g711(np.concatenate([samples, np.zeros(RATE, np.float32)]), law)

    async def run() -> tuple[Any, list[Any]]:
        events: list[Any] = []
        async with realtime(voice_daemon, intent="transcription") as connection:
            turn = {"type": "semantic_vad", "eagerness": "high"}
            session = {"type": "transcription", "audio": {"input": {"format": {"type": law}, "turn_detection": turn}}}
            await connection.session.update(session=session)
            updated = await until(connection, lambda e: e.type == "session.updated", events)
            sender = asyncio.create_task(append(connection, audio, 160, 0.02))
            await until(connection, lambda e: sum(x.type == COMPLETED for x in events) == 2, events)
            await sender
        return updated, events

    updated, events = asyncio.run(run())
    shown = updated.session.audio.input
    assert shown.format.type == law and shown.turn_detection.type == "semantic_vad", shown
    assert shown.turn_detection.eagerness == "high"
    assert [e.type for e in events].count("input_audio_buffer.speech_started") == 2
    transcripts = [e.transcript for e in events if e.type == COMPLETED]
    assert all(wer(s, t) <= 0.2 for s, t in zip(sentences, transcripts, strict=True)), transcripts


def test_g711_in_and_out_of_an_interpreter_turn(interpreter_daemon: Daemon, judge_base: WhisperModel) -> None:
    """A-law in, μ-law out: the answer's deltas decoded by audioop are the sentence, as the judge hears it."""
    samples, _ = recording([LONG[2]], gap_s=1.0, lead_s=0.5)
    audio = g711(np.concatenate([samples, np.zeros(RATE, np.float32)]), "audio/pcma")

    async def run() -> list[Any]:
        events: list[Any] = []
        async with realtime(interpreter_daemon, model="interpreter", target="en") as connection:
            formats = {"input": {"format": {"type": "audio/pcma"}}, "output": {"format": {"type": "audio/pcmu"}}}
            await connection.session.update(session={"type": "realtime", "audio": formats})
            await until(connection, lambda e: e.type == "session.updated", events)
            await append(connection, audio, 800, 0.1)
            await until(connection, lambda e: e.type == "response.done", events)
        return events

    events = asyncio.run(run())
    done = next(e for e in events if e.type == "response.done")
    assert done.response.status == "completed", done
    answer = b"".join(base64.b64decode(e.delta) for e in events if e.type == DELTA)
    heard = judged(judge_base, answer, "audio/pcmu")
    assert {"rain", "afternoon"} <= set(words(heard).split()), heard


def voice_idle(daemon: Daemon) -> bool:
    depth = [v for k, v in metrics(daemon).items() if k.startswith('appliance_queue_depth{model="joe"')]
    return depth == [0.0]


def test_response_cancel_mid_answer_stops_the_voice_and_its_engine_work(interpreter_daemon: Daemon) -> None:
    """A long user turn (21 sentences, as a text item: one segment), answered on response.create and
    cancelled at its first audio delta: response.done says cancelled (client_cancelled), no delta
    follows it, the voice's queue empties and it made fewer sentences than the answer has (it makes
    SHARDS_AHEAD ahead of the one being sent, no more)."""
    text = " ".join(LONG * 3)
    before = shards_run(interpreter_daemon)

    async def run() -> list[Any]:
        events: list[Any] = []
        async with realtime(interpreter_daemon, model="interpreter", target="en") as connection:
            part = {"type": "input_text", "text": text}
            await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [part]})
            await until(connection, lambda e: e.type == "conversation.item.done", events)
            await connection.response.create()
            await until(connection, lambda e: e.type == DELTA, events)
            await connection.response.cancel()
            await until(connection, lambda e: e.type == "response.done", events)
            await asyncio.to_thread(wait_until, lambda: voice_idle(interpreter_daemon), "the voice idle")
            item = next(e for e in events if e.type == "response.output_item.added").item.id
            await connection.conversation.item.retrieve(item_id=item)  # what comes before its answer is all
            await until(connection, lambda e: e.type == "conversation.item.retrieved", events)
        return events

    events = asyncio.run(run())
    kinds = [e.type for e in events]
    done = kinds.index("response.done")
    response = events[done].response
    assert response.status == "cancelled", [k for k in kinds if k != DELTA]
    assert response.status_details.reason == "client_cancelled", response
    assert DELTA not in kinds[done:], kinds[done:]
    assert kinds.count("response.created") == 1
    made = shards_run(interpreter_daemon) - before
    assert made < len(LONG) * 3, f"the voice made {made} sentences of {len(LONG) * 3} after the cancel"


def test_barge_in_cancels_the_answer_being_spoken(interpreter_daemon: Daemon) -> None:
    """interrupt_response on: speech heard while an answer is being sent cancels it (turn_detected);
    no delta of it follows, and the new turn is answered in full."""
    first, _ = recording([" ".join(LONG[:5])], gap_s=0.2, lead_s=0.3)
    second, _ = recording([CLEAR[3]], gap_s=1.0, lead_s=0.2)

    async def run() -> list[Any]:
        events: list[Any] = []
        async with realtime(interpreter_daemon, model="interpreter", target="en") as connection:
            turn = {"type": "server_vad", "silence_duration_ms": 700, "interrupt_response": True}
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": turn}}})
            await until(connection, lambda e: e.type == "session.updated", events)
            await append(connection, pcm24(np.concatenate([first, np.zeros(RATE, np.float32)])), 4800)
            await until(connection, lambda e: e.type == DELTA, events)
            await append(connection, pcm24(np.concatenate([second, np.zeros(RATE, np.float32)])), 4800)
            await until(connection, lambda e: sum(x.type == "response.done" for x in events) == 2, events)
        return events

    events = asyncio.run(run())
    kinds = [e.type for e in events]
    dones = [e for e in events if e.type == "response.done"]
    assert dones[0].response.status == "cancelled", dones[0].response
    assert dones[0].response.status_details.reason == "turn_detected"
    assert dones[1].response.status == "completed", dones[1].response
    cancelled_at = kinds.index("response.done")
    second_start = [i for i, k in enumerate(kinds) if k == "input_audio_buffer.speech_started"][1]
    assert second_start < cancelled_at
    first_response = dones[0].response.id
    assert not [e for e in events[cancelled_at:] if e.type == DELTA and e.response_id == first_response]
    said = dones[1].response.output[0].content[0].transcript
    assert {"going", "weekend"} <= set(words(said).split()), said


def test_conversation_items_text_audio_truncate_delete(interpreter_daemon: Daemon) -> None:
    """A text item and an audio item (PCM at 24 kHz, transcribed), each answered on response.create;
    the first answer truncated where the client says (its transcript dropped, past its audio an
    error); the audio item deleted (then unknown)."""
    spoken, _ = recording([CLEAR[2]], gap_s=0.5, lead_s=0.3)

    async def run() -> list[Any]:
        events: list[Any] = []
        async with realtime(interpreter_daemon, model="interpreter", target="en") as connection:
            await connection.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await until(connection, lambda e: e.type == "session.updated", events)
            text = {"type": "input_text", "text": CLEAR[4]}
            await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [text]})
            await until(connection, lambda e: e.type == "conversation.item.done", events)
            await connection.response.create()
            first = await until(connection, lambda e: e.type == "response.done", events)
            answer = first.response.output[0].id
            await connection.conversation.item.truncate(item_id=answer, content_index=0, audio_end_ms=300)
            await until(connection, lambda e: e.type == "conversation.item.truncated", events)
            await connection.conversation.item.truncate(item_id=answer, content_index=0, audio_end_ms=60_000)
            await until(connection, lambda e: e.type == "error", events)
            await connection.conversation.item.retrieve(item_id=answer)
            await until(connection, lambda e: e.type == "conversation.item.retrieved", events)
            audio = {"type": "input_audio", "audio": base64.b64encode(pcm24(spoken)).decode()}
            await connection.conversation.item.create(item={"type": "message", "role": "user", "content": [audio]})
            await until(connection, lambda e: e.type == COMPLETED, events)
            await connection.response.create()
            await until(connection, lambda e: e.type == "response.done", events)
            spoken_item = next(e for e in events if e.type == COMPLETED).item_id
            for _ in range(2):
                await connection.conversation.item.delete(item_id=spoken_item)
                await until(connection, lambda e: e.type in ("conversation.item.deleted", "error"), events)
        return events

    events = asyncio.run(run())
    dones = [e.response for e in events if e.type == "response.done"]
    assert [d.status for d in dones] == ["completed", "completed"], dones
    assert wer(CLEAR[4], dones[0].output[0].content[0].transcript) == 0.0, dones[0]
    assert wer(CLEAR[2], dones[1].output[0].content[0].transcript) <= 0.2, dones[1]
    truncated = next(e for e in events if e.type == "conversation.item.truncated")
    assert truncated.audio_end_ms == 300 and truncated.item_id == dones[0].output[0].id
    errors = [e.error for e in events if e.type == "error"]
    assert errors[0].param == "audio_end_ms", errors
    assert next(e for e in events if e.type == "conversation.item.retrieved").item.content[0].transcript == ""
    assert [e.type for e in events][-2:] == ["conversation.item.deleted", "error"]
    assert errors[1].code == "item_not_found", errors

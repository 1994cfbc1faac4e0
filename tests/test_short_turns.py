"""Short turns: a one-word answer ("Yes.", "No.", "Sim.": 224 ms of speech above the VAD's threshold when
said briskly) is a segment of the VAD's recording route and a turn of the Realtime API's live segmenter,
on a real daemon (the voice firmware), while silence, noise, hum, clicks, knocks, breaths and beeps
(tests/noise.py) give no segment at all. The judges: where espeak-ng said each line, and what Whisper
tiny.en heard in each turn against the known text."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from noise import recordings
from speech import RATE, say
from test_realtime import live_session
from test_speech_to_text import words

from appliance.audio import encode_wav
from appliance.client import Client

# (line, voice, words per minute): the answers said briskly, 224 ms above the threshold each (measured)
DIALOGUE = [
    ("Are you coming to dinner tonight?", "en", 175),
    ("Yes.", "en", 260),
    ("Is the kitchen light still on?", "en", 175),
    ("No.", "en", 220),
]
PORTUGUESE_ANSWER = ("Sim.", "pt", 260)
GAP_S, LEAD_S = 1.2, 0.5
OPENAI_TURNS = {"type": "server_vad"}  # OpenAI's defaults: threshold 0.5, 300 ms padding, 500 ms of silence


def spoken(lines: list[tuple[str, str, int]]) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """The lines with GAP_S of silence between them, and where each was said (seconds)."""
    parts, spans, at = [np.zeros(int(LEAD_S * RATE), np.float32)], [], LEAD_S
    for text, voice, pace in lines:
        voiced = say(text, voice, pace)
        spans.append((at, at + len(voiced) / RATE))
        parts += [voiced, np.zeros(int(GAP_S * RATE), np.float32)]
        at += len(voiced) / RATE + GAP_S
    return np.concatenate(parts), spans


def test_a_one_word_answer_is_a_segment(voice_daemon) -> None:
    lines = [*DIALOGUE, PORTUGUESE_ANSWER]
    samples, spans = spoken(lines)
    with Client(str(voice_daemon.socket)) as client:
        found = client.segments(encode_wav(samples, RATE))["segments"]
    assert len(found) == len(lines), (found, spans)
    for segment, (start, end) in zip(found, spans):
        assert segment["start"] <= start + 0.1 and segment["end"] >= end - 0.1, (segment, start, end)


@pytest.mark.parametrize("sounds", list(recordings()))
def test_noise_and_silence_are_no_segment(voice_daemon, sounds: str) -> None:
    with Client(str(voice_daemon.socket)) as client:
        assert client.segments(encode_wav(recordings()[sounds], RATE))["segments"] == []


async def live_turns(socket, samples: np.ndarray, turns: int) -> list[dict]:
    """The recording sent at real-time pace in 100 ms frames, OpenAI's turn detection; every event until
    `turns` turns completed."""
    return await live_session(socket, samples, 100, RATE, turns, OPENAI_TURNS)


def test_a_one_word_answer_is_a_realtime_turn(voice_daemon) -> None:
    samples, _ = spoken(DIALOGUE)
    events = asyncio.run(live_turns(voice_daemon.socket, samples, len(DIALOGUE)))
    completed = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    started = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    assert len(started) == len(completed) == len(DIALOGUE), [e["type"] for e in events]
    heard = [words(e["transcript"]) for e in completed]
    assert heard[1].split() == ["yes"] and heard[3].split() == ["no"], heard

"""Wyoming's voice activity (voice-started / voice-stopped) and its streamed transcript (transcript-start,
transcript-chunk while the speech still comes, transcript-stop), driven by the `wyoming` package's own
client against the interpreter daemon, with espeak-ng speech placed at known times between known
silences and sent at the pace of speech, as a satellite's microphone sends it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import Daemon
from speech import RATE, recording
from test_speech_to_text import CLEAR, wer, words
from test_wyoming import TINY, wyoming_socket
from wyoming.asr import Transcribe, Transcript, TranscriptChunk
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncUnixClient
from wyoming.event import Event
from wyoming.vad import VoiceStarted, VoiceStopped

from appliance.audio import to_pcm16
from appliance.bench.live import paced

TOLERANCE_S = 0.3


@pytest.fixture(scope="module")
def daemon(interpreter_daemon: Daemon) -> Daemon:
    return interpreter_daemon


async def stream(
    daemon: Daemon, samples: np.ndarray, real_time: bool = True, words_before_stop: int = 0
) -> list[tuple[Event, bool]]:
    """Every event up to the transcript, each with whether the client had sent audio-stop when it came
    (a reader of its own runs while the audio is sent: the order, not a clock). `words_before_stop`: a
    microphone that goes on hearing silence (up to 30 s of it) until the chunks hold that many words, so
    that a busy machine's slower decodes still come while the audio does."""
    async with AsyncUnixClient(wyoming_socket(daemon)) as client:
        stopped, events = False, []

        async def read() -> None:
            while (event := await asyncio.wait_for(client.read_event(), 120)) is not None:
                events.append((event, stopped))
                if Transcript.is_type(event.type):
                    return

        reader = asyncio.create_task(read())
        await client.write_event(Transcribe(name=TINY, language="en").event())
        await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())

        async def send(piece: bytes) -> None:
            await client.write_event(AudioChunk(rate=RATE, width=2, channels=1, audio=piece).event())

        step = RATE * 2 // 10  # 100 ms chunks
        await paced(send, to_pcm16(samples), step, 0.1 if real_time else 0.0)
        for _ in range(300):
            chunks = [TranscriptChunk.from_event(e).text for e, _ in events if TranscriptChunk.is_type(e.type)]
            if len("".join(chunks).split()) >= words_before_stop:
                break
            await paced(send, bytes(step), step, 0.1)
        stopped = True
        await client.write_event(AudioStop().event())
        await reader
        return events


def test_voice_started_and_stopped_where_the_speech_starts_and_ends(daemon: Daemon) -> None:
    """Two sentences with a short pause (shorter than the silence that ends a command) between 1 s and
    1.5 s of silence: one voice-started at the first's start, one voice-stopped at the second's end,
    within 0.3 s, in that order, before the transcript; the voice-stopped came before audio-stop."""
    samples, spans = recording([CLEAR[2], CLEAR[3]], gap_s=0.3, lead_s=1.0)
    samples = np.concatenate([samples[: int((spans[-1][1]) * RATE)], np.zeros(int(1.5 * RATE), np.float32)])
    events = asyncio.run(stream(daemon, samples))
    voice = [(e.type, e.data["timestamp"] / 1000, stopped) for e, stopped in events if e.type.startswith("voice-")]
    assert [kind for kind, _, _ in voice] == [VoiceStarted().event().type, VoiceStopped().event().type], voice
    (_, started, _), (_, ended, before_stop) = voice
    assert abs(started - spans[0][0]) <= TOLERANCE_S, (started, spans)
    assert abs(ended - spans[-1][1]) <= TOLERANCE_S, (ended, spans)
    assert not before_stop  # the box said so while the client was still sending silence


def test_a_recording_sent_at_once_gets_its_transcript_in_chunks_that_join_into_it(daemon: Daemon) -> None:
    """An upload, not a microphone: what the VAD heard before the recording ran ahead of the clock
    still gets its voice events (in pairs), and the transcript comes at the end in chunks."""
    samples, _ = recording([CLEAR[4]], gap_s=0.5, lead_s=0.5)
    events = asyncio.run(stream(daemon, samples, real_time=False))
    voice = [e.type for e, _ in events if e.type.startswith("voice-")]
    assert voice in ([], ["voice-started", "voice-stopped"]), voice
    chunks = [TranscriptChunk.from_event(e).text for e, _ in events if TranscriptChunk.is_type(e.type)]
    transcript = Transcript.from_event(events[-1][0]).text
    assert chunks and "".join(chunks) == transcript and wer(CLEAR[4], transcript) <= 0.2, (chunks, transcript)


def test_transcript_chunks_stream_while_the_speech_comes_and_join_into_the_transcripts_start(daemon: Daemon) -> None:
    """Three sentences spoken without a long pause: transcript chunks come before the client sends
    audio-stop, their words are the known text's first words, and every chunk joined is the transcript."""
    said = [CLEAR[1], CLEAR[0], CLEAR[5]]
    samples, _ = recording(said, gap_s=0.3, lead_s=0.5)
    events = asyncio.run(stream(daemon, samples, words_before_stop=3))
    types = [e.type for e, _ in events]
    assert types[-2:] == ["transcript-stop", "transcript"] and types.count("transcript-start") == 1, types
    assert types.index("transcript-start") < types.index("transcript-chunk")
    chunks = [(TranscriptChunk.from_event(e).text, stopped) for e, stopped in events if TranscriptChunk.is_type(e.type)]
    transcript = Transcript.from_event(events[-1][0]).text
    assert "".join(text for text, _ in chunks) == transcript
    early = "".join(text for text, stopped in chunks if not stopped)
    assert len(early.split()) >= 3, chunks  # words streamed while the speech still came
    known = words(" ".join(said)).split()
    assert wer(" ".join(known[: len(early.split())]), early) <= 0.25, (early, known)
    assert transcript.startswith(early)
    assert wer(said, transcript) <= 0.15, transcript

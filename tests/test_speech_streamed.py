"""`/v1/audio/speech` as wav and flac streams as pcm, mp3, opus and aac do (issue 47, item 9): the
header first (WAV's sizes 0xFFFFFFFF, FLAC's total 0: unknown, as OpenAI's streamed WAV), then each
sentence as the client reads, so a client that asks for 60,000 characters and reads nothing makes
the voice synthesize a bounded number of sentences. A real daemon, the `openai` client, libsndfile
and FFmpeg reading the answers, faster-whisper (from its package) judging the speech."""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx2
import numpy as np
import openai
import pytest
import soundfile
import soxr
from conftest import Daemon, Keys
from faster_whisper import WhisperModel
from test_long_running import (
    SENTENCES,
    held_bound_checked,
    metrics,
    shards_run,
    speech_body,
    stalled_shards,
    unix_request,
    warmed_rss,
)
from test_speech import av_decoded
from waits import wait_until

TEXT = " ".join(SENTENCES * 2)  # eight sentences: several pieces on the wire
FIRST_WORDS = ("train", "coast", "platform", "seven")  # SENTENCES[0]'s, for the judge
UNKNOWN = 0xFFFFFFFF


@pytest.fixture(scope="module")
def speech_daemon(tmp_path_factory: pytest.TempPathFactory, keys: Keys, speech_bundle: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("streamedd"), speech_bundle, keys.trusted).wait_ready(180)
    yield d
    assert d.stop() == 0, d.log.read_text()


@pytest.fixture(scope="module")
def openai_client(speech_daemon: Daemon) -> Iterator[openai.OpenAI]:
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(speech_daemon.socket)), timeout=300)
    yield openai.OpenAI(api_key="on-box", base_url="http://appliance/v1", http_client=http, max_retries=0)
    http.close()


def streamed(client: openai.OpenAI, text: str, audio_format: str) -> list[bytes]:
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="joe", input=text, response_format=audio_format
    ) as response:
        assert response.headers["content-type"] == f"audio/{'pcm' if audio_format == 'pcm' else audio_format}"
        return list(response.iter_bytes())


def test_the_openai_client_reads_wav_and_flac_as_they_stream(
    openai_client: openai.OpenAI, judge_tiny: WhisperModel
) -> None:
    """Eight sentences in each format: several pieces, not one body at the end; the WAV's header says
    "unknown" and libsndfile reads it to its end, FFmpeg decodes the FLAC; each is as long as the pcm
    answer of the same text (Piper's durations are drawn at random: within 5%), and an independent
    Whisper hears the first sentence in both."""
    pcm = len(b"".join(streamed(openai_client, TEXT, "pcm"))) // 2
    assert 20.0 < pcm / 22050 < 60.0, pcm
    wav_pieces = streamed(openai_client, TEXT, "wav")
    flac_pieces = streamed(openai_client, TEXT, "flac")
    assert len(wav_pieces) >= 2 and len(flac_pieces) >= 2, (len(wav_pieces), len(flac_pieces))
    wav = b"".join(wav_pieces)
    assert wav[:4] == b"RIFF" and struct.unpack("<I", wav[4:8])[0] == UNKNOWN
    assert wav[36:40] == b"data" and struct.unpack("<I", wav[40:44])[0] == UNKNOWN
    from_wav, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert rate == 22050 and len(from_wav) == (len(wav) - 44) // 2
    flac_samples, flac_rate, codec = av_decoded(b"".join(flac_pieces))  # FLAC's s16 samples as they are
    assert codec == "flac" and flac_rate == 22050
    for audio in (from_wav, flac_samples / 32768):
        assert abs(len(audio) - pcm) < 0.05 * pcm, (len(audio), pcm)
        first = soxr.resample(audio[: 8 * 22050], 22050, 16000).astype(np.float32)
        heard = " ".join(s.text for s in judge_tiny.transcribe(first, language="en", beam_size=5)[0]).lower()
        assert sum(word in heard for word in FIRST_WORDS) >= 3, heard


def test_wav_and_flac_readers_that_never_read_stop_the_synthesis(
    speech_daemon: Daemon, openai_client: openai.OpenAI
) -> None:
    """Two clients ask for 60,000 characters each, one as wav, one as flac, and read nothing: the voice
    runs a bounded number of sentences for them (800 asked), memory stays within the bound, a good
    client beside them gets its whole WAV, and the two leaving are counted as cancellations."""
    before_rss, before_shards = warmed_rss(speech_daemon, clients=2), shards_run(speech_daemon)
    attackers = [
        unix_request(speech_daemon.socket, "POST", "/v1/audio/speech", speech_body(audio_format=f))
        for f in ("wav", "flac")
    ]
    try:
        for sock in attackers:  # each answer begins: the status with its first sentence (where wav and
            sock.settimeout(120)  # flac are not streamed, once all 800 are synthesized, or never in 120 s)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "no answer began"
        stalled = stalled_shards(speech_daemon, answers=2)
        assert stalled - before_shards < 2 * 40, stalled - before_shards  # as the pcm slow reader's bound
        held_bound_checked(speech_daemon, before_rss)
        good = b"".join(streamed(openai_client, SENTENCES[0], "wav"))
        said, _ = soundfile.read(io.BytesIO(good), dtype="int16")
        assert len(said) > 22050, len(said)
        cancelled = metrics(speech_daemon)["appliance_requests_cancelled_total"]
    finally:
        for sock in attackers:
            sock.close()
    wait_until(lambda: metrics(speech_daemon)["appliance_requests_cancelled_total"] >= cancelled + 2, "both cancelled")
    assert shards_run(speech_daemon) - stalled < 2 * 40

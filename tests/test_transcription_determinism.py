"""The same recording gives the same transcription whatever ran before it (issue 45): Whisper's
temperature fallback samples, and its random generator was carried from every decode sampled before,
in any request (the same conversation came back with 9, 11, 13 or 15 segments on one daemon). Real
voice daemon, the real `openai` client; the box's answer to the same audio is held to itself."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx2
import numpy as np
import openai
import pytest
from conftest import Daemon
from conversations import SENTENCES
from speech import RATE, recording

from appliance.audio import encode_wav
from appliance.client import Client

TINY = "whisper_tiny_en"
CHUNK = 4096  # a live stream's chunk: 256 ms


@pytest.fixture(scope="module")
def openai_client(voice_daemon: Daemon) -> Iterator[openai.OpenAI]:
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(voice_daemon.socket)), timeout=600)
    yield openai.OpenAI(api_key="on-box", base_url="http://appliance/v1", http_client=http, max_retries=0)
    http.close()


def segments(client: openai.OpenAI, samples: np.ndarray, **options: str) -> list[tuple]:
    answer = client.audio.transcriptions.create(
        model=TINY, file=("talk.wav", encode_wav(samples, RATE)), response_format="verbose_json", **options
    )
    assert answer.segments, answer
    return [(s.start, s.end, s.text, s.temperature, tuple(s.tokens)) for s in answer.segments]


def live(daemon: Daemon, samples: np.ndarray) -> None:
    padded = np.concatenate([samples, np.zeros(-len(samples) % CHUNK, np.float32)])
    chunks = [padded[i : i + CHUNK] for i in range(0, len(padded), CHUNK)]
    with Client(str(daemon.socket), timeout=300) as client:
        for i, chunk in enumerate(chunks):
            client.live(chunk, TINY, "determinism", start=i == 0, end=i == len(chunks) - 1)


def test_a_recording_is_heard_alike_before_and_after_other_requests(
    voice_daemon: Daemon, openai_client: openai.OpenAI
) -> None:
    """Sentences said again and again (Whisper's loop test takes them for a loop: their decodes are
    sampled again at rising temperatures), then requests that sample too and others that do not (a short
    clip, Spanish translated by base, a live stream, two at once, among them the same recording), then
    the same recording: the same segments, text, temperatures and tokens each time."""
    # five times one sentence: both windows' greedy decodes loop (and stand sampled at 1.0 from the seed)
    looping = recording([SENTENCES[4]] * 5, gap_s=0.3)[0]
    first = segments(openai_client, looping)
    assert any(s[3] > 0 for s in first), first  # a decode was sampled: the path under test ran

    short = recording(["Turn off the lights in the kitchen please."])[0]
    spanish = recording(["Hola, me gusta mucho la música.", "Mi hermano tiene un coche rojo."], voice="es")[0]
    other_loop = recording([SENTENCES[4]] * 3, gap_s=0.3)[0]  # its one window is sampled too, at 0.2
    segments(openai_client, short)
    assert any(s[3] > 0 for s in segments(openai_client, other_loop, language="en"))
    openai_client.audio.translations.create(model="whisper_base", file=("es.wav", encode_wav(spanish, RATE)))
    live(voice_daemon, short)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # batched together
        together = list(pool.map(lambda samples: segments(openai_client, samples), [looping, short]))

    assert together[0] == first
    assert segments(openai_client, looping) == first

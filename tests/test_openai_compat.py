"""OpenAI's clients with their defaults, against the voice firmware (VAD + Whisper tiny.en and base):
uploads as phones and browsers make them (MP3, M4A, WebM, encoded here with FFmpeg's encoders through
PyAV), OpenAI's model names and list, word timestamps on known sentences, subtitles of a long recording,
the extra form fields OpenAI's SDK sends, and every error in OpenAI's shape (a 413 too)."""

from __future__ import annotations

import asyncio
import io
import json
import re
import socket
import subprocess

import av
import numpy as np
import openai
import pytest
import soxr
import tritonclient.http.aio as aioclient
from conftest import APPLIANCE, ROOT
from speech import RATE, recording, say
from tcp_forward import tcp_to_unix
from test_speech_to_text import BASE, CLEAR, ENGLISH, TINY, daemon, openai_client, unix, wer, words

from appliance.audio import encode_wav
from appliance.client import Client, ServerError

__all__ = ["daemon", "openai_client", "unix"]  # the voice daemon's fixtures (the session's voice daemon)


def encoded(samples: np.ndarray, muxer: str, codec: str, rate: int) -> bytes:
    """16 kHz float samples as FFmpeg writes them (PyAV's encoders; the box's decoder is the judge's peer)."""
    out = io.BytesIO()
    with av.open(out, "w", format=muxer) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = "mono"
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=rate)
        frame = av.AudioFrame.from_ndarray(samples.astype(np.float32)[None, :], format="flt", layout="mono")
        frame.rate = RATE
        for piece in resampler.resample(frame) + resampler.resample(None):
            container.mux(stream.encode(piece))
        container.mux(stream.encode(None))
    return out.getvalue()


def successes(client: Client, model: str) -> int:
    return client.get(f"/v2/models/{model}/stats")["model_stats"][0]["inference_stats"]["success"]["count"]


@pytest.mark.parametrize(
    "name,muxer,codec,rate",
    [("e.mp3", "mp3", "libmp3lame", 44100), ("e.m4a", "ipod", "aac", 44100), ("e.webm", "webm", "libopus", 48000)],
)
def test_uploads_as_phones_and_browsers_make_them(
    openai_client: openai.OpenAI, name: str, muxer: str, codec: str, rate: int
) -> None:
    spoken = recording(CLEAR[:3])[0]
    body = encoded(spoken, muxer, codec, rate)
    text = openai_client.audio.transcriptions.create(model=TINY, file=(name, body)).text
    assert wer(CLEAR[:3], text) <= 0.1, text


def test_a_cut_webm_or_an_unaccepted_container_is_a_one_line_400(openai_client: openai.OpenAI) -> None:
    aiff = encoded(say(CLEAR[0]), "aiff", "pcm_s16be", RATE)
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.audio.transcriptions.create(model=TINY, file=("e.aiff", aiff))
    assert caught.value.body["message"].startswith("audio not supported: AIFF (Apple/SGI) is not an accepted container")
    cut = encoded(say(CLEAR[0]), "webm", "libopus", 48000)[:300]  # a WebM cut inside its first cluster
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.audio.transcriptions.create(model=TINY, file=("e.webm", cut))
    message = caught.value.body["message"]
    assert message.startswith("audio not supported: Format not recognised; send WAV") and "\n" not in message


def test_openai_names_pick_the_best_served_model_and_models_list(openai_client: openai.OpenAI, unix: Client) -> None:
    listed = {m.id for m in openai_client.models.list()}
    assert {TINY, BASE, "whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe"} <= listed
    assert openai_client.models.retrieve("whisper-1").object == "model"
    portuguese = encode_wav(say("Bom dia, como você está hoje?", "pt"), RATE)
    before = successes(unix, BASE)
    answer = openai_client.audio.transcriptions.create(model="whisper-1", file=("pt.wav", portuguese), language="pt")
    assert "dia" in answer.text.lower() and successes(unix, BASE) == before + 1  # multilingual base served it
    english = encode_wav(say(CLEAR[0]), RATE)
    openai_client.audio.transcriptions.create(model="gpt-4o-mini-transcribe", file=("e.wav", english))
    assert successes(unix, BASE) == before + 2  # no language given: a model that detects it
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client.audio.transcriptions.create(model="whisper-large-v3", file=("e.wav", english))
    assert caught.value.body["message"] == (
        f"The model 'whisper-large-v3' does not exist (speech_to_text models served: {TINY}, {BASE})"
    )
    assert caught.value.body["param"] == "model" and caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("whisper-large-v3")


def test_word_timestamps_on_known_sentences(openai_client: openai.OpenAI) -> None:
    sentences = CLEAR[:2]
    spoken, spans = recording(sentences, gap_s=2.0)
    answer = openai_client.audio.transcriptions.create(
        model=TINY,
        file=("e.wav", encode_wav(spoken, RATE)),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
        chunking_strategy="auto",
        include=["logprobs"],
    )
    found = answer.words or []
    assert wer(sentences, " ".join(w.word for w in found)) <= 0.1, found
    starts = [w.start for w in found]
    assert starts == sorted(starts) and all(w.start <= w.end for w in found)
    segments = answer.segments or []
    for word in found:  # each word inside a segment
        assert any(s.start <= word.start and word.end <= s.end for s in segments), (word, segments)
    raw = answer.model_dump()["words"]
    assert all(0.0 < w["probability"] <= 1.0 for w in raw)
    # the first words of each sentence where espeak spoke them (within Whisper's 20 ms steps, give or take)
    for (start, end), sentence in zip(spans, sentences):
        first = words(sentence).split()[0]
        heard = [w for w in found if words(w.word) == first and start - 0.5 <= w.start <= end]
        assert heard and heard[0].start == pytest.approx(start, abs=0.5), (first, start, found)
    only = openai_client.audio.transcriptions.create(
        model=TINY, file=("e.wav", encode_wav(spoken, RATE)), response_format="verbose_json",
        timestamp_granularities=["word"],
    )  # fmt: skip
    assert only.words and not only.segments


def test_word_timestamps_in_the_stream(openai_client: openai.OpenAI) -> None:
    spoken = recording(CLEAR[:2], gap_s=2.0)[0]
    events = list(
        openai_client.audio.transcriptions.create(
            model=TINY, file=("e.wav", encode_wav(spoken, RATE)), stream=True, timestamp_granularities=["word"]
        )
    )
    deltas = [e.model_dump() for e in events[:-1]]
    assert deltas and all(d["words"] for d in deltas)
    done = events[-1].model_dump()
    assert done["type"] == "transcript.text.done" and done["words"] == [w for d in deltas for w in d["words"]]


def test_subtitles_of_a_long_recording_are_cues_of_at_most_7_s_and_two_lines(openai_client: openai.OpenAI) -> None:
    spoken, spans = recording(ENGLISH * 2, gap_s=0.8)
    srt = openai_client.audio.transcriptions.create(
        model=TINY, file=("e.wav", encode_wav(spoken, RATE)), response_format="srt"
    )
    cues = [c for c in srt.strip().split("\n\n") if c]
    assert len(cues) >= len(spans) // 2
    times = []
    for number, cue in enumerate(cues, 1):
        lines = cue.split("\n")
        assert lines[0] == str(number) and 1 <= len(lines[2:]) <= 2, cue
        start, end = [_seconds(t) for t in lines[1].split(" --> ")]
        assert 0 < end - start <= 7.0, cue
        times.append((start, end))
    assert all(a[1] <= b[0] for a, b in zip(times, times[1:]))  # in order, never overlapping
    gaps = [(a[1], b[0]) for a, b in zip(spans, spans[1:])]
    for start, end in times:  # never one cue across a silence between two sentences
        assert not any(start < g0 - 0.3 and g1 + 0.3 < end for g0, g1 in gaps), (start, end)


def test_a_long_sentence_without_a_pause_is_cut_into_cues_of_at_most_7_s(openai_client: openai.OpenAI) -> None:
    run_on = " and ".join(words(s) for s in ENGLISH[6:12])  # about 15 s of speech, no sentence end
    spoken = recording([run_on])[0]
    vtt = openai_client.audio.transcriptions.create(
        model=TINY, file=("e.wav", encode_wav(spoken, RATE)), response_format="vtt"
    )
    cues = vtt.removeprefix("WEBVTT\n\n").strip().split("\n\n")
    lengths = [_seconds(end) - _seconds(start) for start, end in (c.split("\n")[0].split(" --> ") for c in cues)]
    assert len(spoken) / RATE > 12 and len(cues) >= 2 and max(lengths) <= 7.0, vtt
    assert all(len(c.split("\n")[1:]) <= 2 for c in cues), vtt


def _seconds(clock: str) -> float:
    h, m, s = clock.replace(",", ".").split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def test_errors_are_in_openais_shape_even_a_413(daemon, openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.audio.transcriptions.create(
            model=TINY, file=("e.wav", encode_wav(say(CLEAR[0]), RATE)), chunking_strategy="sometimes"
        )
    assert caught.value.body["param"] == "chunking_strategy" and set(caught.value.body) == {
        "message", "type", "param", "code"
    }  # fmt: skip
    with pytest.raises(openai.BadRequestError) as caught:  # nested past any JSON parser's recursion: still a 400
        openai_client.audio.transcriptions.create(
            model=TINY, file=("e.wav", encode_wav(say(CLEAR[0]), RATE)), chunking_strategy="[" * 3000
        )
    assert caught.value.body["param"] == "chunking_strategy"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(daemon.socket))
        s.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999\r\n\r\n")
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert re.fullmatch(r"body of 99999999999 bytes exceeds the limit of \d+ bytes", error["message"])


def test_statistics_count_every_routes_inferences(daemon, unix: Client, openai_client: openai.OpenAI) -> None:
    """Segments, transcribe, OpenAI and KServe calls all count as successes or failures, with the engine
    time they took, as Triton's statistics extension says (read with tritonclient.http.aio, which asks for gzip and reads plain)."""
    before = asyncio.run(_statistics(daemon))
    wav = encode_wav(say(CLEAR[0]), RATE)
    unix.segments(wav)
    assert unix.transcribe(wav, TINY).status == 200
    openai_client.audio.transcriptions.create(model=TINY, file=("e.wav", wav))
    mid = asyncio.run(_statistics(daemon))  # the transcriptions' engine time is theirs (it was 0 ns)
    assert mid[TINY]["compute_infer_ns"] > before[TINY]["compute_infer_ns"], (before[TINY], mid[TINY])
    unix.infer(TINY, {"audio": np.array([wav], dtype=object)})
    with pytest.raises(ServerError, match="audio not supported"):
        unix.transcribe(b"not audio at all" * 64, TINY)
    after = asyncio.run(_statistics(daemon))
    tiny, vad = after[TINY], after["silero_vad"]
    assert tiny["success"] == before[TINY]["success"] + 3 and tiny["fail"] == before[TINY]["fail"] + 1
    assert vad["success"] == before["silero_vad"]["success"] + 4  # its own route, and each transcription's cut
    assert tiny["last_inference"] > 0 and vad["last_inference"] >= tiny["last_inference"] - 60_000
    assert vad["inference_count"] > before["silero_vad"]["inference_count"]


async def _statistics(daemon) -> dict[str, dict[str, int]]:
    with tcp_to_unix(daemon.socket) as url:
        client = aioclient.InferenceServerClient(url)
        try:
            stats = await client.get_inference_statistics()
        finally:
            await client.close()
    return {
        s["name"]: {
            "success": s["inference_stats"]["success"]["count"],
            "fail": s["inference_stats"]["fail"]["count"],
            "last_inference": s["last_inference"],
            "inference_count": s["inference_count"],
            "compute_infer_ns": s["inference_stats"]["compute_infer"]["ns"],
        }
        for s in stats["model_stats"]
    }


@pytest.mark.parametrize("framing", ["wav", "pcm"])
def test_cli_live_reads_standard_input(daemon, framing: str) -> None:
    """`arecord -f S16_LE -r 16000 -c 1 | appliance call live -`: raw PCM16, or a WAV (here 44.1 kHz
    stereo with a streaming header, as arecord's default writes), piped in; each segment printed."""
    spoken = recording(CLEAR[:2], gap_s=1.5)[0]
    if framing == "pcm":
        data = np.clip(np.round(spoken * 32767), -32768, 32767).astype("<i2").tobytes()
    else:
        stereo = np.repeat(soxr.resample(spoken, RATE, 44100)[:, None], 2, axis=1)
        pcm = np.clip(np.round(stereo * 32767), -32768, 32767).astype("<i2").tobytes()
        header = bytearray(encode_wav(np.zeros(0, np.float32), RATE))
        header[4:8] = header[40:44] = b"\xff\xff\xff\x7f"  # "length unknown", as a pipe's writer says
        header[22:24], header[24:28] = (2).to_bytes(2, "little"), (44100).to_bytes(4, "little")
        header[28:32], header[32:34] = (44100 * 4).to_bytes(4, "little"), (4).to_bytes(2, "little")
        data = bytes(header) + pcm
    result = subprocess.run(
        [*APPLIANCE, "call", "live", "-", "--socket", str(daemon.socket), "--model", TINY],
        input=data, capture_output=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert len(lines) >= 2 and all(re.match(r"\[ *\d+\.\d\d -> *\d+\.\d\d\] ", line) for line in lines), lines
    assert wer(CLEAR[:2], " ".join(line.split("] ", 1)[1] for line in lines)) <= 0.1, lines


def test_the_transcribe_route_gives_words_too(unix: Client) -> None:
    doc = unix.transcribe(encode_wav(say(CLEAR[0]), RATE), TINY, words="true").json()
    assert wer(CLEAR[0], " ".join(w["word"] for w in doc["words"])) <= 0.1 and doc["segments"]
    lines = list(unix.stream_transcribe(encode_wav(say(CLEAR[0]), RATE), TINY, words="true"))
    assert [w["word"] for w in lines[0]["words"]] == [w["word"] for w in doc["words"]]

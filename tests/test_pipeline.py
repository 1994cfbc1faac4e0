"""Speech in, translated speech out: the interpreter firmware (VAD, Whisper, Bergamot pairs, the Piper voice
and the pipeline over them) on a real daemon; the box's speech judged from outside the box: faster-whisper
(its own features, decoding and VAD-free pass) on the firmware's Whisper tiny.en directory."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import jiwer
import numpy as np
import pytest
import soundfile
import soxr
from conftest import ROOT, Daemon, Keys, cli
from faster_whisper import WhisperModel
from speech import RATE, say

from appliance.audio import encode_wav
from appliance.client import Call, Client

SPEC = ROOT / "firmware" / "interpreter.toml"
CHUNK = 4096  # 256 ms at 16 kHz
ENGLISH = ["The train leaves at three in the afternoon.", "My brother works at the hospital."]
KEY_WORDS = ["train", "afternoon", "brother", "hospital"]
SPOKEN = [  # sentences the voice says, for the word error rate
    "The weather will be sunny tomorrow morning.",
    "We visited the museum last weekend and saw many paintings.",
    "Please turn off the lights when you leave the room.",
    "She reads a book every night before going to sleep.",
]


@pytest.fixture(scope="module")
def interpreter(keys: Keys, tmp_path_factory: pytest.TempPathFactory, tls):
    work = tmp_path_factory.mktemp("interpreter")
    cli("firmware", "build", SPEC, "--key", keys.private, "--out", work / "bundle")
    d = Daemon(work, work / "bundle", keys.trusted, tls=tls).wait_ready(180)
    yield d
    assert d.stop() == 0, d.log.read_text()


@pytest.fixture(scope="module", params=["unix", "quic"])
def client(request: pytest.FixtureRequest, interpreter: Daemon):
    with interpreter.client(request.param) as c:
        yield c


@pytest.fixture(scope="module")
def listener(interpreter: Daemon) -> WhisperModel:
    """The judge: faster-whisper, not the box, on the CTranslate2 model the firmware carries."""
    bundle = Path(re.search(r'bundle = "([^"]+)"', interpreter.config.read_text())[1])
    return WhisperModel(str(bundle / "models" / "whisper_tiny_en"), device="cpu", compute_type="int8", cpu_threads=2)


def recording(sentences: list[str], gap_s: float = 1.0) -> np.ndarray:
    """espeak-ng speech at 16 kHz, a pause after each sentence."""
    gap = np.zeros(int(gap_s * RATE), np.float32)
    return np.concatenate([gap, *(np.concatenate([say(s), gap]) for s in sentences)])


def heard(listener: WhisperModel, audio: np.ndarray, rate: int) -> str:
    """What faster-whisper hears in INT16 audio at `rate`."""
    samples = soxr.resample(audio.astype(np.float32) / 32768, rate, RATE).astype(np.float32)
    segments, _ = listener.transcribe(samples, language="en", beam_size=5)
    return " ".join(s.text for s in segments)


def words(text: str) -> str:
    return re.sub(r"[^a-z' ]", " ", text.lower())


def test_the_voice_is_understood(client: Client, listener: WhisperModel) -> None:
    """The box's speech, resampled and transcribed by faster-whisper: at most 10% word errors."""
    said = [heard(listener, *_samples(client.speech(s, voice="joe"))) for s in SPOKEN]
    error = jiwer.wer([words(s) for s in SPOKEN], [words(s) for s in said])
    assert error <= 0.10, (error, said)


def _samples(wav: bytes) -> tuple[np.ndarray, int]:
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    return audio, rate


def test_a_recording_comes_back_as_english_speech(client: Client, listener: WhisperModel) -> None:
    lines = list(client.stream_interpret(encode_wav(recording(ENGLISH), RATE), "interpreter"))
    *segments, summary = lines
    assert summary["done"] and summary["segments"] == len(segments) >= 1
    assert all(s["text"] and s["source_text"] and s["sample_rate"] == 22050 for s in segments)
    audio = np.frombuffer(b"".join(base64.b64decode(s["audio"]) for s in segments), "<i2")
    said = words(heard(listener, audio, 22050))
    assert sum(w in said for w in KEY_WORDS) >= 3, said
    # the caller names the language: Whisper transcribes it (no translation needed for an English target)
    *segments, _ = client.stream_interpret(encode_wav(recording(ENGLISH), RATE), "interpreter", "en", "en")
    texts = words(" ".join(s["text"] for s in segments))
    assert all(s["language"] == "en" for s in segments) and sum(w in texts for w in KEY_WORDS) >= 3, texts


def test_kserve_recording_and_live_stream(client: Client) -> None:
    audio = recording(ENGLISH)
    whole = client.infer("interpreter", {"audio": audio})
    assert len(whole["text"]) >= 1 and len(whole["audio"]) > 22050 and len(whole["start"]) == len(whole["text"])
    audio = np.concatenate([audio, np.zeros(-len(audio) % CHUNK, np.float32)])
    chunks = [audio[i : i + CHUNK] for i in range(0, len(audio), CHUNK)]
    first_audio_at, texts = None, []
    for i, chunk in enumerate(chunks):
        out = client.infer(
            "interpreter", {"audio": chunk}, sequence_id="live-1", start=i == 0, end=i == len(chunks) - 1
        )
        texts += [t.decode() for t in out["text"]]
        if len(out["audio"]) and first_audio_at is None:
            first_audio_at = i
    assert first_audio_at is not None and first_audio_at < len(chunks) - 1  # speech back before the input ended
    said = words(" ".join(texts))
    assert sum(w in said for w in KEY_WORDS) >= 3, texts


def test_bad_input(client: Client) -> None:
    wav = encode_wav(recording(ENGLISH[:1]), RATE)
    for target, status, says in (("pt", 400, "no voice speaks 'pt'"), ("xx", 400, "no voice")):
        response = client.send(Call("POST", f"/v2/models/interpreter/interpret?to={target}", wav))
        assert response.status == status and says in response.json()["error"]
    response = client.send(Call("POST", "/v2/models/interpreter/interpret?from=en&to=en&speed=2", wav))
    assert response.status == 400 and "unknown query parameter 'speed'" in response.json()["error"]
    response = client.send(Call("POST", "/v2/models/interpreter/interpret", b"not audio at all"))
    assert response.status == 400 and "\n" not in response.json()["error"]
    assert client.translate("Thank you.", "en", "pt").lower().startswith("obrigad")  # still serving


def test_cli_interpret(interpreter: Daemon, tmp_path: Path) -> None:
    source = tmp_path / "in.wav"
    source.write_bytes(encode_wav(recording(ENGLISH), RATE))
    result = cli("call", "interpret", source, "-o", tmp_path / "out.wav", "--socket", interpreter.socket)
    assert "hospital" in result.stdout.lower()
    with soundfile.SoundFile(tmp_path / "out.wav") as out:
        assert out.samplerate == 22050 and out.frames > 22050

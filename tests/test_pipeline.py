"""Speech in, translated speech out: the interpreter firmware (VAD, Whisper, Bergamot pairs, the Piper voice,
the Kokoro Portuguese voices, language identification and the pipeline over them) on a real daemon; the
box's speech judged from outside the box: faster-whisper (its own features, decoding and VAD-free pass) on
Whisper tiny.en and base from their packages' own files (not the firmware under test); Portuguese and Spanish test speech from Kokoro run
outside the box (tests/kokoro.py)."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
from pathlib import Path

import jiwer
import numpy as np
import pytest
import soundfile
import soxr
from conftest import APPLIANCE, ROOT, Daemon, Keys, cli, movable_spec
from faster_whisper import WhisperModel
from kokoro import Kokoro
from speech import RATE, say

from appliance.audio import encode_wav
from appliance.client import Call, Client
from appliance.client.http import checked

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
def interpreter(interpreter_daemon: Daemon) -> Daemon:
    return interpreter_daemon


@pytest.fixture(scope="module", params=["unix", "quic"])
def client(request: pytest.FixtureRequest, interpreter: Daemon):
    with interpreter.client(request.param) as c:
        yield c


@pytest.fixture(scope="module")
def unix(interpreter: Daemon):
    """The pipeline's speech tests run over the Unix socket: their subject is the pipeline, and each
    route's contract over both transports is checked with `client`."""
    with interpreter.client() as c:
        yield c


@pytest.fixture(scope="module")
def listener(judge_tiny: WhisperModel) -> WhisperModel:
    """The judge: faster-whisper, not the box, on tiny.en from its package's own files."""
    return judge_tiny


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


def test_the_voice_is_understood(unix: Client, listener: WhisperModel) -> None:
    """The box's speech, resampled and transcribed by faster-whisper: at most 10% word errors."""
    said = [heard(listener, *_samples(unix.speech(s, voice="joe"))) for s in SPOKEN]
    error = jiwer.wer([words(s) for s in SPOKEN], [words(s) for s in said])
    assert error <= 0.10, (error, said)


def _samples(wav: bytes) -> tuple[np.ndarray, int]:
    audio, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    return audio, rate


def test_a_recording_comes_back_as_english_speech(unix: Client, listener: WhisperModel) -> None:
    lines = list(unix.stream_interpret(encode_wav(recording(ENGLISH), RATE), "interpreter", "en"))
    *segments, summary = lines
    assert summary["done"] and summary["segments"] == len(segments) >= 1
    assert all(s["text"] and s["source_text"] and s["sample_rate"] == 22050 for s in segments)
    audio = np.frombuffer(b"".join(base64.b64decode(s["audio"]) for s in segments), "<i2")
    said = words(heard(listener, audio, 22050))
    assert sum(w in said for w in KEY_WORDS) >= 3, said
    # the caller names the language: Whisper transcribes it (no translation needed for an English target)
    *segments, _ = unix.stream_interpret(encode_wav(recording(ENGLISH), RATE), "interpreter", "en", "en")
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
    for target, status, says in (("de", 400, "no voice speaks 'de' (targets: en, pt)"), ("xx", 400, "no voice")):
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
    result = cli("call", "interpret", source, "-o", tmp_path / "out.wav", "--to", "en", "--socket", interpreter.socket)
    assert "hospital" in result.stdout.lower()
    assert re.search(r"\(en (0\.[5-9]\d|1\.00)\)", result.stdout), result.stdout  # Whisper's language, its probability
    with soundfile.SoundFile(tmp_path / "out.wav") as out:
        assert out.samplerate == 22050 and out.frames > 22050


PORTUGUESE = ["O trem sai às três da tarde.", "Meu irmão trabalha no hospital."]
SPANISH = ["El tren sale a las tres de la tarde.", "Mi hermano trabaja en el hospital."]


@pytest.fixture(scope="module")
def kokoro(tmp_path_factory: pytest.TempPathFactory) -> Kokoro:
    return Kokoro(tmp_path_factory.mktemp("kokoro"))


@pytest.fixture(scope="module")
def whisper(judge_base: WhisperModel) -> WhisperModel:
    """faster-whisper on Whisper base from its packages' own files: a run of its own, told the language."""
    return judge_base


def spoken_by(kokoro: Kokoro, sentences: list[str], voice: str) -> bytes:
    gap = np.zeros(RATE, np.float32)
    return encode_wav(
        np.concatenate([gap, *(np.concatenate([kokoro.speech16k(s, voice), gap]) for s in sentences)]), RATE
    )


def transcribed(whisper: WhisperModel, segments: list[dict], language: str) -> str:
    audio = np.frombuffer(b"".join(base64.b64decode(s["audio"]) for s in segments), "<i2").astype(np.float32)
    rate = segments[0]["sample_rate"]
    heard, _ = whisper.transcribe(soxr.resample(audio / 32768, rate, RATE), language=language, beam_size=5)
    return " ".join(s.text for s in heard).lower()


def test_english_speech_answers_portuguese_speech(unix: Client, whisper: WhisperModel) -> None:
    *segments, summary = unix.stream_interpret(encode_wav(recording(ENGLISH), RATE), "interpreter", "pt")
    assert summary["done"] and segments and all(s["sample_rate"] == 24000 for s in segments)
    assert all(s["language"] == "en" and s["language_probability"] > 0.5 and "note" not in s for s in segments)
    text = " ".join(s["text"] for s in segments).lower()
    assert sum(w in text for w in ("trem", "tarde", "irmão", "hospital")) >= 3, text
    heard = transcribed(whisper, segments, "pt")  # the Portuguese speech, by an independent Whisper
    assert sum(w in heard for w in ("trem", "tarde", "irmão", "hospital")) >= 3, heard


@pytest.mark.parametrize(
    ("sentences", "voice", "language"), [(PORTUGUESE, "pm_alex", "pt"), (SPANISH, "ef_dora", "es")]
)
def test_portuguese_and_spanish_speech_answer_english_speech(
    unix: Client, kokoro: Kokoro, whisper: WhisperModel, sentences: list[str], voice: str, language: str
) -> None:
    *segments, summary = unix.stream_interpret(spoken_by(kokoro, sentences, voice), "interpreter", "en")
    assert summary["done"] and segments and all(s["sample_rate"] == 22050 for s in segments)
    assert all(s["language"] == language for s in segments), segments
    text = words(" ".join(s["text"] for s in segments))
    assert sum(w in text for w in KEY_WORDS) >= 3, text
    heard = words(transcribed(whisper, segments, "en"))
    assert sum(w in heard for w in KEY_WORDS) >= 3, heard


def test_the_config_lists_each_target_with_its_voice_and_paths(client: Client) -> None:
    targets = client.get("/v2/models/interpreter/config")["targets"]
    assert {t: v["voice"] for t, v in targets.items()} == {"en": "joe", "pt": "pf_dora"}
    assert {"from": "en", "through": ["whisper_base", "en-pt"]} in targets["pt"]["paths"]
    assert {"from": "any", "through": ["whisper_base (translate)"]} in targets["en"]["paths"]
    assert client.get("/v2/models/interpreter")["parameters"]["targets"] == targets


def test_libretranslate_source_auto(client: Client) -> None:
    call = Call(
        "POST", "/translate", json.dumps({"q": "Eu gostaria de um café, por favor.", "source": "auto", "target": "en"}).encode(),
        (("content-type", "application/json"),),
    )  # fmt: skip
    doc = checked(client.send(call)).json()
    assert doc["detectedLanguage"]["language"] == "pt" and doc["detectedLanguage"]["confidence"] > 50, doc
    assert "coffee" in doc["translatedText"].lower()
    q = ["Where is the train station?", "Meu irmão trabalha no hospital."]
    call = Call("POST", "/translate", json.dumps({"q": q, "source": "auto", "target": "pt"}).encode())
    doc = checked(client.send(call)).json()
    assert [d["language"] for d in doc["detectedLanguage"]] == ["en", "pt"], doc
    assert "estação" in doc["translatedText"][0].lower() and doc["translatedText"][1] == q[1]


def test_libretranslate_detects_among_the_languages_it_translates(unix: Client) -> None:
    """As LibreTranslate detects among its loaded languages: "Bom dia." is Portuguese here (of all the
    firmware's languages, fastText likes Italian best, and the translation was a 400: no it->en)."""
    form = (("content-type", "application/json"),)
    call = Call("POST", "/translate", json.dumps({"q": "Bom dia.", "source": "auto", "target": "en"}).encode(), form)
    doc = checked(unix.send(call)).json()
    assert doc["detectedLanguage"]["language"] == "pt" and "morning" in doc["translatedText"].lower(), doc
    found = checked(unix.send(Call("POST", "/detect", json.dumps({"q": "Bom dia."}).encode(), form))).json()
    languages = {entry["code"] for entry in unix.get("/languages")}
    assert found[0]["language"] == "pt" and {d["language"] for d in found} <= languages == {"en", "pt"}, found


def test_a_target_no_translation_reaches_is_a_400_naming_those_that_have_one(
    keys: Keys, tmp_path: Path, tls: tuple[Path, Path]
) -> None:
    """The interpreter firmware with a Spanish voice instead of the Portuguese ones and no pairs: es has a
    voice but no path (Whisper translates to English only)."""
    pins = {  # pf_dora's style table (pinned in the spec) -> ef_dora's
        "pf_dora": "3da7b5b2d91847ebf5646f57631af6ececae3c29a89cd300f06edf9aa6cfe9ee",
        "ef_dora": "f66ec66bd295acb18372e37008533a9a3228483ccd294e7538d5d9294ac9a532",
    }
    spec = movable_spec(SPEC).replace(pins["pf_dora"], pins["ef_dora"])
    spec = spec.replace("voices/pf_dora.bin", "voices/ef_dora.bin")  # the assembled file and its source
    spec = spec.replace('voices = ["pf_dora", "pm_alex"]', 'voices = ["ef_dora"]')
    spec = spec.replace('voices = ["joe", "pf_dora"], translations = ["en-pt", "pt-en"]', 'voices = ["joe", "ef_dora"]')
    (tmp_path / "es.toml").write_text(spec)
    cli("firmware", "build", tmp_path / "es.toml", "--key", keys.private, "--out", tmp_path / "bundle")
    (tmp_path / "d").mkdir()
    daemon = Daemon(tmp_path / "d", tmp_path / "bundle", keys.trusted).wait_ready(180)
    try:
        with daemon.client("unix") as client:
            targets = client.get("/v2/models/interpreter/config")["targets"]
            assert targets["es"] == {"voice": "ef_dora", "model": "kokoro", "paths": []}, targets
            assert targets["en"]["paths"], targets
            wav = encode_wav(recording(ENGLISH[:1]), RATE)
            response = client.send(Call("POST", "/v2/models/interpreter/interpret?to=es", wav))
            error = response.json()["error"]
            assert response.status == 400 and "no path to 'es'" in error and "(targets: en)" in error, error
    finally:
        assert daemon.stop() == 0, daemon.log.read_text()


def test_cli_interpret_checks_every_parameter_before_the_answer_starts(interpreter: Daemon, tmp_path: Path) -> None:
    source = tmp_path / "in.wav"
    source.write_bytes(encode_wav(recording(ENGLISH[:1]), RATE))
    result = cli("call", "interpret", source, "-o", tmp_path / "zz.wav", "--from", "zz", "--socket", interpreter.socket, check=False)  # fmt: skip
    assert result.returncode == 1 and result.stderr == (
        "appliance: error: the daemon answered HTTP 400: language 'zz' is not one of Whisper's (99 codes)\n"
    )
    assert not (tmp_path / "zz.wav").exists()
    out = subprocess.run(  # `-o -`: the WAV to stdout (the texts go to stderr then)
        [*APPLIANCE, "call", "interpret", str(source), "-o", "-", "--to", "en", "--socket", str(interpreter.socket)],
        capture_output=True, cwd=ROOT, timeout=300, check=True,
    )  # fmt: skip
    with soundfile.SoundFile(io.BytesIO(out.stdout)) as wav:
        assert wav.samplerate == 22050 and wav.frames > 22050

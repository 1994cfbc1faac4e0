"""Kokoro's voices of Portuguese, Spanish, French and Italian (firmware/voices.toml) on a real daemon, on both
transports: the box's Kokoro against Kokoro on ONNX Runtime alone, its speech heard by an independent
faster-whisper run, OpenAI voice names, the voice listing, LibreTranslate's /detect, and bad input."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile
import soxr
from conftest import ROOT, Daemon, Keys, cli, movable_spec
from faster_whisper import WhisperModel
from kokoro import VOICES, Kokoro

from appliance.client import Call, Client

SPEC = ROOT / "firmware" / "voices.toml"
SAID = {  # voice: (language, sentence, key words an independent Whisper must hear)
    "pf_dora": ("pt", "A biblioteca fecha às seis horas da tarde.", ["biblioteca", "fecha", "seis", "tarde"]),
    "ef_dora": ("es", "El tren sale a las tres de la tarde.", ["tren", "sale", "tres", "tarde"]),
    "ff_siwis": ("fr", "Mon frère travaille à l'hôpital.", ["frère", "travaille", "hôpital"]),
    "if_sara": ("it", "Il museo apre alle nove di mattina.", ["museo", "apre", "nove", "mattina"]),
}
SHORT = {  # short sentences per firmware language, for /detect
    "en": ["Where is the station?", "I would like a coffee.", "See you tomorrow.", "My name is Anna."],
    "pt": ["Onde fica a estação?", "Eu gostaria de um café.", "Até amanhã.", "Está chovendo hoje."],
    "es": ["¿Dónde está la estación?", "Quisiera un café.", "Hasta mañana.", "Tengo hambre."],
    "fr": ["Où est la gare ?", "Je voudrais un café.", "À demain.", "Il pleut aujourd'hui."],
    "it": ["Dov'è la stazione?", "Vorrei un caffè.", "A domani.", "Oggi piove."],
}


@pytest.fixture(scope="module")
def bundle(firmware_of) -> Path:
    return firmware_of("voices")


@pytest.fixture(scope="module")
def voices(keys: Keys, bundle: Path, tmp_path_factory: pytest.TempPathFactory, tls):
    d = Daemon(tmp_path_factory.mktemp("voices"), bundle, keys.trusted, tls=tls).wait_ready(120)
    yield d
    assert d.stop() == 0, d.log.read_text()


@pytest.fixture(scope="module", params=["unix", "quic"])
def client(request: pytest.FixtureRequest, voices: Daemon):
    with voices.client(request.param) as c:
        yield c


@pytest.fixture(scope="module")
def unix(voices: Daemon):
    """The voices' own tests (what they say, as heard from outside) run over the Unix socket; each
    route's contract over both transports is checked with `client`."""
    with voices.client() as c:
        yield c


@pytest.fixture(scope="module")
def kokoro(tmp_path_factory: pytest.TempPathFactory) -> Kokoro:
    return Kokoro(tmp_path_factory.mktemp("kokoro"))


@pytest.fixture(scope="module")
def whisper(judge_base: WhisperModel) -> WhisperModel:
    return judge_base


def post(client: Client, path: str, doc: object):
    return client.send(Call("POST", path, json.dumps(doc).encode(), (("content-type", "application/json"),)))


def test_kokoro_through_the_daemon_equals_onnxruntime_alone(unix: Client, kokoro: Kokoro) -> None:
    """KServe infer of one sentence per voice: the same samples as the graph run alone on the same phonemes."""
    for voice, (_, sentence, _) in SAID.items():
        text = np.array([sentence.encode()], dtype=object)
        out = unix.infer("kokoro", {"text": text}, parameters={"voice": voice})["audio"]
        alone = kokoro.samples(kokoro.tokens(sentence, voice), voice)
        expected = np.clip(np.round(alone * 32767), -32767, 32767)
        assert out.dtype == np.int16 and len(out) == len(expected) > 24000, (voice, len(out), len(expected))
        assert np.max(np.abs(out.astype(np.int64) - expected)) <= 1, voice  # measured: 0 (the same ids and style)


def test_each_language_is_heard_by_an_independent_whisper(unix: Client, whisper: WhisperModel) -> None:
    """The box's speech in each voice's language, transcribed by faster-whisper base told the language."""
    for voice, (language, sentence, key_words) in SAID.items():
        wav = unix.speech(sentence, voice=voice, response_format="wav")
        audio, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
        segments, _ = whisper.transcribe(soxr.resample(audio, rate, 16000), language=language, beam_size=5)
        heard = " ".join(s.text for s in segments).lower()
        assert sum(w in heard for w in key_words) >= len(key_words) - 1, (voice, heard)


def test_openai_voice_names_pick_the_voice_of_the_text(unix: Client) -> None:
    for voice, (language, sentence, _) in SAID.items():
        response = post(unix, "/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": sentence})
        assert response.status == 200 and response.headers["x-voice"] == voice, (voice, response.headers)
        assert response.headers["x-detected-language"].startswith(f"{language};")
    # a voice of the firmware by name, and a model name standing for its default voice
    response = post(unix, "/v1/audio/speech", {"model": "tts-1", "voice": "pm_alex", "input": "Bom dia."})
    assert response.status == 200 and response.headers["x-voice"] == "pm_alex"
    response = post(unix, "/v1/audio/speech", {"model": "kokoro", "voice": "nova", "input": "Hello there."})
    assert response.status == 200 and response.headers["x-voice"] == "pf_dora"  # no English voice: the first
    response = post(unix, "/v1/audio/speech", {"model": "tts-1", "voice": "darth", "input": "Olá."})
    error = response.json()["error"]["message"]
    assert response.status == 400 and "unknown voice 'darth'" in error and "ef_dora" in error and "\n" not in error


def test_the_voice_listing(client: Client) -> None:
    listing = client.get("/v1/audio/voices")
    names = [v["name"] for v in listing["voices"]]
    assert names == ["pf_dora", "pm_alex", "ef_dora", "ff_siwis", "if_sara", "im_nicola"]
    assert listing["defaults"] == {"pt": "pf_dora", "es": "ef_dora", "fr": "ff_siwis", "it": "if_sara"}
    assert all(v["sample_rate"] == 24000 and v["model"] == "kokoro" for v in listing["voices"])
    assert client.get("/v2/models/kokoro")["parameters"]["voices"] == listing["voices"]


def test_detect_short_sentences_in_every_language(client: Client) -> None:
    right = 0
    for language, sentences in SHORT.items():
        for sentence in sentences:
            response = post(client, "/detect", {"q": sentence})
            candidates = response.json()
            assert response.status == 200 and 0 <= candidates[0]["confidence"] <= 100, candidates
            right += candidates[0]["language"] == language
    assert right >= 19, right  # of 20: fastText lid.176 on sentences of two to five words
    texts = np.array([s.encode() for s in SHORT["fr"]], dtype=object)
    out = client.infer("language", {"text": texts})
    assert [x.decode() for x in out["language"]] == ["fr"] * 4 and all(0 < p <= 1 for p in out["confidence"])


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/audio/speech", {"model": "kokoro", "voice": "pf_dora", "input": ""}, "input is empty"),
        ("/v1/audio/speech", {"model": "kokoro", "voice": "pf_dora", "input": " ... "}, "nothing to say"),
        ("/detect", {"q": "  "}, "q is empty"),
        (
            "/translate",
            {"q": "Eu gostaria de um café, por favor.", "source": "auto", "target": "en"},
            "no translation from 'pt' to 'en'",
        ),
    ],
)
def test_bad_input(client: Client, path: str, body: dict, says: str) -> None:
    response = post(client, path, body)
    doc = response.json()
    message = doc["error"]["message"] if isinstance(doc["error"], dict) else doc["error"]
    assert response.status == 400 and says in message and "\n" not in message, message


def test_kserve_voice_parameter(client: Client) -> None:
    text = np.array([b"Bonjour."], dtype=object)
    response = client.send(Call("POST", "/v2/models/kokoro/infer", json.dumps(
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["Bonjour."]}],
         "parameters": {"voice": "zf_xiaobei"}}).encode()))  # fmt: skip
    assert response.status == 400 and "no voice 'zf_xiaobei'" in response.json()["error"]
    assert len(client.infer("kokoro", {"text": text}, parameters={"voice": "ff_siwis"})["audio"]) > 12000


def _spec_with_voice_file(tmp_path: Path, voice: str, data: bytes) -> Path:
    """firmware/voices.toml with one voice's style table replaced by `data`, pinned by its own sha256."""
    part = tmp_path / f"{voice}.bin"
    part.write_bytes(data)
    text = movable_spec(SPEC)  # the spec moves to tmp_path
    original = VOICES / f"{voice}.bin"
    pin = hashlib.sha256(original.read_bytes()).hexdigest()
    text = text.replace(f'{{ path = "{VOICES}/{voice}.bin" }}', f'{{ path = "{part}" }}')
    text = text.replace(pin, hashlib.sha256(data).hexdigest())
    spec = tmp_path / "voices.toml"
    spec.write_text(text)
    return spec


def test_a_voice_file_of_the_wrong_size_fails_the_build(keys: Keys, tmp_path: Path) -> None:
    short = (VOICES / "ef_dora.bin").read_bytes()[:-1024]  # pinned, but not a 510x256 table
    result = cli("firmware", "build", _spec_with_voice_file(tmp_path, "ef_dora", short), "--key", keys.private,
                 "--out", tmp_path / "out", check=False)  # fmt: skip
    assert result.returncode != 0 and "ef_dora.bin is 521216 bytes, not a style table" in result.stderr
    assert not (tmp_path / "out").exists()
    spec = SPEC.read_text().replace('"im_nicola"]', '"im_nicola", "zf_xiaobei"]')
    (tmp_path / "chinese.toml").write_text(spec.replace("../build", str(ROOT / "build")))
    result = cli(
        "firmware", "build", tmp_path / "chinese.toml", "--key", keys.private, "--out", tmp_path / "x", check=False
    )
    assert result.returncode != 0 and "voice 'zf_xiaobei' is not a Kokoro voice of a served language" in result.stderr


def test_a_tampered_voice_file_fails_verify(keys: Keys, bundle: Path, tmp_path: Path) -> None:
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    voice = copy / "models" / "kokoro" / "voices" / "if_sara.bin"
    data = bytearray(voice.read_bytes())
    data[1000] ^= 0x01
    voice.write_bytes(bytes(data))
    result = cli("firmware", "verify", copy, "--trusted-keys", keys.trusted, check=False)
    assert result.returncode != 0 and "models/kokoro/voices/if_sara.bin" in result.stderr, result.stderr
    assert re.search(r"sha256|hash", result.stderr)


def test_cli_speak_picks_the_voice_of_the_text(voices: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "es.wav"
    cli("call", "speak", "La biblioteca cierra a las seis.", "-o", out, "--socket", voices.socket)
    with soundfile.SoundFile(out) as wav:
        assert wav.samplerate == 24000 and wav.frames > 24000

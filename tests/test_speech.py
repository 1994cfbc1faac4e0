"""Speech out (the Piper voice joe) and text translation (Bergamot en<->pt), real models from the speech
firmware plus the VAD, served by a real daemon over both transports."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import wave
from pathlib import Path

import av
import httpx2
import numpy as np
import openai
import pytest
import soundfile
import soxr
from conftest import APPLIANCE, ROOT, Daemon, Keys, cli

from appliance.client import Call, Client
from appliance.kinds.text import ArrivingText, Clause, plan_shards, sentences

SPEECH_SPEC = ROOT / "firmware" / "speech.toml"
PARAGRAPH = (
    "Hello there, this is the first sentence. And here comes a second one that is a little longer than the first. "
    "Good bye and thank you!"
)
KEY_WORDS = {  # English sentences and the words a round trip through Portuguese must keep
    "The doctor works at the hospital every morning.": ["doctor", "hospital", "morning"],
    "My brother bought a new car yesterday.": ["brother", "car", "yesterday"],
    "The children are playing in the garden.": ["children", "playing", "garden"],
    "Where is the nearest train station?": ["train", "station"],
}


@pytest.fixture(scope="module")
def speech_bundle(keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The speech firmware with the default firmware's VAD added, to check the voice's audio is speech."""
    work = tmp_path_factory.mktemp("speechfw")
    default = (ROOT / "firmware" / "default.toml").read_text()
    vad = default[default.index("[[models]]") :]
    spec = work / "speech-vad.toml"
    spec.write_text(SPEECH_SPEC.read_text() + "\n" + vad)
    cli("firmware", "build", spec, "--key", keys.private, "--out", work / "bundle")
    return work / "bundle"


@pytest.fixture(scope="module")
def speech_daemon(tmp_path_factory: pytest.TempPathFactory, keys: Keys, speech_bundle: Path, tls):
    d = Daemon(tmp_path_factory.mktemp("speechd"), speech_bundle, keys.trusted, tls=tls).wait_ready(120)
    yield d
    assert d.stop() == 0, d.log.read_text()


@pytest.fixture(scope="module", params=["unix", "quic"])
def client(request: pytest.FixtureRequest, speech_daemon: Daemon):
    with speech_daemon.client(request.param) as c:
        yield c


def decoded(body: bytes) -> tuple[np.ndarray, int]:
    audio, rate = soundfile.read(io.BytesIO(body), dtype="float32")
    return audio, rate


def speech_fraction(client: Client, audio: np.ndarray, rate: int) -> float:
    """The share of the audio that the box's own VAD calls speech."""
    samples = soxr.resample(audio, rate, 16000).astype(np.float32)
    probs = client.speech_probs(samples[: len(samples) // 512 * 512])
    return float(np.mean(probs > 0.5))


def post_json(client: Client, path: str, doc: object) -> tuple[int, dict]:
    response = client.send(Call("POST", path, json.dumps(doc).encode(), (("content-type", "application/json"),)))
    return response.status, response.json() if response.body.startswith(b"{") else {}


def message(doc: dict) -> str:
    """An error's message: {"error": "..."}, or OpenAI's {"error": {"message": ...}} on its routes."""
    error = doc["error"]
    return error if isinstance(error, str) else error["message"]


# --- speech ----------------------------------------------------------------------------------------


def test_speech_is_speech_at_the_voice_rate(client: Client) -> None:
    audio, rate = decoded(client.speech(PARAGRAPH, voice="joe"))
    assert rate == 22050
    seconds = len(audio) / rate
    assert 4.0 < seconds < 12.0, seconds  # three sentences, 28 words
    assert 0.02 < float(np.sqrt(np.mean(audio**2))) < 0.5  # loud enough, not noise at full scale
    assert speech_fraction(client, audio, rate) > 0.6


def test_speech_streams_each_sentence_as_it_is_ready(client: Client) -> None:
    five = PARAGRAPH + " The weather will be sunny tomorrow. We visited the museum last weekend."
    pieces = list(client.stream_speech(five, voice="joe", response_format="pcm"))
    pcm = np.frombuffer(b"".join(pieces), "<i2")
    assert len(pieces) >= 2  # not one body at the end
    assert 7.0 < len(pcm) / 22050 < 20.0


def test_formats_and_speed(client: Client) -> None:
    flac, rate, codec = av_decoded(  # FFmpeg: libsndfile reads no FLAC of unknown length (compatibility.md)
        client.speech("The quick brown fox jumps over the lazy dog.", voice="joe", response_format="flac")
    )
    assert codec == "flac" and rate == 22050 and len(flac) > rate
    fast, _ = decoded(client.speech("The quick brown fox jumps over the lazy dog.", voice="joe", speed=2.0))
    slow, _ = decoded(client.speech("The quick brown fox jumps over the lazy dog.", voice="joe", speed=0.5))
    assert len(slow) > 2.5 * len(fast)
    status, doc = post_json(
        client, "/v1/audio/speech", {"model": "tts-1", "voice": "joe", "input": "Hi.", "response_format": "ogg"}
    )
    assert status == 400 and "response_format" in message(doc) and doc["error"]["type"] == "invalid_request_error"


def test_kserve_text_in_int16_audio_out(client: Client) -> None:
    status, doc = post_json(
        client,
        "/v2/models/joe/infer",
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["Good morning."]}]},
    )
    assert status == 200, doc
    (out,) = doc["outputs"]
    assert out["name"] == "audio" and out["datatype"] == "INT16" and out["shape"][0] > 22050 // 2
    assert max(abs(v) for v in out["data"]) > 10000


# --- translation -----------------------------------------------------------------------------------


def test_english_portuguese_english_keeps_key_words(client: Client) -> None:
    english = list(KEY_WORDS)
    portuguese = client.translate(english, "en", "pt")
    assert len(portuguese) == len(english) and all(p and p not in english for p in portuguese)
    back = client.translate(portuguese, "pt", "en")
    for sentence, words, text in zip(english, KEY_WORDS.values(), back):
        assert all(w in text.lower() for w in words), (sentence, text)


def test_fifty_sentences_come_back_in_order_all_translated(client: Client) -> None:
    text = " ".join(f"There are {n + 3} apples on the table in room {n + 100}." for n in range(50))
    translated = client.translate(text, "en", "pt")
    numbers = [int(x) for x in re.findall(r"\d+", translated)]
    assert numbers == [x for n in range(50) for x in (n + 3, n + 100)], translated
    assert "apples" not in translated and translated.count("maçãs") >= 45


FIELDS = (("q", "Good morning"), ("source", "en"), ("target", "pt"))
MULTIPART = "multipart/form-data; boundary=b0"


def test_libretranslate_forms_and_languages(client: Client, speech_daemon: Daemon) -> None:
    assert client.languages() == [
        {"code": "en", "name": "English", "targets": ["pt"]},
        {"code": "pt", "name": "Portuguese", "targets": ["en"]},
    ]
    form = Call(
        "POST",
        "/translate",
        b"q=Good+morning&source=en&target=pt",
        (("content-type", "application/x-www-form-urlencoded"),),
    )
    assert client.send(form).json() == {"translatedText": "Bom dia"}
    # a multipart form (`curl -F q=...`), as LibreTranslate's Flask reads it (it was "not valid JSON")
    parts = "".join(f'--b0\r\ncontent-disposition: form-data; name="{n}"\r\n\r\n{v}\r\n' for n, v in FIELDS)
    multipart = Call("POST", "/translate", (parts + "--b0--\r\n").encode(), (("content-type", MULTIPART),))
    assert client.send(multipart).json() == {"translatedText": "Bom dia"}
    assert client.translate("Line one.\n\nLine two.", "en", "pt").count("\n") == 2


def test_kserve_bytes_in_bytes_out(client: Client) -> None:
    status, doc = post_json(
        client,
        "/v2/models/en-pt/infer",
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": ["Thank you.", "Good night."]}]},
    )
    assert status == 200, doc
    (out,) = doc["outputs"]
    assert out["name"] == "translation" and out["datatype"] == "BYTES" and out["shape"] == [2]
    assert out["data"][0].lower().startswith("obrigad")


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/translate", {"q": "", "source": "en", "target": "pt"}, 400, "empty"),
        ("/translate", {"source": "en", "target": "pt"}, 400, "q is missing"),  # said "got NoneType"
        ("/translate", {"q": 5, "source": "en", "target": "pt"}, 400, "q must be a string of text, not a number"),
        ("/translate", {"q": "a" * (1 << 20), "source": "en", "target": "pt"}, 413, "characters"),
        ("/translate", {"q": "hello", "source": "en", "target": "de"}, 400, "no translation from 'en' to 'de'"),
        ("/translate", {"q": "hello", "source": "auto", "target": "pt"}, 400, "detect"),
        ("/v1/audio/speech", {"model": "tts-1", "voice": "joe", "input": "  "}, 400, "empty"),
        ("/v1/audio/speech", {"model": "tts-1", "voice": "joe", "input": "a" * (1 << 20)}, 413, "characters"),
        ("/v1/audio/speech", {"model": "tts-1", "voice": "darth", "input": "hi"}, 400, "unknown voice"),
        ("/v1/audio/speech", {"model": "tts-1", "input": "hi"}, 400, "Missing required parameter: 'voice'"),
        ("/v1/audio/speech", {"model": "tts-2", "voice": "joe", "input": "hi"}, 404, "joe; or tts-1, tts-1-hd"),
        ("/v1/audio/speech", {"model": "tts-1", "voice": "joe", "input": "hi", "speed": 9}, 400, "speed"),
        ("/v1/audio/speech", {"model": "tts-1", "voice": "joe", "input": "... !!"}, 400, "nothing to say"),
    ],
)
def test_bad_input_is_a_one_line_4xx(client: Client, path: str, body: dict, status: int, says: str) -> None:
    got, doc = post_json(client, path, body)
    assert got == status and says in message(doc) and "\n" not in message(doc), doc
    assert client.translate("Thank you.", "en", "pt").lower().startswith("obrigad")  # still serving


@pytest.mark.parametrize("path", ["/translate", "/v1/audio/speech"])
def test_invalid_utf8_is_a_400(client: Client, path: str) -> None:
    response = client.send(
        Call("POST", path, b'{"q": "\xff\xfe", "input": "\xff"}', (("content-type", "application/json"),))
    )
    assert response.status == 400 and "UTF-8" in message(response.json())
    infer = b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"parameters":{"binary_data_size":6}}]}'
    call = Call(
        "POST",
        "/v2/models/en-pt/infer",
        infer + b"\x02\x00\x00\x00\xff\xfe",
        (("inference-header-content-length", str(len(infer))),),
    )
    response = client.send(call)
    assert response.status == 400 and "UTF-8" in message(response.json())


# --- the CLI ---------------------------------------------------------------------------------------


def test_cli_speak_and_translate(speech_daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "hello.wav"
    cli("call", "speak", "Hello there. How are you today?", "-o", out, "--socket", speech_daemon.socket)
    with wave.open(str(out)) as wav:  # the CLI wrote the true sizes into the streamed header
        assert wav.getframerate() == 22050 and wav.getnframes() == (out.stat().st_size - 44) // 2 > 22050
    result = cli("call", "translate", "--to", "pt", "Good morning.", "--socket", speech_daemon.socket)
    assert result.stdout.strip() == "Bom dia."
    missing = cli("call", "translate", "--to", "de", "Hi", "--socket", speech_daemon.socket, check=False)
    assert (
        missing.returncode == 2
        and "no translation into 'de' on this box (it translates into: en, pt)" in missing.stderr
    )


def translators(daemon: Daemon) -> list[int]:
    """The daemon's translator processes (engine/bergamot_process.py)."""
    return [pid for pid in daemon.pids()[1:] if b"bergamot_process" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_translation_runs_in_processes_of_its_own_and_one_killed_is_replaced(speech_daemon: Daemon) -> None:
    """fxtranslate holds the GIL while it translates: the daemon runs each translator (two per pair at
    the default engine.threads) in a process of its own, where the work's CPU time goes. Stop and
    hang-up signals leave it be; one killed between texts is replaced by the next text, which is
    translated."""
    first = translators(speech_daemon)
    assert len(first) == 2 * 2, first  # en->pt and pt->en, two threads each
    before = {pid: cpu_s(pid) for pid in first}
    engine_before = cpu_s(speech_daemon.proc.pid)
    text = " ".join(f"There are {n + 3} apples on the table in room {n + 100}." for n in range(40))
    with speech_daemon.client() as client:
        assert client.translate(text, "en", "pt").count("maçãs") >= 36
        spent = sum(cpu_s(pid) - before[pid] for pid in first)
        assert spent > cpu_s(speech_daemon.proc.pid) - engine_before, "the translation ran in the engine process"
        for pid in first:  # what reaches the whole group (systemd's stop, ^C, a hang-up) is the daemon's to act on
            for sent in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                os.kill(pid, sent)
        assert client.translate("Good morning.", "en", "pt") == "Bom dia."
        assert sorted(translators(speech_daemon)) == sorted(first)
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        translated = [client.translate(f"My brother has {n + 2} cars.", "en", "pt") for n in range(8)]
        back = client.translate("Bom dia.", "pt", "en")
    assert all("carros" in t and str(n + 2) in t for n, t in enumerate(translated)), translated
    assert back == "Good morning."
    replaced = translators(speech_daemon)
    assert len(replaced) >= 2 and not set(replaced) & set(first), (first, replaced)


# --- shards ----------------------------------------------------------------------------------------


def test_sentences_and_clauses_as_espeak_cuts_them() -> None:
    found = sentences("Hello, world. It costs $3.50 (about 3 euros)... Really?! Fine")
    assert [[(c.text, c.terminator) for c in s] for s in found] == [
        [("Hello", ","), ("world", ".")],
        [("It costs $3.50 (about 3 euros)", ".")],
        [("Really", "?")],
        [("Fine", "")],
    ]


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_whole_sentences_of_a_text_still_arriving(piece: int) -> None:
    """Streamed text (Wyoming's synthesize-chunk) is spoken up to its last sentence end that white
    space follows: "3." may become "3.50", a comma ends no sentence; however the text is cut."""

    def said(text: str) -> str:
        arriving = ArrivingText()
        return "".join(arriving.add(text[at : at + piece]) for at in range(0, len(text), piece))

    assert said("It costs 3.") == ""
    assert said("It costs 3.50. Fine") == "It costs 3.50."
    assert said("Hello, world") == said("Hello, ") == ""
    assert said('Really?!" And then') == 'Really?!"'
    assert said("One. Two! Three") == "One. Two!"
    assert said('He said ".". Then') == 'He said ".".'
    arriving = ArrivingText()
    assert [arriving.add("One. Tw"), arriving.add("o! Thr"), arriving.add("ee"), arriving.rest()] == [
        "One.",
        " Two!",
        "",
        " Three",
    ]


def test_shards_semantic_and_fixed() -> None:
    """The planner's cuts against shards written out by hand (a token is a word here; a cut splits
    clauses into runs of whole words)."""

    def words(run: list[Clause]) -> int:
        return sum(len(c.text.split()) for c in run)

    def cut(run: list[Clause], n: int) -> list[list[Clause]]:
        flat = [w for c in run for w in c.text.split()]
        return [[Clause(" ".join(flat[i : i + n]), "", False)] for i in range(0, len(flat), n)]

    def texts(shards: list[list[Clause]]) -> list[list[str]]:
        return [[c.text for c in shard] for shard in shards]

    text = "One two three, four five six. Seven eight. Nine ten eleven twelve thirteen."
    assert texts(plan_shards(sentences(text), 10, "semantic", words, cut)) == [
        ["One two three", "four five six"],
        ["Seven eight"],
        ["Nine ten eleven twelve thirteen"],
    ]  # one shard per sentence
    assert texts(plan_shards(sentences(text), 4, "semantic", words, cut)) == [
        ["One two three"],
        ["four five six"],
        ["Seven eight"],
        ["Nine ten eleven twelve"],
        ["thirteen"],
    ]  # a sentence over the limit cut between its clauses; a clause over it cut at the limit
    assert texts(plan_shards(sentences(text), 4, "fixed", words, cut)) == [
        ["One two three four"],
        ["five six Seven eight"],
        ["Nine ten eleven twelve"],
        ["thirteen"],
    ]  # every clause, cut every 4 tokens wherever they fall


def test_fixed_shards_at_the_limit(keys: Keys, start_daemon, tmp_path: Path) -> None:
    """A firmware that cuts at the limit: tiny shards, many per request, still answered in order."""
    spec = SPEECH_SPEC.read_text()
    spec = spec.replace(
        'max_tokens_per_shard = 400, split_algorithm = "semantic"',
        'max_tokens_per_shard = 40, split_algorithm = "fixed"',
    )
    spec = spec.replace(
        'max_tokens_per_shard = 256, split_algorithm = "semantic"',
        'max_tokens_per_shard = 8, split_algorithm = "fixed"',
    )
    (tmp_path / "fixed.toml").write_text(spec)
    cli("firmware", "build", tmp_path / "fixed.toml", "--key", keys.private, "--out", tmp_path / "fixed")
    with start_daemon(bundle_dir=tmp_path / "fixed").client() as client:
        model = client.model("en-pt")["parameters"]["baked"]
        assert model["max_tokens_per_shard"] == 8 and model["split_algorithm"] == "fixed"
        translated = client.translate("I have 12 apples, 7 pears and 30 plums in 4 baskets.", "en", "pt")
        assert [int(x) for x in re.findall(r"\d+", translated)] == [12, 7, 30, 4], translated
        audio, rate = decoded(client.speech(PARAGRAPH, voice="joe"))
        assert 4.0 < len(audio) / rate < 14.0


def test_the_openai_client_speaks_and_streams(speech_daemon: Daemon) -> None:
    """The real `openai` package against the box, over its Unix socket."""
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(speech_daemon.socket)), timeout=300)
    client = openai.OpenAI(api_key="on-box", base_url="http://appliance/v1", http_client=http, max_retries=0)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="joe", input=PARAGRAPH, response_format="pcm"
    ) as response:
        pieces = list(response.iter_bytes())
    assert len(pieces) >= 2 and 4.0 < len(b"".join(pieces)) / 2 / 22050 < 12.0
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model="tts-1", voice="darth", input="Hello.")


def av_decoded(body: bytes) -> tuple[np.ndarray, int, str]:
    """FFmpeg's own reading of an answer (PyAV directly, not the box's decoder): mono float, rate, codec."""
    with av.open(io.BytesIO(body)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        return np.concatenate(frames).astype(np.float32), stream.rate, stream.codec_context.name


def test_the_openai_client_with_its_defaults_gets_mp3_and_every_format_reads(
    speech_daemon: Daemon, tmp_path: Path
) -> None:
    """The SDK's default response_format is mp3; opus and aac stream sentence by sentence; a streamed
    WAV's header says its length is unknown, and Python's wave and libsndfile read it to its end."""
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(speech_daemon.socket)), timeout=300)
    client = openai.OpenAI(api_key="on-box", base_url="http://appliance/v1", http_client=http, max_retries=0)
    answer = client.audio.speech.create(model="tts-1", voice="joe", input=PARAGRAPH)
    assert answer.response.headers["content-type"] == "audio/mpeg"
    audio, rate, codec = av_decoded(answer.content)
    assert codec in ("mp3", "mp3float") and rate == 22050 and 4.0 < len(audio) / rate < 12.0
    with speech_daemon.client("unix") as box:
        assert speech_fraction(box, audio, rate) > 0.6
    for audio_format, codec_name, expected_rate in (("opus", "opus", 48000), ("aac", "aac", 22050)):
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="joe", input=PARAGRAPH, response_format=audio_format
        ) as response:
            pieces = list(response.iter_bytes())
        assert len(pieces) >= 2, audio_format  # streamed as the sentences are ready, not one body at the end
        audio, rate, codec = av_decoded(b"".join(pieces))
        assert codec == codec_name and rate == expected_rate and 4.0 < len(audio) / rate < 12.0, audio_format
    path = tmp_path / "hello.wav"
    client.audio.speech.create(model="tts-1", voice="joe", input=PARAGRAPH, response_format="wav").write_to_file(path)
    with wave.open(str(path)) as w:
        frames = len(w.readframes(w.getnframes())) // 2
        assert w.getframerate() == 22050 and frames * 2 + 44 == path.stat().st_size
    assert soundfile.info(str(path)).frames == frames and 4.0 < frames / 22050 < 12.0


def test_cli_speak_errors_in_one_line_and_to_stdout(speech_daemon: Daemon, tmp_path: Path) -> None:
    out = tmp_path / "darth.wav"
    wrong = cli("call", "speak", "Hi", "--voice", "darth", "-o", out, "--socket", speech_daemon.socket, check=False)
    assert wrong.returncode == 1 and wrong.stderr == (
        "appliance: error: the daemon answered HTTP 400: unknown voice 'darth' (voices: joe; or OpenAI's"
        " alloy, ash, ballad, coral, echo, fable, nova, onyx, sage, shimmer, verse: each maps to this box's voice"
        " for the text's language)\n"
    )
    assert not out.exists()
    piped = subprocess.run(
        [*APPLIANCE, "call", "speak", PARAGRAPH, "-o", "-", "--format", "mp3", "--socket", str(speech_daemon.socket)],
        capture_output=True, cwd=ROOT, timeout=300, check=True,
    )  # fmt: skip
    audio, rate, codec = av_decoded(piped.stdout)
    assert codec in ("mp3", "mp3float") and 4.0 < len(audio) / rate < 12.0 and not (ROOT / "-").exists()

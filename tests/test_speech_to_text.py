"""Speech to text and speech-to-English translation: the voice firmware (VAD + Whisper tiny.en and base
on CTranslate2) served by one real daemon, called with real espeak-ng speech through KServe, the
transcribe route, live sequences, the CLI and the real `openai` package."""

from __future__ import annotations

import contextlib
import io
import re
import select
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import jiwer
import numpy as np
import openai
import pytest
import soundfile as sf
from conftest import ROOT, Daemon, Keys, cli
from promtext import sample, total
from speech import RATE, recording, say
from waits import wait_until

from appliance.audio import encode_wav
from appliance.client import Call, Client
from appliance.client.http import tensors_call

TINY, BASE = "whisper_tiny_en", "whisper_base"
# Sentences tiny.en hears word for word even alone (a short clip gives Whisper little context)
CLEAR = [
    "Please call me back when you get home tonight.",
    "I would like to order a cup of coffee and a sandwich.",
    "Turn off the lights in the kitchen please.",
    "We are going to the beach this weekend.",
    "Where is the nearest pharmacy?",
    "Dinner is ready, please wash your hands.",
]
# and others it finds harder: the word error rate is measured on all of them
ENGLISH = [
    *CLEAR,
    "The weather is very nice today and the sun is shining.",
    "My phone battery is almost empty.",
    "The children are playing football in the park.",
    "Can you help me carry these heavy boxes?",
    "I forgot my umbrella at the office.",
    "The train leaves from the main station in the morning.",
]
CHUNK = 4096  # 256 ms: a live stream's chunk


def words(text: str) -> str:
    """Text as WER compares it: lower case, no punctuation."""
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def wer(reference: list[str] | str, hypothesis: str) -> float:
    ref = words(" ".join(reference) if isinstance(reference, list) else reference)
    return float(jiwer.wer(ref, words(hypothesis)))


@pytest.fixture(scope="module")
def daemon(voice_daemon: Daemon) -> Daemon:
    return voice_daemon


@pytest.fixture(scope="module")
def unix(daemon: Daemon) -> Iterator[Client]:
    with Client(str(daemon.socket), timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def english() -> np.ndarray:
    return recording(ENGLISH)[0]


@pytest.fixture(scope="module")
def openai_client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(daemon.socket)), timeout=300)
    yield openai.OpenAI(api_key="on-box", base_url="http://appliance/v1", http_client=http, max_retries=0)
    http.close()


def flac(samples: np.ndarray, rate: int = RATE, channels: int = 1) -> bytes:
    import soxr

    resampled = soxr.resample(samples, RATE, rate) if rate != RATE else samples
    out = io.BytesIO()
    sf.write(out, np.repeat(resampled[:, None], channels, axis=1), rate, format="FLAC", subtype="PCM_24")
    return out.getvalue()


def text_of(outputs: dict[str, np.ndarray]) -> str:
    return " ".join(bytes(t).decode() for t in outputs["text"])


@pytest.mark.parametrize(("model", "transport"), [(TINY, "unix"), (BASE, "quic")])
def test_english_word_error_rate_at_most_10_percent(daemon: Daemon, english, model: str, transport: str) -> None:
    """KServe infer, the recording as one BYTES element (44.1 kHz stereo FLAC, resampled by the daemon):
    each Whisper once, each transport once (the transports' contract is test_api's)."""
    audio = np.array([flac(english, 44100, 2)], dtype=object)
    with daemon.client(transport) as client:
        outputs = client.infer(model, {"audio": audio})
    assert wer(ENGLISH, text_of(outputs)) <= 0.10, text_of(outputs)
    assert outputs["start"].dtype == np.float32 and np.all(np.diff(outputs["start"]) > 0)


def test_spanish_speech_translated_to_english(openai_client: openai.OpenAI) -> None:
    spanish, _ = recording(["Hola, me gusta mucho la música.", "Mi hermano tiene un coche rojo."], voice="es")
    answer = openai_client.audio.translations.create(model="whisper-1", file=("es.wav", encode_wav(spanish, RATE)))
    text = words(answer.text)
    assert {"music", "brother", "red"} <= set(text.split()), answer.text
    verbose = openai_client.audio.translations.create(
        model="whisper-1", file=("es.wav", encode_wav(spanish, RATE)), response_format="verbose_json"
    )
    assert verbose.language == "english" and "music" in words(verbose.text)  # as whisper-1: its text's language


@pytest.fixture(scope="module")
def ten_minutes() -> tuple[np.ndarray, list[str], list[tuple[float, float]]]:
    """Ten minutes of speech: the sentences in turn, pauses of 0.8 to 3 s between; when each is said."""
    rng = np.random.default_rng(7)
    sentences: list[str] = []
    parts, spans, position = [], [], 0
    while position < 600 * RATE:
        text = ENGLISH[len(sentences) % len(ENGLISH)]
        sentences.append(text)
        voice, gap = say(text), int(rng.uniform(0.8, 3.0) * RATE)
        spans.append((position / RATE, (position + len(voice)) / RATE))
        parts += [voice, np.zeros(gap, np.float32)]
        position += len(voice) + gap
    return np.concatenate(parts), sentences, spans


@pytest.fixture(scope="module")
def twenty_minutes(ten_minutes) -> tuple[int, bytes]:
    """The ten minutes twice, as FLAC (some 40 shards), and its length in samples."""
    samples = np.concatenate([ten_minutes[0], ten_minutes[0]])
    return len(samples), flac(samples)


def test_ten_minute_recording_streams_every_sentence_in_order_with_times(unix: Client, ten_minutes) -> None:
    samples, sentences, spans = ten_minutes
    assert len(samples) >= 600 * RATE
    lines = list(unix.stream_transcribe(flac(samples), TINY))
    segments, summary = lines[:-1], lines[-1]
    assert summary["done"] and summary["segments"] == len(segments)
    assert wer(sentences, " ".join(s["text"] for s in segments)) <= 0.10
    assert [s["start"] for s in segments] == sorted(s["start"] for s in segments)
    for segment in segments:  # its times hold its words (most: tiny.en mishears some), said then ±0.5 s
        start, end = segment["start"] - 0.5, segment["end"] + 0.5
        spoken = [i for i, (a, b) in enumerate(spans) if a < end and b > start]
        assert any(a - 0.5 <= segment["start"] <= b for a, b in spans), segment  # starts on speech
        assert any(a <= segment["end"] <= b + 0.5 for a, b in spans), segment  # and ends on speech
        said = set(words(" ".join(sentences[i] for i in spoken)).split())
        heard = words(segment["text"]).split()
        assert sum(w in said for w in heard) >= 0.5 * len(heard), (segment, [sentences[i] for i in spoken])


def test_eight_concurrent_requests_are_right_and_batched_together(daemon: Daemon, unix: Client) -> None:
    def batches() -> tuple[int, int]:
        """Engine calls of one shard, and of any number (the batch size histogram)."""
        found = {}
        for line in unix.metrics().splitlines():
            if line.startswith("appliance_batch_size_") and f'model="{TINY}"' in line:
                if 'le="1"' in line or "_count" in line:
                    found["one" if 'le="1"' in line else "all"] = int(float(line.split()[-1]))
        return found["one"], found["all"]

    before = batches()
    texts = [CLEAR[i % 6 :] + CLEAR[: i % 6] for i in range(8)]  # each client its own order: its own text
    clips = [recording(pair)[0] for pair in texts]
    answers: list[str | None] = [None] * 8
    barrier = threading.Barrier(8)

    def ask(i: int) -> None:
        with Client(str(daemon.socket), timeout=300) as client:
            barrier.wait()
            answers[i] = client.transcribe(encode_wav(clips[i], RATE), TINY, response_format="text").body.decode()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, answer in enumerate(answers):
        assert answer is not None and wer(texts[i], answer) <= 0.10, answer
    ones, total = batches()
    assert total - before[1] > ones - before[0], "no engine call ran more than one shard"


def test_live_stream_final_text_equals_the_whole_file_text(unix: Client) -> None:
    """Live, each segment is decoded alone as the VAD closes it; in a file, segments share shards."""
    spoken = recording(CLEAR)[0]
    whole = unix.transcribe(encode_wav(spoken, RATE), TINY).json()
    assert wer(CLEAR, whole["text"]) <= 0.05
    samples = np.pad(spoken, (0, -len(spoken) % CHUNK))
    final, partials = [], []
    count = len(samples) // CHUNK
    for i in range(count):
        out = unix.live(  # the open segment's text asked for every second (each ask decodes it)
            samples[i * CHUNK : (i + 1) * CHUNK], TINY, 4242, start=i == 0, end=i == count - 1, partial=i % 4 == 3
        )
        final += [bytes(t).decode() for t in out["text"]]
        partials += [bytes(t).decode() for t in out.get("partial", [])]
    assert words(" ".join(final)) == words(whole["text"])
    assert any(words(p) for p in partials)  # the open segment's text while it is spoken


@pytest.mark.parametrize(
    "name, body",
    [
        ("empty", b""),
        ("random", np.random.default_rng(1).bytes(20000)),
        ("truncated", encode_wav(np.zeros(RATE, np.float32), RATE)[:5000]),
        # a WAV header declaring 4 GB of data (data size 0xFFFFFFF0 is not the streaming marker)
        (
            "4GB-declared",
            encode_wav(np.zeros(100, np.float32), RATE)[:40] + (0xFFFFFFF0).to_bytes(4, "little") + b"\0" * 200,
        ),
        ("one-sample", encode_wav(np.zeros(1, np.float32), RATE)),
        ("broken-mp3", b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\xff\xfb\x90\x64" * 500),  # MP3 frame headers, no frames
    ],
)
def test_bad_audio_is_a_one_line_4xx_and_the_daemon_keeps_serving(
    daemon: Daemon, unix: Client, openai_client: openai.OpenAI, name: str, body: bytes
) -> None:
    for call in (
        Call("POST", f"/v2/models/{TINY}/transcribe", body),
        tensors_call(TINY, {"audio": np.array([body], dtype=object)}),
    ):
        response = unix.send(call)
        assert 400 <= response.status < 500, (name, response.status, response.body)
        message = response.json()["error"]
        assert "\n" not in message and message, message
    with pytest.raises(openai.APIStatusError) as caught:
        openai_client.audio.transcriptions.create(model="whisper-1", file=("x.wav", body))
    assert 400 <= caught.value.status_code < 500 and "\n" not in caught.value.message
    assert wer(ENGLISH[0], unix.transcribe(encode_wav(say(ENGLISH[0]), RATE), TINY).json()["text"]) <= 0.1
    assert "Traceback" not in daemon.log.read_text()


def test_stream_means_one_thing_on_every_route(unix: Client, openai_client: openai.OpenAI) -> None:
    """`stream` is true/1/yes or false/0/no on the VAD's and Whisper's routes and in OpenAI's form;
    anything else is a 400 naming it, never a quiet false."""
    wav = encode_wav(say(ENGLISH[0]), RATE)
    for route in ("silero_vad/segments", f"{TINY}/transcribe"):
        response = unix.send(Call("POST", f"/v2/models/{route}?stream=maybe", wav))
        assert response.status == 400, (route, response.status, response.body)
        assert response.json()["error"] == "query parameter stream: 'maybe' is not true or false"
        for yes in ("1", "yes", "TRUE"):
            response = unix.send(Call("POST", f"/v2/models/{route}?stream={yes}", wav))
            assert response.status == 200 and response.headers["content-type"] == "application/x-ndjson", route
            assert response.body.decode().splitlines()[-1].endswith('"done":true}'), response.body
    with pytest.raises(openai.BadRequestError, match="form field stream: 'maybe' is not true or false"):
        openai_client.audio.transcriptions.create(model=TINY, file=("e.wav", wav), extra_body={"stream": "maybe"})


def test_openai_client_every_response_format_and_streaming(openai_client: openai.OpenAI) -> None:
    spoken = recording(CLEAR)[0]
    wav = encode_wav(spoken, RATE)
    plain = openai_client.audio.transcriptions.create(model=TINY, file=("e.wav", wav))
    assert wer(CLEAR, plain.text) <= 0.05
    verbose = openai_client.audio.transcriptions.create(
        model=TINY, file=("e.wav", wav), response_format="verbose_json", language="en"
    )
    assert verbose.text == plain.text and verbose.duration == pytest.approx(len(spoken) / RATE, abs=0.01)
    assert [s.text for s in verbose.segments or []] and verbose.segments[0].start < verbose.segments[0].end
    text = openai_client.audio.transcriptions.create(model=TINY, file=("e.wav", wav), response_format="text")
    assert words(text) == words(plain.text)
    srt = openai_client.audio.transcriptions.create(model=TINY, file=("e.wav", wav), response_format="srt")
    assert re.match(r"1\n\d\d:\d\d:\d\d,\d{3} --> \d\d:\d\d:\d\d,\d{3}\n", srt), srt
    vtt = openai_client.audio.transcriptions.create(model=TINY, file=("e.wav", wav), response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n") and "-->" in vtt
    events = list(openai_client.audio.transcriptions.create(model=TINY, file=("e.wav", wav), stream=True))
    assert [e.type for e in events][-1] == "transcript.text.done" and len(events) >= 2
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == plain.text
    with pytest.raises(openai.BadRequestError, match="English-only: for translations use whisper_base"):
        openai_client.audio.translations.create(model=TINY, file=("e.wav", wav))


def send_transcription(daemon: Daemon, body: bytes, model: str = BASE) -> socket.socket:
    """A transcription sent on a socket of its own, its answer left unread: the test closes the socket
    to abandon it. Named English: its shards go to Whisper as the VAD cuts them, no segment's language
    identified first."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(daemon.socket))
    head = f"POST /v2/models/{model}/transcribe?language=en HTTP/1.1\r\nhost: box\r\ncontent-type: audio/flac\r\n"
    sock.sendall(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_health_and_vad_answer_while_a_long_transcription_runs(daemon: Daemon, unix: Client) -> None:
    """Five health checks and VAD calls answered while Whisper base works through five minutes of speech
    (then abandoned: its answer is not the subject)."""
    sock = send_transcription(daemon, flac(recording(ENGLISH * 8)[0]))

    def answered() -> bool:
        return bool(select.select([sock], [], [], 0)[0])

    try:
        while whisper_metric(unix, "appliance_queue_depth") == 0 and not answered():
            pass  # until its shards are queued or running
        assert not answered(), "the transcription finished before its shards were seen queued"
        for _ in range(5):
            assert unix.health()["ready"]
            assert unix.segments(encode_wav(say(ENGLISH[1]), RATE))["segments"]
        assert not answered(), "the transcription finished before the others were answered"
    finally:
        sock.close()
    wait_until_idle(daemon)


def test_cli_transcribe_and_live(daemon: Daemon, tmp_path: Path) -> None:
    spoken = recording(ENGLISH[:2])[0]
    path = tmp_path / "speech.flac"
    path.write_bytes(flac(spoken, 22050))
    srt = cli("call", "--socket", daemon.socket, "transcribe", path, "--format", "srt").stdout
    texts = [" ".join(cue.splitlines()[2:]) for cue in srt.strip().split("\n\n")]  # a cue has one or two lines
    assert srt.startswith("1\n00:00:0") and wer(ENGLISH[:2], " ".join(texts)) <= 0.1
    live = cli("call", "--socket", daemon.socket, "live", path).stdout
    assert wer(ENGLISH[:2], " ".join(line.split("] ", 1)[1] for line in live.splitlines())) <= 0.1


def test_flipped_byte_in_whisper_weights_refused_at_verify_and_start(
    voice_bundle: Path, keys: Keys, tmp_path: Path, start_daemon
) -> None:
    tampered = tmp_path / "bundle"
    shutil.copytree(voice_bundle, tampered)
    weights = tampered / "models" / TINY / "model.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    result = cli("firmware", "verify", tampered, "--trusted-keys", keys.trusted, check=False)
    assert result.returncode == 2 and "sha256 does not match" in result.stderr and "model.bin" in result.stderr
    daemon = start_daemon(bundle_dir=tampered, wait=False)
    assert daemon.proc.wait(120) == 3 and "sha256 does not match" in daemon.log.read_text()


def test_a_build_refuses_assembled_weights_whose_hash_is_not_pinned(keys: Keys, tmp_path: Path) -> None:
    spec = (ROOT / "firmware" / "voice.toml").read_text()
    wrong = re.sub(r'sha256 = "d01c[0-9a-f]+"', 'sha256 = "' + "0" * 64 + '"', spec)
    (tmp_path / "voice.toml").write_text(wrong)
    result = cli(
        "firmware", "build", tmp_path / "voice.toml", "--key", keys.private, "--out", tmp_path / "out", check=False
    )
    assert result.returncode != 0 and result.stderr.strip().splitlines()[-1].endswith("the spec pins " + "0" * 64)
    assert not (tmp_path / "out").exists()


def whisper_metric(client: Client, name: str, model: str = BASE) -> float:
    return sample(client.metrics(), name, model=model)


def vad_frames(client: Client) -> float:
    """The VAD's frames so far (512 samples each): a recording is cut whole once its frames are counted."""
    return sample(client.metrics(), "appliance_engine_frames_total", model="silero_vad")


def wait_until_idle(daemon: Daemon) -> None:
    """Until no model has work waiting or running: its only client gone, the engine call under way has
    ended (each model's queue depth counts its running calls' works too)."""
    with Client(str(daemon.socket), timeout=60) as client:
        wait_until(lambda: total(client.metrics(), "appliance_queue_depth") == 0, "every model's queue empty")


@contextlib.contextmanager
def whisper_held(daemon: Daemon) -> Iterator[None]:
    """Whisper's next batch waits until the block ends (the speech hang failpoint); the VAD cuts on."""
    daemon.whisper_hold.write_text("0")
    try:
        yield
    finally:
        daemon.whisper_hold.unlink(missing_ok=True)


def test_a_twenty_minute_transcription_abandoned_stops_within_one_engine_call(
    daemon: Daemon, unix: Client, twenty_minutes: tuple[int, bytes]
) -> None:
    """Its client leaves while Whisper's first batch of its shards is held and more than another batch
    waits: its waiting shards leave the queue, the held call runs on (its results dropped), and no
    other shard of it runs, before every queue is empty or later."""
    with whisper_held(daemon):
        with send_transcription(daemon, twenty_minutes[1], TINY):  # closed: the client leaves
            wait_until(lambda: whisper_metric(unix, "appliance_queue_depth", TINY) > 2 * 8, "17 of its shards waiting")
            before = whisper_metric(unix, "nv_inference_count", TINY)  # a call counts its shards when it ends
        wait_until(lambda: whisper_metric(unix, "appliance_queue_depth", TINY) <= 8, "only the held call's shards")
    wait_until_idle(daemon)
    ran = whisper_metric(unix, "nv_inference_count", TINY) - before
    assert ran <= 8, f"{ran} shards ran after the client left (max_batch 8: the held call's)"
    assert whisper_metric(unix, "appliance_cancelled_work_total", TINY) > 0
    time.sleep(5.0)  # nothing of it comes back later (a VAD left cutting would send more shards)
    assert whisper_metric(unix, "nv_inference_count", TINY) - before == ran, (
        "shards of the abandoned recording ran later"
    )


def test_a_silent_live_stream_keeps_bounded_audio_at_any_age(daemon: Daemon, unix: Client) -> None:
    """Twenty minutes of near silence fed as fast as the answers come: the audio the stream keeps is
    bounded (test_live_units.py checks the bound after every chunk of an hour, in process), so the
    daemon does not grow with the stream's age: kept whole, the audio would be 77 MB."""
    chunk = (np.random.default_rng(3).standard_normal(CHUNK) * 1e-4).astype(np.float32)
    count = 20 * 60 * RATE // CHUNK
    grown_from = 0
    for i in range(count):
        if i == 220:  # after the first stretch: the engines' arenas have grown to what a chunk needs
            grown_from = daemon.rss_kib()
        out = unix.live(chunk, TINY, 90210, start=i == 0, end=i == count - 1)
        assert not len(out["text"]), out
    assert daemon.rss_kib() - grown_from < 32 << 10


def test_a_short_transcription_goes_before_a_long_recordings_queued_shards(
    daemon: Daemon, unix: Client, twenty_minutes: tuple[int, bytes]
) -> None:
    """A twenty-minute recording is cut whole while Whisper is held on its first batch (max_batch 8), so
    its other shards (some 30) wait when a one-sentence request comes: every request's first shard goes
    before anyone's next, so the sentence is answered after the held call and the next (16 shards, its
    own among them), not after the recording's queued shards."""
    length, body = twenty_minutes
    frames = vad_frames(unix)
    with whisper_held(daemon):
        sock = send_transcription(daemon, body, TINY)
        try:
            wait_until(lambda: vad_frames(unix) - frames >= -(-length // 512), "the recording cut whole")
            waiting = whisper_metric(unix, "appliance_queue_depth", TINY)
            assert waiting > 2 * 8, f"{waiting:.0f} shards of the recording: too few to show the order"
            before = whisper_metric(unix, "nv_inference_count", TINY)
            answer: list[str] = []
            with Client(str(daemon.socket), timeout=120) as short:
                asked = threading.Thread(
                    target=lambda: answer.append(
                        short.transcribe(encode_wav(say(CLEAR[0]), RATE), TINY, response_format="text").body.decode()
                    )
                )
                asked.start()
                wait_until(
                    lambda: whisper_metric(unix, "appliance_queue_depth", TINY) > waiting, "the sentence's shard queued"
                )
                daemon.whisper_hold.unlink()  # Whisper goes on
                asked.join(120)
            ran = whisper_metric(unix, "nv_inference_count", TINY) - before
            assert answer and wer(CLEAR[0], answer[0]) == 0.0, answer
            assert ran <= 2 * 8, f"{ran} shards ran before the short request's answer ({waiting:.0f} were waiting)"
            assert whisper_metric(unix, "appliance_queue_depth", TINY) > 0, "the recording was done first"
        finally:
            sock.close()  # the recording is abandoned: its shards leave the queue
    wait_until_idle(daemon)  # and the engine call under way ends before the next test (or the stop)

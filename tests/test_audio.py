"""Audio in: every accepted format through the real daemon's segments route and the CLI; broken input is a 4xx.

The variants are made from one espeak-ng recording with soundfile and soxr; each must give the segments
the same speech gives as 16 kHz mono PCM16 WAV.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator

import av
import numpy as np
import pytest
import soundfile as sf
import soxr
from conftest import cli
from speech import RATE, SENTENCES, recording

from appliance.audio import decode_audio, encode_wav
from appliance.client import Call, Client
from appliance.errors import ApiError

QUERY = {"min_silence_ms": 400}  # as in test_vad: pauses inside a sentence are speech
TOLERANCE_S = 0.05
WAVE_FORMAT_EXTENSIBLE = 0xFFFE
# name: (container, subtype, rate, channels)
VARIANTS = {
    "wav-pcm16-8k": ("WAV", "PCM_16", 8000, 1),
    "wav-pcm24-22k": ("WAV", "PCM_24", 22050, 1),
    "wav-pcm32-44k": ("WAV", "PCM_32", 44100, 1),
    "wav-float-48k": ("WAV", "FLOAT", 48000, 1),
    "wav-pcm16-16k-stereo": ("WAV", "PCM_16", 16000, 2),
    "wav-float-44k-stereo": ("WAV", "FLOAT", 44100, 2),
    "wavex-pcm24-48k-stereo": ("WAVEX", "PCM_24", 48000, 2),
    "wavex-float-16k": ("WAVEX", "FLOAT", 16000, 1),
    "flac-16-44k": ("FLAC", "PCM_16", 44100, 1),
    "flac-24-48k-stereo": ("FLAC", "PCM_24", 48000, 2),
    "ogg-vorbis-22k": ("OGG", "VORBIS", 22050, 1),
    "ogg-vorbis-44k-stereo": ("OGG", "VORBIS", 44100, 2),
    "ogg-opus-48k": ("OGG", "OPUS", 48000, 1),
}


def encode(audio: np.ndarray, container: str, subtype: str, rate: int, channels: int) -> bytes:
    """The 16 kHz recording as another file: resampled by soxr, written by libsndfile."""
    x = audio if rate == RATE else soxr.resample(audio, RATE, rate)
    if channels == 2:
        x = np.stack([x, 0.8 * x], axis=1)  # unequal channels, so the downmix is exercised
    buffer = io.BytesIO()
    sf.write(buffer, x, rate, format=container, subtype=subtype)
    return buffer.getvalue()


def streamed_sizes(wav: bytes) -> bytes:
    """The header espeak-ng --stdout and sox write to a pipe: RIFF and data sizes 'unknown' (0x7ffff000)."""
    data = wav.index(b"data")
    return wav[:4] + struct.pack("<I", 0x7FFFF024) + wav[8 : data + 4] + struct.pack("<I", 0x7FFFF000) + wav[data + 8 :]


def spans(result: dict) -> list[tuple[float, float]]:
    return [(s["start"], s["end"]) for s in result["segments"]]


def assert_same_segments(got: list[tuple[float, float]], want: list[tuple[float, float]]) -> None:
    assert len(got) == len(want), (got, want)
    for (start, end), (want_start, want_end) in zip(got, want):
        assert abs(start - want_start) <= TOLERANCE_S and abs(end - want_end) <= TOLERANCE_S, (got, want)


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return recording(SENTENCES)[0]


@pytest.fixture(scope="module")
def unix(daemon) -> Iterator[Client]:
    with daemon.client("unix") as c:
        yield c


@pytest.fixture(scope="module")
def reference(unix: Client, speech: np.ndarray) -> list[tuple[float, float]]:
    """The segments of the speech as 16 kHz mono PCM16 WAV, the format every variant is held to."""
    segments = spans(unix.segments(encode_wav(speech, RATE), **QUERY))
    assert len(segments) == len(SENTENCES), segments
    return segments


@pytest.mark.parametrize("name", VARIANTS)
def test_every_format_gives_the_segments_of_16k_pcm16(unix: Client, speech, reference, name: str) -> None:
    data = encode(speech, *VARIANTS[name])
    if VARIANTS[name][0] == "WAVEX":
        assert struct.unpack_from("<H", data, 20)[0] == WAVE_FORMAT_EXTENSIBLE  # the fmt chunk's format tag
    result = unix.segments(data, **QUERY)
    assert_same_segments(spans(result), reference)
    assert result["duration"] == pytest.approx(len(speech) / RATE, abs=TOLERANCE_S)


def test_wav_with_streamed_sizes_is_read_to_its_end(unix: Client, speech, reference) -> None:
    result = unix.segments(streamed_sizes(encode_wav(speech, RATE)), **QUERY)
    assert_same_segments(spans(result), reference)
    assert result["duration"] == pytest.approx(len(speech) / RATE, abs=0.001)


def _wav_with(wav: bytes, offset: int, fmt: str, value: int) -> bytes:
    return wav[:offset] + struct.pack(fmt, value) + wav[offset + struct.calcsize(fmt) :]


def broken_inputs() -> list[tuple[str, bytes, str]]:
    """(name, body, what the error must name). Offsets are those of the 44-byte header encode_wav writes."""
    wav = encode_wav(np.full(RATE, 0.1, np.float32), RATE)
    return [
        ("garbage", b"this is not audio at all\x00\x01\x02" * 64, "Format not recognised"),
        ("empty", b"", "the body is empty"),
        (
            "truncated-wav",
            wav[: len(wav) // 2],
            "truncated WAV: the 'data' chunk declares 32000 bytes, the body holds 15978",
        ),
        ("header-cut-to-43-bytes", wav[:43], "truncated WAV: the body ends inside a chunk header at byte 36"),
        (
            "chunk-past-riff-size",
            _wav_with(wav, 4, "<I", 100),
            "the 'data' chunk (32000 bytes at byte 36) runs past the RIFF size of 100 bytes",
        ),
        ("zero-channels", _wav_with(wav, 22, "<H", 0), "Channel count is zero"),
        ("absurd-rate", _wav_with(wav, 24, "<I", 1_000_000), "1000000 Hz is outside 8000 to 384000 Hz"),
        ("absurd-channels", _wav_with(wav, 22, "<H", 1000), "1000 channels (1 to 8 are accepted)"),
        (
            "unknown-container",
            encode(np.zeros(RATE, np.float32), "AIFF", "PCM_16", RATE, 1),
            "AIFF (Apple/SGI) is not an accepted container",
        ),
    ]


@pytest.mark.parametrize("name,body,reason", broken_inputs(), ids=[case[0] for case in broken_inputs()])
def test_broken_audio_is_a_one_line_400_and_the_daemon_keeps_serving(
    daemon, unix: Client, speech, reference, name: str, body: bytes, reason: str
) -> None:
    response = unix.send(Call("POST", "/v2/models/silero_vad/segments", body, (("content-type", "audio/wav"),)))
    assert response.status == 400, response.body
    error = response.json()["error"]
    assert "\n" not in error and error.startswith(f"audio not supported: {reason}; send WAV ("), error
    assert error.endswith("WebM (Opus, Vorbis) or MPEG audio"), error
    assert_same_segments(spans(unix.segments(encode_wav(speech, RATE), **QUERY)), reference)
    assert "Traceback" not in daemon.log.read_text()


def test_audio_longer_than_the_body_limit_could_hold_is_a_413_before_decoding(daemon, unix: Client) -> None:
    # The test daemon's limit is 8 MiB: 262 s of 16 kHz PCM16. Five minutes of silence is a small FLAC.
    flac = encode(np.zeros(300 * RATE, np.float32), "FLAC", "PCM_16", RATE, 1)
    assert len(flac) < 1 << 20
    response = unix.send(Call("POST", "/v2/models/silero_vad/segments", flac))
    assert response.status == 413, response.body
    assert response.json()["error"] == "audio too long: 300.0 s declared; at most 262.1 s is accepted"
    assert unix.health()["ready"]


def test_decoder_mutated_files_only_ever_raise_api_errors(speech) -> None:
    """Corrupt headers and bodies of every container: a 4xx or finite samples, never another exception."""
    short = speech[:RATE]
    bases = [
        encode(short, *spec)
        for spec in (
            ("WAV", "PCM_16", RATE, 1),
            ("WAVEX", "FLOAT", 44100, 2),
            ("FLAC", "PCM_16", RATE, 1),
            ("OGG", "VORBIS", RATE, 1),
            ("OGG", "OPUS", 48000, 1),
        )
    ]
    rng = np.random.default_rng(0)
    for i in range(1500):
        data = bytearray(bases[i % len(bases)])
        for _ in range(int(rng.integers(1, 8))):  # mostly in the header, where the lengths and formats are
            position = int(rng.integers(0, min(len(data), 64) if rng.random() < 0.6 else len(data)))
            data[position] = int(rng.integers(0, 256))
        if rng.random() < 0.2:
            data = data[: int(rng.integers(0, len(data)))]
        try:
            samples = decode_audio(bytes(data), RATE, max_seconds=10)
        except ApiError as exc:
            assert exc.status in (400, 413) and "\n" not in exc.message
        else:
            assert samples.dtype == np.float32 and samples.ndim == 1 and np.isfinite(samples).all()
            assert len(samples) <= 10 * RATE + 1


def test_cli_call_vad_and_probs_on_a_flac_file(daemon, speech, tmp_path) -> None:
    flac = tmp_path / "speech.flac"
    flac.write_bytes(encode(speech, "FLAC", "PCM_16", 44100, 2))
    result = json.loads(cli("call", "vad", flac, "--socket", daemon.socket).stdout)
    # the CLI sends the segments route's defaults; compare with the 16 kHz WAV under the same defaults
    with daemon.client("unix") as c:
        want = spans(c.segments(encode_wav(speech, RATE)))
    assert_same_segments(spans(result), want)
    probs = json.loads(cli("call", "probs", flac, "--socket", daemon.socket).stdout)
    assert abs(len(probs) - -(-len(speech) // 512)) <= 1 and max(probs) > 0.5


class _Pipe:
    """A write-only output, as a browser's MediaRecorder streams: a WebM muxer writes no duration to it."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)


def test_a_webm_that_declares_no_length_is_decoded_under_the_budget() -> None:
    pipe = _Pipe()
    with av.open(pipe, "w", format="webm") as container:
        stream = container.add_stream("libopus", rate=48000)
        stream.layout = "mono"
        resampler = av.AudioResampler(format="s16", layout="mono", rate=48000)
        frame = av.AudioFrame.from_ndarray(np.full((1, 5 * RATE), 0.1, np.float32), format="flt", layout="mono")
        frame.rate = RATE
        for piece in resampler.resample(frame) + resampler.resample(None):
            container.mux(stream.encode(piece))
        container.mux(stream.encode(None))
    webm = b"".join(pipe.parts)
    with av.open(io.BytesIO(webm)) as container:
        assert container.duration is None  # nothing to check before decoding
    assert len(decode_audio(webm, RATE, 10.0)) == 5 * RATE
    with pytest.raises(ApiError) as refused:
        decode_audio(webm, RATE, 2.0)
    assert refused.value.status == 413 and refused.value.message == (
        "audio too long: WebM/Matroska (opus) decodes to more than 2.0 s; at most 2.0 s is accepted"
    )

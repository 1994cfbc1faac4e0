"""Audio in: any accepted recording -> float32 mono at the model's rate; framing (pure functions).

One decoder serves every route that takes audio; the container is sniffed from the bytes, whatever
the content type says. libsndfile (the `soundfile` wheel) reads WAV, FLAC and Ogg, checked to the
chunk; FFmpeg's decoders (the `av` wheel, audio_av.py) read the rest of what OpenAI accepts: MP3,
MP4/M4A, WebM/Matroska, MPEG, and a stream whose header declares no length (a FLAC written to a
pipe, as the box's own speech is). soxr resamples. Both run block by block, so memory stays near the size
of the result, and a result too long is refused from the header (or, where none declares it, once
decoding passes the limit).
"""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import soundfile as sf
import soxr

from appliance import audio_av
from appliance.errors import ApiError, BadRequest

ACCEPTED = (
    "send WAV (PCM 8/16/24/32-bit or float, 8 to 384 kHz, 1 to 8 channels), FLAC, Ogg (Vorbis, Opus), "
    "MP3, MP4/M4A (AAC, ALAC), WebM (Opus, Vorbis) or MPEG audio"
)
CONTAINERS = frozenset({"WAV", "WAVEX", "FLAC", "OGG"})  # libsndfile's names; WAVEX is WAVE_FORMAT_EXTENSIBLE
FFMPEG_READS = frozenset({"MP3"})  # what libsndfile recognises but FFmpeg decodes here (its MP3 reader is younger)
MIN_RATE, MAX_RATE, MAX_CHANNELS = 8000, 384000, 8
BLOCK_FRAMES = 1 << 16  # per read: at most 8 channels x 64 Ki frames x 4 bytes = 2 MiB in flight
UNRECOGNISED = 1  # libsndfile's SF_ERR_UNRECOGNISED_FORMAT: the bytes are no container it knows
# libsndfile's count for a stream whose header gives no length (a FLAC streamed to a pipe, the box's
# own among them): libsndfile cannot read those to the end, FFmpeg does, under its budget of samples
UNKNOWN_FRAMES = 2**63 - 1
# A RIFF or data size this large is a writer's "length unknown" (sox, espeak-ng --stdout, ffmpeg to a
# pipe): the chunk runs to the end of the file. No body the daemon accepts comes near 2 GiB.
STREAMED_SIZE = 0x7FFFF000


def unsupported(reason: str) -> BadRequest:
    """The one-line 400 for audio we cannot use: what is wrong, then what is accepted."""
    return BadRequest(f"audio not supported: {' '.join(reason.split()).rstrip('.')}; {ACCEPTED}")


def decode_audio(data: bytes, sample_rate: int, max_seconds: float | None = None) -> np.ndarray:
    """An accepted recording -> float32 mono samples in [-1, 1] at `sample_rate`.

    Channels are averaged; other rates are resampled (soxr, high quality). Input that is not accepted
    audio, or is broken, is a 400 naming the problem; a header declaring more than `max_seconds` is a
    413 before anything is decoded."""
    if not data:
        raise unsupported("the body is empty")
    if _mpeg_audio(data):  # straight to FFmpeg: libsndfile's mpg123 would print its notes to stderr
        return audio_av.decode(data, sample_rate, max_seconds, unsupported, _check_format)
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.format not in FFMPEG_READS and f.frames != UNKNOWN_FRAMES:
                _check_header(f, data, max_seconds)
                return _read_mono(f, sample_rate)
    except sf.LibsndfileError as exc:
        if exc.code != UNRECOGNISED:
            raise unsupported(exc.error_string.removeprefix("Error : ")) from None
    return audio_av.decode(data, sample_rate, max_seconds, unsupported, _check_format)


def _mpeg_audio(data: bytes) -> bool:
    """An MP3's start: an ID3 tag, or an MPEG audio frame's 11-bit sync."""
    return data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0)


def _check_format(rate: int, channels: int) -> None:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise unsupported(f"{rate} Hz is outside {MIN_RATE} to {MAX_RATE} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise unsupported(f"{channels} channels (1 to {MAX_CHANNELS} are accepted)")


def _check_header(f: sf.SoundFile, data: bytes, max_seconds: float | None) -> None:
    if f.format not in CONTAINERS:
        raise unsupported(f"{f.format_info} is not an accepted container")
    _check_format(f.samplerate, f.channels)
    if f.format in ("WAV", "WAVEX"):
        _check_riff(data)  # libsndfile quietly reads what is there; a cut or overrun file is an error here
    seconds = f.frames / f.samplerate
    if max_seconds is not None and seconds > max_seconds:
        raise ApiError(f"audio too long: {seconds:.1f} s declared; at most {max_seconds:.1f} s is accepted", 413)


def _check_riff(data: bytes) -> None:
    """Every chunk of a WAV lies inside both the RIFF size and the body (libsndfile clips and goes on)."""
    order = ">" if data[:4] == b"RIFX" else "<"  # RIFX: the big-endian WAV
    (riff_size,) = struct.unpack(order + "I", data[4:8])
    riff_end = len(data) if riff_size >= STREAMED_SIZE else 8 + riff_size
    position = 12
    while position + 8 <= min(riff_end, len(data)):
        name = data[position : position + 4].decode("latin-1")
        (size,) = struct.unpack(order + "I", data[position + 4 : position + 8])
        end = position + 8 + size
        if name == "data" and size >= STREAMED_SIZE:
            end = min(riff_end, len(data))
        if end > riff_end:
            raise unsupported(
                f"the '{name}' chunk ({size} bytes at byte {position}) runs past the RIFF size of {riff_size} bytes"
            )
        if end > len(data):
            raise unsupported(
                f"truncated WAV: the '{name}' chunk declares {size} bytes, the body holds {len(data) - position - 8}"
            )
        position = end + (size & 1)  # chunks are padded to an even size
    if position < min(riff_end, len(data)):  # bytes left over that cannot hold a chunk's 8-byte header
        raise unsupported(f"truncated WAV: the body ends inside a chunk header at byte {position}")


def _read_mono(f: sf.SoundFile, sample_rate: int) -> np.ndarray:
    resampler = None if f.samplerate == sample_rate else soxr.ResampleStream(f.samplerate, sample_rate, 1)
    pieces, count = [], 0
    while count < f.frames:
        block = f.read(min(BLOCK_FRAMES, f.frames - count), dtype="float32", always_2d=True)
        if not len(block):
            raise unsupported(f"truncated {f.format}: it declares {f.frames} frames, holds {count}")
        count += len(block)
        if not np.isfinite(block).all():
            raise unsupported("samples that are not finite numbers")
        np.clip(block, -1.0, 1.0, out=block)  # float files may hold louder than full scale (and overflow a mean)
        mono = block[:, 0] if f.channels == 1 else block.mean(axis=1, dtype=np.float32)
        pieces.append(mono if resampler is None else resampler.resample_chunk(mono))
    if resampler is not None:
        pieces.append(resampler.resample_chunk(np.zeros(0, np.float32), last=True))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """float32 samples -> PCM16 mono WAV bytes (the tests and the GPU checks send these)."""
    pcm = to_pcm16(samples)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return buffer.getvalue()


def to_frames(samples: np.ndarray, frame_samples: int) -> np.ndarray:
    """[n] samples -> [ceil(n / frame), frame], the last frame zero-padded."""
    count = -(-len(samples) // frame_samples)
    frames = np.zeros((count, frame_samples), np.float32)
    frames.reshape(-1)[: len(samples)] = samples
    return frames


class StreamResampler:
    """Live audio from one rate to another, piece by piece (soxr keeps the filter's state between
    pieces, so the joins are seamless); `flush` gives what the filter still holds."""

    def __init__(self, from_rate: int, to_rate: int) -> None:
        self._soxr = None if from_rate == to_rate else soxr.ResampleStream(from_rate, to_rate, 1, dtype="float32")

    def feed(self, samples: np.ndarray) -> np.ndarray:
        return samples if self._soxr is None else self._soxr.resample_chunk(samples)

    def flush(self) -> np.ndarray:
        return (
            np.zeros(0, np.float32)
            if self._soxr is None
            else self._soxr.resample_chunk(np.zeros(0, np.float32), last=True)
        )


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """A whole clip at another rate."""
    resampler = StreamResampler(from_rate, to_rate)
    return np.concatenate([resampler.feed(samples), resampler.flush()])


def pcm16(data: bytes) -> np.ndarray:
    """Little-endian PCM16 bytes -> float32 samples in [-1, 1)."""
    if len(data) % 2:
        raise BadRequest(f"PCM16 audio has 2 bytes a sample; got {len(data)} bytes")
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def to_pcm16(samples: np.ndarray) -> bytes:
    """float32 samples -> little-endian PCM16 bytes (clipped)."""
    return int16_samples(samples).astype("<i2").tobytes()


def int16_samples(samples: np.ndarray) -> np.ndarray:
    """float32 samples in [-1, 1) -> int16 (clipped): audio held at half float32's bytes."""
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)

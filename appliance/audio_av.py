"""Audio in through FFmpeg's demuxers and decoders (the `av` wheel carries them): the containers
OpenAI accepts that libsndfile does not read (MP3, MP4/M4A, WebM/Matroska, MPEG) -> float32 mono.

Bounded as audio.py is: only the containers and codecs named here are opened; a declared duration
longer than the limit is a 413 before any packet is decoded; a stream that declares none (a browser's
MediaRecorder WebM) is decoded under a budget of samples and packets and refused once it runs past it.
Every refusal names the container and the codec.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator

import av
import av.error
import numpy as np
import soxr

from appliance.errors import ApiError, BadRequest

# FFmpeg's demuxer names -> what a user calls them (OpenAI's list: mp3, mp4, mpeg, mpga, m4a, ogg, wav, webm, flac)
CONTAINERS = {
    "mp3": "MP3",
    "mov,mp4,m4a,3gp,3g2,mj2": "MP4/M4A",
    "matroska,webm": "WebM/Matroska",
    "mpeg": "MPEG",
    "ogg": "Ogg",
    "wav": "WAV",
    "flac": "FLAC",
    "aac": "AAC (ADTS)",  # not in OpenAI's list, but what many phones' recorders write
}
CODECS = {"mp3", "mp3float", "mp2", "mp2float", "aac", "opus", "vorbis", "flac", "alac"} | {
    f"pcm_{kind}" for kind in ("s16le", "s16be", "s24le", "s32le", "f32le", "f64le", "u8", "alaw", "mulaw")
}
MIN_PACKET_SECONDS = 0.0025  # the shortest frame of these codecs (Opus's 2.5 ms): the packet budget's unit
PROBE_BYTES = 1 << 20  # how far FFmpeg may read to find the streams


def decode(
    data: bytes,
    sample_rate: int,
    max_seconds: float | None,
    unsupported: Callable[[str], BadRequest],
    check_format: Callable[[int, int], None],
) -> np.ndarray:
    """A recording in one of CONTAINERS -> float32 mono samples in [-1, 1] at `sample_rate`.
    `unsupported` makes the one-line 400; `check_format(rate, channels)` refuses what audio.py refuses."""
    try:
        container = av.open(io.BytesIO(data), "r", options={"probesize": str(PROBE_BYTES)}, metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError):
        raise unsupported("Format not recognised") from None
    with container:
        name = CONTAINERS.get(container.format.name)
        if name is None:
            raise unsupported(f"{container.format.long_name} is not an accepted container")
        if not container.streams.audio:
            raise unsupported(f"the {name} file holds no audio stream")
        stream = container.streams.audio[0]
        codec = stream.codec_context.name
        where = f"{name} ({codec})"
        if codec not in CODECS:
            raise unsupported(f"{where}: the codec {stream.codec_context.codec.long_name} is not accepted")
        check_format(stream.codec_context.sample_rate, stream.codec_context.channels)
        declared = container.duration / av.time_base if container.duration else None
        if max_seconds is not None and declared is not None and declared > max_seconds:
            raise _too_long(f"{declared:.1f} s declared", max_seconds)
        try:
            return _read_mono(_frames(container, stream, max_seconds, where), stream.codec_context, sample_rate)
        except av.error.FFmpegError as exc:
            raise unsupported(f"{where}: {' '.join(str(exc.strerror).split())}") from None
        except _Refused as exc:
            raise unsupported(f"{where}: {exc}") from None


class _Refused(Exception):
    """What is wrong with the decoded stream; decode() names the container and codec."""


def _frames(
    container: av.container.InputContainer, stream: av.audio.stream.AudioStream, max_seconds: float | None, where: str
) -> Iterator[np.ndarray]:
    """Each decoded frame as float32 [samples, channels], until the budget of samples or packets is spent."""
    rate = stream.codec_context.sample_rate
    budget = None if max_seconds is None else int(max_seconds * rate)
    packets_left = None if max_seconds is None else int(max_seconds / MIN_PACKET_SECONDS) + 64
    decoded = 0
    for packet in container.demux(stream):
        if packets_left is not None:
            packets_left -= 1
            if packets_left < 0:
                raise _Refused(f"more packets than {max_seconds:.1f} s of audio can hold")
        for frame in packet.decode():
            samples = _interleaved(frame)
            decoded += len(samples)
            if max_seconds is not None and budget is not None and decoded > budget:
                raise _too_long(f"{where} decodes to more than {max_seconds:.1f} s", max_seconds)
            yield samples


def _interleaved(frame: av.AudioFrame) -> np.ndarray:
    """A frame's samples as float32 [samples, channels], whatever its sample format."""
    array = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if frame.format.is_planar:
        array = array.T
    else:
        array = array.reshape(-1, channels)
    kind = array.dtype
    if kind.kind == "f":
        return array.astype(np.float32, copy=False)
    if kind == np.uint8:
        return (array.astype(np.float32) - 128.0) / 128.0
    return array.astype(np.float32) / float(2 ** (8 * kind.itemsize - 1))


def _read_mono(
    frames: Iterator[np.ndarray], codec: av.audio.codeccontext.AudioCodecContext, sample_rate: int
) -> np.ndarray:
    resampler = None if codec.sample_rate == sample_rate else soxr.ResampleStream(codec.sample_rate, sample_rate, 1)
    pieces = []
    for block in frames:
        if not np.isfinite(block).all():
            raise _Refused("samples that are not finite numbers")
        np.clip(block, -1.0, 1.0, out=block)
        mono = block[:, 0].copy() if block.shape[1] == 1 else block.mean(axis=1, dtype=np.float32)
        pieces.append(mono if resampler is None else resampler.resample_chunk(mono))
    if resampler is not None:
        pieces.append(resampler.resample_chunk(np.zeros(0, np.float32), last=True))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def _too_long(what: str, max_seconds: float) -> ApiError:
    return ApiError(f"audio too long: {what}; at most {max_seconds:.1f} s is accepted", 413)


# OpenAI's compressed speech formats: (muxer, encoder, rate: None keeps the voice's, Opus takes 48 kHz;
# bits per second for mono speech: transparent for a 22 kHz voice, about OpenAI's sizes; FLAC is lossless).
# Written to a stream that cannot seek, FLAC's STREAMINFO keeps 0 samples: "length unknown".
ENCODINGS = {
    "mp3": ("mp3", "libmp3lame", None, 64000),
    "opus": ("ogg", "libopus", 48000, 32000),
    "aac": ("adts", "aac", None, 64000),
    "flac": ("flac", "flac", None, 0),
}


class Encoder:
    """16-bit mono samples in, piece by piece, and the encoded file's bytes out as the muxer writes
    them, so an answer streams as it is synthesized. `finish` flushes the encoder and the container."""

    def __init__(self, audio_format: str, sample_rate: int) -> None:
        muxer, codec, rate, bit_rate = ENCODINGS[audio_format]
        self.sample_rate = sample_rate
        self._written: list[bytes] = []
        self._container = av.open(self, "w", format=muxer)
        stream = self._container.add_stream(codec, rate=rate or sample_rate)
        assert isinstance(stream, av.audio.stream.AudioStream)
        stream.layout = "mono"
        stream.bit_rate = bit_rate
        self._stream = stream
        context = stream.codec_context
        self._resampler = av.AudioResampler(
            format=context.format.name, layout="mono", rate=context.sample_rate, frame_size=context.frame_size or None
        )

    def write(self, data: bytes) -> int:
        """The container's output (it writes here, as to a file)."""
        self._written.append(bytes(data))
        return len(data)

    def encode(self, samples: np.ndarray) -> bytes:
        frame = av.AudioFrame.from_ndarray(samples.astype("<i2").reshape(1, -1), format="s16", layout="mono")
        frame.rate = self.sample_rate
        return self._mux(self._resampler.resample(frame))

    def finish(self) -> bytes:
        tail = self._mux(self._resampler.resample(None), flush=True)
        self._container.close()
        return tail + self._take()

    def _mux(self, frames: list[av.AudioFrame], flush: bool = False) -> bytes:
        for frame in [*frames, None] if flush else frames:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        return self._take()

    def _take(self) -> bytes:
        out, self._written = b"".join(self._written), []
        return out

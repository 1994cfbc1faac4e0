"""A Wyoming stream's audio in: 16-bit PCM of 1 to 8 channels at 8 to 192 kHz, as its audio-start (or
first chunk) gives it, made 16 kHz mono piece by piece for the box's models; and a recording's audio
held until it is transcribed, bounded in length and held against the daemon's byte budget."""

from __future__ import annotations

import numpy as np
from wyoming.audio import AudioChunk, AudioStart

from appliance.api.wyoming_codec import WyomingError
from appliance.audio import StreamResampler, int16_samples, pcm16, to_pcm16
from appliance.errors import BadRequest
from appliance.protocol.limits import ByteBudget, Held

SAMPLE_RATE = 16000
MIN_RATE, MAX_RATE, MAX_CHANNELS = 8000, 192000, 8  # the PCM a recording may come as


class PcmIn:
    """One stream's chunks -> 16 kHz mono float32, in the format its first event gave."""

    def __init__(self, first: AudioStart | AudioChunk, event: str) -> None:
        self.format = pcm_format(first, event)
        self.resampler = StreamResampler(self.format[0], SAMPLE_RATE)
        self.partial_frame = b""  # a chunk's bytes that end inside a sample frame: the next chunk's start

    def feed(self, chunk: AudioChunk) -> np.ndarray:
        rate, channels = pcm_format(chunk, "audio-chunk")
        if (rate, channels) != self.format:  # the resampler and the frames are the stream's
            raise BadRequest(
                f"audio-chunk: rate {rate} and channels {channels} differ from audio-start's "
                f"({self.format[0]}, {self.format[1]})"
            )
        data = self.partial_frame + chunk.audio
        whole = len(data) - len(data) % (2 * channels)
        samples, self.partial_frame = pcm16(data[:whole]), data[whole:]
        if channels > 1:
            samples = samples.reshape(-1, channels).mean(axis=1, dtype=np.float32)
        return self.resampler.feed(samples)

    def feed_pcm16(self, chunk: AudioChunk) -> bytes:
        """The same as 16 kHz PCM16 bytes: a satellite's own format passes as it came."""
        whole = not self.partial_frame and len(chunk.audio) % 2 == 0
        if whole and self.format == (SAMPLE_RATE, 1) and pcm_format(chunk, "audio-chunk") == self.format:
            return chunk.audio
        return to_pcm16(self.feed(chunk))

    def flush(self) -> np.ndarray:
        return self.resampler.flush()


def pcm_format(audio: AudioStart | AudioChunk, event: str) -> tuple[int, int]:
    """An audio event's rate and channels, where it is PCM the box takes: 16-bit, 1 to 8 channels, 8 to
    192 kHz (a chunk of 0 channels has no frames, one of a billion holds every byte back)."""
    fields = {"rate": audio.rate, "width": audio.width, "channels": audio.channels}
    if (
        not all(type(value) is int for value in fields.values())
        or audio.width != 2
        or not 1 <= audio.channels <= MAX_CHANNELS
        or not MIN_RATE <= audio.rate <= MAX_RATE
    ):
        given = ", ".join(f"{name} {str(value)[:20]}" for name, value in fields.items())
        raise BadRequest(
            f"{event}: send 16-bit PCM (width 2), 1 to {MAX_CHANNELS} channels, {MIN_RATE // 1000} to "
            f"{MAX_RATE // 1000} kHz; got {given}"
        )
    return audio.rate, audio.channels


class Recording:
    """A recording's 16 kHz samples as they arrive, kept as PCM16 (half float32's bytes): at most
    `max_samples` (the API's body as PCM16), each piece held against `budget` (server.max_buffered_bytes,
    shared with the API's request bodies) until release(): transcribed, replaced, or its connection
    gone. Past either bound it is refused whole."""

    def __init__(self, max_samples: int, budget: ByteBudget) -> None:
        self.max_samples, self.held = max_samples, Held(budget)
        self.pieces: list[np.ndarray] = []
        self.samples = 0

    def add(self, samples: np.ndarray) -> None:
        if self.samples + len(samples) > self.max_samples:
            raise WyomingError(
                f"recording over {self.max_samples / SAMPLE_RATE:.0f} s: send shorter ones", "recording_too_long"
            )
        kept = int16_samples(samples)
        if why := self.held.take(kept.nbytes):
            raise WyomingError(f"{why} (server.max_buffered_bytes); retry later", "max_buffered_bytes")
        self.samples += len(kept)
        self.pieces.append(kept)

    def audio(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Its samples from `start` to `end`, float32 as the models hear them."""
        kept = np.concatenate(self.pieces) if self.pieces else np.zeros(0, np.int16)
        samples = kept[start:end].astype(np.float32)
        samples *= 1 / 32768  # in place: a long recording's float32 copy is made once
        return samples

    def release(self) -> None:
        self.held.give_all()
        self.samples = 0
        self.pieces.clear()

"""Recordings heard as they arrive and transcribed at their end (Wyoming's): transcribed ahead once
their speech so far is final, so the text is ready when the client stops (`Heard`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

import numpy as np

from appliance.audio import to_frames
from appliance.config import Live
from appliance.engine.stats import RequestTimes
from appliance.errors import ApiError
from appliance.kinds.capabilities import VoiceHeard
from appliance.kinds.segments import SegmentTracker
from appliance.kinds.speech_api import SAMPLE_RATE, Options, Segment
from appliance.kinds.streaming import whole
from appliance.kinds.vad import VadModel

log = logging.getLogger("appliance")

# how far a recording may run ahead of the clock and still be heard as it arrives (a client's buffering;
# one sent faster is an upload, transcribed whole at its end), and how far behind (a client that stops
# sending, or a box too busy to read it, is not heard further)
HEARD_AHEAD_S, HEARD_BEHIND_S = 1.0, 2.0
# the audio gathered for each VAD call while hearing (whole frames of it): Home Assistant's chunks
# are as short as 10 ms, and a call per frame would cost the loop more than hearing saves
HEARD_HOP = SAMPLE_RATE // 10
# the silence after the last segment's padding that starts the transcription ahead: early, as speech
# after it only drops it (Home Assistant stops recording after 0.7 s of silence, and a window takes a
# small CPU about a second; with 0.3 s audio-stop to transcript p50 was 590 ms, with 0.1 s 409-453 ms)
HEARD_SILENCE = int(0.1 * SAMPLE_RATE)
# recordings heard at once: per client (a satellite streams one at a time), and in all a share
# (max_live / 16) of the VAD's sequence table, which live streams need (one not heard loses no text)
HEARD_PER_CLIENT, HEARD_TABLE_SHARE = 2, 16
_heard_keys = itertools.count()


class Listener(Protocol):
    """What a recording heard needs of its speech model (SpeechToText)."""

    vad: VadModel
    live: Live
    clock: Callable[[], float]

    def transcribe(
        self, samples: np.ndarray, options: Options, times: RequestTimes | None = None
    ) -> AsyncGenerator[Segment, None]:
        """A recording's segments."""
        ...


class Heard:
    """A recording that arrives as it is spoken (a voice assistant's microphone over Wyoming) and is
    transcribed at its end. While it comes at the pace of speech, the VAD hears it as it arrives (a
    sequence of its own, the config's [vad] rules); once every segment heard is final (released: no
    speech since, and its padding heard), the recording so far is transcribed ahead. At the end, where
    no speech came after, that is the recording's text: the same segments the whole recording would
    give, ready when the client asks (it stops only after some silence of its own). Else, and for a
    recording sent faster or slower than it is spoken or longer than one VAD shard (where the whole
    recording's VAD pass is no longer one sequence as the hearing is), the whole recording is
    transcribed at its end."""

    def __init__(self, model: Listener, options: Options, client: str) -> None:
        self.model, self.options, self.client = model, options, client
        vad = model.vad
        self.frame = vad.frames.frame_samples
        self.longest = vad.baked.max_tokens_per_shard * self.frame
        self.tracker = SegmentTracker(self.frame, vad.frames.sample_rate, model.live.config.vad)
        self.key = ("heard", next(_heard_keys))
        self.began = model.clock()
        self.audio: list[np.ndarray] = []  # while it is heard
        self.received = 0  # samples
        self.unheard = np.empty(0, np.float32)  # what the VAD has not taken yet
        self.through_vad = 0  # samples the VAD heard
        self.released = 0  # segments the tracker released
        self.spoken_to = 0  # the end of the last one (padded)
        self.listening = True
        self.ahead: tuple[int, asyncio.Task[list[Segment]]] | None = None  # (segments released, its text)

    async def feed(self, samples: np.ndarray) -> None:
        self.received += len(samples)
        if not self.listening:
            return
        spoken = self.model.clock() - self.began
        if not -HEARD_BEHIND_S <= self.received / SAMPLE_RATE - spoken <= HEARD_AHEAD_S or self.received > self.longest:
            self.close()  # not a microphone at the pace of speech, or too long: its end comes as it will
            return
        self.audio.append(samples)
        pending = np.concatenate([self.unheard, samples])
        whole_frames = len(pending) // self.frame * self.frame if len(pending) >= HEARD_HOP else 0
        self.unheard = pending[whole_frames:]
        if not whole_frames:
            return
        if self.through_vad == 0 and not self._may_open():
            self.close()
            return
        if not await self._hear(pending[:whole_frames]):
            return
        if self.tracker.speaking:
            self._drop_ahead()  # the text ahead has not heard this
        elif (
            self.released
            and self.tracker.settled
            and self.through_vad - self.spoken_to >= HEARD_SILENCE
            and self.ahead is None
        ):
            so_far = np.concatenate(self.audio)
            task = asyncio.get_running_loop().create_task(
                whole(self.model.transcribe(so_far, self.options)), name="heard-ahead"
            )
            self.ahead = (self.released, task)

    async def segments(self, samples: np.ndarray) -> AsyncGenerator[Segment, None]:
        ahead = await self._made_ahead(samples)
        self.close()
        if ahead is not None:
            try:
                segments = await ahead
            except ApiError:
                segments = None  # it failed late (a full queue): the whole recording, as without
            finally:
                ahead.cancel()  # where the client left first; done, it is a no-op
            if segments is not None:
                for segment in segments:
                    yield segment
                return
        async with contextlib.aclosing(self.model.transcribe(samples, self.options)) as found:
            async for segment in found:
                yield segment

    def voice(self) -> VoiceHeard:
        tracker = self.tracker  # a released segment ends its padding after the speech
        speech_to = max(0, self.spoken_to - tracker.pad) if self.released else 0
        return VoiceHeard(self.listening, tracker.open_start if tracker.speaking else None, speech_to, self.through_vad)

    def close(self) -> None:
        self._drop_ahead()
        if self.listening:
            self.model.vad.sequences.end(self.key)
        self.listening, self.audio, self.unheard = False, [], np.empty(0, np.float32)

    async def _made_ahead(self, samples: np.ndarray) -> asyncio.Task[list[Segment]] | None:
        """The transcription ahead, where it has every segment the whole recording (`samples`) has:
        the rest of it heard as the whole recording's VAD pass hears it (the last frame zero-padded)."""
        if not self.listening or self.ahead is None:
            return None
        rest = samples[self.through_vad :]
        if len(rest) and not await self._hear(to_frames(rest, self.frame).reshape(-1)):
            return None
        self.released += len(self.tracker.finish(len(samples)))
        released, task = self.ahead
        if released != self.released or (task.done() and (task.cancelled() or task.exception())):
            return None
        self.ahead = None  # taken: its failure is the awaiter's to report
        return task

    async def _hear(self, frames: np.ndarray) -> bool:
        """Whole frames through the VAD and the tracker; False where the VAD refused (no longer heard)."""
        try:
            probs, _ = await self.model.vad.infer_stream(frames, self.key, self.through_vad == 0, False, self.client)
        except ApiError:  # an engine error, or its sequence expired: transcribed at the end only
            self.close()
            return False
        self.through_vad += len(frames)
        if released := self.tracker.feed(probs):
            self.released += len(released)
            self.spoken_to = released[-1][1]
            self._drop_ahead()  # made before these segments
        return True

    def _may_open(self) -> bool:
        """Room for one more recording heard: this client's and all clients' share of the VAD's table."""
        table = self.model.vad.sequences
        return (
            table.count("heard", self.client) < HEARD_PER_CLIENT
            and table.count("heard") < table.max_live // HEARD_TABLE_SHARE
        )

    def _drop_ahead(self) -> None:
        if self.ahead is not None:
            drop(self.ahead[1])
            self.ahead = None


def drop(task: asyncio.Task[list[Segment]]) -> None:
    """A decode beside a stream that nobody will await: cancelled, and where it failed before, logged
    (consume_error). One that is taken is awaited instead, so each failure is reported once."""
    task.cancel()
    task.add_done_callback(consume_error)


def consume_error(task: asyncio.Task[list[Segment]]) -> None:
    """A decode started ahead or behind a stream (its text so far) that nobody may await any more: its
    refusal (a full queue, an expired sequence) is the client's to see at the stream's end; any other
    failure is ours, logged with its traceback."""
    if task.cancelled():
        return
    error = task.exception()
    if error is not None and not isinstance(error, ApiError):
        log.error("a decode run beside its stream (%s) failed", task.get_name(), exc_info=error)

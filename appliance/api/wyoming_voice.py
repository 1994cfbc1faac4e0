"""Wyoming's voice activity and streamed transcript on one transcription stream, from what the box's
VAD hears of it as it arrives (Heard, kinds/heard.py: Silero on the recording at the pace of speech):

    voice-started   where the speech begins (ms from audio-start), once it is long enough to be kept
    voice-stopped   where it ended, once STOP_SILENCE of silence followed (Home Assistant's default
                    end of a command), and at audio-stop where it was still going on
    transcript-start, transcript-chunk
                    while the speech still comes: the recording from its first speech decoded again
                    after each PARTIAL_GAP of speech, behind the stream, its words let through by local
                    agreement (api/agreement.py, as Realtime's deltas)
    at audio-stop   the final decode's words past those already sent, as chunks; transcript-stop; the
                    transcript: the words streamed, then the rest of the final decode (a word sent is
                    never taken back, so the chunks joined are always the transcript's start)

A recording sent faster or slower than it is spoken is not heard as it arrives: no voice events, and
its transcript streams at audio-stop only, a chunk per segment as it is decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

import numpy as np
from wyoming.asr import Transcript, TranscriptChunk, TranscriptStart, TranscriptStop
from wyoming.event import Event
from wyoming.vad import VoiceStarted, VoiceStopped

from appliance.api.agreement import LocalAgreement
from appliance.api.wyoming_audio import SAMPLE_RATE, Recording
from appliance.kinds.capabilities import HeardRecording
from appliance.kinds.heard import consume_error
from appliance.kinds.speech_api import Segment
from appliance.kinds.streaming import whole

STOP_SILENCE = int(0.7 * SAMPLE_RATE)
PARTIAL_GAP = SAMPLE_RATE  # speech heard between two decodes of the text so far
PARTIAL_PAD = int(0.2 * SAMPLE_RATE)  # of silence before the first speech, in each decode of it
# the longest recording streamed while it is spoken: one Whisper window (its text so far is then one
# decode); past it the rest of the text comes at audio-stop
MAX_PARTIAL = 30 * SAMPLE_RATE
Send = Callable[[Event], Awaitable[None]]
Transcribe = Callable[[np.ndarray], AsyncGenerator[Segment, None]]


def ms(samples: int) -> int:
    return samples * 1000 // SAMPLE_RATE


class Follower:
    """One transcription stream's voice events and streamed text. `recording`: the recording so far
    (the handler's); `transcribe`: its model's transcription with the stream's options.
    Without `heard` (a recording not heard as it arrives), only its transcript at audio-stop."""

    def __init__(
        self, heard: HeardRecording | None, recording: Recording, transcribe: Transcribe | None = None
    ) -> None:
        self.heard, self.recording, self.transcribe = heard, recording, transcribe
        self.agreement = LocalAgreement()
        self.in_voice, self.first_speech, self.speech_to, self.silent = False, -1, 0, True
        self.started = False  # transcript-start sent
        self.partial: asyncio.Task[list[Segment]] | None = None
        self.partial_to = 0  # where the last decode of the text so far ended

    def heard_more(self, language: str | None) -> list[Event]:
        """After each chunk the VAD heard: the events it makes."""
        voice = self.heard.voice() if self.heard is not None else None
        if voice is None or not voice.listening:
            self.close()
            return []
        events: list[Event] = []
        if voice.speech_from is not None:
            if not self.in_voice:
                self.in_voice = True
                events.append(VoiceStarted(timestamp=ms(voice.speech_from)).event())
            if self.first_speech < 0:
                self.first_speech = voice.speech_from
        elif self.in_voice and voice.speech_to and voice.heard - voice.speech_to >= STOP_SILENCE:
            self.in_voice = False
            events.append(VoiceStopped(timestamp=ms(voice.speech_to)).event())
        self.speech_to, self.silent = voice.speech_to, voice.speech_from is None
        if self.partial is not None and self.partial.done():
            task, self.partial = self.partial, None
            if not task.cancelled() and task.exception() is None:
                events += self._chunk(self.agreement.hear(" ".join(s.text.strip() for s in task.result())), language)
        due = max(self.first_speech, self.partial_to) + PARTIAL_GAP
        speaking = voice.speech_from is not None and self.transcribe is not None
        if speaking and self.partial is None and due <= voice.heard <= MAX_PARTIAL:
            assert self.transcribe is not None
            audio = self.recording.audio(max(0, self.first_speech - PARTIAL_PAD), voice.heard)
            self.partial = asyncio.get_running_loop().create_task(whole(self.transcribe(audio)), name="wyoming-partial")
            self.partial.add_done_callback(consume_error)
            self.partial_to = voice.heard
        return events

    def _chunk(self, text: str, language: str | None) -> list[Event]:
        if not text:
            return []
        events = [] if self.started else [TranscriptStart(language=language).event()]
        self.started = True
        return [*events, TranscriptChunk(text=text).event()]

    async def finish(self, segments: AsyncGenerator[Segment, None], send: Send, language: str | None) -> None:
        """audio-stop: voice-stopped where no silence ended the speech yet, then the transcript: the
        final decode's words past those streamed, each segment's as it is decoded."""
        self.close()
        if self.in_voice:  # where it ended, or the recording's end where it was still going on
            end = self.speech_to if self.silent else self.recording.samples
            await send(VoiceStopped(timestamp=ms(end)).event())
        if not self.started:
            await send(TranscriptStart(language=language).event())
        sent, final = list(self.agreement.sent), []
        out = len(sent)  # words sent as chunks
        spoken: dict[str, float] = {}  # seconds of speech in each language identified
        async with contextlib.aclosing(segments) as found:
            async for segment in found:
                final += segment.text.split()
                spoken[segment.language] = spoken.get(segment.language, 0.0) + segment.end - segment.start
                if new := final[out:]:
                    await send(TranscriptChunk(text=(" " if out else "") + " ".join(new)).event())
                    out += len(new)
        await send(TranscriptStop().event())
        # none named: the language identified in most of the speech (a segment each, speech_languages.py)
        heard_in = language or max(spoken, key=spoken.__getitem__, default=None)
        await send(Transcript(text=" ".join(sent + final[len(sent) :]), language=heard_in).event())

    def close(self) -> None:
        if self.partial is not None:
            self.partial.cancel()
            self.partial = None

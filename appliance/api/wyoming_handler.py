"""One Wyoming client's events answered as the protocol says (transport/wyoming_server.py serves the connection):
describe, transcription of a recording as it arrives, synthesis whole or streamed, ping.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np
from wyoming.asr import Transcribe
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.event import Event
from wyoming.info import AsrModel, AsrProgram, Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)
from wyoming.wake import Detect

from appliance import __version__
from appliance.api.openai_speech import voice_for_text
from appliance.api.wyoming_audio import PcmIn, Recording
from appliance.api.wyoming_codec import WyomingError
from appliance.api.wyoming_events import read_as
from appliance.api.wyoming_noise import denoiser
from appliance.api.wyoming_voice import Follower
from appliance.api.wyoming_wake import WakeListening, wake_programs
from appliance.denoise import Denoiser
from appliance.errors import ApiError, BadRequest
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import HeardRecording, LiveTranscriber, Speaker, WakeWordDetector
from appliance.kinds.counting import recorded
from appliance.kinds.speech_api import MIN_SAMPLES, Options
from appliance.kinds.text import MAX_TEXT_CHARS, ArrivingText, checked_text
from appliance.protocol.limits import ByteBudget

# who made the models and voices Home Assistant lists: its voice settings show these beside them
MADE_BY = {
    "speech_to_text": Attribution(name="OpenAI Whisper", url="https://github.com/openai/whisper"),
    "speech_synthesis": Attribution(name="Piper", url="https://github.com/rhasspy/piper"),
    "kokoro_speech": Attribution(name="Kokoro-82M", url="https://huggingface.co/hexgrad/Kokoro-82M"),
}
Send = Callable[[Event], Awaitable[None]]
Observe = Callable[[str, float], None]  # a model's transcript made, and how long after audio-stop (s)


class WyomingHandler:
    """One client's connection: events in order, each answered as the protocol says."""

    def __init__(
        self, models: dict[str, ServedModel], max_samples: int, budget: ByteBudget, client: str, observe: Observe
    ) -> None:
        self.models, self.client, self.observe = models, client, observe
        self.max_samples, self.budget = max_samples, budget  # a recording's bounds (wyoming_audio.Recording)
        self.wake_words = [m for m in models.values() if isinstance(m, WakeWordDetector)]
        self.wake: WakeListening | None = None  # between detect and audio-stop: the audio is heard for wake words
        self.speech = [m for m in models.values() if isinstance(m, LiveTranscriber)]
        self.voices = [m for m in models.values() if isinstance(m, Speaker)]
        self.transcribe: Transcribe | None = None
        self.recording: Recording | None = None  # while one arrives: its 16 kHz samples
        self.pcm: PcmIn | None = None  # the recording's audio in, as its audio-start gave it
        self.denoiser: Denoiser | None = None  # where the transcribe event's context asks (wyoming_noise.py)
        self.heard: HeardRecording | None = None  # the recording, heard as it arrives
        self.follower: Follower | None = None  # and its voice events and text so far (wyoming_voice.py)
        self.synthesis: ArrivingText | None = None  # streamed synthesis: its text not spoken yet
        self.synthesis_voice: SynthesizeVoice | None = None  # and the voice its start named
        self.synthesis_audio = False  # and whether its audio-start was sent

    def idle(self) -> bool:
        """Nothing under way but listening: no recording arriving, no synthesis streamed in."""
        return self.recording is None and self.synthesis is None

    def info(self) -> Info:
        return Info(
            asr=[self._asr()] if self.speech else [],
            tts=[self._tts()] if self.voices else [],
            wake=wake_programs(self.wake_words),
        )

    def _asr(self) -> AsrProgram:
        return AsrProgram(
            name="appliance-asr",
            description="Whisper behind the box's VAD, batched across clients",
            **_installed(*(m.spec.kind for m in self.speech)),
            models=[
                AsrModel(name=m.name, description=m.name, **_installed(m.spec.kind), languages=m.languages)
                for m in self.speech
            ],
            supports_transcript_streaming=True,
        )

    def _tts(self) -> TtsProgram:
        return TtsProgram(
            name="appliance-tts",
            description="the box's voices (Piper, Kokoro), batched across clients",
            **_installed(*(m.spec.kind for m in self.voices)),
            voices=[
                TtsVoice(
                    name=v.name,
                    description=f"{v.name} ({v.language}, model {m.name})",
                    **_installed(m.spec.kind),
                    languages=[v.language],
                )
                for m in self.voices
                for v in m.voices.values()
            ],
            supports_synthesize_streaming=True,
        )

    async def handle(self, event: Event, send: Send) -> list[Event]:
        """The answers to one event, sent in order after those `send` streamed (speech as it is made)."""
        if Describe.is_type(event.type):
            return [self.info().event()]
        if Transcribe.is_type(event.type):
            self.transcribe = read_as(Transcribe.from_event, event)
            self.close()  # a recording under way was heard for other options
            return []
        if Detect.is_type(event.type):
            self.close()
            self.wake = WakeListening(self.wake_words, read_as(Detect.from_event, event))
            return []
        if self.wake is not None and AudioChunk.is_type(event.type):
            return await self.wake.chunk(read_as(AudioChunk.from_event, event))
        if self.wake is not None and AudioStart.is_type(event.type):
            self.wake.start(read_as(AudioStart.from_event, event))
            return []
        if self.wake is not None and AudioStop.is_type(event.type):
            answers, self.wake = self.wake.stop(), None
            return answers
        if AudioStart.is_type(event.type):
            self.pcm = PcmIn(read_as(AudioStart.from_event, event), "audio-start")
            self.denoiser = denoiser(self.transcribe)  # a bad one refuses the recording: no audio-start
            self._drop_recording()
            self.recording = Recording(self.max_samples, self.budget)
            self._hear()
            return []
        if AudioChunk.is_type(event.type):
            samples = self._chunk(read_as(AudioChunk.from_event, event))
            if self.heard is not None and self.follower is not None:
                await self.heard.feed(samples)
                return self.follower.heard_more(self.transcribe.language if self.transcribe else None)
            return []
        if AudioStop.is_type(event.type):
            stopped = time.monotonic()
            model = await self.finish_transcription(send)  # its answers stream
            self.observe(model, time.monotonic() - stopped)
            return []
        if Synthesize.is_type(event.type):
            if self.synthesis is not None:
                return []  # the streamed form's closing synthesize, for old servers: already spoken
            synthesize = read_as(Synthesize.from_event, event)
            await self.speak(checked_text(synthesize.text, "synthesize text"), synthesize.voice, send)
            return []
        if Ping.is_type(event.type):
            return [Pong(text=read_as(Ping.from_event, event).text).event()]
        if SynthesizeStart.is_type(event.type):
            self.synthesis, self.synthesis_voice = ArrivingText(), read_as(SynthesizeStart.from_event, event).voice
            self.synthesis_audio = False
            return []
        if SynthesizeChunk.is_type(event.type):
            if self.synthesis is None:
                raise BadRequest("synthesize-chunk before synthesize-start")
            text = read_as(SynthesizeChunk.from_event, event).text
            if not isinstance(text, str):
                raise BadRequest("synthesize-chunk: its text is a string")
            if self.synthesis.length + len(text) > MAX_TEXT_CHARS:  # as the HTTP API's speech input
                self.synthesis = None
                raise WyomingError(
                    f"a streamed synthesis over {MAX_TEXT_CHARS} characters: the most one takes", "text_too_long"
                )
            if said := self.synthesis.add(text):  # each whole sentence spoken as it arrives (an LLM's words)
                await self._speak_streamed(said, send)
            return []
        if SynthesizeStop.is_type(event.type):
            text, self.synthesis = self.synthesis.rest() if self.synthesis else "", None
            if text.strip():
                await self._speak_streamed(text, send)
            if self.synthesis_audio:
                await send(AudioStop().event())
            return [SynthesizeStopped().event()]
        return []  # Wyoming: events a server does not know are ignored

    def _chunk(self, chunk: AudioChunk) -> np.ndarray:
        if self.recording is None or self.pcm is None:
            raise BadRequest("audio-chunk before audio-start")
        resampled = self.pcm.feed(chunk)
        if self.denoiser is not None:
            resampled = self.denoiser.feed(resampled)
        try:
            self.recording.add(resampled)
        except WyomingError:  # refused whole: no transcript of its beginning
            self.end()
            raise
        return resampled

    def _hear(self) -> None:
        """The recording heard as it arrives, its text made ahead where it can be; not where its model
        or options are refused (audio-stop says why, as without)."""
        self.close()
        with contextlib.suppress(ApiError):
            model, options = self._model(), self._options()
            self.heard = model.hear(options, self.client)
            assert self.recording is not None
            self.follower = Follower(self.heard, self.recording, lambda audio: model.transcribe(audio, options))

    def end(self) -> None:
        """The connection's end (or its recording refused): its work stopped, its audio let go."""
        self.close()
        self._drop_recording()
        self.pcm = None

    def _drop_recording(self) -> None:
        if self.recording is not None:
            self.recording.release()
        self.recording = None

    def close(self) -> None:
        for listening in (self.wake, self.follower, self.heard):
            if listening is not None:
                listening.close()
        self.wake, self.follower, self.heard = None, None, None

    def _options(self) -> Options:
        return Options(self._language())

    def _language(self) -> str | None:
        wanted = self.transcribe.language if self.transcribe else None
        return base_language(wanted) if wanted else None

    def _model(self) -> LiveTranscriber:
        """The model the transcribe event names; else the first that hears its language (Home Assistant
        names only a language where its pipeline has one); else the box's first."""
        if not self.speech:
            raise BadRequest("this firmware serves no speech_to_text model")
        name, language = (self.transcribe.name if self.transcribe else None), self._language()
        if name:
            found, missing = [m for m in self.speech if m.name == name], f"no speech_to_text model {name[:40]!r}"
        elif language:
            found, missing = (
                [m for m in self.speech if language in m.languages],
                f"no speech_to_text model hears {language[:20]!r}",
            )
        else:
            found, missing = self.speech, ""
        if not found:
            raise BadRequest(f"{missing} (models: {', '.join(m.name for m in self.speech)})")
        return found[0]

    async def finish_transcription(self, send: Send) -> str:
        """audio-stop: the recording's segments, each sent as it is decoded, then the whole transcript."""
        if self.recording is None or self.pcm is None:
            raise BadRequest("audio-stop before audio-start")
        tail = self.pcm.flush()
        if self.denoiser is not None:  # its last 20 ms too
            tail = np.concatenate([self.denoiser.feed(tail), self.denoiser.flush()])
        recording, self.recording, self.pcm, self.denoiser = self.recording, None, None, None
        audio = np.concatenate([recording.audio(), tail])
        heard, self.heard = self.heard, None
        follower, self.follower = self.follower or Follower(None, recording), None
        try:
            model, options = self._model(), self._options()
            with recorded(model.stats) as times:  # a request in the model's statistics, as over HTTP
                model.check(options)  # a refused language or task: the error comes before transcript-start
                language = self.transcribe.language if self.transcribe else None
                self.transcribe = None
                audio = np.concatenate([audio, np.zeros(max(0, MIN_SAMPLES - len(audio)), np.float32)])
                segments = heard.segments(audio) if heard is not None else model.transcribe(audio, options, times)
                await follower.finish(segments, send, language)
            return model.name
        finally:
            recording.release()  # held until transcribed
            if heard is not None:
                heard.close()

    async def speak(
        self, text: str, wanted: SynthesizeVoice | None, send: Send, start: bool = True, stop: bool = True
    ) -> None:
        """Each sentence's audio sent as soon as it is made (a client that does not read holds the rest),
        between audio-start and audio-stop (a streamed synthesis sends each once, around all its text)."""
        model, voice = chosen_voice(self.voices, wanted, text, self.models.values())
        rate = model.sample_rate
        shards = await model.prepare(text, voice)  # a text with nothing to say is an error before any audio
        if start:
            await send(AudioStart(rate=rate, width=2, channels=1).event())
        async with contextlib.aclosing(model.synthesize(shards, 1.0, voice=voice)) as pieces:
            async for piece in pieces:
                await send(AudioChunk(rate=rate, width=2, channels=1, audio=piece.astype("<i2").tobytes()).event())
        if stop:
            await send(AudioStop().event())

    async def _speak_streamed(self, text: str, send: Send) -> None:
        self.synthesis_voice = streamed_voice(self.voices, self.synthesis_voice, text, self.models.values())
        await self.speak(text, self.synthesis_voice, send, start=not self.synthesis_audio, stop=False)
        self.synthesis_audio = True


def streamed_voice(
    voices: Sequence[Speaker], named: SynthesizeVoice | None, text: str, models: Iterable[ServedModel]
) -> SynthesizeVoice:
    """A streamed synthesis's voice: the one its start named, else its first sentence's language's, kept
    for the rest of it."""
    if named and (named.name or named.language):
        return named
    return SynthesizeVoice(name=chosen_voice(voices, None, text, models)[1])


def chosen_voice(
    voices: Sequence[Speaker], wanted: SynthesizeVoice | None, text: str, models: Iterable[ServedModel]
) -> tuple[Speaker, str]:
    """The voice a synthesize event names; else the first of the language it names; else the first of
    the text's language (as OpenAI's voice names choose: Home Assistant's default names none)."""
    spoken = [(m, v) for m in voices for v in m.voices.values()]
    if not spoken:
        raise BadRequest("this firmware serves no voice")
    names = ", ".join(f"{v.name} ({v.language})" for _, v in spoken)
    if wanted is not None and wanted.name:
        found = [(m, v.name) for m, v in spoken if v.name == wanted.name]
        if not found:
            raise BadRequest(f"unknown voice {wanted.name[:80]!r} (voices: {names})")
        return found[0]
    if wanted is not None and wanted.language:
        language = base_language(wanted.language)
        found = [(m, v.name) for m, v in spoken if v.language == language]
        if not found:
            raise BadRequest(f"no voice speaks {wanted.language[:20]!r} (voices: {names})")
        return found[0]
    model, voice, _ = voice_for_text(voices, models, text)
    return model, voice


def _installed(*kinds: str) -> dict[str, Any]:
    """What `info` says of each program, model and voice beside its name: who made it, and that this
    box has it."""
    return {"attribution": made_by(*kinds), "installed": True, "version": __version__}


def made_by(*kinds: str) -> Attribution:
    """The makers of models of these kinds (a kind not in MADE_BY: the box's own); of several, named
    together at the first one's address."""
    found = [MADE_BY.get(kind, Attribution(name="appliance", url="")) for kind in dict.fromkeys(kinds)]
    return found[0] if len(found) == 1 else Attribution(name=", ".join(a.name for a in found), url=found[0].url)


def base_language(code: str) -> str:
    """A language as Whisper and the voices name it: "en-US", "pt_BR" -> "en", "pt"."""
    return code.replace("_", "-").split("-")[0].lower()

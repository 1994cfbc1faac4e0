"""One Wyoming client's events answered as the protocol says (api/wyoming.py serves the connection):
describe, transcription of a recording as it arrives, synthesis whole or streamed, ping.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStart, TranscriptStop
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

from appliance import __version__
from appliance.api.wyoming_events import WyomingError
from appliance.api.wyoming_noise import denoiser
from appliance.audio import StreamResampler, pcm16
from appliance.denoise import Denoiser
from appliance.errors import ApiError, BadRequest
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import HeardRecording, LiveTranscriber, Speaker
from appliance.kinds.speech_api import MIN_SAMPLES, Options
from appliance.kinds.text import MAX_TEXT_CHARS, ArrivingText, checked_text

SAMPLE_RATE = 16000
MIN_RATE, MAX_RATE, MAX_CHANNELS = 8000, 192000, 8  # the PCM a recording may come as
# who made the models and voices Home Assistant lists: its voice settings show these beside them
MADE_BY = {
    "speech_to_text": Attribution(name="OpenAI Whisper", url="https://github.com/openai/whisper"),
    "speech_synthesis": Attribution(name="Piper", url="https://github.com/rhasspy/piper"),
    "kokoro_speech": Attribution(name="Kokoro-82M", url="https://huggingface.co/hexgrad/Kokoro-82M"),
}
Send = Callable[[Event], Awaitable[None]]


class WyomingHandler:
    """One client's connection: events in order, each answered as the protocol says."""

    def __init__(self, models: dict[str, ServedModel], max_samples: int, client: str) -> None:
        self.models, self.max_samples, self.client = models, max_samples, client
        self.speech = [m for m in models.values() if isinstance(m, LiveTranscriber)]
        self.voices = [m for m in models.values() if isinstance(m, Speaker)]
        self.transcribe: Transcribe | None = None
        self.audio: list[np.ndarray] | None = None  # while a recording arrives: 16 kHz samples
        self.samples = 0
        self.resampler: StreamResampler | None = None
        self.denoiser: Denoiser | None = None  # where the transcribe event's context asks (wyoming_noise.py)
        self.format = (SAMPLE_RATE, 1)  # the recording's rate and channels, as its audio-start gave them
        self.partial_frame = b""  # a chunk's bytes that end inside a sample frame: the next chunk's start
        self.heard: HeardRecording | None = None  # the recording, heard as it arrives
        self.synthesis: ArrivingText | None = None  # streamed synthesis: its text not spoken yet
        self.synthesis_voice: SynthesizeVoice | None = None  # and the voice its start named
        self.synthesis_audio = False  # and whether its audio-start was sent

    def info(self) -> Info:
        return Info(asr=[self._asr()] if self.speech else [], tts=[self._tts()] if self.voices else [])

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
            self.transcribe = Transcribe.from_event(event)
            self.close()  # a recording under way was heard for other options
            return []
        if AudioStart.is_type(event.type):
            self.format = _pcm_format(AudioStart.from_event(event), "audio-start")
            self.denoiser = denoiser(self.transcribe)  # a bad one refuses the recording: no audio-start
            self.audio, self.samples, self.partial_frame = [], 0, b""
            self.resampler = StreamResampler(self.format[0], SAMPLE_RATE)
            self._hear()
            return []
        if AudioChunk.is_type(event.type):
            samples = self._chunk(AudioChunk.from_event(event))
            if self.heard is not None:
                await self.heard.feed(samples)
            return []
        if AudioStop.is_type(event.type):
            return []  # the caller runs finish_transcription: its answers stream
        if Synthesize.is_type(event.type):
            if self.synthesis is not None:
                return []  # the streamed form's closing synthesize, for old servers: already spoken
            synthesize = Synthesize.from_event(event)
            await self.speak(checked_text(synthesize.text, "synthesize text"), synthesize.voice, send)
            return []
        if Ping.is_type(event.type):
            return [Pong(text=Ping.from_event(event).text).event()]
        if SynthesizeStart.is_type(event.type):
            self.synthesis, self.synthesis_voice = ArrivingText(), SynthesizeStart.from_event(event).voice
            self.synthesis_audio = False
            return []
        if SynthesizeChunk.is_type(event.type):
            if self.synthesis is None:
                raise BadRequest("synthesize-chunk before synthesize-start")
            text = SynthesizeChunk.from_event(event).text
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
        if self.audio is None or self.resampler is None:
            raise BadRequest("audio-chunk before audio-start")
        rate, channels = _pcm_format(chunk, "audio-chunk")
        if (rate, channels) != self.format:  # the resampler and the frames are audio-start's
            raise BadRequest(
                f"audio-chunk: rate {rate} and channels {channels} differ from audio-start's "
                f"({self.format[0]}, {self.format[1]})"
            )
        data = self.partial_frame + chunk.audio
        whole = len(data) - len(data) % (2 * channels)
        samples, self.partial_frame = pcm16(data[:whole]), data[whole:]
        if channels > 1:
            samples = samples.reshape(-1, channels).mean(axis=1, dtype=np.float32)
        resampled = self.resampler.feed(samples)
        if self.denoiser is not None:
            resampled = self.denoiser.feed(resampled)
        self.samples += len(resampled)
        if self.samples > self.max_samples:  # refused whole: no transcript of its beginning
            self.audio, self.resampler = None, None
            self.close()
            raise WyomingError(
                f"recording over {self.max_samples / SAMPLE_RATE:.0f} s: send shorter ones", "recording_too_long"
            )
        self.audio.append(resampled)
        return resampled

    def _hear(self) -> None:
        """The recording heard as it arrives, its text made ahead where it can be; not where its model
        or options are refused (audio-stop says why, as without)."""
        self.close()
        with contextlib.suppress(ApiError):
            self.heard = self._model().hear(self._options(), self.client)

    def close(self) -> None:
        if self.heard is not None:
            self.heard.close()
            self.heard = None

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
        if self.audio is None or self.resampler is None:
            raise BadRequest("audio-stop before audio-start")
        audio = np.concatenate([*self.audio, self.resampler.flush()])
        self.audio, self.resampler = None, None
        heard, self.heard = self.heard, None
        try:
            model, options = self._model(), self._options()
            model.check(options)  # a refused language or task: the error comes before transcript-start
            language = self.transcribe.language if self.transcribe else None
            self.transcribe = None
            audio = np.concatenate([audio, np.zeros(max(0, MIN_SAMPLES - len(audio)), np.float32)])
            segments = heard.segments(audio) if heard is not None else model.transcribe(audio, options)
            texts, spoken = [], collections.defaultdict[str, float](float)
            await send(TranscriptStart(language=language).event())
            async with contextlib.aclosing(segments) as found:
                async for segment in found:
                    texts.append(segment.text.strip())
                    spoken[segment.language] += segment.end - segment.start
                    await send(TranscriptChunk(text=(" " if len(texts) > 1 else "") + texts[-1]).event())
            await send(TranscriptStop().event())
            # none named: the language identified in most of the speech (a segment each, speech_languages.py)
            heard_in = language or max(spoken, key=spoken.__getitem__, default=None)
            await send(Transcript(text=" ".join(texts), language=heard_in).event())
            return model.name
        finally:
            if heard is not None:
                heard.close()

    async def speak(
        self, text: str, wanted: SynthesizeVoice | None, send: Send, start: bool = True, stop: bool = True
    ) -> None:
        """Each sentence's audio sent as soon as it is made (a client that does not read holds the rest),
        between audio-start and audio-stop (a streamed synthesis sends each once, around all its text)."""
        model, voice = self._voice(wanted)
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
        await self.speak(text, self.synthesis_voice, send, start=not self.synthesis_audio, stop=False)
        self.synthesis_audio = True

    def _voice(self, wanted: SynthesizeVoice | None) -> tuple[Speaker, str]:
        """The voice a synthesize event names; else the first of the language it names; else the box's first."""
        spoken = [(m, v) for m in self.voices for v in m.voices.values()]
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
        return spoken[0][0], spoken[0][1].name


def _pcm_format(audio: AudioStart | AudioChunk, event: str) -> tuple[int, int]:
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

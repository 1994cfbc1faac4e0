"""Home Assistant's Wyoming protocol (PyPI `wyoming`: its event classes and writer) on a Unix socket
next to the API socket, served from the engine process: the same models, the same batches.

    describe                                   -> info: every speech_to_text model (its languages)
                                                  in one asr program, every voice of every speech
                                                  model (its language) in one tts program
    transcribe, audio-start, audio-chunk..., audio-stop
                                               -> transcript-start, transcript-chunk per segment as
                                                  it is decoded, transcript-stop, then transcript
                                                  (made ahead where the recording came as it was
                                                  spoken and ended in silence: LiveTranscriber.hear)
    synthesize (or synthesize-start/-chunk.../-stop), its voice by name or by language
                                               -> audio-start, audio-chunk per sentence as it is
                                                  made, audio-stop (the streamed form: each sentence
                                                  spoken once its chunks complete it, then
                                                  synthesize-stopped)

Wyoming has no authentication: whoever reaches the socket may use it (its mode and group are the API
socket's). Events are read with bounds of our own (the package's reader has none): a header line of at
most MAX_HEADER_BYTES, data and payload of at most [wyoming] max_payload_bytes, a recording of at most
the API's body limit; in time as the API's HTTP/1.1 (an idle connection, a header line, a stalled
payload); and [wyoming] max_connections clients at once, max_connections_per_peer of one user (Unix
socket) or host (TCP). A broken or oversized event, a bound in time or a connection past the count is
answered by one `error` event and the connection closes; a client that disconnects mid-stream cancels
its work. Concurrent clients' recordings share engine calls (the speech_to_text batch queue), where
wyoming-faster-whisper holds a lock per model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStart, TranscriptStop
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
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
from zeroconf.asyncio import AsyncZeroconf

from appliance import __version__
from appliance.api.metrics import Metrics
from appliance.api.wyoming_lan import Serve, listen_tcp
from appliance.audio import StreamResampler, pcm16
from appliance.config import Config, Live, WyomingConfig
from appliance.errors import ApiError, BadRequest
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import HeardRecording, LiveTranscriber, Speaker
from appliance.kinds.speech_api import MIN_SAMPLES, Options
from appliance.kinds.text import MAX_TEXT_CHARS, ArrivingText, checked_text
from appliance.protocol.limits import LIMITS_BITTEN
from appliance.transport.unix_peer import unix_peer

log = logging.getLogger("appliance.wyoming")
MAX_HEADER_BYTES = 64 << 10
LINGER_S = 5.0  # how long a connection closing after an error still reads what the client sends
SAMPLE_RATE = 16000
MIN_RATE, MAX_RATE, MAX_CHANNELS = 8000, 192000, 8  # the PCM a recording may come as
# who made the models and voices Home Assistant lists: its voice settings show these beside them
MADE_BY = {
    "speech_to_text": Attribution(name="OpenAI Whisper", url="https://github.com/openai/whisper"),
    "speech_synthesis": Attribution(name="Piper", url="https://github.com/rhasspy/piper"),
    "kokoro_speech": Attribution(name="Kokoro-82M", url="https://huggingface.co/hexgrad/Kokoro-82M"),
}
Send = Callable[[Event], Awaitable[None]]


class WyomingError(Exception):
    """The client broke the protocol or a bound: one `error` event, then the connection closes. A bound
    names itself (`limit`): it is logged as limits are (LIMITS_BITTEN), so a flood is not a flood of lines."""

    def __init__(self, message: str, limit: str = "", code: str = "") -> None:
        super().__init__(message)
        self.limit = limit
        self.code = code or limit or "protocol"  # the error event's


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one connection may send, and how slowly: the config as it was when the connection came."""

    max_payload: int  # [wyoming] max_payload_bytes: an event's data, and its payload
    max_samples: int  # a recording, in 16 kHz samples: as much as the API's body as PCM16
    idle_s: float  # server.keepalive_timeout_s: no next event begun (the first: header_s)
    header_s: float  # server.header_timeout_s: an event's header line, from its first byte; the first event
    quiet_s: float  # server.body_timeout_s: its data and payload may go quiet this long

    @classmethod
    def of(cls, config: Config) -> Bounds:
        server = config.server
        return cls(
            config.wyoming.max_payload_bytes,
            server.max_body_bytes // 2,
            server.keepalive_timeout_s,
            server.header_timeout_s,
            server.body_timeout_s,
        )


class Admission:
    """The Wyoming clients connected now, per peer (a user on the Unix socket, a host on TCP), against
    [wyoming] max_connections and max_connections_per_peer: one user or host cannot take them all. A
    refused connection lingers a moment so its client reads why (_linger): at most max_connections of
    those at once, the rest closed at once, so a flood of them holds no more sockets than that."""

    def __init__(self) -> None:
        self.peers: Counter[str] = Counter()
        self.refused = 0  # refused connections lingering now

    def refusal(self, peer: str, settings: WyomingConfig) -> WyomingError | None:
        """Why `peer` may not connect now (None where it may)."""
        if self.peers.total() >= settings.max_connections:
            return WyomingError(
                f"too many Wyoming connections (limit {settings.max_connections})", "too_many_connections"
            )
        if self.peers[peer] >= settings.max_connections_per_peer:
            return WyomingError(
                f"too many Wyoming connections from {peer} (its share is {settings.max_connections_per_peer})",
                "too_many_connections_from_peer",
            )
        return None

    @contextlib.contextmanager
    def held(self, peer: str) -> Iterator[None]:
        self.peers[peer] += 1
        try:
            yield
        finally:
            self.peers[peer] -= 1
            if not self.peers[peer]:
                del self.peers[peer]

    @contextlib.contextmanager
    def refusing(self, settings: WyomingConfig) -> Iterator[bool]:
        """Whether a refused connection may linger, counted while it does."""
        lingers = self.refused < settings.max_connections
        self.refused += lingers
        try:
            yield lingers
        finally:
            self.refused -= lingers


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
            texts = []
            await send(TranscriptStart(language=language).event())
            async with contextlib.aclosing(segments) as found:
                async for segment in found:
                    texts.append(segment.text.strip())
                    await send(TranscriptChunk(text=(" " if len(texts) > 1 else "") + texts[-1]).event())
            await send(TranscriptStop().event())
            await send(Transcript(text=" ".join(texts), language=language).event())
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


async def read_event(reader: asyncio.StreamReader, bounds: Bounds, idle_s: float) -> Event | None:
    """One event, begun within `idle_s` and bounded before anything is read into memory; None at the end
    of the stream."""
    try:
        async with asyncio.timeout(idle_s):
            first = await reader.read(1)
    except TimeoutError:
        raise WyomingError(f"no event for {idle_s:g} s", "idle_timeout") from None
    if not first:
        return None
    try:
        async with asyncio.timeout(bounds.header_s):
            line = first + await reader.readuntil(b"\n") if first != b"\n" else first
    except TimeoutError:
        raise WyomingError(f"an event header not complete within {bounds.header_s:g} s", "header_timeout") from None
    except asyncio.IncompleteReadError:
        raise WyomingError("the connection ended inside an event header") from None
    except asyncio.LimitOverrunError:
        raise WyomingError(f"an event header line is over {MAX_HEADER_BYTES} bytes", "header_too_large") from None
    try:
        header = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested past Python's stack
        raise WyomingError(f"an event header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise WyomingError("an event header is a JSON object with a string 'type'")
    data = header.get("data") or {}
    lengths = [header.get("data_length") or 0, header.get("payload_length") or 0]
    if not isinstance(data, dict) or not all(isinstance(n, int) and 0 <= n <= bounds.max_payload for n in lengths):
        raise WyomingError(
            f"data must be an object, data_length and payload_length integers of at most {bounds.max_payload}",
            "payload_too_large",
        )
    try:
        if lengths[0]:
            extra = json.loads(await _read_exactly(reader, lengths[0], bounds.quiet_s))
            if not isinstance(extra, dict):
                raise WyomingError("an event's data is a JSON object")
            data = {**data, **extra}
        payload = await _read_exactly(reader, lengths[1], bounds.quiet_s) if lengths[1] else None
    except asyncio.IncompleteReadError:
        raise WyomingError("the connection ended inside an event") from None
    except TimeoutError:
        raise WyomingError(f"an event's data or payload stalled for {bounds.quiet_s:g} s", "payload_timeout") from None
    except (ValueError, RecursionError) as exc:
        raise WyomingError(f"an event's data is not JSON: {exc}") from None
    return Event(type=header["type"], data=data, payload=payload)


async def _read_exactly(reader: asyncio.StreamReader, size: int, quiet_s: float) -> bytes:
    """`size` bytes, the client never quiet for `quiet_s` in between (TimeoutError where it is)."""
    parts: list[bytes] = []
    while size:
        async with asyncio.timeout(quiet_s):
            part = await reader.read(size)
        if not part:
            raise asyncio.IncompleteReadError(b"".join(parts), size)
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


async def serve_client(
    models: dict[str, ServedModel],
    metrics: Metrics,
    bounds: Bounds,
    client: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    handler = WyomingHandler(models, bounds.max_samples, client)

    async def send(event: Event) -> None:
        await async_write_event(event, writer)  # drains: a client that does not read stops us

    try:
        idle_s = bounds.header_s  # a new connection's first event comes as soon as a new HTTP one's request
        while (event := await read_event(reader, bounds, idle_s)) is not None:
            idle_s = bounds.idle_s
            try:
                for answer in await handler.handle(event, send):
                    await send(answer)
                if AudioStop.is_type(event.type):
                    stopped = time.monotonic()
                    model = await handler.finish_transcription(send)
                    metrics.observe_live(model, "wyoming", time.monotonic() - stopped)
            except (ApiError, ValueError, KeyError, TypeError) as exc:  # a bad event's fields: one error, go on
                message = exc.message if isinstance(exc, ApiError) else f"bad {event.type} event: {exc}"
                if AudioStop.is_type(event.type):
                    # no transcript will come, and a client may wait for one (Home Assistant's does,
                    # ignoring errors): the connection closes, which it takes as the end
                    raise WyomingError(message, code=type(exc).__name__) from None
                await send(Error(text=message, code=type(exc).__name__).event())
                # the connection goes on: not at info, where one client could repeat it without end
                log.debug("Wyoming client %s: %s", client, message)
    except WyomingError as exc:
        await _close_with_error(exc, client, reader, writer)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the client left; what it asked for is cancelled with this task
    except Exception:
        log.exception("Wyoming client crashed")
    finally:
        handler.close()
        writer.close()


async def _close_with_error(
    exc: WyomingError, client: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, linger: bool = True
) -> None:
    """The one `error` event before a close, and its line in the log: a bound's as limits are logged."""
    if exc.limit:
        LIMITS_BITTEN.bit(f"wyoming {exc.limit}", f"Wyoming client {client}: {exc}")
    else:
        log.info("Wyoming client %s: %s; closed", client, exc)
    with contextlib.suppress(OSError):  # the client gone: ConnectionError, or ENOTCONN as we shut our side
        await async_write_event(Error(text=str(exc), code=exc.code).event(), writer)
        if linger:
            await _linger(reader, writer)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Before a close after an error: our side shut, what the client still sends read and dropped (up to
    LINGER_S), so its unread data does not reset the connection before it reads the error."""
    writer.write_eof()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while await reader.read(1 << 16):
                pass


def _peer(writer: asyncio.StreamWriter) -> str:
    """Who owns the connection's VAD sequence: the user on the Unix socket, the host on TCP."""
    peername = writer.get_extra_info("peername")
    if isinstance(peername, tuple) and peername:
        return str(peername[0])
    return unix_peer(writer.get_extra_info("socket"))[0]


@dataclass
class Listeners:
    """Where Wyoming is served: the Unix socket, and TCP with its mDNS announcement where it is on."""

    unix: asyncio.Server
    path: Path
    tcp: asyncio.Server | None = None
    zeroconf: AsyncZeroconf | None = None  # its announcement on the LAN (wyoming_lan.py)

    async def close(self) -> None:
        for server in (self.unix, self.tcp):
            if server is not None:
                server.close()
        if self.zeroconf is not None:
            await self.zeroconf.async_close()  # says goodbye on the LAN


async def start(
    config: Config, bind: Callable[[Path], socket.socket], models: dict[str, ServedModel], live: Live, metrics: Metrics
) -> Listeners | None:
    """[wyoming]: the Unix socket (`bind` makes it as the API's is made), and TCP where asked for."""
    settings = config.wyoming
    if not settings.enabled:
        return None
    path = Path(str(settings.socket)) if str(settings.socket) != "." else config.server.socket.with_name("wyoming.sock")
    serve = _client(models, live, metrics, Admission())  # one count for both listeners
    listeners = Listeners(await listen(bind(path), serve), path)
    log.info("Wyoming on %s", path)
    if settings.tcp:
        listeners.tcp, listeners.zeroconf = await listen_tcp(settings.tcp, serve, MAX_HEADER_BYTES)
    return listeners


def _client(models: dict[str, ServedModel], live: Live, metrics: Metrics, admission: Admission) -> Serve:
    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        config, peer = live.config, _peer(writer)  # as the config is now: a reload bounds new connections
        if refusal := admission.refusal(peer, config.wyoming):
            try:
                with admission.refusing(config.wyoming) as linger:
                    await _close_with_error(refusal, peer, reader, writer, linger)
            finally:
                writer.close()
            return
        with admission.held(peer):
            await serve_client(models, metrics, Bounds.of(config), peer, reader, writer)

    return client


async def listen(sock: socket.socket, serve: Serve) -> asyncio.Server:
    """Serve Wyoming on a bound, listening Unix socket; each client in its own task."""
    return await asyncio.start_unix_server(serve, sock=sock, limit=MAX_HEADER_BYTES)

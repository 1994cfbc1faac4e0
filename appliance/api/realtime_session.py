"""OpenAI's Realtime API (GA event format), transcription session, without I/O: client events in
(text), server events and audio steps out; what the VAD and Whisper found in (turn_heard,
turn_closed, partial), the events that tell the client out. realtime.py pumps it.

Client events: `session.update` (session.type "transcription"; audio.input.format audio/pcm at
24000 or 16000 Hz, or G.711's audio/pcmu and audio/pcma; audio.input.transcription model, language,
prompt; audio.input.noise_reduction; audio.input.turn_detection server_vad or semantic_vad, or null
for manual commits), `input_audio_buffer.append`, `input_audio_buffer.commit`, `input_audio_buffer.clear`;
an interpreter session's `response.create`, `response.cancel` and `conversation.item.*` too
(realtime_conversation.py). A bad event is answered by one `error` event with OpenAI's fields; the
session goes on. The settings session.update may change are read and checked in realtime_settings.py.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance import g711
from appliance.api.agreement import LocalAgreement
from appliance.api.realtime_conversation import AudioItem, Conversation, Item, user_content
from appliance.api.realtime_settings import (
    PCM,
    RealtimeError,
    Settings,
    as_object,
    audio_format,
    describe_format,
    with_noise_reduction,
    with_transcription,
    with_turn_detection,
)
from appliance.audio import StreamResampler, pcm16, resample
from appliance.denoise import Denoiser, denoise
from appliance.errors import ApiError, BadRequest
from appliance.kinds.speech_api import Segment
from appliance.protocol.json_reader import BeyondBounds, read_json
from appliance.protocol.limits import LIMITS_BITTEN

SAMPLE_RATE = 16000  # what the VAD and Whisper take
MAX_BUFFER_S = 600.0  # a manual buffer (no server VAD) not committed by then is refused


@dataclass(frozen=True, slots=True)
class Audio:
    """Samples at 16 kHz for the live stream (server VAD) or the manual buffer."""

    samples: np.ndarray


@dataclass(frozen=True, slots=True)
class Commit:
    """The client committed: end the turn being heard (server VAD) or transcribe the buffer."""

    item_id: str


@dataclass(frozen=True, slots=True)
class Clear:
    """Drop what was heard and not committed."""


@dataclass(frozen=True, slots=True)
class Restart:
    """The settings changed: the next audio starts a new live stream under them."""


@dataclass(frozen=True, slots=True)
class Respond:
    """response.create: answer the latest user item not yet answered."""


@dataclass(frozen=True, slots=True)
class Cancel:
    """response.cancel: stop the answer being made (`response_id`, where given, must be it)."""

    response_id: str | None


Step = dict[str, Any] | Audio | Commit | Clear | Restart | Respond | Cancel | AudioItem  # a dict: an event


def read_event(message: str | bytes) -> Any:
    """A client event's JSON, bounded as HTTP bodies are (nesting past the stack is an error, never a
    RecursionError), or the error saying why it is not one. It touches no session: a long event is
    read on a thread (a 1 MiB one of 99,000 strings: 137 ms)."""
    if isinstance(message, bytes):
        return RealtimeError("events are JSON text messages, not binary", "invalid_event")
    try:
        return read_json(message.encode(), tensors=False, name="the event")
    except BadRequest as exc:
        return exc


@dataclass(slots=True)
class TranscriptionSession:
    settings: Settings
    models: tuple[str, ...]  # the speech_to_text models a session may name
    kind: str = "transcription"  # or "realtime": the interpreter session (translated speech back)
    target: str = ""  # the interpreter's target language
    text_language: str = ""  # the language a text item is taken to be in (an interpreter's)
    id: str = field(default_factory=lambda: "sess_" + secrets.token_hex(12))
    _events: itertools.count[int] = field(default_factory=itertools.count)
    _items: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _resampler: StreamResampler | None = None
    _denoiser: Denoiser | None = None  # where the session asked for noise_reduction
    heard_samples: int = 0  # 16 kHz samples of input so far: the clock of audio_start_ms / audio_end_ms
    _item: str | None = None  # the turn being heard, from speech_started on
    _previous: str | None = None
    _agreement: LocalAgreement = field(default_factory=LocalAgreement)  # the open turn's words sent as deltas
    _client_event: str | None = None  # the event_id of the client event being handled: errors name it

    conversation: Conversation = field(init=False)

    def __post_init__(self) -> None:
        self._resampler = StreamResampler(self.settings.rate, SAMPLE_RATE)
        self.conversation = Conversation(self.event)

    def new_id(self, kind: str) -> str:
        """A new item's or response's id (`item`, `resp`)."""
        return f"{kind}_{self.id[5:13]}{next(self._items):04d}"

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": f"event_{self.id[5:13]}{next(self._events)}", **fields}

    def created(self) -> dict[str, Any]:
        return self.event("session.created", session=self.describe())

    def describe(self) -> dict[str, Any]:
        s = self.settings
        if self.kind == "realtime":
            audio_in = {
                "format": describe_format(s.codec, s.rate),
                "turn_detection": s.turn_detection,
                "noise_reduction": _noise(s),
            }
            output = {"format": describe_format(s.output_codec, s.output_rate), "language": self.target}
            return {
                "type": "realtime",
                "object": "realtime.session",
                "id": self.id,
                "model": s.model,
                "output_modalities": ["audio"],
                "audio": {"input": audio_in, "output": output},
            }
        return {
            "type": "transcription",
            "object": "realtime.transcription_session",
            "id": self.id,
            "audio": {
                "input": {
                    "format": describe_format(s.codec, s.rate),
                    "transcription": {"model": s.model, "language": s.language, "prompt": s.prompt},
                    "turn_detection": s.turn_detection,
                    "noise_reduction": _noise(s),
                }
            },
            "include": [],
        }

    # --- client events ---
    def receive(self, text: str) -> list[Step]:
        """One client event's steps; a bad event is one `error` event (and nothing else happens)."""
        return self.receive_read(read_event(text))

    def receive_read(self, event: Any) -> list[Step]:
        """receive, for an event already read (read_event's JSON, or the error saying why not)."""
        self._client_event = None
        try:
            if isinstance(event, RealtimeError):
                raise event
            if isinstance(event, BadRequest):
                if isinstance(event, BeyondBounds):  # a cheap message sent in a loop: logged as a limit
                    LIMITS_BITTEN.bit("realtime json bounds", f"Realtime session {self.id}: {event.message}")
                raise RealtimeError(event.message, "invalid_json") from None
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise RealtimeError("an event is a JSON object with a string 'type'", "invalid_event", "type")
            client_id = event.get("event_id")
            self._client_event = client_id if isinstance(client_id, str) else None
            handler = HANDLERS.get(event["type"])
            if handler is None and self.kind == "realtime":
                handler = CONVERSATION_HANDLERS.get(event["type"])
            elif event["type"] in CONVERSATION_HANDLERS:
                raise RealtimeError(
                    f"{event['type']} is an interpreter session's (?model= a speech pipeline): a transcription "
                    "session has no responses or conversation",
                    "invalid_event",
                    "type",
                )
            if handler is None:
                raise RealtimeError(
                    f"unknown event type {event['type'][:60]!r} (known: {', '.join(HANDLERS)})", "invalid_event", "type"
                )
            return list(handler(self, event))
        except RealtimeError as exc:
            return [self.error(exc)]

    def error(self, exc: ApiError) -> dict[str, Any]:
        """An `error` event for what the client event being handled (if any) caused."""
        client_event = self._client_event
        code = exc.code if isinstance(exc, RealtimeError) else "server_error" if exc.status >= 500 else "invalid_value"
        param = exc.param if isinstance(exc, RealtimeError) else None
        kind = "server_error" if exc.status >= 500 else "invalid_request_error"
        detail = {"type": kind, "code": code, "message": exc.message, "param": param, "event_id": client_event}
        return self.event("error", error=detail)

    def _update(self, event: dict[str, Any]) -> list[Step]:
        session = as_object(event.get("session"), "session")
        kind = session.get("type", self.kind)
        if kind != self.kind:
            raise RealtimeError(
                f"session.type {str(kind)[:40]!r}: this session is {self.kind!r} (the URL decides: "
                "?intent=transcription, or ?model= a speech pipeline for 'realtime')",
                param="session.type",
            )
        audio = as_object(session.get("audio", {}), "session.audio")
        given = as_object(audio.get("input", {}), "session.audio.input")
        settings = self.settings
        if "format" in given:
            codec, rate = audio_format(given["format"])
            settings = dataclasses.replace(settings, codec=codec, rate=rate)
        if "noise_reduction" in given:
            settings = with_noise_reduction(settings, given["noise_reduction"])
        if "transcription" in given:
            settings = with_transcription(
                settings, as_object(given["transcription"], "session.audio.input.transcription"), self.models
            )
        if "turn_detection" in given:
            settings = with_turn_detection(settings, given["turn_detection"])
        output = as_object(audio.get("output", {}), "session.audio.output")
        if self.kind == "realtime" and "format" in output:
            codec, rate = audio_format(output["format"], "output")
            settings = dataclasses.replace(settings, output_codec=codec, output_rate=rate)
        steps: list[Step] = []
        if settings != self.settings:
            if settings.rate != self.settings.rate:
                self._resampler = StreamResampler(settings.rate, SAMPLE_RATE)
            if settings.noise_reduction != self.settings.noise_reduction:
                self._denoiser = Denoiser() if settings.noise_reduction else None
            self.settings = settings
            steps.append(Restart())
        return [*steps, self.event("session.updated", session=self.describe())]

    def _append(self, event: dict[str, Any]) -> list[Step]:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise RealtimeError(
                "input_audio_buffer.append needs 'audio': base64 in the input format",
                "missing_required_parameter",
                "audio",
            )
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("'audio' is not valid base64", "invalid_value", "audio") from None
        assert self._resampler is not None
        resampled = self._resampler.feed(self.decode(raw, "audio"))
        if self._denoiser is not None:  # before the VAD and Whisper; its 20 ms lag shifts the turns' times
            resampled = self._denoiser.feed(resampled)
        self.heard_samples += len(resampled)
        return [Audio(resampled)] if len(resampled) else []

    def decode(self, raw: bytes, param: str) -> np.ndarray:
        """Input audio in the session's format as float samples at its rate."""
        if self.settings.codec != PCM:
            return g711.decode(raw, self.settings.codec)
        try:
            return pcm16(raw)
        except ApiError as exc:
            raise RealtimeError(exc.message, "invalid_value", param) from None

    # --- what the box heard ---
    def _new_item(self) -> str:
        return f"item_{self.id[5:13]}{next(self._items):04d}"

    def end_turn(self) -> str:
        """The turn being heard (or, with none, a new item) is committed: its item id."""
        item = self._item or self._new_item()
        self._item = None
        return item

    @property
    def turn_open(self) -> bool:
        """Whether a turn is being heard (speech_started, not yet closed)."""
        return self._item is not None

    def turn_heard(self, start_sample: int) -> list[dict[str, Any]]:
        """The VAD hears speech from `start_sample` (16 kHz samples since the session began)."""
        if self._item is not None:
            return []
        self._item = self._new_item()
        self._new_partials()
        start_ms = max(0, start_sample * 1000 // SAMPLE_RATE - self._pad_ms())
        return [self.event("input_audio_buffer.speech_started", audio_start_ms=start_ms, item_id=self._item)]

    def partial(self, text: str) -> list[dict[str, Any]]:
        """The open turn's text so far: its words that two texts in a row agree on go out as deltas."""
        if self._item is None or not (delta := self._agreement.hear(text)):
            return []
        return [self.event(DELTA, item_id=self._item, content_index=0, delta=delta)]

    def _new_partials(self) -> None:
        self._agreement = LocalAgreement()

    def turn_closed(self, end_sample: int | None, transcript: str, item_id: str | None = None) -> list[dict[str, Any]]:
        """A turn ended (the VAD's silence at `end_sample`, or a commit): stopped, committed, completed."""
        item = item_id or self._item or self._new_item()
        if item_id is None:
            self._item = None
        events = []
        if end_sample is not None:
            end_ms = end_sample * 1000 // SAMPLE_RATE
            events.append(self.event("input_audio_buffer.speech_stopped", audio_end_ms=end_ms, item_id=item))
        events.append(self.event("input_audio_buffer.committed", previous_item_id=self._previous, item_id=item))
        self._previous = item
        self._new_partials()
        usage = {"type": "duration", "seconds": 0}
        events.append(self.event(COMPLETED, item_id=item, content_index=0, transcript=transcript.strip(), usage=usage))
        return events

    def _pad_ms(self) -> int:
        return self.settings.vad.speech_pad_ms if self.settings.vad is not None else 0


DELTA = "conversation.item.input_audio_transcription.delta"


COMPLETED = "conversation.item.input_audio_transcription.completed"


# an interpreter session's conversation and responses
def _create_item(session: TranscriptionSession, event: dict[str, Any]) -> Sequence[Step]:
    text, audio = user_content(event)
    previous = event.get("previous_item_id")
    if previous is not None and not isinstance(previous, str):
        raise RealtimeError("previous_item_id must be a string", "invalid_type", "previous_item_id")
    given = as_object(event["item"], "item").get("id")
    item_id = given if isinstance(given, str) and given not in session.conversation.items else session.new_id("item")
    if audio is None:
        segment = Segment(0.0, 0.0, text, session.text_language)
        return session.conversation.add(
            Item(item_id, "user", [{"type": "input_text", "text": text}], [segment]), previous
        )
    samples = resample(session.decode(audio, "item.content[0].audio"), session.settings.rate, SAMPLE_RATE)
    if session.settings.noise_reduction:
        samples = denoise(samples)
    return [AudioItem(item_id, previous, samples)]


def _respond(session: TranscriptionSession, event: dict[str, Any]) -> list[Step]:
    return [Respond()]


def _cancel(session: TranscriptionSession, event: dict[str, Any]) -> list[Step]:
    given = event.get("response_id")
    return [Cancel(given if isinstance(given, str) else None)]


def _commit(session: TranscriptionSession, event: dict[str, Any]) -> list[Step]:
    return [Commit(session.end_turn())]


def _clear(session: TranscriptionSession, event: dict[str, Any]) -> list[Step]:
    session._item = None
    session._new_partials()
    return [Clear(), session.event("input_audio_buffer.cleared")]


Handler = Callable[["TranscriptionSession", dict[str, Any]], Sequence[Step]]
HANDLERS: dict[str, Handler] = {
    "session.update": TranscriptionSession._update,
    "transcription_session.update": TranscriptionSession._update,  # the beta name some clients still send
    "input_audio_buffer.append": TranscriptionSession._append,
    "input_audio_buffer.commit": _commit,
    "input_audio_buffer.clear": _clear,
}
CONVERSATION_HANDLERS: dict[str, Handler] = {
    "conversation.item.create": _create_item,
    "conversation.item.truncate": lambda session, event: session.conversation.truncate(event),
    "conversation.item.delete": lambda session, event: session.conversation.delete(event),
    "conversation.item.retrieve": lambda session, event: session.conversation.retrieve(event),
    "response.create": _respond,
    "response.cancel": _cancel,
}


def _noise(settings: Settings) -> dict[str, str] | None:
    return {"type": settings.noise_reduction} if settings.noise_reduction else None

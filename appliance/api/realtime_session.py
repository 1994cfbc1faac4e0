"""OpenAI's Realtime API (GA event format), transcription session, without I/O: client events in
(text), server events and audio steps out; what the VAD and Whisper found in (turn_heard,
turn_closed, partial), the events that tell the client out. realtime.py pumps it.

Client events: `session.update` (session.type "transcription"; audio.input.format audio/pcm at
24000 or 16000 Hz; audio.input.transcription model, language, prompt; audio.input.turn_detection
server_vad with threshold, prefix_padding_ms, silence_duration_ms, or null for manual commits),
`input_audio_buffer.append` (base64 PCM16), `input_audio_buffer.commit`, `input_audio_buffer.clear`.
A bad event is answered by one `error` event with OpenAI's fields; the session goes on. The settings
session.update may change are read and checked in realtime_settings.py.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.api.agreement import LocalAgreement
from appliance.api.realtime_settings import (
    RealtimeError,
    Settings,
    as_object,
    audio_rate,
    with_transcription,
    with_turn_detection,
)
from appliance.audio import StreamResampler, pcm16
from appliance.errors import ApiError
from appliance.protocol.limits import LIMITS_BITTEN

SAMPLE_RATE = 16000  # what the VAD and Whisper take
MAX_BUFFER_S = 600.0  # a manual buffer (no server VAD) not committed by then is refused
TOO_DEEP = "the event nests lists and objects deeper than the box parses"


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


Step = dict[str, Any] | Audio | Commit | Clear | Restart  # a dict is a server event to send


@dataclass(slots=True)
class TranscriptionSession:
    settings: Settings
    models: tuple[str, ...]  # the speech_to_text models a session may name
    kind: str = "transcription"  # or "realtime": the interpreter session (translated speech back)
    target: str = ""  # the interpreter's target language
    id: str = field(default_factory=lambda: "sess_" + secrets.token_hex(12))
    _events: itertools.count[int] = field(default_factory=itertools.count)
    _items: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _resampler: StreamResampler | None = None
    heard_samples: int = 0  # 16 kHz samples of input so far: the clock of audio_start_ms / audio_end_ms
    _item: str | None = None  # the turn being heard, from speech_started on
    _previous: str | None = None
    _agreement: LocalAgreement = field(default_factory=LocalAgreement)  # the open turn's words sent as deltas
    _client_event: str | None = None  # the event_id of the client event being handled: errors name it

    def __post_init__(self) -> None:
        self._resampler = StreamResampler(self.settings.rate, SAMPLE_RATE)

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "event_id": f"event_{self.id[5:13]}{next(self._events)}", **fields}

    def created(self) -> dict[str, Any]:
        return self.event("session.created", session=self.describe())

    def describe(self) -> dict[str, Any]:
        s = self.settings
        if self.kind == "realtime":
            audio_in = {"format": {"type": "audio/pcm", "rate": s.rate}, "turn_detection": s.turn_detection}
            output = {"format": {"type": "audio/pcm", "rate": s.output_rate}, "language": self.target}
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
                    "format": {"type": "audio/pcm", "rate": s.rate},
                    "transcription": {"model": s.model, "language": s.language, "prompt": s.prompt},
                    "turn_detection": s.turn_detection,
                    "noise_reduction": None,
                }
            },
            "include": [],
        }

    # --- client events ---
    def receive(self, text: str) -> list[Step]:
        """One client event's steps; a bad event is one `error` event (and nothing else happens)."""
        event: Any = None
        self._client_event = None
        try:
            try:
                event = json.loads(text)
            except ValueError as exc:
                raise RealtimeError(f"the event is not JSON: {exc}", "invalid_json") from None
            except RecursionError:  # a cheap message that costs a traceback a time: logged as a limit
                LIMITS_BITTEN.bit("realtime json depth", f"Realtime session {self.id}: {TOO_DEEP}")
                raise RealtimeError(TOO_DEEP, "invalid_json") from None
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise RealtimeError("an event is a JSON object with a string 'type'", "invalid_event", "type")
            client_id = event.get("event_id")
            self._client_event = client_id if isinstance(client_id, str) else None
            handler = HANDLERS.get(event["type"])
            if handler is None:
                raise RealtimeError(
                    f"unknown event type {event['type'][:60]!r} (known: {', '.join(HANDLERS)})", "invalid_event", "type"
                )
            return handler(self, event)
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
            settings = dataclasses.replace(settings, rate=audio_rate(given["format"]))
        if "transcription" in given:
            settings = with_transcription(
                settings, as_object(given["transcription"], "session.audio.input.transcription"), self.models
            )
        if "turn_detection" in given:
            settings = with_turn_detection(settings, given["turn_detection"])
        output = as_object(audio.get("output", {}), "session.audio.output")
        if self.kind == "realtime" and "format" in output:
            settings = dataclasses.replace(settings, output_rate=audio_rate(output["format"], "output"))
        steps: list[Step] = []
        if settings != self.settings:
            if settings.rate != self.settings.rate:
                self._resampler = StreamResampler(settings.rate, SAMPLE_RATE)
            self.settings = settings
            steps.append(Restart())
        return [*steps, self.event("session.updated", session=self.describe())]

    def _append(self, event: dict[str, Any]) -> list[Step]:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise RealtimeError(
                "input_audio_buffer.append needs 'audio': base64 PCM16", "missing_required_parameter", "audio"
            )
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("'audio' is not valid base64", "invalid_value", "audio") from None
        try:
            samples = pcm16(raw)
        except ApiError as exc:
            raise RealtimeError(exc.message, "invalid_value", "audio") from None
        assert self._resampler is not None
        resampled = self._resampler.feed(samples)
        self.heard_samples += len(resampled)
        return [Audio(resampled)] if len(resampled) else []

    def _commit(self, event: dict[str, Any]) -> list[Step]:
        item = self._item or self._new_item()
        self._item = None
        return [Commit(item)]

    def _clear(self, event: dict[str, Any]) -> list[Step]:
        self._item = None
        self._new_partials()
        return [Clear(), self.event("input_audio_buffer.cleared")]

    # --- what the box heard ---
    def _new_item(self) -> str:
        return f"item_{self.id[5:13]}{next(self._items):04d}"

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

    def response(self, item: str, text: str, audio: list[bytes], language: str, route: str) -> list[dict[str, Any]]:
        """An interpreter turn's answer: the translated speech (PCM16 at the output rate, in pieces)
        and its transcript, as a Realtime response with one assistant message; its metadata names the
        turn it answers, the language it is in and the route it took (the models, in order)."""
        response_id = f"resp_{self.id[5:13]}{next(self._items):04d}"
        out_item = f"item_{self.id[5:13]}{next(self._items):04d}"
        where = {"response_id": response_id, "item_id": out_item, "output_index": 0, "content_index": 0}
        message = {"id": out_item, "object": "realtime.item", "type": "message", "role": "assistant"}
        part = {"type": "output_audio", "transcript": text}
        done = {**message, "status": "completed", "content": [part]}
        head = {
            "id": response_id,
            "object": "realtime.response",
            "output_modalities": ["audio"],
            # the turn it answers, from its first event on (OpenAI's metadata: string values)
            "metadata": {"input_item_id": item, "language": language, "route": route},
        }
        return [
            self.event("response.created", response={**head, "status": "in_progress", "output": []}),
            self.event(
                "response.output_item.added",
                response_id=response_id,
                output_index=0,
                item={**message, "status": "in_progress", "content": []},
            ),
            self.event("response.output_audio_transcript.delta", **where, delta=text),
            *(self.event("response.output_audio.delta", **where, delta=base64.b64encode(p).decode()) for p in audio),
            self.event("response.output_audio.done", **where),
            self.event("response.output_audio_transcript.done", **where, transcript=text),
            self.event("response.output_item.done", response_id=response_id, output_index=0, item=done),
            self.event(
                "response.done",
                response={**head, "status": "completed", "output": [done]},
            ),
        ]

    def _pad_ms(self) -> int:
        return self.settings.vad.speech_pad_ms if self.settings.vad is not None else 0


DELTA = "conversation.item.input_audio_transcription.delta"


COMPLETED = "conversation.item.input_audio_transcription.completed"
HANDLERS = {
    "session.update": TranscriptionSession._update,
    "transcription_session.update": TranscriptionSession._update,  # the beta name some clients still send
    "input_audio_buffer.append": TranscriptionSession._append,
    "input_audio_buffer.commit": TranscriptionSession._commit,
    "input_audio_buffer.clear": TranscriptionSession._clear,
}

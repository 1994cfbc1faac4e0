"""An interpreter session's conversation (OpenAI's Realtime API, GA), without I/O: the user's items (the
turns the VAD closed or the client committed, and the client's own `conversation.item.create`, text or
audio) and the assistant's answers; `.truncate`, `.delete` and `.retrieve` on them; the events of a
response as it goes. realtime_session.py reads the client events, realtime_answers.py speaks.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from appliance.api.realtime_settings import RealtimeError, as_object
from appliance.errors import BadRequest
from appliance.kinds.speech_api import Segment
from appliance.kinds.text import checked_text

Event = Callable[..., dict[str, Any]]  # TranscriptionSession.event: a server event with its id
# a conversation keeps its latest items, no more: a session of hours, or a client creating items in a
# loop, holds at most this many (the oldest go first, as OpenAI's context truncation drops them)
MAX_ITEMS = 256


@dataclass(slots=True)
class Item:
    """One item of the conversation. A user item holds what to answer (its segments, in their
    language); an assistant item, the answer's text and how much of its audio the client has."""

    id: str
    role: str  # "user" or "assistant"
    content: list[dict[str, Any]]  # the GA content parts, as retrieve shows them (no audio data)
    segments: list[Segment] = field(default_factory=list)
    answered: bool = False
    audio_ms: int = 0  # an assistant item's audio sent so far
    cut_ms: int | None = None  # where the client truncated it: no audio past this is sent

    def describe(self, status: str = "completed") -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "role": self.role,
            "status": status,
            "content": self.content,
        }


@dataclass(slots=True)
class AudioItem:
    """A user item of audio to transcribe (16 kHz samples) before it joins the conversation."""

    item_id: str
    previous: str | None
    samples: Any  # np.ndarray


class Conversation:
    def __init__(self, event: Event) -> None:
        self.event = event
        self.items: dict[str, Item] = {}  # in the conversation's order

    def add(self, item: Item, previous: str | None = None) -> list[dict[str, Any]]:
        """Append an item (or insert it after `previous`): conversation.item.added, then .done."""
        if previous is not None and previous not in self.items:
            raise RealtimeError(f"no item {previous[:60]!r} to insert after", param="previous_item_id")
        before = previous if previous is not None else next(reversed(self.items), None)
        if previous is not None:  # dicts keep insertion order: rebuild it with the item in its place
            order = list(self.items.items())
            at = [k for k, _ in order].index(previous) + 1
            self.items = dict([*order[:at], (item.id, item), *order[at:]])
        else:
            self.keep(item)
        self._trim()
        return [
            self.event("conversation.item.added", previous_item_id=before, item=item.describe("in_progress")),
            self.event("conversation.item.done", previous_item_id=before, item=item.describe()),
        ]

    def keep(self, item: Item) -> None:
        """An item with no events of its own here (an answer: its response's events tell of it)."""
        self.items[item.id] = item
        self._trim()

    def _trim(self) -> None:
        while len(self.items) > MAX_ITEMS:
            del self.items[next(iter(self.items))]

    def user_turn(self, item_id: str, segments: list[Segment]) -> list[dict[str, Any]]:
        """A turn the VAD closed or the client committed, transcribed."""
        text = " ".join(s.text.strip() for s in segments).strip()
        part = {"type": "input_audio", "transcript": text}
        return self.add(Item(item_id, "user", [part], segments))

    def unanswered(self) -> Item | None:
        """The latest user item with something to say and no answer yet: what response.create answers."""
        for item in reversed(self.items.values()):
            if item.role == "user" and not item.answered and any(s.text.strip() for s in item.segments):
                return item
        return None

    def truncate(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        item = self._item(event)
        if item.role != "assistant":
            raise RealtimeError(f"item {item.id} is the user's: only an answer's audio is truncated", param="item_id")
        if event.get("content_index", 0) != 0:
            raise RealtimeError("content_index must be 0: an answer has one part", param="content_index")
        end = event.get("audio_end_ms")
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise RealtimeError("audio_end_ms must be a whole number of ms, 0 or more", param="audio_end_ms")
        if end > item.audio_ms:
            raise RealtimeError(
                f"audio_end_ms {end} is past the {item.audio_ms} ms of audio item {item.id} has sent",
                param="audio_end_ms",
            )
        item.cut_ms = item.audio_ms = end
        # OpenAI drops the text the listener did not hear; the answer's text is kept whole nowhere else
        item.content = [{"type": "output_audio", "transcript": ""}]
        return [self.event("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=end)]

    def delete(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        item = self._item(event)
        del self.items[item.id]  # a user item waiting for its answer is not answered
        return [self.event("conversation.item.deleted", item_id=item.id)]

    def retrieve(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        return [self.event("conversation.item.retrieved", item=self._item(event).describe())]

    def _item(self, event: dict[str, Any]) -> Item:
        item_id = event.get("item_id")
        if not isinstance(item_id, str):
            raise RealtimeError("item_id is missing", "missing_required_parameter", "item_id")
        if item_id not in self.items:
            raise RealtimeError(f"no item {item_id[:60]!r} in the conversation", "item_not_found", "item_id")
        return self.items[item_id]


def user_content(event: dict[str, Any]) -> tuple[str, bytes | None]:
    """A conversation.item.create's user message: its text, or its audio (base64 in the session's
    input format). One content part of either; anything else is an error naming it."""
    item = as_object(event.get("item"), "item")
    if item.get("type", "message") != "message" or item.get("role") != "user":
        raise RealtimeError("the box takes user messages only (type message, role user)", param="item.role")
    content = item.get("content")
    if not isinstance(content, list) or len(content) != 1 or not isinstance(content[0], dict):
        raise RealtimeError("item.content must be one input_text or input_audio part", param="item.content")
    part = content[0]
    if part.get("type") == "input_text" and isinstance(part.get("text"), str):
        try:
            return checked_text(part["text"], "item.content[0].text"), None
        except BadRequest as exc:  # too long, or empty: one error event, the session goes on
            raise RealtimeError(exc.message, param="item.content[0].text") from None
    if part.get("type") == "input_audio" and isinstance(part.get("audio"), str):
        try:
            return "", base64.b64decode(part["audio"], validate=True)
        except ValueError:
            raise RealtimeError("'audio' is not valid base64", param="item.content[0].audio") from None
    raise RealtimeError("item.content[0] must be input_text with 'text' or input_audio with 'audio'", param="item")


@dataclass(slots=True)
class Response:
    """One answer's events, from response.created to response.done."""

    event: Event
    id: str
    item: Item  # the assistant message it makes
    metadata: dict[str, str]

    def _head(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "output_modalities": ["audio"],
            "output": output,
            "metadata": self.metadata,  # the turn it answers, from its first event on (OpenAI's: strings)
        }

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    def started(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self._head("in_progress", [])),
            self.event(
                "response.output_item.added",
                response_id=self.id,
                output_index=0,
                item=self.item.describe("in_progress"),
            ),
        ]

    def text(self, text: str) -> list[dict[str, Any]]:
        self.item.content = [{"type": "output_audio", "transcript": text}]
        return [self.event("response.output_audio_transcript.delta", **self._where(), delta=text)]

    def audio(self, piece: bytes, ms: int) -> dict[str, Any]:
        self.item.audio_ms += ms
        return self.event("response.output_audio.delta", **self._where(), delta=base64.b64encode(piece).decode())

    def done(self) -> list[dict[str, Any]]:
        transcript = self.item.content[0]["transcript"] if self.item.content else ""
        return [
            self.event("response.output_audio.done", **self._where()),
            self.event("response.output_audio_transcript.done", **self._where(), transcript=transcript),
            *self.finished("completed"),
        ]

    def finished(self, status: str, reason: str | None = None) -> list[dict[str, Any]]:
        """The item's and the response's last events: completed, or cancelled (`reason`: client_cancelled,
        turn_detected)."""
        item = self.item.describe("completed" if status == "completed" else "incomplete")
        head = self._head(status, [item])
        if reason is not None:
            head["status_details"] = {"type": status, "reason": reason}
        return [
            self.event("response.output_item.done", response_id=self.id, output_index=0, item=item),
            self.event("response.done", response=head),
        ]

"""The GA Realtime pieces without a daemon: G.711 against Python's own audioop on every PCM16 value,
semantic_vad's eagerness as silence, and the conversation's bounds and errors (the session sans I/O)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from appliance import g711
from appliance.api.realtime_conversation import MAX_ITEMS
from appliance.api.realtime_session import TranscriptionSession
from appliance.api.realtime_settings import EAGERNESS_SILENCE_MS, default_settings

with warnings.catch_warnings():  # deprecated since 3.11, gone in 3.13: the judge while the box runs 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

LAWS = {g711.ULAW: (audioop.lin2ulaw, audioop.ulaw2lin), g711.ALAW: (audioop.lin2alaw, audioop.alaw2lin)}


@pytest.mark.parametrize("law", [g711.ULAW, g711.ALAW])
def test_g711_equals_audioop_on_every_value(law: str) -> None:
    encode, decode = LAWS[law]
    every = np.arange(-32768, 32768, dtype=np.int16)
    assert g711.encode(every.astype(np.float32) / 32768, law) == encode(every.tobytes(), 2)
    codes = bytes(range(256))
    expected = np.frombuffer(decode(codes, 2), np.int16)
    assert np.array_equal(np.round(g711.decode(codes, law) * 32768).astype(np.int16), expected)


def session(kind: str = "realtime") -> TranscriptionSession:
    made = TranscriptionSession(default_settings("whisper_tiny_en"), ("whisper_tiny_en",), kind=kind)
    made.text_language = "en"
    return made


def said(s: TranscriptionSession, **event: object) -> list:
    return s.receive(json.dumps(event))


def text_item(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


@pytest.mark.parametrize("eagerness", ["low", "medium", "high", "auto"])
def test_semantic_vad_eagerness_is_the_silence_that_ends_a_turn(eagerness: str) -> None:
    s = session("transcription")
    turn = {"type": "semantic_vad", "eagerness": eagerness}
    updated = said(s, type="session.update", session={"audio": {"input": {"turn_detection": turn}}})[-1]
    assert updated["session"]["audio"]["input"]["turn_detection"]["eagerness"] == eagerness
    assert s.settings.vad is not None and s.settings.vad.min_silence_ms == EAGERNESS_SILENCE_MS[eagerness]


def test_a_conversation_keeps_its_latest_items_only() -> None:
    s = session()
    for index in range(MAX_ITEMS + 40):
        assert said(s, type="conversation.item.create", item=text_item(f"turn {index}"))[-1]["type"] == (
            "conversation.item.done"
        )
    assert len(s.conversation.items) == MAX_ITEMS
    assert s.conversation.unanswered().segments[0].text == f"turn {MAX_ITEMS + 39}"


def test_bad_conversation_events_are_one_error_each_and_the_session_goes_on() -> None:
    s = session()
    answers = [
        said(s, type="conversation.item.create", item=text_item("x" * 70_000)),
        said(s, type="conversation.item.create", item=text_item("  ")),
        said(s, type="conversation.item.create", item={"type": "message", "role": "assistant", "content": []}),
        said(s, type="conversation.item.delete", item_id="item_nope"),
        said(s, type="conversation.item.truncate", item_id="item_nope", content_index=0, audio_end_ms=0),
    ]
    codes = [(a[0]["type"], a[0]["error"]["code"]) for a in answers]
    assert all(kind == "error" for kind, _ in codes) and codes[3][1] == codes[4][1] == "item_not_found", codes
    assert said(s, type="conversation.item.create", item=text_item("hello"))[-1]["type"] == "conversation.item.done"
    refused = said(session("transcription"), type="response.create")[0]
    assert refused["error"]["code"] == "invalid_event" and "interpreter" in refused["error"]["message"]

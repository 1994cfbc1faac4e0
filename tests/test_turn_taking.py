"""Conversation mode's short turns (kinds/speech_languages.py turn_taking): a segment under a second is
in the other of the two languages than the speech before it; anything else keeps Whisper's detection."""

from __future__ import annotations

from appliance.kinds.speech_api import SAMPLE_RATE, Options
from appliance.kinds.speech_languages import turn_taking
from appliance.kinds.speech_shards import Span

SHORT, LONG = Span(0, SAMPLE_RATE // 2, 0), Span(0, 3 * SAMPLE_RATE, 0)
CONVERSATION = Options(conversation=("en", "pt"))


def test_short_segments_alternate_after_the_speech_before_them() -> None:
    heard = [("en", 0.9), ("en", 0.91), ("ja", 0.6)]
    found = turn_taking(heard, [LONG, SHORT, SHORT], CONVERSATION)
    assert found == [("en", 0.9), ("pt", 1.0), ("en", 1.0)]
    told = Options(conversation=("en", "pt"), after="pt")  # a live session's last turn
    assert turn_taking([("pt", 0.8)], [SHORT], told) == [("en", 1.0)]


def test_a_turn_is_its_speech_without_the_vads_padding() -> None:
    """Realtime's default prefix_padding_ms (300) makes a 0.45 s "Sim." a span of 1.05 s."""
    padded = Span(0, int(1.05 * SAMPLE_RATE), 0)
    told = Options(conversation=("en", "pt"), after="en", padding=int(0.3 * SAMPLE_RATE))
    assert turn_taking([("en", 0.91)], [padded], told) == [("pt", 1.0)]
    assert turn_taking([("en", 0.91)], [padded], Options(conversation=("en", "pt"), after="en")) == [("en", 0.91)]


def test_whispers_detection_stands_without_a_turn_before_or_out_of_conversation_mode() -> None:
    assert turn_taking([("en", 0.91)], [SHORT], CONVERSATION) == [("en", 0.91)]  # the first turn
    assert turn_taking([("es", 0.9), ("en", 0.8)], [LONG, SHORT], CONVERSATION) == [("es", 0.9), ("en", 0.8)]
    one_way = Options(transcribed=("en", "pt"), after="en")
    assert turn_taking([("en", 0.91)], [SHORT], one_way) == [("en", 0.91)]

"""Conversation mode's short turns (kinds/speech_languages.py turn_taking): a segment under a second is
in the other of the two languages than the speech before it; anything else keeps Whisper's detection.
A live stream's decodes of speech that may go on (kinds/live_speech.py) are not told a language by it,
and a decode ahead's failure is reported once: by the request that takes it, or logged where dropped."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from test_live_units import LoudVad

from appliance.config.sections import SequenceConfig, VadConfig
from appliance.engine.sequences import OwnedTable
from appliance.engine.stats import RequestTimes
from appliance.kinds.base import SequenceCall
from appliance.kinds.live_speech import LiveTranscription
from appliance.kinds.speech_api import SAMPLE_RATE, Options, Segment
from appliance.kinds.speech_languages import turn_taking
from appliance.kinds.speech_shards import ShardPlan, Span

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


# the language the stand-in Whisper detects in speech at each level (LoudVad hears anything above 0.1 as
# speech); decoded in Japanese, it has no words
HEARD_AS = {0.5: "en", 0.7: "pt", 0.3: "ja"}


class TwoSpeakers:
    """A speech model on LoudVad whose Whisper hears speech by its level (HEARD_AS), its segments'
    languages then given by the real turn-taking rule unless the caller named one; each decode's
    language noted, in order. Its live streams are the real ones (`streams`)."""

    name = "whisper"

    def __init__(self) -> None:
        self.vad = cast(Any, LoudVad())
        self.live = cast(Any, SimpleNamespace(config=SimpleNamespace(vad=VadConfig())))
        self.clock = lambda: 0.0
        self.decoded: list[str] = []
        self.streams = LiveTranscription(cast(Any, self), OwnedTable(SequenceConfig))

    def check(self, options: Options) -> None:
        pass

    def plans(self, samples: np.ndarray, segments: list[tuple[int, int]]) -> list[ShardPlan]:
        return [ShardPlan([Span(*segment, 0)], segment[1] - segment[0]) for segment in segments]

    async def decode(self, plan: ShardPlan, samples: np.ndarray, options: Options, *_: Any) -> list[Segment]:
        span = plan.spans[0]
        heard = options.language or HEARD_AS[round(float(samples[span.start : span.end].max()), 1)]
        if options.language is None:
            [(heard, _)] = turn_taking([(heard, 0.9)], plan.spans, options)
        self.decoded.append(heard)
        return [] if heard == "ja" else [Segment(0.0, 1.0, "words", heard)]


def live_turns(model: TwoSpeakers, options: Options, *spans: tuple[float, float]) -> list[str]:
    """(seconds, level) spans fed to a live stream, in 128 ms chunks, decodes started ahead let run
    between them: the languages of the segments closed."""
    frames = [np.full(round(s * SAMPLE_RATE / 512) * 512, level, np.float32) for s, level in spans]
    audio, chunk = np.concatenate(frames), 4 * 512
    rules = VadConfig(min_silence_ms=500)  # a pause inside a sentence does not end it

    async def run() -> list[str]:
        found = []
        for at in range(0, len(audio), chunk):
            call = SequenceCall("s", at == 0, at + chunk >= len(audio))
            out = await model.streams.live_chunk(audio[at : at + chunk], call, False, options, RequestTimes(), rules)
            found += [s.language for _, segments in out.closed for s in segments]
            for _ in range(5):
                await asyncio.sleep(0)  # the decode ahead runs
        return found

    return asyncio.run(run())


AFTER_ENGLISH = Options(conversation=("en", "pt"), after="en")  # conversation mode, an English turn before


def test_a_sentences_first_words_before_a_pause_are_not_decoded_as_the_other_persons_turn() -> None:
    """0.6 s of English, a 0.25 s pause inside the sentence, 1.5 s more: the decode started ahead at the
    pause heard Whisper's language (told Portuguese, English was decoded as Portuguese: 1.4 s, looping)."""
    model = TwoSpeakers()
    assert live_turns(model, AFTER_ENGLISH, (0.6, 0.5), (0.25, 0.0), (1.5, 0.5), (1.0, 0.0)) == ["en"]
    assert len(model.decoded) >= 2 and set(model.decoded) == {"en"}, model.decoded  # the pause's decode ran


@pytest.mark.parametrize(
    ("level", "decoded"),
    [
        (0.5, ["en", "pt"]),  # heard ahead as English: decoded again, told Portuguese by the turns
        (0.3, ["ja", "pt"]),  # heard ahead as Japanese (base on "Não."), no words: again, told
        (0.7, ["pt"]),  # heard ahead as the turns tell it: that decode is the turn's
    ],
)
def test_a_one_word_turn_is_in_the_language_the_turns_tell_decoded_again_only_where_heard_otherwise(
    level: float, decoded: list[str]
) -> None:
    model = TwoSpeakers()
    assert live_turns(model, AFTER_ENGLISH, (0.5, level), (1.0, 0.0)) == ["pt"]
    assert model.decoded == decoded  # ahead as Whisper heard it, then again at the close where it differs


@pytest.mark.parametrize(
    "options",
    [Options("en", conversation=("en", "pt"), after="en"), Options(transcribed=("en", "pt"), after="en")],
    ids=["language-named", "one-way"],
)
def test_a_one_word_turn_is_decoded_once_where_no_turns_tell_its_language(options: Options) -> None:
    model = TwoSpeakers()
    assert live_turns(model, options, (0.5, 0.5), (1.0, 0.0)) == ["en"]
    assert model.decoded == ["en"]


class FailingWhisper(TwoSpeakers):
    """Every decode fails by a fault of ours."""

    async def decode(self, plan: ShardPlan, samples: np.ndarray, options: Options, *_: Any) -> list[Segment]:
        self.decoded.append("failed")
        raise RuntimeError("a bug of ours")


def test_a_decode_ahead_that_failed_is_the_closing_chunks_failure_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The decode started ahead fails before the close takes it: the closing chunk's request fails with
    it (its 500 logs it), and it is not logged a second time as a decode nobody awaits."""
    model = FailingWhisper()
    with caplog.at_level("ERROR", logger="appliance"), pytest.raises(RuntimeError, match="a bug of ours"):
        live_turns(model, AFTER_ENGLISH, (1.5, 0.5), (1.0, 0.0))
    assert model.decoded == ["failed"]  # the one ahead, taken at the close
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_a_failed_decode_ahead_that_the_speech_went_on_past_is_logged_where_it_is_ours(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pause inside a sentence: its decode ahead fails, and the speech goes on, so nobody awaits it;
    its failure is an ERROR with its traceback, once (the close's own decode fails the request)."""
    model = FailingWhisper()
    with caplog.at_level("ERROR", logger="appliance"), pytest.raises(RuntimeError, match="a bug of ours"):
        live_turns(model, AFTER_ENGLISH, (0.6, 0.5), (0.25, 0.0), (1.5, 0.5), (1.0, 0.0))
    errors = [(r.getMessage(), r.exc_info is not None) for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [("a decode run beside its stream (live-ahead) failed", True)], errors

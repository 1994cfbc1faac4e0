"""Continuous batching of the box's own Whisper decoder (engine/whisper_batch.py): sequences join
and leave the batch at every step, and each gets the tokens it gets decoding alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Keys
from speech import say
from test_whisper_reference import ENGLISH, model_dir

from appliance.engine import whisper_weights
from appliance.engine.whisper_arrays_engine import hotter
from appliance.engine.whisper_batch import DecodeBatch, Sequence
from appliance.engine.whisper_features import log_mel, mel_filters
from appliance.engine.whisper_model import WhisperModel
from appliance.engine.whisper_rules import Rules
from appliance.engine.whisper_tokens import WhisperTokens

FRAMES = 1000  # 10 s windows: the batching is the same as on 30 s ones, the encoder 3 times cheaper


@pytest.fixture(scope="module")
def tiny(voice_bundle: Path, keys: Keys, tmp_path_factory: pytest.TempPathFactory):
    directory = model_dir(voice_bundle, keys, "whisper_tiny_en")
    converted = tmp_path_factory.mktemp("tiny") / "whisper.npz"
    whisper_weights.convert(directory, converted)
    model = WhisperModel(whisper_weights.load(converted))
    tokens = WhisperTokens(directory / "tokenizer.json", False, [])
    return model, tokens, Rules.of(directory, tokens.eot, tokens.no_timestamps)


def batch(tiny, capacity: int) -> DecodeBatch:
    model, tokens, rules = tiny
    return DecodeBatch(model, rules, capacity, tokens.sot, None, frames=FRAMES // 2)


def test_sequences_joining_and_leaving_at_every_step_get_what_they_get_alone(tiny) -> None:
    model, tokens, _ = tiny
    features = log_mel([say(s) for s in ENGLISH], mel_filters(model.n_mels))[:, :, :FRAMES]
    cross = model.cross(model.encode(features))
    # each window with no prompt and with a previous-text prompt: prompts of 1 and of 6 tokens
    jobs = [
        (at, tokens.prompt("transcribe", "en", p))
        for at in range(len(ENGLISH))
        for p in ((), tokens.ids("Hi, it's Sam."))
    ]

    alone = []
    for at, prompt in jobs:
        one = batch(tiny, 1)
        one.join(Sequence(prompt), cross, at)
        while one.rows:
            ended = one.step()
        alone.append(ended[0].chosen)
    assert all(ids[-1] == tokens.eot and len(ids) > 3 for ids in alone)

    # every step: the stranger that joined at the last one is dropped (its caller went away), a new
    # stranger joins, and a waiting sequence joins where two rows are free (one kept for strangers)
    together = batch(tiny, 4)
    waiting, finished, cancelled, steps = [Sequence(p, key) for key, (_, p) in enumerate(jobs)], {}, [], []
    while waiting or any(s.key >= 0 for s in together.rows):
        for doomed in cancelled:
            together.leave(doomed)
        if waiting and together.free >= 2:
            sequence = waiting.pop(0)
            together.join(sequence, cross, jobs[sequence.key][0])
        stranger = Sequence(tokens.prompt("transcribe", "en"), -1)
        together.join(stranger, cross, len(steps) % len(ENGLISH))
        left_with_it = len(cancelled)
        cancelled = [stranger]
        for sequence in together.step():
            left_with_it += 1
            if sequence.key >= 0:
                finished[sequence.key] = sequence.chosen
        steps.append(left_with_it)
    assert [finished[k] for k in range(len(jobs))] == alone
    assert all(steps[1:]), steps  # at every step one joined and one (or more) left
    one_by_one = sum(len(ids) + len(prompt) for ids, (_, prompt) in zip(alone, jobs))
    assert together.steps < one_by_one / 2  # and they shared the steps


def test_a_full_batch_refuses_one_more_and_a_prompt_too_long_is_refused(tiny) -> None:
    model, tokens, _ = tiny
    cross = model.cross(model.encode(log_mel([say(ENGLISH[2])], mel_filters(model.n_mels))[:, :, :FRAMES]))
    full = batch(tiny, 1)
    full.join(Sequence(tokens.prompt("transcribe", "en")), cross, 0)
    with pytest.raises(RuntimeError, match="the decode batch is full"):
        full.join(Sequence(tokens.prompt("transcribe", "en")), cross, 0)
    with pytest.raises(ValueError, match="a prompt of 448 tokens: the decoder takes 1 to 447"):
        batch(tiny, 1).join(Sequence([tokens.sot] * 448), cross, 0)


def test_a_looping_or_unsure_decode_is_tried_again_hotter_unless_nothing_was_said(
    voice_bundle: Path, keys: Keys
) -> None:
    """openai-whisper's fallback rule (whisper_arrays_engine.py), on the decodes it judges: a text that
    compresses more than 2.4 times, or a mean log probability under -1, runs again at the next
    temperature; not where <|nocaptions|> was likelier than 0.6 (silence), nor past 1.0."""
    directory = model_dir(voice_bundle, keys, "whisper_tiny_en")
    tokens = WhisperTokens(directory / "tokenizer.json", False, [])
    text = list(tokens.ids("Where is the nearest pharmacy?"))
    prompt = tokens.prompt("transcribe", "en")

    def decoded(ids: list[int], mean: float, no_speech: float = 0.1, temperature: float = 0.0) -> Sequence:
        chosen = [*ids, tokens.eot]
        return Sequence(prompt, 3, temperature, chosen=chosen, logprob=mean * len(chosen), no_speech_prob=no_speech)

    assert hotter(decoded(text, -0.3), tokens) is None  # sure, and no loop
    looping = hotter(decoded(text * 12, -0.1), tokens)
    assert looping is not None and (looping.key, looping.temperature, looping.prompt) == (3, 0.2, prompt)
    unsure = hotter(decoded(text, -1.5, temperature=0.4), tokens)
    assert unsure is not None and unsure.temperature == 0.6 and not unsure.chosen
    assert hotter(decoded(text, -1.5, no_speech=0.8), tokens) is None  # silence
    assert hotter(decoded(text * 12, -1.5, temperature=1.0), tokens) is None  # no hotter one


def test_where_no_hotter_decode_stands_the_first_is_kept_cut_where_its_loop_begins(
    voice_bundle: Path, keys: Keys, tmp_path: Path
) -> None:
    """The box's own engine on a sentence said six times (tests/test_languages.py has it through the
    daemon): every sample at 0.2 to 1.0 loops or is unsure, and the answer is the first decode's two
    turns, not the hottest sample's words nobody said."""
    from test_languages import REPEATED
    from test_whisper_reference import converted

    from appliance.engine.speech_engine import Shard

    engine = converted(model_dir(voice_bundle, keys, "whisper_tiny_en"), tmp_path)
    (answer,) = engine.run([Shard(say(" ".join([REPEATED] * 6)), "en")])
    text = " ".join(piece.text for piece in answer.pieces).strip()
    assert engine.retried["temperature"] == 5 and answer.quality.temperature == 0.0, (engine.retried, answer)
    turn = text[: len(text) // 2].strip()  # greedy tiny.en hears "at mustation ... leans": its own, at 0.0
    assert turn.startswith("We will meet at") and text == f"{turn} {turn}", text

"""Word timestamps of the box's own Whisper (engine/whisper_align.py: its alignment heads' cross-attention,
median filtered, through dynamic time warping) against the shipped engine's (CTranslate2's `align`)
on a window of three sentences: the same words, each starting and ending within 0.1 s of CTranslate2's
(measured: within 0.02 s, one 20 ms encoder position), inside the span each sentence was said."""

from __future__ import annotations

from pathlib import Path

from conftest import Keys
from speech import recording
from test_whisper_reference import ENGLISH, model_dir

from appliance.engine import whisper_weights
from appliance.engine.speech_engine import Shard
from appliance.engine.whisper import WhisperEngine
from appliance.engine.whisper_arrays_engine import ArrayWhisperEngine


def test_words_are_timed_as_ctranslate2_times_them(voice_bundle: Path, keys: Keys, tmp_path: Path) -> None:
    directory = model_dir(voice_bundle, keys, "whisper_tiny_en")
    whisper_weights.convert(directory, tmp_path / "w.npz")
    ours = ArrayWhisperEngine(whisper_weights.load(tmp_path / "w.npz"), directory, 8)
    audio, spans = recording(ENGLISH)
    shard = [Shard(audio, words=True)]
    mine, theirs = ours.run(shard)[0].words, WhisperEngine(directory, "cpu", 2, 1).run(shard)[0].words
    assert [w.text for w in mine] == [w.text for w in theirs] and len(mine) == 17
    for a, b in zip(mine, theirs):
        assert abs(a.start - b.start) <= 0.1 and abs(a.end - b.end) <= 0.1, (a, b)
        assert abs(a.probability - b.probability) <= 0.1, (a, b)
    pharmacy = next(w for w in mine if "pharmacy" in w.text)
    assert spans[1][0] - 0.5 <= pharmacy.start <= spans[1][1]  # heard while the second sentence was said

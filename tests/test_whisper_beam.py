"""Beam search (beam 5) of the box's own Whisper (engine/whisper_beams.py on the NumPy reference)
against the shipped CPU engine (CTranslate2 int8, beam 5) on the same windows of several sentences:
its word error rate against the text said is the same or better, and a piece both give the same
text ends within 0.1 s of CTranslate2's, and starts within 0.1 s where the piece before it is also
the same (a piece starts where the one before ended: on the second window ours heard two sentences as
one piece, 0 to 7 s, CTranslate2 as two, and the next piece started at 7.0 s against 6.0 s)."""

from __future__ import annotations

import re
from pathlib import Path

import jiwer
from conftest import Keys
from speech import recording
from test_whisper_reference import ENGLISH, model_dir
from test_whisper_windows import ENGLISH as MORE

from appliance.engine import whisper_weights
from appliance.engine.speech_engine import Shard
from appliance.engine.whisper import WhisperEngine
from appliance.engine.whisper_arrays_engine import ArrayWhisperEngine


def words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z ]", " ", text.lower()).split())


def test_beam_5_hears_as_well_as_ctranslate2_and_times_pieces_alike(
    voice_bundle: Path, keys: Keys, tmp_path: Path
) -> None:
    directory = model_dir(voice_bundle, keys, "whisper_tiny_en")
    whisper_weights.convert(directory, tmp_path / "w.npz")
    ours = ArrayWhisperEngine(whisper_weights.load(tmp_path / "w.npz"), directory, 8, beam_size=5)
    theirs = WhisperEngine(directory, "cpu", 2, 5)
    said = [ENGLISH, MORE[3:6]]
    shards = [Shard(recording(sentences)[0]) for sentences in said]
    answers = {"ours": ours.run(shards), "ctranslate2": theirs.run(shards)}
    references = [words(" ".join(s)) for s in said]
    wer = {k: jiwer.wer(references, [words(" ".join(p.text for p in d.pieces)) for d in v]) for k, v in answers.items()}
    assert wer["ours"] <= wer["ctranslate2"], wer
    ends = starts = 0
    for mine, other in zip(answers["ours"], answers["ctranslate2"]):
        timed = {p.text: (p.start, p.end, k and other.pieces[k - 1].text) for k, p in enumerate(other.pieces)}
        for k, piece in enumerate(mine.pieces):
            if piece.text in timed:
                start, end, before = timed[piece.text]
                assert abs(piece.end - end) <= 0.1, (piece, end)
                ends += 1
                if before == (k and mine.pieces[k - 1].text):
                    assert abs(piece.start - start) <= 0.1, (piece, start)
                    starts += 1
    assert ends >= 5 and starts >= 4, (answers, wer)  # most pieces were compared
    assert ours.batch.rows_stepped >= 5 * ours.batch.steps // 2  # it decoded with five beams a shard

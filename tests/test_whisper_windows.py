"""Whisper windows shared across shards (appliance/engine/whisper_windows.py): the packing and the
split as plain functions, then Whisper tiny.en itself on espeak-ng sentences, each shard judged by
the sentence it was made from (the known text), packed against decoded alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jiwer
import numpy as np
import pytest
from conftest import Keys
from speech import RATE, say
from test_speech_to_text import CLEAR, ENGLISH, words

from appliance import firmware
from appliance.engine.speech_engine import Decoded, Shard
from appliance.engine.whisper import WhisperEngine
from appliance.engine.whisper_tokens import Piece
from appliance.engine.whisper_windows import Window, pack, split

PAD = np.zeros(int(0.3 * RATE), np.float32)  # a shard starts and ends with 0.3 s of silence (speech_shards.GAP_S)


def test_pack_fills_windows_in_order_and_keeps_unpackable_shards_alone() -> None:
    lengths = [10, 10, 10, 5, 7, 30]
    keys = ["en", "en", "en", None, "de", "en"]
    windows = pack(lengths, keys, capacity=25, separator=2)
    assert sorted(m for w in windows for m in w.members) == list(range(6))  # every shard exactly once
    assert Window((0, 1), (0, 12), (10, 10)) in windows  # 10 + 2 + 10 fits 25; a third 10 does not
    assert Window((3,), (0,), (5,)) in windows  # no key: alone
    assert all(len(w.members) == 1 for w in windows if 4 in w.members or 5 in w.members)
    assert all(w.length <= 25 or len(w.members) == 1 for w in windows)


def test_split_gives_each_piece_to_the_shard_whose_audio_it_covers() -> None:
    window = Window((4, 7, 9), (0, 6 * RATE, 12 * RATE), (5 * RATE, 4 * RATE, 5 * RATE))
    # Whisper's times drift: the second piece starts 0.4 s before its shard's audio, the last runs on
    found = split(window, [(0.0, 4.0, "one"), (5.6, 9.9, "two"), (12.2, 17.0, "three")], RATE)
    assert found.alone == set()
    assert found.pieces == {
        4: [(0.0, 4.0, "one")],
        7: [(0.0, pytest.approx(3.9), "two")],
        9: [(pytest.approx(0.2), 5.0, "three")],
    }


def test_a_piece_covering_two_shards_sends_both_alone() -> None:
    window = Window((0, 1, 2), (0, 6 * RATE, 12 * RATE), (5 * RATE, 4 * RATE, 5 * RATE))
    found = split(window, [(0.0, 8.0, "one and two"), (12.0, 16.0, "three")], RATE)
    assert found.alone == {0, 1}
    assert found.pieces == {2: [(0.0, 4.0, "three")]}


def test_a_piece_over_two_shards_is_cut_where_its_words_were_heard() -> None:
    window = Window((0, 1), (0, 7 * RATE), (5 * RATE, 4 * RATE))  # audio at 0 to 5 s and 7 to 11 s
    words = [(1.0, " one"), (2.0, " more"), (7.4, " two"), (8.0, " words")]
    found = split(window, [(0.0, 9.0, "one more two words")], RATE, [words])
    assert found.alone == set()
    assert found.pieces == {0: [(1.0, 5.0, "one more")], 1: [(pytest.approx(0.4), 2.0, "two words")]}
    # every word heard in the first shard: the piece's end only drifted into the second (tiny.en's
    # times land on whole seconds), so it is the first's, and the second keeps its own pieces
    drifted = [(1.0, " one"), (2.0, " more"), (4.2, " words")]
    found = split(window, [(0.0, 7.8, "one more words"), (8.0, 10.0, "two")], RATE, [drifted, [(8.1, " two")]])
    assert found.alone == set()
    assert found.pieces == {0: [(1.0, 5.0, "one more words")], 1: [(pytest.approx(1.0), 3.0, "two")]}
    # a word heard in the silence between them (more than REACH_S from both): neither can have it
    lost = [(1.0, " one"), (6.0, " more"), (7.4, " two")]
    assert split(window, [(0.0, 9.0, "one more two")], RATE, [lost]).alone == {0, 1}
    # words that go back from the second shard to the first: not a cut, a muddle
    back = [(7.4, " two"), (1.0, " one")]
    assert split(window, [(0.0, 9.0, "two one")], RATE, [back]).alone == {0, 1}


def test_a_shard_the_window_gave_no_text_goes_alone() -> None:
    window = Window((0, 1), (0, 6 * RATE), (5 * RATE, 5 * RATE))
    found = split(window, [(0.0, 4.0, "one")], RATE)  # Whisper stopped after the first shard
    assert found.alone == {1} and found.pieces == {0: [(0.0, 4.0, "one")]}


@pytest.fixture(scope="module")
def tiny(keys: Keys, voice_bundle: Path) -> Path:
    bundle = firmware.verify(voice_bundle, keys.trusted)
    spec = next(m for m in bundle.manifest.models if m.name == "whisper_tiny_en")
    return bundle.artifact(spec.file)


def engine(directory: Path, separator_s: float = 1.5) -> WhisperEngine:
    return WhisperEngine(directory, "cpu", 2, 5, window_samples=1400 * 320, separator_s=separator_s)


def text(decoded) -> str:
    return " ".join(p.text for p in decoded.pieces)


def test_packed_windows_give_each_shard_the_text_it_would_get_alone(tiny: Path) -> None:
    """Twelve shards of one request (two sentences each, every shard its own pair) in a few shared
    windows: each gets its own words, with a word error rate within 0.01 of decoding it alone."""
    pairs = [(ENGLISH[i], ENGLISH[(i + 5) % len(ENGLISH)]) for i in range(len(ENGLISH))]
    shards = [Shard(np.concatenate([PAD, say(a), PAD, say(b), PAD]), request="one") for a, b in pairs]
    whisper = engine(tiny)
    packed = whisper.run(shards)
    assert whisper.windows["windows"] < len(shards) / 2, dict(whisper.windows)  # shared: 3 to 5 a window
    alone = [whisper.run([s])[0] for s in shards]
    references = [words(f"{a} {b}") for a, b in pairs]
    packed_wer = jiwer.wer(references, [words(text(d)) for d in packed])
    alone_wer = jiwer.wer(references, [words(text(d)) for d in alone])
    assert packed_wer <= alone_wer + 0.01, (packed_wer, alone_wer, [text(d) for d in packed])
    for (a, b), decoded in zip(pairs, packed):  # the right shard gets each word
        own, heard = words(f"{a} {b}").split(), words(text(decoded)).split()
        # its own sentences (a word or three misheard: "The weather" heard as "but when there")
        assert sum(w in heard for w in own) >= len(own) - 3, (a, b, text(decoded))
        # and no other shard's: no three words in a row from another pair that its own lacks
        others = {t for x, y in pairs if (x, y) != (a, b) for t in trigrams(words(f"{x} {y}").split())}
        leaked = (trigrams(heard) & others) - trigrams(own)
        assert not leaked, (a, b, text(decoded), leaked)
        assert all(0.0 <= p.start <= p.end <= decoded.pieces[-1].end for p in decoded.pieces)


def trigrams(sequence: list[str]) -> set[tuple[str, ...]]:
    return {tuple(sequence[i : i + 3]) for i in range(len(sequence) - 2)}


def test_the_engine_decodes_the_shards_of_a_straddling_piece_alone(tiny: Path, monkeypatch) -> None:
    """The engine's wiring: the shared window's decode gives a piece over shards 0 and 1; those two are
    decoded again alone (side by side, on the model's two workers) and answered from that, shard 2
    from the window."""
    whisper = engine(tiny)
    calls: list[list[int]] = []

    def decode(model, shards: list[Shard], shared: int = 0) -> list[Decoded]:
        calls.append([len(s.samples) for s in shards])
        if len(calls) == 1:  # the window: shards at 0, 2.5 and 5.1 s
            return [Decoded("en", [Piece(0.0, 3.5, "zero and one"), Piece(5.1, 6.3, "two")])]
        return [Decoded("en", [Piece(0.0, 1.0, f"alone {len(s.samples)}")]) for s in shards]

    monkeypatch.setattr(whisper, "_run", decode)
    lengths = [RATE, RATE * 11 // 10, RATE * 12 // 10]
    answers = whisper.run([Shard(np.zeros(n, np.float32), request="one") for n in lengths])
    # the window, then shards 0 and 1 alone, each in one of the engine's two lanes
    assert calls[0] == [int(5.1 * RATE) + lengths[2]] and sorted(calls[1:]) == [[lengths[0]], [lengths[1]]], calls
    assert [text(a) for a in answers] == [f"alone {lengths[0]}", f"alone {lengths[1]}", "two"]
    assert answers[2].pieces == [Piece(0.0, pytest.approx(1.2), "two", tokens=whisper.tokens.ids("two"))]
    assert dict(whisper.windows) == {"shards": 3, "windows": 1, "alone": 2}


def test_whisper_running_two_shards_into_one_piece_takes_the_fallback(tiny: Path) -> None:
    """No silence between the shards: Whisper runs sentences of two shards into one piece, and those
    shards are decoded alone (their texts repaired: the four sentences heard within 10%)."""
    whisper = engine(tiny, separator_s=0.0)
    decoded = whisper.run([Shard(say(s), request="one") for s in CLEAR[:4]])
    assert whisper.windows["alone"] >= 2, dict(whisper.windows)
    assert jiwer.wer([words(s) for s in CLEAR[:4]], [words(text(d)) for d in decoded]) <= 0.1


def test_shards_share_a_window_only_with_their_own_requests(tiny: Path, monkeypatch) -> None:
    """Whisper's text of one shard in a window conditions the next one's: another request's speech
    must not change a request's text, so only shards of one request (and none without one) share."""
    whisper = engine(tiny)
    windows: list[int] = []

    def decode(model, shards: list[Shard], shared: int = 0) -> list[Decoded]:
        windows.extend(len(s.samples) for s in shards)  # a piece on each 1 s shard, 2.5 s apart in a window
        return [
            Decoded("en", [Piece(at, at + 1.0, "words") for at in (0.0, 2.5)[: 1 + (len(s.samples) > RATE)]])
            for s in shards
        ]

    monkeypatch.setattr(whisper, "_run", decode)
    requests = ["a", "b", "a", None, None, "b"]
    whisper.run([Shard(np.zeros(RATE, np.float32), request=r) for r in requests])
    shared = int(1.5 * RATE) + 2 * RATE  # two 1 s shards and the silence between them
    assert sorted(windows) == [RATE, RATE, shared, shared], windows
    assert dict(whisper.windows) == {"shards": 6, "windows": 4, "alone": 0}


@pytest.mark.parametrize("coming", [True, False], ids=["recording-in-its-vad", "nothing-coming"])
def test_a_batch_waits_for_shards_of_a_recording_still_in_its_vad(coming: bool) -> None:
    """BatchQueue's `coming`: while a recording is cut by the VAD, a batch that is not full waits for
    its shards (so eight clients' shards share one engine call); with nothing coming it runs at once."""
    from appliance.config import EngineConfig
    from appliance.engine.batch_queue import BatchQueue
    from appliance.engine.queue_policy import QueuePolicy
    from appliance.engine.stats import ModelStats

    calls: list[list[int]] = []

    async def scenario() -> None:
        queue: BatchQueue[int, int] = BatchQueue(
            lambda batch: calls.append(batch) or batch,
            8,
            stats := ModelStats(),
            QueuePolicy("test", EngineConfig, stats),
            coming=lambda: coming and len(calls) == 0,
        )
        queue.start()
        first = queue.submit([1])
        await asyncio.sleep(0.05)  # the second request's VAD finishes 50 ms later
        second = queue.submit([2])
        await asyncio.gather(*first, *second)
        await queue.stop(1.0)

    asyncio.run(scenario())
    assert calls == ([[1, 2]] if coming else [[1], [2]])

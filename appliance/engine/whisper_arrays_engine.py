"""The box's own Whisper engine (a `SpeechEngine`): whisper_model.py over an array module, its
decoder continuously batched (whisper_batch.py).

NumPy computes in float32: the reference CI holds against CTranslate2 on the CPU. CuPy runs the same
code in float16 on the GPU. A batch's encoder windows run max_batch at a time; its sequences join the
decode batch while it has a free row, and a decode that loops on itself or is unsure of itself
(whisper_loops.stands) joins again at the next temperature while the others still decode, as
openai-whisper falls back; where none stands, the first decode does, cut where its loop begins
(whisper_decoding.py). Greedy or beam search
(whisper_beams.py); each shard in its own window.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np

from appliance.engine import whisper_align, whisper_language, whisper_loops
from appliance.engine.speech_engine import Decoded, Shard, check_request
from appliance.engine.whisper_batch import DecodeBatch, Sequence
from appliance.engine.whisper_beams import BeamGroup
from appliance.engine.whisper_decoding import Decoding
from appliance.engine.whisper_features import HOP, SAMPLE_RATE, WINDOW_FRAMES, log_mel, mel_filters
from appliance.engine.whisper_model import KvCache, WhisperModel
from appliance.engine.whisper_ops import ArrayOps, softmax, to_host
from appliance.engine.whisper_rules import Rules
from appliance.engine.whisper_tokens import WhisperTokens
from appliance.engine.whisper_words import Word

MULTILINGUAL_VOCABULARY = 51865


def stands(sequence: Sequence, tokens: WhisperTokens) -> bool:
    """The decode neither loops nor is unsure, or nothing was said (whisper_loops.stands)."""
    ids = [t for t in sequence.chosen if t < tokens.eot]
    mean = sequence.logprob / (len(sequence.chosen) or 1)
    return whisper_loops.stands(ids, tokens.tokenizer.decode(ids), mean, sequence.no_speech_prob)


def hotter(sequence: Sequence, tokens: WhisperTokens) -> Sequence | None:
    """The same prompt at the next temperature, where this decode does not stand, as openai-whisper
    falls back; None where it stands or was the hottest."""
    temperatures = [t for t in whisper_loops.FALLBACK_TEMPERATURES if t > sequence.temperature]
    if not temperatures or stands(sequence, tokens):
        return None
    return Sequence(sequence.prompt, sequence.key, temperatures[0], sequence.timestamps)


class ArrayWhisperEngine:
    """One Whisper on an array module; `weights`: the arrays whisper_weights.py converted,
    `directory`: the model's CTranslate2 directory (tokenizer.json, config.json)."""

    def __init__(
        self,
        weights: dict[str, np.ndarray],
        directory: Path,
        max_batch: int,
        xp: Any = np,
        dtype: Any = np.float32,
        name: str = "whisper-numpy",
        weight_bytes: int = 0,
        beam_size: int = 1,
        ops: ArrayOps | None = None,
    ) -> None:
        """`beam_size` 1: greedy; more: beam search, each shard's beams rows of the max_batch. `ops`: the
        fused steps (the firmware's kernels, whisper_ops.py), else the array module's operations."""
        self.model = WhisperModel(weights, xp, dtype, ops)
        self.beam_size = min(beam_size, max_batch)
        self.name, self.max_batch, self.weight_bytes = name, max_batch, weight_bytes
        languages = whisper_language.codes(directory)
        # as CTranslate2 tells: the English-only models have one token fewer (51864)
        multilingual = self.model.vocabulary >= MULTILINGUAL_VOCABULARY
        self.tokens = WhisperTokens(directory / "tokenizer.json", multilingual, languages)
        self.rules = Rules.of(directory, self.tokens.eot, self.tokens.no_timestamps)
        config = json.loads((directory / "config.json").read_text())
        self.language_ids = [int(i) for i in config.get("lang_ids", [])]
        self.alignment_heads = [(int(layer), int(head)) for layer, head in config.get("alignment_heads", [])]
        no_speech = [self.tokens.tokenizer.token_to_id(t) for t in ("<|nospeech|>", "<|nocaptions|>")]
        self.no_speech = next((int(t) for t in no_speech if t is not None), None)
        self.filters = mel_filters(self.model.n_mels)
        self.fallbacks: Counter[str] = Counter()  # none: it is the GPU engine SpeechCpuFallback counts for
        self.retried: Counter[str] = Counter()  # decodes run again at a higher temperature
        self.windows: Counter[str] = Counter()
        self.batch = DecodeBatch(self.model, self.rules, max_batch, self.tokens.sot, self.no_speech)

    def check(self, language: str | None, task: str) -> None:
        check_request(self.tokens, language, task)

    def run(self, shards: list[Shard]) -> list[Decoded]:
        """Each shard decoded (beam search, or sampled at its temperature), timed pieces out, in the shards' order."""
        decoding = Decoding(self)
        decoding.begin(list(enumerate(shards)))
        answers: dict[Hashable, Decoded] = {}
        while decoding.busy:
            answers.update(decoding.advance())
        return [answers[i] for i in range(len(shards))]

    def decoding(self, max_batch: int) -> Decoding:
        """The batch queue's runner: shards of any request join this engine's batch as rows free up."""
        assert max_batch == self.max_batch, (max_batch, self.max_batch)
        return Decoding(self)

    def hotter(self, sequence: Sequence) -> Sequence | None:
        return hotter(sequence, self.tokens)

    def stands(self, sequence: Sequence) -> bool:
        return stands(sequence, self.tokens)

    def words(self, shard: Shard, language: str, ids: list[int], cross: list[tuple[Any, Any]], at: int) -> list[Word]:
        """The shard's words timed by the alignment heads (whisper_align.py); item `at` of `cross`."""
        return whisper_align.words(
            self.model,
            cross,
            at,
            self.tokens.prompt(shard.task, language),
            [t for t in ids if t < self.tokens.eot],
            (self.tokens.no_timestamps, self.tokens.eot),
            min(len(shard.samples) // HOP, WINDOW_FRAMES),
            self.alignment_heads,
            self.tokens.tokenizer.decode,
            language,
        )

    def decode(
        self, waiting: list[Sequence], cross: list[list[tuple[Any, Any]]], fallback: bool = True
    ) -> dict[Hashable, Sequence]:
        """Every sequence (its key: its index in the encoded batch) decoded on the continuous batch:
        one joins as soon as a row is free, a fallback joins again at its next temperature (unless
        `fallback` is False); the last answer of each key."""
        decoding = Decoding(self, fallback)
        for sequence in waiting:
            assert isinstance(sequence.key, int)
            chunk, at = divmod(sequence.key, self.max_batch)
            decoding.add(sequence, cross[chunk], at)
        finished: dict[Hashable, Sequence] = {}
        while decoding.busy:
            finished.update((s.key, s) for s in decoding.step())
        return finished

    def beams_of(self, sequence: Sequence) -> list[Sequence]:
        """A greedy decode as beam_size beams of one group (beam search); a sampled one as it is."""
        if sequence.temperature > 0 or self.beam_size == 1:
            return [sequence]
        group = BeamGroup(self.beam_size)
        return [
            Sequence(sequence.prompt, sequence.key, 0.0, sequence.timestamps, group=group) for _ in range(group.size)
        ]

    def encode(self, features: np.ndarray) -> list[list[tuple[Any, Any]]]:
        """Encoder windows max_batch at a time; each chunk's cross-attention keys and values."""
        return [
            self.model.cross(self.model.encode(features[at : at + self.max_batch]))
            for at in range(0, len(features), self.max_batch)
        ]

    def languages(self, shards: list[Shard], cross: list[list[tuple[Any, Any]]]) -> list[tuple[str, float]]:
        """The caller's language (1.0), else Whisper's detection on the shard's window."""
        if not self.tokens.multilingual:
            return [("en", 1.0)] * len(shards)
        found: list[tuple[str, float]] = []
        for chunk, items in enumerate(cross):
            members = shards[chunk * self.max_batch : (chunk + 1) * self.max_batch]
            heard = self._detect_on(items, len(members)) if any(s.language is None for s in members) else []
            found += [(s.language, 1.0) if s.language else heard[k] for k, s in enumerate(members)]
        return found

    def _detect_on(self, cross: list[tuple[Any, Any]], count: int) -> list[tuple[str, float]]:
        """The language tokens' distribution after <|startoftranscript|>: the likeliest and its probability."""
        xp = self.model.xp
        cache = KvCache(self.model, count, int(cross[0][0].shape[2]))
        for i in range(count):
            cache.put(i, cross, i)
        logits = to_host(xp, self.model.step(cache, xp.asarray([self.tokens.sot] * count), xp.zeros(count, int)))
        probs = softmax(np, logits[:, self.language_ids])
        best = probs.argmax(axis=1)
        decode = self.tokens.tokenizer.id_to_token
        return [
            (whisper_language.code(str(decode(self.language_ids[b]))), round(float(p[b]), 3))
            for b, p in zip(best, probs)
        ]

    def detect(self, clips: list[np.ndarray]) -> list[tuple[str, float]]:
        """Each clip's language from its first DETECT_MAX_S and DETECT_PAD_S of silence after it, as
        whisper_language.detect asks CTranslate2."""
        assert self.tokens.multilingual, "an English-only Whisper detects no language"
        if not clips:
            return []
        clips = [c[: int(whisper_language.DETECT_MAX_S * SAMPLE_RATE)] for c in clips]
        pad = int(whisper_language.DETECT_PAD_S * SAMPLE_RATE) // HOP
        frames = min(WINDOW_FRAMES, max(len(c) for c in clips) // HOP + pad)
        features = np.ascontiguousarray(log_mel(clips, self.filters)[:, :, :frames])
        found: list[tuple[str, float]] = []
        for at in range(0, len(clips), self.max_batch):
            chunk = self.model.cross(self.model.encode(features[at : at + self.max_batch]))
            found += self._detect_on(chunk, min(self.max_batch, len(clips) - at))
        return found

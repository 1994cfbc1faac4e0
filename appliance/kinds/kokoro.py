"""Kokoro-82M as a speaker of the speech kind: one graph (int8 ONNX), many voices.

A voice is a style table (firmware/voices.py): the row for a shard of n phoneme tokens is the style
the graph takes with it. Phonemes come from espeak-ng with ^ tying a phoneme's letters, mapped to
Kokoro's symbols as its own G2P (misaki's espeak fallback for languages other than English) maps
them: the tied diphthongs and affricates become one symbol each, and symbols outside Kokoro's
114-symbol vocabulary are dropped. A shard is [0, tokens..., 0]: at most 510 tokens between the pads.

The graph takes one shard per call (tokens [1, n], style [1, 256], speed [1]): there is no padded
batch to make. On the CPU engine a batch's shards run side by side on single-threaded sessions
(`lanes`, one per intra-op thread), and a lone shard (a lone request's next sentence) takes every
thread, as the Piper voice does (kinds/voice_graph.py); appliance bench --part voices measures both.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from collections.abc import Mapping

import numpy as np

from appliance.config import Live
from appliance.engine.choice import load_engine
from appliance.engine.onnx_cpu import OnnxCpuEngine
from appliance.errors import ApplianceError
from appliance.firmware import Bundle, ModelSpec
from appliance.firmware.voices import STYLE_DIM, STYLE_ROWS, language_of, voice_file
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import SpokenVoice
from appliance.kinds.speakers import Shard, lanes_for
from appliance.kinds.speech import SpeechModel

SAMPLE_RATE = 24000
TOKENS, STYLE, SPEED, AUDIO = "tokens", "style", "speed", "audio"
PAD = 0
PEAK = 32767.0
# espeak-ng's tied phonemes as Kokoro's symbols (misaki's EspeakG2P table for non-English languages)
TIED = {
    "a^ɪ": "I", "a^ʊ": "W", "d^z": "ʣ", "d^ʒ": "ʤ", "e^ɪ": "A", "o^ʊ": "O", "ə^ʊ": "Q", "s^s": "S",
    "t^s": "ʦ", "t^ʃ": "ʧ", "ɔ^ɪ": "Y",
}  # fmt: skip


class KokoroModel(SpeechModel):
    """Kind kokoro_speech: Kokoro's voices served as a speech model."""

    def __init__(self, spec: ModelSpec, bundle: Bundle, live: Live, loaded: Mapping[str, ServedModel]) -> None:
        super().__init__(spec, bundle, live, loaded, KokoroSpeaker(spec, bundle, live))


class KokoroSpeaker:
    backend, tie = "kokoro", True
    ids_around, ids_per_phoneme = 0, 1  # the limit counts phoneme tokens; the two pads are Kokoro's own

    def __init__(self, spec: ModelSpec, bundle: Bundle, live: Live) -> None:
        params = spec.parameters
        names = params["voices"]
        assert isinstance(names, list)
        directory = bundle.artifact(spec.file)
        try:
            vocab = json.loads((directory / str(params["vocab"])).read_text(encoding="utf-8"))["vocab"]
            self.vocab = {str(symbol): int(token) for symbol, token in vocab.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ApplianceError(f"model {spec.name}: {params['vocab']} is not Kokoro's vocab.json: {exc}") from None
        self.voices: dict[str, SpokenVoice] = {}
        self.styles: dict[str, np.ndarray] = {}
        for name in map(str, names):
            language = language_of(name, f"model {spec.name}")
            self.voices[name] = SpokenVoice(name, language.code, language.espeak_voice)
            raw = np.fromfile(directory / voice_file(name), "<f4")
            if raw.size != STYLE_ROWS * STYLE_DIM:  # verify checked its hash; the build its size
                raise ApplianceError(f"model {spec.name}: voice {name} is not a {STYLE_ROWS}x{STYLE_DIM} style table")
            self.styles[name] = raw.reshape(STYLE_ROWS, STYLE_DIM)
        graph = dataclasses.replace(spec, file=f"{spec.file}/{params['graph']}")
        config = live.config.engine
        self.engine = load_engine(config.device, bundle, graph, config.threads, varied_shapes=True)
        self.sample_rate = SAMPLE_RATE
        self.lanes = max(1, lanes_for(self.engine, live))
        self._pool = concurrent.futures.ThreadPoolExecutor(self.lanes, thread_name_prefix="kokoro")

    def ids(self, voice: str, phonemes: list[str]) -> list[int]:
        return kokoro_ids(self.vocab, phonemes)

    def run(self, shards: list[Shard]) -> list[np.ndarray]:
        alone = len(shards) == 1
        if isinstance(self.engine, OnnxCpuEngine) and not alone:
            return list(self._pool.map(lambda shard: self._one(shard, False), shards))
        return [self._one(shard, alone) for shard in shards]

    def _one(self, shard: Shard, alone: bool) -> np.ndarray:
        ids, speed, voice = shard
        tokens = len(ids) - 2
        style = self.styles[voice][min(tokens, STYLE_ROWS - 1)].reshape(1, STYLE_DIM)
        feeds: dict[str, np.ndarray] = {
            TOKENS: np.array([ids], np.int64),
            STYLE: np.ascontiguousarray(style, np.float32),
            SPEED: np.array([speed], np.float32),
        }
        if isinstance(self.engine, OnnxCpuEngine):
            out = self.engine.run(feeds, 1, parallel=alone)
        else:
            out = self.engine.run(feeds, 1)
        return to_int16(out[AUDIO].reshape(-1))


def kokoro_ids(vocab: dict[str, int], phonemes: list[str]) -> list[int]:
    """[0, tokens..., 0]: espeak-ng's tied phonemes as Kokoro's symbols, unknown symbols dropped."""
    text = "".join(phonemes)
    for tied, symbol in TIED.items():
        text = text.replace(tied, symbol)
    text = text.replace("^", "").replace("-", "")
    return [PAD, *(vocab[c] for c in text if c in vocab), PAD]


def to_int16(audio: np.ndarray) -> np.ndarray:
    """Kokoro's samples (about -1 to 1) as 16-bit, rounded, clipped at full scale."""
    return np.clip(np.round(audio * PEAK), -PEAK, PEAK).astype(np.int16)

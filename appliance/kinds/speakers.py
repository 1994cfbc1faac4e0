"""What the speech kind asks of a speech engine (a Piper voice, Kokoro's voices): the voices it speaks,
how a shard's phonemes become its ids, and a batch of shards made into audio. The speech kind
(kinds/speech.py) cuts the text, queues and streams; a speaker only turns shards into samples.

A shard is (ids, speed, voice): a batch of them comes from many requests, in one speed (the queue
groups by it), in any of the speaker's voices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

import numpy as np

from appliance.config import Live
from appliance.engine.choice import load_engine
from appliance.engine.interface import Engine
from appliance.engine.onnx_cpu import OnnxCpuEngine
from appliance.firmware import Bundle, ModelSpec
from appliance.kinds.capabilities import SpokenVoice
from appliance.kinds.phonemes import Voice
from appliance.kinds.voice_graph import VoiceGraph

Shard = tuple[list[int], float, str]  # phoneme ids, speed, voice name


class VoiceBackend(Protocol):
    engine: Engine
    sample_rate: int
    backend: str  # Triton's backend name, for the model config
    tie: bool  # espeak-ng's phonemes with ^ joining a phoneme's letters
    ids_around: int  # ids a shard takes besides its phonemes
    ids_per_phoneme: int

    @property
    def voices(self) -> Mapping[str, SpokenVoice]:
        """In the firmware's order: the first of a language is its default."""
        ...

    def ids(self, voice: str, phonemes: list[str]) -> list[int]: ...

    def run(self, shards: list[Shard]) -> list[np.ndarray]:
        """Each shard's audio, INT16 at sample_rate."""
        ...


def lanes_for(engine: Engine, live: Live) -> int:
    """Side by side single-threaded runs pay on the CPU engine only (kinds/voice_graph.py)."""
    return live.config.engine.threads if isinstance(engine, OnnxCpuEngine) else 1


class PiperSpeaker:
    """One Piper voice: its .onnx.json and its VITS graph (kinds/voice_graph.py)."""

    backend, tie = "piper", False
    ids_around = 3  # BOS, its pad and EOS around a shard's phonemes
    ids_per_phoneme = 2  # each phoneme and a pad

    def __init__(self, spec: ModelSpec, bundle: Bundle, live: Live) -> None:
        params = spec.parameters
        self.voice = Voice.from_config(bundle.artifact(f"{spec.file}/{params['config']}"))
        graph = dataclasses.replace(spec, file=f"{spec.file}/{params['graph']}")
        config = live.config.engine
        self.engine = load_engine(config.device, bundle, graph, config.threads, varied_shapes=True)
        self.graph = VoiceGraph(self.engine, self.voice, lanes_for(self.engine, live))
        self.sample_rate = self.voice.sample_rate
        name = str(params["voice"])
        self.voices = {name: SpokenVoice(name, self.voice.language, self.voice.espeak_voice)}

    def ids(self, voice: str, phonemes: list[str]) -> list[int]:
        return self.voice.ids(phonemes)

    def run(self, shards: list[Shard]) -> list[np.ndarray]:
        return self.graph.run([(ids, speed) for ids, speed, _ in shards])

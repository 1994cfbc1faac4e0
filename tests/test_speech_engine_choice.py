"""The speech-to-text engine a Whisper gets (engine/speech_choice.py): `auto` falls back to
CTranslate2 where the box's own GPU engine cannot run (here: no CuPy, no GPU), and the GPU engine
hands a batch to the CPU engine above the baked memory threshold or when it runs out of memory,
as the VAD's engine does. The box's own engine on NumPy stands in for it on the GPU."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Keys
from speech import say
from test_whisper_reference import model_dir

from appliance import firmware
from appliance.engine import whisper_weights
from appliance.engine.speech_choice import SpeechCpuFallback, load_speech_engine
from appliance.engine.speech_engine import Shard
from appliance.engine.whisper import WhisperEngine
from appliance.engine.whisper_arrays_engine import ArrayWhisperEngine
from appliance.errors import ApplianceError


class FlakyGpu(ArrayWhisperEngine):
    """The box's own engine, out of memory while `oom` is set."""

    oom = False

    def encode(self, features):
        if self.oom:
            raise MemoryError("out of memory allocating 1,073,741,824 bytes")
        return super().encode(features)


def test_auto_without_a_gpu_engine_is_ctranslate2_on_the_cpu(voice_bundle: Path, keys: Keys, caplog) -> None:
    bundle = firmware.verify(voice_bundle, keys.trusted)
    spec = next(m for m in bundle.manifest.models if m.name == "whisper_tiny_en")
    with caplog.at_level(logging.INFO, logger="appliance"):
        engine = load_speech_engine("auto", bundle, spec, 1, 5, 1400 * 320)
    assert isinstance(engine, WhisperEngine) and engine.name == "ctranslate2-cpu"
    assert "the box's own Whisper does not run here" in caplog.text
    with pytest.raises(ApplianceError, match="engine.device: no engine for 'tpu'"):
        load_speech_engine("tpu", bundle, spec, 1, 5, 1400 * 320)


@pytest.fixture
def fallback(voice_bundle: Path, keys: Keys, tmp_path: Path):  # type: ignore[no-untyped-def]
    """tiny.en's own engine (FlakyGpu) with CTranslate2 on the CPU behind it, above 85% of a GPU
    memory reading the test sets: the engines, the reading, and SpeechCpuFallback over them."""
    directory = model_dir(voice_bundle, keys, "whisper_tiny_en")
    whisper_weights.convert(directory, tmp_path / "w.npz")
    gpu = FlakyGpu(whisper_weights.load(tmp_path / "w.npz"), directory, 2)
    cpu = WhisperEngine(directory, "cpu", 1, 1)
    reading = {"used": 0.10}
    return gpu, cpu, reading, SpeechCpuFallback(gpu, cpu, 0.85, lambda: reading["used"])


def test_batches_go_to_the_cpu_above_the_threshold_and_when_the_gpu_runs_out_of_memory(fallback) -> None:  # type: ignore[no-untyped-def]
    gpu, cpu, reading, engine = fallback
    shard = [Shard(say("Where is the nearest pharmacy"))]
    texts = []
    for used, oom in ((0.10, False), (0.92, False), (0.85, False), (0.10, True)):
        reading["used"], gpu.oom = used, oom
        texts.append(" ".join(p.text for p in engine.run(shard)[0].pieces).lower())
    assert engine.fallbacks == {"memory_pressure": 1, "out_of_memory": 1}
    assert gpu.windows["shards"] == 2 and cpu.windows["shards"] == 2  # at 0.85 it stayed on the GPU
    assert engine.windows["shards"] == 4
    assert all("pharmacy" in t for t in texts), texts


def test_the_continuous_runner_goes_to_the_cpu_above_the_threshold_and_when_the_gpu_runs_out_of_memory(
    fallback,  # type: ignore[no-untyped-def]
) -> None:
    """The batch queue's runner of the same engines (FallbackDecoding): shards that begin above the
    threshold, or whose encoding runs out of GPU memory, are answered by the CPU engine."""
    gpu, cpu, reading, engine = fallback
    runner = engine.decoding(2)
    shard = Shard(say("Where is the nearest pharmacy"))
    texts = {}
    for key, (used, oom) in enumerate(((0.10, False), (0.92, False), (0.10, True))):
        reading["used"], gpu.oom = used, oom
        runner.begin([(key, shard)])
        while key not in texts:
            texts.update((k, " ".join(p.text for p in d.pieces).lower()) for k, d in runner.advance())
    assert engine.fallbacks == {"memory_pressure": 1, "out_of_memory": 1}
    assert gpu.windows["shards"] == 1 and cpu.windows["shards"] == 2
    assert all("pharmacy" in t for t in texts.values()), texts


def test_the_boxs_own_whisper_runs_without_ctranslate2() -> None:
    """Its modules import no CTranslate2 (the lent GPU machine has none: tests/gpu/ carries what runs)."""
    modules = "whisper_arrays_engine, whisper_ops, whisper_weights, whisper_decoding, whisper_features"
    probe = f"import sys; from appliance.engine import {modules}; print(sorted(m for m in sys.modules if 'ctranslate2' in m))"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert found == "[]", found

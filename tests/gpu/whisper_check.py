"""The box's own Whisper on the GPU (tests/gpu/run.sh whisper), one run, one report appended to
tests/gpu/results.md. Never run on a GPU yet (issue 40 had no device lent): nothing here is a result.

1. `firmware build` of the voice firmware with the `cuda` target: the Whispers' converted weights and
   kernels/whisper.cu compiled with the model's baked max_batch and shard length.
2. kernels/whisper.cu loaded from the bundle, each kernel against the reference's function
   (whisper_kernels.py).
3. The same code on CuPy (float16), with CuPy's own operations and with the firmware's kernels
   (engine/whisper_ops.py KernelOps: what the daemon runs), against NumPy (float32, the reference CI
   holds to CTranslate2) on the same shards, greedy: tokens identical per shard counted, and the WER of each against the text
   said (espeak-ng's sentences).
4. The engine's GPU time per window (encoder) and per decoder step at batch 1, 8 and 64.
5. Through the daemon's Unix socket, engine.device = "auto" (the GPU engine) then "cpu" (CTranslate2
   on the machine's cores): one 60 s recording and 64 10 s clips at once, tiny.en and base.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import daemon_path  # noqa: E402
import jiwer  # noqa: E402
import whisper_kernels  # noqa: E402
from speech import say  # noqa: E402

from appliance import firmware  # noqa: E402
from appliance.engine import whisper_weights  # noqa: E402
from appliance.engine.whisper_arrays_engine import ArrayWhisperEngine  # noqa: E402
from appliance.engine.whisper_batch import DecodeBatch, Sequence  # noqa: E402
from appliance.engine.whisper_features import log_mel  # noqa: E402
from appliance.engine.whisper_ops import KernelOps, baked_shape, kernel_files  # noqa: E402

RATE = 16000
SENTENCES = [
    "Please turn off the lights in the kitchen",
    "Where is the nearest pharmacy",
    "Good bye and thank you",
    "I would like a cup of coffee with milk please",
    "The train to the airport leaves at seven thirty",
    "Can you tell me how to get to the museum",
    "It is very nice today and the sun is shining",
    "Set the temperature to twenty one degrees",
]
report: list[str] = []


def say_line(line: str) -> None:
    print(line, flush=True)
    report.append(line)


def cli(*args: object) -> None:
    subprocess.run([sys.executable, "-m", "appliance", *map(str, args)], check=True, cwd=ROOT)


def build(work: Path) -> tuple[Path, Path]:
    """The voice firmware with the cuda target, signed by a key made here."""
    voice = (ROOT / "firmware" / "voice.toml").read_text().replace('targets = ["cpu"]', 'targets = ["cpu", "cuda"]')
    spec = work / "voice-cuda.toml"  # its sources are packages: nothing relative to firmware/
    spec.write_text(voice)
    cli("keys", "new", "--out", work / "signing.key", "--trust-dir", work / "trusted")
    started = time.perf_counter()
    cli("firmware", "build", spec, "--key", work / "signing.key", "--out", work / "voice-cuda")
    say_line(f"firmware voice (cuda target) built in {time.perf_counter() - started:.1f} s")
    return work / "voice-cuda", work / "trusted"


def engines(bundle: firmware.Bundle, name: str, cupy) -> list[ArrayWhisperEngine]:
    """NumPy (the reference), CuPy's own operations, and the firmware's kernels: the same code on each,
    at the model's baked max_batch."""
    spec = next(m for m in bundle.manifest.models if m.name == name)
    directory = bundle.artifact(spec.file)
    weights = whisper_weights.load(bundle.artifact(whisper_weights.bundle_file(spec.name)))
    max_batch, shard_tokens = baked_shape(spec.parameters)
    module = cupy.RawModule(path=str(bundle.artifact(kernel_files(max_batch, shard_tokens)[0])))
    kernels = KernelOps(cupy, module, max_batch, shard_tokens)
    return [
        ArrayWhisperEngine(weights, directory, max_batch),
        ArrayWhisperEngine(weights, directory, max_batch, cupy, cupy.float16, "whisper-cupy"),
        ArrayWhisperEngine(weights, directory, max_batch, cupy, cupy.float16, "whisper-cuda-kernels", ops=kernels),
    ]


def tokens_against_reference(reference: ArrayWhisperEngine, gpu: ArrayWhisperEngine, audio: list[np.ndarray]) -> None:
    features = log_mel(audio, reference.filters)
    decoded = {}
    for engine in (reference, gpu):
        prompts = [engine.tokens.prompt("transcribe", "en")] * len(audio)
        finished = engine.decode([Sequence(p, i) for i, p in enumerate(prompts)], engine.encode(features), False)
        decoded[engine.name] = [[t for t in finished[i].chosen if t < engine.tokens.eot] for i in range(len(audio))]
    ours, theirs = decoded[gpu.name], decoded[reference.name]
    same = sum(a == b for a, b in zip(ours, theirs))
    wer = {k: jiwer.wer(SENTENCES, [reference.tokens.text(v) for v in d]) for k, d in decoded.items()}
    verdict = "PASS" if wer[gpu.name] <= wer[reference.name] + 0.02 else "FAIL"
    say_line(f"{verdict} greedy tokens, CuPy fp16 vs NumPy fp32: {same} of {len(audio)} shards identical; WER {wer}")


def gpu_times(engine: ArrayWhisperEngine, cupy, audio: np.ndarray) -> None:
    """GPU time (CUDA events) per encoder window and per decoder step at batch 1, 8 and 64."""
    features = log_mel([audio], engine.filters)
    for batch in (1, 8, 64):
        windows = np.repeat(features, batch, axis=0)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        engine.model.encode(windows[:1])  # warm
        start.record()
        cross = engine.model.cross(engine.model.encode(windows))
        end.record()
        end.synchronize()
        per_window = cupy.cuda.get_elapsed_time(start, end) / batch
        steps = DecodeBatch(engine.model, engine.rules, batch, engine.tokens.sot, None)
        for i in range(batch):
            steps.join(Sequence([engine.tokens.sot] * 8, i), cross, i)  # prompts long enough to time 8 steps
        start.record()
        for _ in range(7):
            steps.step()
        end.record()
        end.synchronize()
        say_line(
            f"| {engine.name} | batch {batch} | {per_window:.2f} ms/window | {cupy.cuda.get_elapsed_time(start, end) / 7:.2f} ms/step |"
        )


def main() -> int:
    try:
        import cupy
    except ImportError as exc:
        print(f"SKIP: CuPy is not installed here ({exc})")
        return 0
    say_line(f"## Whisper on the GPU ({time.strftime('%Y-%m-%d')}), CuPy {cupy.__version__}")
    with tempfile.TemporaryDirectory(prefix="appliance-whisper-gpu-") as tmp:
        work = Path(tmp)
        bundle_dir, trusted = build(work)
        bundle = firmware.verify(bundle_dir, trusted)
        audio = [say(s) for s in SENTENCES]
        for name in ("whisper_tiny_en", "whisper_base"):
            reference, *on_gpu = engines(bundle, name, cupy)
            if name == "whisper_base":
                for line in whisper_kernels.check(bundle_dir, cupy, reference.rules):
                    say_line(line)
            for gpu in on_gpu:
                tokens_against_reference(reference, gpu, audio)
                gpu_times(gpu, cupy, audio[0])
        say_line("| model | engine.device | 60 s (s) | 64 x 10 s at once (s) |")
        for row in daemon_path.whisper_cuda_vs_cpu(
            bundle_dir, trusted, work, np.concatenate(audio), ("auto", "cpu"), 64
        ):
            say_line(row)
    with open(ROOT / "tests" / "gpu" / "results.md", "a") as f:
        f.write("\n" + "\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU checks, run by tests/gpu/run.sh on a machine with a CUDA GPU (one run, one report).

1. `appliance firmware build firmware/gpu.toml` compiles the kernels for sm_90 with the baked values.
2. The CUDA engine against the NumPy reference on real speech: 64 streams, probabilities within
   1e-3, identical segments; both ways in (host feeds, and GPU-resident state by slot).
3. The fallback: GPU memory filled past the baked threshold moves batches to ONNX Runtime on the
   CPU and back, a stream keeping its state across both switches; an out-of-memory batch is
   retried on the CPU.
4. TensorRT: skipped with the reason where it is not installed.
5. The daemon with engine.device = "auto" serves the model on the GPU engine.
6. The daemon's own path (daemon_path.py): live 256 ms streams through the Unix socket from many
   client processes, the CUDA engine behind the batcher at the firmware's baked max_batch, against
   engine.device = "cpu" in the same run; what CTranslate2's CUDA build loads, and Whisper tiny.en
   and base on CUDA against the CPU through the daemon where the interpreter firmware can be built.
   (The earlier figure, LiveStreams at batch 8192, was a path the daemon never serves: dropped.)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import daemon_path  # noqa: E402
from live_streams import LiveStreams  # noqa: E402
from speech import speech_segments  # noqa: E402
from streams import CONTEXT, FRAME, RATE, run_streams  # noqa: E402

from appliance import firmware  # noqa: E402
from appliance.audio import encode_wav  # noqa: E402
from appliance.engine.choice import CpuFallback  # noqa: E402
from appliance.engine.interface import GpuOutOfMemory  # noqa: E402
from appliance.engine.onnx_cpu import OnnxCpuEngine  # noqa: E402
from appliance.engine.reference import ReferenceVad, load_weights  # noqa: E402
from appliance.kinds.segments import SegmentParams  # noqa: E402

STREAM_SECONDS = 8.0  # each count of live streams runs this long
results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> None:
    results.append((name, bool(ok), detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def cli(*args: object) -> None:
    subprocess.run([sys.executable, "-m", "appliance", *map(str, args)], check=True, cwd=ROOT)


def build_firmware(work: Path, key: Path, name: str, **baked: int) -> firmware.Bundle:
    spec_text = (ROOT / "firmware" / "gpu.toml").read_text()
    for k, v in baked.items():
        spec_text = (
            "\n".join(f"{k} = {v}" if line.split("=")[0].strip() == k else line for line in spec_text.splitlines())
            + "\n"
        )
    spec = work / f"{name}.toml"
    spec.write_text(spec_text)
    started = time.monotonic()
    cli("firmware", "build", spec, "--key", key, "--out", work / name)
    print(f"firmware {name}: built in {time.monotonic() - started:.1f} s", flush=True)
    return firmware.verify(work / name, work / "trusted")


def streams_of(audio: np.ndarray, count: int, frames: int) -> np.ndarray:
    """`count` streams of `frames` frames: the recording from `count` different starting points."""
    total = len(audio) // FRAME
    whole = audio[: total * FRAME].reshape(total, FRAME)
    return np.stack(
        [np.roll(whole, -(i * total // count), axis=0)[:frames] for i in range(count)], axis=1
    )  # [T, S, FRAME]


def compare_with_reference(bundle: firmware.Bundle, audio: np.ndarray) -> None:
    from appliance.engine.cuda import CudaVadEngine

    model = bundle.manifest.models[0]
    gpu = CudaVadEngine(bundle, model)
    reference = ReferenceVad(load_weights(bundle.artifact(model.file)))
    pcm = np.clip(np.round(audio * 32768), -32768, 32767).astype(np.int16)
    frames = streams_of(pcm.astype(np.float32) / 32768, 64, len(audio) // FRAME)
    ours, truth = run_streams(gpu, frames), run_streams(reference, frames)
    diff = float(np.abs(ours - truth).max())
    check(
        "cuda engine vs reference (host feeds, 64 streams)",
        diff < 1e-3,
        f"max |p_gpu - p_ref| = {diff:.2e} over {ours.size} frames",
    )
    params = SegmentParams()
    same = all(
        speech_segments(ours[:, s], FRAME, RATE, frames.shape[0] * FRAME, params)
        == speech_segments(truth[:, s], FRAME, RATE, frames.shape[0] * FRAME, params)
        for s in range(64)
    )
    segments = speech_segments(truth[:, 0], FRAME, RATE, frames.shape[0] * FRAME, params)
    check(
        "segments identical", same and len(segments) > 0, f"stream 0: {len(segments)} segments, all 64 streams compared"
    )

    live = LiveStreams(gpu, capacity=256)
    slots = np.random.default_rng(1).permutation(256)[:64].astype(np.int32)  # scattered rows
    pcm_frames = streams_of(pcm, 64, frames.shape[0])
    resident = np.stack([live.step(slots, pcm_frames[t]) for t in range(frames.shape[0])])
    diff = float(np.abs(resident - truth).max())
    check("cuda engine vs reference (GPU-resident state by slot, PCM16 in)", diff < 1e-3, f"max diff {diff:.2e}")


def check_fallback(bundle: firmware.Bundle, audio: np.ndarray) -> None:
    import pycuda.driver as cuda

    from appliance.engine.cuda import CudaVadEngine, memory_used

    model = bundle.manifest.models[0]
    gpu = CudaVadEngine(bundle, model)
    cpu = OnnxCpuEngine(bundle.artifact(model.file), 4)
    threshold = bundle.manifest.baked.fallback_cpu_threshold
    engine = CpuFallback(gpu, cpu, threshold, memory_used)
    frames = streams_of(audio, 8, 120)
    truth = run_streams(ReferenceVad(load_weights(bundle.artifact(model.file))), frames)

    # One run over all frames; GPU memory is filled past the threshold for the middle third.
    state, context = np.zeros((2, 8, 128), np.float32), np.zeros((8, CONTEXT), np.float32)
    probs, filler, used_during = [], [], 0.0
    for t in range(frames.shape[0]):
        if t == 40:
            gpu.context.push()
            try:
                while memory_used() <= threshold:
                    filler.append(cuda.mem_alloc(1 << 30))
                used_during = memory_used()
            finally:
                cuda.Context.pop()
        if t == 80:
            filler.clear()
        x = np.concatenate([context, frames[t]], axis=1)
        out = engine.run({"input": x, "state": state, "sr": np.array(RATE, np.int64)}, 8)
        probs.append(out["output"][:, 0])
        state, context = out["stateN"], frames[t][:, -CONTEXT:]
    diff = float(np.abs(np.stack(probs) - truth).max())
    check(
        "fallback under memory pressure",
        engine.fallbacks["memory_pressure"] == 40 and diff < 1e-3,
        f"GPU memory {used_during:.1%} used > threshold {threshold:.0%}: {engine.fallbacks['memory_pressure']} of 120 "
        f"batches ran on the CPU, then back on the GPU; state kept: max diff vs reference {diff:.2e}",
    )

    # Out of memory: nearly all memory taken, a batch larger than the engine's work space needs more.
    oom_engine = CpuFallback(CudaVadEngine(bundle, model), cpu, 1.0, lambda: 0.0)
    oom_engine.gpu.context.push()
    try:
        chunk = 1 << 30
        while chunk >= 1 << 12:
            try:
                filler.append(cuda.mem_alloc(chunk))
            except cuda.MemoryError:
                chunk //= 2
    finally:
        cuda.Context.pop()
    try:
        first = run_streams(oom_engine, streams_of(audio, 64, 3))
        raised = oom_engine.fallbacks["out_of_memory"]
    except GpuOutOfMemory as exc:
        first, raised = None, f"escaped: {exc}"
    filler.clear()
    check(
        "out-of-memory batch retried on the CPU",
        raised == 3 and first is not None,
        f"out_of_memory fallbacks: {raised}",
    )


def check_tensorrt() -> None:
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        print(f"SKIP tensorrt: not installed on this machine ({exc}); the plan build and its check need it", flush=True)
        return
    print(f"tensorrt {tensorrt.__version__} present", flush=True)


def check_daemon(bundle_dir: Path, trusted: Path, work: Path, audio: np.ndarray) -> None:
    from appliance.client import Client

    sock = work / "api.sock"
    config = work / "appliance.toml"
    config.write_text(
        f'[server]\nsocket = "{sock}"\n[firmware]\nbundle = "{bundle_dir}"\ntrusted_keys = "{trusted}"\n'
        '[engine]\ndevice = "auto"\n'
    )
    log = work / "daemon.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "appliance", "run", "--config", str(config)],
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while not sock.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(1.0)
        with Client(str(sock), timeout=60) as client:
            segments = client.segments(encode_wav(audio, RATE))
            metrics = client.metrics()
        engine_line = next(
            (line for line in metrics.splitlines() if line.startswith("appliance_engine_frames_total")), ""
        )
        check(
            "daemon with engine.device = auto",
            'engine="cuda-sm_90"' in engine_line,
            f"{engine_line}; POST segments: {segments}",
        )
    except Exception as exc:  # noqa: BLE001 - reported, with the daemon's log
        check("daemon with engine.device = auto", False, f"{exc!r}\n{log.read_text()[-3000:]}")
    finally:
        proc.terminate()
        proc.wait(30)


def whisper_step(work: Path, key: Path, audio: np.ndarray) -> None:
    """Whisper on CUDA: what loads, then the speech-to-text cases where the interpreter firmware builds."""
    try:
        print(daemon_path.cuda_libraries(), flush=True)
    except ImportError as exc:
        print(f"SKIP whisper on cuda: {exc}", flush=True)
        return
    try:
        cli("firmware", "build", ROOT / "firmware" / "interpreter.toml", "--key", key, "--out", work / "interpreter")
    except subprocess.CalledProcessError as exc:
        print(f"SKIP whisper on cuda: the interpreter firmware did not build here (its model packages): {exc}")
        return
    try:
        print("\n| model | device | 60 s recording s | 8 clients x 10 s s |\n| --- | --- | --- | --- |")
        rows = daemon_path.whisper_cuda_vs_cpu(work / "interpreter", work / "trusted", work, audio)
        check("whisper through the daemon on cuda and cpu", len(rows) == 4, f"{len(rows)} of 4 rows")
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        check("whisper on cuda", False, repr(exc))


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="appliance-gpu-"))
    key = work / "signing.key"
    cli("keys", "new", "--out", key, "--trust-dir", work / "trusted")
    audio = np.load(ROOT / ".gpu" / "speech.npy") if (ROOT / ".gpu" / "speech.npy").exists() else None
    if audio is None:
        from speech import SENTENCES, recording  # tests/ on sys.path: espeak-ng makes it where installed

        audio = recording(SENTENCES)[0]
    audio = np.concatenate([audio, np.zeros(2 * RATE, np.float32)])
    bundle = build_firmware(work, key, "gpu")
    for name in ("silero_vad.sm_90.cubin", "silero_vad.ptx"):
        print(f"  kernels/{name}: {(work / 'gpu' / 'kernels' / name).stat().st_size} bytes", flush=True)
    steps = [
        ("reference", lambda: compare_with_reference(bundle, audio)),
        ("fallback", lambda: check_fallback(bundle, audio)),
        ("tensorrt", check_tensorrt),
        ("daemon", lambda: check_daemon(work / "gpu", work / "trusted", work, audio)),
    ]
    for name, step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - one failed step must not hide the others
            import traceback

            traceback.print_exc()
            check(name, False, repr(exc))
    try:
        print(
            "\n| device | workers | live streams | chunks answered | p50 lag ms | p99 lag ms | mean batch | real time |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        pcm = np.clip(np.round(np.resize(audio, 60 * RATE) * 32768), -32768, 32767).astype(np.int16)
        rows = daemon_path.live_streams(work / "gpu", work / "trusted", work, pcm, STREAM_SECONDS)
        served = [int(r.split("|")[3]) for r in rows if r.startswith("| cuda") and r.rstrip().endswith("yes |")]
        check(
            "live streams through the socket on the CUDA engine",
            bool(served),
            f"at most {max(served, default=0)} live 256 ms streams served in real time "
            f"(max_batch {bundle.manifest.baked.max_batch} as baked)",
        )
    except Exception as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        check("live streams through the socket", False, repr(exc))
    whisper_step(work, key, audio)
    failed = [name for name, ok, _ in results if not ok]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

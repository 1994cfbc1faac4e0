"""The CUDA engine for the default VAD model: kernels/silero_vad.cu from the firmware bundle, run
with pycuda (the `gpu` extra).

One forward pass:
- `run(feeds, batch)`, the Engine interface: the batcher's host feeds (context + frame, state
  [2, B, 128]) go up, probabilities and new state come back. State stays in the batcher's
  sequences, so a batch can move to the CPU engine and back without losing a stream's state.
- the kernels' gather and scatter of state rows by slot, for state resident on the GPU
  (tests/gpu/live_streams.py checks them; the daemon keeps state in its sequences).

The binary is the one the firmware build compiled with the baked values; at load the engine
reads them back from the binary (appliance_baked) and refuses one that disagrees with the
manifest.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from appliance.engine.interface import GpuOutOfMemory
from appliance.errors import ApplianceError
from appliance.firmware import Bundle, ModelSpec

try:
    import pycuda.driver as cuda
except ImportError as exc:  # the `gpu` extra is not installed: the caller falls back to the CPU
    cuda = None
    IMPORT_ERROR = str(exc)

ARCH = "sm_90"
TILE = 8  # streams per block, as in kernels/silero_vad.cu
THREADS = 256
HIDDEN = 128
STFT_FILTERS, STFT_TAPS, HOP, REFLECT = 258, 256, 128, 64
ENCODER = ((129, 128, 1), (128, 64, 2), (64, 64, 2), (64, 128, 1))  # (in, out, stride), kernel 3, padding 1


def artifacts(model: ModelSpec) -> tuple[str, str, str]:
    """The bundle's files for the CUDA engine: weights, cubin, PTX."""
    return f"models/{model.name}.cuda.npz", f"kernels/silero_vad.{ARCH}.cubin", "kernels/silero_vad.ptx"


def unavailable_reason(bundle: Bundle, model: ModelSpec) -> str | None:
    """Why this model cannot run on the CUDA engine here, or None if it can."""
    if cuda is None:
        return f"pycuda is not installed (the gpu extra): {IMPORT_ERROR}"
    missing = [a for a in artifacts(model) if a not in bundle.manifest.artifacts]
    if missing:
        return f"the firmware has no cuda target for model {model.name} (missing {', '.join(missing)})"
    try:
        cuda.init()
        if cuda.Device.count() == 0:
            return "no CUDA device"
    except cuda.Error as exc:
        return f"CUDA is not usable: {exc}"
    return None


@functools.cache
def _primary_context(device: int):
    cuda.init()
    return cuda.Device(device).retain_primary_context()


def memory_used(device: int = 0) -> float:
    """The fraction of the device's memory in use (by anyone), read from the driver before each batch."""
    with _PushedContext(_primary_context(device)):
        free, total = cuda.mem_get_info()
    return 1.0 - free / total


def _out_of_memory(exc: Exception) -> bool:
    return isinstance(exc, cuda.MemoryError) or "out of memory" in str(exc).lower()


class _Buffers:
    """Device work space for a batch, grown on demand (so running short of memory shows up at a
    batch, where the caller can move it to the CPU, not only at start)."""

    def __init__(self) -> None:
        self.capacity = 0
        self.arrays: dict[str, object] = {}

    def ensure(self, batch: int, audio_samples: int) -> dict[str, object]:
        if batch <= self.capacity:
            return self.arrays
        capacity = max(batch, 2 * self.capacity)
        sizes = {  # float32 elements per stream
            "x": audio_samples,
            "spectrum": STFT_FILTERS * 4,
            "magnitude": (STFT_FILTERS // 2) * 4,
            "enc0": 128 * 4,
            "enc1": 64 * 2,
            "enc2": 64,
            "features": HIDDEN,
            "state": 2 * HIDDEN,
            "probs": 1,
            "frames": audio_samples,
            "context": audio_samples,
            "slots": 1,
            "pcm": audio_samples,
        }
        fresh = {name: cuda.mem_alloc(max(capacity * n * 4, 4)) for name, n in sizes.items()}
        self.arrays, self.capacity = fresh, capacity  # the old ones are freed with their last reference
        return fresh


class CudaVadEngine:
    """Silero VAD v5 on one CUDA device, batch bound and frame sizes baked into the binary."""

    name = "cuda-" + ARCH

    def __init__(self, bundle: Bundle, model: ModelSpec, device: int = 0) -> None:
        if cuda is None:
            raise ApplianceError(f"engine cuda: pycuda is not installed: {IMPORT_ERROR}")
        self.context = _primary_context(device)  # initialises the driver
        self.device = cuda.Device(device)
        self.baked, self.audio = bundle.manifest.baked, model.vad_audio
        weights_file, cubin, ptx = (bundle.artifact(a) for a in artifacts(model))
        self._lock = threading.Lock()  # one batch at a time: the buffers are shared
        with self._current():
            capability = self.device.compute_capability()
            if capability == (9, 0):
                self.module = cuda.module_from_file(str(cubin))
            else:  # another GPU: the driver compiles the PTX for it
                self.module = cuda.module_from_buffer(Path(ptx).read_bytes())
            self._check_baked()
            with np.load(weights_file) as stored:
                self.weights = {name: cuda.to_device(np.ascontiguousarray(stored[name])) for name in stored.files}
            self.kernels = {
                name: self.module.get_function(name)
                for name in (
                    "pcm16_to_float",
                    "frame_with_context",
                    "gather_rows",
                    "scatter_rows",
                    "conv1d_tile",
                    "magnitude",
                    "lstm_decoder",
                )
            }
            self.buffers = _Buffers()

    def _current(self) -> _PushedContext:
        return _PushedContext(self.context)

    def _check_baked(self) -> None:
        out = np.zeros(4, np.int32)
        self.module.get_function("appliance_baked")(cuda.Out(out), block=(1, 1, 1), grid=(1, 1))
        expected = (
            self.baked.max_batch,
            self.baked.max_tokens_per_shard,
            self.audio.frame_samples,
            self.audio.context_samples,
        )
        if tuple(int(v) for v in out) != expected:
            raise ApplianceError(
                f"cuda kernels were built with (max_batch, shard_frames, frame_samples, context_samples) = "
                f"{tuple(int(v) for v in out)}, the manifest says {expected}: rebuild the firmware"
            )

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        x = np.ascontiguousarray(feeds[self.audio.audio_input], np.float32)
        state = np.ascontiguousarray(feeds["state"], np.float32)
        self._check_batch(batch)
        with self._lock, self._current():
            try:
                b = self.buffers.ensure(batch, x.shape[1])
                cuda.memcpy_htod(b["x"], x)
                cuda.memcpy_htod(b["state"], state)
                self._forward(b, batch)
                probs, new_state = np.empty(batch, np.float32), np.empty_like(state)
                cuda.memcpy_dtoh(probs, b["probs"])
                cuda.memcpy_dtoh(new_state, b["state"])
            except cuda.Error as exc:
                if _out_of_memory(exc):
                    raise GpuOutOfMemory(str(exc)) from exc
                raise
        return {self.audio.prob_output: probs[:, None], "stateN": new_state}

    def _check_batch(self, batch: int) -> None:
        if batch > self.baked.max_batch:
            raise ApplianceError(f"batch of {batch} over the baked max_batch {self.baked.max_batch}")

    def _forward(self, b: dict[str, object], batch: int) -> None:
        """x [B, 576] and state [2, B, 128] in `b` -> probs [B] and the new state, in place."""
        k, w = self.kernels, self.weights
        blocks = ((batch + TILE - 1) // TILE, 1)
        samples = self.audio.context_samples + self.audio.frame_samples
        stft_frames = (samples + REFLECT - STFT_TAPS) // HOP + 1

        def conv(src, weight, bias, dst, c_in, t_in, c_out, t_out, kernel, stride, padding, relu, reflect):
            shared = TILE * c_in * (t_in + reflect) * 4
            k["conv1d_tile"](
                src,
                weight,
                bias,
                dst,
                np.int32(batch),
                np.int32(c_in),
                np.int32(t_in),
                np.int32(c_out),
                np.int32(t_out),
                np.int32(kernel),
                np.int32(stride),
                np.int32(padding),
                np.int32(relu),
                np.int32(reflect),
                block=(THREADS, 1, 1),
                grid=blocks,
                shared=shared,
            )

        conv(
            b["x"],
            w["stft_basis"],
            np.intp(0),
            b["spectrum"],
            1,
            samples,
            STFT_FILTERS,
            stft_frames,
            STFT_TAPS,
            HOP,
            0,
            0,
            REFLECT,
        )
        bins = STFT_FILTERS // 2
        k["magnitude"](
            b["spectrum"],
            b["magnitude"],
            np.int32(batch),
            np.int32(bins),
            np.int32(stft_frames),
            block=(THREADS, 1, 1),
            grid=((batch * bins * stft_frames + THREADS - 1) // THREADS, 1),
        )
        src, t = b["magnitude"], stft_frames
        for i, (c_in, c_out, stride) in enumerate(ENCODER):
            t_out = (t + 2 - 3) // stride + 1
            dst = b["features"] if i == len(ENCODER) - 1 else b[f"enc{i}"]
            conv(src, w[f"encoder{i}_weight"], w[f"encoder{i}_bias"], dst, c_in, t, c_out, t_out, 3, stride, 1, 1, 0)
            src, t = dst, t_out
        k["lstm_decoder"](
            b["features"],
            b["state"],
            w["lstm_weight_ih_t"],
            w["lstm_weight_hh_t"],
            w["lstm_bias"],
            w["decoder_weight"],
            w["decoder_bias"],
            b["probs"],
            np.int32(batch),
            block=(HIDDEN, 1, 1),
            grid=blocks,
        )


class _PushedContext:
    def __init__(self, context) -> None:
        self.context = context

    def __enter__(self) -> None:
        self.context.push()

    def __exit__(self, *exc: object) -> None:
        cuda.Context.pop()

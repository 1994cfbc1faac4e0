"""State and audio context resident on the GPU in tables of one row per stream: a step uploads only
PCM16 frames and the streams' slots, and the kernels gather and scatter the rows. Not a path the daemon
serves (its sequences keep the state on the host); the GPU check uses it to check those kernels."""

from __future__ import annotations

import numpy as np

from appliance.engine.cuda import HIDDEN, THREADS, CudaVadEngine, cuda


class LiveStreams:
    """`capacity` live streams whose state and audio context stay on the GPU. A step takes one
    PCM16 frame for each of some streams (by slot) and returns their speech probabilities."""

    def __init__(self, engine: CudaVadEngine, capacity: int) -> None:
        self.engine, self.capacity = engine, capacity
        audio = engine.audio
        self.frame, self.context_samples = audio.frame_samples, audio.context_samples
        with engine._current():
            self.state_h = cuda.mem_alloc(capacity * HIDDEN * 4)
            self.state_c = cuda.mem_alloc(capacity * HIDDEN * 4)
            self.contexts = cuda.mem_alloc(capacity * self.context_samples * 4)
            for table, size in ((self.state_h, HIDDEN), (self.state_c, HIDDEN), (self.contexts, self.context_samples)):
                cuda.memset_d32(table, 0, capacity * size)

    def step(self, slots: np.ndarray, pcm: np.ndarray) -> np.ndarray:
        """slots [B] int32, pcm [B, frame_samples] int16 -> probabilities [B]."""
        batch = len(slots)
        engine = self.engine
        engine._check_batch(batch)
        if slots.min() < 0 or slots.max() >= self.capacity:
            raise ValueError(f"slots must be in [0, {self.capacity})")
        k = engine.kernels
        rows = (batch, 1)
        with engine._lock, engine._current():
            b = engine.buffers.ensure(batch, self.context_samples + self.frame)
            cuda.memcpy_htod(b["slots"], np.ascontiguousarray(slots, np.int32))
            cuda.memcpy_htod(b["pcm"], np.ascontiguousarray(pcm, np.int16))
            count = batch * self.frame
            k["pcm16_to_float"](
                b["pcm"],
                b["frames"],
                np.int32(count),
                block=(THREADS, 1, 1),
                grid=((count + THREADS - 1) // THREADS, 1),
            )
            self._rows("gather_rows", self.contexts, b["context"], b["slots"], batch, self.context_samples)
            k["frame_with_context"](
                b["frames"], b["context"], b["x"], np.int32(batch), block=(THREADS, 1, 1), grid=rows
            )
            self._rows("scatter_rows", self.contexts, b["context"], b["slots"], batch, self.context_samples)
            cell = int(b["state"]) + batch  # type: ignore[call-overload]  # a DeviceAllocation: its address * HIDDEN * 4  # state rows are [2][B][128]: h, then c
            self._rows("gather_rows", self.state_h, b["state"], b["slots"], batch, HIDDEN)
            self._rows("gather_rows", self.state_c, np.intp(cell), b["slots"], batch, HIDDEN)
            engine._forward(b, batch)
            self._rows("scatter_rows", self.state_h, b["state"], b["slots"], batch, HIDDEN)
            self._rows("scatter_rows", self.state_c, np.intp(cell), b["slots"], batch, HIDDEN)
            probs = np.empty(batch, np.float32)
            cuda.memcpy_dtoh(probs, b["probs"])
        return probs

    def _rows(self, kernel: str, table, rows, slots, batch: int, width: int) -> None:
        """Gather table rows into `rows` or scatter them back, by slot."""
        function = self.engine.kernels[kernel]
        args = (table, slots, rows) if kernel == "gather_rows" else (rows, slots, table)
        function(*args, np.int32(batch), np.int32(width), block=(HIDDEN, 1, 1), grid=(batch, 1))

"""The speaker_embedding kind: a voice in, a 256-number voiceprint out, on Resemblyzer's GE2E encoder
(firmware_build/ge2e.py made it an ONNX graph at build; ONNX Runtime runs it, torch never loads).

Its work is windows of mel frames (speaker_mels.py): an utterance's partials of 160 frames, or a
diarization's sliding windows. Every waiting request's windows of one length run together, up to the
baked `max_batch` per engine call (engine/batch_queue.py).

Its route `diarize` answers a recording's turns (who speaks when, kinds/diarized.py), in the speech its
VAD finds. KServe infer: input `audio` (FP32 or INT16 samples at 16 kHz, or BYTES holding one encoded file),
output `embedding` (FP32 [1, 256], L2-normalized): Resemblyzer's embed_utterance of the audio (its
partials' mean, normalized), after its volume normalization.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import numpy as np

from appliance.config import Live
from appliance.engine.batch_queue import BatchQueue
from appliance.engine.choice import load_engine
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import ApplianceError, BadRequest
from appliance.firmware import Bundle, ModelSpec, TensorSpec
from appliance.kinds import diarize, diarized, speaker_mels
from appliance.kinds.audio_in import AUDIO_INPUT, audio_input, decode_upload
from appliance.kinds.base import NoSequences, QueuedModel, SequenceCall, ServedModel, Task, stateless
from appliance.kinds.counting import counted
from appliance.kinds.speaker_mels import EMBEDDING_OUTPUT, HIDDEN, MELS_INPUT
from appliance.kinds.triton_config import model_config
from appliance.kinds.vad import VadModel
from appliance.protocol.messages import Opened, Request, Response, json_response
from appliance.protocol.tensors import InferRequest

MIN_SECONDS = 0.5  # shorter audio holds too little voice to say whose it is


class SpeakerEncoder(QueuedModel):
    def __init__(self, spec: ModelSpec, bundle: Bundle, live: Live, loaded: Mapping[str, ServedModel]) -> None:
        self.spec, self.baked, self.live = spec, bundle.manifest.baked, live
        params = spec.parameters
        self.window_frames = int(params["window_frames"])  # type: ignore[arg-type]  # the reader checks int
        self.step_frames = int(params["step_frames"])  # type: ignore[arg-type]
        self.max_batch = int(params["max_batch"])  # type: ignore[arg-type]
        self.engine = load_engine(live.config.engine.device, bundle, spec, live.config.engine.threads)
        self.stats = ModelStats()
        self.queue: BatchQueue[np.ndarray, np.ndarray] = BatchQueue(
            self._run, self.max_batch, self.stats, QueuePolicy(spec.name, lambda: live.config.engine, self.stats)
        )
        vad = loaded.get(str(params["vad"]))
        if not isinstance(vad, VadModel):
            raise ApplianceError(
                f"model {spec.name}: parameters.vad {params['vad']!r} is not a VAD model listed before it"
            )
        self.vad: VadModel = vad
        self.tasks: Mapping[str, Task] = {"diarize": self._diarize_route}
        self.sequences = NoSequences()

    def speech(self, samples: np.ndarray) -> AsyncGenerator[tuple[int, int], None]:
        return self.vad.segments(samples, self.live.config.vad)

    def _run(self, windows: list[np.ndarray]) -> list[np.ndarray]:
        batch = np.stack(windows)
        found = self.engine.run({MELS_INPUT: batch}, len(windows))[EMBEDDING_OUTPUT]
        return list(found)

    async def embed(self, windows: list[np.ndarray]) -> np.ndarray:
        """[len(windows), 256]: each window of mel frames [frames, 40] (one request's; windows of one
        length batch together, with other requests' of that length)."""
        if not windows:
            return np.zeros((0, HIDDEN), np.float32)
        owner = self.queue.new_owner()
        futures = [self.queue.submit([w], group=len(w), owner=owner, first_index=i)[0] for i, w in enumerate(windows)]
        try:
            return np.stack([(await f).result for f in futures])
        finally:
            for f in futures:
                f.cancel()

    async def utterance(self, samples: np.ndarray) -> np.ndarray:
        """Resemblyzer's embed_utterance: the L2-normalized mean of its partials' embeddings."""
        if len(samples) < MIN_SECONDS * speaker_mels.SAMPLE_RATE:
            raise BadRequest(f"a voice sample of {len(samples) / 16000:.2f} s is too short: at least {MIN_SECONDS} s")
        windows = await asyncio.to_thread(speaker_mels.utterance_mels, speaker_mels.louder(samples))
        mean = (await self.embed(list(windows))).mean(axis=0)
        return (mean / max(float(np.linalg.norm(mean)), 1e-12)).astype(np.float32)

    async def _diarize_route(self, request: Request, query: dict[str, str]) -> Response:
        """POST /v2/models/{name}/diarize[?min_speakers=&max_speakers=]: a recording's turns, who speaks
        from when to when (letters in order of first appearance), without its words."""
        return await counted(self.stats, self._diarized(request, query))

    async def _diarized(self, request: Request, query: dict[str, str]) -> Response:
        unknown = sorted(set(query) - {"min_speakers", "max_speakers"})
        if unknown:
            raise BadRequest(f"unknown query parameter {unknown[0][:40]!r} (known: min_speakers, max_speakers)")
        count = diarize.speaker_count(query)
        self.queue.check_room()
        samples = await asyncio.to_thread(decode_upload, request.body, speaker_mels.SAMPLE_RATE, self.live)
        turns = await diarized.timeline(self, samples, diarized.Who(count))
        return json_response(
            200,
            {
                "duration": round(len(samples) / speaker_mels.SAMPLE_RATE, 3),
                "speakers": len({t.speaker for t in turns}),
                "turns": [{"start": t.start, "end": t.end, "speaker": t.speaker} for t in turns],
            },
        )

    async def probe(self) -> None:
        noise = np.random.default_rng(0).normal(0, 0.1, speaker_mels.SAMPLE_RATE).astype(np.float32)
        if not np.all(np.isfinite(await self.utterance(noise))):
            raise ApplianceError(f"model {self.name}: the warm-up embedding holds non-finite values")

    def metadata(self) -> dict[str, Any]:
        return {
            "platform": "onnxruntime_onnx",
            "inputs": [
                {
                    "name": AUDIO_INPUT,
                    "datatype": "FP32",
                    "shape": [-1],
                    "parameters": {"accepts": ["FP32", "INT16", "BYTES"], "sample_rate": speaker_mels.SAMPLE_RATE},
                }
            ],
            "outputs": [{"name": EMBEDDING_OUTPUT, "datatype": "FP32", "shape": [1, HIDDEN]}],
            "parameters": {
                "kind": self.spec.kind,
                "engine": self.engine_name,
                "parameters": dict(self.spec.parameters),
            },
        }

    def config(self) -> dict[str, Any]:
        return model_config(
            self.spec, self.baked, self.live, platform="onnxruntime_onnx", backend="onnxruntime", max_batch_size=0,
            inputs=[TensorSpec(AUDIO_INPUT, "FP32", (-1,))], outputs=[TensorSpec(EMBEDDING_OUTPUT, "FP32", (1, HIDDEN))],
            dynamic_batching=True, stateful=False,
        )  # fmt: skip

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        stateless(self.name, sequence)
        samples = await asyncio.to_thread(audio_input, request.inputs, self.name, speaker_mels.SAMPLE_RATE, self.live)
        return {EMBEDDING_OUTPUT: (await self.utterance(samples))[None]}, None

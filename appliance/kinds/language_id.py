"""The language identification kind: text in, its language and a confidence out, on fastText's model
(the firmware's file; fasttext-predict runs it, nothing is downloaded). LibreTranslate's `/detect`
and `source: "auto"` (api/libretranslate.py) and the OpenAI speech route's voice choice ask it.

KServe infer: input `text` (BYTES, one element per text), outputs `language` (BYTES) and
`confidence` (FP32, 0 to 1), one each per text. The firmware's `languages` limit the answers to the
languages it serves (a box with no Dutch has no use for "nl"); empty, every language the model knows.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Mapping
from typing import Any

import fasttext
import numpy as np

from appliance.config import Live
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import ApplianceError
from appliance.firmware import Bundle, ModelSpec, TensorSpec
from appliance.kinds.base import NoSequences, SequenceCall, ServedModel, Task, stateless
from appliance.kinds.text import request_texts
from appliance.kinds.triton_config import model_config
from appliance.protocol.messages import Opened
from appliance.protocol.tensors import InferRequest

TEXT, LANGUAGE, CONFIDENCE = "text", "language", "confidence"
LABEL = "__label__"
MOST_LABELS = 176  # lid.176's languages
MANY_TEXTS = 64  # texts that fastText reads in about a millisecond: an infer of more is detected off the event loop


class LanguageIdentifier:
    def __init__(self, spec: ModelSpec, bundle: Bundle, live: Live, loaded: Mapping[str, ServedModel]) -> None:
        self.spec, self.baked, self.live = spec, bundle.manifest.baked, live
        self.tasks: Mapping[str, Task] = {}
        self.sequences = NoSequences()
        self.stats = ModelStats()
        path = bundle.artifact(spec.file)
        try:
            self.model = fasttext.load_model(str(path))
        except ValueError as exc:  # fasttext's error for a file that is not a model
            raise ApplianceError(f"model {spec.name}: {path.name} is not a fastText model: {exc}") from None
        languages = spec.parameters["languages"]
        assert isinstance(languages, list)
        self.languages = [str(code) for code in languages]  # empty: all the model's

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def engine_name(self) -> str:
        return "fasttext"

    @property
    def fallbacks(self) -> Mapping[str, int]:
        return {}

    @property
    def queue_depth(self) -> int:
        return 0  # answered inline: microseconds per text

    def start(self) -> None:
        pass

    async def stop(self, timeout_s: float) -> bool:
        return True

    def expire_idle(self) -> int:
        return 0

    async def probe(self) -> None:
        if not self.detect("Hello, how are you?"):
            raise ApplianceError(f"model {self.name}: the warm-up sentence got no language")

    def metadata(self) -> dict[str, Any]:
        return {
            "platform": "fasttext",
            "inputs": [{"name": TEXT, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [
                {"name": LANGUAGE, "datatype": "BYTES", "shape": [-1]},
                {"name": CONFIDENCE, "datatype": "FP32", "shape": [-1]},
            ],
            "parameters": {"kind": self.spec.kind, "engine": self.engine_name, "languages": self.languages or "all"},
        }

    def config(self) -> dict[str, Any]:
        return model_config(
            self.spec, self.baked, self.live, platform="fasttext", backend="fasttext", max_batch_size=0,
            inputs=[TensorSpec(TEXT, "BYTES", (-1,))],
            outputs=[TensorSpec(LANGUAGE, "BYTES", (-1,)), TensorSpec(CONFIDENCE, "FP32", (-1,))],
            dynamic_batching=False, stateful=False,
        )  # fmt: skip

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        stateless(self.name, sequence)

        def detect_all() -> dict[str, np.ndarray]:
            best = [self.detect(t)[0] for t in request_texts(request, self.name, TEXT)]
            languages = np.empty(len(best), object)
            languages[:] = [code.encode() for code, _ in best]
            confidence = np.array([p for _, p in best], np.float32)
            shape = request.inputs[TEXT].shape
            return {LANGUAGE: languages.reshape(shape), CONFIDENCE: confidence.reshape(shape)}

        # up to 65,536 texts, each read, checked and detected (some 20 us of fastText): more than about a
        # millisecond's work leaves the loop, the reading and the answer's arrays with it (65 ms on it at most)
        many = TEXT in request.inputs and request.inputs[TEXT].size > MANY_TEXTS
        return (await asyncio.to_thread(detect_all) if many else detect_all()), None

    def detect(self, text: str, candidates: int = 1, among: Collection[str] = ()) -> list[tuple[str, float]]:
        """The text's likeliest languages among `among` (else the firmware's), best first, with fastText's
        probability (where none of them is among the model's answers, its best answer of any language).
        LibreTranslate detects among the languages it translates: "Bom dia." is Portuguese there, though
        of all the firmware's languages fastText likes Italian best."""
        started = time.perf_counter_ns()
        # one line (fastText's unit); its hierarchical softmax answers the likely labels only
        labels, probabilities = self.model.predict(" ".join(text.split()), k=MOST_LABELS, threshold=0.0)
        ranked = [(label.removeprefix(LABEL), round(float(p), 4)) for label, p in zip(labels, probabilities)]
        allowed = set(among or self.languages)
        found = [(code, p) for code, p in ranked if not allowed or code in allowed][:candidates] or ranked[:1]
        self.stats.record_request(True, time.perf_counter_ns() - started, RequestTimes(), time.time_ns() // 1_000_000)
        return found

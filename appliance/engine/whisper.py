"""Whisper on CTranslate2: a batch of audio shards (at most 30 s each) in, timed text segments out.

The stages are plain functions of arrays (log-mel features, prompts, token parsing) around one
engine call per batch: encode every shard together, then decode each group of shards that share a
prompt length and a temperature (CTranslate2 wants <|startoftranscript|> at one position in a batch).
Nothing here knows about requests, queues or the event loop; `WhisperEngine.run` is called on a
worker thread (CTranslate2 releases the GIL while it computes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable
from pathlib import Path

import ctranslate2
import numpy as np

from appliance.engine import nvidia_libs, whisper_language, whisper_loops, whisper_windows
from appliance.engine.batch_queue import WholeBatches
from appliance.engine.speech_engine import Decoded, Shard, check_request
from appliance.engine.whisper_features import HOP, SAMPLE_RATE, WINDOW_FRAMES, WINDOW_SAMPLES, log_mel, mel_filters
from appliance.engine.whisper_tokens import TOKEN_SECONDS, Generated, Piece, WhisperTokens
from appliance.engine.whisper_words import aligned_words
from appliance.errors import ApplianceError

log = logging.getLogger("appliance")

MAX_INITIAL_TIMESTAMP_INDEX = 50  # the first timestamp at most 1 s in, as openai-whisper decodes
SAMPLING_SEED = 0  # where a looping shard's sampler starts (the box's own Whisper seeds its sequences alike)


class WhisperEngine:
    """One CTranslate2 Whisper model on the CPU (int8) or a CUDA device (int8 weights, fp16 compute),
    with the CPU model taking a batch that arrives while GPU memory is above `fallback_threshold`
    or that ran out of it."""

    def __init__(
        self,
        directory: Path,
        device: str,
        threads: int,
        beam_size: int,
        fallback_threshold: float = 1.0,
        memory_used: Callable[[], float] | None = None,
        window_samples: int = WINDOW_SAMPLES,
        separator_s: float = whisper_windows.SEPARATOR_S,
    ) -> None:
        """`window_samples`: the most audio one window holds when shards share it (the firmware's
        baked shard size); `separator_s`: the silence between two shards sharing a window."""
        if device not in ("cpu", "cuda", "auto"):
            raise ApplianceError(f"engine.device: no engine for {device!r}")
        if device != "cpu":
            _, failed = nvidia_libs.preload()
            for line in failed:
                log.warning("engine.device = %r: %s", device, line)
        gpus = ctranslate2.get_cuda_device_count() if device != "cpu" else 0
        if device == "cuda" and not gpus:
            raise ApplianceError('engine.device = "cuda": CTranslate2 finds no CUDA device here')
        # `threads` decodes side by side (the weights are shared), each free to split over `threads`
        # intra-op threads: a lone shard (a live segment) has every core, several share them. On a
        # 2-core AVX2 EPYC one sentence took 1,023 ms on two threads against 1,738 ms on one, and
        # eight 10 s clips 9.97 s against 9.3 s as lanes of one thread (docs/performance.md).
        self.cpu = ctranslate2.models.Whisper(
            str(directory),
            device="cpu",
            compute_type="int8",
            intra_threads=max(1, threads),
            inter_threads=max(1, threads),
        )
        self._lanes = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="whisper-lane")
        self.gpu = (
            ctranslate2.models.Whisper(str(directory), device="cuda", compute_type="int8_float16") if gpus else None
        )
        self.name = "ctranslate2-cuda" if self.gpu else "ctranslate2-cpu"
        self.beam_size, self.fallback_threshold, self.memory_used = beam_size, fallback_threshold, memory_used
        self.fallbacks: Counter[str] = Counter()
        self.window_samples, self.separator = min(window_samples, WINDOW_SAMPLES), int(separator_s * SAMPLE_RATE)
        self.directory, self.threads = directory, max(1, threads)
        # shards, the windows they ran in, and those decoded alone again after sharing one
        self.windows: Counter[str] = Counter()
        model = self.cpu
        languages = whisper_language.codes(directory)
        self.tokens = WhisperTokens(directory / "tokenizer.json", model.is_multilingual, languages)
        self.filters = mel_filters(model.n_mels)
        self.weight_bytes = (
            (directory / "model.bin").stat().st_size
        )  # a larger Whisper hears better: OpenAI's names pick by it

    def check(self, language: str | None, task: str) -> None:
        check_request(self.tokens, language, task)

    def run(self, shards: list[Shard]) -> list[Decoded]:
        """Decode a batch; the answers in the shards' order."""
        model = self._model(len(shards))
        try:
            return self._shared(model, shards)
        except RuntimeError as exc:
            if model is self.cpu or "out of memory" not in str(exc).lower():
                raise
            self.fallbacks["out_of_memory"] += 1
            log.warning("engine %s: out of GPU memory on a batch of %d, ran it on the CPU", self.name, len(shards))
            return self._shared(self.cpu, shards)

    def _window_key(self, shard: Shard) -> tuple[Hashable, str, str, float] | None:
        """Shards that may share a window: of one request, no prompt (it conditions the whole window),
        a known language."""
        language = shard.language if self.tokens.multilingual else "en"
        if shard.request is None or shard.prompt or language is None:
            return None
        return (shard.request, language, shard.task, shard.temperature)

    def _shared(self, model: ctranslate2.models.Whisper, shards: list[Shard]) -> list[Decoded]:
        """The batch's shards packed into shared windows (whisper_windows.py), each decoded once; the
        text split back by its timestamps, and the shards it cannot split decoded alone."""
        windows = whisper_windows.pack(
            [len(s.samples) for s in shards], [self._window_key(s) for s in shards], self.window_samples, self.separator
        )
        windows.sort(key=lambda w: len(w.members) == 1)  # shared windows first
        inputs = [
            shards[w.members[0]]
            if len(w.members) == 1
            else dataclasses.replace(shards[w.members[0]], samples=w.audio([s.samples for s in shards]))
            for w in windows
        ]
        answers: list[Decoded | None] = [None] * len(shards)
        alone: list[int] = []
        shared = sum(len(w.members) > 1 for w in windows)
        for window, decoded in zip(windows, self._in_lanes(model, inputs, shared)):
            if len(window.members) == 1:
                answers[window.members[0]] = decoded
                continue
            found = whisper_windows.split(
                window,
                [(p.start, p.end, p.text) for p in decoded.pieces],
                SAMPLE_RATE,
                [p.words for p in decoded.pieces],
            )
            for member, pieces in found.pieces.items():
                answers[member] = Decoded(
                    decoded.language,
                    [Piece(*p, tokens=self.tokens.ids(p[2])) for p in pieces],  # a piece may be cut: its own ids
                    language_probability=decoded.language_probability,
                    quality=decoded.quality,
                )
            alone += sorted(found.alone)
        if alone:
            for member, decoded in zip(alone, self._in_lanes(model, [shards[i] for i in alone])):
                answers[member] = decoded
        self.windows.update(shards=len(shards), windows=len(windows), alone=len(alone))
        return [a for a in answers if a is not None]

    def _model(self, batch: int) -> ctranslate2.models.Whisper:
        if self.gpu is None:
            return self.cpu
        if self.memory_used is not None and self.memory_used() > self.fallback_threshold:
            self.fallbacks["memory_pressure"] += 1
            return self.cpu
        return self.gpu

    def _in_lanes(self, model: ctranslate2.models.Whisper, shards: list[Shard], shared: int = 0) -> list[Decoded]:
        """`_run` on the model's workers (inter_threads) side by side: the shards dealt out in turn (the shared
        windows, first, spread over the lanes), each lane's answers put back in the shards' order."""
        lanes = min(model.num_workers, len(shards))
        if lanes <= 1:
            return self._run(model, shards, shared)
        dealt = [list(range(lane, len(shards), lanes)) for lane in range(lanes)]
        runs = [
            self._lanes.submit(self._run, model, [shards[i] for i in lane], sum(i < shared for i in lane))
            for lane in dealt
        ]
        answers: list[Decoded | None] = [None] * len(shards)
        for lane, run in zip(dealt, runs):
            for i, decoded in zip(lane, run.result()):
                answers[i] = decoded
        return [a for a in answers if a is not None]

    def _run(self, model: ctranslate2.models.Whisper, shards: list[Shard], shared: int = 0) -> list[Decoded]:
        """The first `shared` shards are shared windows: their pieces are timed by where the decoder
        heard each token (Whisper's own timestamps drift by seconds over a window of many sentences)."""
        groups: dict[tuple[int, float, str | None], list[int]] = defaultdict(list)
        for i, shard in enumerate(shards):
            groups[(len(shard.prompt), shard.temperature, shard.language)].append(i)
        answers: list[Decoded | None] = [None] * len(shards)
        for (_, temperature, _), members in groups.items():
            group = [shards[i] for i in members]
            features = log_mel([s.samples for s in group], self.filters)
            encoded = model.encode(ctranslate2.StorageView.from_array(features), to_cpu=False)
            detected = whisper_language.shard_languages(model, encoded, group, self.tokens.multilingual)
            languages = [language for language, _ in detected]
            prompts = [self.tokens.prompt(s.task, language, s.prompt) for s, language in zip(group, languages)]
            generated = self._generate(model, encoded, prompts, temperature)
            used = [temperature] * len(group)
            for at in self._looping([g.ids for g in generated]):  # openai-whisper's fallback: rising temperatures
                sampler = seeded_sampler(self.directory, self.threads)
                one = sampler.encode(ctranslate2.StorageView.from_array(features[at : at + 1]), to_cpu=False)
                for fallback in (t for t in whisper_loops.FALLBACK_TEMPERATURES if t > temperature):
                    again = self._generate(sampler, one, prompts[at : at + 1], fallback)
                    if stands(self.tokens, again[0]):
                        generated[at], used[at] = again[0], fallback
                        break
                else:  # none stands: the first answer, cut where its loop begins
                    generated[at] = dataclasses.replace(
                        generated[at], ids=whisper_loops.cut(generated[at].ids, self.tokens.eot)
                    )
            ids = [g.ids for g in generated]
            heard = self._heard(model, encoded, group, languages, ids) if members[0] < shared else None
            asked = [self.tokens.prompt(s.task, lang) if s.words else None for s, lang in zip(group, languages)]
            frames = [min(len(s.samples) // HOP, WINDOW_FRAMES) for s in group]
            words = aligned_words(
                model, (features, encoded), asked, ids, frames, self.tokens.eot, self.tokens.tokenizer.decode, languages
            )
            for k, (i, shard, language, tokens) in enumerate(zip(members, group, languages, ids)):
                duration = len(shard.samples) / SAMPLE_RATE
                times = heard[k] if heard is not None and i < shared else None
                answers[i] = Decoded(
                    language,
                    self.tokens.pieces(tokens, duration, times),
                    words.get(k, []),
                    detected[k][1],
                    self.tokens.quality(generated[k], used[k]),
                )
        return [a for a in answers if a is not None]

    def _heard(
        self,
        model: ctranslate2.models.Whisper,
        encoded: ctranslate2.StorageView,
        group: list[Shard],
        languages: list[str],
        ids: list[list[int]],
    ) -> list[list[float] | None]:
        """Where each text token of each decode was heard, and where its text ended (seconds): the
        first encoder position CTranslate2's alignment (cross-attention, as faster-whisper's word
        timestamps) gives each token; None for a decode with no text."""
        texts = [[t for t in tokens if t < self.tokens.eot] for tokens in ids]
        start = self.tokens.prompt(group[0].task, languages[0])
        frames = [max(1, len(s.samples) // HOP) for s in group]
        results = model.align(encoded, start, [t or [self.tokens.eot] for t in texts], frames)
        out: list[list[float] | None] = []
        for text, result in zip(texts, results):
            first: dict[int, float] = {}
            for token, position in result.alignments:
                first.setdefault(token, position * TOKEN_SECONDS)
            out.append([first.get(k, 0.0) for k in range(len(text) + 1)] if text else None)
        return out

    def decoding(self, max_batch: int) -> WholeBatches[Shard, Decoded]:
        """CTranslate2 batches statically: one `generate` per batch, new shards wait for its end."""
        return WholeBatches(self.run, max_batch)

    def _generate(
        self,
        model: ctranslate2.models.Whisper,
        encoded: ctranslate2.StorageView,
        prompts: list[list[int]],
        temperature: float,
    ) -> list[Generated]:
        sampling = {"sampling_topk": 0, "sampling_temperature": temperature} if temperature > 0 else {}
        results = model.generate(
            encoded,
            prompts,
            beam_size=1 if temperature > 0 else self.beam_size,
            max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX,
            return_scores=True,
            return_no_speech_prob=True,
            **sampling,
        )
        return [Generated(list(r.sequences_ids[0]), float(r.scores[0]), float(r.no_speech_prob)) for r in results]

    def _looping(self, ids: list[list[int]]) -> list[int]:
        """Which decodes loop on themselves (whisper_loops.py)."""
        return whisper_loops.looping_rows(ids, self.tokens.eot, self.tokens.tokenizer.decode)

    def detect(self, clips: list[np.ndarray]) -> list[tuple[str, float]]:
        """Each clip's language and its probability, as Whisper detects it (a multilingual model only)."""
        assert self.tokens.multilingual, "an English-only Whisper detects no language"
        return whisper_language.detect(self._model(len(clips)), self.filters, clips)


def stands(tokens: WhisperTokens, generated: Generated) -> bool:
    """A sampled decode neither loops nor is unsure (whisper_loops.stands)."""
    text = [t for t in generated.ids if t < tokens.eot]
    mean = tokens.quality(generated, 0.0).avg_logprob
    return whisper_loops.stands(text, tokens.tokenizer.decode(text), mean, generated.no_speech_prob)


def seeded_sampler(directory: Path, threads: int) -> ctranslate2.models.Whisper:
    """A model of its own for one looping shard's sampled fallbacks (0.3 s to load tiny.en, 0.5 s base,
    on 2 cores). CTranslate2 samples from a generator per worker thread, seeded when the thread first
    samples and carried on from each sampled decode to the next: on the served model a fallback's text
    depended on every decode sampled before it, in any request, since the daemon started (issue 45: the
    same recording came back with 9, 11, 13 or 15 segments). A new model's worker starts from the seed."""
    ctranslate2.set_random_seed(SAMPLING_SEED)
    return ctranslate2.models.Whisper(
        str(directory), device="cpu", compute_type="int8", intra_threads=threads, inter_threads=1
    )

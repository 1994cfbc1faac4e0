"""The language half of SpeechToText: speech language identification on every VAD segment.

Where a request names no language, each segment of a shard is given its own by a multilingual Whisper
(the model itself, or for an English-only one the model its `languages_by` parameter names), on a window
cut to the segment (engine/whisper_language.py: about 0.1 s a segment for base on 2 cores). The shard is
then decoded as runs of segments of one language, each told its language: a recording of two languages
keeps all its speech, each segment in its own (a window given one language for both turned the other's
speech into nonsense or dropped it). An English-only model never answers speech in another language: it
decodes the English runs, the model that identified the others decodes those.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Hashable
from typing import Protocol

import numpy as np

from appliance.engine.speech_engine import SpeechEngine
from appliance.engine.stats import RequestTimes
from appliance.errors import BadRequest
from appliance.kinds.interpret_routes import target_of
from appliance.kinds.speech_api import SAMPLE_RATE, Options, Segment
from appliance.kinds.speech_shards import ShardDecoder, ShardPlan, Span

# Under this much audio, Whisper's language detection is not to be trusted: base heard Kokoro's "Sim."
# as English (0.91) and "Não." as Japanese (0.60); "Obrigado." (0.8 s) and longer turns right (docs/live.md)
SHORT_TURN_S = 1.0


class LanguageDecoding(ShardDecoder, Protocol):
    """What the segments' languages need of their speech model (SpeechToText)."""

    engine: SpeechEngine

    @property
    def languages(self) -> list[str]:
        """The languages it hears."""
        ...


class SegmentLanguages:
    """A speech model's segments given their languages by its `listener`: the model itself where it is
    multilingual, else the one its `languages_by` parameter names (set at its start), else None."""

    def __init__(self, model: LanguageDecoding) -> None:
        self.model: LanguageDecoding = model
        self.listener: LanguageDecoding | None = None

    def identifies(self, plan: ShardPlan, options: Options) -> bool:
        """Its segments' languages are to be identified before decoding: no language was named, and the
        model is English-only, the shard holds more than one segment (a lone segment's language is
        detected in its own decode) or the task or the turn-taking depends on the language."""
        return (
            options.language is None
            and self.listener is not None
            and (
                not self.model.engine.tokens.multilingual
                or len(plan.spans) > 1
                or bool(options.transcribed or options.conversation)
            )
        )

    def refer_to_listener(self, options: Options) -> None:
        """An English-only model asked for another language or a translation: a 400 naming the model
        that hears it (its listener), where it has one."""
        other = self.listener if self.listener is not self.model else None
        if other is None or (options.task != "translate" and options.language in (None, *self.model.languages)):
            return
        if options.task == "translate":
            raise BadRequest(f"model {self.model.name} is English-only: for translations use {other.name}")
        raise BadRequest(
            f"model {self.model.name} is English-only: for language {options.language!r} use {other.name}, or name"
            f" no language (this model hands speech in other languages to {other.name})"
        )

    async def by_language(
        self,
        plan: ShardPlan,
        samples: np.ndarray,
        options: Options,
        times: RequestTimes,
        request: Hashable,
        urgent: bool,
        offset: int,
        index: int,
    ) -> list[Segment]:
        """The shard's segments, runs of one language decoded in it, by this model where it hears it, else
        by the listener; each segment keeps the probability its language was identified with. The runs
        keep the shard's `index` in its request (the batcher's turn: a request's first shard goes before
        anyone's next)."""
        listener = self.listener
        assert listener is not None  # it identifies
        clips = [samples[s.start : s.end] for s in plan.spans]
        heard = turn_taking(await asyncio.to_thread(listener.engine.detect, clips), plan.spans, options)
        runs = itertools.groupby(zip(heard, plan.spans), key=lambda found: found[0][0])
        decodes = []
        for language, run in runs:
            members = list(run)
            probability = min(p for (_, p), _ in members)
            model = self.model if language in self.model.languages else listener
            translated = bool(options.transcribed) and language not in options.transcribed
            told = dataclasses.replace(options, language=language, task="translate" if translated else options.task)
            plans = self.model.plans(samples, [(span.start, span.end) for _, span in members])
            decodes += [
                (probability, model.decode(p, samples, told, times, request, urgent, offset, index)) for p in plans
            ]
        found = await asyncio.gather(*(decode for _, decode in decodes))
        return [
            dataclasses.replace(s, language_probability=probability)
            for (probability, _), segments in zip(decodes, found)
            for s in segments
        ]


def turn_taking(heard: list[tuple[str, float]], spans: list[Span], options: Options) -> list[tuple[str, float]]:
    """Each segment's language and its probability, in conversation mode with a short segment's taken
    from the turns (`told_by_turns`), told as a caller's language is (probability 1.0)."""
    before, found = options.after, []
    for (language, probability), span in zip(heard, spans):
        told = told_by_turns(span.end - span.start, before, options)
        if told is not None:
            language, probability = told, 1.0
        found.append((language, probability))
        before = language
    return found


def told_by_turns(length: int, before: str, options: Options) -> str | None:
    """The language of a segment of `length` samples after speech in `before`, where conversation mode
    tells it: two people take turns, so a segment whose speech (less the VAD's padding) is too short for
    Whisper to tell (SHORT_TURN_S) is in the other of the two languages. None where the caller named the
    language, and where Whisper's detection stands: not conversation mode, a longer segment, no speech
    before it or speech in a third language."""
    short = length - 2 * options.padding < SHORT_TURN_S * SAMPLE_RATE
    if options.language is None and len(options.conversation) == 2 and short and before in options.conversation:
        return target_of(options.conversation, before)
    return None

"""The live streams of the speech_to_text kind (speech_to_text.py): each chunk fed to the stream's own
VAD sequence, each segment the VAD closes decoded at once (its decode started while the VAD waited out
the silence, where the speech did not go on), and the audio kept no longer than a segment to come needs.
Also recordings heard as they arrive (`hear`: heard.py).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from appliance.config import VadConfig
from appliance.engine.sequences import OwnedTable
from appliance.engine.stats import RequestTimes
from appliance.errors import ApiError
from appliance.kinds.base import SequenceCall
from appliance.kinds.heard import Heard, Listener, consume_error, drop
from appliance.kinds.segments import SegmentTracker
from appliance.kinds.speech_api import SAMPLE_RATE, LiveChunk, Options, Segment, merged
from appliance.kinds.speech_languages import told_by_turns
from appliance.kinds.speech_shards import ShardDecoder
from appliance.kinds.vad import VadModel

# the speech heard between decodes of a segment's text so far behind the stream (and before the first)
PARTIAL_GAP = SAMPLE_RATE


@dataclass(slots=True, eq=False)
class LiveStream:
    """A live stream (an entry of the model's OwnedTable): its VAD's segment tracker, the audio not yet
    decoded, and a sequence of the VAD under its own key (`vad_key`), ended when the stream is dropped."""

    options: Options
    tracker: SegmentTracker
    audio: list[np.ndarray] = field(default_factory=list)
    base: int = 0  # sample position of audio[0]'s first sample
    position: int = 0  # samples received
    client: str = ""
    serial: int = 0
    last_used: float = 0.0
    in_flight: int = 0
    # the decode of the span the VAD is about to close, started while it waits out min_silence_ms
    ahead: tuple[tuple[int, int], asyncio.Task[list[Segment]]] | None = None
    # the open segment's text so far, decoded behind the stream (live_chunk's partial_waits=False)
    partial: asyncio.Task[list[Segment]] | None = None
    partial_ended: int = 0  # the stream position when the last one ended

    def drop_ahead(self) -> None:
        if self.ahead is not None:
            drop(self.ahead[1])
            self.ahead = None

    def drop_partial(self) -> None:
        if self.partial is not None:
            self.partial.cancel()
            self.partial = None

    def finished_partial(self) -> str | None:
        """The text of the partial decode behind the stream, once it is done (then it is gone)."""
        if self.partial is None or not self.partial.done():
            return None
        task, self.partial = self.partial, None
        return None if task.cancelled() or task.exception() else " ".join(s.text for s in task.result())


class SpeechDecoding(ShardDecoder, Listener, Protocol):
    """What the live streams need of their speech model (SpeechToText): its shards decoded, and what a
    recording heard as it arrives needs of it."""

    def check(self, options: Options) -> None: ...


class LiveTranscription:
    """A speech model's live streams (its `sequences`, each a LiveStream) and the recordings it hears
    as they arrive."""

    def __init__(self, model: SpeechDecoding, sequences: OwnedTable[LiveStream]) -> None:
        self.model, self.sequences = model, sequences

    def hear(self, options: Options, client: str) -> Heard:
        self.model.check(options)
        return Heard(self.model, options, client)

    async def live_chunk(
        self,
        samples: np.ndarray,
        sequence: SequenceCall,
        partial: bool,
        options: Options,
        times: RequestTimes,
        vad: VadConfig | None = None,
        partial_waits: bool = True,
    ) -> LiveChunk:
        """One chunk of a live stream: the spans the VAD closed with it (each decoded), the open
        span's start and its text so far when `partial`, and the stream's serial when this chunk
        opened it. `vad`: the stream's own segment rules (when it starts), else the config's [vad].
        `partial_waits=False`: the text so far is decoded behind the stream, at most once every
        PARTIAL_GAP of speech, and comes with the first chunk after it is done (a live session then
        never waits a window for it: the chunk where the speech stops goes on at once to decode the
        segment ahead)."""
        now = self.model.clock()
        if sequence.start:
            self.model.check(options)
            rules = vad or self.model.live.config.vad
            frames = self.model.vad.frames
            tracker = SegmentTracker(frames.frame_samples, frames.sample_rate, rules)
            stream = self.sequences.open(
                sequence.id,
                now,
                sequence.client,
                lambda: LiveStream(replace(options, padding=tracker.pad), tracker),
                sequence.address,
                sequence.principal,
            )
        else:
            stream = self.sequences.get(sequence.id, now, sequence.client)
            if stream.in_flight:  # its audio would join out of turn, and the one in flight would trim it away
                raise ApiError(
                    f"sequence {sequence.id}: its previous chunk is still being heard; send after its answer", 409
                )
        serial = stream.serial if sequence.start else None
        stream.in_flight += 1
        try:
            key = vad_key(self.model.name, sequence.id, stream)
            probs, _ = await self.model.vad.infer_stream(samples, key, sequence.start, sequence.end, sequence.client)
            stream.audio.append(samples)
            stream.position += len(samples)
            closed = stream.tracker.feed(probs)
            if sequence.end:
                closed += stream.tracker.finish(stream.position)
            audio, base = np.concatenate(stream.audio), stream.base
            final = functools.partial(self._final, stream, audio, base, times=times)
            in_turn = stream.options.conversation  # one after another: a turn's language is the next one's before
            decoded = [await final(s) for s in closed] if in_turn else await asyncio.gather(*map(final, closed))
            text, open_start = None, None if sequence.end else stream.tracker.open_start
            speaking = open_start is not None and stream.tracker.closing() is None  # else decoded ahead
            if closed or open_start is None:
                stream.drop_partial()  # of a segment now closed
            elif not partial_waits:
                # one at a time, each once PARTIAL_GAP more of the speech is heard since the segment began
                # or the last one ended: where a decode takes about that long (a slow CPU), the engine is
                # then not always busy with one when the speech stops, which the segment's decode would
                # wait behind (a new one also waits for the speech to go on after a pause)
                text = stream.finished_partial()
                assert open_start is not None
                due = max(open_start, stream.partial_ended) + PARTIAL_GAP
                if partial and speaking and stream.partial is None and stream.position >= due:
                    stream.partial = asyncio.get_running_loop().create_task(
                        self._decode_live(
                            stream, audio, base, (open_start, stream.position), RequestTimes(), by_turns=False
                        ),
                        name="live-partial",
                    )
                    stream.partial.add_done_callback(functools.partial(_partial_ended, stream))
            elif partial and speaking:
                found = await self._decode_live(
                    stream, audio, base, (open_start, stream.position), times, by_turns=False
                )
                text = " ".join(s.text for s in found)
            # keep only what a segment still to come can include: after a closed segment its padded
            # end, in silence the VAD's padding, so a chunk's cost does not grow with the stream's age
            keep = max(stream.tracker.needed_from(), closed[-1][1] if closed else 0, base)
            stream.audio, stream.base = [audio[keep - base :]], keep
            audio, base = stream.audio[0], stream.base
            self._decode_ahead(stream, audio, base, sequence.end)
            return LiveChunk(list(zip(closed, decoded, strict=True)), open_start, text, serial)
        finally:
            stream.in_flight -= 1
            # a first chunk whose VAD sequence did not open (nothing heard) opens no stream either
            if sequence.end or (sequence.start and not stream.position):
                self.sequences.end(sequence.id)

    async def _final(
        self, stream: LiveStream, audio: np.ndarray, base: int, span: tuple[int, int], times: RequestTimes
    ) -> list[Segment]:
        """A closed segment's text: the decode started before the close, where it was of this very span
        and heard in the language the turns tell it, if they do. Its language is the speech before the
        stream's next turns (speech_languages.turn_taking)."""
        if stream.ahead is not None and stream.ahead[0] == span:
            task, stream.ahead = stream.ahead[1], None
            turn = await task
            told = told_by_turns(span[1] - span[0], stream.options.after, stream.options)
            if told is not None and (not turn or any(s.language != told for s in turn)):  # heard untold: again
                turn = await self._decode_live(stream, audio, base, span, times)
        else:
            turn = await self._decode_live(stream, audio, base, span, times)
        stream.options = replace(stream.options, after=turn[-1].language) if turn else stream.options
        return turn

    def _decode_ahead(self, stream: LiveStream, audio: np.ndarray, base: int, ending: bool) -> None:
        """Start decoding the span the VAD will close if the silence it hears goes on (the final text
        is then mostly done at the close); drop a decode the speech went on past."""
        closing = None if ending else stream.tracker.closing()
        if stream.ahead is not None and stream.ahead[0] == closing:
            return
        stream.drop_ahead()
        if closing is not None and base <= closing[0]:
            # at once, from the silence's first chunk: the padding after the speech, not all heard yet,
            # is silence the VAD is waiting out, so the decode of what is heard is the segment's text
            heard = (closing[0], min(closing[1], base + len(audio)))
            task = asyncio.get_running_loop().create_task(
                self._decode_live(stream, audio, base, heard, RequestTimes(), by_turns=False), name="live-ahead"
            )
            stream.ahead = (closing, task)  # taken at the close, or dropped (its failure logged: heard.drop)

    async def _decode_live(
        self,
        stream: LiveStream,
        audio: np.ndarray,
        base: int,
        span: tuple[int, int],
        times: RequestTimes,
        by_turns: bool = True,
    ) -> list[Segment]:
        """A span of a live stream's kept `audio` (from stream position `base`), decoded ahead of recordings.
        `by_turns=False`: a span the speech may go on past (decoded ahead, or its text so far) is heard in
        the language Whisper detects, not told one by conversation mode's turns: it is often a sentence's
        first words before a pause inside it, and English decoded as Portuguese cost 1.4 s and could loop."""
        options = stream.options if by_turns else replace(stream.options, after="")  # no turn before it
        plans = self.model.plans(audio, [(span[0] - base, span[1] - base)])
        request = object()  # the span's shards may share Whisper windows, no one else's
        found = await asyncio.gather(*(self.model.decode(p, audio, options, times, request, True, base) for p in plans))
        return merged([s for segments in found for s in segments])  # one turn


def dropped(stream: LiveStream, vad: VadModel, key: object) -> None:
    """A live stream dropped (ended, expired, replaced): its decode ahead and its VAD sequence go."""
    stream.drop_ahead()
    stream.drop_partial()
    vad.sequences.end(key)


def _partial_ended(stream: LiveStream, task: asyncio.Task[list[Segment]]) -> None:
    stream.partial_ended = stream.position
    consume_error(task)


def vad_key(model: str, key: object, stream: LiveStream) -> object:
    """The key of a live stream's sequence in its VAD's table."""
    return (model, key, stream.serial)

"""Who said what: a transcription's segments with their speakers, as OpenAI's diarized transcription
answers them (response_format diarized_json, `transcript.text.segment` events) and as a `speaker` in
verbose_json and the subtitles' cues.

The recording's speech (the transcriber's VAD) is cut into windows, each window's voiceprint comes
from the firmware's speaker_embedding model (windows of all requests batched), the windows are
clustered (diarize.py) into a timeline of turns, and each Whisper segment is split where the speaker
of its words changes. Memory: the windows' mel frames are made DIARIZE_CHUNK at a time; what is kept
is one voiceprint per window (1 KiB per 0.4 s of speech).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import numpy as np

from appliance.kinds import diarize, speaker_mels
from appliance.kinds.capabilities import VoicePrinter
from appliance.kinds.diarize import SpeakerCount, Turn
from appliance.kinds.speech_api import SAMPLE_RATE, Segment, Word

DIARIZE_CHUNK = 256  # windows whose mel frames exist at once (256 x 160 x 40 floats: 6.5 MB)


@dataclasses.dataclass(frozen=True, slots=True)
class Who:
    """What a request asks of the diarization: how many speakers, and the voiceprints of known ones."""

    count: SpeakerCount = SpeakerCount()
    known: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)


def _window_mels(samples: np.ndarray, bounds: list[tuple[int, int, int]]) -> list[np.ndarray]:
    return [speaker_mels.mels(speaker_mels.louder(samples[start:end]))[:-1] for start, end, _ in bounds]


async def timeline(printer: VoicePrinter, samples: np.ndarray, who: Who) -> list[Turn]:
    """The recording's turns: who speaks from when to when, in its speech."""
    spans = [span async for span in printer.speech(samples)]
    hop = speaker_mels.HOP
    bounds = diarize.windows(spans, printer.window_frames * hop, printer.step_frames * hop, SAMPLE_RATE)
    prints = []
    for at in range(0, len(bounds), DIARIZE_CHUNK):
        chunk = bounds[at : at + DIARIZE_CHUNK]
        prints.append(await printer.embed(await asyncio.to_thread(_window_mels, samples, chunk)))
    if not bounds:
        return []
    embeddings = np.concatenate(prints)
    span_of = [span for _, _, span in bounds]
    labels = diarize.clusters(embeddings, span_of, printer.step_frames * hop / SAMPLE_RATE, who.count)
    named = diarize.names(embeddings, labels, dict(who.known))
    return diarize.turns(bounds, spans, [named[int(c)] for c in labels], SAMPLE_RATE)


def by_speaker(segment: Segment, turns: list[Turn]) -> list[Segment]:
    """The segment with its speaker, cut where the speaker of its words changes."""
    if not segment.words:
        return [dataclasses.replace(segment, speaker=diarize.speaker_at(turns, segment.start, segment.end))]
    runs: list[tuple[str, list[Word]]] = []
    for word in segment.words:
        speaker = diarize.speaker_at(turns, word.start, word.end)
        if runs and runs[-1][0] == speaker:
            runs[-1][1].append(word)
        else:
            runs.append((speaker, [word]))
    if len(runs) == 1:
        return [dataclasses.replace(segment, speaker=runs[0][0])]
    return [
        dataclasses.replace(
            segment,
            start=segment.start if i == 0 else words[0].start,
            end=segment.end if i == len(runs) - 1 else words[-1].end,
            text="".join(w.word for w in words).strip(),
            words=tuple(words),
            tokens=(),  # Whisper's ids are the whole segment's
            speaker=speaker,
        )
        for i, (speaker, words) in enumerate(runs)
    ]


async def labelled(segments: AsyncIterator[Segment], turns: asyncio.Task[list[Turn]]) -> AsyncGenerator[Segment, None]:
    """Each segment with its speaker, as soon as it is decoded and the timeline is made."""
    try:
        async for segment in segments:
            for piece in by_speaker(segment, await turns):
                yield piece
    finally:
        turns.cancel()  # the client went away or the transcription failed: the timeline is not needed


def diarized_json(segments: list[Segment], duration: float) -> dict[str, Any]:
    """OpenAI's TranscriptionDiarized."""
    return {
        "task": "transcribe",
        "duration": round(duration, 3),
        "text": " ".join(s.text for s in segments),
        "segments": [segment_event(i, s) for i, s in enumerate(segments)],
        "usage": {"type": "duration", "seconds": round(duration, 3)},
    }


def segment_event(index: int, segment: Segment) -> dict[str, Any]:
    """A diarized segment (and the `transcript.text.segment` event, which has the same shape)."""
    return {
        "type": "transcript.text.segment",
        "id": f"seg_{index}",
        "start": segment.start,
        "end": segment.end,
        "text": segment.text,
        "speaker": segment.speaker,
    }

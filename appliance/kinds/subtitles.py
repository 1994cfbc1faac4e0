"""SRT and WebVTT as subtitle tools make them: cues of at most MAX_CUE_S and two lines of at most
LINE_CHARS, cut at the words' times (Whisper's alignment): at a pause between words (the VAD's
silences are such pauses, so no cue spans one), after a sentence, or where the next word would make
the cue too long. A segment without word times is cut in proportion to its characters. Plain functions."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Word(Protocol):
    """A word with its times (speech_api.Word)."""

    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def word(self) -> str: ...


class Segment(Protocol):
    """A segment with its text and words (speech_api.Segment)."""

    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def text(self) -> str: ...
    @property
    def words(self) -> Sequence[Word]: ...
    @property
    def speaker(self) -> str: ...


MAX_CUE_S = 7.0
LINE_CHARS = 42  # the common broadcast limit per line
MAX_LINES = 2
PAUSE_S = 0.3  # a pause this long between two words ends a cue
MIN_SENTENCE_CUE_S = 1.0  # a sentence's end ends a cue once it has been up this long
SENTENCE_ENDS = (".", "?", "!", "。", "？", "！")


@dataclass(frozen=True, slots=True)
class Cue:
    start: float
    end: float
    text: str
    speaker: str = ""  # who says it, where the transcription was diarized


def cues(segments: Sequence[Segment]) -> list[Cue]:
    out: list[Cue] = []
    for segment in segments:
        pieces = _by_words(segment.words) if segment.words else _by_characters(segment)
        for cue in pieces:
            start = max(cue.start, out[-1].end) if out else cue.start  # cues never overlap
            out.append(Cue(start, max(cue.end, start), cue.text, segment.speaker))
    return out


def _by_words(words: Sequence[Word]) -> list[Cue]:
    found: list[Cue] = []
    current: list[Word] = []

    def close() -> None:
        if current:
            found.append(Cue(current[0].start, current[-1].end, _joined(current)))
            current.clear()

    for word in words:
        if current:
            last = current[-1]
            longer = word.end - current[0].start > MAX_CUE_S
            wider = len(_joined([*current, word])) > LINE_CHARS * MAX_LINES
            paused = word.start - last.end >= PAUSE_S
            sentence = last.word.rstrip().endswith(SENTENCE_ENDS) and last.end - current[0].start >= MIN_SENTENCE_CUE_S
            if longer or wider or paused or sentence:
                close()
        current.append(word)
    close()
    return found


def _by_characters(segment: Segment) -> list[Cue]:
    """Lines of the segment's text, grouped into cues that fit, timed in proportion to their characters."""
    duration = segment.end - segment.start
    per_char = duration / max(len(segment.text), 1)
    room = min(LINE_CHARS * MAX_LINES, max(int(MAX_CUE_S / per_char) if per_char else LINE_CHARS, 1))
    chunks = textwrap.wrap(segment.text, room) or [""]
    found, position = [], segment.start
    for chunk in chunks:
        length = duration * len(chunk) / max(sum(map(len, chunks)), 1)
        found.append(Cue(position, min(position + length, segment.end), chunk))
        position += length
    return found


def _joined(words: Sequence[Word]) -> str:
    return "".join(w.word for w in words).strip()


def lines(text: str) -> str:
    """A cue's text in at most two lines of about even length."""
    if len(text) <= LINE_CHARS:
        return text
    wrapped = textwrap.wrap(text, max(LINE_CHARS, -(-len(text) // MAX_LINES)))
    return "\n".join(wrapped[: MAX_LINES - 1] + [" ".join(wrapped[MAX_LINES - 1 :])])


def _labelled(cue: Cue, srt: bool) -> str:
    """The cue's lines, with its speaker where known: WebVTT's voice span (`<v A>`), SRT's `A: ` (SRT
    has no voice tag; players show the text as it is)."""
    if not cue.speaker:
        return lines(cue.text)
    return f"{cue.speaker}: {lines(cue.text)}" if srt else f"<v {cue.speaker}>{lines(cue.text)}"


def render(segments: Sequence[Segment], response_format: str) -> str:
    """SRT (numbered cues, comma decimals) or WebVTT (a header, dot decimals)."""
    comma = response_format == "srt"

    def clock(seconds: float) -> str:
        ms = round(seconds * 1000)
        text = f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"
        return text.replace(".", ",") if comma else text

    shown = [f"{clock(c.start)} --> {clock(c.end)}\n{_labelled(c, comma)}\n" for c in cues(segments)]
    if comma:
        return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(shown, 1))
    return "WEBVTT\n\n" + "\n".join(shown)

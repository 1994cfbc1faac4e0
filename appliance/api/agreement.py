"""Live text that is never taken back: Whisper revises what it heard as the audio grows (a word cut at
the end, a misheard start), and a word sent cannot be unsent; so a word goes out once two texts in a
row agree on it and on every word before it (whisper_streaming's local agreement). Realtime's
transcription deltas and Wyoming's streamed transcript chunks both send what this lets through.
"""

from __future__ import annotations


class LocalAgreement:
    def __init__(self) -> None:
        self.sent: list[str] = []  # the words let through, in order
        self._hypothesis: list[str] = []

    def hear(self, text: str) -> str:
        """The words newly agreed on by this text and the one before (with a space before them where
        words went before); "" where none are."""
        hypothesis = text.split()
        agreed = 0
        for mine, last in zip(hypothesis, self._hypothesis):
            if plain(mine) != plain(last):
                break
            agreed += 1
        self._hypothesis = hypothesis
        if agreed <= len(self.sent):
            return ""
        new = hypothesis[len(self.sent) : agreed]
        delta = (" " if self.sent else "") + " ".join(new)
        self.sent += new
        return delta


def plain(word: str) -> str:
    """A word as two texts are compared: "sandwich," and "Sandwich." agree."""
    return "".join(c for c in word.lower() if c.isalnum() or c == "'")

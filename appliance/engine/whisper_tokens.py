"""Whisper's tokens: its special tokens read from the model's tokenizer.json, prompts, decoded ids split
into timed pieces at their timestamp tokens, and openai-whisper's measures of a decode (avg_logprob,
compression_ratio, no_speech_prob). Plain functions of ids and text; no engine here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tokenizers

from appliance.engine.whisper_loops import compression_ratio
from appliance.errors import ApplianceError

TOKEN_SECONDS = 0.02  # an encoder position, and a timestamp token's step
MAX_PROMPT_TOKENS = 223  # Whisper's limit for previous text: half its 448-token context, less the start


@dataclass(frozen=True, slots=True)
class Piece:
    """Text of a shard between two of its timestamps (seconds from the shard's start)."""

    start: float
    end: float
    text: str
    words: tuple[tuple[float, str], ...] = ()  # in a shared window: each word and where it was heard
    tokens: tuple[int, ...] = ()  # its text's token ids


@dataclass(frozen=True, slots=True)
class Quality:
    """How sure Whisper was of one decode, as openai-whisper reports it on each of its segments."""

    temperature: float = 0.0  # the one whose answer was kept (a fallback's, where the first looped)
    avg_logprob: float = 0.0  # the decode's mean log probability per token, its end counted
    compression_ratio: float = 0.0  # its text's length over gzip's: above 2.4 it repeats itself
    no_speech_prob: float = 0.0  # the <|nospeech|> token's probability at its start


@dataclass(frozen=True, slots=True)
class Generated:
    """One decode's token ids, with CTranslate2's score of it and its no-speech probability."""

    ids: list[int]
    score: float  # the log probability per token (length_penalty 1)
    no_speech_prob: float


class WhisperTokens:
    """The tokenizer and Whisper's special tokens, read from the model's tokenizer.json."""

    def __init__(self, path: Path, multilingual: bool, languages: list[str]) -> None:
        self.tokenizer = tokenizers.Tokenizer.from_file(str(path))
        self.multilingual, self.languages = multilingual, languages
        token = self._special
        self.sot, self.eot, self.sot_prev = token("startoftranscript"), token("endoftext"), token("startofprev")
        self.no_timestamps = token("notimestamps")
        self.timestamp_begin = self.no_timestamps + 1

    def _special(self, name: str) -> int:
        found = self.tokenizer.token_to_id(f"<|{name}|>")
        if found is None:
            raise ApplianceError(f"tokenizer.json has no <|{name}|> token: not a Whisper tokenizer")
        return int(found)

    def ids(self, text: str) -> tuple[int, ...]:
        """A text's token ids as Whisper writes it after a space."""
        return tuple(self.tokenizer.encode(" " + text.strip(), add_special_tokens=False).ids)

    def encode(self, text: str) -> tuple[int, ...]:
        return self.ids(text)[-MAX_PROMPT_TOKENS:]

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode([t for t in ids if t < self.eot]))

    def quality(self, generated: Generated, temperature: float) -> Quality:
        """openai-whisper's measures of a decode (faster-whisper's formulas for CTranslate2's score)."""
        text = self.text(generated.ids)
        count = len(generated.ids)
        return Quality(
            temperature,
            round(generated.score * count / (count + 1), 4),
            round(compression_ratio(text), 4),
            round(generated.no_speech_prob, 4),
        )

    def prompt(self, task: str, language: str, previous_text: tuple[int, ...] = ()) -> list[int]:
        previous = [self.sot_prev, *previous_text] if previous_text else []
        start = [self.sot]
        if self.multilingual:
            start += [self._special(language), self._special(task)]
        return previous + start

    def pieces(self, ids: list[int], duration: float, heard: list[float] | None = None) -> list[Piece]:
        """Split decoded ids at their timestamp tokens; text left open at the end runs to `duration`.
        `heard`: where each text token was heard (and, last, where the text ended), from the decoder's
        cross-attention: a piece then spans its first token to the one after its last, as heard."""
        pieces: list[Piece] = []
        text: list[int] = []
        start, count = 0.0, 0

        def close(end: float) -> None:
            decoded = self.tokenizer.decode(text).strip()
            if heard is None:
                pieces.append(Piece(start, max(start, end), decoded, tokens=tuple(text)))
            else:
                a, b = heard[count - len(text)], heard[count]
                words = self._words(text, heard[count - len(text) : count])
                pieces.append(Piece(a, max(a, b), decoded, words, tuple(text)))
            text.clear()

        for token in ids:
            if token >= self.timestamp_begin:
                time = min((token - self.timestamp_begin) * TOKEN_SECONDS, duration)
                if text:
                    close(time)
                start = time
            elif token < self.eot:
                text.append(token)
                count += 1
        if text:
            close(duration)
        return [p for p in pieces if p.text]

    def _words(self, tokens: list[int], heard: list[float]) -> tuple[tuple[float, str], ...]:
        """Tokens joined into words (a word starts at a token with a leading space), each at the time
        its first token was heard."""
        words: list[tuple[float, str]] = []
        for token, time in zip(tokens, heard):
            piece = self.tokenizer.decode([token])
            if not words or piece.startswith(" "):
                words.append((time, piece))
            else:
                words[-1] = (words[-1][0], words[-1][1] + piece)
        return tuple(words)

"""Whisper's logit rules, as openai-whisper and CTranslate2 apply them before each token is chosen:
the tokens never generated (the model's `suppress_ids`), a blank or an end as the first token
(`suppress_ids_begin`), and the timestamp rules (timestamps in pairs, never going back, the first one
at most MAX_INITIAL_TIMESTAMP_INDEX steps in, a timestamp forced where all of them together are likelier
than any text token). Plain functions of a row's logits and the tokens it has chosen."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAX_INITIAL_TIMESTAMP_INDEX = 50  # the first timestamp at most 1 s in, as the CTranslate2 engine decodes


@dataclass(frozen=True, slots=True)
class Rules:
    eot: int
    no_timestamps: int
    suppress: np.ndarray  # token ids never generated
    suppress_begin: np.ndarray  # nor as the first one

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @classmethod
    def of(cls, model_dir: Path, eot: int, no_timestamps: int) -> Rules:
        """The model's own lists, from its CTranslate2 config.json."""
        config = json.loads((model_dir / "config.json").read_text())
        return cls(
            eot,
            no_timestamps,
            np.asarray(config.get("suppress_ids", []), np.int64),
            np.asarray(config.get("suppress_ids_begin", []), np.int64),
        )

    def apply(self, logits: np.ndarray, chosen: list[int], timestamps: bool) -> np.ndarray:
        """One row's logits [vocabulary] (float32, modified in place) after `chosen`, the tokens it has
        generated so far; `timestamps`: the prompt did not end in <|notimestamps|>."""
        logits[self.suppress] = -np.inf
        if not chosen:
            logits[self.suppress_begin] = -np.inf
        if not timestamps:
            return logits
        begin = self.timestamp_begin
        logits[self.no_timestamps] = -np.inf
        if not chosen:
            logits[:begin] = -np.inf  # the text starts with a timestamp, at most 1 s in
            logits[begin + MAX_INITIAL_TIMESTAMP_INDEX + 1 :] = -np.inf
        else:
            last = chosen[-1] >= begin
            penultimate = len(chosen) < 2 or chosen[-2] >= begin
            if last:
                if penultimate:
                    logits[begin:] = -np.inf  # a pair closed: text comes next
                else:
                    logits[: self.eot] = -np.inf  # a piece ended: its closing timestamp, or the end
            stamps = [t for t in chosen if t >= begin]
            if stamps:  # never back in time, and a piece is never empty
                logits[begin : stamps[-1] + (0 if last and not penultimate else 1)] = -np.inf
        logprobs = log_softmax(logits)
        if np.logaddexp.reduce(logprobs[begin:]) > logprobs[:begin].max():
            logits[:begin] = -np.inf  # all timestamps together likelier than any text token
        return logits


def log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=-1, keepdims=True)
    shifted = logits - top
    return np.asarray(shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)))

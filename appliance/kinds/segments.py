"""Per-frame speech probabilities -> speech segments, with hysteresis, minimum lengths and padding.

Follows the rules of silero-vad's get_speech_timestamps: speech starts at a frame above
`threshold`, ends after `min_silence_ms` below `threshold - 0.15`; segments shorter than
`min_speech_ms` are dropped; each side is padded by `speech_pad_ms`, splitting a shorter gap.

`SegmentTracker` applies the rules incrementally, so a long recording's segments can be sent
as soon as they are final: a segment is final once the next one has started or the silence
after it is long enough that no later segment can take from its padding.
"""

from __future__ import annotations

import numpy as np

from appliance.config import VadConfig

# A request's segment parameters are the config's [vad] defaults with its own values in place: one type.
SegmentParams = VadConfig


class SegmentTracker:
    """Feed probabilities in order with `feed`; each call returns the (start, end) sample
    positions that became final; `finish(total_samples)` returns the rest."""

    def __init__(self, frame_samples: int, sample_rate: int, params: SegmentParams) -> None:
        self.frame_samples = frame_samples
        self.threshold = params.threshold
        self.off_threshold = max(params.threshold - 0.15, 0.01)
        self.min_speech = sample_rate * params.min_speech_ms / 1000
        self.min_silence = sample_rate * params.min_silence_ms / 1000
        self.pad = int(sample_rate * params.speech_pad_ms / 1000)
        self._position = 0  # sample position of the next frame
        self._start: int | None = None  # start of the speech being heard
        self._silence_from = 0
        self._closed: list[tuple[int, int]] = []  # unpadded, not yet final
        self._left: int | None = None  # padded start of _closed[0] when a previous segment set it

    def feed(self, probs: np.ndarray) -> list[tuple[int, int]]:
        for p in probs.tolist():
            position = self._position
            self._position += self.frame_samples
            if p >= self.threshold:
                self._silence_from = 0
                if self._start is None:
                    self._start = position
            elif self._start is not None and p < self.off_threshold:
                if not self._silence_from:
                    self._silence_from = position
                if position - self._silence_from >= self.min_silence:
                    if self._silence_from - self._start > self.min_speech:
                        self._closed.append((self._start, self._silence_from))
                    self._start, self._silence_from = None, 0
        return self._release(total=None)

    @property
    def open_start(self) -> int | None:
        """Where the speech being heard began (no segment closed it yet), if any is."""
        return self._start

    @property
    def speaking(self) -> bool:
        """Speech long enough to be kept is being heard (it will be a segment)."""
        return self._kept_start() is not None

    @property
    def settled(self) -> bool:
        """No speech is being heard and every segment heard is released: those are final whatever
        follows, and a recording that ends with no more speech has these very segments."""
        return self._start is None and not self._closed

    def closing(self) -> tuple[int, int] | None:
        """The span `feed` will return next should the silence heard now go on: the speech being
        heard's, once `min_silence_ms` of silence ends it, and then the same span until it is released
        (after its padding, where no speech follows within it); None while speech goes on. A live
        stream starts decoding it before the close."""
        if self._closed:
            if len(self._closed) > 1 or self._start is not None:
                return None  # speech came back within the padding: the span's end is not known yet
            start, end = self._closed[0]
        elif self._start is None or not self._silence_from or self._silence_from - self._start <= self.min_speech:
            return None
        else:
            start, end = self._start, self._silence_from
        return self._left_edge(start), end + self.pad

    def finish(self, total_samples: int) -> list[tuple[int, int]]:
        if self._start is not None and total_samples - self._start > self.min_speech:
            self._closed.append((self._start, total_samples))
        self._start = None
        return self._release(total=total_samples)

    def _release(self, total: int | None) -> list[tuple[int, int]]:
        final = []
        while self._closed:
            start, end = self._closed[0]
            next_start = self._closed[1][0] if len(self._closed) > 1 else self._kept_start()
            if next_start is not None:
                gap = next_start - end
                share = gap // 2 if gap < 2 * self.pad else self.pad
            elif total is not None:
                share = min(total, end + self.pad) - end
            elif (self._start if self._start is not None else self._position) - end >= 2 * self.pad:
                share = self.pad  # whatever speech comes next starts too far away to take from this padding
            else:
                break
            final.append((self._left_edge(start), end + share))
            self._closed.pop(0)
            self._left = next_start - share if next_start is not None else None
        return final

    def _left_edge(self, start: int) -> int:
        """Where the next segment released begins: its share of the gap before it, else its padding."""
        return self._left if self._left is not None else max(0, start - self.pad)

    def needed_from(self) -> int:
        """The first sample position any segment still to come can include: what a live stream must
        keep of its audio (the rest is silence beyond the padding, dropped at once)."""
        earliest = self._position - self.frame_samples - self.pad  # speech starting at the next frame, padded
        if self._start is not None:
            earliest = min(earliest, self._start - self.pad)
        if self._closed:
            earliest = min(earliest, self._closed[0][0] - self.pad)
        if self._left is not None:
            earliest = min(earliest, self._left)
        return max(0, earliest)

    def _kept_start(self) -> int | None:
        """Start of the speech being heard once it is long enough that it will be kept."""
        if self._start is None:
            return None
        end_so_far = self._silence_from or self._position
        return self._start if end_so_far - self._start > self.min_speech else None

"""Wyoming's wake words (the `wake` domain) on one connection: `detect` names the wake words to hear
(none: all), then audio chunks (an audio-start first, or straight away as satellites stream) ->
`detection` with the name and its time in the stream (ms) as each is heard, and `not-detected` at
audio-stop where none was. The audio goes to a WakeWordDetector (kinds/wake_word.py), which hears every
connection's stream in one engine call per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wyoming.audio import AudioChunk, AudioStart
from wyoming.event import Event
from wyoming.info import Attribution, WakeModel, WakeProgram
from wyoming.wake import Detect, Detection, NotDetected

from appliance import __version__
from appliance.api.wyoming_audio import PcmIn
from appliance.errors import BadRequest
from appliance.kinds.capabilities import WakeWordDetector

MADE_BY = Attribution(
    name="microWakeWord (Kevin Ahrendt, Open Home Foundation)", url="https://github.com/kahrendt/microWakeWord"
)


def wake_programs(detectors: Sequence[WakeWordDetector]) -> list[WakeProgram]:
    """`info`'s wake programs: one per wake_word model, its wake words with their phrases and languages."""
    installed: dict[str, Any] = {"attribution": MADE_BY, "installed": True, "version": __version__}
    return [
        WakeProgram(
            name=detector.spec.name,
            description="microWakeWord's streaming models, every satellite's audio in one engine call per step",
            **installed,
            models=[
                WakeModel(
                    name=p.name, description=p.description, phrase=p.phrase, languages=list(p.languages), **installed
                )
                for p in detector.phrases.values()
            ],
        )
        for detector in detectors
    ]


class WakeListening:
    """One connection's detect: its stream on the detector, from `detect` to audio-stop."""

    def __init__(self, detectors: Sequence[WakeWordDetector], detect: Detect) -> None:
        if not detectors:
            raise BadRequest("this firmware serves no wake_word model")
        names = detect.names
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise BadRequest("detect: its names are a list of strings")
        # the model that has all the names asked for (Home Assistant asks for one)
        found = [d for d in detectors if all(n in d.phrases for n in names or ())]
        self.detector = found[0] if found else detectors[0]  # whose open() names the one it lacks
        self.stream: Any = self.detector.open(names)
        self.context, self.detected = detect.context, False
        self.pcm: PcmIn | None = None

    def start(self, start: AudioStart) -> None:
        self.pcm = PcmIn(start, "audio-start")

    async def chunk(self, chunk: AudioChunk) -> list[Event]:
        if self.pcm is None:  # a satellite streams its microphone without an audio-start
            self.pcm = PcmIn(chunk, "audio-chunk")
        found = await self.detector.hear(self.stream, self.pcm.feed_pcm16(chunk))
        self.detected |= bool(found)
        return [Detection(name=name, timestamp=ms, context=self.context).event() for name, ms in found]

    def stop(self) -> list[Event]:
        """audio-stop: `not-detected` where nothing was."""
        self.close()
        return [] if self.detected else [NotDetected(context=self.context).event()]

    def close(self) -> None:
        if self.stream is not None:
            self.detector.close(self.stream)
            self.stream = None

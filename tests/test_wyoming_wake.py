"""Wake words over Wyoming (the `wake` domain), driven by the `wyoming` package's own client against the
interpreter daemon: `info` lists the wake program; phrases spoken by the box's own English voice (Piper
joe, over Wyoming's synthesize) and by espeak-ng are heard as their wake word, at the time they are
said, and 60 other phrases are not; eight satellites streaming at once share engine calls; bad detects
get one error and the connection goes on."""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest
import soxr
from conftest import Daemon
from speech import RATE, say
from test_wyoming import speech_of, synthesize, wyoming_socket
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncUnixClient
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.tts import Synthesize, SynthesizeVoice
from wyoming.wake import Detect, Detection, NotDetected

from appliance.audio import to_pcm16

MODEL = "wake_words"
PHRASES = {"okay_nabu": "Okay Nabu", "hey_jarvis": "Hey Jarvis", "alexa": "Alexa", "hey_mycroft": "Hey Mycroft"}
LEAD_S = TAIL_S = 0.5
# What a satellite in a living room hears that is not its wake word: commands, questions, talk.
OTHER = [
    "Turn on the lights in the living room.", "What is the weather like tomorrow?", "Set a timer for ten minutes.",
    "Play some music in the kitchen.", "How long does it take to get to the station?", "Remind me to call my mother.",
    "The train leaves at three in the afternoon.", "My brother works at the hospital.", "Close the garage door.",
    "What time is it in Lisbon?", "Add milk and eggs to the shopping list.", "Is the front door locked?",
    "Turn the heating down to nineteen degrees.", "Good morning, how did you sleep?", "I will be home late tonight.",
    "Can you open the window a little?", "The children are playing in the garden.", "Dinner is ready in five minutes.",
    "Please switch off the television.", "We need to buy a new kettle.", "The meeting was moved to Thursday.",
    "Where did I leave my keys?", "It is going to rain this evening.", "Start the vacuum cleaner.",
    "Okay, let us go now.", "Hey, are you coming with us?", "A lexicon of old words.", "Hey Jack, how are you?",
    "Okay, nobody is home.", "Lock all the doors at midnight.", "Read me the news headlines.",
    "The coffee machine needs cleaning.", "Turn off the bedroom lamp.", "Call the plumber on Monday.",
    "What is on the calendar today?", "Dim the lights to half.", "The dog wants to go outside.",
    "Show me the camera at the door.", "How many days until the holidays?", "Set an alarm for seven.",
    "Make the room a bit warmer.", "Is there any post today?", "Tell me a joke.", "Pause the music.",
    "Next song, please.", "Turn up the volume.", "What did she say on the phone?", "The bus is late again.",
    "Open the blinds in the study.", "Water the plants on the balcony.",
]  # fmt: skip
OTHER_BY_JOE = OTHER[:10]


@pytest.fixture(scope="module")
def daemon(interpreter_daemon: Daemon) -> Daemon:
    return interpreter_daemon


def framed(speech: np.ndarray) -> np.ndarray:
    """Speech between LEAD_S and TAIL_S of silence, as a satellite hears it."""
    return np.concatenate([np.zeros(int(LEAD_S * RATE), np.float32), speech, np.zeros(int(TAIL_S * RATE), np.float32)])


async def joe(daemon: Daemon, text: str) -> np.ndarray:
    """The box's own English voice (Piper joe, over Wyoming) at 16 kHz."""
    samples, rate = speech_of(
        *await synthesize(daemon, Synthesize(text=text, voice=SynthesizeVoice(name="joe")).event())
    )
    return soxr.resample(samples, rate, RATE).astype(np.float32)


async def detect(
    daemon: Daemon, samples: np.ndarray, names: list[str] | None = None, start: bool = True
) -> list[Event]:
    """Everything the box answers a detect and a stream of `samples` (100 ms chunks) with, up to the
    pong of a ping sent after audio-stop."""
    async with AsyncUnixClient(wyoming_socket(daemon)) as client:
        await client.write_event(Detect(names=names).event())
        if start:
            await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())
        audio, step = to_pcm16(samples), RATE // 10 * 2
        for offset in range(0, len(audio), step):
            await client.write_event(
                AudioChunk(rate=RATE, width=2, channels=1, audio=audio[offset : offset + step]).event()
            )
        await client.write_event(AudioStop().event())
        await client.write_event(Ping(text="end").event())
        events = []
        while (event := await asyncio.wait_for(client.read_event(), 60)) is not None and not Pong.is_type(event.type):
            events.append(event)
        return events


def detected(events: list[Event]) -> list[tuple[str, int]]:
    return [(d.name, d.timestamp) for d in map(Detection.from_event, (e for e in events if Detection.is_type(e.type)))]


def engine_calls_of_several(daemon: Daemon) -> int:
    with daemon.client() as client:
        text = client.metrics()
    found = dict(re.findall(rf'appliance_batch_size_bucket\{{model="{MODEL}",[^}}]*le="([^"]+)"\}} (\d+)', text))
    return int(found["+Inf"]) - int(found["1"])


def test_info_lists_the_wake_words_with_their_phrases_languages_and_marks(daemon: Daemon) -> None:
    async def run() -> Info:
        async with AsyncUnixClient(wyoming_socket(daemon)) as client:
            await client.write_event(Describe().event())
            return Info.from_event(await asyncio.wait_for(client.read_event(), 30))

    (program,) = asyncio.run(run()).wake
    assert program.name == MODEL and program.installed
    models = {m.name: m for m in program.models}
    assert {name: m.phrase for name, m in models.items()} == PHRASES
    assert "en" in models["okay_nabu"].languages and models["alexa"].languages == ["en"]
    assert "Amazon" in models["alexa"].description and "Mycroft AI" in models["hey_mycroft"].description


def test_wake_words_by_two_voices_are_heard_and_sixty_other_phrases_are_not(daemon: Daemon) -> None:
    """Each wake word alone and before a command, by joe and by espeak-ng (en-us and en): detected at the
    time it is said. The counts go to docs/live.md; hey_jarvis is the one these voices miss."""

    lengths: dict[tuple[str, str, str], float] = {}

    async def run() -> tuple[dict[tuple[str, str, str], list[tuple[str, int]]], dict[tuple[str, str], list[Event]]]:
        said: dict[tuple[str, str, str], np.ndarray] = {}
        for name, phrase in PHRASES.items():
            for text in (f"{phrase}.", f"{phrase}, turn on the lights."):
                said[(name, "joe", text)] = await joe(daemon, text)
                for voice in ("en-us", "en"):
                    said[(name, voice, text)] = say(text, voice)
        others = {(text, "espeak-ng"): say(text, "en-us") for text in OTHER}
        others |= {(text, "joe"): await joe(daemon, text) for text in OTHER_BY_JOE}
        lengths.update({key: len(samples) / RATE for key, samples in said.items()})
        heard = {}
        for batch in range(0, len(said), 8):  # eight satellites at a time
            keys = list(said)[batch : batch + 8]
            found = await asyncio.gather(*(detect(daemon, framed(said[k])) for k in keys))
            heard |= {k: detected(events) for k, events in zip(keys, found)}
        false = {}
        for batch in range(0, len(others), 8):
            keys = list(others)[batch : batch + 8]
            found = await asyncio.gather(*(detect(daemon, framed(others[k])) for k in keys))
            false |= {k: events for k, events in zip(keys, found)}
        return heard, false

    heard, others = asyncio.run(run())
    missed = [key for key, found in heard.items() if key[0] not in {name for name, _ in found}]
    wrong = {key: found for key, found in heard.items() if {name for name, _ in found} - {key[0]}}
    accepted = {key: detected(events) for key, events in others.items() if detected(events)}
    print(f"\nwake words: {len(heard) - len(missed)} of {len(heard)} heard, missed {missed}; "
          f"{len(accepted)} of {len(others)} other phrases heard as one: {accepted}")  # fmt: skip
    assert not wrong, wrong
    # espeak-ng says a text the same way every time: none of its fifty. Piper samples its noise afresh
    # for every sentence, and alexa hears one of joe's ten ("Play some music in the kitchen.") in about
    # one rendition in four (docs/live.md): at most that one
    assert not [key for key in accepted if key[1] == "espeak-ng"], accepted
    assert len(accepted) <= 1, accepted
    # the three these voices say as the models learnt them: every time
    assert [key for key in missed if key[0] != "hey_jarvis"] == [], missed
    for (name, voice, text), found in heard.items():
        if text == f"{PHRASES[name]}.":  # the phrase alone: heard between its start and shortly after its end
            for _, ms in found:
                assert LEAD_S * 1000 <= ms <= (LEAD_S + lengths[name, voice, text] + 0.5) * 1000, (name, voice, ms)
    for key, events in others.items():  # each ended in not-detected, as Home Assistant expects
        if key not in accepted:
            assert [e.type for e in events] == ["not-detected"], (key, events)


def test_eight_satellites_at_once_share_engine_calls_and_each_hears_its_own(daemon: Daemon) -> None:
    """Eight streams: four say okay nabu after different silences, four say something else. Each
    detection comes at its own stream's time, and engine calls held several streams' audio."""
    before = engine_calls_of_several(daemon)
    wake, other = say("Okay Nabu.", "en-us"), say(OTHER[0], "en-us")
    streams = [
        np.concatenate(
            [
                np.zeros(int((0.5 + i) * RATE), np.float32),
                wake if i % 2 == 0 else other,
                np.zeros(RATE // 2, np.float32),
            ]
        )
        for i in range(8)
    ]

    async def run() -> list[list[Event]]:
        return await asyncio.gather(*(detect(daemon, s, ["okay_nabu"], start=i < 4) for i, s in enumerate(streams)))

    for i, events in enumerate(asyncio.run(run())):
        if i % 2 == 0:
            ((name, ms),) = detected(events)
            start_ms, end_ms = (0.5 + i) * 1000, (0.5 + i) * 1000 + len(wake) / RATE * 1000
            assert name == "okay_nabu" and start_ms <= ms <= end_ms + 500, (i, ms, start_ms, end_ms)
        else:
            assert [e.type for e in events] == [NotDetected().event().type], (i, events)
    assert engine_calls_of_several(daemon) > before


def test_bad_detects_get_one_error_and_the_connection_goes_on(daemon: Daemon) -> None:
    async def run() -> list[Event]:
        async with AsyncUnixClient(wyoming_socket(daemon)) as client:
            await client.write_event(Detect(names=["hey_nobody"]).event())
            await client.write_event(Event(type="detect", data={"names": "okay_nabu"}))
            await client.write_event(Detect(names=["alexa"]).event())
            await client.write_event(AudioChunk(rate=RATE, width=3, channels=1, audio=bytes(300)).event())
            await client.write_event(Ping(text="still here").event())
            return [await asyncio.wait_for(client.read_event(), 30) for _ in range(3)]  # type: ignore[misc]

    first, second, third = asyncio.run(run())
    assert first.type == "error" and "unknown wake word 'hey_nobody'" in first.data["text"], first
    assert "okay_nabu" in first.data["text"]  # it names the ones there are
    assert second.type == "error" and "names are a list" in second.data["text"], second
    assert third.type == "error" and "16-bit PCM" in third.data["text"], third


def test_satellites_that_leave_mid_stream_free_their_streams(daemon: Daemon) -> None:
    """72 satellites (past the firmware's bound of 64 streams), eight at a time, leave in the middle of
    their audio (no audio-stop): four once the box has answered a ping after their audio, four at once,
    while the box may be hearing it. The box is still up, and the next one is heard."""
    talk = to_pcm16(say(OTHER[1], "en-us"))

    async def leave(wait: bool) -> None:
        async with AsyncUnixClient(wyoming_socket(daemon)) as client:
            await client.write_event(Detect().event())
            for offset in range(0, len(talk) // 2, 640):
                await client.write_event(
                    AudioChunk(rate=RATE, width=2, channels=1, audio=talk[offset : offset + 640]).event()
                )
            if wait:
                await client.write_event(Ping().event())
                while (event := await asyncio.wait_for(client.read_event(), 60)) and not Pong.is_type(event.type):
                    assert event.type != "error", event

    async def run() -> None:
        for _ in range(9):
            await asyncio.gather(*(leave(i < 4) for i in range(8)))

    asyncio.run(run())
    deadline = time.monotonic() + 120  # their connections end once the box has read what they sent
    while (events := asyncio.run(detect(daemon, framed(say("Okay Nabu.", "en-us")))))[0].type == "error":
        assert events[0].data["code"] == "too_many_connections_from_peer" and time.monotonic() < deadline, events
        time.sleep(0.5)
    assert [name for name, _ in detected(events)] == ["okay_nabu"], events

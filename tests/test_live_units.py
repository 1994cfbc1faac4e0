"""The live protocols' cores without a daemon: the Realtime session state machine over plain events,
the WebSocket pump driven in memory by wsproto's own client side (no sockets, no sleeps), and a Wyoming
recording heard as it arrives over a VAD that hears loud frames as speech."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from wsproto.connection import Connection, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage

from appliance.api.realtime_session import Audio, Commit, TranscriptionSession
from appliance.api.realtime_settings import default_settings
from appliance.api.wyoming_audio import Recording
from appliance.api.wyoming_voice import Follower
from appliance.config import WebSocketConfig
from appliance.config.sections import SequenceConfig, ServerConfig, VadConfig
from appliance.engine.sequences import OwnedTable
from appliance.engine.stats import RequestTimes
from appliance.errors import ApiError, TooManyRequests
from appliance.kinds.base import SequenceCall
from appliance.kinds.capabilities import VoiceHeard
from appliance.kinds.heard import Heard
from appliance.kinds.live_speech import LiveTranscription
from appliance.kinds.speech_api import SAMPLE_RATE, Options, Segment
from appliance.protocol.messages import Close, SessionIO
from appliance.transport.assembler import BodyBudget
from appliance.transport.websocket import StreamIO, WebSocketPump


def session() -> TranscriptionSession:
    return TranscriptionSession(default_settings("whisper_tiny_en"), ("whisper_tiny_en",))


def test_append_resamples_24k_to_16k_and_counts_the_clock() -> None:
    s = session()
    pcm = (np.sin(np.arange(24000) / 10) * 8000).astype("<i2").tobytes()
    steps = s.receive(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
    audio = [step for step in steps if isinstance(step, Audio)]
    assert audio and 0 <= 16000 - sum(len(a.samples) for a in audio) < 500  # soxr holds its filter's delay
    assert s.heard_samples == sum(len(a.samples) for a in audio)


def test_turn_events_chain_their_items() -> None:
    s = session()
    started = s.turn_heard(16000)[0]
    assert started["audio_start_ms"] == 1000 - 300  # OpenAI's default prefix padding
    # a word goes out once two texts in a row agree on it and on all before it
    assert s.partial("I will die") == []
    assert s.partial("I would like to")[0]["delta"] == "I"
    assert s.partial("I would like to order a cup.")[0]["delta"] == " would like to"
    assert s.partial("I would like to order a cup of coffee")[0]["delta"] == " order a cup"
    assert s.partial("I would like to odor") == []  # a revision of what was sent is not taken back
    assert s.partial("I would like to order a cup of coffee and") == []
    first = s.turn_closed(32000, "hello there")
    assert [e["type"].rsplit(".", 1)[-1] for e in first] == ["speech_stopped", "committed", "completed"]
    assert first[0]["item_id"] == started["item_id"] == first[2]["item_id"]
    s.turn_heard(48000)
    second = s.turn_closed(64000, "again")
    assert second[1]["previous_item_id"] == started["item_id"]


def test_bad_events_name_their_field_and_client_event() -> None:
    s = session()
    bad = s.receive(
        json.dumps(
            {
                "type": "session.update",
                "event_id": "c1",
                "session": {"audio": {"input": {"turn_detection": {"threshold": 2}}}},
            }
        )
    )
    assert bad[0]["error"]["param"] == "session.audio.input.turn_detection.threshold"
    assert bad[0]["error"]["event_id"] == "c1"
    odd = s.receive(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x00").decode()}))
    assert odd[0]["error"]["param"] == "audio"
    assert isinstance(s.receive(json.dumps({"type": "input_audio_buffer.commit"}))[0], Commit)


class Wire:
    """The pump's stream, in memory: what it writes reaches a wsproto client."""

    def __init__(self) -> None:
        self.client = Connection(ConnectionType.CLIENT)
        self.writable = asyncio.Event()
        self.writable.set()
        self.paused = self.closed = False

    def io(self) -> StreamIO:
        return StreamIO(self.client.receive_data, self.pause, self.resume, self.close, self.writable, self.close)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True


def test_pump_echoes_pings_bounds_messages_and_pauses_reading() -> None:
    async def run() -> None:
        wire = Wire()
        got: list[object] = []

        async def echo(io: SessionIO) -> Close:
            while True:
                message = await io.receive()
                got.append(message)
                await io.send(message)

        limits = WebSocketConfig(max_message_bytes=1000, buffered_bytes=1500)
        pump = WebSocketPump(wire.io(), lambda: limits, echo)
        pump.start()
        pump.data_received(wire.client.send(TextMessage(data="hello")))
        pump.data_received(wire.client.send(Ping(b"x")))
        await asyncio.sleep(0)
        events = list(wire.client.events())
        assert any(isinstance(e, Pong) for e in events)
        assert [e.data for e in events if isinstance(e, TextMessage)] == ["hello"] and got == ["hello"]
        # two messages the session has not read yet pass buffered_bytes: reading pauses
        got.clear()
        stuck = WebSocketPump(wire.io(), lambda: limits, lambda io: asyncio.Event().wait())  # type: ignore[arg-type,return-value]
        stuck.start()
        stuck.data_received(wire.client.send(BytesMessage(data=b"a" * 900)))
        stuck.data_received(wire.client.send(BytesMessage(data=b"b" * 900)))
        assert wire.paused
        stuck.lost()
        # a message over max_message_bytes closes with 1009 before it is whole
        pump.data_received(wire.client.send(BytesMessage(data=b"z" * 600, message_finished=False)))
        pump.data_received(wire.client.send(BytesMessage(data=b"z" * 600, message_finished=False)))
        closes = [e for e in wire.client.events() if isinstance(e, CloseConnection)]
        assert closes and closes[0].code == 1009
        pump.lost()

    asyncio.run(run())


def test_a_quiet_client_is_pinged_and_closed_without_its_pong_but_not_while_the_box_holds_it_back() -> None:
    async def run() -> None:
        limits = WebSocketConfig(buffered_bytes=1500, idle_timeout_s=100.0, ping_interval_s=10.0)
        quiet, held = Wire(), Wire()
        pump = WebSocketPump(quiet.io(), lambda: limits, lambda io: asyncio.Event().wait())  # type: ignore[arg-type,return-value]
        pump.start()
        start = pump.last_heard
        pump.check_timeouts(start + 11)
        assert [e for e in quiet.client.events() if isinstance(e, Ping)]
        pump.check_timeouts(start + 22)  # no pong by the next interval
        closes = [e for e in quiet.client.events() if isinstance(e, CloseConnection)]
        assert closes and closes[0].code == 1011
        # a client whose messages wait for the session (reading paused): its pong could not be read
        stuck = WebSocketPump(held.io(), lambda: limits, lambda io: asyncio.Event().wait())  # type: ignore[arg-type,return-value]
        stuck.start()
        stuck.data_received(held.client.send(BytesMessage(data=b"a" * 900)))
        stuck.data_received(held.client.send(BytesMessage(data=b"b" * 900)))
        assert held.paused
        start = stuck.last_heard
        for later in (11, 22, 33, 99):
            stuck.check_timeouts(start + later)
        assert not [e for e in held.client.events() if isinstance(e, CloseConnection)]
        stuck.check_timeouts(start + 101)  # the idle bound still holds
        closes = [e for e in held.client.events() if isinstance(e, CloseConnection)]
        assert closes and closes[0].code == 1001
        pump.lost()
        stuck.lost()

    asyncio.run(run())


class LoudVad:
    """Speech where a 512-sample frame is loud, its sequences in a real OwnedTable; each one ended is noted."""

    frames = SimpleNamespace(frame_samples=512, sample_rate=SAMPLE_RATE)
    baked = SimpleNamespace(max_tokens_per_shard=1024)

    def __init__(self) -> None:
        self.ended: list[object] = []
        self.sequences: OwnedTable[Any] = OwnedTable(SequenceConfig, on_drop=lambda key, _: self.ended.append(key))

    async def infer_stream(
        self, samples: np.ndarray, key: object, start: bool, end: bool, client: str
    ) -> tuple[np.ndarray, None]:
        if start:
            self.sequences.open(key, 0.0, client, lambda: SimpleNamespace(in_flight=0))
        else:
            self.sequences.get(key, 0.0, client)
        return (np.abs(samples.reshape(-1, 512)).mean(axis=1) > 0.1).astype(np.float32) * 0.9, None


def heard_model(clock_step: float, vad: VadConfig = VadConfig()) -> tuple[Any, list[int]]:
    """A model whose transcription's text is the length it was given; and those lengths, one per call."""
    calls: list[int] = []

    async def transcribe(samples: np.ndarray, options: Options) -> AsyncGenerator[Segment, None]:
        calls.append(len(samples))
        yield Segment(0.0, len(samples) / SAMPLE_RATE, str(len(samples)), "en")

    ticks = itertools.count()
    model = SimpleNamespace(
        vad=LoudVad(),
        live=SimpleNamespace(config=SimpleNamespace(vad=vad)),
        clock=lambda: next(ticks) * clock_step,
        transcribe=transcribe,
    )
    return model, calls


def sound(*spans: tuple[float, float]) -> np.ndarray:
    """(seconds, level) spans end to end."""
    return np.concatenate([np.full(round(s * SAMPLE_RATE), level, np.float32) for s, level in spans])


async def heard_text(
    recording: np.ndarray, chunk_s: float, pace: float, vad: VadConfig = VadConfig()
) -> tuple[str, list[int], list[int]]:
    """The recording fed in chunks, the clock moving `pace` s for each second sent: its text at the end,
    the lengths transcribed before the end, and all of them."""
    model, calls = heard_model(chunk_s * pace, vad)
    heard = Heard(model, Options(None), "client")
    chunk = round(chunk_s * SAMPLE_RATE)
    for at in range(0, len(recording), chunk):
        await heard.feed(recording[at : at + chunk])
        for _ in range(3):
            await asyncio.sleep(0)  # the transcription ahead runs as the next chunk is awaited
    before = list(calls)
    text = " ".join([s.text async for s in heard.segments(recording)])
    ended = cast(LoudVad, model.vad).ended
    assert ended == [heard.key] and not len(model.vad.sequences)  # its VAD sequence ended, once
    return text, before, calls


SAID = ((0.3, 0.0), (1.0, 0.5), (0.8, 0.0))  # a second of speech, then silence past HEARD_SILENCE


@pytest.mark.parametrize(
    ("recording", "chunk_s", "pace", "answered_ahead"),
    [
        (sound(*SAID), 0.1, 1.0, True),  # it ended in silence: the text made ahead is its answer
        (sound(*SAID), 0.01, 1.0, True),  # the same in Home Assistant's 10 ms chunks
        (sound(*SAID, (0.5, 0.5)), 0.1, 1.0, False),  # speech after it: the whole recording's
        (sound(*SAID, *SAID), 0.1, 1.0, True),  # and silence after that: made ahead again
        # a short sound at the end, too short to be speech while heard, is speech at the end (finish())
        (sound(*SAID, (0.2, 0.5), (0.1, 0.0)), 0.1, 1.0, False),
        # speech at the very end, part of it in the last chunks the VAD had not heard yet
        (sound(*SAID, (0.27, 0.5)), 0.01, 1.0, False),
        (sound(*SAID), 0.1, 0.0, False),  # an upload (sent faster than spoken): not heard
        (sound(*SAID), 0.1, 10.0, False),  # sent slower than spoken (it stopped): no longer heard
        (sound(*SAID, (31.0, 0.0)), 0.1, 1.0, False),  # longer than a VAD shard: no longer heard
    ],
    ids=[
        "silence",
        "silence-10ms-chunks",
        "speech-after",
        "speech-after-then-silence",
        "short-sound-at-the-end",
        "speech-in-the-unheard-end",
        "upload",
        "slower-than-spoken",
        "longer-than-a-vad-shard",
    ],
)
def test_a_recording_heard_as_it_arrives_is_answered_ahead_only_where_nothing_came_after(
    recording: np.ndarray, chunk_s: float, pace: float, answered_ahead: bool
) -> None:
    text, before, calls = asyncio.run(heard_text(recording, chunk_s, pace))
    if answered_ahead:
        assert before and calls == before
        assert len(recording) > before[-1] > len(recording) - sound(SAID[-1]).size  # all the speech, some silence
        assert text == str(before[-1])
    else:
        assert calls[len(before) :] == [len(recording)] and text == str(len(recording))


def test_speech_that_starts_in_the_audio_the_vad_had_not_heard_yet_is_in_the_answer() -> None:
    """The last chunks, less than a VAD call's worth, are heard at the end as the whole recording's VAD
    pass hears them: with short speech kept (min_speech_ms 50), 60 ms there is a segment."""
    recording = sound(*SAID, (0.04, 0.0), (0.06, 0.5))
    text, before, calls = asyncio.run(heard_text(recording, 0.01, 1.0, VadConfig(min_speech_ms=50)))
    assert before and calls[len(before) :] == [len(recording)] and text == str(len(recording))


def test_a_word_heard_whole_within_one_chunk_is_transcribed_ahead_again() -> None:
    """A client that sends a second at a time: a word begins, ends and is released within one chunk
    (the VAD never hears it under way); the text made before it goes, and one made after it answers."""
    recording = sound((0.3, 0.0), (1.0, 0.5), (0.7, 0.0), (0.3, 0.5), (1.7, 0.0))
    text, before, calls = asyncio.run(heard_text(recording, 1.0, 1.0))
    assert len(before) == 2 and calls == before and before[-1] >= 3 * SAMPLE_RATE and text == str(before[-1])


def test_a_transcription_ahead_that_fails_after_the_end_gives_way_to_the_whole_recording() -> None:
    async def run() -> tuple[str, list[int]]:
        model, calls = heard_model(0.1)
        failed = asyncio.Event()

        async def transcribe(samples: np.ndarray, options: Options) -> AsyncGenerator[Segment, None]:
            calls.append(len(samples))
            if len(calls) == 1:  # the one ahead: refused once the end is asked for (a queue's timeout)
                await failed.wait()
                raise TooManyRequests("queue full")
            yield Segment(0.0, len(samples) / SAMPLE_RATE, str(len(samples)), "en")

        model.transcribe = transcribe
        heard, recording = Heard(model, Options(None), "client"), sound(*SAID)
        for at in range(0, len(recording), SAMPLE_RATE // 10):
            await heard.feed(recording[at : at + SAMPLE_RATE // 10])
            await asyncio.sleep(0)
        asyncio.get_running_loop().call_later(0.01, failed.set)
        return " ".join([s.text async for s in heard.segments(recording)]), calls

    text, calls = asyncio.run(run())
    assert len(calls) == 2 and text == str(calls[-1]) == str(len(sound(*SAID)))


def test_a_transcription_ahead_that_fails_by_our_fault_after_the_end_is_the_requests_failure_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Taken at the end and awaited, a decode ahead's own failure is the request's (its 500 logs it):
    not logged a second time as a decode that nobody awaits."""

    async def run() -> None:
        model, calls = heard_model(0.1)
        failed = asyncio.Event()

        async def transcribe(samples: np.ndarray, options: Options) -> AsyncGenerator[Segment, None]:
            calls.append(len(samples))
            await failed.wait()
            raise RuntimeError("a bug of ours")
            yield  # an async generator

        model.transcribe = transcribe
        heard, recording = Heard(model, Options(None), "client"), sound(*SAID)
        for at in range(0, len(recording), SAMPLE_RATE // 10):
            await heard.feed(recording[at : at + SAMPLE_RATE // 10])
            await asyncio.sleep(0)
        assert calls  # the decode ahead is under way
        asyncio.get_running_loop().call_later(0.01, failed.set)
        with pytest.raises(RuntimeError, match="a bug of ours"):
            [s async for s in heard.segments(recording)]
        await asyncio.sleep(0.02)  # its done callbacks have run

    with caplog.at_level("ERROR", logger="appliance"):
        asyncio.run(run())
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


def test_a_client_has_two_recordings_heard_at_once_and_others_theirs() -> None:
    """Each recording heard holds a VAD sequence: a client's third is transcribed at its end only."""

    async def run() -> list[bool]:
        model, _ = heard_model(0.1)
        recordings = [Heard(model, Options(None), client) for client in ("a", "a", "a", "b")]
        for heard in recordings:
            await heard.feed(sound((0.1, 0.0)))
        return [heard.listening for heard in recordings]

    assert asyncio.run(run()) == [True, True, False, True]


def live_streams(vad: LoudVad) -> SimpleNamespace:
    """A speech model's stand-in for its live streams: on `vad`, no check; nothing decoded where it
    hears no speech."""
    live = SimpleNamespace(config=SimpleNamespace(vad=VadConfig()))
    return SimpleNamespace(name="whisper", vad=vad, live=live, clock=lambda: 0.0, check=lambda options: None)


def silent_streams() -> LiveTranscription:
    """The live half of speech to text over LoudVad: nothing to decode in silence."""
    return LiveTranscription(cast(Any, live_streams(LoudVad())), OwnedTable(SequenceConfig, "streams"))


def test_a_silent_live_stream_keeps_no_more_audio_after_an_hour_than_after_a_second() -> None:
    """An hour of near silence in 256 ms chunks: after each, the stream keeps at most the VAD's padding,
    a frame and a chunk of audio (what a segment still to come may include), so a chunk costs the same
    at any age. The daemon's end-to-end run of this is test_speech_to_text.py's silent stream."""
    chunk = (np.random.default_rng(3).standard_normal(4096) * 1e-4).astype(np.float32)
    count = 60 * 60 * SAMPLE_RATE // len(chunk)
    bound = SAMPLE_RATE * VadConfig().speech_pad_ms // 1000 + 512 + len(chunk)

    async def run() -> list[int]:
        streams, kept = silent_streams(), []
        for i in range(count):
            call = SequenceCall(7, start=i == 0, end=False, client="c")
            out = await streams.live_chunk(chunk, call, False, Options(None), RequestTimes())
            assert not out.segments
            stream = streams.sequences.get(7, 0.0, "c")
            kept.append(sum(len(a) for a in stream.audio))
            assert kept[-1] <= bound, f"chunk {i}: {kept[-1]} samples kept"
        return kept

    kept = asyncio.run(run())
    assert max(kept[-100:]) == max(kept[:100]), (max(kept[:100]), max(kept[-100:]))


class HeldVad(LoudVad):
    """LoudVad whose first chunk is held until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def infer_stream(
        self, samples: np.ndarray, key: object, start: bool, end: bool, client: str
    ) -> tuple[np.ndarray, None]:
        if start:
            await self.release.wait()
        return await super().infer_stream(samples, key, start, end, client)


class ChunkedStreams(LiveTranscription):
    """The live half of a speech model on HeldVad, whose decodes give each span's length in samples."""

    def __init__(self) -> None:
        super().__init__(cast(Any, live_streams(HeldVad())), OwnedTable(SequenceConfig))

    async def _decode_live(
        self, stream: Any, audio: np.ndarray, base: int, span: tuple[int, int], times: Any, by_turns: bool = True
    ) -> list:
        return [Segment(span[0] / SAMPLE_RATE, span[1] / SAMPLE_RATE, str(span[1] - span[0]), "en")]


def test_a_chunk_sent_while_the_streams_last_one_is_heard_is_refused_and_no_audio_is_lost() -> None:
    """Two chunks of one live stream at once: the second is a 409 naming the sequence (served, it joined
    the audio out of turn and the first one's trim lost it); sent again after the first's answer, the
    stream holds every sample of both."""
    model = ChunkedStreams()
    speech = np.full(32 * 512, 0.5, np.float32)  # whole VAD frames, about a second

    async def run() -> tuple[int, int]:
        first = asyncio.create_task(
            model.live_chunk(speech, SequenceCall("s", True, False), False, Options("en"), RequestTimes())
        )
        await asyncio.sleep(0)  # the first chunk is in, held in its VAD
        with pytest.raises(ApiError) as refused:
            await model.live_chunk(speech, SequenceCall("s", False, False), False, Options("en"), RequestTimes())
        assert refused.value.status == 409 and "sequence s" in refused.value.message
        cast(HeldVad, model.model.vad).release.set()
        await first
        await model.live_chunk(speech, SequenceCall("s", False, False), False, Options("en"), RequestTimes())
        last = await model.live_chunk(
            np.zeros(32 * 512, np.float32), SequenceCall("s", False, True), False, Options("en"), RequestTimes()
        )
        (span, _), *_ = last.closed
        return span[0], span[1]

    start, end = asyncio.run(run())
    assert end - start >= 2 * 32 * 512, (start, end)  # both chunks' speech, in one segment


class SpeakingRecording:
    """A recording whose VAD has heard `heard` samples of speech from its start, still going on."""

    def __init__(self, heard: int) -> None:
        self.heard = heard

    def voice(self) -> VoiceHeard:
        return VoiceHeard(True, 0, 0, self.heard)


@pytest.mark.parametrize(
    ("error", "logged"), [(RuntimeError("a bug of ours"), True), (TooManyRequests("queue full"), False)]
)
def test_a_failed_decode_of_the_text_so_far_is_logged_where_it_is_ours(
    error: Exception, logged: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Wyoming's text so far is decoded behind the stream and may be dropped: a failure of ours is an
    ERROR with its traceback (it was swallowed), a refusal is the client's to see at audio-stop."""

    async def transcribe(samples: np.ndarray) -> AsyncGenerator[Segment, None]:
        raise error
        yield  # an async generator

    async def run() -> None:
        recording = Recording(10 * SAMPLE_RATE, BodyBudget(lambda: ServerConfig()))
        recording.add(np.zeros(2 * SAMPLE_RATE, np.float32))
        follower = Follower(SpeakingRecording(2 * SAMPLE_RATE), recording, transcribe)
        follower.heard_more(None)
        assert follower.partial is not None  # started behind the stream
        await asyncio.wait([follower.partial])

    with caplog.at_level("ERROR", logger="appliance"):
        asyncio.run(run())
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [(r.getMessage(), r.exc_info is not None) for r in errors] == (
        [("a decode run beside its stream (wyoming-partial) failed", True)] if logged else []
    )

"""Wyoming's events read from bytes (appliance/api/wyoming_codec.py), sans I/O: the bytes fed as a
connection might cut them, the deadlines on a clock the test holds (no real time enters a verdict), the
bounds before anything is read into memory; the time the box takes to answer is not the client's; a
field the wyoming package would drop is named. Its pump, and the writes' deadline, on real asyncio
streams at the end; the same
bounds are attacked end to end on a real daemon in test_wyoming.py."""

from __future__ import annotations

import asyncio
import io
import json
import socket

import pytest
from wyoming.audio import AudioChunk
from wyoming.event import Event
from wyoming.event import write_event as write_sync
from wyoming.info import Describe
from wyoming.tts import Synthesize

from appliance.api.wyoming_codec import MAX_HEADER_BYTES, Bounds, EventReader, WyomingError
from appliance.api.wyoming_events import Nudge, WriteTimeout, answered, read_as, read_event, write_event
from appliance.errors import BadRequest

BOUNDS = Bounds(max_payload=4096, max_samples=16000, idle_s=4.0, header_s=2.0, quiet_s=1.0, write_s=5.0)


def encoded(*events: Event) -> bytes:
    """Events as the wyoming library writes them (a chunk's data goes in its own part: data_length)."""
    out = io.BytesIO()
    for event in events:
        write_sync(event, out)
    return out.getvalue()


def chunk(payload: bytes) -> Event:
    return AudioChunk(rate=16000, width=2, channels=1, audio=payload).event()


def events_of(reader: EventReader, now: float = 0.0) -> list[Event]:
    found = []
    while (event := reader.next_event(now)) is not None:
        found.append(event)
    return found


def test_events_cut_anywhere_come_out_whole_and_in_order() -> None:
    """Byte by byte, or three events in one read: the same events, data merged from its part."""
    sent = [Describe().event(), chunk(bytes(range(200)) * 3), Event("ping", {"text": "é"})]
    wire = encoded(*sent)
    assert b'"data_length"' in wire  # the library's data part is read, not only the header's data
    reader = EventReader(BOUNDS, 0.0)
    got: list[Event] = []
    for byte in wire:
        reader.feed(bytes([byte]), 0.0)
        got += events_of(reader)
    whole = EventReader(BOUNDS, 0.0)
    whole.feed(wire, 0.0)
    for received in (got, events_of(whole)):
        assert [(e.type, e.data, e.payload) for e in received] == [(e.type, e.data, e.payload) for e in sent]
    reader.feed(b"", 0.0)
    assert reader.next_event(0.0) is None and reader.finished


@pytest.mark.parametrize(
    "wire, message",
    [
        (b'{"type": "ping"', "the connection ended inside an event header"),
        (b'{"type": "audio-chunk", "payload_length": 10}\n' + bytes(4), "the connection ended inside an event"),
    ],
)
def test_a_stream_ending_inside_an_event_is_an_error(wire: bytes, message: str) -> None:
    reader = EventReader(BOUNDS, 0.0)
    reader.feed(wire, 0.0)
    assert reader.next_event(0.0) is None and not reader.finished
    reader.feed(b"", 0.0)
    with pytest.raises(WyomingError, match=message):
        reader.next_event(0.0)


@pytest.mark.parametrize(
    "header, message, code",
    [
        (b"this is not json\n", "an event header is not JSON", "protocol"),
        (b'["ping"]\n', "a JSON object with a string 'type'", "protocol"),
        (b'{"type": 5}\n', "a JSON object with a string 'type'", "protocol"),
        (b'{"type": "ping", "data": [1]}\n', "data must be an object", "payload_too_large"),
        (b'{"type": "audio-chunk", "payload_length": 4097}\n', "integers of at most 4096", "payload_too_large"),
        (b'{"type": "ping", "data_length": -1}\n', "integers of at most 4096", "payload_too_large"),
        (b'{"type": "ping", "data_length": 3}\n[1]', "an event's data is a JSON object", "protocol"),
        (b'{"type": "ping", "data_length": 3}\n{x}', "an event's data is not JSON", "protocol"),
    ],
)
def test_a_broken_event_names_what_is_wrong(header: bytes, message: str, code: str) -> None:
    reader = EventReader(BOUNDS, 0.0)
    reader.feed(header, 0.0)
    with pytest.raises(WyomingError, match=message) as raised:
        reader.next_event(0.0)
    assert raised.value.code == code


def test_nothing_past_a_bound_is_asked_for_and_a_long_header_line_is_refused_before_its_end() -> None:
    """The pump reads what `wanted` says: never more than a header line's bound before its newline, nor
    past the payload the header announced."""
    reader = EventReader(BOUNDS, 0.0)
    assert reader.wanted() == MAX_HEADER_BYTES + 1
    reader.feed(b"x" * 1000, 0.0)
    assert reader.next_event(0.0) is None and reader.wanted() == MAX_HEADER_BYTES + 1 - 1000
    reader.feed(b"x" * reader.wanted(), 0.0)  # no newline yet: the line is already past the bound
    with pytest.raises(WyomingError, match=f"over {MAX_HEADER_BYTES} bytes") as raised:
        reader.next_event(0.0)
    assert raised.value.limit == "header_too_large"
    reader = EventReader(BOUNDS, 0.0)
    reader.feed(b'{"type": "audio-chunk", "payload_length": 4000}\n' + bytes(1000), 0.0)
    assert reader.next_event(0.0) is None and reader.wanted() == 3000


def expires(reader: EventReader) -> tuple[float, str]:
    due, error = reader.due()
    return due, error.limit


def test_each_part_of_an_event_has_its_deadline_on_the_clock() -> None:
    """The first event is begun within header_s, later ones within idle_s of the last; a header line is
    whole within header_s of its first byte however it trickles; a payload may go quiet for quiet_s, each
    byte starting that again."""
    reader = EventReader(BOUNDS, 100.0)
    assert expires(reader) == (102.0, "idle_timeout")  # a new connection's first event: header_s
    reader.feed(b'{"type": ', 101.5)
    assert expires(reader) == (103.5, "header_timeout")
    reader.feed(b'"audio-chunk", ', 103.0)  # a trickle does not move the header's deadline
    assert expires(reader) == (103.5, "header_timeout")
    reader.feed(b'"payload_length": 4}\n', 103.4)
    assert reader.next_event(103.4) is None
    assert expires(reader) == (104.4, "payload_timeout")  # the body: quiet_s from the header's end
    reader.feed(b"\0", 104.3)
    assert expires(reader) == (105.3, "payload_timeout")  # each byte of it starts the quiet time again
    reader.feed(b"\0\0\0", 105.0)
    assert reader.next_event(105.0) is not None
    reader.resume(180.0)  # the box answered it for 75 s: that time is not the client's
    assert expires(reader) == (184.0, "idle_timeout")  # the next event: idle_s from reading again
    reader.feed(b'{"type": "ping"}\n{"ty', 181.0)
    assert reader.next_event(181.0) is not None
    reader.resume(190.0)
    assert expires(reader) == (192.0, "header_timeout")  # the next one begun in the same read: its header
    _, error = reader.due()
    assert str(error) == "an event header not complete within 2 s"
    reader.feed(b'pe": "audio-chunk", "payload_length": 2}\n\0', 191.0)
    assert reader.next_event(191.0) is None
    reader.resume(500.0)  # a read begun again inside an event (after a cancel): its quiet time runs on
    assert expires(reader) == (192.0, "payload_timeout")


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_pump_gives_events_as_they_come_and_a_cancel_loses_nothing() -> None:
    """read_event on a real stream: an event whose header came before a cancel is whole after it."""

    async def run() -> None:
        stream = asyncio.StreamReader()
        clock = Clock(0.0)
        events = EventReader(BOUNDS, clock())
        wire = encoded(chunk(bytes(8)), Event("ping"))
        stream.feed_data(wire[:10])
        reading = asyncio.ensure_future(read_event(stream, events, clock))
        await asyncio.sleep(0)
        assert not reading.done()
        reading.cancel()
        await asyncio.wait([reading])
        stream.feed_data(wire[10:])
        stream.feed_eof()
        first = await read_event(stream, events, clock)
        assert first is not None and first.type == "audio-chunk" and first.payload == bytes(8)
        second = await read_event(stream, events, clock)
        assert second is not None and second.type == "ping"
        assert await read_event(stream, events, clock) is None

    asyncio.run(run())


def test_the_time_the_box_takes_to_answer_an_event_is_not_counted_against_the_client() -> None:
    """An answer that takes longer than the idle bound (a long synthesis, a long recording's text): the
    next event's deadline runs from when the pump reads again, so the client is not closed as idle."""

    async def run() -> None:
        stream = asyncio.StreamReader()
        clock = Clock(0.0)
        events = EventReader(BOUNDS, clock())
        stream.feed_data(encoded(Event("ping")))
        assert (await read_event(stream, events, clock)) is not None
        clock.now = 100.0  # the answer took 100 s, past idle_s (4)
        reading = asyncio.ensure_future(read_event(stream, events, clock))
        await asyncio.sleep(0.05)
        assert not reading.done()  # not "no event for 4 s" at once
        stream.feed_data(encoded(Event("ping")))
        assert (await reading) is not None

    asyncio.run(run())


class NoSocket:
    """The writer of an in-memory stream: no socket to ask whether the client only half-closed, so its
    end is its leaving (as on TCP)."""

    def get_extra_info(self, name: str) -> None:
        return None


def test_what_a_client_sends_while_the_box_answers_is_read_ahead_within_a_bound_and_kept() -> None:
    """While an answer is made, the connection is watched for its end: what the client pipelines meanwhile
    is read ahead (up to the next header line's bound; the rest stays in the stream), and every event of
    it comes whole after the answer."""

    pipelined = encoded(*[Event("ping", {"text": "x" * 1000}) for _ in range(200)])  # 200 KiB

    async def run() -> tuple[int, int, list[str]]:
        stream = asyncio.StreamReader(limit=1 << 22)
        clock, release = Clock(0.0), asyncio.Event()
        events = EventReader(BOUNDS, clock())
        stream.feed_data(encoded(Event("ping")) + pipelined)
        stream.feed_eof()
        assert await read_event(stream, events, clock) is not None

        async def handling() -> list[Event]:
            await release.wait()
            return [Event("pong")]

        answering = asyncio.ensure_future(answered(handling(), stream, NoSocket(), events, clock, Nudge()))  # type: ignore[arg-type]
        for _ in range(20):
            await asyncio.sleep(0)
        room, left_in_stream = events.room_ahead(), len(stream._buffer)  # type: ignore[attr-defined]
        release.set()
        assert [e.type for e in await answering] == ["pong"]
        later = []
        while (event := await read_event(stream, events, clock)) is not None:
            later.append(event.type)
        return room, left_in_stream, later

    room, left_in_stream, later = asyncio.run(run())
    assert room == 0 and left_in_stream == len(pipelined) - (MAX_HEADER_BYTES + 1)  # the codec holds the bound
    assert later == ["ping"] * 200


def test_a_client_that_leaves_while_the_box_answers_cancels_the_answer() -> None:
    """A synthesis sends nothing before its first sentence is spoken: the client's end, seen while it is
    made, cancels it (the connection's end raised), rather than the box speaking to no one."""

    async def run() -> list[str]:
        stream, clock, steps = asyncio.StreamReader(), Clock(0.0), []
        events = EventReader(BOUNDS, clock())

        async def handling() -> list[Event]:
            steps.append("answering")
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                steps.append("cancelled")
                raise
            return []

        answering = asyncio.ensure_future(answered(handling(), stream, NoSocket(), events, clock, Nudge()))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        stream.feed_eof()
        with pytest.raises(ConnectionResetError, match="the client left"):
            await answering
        return steps

    assert asyncio.run(run()) == ["answering", "cancelled"]


def test_the_pump_ends_a_part_when_the_clock_passes_its_deadline_not_the_loops_time() -> None:
    """The loop's time only wakes the pump (quiet_s here is 50 ms of it); the clock says whether the part
    has expired: a payload waited for past the loop's 50 ms, its clock not moved, is still read whole;
    with the clock moved past quiet_s, the pump's read ends with the part's error."""
    quick = Bounds(max_payload=4096, max_samples=16000, idle_s=4.0, header_s=2.0, quiet_s=0.05, write_s=5.0)

    async def run() -> None:
        stream = asyncio.StreamReader()
        clock = Clock(0.0)
        events = EventReader(quick, clock())
        stream.feed_data(json.dumps({"type": "audio-chunk", "payload_length": 4}).encode() + b"\n\0")
        reading = asyncio.ensure_future(read_event(stream, events, clock))
        await asyncio.sleep(0.3)  # six of the loop's quiet times, none of the clock's
        assert not reading.done()
        stream.feed_data(bytes(3))
        assert (await reading).payload == bytes(4)  # type: ignore[union-attr]
        stream.feed_data(json.dumps({"type": "audio-chunk", "payload_length": 4}).encode() + b"\n\0")
        reading = asyncio.ensure_future(read_event(stream, events, clock))
        await asyncio.sleep(0)
        clock.now = 0.06
        with pytest.raises(WyomingError, match="payload stalled for 0.05 s"):
            await reading

    asyncio.run(run())


def test_a_write_the_client_takes_nothing_of_ends_when_the_clock_passes_its_deadline() -> None:
    """write_event's deadline on the clock (50 ms of the loop's time only wake it): a client that takes
    nothing is waited for while the clock stays; one that takes some of it starts the deadline again;
    past it, with nothing taken, a WriteTimeout."""

    async def run() -> None:
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        _, writer = await asyncio.open_connection(sock=ours)
        clock = Clock(0.0)
        big = Event("audio-chunk", {"rate": 16000, "width": 2, "channels": 1}, payload=bytes(8 << 20))
        writing = asyncio.ensure_future(write_event(big, writer, 0.05, clock))
        await asyncio.sleep(0.3)  # six of the loop's write timeouts, none of the clock's
        assert not writing.done()
        clock.now = 0.04
        taken = theirs.recv(1 << 20)  # the client takes some: the deadline runs from the next look
        assert taken
        await asyncio.sleep(0.2)
        clock.now = 0.08  # past 50 ms from the write, not from what was taken
        await asyncio.sleep(0.2)
        assert not writing.done()
        clock.now = 0.2
        with pytest.raises(WriteTimeout, match="it took nothing the box sent for 0.05 s"):
            await writing
        writer.transport.abort()
        theirs.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("voice", "error"),
    [
        ({"name": "pf_dora"}, None),
        ("", None),  # no voice, as the wyoming package reads it (clients send it for their default)
        ("pf_dora", "bad synthesize event: its 'voice' is \"pf_dora\", not an object"),
        (["pf_dora"], "bad synthesize event: its 'voice' is [\"pf_dora\"], not an object"),
    ],
)
def test_a_voice_that_is_not_an_object_is_named_not_dropped(voice: object, error: str | None) -> None:
    """The package reads {"voice": "pf_dora"} as no voice at all: the box's first voice spoke the text."""
    event = Event("synthesize", {"text": "Bom dia.", "voice": voice})
    if error is None:
        assert read_as(Synthesize.from_event, event).text == "Bom dia."
    else:
        with pytest.raises(BadRequest) as raised:
            read_as(Synthesize.from_event, event)
        assert raised.value.message == error

"""HTTP/3 header sections bounded before and while they are decoded (RFC 9114 section 4.2.2).

aioquic's H3Connection buffers a HEADERS frame whole however long it says it is, has pylsqpack
expand it whatever it decodes to, then validates every field at Python speed; so one peer could
make a worker copy megabytes quadratically, or expand a few kilobytes that reference one 4 KB
dynamic-table entry thousands of times (a QPACK bomb) into 100 MB, before any limit of ours ran.

BoundedH3Connection advertises SETTINGS_MAX_FIELD_SECTION_SIZE and holds every request stream to it:
- a HEADERS frame longer than the limit is refused when its frame header arrives, not buffered;
- a section with more field lines than the limit allows is refused before it is decoded: in RFC
  9114's size each field line counts at least 32 bytes, so the count is limit // 32 at most, and
  what the decoder can expand is that many dynamic-table entries, a few megabytes at worst;
- a decoded section over the limit is refused before aioquic validates it.
A refused stream is answered 431 by the transport (a HeadersRefused event) and asked to stop sending
(STOP_SENDING with H3_NO_ERROR, RFC 9114 section 4.1.1); what else arrives on it is dropped. A peer
refused MAX_REFUSALS times has its connection closed with H3_EXCESSIVE_LOAD, as is one whose control
stream announces a SETTINGS or MAX_PUSH_ID frame longer than the limit (aioquic waits for such a frame
whole). No stream may block on the dynamic table (QPACK_BLOCKED_STREAMS 0): no partly decoded section
waits in the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

from aioquic.h3.connection import ErrorCode, FrameType, H3Connection, H3Stream, ProtocolError, Setting, StreamType
from aioquic.h3.events import H3Event, Headers
from aioquic.quic.connection import QuicConnection

FIELD_LINE_OVERHEAD = 32  # bytes each field line adds to a section's size (RFC 9114 section 4.2.2)
MAX_REFUSALS = 8  # refused header sections on one connection before it is closed


@dataclass
class HeadersRefused(H3Event):
    """A request stream's header section broke the limit; `reason` says how. Answer it 431."""

    stream_id: int
    reason: str


class ExcessiveLoad(ProtocolError):
    error_code = ErrorCode.H3_EXCESSIVE_LOAD


class _Refused(Exception):
    def __init__(self, reason: str, decoded: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.decoded = reason, decoded  # decoded: the decoder has acknowledged the section


def _prefixed_int(block: bytes, at: int, bits: int) -> tuple[int, int]:
    """The QPACK/HPACK prefix integer (RFC 7541 section 5.1) whose first byte is block[at], and where
    it ends; an integer cut short reads as one past the block's end."""
    mask = (1 << bits) - 1
    value, at = block[at] & mask, at + 1
    if value < mask:
        return value, at
    shift = 0
    while at < len(block):
        byte, at = block[at], at + 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80 or shift > 62:
            return value, at
    return value, len(block) + 1


def _skip_string(block: bytes, at: int, bits: int) -> int:
    """Past a length-prefixed string literal whose length has a `bits`-bit prefix at block[at]."""
    if at >= len(block):
        return len(block) + 1
    length, at = _prefixed_int(block, at, bits)
    return at + length


def field_lines(block: bytes, most: int) -> int:
    """How many field lines an encoded field section holds (RFC 9204 section 4.5), counting no further
    than `most` + 1: only the representations' prefixes are read, nothing is expanded. A malformed
    section is counted as far as it goes (the decoder then refuses it)."""
    if len(block) < 2:
        return 0
    _, at = _prefixed_int(block, 0, 8)  # Required Insert Count
    if at >= len(block):
        return 0
    _, at = _prefixed_int(block, at, 7)  # sign and Delta Base
    count = 0
    while at < len(block) and count <= most:
        first = block[at]
        count += 1
        if first & 0x80:  # indexed field line
            _, at = _prefixed_int(block, at, 6)
        elif first & 0x40:  # literal with name reference, then the value
            _, at = _prefixed_int(block, at, 4)
            at = _skip_string(block, at, 7)
        elif first & 0x20:  # literal with literal name, then the value
            at = _skip_string(block, at, 3)
            at = _skip_string(block, at, 7)
        elif first & 0x10:  # indexed field line with post-base index
            _, at = _prefixed_int(block, at, 4)
        else:  # literal with post-base name reference, then the value
            _, at = _prefixed_int(block, at, 3)
            at = _skip_string(block, at, 7)
    return count


def section_size(headers: Headers) -> int:
    return sum(len(name) + len(value) + FIELD_LINE_OVERHEAD for name, value in headers)


class BoundedH3Connection(H3Connection):
    """aioquic's H3Connection with header sections bounded (see the module's docstring); the server's."""

    def __init__(self, quic: QuicConnection, max_field_section_size: int) -> None:
        self.max_field_section_size = max_field_section_size
        self.refusals = 0
        self._refused: set[int] = set()  # request streams whose remaining data is dropped
        super().__init__(quic)  # which sends the SETTINGS: see _get_local_settings
        self._blocked_streams = 0
        self._decoder = type(self._decoder)(self._max_table_capacity, self._blocked_streams)

    def _get_local_settings(self) -> dict[int, int]:
        settings = super()._get_local_settings()
        settings[Setting.MAX_FIELD_SECTION_SIZE] = self.max_field_section_size
        settings[Setting.QPACK_BLOCKED_STREAMS] = 0
        return settings

    def _receive_request_or_push_data(self, stream: H3Stream, data: bytes, stream_ended: bool) -> list[H3Event]:
        if stream.stream_id in self._refused:
            stream.receiving_ended = stream.sending_ended = True  # forgotten once this call returns
            return []
        try:
            events = super()._receive_request_or_push_data(stream, data, stream_ended)
        except _Refused as refused:
            return [self._refuse(stream, refused.reason, refused.decoded)]
        if stream.frame_type == FrameType.HEADERS and stream.frame_size is not None:
            pending = max(stream.frame_size, len(stream.buffer))  # a frame still arriving
            if pending > self.max_field_section_size:
                events.append(self._refuse(stream, f"HEADERS frame of {pending} bytes"))
        return events

    def _receive_stream_data_uni(self, stream: H3Stream, data: bytes, stream_ended: bool) -> list[H3Event]:
        events = super()._receive_stream_data_uni(stream, data, stream_ended)
        waiting = stream.frame_size if stream.frame_type in (FrameType.SETTINGS, FrameType.MAX_PUSH_ID) else None
        if stream.stream_type == StreamType.CONTROL and (waiting or 0) > self.max_field_section_size:
            raise ExcessiveLoad(f"a control frame of {waiting} bytes")  # aioquic would buffer it whole
        return events

    def _handle_request_or_push_frame(
        self, frame_type: int, frame_data: bytes | None, stream: H3Stream, stream_ended: bool
    ) -> list[H3Event]:
        if frame_type == FrameType.HEADERS and frame_data is not None and len(frame_data) > self.max_field_section_size:
            raise _Refused(f"HEADERS frame of {len(frame_data)} bytes")
        return super()._handle_request_or_push_frame(frame_type, frame_data, stream, stream_ended)

    def _decode_headers(self, stream_id: int, frame_data: bytes | None) -> Headers:
        most = self.max_field_section_size // FIELD_LINE_OVERHEAD
        if frame_data is not None and (lines := field_lines(frame_data, most)) > most:
            raise _Refused(f"header section of more than {lines - 1} field lines")
        headers = super()._decode_headers(stream_id, frame_data)
        if (size := section_size(headers)) > self.max_field_section_size:
            raise _Refused(f"header section of {size} bytes decoded", decoded=True)
        return headers

    def _refuse(self, stream: H3Stream, reason: str, decoded: bool = False) -> HeadersRefused:
        """Stop reading the stream, tell the encoder a section it will never see acknowledged is
        abandoned (RFC 9204 section 4.4.2), and close the connection of a peer that keeps doing it."""
        self.refusals += 1
        if self.refusals > MAX_REFUSALS:
            raise ExcessiveLoad(f"{self.refusals} header sections over the limit")
        self._refused.add(stream.stream_id)
        stream.buffer, stream.frame_size, stream.frame_type = b"", None, None
        stream.receiving_ended = True
        if not decoded and self._local_decoder_stream_id is not None:
            self._quic.send_stream_data(self._local_decoder_stream_id, self._decoder.cancel_stream(stream.stream_id))
        if not stream_ended_by_peer(self._quic, stream.stream_id):
            self._quic.stop_stream(stream.stream_id, ErrorCode.H3_NO_ERROR)
        return HeadersRefused(
            stream_id=stream.stream_id,
            reason=f"{reason}: the limit (SETTINGS_MAX_FIELD_SECTION_SIZE) is {self.max_field_section_size} bytes",
        )


def stream_ended_by_peer(quic: QuicConnection, stream_id: int) -> bool:
    stream = quic._streams.get(stream_id)
    return stream is None or stream.receiver.is_finished

"""The sending half of an HTTP/3 connection: answers written to their streams, a streamed one held to
what the peer takes (protocol/flow.py's SendWindow over what aioquic holds unacknowledged), and the
write deadline's view of what the peer has taken."""

from __future__ import annotations

import logging
from collections.abc import Callable

from aioquic.quic.connection import QuicConnection

from appliance.protocol.flow import SendWindow
from appliance.protocol.messages import Response
from appliance.transport.h3_bounds import BoundedH3Connection

log = logging.getLogger("appliance.h3")


class StreamAnswers:
    """One connection's answers (h3.H3Protocol's): `http()` once the handshake chose HTTP/3, `transmit()`
    sends what is due (the protocol's, which calls `transmitted` after), `ended()` once the connection is over."""

    def __init__(
        self,
        quic: QuicConnection,
        http: Callable[[], BoundedH3Connection | None],
        transmit: Callable[[], None],
        ended: Callable[[], bool],
        now: float,
    ) -> None:
        self._quic, self._http, self._transmit, self._ended = quic, http, transmit, ended
        self.windows: dict[int, SendWindow] = {}  # streams whose answer waits for the peer to take some
        # at the last check: each stream with bytes held, where its held bytes begin; since when unchanged
        self._write_seen: dict[int, int] = {}
        self._write_since = now

    def unacknowledged(self, stream_id: int) -> int:
        """Bytes of this stream aioquic holds for the peer: sent and not acknowledged, or not sent yet."""
        stream = self._quic._streams.get(stream_id)
        if stream is None:
            return 0
        return stream.sender._buffer_stop - stream.sender._buffer_start

    def _held(self) -> dict[int, int]:
        """The answers aioquic holds for the peer, by request stream (client-initiated, bidirectional:
        the server's control and QPACK streams never end), where each one's unacknowledged bytes begin:
        some not acknowledged or not sent yet, or only its end (FIN). A reset answer holds nothing."""
        held = {}
        for stream_id, stream in self._quic._streams.items():
            sender = stream.sender
            if stream_id % 4 or sender._reset_error_code is not None:
                continue
            if sender._buffer_stop > sender._buffer_start or (sender._buffer_fin is not None and not sender._acked_fin):
                held[stream_id] = sender._buffer_start
        return held

    def write_overdue(self, now: float, timeout_s: float) -> bool:
        """Whether the peer has taken nothing of the answers held for it for `timeout_s`: none of their
        bytes acknowledged, nor sent where the peer gives no flow-control credit. Any byte taken (or a
        new answer) starts the deadline again, as HTTP/1.1's WriteProgress does."""
        held = self._held()
        if held != self._write_seen:
            self._write_seen, self._write_since = held, now
        return bool(held) and now - self._write_since > timeout_s

    @property
    def delivering(self) -> bool:
        """Whether the live peer has yet to acknowledge some answer: a drain waits for it."""
        return not self._ended() and bool(self._held())

    def transmitted(self) -> None:
        """Each answer that waits for its peer learns what the peer took meanwhile (acknowledgements and
        MAX_STREAM_DATA arrive before aioquic's protocol transmits)."""
        for stream_id, window in self.windows.items():
            window.hold(0 if self._ended() else self.unacknowledged(stream_id))

    def respond(self, stream_id: int, response: Response, head_only: bool = False) -> bool:
        """Send the headers, and the body unless it is streamed or `head_only` (a HEAD's answer); False
        if the stream is gone."""
        if (http := self._http()) is None:
            return False
        headers = [(b":status", str(response.status).encode()), (b"content-type", response.content_type.encode())]
        # a HEAD's head states no length here (RFC 9110 8.6 allows): aioquic's client (1.7) checks it
        # against the DATA received, as if for a GET, and fails the answer
        if response.stream is None and not head_only:
            headers.append((b"content-length", str(len(response.body)).encode()))
        headers += [(k.lower().encode(), v.encode()) for k, v in response.headers]
        try:
            http.send_headers(stream_id, headers)
        except Exception as exc:  # the stream or connection went away meanwhile
            log.debug("stream %d: response dropped: %s", stream_id, exc)
            return False
        body = b"" if head_only else response.body
        return response.stream is not None or self.send_data(stream_id, body, end_stream=True)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool) -> bool:
        http = self._http()
        assert http is not None
        try:
            http.send_data(stream_id, data, end_stream=end_stream)
        except Exception as exc:
            log.debug("stream %d: response dropped: %s", stream_id, exc)
            return False
        finally:
            self._transmit()
        return True

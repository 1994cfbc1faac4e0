"""The sending half of an HTTP/3 connection: answers written to their streams, a streamed one held to
what the peer takes (protocol/flow.py's SendWindow over what aioquic holds unacknowledged)."""

from __future__ import annotations

import logging

from aioquic.asyncio import QuicConnectionProtocol

from appliance.protocol.flow import SendWindow
from appliance.protocol.messages import Response
from appliance.transport.h3_bounds import BoundedH3Connection

log = logging.getLogger("appliance.h3")


class AnsweringProtocol(QuicConnectionProtocol):
    _http: BoundedH3Connection | None  # once the handshake chose HTTP/3
    _windows: dict[int, SendWindow]  # streams whose answer waits for the peer to take some
    _terminated: bool

    def _unacknowledged(self, stream_id: int) -> int:
        """Bytes of this stream aioquic holds for the peer: sent and not acknowledged, or not sent yet."""
        stream = self._quic._streams.get(stream_id)
        if stream is None:
            return 0
        return stream.sender._buffer_stop - stream.sender._buffer_start

    def transmit(self) -> None:
        """Send what is due; each answer that waits for its peer learns what the peer took meanwhile
        (acknowledgements and MAX_STREAM_DATA arrive before aioquic's protocol calls this)."""
        super().transmit()
        for stream_id, window in self._windows.items():
            window.hold(0 if self._terminated else self._unacknowledged(stream_id))

    def _respond(self, stream_id: int, response: Response) -> bool:
        """Send the headers, and the body unless it is streamed; False if the stream is gone."""
        if self._http is None:
            return False
        headers = [(b":status", str(response.status).encode()), (b"content-type", response.content_type.encode())]
        if response.stream is None:
            headers.append((b"content-length", str(len(response.body)).encode()))
        headers += [(k.lower().encode(), v.encode()) for k, v in response.headers]
        try:
            self._http.send_headers(stream_id, headers)
        except Exception as exc:  # the stream or connection went away meanwhile
            log.debug("stream %d: response dropped: %s", stream_id, exc)
            return False
        return response.stream is not None or self._send_data(stream_id, response.body, end_stream=True)

    def _send_data(self, stream_id: int, data: bytes, end_stream: bool) -> bool:
        assert self._http is not None
        try:
            self._http.send_data(stream_id, data, end_stream=end_stream)
        except Exception as exc:
            log.debug("stream %d: response dropped: %s", stream_id, exc)
            return False
        finally:
            self.transmit()
        return True

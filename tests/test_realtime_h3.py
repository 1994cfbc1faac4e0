"""OpenAI's Realtime API over HTTP/3: a WebSocket opened by RFC 9220's extended CONNECT (`:protocol
websocket`) on one QUIC stream, driven by a client made of aioquic's own H3Connection and wsproto's
client framing. Real espeak-ng speech is transcribed and checked against the known sentence; a bad
event is an error event and the session goes on; the close handshake ends the stream. Both with the
transports in the engine process (workers = 1) and in a protocol worker (workers = 2)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent
from conftest import Daemon, Keys
from speech import RATE, recording
from test_realtime import TINY, TURN_DETECTION, pcm
from test_speech_to_text import CLEAR, wer
from wsproto.connection import Connection, ConnectionType
from wsproto.events import CloseConnection, TextMessage


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def daemon(request, tmp_path_factory: pytest.TempPathFactory, keys: Keys, voice_bundle: Path, tls) -> Iterator[Daemon]:
    extra = "[websocket]\nmax_message_bytes = 262144\n"
    d = Daemon(
        tmp_path_factory.mktemp("daemon"), voice_bundle, keys.trusted, tls=tls, extra=extra, workers=request.param
    )
    d.wait_ready(180)
    yield d
    assert d.stop() == 0, d.log.read_text()


class H3Client(QuicConnectionProtocol):
    """An HTTP/3 connection whose streams' headers and data are queued by stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.arrived: dict[int, asyncio.Queue] = {}

    def queue(self, stream_id: int) -> asyncio.Queue:
        return self.arrived.setdefault(stream_id, asyncio.Queue())

    def quic_event_received(self, event: QuicEvent) -> None:
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived | DataReceived):
                self.queue(h3_event.stream_id).put_nowait(h3_event)


class WebSocketOverH3:
    """wsproto's client framing on one extended-CONNECT stream."""

    def __init__(self, client: H3Client, stream_id: int) -> None:
        self.client, self.stream_id, self.ws = client, stream_id, Connection(ConnectionType.CLIENT)
        self.events: list = []
        self.ended = False

    def send(self, event: Any) -> None:
        self.client.h3.send_data(self.stream_id, self.ws.send(event), end_stream=False)
        self.client.transmit()

    async def next(self, timeout: float = 60.0) -> Any:
        while not self.events:
            assert not self.ended, "the stream ended"
            arrived = await asyncio.wait_for(self.client.queue(self.stream_id).get(), timeout)
            self.ended = arrived.stream_ended
            if isinstance(arrived, DataReceived):
                self.ws.receive_data(arrived.data)
                self.events += list(self.ws.events())
        return self.events.pop(0)

    async def next_json(self, kind: str) -> dict[str, Any]:
        while True:
            event = await self.next()
            if isinstance(event, TextMessage) and (doc := json.loads(event.data))["type"] == kind:
                return doc


async def open_websocket(client: H3Client, path: str) -> tuple[list[tuple[bytes, bytes]], WebSocketOverH3]:
    stream_id = client._quic.get_next_available_stream_id()
    headers = [
        (b":method", b"CONNECT"),
        (b":protocol", b"websocket"),
        (b":scheme", b"https"),
        (b":authority", b"localhost"),
        (b":path", path.encode()),
        (b"sec-websocket-version", b"13"),
    ]
    client.h3.send_headers(stream_id, headers)
    client.transmit()
    answer = await asyncio.wait_for(client.queue(stream_id).get(), 30)
    assert isinstance(answer, HeadersReceived), answer
    return answer.headers, WebSocketOverH3(client, stream_id)


def configuration(daemon: Daemon) -> QuicConfiguration:
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name="localhost")
    config.load_verify_locations(daemon.cafile)
    config.load_cert_chain(*daemon.operator) if daemon.operator else None
    return config


def test_a_realtime_transcription_session_over_http3(daemon: Daemon) -> None:
    sentence = CLEAR[0]
    samples, _ = recording([sentence], gap_s=1.2, lead_s=0.5)
    audio = pcm(np.concatenate([samples, np.zeros(RATE, np.float32)]), 16000)

    async def run() -> tuple[dict, list[dict], dict, Any]:
        async with connect(
            "127.0.0.1", daemon.quic_port, configuration=configuration(daemon), create_protocol=H3Client
        ) as client:
            assert isinstance(client, H3Client)
            headers, ws = await open_websocket(client, "/v1/realtime?intent=transcription")
            assert dict(headers)[b":status"] == b"200", headers
            created = await ws.next_json("session.created")
            session = {
                "type": "transcription",
                "audio": {
                    "input": {
                        "format": {"type": "audio/pcm", "rate": 16000},
                        "transcription": {"model": TINY, "language": "en"},
                        "turn_detection": TURN_DETECTION,
                    }
                },
            }
            ws.send(TextMessage(json.dumps({"type": "session.update", "session": session})))
            await ws.next_json("session.updated")
            ws.send(TextMessage("not json"))
            errors = [await ws.next_json("error")]
            step = 16000 * 2 // 10  # 100 ms frames, sent as fast as the stream takes them
            for offset in range(0, len(audio), step):
                piece = base64.b64encode(audio[offset : offset + step]).decode()
                ws.send(TextMessage(json.dumps({"type": "input_audio_buffer.append", "audio": piece})))
                await asyncio.sleep(0)
            completed = await ws.next_json("conversation.item.input_audio_transcription.completed")
            ws.send(CloseConnection(code=1000, reason="done"))
            closing = await ws.next()
            while not ws.ended:  # the server ends the stream after the close handshake
                await asyncio.wait_for(client.queue(ws.stream_id).get(), 10)
                ws.ended = True
            return created, errors, completed, closing

    created, errors, completed, closing = asyncio.run(run())
    assert created["session"]["type"] == "transcription"
    assert errors[0]["error"]["code"] == "invalid_json", errors
    assert wer(sentence, completed["transcript"]) == 0.0, completed["transcript"]
    assert isinstance(closing, CloseConnection) and closing.code == 1000, closing


def test_an_extended_connect_elsewhere_is_answered_as_the_route_answers_and_plain_requests_go_on(
    daemon: Daemon,
) -> None:
    async def run() -> tuple[list, list]:
        async with connect(
            "127.0.0.1", daemon.quic_port, configuration=configuration(daemon), create_protocol=H3Client
        ) as client:
            assert isinstance(client, H3Client)
            refused, _ = await open_websocket(client, "/v2/models/no_such_model/infer")
            opened, _ = await open_websocket(client, "/v1/realtime?intent=transcription")  # on the same connection
            return refused, opened

    refused, opened = asyncio.run(run())
    assert dict(refused)[b":status"] in (b"404", b"405"), refused
    assert dict(opened)[b":status"] == b"200", opened

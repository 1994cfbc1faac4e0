"""A streamed answer on HTTP/1.1 whose producer yields an empty piece (an encoder with no tail left,
say): the server's chunked body must not end there. Before, it wrote the empty piece as the zero-size
chunk that ends a body, then the rest and a second end, and the next answer on that kept-alive
connection began with them (test_speech's "Expected HTTP/" on a FLAC answer's next request). Judged by
h11, a peer's parser, over a real Unix socket with a stub API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

import h11
from test_http1_timeouts import Answers, served

from appliance.protocol.messages import Request, Response


class Streams(Answers):
    """Every answer streamed, with an empty piece in the middle and one at the end."""

    async def handle(self, request: Request) -> Response:
        async def pieces() -> AsyncGenerator[bytes, None]:
            for piece in (b"one ", b"", b"two", b""):
                yield piece

        return Response(200, content_type="application/octet-stream", stream=pieces())


def test_empty_pieces_of_a_streamed_answer_neither_end_it_nor_reach_the_next_answer(tmp_path: Path) -> None:
    bodies: list[bytes] = []

    async def two_requests(server, clock, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = h11.Connection(h11.CLIENT)
        for _ in range(2):
            writer.write(client.send(h11.Request(method="GET", target="/stream", headers=[("host", "box")])))
            writer.write(client.send(h11.EndOfMessage()))
            body = b""
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await asyncio.wait_for(reader.read(4096), 30))
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
            bodies.append(body)
            client.start_next_cycle()

    served(tmp_path, two_requests, Streams())
    assert bodies == [b"one two", b"one two"]

"""One request's turn, as every HTTP transport takes it (HTTP/1.1 and its WebSocket handshake,
HTTP/3): the body made whole, the API's answer, the body's bytes given back to the budget, and the
sequence the request opened handed to the transport, which ends it when its client leaves. The
transports differ only in how they read a request and write its answer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from appliance.protocol.messages import Handler, Opened, Response
from appliance.tasks import off_loop
from appliance.transport.assembler import Arrived, BodyBudget


class AnsweringServer(Protocol):
    api: Handler
    budget: BodyBudget


async def answer(server: AnsweringServer, arrived: Arrived, opened: Callable[[Opened], None]) -> Response:
    try:
        response = await server.api.handle(dataclasses.replace(arrived.head, body=await whole(arrived)))
    finally:
        server.budget.give(arrived.size)
    if response.opened is not None:
        opened(response.opened)
    return response


async def whole(arrived: Arrived) -> bytes:
    """The body in one piece, its pieces let go (the transport keeps what arrived until the answer
    is sent). A large one is joined off the event loop: the copy of 60 MiB takes tens of
    milliseconds, and bytes.join lets the GIL go while it copies."""
    pieces = arrived.pieces
    body = pieces[0] if len(pieces) == 1 else await off_loop(arrived.size, b"".join, pieces)
    pieces.clear()
    return body

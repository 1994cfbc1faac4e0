"""HTTP/1.1's timeouts on a clock the test holds: a real asyncio server on a Unix socket (the transport
the daemon runs), a stub API, and the server's clock moved by the test. Each bound holds a connection
open up to its value and closes it (or answers 408) just past it; no real time enters the verdict.
The same bounds are attacked end to end on a real daemon in test_hostile_clients.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from appliance.config import Config, Live, ServerConfig
from appliance.protocol.messages import Request, Response, json_response
from appliance.transport.assembler import BodyBudget
from appliance.transport.http1 import Http1Server

LIMITS = ServerConfig(header_timeout_s=1.0, body_timeout_s=2.0, keepalive_timeout_s=3.0)
HEALTH = b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n\r\n"


class Answers:
    """The API: 200 to every request."""

    async def handle(self, request: Request) -> Response:
        return json_response(200, {"ready": True})

    def keep_connections(self) -> bool:
        return True

    def end_opened(self, opened: object) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


Scenario = Callable[[Http1Server, Clock, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def served(tmp_path: Path, scenario: Scenario, api: Answers | None = None) -> None:
    """`scenario` against a real server on a Unix socket, answered by `api` (200 to everything)."""

    async def run() -> None:
        clock = Clock()
        live = Live(Config(server=LIMITS))
        server = Http1Server(api or Answers(), live, BodyBudget(lambda: live.config.server), clock)  # type: ignore[arg-type]
        listening = await asyncio.get_running_loop().create_unix_server(server.protocol, str(tmp_path / "s"))
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "s"))
        try:
            await until(lambda: len(server.connections) == 1)
            await scenario(server, clock, reader, writer)
        finally:
            writer.close()
            server.close_all()
            listening.close()

    asyncio.run(run())


async def until(condition: Callable[[], bool]) -> None:
    """Let the loop run until `condition` (the server has read what the client sent)."""
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the server did not get there")


def check(server: Http1Server, clock: Clock, at: float) -> bool:
    """Move the clock to `at`, let the server check its timeouts; whether its one connection is closing."""
    clock.now = at
    (connection,) = server.connections
    connection.check_timeouts(clock())
    assert connection.transport is not None
    return connection.transport.is_closing() or connection._rejected


@pytest.mark.parametrize("case", ["silent", "head", "body", "keep-alive"])
def test_each_bound_holds_a_connection_to_its_value_and_ends_it_past_it(tmp_path: Path, case: str) -> None:
    """silent: a connection that sends nothing has header_timeout_s; head: a head begun and not ended,
    header_timeout_s from its start (408); body: a body gone quiet, body_timeout_s from its last byte
    (408); keep-alive: after an answer, keepalive_timeout_s of quiet."""
    expected = {
        "silent": (LIMITS.header_timeout_s, b""),
        "head": (LIMITS.header_timeout_s, b"request head not complete within 1 s"),
        "body": (LIMITS.body_timeout_s, b"request body stalled for 2 s"),
        "keep-alive": (LIMITS.keepalive_timeout_s, b""),
    }[case]

    async def scenario(server: Http1Server, clock: Clock, reader: asyncio.StreamReader, writer) -> None:
        (connection,) = server.connections
        if case == "head":
            writer.write(b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n")
            await until(lambda: connection.in_flight == 1)
        elif case == "body":
            writer.write(b"POST /x HTTP/1.1\r\ncontent-length: 10\r\n\r\n12345")
            await until(lambda: connection._assembler is not None and connection._assembler.wire_bytes == 5)
            clock.now += 0.5  # the body's clock runs from its last byte, not from the head
            writer.write(b"678")
            await until(lambda: connection._assembler is not None and connection._assembler.wire_bytes == 8)
        elif case == "keep-alive":
            writer.write(HEALTH)
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            length = next(int(line[15:]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
            await reader.readexactly(length)
            await until(lambda: connection.in_flight == 0)
        start, (bound, answer) = clock.now, expected
        assert not check(server, clock, start + bound), f"{case}: closed at its bound"
        assert check(server, clock, start + bound + 0.001), f"{case}: open past its bound"
        raw = await reader.read()
        assert (b" 408 " in raw and answer in raw) if answer else raw == b"", raw

    served(tmp_path, scenario)

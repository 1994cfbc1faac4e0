"""Hostile HTTP/3 header sections against a real daemon: a QPACK bomb and one huge HEADERS frame.

The attacker is aioquic's own client with its QPACK encoder stream and HEADERS frames written by
hand: one 4 KB dynamic-table entry referenced by thousands of one-byte field lines, and a HEADERS
frame that says it is 16 MB long. Good clients call on both transports throughout; none may fail,
no worker may be killed, and each attack gets its own answer (a 431 naming the limit, STOP_SENDING,
the connection closed with H3_EXCESSIVE_LOAD).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import ErrorCode, FrameType, Setting, encode_frame
from conftest import Daemon, good_clients_throughout, process_tree_cpu_s

from appliance.bench.attacks import ENTRY, HEALTH, Attacker, attacker, bomb
from appliance.transport.h3_bounds import MAX_REFUSALS, field_lines

LIMIT = 16 << 10  # max_header_bytes, and so SETTINGS_MAX_FIELD_SECTION_SIZE


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def daemon(request, tmp_path_factory, keys, bundle, tls) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("hostile-h3"), bundle, keys.trusted, tls=tls, workers=request.param)
    with good_clients_throughout(d.wait_ready()):
        yield d


def attack(daemon: Daemon, run) -> None:
    async def main() -> None:
        async with attacker(f"127.0.0.1:{daemon.quic_port}", daemon.cafile) as a:
            await run(a)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_server_advertises_its_field_section_limit_and_no_blocked_streams(daemon) -> None:
    async def run(attacker: Attacker) -> None:
        settings = await attacker.settings()
        assert settings[Setting.MAX_FIELD_SECTION_SIZE] == LIMIT
        assert settings[Setting.QPACK_BLOCKED_STREAMS] == 0

    attack(daemon, run)


def test_a_qpack_bomb_is_refused_before_it_is_expanded_and_a_repeat_offender_closed(daemon) -> None:
    """Each 16 KB section would expand to 64 MB; the server counts its field lines and answers 431."""

    async def run(attacker: Attacker) -> None:
        await attacker.settings()
        await attacker.insert(b"x-bomb", ENTRY)
        for _ in range(MAX_REFUSALS):
            stream_id = attacker.send_raw(encode_frame(FrameType.HEADERS, bomb(16_000)))
            status, body = await attacker.answers[stream_id]
            assert status == 431 and b"field lines" in body and b"SETTINGS_MAX_FIELD_SECTION_SIZE" in body, body
        attacker.send_raw(encode_frame(FrameType.HEADERS, bomb(16_000)))
        closed = await attacker.closed
        assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD, closed

    attack(daemon, run)
    assert "header section of more than" in daemon.log.read_text()


def test_a_section_that_decodes_past_the_limit_is_431_and_a_small_one_is_served(daemon) -> None:
    """Five references to a 4 KB entry: few lines, 20 KB decoded, over the 16 KiB limit."""

    async def run(attacker: Attacker) -> None:
        await attacker.settings()
        await attacker.insert(b"x-big", ENTRY)
        status, body = await attacker.answers[attacker.send_raw(encode_frame(FrameType.HEADERS, bomb(5)))]
        assert status == 431 and b"decoded" in body, body
        status, body = await attacker.answers[attacker.send_raw(encode_frame(FrameType.HEADERS, HEALTH))]
        assert status == 200, body

    attack(daemon, run)


def test_a_huge_headers_frame_is_refused_when_its_length_arrives(daemon) -> None:
    """A HEADERS frame that says it is 16 MB, its first megabyte sent at once: answered 431, stopped,
    the rest dropped unread; the connection still serves a good request."""

    async def run(attacker: Attacker) -> None:
        await attacker.settings()
        head = encode_uint_var(FrameType.HEADERS) + encode_uint_var(16 << 20)
        stream_id = attacker.send_raw(head + b"\x00" * (1 << 20), end_stream=False)
        status, body = await attacker.answers[stream_id]
        assert status == 431 and f"HEADERS frame of {16 << 20} bytes".encode() in body, body
        for _ in range(100):
            if stream_id in attacker.stopped:
                break
            await asyncio.sleep(0.02)
        assert attacker.stopped.get(stream_id) == ErrorCode.H3_NO_ERROR
        status, body = await attacker.answers[attacker.send_raw(encode_frame(FrameType.HEADERS, HEALTH))]
        assert status == 200 and not attacker.closed.done(), body

    attack(daemon, run)


def test_a_huge_control_frame_closes_the_connection(daemon) -> None:
    """MAX_PUSH_ID (which aioquic waits for whole) announced as 16 MB on the client's control stream."""

    async def run(attacker: Attacker) -> None:
        await attacker.settings()
        control = attacker.http._local_control_stream_id
        head = encode_uint_var(FrameType.MAX_PUSH_ID) + encode_uint_var(16 << 20)
        attacker._quic.send_stream_data(control, head + b"\x00" * 65536)
        attacker.transmit()
        closed = await attacker.closed
        assert closed.error_code == ErrorCode.H3_EXCESSIVE_LOAD, closed

    attack(daemon, run)


def test_bombs_from_many_connections_for_seconds_cost_little(daemon) -> None:
    """Eight attackers at once, each sending bombs until its connection is closed, again for 3 s;
    the good clients (the fixture's) keep being served. Prints the daemon's CPU per refused bomb."""
    sent = 0

    async def one_attacker() -> None:
        nonlocal sent
        async with attacker(f"127.0.0.1:{daemon.quic_port}", daemon.cafile) as a:
            await a.settings()
            await a.insert(b"x-bomb", ENTRY)
            for _ in range(MAX_REFUSALS + 1):
                a.send_raw(encode_frame(FrameType.HEADERS, bomb(16_000)))
                sent += 1
            assert (await a.closed).error_code == ErrorCode.H3_EXCESSIVE_LOAD

    async def main() -> None:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            await asyncio.gather(*(one_attacker() for _ in range(8)))

    cpu_before = process_tree_cpu_s(daemon.proc.pid)
    asyncio.run(asyncio.wait_for(main(), 60))
    spent = process_tree_cpu_s(daemon.proc.pid) - cpu_before
    print(f"{sent} bombs of 16 KB (64 MB each if expanded): daemon CPU {spent:.2f} s, {spent / sent * 1e3:.1f} ms each")


def test_field_lines_are_counted_without_expanding_and_stop_past_the_limit() -> None:
    assert field_lines(bomb(3), 100) == 4 + 3
    assert field_lines(bomb(100_000), 512) == 513
    assert field_lines(b"", 10) == 0
    assert field_lines(b"\x02\x00\x5f", 10) == 1  # a name index cut short: counted as far as it goes

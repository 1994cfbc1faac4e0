"""The crossing between a protocol worker process and the engine process.

One Unix stream socket pair per worker carries small messages (the doorbell): a 4-byte length and a
pickled tuple. A body rides in its message up to INLINE_BYTES, a larger one in shared memory
(front/bodies.py); one that cannot cross fails its own request with a logged 500, and the channel and
every other request go on.

Both ends are our own processes, started together from one installed package: pickle is the codec.

Messages, worker to engine:
    ("request", rid, Request, Body)               the transport's request; its body apart
    ("cancel", rid)                               the client went away: stop serving rid
    ("credit", rid, n)                            its transport took n bytes of rid's stream: send more
    ("end_opened", [Opened])                      a vanished QUIC peer's sequences
    ("still_open", rid, [Opened])                 which of these sequences are still open
    ("report", WorkerReport)                      once a second: the heartbeat, in-flight, QUIC peers
engine to worker:
    ("response", rid, Response, Body, mode, keep)  mode: "" (whole), "stream" (chunks follow) or
                                                  "session" (a WebSocket, sessions.py); keep: the
                                                  engine's api.keep_connections()
    ("chunk", rid, bytes) / ("end", rid)          a streamed body, piece by piece, while the worker's
                                                  credit lasts (protocol/flow.py: the window per stream)
    ("open", rid, [bool])                         the answer to still_open
    ("keep", 0, bool)                             while draining: api.keep_connections(), as it changes
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import socket
import struct
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from appliance.front.bodies import Body, hand_over_failed, read_body, written_body
from appliance.front.sessions import WorkerEnd
from appliance.protocol.messages import Close, Opened, Request, Response, Session, SessionIO, error_response
from appliance.protocol.peers import Peer, Totals
from appliance.tasks import spawn

log = logging.getLogger("appliance.workers")

FRAME = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What a worker tells the engine each second; the engine's /status and /metrics sum them."""

    slot: int
    pid: int
    in_flight: int
    connections: int  # on the Unix socket
    tcp_connections: int  # HTTPS
    quic_peers: list[str]  # the address of each of its QUIC connections
    quic_datagrams: int  # received on its UDP socket
    quic_stray_datagrams: int  # of those, short-header ones for a connection it does not have
    # where this worker keeps the connection cache in user space (no eBPF), its validated peers and the
    # drops of those over budget last (the unvalidated sources stay in the worker: a flood fills them)
    peers: dict[str, Peer] | None = None
    droppers: dict[str, int] | None = None
    totals: Totals = field(default_factory=Totals)
    held_bytes: int = 0  # of streamed answers, held for clients that have not taken them (protocol/flow.py)
    held_largest_bytes: int = 0
    loop_lag_s: float = 0.0  # its event loop's lag, lately


class Channel:
    """Framed messages over one end of the socket pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, fd: int) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd), limit=1 << 20)
        return cls(reader, writer)

    def send(self, message: tuple[Any, ...]) -> None:
        if self.writer.is_closing():
            return  # the other end is gone; its supervisor or its own exit handles the rest
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.writer.write(FRAME.pack(len(payload)) + payload)

    async def receive(self) -> tuple[Any, ...] | None:
        """The next message, or None at the end (the other process exited)."""
        try:
            (length,) = FRAME.unpack(await self.reader.readexactly(FRAME.size))
            message: tuple[Any, ...] = pickle.loads(await self.reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return message

    async def drain(self) -> None:
        """Wait while the other end does not read (backpressure for streamed bodies)."""
        try:
            await self.writer.drain()
        except ConnectionError:
            pass

    def close(self) -> None:
        self.writer.close()


STILL_OPEN_WAIT_S = 10.0  # the engine answers at once; a longer wait is a wedged engine
TICKET_WAIT_S = 0.1  # a lookup not answered by then is a miss: the client does a full handshake
SEQUENCE = struct.Struct("<Q")


class RemoteTickets:
    """A QUIC worker's view of the engine's session-ticket store, over a SOCK_SEQPACKET pair of its
    own: a ticket issued by one worker resumes a connection that reaches another, and is still usable
    once only. aioquic looks a ticket up inside the handshake, synchronously: so is this."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.settimeout(TICKET_WAIT_S)
        self._sequence = itertools.count(1)

    def add(self, ticket: Any) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(b"A" + pickle.dumps(ticket, protocol=pickle.HIGHEST_PROTOCOL))

    def pop(self, label: bytes) -> Any:
        sequence = next(self._sequence)
        try:
            self.sock.send(b"P" + SEQUENCE.pack(sequence) + label)
            while True:  # an answer to an earlier lookup that timed out is skipped
                reply = self.sock.recv(1 << 16)
                if not reply:
                    return None
                if SEQUENCE.unpack_from(reply)[0] == sequence:
                    return pickle.loads(reply[SEQUENCE.size :])
        except OSError:  # timed out, or the engine is gone
            return None


def serve_tickets(sock: socket.socket, store: Any) -> None:
    """The engine's side of one worker's RemoteTickets: called when `sock` is readable."""
    try:
        message = sock.recv(1 << 16)
    except BlockingIOError:
        return
    if message[:1] == b"A":
        store.add(pickle.loads(message[1:]))
    elif message[:1] == b"P":
        sequence, label = message[1 : 1 + SEQUENCE.size], message[1 + SEQUENCE.size :]
        with contextlib.suppress(OSError):
            sock.send(sequence + pickle.dumps(store.pop(label), protocol=pickle.HIGHEST_PROTOCOL))


class RemoteApi:
    """A worker's API: each request goes to the engine process and its answer comes back."""

    def __init__(self, channel: Channel, request_timeout_s: Callable[[], float] = lambda: 3600.0) -> None:
        self.channel, self.request_timeout_s = channel, request_timeout_s
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._streams: dict[int, asyncio.Queue[bytes | None]] = {}
        self._sessions: dict[int, WorkerEnd] = {}
        self._keep = True
        self._owner = str(os.getpid())  # names the shared-memory bodies this worker writes

    async def _ask(self, kind: str, *payload: Any, timeout_s: float) -> tuple[int, Any]:
        """Send one question under a new id; its id and the engine's answer (deliver sets it), or
        TimeoutError after `timeout_s` (the engine is told to stop, as for a client gone)."""
        rid = next(self._ids)
        answer = asyncio.get_running_loop().create_future()
        self._waiting[rid] = answer
        self.channel.send((kind, rid, *payload))
        try:
            return rid, await asyncio.wait_for(answer, timeout_s)
        except (asyncio.CancelledError, TimeoutError):
            self.channel.send(("cancel", rid))
            raise
        finally:
            self._waiting.pop(rid, None)

    async def handle(self, request: Request) -> Response:
        try:
            body = await written_body(request.body, self._owner)
        except OSError as exc:
            return hand_over_failed(exc)
        try:
            rid, (response, mode) = await self._ask(
                "request", dataclasses.replace(request, body=b""), body, timeout_s=self.request_timeout_s()
            )
        except TimeoutError:
            return error_response(504, f"the engine did not answer within {self.request_timeout_s():g} s")
        if mode == "stream":
            response.stream = self._stream(rid)
        elif mode == "session":
            response.session = self._session(rid)
        return response

    def _session(self, rid: int) -> Session:
        end = self._sessions[rid]  # made as the answer arrived: the session's messages follow it at once

        async def run(io: SessionIO) -> Close:
            try:
                return await end(io)
            finally:
                self._sessions.pop(rid, None)

        return run

    async def _stream(self, rid: int) -> AsyncGenerator[bytes, None]:
        pieces, ended = self._streams[rid], False
        try:
            while (piece := await pieces.get()) is not None:
                yield piece
                self.channel.send(("credit", rid, len(piece)))  # the transport took it: the engine may send more
            ended = True
        finally:
            self._streams.pop(rid, None)
            if not ended:
                self.channel.send(("cancel", rid))  # the client left mid-stream

    def keep_connections(self) -> bool:
        return self._keep

    def end_opened(self, opened: Iterable[Opened]) -> None:
        self.channel.send(("end_opened", list(opened)))

    async def still_open(self, opened: list[Opened]) -> list[bool]:
        if not opened:
            return []
        _, result = await self._ask("still_open", opened, timeout_s=STILL_OPEN_WAIT_S)
        return list(result)

    def deliver(self, message: tuple[Any, ...]) -> None:
        """One message from the engine, in order."""
        kind, rid = message[0], message[1]
        if kind == "response":
            _, _, response, body, mode, self._keep = message
            if mode == "stream":  # made now: the stream's chunks follow this message at once
                self._streams[rid] = asyncio.Queue()
            elif mode == "session":
                self._sessions[rid] = WorkerEnd(self.channel, rid)
            if body.shm:  # read in a thread: nothing after it waits for it
                spawn(self._answered(rid, response, body, mode), f"the body of answer {rid}")
            else:
                response.body = body.inline
                self._settle(rid, response, mode)
        elif kind in ("session_out", "session_end", "session_ack"):
            if (end := self._sessions.get(rid)) is not None:
                if kind == "session_ack":
                    end.credit.give(message[2])
                else:
                    end.outbox.put_nowait(message[2])
        elif kind in ("chunk", "end"):
            queue = self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(message[2] if kind == "chunk" else None)
        elif kind == "keep":
            self._keep = message[2]
        elif kind == "open":
            answer = self._waiting.get(rid)
            if answer is not None and not answer.done():
                answer.set_result(message[2])

    async def _answered(self, rid: int, response: Response, body: Body, mode: str) -> None:
        try:
            response.body = await read_body(body)
        except Exception as exc:  # the file gone or short (OSError), or ours: either way its request gets a 500
            if not isinstance(exc, OSError):
                log.exception("the body of answer %d could not be read", rid)
            response = hand_over_failed(exc)
            if mode:  # what would follow is not wanted
                self._streams.pop(rid, None)
                self._sessions.pop(rid, None)
                self.channel.send(("cancel", rid))
                mode = ""
        self._settle(rid, response, mode)

    def _settle(self, rid: int, response: Response, mode: str) -> None:
        answer = self._waiting.get(rid)
        if answer is not None and not answer.done():
            answer.set_result((response, mode))
        elif mode:  # its request gave up meanwhile
            self._streams.pop(rid, None)
            self._sessions.pop(rid, None)
            self.channel.send(("cancel", rid))

    def fail_all(self) -> None:
        """The engine is gone: nothing pending will be answered."""
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(ConnectionError("the engine process is gone"))
        for queue in self._streams.values():
            queue.put_nowait(None)
        for end in self._sessions.values():
            end.outbox.put_nowait(Close(1011, "the engine process is gone"))

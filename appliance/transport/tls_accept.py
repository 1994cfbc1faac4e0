"""TCP accepted for TLS, admitted before its handshake: asyncio's own TLS server accepts every
connection and each handshake holds a descriptor and its TLS state until it ends, so a client that
opens connections and never finishes them was bounded only by the process's descriptors (and took
the Unix socket's). Here a connection is accepted only while handshakes in flight are under
https.max_handshakes, and its address's under https.max_handshakes_per_address (each of N workers
holds 1/N of both); others are closed at once. A handshake must end within https.handshake_timeout_s.
While a descriptor just accepted leaves less than FD_RESERVE under RLIMIT_NOFILE, it is closed and
the listener stops accepting for ACCEPT_PAUSE_S (the kernel's backlog holds the rest), so the Unix
sockets always have descriptors to accept with."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections import Counter
from collections.abc import Callable

from appliance.config import HttpsConfig
from appliance.protocol.proxied import Address, BadHeader, checked, from_proxy, origin_from_socket
from appliance.tasks import spawn
from appliance.transport.assembler import LIMITS_BITTEN
from appliance.transport.connection_bounds import FD_RESERVE, admission_refusal, descriptors_short

log = logging.getLogger("appliance.https")
ACCEPTS_PER_WAKE = 64
ACCEPT_PAUSE_S = 0.1
TLS_HANDSHAKE_RECORD = b"\x16"  # a TLS record's content type: every ClientHello begins with it
MAX_PLAIN_REQUEST = 65536


def plain_http_refusal(port: int) -> bytes:
    """The answer to an HTTP request sent without TLS to the HTTPS port."""
    body = f"this port speaks HTTPS only: plain HTTP was sent to it; use https:// (port {port})\n".encode()
    head = f"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"connection: close\r\n\r\n" + body


class TlsAcceptor:
    """The TCP listener of one process: accepts, admits, and hands each handshake to asyncio's TLS."""

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        settings: Callable[[], HttpsConfig],
        connection: Callable[[Address | None], asyncio.Protocol],
        workers: int,
        proxies: Callable[[], str],
    ) -> None:
        """`connection(origin)`: the protocol a connection is once its handshake is done, `origin` the
        client its balancer's PROXY header named (None: the connection's own address is the client's).
        `proxies()`: [fleet] proxies, the balancers whose connections begin with that header."""
        self.sock, self.context, self._settings, self._connection, self.workers = (
            sock,
            context,
            settings,
            connection,
            workers,
        )
        self._proxies = proxies
        self.handshakes: Counter[str] = Counter()  # in flight, by address (a proxied one's: its client's)
        self.headers = 0  # balancers' connections whose PROXY header is being read
        self._loop = asyncio.get_running_loop()
        self._resume: asyncio.TimerHandle | None = None
        self._loop.add_reader(sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                conn, address = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors or memory: the Unix sockets go first
                self._pause(f"accept failed: {exc.strerror or exc}")
                return
            if descriptors_short(conn.fileno()):
                conn.close()
                self._pause(f"descriptors: under {FD_RESERVE} left below RLIMIT_NOFILE, kept for the Unix sockets")
                return
            host, settings = address[0], self._settings()
            conn.setblocking(False)
            if not from_proxy(host, self._proxies()):
                self._admit(conn, host, None)
            elif self.headers * self.workers < settings.max_handshakes:  # the header first: who the client is
                self.headers += 1
                spawn(self._from_proxy(conn, host, settings.handshake_timeout_s), f"the PROXY header of {host}")
            else:
                conn.close()

    def _admit(self, conn: socket.socket, host: str, origin: Address | None) -> None:
        """The handshake of `host`'s connection, where its share and the listener's bound admit it."""
        settings = self._settings()
        limit, share = settings.max_handshakes, settings.max_handshakes_per_address
        if admission_refusal(self.handshakes.elements(), host, limit, share, self.workers, "TLS handshakes"):
            conn.close()
            return
        self.handshakes[host] += 1
        spawn(self._handshake(conn, host, origin, settings.handshake_timeout_s), f"the TLS handshake of {host}")

    async def _from_proxy(self, conn: socket.socket, proxy: str, timeout_s: float) -> None:
        try:
            origin = await checked(origin_from_socket(conn), timeout_s, f"a connection from proxy {proxy}")
        except BadHeader:
            conn.close()
            return
        except BaseException:  # cancelled (the stop): the socket goes with it
            conn.close()
            raise
        finally:
            self.headers -= 1
        self._admit(conn, origin[0] if origin else proxy, origin)

    async def _handshake(self, conn: socket.socket, host: str, origin: Address | None, timeout_s: float) -> None:
        deadline = self._loop.time() + timeout_s
        try:
            if not await self._begins_tls(conn, host, deadline):
                return
            await self._loop.connect_accepted_socket(
                lambda: self._connection(origin),
                conn,
                ssl=self.context,
                ssl_handshake_timeout=max(deadline - self._loop.time(), 0.001),
            )
        except (ConnectionAbortedError, TimeoutError):  # a slowloris, or a loop that stalled
            why = f"a TLS handshake of {host} not done in {timeout_s:g} s (https.handshake_timeout_s): closed"
            LIMITS_BITTEN.bit("tls handshake timeout", why)
        except OSError as exc:  # the client's failure (a bad handshake): asyncio closed its socket
            log.debug("TLS handshake of %s failed: %s", host, exc)
        finally:
            self.handshakes[host] -= 1
            if not self.handshakes[host]:
                del self.handshakes[host]

    async def _begins_tls(self, conn: socket.socket, host: str, deadline: float) -> bool:
        """Whether the client's first byte opens a TLS record. A plain HTTP request (http:// to this
        port) is answered with a 400 that says so, as nginx does, rather than a silent close."""
        try:
            async with asyncio.timeout_at(deadline):
                await self._readable(conn)
        except BaseException:  # the deadline (the caller tells it) or the stop: the socket goes with it
            conn.close()
            raise
        try:
            first = conn.recv(1, socket.MSG_PEEK)
        except OSError:
            first = b""
        if first == TLS_HANDSHAKE_RECORD:
            return True
        if first.isalpha():
            with contextlib.suppress(OSError, TimeoutError):
                conn.send(plain_http_refusal(conn.getsockname()[1]))
                conn.shutdown(socket.SHUT_WR)
                # what the client still sends is read to its end (within the handshake's time): closed
                # with it unread, the kernel would reset the connection, and the client lose the answer
                async with asyncio.timeout_at(deadline):
                    while await self._loop.sock_recv(conn, MAX_PLAIN_REQUEST):
                        pass
            log.debug("plain HTTP from %s to the HTTPS port: answered 400", host)
        conn.close()
        return False

    async def _readable(self, conn: socket.socket) -> None:
        """Once `conn` has bytes to read (or its end), none taken: asyncio's sock_recv would take them."""
        readable: asyncio.Future[None] = self._loop.create_future()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        self._loop.add_reader(conn.fileno(), ready)
        try:
            await readable
        finally:
            self._loop.remove_reader(conn.fileno())

    def _pause(self, why: str) -> None:
        LIMITS_BITTEN.bit("tcp accepts", f"TCP accepts paused {ACCEPT_PAUSE_S:g} s: {why}")
        self._loop.remove_reader(self.sock.fileno())
        self._resume = self._loop.call_later(ACCEPT_PAUSE_S, self._loop.add_reader, self.sock.fileno(), self._accept)

    def close(self) -> None:
        """No more accepts; connections and handshakes under way go on (the stop drains them)."""
        if self._resume is not None:
            self._resume.cancel()
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()

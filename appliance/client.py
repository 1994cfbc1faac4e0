"""Python client for the appliance API over the Unix socket (HTTP/1.1, keep-alive).

`Client` is blocking, for scripts and on-box apps; `AsyncClient` is the same over asyncio.
Both build requests and read responses with the same functions below.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import select
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import urlencode

import httptools
import numpy as np

from appliance.api.tensors import decode_response, encode_request

DEFAULT_MODEL = "silero_vad"
DEFAULT_CONNECT_TIMEOUT_S = 5.0  # connecting, and the QUIC handshake: an unreachable daemon fails this fast


class ClientError(Exception):
    """Anything a call could not do; `ServerError` and `ConnectError` below say which.

    `status` is the HTTP status the daemon answered with, 0 when it did not answer.
    """

    status: int = 0

    @property
    def message(self) -> str:
        return str(self)


class ServerError(ClientError):
    """The daemon answered with an error status; `message` is its {"error": ...} text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self._message = message

    @property
    def message(self) -> str:
        return self._message


class ConnectError(ClientError, ConnectionError):
    """The daemon could not be reached, or the connection to it broke: nothing was answered.

    Also a ConnectionError (an OSError), as it was before this type existed.
    """


class SocketUnreachable(ConnectError):
    """Connecting to the Unix socket failed; the message names `path` and what is there."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


class NoAnswer(ConnectError, TimeoutError):
    """Nobody answered in time: no QUIC handshake, or no response before the timeout."""


class CertificateRejected(ConnectError):
    """QUIC: the server's certificate does not verify against the client's CA file (or the reverse:
    the server refused the client's certificate, `by_server`)."""

    def __init__(self, message: str, by_server: bool = False) -> None:
        super().__init__(message)
        self.by_server = by_server


def parse_quic_address(address: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPv6]:PORT' -> (host, port); ValueError saying what is wrong otherwise."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ValueError(f"{address!r} is not HOST:PORT (an IPv6 address goes in brackets: [::1]:4433)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: {port!r} is not a UDP port (1-65535)")
    return host.strip("[]"), int(port)


def describe_path(path: str) -> str:
    """What is at `path`, in words: 'no such file', 'a regular file (12 bytes)', 'a socket', ..."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
        parent = os.path.dirname(os.path.abspath(path))
        return "no such file" if os.path.isdir(parent) else f"no such file, nor its directory {parent}"
    except OSError as exc:
        return f"cannot look ({(exc.strerror or str(exc)).lower()})"
    kinds = {stat.S_ISSOCK: "a socket", stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    for test, kind in kinds.items():
        if test(st.st_mode):
            return kind
    return f"a regular file ({st.st_size} bytes)"


def _owner(st: os.stat_result) -> str:
    import grp
    import pwd

    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def unix_connect_error(path: str, exc: OSError, timeout: float) -> SocketUnreachable:
    """Why connecting to the daemon's Unix socket failed, naming the path and what is there."""
    there = describe_path(path)
    if isinstance(exc, (TimeoutError, BlockingIOError)):
        reason = f"{there} is there but did not accept the connection within {timeout:g} s (the daemon is overloaded?)"
    elif there == "a socket" and exc.errno == errno.ECONNREFUSED:
        reason = "a socket file is there but nothing listens on it (stale: the daemon is not running)"
    elif there == "a socket" and exc.errno in (errno.EACCES, errno.EPERM):
        st = os.stat(path)
        reason = (f"a socket is there but this user may not connect to it (permission denied: owner {_owner(st)}, "
                  f"mode {stat.S_IMODE(st.st_mode):04o}; the daemon's socket_group may)")
    elif there.startswith("no such file") or there.endswith("which does not exist"):
        reason = f"{there} (is the daemon running, and is this its socket?)"
    elif there.startswith("a ") and there != "a socket":
        reason = f"{there} is there, not a socket"
    else:
        reason = f"{there}: {(exc.strerror or str(exc)).lower()}"
    return SocketUnreachable(f"cannot reach the daemon at {path}: {reason}", path)


@dataclass(slots=True)
class HttpResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class Call:
    method: str
    target: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    def encode(self) -> bytes:
        lines = [f"{self.method} {self.target} HTTP/1.1", "host: localhost", f"content-length: {len(self.body)}"]
        lines += [f"{k}: {v}" for k, v in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + self.body


class ResponseReader:
    """Bytes in, complete responses out (httptools' response parser)."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.done: list[HttpResponse] = []
        self.status = 0  # of the response being read, once its headers are in
        self.arrived: list[bytes] = []  # body pieces not yet taken by a streaming reader
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    def feed(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_begin(self) -> None:
        self._headers, self._body, self.arrived, self.status = {}, [], [], 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self.arrived.append(body)

    def on_message_complete(self) -> None:
        self.done.append(HttpResponse(self._parser.get_status_code(), self._headers, b"".join(self._body)))


def checked(response: HttpResponse) -> HttpResponse:
    if response.status >= 400:
        try:
            message = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            message = response.body.decode("utf-8", "replace")
        raise ServerError(response.status, message)
    return response


# --- calls: how each API operation is asked and read --------------------------------------------

def infer_call(model: str, audio: np.ndarray, sequence_id: int | str | None = None, start: bool = False,
               end: bool = False, binary: bool = True) -> Call:
    parameters: dict[str, Any] = {}
    if sequence_id is not None:
        parameters = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
    body, header_length = encode_request({"audio": np.asarray(audio)}, parameters, binary)
    headers = [("content-type", "application/octet-stream" if binary else "application/json")]
    if header_length is not None:
        headers.append(("inference-header-content-length", str(header_length)))
    return Call("POST", f"/v2/models/{model}/infer", body, tuple(headers))


def infer_result(response: HttpResponse) -> np.ndarray:
    length = response.headers.get("inference-header-content-length")
    return decode_response(response.body, int(length) if length else None)["speech_prob"]


def json_lines(pieces: Iterator[bytes]) -> Iterator[Any]:
    """A streamed NDJSON body, one document per line as each arrives; an error line raises."""
    buffered = b""
    for piece in pieces:
        buffered += piece
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            doc = json.loads(line)
            if "error" in doc:
                raise ServerError(200, doc["error"])
            yield doc


# The daemon finds the format in the bytes and ignores the content type; this only labels the body.
AUDIO_TYPES = {b"RIFF": "audio/wav", b"RIFX": "audio/wav", b"fLaC": "audio/flac", b"OggS": "audio/ogg"}


def segments_call(model: str, audio: bytes, **params: float) -> Call:
    """A recording (WAV, FLAC or Ogg, as the file holds it) -> the segments route."""
    query = f"?{urlencode(params)}" if params else ""
    content_type = AUDIO_TYPES.get(audio[:4], "application/octet-stream")
    return Call("POST", f"/v2/models/{model}/segments{query}", audio, (("content-type", content_type),))


class UnixTransport:
    """HTTP/1.1 on the Unix socket; one keep-alive connection, reopened if the daemon closed it.

    `busy_poll_s`: spin on the socket this long before sleeping in recv. A latency-critical
    on-box app trades a core for the wake-up of a sleeping CPU (tens of microseconds in a VM).
    `connect_timeout`: how long connecting may take; `timeout`: how long the daemon may be silent.
    Connection failures raise `ConnectError` (naming the path and what is there), silence `NoAnswer`.
    """

    def __init__(self, socket_path: str, timeout: float, busy_poll_s: float = 0.0,
                 connect_timeout: float | None = None) -> None:
        self.socket_path, self.timeout, self.busy_poll_s = socket_path, timeout, busy_poll_s
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._sock: socket.socket | None = None
        self._reader = ResponseReader()
        self._cut_short = False  # the daemon answered before it had the whole request

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout)
            try:
                sock.connect(self.socket_path)
            except OSError as exc:
                sock.close()
                raise unix_connect_error(self.socket_path, exc, self.connect_timeout) from None
            sock.settimeout(self.timeout)
            self._sock, self._reader, self._cut_short = sock, ResponseReader(), False
        return self._sock

    def stream(self, call: Call) -> Iterator[bytes]:
        """Send one call; yield its body in pieces as they arrive (an error status raises first)."""
        sock, reader = self._connect(), self._reader
        reader.status, reader.arrived = 0, []  # what is left of the previous response is not ours
        try:
            self._write(sock, reader, call.encode())
            while not reader.done:
                if reader.status and reader.status < 400 and reader.arrived:
                    pieces, reader.arrived = reader.arrived, []
                    yield from pieces
                self._read(sock, reader)
        except BaseException as exc:
            self.close()
            self._raise_as_client_error(exc)
            raise
        checked(self._take(reader))
        yield from reader.arrived

    def send(self, call: Call) -> HttpResponse:
        sock, reader = self._connect(), self._reader
        try:
            self._write(sock, reader, call.encode())
            if self.busy_poll_s:
                self._busy_poll(sock, reader)
            while not reader.done:
                self._read(sock, reader)
        except BaseException as exc:
            self.close()
            self._raise_as_client_error(exc)
            raise
        return self._take(reader)

    def _raise_as_client_error(self, exc: BaseException) -> None:
        """An OSError on an open connection, said as what it means for the call."""
        if isinstance(exc, ClientError) or not isinstance(exc, OSError):
            return
        if isinstance(exc, TimeoutError):
            raise NoAnswer(f"the daemon at {self.socket_path} did not answer within {self.timeout:g} s") from None
        raise ConnectError(f"the connection to the daemon at {self.socket_path} broke before it answered "
                           f"({exc.strerror or exc})") from None

    def _write(self, sock: socket.socket, reader: ResponseReader, data: bytes) -> None:
        """Send the request, reading while it goes out: the daemon may answer before it has the whole
        body (413 for one over its limit) and stop reading or close; that answer is the call's answer,
        not a broken pipe."""
        try:
            view = memoryview(data)[sock.send(data):]
            if not view:
                return
            poller = select.poll()  # not select(): that fails for descriptors past 1023
            poller.register(sock, select.POLLIN | select.POLLOUT)
            deadline = time.monotonic() + self.timeout
            while view:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                for _, events in poller.poll(remaining * 1000):
                    if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                        self._read(sock, reader)
                        if reader.done:
                            self._cut_short = True
                            return
                    elif events & select.POLLOUT:
                        view = view[sock.send(view):]
                        deadline = time.monotonic() + self.timeout
        except (BrokenPipeError, ConnectionResetError):
            self._cut_short = True  # the daemon stopped reading; its answer, if it sent one, is read next

    def _read(self, sock: socket.socket, reader: ResponseReader) -> None:
        data = sock.recv(1 << 20)
        if not data:
            what = "before it answered" if not reader.status else "in the middle of its answer"
            raise ConnectError(f"the daemon at {self.socket_path} closed the connection {what}")
        reader.feed(data)

    def _take(self, reader: ResponseReader) -> HttpResponse:
        """The completed response; the connection closes if the daemon said so, or answered early."""
        response = reader.done.pop(0)
        if response.headers.get("connection") == "close" or self._cut_short:
            self.close()
        return response

    def _busy_poll(self, sock: socket.socket, reader: ResponseReader) -> None:
        deadline = time.perf_counter() + self.busy_poll_s
        sock.setblocking(False)
        try:
            while not reader.done and time.perf_counter() < deadline:
                try:
                    self._read(sock, reader)
                except BlockingIOError:
                    continue
        finally:
            sock.settimeout(self.timeout)


class QuicTransport:
    """HTTP/3 to HOST:PORT on a private event loop thread, so blocking callers can use it."""

    def __init__(self, address: str, cafile: str | None, timeout: float,
                 certificate: tuple[str, str] | None = None, local_host: str = "",
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        from appliance.quic_client import QuicSession  # aioquic is only needed by QUIC callers

        self.address, self.timeout = address, timeout
        self._session = QuicSession(address, cafile, certificate, local_host, connect_timeout)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="quic-client", daemon=True)
        self._thread.start()

    def _run(self, coroutine: Any) -> Any:
        """Run on the client's loop; silence past the timeout is `NoAnswer`, a broken connection `ConnectError`."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(self.timeout)
        except ClientError:
            raise
        except TimeoutError:
            future.cancel()
            raise NoAnswer(f"no answer from {self.address} over QUIC within {self.timeout:g} s") from None
        except ConnectionError as exc:
            raise ConnectError(f"the QUIC connection to {self.address} broke before it answered "
                               f"({str(exc) or type(exc).__name__})") from None

    def send(self, call: Call) -> HttpResponse:
        return self._run(self._session.send(call))

    def stream(self, call: Call) -> Iterator[bytes]:
        """Send one call; yield its body in pieces as they arrive (an error status raises first)."""
        parts = self._session.exchange(call)

        async def next_part() -> Any:
            return await anext(parts, None)

        def step() -> Any:
            return self._run(next_part())

        headers = dict(step())
        status = int(headers.pop(":status", "0"))
        if status >= 400:
            body = b"".join(iter(step, None))
            checked(HttpResponse(status, headers, body))
        yield from iter(step, None)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(self.timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


class Client:
    """Blocking client over the Unix socket (`Client(path)`) or QUIC (`Client(quic="host:port")`)."""

    def __init__(self, socket_path: str | None = None, timeout: float = 120.0, busy_poll_s: float = 0.0,
                 quic: str | None = None, cafile: str | None = None,
                 certificate: tuple[str, str] | None = None, local_host: str = "",
                 connect_timeout: float | None = None) -> None:
        """`timeout`: how long the daemon may be silent; `connect_timeout`: how long connecting may take
        (default: the QUIC handshake DEFAULT_CONNECT_TIMEOUT_S, a Unix socket `timeout`, where only a
        full backlog makes it wait). Errors: `ServerError` (it answered 4xx/5xx), `ConnectError` (not
        reached, or the connection broke; `SocketUnreachable`, `NoAnswer`, `CertificateRejected` are
        kinds of it), both `ClientError`."""
        self.transport: UnixTransport | QuicTransport
        if quic is not None:
            self.transport = QuicTransport(quic, cafile, timeout, certificate, local_host,
                                           DEFAULT_CONNECT_TIMEOUT_S if connect_timeout is None else connect_timeout)
        elif socket_path is not None:
            self.transport = UnixTransport(socket_path, timeout, busy_poll_s, connect_timeout)
        else:
            raise ValueError("Client needs a socket path or quic='host:port'")

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, call: Call) -> HttpResponse:
        """Send one call and return the raw response, whatever its status."""
        return self.transport.send(call)

    def get(self, path: str) -> Any:
        return checked(self.send(Call("GET", path))).json()

    def health(self) -> dict[str, Any]:
        return {"live": self.send(Call("GET", "/v2/health/live")).status == 200,
                "ready": self.send(Call("GET", "/v2/health/ready")).status == 200}

    def server(self) -> Any:
        return self.get("/v2")

    def models(self) -> Any:
        return self.get("/v2/models")

    def model(self, name: str = DEFAULT_MODEL) -> Any:
        return self.get(f"/v2/models/{name}")

    def metrics(self) -> str:
        return checked(self.send(Call("GET", "/metrics"))).body.decode()

    def status(self) -> Any:
        return self.get("/status")

    def infer(self, audio: np.ndarray, model: str = DEFAULT_MODEL, **kwargs: Any) -> np.ndarray:
        return infer_result(checked(self.send(infer_call(model, audio, **kwargs))))

    def segments(self, wav: bytes, model: str = DEFAULT_MODEL, **params: float) -> Any:
        return checked(self.send(segments_call(model, wav, **params))).json()

    def stream_segments(self, wav: bytes, model: str = DEFAULT_MODEL, **params: float) -> Iterator[Any]:
        """Each speech segment as soon as the daemon finds it final, then a summary with "done"."""
        return json_lines(self.transport.stream(segments_call(model, wav, stream="true", **params)))


@dataclass
class AsyncClient:
    """The same over asyncio, for apps that stream many sequences at once."""

    socket_path: str
    _reader: ResponseReader = field(default_factory=ResponseReader)
    _streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def send(self, call: Call) -> HttpResponse:
        if self._streams is None:
            try:
                self._streams = await asyncio.open_unix_connection(self.socket_path, limit=1 << 22)
            except OSError as exc:
                raise unix_connect_error(self.socket_path, exc, 0.0) from None
            self._reader = ResponseReader()
        stream_in, stream_out = self._streams
        stream_out.write(call.encode())
        while not self._reader.done:
            data = await stream_in.read(1 << 20)
            if not data:
                await self.close()
                raise ConnectError(f"the daemon at {self.socket_path} closed the connection before it answered")
            self._reader.feed(data)
        return self._reader.done.pop(0)

    async def infer(self, audio: np.ndarray, model: str = DEFAULT_MODEL, **kwargs: Any) -> np.ndarray:
        return infer_result(checked(await self.send(infer_call(model, audio, **kwargs))))

    async def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

"""Python client for the appliance API over the Unix socket (HTTP/1.1, keep-alive).

`Client` is blocking, for scripts and on-box apps; `AsyncClient` is the same over asyncio.
Both build requests and read responses with the same functions below.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator
from urllib.parse import urlencode

import httptools
import numpy as np

from appliance.api.tensors import decode_response, encode_request

DEFAULT_MODEL = "silero_vad"


class ClientError(Exception):
    """The daemon answered with an error status; `message` is its {"error": ...} text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


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
        raise ClientError(response.status, message)
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
                raise ClientError(200, doc["error"])
            yield doc


def segments_call(model: str, wav: bytes, **params: float) -> Call:
    query = f"?{urlencode(params)}" if params else ""
    return Call("POST", f"/v2/models/{model}/segments{query}", wav, (("content-type", "audio/wav"),))


class UnixTransport:
    """HTTP/1.1 on the Unix socket; one keep-alive connection, reopened if the daemon closed it.

    `busy_poll_s`: spin on the socket this long before sleeping in recv. A latency-critical
    on-box app trades a core for the wake-up of a sleeping CPU (tens of microseconds in a VM).
    """

    def __init__(self, socket_path: str, timeout: float, busy_poll_s: float = 0.0) -> None:
        self.socket_path, self.timeout, self.busy_poll_s = socket_path, timeout, busy_poll_s
        self._sock: socket.socket | None = None
        self._reader = ResponseReader()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.settimeout(self.timeout)
            self._sock.connect(self.socket_path)
            self._reader = ResponseReader()
        return self._sock

    def stream(self, call: Call) -> Iterator[bytes]:
        """Send one call; yield its body in pieces as they arrive (an error status raises first)."""
        sock, reader = self._connect(), self._reader
        reader.status, reader.arrived = 0, []  # what is left of the previous response is not ours
        try:
            sock.sendall(call.encode())
            while not reader.done:
                if reader.status and reader.status < 400 and reader.arrived:
                    pieces, reader.arrived = reader.arrived, []
                    yield from pieces
                self._read(sock, reader)
        except BaseException:
            self.close()
            raise
        checked(self._take(reader))
        yield from reader.arrived

    def send(self, call: Call) -> HttpResponse:
        sock, reader = self._connect(), self._reader
        try:
            sock.sendall(call.encode())
            if self.busy_poll_s:
                self._busy_poll(sock, reader)
            while not reader.done:
                self._read(sock, reader)
        except BaseException:
            self.close()
            raise
        return self._take(reader)

    @staticmethod
    def _read(sock: socket.socket, reader: ResponseReader) -> None:
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("the daemon closed the connection")
        reader.feed(data)

    def _take(self, reader: ResponseReader) -> HttpResponse:
        """The completed response; the connection closes if the daemon said so."""
        response = reader.done.pop(0)
        if response.headers.get("connection") == "close":
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
                 certificate: tuple[str, str] | None = None, local_host: str = "") -> None:
        from appliance.quic_client import QuicSession  # aioquic is only needed by QUIC callers

        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="quic-client", daemon=True)
        self._thread.start()
        self._session = QuicSession(address, cafile, certificate, local_host)

    def send(self, call: Call) -> HttpResponse:
        future = asyncio.run_coroutine_threadsafe(self._session.send(call), self._loop)
        return future.result(self.timeout)

    def stream(self, call: Call) -> Iterator[bytes]:
        """Send one call; yield its body in pieces as they arrive (an error status raises first)."""
        parts = self._session.exchange(call)

        async def next_part() -> Any:
            return await anext(parts, None)

        def step() -> Any:
            return asyncio.run_coroutine_threadsafe(next_part(), self._loop).result(self.timeout)

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
                 certificate: tuple[str, str] | None = None, local_host: str = "") -> None:
        self.transport: UnixTransport | QuicTransport
        if quic is not None:
            self.transport = QuicTransport(quic, cafile, timeout, certificate, local_host)
        elif socket_path is not None:
            self.transport = UnixTransport(socket_path, timeout, busy_poll_s)
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
            self._streams = await asyncio.open_unix_connection(self.socket_path, limit=1 << 22)
            self._reader = ResponseReader()
        stream_in, stream_out = self._streams
        stream_out.write(call.encode())
        while not self._reader.done:
            data = await stream_in.read(1 << 20)
            if not data:
                await self.close()
                raise ConnectionError("the daemon closed the connection")
            self._reader.feed(data)
        return self._reader.done.pop(0)

    async def infer(self, audio: np.ndarray, model: str = DEFAULT_MODEL, **kwargs: Any) -> np.ndarray:
        return infer_result(checked(await self.send(infer_call(model, audio, **kwargs))))

    async def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

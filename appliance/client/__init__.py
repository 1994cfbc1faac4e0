"""Python client for the appliance API: the Unix socket (HTTP/1.1, keep-alive) or QUIC (HTTP/3).

`Client` is blocking, for scripts and on-box apps; `AsyncClient` is the same over asyncio on the Unix
socket. The HTTP codec (`http`), the transports (`unix`, `quic`) and the errors (`errors`) are modules
of their own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.client.errors import (
    CertificateRejected,
    ClientError,
    ConnectError,
    NoAnswer,
    ServerError,
    SocketUnreachable,
    describe_path,
    parse_quic_address,
    unix_connect_error,
)
from appliance.client.http import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MODEL,
    Call,
    HttpResponse,
    ResponseReader,
    checked,
    infer_call,
    infer_result,
    interpret_call,
    json_lines,
    recording_call,
    segments_call,
    speech_call,
    tensors_call,
    tensors_result,
    translate_call,
)
from appliance.client.quic import QuicTransport
from appliance.client.unix import UnixTransport

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_MODEL",
    "AsyncClient",
    "Call",
    "CertificateRejected",
    "Client",
    "ClientError",
    "ConnectError",
    "HttpResponse",
    "NoAnswer",
    "ServerError",
    "SocketUnreachable",
    "describe_path",
    "infer_call",
    "parse_quic_address",
    "tensors_call",
]


class Client:
    """Blocking client over the Unix socket (`Client(path)`) or QUIC (`Client(quic="host:port")`)."""

    def __init__(
        self,
        socket_path: str | None = None,
        timeout: float = 120.0,
        busy_poll_s: float = 0.0,
        quic: str | None = None,
        cafile: str | None = None,
        certificate: tuple[str, str] | None = None,
        local_host: str = "",
        connect_timeout: float | None = None,
    ) -> None:
        """`timeout`: how long the daemon may be silent; `connect_timeout`: how long connecting may take
        (default: the QUIC handshake DEFAULT_CONNECT_TIMEOUT_S, a Unix socket `timeout`, where only a
        full backlog makes it wait). Errors: `ServerError` (it answered 4xx/5xx), `ConnectError` (not
        reached, or the connection broke; `SocketUnreachable`, `NoAnswer`, `CertificateRejected` are
        kinds of it), both `ClientError`."""
        self.transport: UnixTransport | QuicTransport
        if quic is not None:
            self.transport = QuicTransport(
                quic,
                cafile,
                timeout,
                certificate,
                local_host,
                DEFAULT_CONNECT_TIMEOUT_S if connect_timeout is None else connect_timeout,
            )
        elif socket_path is not None:
            self.transport = UnixTransport(socket_path, timeout, busy_poll_s, connect_timeout)
        else:
            raise ValueError("Client needs a socket path or quic='host:port'")

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, call: Call) -> HttpResponse:
        """Send one call and return the raw response, whatever its status."""
        return self.transport.send(call)

    def get(self, path: str) -> Any:
        return checked(self.send(Call("GET", path))).json()

    def health(self) -> dict[str, Any]:
        return {
            "live": self.send(Call("GET", "/v2/health/live")).status == 200,
            "ready": self.send(Call("GET", "/v2/health/ready")).status == 200,
        }

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

    def infer(self, model: str, inputs: dict[str, np.ndarray], **kwargs: Any) -> dict[str, np.ndarray]:
        """Any model: input tensors by name in, output tensors by name out. Keywords as `tensors_call`
        takes them: sequence_id, start, end (Triton's sequence parameters), binary, outputs, version."""
        return tensors_result(checked(self.send(tensors_call(model, inputs, **kwargs))))

    def speech_probs(self, audio: np.ndarray, model: str = DEFAULT_MODEL, **kwargs: Any) -> np.ndarray:
        """The VAD: audio samples at 16 kHz in, one speech probability per 512-sample frame out."""
        return infer_result(checked(self.send(infer_call(model, audio, **kwargs))))

    def segments(self, wav: bytes, model: str = DEFAULT_MODEL, **params: float) -> Any:
        return checked(self.send(segments_call(model, wav, **params))).json()

    def stream_segments(self, wav: bytes, model: str = DEFAULT_MODEL, **params: float) -> Iterator[Any]:
        """Each speech segment as soon as the daemon finds it final, then a summary with "done"."""
        return json_lines(self.transport.stream(segments_call(model, wav, stream="true", **params)))

    def stream_speech(
        self, text: str, voice: str, model: str = "tts-1", response_format: str = "wav", speed: float = 1.0
    ) -> Iterator[bytes]:
        """The audio of `text` (POST /v1/audio/speech), piece by piece as each sentence is ready."""
        return self.transport.stream(speech_call(text, model, voice, response_format, speed))

    def speech(
        self, text: str, voice: str, model: str = "tts-1", response_format: str = "wav", speed: float = 1.0
    ) -> bytes:
        return checked(self.send(speech_call(text, model, voice, response_format, speed))).body

    def translate(self, q: str | list[str], source: str, target: str) -> Any:
        """`q` translated (POST /translate): a string, or a list for a list."""
        return checked(self.send(translate_call(q, source, target))).json()["translatedText"]

    def stream_interpret(
        self, audio: bytes, model: str, to: str | None = None, source: str | None = None, languages: str | None = None
    ) -> Iterator[Any]:
        """A recording through a speech pipeline: a document per segment as soon as it is spoken (times,
        each stage's text, its target and route, base64 PCM16 audio), then a summary with "done". No
        `to`: conversation mode between `languages` (else the pipeline's two)."""
        return json_lines(self.transport.stream(interpret_call(model, audio, to, source, languages)))

    def languages(self) -> Any:
        return self.get("/languages")

    def transcribe(self, audio: bytes, model: str, **params: str) -> HttpResponse:
        """A recording's text (a speech_to_text model): language, task, prompt, response_format."""
        return checked(self.send(recording_call(model, "transcribe", audio, **params)))

    def stream_transcribe(self, audio: bytes, model: str, **params: str) -> Iterator[Any]:
        """Each segment's text as soon as it is decoded, then a summary with "done"."""
        return json_lines(self.transport.stream(recording_call(model, "transcribe", audio, stream="true", **params)))

    def live(
        self,
        chunk: np.ndarray,
        model: str,
        sequence_id: int | str,
        start: bool = False,
        end: bool = False,
        **params: Any,
    ) -> dict[str, np.ndarray]:
        """One chunk of a live stream (parameters partial=, language=, task=): its outputs."""
        call = tensors_call(model, {"audio": chunk}, sequence_id, start, end, parameters=params)
        return tensors_result(checked(self.send(call)))


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

    async def infer(self, model: str, inputs: dict[str, np.ndarray], **kwargs: Any) -> dict[str, np.ndarray]:
        return tensors_result(checked(await self.send(tensors_call(model, inputs, **kwargs))))

    async def speech_probs(self, audio: np.ndarray, model: str = DEFAULT_MODEL, **kwargs: Any) -> np.ndarray:
        return infer_result(checked(await self.send(infer_call(model, audio, **kwargs))))

    async def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None

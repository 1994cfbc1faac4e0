"""HTTP/1.1 as the client speaks it, without I/O: calls encoded, responses parsed (httptools), and
the API's calls and results (infer, segments) built and read. Both transports share it."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httptools
import numpy as np

from appliance.client.errors import ServerError
from appliance.protocol import json_text
from appliance.protocol.tensors import NUMPY_TYPES, tensor_entry

DEFAULT_MODEL = "silero_vad"
DEFAULT_CONNECT_TIMEOUT_S = 5.0  # connecting, and the QUIC handshake: an unreachable daemon fails this fast


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
            error = response.json()["error"]
            # KServe's {"error": "..."}, or OpenAI's {"error": {"message": "...", "type": ...}}
            message = error["message"] if isinstance(error, dict) else error
            if not isinstance(message, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            message = response.body.decode("utf-8", "replace")
        raise ServerError(response.status, " ".join(message.split()))
    return response


# --- calls: how each API operation is asked and read --------------------------------------------


def tensors_call(
    model: str,
    inputs: dict[str, np.ndarray],
    sequence_id: int | str | None = None,
    start: bool = False,
    end: bool = False,
    binary: bool = True,
    outputs: list[str] | None = None,
    version: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> Call:
    """An infer call of any model: its input tensors by name (binary tensors by default), Triton's
    sequence parameters, and the outputs to return (all when None)."""
    params: dict[str, Any] = dict(parameters or {})
    if sequence_id is not None:
        params.update(sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    arrays = {name: np.asarray(array) for name, array in inputs.items()}
    body, header_length = encode_request(arrays, params, binary, outputs=outputs)
    headers = [("content-type", "application/octet-stream" if binary else "application/json")]
    if header_length is not None:
        headers.append(("inference-header-content-length", str(header_length)))
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version is not None else "") + "/infer"
    return Call("POST", path, body, tuple(headers))


def tensors_result(response: HttpResponse) -> dict[str, np.ndarray]:
    length = response.headers.get("inference-header-content-length")
    return decode_response(response.body, int(length) if length else None)


def infer_call(model: str, audio: np.ndarray, **kwargs: Any) -> Call:
    """The VAD's infer call: audio samples (FP32 or INT16) in, as `tensors_call` takes the rest."""
    return tensors_call(model, {"audio": audio}, **kwargs)


def infer_result(response: HttpResponse) -> np.ndarray:
    """The VAD's speech probabilities, one per frame."""
    return tensors_result(response)["speech_prob"]


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


def segments_call(model: str, audio: bytes, **params: float | str) -> Call:
    """A recording (WAV, FLAC or Ogg, as the file holds it) -> the segments route."""
    return recording_call(model, "segments", audio, **params)


def recording_call(model: str, route: str, audio: bytes, **params: float | str) -> Call:
    """A recording (WAV, FLAC or Ogg, as the file holds it) -> a model's route (segments, transcribe)."""
    query = f"?{urlencode(params)}" if params else ""
    content_type = AUDIO_TYPES.get(audio[:4], "application/octet-stream")
    return Call("POST", f"/v2/models/{model}/{route}{query}", audio, (("content-type", content_type),))


def form_call(path: str, fields: list[tuple[str, str]], files: dict[str, bytes]) -> Call:
    """A multipart/form-data POST (OpenAI's audio routes): text fields (a name may repeat) and files."""
    boundary = "appliance-form-" + uuid.uuid4().hex
    parts = [f'--{boundary}\r\ncontent-disposition: form-data; name="{n}"\r\n\r\n{v}\r\n'.encode() for n, v in fields]
    for name, data in files.items():
        head = f'--{boundary}\r\ncontent-disposition: form-data; name="{name}"; filename="{name}"\r\n'
        parts.append(head.encode() + b"content-type: application/octet-stream\r\n\r\n" + data + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    return Call("POST", path, body, (("content-type", f"multipart/form-data; boundary={boundary}"),))


def encode_request(
    inputs: dict[str, np.ndarray],
    parameters: dict[str, Any] | None = None,
    binary: bool = True,
    request_id: str | None = None,
    outputs: list[str] | None = None,
) -> tuple[bytes, int | None]:
    """Client side: an infer request body (binary tensors by default) and its JSON header length."""
    chunks: list[bytes] = []
    entries = [tensor_entry(name, np.asarray(array), binary, chunks) for name, array in inputs.items()]
    doc: dict[str, Any] = {"inputs": entries}
    if request_id is not None:
        doc["id"] = request_id
    if outputs is not None:
        doc["outputs"] = [{"name": name, "parameters": {"binary_data": binary}} for name in outputs]
    params = dict(parameters or {})
    if binary:
        params["binary_data_output"] = True
    if params:
        doc["parameters"] = params
    header = json_text.dumps(doc).encode()
    return (b"".join([header, *chunks]), len(header)) if binary else (header, None)


def decode_response(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """Client side: the outputs of an infer response as arrays."""
    head = body if header_length is None else body[:header_length]
    doc = json.loads(head)
    offset = header_length or 0
    outputs = {}
    for entry in doc["outputs"]:
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if entry["datatype"] == "BYTES":
            count = math.prod(entry["shape"])
            if size is not None:
                values: list[bytes] = []
                at = offset
                while len(values) < count:  # Triton's binary strings: a 4-byte little-endian length, the bytes
                    length = int.from_bytes(body[at : at + 4], "little")
                    values.append(body[at + 4 : at + 4 + length])
                    at += 4 + length
                offset += size
            else:
                values = [v.encode() for v in entry["data"]]
            array = np.empty(count, object)
            array[:] = values
            outputs[entry["name"]] = array.reshape(entry["shape"])
            continue
        dtype = np.dtype(NUMPY_TYPES[entry["datatype"]])
        if size is not None:
            outputs[entry["name"]] = np.frombuffer(body, dtype, size // dtype.itemsize, offset).reshape(entry["shape"])
            offset += size
        else:
            outputs[entry["name"]] = np.asarray(entry["data"], dtype).reshape(entry["shape"])
    return outputs


def speech_call(text: str, model: str, voice: str, response_format: str = "wav", speed: float = 1.0) -> Call:
    """OpenAI's text-to-speech route."""
    doc = {"model": model, "input": text, "voice": voice, "response_format": response_format, "speed": speed}
    return Call("POST", "/v1/audio/speech", json.dumps(doc).encode(), (("content-type", "application/json"),))


def translate_call(q: str | list[str], source: str, target: str) -> Call:
    """LibreTranslate's translate route."""
    doc = {"q": q, "source": source, "target": target, "format": "text"}
    return Call("POST", "/translate", json.dumps(doc).encode(), (("content-type", "application/json"),))


def interpret_call(
    model: str, audio: bytes, to: str | None = None, source: str | None = None, languages: str | None = None
) -> Call:
    """A recording -> a speech pipeline's interpret route (NDJSON: a line per segment, then "done"); no
    `to`: conversation mode, each turn into the other of `languages` ("en,pt", else the pipeline's two)."""
    asked = {k: v for k, v in (("to", to), ("from", source), ("languages", languages)) if v}
    query = f"?{urlencode(asked)}" if asked else ""
    content_type = AUDIO_TYPES.get(audio[:4], "application/octet-stream")
    return Call("POST", f"/v2/models/{model}/interpret{query}", audio, (("content-type", content_type),))

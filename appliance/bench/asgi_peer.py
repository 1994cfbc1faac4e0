"""The peer for `appliance bench`: the VAD's infer endpoint as an ASGI app, written the usual way,
served by Hypercorn over HTTP/3 (Hypercorn also uses aioquic). One ORT call per request, no batching.

Run by the bench (hypercorn_peer) as:
hypercorn --quic-bind HOST:PORT --certfile ... --keyfile ... appliance.bench.asgi_peer:app
with APPLIANCE_BENCH_MODEL naming the verified bundle's model file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from appliance.engine.onnx_cpu import session
from appliance.protocol.tensors import HEADER_LENGTH, decode_infer, encode_infer

_session = session(Path(os.environ["APPLIANCE_BENCH_MODEL"]), threads=1)
_SR = np.array(16000, np.int64)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
    request = decode_infer(body, headers.get(HEADER_LENGTH))
    audio = request.inputs["audio"].reshape(1, -1)
    x = np.concatenate([np.zeros((1, 64), np.float32), audio], axis=1)
    out, _ = _session.run(None, {"input": x, "state": np.zeros((2, 1, 128), np.float32), "sr": _SR})
    payload, header_length = encode_infer("silero_vad", "1", request, {"speech_prob": out[:, 0]}, {})
    response_headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(payload)).encode())]
    if header_length is not None:
        response_headers.append((b"inference-header-content-length", str(header_length).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": response_headers})
    await send({"type": "http.response.body", "body": payload})

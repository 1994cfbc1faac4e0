"""Issue 47, item 12: the red team's four cross-origin attacks, each on every listener of a box with NO
API keys (the shared interpreter daemon: the Unix socket, HTTPS and HTTP/3, two protocol workers).
A web page of another origin may open a Realtime WebSocket (`Origin: https://evil.example`), or POST
`/translate`, `/detect` and `/v1/audio/speech` in the bodies a browser sends cross-origin without a
preflight (CORS "simple" requests: text/plain, form-urlencoded, multipart). Each is refused with a 403
and a one-line reason before its handler runs (no model is asked), counted per listener; the same
request from the box's own origin, or from a client that is no browser (no Origin), is served."""

from __future__ import annotations

import asyncio
import json
import re
import ssl

import httpx2
import pytest
import websockets
from aioquic.asyncio import connect
from aioquic.h3.events import HeadersReceived
from conftest import Daemon
from test_access import refused
from test_realtime_h3 import H3Client, configuration

from appliance.client import Call, Client

EVIL = "https://evil.example"
REALTIME = "/v1/realtime?intent=transcription"
JSON_TEXT = {  # each route's JSON, as a page's fetch() sends it with `content-type: text/plain`
    "/translate": {"q": "Good morning.", "source": "en", "target": "pt"},
    "/detect": {"q": "Bom dia, como vai?"},
    "/v1/audio/speech": {"model": "tts-1", "voice": "joe", "input": "Hello there.", "response_format": "pcm"},
}
LISTENERS = ("unix", "https", "quic")


def simple_requests() -> list[tuple[str, bytes, str]]:
    """(path, body, content type) of every CORS simple request the attacks send."""
    found = [(path, json.dumps(doc).encode(), "text/plain") for path, doc in JSON_TEXT.items()]
    form = b"q=Good+morning.&source=en&target=pt"
    found.append(("/translate", form, "application/x-www-form-urlencoded"))
    boundary = "evilboundary"
    parts = "".join(
        f'--{boundary}\r\ncontent-disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
        for name, value in (("q", "Good morning."), ("source", "en"), ("target", "pt"))
    )
    found.append(("/translate", f"{parts}--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"))
    return found


def models_asked(daemon: Daemon) -> float:
    """Requests every model of the daemon has answered or failed (Triton's counters): a handler that ran
    for a refused request would raise them."""
    with daemon.client() as client:
        text = client.metrics()
    counted = re.findall(r"^nv_inference_request_(?:success|failure)\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(n) for n in counted)


def post(daemon: Daemon, listener: str, path: str, body: bytes, content_type: str, origin: str | None) -> int:
    """The status of a POST on `listener`, with `origin` as a browser would send it (None: no browser)."""
    headers = {"content-type": content_type, **({"origin": origin} if origin else {})}
    if listener == "https":
        context = ssl.create_default_context(cafile=daemon.cafile)
        with httpx2.Client(base_url=daemon.https_url, verify=context, timeout=120) as http:
            return http.post(path, content=body, headers=headers).status_code
    quic = Client(quic=f"127.0.0.1:{daemon.quic_port}", cafile=daemon.cafile, timeout=120)
    with Client(str(daemon.socket), timeout=120) if listener == "unix" else quic as client:
        return client.send(Call("POST", path, body, tuple(headers.items()))).status


def own_origin(daemon: Daemon, listener: str) -> str | None:
    """The box's own page's origin where a browser can be (HTTPS); elsewhere a client with no Origin."""
    return daemon.https_url if listener == "https" else None


@pytest.mark.parametrize("listener", LISTENERS)
def test_cross_origin_simple_posts_are_refused_before_any_model_runs(interpreter_daemon: Daemon, listener: str) -> None:
    daemon = interpreter_daemon
    for path, body, content_type in simple_requests():
        before, asked = refused(daemon).get(("origin", listener), 0), models_asked(daemon)
        assert post(daemon, listener, path, body, content_type, EVIL) == 403, (path, content_type)
        assert refused(daemon).get(("origin", listener), 0) == before + 1, (path, content_type)
        assert models_asked(daemon) == asked, f"{path} ({content_type}) ran for {EVIL}"
        assert post(daemon, listener, path, body, content_type, "null") == 403  # a sandboxed frame, a data: URL
    for path, doc in JSON_TEXT.items():  # the same requests from the box's own page, or no browser
        body = json.dumps(doc).encode()
        assert post(daemon, listener, path, body, "application/json", own_origin(daemon, listener)) == 200, path


def refusal_of_websocket(daemon: Daemon, listener: str, origin: str) -> int:
    """The status of a Realtime WebSocket upgrade from a page at `origin` (101 or 200: opened)."""
    if listener == "quic":
        return asyncio.run(h3_websocket_status(daemon, origin))

    async def opened() -> int:
        if listener == "unix":
            connecting = websockets.unix_connect(str(daemon.socket), f"ws://localhost{REALTIME}", origin=origin)
        else:
            context = ssl.create_default_context(cafile=daemon.cafile)
            connecting = websockets.connect(
                f"wss://127.0.0.1:{daemon.https_port}{REALTIME}", ssl=context, origin=origin
            )
        try:
            async with connecting:
                return 101
        except websockets.InvalidStatus as refusal:
            return refusal.response.status_code

    return asyncio.run(opened())


async def h3_websocket_status(daemon: Daemon, origin: str) -> int:
    """An RFC 9220 extended CONNECT with `origin`, as a browser opening a WebSocket over HTTP/3 would."""
    async with connect(
        "127.0.0.1", daemon.quic_port, configuration=configuration(daemon), create_protocol=H3Client
    ) as h3:
        stream_id = h3._quic.get_next_available_stream_id()
        headers = [
            (b":method", b"CONNECT"),
            (b":protocol", b"websocket"),
            (b":scheme", b"https"),
            (b":authority", f"127.0.0.1:{daemon.quic_port}".encode()),
            (b":path", REALTIME.encode()),
            (b"sec-websocket-version", b"13"),
            (b"origin", origin.encode()),
        ]
        h3.h3.send_headers(stream_id, headers)
        h3.transmit()
        answer = await asyncio.wait_for(h3.queue(stream_id).get(), 30)
        assert isinstance(answer, HeadersReceived), answer
        return int(dict(answer.headers)[b":status"])


@pytest.mark.parametrize("listener", LISTENERS)
def test_a_realtime_websocket_from_another_origin_is_refused(interpreter_daemon: Daemon, listener: str) -> None:
    daemon = interpreter_daemon
    before = refused(daemon).get(("origin", listener), 0)
    assert refusal_of_websocket(daemon, listener, EVIL) == 403
    assert refused(daemon).get(("origin", listener), 0) == before + 1
    if listener != "unix":  # a browser reaches the box's page over HTTPS (or HTTP/3): its own origin opens
        port = daemon.https_port if listener == "https" else daemon.quic_port
        assert refusal_of_websocket(daemon, listener, f"https://127.0.0.1:{port}") in (101, 200)

"""Who may use the box (api/access): API keys as each real client sends them, per listener, Wyoming's
address allow-list, browsers held to the box's page, room secrets, each key's share, and revocation at
SIGHUP. One interpreter daemon (HTTPS, QUIC, Wyoming on TCP, two protocol workers) with a key file the
real `appliance keys add` wrote.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import ssl
import subprocess
import threading
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import httpx2
import numpy as np
import openai
import pytest
import tritonclient.http as httpclient
import websockets
from conftest import APPLIANCE, ROOT, Daemon, free_tcp_port
from libretranslatepy import LibreTranslateAPI
from tritonclient.utils import InferenceServerException
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info

from appliance.client import Client, ServerError
from appliance.client.http import Call

PIPELINE = "interpreter"
KEYS = {  # name: `appliance keys add` options
    "hall": [],
    "kiosk": ["--routes", "translate,languages"],
    "flood": ["--requests-per-minute", "30"],
    "guest": ["--sessions", "1"],
    "leaver": [],
    "talker": ["--audio-seconds-per-hour", "2"],
}


def add_key(key_file: Path, name: str, *options: str) -> str:
    out = subprocess.run(
        [*APPLIANCE, "keys", "add", name, "--file", str(key_file), *options],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    return re.search(r"^box-\S+$", out, re.M)[0]


@pytest.fixture(scope="module")
def box(tmp_path_factory, keys, interpreter_bundle, tls) -> Iterator[Daemon]:
    workdir = tmp_path_factory.mktemp("access")
    key_file = workdir / "api-keys.toml"
    secrets = {name: add_key(key_file, name, *options) for name, options in KEYS.items()}
    port = free_tcp_port()
    extra = (
        f'[access]\nkeys = "{key_file}"\n[wyoming]\ntcp = "127.0.0.1:{port}"\nallow = "127.0.0.1/32, 127.0.0.2/32"\n'
    )
    d = Daemon(workdir, interpreter_bundle, keys.trusted, extra=extra, tls=tls, https="", workers=2)
    d.secrets, d.key_file, d.wyoming_port = secrets, key_file, port  # type: ignore[attr-defined]
    yield d.wait_ready(240)
    assert d.stop() == 0, d.log.read_text()


def refused(box: Daemon) -> dict[tuple[str, str], int]:
    with box.client() as client:  # the Unix socket: an operator, no key
        text = client.metrics()
    found = re.findall(r'appliance_refused_total\{reason="(\w+)",listener="(\w+)"\} (\d+)', text)
    return {(reason, listener): int(n) for reason, listener, n in found}


def https(box: Daemon) -> httpx2.Client:
    return httpx2.Client(base_url=box.https_url, verify=ssl.create_default_context(cafile=box.cafile), timeout=120)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_openai_sdk_rest_needs_a_key_of_the_box(box: Daemon) -> None:
    http = https(box)
    good = openai.OpenAI(api_key=box.secrets["hall"], base_url=box.https_url + "/v1", http_client=http, max_retries=0)
    assert PIPELINE in [m.id for m in good.models.list()]
    pcm = good.audio.speech.create(model="tts-1", voice="joe", input="Hello there.", response_format="pcm").content
    assert len(pcm) > 22050  # over half a second of speech
    before = refused(box)
    wrong = openai.OpenAI(api_key="on-box", base_url=box.https_url + "/v1", http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="not one of this box's"):
        wrong.models.list()
    answer = http.get("/v1/models")  # no key at all
    assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Bearer")
    assert answer.json()["error"]["message"] == "this box needs an API key (Authorization: Bearer KEY)"
    after = refused(box)
    assert after[("bad_key", "https")] == before.get(("bad_key", "https"), 0) + 1
    assert after[("no_key", "https")] == before.get(("no_key", "https"), 0) + 1
    log = box.log.read_text()  # one line per reason (and 10 s), not one per refusal
    assert "limit: refused (bad_key, https)" in log and "limit: refused (no_key, https)" in log


def realtime(box: Daemon, secret: str, **query: str):
    """The openai package's Realtime client over HTTPS (its websockets connection), with `secret` as its key."""
    client = openai.AsyncOpenAI(api_key=secret, base_url=box.https_url + "/v1", max_retries=0)
    context = ssl.create_default_context(cafile=box.cafile)
    return client.realtime.connect(
        extra_query=query or {"intent": "transcription"}, websocket_connection_options={"ssl": context}
    )


async def first_event(connection) -> str:
    return (await connection.recv()).type


def test_openai_realtime_client_with_and_without_a_key(box: Daemon) -> None:
    async def run() -> str:
        async with realtime(box, box.secrets["hall"]) as connection:
            return await first_event(connection)

    assert asyncio.run(asyncio.wait_for(run(), 60)).endswith("created")
    with pytest.raises(websockets.InvalidStatus) as refusal:

        async def wrong() -> None:
            async with realtime(box, "box-guessed") as connection:
                await first_event(connection)

        asyncio.run(asyncio.wait_for(wrong(), 60))
    assert refusal.value.response.status_code == 401


def test_libretranslatepy_sends_its_api_key_field(box: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", box.cafile)  # urllib's default context trusts the box's certificate
    kiosk = LibreTranslateAPI(box.https_url + "/", api_key=box.secrets["kiosk"])
    assert "estação" in kiosk.translate("Where is the train station?", "en", "pt").lower()
    assert {"code": "en", "name": "English", "targets": ["pt"]} in kiosk.languages()
    with pytest.raises(urllib.error.HTTPError) as refusal:
        LibreTranslateAPI(box.https_url + "/").translate("Good morning.", "en", "pt")
    assert refusal.value.code == 401
    # as LibreTranslate, its settings tell a client without a key that one is needed
    settings = https(box).get("/frontend/settings").json()
    assert settings["apiKeys"] is True and settings["keyRequired"] is True, settings
    # the kiosk's key is for translation only: the OpenAI routes are not its own
    answer = https(box).get("/v1/models", headers=bearer(box.secrets["kiosk"]))
    assert answer.status_code == 403 and answer.json()["error"]["message"] == "key:kiosk may not use openai_models"


def test_tritonclient_with_a_header(box: Daemon) -> None:
    triton = httpclient.InferenceServerClient(
        f"127.0.0.1:{box.https_port}", ssl=True, ssl_options={"ca_certs": box.cafile}
    )
    tensor = httpclient.InferInput("audio", [1024], "FP32")
    tensor.set_data_from_numpy(np.zeros(1024, np.float32), binary_data=True)
    result = triton.infer("silero_vad", [tensor], headers=bearer(box.secrets["hall"]))
    assert result.as_numpy("speech_prob").shape == (2,)
    with pytest.raises(InferenceServerException, match="needs an API key"):
        triton.infer("silero_vad", [tensor])
    assert triton.is_server_ready()  # health is public: a load balancer needs no key
    triton.close()


def test_quic_needs_a_key_and_the_unix_socket_does_not(box: Daemon) -> None:
    with Client(quic=f"127.0.0.1:{box.quic_port}", cafile=box.cafile, timeout=60) as quic:
        with pytest.raises(ServerError, match="needs an API key"):
            quic.models()
        keyed = quic.send(Call("GET", "/v2/models", headers=(("authorization", f"Bearer {box.secrets['hall']}"),)))
        assert keyed.status == 200 and PIPELINE in keyed.body.decode()
    with box.client() as local:  # a local user of the socket's group: no key
        assert PIPELINE in [m["name"] for m in local.models()["models"]]
        assert "estação" in local.translate("Where is the train station?", "en", "pt").lower()


class FromAddress(AsyncTcpClient):
    """The wyoming package's TCP client, connecting from a chosen loopback address."""

    def __init__(self, source: str, port: int) -> None:
        super().__init__("127.0.0.1", port, connect_timeout=30, read_timeout=60)
        self.source = source

    async def connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(self.source, 0))


def test_wyoming_takes_only_the_allowed_addresses(box: Daemon) -> None:
    async def describe(source: str):
        async with FromAddress(source, box.wyoming_port) as client:
            await client.write_event(Describe().event())
            return await client.read_event()

    before = refused(box).get(("address", "wyoming"), 0)
    allowed = asyncio.run(describe("127.0.0.2"))
    assert Info.is_type(allowed.type) and Info.from_event(allowed).asr
    refusal = asyncio.run(describe("127.0.0.3"))
    assert Error.is_type(refusal.type)
    assert Error.from_event(refusal).text == "address 127.0.0.3 may not use Wyoming here (wyoming.allow)"
    assert refused(box)[("address", "wyoming")] == before + 1


def test_browsers_are_held_to_the_box_page(box: Daemon) -> None:
    http = https(box)
    page = http.get("/")  # the page is public: it is where a visitor types the room's PIN
    policy = page.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in policy and "default-src 'self'" in policy
    assert page.headers["x-content-type-options"] == "nosniff" and page.headers["referrer-policy"] == "no-referrer"
    doc = {"q": "Good morning.", "source": "en", "target": "pt"}
    own = http.post("/translate", json=doc, headers={**bearer(box.secrets["hall"]), "Origin": box.https_url})
    assert own.status_code == 200
    other = http.post("/translate", json=doc, headers={**bearer(box.secrets["hall"]), "Origin": "https://evil.example"})
    assert other.status_code == 403 and other.json()["error"] == "origin 'https://evil.example' is not this box's"

    async def upgrade() -> None:
        url = f"wss://127.0.0.1:{box.https_port}/v1/realtime?intent=transcription"
        context = ssl.create_default_context(cafile=box.cafile)
        async with websockets.connect(
            url, ssl=context, origin="https://evil.example", additional_headers=bearer(box.secrets["hall"])
        ):
            pass

    with pytest.raises(websockets.InvalidStatus) as refusal:
        asyncio.run(upgrade())
    assert refusal.value.response.status_code == 403


def room_pin(box: Daemon) -> str:
    """A room opened by `appliance room open`, as an operator opens one: its PIN."""
    opened = subprocess.run(
        [*APPLIANCE, "room", "open", "--minutes", "30", "--socket", str(box.socket)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    return re.search(r"room PIN (\d{8})", opened)[1]


def test_a_room_pin_buys_a_secret_for_the_interpreter_alone(box: Daemon) -> None:
    pin = room_pin(box)
    http = https(box)
    wrong = http.post("/v1/realtime/client_secrets", json={"room": "00000000" if pin != "00000000" else "1"})
    assert wrong.status_code == 401
    # the openai package's own call, as a page's server would make it (the PIN in place of a key)
    sdk = openai.OpenAI(api_key="no-key", base_url=box.https_url + "/v1", http_client=http, max_retries=0)
    made = sdk.realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": 600}, extra_body={"room": pin}
    )
    assert made.value.startswith("ek_") and made.session.type == "realtime" and made.session.model == PIPELINE
    secret = {"value": made.value}
    doc = {"q": "Good morning.", "source": "en", "target": "pt"}
    assert http.post("/translate", json=doc, headers=bearer(secret["value"])).status_code == 200
    assert http.get("/v1/audio/voices", headers=bearer(secret["value"])).status_code == 200
    assert http.post("/v2/models/silero_vad/infer", headers=bearer(secret["value"])).status_code == 403

    async def session(query: dict[str, str]) -> str:
        async with realtime(box, secret["value"], **query) as connection:
            return await first_event(connection)

    assert asyncio.run(asyncio.wait_for(session({"model": PIPELINE, "target": "pt"}), 60)).endswith("created")
    with pytest.raises(websockets.InvalidStatus) as refusal:  # not the room's interpreter: a plain transcription
        asyncio.run(asyncio.wait_for(session({"intent": "transcription"}), 60))
    assert refusal.value.response.status_code == 403


def test_one_key_flood_leaves_another_key_its_share(box: Daemon) -> None:
    flood_answers: list[int] = []
    stop = threading.Event()

    def flood() -> None:
        with https(box) as http:
            while not stop.is_set() and len(flood_answers) < 400:
                flood_answers.append(http.get("/v2/models", headers=bearer(box.secrets["flood"])).status_code)

    flooder = threading.Thread(target=flood)
    flooder.start()
    hall_answers = []
    with https(box) as http:
        while 429 not in flood_answers and flooder.is_alive():  # until the flood is refused ...
            hall_answers.append(http.get("/v2/models", headers=bearer(box.secrets["hall"])).status_code)
        for _ in range(30):  # ... and while it goes on
            hall_answers.append(http.get("/v2/models", headers=bearer(box.secrets["hall"])).status_code)
    stop.set()
    flooder.join(120)
    assert 429 in flood_answers and flood_answers[:30] == [200] * 30, flood_answers[:40]
    assert set(hall_answers) == {200}, hall_answers
    assert refused(box)[("rate", "https")] >= 1


def test_a_key_holds_its_sessions_share(box: Daemon) -> None:
    async def run() -> int:
        async with realtime(box, box.secrets["guest"]) as first:
            await first_event(first)
            try:
                async with realtime(box, box.secrets["guest"]) as second:
                    await first_event(second)
            except websockets.InvalidStatus as refusal:
                return refusal.response.status_code
        return 0

    assert asyncio.run(asyncio.wait_for(run(), 60)) == 429


def test_a_key_audio_share_ends_its_session_and_refuses_the_next(box: Daemon) -> None:
    """talker may send 2 s of audio an hour: its session is closed once 3 s of silence are appended."""
    silence = base64.b64encode(bytes(24000 * 2 // 10)).decode()  # 100 ms of PCM16 at 24 kHz

    async def run() -> tuple[int, str]:
        async with realtime(box, box.secrets["talker"]) as connection:
            await first_event(connection)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                for _ in range(30):
                    await connection.input_audio_buffer.append(audio=silence)
                while True:
                    await connection.recv()
            return closed.value.rcvd.code, closed.value.rcvd.reason

    assert asyncio.run(asyncio.wait_for(run(), 60)) == (1008, "key:talker spent its audio share for this hour")

    async def again() -> None:
        async with realtime(box, box.secrets["talker"]) as connection:
            await first_event(connection)

    with pytest.raises(websockets.InvalidStatus) as refusal:
        asyncio.run(asyncio.wait_for(again(), 60))
    assert refusal.value.response.status_code == 429
    assert refused(box)[("audio", "https")] >= 2  # the close, and the session refused after it


def test_revocation_at_sighup_stops_that_key_alone(box: Daemon) -> None:
    async def run() -> tuple[int, str, str]:
        async with realtime(box, box.secrets["leaver"]) as leaver, realtime(box, box.secrets["hall"]) as hall:
            await first_event(leaver)
            await first_event(hall)
            subprocess.run([*APPLIANCE, "keys", "revoke", "leaver", "--file", str(box.key_file)], cwd=ROOT, check=True)
            box.proc.send_signal(signal.SIGHUP)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await leaver.recv()
            await hall.session.update(session={"type": "transcription"})
            answer = await first_event(hall)  # the other key's session goes on
            return closed.value.rcvd.code, closed.value.rcvd.reason, answer

    code, reason, answer = asyncio.run(asyncio.wait_for(run(), 120))
    assert (code, reason) == (1008, "key:leaver was revoked")
    assert answer.endswith("updated"), answer
    assert https(box).get("/v2/models", headers=bearer(box.secrets["leaver"])).status_code == 401
    assert https(box).get("/v2/models", headers=bearer(box.secrets["hall"])).status_code == 200
    assert json.loads(https(box).get("/v2/health/ready").text)["ready"]

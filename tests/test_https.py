"""HTTPS on TCP as LAN clients reach the box: Debian's curl, the openai package, tritonclient and
libretranslatepy, each over TLS with the box's own certificate; mutual TLS; Alt-Svc leading an aioquic
client to QUIC; sequences owned by the connection (or the client certificate). The interpreter
firmware, so that every route family has a model behind it; two protocol workers accept on the port."""

from __future__ import annotations

import http.client
import io
import json
import re
import socket
import ssl
import subprocess
import time
from pathlib import Path

import httpx2
import numpy as np
import openai
import pytest
import soundfile
import tritonclient.http as httpclient
from conftest import ROOT, Daemon
from libretranslatepy import LibreTranslateAPI
from promtext import sample
from speech import RATE, recording
from test_quic import make_ca_and_client
from tritonclient.utils import InferenceServerException

from appliance.audio import encode_wav
from appliance.client import Call, Client
from appliance.kinds.speech import SHARDS_AHEAD

SENTENCE = "The doctor works at the hospital every morning."
FRAME = np.zeros(512, np.float32)


@pytest.fixture(scope="module")
def daemon(interpreter_daemon: Daemon) -> Daemon:
    return interpreter_daemon


def curl(daemon: Daemon, path: str, *args: str, cafile: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """Debian's curl over HTTPS/1.1: the status, the headers (lower-case names) and the body."""
    result = subprocess.run(
        ["curl", "-sS", "--http1.1", "-D", "-", "--cacert", cafile or daemon.cafile, *args, daemon.https_url + path],
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()
    head, _, body = result.stdout.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def english_wav(tmp_path: Path) -> Path:
    path = tmp_path / "english.wav"
    path.write_bytes(encode_wav(recording([SENTENCE])[0], RATE))
    return path


def test_curl_over_https_on_every_route_family(daemon: Daemon, tmp_path: Path) -> None:
    alt_svc = f'h3=":{daemon.quic_port}"; ma=86400'
    wav = english_wav(tmp_path)
    infer = json.dumps({"inputs": [{"name": "audio", "datatype": "FP32", "shape": [512], "data": [0.0] * 512}]})
    assert daemon.operator is not None
    operator = ["--cert", daemon.operator[0], "--key", daemon.operator[1]]  # a certificate the operator CA signed
    calls = {
        "/v2/health/ready": [],
        "/v2/models/silero_vad/config": [],
        "/v2/models/silero_vad/infer": ["-H", "content-type: application/json", "--data-binary", infer],
        "/v2/models/silero_vad/segments": ["--data-binary", f"@{wav}"],
        "/v2/repository/index": ["-X", "POST"],
        "/metrics": operator,
        "/status": operator,
        "/languages": [],
        "/translate": ["-H", "content-type: application/json", "--data", json.dumps({"q": SENTENCE, "source": "en", "target": "pt"})],
        "/v1/audio/speech": ["-H", "content-type: application/json", "--data", json.dumps({"model": "tts-1", "voice": "joe", "input": SENTENCE})],
        "/v1/audio/transcriptions": ["-F", f"file=@{wav}", "-F", "model=whisper_tiny_en"],
        "/": [],
        "/page/app.js": [],
        "/tls/certificate.pem": [],
    }  # fmt: skip
    answers = {}
    for path, args in calls.items():
        status, headers, body = curl(daemon, path, *args)
        assert status == 200, (path, body[:300])
        assert headers["alt-svc"] == alt_svc, path
        answers[path] = headers, body
    for path in ("/metrics", "/status"):  # operator routes, without an operator's certificate
        status, _, body = curl(daemon, path)
        assert status == 403 and b"for operators" in body, (path, status, body)
    assert json.loads(answers["/v2/models/silero_vad/infer"][1])["outputs"][0]["name"] == "speech_prob"
    assert json.loads(answers["/v2/models/silero_vad/segments"][1])["segments"]
    metrics = answers["/metrics"][1].decode()
    assert "appliance_requests_total" in metrics
    assert 'appliance_worker_https_connections{worker="1"}' in metrics
    translated = json.loads(answers["/translate"][1])["translatedText"].lower()
    assert "médic" in translated and "hospital" in translated, translated  # Portuguese for doctor, hospital
    audio, rate = soundfile.read(io.BytesIO(answers["/v1/audio/speech"][1]))
    assert rate == 22050 and 1.5 < len(audio) / rate < 6
    heard = json.loads(answers["/v1/audio/transcriptions"][1])["text"].lower()
    assert "doctor" in heard and "hospital" in heard, heard  # espeak-ng said it, the box heard it
    assert answers["/"][0]["content-type"].startswith("text/html") and b"/page/app.js" in answers["/"][1]
    assert answers["/tls/certificate.pem"][1] == Path(daemon.cafile).read_bytes()


def test_curl_refuses_the_box_without_its_certificate_and_status_prints_its_fingerprint(daemon: Daemon) -> None:
    result = subprocess.run(["curl", "-sS", daemon.https_url + "/v2/health/ready"], capture_output=True, text=True)
    assert result.returncode == 60, result.stderr  # "SSL certificate problem: self-signed certificate"
    status = subprocess.run(
        [".venv/bin/python", "-m", "appliance", "status", "--socket", str(daemon.socket)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    fingerprint = subprocess.run(
        ["openssl", "x509", "-in", daemon.cafile, "-noout", "-fingerprint", "-sha256"], capture_output=True, text=True
    ).stdout.strip()  # "sha256 Fingerprint=AB:CD:..." as openssl, not the box, computes it
    assert f"tls: SHA-256 fingerprint {fingerprint.split('=')[1]}" in status, status
    assert f"https on TCP port {daemon.https_port}" in status


def test_the_openai_package_over_https_with_the_box_certificate(daemon: Daemon, tmp_path: Path) -> None:
    http = httpx2.Client(verify=ssl.create_default_context(cafile=daemon.cafile), timeout=300)
    client = openai.OpenAI(api_key="on-box", base_url=daemon.https_url + "/v1", http_client=http, max_retries=0)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="joe", input=SENTENCE, response_format="pcm"
    ) as response:
        pcm = b"".join(response.iter_bytes())
    assert 1.5 < len(pcm) / 2 / 22050 < 6
    with english_wav(tmp_path).open("rb") as audio:
        text = client.audio.transcriptions.create(model="whisper_tiny_en", file=audio).text.lower()
    assert "doctor" in text and "hospital" in text, text
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model="tts-1", voice="darth", input="Hello.")
    with pytest.raises(
        openai.BadRequestError,
        match=r"voice 'joe' belongs to model 'joe', not to 'kokoro' \(whose voices are pf_dora, pm_alex\)",
    ):
        client.audio.speech.create(model="kokoro", voice="joe", input="Hello.")  # a voice of another model
    http.close()


def triton_over_https(daemon: Daemon, **options: str) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(
        f"127.0.0.1:{daemon.https_port}", ssl=True, ssl_options={"ca_certs": daemon.cafile, **options}
    )


def vad_input(audio: np.ndarray) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("audio", [len(audio)], "FP32")
    tensor.set_data_from_numpy(audio, binary_data=True)
    return [tensor]


def test_tritonclient_over_https(daemon: Daemon) -> None:
    triton = triton_over_https(daemon)
    assert triton.is_server_ready() and triton.is_model_ready("silero_vad")
    assert triton.get_model_metadata("silero_vad")["outputs"][0]["name"] == "speech_prob"
    result = triton.infer("silero_vad", vad_input(np.zeros(1024, np.float32)))
    assert result.as_numpy("speech_prob").shape == (2,)
    triton.close()


def test_libretranslatepy_over_https(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", daemon.cafile)  # urllib's default context trusts the box's certificate
    lt = LibreTranslateAPI(daemon.https_url + "/")
    assert {"code": "en", "name": "English", "targets": ["pt"]} in lt.languages()
    translated = lt.translate("Where is the nearest train station?", "en", "pt").lower()
    assert "estação" in translated, translated  # Portuguese for station


def test_alt_svc_leads_an_aioquic_client_to_quic(daemon: Daemon) -> None:
    _, headers, _ = curl(daemon, "/v2/health/ready")
    port = int(re.fullmatch(r'h3=":(\d+)"; ma=\d+', headers["alt-svc"])[1])
    with Client(quic=f"127.0.0.1:{port}", cafile=daemon.cafile, timeout=30) as quic:  # aioquic's HTTP/3
        assert quic.health()["ready"] and quic.speech_probs(FRAME).shape == (1,)


def live_sequences(daemon: Daemon) -> int:
    with daemon.client() as client:
        return next(m["live_sequences"] for m in client.status()["models"] if m["name"] == "silero_vad")


def test_a_sequence_belongs_to_its_connection_and_ends_with_it(daemon: Daemon) -> None:
    owner, other = triton_over_https(daemon), triton_over_https(daemon)
    owner.infer("silero_vad", vad_input(FRAME), sequence_id=4242, sequence_start=True)
    with pytest.raises(InferenceServerException, match="sequence 4242 belongs to another client"):
        other.infer("silero_vad", vad_input(FRAME), sequence_id=4242)
    assert owner.infer("silero_vad", vad_input(FRAME), sequence_id=4242).as_numpy("speech_prob").shape == (1,)
    assert live_sequences(daemon) == 1
    owner.close()  # nobody else can continue it: it ends with its connection, not at the idle timeout
    deadline = time.monotonic() + 10
    while live_sequences(daemon) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_sequences(daemon) == 0
    other.close()


def https_get(daemon: Daemon, path: str, certificate: tuple[str, str] | None) -> int:
    context = ssl.create_default_context(cafile=daemon.cafile)
    if certificate is not None:
        context.load_cert_chain(*certificate)
    connection = http.client.HTTPSConnection("127.0.0.1", daemon.https_port, context=context, timeout=20)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def test_mutual_tls_over_https_refuses_clients_without_a_signed_certificate(start_daemon, tls, tmp_path) -> None:
    ca, cert, key = make_ca_and_client(tmp_path, "good")
    _, rogue_cert, rogue_key = make_ca_and_client(tmp_path, "rogue", signed=False)
    daemon = start_daemon(tls=tls, extra_quic=f'client_ca = "{ca}"\n', https="")
    assert https_get(daemon, "/v2/health/ready", (cert, key)) == 200
    for certificate in (None, (rogue_cert, rogue_key)):
        with pytest.raises((ssl.SSLError, ConnectionError)):  # refused in the handshake, before any request
            https_get(daemon, "/v2/health/ready", certificate)
    result = subprocess.run(
        ["curl", "-sS", "--cacert", daemon.cafile, daemon.https_url + "/v2/health/ready"],
        capture_output=True,
        text=True,
    )
    # TLS 1.3 checks the client's certificate after the client's side of the handshake: curl sees the
    # handshake fail (35), an empty reply (52) or a receive error (56), and never an HTTP answer
    assert result.returncode in (35, 52, 56) and not result.stdout, result
    good = curl(daemon, "/v2/health/ready", "--cert", cert, "--key", key)
    assert good[0] == 200
    with daemon.client() as local:
        assert local.status()["tls"]["mutual_tls"] is True


def test_with_mutual_tls_a_sequence_belongs_to_the_certificate_across_connections(start_daemon, tls, tmp_path) -> None:
    ca, cert, key = make_ca_and_client(tmp_path, "owner")
    other_ca, cert2, key2 = make_ca_and_client(tmp_path, "owner2")
    both = tmp_path / "both.pem"
    both.write_text(Path(ca).read_text() + Path(other_ca).read_text())
    daemon = start_daemon(tls=tls, extra_quic=f'client_ca = "{both}"\n', https="")
    first = triton_over_https(daemon, certfile=cert, keyfile=key)
    first.infer("silero_vad", vad_input(FRAME), sequence_id=77, sequence_start=True)
    first.close()
    again = triton_over_https(daemon, certfile=cert, keyfile=key)  # a new connection, the same certificate
    assert again.infer("silero_vad", vad_input(FRAME), sequence_id=77).as_numpy("speech_prob").shape == (1,)
    stranger = triton_over_https(daemon, certfile=cert2, keyfile=key2)
    with pytest.raises(InferenceServerException, match="belongs to another client"):
        stranger.infer("silero_vad", vad_input(FRAME), sequence_id=77)
    again.infer("silero_vad", vad_input(FRAME), sequence_id=77, sequence_end=True)
    again.close()
    stranger.close()


@pytest.mark.parametrize("transport", ["unix", "quic"])
def test_the_page_and_the_certificate_are_served_on_every_transport(daemon: Daemon, transport: str) -> None:
    with daemon.client(transport) as client:
        page = client.send(Call("GET", "/"))
        assert page.status == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert "default-src 'self'" in page.headers["content-security-policy"]
        script = client.send(Call("GET", "/page/app.js"))
        assert script.status == 200 and b"/v1/realtime" in script.body
        assert client.send(Call("GET", "/page/../../etc/passwd")).status == 404
        assert client.send(Call("GET", "/tls/certificate.pem")).body == Path(daemon.cafile).read_bytes()


@pytest.mark.parametrize("missing", ["key", "client CA"])
def test_https_that_cannot_start_is_one_line_and_the_start_failure_code(
    start_daemon, tls, tmp_path: Path, missing: str
) -> None:
    """A missing key, or a missing client CA (it was blamed on the certificate and the key): one line
    naming the file that is missing."""
    gone = tmp_path / f"missing-{missing.replace(' ', '-')}.pem"
    key, quic = (gone, "") if missing == "key" else (tls[1], f'client_ca = "{gone}"\n')
    daemon = start_daemon(tls=(tls[0], key), https="", extra_quic=quic, wait=False)
    assert daemon.proc.wait(60) == 3  # exitcodes.START_FAILED: systemd does not restart it
    lines = [line for line in daemon.log.read_text().splitlines() if "start failed" in line]
    assert len(lines) == 1 and gone.name in lines[0], daemon.log.read_text()
    if missing == "client CA":
        assert "client CA file" in lines[0] and str(tls[0]) not in lines[0], lines


@pytest.mark.parametrize("key", ["wyoming.tcp", "fleet.agent_address"])
def test_a_listener_whose_port_is_taken_is_one_start_failure_line_naming_its_key(start_daemon, key: str) -> None:
    """Another process holds the port: the daemon exits with the start-failure code and one line that
    names the key and the address, as systemd's status shows it; the socket files it made are gone
    (Wyoming's Unix socket is made before its TCP one)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        section, name = key.split(".")
        daemon = start_daemon(extra=f'[{section}]\n{name} = "{address}"\n', wait=False)
        assert daemon.proc.wait(60) == 3  # exitcodes.START_FAILED: systemd does not restart it
    lines = [line for line in daemon.log.read_text().splitlines() if "start failed" in line]
    assert lines == [f"appliance: ERROR: start failed: {key} {address}: cannot listen: Address already in use"], (
        daemon.log.read_text()
    )
    assert not list(daemon.socket.parent.glob("*.sock"))


def test_alt_svc_is_left_out_when_turned_off(start_daemon, tls) -> None:
    daemon = start_daemon(tls=tls, https="alt_svc = false\n")
    status, headers, _ = curl(daemon, "/v2/health/ready")
    assert status == 200 and "alt-svc" not in headers


def test_a_realtime_session_over_wss_with_the_box_certificate(daemon: Daemon) -> None:
    """The `websockets` client over TLS: the WebSocket upgrade rides the HTTPS listener too (here
    through a protocol worker; the page's tests take the engine process's listener)."""
    from websockets.sync.client import connect

    context = ssl.create_default_context(cafile=daemon.cafile)
    uri = f"wss://127.0.0.1:{daemon.https_port}/v1/realtime?intent=transcription"
    with connect(uri, ssl=context, open_timeout=30) as ws:
        assert json.loads(ws.recv(30))["type"] == "session.created"
        ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "not base64!"}))
        error = json.loads(ws.recv(30))
        assert error["type"] == "error" and error["error"]["message"] == "'audio' is not valid base64"


def executions(daemon: Daemon, model: str) -> int:
    with daemon.client() as client:
        response = client.send(Call("GET", f"/v2/models/{model}/stats"))
    return int(response.json()["model_stats"][0]["execution_count"])


def test_a_client_that_leaves_a_streamed_answer_stops_its_production(daemon: Daemon) -> None:
    """Cancellation over TLS and through a protocol worker: 60 sentences asked, one piece read, gone."""
    text = " ".join(f"This is sentence number {n} of a long story." for n in range(60))
    before, cancelled_before = executions(daemon, "joe"), gauge(daemon, "appliance_requests_cancelled_total")
    context = ssl.create_default_context(cafile=daemon.cafile)
    connection = http.client.HTTPSConnection("127.0.0.1", daemon.https_port, context=context, timeout=60)
    body = json.dumps({"model": "tts-1", "voice": "joe", "input": text, "response_format": "pcm"})
    connection.request("POST", "/v1/audio/speech", body, {"content-type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.read1(1 << 16)
    connection.close()
    while gauge(daemon, "appliance_requests_cancelled_total") == cancelled_before:
        time.sleep(0.05)
    cancelled = executions(daemon, "joe")
    while gauge(daemon, "appliance_queue_depth", model="joe") > 0:
        time.sleep(0.05)
    settled = executions(daemon, "joe")
    assert settled - cancelled <= SHARDS_AHEAD  # what was queued when the cancel came: nothing more for nobody
    assert settled - before < 30, settled - before  # of 60 (one engine call each when alone; 3 here once)


def gauge(daemon: Daemon, name: str, **labels: str) -> float:
    with daemon.client() as client:
        return sample(client.metrics(), name, **labels)


def test_a_client_that_offers_http2_is_answered_in_http11(daemon: Daemon) -> None:
    """ALPN: the box takes http/1.1 only (docs/https.md says why); curl --http2 falls back to it."""
    result = subprocess.run(
        ["curl", "-sS", "-i", "--http2", "--cacert", daemon.cafile, daemon.https_url + "/v2/health/ready"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and result.stdout.startswith("HTTP/1.1 200 OK"), result

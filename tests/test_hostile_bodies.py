"""Hostile bodies on the task routes (/translate, /v1/audio/speech, the OpenAI forms) against a real
daemon, sent by the real clients (libretranslatepy, openai) where they can carry them.

Each body is bounded before anything in it is expanded: its size, its JSON depth and value count, its
form fields and multipart parts; the refusal is one 4xx naming the bound, logged once per 10 s, never
a 500 or a traceback. Good clients call on both transports throughout; none may fail and no worker
may die. The daemon keeps the production body limit (64 MiB), so the route's own bound is what bites.
"""

from __future__ import annotations

import json
import urllib.error
from collections.abc import Iterator

import httpx2
import libretranslatepy
import openai
import pytest
from conftest import Daemon, good_clients_throughout
from tcp_forward import tcp_to_unix

from appliance.api.bodies import MAX_FORM_FIELDS, MAX_TEXT_BODY_BYTES, MAX_TEXT_VALUES
from appliance.client import Call
from appliance.protocol.json_reader import MAX_DEPTH

FORM = (("content-type", "application/x-www-form-urlencoded"),)
JSON = (("content-type", "application/json"),)


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def daemon(request, tmp_path_factory, keys, bundle, tls) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("hostile-bodies"),
        bundle,
        keys.trusted,
        tls=tls,
        workers=request.param,
        max_body_bytes=64 << 20,
    )
    with good_clients_throughout(d.wait_ready()):
        yield d


@pytest.fixture(scope="module")
def openai_client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(daemon.socket)), timeout=120)
    yield openai.OpenAI(api_key="on-box", base_url="http://appliance/v1", http_client=http, max_retries=0)
    http.close()


def assert_no_crash(daemon: Daemon) -> None:
    log = daemon.log.read_text()
    assert "crashed" not in log and "Traceback" not in log, log[-2000:]


def test_a_32_mib_form_from_libretranslatepy_is_413_before_it_is_parsed(daemon) -> None:
    with tcp_to_unix(daemon.socket) as address:
        api = libretranslatepy.LibreTranslateAPI(f"http://{address}/")
        with pytest.raises(urllib.error.HTTPError) as caught:
            api.translate("a" * (32 << 20), "en", "pt", timeout=120)
    assert caught.value.code == 413
    assert f"this route's limit of {MAX_TEXT_BODY_BYTES} bytes" in caught.value.read().decode()
    assert_no_crash(daemon)


@pytest.mark.parametrize("transport", ["unix", "quic"])
def test_a_form_of_many_fields_is_400_naming_the_bound(daemon, transport) -> None:
    body = b"&".join(b"f%d=x" % i for i in range(100_000))  # 1 MB: under the size bound, not the fields'
    with daemon.client(transport) as client:
        answer = client.send(Call("POST", "/translate", body, FORM))
    assert answer.status == 400 and f"more than {MAX_FORM_FIELDS} fields" in answer.json()["error"], answer
    assert_no_crash(daemon)


@pytest.mark.parametrize("transport", ["unix", "quic"])
def test_json_nested_a_thousand_deep_is_400_not_500(daemon, transport) -> None:
    body = b'{"q":' + b"[" * 1000 + b"]" * 1000 + b', "source": "en", "target": "pt"}'
    with daemon.client(transport) as client:
        answer = client.send(Call("POST", "/translate", body, JSON))
    assert answer.status == 400 and f"more than {MAX_DEPTH} deep" in answer.json()["error"], answer
    assert_no_crash(daemon)


def test_a_63_mib_json_list_from_the_openai_client_is_413(daemon, openai_client) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        openai_client.audio.speech.create(model="tts-1", voice="x", input="hi", extra_body={"pad": [1] * (30 << 20)})
    assert caught.value.status_code == 413, caught.value
    assert "this route's limit" in caught.value.message
    assert_no_crash(daemon)


def test_json_of_many_values_under_the_size_bound_is_400(daemon, openai_client) -> None:
    with pytest.raises(openai.BadRequestError, match=f"more than {MAX_TEXT_VALUES} JSON values"):
        openai_client.audio.speech.create(model="tts-1", voice="x", input="hi", extra_body={"pad": ["a"] * 100_000})
    assert_no_crash(daemon)


def test_a_multipart_form_of_many_parts_is_400(daemon, openai_client) -> None:
    boundary = "b0undary"
    parts = "".join(f'--{boundary}\r\ncontent-disposition: form-data; name="f{i}"\r\n\r\nx\r\n' for i in range(10_000))
    body = (parts + f"--{boundary}--\r\n").encode()
    headers = (("content-type", f"multipart/form-data; boundary={boundary}"),)
    with daemon.client() as client:
        answer = client.send(Call("POST", "/v1/audio/transcriptions", body, headers))
    assert answer.status == 400, answer
    assert f"more than {MAX_FORM_FIELDS} parts" in answer.json()["error"]["message"]
    assert_no_crash(daemon)


def test_a_refused_body_is_logged_once_per_ten_seconds(daemon) -> None:
    def logged() -> int:
        return sum("this route's limit" in line for line in daemon.log.read_text().splitlines())

    before = logged()
    body = json.dumps({"q": "a" * (MAX_TEXT_BODY_BYTES + 1)}).encode()
    with daemon.client() as client:
        for _ in range(5):
            assert client.send(Call("POST", "/translate", body, JSON)).status == 413
    assert logged() >= 1 and logged() - before <= 1  # none where an earlier test's line is under 10 s old

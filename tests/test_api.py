"""The KServe v2 API over the real Unix socket: every route, both tensor encodings, sequences, bad input."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import cli
from promtext import sample, samples, total
from test_workers import UnixConnection
from waits import wait_until

from appliance.audio import encode_wav
from appliance.client import Call, Client, ClientError, infer_call

FRAME = 512


def raw_exchange(path: Path, data: bytes) -> bytes:
    """Send bytes as they are and read until the daemon closes or answers once."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks) and b'"error"' in b"".join(chunks):
                break
        return b"".join(chunks)


def noise(frames: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(frames * FRAME) * 0.1).astype(np.float32)


def test_health_server_and_model_metadata(client: Client, keys) -> None:
    assert client.health() == {"live": True, "ready": True}
    server = client.server()
    assert (
        server["name"] == "triton" and server["server"] == "appliance" and "binary_tensor_data" in server["extensions"]
    )
    assert server["firmware"]["name"] == "voice-vad"
    model = client.model("silero_vad")
    assert model["inputs"][0]["name"] == "audio" and model["outputs"][0]["name"] == "speech_prob"
    params = model["parameters"]
    assert params["baked"] == {
        "max_tokens_per_shard": 1024,
        "split_algorithm": "semantic",
        "fallback_cpu_threshold": 0.85,
        "max_batch": 64,
    }
    kid = next(keys.trusted.glob("*.pub")).stem
    assert params["firmware"]["signing_key_id"] == kid and params["firmware"]["version"] == "1.0.0"
    assert client.get("/v2/models/silero_vad/ready") == {"name": "silero_vad", "ready": True}
    assert client.get("/v2/models/silero_vad/versions/1.0.0")["name"] == "silero_vad"
    assert [m["name"] for m in client.models()["models"]] == ["silero_vad"]


def test_curl_over_the_socket(daemon) -> None:
    out = subprocess.run(
        ["curl", "-s", "--unix-socket", str(daemon.socket), "http://localhost/v2/health/ready"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out) == {"ready": True}


def test_cli_call_commands(daemon, tmp_path: Path) -> None:
    env_socket = ["--socket", str(daemon.socket)]
    assert json.loads(cli("call", "health", *env_socket).stdout)["ready"] is True
    assert json.loads(cli("call", "models", *env_socket).stdout)["models"][0]["name"] == "silero_vad"
    wav = tmp_path / "silence.wav"
    wav.write_bytes(encode_wav(np.zeros(16000, np.float32), 16000))
    assert json.loads(cli("call", "vad", wav, *env_socket).stdout)["segments"] == []
    streamed = [json.loads(line) for line in cli("call", "vad", wav, "--stream", *env_socket).stdout.splitlines()]
    assert streamed == [{"model_name": "silero_vad", "duration": 1.0, "segments": 0, "done": True}]


def test_curl_reads_streamed_segments_as_chunked_http(daemon, tmp_path: Path) -> None:
    wav = tmp_path / "silence.wav"
    wav.write_bytes(encode_wav(np.zeros(16000, np.float32), 16000))
    out = subprocess.run(
        [
            "curl",
            "-si",
            "--unix-socket",
            str(daemon.socket),
            "--data-binary",
            f"@{wav}",
            "http://localhost/v2/models/silero_vad/segments?stream=true",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    head, _, body = out.partition("\n\n")  # text mode reads \r\n as \n
    assert "transfer-encoding: chunked" in head.lower() and "application/x-ndjson" in head
    assert json.loads(body)["done"] is True


def test_socket_mode_is_0660(daemon) -> None:
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660


def test_json_and_binary_tensors_give_the_same_result(client: Client) -> None:
    audio = noise(6)
    binary = client.speech_probs(audio, binary=True)
    as_json = client.speech_probs(audio, binary=False)
    assert binary.shape == (6,) and binary.dtype == np.float32
    np.testing.assert_allclose(binary, as_json, atol=1e-6)
    int16 = client.speech_probs((audio * 32768).astype(np.int16))
    np.testing.assert_allclose(int16, binary, atol=1e-3)


def test_sequence_keeps_state_across_requests(client: Client) -> None:
    audio = noise(12, seed=3)
    whole = client.speech_probs(audio)  # one-off: one shard, the same frames in one sequence
    parts = [
        client.speech_probs(audio[: 4 * FRAME], sequence_id=77, start=True),
        client.speech_probs(audio[4 * FRAME : 8 * FRAME], sequence_id=77),
        client.speech_probs(audio[8 * FRAME :], sequence_id=77, end=True),
    ]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-5)
    with pytest.raises(ClientError) as err:  # ended: no longer usable
        client.speech_probs(audio[:FRAME], sequence_id=77)
    assert err.value.status == 400 and "sequence 77 is not open" in err.value.message


def test_sequence_response_echoes_parameters(client: Client) -> None:
    response = client.send(infer_call("silero_vad", noise(1), sequence_id="abc", start=True, end=True, binary=False))
    assert json.loads(response.body)["parameters"] == {
        "sequence_id": "abc",
        "sequence_start": True,
        "sequence_end": True,
    }


BINARY_HEADER = b'{"inputs":[{"name":"audio","shape":[512],"datatype":"FP32","parameters":{"binary_data_size":2048}}]}'


def infer_body(doc: dict) -> Call:
    return Call(
        "POST", "/v2/models/silero_vad/infer", json.dumps(doc).encode(), (("content-type", "application/json"),)
    )


@pytest.mark.parametrize(
    "call, status, message",
    [
        (
            infer_body({"inputs": [{"name": "audio", "shape": [3], "datatype": "FP32", "data": [1, 2]}]}),
            400,
            "holds 2 values but shape [3] needs 3",
        ),
        (
            infer_body({"inputs": [{"name": "audio", "shape": [2], "datatype": "BF16", "data": [1, 2]}]}),
            400,
            "datatype 'BF16' is not supported",
        ),
        (
            infer_body({"inputs": [{"name": "audio", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}]}),
            400,
            "input audio: datatype must be FP32 or INT16",
        ),
        (
            infer_body({"inputs": [{"name": "pcm", "shape": [1], "datatype": "FP32", "data": [0]}]}),
            400,
            "takes one input named 'audio'",
        ),
        (
            infer_body({"inputs": [{"name": "audio", "shape": [2, 2, 2], "datatype": "FP32", "data": [0] * 8}]}),
            400,
            "shape must be [samples]",
        ),
        (
            infer_body({"inputs": [{"name": "audio", "shape": [2], "datatype": "INT64", "data": [0, 0]}]}),
            400,
            "must be FP32 or INT16",
        ),
        (infer_body({"inputs": []}), 400, "'inputs' must be a non-empty list"),
        (
            infer_body(
                {
                    "inputs": [{"name": "audio", "shape": [512], "datatype": "FP32", "data": [0] * 512}],
                    "parameters": {"sequence_id": 5},
                }
            ),
            400,
            "sequence 5 is not open",
        ),
        (
            infer_body(
                {
                    "inputs": [{"name": "audio", "shape": [100], "datatype": "FP32", "data": [0] * 100}],
                    "parameters": {"sequence_id": 6, "sequence_start": True},
                }
            ),
            400,
            "not a multiple of 512",
        ),
        (Call("POST", "/v2/models/silero_vad/infer", b"{not json"), 400, "not valid JSON"),
        (Call("POST", "/v2/models/nope/infer", b"{}"), 404, "Request for unknown model: 'nope' is not found"),
        (Call("GET", "/v2/models/silero_vad/infer"), 405, "GET is not allowed"),
        (Call("GET", "/v3/whatever"), 404, "no route for /v3/whatever"),
        (
            Call(
                "POST",
                "/v2/models/silero_vad/infer",
                BINARY_HEADER + b"\0" * 100,
                (("inference-header-content-length", str(len(BINARY_HEADER))),),
            ),
            400,
            "truncated",
        ),
        (Call("POST", "/v2/models/silero_vad/segments", b"RIFF0000WAVEjunk"), 400, "audio not supported"),
        (
            Call("POST", "/v2/models/silero_vad/segments", encode_wav(np.zeros(800, np.float32), 4000)),
            400,
            "4000 Hz is outside 8000 to 384000 Hz",
        ),
        (
            Call("POST", "/v2/models/silero_vad/segments?threshold=2", encode_wav(np.zeros(800, np.float32), 16000)),
            400,
            "threshold",
        ),
        (
            Call("POST", "/v2/models/silero_vad/segments?stream=maybe", encode_wav(np.zeros(800, np.float32), 16000)),
            400,
            "query parameter stream: 'maybe' is not true or false",
        ),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_the_daemon_keeps_serving(
    client: Client, call: Call, status: int, message: str
) -> None:
    response = client.send(call)
    assert response.status == status, response.body
    assert message in response.json()["error"]
    assert client.health()["ready"]


def test_binary_header_length_must_match(client: Client) -> None:
    response = client.send(
        Call(
            "POST",
            "/v2/models/silero_vad/infer",
            BINARY_HEADER + b"\0" * 2048,
            (("inference-header-content-length", str(len(BINARY_HEADER) + 5000)),),
        )
    )
    assert response.status == 400 and "exceeds the body" in response.json()["error"]


def test_malformed_http_and_oversized_body(daemon, client: Client) -> None:
    reply = raw_exchange(daemon.socket, b"GARBAGE / HTTP/9.9\r\n\x00\x01\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400") and b"malformed HTTP request" in reply
    reply = raw_exchange(
        daemon.socket, b"POST /v2/models/silero_vad/infer HTTP/1.1\r\ncontent-length: 999999999\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 413") and b"exceeds the limit" in reply
    reply = raw_exchange(daemon.socket, b"GET /v2 HTTP/1.1\r\nx-big: " + b"a" * 40000 + b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431")
    assert client.health()["ready"]


def test_metrics_count_requests_batches_and_sequences(client: Client) -> None:
    def counts(text: str) -> tuple[float, ...]:
        return (
            total(text, "appliance_requests_total", endpoint="infer", code="200"),
            total(text, "appliance_request_duration_seconds_count", endpoint="infer"),
            total(text, "appliance_request_duration_seconds_bucket", endpoint="infer", le="+Inf"),
            total(text, "appliance_batch_size_count", model="silero_vad"),
            total(text, "appliance_live_sequences", model="silero_vad"),
        )

    before = counts(client.metrics())
    client.speech_probs(noise(2), sequence_id=901, start=True)
    text = client.metrics()
    requests, timed, under_inf, batches, live = counts(text)
    # the call is counted once, timed once (the +Inf bucket holds every observation), ran in >= 1 engine
    # call, and its sequence is open; other clients of the shared daemon may add to the counts meanwhile
    assert requests >= before[0] + 1 and timed >= before[1] + 1 and under_inf == timed, (before, text)
    assert batches >= before[3] + 1 and live >= 1, (before, text)
    buckets = samples(text, "appliance_request_duration_seconds_bucket", endpoint="infer")
    assert buckets == sorted(buckets) and buckets[-1] == timed, buckets  # cumulative, ending at the count
    client.speech_probs(noise(1), sequence_id=901, end=True)
    assert sample(client.metrics(), "appliance_live_sequences", model="silero_vad") <= live - 1  # ended


def test_sequence_table_is_bounded_and_idle_sequences_expire(start_daemon) -> None:
    daemon = start_daemon("[sequences]\nmax_live = 2\nidle_timeout_s = 3.0\n")  # longer than three calls take
    with daemon.client() as client:
        client.speech_probs(noise(1), sequence_id=1, start=True)
        client.speech_probs(noise(1), sequence_id=2, start=True)
        with pytest.raises(ClientError) as err:
            client.speech_probs(noise(1), sequence_id=3, start=True)
        assert err.value.status == 429 and "sequence table full (2 live" in err.value.message
        live = "appliance_live_sequences"
        wait_until(lambda: sample(client.metrics(), live, model="silero_vad") == 0, "both expired")
        with pytest.raises(ClientError) as err:
            client.speech_probs(noise(1), sequence_id=1)
        assert "expired after 3 s idle" in err.value.message
        client.speech_probs(noise(1), sequence_id=3, start=True)  # room again


def test_sigterm_exits_zero_and_removes_the_socket(start_daemon) -> None:
    daemon = start_daemon()
    assert daemon.stop() == 0
    assert not daemon.socket.exists()


def test_a_vad_only_firmware_loads_no_other_kinds_engine(daemon) -> None:
    """The kind registry is lazy: the default firmware's engine process maps ONNX Runtime, and neither
    CTranslate2 (speech_to_text) nor fxtranslate and sentencepiece (text_translation) nor tokenizers."""
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "onnxruntime" in maps
    loaded = [name for name in ("ctranslate2", "fxtranslate", "sentencepiece", "tokenizers") if name in maps]
    assert not loaded, f"a VAD-only firmware loaded {loaded}"


def test_a_method_not_allowed_names_the_allowed_one_in_allow(client: Client) -> None:
    """RFC 9110 15.5.6: a 405 carries Allow (a client or a probe learns the method from the header)."""
    response = client.send(Call("DELETE", "/v2/health/ready"))
    assert response.status == 405 and response.headers.get("allow") == "GET, HEAD", (response.status, response.headers)
    assert "(use GET or HEAD)" in response.json()["error"], response.body
    response = client.send(Call("GET", "/v2/models/silero_vad/infer"))
    assert response.status == 405 and response.headers.get("allow") == "POST", (response.status, response.headers)


def test_a_head_answers_the_gets_head_alone_and_the_connection_goes_on(daemon) -> None:
    """RFC 9110 9.3.2, as health probes use it: HEAD where GET is served, its content-length the GET's
    body's, no body sent (the GET after it on the same connection is read whole)."""
    connection = UnixConnection(str(daemon.socket))
    answers = []
    for method in ("HEAD", "GET"):
        connection.request(method, "/v2/models")
        response = connection.getresponse()
        answers.append((response.status, response.getheader("content-length"), response.read()))
    connection.close()
    (head_status, head_length, _), (status, length, body) = answers
    assert (head_status, status) == (200, 200), answers  # (http.client reads no body after a HEAD: the GET tells)
    assert head_length == length == str(len(body)) and json.loads(body)["models"], answers

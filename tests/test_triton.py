"""Triton's HTTP API as NVIDIA's own client sees it: tritonclient.http against the real daemon (over a
TCP port piped byte for byte to its Unix socket): metadata, config, statistics, repository index,
JSON and binary tensors, gzip and deflate both ways, sequences."""

from __future__ import annotations

import gzip
import json
import socket
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from conftest import Daemon, Keys
from tcp_forward import tcp_to_unix
from test_generic import MAX_BATCH, accumulator, build, integer_mlp, model_table
from tritonclient.utils import InferenceServerException

from appliance.client import Call, Client, ServerError

VAD = "silero_vad"
FRAME = 512


@pytest.fixture(scope="module")
def triton(daemon) -> Iterator[httpclient.InferenceServerClient]:
    with tcp_to_unix(daemon.socket) as url:
        client = httpclient.InferenceServerClient(url, concurrency=4, network_timeout=60.0)
        yield client
        client.close()


def noise(frames: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(frames * FRAME) * 0.1).astype(np.float32)


def vad_inputs(audio: np.ndarray, binary: bool) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("audio", [len(audio)], "FP32")
    tensor.set_data_from_numpy(audio, binary_data=binary)
    return [tensor]


def vad_outputs(binary: bool) -> list[httpclient.InferRequestedOutput]:
    return [httpclient.InferRequestedOutput("speech_prob", binary_data=binary)]


def test_server_and_model_metadata(triton: httpclient.InferenceServerClient) -> None:
    assert triton.is_server_live() and triton.is_server_ready() and triton.is_model_ready(VAD)
    server = triton.get_server_metadata()
    assert {"binary_tensor_data", "sequence", "model_repository"} <= set(server["extensions"])
    metadata = triton.get_model_metadata(VAD)
    assert metadata["name"] == VAD and metadata["versions"] == ["1.0.0"]
    assert metadata["inputs"][0]["name"] == "audio" and metadata["outputs"][0]["name"] == "speech_prob"
    assert triton.get_model_metadata(VAD, "1.0.0")["name"] == VAD
    with pytest.raises(
        InferenceServerException, match="Request for unknown model: 'silero_vad' version 7 is not found"
    ):
        triton.get_model_metadata(VAD, "7")


def test_repository_index_and_no_load_or_unload(triton: httpclient.InferenceServerClient) -> None:
    index = triton.get_model_repository_index()
    assert index == [{"name": VAD, "version": "1.0.0", "state": "READY", "reason": ""}]
    for call in (triton.load_model, triton.unload_model):
        with pytest.raises(InferenceServerException, match="the signed firmware decides") as caught:
            call(VAD)
        assert caught.value.status() == "403"
    assert triton.is_model_ready(VAD)  # still served


@pytest.mark.parametrize(
    ("body", "status", "answer"),
    [
        (b'{"ready": true}', 200, [{"name": VAD, "version": "1.0.0", "state": "READY", "reason": ""}]),
        (
            b'{"ready": "yes"}',
            400,
            {"error": 'repository index request: the body must be an object like {"ready": true}'},
        ),
        (b"[", 400, {"error": "repository index request: the body is not JSON"}),
        (  # read by the bounded reader: no recursion, no 500
            b"[" * 5000 + b"]" * 5000,
            400,
            {"error": "repository index request: request body nests lists and objects more than 32 deep"},
        ),
    ],
)
def test_repository_index_request_bodies(daemon, body: bytes, status: int, answer: object) -> None:
    got, _, text = raw_request(daemon, "POST /v2/repository/index HTTP/1.1\r\nhost: x\r\n", body)
    assert (got, json.loads(text)) == (status, answer)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_matches_the_appliance_client(triton, daemon, binary: bool) -> None:
    audio = noise(6, seed=3)
    result = triton.infer(VAD, vad_inputs(audio, binary), outputs=vad_outputs(binary))
    with Client(str(daemon.socket)) as ours:
        expected = ours.speech_probs(audio)
    assert result.get_response()["model_name"] == VAD
    np.testing.assert_array_equal(result.as_numpy("speech_prob"), expected)


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_compressed_requests_and_responses(triton, daemon, coding: str, binary: bool) -> None:
    audio = noise(12, seed=4)
    result = triton.infer(
        VAD,
        vad_inputs(audio, binary),
        outputs=vad_outputs(binary),
        request_compression_algorithm=coding,
        response_compression_algorithm=coding,
    )
    with Client(str(daemon.socket)) as ours:
        expected = ours.speech_probs(audio)
    np.testing.assert_array_equal(result.as_numpy("speech_prob"), expected)


def test_sequences_keep_their_state(triton, daemon) -> None:
    """A stream sent in pieces by tritonclient with Triton's sequence parameters gets what one
    whole request gets; two interleaved streams do not disturb each other."""
    streams = {101: noise(32, seed=5), 102: noise(32, seed=6)}
    pieces: dict[int, list[np.ndarray]] = {s: [] for s in streams}
    for step in range(4):
        for sequence_id, audio in streams.items():
            chunk = audio[step * 8 * FRAME : (step + 1) * 8 * FRAME]
            result = triton.infer(
                VAD,
                vad_inputs(chunk, binary=True),
                outputs=vad_outputs(True),
                sequence_id=sequence_id,
                sequence_start=step == 0,
                sequence_end=step == 3,
            )
            assert result.get_response()["parameters"]["sequence_id"] == sequence_id
            pieces[sequence_id].append(result.as_numpy("speech_prob"))
    with Client(str(daemon.socket)) as ours:
        for sequence_id, audio in streams.items():
            np.testing.assert_allclose(np.concatenate(pieces[sequence_id]), ours.speech_probs(audio), atol=1e-5)


# --- content codings at the HTTP level: what the bounds do with hostile bodies ------------------------


def raw_request(daemon, head: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on the Unix socket as bytes; the status, headers and body of the answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(daemon.socket))
        s.sendall(head.encode() + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    head_bytes, _, answer = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, answer


def infer_body(frames: int) -> bytes:
    doc = {"inputs": [{"name": "audio", "datatype": "FP32", "shape": [frames * FRAME], "data": [0.0] * frames * FRAME}]}
    return json.dumps(doc).encode()


def test_a_zip_bomb_is_refused_within_the_body_limit(daemon) -> None:
    """16 MiB of zeros gzip to 16 KiB: the decompressed size counts against max_body_bytes (8 MiB)."""
    bomb = gzip.compress(bytes(16 << 20))
    status, _, answer = raw_request(
        daemon, f"POST /v2/models/{VAD}/infer HTTP/1.1\r\nhost: x\r\ncontent-encoding: gzip\r\n", bomb
    )
    assert status == 413 and b"decompressed exceeds the limit of 8388608 bytes" in answer, answer
    with Client(str(daemon.socket)) as ours:
        assert ours.health()["ready"]


@pytest.mark.parametrize(
    ("coding", "body", "status", "message"),
    [
        ("br", b"x", 415, b"content-encoding 'br' is not supported"),
        ("gzip", b"not gzip at all", 400, b"not valid gzip data"),
        ("gzip", gzip.compress(infer_body(2))[:-9], 400, b"ends before its end"),
        ("deflate", zlib.compress(infer_body(2)) + b"junk", 400, b"bytes after the end"),
    ],
    ids=["unknown", "garbage", "truncated", "trailing"],
)
def test_bad_compressed_bodies_get_one_line(daemon, coding: str, body: bytes, status: int, message: bytes) -> None:
    got, _, answer = raw_request(
        daemon, f"POST /v2/models/{VAD}/infer HTTP/1.1\r\nhost: x\r\ncontent-encoding: {coding}\r\n", body
    )
    assert got == status and message in answer and b"\n" not in answer.strip(), answer


def test_gzip_members_and_accept_encoding_weights(daemon) -> None:
    body = infer_body(3)
    two_members = gzip.compress(body[:100]) + gzip.compress(body[100:])
    head = f"POST /v2/models/{VAD}/infer HTTP/1.1\r\nhost: x\r\ncontent-encoding: gzip\r\n"
    status, headers, plain = raw_request(daemon, head + "accept-encoding: gzip;q=0, identity\r\n", two_members)
    assert status == 200 and "content-encoding" not in headers
    status, headers, packed = raw_request(daemon, head + "accept-encoding: br;q=1.0, deflate;q=0.5\r\n", two_members)
    assert status == 200 and headers["content-encoding"] == "deflate"
    assert zlib.decompress(packed) == plain
    status, headers, packed = raw_request(daemon, "GET /metrics HTTP/1.1\r\nhost: x\r\naccept-encoding: gzip\r\n", b"")
    assert (
        status == 200
        and headers["content-encoding"] == "gzip"
        and b"appliance_requests_total" in gzip.decompress(packed)
    )


def test_both_transports_decode_and_compress(client: Client) -> None:
    """The codings live in the shared assembler and the API core: HTTP/1.1 and HTTP/3 alike."""
    target, body = f"/v2/models/{VAD}/infer", infer_body(4)
    plain = client.send(Call("POST", target, body))
    packed = client.send(
        Call("POST", target, gzip.compress(body), (("content-encoding", "gzip"), ("accept-encoding", "gzip")))
    )
    assert packed.status == plain.status == 200 and packed.headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(packed.body)) == plain.json()
    bomb = client.send(Call("POST", target, gzip.compress(bytes(16 << 20)), (("content-encoding", "gzip"),)))
    assert bomb.status == 413 and "decompressed exceeds" in bomb.json()["error"]


def test_generic_infer_and_requested_outputs(client: Client) -> None:
    """The client's generic infer (tensors by name), and outputs named as Triton names them."""
    audio = noise(3, seed=8)
    outputs = client.infer(VAD, {"audio": audio}, outputs=["speech_prob"], binary=False)
    assert list(outputs) == ["speech_prob"]
    np.testing.assert_array_equal(outputs["speech_prob"], client.speech_probs(audio))
    with pytest.raises(ServerError, match="has no output 'logits' \\(it has: speech_prob\\)") as caught:
        client.infer(VAD, {"audio": audio}, outputs=["logits"])
    assert caught.value.status == 400


def test_model_config_in_tritons_shape(triton: httpclient.InferenceServerClient) -> None:
    config = triton.get_model_config(VAD)
    assert config == triton.get_model_config(VAD, "1.0.0")
    assert config["name"] == VAD and config["platform"] == "onnxruntime_onnx" and config["max_batch_size"] == 0
    assert config["input"] == [{"name": "audio", "data_type": "TYPE_FP32", "dims": [-1]}]
    assert config["output"] == [{"name": "speech_prob", "data_type": "TYPE_FP32", "dims": [-1]}]
    state = config["sequence_batching"]["state"]
    assert [(s["input_name"], s["output_name"], s["data_type"]) for s in state] == [("state", "stateN", "TYPE_FP32")]
    assert state[0]["dims"] == [2, 128]
    assert config["parameters"]["max_batch"] == {"string_value": "64"}
    assert config["parameters"]["split_algorithm"] == {"string_value": "semantic"}
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
        triton.get_model_config("nope")


def test_statistics_count_requests_executions_and_times(start_daemon) -> None:
    """A daemon of its own, so the counts are this test's: three one-off requests, a failed one and a
    sequence of two; queue and compute times are recorded for each successful request."""
    daemon = start_daemon()
    with tcp_to_unix(daemon.socket) as url:
        triton = httpclient.InferenceServerClient(url)
        empty = triton.get_inference_statistics(VAD)["model_stats"][0]
        for seed in range(3):
            triton.infer(VAD, vad_inputs(noise(4, seed), True))
        with pytest.raises(InferenceServerException, match="whole frames"):
            triton.infer(VAD, vad_inputs(noise(1)[:100], True), sequence_id=5, sequence_start=True)
        for step in range(2):
            triton.infer(VAD, vad_inputs(noise(2, step), True), sequence_id=6, sequence_start=step == 0,
                         sequence_end=step == 1)  # fmt: skip
        every = triton.get_inference_statistics()
        stats = triton.get_inference_statistics(VAD, "1.0.0")
        triton.close()
    assert every == stats
    (model,) = stats["model_stats"]
    assert model["name"] == VAD and model["version"] == "1.0.0" and model["last_inference"] > 0
    assert empty["inference_stats"]["success"]["count"] == 0
    inference = model["inference_stats"]
    assert inference["success"]["count"] == 5 and inference["fail"]["count"] == 1
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inference[key]["count"] == 5 and inference[key]["ns"] > 0, (key, inference[key])
    assert inference["success"]["ns"] >= inference["compute_infer"]["ns"]
    frames = 3 * 4 + 2 * 2 + empty["inference_count"]  # the VAD infers frames: Triton's inference_count
    assert model["inference_count"] == frames
    batches = model["batch_stats"]
    assert sum(b["compute_infer"]["count"] for b in batches) == model["execution_count"]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == frames


def test_prometheus_metrics_as_triton_names_them(start_daemon) -> None:
    daemon = start_daemon()
    with Client(str(daemon.socket)) as ours:
        for seed in range(2):
            ours.speech_probs(noise(3, seed))
        with pytest.raises(ServerError):
            ours.infer(VAD, {"audio": np.zeros(3, np.int64)})
        text = ours.metrics()
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith("nv_inference")
    }
    label = f'{{model="{VAD}",version="1.0.0"}}'
    assert samples[f"nv_inference_request_success{label}"] == 2
    assert samples[f"nv_inference_request_failure{label}"] == 1
    assert samples[f"nv_inference_count{label}"] >= 6 and samples[f"nv_inference_exec_count{label}"] >= 1
    for name in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
        assert samples[f"nv_inference_{name}_duration_us{label}"] > 0, name
    assert "# TYPE nv_inference_request_success counter" in text
    assert "appliance_requests_total" in text  # ours stay


# --- a generic ONNX model (graphs made with onnx.helper, as test_generic.py makes them) ---------------


@pytest.fixture(scope="module")
def mlp_graph(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return integer_mlp(tmp_path_factory.mktemp("graphs") / "mlp.onnx")


@pytest.fixture(scope="module")
def generic_url(tmp_path_factory: pytest.TempPathFactory, keys: Keys, mlp_graph: Path) -> Iterator[str]:
    """tritonclient's url of a daemon serving an integer MLP (dynamically batched) and an accumulator
    (a stateful graph), waiting up to 3 ms for requests to batch together."""
    work = tmp_path_factory.mktemp("triton-generic")
    tables = model_table("mlp", mlp_graph)
    tables += model_table(
        "accumulator",
        accumulator(work / "acc.onnx"),
        'state = [{ input = "total_in", output = "total_out", batch_axis = 0 }]\n',
    )
    build(keys, work / "bundle", tables)
    daemon = Daemon(work, work / "bundle", keys.trusted, "[engine]\nqueue_delay_us = 3000\n").wait_ready()
    with tcp_to_unix(daemon.socket) as url:
        yield url
    assert daemon.stop() == 0, daemon.log.read_text()


@pytest.fixture(scope="module")
def generic(generic_url: str) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(generic_url, network_timeout=60.0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def mlp(mlp_graph: Path) -> ort.InferenceSession:
    """The graph on ONNX Runtime, alone: what every answer must equal."""
    return ort.InferenceSession(str(mlp_graph), providers=["CPUExecutionProvider"])


def mlp_inputs(x: np.ndarray, binary: bool) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("x", list(x.shape), "INT32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    return [tensor]


def test_generic_config_metadata_and_index(generic: httpclient.InferenceServerClient) -> None:
    config = generic.get_model_config("mlp")
    assert config["max_batch_size"] == MAX_BATCH and config["platform"] == "onnxruntime_onnx"
    assert config["input"] == [{"name": "x", "data_type": "TYPE_INT32", "dims": [8]}]  # the batch axis implied
    assert config["output"] == [
        {"name": "y", "data_type": "TYPE_INT32", "dims": [4]},
        {"name": "half", "data_type": "TYPE_FP32", "dims": [8]},
    ]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 3000
    assert "sequence_batching" not in config
    state = generic.get_model_config("accumulator")["sequence_batching"]["state"]
    assert [(s["input_name"], s["output_name"], s["data_type"], s["dims"]) for s in state] == [
        ("total_in", "total_out", "TYPE_FP32", [3])
    ]
    assert generic.get_model_metadata("mlp")["inputs"] == [{"name": "x", "datatype": "INT32", "shape": [-1, 8]}]
    index = generic.get_model_repository_index()
    assert sorted(m["name"] for m in index) == ["accumulator", "mlp"] and {m["state"] for m in index} == {"READY"}


@pytest.mark.parametrize("coding", [None, "gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_generic_infer_equals_onnx_runtime(generic, mlp, binary: bool, coding: str | None) -> None:
    x = np.random.default_rng(11).integers(-50, 50, (3, 8)).astype(np.int32)
    result = generic.infer(
        "mlp",
        mlp_inputs(x, binary),
        outputs=[httpclient.InferRequestedOutput("y", binary_data=binary)],
        request_compression_algorithm=coding,
        response_compression_algorithm=coding,
    )
    (y,) = mlp.run(["y"], {"x": x})
    np.testing.assert_array_equal(result.as_numpy("y"), y)
    assert result.as_numpy("half") is None  # only the outputs asked for, as Triton


def test_generic_sequences_keep_their_state(generic) -> None:
    def add(value: float, sequence_id: int, **flags: bool) -> float:
        tensor = httpclient.InferInput("x", [1, 3], "FP32")
        tensor.set_data_from_numpy(np.full((1, 3), value, np.float32))
        return float(generic.infer("accumulator", [tensor], sequence_id=sequence_id, **flags).as_numpy("y")[0, 0])

    assert [add(1, 71, sequence_start=True), add(10, 72, sequence_start=True), add(1, 71), add(10, 72)] == [
        1,
        10,
        2,
        20,
    ]
    assert add(1, 71, sequence_end=True) == 3
    with pytest.raises(InferenceServerException, match="sequence 71 is not open"):
        add(1, 71)


def test_generic_statistics_show_batched_executions(generic, generic_url: str, mlp) -> None:
    before = generic.get_inference_statistics("mlp")["model_stats"][0]
    rng = np.random.default_rng(12)
    requests = [rng.integers(-50, 50, (1, 8)).astype(np.int32) for _ in range(48)]

    def one(x: np.ndarray) -> np.ndarray:
        client = httpclient.InferenceServerClient(generic_url, network_timeout=60.0)
        try:
            return client.infer("mlp", mlp_inputs(x, True)).as_numpy("y")
        finally:
            client.close()

    with ThreadPoolExecutor(len(requests)) as pool:  # one client each, all at once
        answers = list(pool.map(one, requests))
    for x, y in zip(requests, answers):
        np.testing.assert_array_equal(y, mlp.run(["y"], {"x": x})[0])
    after = generic.get_inference_statistics("mlp", "2.0.0")["model_stats"][0]
    done = lambda key: after["inference_stats"][key]["count"] - before["inference_stats"][key]["count"]  # noqa: E731
    assert done("success") == done("queue") == done("compute_infer") == len(requests)
    assert after["inference_count"] - before["inference_count"] == len(requests)
    executions = after["execution_count"] - before["execution_count"]
    assert executions < len(requests), f"{executions} executions for {len(requests)} one-row requests"
    assert max(b["batch_size"] for b in after["batch_stats"]) > 1
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in after["batch_stats"]) == after["inference_count"]

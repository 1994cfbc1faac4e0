"""NVIDIA's own example clients (tests/triton_examples/, unchanged) against the daemon serving an ONNX
model shaped as Triton's `simple`, through a TCP port piped to its Unix socket; and
tritonclient.http.aio, with aiohttp's default Accept-Encoding, on every route the box serves."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from conftest import Daemon, Keys
from onnx import TensorProto, helper
from tcp_forward import tcp_to_unix
from test_generic import build, model_table, save
from tritonclient.utils import InferenceServerException

EXAMPLES = Path(__file__).parent / "triton_examples"
MAX_BATCH = 8  # Triton's simple model's max_batch_size


def simple(path: Path) -> Path:
    """Triton's `simple`: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, INT32 [batch, 16]."""
    tensor = helper.make_tensor_value_info
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]), helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "simple",
        [tensor("INPUT0", TensorProto.INT32, ["batch", 16]), tensor("INPUT1", TensorProto.INT32, ["batch", 16])],
        [tensor("OUTPUT0", TensorProto.INT32, ["batch", 16]), tensor("OUTPUT1", TensorProto.INT32, ["batch", 16])],
    )  # fmt: skip
    return save(graph, path)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, keys: Keys) -> Iterator[Daemon]:
    work = tmp_path_factory.mktemp("simple")
    build(keys, work / "bundle", model_table("simple", simple(work / "simple.onnx")), max_batch=MAX_BATCH)
    daemon = Daemon(work, work / "bundle", keys.trusted).wait_ready()
    yield daemon
    assert daemon.stop() == 0, daemon.log.read_text()


@pytest.fixture(scope="module")
def url(served: Daemon) -> Iterator[str]:
    with tcp_to_unix(served.socket) as address:
        yield address


@pytest.mark.parametrize(
    "example,args",
    [
        ("simple_http_health_metadata.py", []),
        ("simple_http_infer_client.py", []),
        ("simple_http_infer_client.py", ["--request-compression-algorithm", "gzip"]),
        ("simple_http_infer_client.py", ["--response-compression-algorithm", "deflate"]),
        ("simple_http_aio_infer_client.py", []),
        ("simple_http_async_infer_client.py", []),
    ],
)
def test_nvidias_example_client_passes_unchanged(served: Daemon, url: str, example: str, args: list[str]) -> None:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "-u", url, *args], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "error" not in run.stdout.lower().replace("expected error", ""), run.stdout[-2000:]
    assert "Traceback" not in served.log.read_text()


def test_the_aio_client_on_every_route(served: Daemon, url: str) -> None:
    asyncio.run(_every_route(url))


async def _every_route(url: str) -> None:
    client = aioclient.InferenceServerClient(url)
    try:
        assert await client.is_server_live() and await client.is_server_ready()
        assert await client.is_model_ready("simple") and not await client.is_model_ready("nope")
        assert (await client.get_server_metadata())["name"] == "triton"
        metadata = await client.get_model_metadata("simple")
        assert [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]
        config = await client.get_model_config("simple")
        assert config["max_batch_size"] == MAX_BATCH
        assert [m["name"] for m in await client.get_model_repository_index()] == ["simple"]
        a = np.arange(32, dtype=np.int32).reshape(2, 16)
        b = np.full((2, 16), 3, np.int32)
        for compression in (None, "gzip", "deflate"):
            inputs = [
                httpclient.InferInput("INPUT0", [2, 16], "INT32"),
                httpclient.InferInput("INPUT1", [2, 16], "INT32"),
            ]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b, binary_data=False)
            result = await client.infer(
                "simple", inputs, request_compression_algorithm=compression, response_compression_algorithm=compression
            )
            assert (result.as_numpy("OUTPUT0") == a + b).all() and (result.as_numpy("OUTPUT1") == a - b).all()
        stats = await client.get_inference_statistics("simple")  # aiohttp asks for gzip; it must come plain
        (entry,) = stats["model_stats"]
        assert entry["inference_stats"]["success"]["count"] >= 3 and entry["last_inference"] > 0
        assert {s["name"] for s in (await client.get_inference_statistics())["model_stats"]} == {"simple"}
        for call, says in (
            (client.load_model("simple"), "firmware"),
            (client.unload_model("simple"), "firmware"),
            (client.get_model_metadata("nope"), "Request for unknown model: 'nope' is not found"),
            (client.get_model_metadata("simple", "9"), "Request for unknown model: 'simple' version 9 is not found"),
        ):
            with pytest.raises(InferenceServerException, match=says):
                await call
    finally:
        await client.close()


@pytest.mark.parametrize(
    "inputs,says",
    [
        ({"INPUT0": np.zeros((1, 16), np.int32), "INPUTX": np.zeros((1, 16), np.int32)}, "unexpected inference input 'INPUTX' for model 'simple'"),
        ({"INPUT0": np.zeros((1, 16), np.int32), "INPUT1": np.zeros((1, 15), np.int32)}, "unexpected shape for input 'INPUT1' for model 'simple'. Expected [-1,16], got [1,15]"),
        ({"INPUT0": np.zeros((1, 16), np.float32), "INPUT1": np.zeros((1, 16), np.int32)}, "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'"),
        ({"INPUT0": np.zeros((9, 16), np.int32), "INPUT1": np.zeros((9, 16), np.int32)}, "inference request batch-size must be <= 8 for 'simple'"),
    ],
)  # fmt: skip
def test_tritons_error_texts_for_inputs_that_do_not_fit(url: str, inputs: dict[str, np.ndarray], says: str) -> None:
    client = httpclient.InferenceServerClient(url)
    tensors = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), "FP32" if array.dtype == np.float32 else "INT32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("simple", tensors)
    assert caught.value.message().startswith(says) and caught.value.status() == "400"
    client.close()

"""An integrator's model with a real amount of compute: an MLP of 7.3 million parameters, built into
two signed firmwares that differ only in the baked max_batch (64: dynamic batching; 1: batching off),
served side by side in one run to 16 concurrent clients of one row each; and the daemon's cost per request
over a raw ONNX Runtime call of the same row."""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from appliance import keys
from appliance.bench.daemon import DaemonProcess
from appliance.client import Client
from appliance.engine.onnx_cpu import session
from appliance.firmware_build import bundle as build

LAYERS = (1024, 2048, 2048, 512)  # 1024*2048 + 2048*2048 + 2048*512 = 7.3 M weights (29 MiB: about the L3 cache here)
CLIENTS = 16
SPEC = """name = "bench-mlp"
version = "1.0.0"
[baked]
max_tokens_per_shard = 1024
split_algorithm = "fixed"
fallback_cpu_threshold = 0.9
max_batch = {max_batch}
[[models]]
name = "mlp"
kind = "onnx"
source = {{ path = "mlp.onnx" }}
"""


def mlp_graph(path: Path) -> Path:
    rng = np.random.default_rng(0)
    nodes, weights, current = [], [], "x"
    for i, (n_in, n_out) in enumerate(zip(LAYERS, LAYERS[1:])):
        weights.append(
            numpy_helper.from_array((rng.standard_normal((n_in, n_out)) / n_in**0.5).astype(np.float32), f"w{i}")
        )
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"h{i}"]))
        current = f"h{i}"
        if i < len(LAYERS) - 2:
            nodes.append(helper.make_node("Relu", [current], [f"r{i}"]))
            current = f"r{i}"
    nodes.append(helper.make_node("Identity", [current], ["y"]))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", LAYERS[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", LAYERS[-1]])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def infer_row(client: Client, row: np.ndarray) -> np.ndarray:
    return client.infer("mlp", {"x": row})["y"]


def requests_per_s(socket_path: Path, row: np.ndarray, seconds: float) -> float:
    """CLIENTS threads, each a connection sending one row at a time, for `seconds`."""
    counts = [0] * CLIENTS
    deadline = time.perf_counter() + seconds

    def client(i: int) -> None:
        with Client(str(socket_path)) as c:
            while time.perf_counter() < deadline:
                infer_row(c, row)
                counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - started)


def median_us(fn: Any, seconds: float) -> float:
    times, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def generic_batching(seconds: float) -> dict[str, Any]:
    row = np.random.default_rng(1).standard_normal((1, LAYERS[0])).astype(np.float32)
    results: dict[str, Any] = {"parameters": sum(a * b for a, b in zip(LAYERS, LAYERS[1:])), "clients": CLIENTS}
    with tempfile.TemporaryDirectory(prefix="appliance-bench-mlp-") as tmp:
        work = Path(tmp)
        mlp_graph(work / "mlp.onnx")
        (work / "trusted").mkdir()
        keys.new_key_pair(work / "bench.key", work / "trusted")
        for label, max_batch in (("batching", 64), ("no_batching", 1)):
            spec = work / f"{label}.toml"
            spec.write_text(SPEC.format(max_batch=max_batch))
            build.build(spec, work / "bench.key", work / label)
        raw = session(work / "mlp.onnx", 1)
        daemons: dict[str, DaemonProcess] = {}
        try:
            for label in ("batching", "no_batching"):
                # QUIC's connection cache plays no part here: the user-space one
                daemons[label] = DaemonProcess(
                    work / label, work / "trusted", work / f"d-{label}", 'backend = "user"\n', label=f"generic {label}"
                )
            with Client(str(daemons["batching"].socket)) as c:
                expected = raw.run(None, {"x": row})[0]
                assert np.allclose(infer_row(c, row), expected, atol=1e-4), "the daemon's answer is not the graph's"
                raw_us = median_us(lambda: raw.run(None, {"x": row}), seconds / 2)
                daemon_us = median_us(lambda: infer_row(c, row), seconds / 2)
            rates = {label: requests_per_s(d.socket, row, seconds) for label, d in daemons.items()}
        finally:
            for d in daemons.values():
                d.stop()
    results["requests_per_s"] = {label: round(rate) for label, rate in rates.items()}
    results["batching_ratio"] = round(rates["batching"] / rates["no_batching"], 2)
    results["raw_onnxruntime_one_row_us"] = round(raw_us, 1)
    results["daemon_one_row_us"] = round(daemon_us, 1)
    results["overhead_per_request_us"] = round(daemon_us - raw_us, 1)
    return results

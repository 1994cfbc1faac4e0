"""An integrator's own ONNX graphs, as a user serves them: a spec, a signed build, the daemon, KServe v2.

The graphs are made here with onnx.helper; every answer is compared with ONNX Runtime run on the same
request alone."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import APPLIANCE, ROOT, Daemon, Keys, cli
from onnx import TensorProto, helper, numpy_helper

from appliance.client import Client
from appliance.client.http import Call

MAX_BATCH = 8


def save(graph: onnx.GraphProto, path: Path) -> Path:
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def integer_mlp(path: Path) -> Path:
    """Integer arithmetic, so batched and alone must agree to the bit: y = x @ W (INT32), half = x * 0.5."""
    weights = np.random.default_rng(0).integers(-9, 9, (8, 4)).astype(np.int32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"]),
        helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xf", "c"], ["half"]),
    ]
    graph = helper.make_graph(
        nodes,
        "integer_mlp",
        [helper.make_tensor_value_info("x", TensorProto.INT32, ["batch", 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.INT32, ["batch", 4]),
            helper.make_tensor_value_info("half", TensorProto.FLOAT, ["batch", 8]),
        ],
        [numpy_helper.from_array(weights, "W"), numpy_helper.from_array(np.array(0.5, np.float32), "c")],
    )
    return save(graph, path)


def accumulator(path: Path) -> Path:
    """A stateful graph: total_out = total_in + x; y = total_out (state pair total_in -> total_out)."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["total_in", "x"], ["total_out"]), helper.make_node("Identity", ["total_out"], ["y"])],
        "accumulator",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("total_in", TensorProto.FLOAT, ["batch", 3]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("total_out", TensorProto.FLOAT, ["batch", 3]),
        ],
    )
    return save(graph, path)


def pairwise_sum(path: Path) -> Path:
    """y = a + b, each [batch, n]: a free dimension the graph names for both inputs."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "pairwise_sum",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "n"]) for name in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])],
    )
    return save(graph, path)


def fails_at_run(path: Path) -> Path:
    """Loads, but cannot run: a [batch, 4] input reshaped to 3 elements."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "fails_at_run",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.array([3], np.int64), "shape")],
    )
    return save(graph, path)


SPEC = """name = "integrator"
version = "2.0.0"
[baked]
max_tokens_per_shard = 1024
split_algorithm = "fixed"
fallback_cpu_threshold = 0.9
max_batch = {max_batch}
"""


def model_table(name: str, source: Path, extra: str = "") -> str:
    return f'[[models]]\nname = "{name}"\nkind = "onnx"\nsource = {{ path = "{source}" }}\n{extra}'


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("graphs")
    return {
        "mlp": integer_mlp(work / "mlp.onnx"),
        "accumulator": accumulator(work / "acc.onnx"),
        "broken": fails_at_run(work / "broken.onnx"),
        "pairwise": pairwise_sum(work / "pairwise.onnx"),
    }


def build(
    keys: Keys, out: Path, tables: str, max_batch: int = MAX_BATCH, check: bool = True
) -> subprocess.CompletedProcess[str]:
    spec = out.parent / f"{out.name}.toml"
    spec.write_text(SPEC.format(max_batch=max_batch) + tables)
    return cli("firmware", "build", str(spec), "--key", str(keys.private), "--out", str(out), check=check)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, keys: Keys, graphs: dict[str, Path]):
    work = tmp_path_factory.mktemp("generic")
    tables = model_table("mlp", graphs["mlp"], 'inputs = [{ name = "x", datatype = "INT32", shape = [-1, 8] }]\n')
    tables += model_table(
        "accumulator", graphs["accumulator"], 'state = [{ input = "total_in", output = "total_out", batch_axis = 0 }]\n'
    )
    tables += model_table("pairwise", graphs["pairwise"])
    build(keys, work / "bundle", tables)
    daemon = Daemon(work, work / "bundle", keys.trusted, "[engine]\nqueue_delay_us = 3000\n").wait_ready()
    yield daemon
    assert daemon.stop() == 0, daemon.log.read_text()


def post_infer(client: Client, model: str, inputs: dict[str, np.ndarray], **parameters: object) -> tuple[int, dict]:
    datatypes = {"int32": "INT32", "float32": "FP32"}
    doc: dict[str, object] = {
        "inputs": [
            {"name": n, "datatype": datatypes[a.dtype.name], "shape": list(a.shape), "data": a.reshape(-1).tolist()}
            for n, a in inputs.items()
        ]
    }
    if parameters:
        doc["parameters"] = parameters
    response = client.send(Call("POST", f"/v2/models/{model}/infer", json.dumps(doc).encode()))
    return response.status, json.loads(response.body)


def outputs_of(answer: dict) -> dict[str, np.ndarray]:
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in answer["outputs"]}


def test_graph_tensors_come_from_the_graph_and_metadata_says_so(served: Daemon) -> None:
    with served.client() as c:
        meta = c.model("mlp")
    assert meta["inputs"] == [{"name": "x", "datatype": "INT32", "shape": [-1, 8]}]
    assert meta["outputs"] == [
        {"name": "y", "datatype": "INT32", "shape": [-1, 4]},
        {"name": "half", "datatype": "FP32", "shape": [-1, 8]},
    ]
    assert meta["parameters"]["max_batch_size"] == MAX_BATCH


def test_concurrent_requests_of_mixed_sizes_are_batched_and_each_answer_is_its_own(
    served: Daemon, graphs: dict[str, Path]
) -> None:
    reference = ort.InferenceSession(str(graphs["mlp"]), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    requests = [rng.integers(-50, 50, (int(rng.integers(1, 5)), 8)).astype(np.int32) for _ in range(64)]

    def one(x: np.ndarray) -> dict[str, np.ndarray]:
        with Client(str(served.socket)) as c:
            status, answer = post_infer(c, "mlp", {"x": x})
        assert status == 200, answer
        return outputs_of(answer)

    with served.client() as c:
        before = executions(c.metrics(), "mlp")
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(one, requests))
    for x, got in zip(requests, answers):
        y, half = reference.run(None, {"x": x})
        assert np.array_equal(got["y"], y) and got["y"].shape == y.shape
        assert np.array_equal(got["half"].astype(np.float32), half)
    with served.client() as c:
        after = executions(c.metrics(), "mlp")
    calls, batched = after[0] - before[0], after[1] - before[1]
    assert batched > 0, "no engine call held more than one row"
    assert calls < len(requests), f"{calls} engine calls for {len(requests)} requests: nothing was batched"


def executions(metrics: str, model: str) -> tuple[int, int]:
    """(engine calls, calls of more than one row) from the batch-size histogram."""
    label = rf'model="{model}",engine="[^"]+"'
    count = int(re.search(rf"appliance_batch_size_count{{{label}}} (\d+)", metrics)[1])
    single = int(re.search(rf'appliance_batch_size_bucket{{{label},le="1"}} (\d+)', metrics)[1])
    return count, count - single


def test_a_request_over_max_batch_is_a_400_naming_both_numbers(served: Daemon) -> None:
    with served.client() as c:
        status, answer = post_infer(c, "mlp", {"x": np.zeros((MAX_BATCH + 1, 8), np.int32)})
    assert status == 400
    assert (
        answer["error"] == f"inference request batch-size must be <= {MAX_BATCH} for 'mlp' (got {MAX_BATCH + 1} rows)"
    )


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            {"x": np.zeros((1, 8), np.float32)},
            "inference input 'x' data-type is 'FP32', but model 'mlp' expects 'INT32'",
        ),
        (
            {"x": np.zeros((1, 7), np.int32)},
            "unexpected shape for input 'x' for model 'mlp'. Expected [-1,8], got [1,7]",
        ),
        ({"z": np.zeros((1, 8), np.int32)}, "unexpected inference input 'z' for model 'mlp'"),
    ],
)
def test_inputs_that_do_not_fit_the_graph_are_a_400(served: Daemon, inputs: dict, message: str) -> None:
    with served.client() as c:
        status, answer = post_infer(c, "mlp", inputs)
        assert (status, answer["error"]) == (400, message)
        assert post_infer(c, "mlp", {"x": np.ones((1, 8), np.int32)})[0] == 200


def test_inputs_disagreeing_on_a_dimension_the_graph_names_for_both_are_a_400(served: Daemon) -> None:
    """The graph names a's and b's second dimension alike ("n"): a request where they differ is the
    client's mistake, named, not the engine's failure (it was a 500 from ONNX Runtime)."""
    a, b = np.ones((2, 3), np.float32), np.full((2, 4), 2.0, np.float32)
    with served.client() as c:
        status, answer = post_infer(c, "pairwise", {"a": a, "b": b})
        assert (status, answer["error"]) == (
            400,
            "inputs 'a' and 'b' of model 'pairwise' disagree on dimension 'n': 3 and 4",
        )
        status, answer = post_infer(c, "pairwise", {"a": a, "b": b[:, :3]})
    assert status == 200 and outputs_of(answer)["y"].tolist() == [[3.0] * 3] * 2


def test_a_stateful_graph_keeps_each_sequences_state(served: Daemon) -> None:
    x = np.ones((1, 3), np.float32)
    with served.client() as c:
        totals = []
        for step in range(3):
            status, answer = post_infer(c, "accumulator", {"x": x}, sequence_id=41, sequence_start=step == 0)
            assert status == 200, answer
            totals.append(outputs_of(answer)["y"][0, 0])
            # another sequence in between does not touch the first one's state
            other = outputs_of(post_infer(c, "accumulator", {"x": x * 10}, sequence_id=42, sequence_start=step == 0)[1])
            assert other["y"][0, 0] == 10 * (step + 1)
        assert totals == [1, 2, 3]
        assert "total_out" not in outputs_of(
            post_infer(c, "accumulator", {"x": x}, sequence_id=41, sequence_end=True)[1]
        )
        one_off = outputs_of(post_infer(c, "accumulator", {"x": x * 5})[1])  # no sequence: from the zero state
        assert one_off["y"][0].tolist() == [5, 5, 5]
        status, answer = post_infer(c, "accumulator", {"x": x}, sequence_id=41)
        assert status == 400 and "sequence 41 is not open" in answer["error"]


def test_a_spec_naming_a_tensor_the_graph_lacks_fails_the_build_in_one_line(
    tmp_path: Path, keys: Keys, graphs: dict[str, Path]
) -> None:
    table = model_table("mlp", graphs["mlp"], 'inputs = [{ name = "pixels", datatype = "INT32", shape = [-1, 8] }]\n')
    result = build(keys, tmp_path / "bad", table, check=False)
    error = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2
    assert (
        str(tmp_path / "bad.toml") in error and "(model mlp)" in error and "input 'pixels' is not in the graph" in error
    )
    assert "Traceback" not in result.stderr


def test_dimension_names_that_do_not_fit_the_shape_fail_the_build_in_one_line(
    tmp_path: Path, keys: Keys, graphs: dict[str, Path]
) -> None:
    """A tensor's `dim_names` (the manifest's, which a spec may state too) name each dimension or none."""
    declared = 'inputs = [{ name = "x", datatype = "INT32", shape = [-1, 8], dim_names = ["batch"] }]\n'
    result = build(keys, tmp_path / "bad", model_table("mlp", graphs["mlp"], declared), check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert 'dim_names: a name (or "") for each of the shape\'s 2 dimensions' in result.stderr.strip().splitlines()[-1]


def test_a_model_that_fails_its_warm_up_stops_the_start_with_one_line_and_exit_3(
    tmp_path: Path, keys: Keys, graphs: dict[str, Path]
) -> None:
    build(keys, tmp_path / "broken", model_table("broken", graphs["broken"]))
    config = tmp_path / "appliance.toml"
    config.write_text(
        f'[server]\nsocket = "{tmp_path / "api.sock"}"\n'
        f'[firmware]\nbundle = "{tmp_path / "broken"}"\ntrusted_keys = "{keys.trusted}"\n'
    )
    result = subprocess.run(
        [*APPLIANCE, "run", "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 3, result.stderr
    assert len(errors) == 1 and "model broken: warm-up inference failed" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "api.sock").exists()

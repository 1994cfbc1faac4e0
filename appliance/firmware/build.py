"""Building a bundle from a spec: the ONNX graph checked against the spec, CUDA kernels compiled with the
baked parameters, TensorRT plans built on the target GPU, everything hashed and signed."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import time
import tomllib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from appliance import keys
from appliance.durable import DIRECTORY_MODE, FILE_MODE, make_directories
from appliance.engine import tensorrt
from appliance.errors import ApplianceError
from appliance.firmware import kernels
from appliance.firmware.files import copy_file, hash_files
from appliance.firmware.manifest import (
    DATATYPES,
    FORMAT_VERSION,
    TARGETS,
    Baked,
    Manifest,
    ModelSpec,
    Reader,
    read_audio,
    read_baked,
    read_model_fields,
)
from appliance.progress import QUIET, Progress


def sign(directory: Path, manifest: Manifest, private: Ed25519PrivateKey) -> None:
    """Write the manifest and its signature into a bundle directory."""
    keys.write_signed(directory, asdict(manifest), private)


def _resolve_source(source: dict[str, Any], spec_path: Path, where: str) -> Path:
    r = Reader(source, where)
    if "path" in source:
        path = (spec_path.parent / r.get("path", str)).resolve()
    else:
        package, resource = r.get("package", str), r.get("resource", str)
        # find_spec on a top-level package locates it without importing it (silero_vad imports torch).
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ApplianceError(
                f"{where}: package {package!r} is not installed (pip install {package.replace('_', '-')})"
            )
        path = Path(list(found.submodule_search_locations)[0]) / resource
    r.done()
    if not path.is_file():
        raise ApplianceError(f"{where}: model file {path} does not exist")
    return path


def _check_against_graph(model_path: Path, model: ModelSpec, where: str) -> None:
    """The declared tensors must be the graph's, so a wrong spec fails at build, not on the box."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    graph_inputs = {i.name: i for i in graph.input if i.name not in initializers}
    graph_outputs = {o.name: o for o in graph.output}
    for kind, declared, actual in (("input", model.inputs, graph_inputs), ("output", model.outputs, graph_outputs)):
        names = {t.name for t in declared}
        if names != set(actual):
            raise ApplianceError(f"{where}: declared {kind}s {sorted(names)} but the graph has {sorted(actual)}")
        for tensor in declared:
            elem = actual[tensor.name].type.tensor_type.elem_type
            numpy_type = onnx.helper.tensor_dtype_to_np_dtype(elem).name
            if DATATYPES[tensor.datatype] != numpy_type:
                raise ApplianceError(
                    f"{where}: {kind} {tensor.name} is {numpy_type} in the graph, not {tensor.datatype}"
                )
    for pair in model.state:
        if pair.input not in graph_inputs or pair.output not in graph_outputs:
            raise ApplianceError(f"{where}: state pair {pair.input}->{pair.output} is not in the graph")


def _build_cuda(staging: Path, model: ModelSpec, baked: Baked, where: str) -> list[str]:
    """The `cuda` target: the model's weights in the kernels' layouts, and the kernels compiled
    with the baked values; returns their artifact paths (relative to the bundle)."""
    try:
        weights = kernels.cuda_weights(staging / model.file)
    except ValueError as exc:
        raise ApplianceError(f"{where}: target cuda: {exc}") from None
    relative = f"models/{model.name}.cuda.npz"
    with open(staging / relative, "wb") as f:
        np.savez(f, **weights)  # type: ignore[arg-type]  # numpy's stub puts allow_pickle before **kwds
    binaries = kernels.compile_vad_kernels(baked, model.audio, staging / "kernels")
    return [relative, *(str(p.relative_to(staging)) for p in binaries)]


def build(spec_path: Path, key_path: Path, out_dir: Path, progress: Progress = QUIET) -> Manifest:
    """Build and sign a bundle from a firmware spec; the output directory is replaced atomically."""
    try:
        spec = tomllib.loads(spec_path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ApplianceError(f"{spec_path}: {exc}") from None
    private = keys.load_private_key(key_path)
    r = Reader(spec, str(spec_path))
    # checked as verify checks them: a build never makes a bundle that cannot verify
    name = keys.check_name(r.get("name", str), f"{spec_path}: name")
    version = keys.check_name(r.get("version", str), f"{spec_path}: version")
    targets = tuple(r.get("targets", list, ["cpu"]))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or "cpu" not in targets:
        raise ApplianceError(
            f'{spec_path}: targets: {targets} must include "cpu" (the fallback) and only {", ".join(TARGETS)}'
        )
    baked = read_baked(r.table("baked"))
    make_directories(out_dir.parent)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir.parent))
    staging.chmod(DIRECTORY_MODE)  # mkdtemp makes it 0700; the files in it are 0644 (files.write_blocks)
    try:
        make_directories(staging / "models")
        models, files, plans = [], [], []
        for m in r.tables("models"):
            fields = read_model_fields(m)
            source = _resolve_source(m.get("source", dict), spec_path, f"{m.where}.source")
            audio = read_audio(m)
            m.done()
            relative = f"models/{fields['name']}.onnx"
            with progress.phase(f"copy {relative}", source.stat().st_size) as advance:
                copy_file(source, staging / relative, advance)
            model = ModelSpec(file=relative, audio=audio, **fields)
            _check_against_graph(staging / relative, model, m.where)
            models.append(model)
            files.append(relative)
            if "cuda" in targets:
                files += _build_cuda(staging, model, baked, m.where)
            if "tensorrt" in targets:
                plan = tensorrt.build_plan(staging, model, baked, out_dir.parent / "tensorrt-timing.cache")
                files.append(plan.file)
                plans.append(plan)
        r.done()
        if not models:
            raise ApplianceError(f"{spec_path}: no [[models]]")
        artifacts = hash_files(staging, files, progress, "hash artifacts")
        manifest = Manifest(
            format=FORMAT_VERSION,
            name=name,
            version=version,
            built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            targets=targets,
            baked=baked,
            models=tuple(models),
            artifacts=artifacts,
            signing_key_id=keys.key_id(private.public_key()),
            plans=tuple(plans),
        )
        sign(staging, manifest, private)
        for path in staging.rglob("*"):  # whatever wrote them (nvcc, TensorRT, numpy), whatever the umask
            if not path.is_symlink():
                path.chmod(DIRECTORY_MODE if path.is_dir() else FILE_MODE)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest

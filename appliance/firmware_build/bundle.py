"""Building a bundle from a spec: the ONNX graph checked against the spec, CUDA kernels compiled with the
baked parameters, TensorRT plans built on the target GPU, everything hashed and signed."""

from __future__ import annotations

import dataclasses
import fnmatch
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
from appliance.engine import tensorrt, whisper_weights
from appliance.engine.whisper_ops import baked_shape
from appliance.errors import ApplianceError
from appliance.firmware import graphs, voices
from appliance.firmware.files import copy_file, file_blocks, hash_files, sha256_file, write_blocks
from appliance.firmware.manifest import (
    DATATYPES,
    FORMAT_VERSION,
    TARGETS,
    Baked,
    Manifest,
    ModelSpec,
    Reader,
    TensorSpec,
    check_artifact_path,
    read_audio,
    read_baked,
    read_model_fields,
)
from appliance.firmware_build import ge2e, kernels
from appliance.progress import QUIET, Progress

# Kinds whose model is one ONNX graph: its tensors are checked (or read) at build, and TensorRT plans it.
GRAPH_KINDS = ("vad", "onnx")
# Kinds with no files of their own (a pipeline of other models): no source, file "" in the manifest.
FILELESS_KINDS = ("speech_pipeline",)


def sign(directory: Path, manifest: Manifest, private: Ed25519PrivateKey) -> None:
    """Write the manifest and its signature into a bundle directory."""
    keys.write_signed(directory, asdict(manifest), private)


def _resolve_source(source: Any, spec_path: Path, where: str) -> Path:
    """A source table: `{path}` relative to the spec, or `{package, resource}` inside an installed package;
    a file or a directory."""
    r = Reader(source, where)
    if "path" in r.data:
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
    if not path.exists():
        raise ApplianceError(f"{where}: {path} does not exist")
    return path


def _check_pin(path: Path, pinned: str | None, where: str) -> None:
    """A spec may pin a file's sha256 (a model that ships without a checksum): a build refuses another file."""
    if pinned is not None and (actual := sha256_file(path)) != pinned:
        raise ApplianceError(f"{where}: {path.name} has sha256 {actual}, the spec pins {pinned}")


def _copy_model(m: Reader, name: str, spec_path: Path, staging: Path, progress: Progress) -> tuple[str, list[str]]:
    """The model's source copied into the staging bundle: a file to models/NAME.EXT, a directory to
    models/NAME/ (without `exclude`d names, with `assemble`d files). Its path and its files' paths."""
    source = _resolve_source(m.get("source", dict), spec_path, f"{m.where}.source")
    pinned = m.get("sha256", str, None)
    excluded = m.get("exclude", list, [])
    assembled = m.tables("assemble", [])
    if source.is_file():
        if excluded or assembled:
            raise ApplianceError(f"{m.where}: exclude and assemble need a directory source, {source} is a file")
        _check_pin(source, pinned, m.where)
        relative = f"models/{name}{source.suffix}"
        with progress.phase(f"copy {relative}", source.stat().st_size) as advance:
            copy_file(source, staging / relative, advance)
        return relative, [relative]
    if pinned is not None:
        raise ApplianceError(f"{m.where}.sha256: pins a file, but {source} is a directory (pin its files in assemble)")
    top = f"models/{name}"
    files = [
        f
        for f in sorted(source.rglob("*"))
        if f.is_file()
        and "__pycache__" not in f.parts
        and not any(fnmatch.fnmatch(f.name, pattern) for pattern in excluded)
    ]
    copied = []
    with progress.phase(f"copy {top}/", sum(f.stat().st_size for f in files)) as advance:
        for f in files:
            relative = check_artifact_path(f"{top}/{f.relative_to(source).as_posix()}", f"{m.where}.source")
            make_directories((staging / relative).parent)
            copy_file(f, staging / relative, advance)
            copied.append(relative)
    for a in assembled:
        relative = check_artifact_path(f"{top}/{a.get('file', str)}", a.where)
        parts = [_resolve_source(p, spec_path, f"{a.where}.parts[{i}]") for i, p in enumerate(a.get("parts", list))]
        pin = a.get("sha256", str)
        a.done()
        make_directories((staging / relative).parent)  # a file of a folder the source lacks (voices/NAME.bin)
        with progress.phase(f"assemble {relative}", sum(p.stat().st_size for p in parts)) as advance:
            write_blocks((block for part in parts for block in file_blocks(part)), staging / relative, advance)
        _check_pin(staging / relative, pin, a.where)
        if relative not in copied:
            copied.append(relative)
    if not copied:
        raise ApplianceError(f"{m.where}.source: {source} holds no files")
    return top, copied


def graph_tensors(model_path: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The graph's inputs (initializers excluded) and outputs, as KServe tensors (-1: a free dimension,
    with the name the graph gives it)."""
    graph = onnx.load(str(model_path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}

    def tensor(value: onnx.ValueInfoProto) -> TensorSpec:
        kind = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in kind.shape.dim)
        names = tuple("" if d.HasField("dim_value") else d.dim_param for d in kind.shape.dim)
        if kind.elem_type == onnx.TensorProto.STRING:
            return TensorSpec(value.name, "BYTES", dims, names)
        numpy_type = onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type).name
        datatype = next((k for k, v in DATATYPES.items() if v == numpy_type), f"unsupported:{numpy_type}")
        return TensorSpec(value.name, datatype, dims, names)

    inputs = tuple(tensor(i) for i in graph.input if i.name not in initializers)
    return inputs, tuple(tensor(o) for o in graph.output)


def _checked_tensors(model: ModelSpec, graph_path: Path, where: str, exact: bool) -> ModelSpec:
    """The declared tensors checked against the graph, so a wrong spec fails at build, not on the box.
    `exact`: the spec must declare every tensor (the VAD); else it may name some, and the manifest
    gets the graph's own list."""
    actual_inputs, actual_outputs = graph_tensors(graph_path)
    where = f"{where} (model {model.name})"
    for kind, declared, actual in (("input", model.inputs, actual_inputs), ("output", model.outputs, actual_outputs)):
        by_name = {t.name: t for t in actual}
        if exact and {t.name for t in declared} != set(by_name):
            raise ApplianceError(
                f"{where}: declared {kind}s {sorted(t.name for t in declared)} but the graph has {sorted(by_name)}"
            )
        for tensor in declared:
            found = by_name.get(tensor.name)
            if found is None:
                raise ApplianceError(
                    f"{where}: {kind} {tensor.name!r} is not in the graph (it has {', '.join(by_name)})"
                )
            if found.datatype != tensor.datatype:
                raise ApplianceError(
                    f"{where}: {kind} {tensor.name} is {found.datatype} in the graph, not {tensor.datatype}"
                )
            if len(found.shape) != len(tensor.shape):
                raise ApplianceError(
                    f"{where}: {kind} {tensor.name} has rank {len(found.shape)} in the graph, not {len(tensor.shape)}"
                )
    for tensor in (*actual_inputs, *actual_outputs):
        if tensor.datatype.startswith("unsupported:"):
            raise ApplianceError(
                f"{where}: tensor {tensor.name} has a type KServe cannot carry ({tensor.datatype[12:]})"
            )
    for pair in model.state:
        if pair.input not in {t.name for t in actual_inputs} or pair.output not in {t.name for t in actual_outputs}:
            raise ApplianceError(f"{where}: state pair {pair.input}->{pair.output} is not in the graph")
    if model.audio is not None:  # the VAD's audio fields name graph tensors
        graph_names = {t.name for t in (*actual_inputs, *actual_outputs)}
        for key in ("audio_input", "prob_output", "sample_rate_input"):
            if (named := getattr(model.audio, key)) not in graph_names:
                raise ApplianceError(f"{where}: {key} = {named!r} is not a tensor of the graph")
    if exact:
        return model
    return dataclasses.replace(model, inputs=actual_inputs, outputs=actual_outputs)


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
    binaries = kernels.compile_vad_kernels(baked, model.vad_audio, staging / "kernels")
    return [relative, *(str(p.relative_to(staging)) for p in binaries)]


def _build_whisper_cuda(staging: Path, model: ModelSpec) -> list[str]:
    """The `cuda` target of a Whisper: its CTranslate2 weights converted for the box's own engine
    (float16, engine/whisper_weights.py) and kernels/whisper.cu compiled with its batch and shard length."""
    relative = whisper_weights.bundle_file(model.name)
    whisper_weights.convert(staging / model.file, staging / relative)
    binaries = kernels.compile_whisper_kernels(*baked_shape(model.parameters), staging / "kernels")
    return [relative, *(str(p.relative_to(staging)) for p in binaries)]


def _check_kokoro(model: ModelSpec, directory: Path, where: str) -> None:
    """Every voice a Kokoro model names: a voice of a served language, with a style table of the right size."""
    names = model.parameters["voices"]
    assert isinstance(names, list)
    if not names:
        raise ApplianceError(f"{where}.parameters.voices: a Kokoro model names at least one voice")
    for name in names:
        voices.language_of(str(name), f"{where}.parameters.voices")
        voices.check_style_table(directory / voices.voice_file(str(name)), where)


def _speaker_graph(staging: Path, checkpoint: str, where: str) -> tuple[str, list[str]]:
    """Resemblyzer's checkpoint, copied into the staging bundle, replaced by its ONNX graph."""
    graph = str(Path(checkpoint).with_suffix(".onnx"))
    try:
        ge2e.convert(staging / checkpoint, staging / graph)
    except ApplianceError as exc:
        raise ApplianceError(f"{where}.source: {exc}") from None
    (staging / checkpoint).unlink()
    return graph, [graph]


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
            audio = read_audio(m) if fields["kind"] == "vad" else None
            copied: list[str] = []
            if fields["kind"] in FILELESS_KINDS:  # made of the models before it: nothing to copy
                relative = ""
            else:
                relative, copied = _copy_model(m, fields["name"], spec_path, staging, progress)
            m.done()
            if fields["kind"] == "speaker_embedding":  # a torch checkpoint: the box gets its ONNX graph
                relative, copied = _speaker_graph(staging, relative, m.where)
            model = ModelSpec(file=relative, audio=audio, **fields)
            if model.kind in GRAPH_KINDS:
                if not relative.endswith(".onnx"):
                    raise ApplianceError(f"{m.where}.source: kind {model.kind} takes an ONNX file, got {relative}")
                model = _checked_tensors(model, staging / relative, m.where, exact=model.kind == "vad")
            if model.kind == "speech_synthesis":
                graphs.expose_durations(staging / relative / str(model.parameters["graph"]), m.where)
            if model.kind == "kokoro_speech":
                _check_kokoro(model, staging / relative, m.where)
            models.append(model)
            files += copied
            if "cuda" in targets and model.kind == "vad":
                files += _build_cuda(staging, model, baked, m.where)
            if "cuda" in targets and model.kind == "speech_to_text":
                files += [f for f in _build_whisper_cuda(staging, model) if f not in files]  # models may share kernels
            if "tensorrt" in targets and model.kind in GRAPH_KINDS:
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

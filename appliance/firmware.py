"""Firmware bundles: plain data, one build function, one verify function.

A bundle is a directory:

    manifest.json   what the firmware is: baked shard parameters, models, sha256 of every artifact
    manifest.sig    Ed25519 signature over the exact bytes of manifest.json
    models/*.onnx   the model files

The daemon uses a bundle only through `verify`, which checks the signature against a trusted
key and every artifact's hash before returning the typed manifest.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from appliance import keys
from appliance.errors import ApplianceError
from appliance.progress import QUIET, Advance, Progress, ignore

FORMAT_VERSION = 1
BAKED_PARAMETERS = ("max_tokens_per_shard", "split_algorithm", "fallback_cpu_threshold", "max_batch")
SPLIT_ALGORITHMS = ("semantic", "fixed")
TARGETS = ("cpu", "cuda", "tensorrt")
DATATYPES = {
    "FP32": "float32",
    "FP16": "float16",
    "INT64": "int64",
    "INT32": "int32",
    "INT16": "int16",
    "INT8": "int8",
    "UINT8": "uint8",
    "BOOL": "bool",
    "FP64": "float64",
}
MANIFEST = keys.MANIFEST


@dataclass(frozen=True, slots=True)
class Baked:
    """Shard parameters fixed at build time; runtime config cannot change them."""

    max_tokens_per_shard: int
    split_algorithm: str
    fallback_cpu_threshold: float
    max_batch: int


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StatePair:
    """A recurrent state: fed to `input`, read back from `output`, one row per sequence on `batch_axis`."""

    input: str
    output: str
    batch_axis: int


@dataclass(frozen=True, slots=True)
class AudioSpec:
    sample_rate: int
    frame_samples: int
    context_samples: int
    audio_input: str
    prob_output: str
    sample_rate_input: str


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    kind: str
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    state: tuple[StatePair, ...]
    audio: AudioSpec


@dataclass(frozen=True, slots=True)
class PlanSpec:
    """A TensorRT plan for one model, built on the target GPU; it runs only where both match."""

    model: str
    file: str
    tensorrt_version: str
    compute_capability: str  # "9.0" for the H100
    precision: str  # "fp16" or "fp32"
    fp16_max_abs_error: float  # FP16 against FP32 on the same inputs, measured at build time


@dataclass(frozen=True, slots=True)
class Manifest:
    format: int
    name: str
    version: str
    built_at: str
    targets: tuple[str, ...]
    baked: Baked
    models: tuple[ModelSpec, ...]
    artifacts: dict[str, str]
    signing_key_id: str
    plans: tuple[PlanSpec, ...] = ()

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)


@dataclass(frozen=True, slots=True)
class Bundle:
    path: Path
    manifest: Manifest

    def artifact(self, relative: str) -> Path:
        return self.path / relative


# --- strict reading of plain data (spec TOML and manifest JSON share it) ---------------------------


class _Reader:
    """Reads one table strictly: every key must be known and of the right type."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict):
            raise ApplianceError(f"{where}: expected a table, got {type(data).__name__}")
        self.data, self.where = data, where
        self.used: set[str] = set()

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                raise ApplianceError(f"{self.where}: missing key '{key}'")
            return default
        value = self.data[key]
        if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            raise ApplianceError(f"{self.where}.{key}: expected {_kind_name(kind)}, got {value!r}")
        return value

    def table(self, key: str) -> _Reader:
        return _Reader(self.get(key, dict), f"{self.where}.{key}")

    def tables(self, key: str) -> list[_Reader]:
        return [_Reader(item, f"{self.where}.{key}[{i}]") for i, item in enumerate(self.get(key, list))]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ApplianceError(f"{self.where}: unknown key '{unknown[0]}'")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _read_baked(r: _Reader) -> Baked:
    baked = Baked(
        max_tokens_per_shard=r.get("max_tokens_per_shard", int),
        split_algorithm=r.get("split_algorithm", str),
        fallback_cpu_threshold=float(r.get("fallback_cpu_threshold", (int, float))),
        max_batch=r.get("max_batch", int),
    )
    r.done()
    if baked.max_tokens_per_shard < 1 or baked.max_batch < 1:
        raise ApplianceError(f"{r.where}: max_tokens_per_shard and max_batch must be at least 1")
    if baked.split_algorithm not in SPLIT_ALGORITHMS:
        raise ApplianceError(f"{r.where}.split_algorithm: must be one of {', '.join(SPLIT_ALGORITHMS)}")
    if not 0.0 < baked.fallback_cpu_threshold <= 1.0:
        raise ApplianceError(f"{r.where}.fallback_cpu_threshold: must be in (0, 1]")
    return baked


def _read_tensor(r: _Reader) -> TensorSpec:
    spec = TensorSpec(r.get("name", str), r.get("datatype", str), tuple(r.get("shape", list)))
    r.done()
    if spec.datatype not in DATATYPES:
        raise ApplianceError(f"{r.where}.datatype: unknown datatype {spec.datatype!r}")
    return spec


def _read_state(r: _Reader) -> StatePair:
    pair = StatePair(r.get("input", str), r.get("output", str), r.get("batch_axis", int))
    r.done()
    return pair


def _read_model_fields(r: _Reader) -> dict[str, Any]:
    """The fields a spec's model table and a manifest's model entry have in common."""
    fields = {
        "name": r.get("name", str),
        "kind": r.get("kind", str),
        "inputs": tuple(_read_tensor(t) for t in r.tables("inputs")),
        "outputs": tuple(_read_tensor(t) for t in r.tables("outputs")),
        "state": tuple(_read_state(t) for t in r.tables("state")),
    }
    if fields["kind"] != "vad":
        raise ApplianceError(f"{r.where}.kind: unsupported model kind {fields['kind']!r} (supported: vad)")
    return fields


def _read_audio(r: _Reader) -> AudioSpec:
    return AudioSpec(
        sample_rate=r.get("sample_rate", int),
        frame_samples=r.get("frame_samples", int),
        context_samples=r.get("context_samples", int),
        audio_input=r.get("audio_input", str),
        prob_output=r.get("prob_output", str),
        sample_rate_input=r.get("sample_rate_input", str),
    )


def _read_plan(r: _Reader) -> PlanSpec:
    plan = PlanSpec(
        model=r.get("model", str),
        file=r.get("file", str),
        tensorrt_version=r.get("tensorrt_version", str),
        compute_capability=r.get("compute_capability", str),
        precision=r.get("precision", str),
        fp16_max_abs_error=float(r.get("fp16_max_abs_error", (int, float))),
    )
    r.done()
    return plan


def _manifest_from_data(data: Any, where: str) -> Manifest:
    r = _Reader(data, where)
    models = []
    for m in r.tables("models"):
        fields = _read_model_fields(m)
        audio = _read_audio(m.table("audio"))
        models.append(ModelSpec(file=m.get("file", str), audio=audio, **fields))
        m.done()
    manifest = Manifest(
        format=r.get("format", int),
        name=r.get("name", str),
        version=r.get("version", str),
        built_at=r.get("built_at", str),
        targets=tuple(r.get("targets", list)),
        baked=_read_baked(r.table("baked")),
        models=tuple(models),
        artifacts=dict(r.get("artifacts", dict)),
        signing_key_id=r.get("signing_key_id", str),
        plans=tuple(_read_plan(_Reader(p, f"{where}.plans[{i}]")) for i, p in enumerate(r.get("plans", list, []))),
    )
    r.done()
    for plan in manifest.plans:
        if manifest.model(plan.model) is None or plan.file not in manifest.artifacts:
            raise ApplianceError(f"{where}: plan {plan.file} names no model or file of this bundle")
    if manifest.format != FORMAT_VERSION:
        raise ApplianceError(
            f"{where}: format {manifest.format} is not supported (this runtime reads {FORMAT_VERSION})"
        )
    return manifest


def sign(directory: Path, manifest: Manifest, private: Ed25519PrivateKey) -> None:
    """Write the manifest and its signature into a bundle directory."""
    keys.write_signed(directory, asdict(manifest), private)


def sha256_file(path: Path, advance: Advance = ignore) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            advance(len(block))
    return digest.hexdigest()


def copy_file(source: Path, dest: Path, advance: Advance = ignore) -> None:
    """shutil.copyfile, block by block, so that a progress bar can follow it."""
    with source.open("rb") as src, dest.open("wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            dst.write(block)
            advance(len(block))


def hash_files(directory: Path, relatives: list[str], progress: Progress, desc: str) -> dict[str, str]:
    """The sha256 of each file under directory, as one progress phase."""
    total = sum((directory / r).stat().st_size for r in relatives)
    with progress.phase(desc, total) as advance:
        return {r: sha256_file(directory / r, advance) for r in relatives}


# --- verify ------------------------------------------------------------------------------------------


def verify(bundle_dir: Path, trust_dir: Path, progress: Progress = QUIET) -> Bundle:
    """Return the bundle if its signature verifies against a trusted key and every hash matches.

    Every failure is one ApplianceError naming the file and the reason.
    """
    manifest_path = bundle_dir / MANIFEST
    data = keys.read_signed(bundle_dir, trust_dir, "a firmware")
    manifest = _manifest_from_data(data, str(manifest_path))
    artifacts = sorted(manifest.artifacts.items())
    for relative, _ in artifacts:
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise ApplianceError(f"{manifest_path}: artifact path {relative!r} leaves the bundle")
        if not (bundle_dir / relative).is_file():
            raise ApplianceError(f"{bundle_dir / relative}: artifact listed in the manifest is missing")
    total = sum((bundle_dir / relative).stat().st_size for relative, _ in artifacts)
    with progress.phase(f"verify {bundle_dir}", total) as advance:
        for relative, expected in artifacts:
            if sha256_file(bundle_dir / relative, advance) != expected:
                raise ApplianceError(f"{bundle_dir / relative}: sha256 does not match the manifest (file altered)")
    for model in manifest.models:
        if model.file not in manifest.artifacts:
            raise ApplianceError(f"{manifest_path}: model {model.name} file {model.file} is not a hashed artifact")
    return Bundle(bundle_dir, manifest)


def read_unverified_name(bundle_dir: Path) -> str | None:
    """The firmware name, for error messages only (never to decide anything)."""
    try:
        return str(json.loads((bundle_dir / MANIFEST).read_bytes())["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- build -------------------------------------------------------------------------------------------


def _resolve_source(source: dict[str, Any], spec_path: Path, where: str) -> Path:
    r = _Reader(source, where)
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
    import onnx

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
    import numpy as np

    from appliance import kernels

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
    r = _Reader(spec, str(spec_path))
    name, version = r.get("name", str), r.get("version", str)
    targets = tuple(r.get("targets", list, ["cpu"]))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or "cpu" not in targets:
        raise ApplianceError(
            f'{spec_path}: targets: {targets} must include "cpu" (the fallback) and only {", ".join(TARGETS)}'
        )
    baked = _read_baked(r.table("baked"))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir.parent))
    staging.chmod(0o755)
    try:
        (staging / "models").mkdir()
        models, files, plans = [], [], []
        for m in r.tables("models"):
            fields = _read_model_fields(m)
            source = _resolve_source(m.get("source", dict), spec_path, f"{m.where}.source")
            audio = _read_audio(m)
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
                from appliance.engine import tensorrt

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
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest

"""What a firmware bundle is, as typed frozen data, and the strict reading of it: the manifest JSON
and the build spec TOML share one reader (every key known and of the right type)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import keys
from appliance.errors import ApplianceError
from appliance.firmware.kind_parameters import KIND_PARAMETERS, Parameter

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
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "BYTES": "object",  # strings: a graph's STRING tensors
}
MANIFEST = keys.MANIFEST
ARTIFACT_MAX = 16 * keys.GIB  # the largest artifact read (a TensorRT plan is a few hundred MiB)
# An artifact is a plain relative path: at most 8 parts of letters, digits and . _ + - (none starting with
# a dot), so none is absolute, "." or "..", or the manifest or its signature.
ARTIFACT_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}")
ARTIFACT_PARTS_MAX = 8
SHA256 = re.compile(r"[0-9a-f]{64}")


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
    # the graph's names of its free dimensions ("" where fixed or unnamed): tensors sharing a name must agree
    dim_names: tuple[str, ...] = ()


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
    file: str  # its path in the bundle: a file (an ONNX graph) or a directory of files (models/NAME/)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    state: tuple[StatePair, ...]
    audio: AudioSpec | None = None  # the VAD's audio framing; None for other kinds
    parameters: dict[str, Parameter] = field(default_factory=dict)  # the kind's own (KIND_PARAMETERS)

    @property
    def vad_audio(self) -> AudioSpec:
        """The audio framing, which a VAD's manifest entry always has (the reader checks)."""
        assert self.audio is not None, f"model {self.name} has no audio section"
        return self.audio


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


class Reader:
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

    def table(self, key: str) -> Reader:
        return Reader(self.get(key, dict), f"{self.where}.{key}")

    def tables(self, key: str, default: Any = ...) -> list[Reader]:
        return [Reader(item, f"{self.where}.{key}[{i}]") for i, item in enumerate(self.get(key, list, default))]

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ApplianceError(f"{self.where}: unknown key '{unknown[0]}'")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def read_baked(r: Reader) -> Baked:
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


def _read_tensor(r: Reader) -> TensorSpec:
    spec = TensorSpec(
        r.get("name", str), r.get("datatype", str), tuple(r.get("shape", list)), tuple(r.get("dim_names", list, []))
    )
    r.done()
    if spec.datatype not in DATATYPES:
        raise ApplianceError(f"{r.where}.datatype: unknown datatype {spec.datatype!r}")
    if spec.dim_names and (
        len(spec.dim_names) != len(spec.shape) or not all(isinstance(n, str) for n in spec.dim_names)
    ):
        raise ApplianceError(
            f'{r.where}.dim_names: a name (or "") for each of the shape\'s {len(spec.shape)} dimensions'
        )
    return spec


def _read_state(r: Reader) -> StatePair:
    pair = StatePair(r.get("input", str), r.get("output", str), r.get("batch_axis", int))
    r.done()
    return pair


def read_model_fields(r: Reader) -> dict[str, Any]:
    """The fields a spec's model table and a manifest's model entry have in common."""
    fields = {
        "name": r.get("name", str),
        "kind": r.get("kind", str),
        "inputs": tuple(_read_tensor(t) for t in r.tables("inputs", [])),
        "outputs": tuple(_read_tensor(t) for t in r.tables("outputs", [])),
        "state": tuple(_read_state(t) for t in r.tables("state", [])),
    }
    if fields["kind"] not in KIND_PARAMETERS:
        raise ApplianceError(
            f"{r.where}.kind: unsupported model kind {fields['kind']!r} (supported: {', '.join(KIND_PARAMETERS)})"
        )
    fields["parameters"] = read_parameters(r, fields["kind"])
    return fields


def read_parameters(r: Reader, kind: str) -> dict[str, Parameter]:
    """A model's `parameters` table, checked against its kind's schema; defaults filled in."""
    schema = KIND_PARAMETERS[kind]
    table = r.table("parameters") if "parameters" in r.data else Reader({}, f"{r.where}.parameters")
    r.used.add("parameters")
    values: dict[str, Parameter] = {}
    for key, entry in schema.items():
        value = table.get(key, entry.kind, ... if entry.default is None else entry.default)
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise ApplianceError(f"{table.where}.{key}: expected a list of strings, got {value!r}")
        if entry.choices and value not in entry.choices:
            raise ApplianceError(f"{table.where}.{key}: {value!r} is not one of {', '.join(entry.choices)}")
        if entry.bounds and isinstance(value, int) and not entry.bounds[0] <= value <= entry.bounds[1]:
            raise ApplianceError(f"{table.where}.{key}: {value} is outside {entry.bounds[0]} to {entry.bounds[1]}")
        values[key] = value
    unknown = sorted(set(table.data) - set(schema))
    if unknown:
        known = ", ".join(schema) or "none"
        raise ApplianceError(f"{table.where}: kind {kind} has no parameter '{unknown[0]}' (known: {known})")
    return values


def read_audio(r: Reader) -> AudioSpec:
    return AudioSpec(
        sample_rate=r.get("sample_rate", int),
        frame_samples=r.get("frame_samples", int),
        context_samples=r.get("context_samples", int),
        audio_input=r.get("audio_input", str),
        prob_output=r.get("prob_output", str),
        sample_rate_input=r.get("sample_rate_input", str),
    )


def _read_plan(r: Reader) -> PlanSpec:
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


def check_artifact_path(relative: str, where: str) -> str:
    parts = relative.split("/")
    if len(parts) > ARTIFACT_PARTS_MAX or not all(ARTIFACT_PART.fullmatch(part) for part in parts):
        raise ApplianceError(
            f"{where}: artifact path {relative[:80]!r} leaves the bundle or is not a plain relative path "
            f"(at most {ARTIFACT_PARTS_MAX} parts of letters, digits and . _ + -, none starting with a dot)"
        )
    return relative


def _read_artifacts(r: Reader) -> dict[str, str]:
    artifacts = r.get("artifacts", dict)
    for relative, digest in artifacts.items():
        check_artifact_path(relative, f"{r.where}.artifacts")
        if not isinstance(digest, str) or not SHA256.fullmatch(digest):
            raise ApplianceError(f"{r.where}.artifacts: {relative}: not a sha256 in hex: {str(digest)[:80]!r}")
    return dict(artifacts)


def manifest_from_data(data: Any, where: str) -> Manifest:
    """The typed manifest; the name and version are checked as safe names (keys.check_name) and the
    artifacts as plain paths inside the bundle, so a signed manifest cannot name a file elsewhere."""
    r = Reader(data, where)
    models = []
    for m in r.tables("models"):
        fields = read_model_fields(m)
        audio = read_audio(m.table("audio")) if fields["kind"] == "vad" else m.get("audio", type(None), None)
        models.append(ModelSpec(file=m.get("file", str), audio=audio, **fields))
        m.done()
    manifest = Manifest(
        format=r.get("format", int),
        name=keys.check_name(r.get("name", str), f"{where}.name"),
        version=keys.check_name(r.get("version", str), f"{where}.version"),
        built_at=r.get("built_at", str),
        targets=tuple(r.get("targets", list)),
        baked=read_baked(r.table("baked")),
        models=tuple(models),
        artifacts=_read_artifacts(r),
        signing_key_id=r.get("signing_key_id", str),
        plans=tuple(_read_plan(Reader(p, f"{where}.plans[{i}]")) for i, p in enumerate(r.get("plans", list, []))),
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

"""Firmware bundles: plain data, one build function, one verify function.

A bundle is a directory:

    manifest.json   what the firmware is: baked shard parameters, models, sha256 of every artifact
    manifest.sig    Ed25519 signature over the exact bytes of manifest.json
    models/*.onnx   the model files

The daemon uses a bundle only through `verify`, which checks the signature against a trusted
key and every artifact's hash before returning the typed manifest.

The runtime's side (what the daemon imports) is here: the manifest types (`manifest`) and `verify`.
The build (`build`: graph checks, kernels, TensorRT plans) and the store on the box's data partition
(`store`) are modules of their own that the daemon never imports.
"""

from appliance.firmware.files import sha256_file
from appliance.firmware.manifest import (
    BAKED_PARAMETERS,
    DATATYPES,
    FORMAT_VERSION,
    MANIFEST,
    SPLIT_ALGORITHMS,
    TARGETS,
    AudioSpec,
    Baked,
    Bundle,
    Manifest,
    ModelSpec,
    PlanSpec,
    StatePair,
    TensorSpec,
)
from appliance.firmware.verify import read_unverified_name, verify

__all__ = [
    "BAKED_PARAMETERS",
    "DATATYPES",
    "FORMAT_VERSION",
    "MANIFEST",
    "SPLIT_ALGORITHMS",
    "TARGETS",
    "AudioSpec",
    "Baked",
    "Bundle",
    "Manifest",
    "ModelSpec",
    "PlanSpec",
    "StatePair",
    "TensorSpec",
    "read_unverified_name",
    "sha256_file",
    "verify",
]

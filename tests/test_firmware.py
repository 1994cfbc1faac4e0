"""Firmware bundles through the CLI and the daemon: signed, hashed, refused when tampered with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import Keys, build_bundle, cli


def copy_bundle(bundle: Path, tmp_path: Path) -> Path:
    target = tmp_path / "bundle"
    shutil.copytree(bundle, target)
    return target


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_build_records_baked_parameters_models_and_hashes(bundle: Path, keys: Keys) -> None:
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["baked"] == {
        "max_tokens_per_shard": 1024,
        "split_algorithm": "semantic",
        "fallback_cpu_threshold": 0.85,
        "max_batch": 64,
    }
    model = manifest["models"][0]
    assert model["name"] == "silero_vad" and model["kind"] == "vad"
    assert {t["name"] for t in model["inputs"]} == {"input", "state", "sr"}
    assert model["state"] == [{"input": "state", "output": "stateN", "batch_axis": 1}]
    assert len(manifest["artifacts"]["models/silero_vad.onnx"]) == 64
    assert len((bundle / "manifest.sig").read_bytes()) == 64
    result = cli("firmware", "verify", bundle, "--trusted-keys", keys.trusted)
    assert "ok: voice-vad 1.0.0" in result.stdout


def test_inspect_shows_manifest_and_verification(bundle: Path, keys: Keys) -> None:
    result = cli("firmware", "inspect", bundle, "--trusted-keys", keys.trusted)
    doc = json.loads(result.stdout)
    assert doc["manifest"]["baked"]["max_batch"] == 64 and doc["verified"] is True
    assert doc["trusted_keys"] == str(keys.trusted)


def test_two_builds_with_other_baked_values_differ(bundle: Path, keys: Keys, tmp_path: Path, start_daemon) -> None:
    small = build_bundle(keys, tmp_path / "small", max_batch=8, split_algorithm="fixed")
    default, other = (json.loads((b / "manifest.json").read_text()) for b in (bundle, small))
    assert {
        k: (default["baked"][k], other["baked"][k])
        for k in default["baked"]
        if default["baked"][k] != other["baked"][k]
    } == {
        "max_batch": (64, 8),
        "split_algorithm": ("semantic", "fixed"),
    }
    assert other["artifacts"] == default["artifacts"]  # the same model files: only the baked values differ
    assert (small / "manifest.sig").read_bytes() != (bundle / "manifest.sig").read_bytes()
    for built, max_batch in ((bundle, 64), (small, 8)):  # and each daemon serves what its firmware baked
        assert "ok: voice-vad 1.0.0" in cli("firmware", "verify", built, "--trusted-keys", keys.trusted).stdout
        with start_daemon(bundle_dir=built).client() as client:
            parameters = client.get("/v2/models/silero_vad/config")["parameters"]
            assert parameters["max_batch"] == {"string_value": str(max_batch)}, parameters


@pytest.mark.parametrize(
    "target, offset, reason",
    [
        ("models/silero_vad.onnx", 1000, "sha256 does not match"),
        ("manifest.json", 40, "signature does not verify"),
        ("manifest.sig", 5, "signature does not verify"),
    ],
)
def test_tampered_bundle_is_refused_by_verify_and_daemon(
    bundle: Path, keys: Keys, tmp_path: Path, start_daemon, target: str, offset: int, reason: str
) -> None:
    tampered = copy_bundle(bundle, tmp_path)
    flip_byte(tampered / target, offset)
    result = cli("firmware", "verify", tampered, "--trusted-keys", keys.trusted, check=False)
    assert result.returncode == 2 and reason in result.stderr and target.split("/")[-1] in result.stderr

    daemon = start_daemon(bundle_dir=tampered, wait=False)
    assert daemon.proc.wait(60) == 3
    log = daemon.log.read_text()
    assert reason in log and target.split("/")[-1] in log
    assert not daemon.socket.exists()


def test_bundle_signed_by_untrusted_key_is_refused(keys: Keys, tmp_path: Path, start_daemon) -> None:
    cli("keys", "new", "--out", tmp_path / "rogue.key")  # not added to the trusted directory
    rogue = build_bundle(Keys(tmp_path / "rogue.key", keys.trusted), tmp_path / "rogue")
    daemon = start_daemon(bundle_dir=rogue, wait=False)
    assert daemon.proc.wait(60) == 3
    assert "is not trusted" in daemon.log.read_text()


def test_spec_that_does_not_match_the_graph_fails_the_build(keys: Keys, tmp_path: Path) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(
        (Path(__file__).parent.parent / "firmware/default.toml")
        .read_text()
        .replace('{ name = "sr", datatype = "INT64"', '{ name = "sr", datatype = "FP32"')
    )
    result = cli("firmware", "build", spec, "--key", keys.private, "--out", tmp_path / "out", check=False)
    assert result.returncode == 2 and "(model silero_vad): input sr is INT64 in the graph, not FP32" in result.stderr
    assert not (tmp_path / "out").exists()

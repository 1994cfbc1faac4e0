"""The light client: `pip install appliance` (no `server` extra) into a fresh virtual environment, without
the system's site packages, brings no ONNX Runtime and no onnx, and calls a running daemon. The wheel
also carries the BPF C an installed daemon compiles (share/appliance/bpf)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

CALL = """
import importlib.util, json, sys
import numpy as np
from appliance.client import Client
absent = [m for m in ("onnxruntime", "onnx", "soundfile", "soxr") if importlib.util.find_spec(m) is not None]
with Client(sys.argv[1]) as client:
    outputs = client.infer("silero_vad", {"audio": np.zeros(1024, np.float32)})
    probs = client.speech_probs(np.zeros(1024, np.float32))
print(json.dumps({"present": absent, "outputs": {k: list(v.shape) for k, v in outputs.items()}, "probs": len(probs)}))
"""


def test_the_client_installs_and_calls_without_the_server_packages(daemon, tmp_path: Path) -> None:
    source = tmp_path / "src"  # a copy: building the wheel writes build/ and egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "appliance", source / "appliance", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "bpf", source / "bpf")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = venv / "bin" / "python"
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", source], capture_output=True, text=True
    )
    assert installed.returncode == 0, installed.stderr
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
    packages = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "appliance" in packages and not packages & {"onnxruntime", "onnx", "soundfile", "soxr", "tqdm"}, packages
    for program in ("conncache.c", "quic_steering.c"):  # what an installed daemon's loader compiles
        assert (venv / "share/appliance/bpf" / program).read_bytes() == (ROOT / "bpf" / program).read_bytes()
    called = subprocess.run([python, "-c", CALL, str(daemon.socket)], capture_output=True, text=True, cwd=tmp_path)
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout) == {"present": [], "outputs": {"speech_prob": [2]}, "probs": 2}

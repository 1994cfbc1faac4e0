"""What the engine process keeps of the memory its calls used (issue 39's resident memory): the voices'
ONNX Runtime arenas shrunk after each run (engine/onnx_cpu.py). Each case runs in a fresh Python
process, so the allocator starts as the daemon's does; the control case, an arena never shrunk, shows
what the measure catches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import Keys
from test_whisper_reference import model_dir

RSS = 'int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024'

# Kokoro on a 150-token sentence after a 10-token one: the MiB it keeps once the run has ended
KOKORO_RUN = f"""
import sys, numpy as np
from appliance.engine.onnx_cpu import OnnxCpuEngine
engine = OnnxCpuEngine(sys.argv[2], 1, varied_shapes=sys.argv[1] == "varied")
def run(n):
    ids = np.array([[0] + [43, 102, 56, 16, 85] * (n // 5) + [0]], np.int64)
    engine.run({{"tokens": ids, "style": np.full((1, 256), 0.01, np.float32), "speed": np.ones(1, np.float32)}}, 1)
run(10)
before = {RSS}
run(150)
print({RSS} - before)
"""


def mib(script: str, *args: str) -> int:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_a_voice_keeps_little_of_a_long_sentences_memory_after_its_run(interpreter_bundle: Path, keys: Keys) -> None:
    graph = str(model_dir(interpreter_bundle, keys, "kokoro") / "model.onnx")
    assert mib(KOKORO_RUN, "varied", graph) < 100  # measured: 7 MiB
    assert mib(KOKORO_RUN, "fixed", graph) > 200  # an arena never shrunk keeps the run's (289 MiB)

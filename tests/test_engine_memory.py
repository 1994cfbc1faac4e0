"""What the engine process keeps of the memory its calls used (issue 39's resident memory): glibc's
mmap threshold fixed (engine/heap.py) and the voices' ONNX Runtime arenas shrunk after each run
(engine/onnx_cpu.py). Each case runs in a fresh Python process, so the allocator starts as the daemon's
does; the control case, without the fix, shows what the measure catches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import Keys
from test_whisper_reference import model_dir

RSS = 'int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024'

# 16 blocks of 16 MiB freed, after a freed 24 MiB block moved glibc's threshold past them, with small
# allocations between them so that the heap's top cannot give them back: the MiB returned to the kernel
FREED_BLOCKS = f"""
import sys, numpy as np
from appliance.engine.heap import fix_mmap_threshold
if sys.argv[1] == "fixed":
    fix_mmap_threshold()
big = np.ones((24 << 20) // 8)
del big
blocks, pins = [], []
for _ in range(16):
    blocks.append(np.ones((16 << 20) // 8))
    pins.append(np.ones(1000))
before = {RSS}
del blocks
print(before - {RSS})
"""

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


def test_large_blocks_freed_go_back_to_the_kernel_at_once_with_the_threshold_fixed() -> None:
    assert mib(FREED_BLOCKS, "fixed") >= 200  # 256 MiB were freed
    assert mib(FREED_BLOCKS, "moving") < 64  # glibc's own rule kept them in its heap


def test_a_voice_keeps_little_of_a_long_sentences_memory_after_its_run(interpreter_bundle: Path, keys: Keys) -> None:
    graph = str(model_dir(interpreter_bundle, keys, "kokoro") / "model.onnx")
    assert mib(KOKORO_RUN, "varied", graph) < 100  # measured: 7 MiB
    assert mib(KOKORO_RUN, "fixed", graph) > 200  # an arena never shrunk keeps the run's (289 MiB)

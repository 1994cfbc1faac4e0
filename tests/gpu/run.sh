#!/bin/bash
# The GPU checks (tests/gpu/check.py), one script, run once on a machine with an NVIDIA GPU.
# `run.sh whisper`: the box's own Whisper instead (tests/gpu/whisper_check.py, on the image's CuPy:
# no pycuda needed), its report appended to tests/gpu/results.md; held to 560 s by timeout.
#
# Where pycuda is missing and nothing can be downloaded (the lent test machine), it is built
# from the wheelhouse made on a networked machine by `make gpu-wheelhouse` (.gpu/wheels:
# pycuda's source, its runtime needs, and the appliance's own dependencies).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "SKIP: no NVIDIA GPU or driver on this machine (nvidia-smi -L failed)"
    exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader
if [ "${1:-}" = whisper ]; then
    exec timeout 560 "$PYTHON" -u tests/gpu/whisper_check.py
fi

if ! "$PYTHON" -c "import pycuda.driver" 2>/dev/null; then
    [ -d .gpu/wheels ] || { echo "pycuda is not installed and there is no .gpu/wheels (make gpu-wheelhouse)"; exit 2; }
    site=/tmp/appliance-gpu-site src=/tmp/appliance-pycuda
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .gpu/wheels/*.whl
    rm -rf "$src" && mkdir -p "$src" && tar -xzf .gpu/wheels/pycuda-*.tar.gz -C "$src" --strip-components=1
    # The driver library often has no unversioned libcuda.so for the linker: give it one.
    libcuda=$(ldconfig -p | awk '/libcuda\.so\.1 / {print $NF; exit}')
    mkdir -p /tmp/appliance-cudalib && ln -sf "$libcuda" /tmp/appliance-cudalib/libcuda.so
    nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
    cuda_root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
    started=$(date +%s)
    (cd "$src" && "$PYTHON" configure.py --cuda-root="$cuda_root" \
        --cudadrv-lib-dir=/tmp/appliance-cudalib,"$cuda_root/lib64","$cuda_root/lib64/stubs" >/dev/null &&
     PATH="$(dirname "$nvcc"):$PATH" "$PYTHON" setup.py -q build_ext -j "$(nproc)" --inplace >/tmp/appliance-pycuda.log 2>&1) ||
        { tail -40 /tmp/appliance-pycuda.log; echo "pycuda build failed"; exit 2; }
    echo "pycuda built from source in $(( $(date +%s) - started )) s"
    export PYTHONPATH="$site:$src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import pycuda.driver as d; d.init(); print('pycuda', __import__('pycuda').VERSION_TEXT, 'driver', d.get_driver_version())"
exec "$PYTHON" -u tests/gpu/check.py

"""kernels/whisper.cu on the GPU against the NumPy reference's functions (tests/gpu/whisper_check.py runs
it): the cubin the firmware build compiled, loaded with CuPy, its baked values read back, each kernel on
random inputs of the model's sizes. Not yet run on a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from appliance.engine.whisper_ops import gelu, layer_norm, softmax
from appliance.engine.whisper_rules import Rules

ROWS, HEADS, DIMS, VOCABULARY = 8, 8, 512, 51865


def check(bundle_dir: Path, cupy, rules: Rules) -> list[str]:
    cubin = next((bundle_dir / "kernels").glob("whisper-b*.sm_90.cubin"))
    module = cupy.RawModule(path=str(cubin))
    run = module.get_function
    baked = cupy.zeros(2, cupy.int32)
    run("appliance_baked")((1,), (1,), (baked,))
    lines = [f"{cubin.name}: baked max_batch, shard tokens = {baked.get().tolist()}"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, DIMS)).astype(np.float16)
    gamma, beta = rng.standard_normal(DIMS).astype(np.float16), rng.standard_normal(DIMS).astype(np.float16)
    out = cupy.empty((ROWS, DIMS), cupy.float16)
    run("layer_norm")((ROWS,), (256,), (cupy.asarray(x), cupy.asarray(gamma), cupy.asarray(beta), out, np.int32(DIMS)))
    expected = layer_norm(np, x.astype(np.float32), gamma.astype(np.float32), beta.astype(np.float32))
    lines.append(f"layer_norm: max |gpu - numpy| = {np.abs(out.get() - expected).max():.2e}")
    y = cupy.asarray(x)
    bias = cupy.zeros(DIMS, cupy.float16)
    run("bias_gelu")(((ROWS * DIMS + 255) // 256,), (256,), (y, bias, np.int32(ROWS), np.int32(DIMS)))
    lines.append(f"bias_gelu: max |gpu - numpy| = {np.abs(y.get() - gelu(np, x.astype(np.float32))).max():.2e}")
    positions, lengths = 448, rng.integers(1, 448, ROWS).astype(np.int32)
    q = rng.standard_normal((ROWS, HEADS, 64)).astype(np.float16)
    k, v = (rng.standard_normal((ROWS, HEADS, positions, 64)).astype(np.float16) for _ in range(2))
    heard = cupy.empty((ROWS, HEADS, 64), cupy.float16)
    args = (
        cupy.asarray(q),
        cupy.asarray(k),
        cupy.asarray(v),
        cupy.asarray(lengths),
        heard,
        np.int32(HEADS),
        np.int32(positions),
    )
    run("decode_attention")((ROWS * HEADS,), (256,), args)
    worst = 0.0
    for r in range(ROWS):
        n = lengths[r]
        weights = softmax(np, np.einsum("hd,htd->ht", q[r].astype(np.float32), k[r, :, :n].astype(np.float32)) / 8)
        worst = max(worst, float(np.abs(heard.get()[r] - np.einsum("ht,htd->hd", weights, v[r, :, :n])).max()))
    lines.append(f"decode_attention: max |gpu - numpy| = {worst:.2e}")
    logits = rng.standard_normal((ROWS, VOCABULARY)).astype(np.float32) * 3
    history = np.zeros((ROWS, 448), np.int32)
    counts = np.array([0, 1, 2, 3, 0, 1, 2, 3], np.int32)
    for r in range(ROWS):
        history[r, : counts[r]] = [rules.timestamp_begin + 5, 400, rules.timestamp_begin + 9][: counts[r]]
    tokens, logprobs = cupy.empty(ROWS, cupy.int32), cupy.empty(ROWS, cupy.float32)
    suppress, begin = rules.suppress.astype(np.int32), rules.suppress_begin.astype(np.int32)
    run("greedy_with_rules")(
        (ROWS,),
        (256,),
        (
            cupy.asarray(logits),
            cupy.asarray(history),
            cupy.asarray(counts),
            cupy.asarray(suppress),
            np.int32(len(suppress)),
            cupy.asarray(begin),
            np.int32(len(begin)),
            np.int32(VOCABULARY),
            np.int32(rules.eot),
            np.int32(rules.no_timestamps),
            np.int32(50),
            tokens,
            logprobs,
        ),
    )
    expected_tokens = [
        int(np.argmax(rules.apply(logits[r].copy(), list(history[r, : counts[r]]), True))) for r in range(ROWS)
    ]
    same = sum(int(a) == b for a, b in zip(tokens.get(), expected_tokens))
    lines.append(f"greedy_with_rules: {same} of {ROWS} rows chose the reference's token")
    return lines

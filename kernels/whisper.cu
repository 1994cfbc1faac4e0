// Whisper's fused kernels for the box's own GPU engine (appliance/engine/whisper_model.py is the
// NumPy reference of every step; GEMMs go through cuBLAS, not here). fp16 in and out, float inside.
//
// Baked at firmware build time (nvcc -D...), never read at run time:
//   MAX_BATCH     decoder rows per step (the model's max_batch): the continuous batch's capacity
//   SHARD_TOKENS  encoder positions of a window (the model's max_tokens_per_shard, 1500 at most)
// The runtime reads them back with appliance_baked() and refuses a binary that disagrees with its
// manifest. Model sizes (width, heads, vocabulary) are arguments: one binary serves tiny and base.
#include <cstdint>
#include <cuda_fp16.h>

#ifndef MAX_BATCH
#error "MAX_BATCH must be baked in (-DMAX_BATCH=...)"
#endif
#ifndef SHARD_TOKENS
#error "SHARD_TOKENS must be baked in (-DSHARD_TOKENS=...)"
#endif

#define MAX_POSITIONS 448   // the decoder's context
#define HEAD_DIMS 64        // every Whisper size
#define ENCODER_POSITIONS 1500  // a 30 s window's encoder output, which cross-attention reads whole
#define THREADS 256
#define NEG_INF (-__int_as_float(0x7f800000))

extern "C" {

__constant__ int32_t baked_max_batch = MAX_BATCH;
__constant__ int32_t baked_shard_tokens = SHARD_TOKENS;

// What this binary was built with, for the runtime's check against the manifest.
__global__ void appliance_baked(int32_t *out) {
    out[0] = baked_max_batch;
    out[1] = baked_shard_tokens;
}

// A block's sum (or max) of one float per thread; every thread gets it.
__device__ float block_reduce(float value, bool take_max) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other = __shfl_xor_sync(0xffffffff, value, offset);
        value = take_max ? fmaxf(value, other) : value + other;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    value = lane < warps ? partial[lane] : (take_max ? NEG_INF : 0.0f);
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other = __shfl_xor_sync(0xffffffff, value, offset);
        value = take_max ? fmaxf(value, other) : value + other;
    }
    return value;
}

// Layer norm of each row of x [rows][width] (eps 1e-5). One block per row.
__global__ void layer_norm(const half *x, const half *gamma, const half *beta, half *out, int width) {
    const half *row = x + (size_t)blockIdx.x * width;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) sum += __half2float(row[i]);
    float mean = block_reduce(sum, false) / width;
    float squares = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float d = __half2float(row[i]) - mean;
        squares += d * d;
    }
    float scale = rsqrtf(block_reduce(squares, false) / width + 1e-5f);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float y = (__half2float(row[i]) - mean) * scale;
        out[(size_t)blockIdx.x * width + i] = __float2half(y * __half2float(gamma[i]) + __half2float(beta[i]));
    }
}

// x + bias, then GELU (erf), in place: the MLP's first GEMM's epilogue. x [rows][width].
__global__ void bias_gelu(half *x, const half *bias, int rows, int width) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * width) return;
    float v = __half2float(x[i]) + __half2float(bias[i % width]);
    x[i] = __float2half(0.5f * v * (1.0f + erff(v * 0.70710678f)));
}

// One decoder step's attention for every (row, head): q [rows][heads][64] against keys and values
// [capacity][heads][positions][64], the first lengths[row] positions (its own tokens for
// self-attention, the window's encoder positions for cross-attention); softmax in float.
// One block per (row, head); out [rows][heads][64].
__global__ void decode_attention(const half *q, const half *keys, const half *values, const int32_t *lengths,
                                 half *out, int heads, int positions) {
    __shared__ float scores[ENCODER_POSITIONS];  // more than a decoder's MAX_POSITIONS
    __shared__ float query[HEAD_DIMS];
    int row = blockIdx.x / heads, head = blockIdx.x % heads;
    if (row >= MAX_BATCH) return;
    int length = min(min(lengths[row], positions), ENCODER_POSITIONS);
    const half *k = keys + ((size_t)row * heads + head) * positions * HEAD_DIMS;
    const half *v = values + ((size_t)row * heads + head) * positions * HEAD_DIMS;
    if (threadIdx.x < HEAD_DIMS) query[threadIdx.x] = __half2float(q[((size_t)row * heads + head) * HEAD_DIMS + threadIdx.x]) * 0.125f;
    __syncthreads();
    float top = NEG_INF;
    for (int t = threadIdx.x; t < length; t += blockDim.x) {
        float s = 0.0f;
        for (int d = 0; d < HEAD_DIMS; d++) s += query[d] * __half2float(k[(size_t)t * HEAD_DIMS + d]);
        scores[t] = s;
        top = fmaxf(top, s);
    }
    top = block_reduce(top, true);
    float total = 0.0f;
    for (int t = threadIdx.x; t < length; t += blockDim.x) {
        scores[t] = __expf(scores[t] - top);
        total += scores[t];
    }
    total = block_reduce(total, false);
    __syncthreads();
    if (threadIdx.x < HEAD_DIMS) {
        float acc = 0.0f;
        for (int t = 0; t < length; t++) acc += scores[t] * __half2float(v[(size_t)t * HEAD_DIMS + threadIdx.x]);
        out[((size_t)row * heads + head) * HEAD_DIMS + threadIdx.x] = __float2half(acc / total);
    }
}

// The logit rules and the greedy choice of each row (engine/whisper_rules.py): suppressed tokens,
// no blank or end first, timestamps in pairs and never back, the first at most `max_initial` in,
// a timestamp forced where all of them together are likelier than any text token. logits
// [rows][vocabulary] float; history [rows][MAX_POSITIONS] the tokens each row chose, counts[row]
// of them; out: the token and its log probability. One block per row.
__global__ void greedy_with_rules(float *logits, const int32_t *history, const int32_t *counts,
                                  const int32_t *suppress, int suppress_count, const int32_t *suppress_begin,
                                  int begin_count, int vocabulary, int eot, int no_timestamps, int max_initial,
                                  int32_t *tokens, float *logprobs) {
    int row = blockIdx.x;
    if (row >= MAX_BATCH) return;
    float *x = logits + (size_t)row * vocabulary;
    const int32_t *chosen = history + (size_t)row * MAX_POSITIONS;
    int count = counts[row], begin = no_timestamps + 1;
    for (int i = threadIdx.x; i < suppress_count; i += blockDim.x) x[suppress[i]] = NEG_INF;
    if (count == 0)
        for (int i = threadIdx.x; i < begin_count; i += blockDim.x) x[suppress_begin[i]] = NEG_INF;
    if (threadIdx.x == 0) x[no_timestamps] = NEG_INF;
    int cut_from = vocabulary, cut_to = vocabulary, text_to = 0;  // ranges [cut_from, cut_to) and [0, text_to) go
    if (count == 0) {
        text_to = begin;
        cut_from = begin + max_initial + 1;
    } else {
        bool last = chosen[count - 1] >= begin, penultimate = count < 2 || chosen[count - 2] >= begin;
        if (last && penultimate) cut_from = begin;
        if (last && !penultimate) text_to = eot;
        int stamp = -1;
        for (int i = count - 1; i >= 0 && stamp < 0; i--)
            if (chosen[i] >= begin) stamp = chosen[i];
        if (stamp >= 0 && cut_from > begin) {  // never back in time; a piece is never empty
            int upto = stamp + ((last && !penultimate) ? 0 : 1);
            for (int i = begin + threadIdx.x; i < upto; i += blockDim.x) x[i] = NEG_INF;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < vocabulary; i += blockDim.x)
        if (i < text_to || (i >= cut_from && i < cut_to)) x[i] = NEG_INF;
    __syncthreads();
    float top = NEG_INF, text_top = NEG_INF;
    for (int i = threadIdx.x; i < vocabulary; i += blockDim.x) {
        top = fmaxf(top, x[i]);
        if (i < begin) text_top = fmaxf(text_top, x[i]);
    }
    top = block_reduce(top, true);
    text_top = block_reduce(text_top, true);
    float total = 0.0f, stamps = 0.0f;
    for (int i = threadIdx.x; i < vocabulary; i += blockDim.x) {
        float e = __expf(x[i] - top);
        total += e;
        if (i >= begin) stamps += e;
    }
    total = block_reduce(total, false);
    stamps = block_reduce(stamps, false);
    bool force_stamp = __logf(stamps) > text_top - top;  // both against the same normalizer
    // argmax (lowest index on ties, as NumPy's) over what is left
    float best = NEG_INF;
    int best_at = vocabulary;
    for (int i = threadIdx.x; i < vocabulary; i += blockDim.x) {
        if (force_stamp && i < begin) continue;
        if (x[i] > best || (x[i] == best && i < best_at)) best = x[i], best_at = i;
    }
    __shared__ float bests[THREADS];
    __shared__ int best_ats[THREADS];
    bests[threadIdx.x] = best;
    best_ats[threadIdx.x] = best_at;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            float b = bests[threadIdx.x + stride];
            int a = best_ats[threadIdx.x + stride];
            if (b > bests[threadIdx.x] || (b == bests[threadIdx.x] && a < best_ats[threadIdx.x]))
                bests[threadIdx.x] = b, best_ats[threadIdx.x] = a;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        int token = best_ats[0];
        tokens[row] = token;
        // its log probability under the rules: a forced timestamp renormalizes over the timestamps
        float normalizer = force_stamp ? stamps : total;
        logprobs[row] = x[token] - top - __logf(normalizer);
    }
}

}  // extern "C"

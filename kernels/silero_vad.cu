// The default VAD model (Silero VAD v5, 16 kHz) for a batch of live streams on the GPU.
//
// Baked at firmware build time (nvcc -D...), never read at run time:
//   MAX_BATCH        streams per engine call (the firmware's max_batch)
//   SHARD_FRAMES     frames per shard of a long recording (max_tokens_per_shard)
//   FRAME_SAMPLES    samples per frame (512)
//   CONTEXT_SAMPLES  samples of the previous frame fed again (64)
// The runtime reads them back with appliance_baked() and refuses a binary that disagrees with
// its manifest. Weights come from the ONNX file, laid out by the firmware build for coalesced
// reads: every weight matrix is stored input-major ([in][out]), so neighbouring threads, which
// compute neighbouring output channels, read neighbouring addresses.
//
// Each block runs TILE streams, so every weight it reads serves TILE streams; the NumPy
// reference (appliance/engine/reference.py) is the ground truth for every step.
#include <cstdint>

#ifndef MAX_BATCH
#error "MAX_BATCH must be baked in (-DMAX_BATCH=...)"
#endif
#ifndef SHARD_FRAMES
#error "SHARD_FRAMES must be baked in (-DSHARD_FRAMES=...)"
#endif
#ifndef FRAME_SAMPLES
#define FRAME_SAMPLES 512
#endif
#ifndef CONTEXT_SAMPLES
#define CONTEXT_SAMPLES 64
#endif

#define INPUT_SAMPLES (CONTEXT_SAMPLES + FRAME_SAMPLES)   // 576
#define TILE 8
#define HIDDEN 128

extern "C" {

__constant__ int32_t baked_max_batch = MAX_BATCH;
__constant__ int32_t baked_shard_frames = SHARD_FRAMES;
__constant__ int32_t baked_frame_samples = FRAME_SAMPLES;
__constant__ int32_t baked_context_samples = CONTEXT_SAMPLES;

// What this binary was built with, for the runtime's check against the manifest.
__global__ void appliance_baked(int32_t *out) {
    out[0] = baked_max_batch;
    out[1] = baked_shard_frames;
    out[2] = baked_frame_samples;
    out[3] = baked_context_samples;
}

// PCM16 from clients -> float32 samples in [-1, 1).
__global__ void pcm16_to_float(const int16_t *pcm, float *out, int count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) out[i] = pcm[i] * (1.0f / 32768.0f);
}

// The model input of each stream: its saved context, then its new frame; the new context is
// the frame's last CONTEXT_SAMPLES. One block per stream.
__global__ void frame_with_context(const float *frames, float *context, float *x, int batch) {
    int b = blockIdx.x;
    if (b >= batch || b >= MAX_BATCH) return;
    for (int i = threadIdx.x; i < INPUT_SAMPLES; i += blockDim.x) {
        x[b * INPUT_SAMPLES + i] = i < CONTEXT_SAMPLES ? context[b * CONTEXT_SAMPLES + i]
                                                       : frames[b * FRAME_SAMPLES + i - CONTEXT_SAMPLES];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < CONTEXT_SAMPLES; i += blockDim.x)
        context[b * CONTEXT_SAMPLES + i] = frames[b * FRAME_SAMPLES + FRAME_SAMPLES - CONTEXT_SAMPLES + i];
}

// Per-sequence state rows live in a device table, one slot per live sequence; a batch gathers
// its rows by slot and scatters the new ones back.
__global__ void gather_rows(const float *table, const int32_t *slots, float *rows, int batch, int width) {
    int b = blockIdx.x;
    if (b >= batch) return;
    for (int i = threadIdx.x; i < width; i += blockDim.x) rows[b * width + i] = table[slots[b] * width + i];
}

__global__ void scatter_rows(const float *rows, const int32_t *slots, float *table, int batch, int width) {
    int b = blockIdx.x;
    if (b >= batch) return;
    for (int i = threadIdx.x; i < width; i += blockDim.x) table[slots[b] * width + i] = rows[b * width + i];
}

// A 1-D convolution for TILE streams per block: in [B][C_in][T_in], weight [C_in][K][C_out],
// out [B][C_out][T_out]. Threads cover (output channel, output time); the inputs of the tile
// sit in shared memory. Used for the STFT (its basis as 258 filters of 256 taps, stride 128,
// after reflect padding) and the four encoder layers (kernel 3, padding 1, with ReLU).
__global__ void conv1d_tile(const float *in, const float *weight, const float *bias, float *out, int batch,
                            int c_in, int t_in, int c_out, int t_out, int kernel, int stride, int padding,
                            int relu, int reflect_pad_right) {
    extern __shared__ float tile_in[];  // [TILE][C_in][T_in + reflect_pad_right]
    int first = blockIdx.x * TILE;
    int width = t_in + reflect_pad_right;
    for (int i = threadIdx.x; i < TILE * c_in * width; i += blockDim.x) {
        int s = i / (c_in * width), c = (i / width) % c_in, t = i % width;
        int b = first + s;
        // reflect padding: position t_in + j mirrors t_in - 2 - j
        int source = t < t_in ? t : 2 * t_in - 2 - t;
        tile_in[i] = b < batch ? in[(b * c_in + c) * t_in + source] : 0.0f;
    }
    __syncthreads();
    for (int job = threadIdx.x; job < c_out * t_out; job += blockDim.x) {
        int o = job % c_out, t = job / c_out;
        float acc[TILE];
        for (int s = 0; s < TILE; ++s) acc[s] = bias ? bias[o] : 0.0f;
        for (int c = 0; c < c_in; ++c) {
            for (int k = 0; k < kernel; ++k) {
                int position = t * stride + k - padding;
                if (position < 0 || position >= width) continue;
                float w = __ldg(&weight[(c * kernel + k) * c_out + o]);
                for (int s = 0; s < TILE; ++s) acc[s] += w * tile_in[(s * c_in + c) * width + position];
            }
        }
        for (int s = 0; s < TILE; ++s) {
            int b = first + s;
            if (b < batch) out[(b * c_out + o) * t_out + t] = relu ? fmaxf(acc[s], 0.0f) : acc[s];
        }
    }
}

// |STFT|: spectrum [B][2*bins][T] (real, then imaginary) -> magnitude [B][bins][T].
__global__ void magnitude(const float *spectrum, float *out, int batch, int bins, int frames) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= batch * bins * frames) return;
    int b = i / (bins * frames), rest = i % (bins * frames);
    float re = spectrum[b * 2 * bins * frames + rest], im = spectrum[b * 2 * bins * frames + bins * frames + rest];
    out[i] = sqrtf(re * re + im * im);
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + __expf(-x)); }

// The LSTM cell and the decoder for TILE streams per block, one thread per hidden unit.
// features [B][128]; state [2][B][128] (h, c) updated in place; weight_ih_t, weight_hh_t
// [128][512] (gates i, f, g, o); probs [B] = sigmoid(relu(h') . w_dec + b_dec).
__global__ void lstm_decoder(const float *features, float *state, const float *weight_ih_t, const float *weight_hh_t,
                             const float *bias, const float *w_dec, const float *b_dec, float *probs, int batch) {
    __shared__ float x[TILE][HIDDEN], h[TILE][HIDDEN], partial[TILE][HIDDEN];
    int first = blockIdx.x * TILE, j = threadIdx.x;
    for (int s = 0; s < TILE; ++s) {
        int b = first + s;
        x[s][j] = b < batch ? features[b * HIDDEN + j] : 0.0f;
        h[s][j] = b < batch ? state[b * HIDDEN + j] : 0.0f;
    }
    __syncthreads();
    float gate[4][TILE];
    for (int g = 0; g < 4; ++g)
        for (int s = 0; s < TILE; ++s) gate[g][s] = bias[g * HIDDEN + j];
    for (int k = 0; k < HIDDEN; ++k) {
        for (int g = 0; g < 4; ++g) {
            float wi = __ldg(&weight_ih_t[k * 4 * HIDDEN + g * HIDDEN + j]);
            float wh = __ldg(&weight_hh_t[k * 4 * HIDDEN + g * HIDDEN + j]);
            for (int s = 0; s < TILE; ++s) gate[g][s] += wi * x[s][k] + wh * h[s][k];
        }
    }
    for (int s = 0; s < TILE; ++s) {
        int b = first + s;
        float c = b < batch ? state[(batch + b) * HIDDEN + j] : 0.0f;
        c = sigmoidf(gate[1][s]) * c + sigmoidf(gate[0][s]) * tanhf(gate[2][s]);
        float hidden = sigmoidf(gate[3][s]) * tanhf(c);
        if (b < batch) {
            state[b * HIDDEN + j] = hidden;
            state[(batch + b) * HIDDEN + j] = c;
        }
        partial[s][j] = fmaxf(hidden, 0.0f) * w_dec[j];
    }
    __syncthreads();
    for (int stride = HIDDEN / 2; stride > 0; stride >>= 1) {
        if (j < stride)
            for (int s = 0; s < TILE; ++s) partial[s][j] += partial[s][j + stride];
        __syncthreads();
    }
    if (j < TILE && first + j < batch) probs[first + j] = sigmoidf(partial[j][0] + b_dec[0]);
}

}  // extern "C"

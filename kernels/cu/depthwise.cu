/* Kernels of memtrain's depthwise conv2d (src/depthwise.rs): forward, input gradient and
 * weight gradient in f32, f16 and bf16 (f32 arithmetic). Compiled at run time with NVRTC after
 * prelude.cuh (types and half-precision load/store). */
/* One thread per output element; grid = (N*C planes, tiles of Ho*Wo). */
template <typename T>
__device__ void dw_forward(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                           u32 N, u32 C, u32 H, u32 W, u32 K, u32 S, u32 P, u32 Ho, u32 Wo) {
    const u32 plane = blockIdx.x;
    const u32 pos = blockIdx.y * blockDim.x + threadIdx.x;
    if (pos >= Ho * Wo) return;
    const u32 oy = pos / Wo, ox = pos - oy * Wo;
    const T* xp = x + (size_t)plane * H * W;
    const T* wp = w + (size_t)(plane % C) * K * K;
    const int iy0 = (int)(oy * S) - (int)P, ix0 = (int)(ox * S) - (int)P;
    float acc = 0.0f;
    for (u32 ky = 0; ky < K; ++ky) {
        const int iy = iy0 + (int)ky;
        if (iy < 0 || iy >= (int)H) continue;
        for (u32 kx = 0; kx < K; ++kx) {
            const int ix = ix0 + (int)kx;
            if (ix < 0 || ix >= (int)W) continue;
            acc += load(wp, ky * K + kx) * load(xp, (size_t)iy * W + ix);
        }
    }
    store(y, (size_t)plane * Ho * Wo + pos, acc);
}

/* Input gradient as a gather (no atomics): one thread per input element sums the
   (tap, output) pairs that read it. grid = (N*C planes, tiles of H*W). */
template <typename T>
__device__ void dw_input_grad(const T* __restrict__ dy, const T* __restrict__ w, T* __restrict__ dx,
                              u32 N, u32 C, u32 H, u32 W, u32 K, u32 S, u32 P, u32 Ho, u32 Wo) {
    const u32 plane = blockIdx.x;
    const u32 pos = blockIdx.y * blockDim.x + threadIdx.x;
    if (pos >= H * W) return;
    const u32 iy = pos / W, ix = pos - iy * W;
    const T* dyp = dy + (size_t)plane * Ho * Wo;
    const T* wp = w + (size_t)(plane % C) * K * K;
    float acc = 0.0f;
    for (u32 ky = 0; ky < K; ++ky) {
        const int ty = (int)(iy + P) - (int)ky;
        if (ty < 0) break; /* only decreases with ky */
        if ((u32)ty % S != 0) continue;
        const u32 oy = (u32)ty / S;
        if (oy >= Ho) continue;
        for (u32 kx = 0; kx < K; ++kx) {
            const int tx = (int)(ix + P) - (int)kx;
            if (tx < 0) break;
            if ((u32)tx % S != 0) continue;
            const u32 ox = (u32)tx / S;
            if (ox >= Wo) continue;
            acc += load(wp, ky * K + kx) * load(dyp, (size_t)oy * Wo + ox);
        }
    }
    store(dx, (size_t)plane * H * W + pos, acc);
}

/* Weight gradient: one block per (c, ky, kx) reduces dy * x over N, Ho, Wo. */
template <typename T>
__device__ void dw_weight_grad(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dw,
                               u32 N, u32 C, u32 H, u32 W, u32 K, u32 S, u32 P, u32 Ho, u32 Wo) {
    __shared__ float warp_sums[32];
    const u32 KK = K * K;
    const u32 c = blockIdx.x / KK, tap = blockIdx.x - c * KK;
    const u32 ky = tap / K, kx = tap - ky * K;
    const u32 HoWo = Ho * Wo;
    float acc = 0.0f;
    for (u32 n = 0; n < N; ++n) {
        const size_t plane = (size_t)n * C + c;
        const T* xp = x + plane * H * W;
        const T* dyp = dy + plane * HoWo;
        for (u32 pos = threadIdx.x; pos < HoWo; pos += blockDim.x) {
            const u32 oy = pos / Wo, ox = pos - oy * Wo;
            const int iy = (int)(oy * S + ky) - (int)P, ix = (int)(ox * S + kx) - (int)P;
            if (iy >= 0 && iy < (int)H && ix >= 0 && ix < (int)W) {
                acc += load(dyp, pos) * load(xp, (size_t)iy * W + ix);
            }
        }
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        const u32 warps = (blockDim.x + 31u) >> 5;
        acc = lane < warps ? warp_sums[lane] : 0.0f;
        for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
        if (lane == 0) store(dw, blockIdx.x, acc);
    }
}

#define DW_ARGS u32 N, u32 C, u32 H, u32 W, u32 K, u32 S, u32 P, u32 Ho, u32 Wo
#define DW_PASS N, C, H, W, K, S, P, Ho, Wo
#define DW_KERNELS(SUFFIX, T)                                                                  \
    extern "C" __global__ void depthwise_forward_##SUFFIX(const T* a, const T* b, T* out, DW_ARGS) { \
        dw_forward<T>(a, b, out, DW_PASS);                                                     \
    }                                                                                          \
    extern "C" __global__ void depthwise_input_grad_##SUFFIX(const T* a, const T* b, T* out, DW_ARGS) { \
        dw_input_grad<T>(a, b, out, DW_PASS);                                                  \
    }                                                                                          \
    extern "C" __global__ void depthwise_weight_grad_##SUFFIX(const T* a, const T* b, T* out, DW_ARGS) { \
        dw_weight_grad<T>(a, b, out, DW_PASS);                                                 \
    }

DW_KERNELS(f32, float)
DW_KERNELS(f16, half16)
DW_KERNELS(bf16, bfloat16)

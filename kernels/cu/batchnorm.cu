/* Kernels of memtrain's fused BatchNorm (+ ReLU) (src/batchnorm/): batch statistics,
 * normalization and the backward's per-channel sums and input gradient, in f32, f16 and bf16 (all
 * arithmetic f32). Compiled at run time with NVRTC after prelude.cuh (types and half-precision
 * load/store).
 *
 * Per-channel reductions are split over S blocks per channel (grid C x S, each block a contiguous
 * range of images, 256 threads, warp-shuffle + shared-memory tree) that write partial sums, and a
 * small kernel (one thread per channel) adds the S partials: one block per channel left most SMs
 * idle at CIFAR shapes (32 channels on 132 SMs): at [128, 32, 32, 32] on an H100 a reduction pass
 * took 80-94 us that way and takes 11-17 us split (ncu). Elements are visited plane by plane (no
 * per-element division) where a plane fills a warp. Elementwise passes use a grid-stride loop.
 */
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the block; every thread gets the total. blockDim.x must be a multiple of 32. */
__device__ float block_sum(float v) {
    __shared__ float sh[32];
    v = warp_sum(v);
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? sh[lane] : 0.0f;
    v = warp_sum(v);
    __syncthreads(); /* sh is reused by the next call */
    return v;
}

/* Calls f(index) for every element of channel c in images [n0, n1) that this thread owns.
   Planes (the HW elements of one image and channel) are contiguous: a plane at least a block wide
   is swept by the whole block, a plane at least a warp wide by one warp, and tiny planes (1x1, 2x2,
   4x4) are flattened with one division per element. The loops are unrolled so that each thread has
   several independent loads in flight (a reduction pass is memory-latency bound otherwise). */
template <typename F>
__device__ __forceinline__ void for_channel(unsigned n0, unsigned n1, unsigned c, unsigned C, unsigned HW, F f) {
    if (HW >= blockDim.x) {
        for (unsigned n = n0; n < n1; ++n) {
            const unsigned base = (n * C + c) * HW;
#pragma unroll 4
            for (unsigned i = threadIdx.x; i < HW; i += blockDim.x) f(base + i);
        }
    } else if (HW >= 32) {
        const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
        for (unsigned n = n0 + warp; n < n1; n += nw) {
            const unsigned base = (n * C + c) * HW;
#pragma unroll 4
            for (unsigned i = lane; i < HW; i += 32) f(base + i);
        }
    } else {
        const unsigned cnt = (n1 - n0) * HW;
#pragma unroll 4
        for (unsigned j = threadIdx.x; j < cnt; j += blockDim.x) {
            const unsigned q = j / HW;
            f(((n0 + q) * C + c) * HW + (j - q * HW));
        }
    }
}

/* Block (c, s) of a split reduction covers images [s*N/S, (s+1)*N/S) of channel c. */
#define SPLIT_RANGE                                            \
    const unsigned c = blockIdx.x, s = blockIdx.y, S = gridDim.y; \
    const unsigned n0 = s * N / S, n1 = (s + 1) * N / S;

/* Pass 1 of the statistics: partial sums of x. */
template <typename T>
__device__ void psum_impl(const T* __restrict__ x, float* __restrict__ psum, unsigned C, unsigned HW, unsigned N) {
    SPLIT_RANGE
    float acc = 0.0f;
    for_channel(n0, n1, c, C, HW, [&](unsigned i) { acc += load(x, i); });
    acc = block_sum(acc);
    if (threadIdx.x == 0) psum[c * S + s] = acc;
}

/* Sum of the S partials of channel c (S is small; every thread reads them, from cache). */
__device__ __forceinline__ float partials(const float* p, unsigned c, unsigned S) {
    float t = 0.0f;
    for (unsigned k = 0; k < S; ++k) t += p[c * S + k];
    return t;
}

/* Pass 2 of the statistics: partial sums of (x - mean)^2, the mean from pass 1's partials. */
template <typename T>
__device__ void psq_impl(const T* __restrict__ x, const float* __restrict__ psum, float* __restrict__ psq,
                         unsigned C, unsigned HW, unsigned N) {
    SPLIT_RANGE
    const float mean = partials(psum, c, S) / (float)(N * HW);
    float acc = 0.0f;
    for_channel(n0, n1, c, C, HW, [&](unsigned i) {
        const float d = load(x, i) - mean;
        acc += d * d;
    });
    acc = block_sum(acc);
    if (threadIdx.x == 0) psq[c * S + s] = acc;
}

/* Backward partials: sum g' and sum g'·(x - mean), g' the ReLU-masked upstream gradient. */
template <typename T>
__device__ void bwd_partial_impl(const T* __restrict__ x, const T* __restrict__ gy, const T* __restrict__ y,
                                 const float* __restrict__ stats, float* __restrict__ part, unsigned C,
                                 unsigned HW, unsigned N, int relu) {
    SPLIT_RANGE
    const float mean = stats[c];
    float sg = 0.0f, sgx = 0.0f;
    for_channel(n0, n1, c, C, HW, [&](unsigned i) {
        float g = load(gy, i);
        if (relu && !(load(y, i) > 0.0f)) g = 0.0f;
        sg += g;
        sgx += g * (load(x, i) - mean);
    });
    sg = block_sum(sg);
    sgx = block_sum(sgx);
    if (threadIdx.x == 0) {
        part[2 * (c * S + s)] = sg;
        part[2 * (c * S + s) + 1] = sgx;
    }
}

/* Final step of the statistics, one thread per channel: stats = [mean; biased var]. */
extern "C" __global__ void bn_stats_final(const float* psum, const float* psq, float* stats, unsigned C,
                                          unsigned S, unsigned M) {
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    stats[c] = partials(psum, c, S) / (float)M;
    stats[C + c] = partials(psq, c, S) / (float)M;
}

/* Final step of the backward sums, one thread per channel: out = [grad_gamma; grad_beta]. */
extern "C" __global__ void bn_bwd_final(const float* part, const float* stats, float* out, unsigned C,
                                        unsigned S, float eps) {
    const unsigned c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sg = 0.0f, sgx = 0.0f;
    for (unsigned k = 0; k < S; ++k) {
        sg += part[2 * (c * S + k)];
        sgx += part[2 * (c * S + k) + 1];
    }
    out[c] = sgx * rsqrtf(stats[C + c] + eps);
    out[C + c] = sg;
}

template <typename T>
__device__ void norm_impl(const T* __restrict__ x, const float* __restrict__ gamma, const float* __restrict__ beta,
                          const float* __restrict__ stats, T* __restrict__ y, unsigned C, unsigned HW,
                          unsigned total, float eps, int relu) {
    for (unsigned e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const unsigned c = (e / HW) % C;
        const float scale = gamma[c] * rsqrtf(stats[C + c] + eps);
        float v = (load(x, e) - stats[c]) * scale + beta[c];
        if (relu) v = fmaxf(v, 0.0f);
        store(y, e, v);
    }
}

template <typename T>
__device__ void bwd_input_impl(const T* __restrict__ x, const T* __restrict__ gy, const T* __restrict__ y,
                               const float* __restrict__ stats, const float* __restrict__ gamma,
                               const float* __restrict__ sums, T* __restrict__ gx, unsigned C, unsigned HW,
                               unsigned total, float inv_m, float eps, int relu) {
    for (unsigned e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
        const unsigned c = (e / HW) % C;
        const float inv = rsqrtf(stats[C + c] + eps);
        const float a = gamma[c] * inv;
        const float b = -inv * sums[c] * inv_m;
        const float k = -sums[C + c] * inv_m;
        float g = load(gy, e);
        if (relu && !(load(y, e) > 0.0f)) g = 0.0f;
        store(gx, e, a * (g + b * (load(x, e) - stats[c]) + k));
    }
}

#define BN_KERNELS(T, SFX)                                                                                  \
    extern "C" __global__ void bn_psum_##SFX(const T* x, float* psum, unsigned C, unsigned HW, unsigned N) {  \
        psum_impl<T>(x, psum, C, HW, N);                                                                    \
    }                                                                                                       \
    extern "C" __global__ void bn_psq_##SFX(const T* x, const float* psum, float* psq, unsigned C,          \
                                            unsigned HW, unsigned N) {                                      \
        psq_impl<T>(x, psum, psq, C, HW, N);                                                                \
    }                                                                                                       \
    extern "C" __global__ void bn_norm_##SFX(const T* x, const float* gamma, const float* beta,             \
                                             const float* stats, T* y, unsigned C, unsigned HW,             \
                                             unsigned total, float eps, int relu) {                         \
        norm_impl<T>(x, gamma, beta, stats, y, C, HW, total, eps, relu);                                    \
    }                                                                                                       \
    extern "C" __global__ void bn_bwd_partial_##SFX(const T* x, const T* gy, const T* y, const float* stats, \
                                                    float* part, unsigned C, unsigned HW, unsigned N,        \
                                                    int relu) {                                             \
        bwd_partial_impl<T>(x, gy, y, stats, part, C, HW, N, relu);                                         \
    }                                                                                                       \
    extern "C" __global__ void bn_bwd_input_##SFX(const T* x, const T* gy, const T* y, const float* stats,   \
                                                  const float* gamma, const float* sums, T* gx, unsigned C,  \
                                                  unsigned HW, unsigned total, float inv_m, float eps,       \
                                                  int relu) {                                               \
        bwd_input_impl<T>(x, gy, y, stats, gamma, sums, gx, C, HW, total, inv_m, eps, relu);                \
    }

BN_KERNELS(float, f32)
BN_KERNELS(half16, f16)
BN_KERNELS(bfloat16, bf16)

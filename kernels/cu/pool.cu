/* Kernels of memtrain's 2x2 max-pool (src/pool.rs): one thread per 2x2 window, forward (dy
 * null: the window's first maximum) or backward (dy routed to the window's first maximum, zero
 * to the other three). Compiled at run time with NVRTC after prelude.cuh (types and
 * half-precision load/store). 16-bit values are widened (load) only for the comparison; the
 * values themselves are copied bit for bit. */
template <typename T>
__device__ void pool(const T* x, const T* dy, T* out, u64 windows, u32 h, u32 w) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= windows) return;
    u32 wo = w / 2, ho = h / 2;
    u64 p = i / ((u64)ho * wo);
    u32 r = (u32)(i % ((u64)ho * wo)), oy = r / wo, ox = r % wo;
    u64 base = p * h * w + 2ull * oy * w + 2ull * ox;
    u64 idx[4] = {base, base + 1, base + w, base + w + 1};
    int best = 0; float bv = load(x, idx[0]);
    for (int k = 1; k < 4; k++) { float v = load(x, idx[k]); if (v > bv) { bv = v; best = k; } }
    if (dy == 0) { out[i] = x[idx[best]]; }
    else { for (int k = 0; k < 4; k++) out[idx[k]] = (k == best) ? dy[i] : T{}; /* T{}: all-zero bits, +0.0 */ }
}

#define POOL(SUFFIX, T) \
    extern "C" __global__ void pool_##SUFFIX(const T* x, const T* dy, T* out, u64 windows, u32 h, u32 w) { \
        pool<T>(x, dy, out, windows, h, w); \
    }

POOL(f32, float)
POOL(f16, half16)
POOL(bf16, bfloat16)

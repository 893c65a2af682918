/* Shared prelude of memtrain's CUDA kernel sources: src/util.rs (`kernel_source!`) puts it in
 * front of each cu/ file before NVRTC compiles it, and scripts/cuda-check.sh does the same.
 * No headers: NVRTC compiles these at run time without the toolkit's include directory, so half
 * types are 16-bit structs converted with `cvt` instructions / bit operations; storage is the
 * same 2 bytes as `__half`/`__nv_bfloat16`, and all arithmetic on them is f32.
 *
 * load/store are the only f32 <-> half conversions of the kernels. store's pointer is
 * `__restrict__` so that a kernel storing through it keeps its other loads on the read-only path
 * (`ld.global.nc`), as a direct store through a restrict kernel parameter does. */
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

struct half16 { u16 bits; };
struct bfloat16 { u16 bits; };

__device__ __forceinline__ float load(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ double load(const double* p, u64 i) { return p[i]; }
__device__ __forceinline__ float load(const half16* p, u64 i) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i].bits));
    return f;
}
__device__ __forceinline__ float load(const bfloat16* p, u64 i) {
    return __uint_as_float(((u32)p[i].bits) << 16);
}

__device__ __forceinline__ void store(float* __restrict__ p, u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store(double* __restrict__ p, u64 i, double v) { p[i] = v; }
__device__ __forceinline__ void store(half16* __restrict__ p, u64 i, float v) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i].bits = h;
}
__device__ __forceinline__ void store(bfloat16* __restrict__ p, u64 i, float v) {
    u32 u = __float_as_uint(v);
    u16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        h = (u16)((u >> 16) | 0x40u); /* NaN stays a (quiet) NaN */
    } else {
        h = (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
    }
    p[i].bits = h;
}

/* Kernels of memtrain's CUDA conv2d (src/conv2d_cuda.rs): im2col, the output-gradient
 * gather, col2im and the f32 -> half cast of the weight gradient. The gemms run in cuBLAS.
 *
 * Compiled at run time with NVRTC after prelude.cuh (types and half-precision load/store).
 * im2col and the gather only move bits, so they are
 * instantiated per element size (u16, u32, u64), not per float type. Every kernel is a
 * grid-stride loop over 64-bit indices: a chunk of a large batch can exceed 2^32 elements.
 *
 * Column layout (shared with the Rust driver): element (image i of the chunk, row r, pixel p)
 * of the column matrix sits at i * img_stride + r * row_stride + p, where r = (c * K + ky) * K + kx
 * is the weight's own memory order and p = oy * Wo + ox.
 */
#define GRID_STRIDE(e, total) \
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < (total); e += (u64)gridDim.x * blockDim.x)

/* x [N, C, H, W] -> columns of images n0 .. n0 + b. Consecutive threads take consecutive output
 * pixels, so reads (stride S apart) and writes (contiguous) both coalesce. */
template <typename T>
__device__ void im2col(const T* __restrict__ x, T* __restrict__ col, u64 n0, u64 b, u64 C, u64 H,
                       u64 W, u64 K, u64 S, u64 P, u64 Ho, u64 Wo, u64 row_stride,
                       u64 img_stride) {
    const u64 hw = Ho * Wo, kk = K * K, ckk = C * kk;
    GRID_STRIDE(e, b * ckk * hw) {
        const u64 p = e % hw, t = e / hw;
        const u64 r = t % ckk, i = t / ckk;
        const u64 c = r / kk, tap = r % kk;
        const u64 ky = tap / K, kx = tap % K;
        const u64 oy = p / Wo, ox = p % Wo;
        const long long iy = (long long)(oy * S + ky) - (long long)P;
        const long long ix = (long long)(ox * S + kx) - (long long)P;
        T v;
        if (iy >= 0 && iy < (long long)H && ix >= 0 && ix < (long long)W) {
            v = x[(((n0 + i) * C + c) * H + (u64)iy) * W + (u64)ix];
        } else {
            v = (T)0; /* all-zero bits: +0.0 in every float type */
        }
        col[i * img_stride + r * row_stride + p] = v;
    }
}

/* dy [N, Cout, Ho*Wo], images n0 .. n0 + b -> dyT [Cout, b * Ho*Wo], the layout the weight-gradient
 * gemm sums over (its inner dimension runs over images and pixels together). */
template <typename T>
__device__ void gather(const T* __restrict__ dy, T* __restrict__ out, u64 n0, u64 b, u64 Cout,
                       u64 hw) {
    GRID_STRIDE(e, b * Cout * hw) {
        const u64 p = e % hw, t = e / hw;
        const u64 i = t % b, o = t / b;
        out[e] = dy[((n0 + i) * Cout + o) * hw + p];
    }
}

/* Column gradients -> input gradient of images n0 .. n0 + b, as a gather (no atomics, so the
 * result does not depend on scheduling): each thread sums the (tap, output pixel) pairs that read
 * its input element, accumulating in A (float, or double for double). */
template <typename T, typename A>
__device__ void col2im(const T* __restrict__ col, T* __restrict__ dx, u64 n0, u64 b, u64 C, u64 H,
                       u64 W, u64 K, u64 S, u64 P, u64 Ho, u64 Wo, u64 row_stride,
                       u64 img_stride) {
    GRID_STRIDE(e, b * C * H * W) {
        const u64 ix = e % W;
        u64 t = e / W;
        const u64 iy = t % H;
        t /= H;
        const u64 c = t % C, i = t / C;
        const T* ci = col + i * img_stride;
        A acc = 0;
        for (u64 ky = 0; ky < K; ++ky) {
            const long long ty = (long long)(iy + P) - (long long)ky;
            if (ty < 0) break; /* only decreases with ky */
            if ((u64)ty % S != 0) continue;
            const u64 oy = (u64)ty / S;
            if (oy >= Ho) continue;
            for (u64 kx = 0; kx < K; ++kx) {
                const long long tx = (long long)(ix + P) - (long long)kx;
                if (tx < 0) break;
                if ((u64)tx % S != 0) continue;
                const u64 ox = (u64)tx / S;
                if (ox >= Wo) continue;
                acc += load(ci, ((c * K + ky) * K + kx) * row_stride + oy * Wo + ox);
            }
        }
        store(dx, ((n0 + i) * C + c) * H * W + iy * W + ix, acc);
    }
}

/* The f32 weight-gradient accumulator of a half-precision convolution -> the result. */
template <typename T>
__device__ void cast_from_f32(const float* __restrict__ src, T* __restrict__ dst, u64 len) {
    GRID_STRIDE(e, len) { store(dst, e, src[e]); }
}

#define COL_ARGS u64 n0, u64 b, u64 C, u64 H, u64 W, u64 K, u64 S, u64 P, u64 Ho, u64 Wo, u64 rs, u64 is
#define COL_PASS n0, b, C, H, W, K, S, P, Ho, Wo, rs, is

#define BIT_KERNELS(SUFFIX, T)                                                                      \
    extern "C" __global__ void conv_im2col_##SUFFIX(const T* x, T* col, COL_ARGS) {              \
        im2col<T>(x, col, COL_PASS);                                                              \
    }                                                                                             \
    extern "C" __global__ void conv_gather_##SUFFIX(const T* dy, T* out, u64 n0, u64 b, u64 Cout, \
                                                    u64 hw) {                                     \
        gather<T>(dy, out, n0, b, Cout, hw);                                                      \
    }

BIT_KERNELS(u16, u16)
BIT_KERNELS(u32, u32)
BIT_KERNELS(u64, u64)

#define FLOAT_KERNELS(SUFFIX, T, A)                                                       \
    extern "C" __global__ void conv_col2im_##SUFFIX(const T* col, T* dx, COL_ARGS) {     \
        col2im<T, A>(col, dx, COL_PASS);                                                  \
    }

FLOAT_KERNELS(f32, float, float)
FLOAT_KERNELS(f64, double, double)
FLOAT_KERNELS(f16, half16, float)
FLOAT_KERNELS(bf16, bfloat16, float)

extern "C" __global__ void conv_cast_f16(const float* src, half16* dst, u64 len) {
    cast_from_f32<half16>(src, dst, len);
}
extern "C" __global__ void conv_cast_bf16(const float* src, bfloat16* dst, u64 len) {
    cast_from_f32<bfloat16>(src, dst, len);
}

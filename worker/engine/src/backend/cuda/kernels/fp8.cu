// FP8 (e4m3) kernels of Prism's CUDA backend, compiled at run time by NVRTC as their own module.
//
// quantize_rows_e4m3: row r of a bf16 matrix [rows, cols] becomes e4m3 codes with one f32 scale,
// scale[r] = max|x[r]| / 448 (1 for a row of zeros), code = satfinite_rn(x / scale): vLLM's
// per-output-channel weight quantization (`--quantization fp8`) and its per-token dynamic
// activation quantization for the FP8 GEMMs (the same rule; the CPU reference is
// `fp8::quantize_rows` in the backend). One block per row (grid-stride over rows).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;
typedef unsigned char u8;
typedef unsigned long long u64;

#define Q_THREADS 256

__device__ __forceinline__ float q_block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < Q_THREADS / 32; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    return m;
}

__device__ __forceinline__ u8 to_e4m3(float v) {
    return (u8)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// `cols` a multiple of 8 and rows 16-byte aligned (8 values per thread and load).
extern "C" __global__ void __launch_bounds__(Q_THREADS)
    quantize_rows_e4m3(u8* __restrict__ out, float* __restrict__ scale, const bf16* __restrict__ x, int rows, int cols) {
    __shared__ float red[Q_THREADS / 32];
    const int n8 = cols >> 3;
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const uint4* xr = reinterpret_cast<const uint4*>(x + (u64)r * cols);
        float m = 0.f;
        for (int i = threadIdx.x; i < n8; i += Q_THREADS) {
            uint4 v = xr[i];
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float2 f = __bfloat1622float2(h[e]);
                m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
            }
        }
        m = q_block_max(m, red);
        const float s = m > 0.f ? m / 448.f : 1.f;
        const float inv = 1.f / s;
        if (threadIdx.x == 0) scale[r] = s;
        uint2* orow = reinterpret_cast<uint2*>(out + (u64)r * cols);
        for (int i = threadIdx.x; i < n8; i += Q_THREADS) {
            uint4 v = xr[i];
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
            u8 c[8];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float2 f = __bfloat1622float2(h[e]);
                c[2 * e] = to_e4m3(f.x * inv);
                c[2 * e + 1] = to_e4m3(f.y * inv);
            }
            uint2 o;
            o.x = c[0] | (c[1] << 8) | (c[2] << 16) | ((unsigned)c[3] << 24);
            o.y = c[4] | (c[5] << 8) | (c[6] << 16) | ((unsigned)c[7] << 24);
            orow[i] = o;
        }
    }
}

// dequantize_rows_e4m3: bf16 y[r, c] = code[r, c] · scale[r] (the fallback GEMM path when
// cuBLASLt has no FP8 GEMM with per-row scales; `cols` a multiple of 8). Grid-stride over
// groups of 8 values.
extern "C" __global__ void dequantize_rows_e4m3(bf16* __restrict__ y, const u8* __restrict__ code,
                                                const float* __restrict__ scale, int rows, int cols) {
    const u64 groups = (u64)rows * (cols >> 3);
    for (u64 g = blockIdx.x * (u64)blockDim.x + threadIdx.x; g < groups; g += (u64)gridDim.x * blockDim.x) {
        const u64 i = g * 8;
        const float s = scale[i / cols];
        uint2 v = reinterpret_cast<const uint2*>(code)[g];
        const u8* c = reinterpret_cast<const u8*>(&v);
        __nv_bfloat162 o[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            __half2_raw h0 = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(c[2 * e] | (c[2 * e + 1] << 8)), __NV_E4M3);
            float2 f = __half22float2(*reinterpret_cast<__half2*>(&h0));
            o[e] = __floats2bfloat162_rn(f.x * s, f.y * s);
        }
        reinterpret_cast<uint4*>(y)[g] = *reinterpret_cast<uint4*>(o);
    }
}

// scale_rows_cols: y[t, j] *= xs[t] · ws[j] over y [n, out] (bf16, or f32 when `f32_out`): the
// per-token activation scale and the per-output-channel weight scale applied to the FP8 GEMM's
// unscaled product (`out` a multiple of 2). Grid-stride over pairs.
extern "C" __global__ void scale_rows_cols(void* __restrict__ y, const float* __restrict__ xs,
                                           const float* __restrict__ ws, int n, int out, int f32_out) {
    const u64 pairs = (u64)n * (out >> 1);
    for (u64 p = blockIdx.x * (u64)blockDim.x + threadIdx.x; p < pairs; p += (u64)gridDim.x * blockDim.x) {
        const u64 i = p * 2;
        const u64 t = i / out;
        const int j = (int)(i - t * out);
        const float a = xs[t];
        const float s0 = a * ws[j], s1 = a * ws[j + 1];
        if (f32_out) {
            float2* yp = reinterpret_cast<float2*>(y) + p;
            float2 v = *yp;
            *yp = make_float2(v.x * s0, v.y * s1);
        } else {
            __nv_bfloat162* yp = reinterpret_cast<__nv_bfloat162*>(y) + p;
            float2 v = __bfloat1622float2(*yp);
            *yp = __floats2bfloat162_rn(v.x * s0, v.y * s1);
        }
    }
}

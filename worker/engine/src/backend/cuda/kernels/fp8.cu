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

// ---- Fused passes of the FP8 GEMM path (quantize on output, scale on input).
//
// The GEMMs write the unscaled product of the codes (bf16); the kernel that reads a product
// multiplies element (t, j) by xs[t] · ws[j] (the GEMM input's per-token scale times the
// weight's per-channel scale) in f32 as it loads it, instead of a scale pass rounding it to bf16
// in between. The kernels that produce a GEMM's input round each value to bf16 (the tensor the
// unfused path would write) and quantize the row by the rule of quantize_rows_e4m3, so the codes
// are those quantize_rows_e4m3 gives for those bf16 values. One block per row; each thread holds
// up to FQ_CHUNKS groups of 8 values in registers across the row's passes; at most FQ_THREADS
// threads per block (`fp8.rs` picks the count).
#define FQ_CHUNKS 4
#define FQ_THREADS 512

__device__ __forceinline__ float fq_block_sum(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = lane < nw ? red[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __syncthreads();
    return s;
}

__device__ __forceinline__ float fq_block_max(float v, float* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float m = lane < nw ? red[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncthreads();
    return m;
}

__device__ __forceinline__ void fq_load_bf16x8(const bf16* p, float* f) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float2 x = __bfloat1622float2(h[e]);
        f[2 * e] = x.x;
        f[2 * e + 1] = x.y;
    }
}

__device__ __forceinline__ void fq_load_f32x8(const float* p, float* f) {
    float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

// Quantizes the block's row of bf16-exact values v (n8 groups of 8, group c = threadIdx.x +
// k·blockDim.x in v[k]) by the rule of quantize_rows_e4m3 into codes and *scale.
__device__ __forceinline__ void fq_store_e4m3(float (&v)[FQ_CHUNKS][8], float m, int n8, u8* codes, float* scale,
                                              float* red) {
    m = fq_block_max(m, red);
    const float s = m > 0.f ? m / 448.f : 1.f;
    const float inv = 1.f / s;
    if (threadIdx.x == 0) *scale = s;
#pragma unroll
    for (int k = 0; k < FQ_CHUNKS; k++) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c >= n8) break;
        u8 q[8];
#pragma unroll
        for (int e = 0; e < 8; e++) q[e] = to_e4m3(v[k][e] * inv);
        uint2 o;
        o.x = q[0] | (q[1] << 8) | (q[2] << 16) | ((unsigned)q[3] << 24);
        o.y = q[4] | (q[5] << 8) | (q[6] << 16) | ((unsigned)q[7] << 24);
        reinterpret_cast<uint2*>(codes)[c] = o;
    }
}

// Residual add + RMSNorm (add_rmsnorm of llama.cu) with the FP8 path's ends: block b handles row
// r = rows ? rows[b] : b of the f32 residual stream x [*, h]; when delta is set, x[r] += delta[r]
// · (dxs[r] · dws[j]) (dxs null: delta as it is; delta the unscaled product of an FP8 GEMM); then
// y = bf16(x[r] · rsqrt(mean(x[r]²) + eps) · gain) goes to out[b] as bf16 when oscale is null,
// else as e4m3 codes (out [*, h] bytes) with its per-token scale in oscale[b]. h a multiple of 8
// and at most 8 · FQ_CHUNKS · blockDim.x; x, delta, dws, gain 16-byte aligned.
extern "C" __global__ void __launch_bounds__(FQ_THREADS)
    add_rmsnorm_fp8io(float* __restrict__ x, const bf16* __restrict__ delta, const float* __restrict__ dxs,
                      const float* __restrict__ dws, const bf16* __restrict__ gain, void* __restrict__ out,
                      float* __restrict__ oscale, const unsigned* __restrict__ rows, int h, float eps) {
    __shared__ float red[32];
    const int b = blockIdx.x;
    const int r = rows ? (int)rows[b] : b;
    float* xr = x + (u64)r * h;
    const bf16* dr = delta ? delta + (u64)r * h : nullptr;
    const float a = dxs ? dxs[r] : 1.f;
    const int n8 = h >> 3;
    float v[FQ_CHUNKS][8];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < FQ_CHUNKS; k++) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c >= n8) break;
        fq_load_f32x8(xr + c * 8, v[k]);
        if (dr) {
            float d[8];
            fq_load_bf16x8(dr + c * 8, d);
            if (dxs) {
                float w[8];
                fq_load_f32x8(dws + c * 8, w);
#pragma unroll
                for (int e = 0; e < 8; e++) d[e] *= a * w[e];
            }
#pragma unroll
            for (int e = 0; e < 8; e++) v[k][e] += d[e];
            float4* xo = reinterpret_cast<float4*>(xr + c * 8);
            xo[0] = make_float4(v[k][0], v[k][1], v[k][2], v[k][3]);
            xo[1] = make_float4(v[k][4], v[k][5], v[k][6], v[k][7]);
        }
#pragma unroll
        for (int e = 0; e < 8; e++) ss += v[k][e] * v[k][e];
    }
    ss = fq_block_sum(ss, red);
    const float inv = rsqrtf(ss / (float)h + eps);
    float m = 0.f;
#pragma unroll
    for (int k = 0; k < FQ_CHUNKS; k++) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c >= n8) break;
        float g[8];
        fq_load_bf16x8(gain + c * 8, g);
        __nv_bfloat162 o[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            o[e] = __floats2bfloat162_rn(v[k][2 * e] * inv * g[2 * e], v[k][2 * e + 1] * inv * g[2 * e + 1]);
            float2 f = __bfloat1622float2(o[e]);
            v[k][2 * e] = f.x;
            v[k][2 * e + 1] = f.y;
            m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
        if (!oscale) {
            uint4* orow = reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(out) + (u64)b * h);
            orow[c] = *reinterpret_cast<uint4*>(o);
        }
    }
    if (oscale) fq_store_e4m3(v, m, n8, reinterpret_cast<u8*>(out) + (u64)b * h, oscale + b, red);
}

// SiLU·mul of gate_up's unscaled FP8 product into the down GEMM's input: for token t = blockIdx.x,
// g = gu[t, j] · (gxs[t] · gws[j]), u = gu[t, inter + j] · (gxs[t] · gws[inter + j]) (gxs null:
// gu as it is), act = bf16(silu(g) · u) (silu_mul of llama.cu), quantized per token into codes
// [n, inter] and oscale[t]. inter a multiple of 8 and at most 8 · FQ_CHUNKS · blockDim.x; gu and
// gws 16-byte aligned.
extern "C" __global__ void __launch_bounds__(FQ_THREADS)
    silu_mul_fp8io(u8* __restrict__ codes, float* __restrict__ oscale, const bf16* __restrict__ gu,
                   const float* __restrict__ gxs, const float* __restrict__ gws, int inter) {
    __shared__ float red[32];
    const int t = blockIdx.x;
    const bf16* row = gu + (u64)t * 2 * inter;
    const float a = gxs ? gxs[t] : 1.f;
    const int n8 = inter >> 3;
    float v[FQ_CHUNKS][8];
    float m = 0.f;
#pragma unroll
    for (int k = 0; k < FQ_CHUNKS; k++) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c >= n8) break;
        float g[8], u[8];
        fq_load_bf16x8(row + c * 8, g);
        fq_load_bf16x8(row + inter + c * 8, u);
        if (gxs) {
            float wg[8], wu[8];
            fq_load_f32x8(gws + c * 8, wg);
            fq_load_f32x8(gws + inter + c * 8, wu);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                g[e] *= a * wg[e];
                u[e] *= a * wu[e];
            }
        }
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const float y = __bfloat162float(__float2bfloat16_rn(g[e] / (1.f + __expf(-g[e])) * u[e]));
            v[k][e] = y;
            m = fmaxf(m, fabsf(y));
        }
    }
    fq_store_e4m3(v, m, n8, codes + (u64)t * inter, oscale + t, red);
}

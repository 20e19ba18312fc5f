// Decode GEMV kernels of Prism's CUDA backend (fast mode, steps of at most GEMV_MAX_M tokens).
// Compiled at run time by NVRTC as its own module. Storage bf16, arithmetic f32.
//
// y[m, j] = sum_k x[m, k] · W[j, k] for m < M tokens, W row-major [out, inp] bf16 (HF nn.Linear).
// A decode step reads every weight once, so these kernels are HBM-bound: each warp streams R
// weight rows with 16-byte non-allocating loads (U loads per row in flight), multiplies them
// with the M activation rows (from shared memory when the RMSNorm prologue built them, else
// through the read-only cache), and reduces over its lanes. Modes (template MODE):
//   0: y bf16 [M, out]                                         (qkv)
//   1: y f32  [M, out]                                         (lm_head logits)
//   2: x f32  [M, out] += bf16(y)  (residual add fused)        (o_proj, down_proj)
//   3: act bf16 [M, out] = silu(bf16(g)) · bf16(u) where g, u are rows j and out + j of a fused
//      [gate; up] weight [2·out, inp]                          (gate_up + SiLU·mul fused)
//   4: fused QKV with RoPE and the paged K/V write: logical row j pairs weight rows
//      r0 = head·hd + i and r1 = r0 + hd/2 (i = j mod hd/2), the two halves RoPE (rotate-half,
//      HF layout) mixes; q and k heads are rotated by pos[m]·inv_freq[i], all rows are written
//      to qkv [M, out·2] bf16 and the K/V heads also to the token's cache slot (slot u32::MAX =
//      graph padding: no write) — the work of `rope_kv_write` in llama.cu, same formula.
// NORM: the activation rows are bf16(x[m] · rsqrt(mean(x[m]²) + eps) · gain) computed from the
// f32 residual stream by each block (RMSNorm fused as a prologue; Zhang & Sennrich 2019).
// GEMV_FP8 (compile-time define): the weights are e4m3 bytes with one f32 scale per physical
// row (`wscale`, w = code · scale), each 16-byte load bringing 16 of them; the codes are decoded
// to f32 with integer ops (sign and the 7 exponent/mantissa bits moved into an f32's places,
// which is the value · 2^-120, subnormals included; the 2^120 goes into the row scale) and
// the scale is applied to the row's sum. Every mode and prologue is the same.
// GEMV_FP8H (with GEMV_FP8; 1 or 2): packed-f16 inner products instead. Every kind stages its
// activation rows in shared memory as f16: the bf16 values (normed as above, or copied) times a
// power of two per token, 2^(XS - e) with 2^e > max|row| (XS = 0 for 1, 8 for 2), which is exact
// (bf16's 8-bit mantissa fits f16's 11) except below 2^(XS - 24) · 2^e, where f16 subnormals
// round it. The weights become f16 exactly: 1 decodes two codes per instruction in hardware
// (cvt.rn.f16x2.e4m3x2, sm_89+); 2 moves the code bits into an f16's places with integer ops
// (the value · 2^-8, subnormals included; the pairs come out as elements (0, 2) and (1, 3) of
// each 4, so the staging stores the activations in that order). Each 16-byte load's 16
// products per row are summed by __hfma2 in two f16 lanes (|x| ≤ 2^XS: every partial sum is at
// most 8 · 448, far from f16's 65504; each step rounds to f16, relative 2^-11, well below the
// e4m3 codes' own 2^-4), then widened to f32 and added into the f32 row sums, which the row
// scale and 2^e multiply as before. The weight loads stream on from one row group of a warp
// into its next (no drain per group); GEMV_R (default 2) sets the rows per group.
// The rounding points mirror the unfused path (GEMM outputs rounded to bf16 before the residual
// add and before SiLU·mul), so both paths compute the same function up to summation order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifdef GEMV_FP8
typedef unsigned char wtype;
// Weight elements per 16-byte load.
#define GEMV_CH 16
#else
typedef bf16 wtype;
#define GEMV_CH 8
#endif

#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif
// Warps per block of the residual kind (o_proj, down_proj) when it differs.
#ifndef GEMV_WARPS_RES
#define GEMV_WARPS_RES GEMV_WARPS
#endif
#define GV_WARPS_OF(MODE) ((MODE) == 2 ? GEMV_WARPS_RES : GEMV_WARPS)
#ifndef GEMV_R
#define GEMV_R 2
#endif
#define GEMV_U 4
// Loads in flight per lane (weight rows × chunks); 0 = GEMV_U chunks whatever the rows.
#ifndef GEMV_DEPTH
#define GEMV_DEPTH 0
#endif

__device__ __forceinline__ float gv_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// 16-byte streaming load that does not allocate in L1 (weights are read once per step).
__device__ __forceinline__ uint4 ld_weight(const wtype* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// 8 bf16 → 8 f32 (bf16 is the top half of an f32).
__device__ __forceinline__ void unpack8(uint4 v, float f[8]) {
    f[0] = __uint_as_float(v.x << 16); f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16); f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16); f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16); f[7] = __uint_as_float(v.w & 0xffff0000u);
}

// Weight elements 8·h .. 8·h + 7 of a 16-byte load as f32 (FP8: times 2^-120, see the top).
__device__ __forceinline__ void unpack_w(uint4 v, int h, float f[8]) {
#ifdef GEMV_FP8
    u32 a = h ? v.z : v.x, b = h ? v.w : v.y;
    // Byte i moved to the top, arithmetic shift by 4: sign smeared over bits 31..27, the code's
    // 7 low bits at bits 26..20; masking keeps the sign and those bits.
    f[0] = __int_as_float(((int)(a << 24) >> 4) & 0x87f00000);
    f[1] = __int_as_float(((int)(a << 16) >> 4) & 0x87f00000);
    f[2] = __int_as_float(((int)(a << 8) >> 4) & 0x87f00000);
    f[3] = __int_as_float(((int)a >> 4) & 0x87f00000);
    f[4] = __int_as_float(((int)(b << 24) >> 4) & 0x87f00000);
    f[5] = __int_as_float(((int)(b << 16) >> 4) & 0x87f00000);
    f[6] = __int_as_float(((int)(b << 8) >> 4) & 0x87f00000);
    f[7] = __int_as_float(((int)b >> 4) & 0x87f00000);
#else
    unpack8(v, f);
#endif
}

// The factor a row's sum is multiplied by: its FP8 scale (with the decode's 2^120), else 1.
__device__ __forceinline__ float row_scale(const float* ws, int row) {
#if defined(GEMV_FP8H)
    return ws[row];
#elif defined(GEMV_FP8)
    return ws[row] * 0x1p120f;
#else
    return 1.f;
#endif
}

__device__ __forceinline__ float rbf(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// One token's activations held in registers through the prologue (GEMV_XREG = chunks per
// thread, 0 = none; more tokens always read them from memory): the first XR 16-byte chunks of
// each thread (chunk i = thread + c · blockDim), four f32 residual values each for the norm kinds
// (with the four gain values: uint2), eight bf16 values for the others. Loaded with volatile asm
// so they stay where the kernel issues them: with GEMV_XFIRST before the weight loads, so these
// L2 reads do not queue behind the weight stream (measured on an H200: the prologue took 3–6 µs
// per launch when they did); GEMV_XFIRST=2 runs the whole prologue before the first weight load.
#ifndef GEMV_XREG
#define GEMV_XREG 0
#endif
#ifndef GEMV_XFIRST
#define GEMV_XFIRST 0
#endif
// GEMV_XFIRST of the residual kind when it differs.
#ifndef GEMV_XFIRST_RES
#define GEMV_XFIRST_RES GEMV_XFIRST
#endif
template <int M>
struct XPre {
    static constexpr int XR = (M == 1 && GEMV_XREG > 0) ? GEMV_XREG : 0;
    uint4 x[XR > 0 ? XR : 1];
    uint2 g[XR > 0 ? XR : 1];
};

__device__ __forceinline__ uint4 ld_act(const void* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ld_act2(const void* p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// Loads `p` (see XPre): NORM: f32 rows (4 values a chunk) and the gain, else bf16 (8 a chunk).
template <int M, bool NORM>
__device__ __forceinline__ void x_preload(XPre<M>& p, const void* __restrict__ xin, const bf16* __restrict__ gain,
                                          int inp) {
    const int n = NORM ? inp >> 2 : inp >> 3;
#pragma unroll
    for (int c = 0; c < XPre<M>::XR; c++) {
        int i = threadIdx.x + c * blockDim.x;
        p.x[c] = i < n ? ld_act(reinterpret_cast<const uint4*>(xin) + i) : make_uint4(0, 0, 0, 0);
        if (NORM) p.g[c] = i < n ? ld_act2(reinterpret_cast<const uint2*>(gain) + i) : make_uint2(0, 0);
    }
}

__device__ __forceinline__ float4 as_f4(uint4 v) {
    return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}

// RMSNorm prologue: writes bf16(x[m] · rsqrt(mean(x[m]²) + eps) · gain) for the M f32 residual
// rows `xin` into shared memory (as bf16 [M, inp]) and each row's max |value| (of the bf16
// values) into amax[m]; ends with the block synchronised when SYNC. The chunks `p` holds come
// from it, the rest from memory, vectorised and unrolled so each thread's loads are in flight
// together (a plain strided loop issues them one L2 round trip at a time: ~9 µs per kernel
// measured).
template <int M, bool SYNC, int W>
__device__ __forceinline__ void norm_rows(const void* __restrict__ xin, const bf16* __restrict__ gain, int inp,
                                          float eps, float amax[M], const XPre<M>& p) {
    extern __shared__ uint4 gv_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* red = reinterpret_cast<float*>(reinterpret_cast<bf16*>(gv_smem) + (u64)M * inp);
    const float4* x4 = reinterpret_cast<const float4*>(xin);
    const uint2* g4 = reinterpret_cast<const uint2*>(gain);
    uint2* xw4 = reinterpret_cast<uint2*>(gv_smem);
    const int n4 = inp >> 2;
    constexpr int XR = XPre<M>::XR;
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < XR; c++) {
            float4 v = as_f4(p.x[c]);
            s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
#pragma unroll 4
        for (int i = threadIdx.x + XR * blockDim.x; i < n4; i += blockDim.x) {
            float4 v = x4[(u64)m * n4 + i];
            s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        s = gv_warp_sum(s);
        if (lane == 0) red[warp * M + m] = s;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M; m++) {
        float s = 0.f;
#pragma unroll
        for (int ww = 0; ww < W; ww++) s += red[ww * M + m];
        ss[m] = rsqrtf(s / (float)inp + eps);
    }
    auto put = [&](int m, int i, float4 v, uint2 gw) -> float {
        float g0 = __uint_as_float(gw.x << 16), g1 = __uint_as_float(gw.x & 0xffff0000u);
        float g2 = __uint_as_float(gw.y << 16), g3 = __uint_as_float(gw.y & 0xffff0000u);
        __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * ss[m] * g0, v.y * ss[m] * g1);
        __nv_bfloat162 hi = __floats2bfloat162_rn(v.z * ss[m] * g2, v.w * ss[m] * g3);
        uint2 o;
        o.x = *reinterpret_cast<unsigned int*>(&lo);
        o.y = *reinterpret_cast<unsigned int*>(&hi);
        xw4[(u64)m * n4 + i] = o;
        float2 fl = __bfloat1622float2(lo), fh = __bfloat1622float2(hi);
        return fmaxf(fmaxf(fabsf(fl.x), fabsf(fl.y)), fmaxf(fabsf(fh.x), fabsf(fh.y)));
    };
#pragma unroll
    for (int m = 0; m < M; m++) {
        float am = 0.f;
#pragma unroll
        for (int c = 0; c < XR; c++) {
            int i = threadIdx.x + c * blockDim.x;
            if (i < n4) am = fmaxf(am, put(m, i, as_f4(p.x[c]), p.g[c]));
        }
#pragma unroll 4
        for (int i = threadIdx.x + XR * blockDim.x; i < n4; i += blockDim.x)
            am = fmaxf(am, put(m, i, x4[(u64)m * n4 + i], g4[i]));
        amax[m] = am;
    }
    if (SYNC) __syncthreads();
}

#ifdef GEMV_FP8H
#if GEMV_FP8H == 2
#define GEMV_XS 8
#else
#define GEMV_XS 0
#endif
__device__ __forceinline__ u32 h2_bits(__half2 h) { return *reinterpret_cast<u32*>(&h); }
__device__ __forceinline__ __half2 bits_h2(u32 v) { return *reinterpret_cast<__half2*>(&v); }

// The 16 codes of a 16-byte load as 8 f16 pairs (see the top for the order and the factor).
__device__ __forceinline__ void decode16(uint4 v, __half2 h[8]) {
    const u32 q[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
#if GEMV_FP8H == 1
        u32 lo, hi;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(q[i] & 0xffffu)));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(q[i] >> 16)));
        h[2 * i] = bits_h2(lo);      // elements 4i, 4i + 1
        h[2 * i + 1] = bits_h2(hi);  // elements 4i + 2, 4i + 3
#else
        // Bytes 1 and 3 sit at the top of the 16-bit lanes: the sign stays, the 7 other bits
        // move one place down (f16's exponent is one bit wider); bytes 0 and 2 likewise after
        // a shift by 8.
        const u32 a = q[i], b = q[i] << 8;
        h[2 * i] = bits_h2((b & 0x80008000u) | ((b >> 1) & 0x3f803f80u));      // elements 4i, 4i + 2
        h[2 * i + 1] = bits_h2((a & 0x80008000u) | ((a >> 1) & 0x3f803f80u));  // elements 4i + 1, 4i + 3
#endif
    }
}

__device__ __forceinline__ float gv_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Stages the M activation rows in shared memory as f16 (see the top): bf16 rows first (normed
// from the f32 residual rows when NORM, else copied from `xin`), then each token's row scaled
// in place by 2^(XS - e); xun[m] = 2^e. Shared memory: M · inp halves + 2 · W · M f32 (W warps).
// The chunks `p` holds come from it (see XPre).
template <int M, bool NORM, int W>
__device__ __forceinline__ void stage_f16(const void* __restrict__ xin, const bf16* __restrict__ gain, int inp,
                                          float eps, float xun[M], const XPre<M>& p) {
    extern __shared__ uint4 gv_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float* red = reinterpret_cast<float*>(reinterpret_cast<bf16*>(gv_smem) + (u64)M * inp);
    float* redmax = red + W * M;
    float amax[M];
    if (NORM) {
        norm_rows<M, false, W>(xin, gain, inp, eps, amax, p);
    } else {
        const uint4* x8 = reinterpret_cast<const uint4*>(xin);
        const int n8 = inp >> 3;
        auto put = [&](int m, int i, uint4 v) -> float {
            gv_smem[(u64)m * n8 + i] = v;
            float f[8];
            unpack8(v, f);
            float am = 0.f;
#pragma unroll
            for (int e = 0; e < 8; e++) am = fmaxf(am, fabsf(f[e]));
            return am;
        };
#pragma unroll
        for (int m = 0; m < M; m++) {
            float am = 0.f;
#pragma unroll
            for (int c = 0; c < XPre<M>::XR; c++) {
                int i = threadIdx.x + c * blockDim.x;
                if (i < n8) am = fmaxf(am, put(m, i, p.x[c]));
            }
#pragma unroll 4
            for (int i = threadIdx.x + XPre<M>::XR * blockDim.x; i < n8; i += blockDim.x)
                am = fmaxf(am, put(m, i, x8[(u64)m * n8 + i]));
            amax[m] = am;
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        float a = gv_warp_max(amax[m]);
        if (lane == 0) redmax[warp * M + m] = a;
    }
    __syncthreads();
    float sc[M];
#pragma unroll
    for (int m = 0; m < M; m++) {
        float a = 0.f;
#pragma unroll
        for (int ww = 0; ww < W; ww++) a = fmaxf(a, redmax[ww * M + m]);
        int e = 0;
        if (a > 0.f && a <= 3.0e38f) frexpf(a, &e);  // a = f · 2^e, f in [0.5, 1)
        xun[m] = ldexpf(1.f, e);
        sc[m] = ldexpf(1.f, GEMV_XS - e);
    }
    const int n8 = inp >> 3;
#pragma unroll
    for (int m = 0; m < M; m++) {
        for (int i = threadIdx.x; i < n8; i += blockDim.x) {
            uint4 v = gv_smem[(u64)m * n8 + i];
            float f[8];
            unpack8(v, f);
#if GEMV_FP8H == 2
            const int ord[8] = {0, 2, 1, 3, 4, 6, 5, 7};
#else
            const int ord[8] = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
            u32 o[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[e] = h2_bits(__floats2half2_rn(f[ord[2 * e]] * sc[m], f[ord[2 * e + 1]] * sc[m]));
            gv_smem[(u64)m * n8 + i] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
    __syncthreads();
}
#endif

// Extra arguments of MODE 4 (unused otherwise).
struct RopeKv {
    const u32* pos;
    const u32* slots;
    const float* inv_freq;
    bf16* kc;
    bf16* vc;
    int qh, kvh, hd;
    // The caches hold e4m3 (per-tensor scale 1) instead of bf16.
    int kv_fp8;
};

// Physical weight row of slot r (< NW) for logical row j.
template <int MODE>
__device__ __forceinline__ int phys_row(int j, int r, int out, int hd) {
    if (MODE == 3) return r >= GEMV_R ? out + j : j;
    if (MODE == 4) {
        int half = hd >> 1;
        int base = (j / half) * hd + (j % half);
        return r >= GEMV_R ? base + half : base;
    }
    return j;
}

// Programmatic dependent launch (Hopper): the host launches these kernels with the
// programmatic-stream-serialization attribute, so a GEMV's blocks may start while the previous
// kernel finishes; they issue their first weight loads (which depend on nothing), then wait for
// the previous grid (griddepcontrol.wait) before touching activations. Each kernel lets its own
// successor launch early (griddepcontrol.launch_dependents). Without the attribute both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// GEMV_TRACE (benchmarks): every block appends one record of 8 u64 to gv_trace (in completion
// order, gv_trace_n counts them): [0] MODE | out << 8 | inp << 32, [1] SM id << 32 | block,
// [2] %globaltimer (ns) at entry, [3] after the prologue, [4] at exit, then clock64 cycles
// from entry: [5] to the end of the prologue (thread 0), [6] / [7] to the first / last end of a
// warp that had rows. Reading the timer costs a few cycles; the extra block barrier at entry
// is the only change to the kernel's schedule.
#ifdef GEMV_TRACE
#define GEMV_TRACE_CAP 131072
__device__ u64 gv_trace[GEMV_TRACE_CAP * 8];
__device__ u32 gv_trace_n;
__shared__ u64 gv_t0_g, gv_t0_c, gv_t_pro_g, gv_t_pro_c, gv_w_min, gv_w_max;
__device__ __forceinline__ u64 gv_gtime() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// The entry times live in shared memory (thread 0's), not in registers across the kernel.
__device__ __forceinline__ void gv_trace_begin() {
    if (threadIdx.x == 0) {
        gv_t0_c = (u64)clock64();
        gv_t0_g = gv_gtime();
        gv_w_min = ~0ull;
        gv_w_max = 0;
        gv_t_pro_c = gv_t0_c;
        gv_t_pro_g = gv_t0_g;
    }
    __syncthreads();
}
__device__ __forceinline__ void gv_trace_prologue() {
    if (threadIdx.x == 0) {
        gv_t_pro_c = (u64)clock64();
        gv_t_pro_g = gv_gtime();
    }
}
__device__ __forceinline__ void gv_trace_end(int mode, int out, int inp) {
    u64 c = (u64)clock64();
    const int groups = (out + GEMV_R - 1) / GEMV_R;
    if ((threadIdx.x & 31) == 0 && blockIdx.x + gridDim.x * (threadIdx.x >> 5) < groups) {
        atomicMin(&gv_w_min, c);
        atomicMax(&gv_w_max, c);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 i = atomicAdd(&gv_trace_n, 1u);
        if (i < GEMV_TRACE_CAP) {
            u32 smid;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
            u64* r = gv_trace + (u64)i * 8;
            r[0] = (u64)mode | ((u64)out << 8) | ((u64)inp << 32);
            r[1] = ((u64)smid << 32) | blockIdx.x;
            r[2] = gv_t0_g;
            r[3] = gv_t_pro_g;
            r[4] = gv_gtime();
            r[5] = gv_t_pro_c - gv_t0_c;
            r[6] = gv_w_max ? gv_w_min - gv_t0_c : 0;
            r[7] = gv_w_max ? gv_w_max - gv_t0_c : 0;
        }
    }
}
#define GV_TRACE_BEGIN gv_trace_begin();
#define GV_TRACE_END(MODE) gv_trace_end(MODE, out, inp);
#define GV_TRACE_PROLOGUE gv_trace_prologue();
#else
#define GV_TRACE_BEGIN
#define GV_TRACE_END(MODE)
#define GV_TRACE_PROLOGUE
#endif

// Writes logical row j of token m as MODE says: sa is the row's scaled sum, sb its partner row's
// (MODE 3: the up row; MODE 4: the other RoPE half; unused otherwise).
template <int MODE>
__device__ __forceinline__ void gv_store(void* y, int j, int m, int out, float sa, float sb, const RopeKv& rk) {
    u64 o = (u64)m * out + j;
    if (MODE == 4) {
        int half = rk.hd >> 1, head = j / half, i = j % half;
        int r0 = head * rk.hd + i;
        float a = rbf(sa), b = rbf(sb);
        if (head < rk.qh + rk.kvh) {
            float sn, cs;
            sincosf((float)rk.pos[m] * rk.inv_freq[i], &sn, &cs);
            float a2 = a * cs - b * sn, b2 = b * cs + a * sn;
            a = a2;
            b = b2;
        }
        bf16 ab = __float2bfloat16_rn(a), bb = __float2bfloat16_rn(b);
        bf16* row = reinterpret_cast<bf16*>(y) + (u64)m * (2 * out);
        row[r0] = ab;
        row[r0 + half] = bb;
        u32 slot = rk.slots[m];
        if (head >= rk.qh && slot != 0xffffffffu) {
            int kvd = rk.kvh * rk.hd;
            bool is_v = head >= rk.qh + rk.kvh;
            int col = r0 - (is_v ? rk.qh + rk.kvh : rk.qh) * rk.hd;
            bf16* cache = is_v ? rk.vc : rk.kc;
            if (rk.kv_fp8) {
                unsigned char* c8 = reinterpret_cast<unsigned char*>(cache);
                c8[(u64)slot * kvd + col] = __nv_cvt_float_to_fp8(__bfloat162float(ab), __NV_SATFINITE, __NV_E4M3);
                c8[(u64)slot * kvd + col + half] =
                    __nv_cvt_float_to_fp8(__bfloat162float(bb), __NV_SATFINITE, __NV_E4M3);
            } else {
                cache[(u64)slot * kvd + col] = ab;
                cache[(u64)slot * kvd + col + half] = bb;
            }
        }
    } else if (MODE == 0) {
        reinterpret_cast<bf16*>(y)[o] = __float2bfloat16_rn(sa);
    } else if (MODE == 1) {
        reinterpret_cast<float*>(y)[o] = sa;
    } else if (MODE == 2) {
        reinterpret_cast<float*>(y)[o] += rbf(sa);
    } else {
        float g = rbf(sa), up = rbf(sb);
        reinterpret_cast<bf16*>(y)[o] = __float2bfloat16_rn(g / (1.f + __expf(-g)) * up);
    }
}

// Groups of R logical rows are dealt to warps block-first (group g → block g mod grid, warp
// (g / grid) mod W, …, W = GV_WARPS_OF(MODE)) so every block, and so every SM, gets the same share of a
// small matrix; blocks are persistent (grid ≤ resident blocks) so the norm prologue runs once
// per block. Requires
// inp % 8 == 0 and 16-byte aligned rows. Dynamic shared memory (NORM only): M · inp bf16
// activation rows + W · M f32. `out` counts logical rows (MODE 4: qkv_dim / 2).
template <int M, int MODE, bool NORM>
__device__ __forceinline__ void gemv_impl(void* y, const wtype* __restrict__ w, const void* __restrict__ xin,
                                          const bf16* __restrict__ gain, int out, int inp, float eps,
                                          const float* __restrict__ wscale, RopeKv rk) {
    constexpr int NW = (MODE == 3 || MODE == 4) ? 2 * GEMV_R : GEMV_R;
    constexpr int W = GV_WARPS_OF(MODE);
    constexpr int XF = MODE == 2 ? GEMV_XFIRST_RES : GEMV_XFIRST;
    constexpr int U = GEMV_DEPTH > 0 ? (GEMV_DEPTH / NW > 0 ? GEMV_DEPTH / NW : 1) : GEMV_U;
    extern __shared__ uint4 gv_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = (out + GEMV_R - 1) / GEMV_R;
    int grp = blockIdx.x + gridDim.x * warp;
    int j0 = (grp < groups ? grp : groups - 1) * GEMV_R;
    pdl_launch_dependents();

    // Weight row pointers (rows past `out` are clamped and their results dropped).
    const wtype* wrow[NW];
    uint4 wv[U][NW];
    auto start_tile = [&]() {
#pragma unroll
        for (int r = 0; r < NW; r++) {
            int j = j0 + (r % GEMV_R);
            j = j < out ? j : out - 1;
            wrow[r] = w + (u64)phys_row<MODE>(j, r, out, rk.hd) * inp;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int k = lane * GEMV_CH + u * 32 * GEMV_CH;
#pragma unroll
            for (int r = 0; r < NW; r++) wv[u][r] = k < inp ? ld_weight(wrow[r] + k) : make_uint4(0, 0, 0, 0);
        }
    };
#ifdef GEMV_FP8H
    constexpr bool STAGED = true;
#else
    constexpr bool STAGED = false;
#endif
    XPre<M> xp;
    if (XF != 0) {
        // The activations first (see XPre), then (XF 1) the first weight loads, which the
        // prologue overlaps, or (XF 2) the whole prologue before any weight load: its barriers
        // then wait on no warp still issuing loads.
        pdl_wait();
        if (NORM || STAGED) x_preload<M, NORM>(xp, xin, gain, inp);
        if (XF == 1) start_tile();
    } else {
        // The first weight loads before waiting on the previous kernel and before the prologue,
        // so HBM is busy meanwhile.
        start_tile();
        pdl_wait();
        if (NORM || STAGED) x_preload<M, NORM>(xp, xin, gain, inp);
    }

    const bf16* xs = reinterpret_cast<const bf16*>(gv_smem);
#ifdef GEMV_FP8H
    float xun[M];
    stage_f16<M, NORM, W>(xin, gain, inp, eps, xun, xp);
    const __half* xh = reinterpret_cast<const __half*>(gv_smem);
    (void)xs;
#else
    if (NORM) {
        float amax[M];
        norm_rows<M, true, W>(xin, gain, inp, eps, amax, xp);
    }
#endif

    GV_TRACE_PROLOGUE
    if (XF == 2) start_tile();
    const bf16* xg = reinterpret_cast<const bf16*>(xin);
#ifdef GEMV_FP8H
    (void)xg;
#endif
    if (grp >= groups) return;
#ifdef GEMV_FP8H
    // Streaming across row groups: when `inp` is a whole number of load rounds, the last
    // round's refills already load the warp's next group (same lane offsets), so HBM stays
    // busy through the reduction and the epilogue instead of draining once per group.
    const bool stream = inp % (32 * GEMV_CH * U) == 0;
    const wtype* wnext[NW];
#endif
  for (;;) {
#ifdef GEMV_FP8H
    const int gnext = grp + gridDim.x * W;
    const bool prefetch = stream && gnext < groups;
    if (prefetch) {
#pragma unroll
        for (int r = 0; r < NW; r++) {
            int j = gnext * GEMV_R + (r % GEMV_R);
            j = j < out ? j : out - 1;
            wnext[r] = w + (u64)phys_row<MODE>(j, r, out, rk.hd) * inp;
        }
    }
#endif
    float acc[NW][M];
#pragma unroll
    for (int r = 0; r < NW; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.f;

    for (int k0 = lane * GEMV_CH; k0 < inp; k0 += 32 * GEMV_CH * U) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            int k = k0 + u * 32 * GEMV_CH;
#ifdef GEMV_FP8H
            if (k < inp) {
                __half2 wh[NW][8];
#pragma unroll
                for (int r = 0; r < NW; r++) decode16(wv[u][r], wh[r]);
#pragma unroll
                for (int m = 0; m < M; m++) {
                    const uint4* xp = reinterpret_cast<const uint4*>(xh + (u64)m * inp + k);
                    const uint4 xa = xp[0], xb = xp[1];
                    const __half2 xv[8] = {bits_h2(xa.x), bits_h2(xa.y), bits_h2(xa.z), bits_h2(xa.w),
                                           bits_h2(xb.x), bits_h2(xb.y), bits_h2(xb.z), bits_h2(xb.w)};
#pragma unroll
                    for (int r = 0; r < NW; r++) {
                        __half2 hs = __hmul2(wh[r][0], xv[0]);
#pragma unroll
                        for (int e = 1; e < 8; e++) hs = __hfma2(wh[r][e], xv[e], hs);
                        const float2 f = __half22float2(hs);
                        acc[r][m] += f.x + f.y;
                    }
                }
            }
#else
            if (k < inp) {
#pragma unroll
              for (int hh = 0; hh < GEMV_CH / 8; hh++) {
                float wf[NW][8];
#pragma unroll
                for (int r = 0; r < NW; r++) unpack_w(wv[u][r], hh, wf[r]);
                const int kx = k + hh * 8;
#pragma unroll
                for (int m = 0; m < M; m++) {
                    uint4 xv = NORM ? *reinterpret_cast<const uint4*>(xs + (u64)m * inp + kx)
                                    : __ldg(reinterpret_cast<const uint4*>(xg + (u64)m * inp + kx));
                    float xf[8];
                    unpack8(xv, xf);
#pragma unroll
                    for (int r = 0; r < NW; r++) {
                        float a = acc[r][m];
#pragma unroll
                        for (int e = 0; e < 8; e++) a = fmaf(wf[r][e], xf[e], a);
                        acc[r][m] = a;
                    }
                }
              }
            }
#endif
            // Refill this slot with the loads of the next outer iteration.
            int kn = k + 32 * GEMV_CH * U;
#ifdef GEMV_FP8H
#pragma unroll
            for (int r = 0; r < NW; r++)
                wv[u][r] = kn < inp    ? ld_weight(wrow[r] + kn)
                           : prefetch ? ld_weight(wnext[r] + (kn - inp))
                                      : make_uint4(0, 0, 0, 0);
#else
#pragma unroll
            for (int r = 0; r < NW; r++) wv[u][r] = kn < inp ? ld_weight(wrow[r] + kn) : make_uint4(0, 0, 0, 0);
#endif
        }
    }

#pragma unroll
    for (int r = 0; r < NW; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = gv_warp_sum(acc[r][m]);
#ifdef GEMV_FP8
#pragma unroll
    for (int r = 0; r < NW; r++) {
        int j = j0 + (r % GEMV_R);
        j = j < out ? j : out - 1;
        float sc = row_scale(wscale, phys_row<MODE>(j, r, out, rk.hd));
#pragma unroll
#ifdef GEMV_FP8H
        for (int m = 0; m < M; m++) acc[r][m] *= sc * xun[m];
#else
        for (int m = 0; m < M; m++) acc[r][m] *= sc;
#endif
    }
#endif
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < GEMV_R; r++) {
            int j = j0 + r;
            if (j >= out) break;
#pragma unroll
            for (int m = 0; m < M; m++) gv_store<MODE>(y, j, m, out, acc[r][m], acc[NW > GEMV_R ? GEMV_R + r : r][m], rk);
        }
    }
    grp += gridDim.x * W;
    if (grp >= groups) return;
    j0 = grp * GEMV_R;
#ifdef GEMV_FP8H
    if (prefetch) {
#pragma unroll
        for (int r = 0; r < NW; r++) wrow[r] = wnext[r];
        continue;
    }
#endif
    start_tile();
  }
}

// Launch bounds (an explicit minimum of one block per SM changes ptxas's register choice, so
// the second argument appears only when asked for).
#if GEMV_GATE_MINB > 1
#define GV_GATE_BOUNDS __launch_bounds__(GEMV_WARPS * 32, GEMV_GATE_MINB)
#else
#define GV_GATE_BOUNDS __launch_bounds__(GEMV_WARPS * 32)
#endif
#if GEMV_QKV_MINB > 1
#define GV_QKV_BOUNDS __launch_bounds__(GEMV_WARPS * 32, GEMV_QKV_MINB)
#else
#define GV_QKV_BOUNDS __launch_bounds__(GEMV_WARPS * 32)
#endif
#define GV_BOUNDS(MODE) __launch_bounds__(GV_WARPS_OF(MODE) * 32)

// NORM_IF_GAIN: with a gain the kernel takes the f32 residual rows and RMSNorms them first.
#define GEMV_KERNEL(NAME, M, MODE, NORM, BOUNDS, NORM_IF_GAIN)                                            \
    extern "C" __global__ void BOUNDS NAME(                                                               \
        void* y, const wtype* w, const void* x, const bf16* gain, int out, int inp, float eps,           \
        const float* wscale) {                                                                            \
        RopeKv rk = {nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 2, 0};                            \
        GV_TRACE_BEGIN                                                                                    \
        if (NORM_IF_GAIN && gain != nullptr) gemv_impl<M, MODE, NORM_IF_GAIN>(y, w, x, gain, out, inp, eps, wscale, rk); \
        else gemv_impl<M, MODE, NORM>(y, w, x, gain, out, inp, eps, wscale, rk);                          \
        GV_TRACE_END(MODE)                                                                                \
    }

// MODE 4: `out` = qkv_dim / 2 logical rows (RoPE pairs). GEMV_QKV_MINB: resident blocks per SM
// the compiler must leave registers for (the RoPE epilogue's sincosf otherwise takes enough that
// only two 8-warp blocks fit on an H200 SM, fewer warps than a Llama-3-8B QKV has row pairs).
#ifndef GEMV_QKV_MINB
#define GEMV_QKV_MINB 1
#endif
// The same for the gate_up kind.
#ifndef GEMV_GATE_MINB
#define GEMV_GATE_MINB 1
#endif
#define GEMV_QKV_ROPE(M)                                                                                   \
    extern "C" __global__ void GV_QKV_BOUNDS gemv_qkv_rope_m##M(                                         \
        void* y, const wtype* w, const void* x, const bf16* gain, int out, int inp, float eps,            \
        const float* wscale, const u32* pos, const u32* slots, const float* inv_freq, bf16* kc, bf16* vc, int qh, int kvh,     \
        int hd, int kv_fp8) {                                                                              \
        RopeKv rk = {pos, slots, inv_freq, kc, vc, qh, kvh, hd, kv_fp8};                                  \
        GV_TRACE_BEGIN                                                                                    \
        gemv_impl<M, 4, true>(y, w, x, gain, out, inp, eps, wscale, rk);                                  \
        GV_TRACE_END(4)                                                                                   \
    }

// The staged (FP8) lm_head can take the final RMSNorm in its prologue (a gain given).
#ifdef GEMV_FP8H
#define GV_LOGITS_NORM true
#else
#define GV_LOGITS_NORM false
#endif
#define GEMV_FAMILY(M)                                  \
    GEMV_QKV_ROPE(M)                                    \
    GEMV_KERNEL(gemv_logits_m##M, M, 1, false, GV_BOUNDS(1), GV_LOGITS_NORM)    \
    GEMV_KERNEL(gemv_residual_m##M, M, 2, false, GV_BOUNDS(2), false)  \
    GEMV_KERNEL(gemv_gate_up_m##M, M, 3, true, GV_GATE_BOUNDS, false)

GEMV_FAMILY(1)
GEMV_FAMILY(2)
GEMV_FAMILY(3)
GEMV_FAMILY(4)

// Prism CUDA backend kernels (compiled at run time with NVRTC for the device's arch).
// Storage is bf16, arithmetic f32. The residual stream is kept in f32 ([n, hidden]).
// Layouts follow backend/mod.rs: fused QKV rows [q_heads*hd | kv_heads*hd | kv_heads*hd],
// K/V caches [num_blocks, block_size, kv_heads, head_dim], RoPE rotate-half (HF layout).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf2f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ bf16 f2bf(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float block_sum(float v) {
    __shared__ float sh[32];
    v = warp_sum(v);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    int nw = (blockDim.x + 31) >> 5;
    v = (l < nw) ? sh[l] : 0.f;
    return warp_sum(v);
}

// x[t, :] = table[ids[t], :] (f32 residual stream). Grid: n tokens.
extern "C" __global__ void embed_gather(float* x, const bf16* table, const u32* ids, int h) {
    int t = blockIdx.x;
    const bf16* row = table + (u64)ids[t] * h;
    float* out = x + (u64)t * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) out[i] = bf2f(row[i]);
}

// Fused residual add + RMSNorm. Block b handles row r = rows ? rows[b] : b of x:
// if delta: x[r] += delta[r]; out[b] = bf16(x[r] / rms(x[r]) * gain).
extern "C" __global__ void add_rmsnorm(float* x, const bf16* delta, const bf16* gain, bf16* out,
                                       const u32* rows, int h, float eps) {
    int b = blockIdx.x;
    int r = rows ? (int)rows[b] : b;
    float* xr = x + (u64)r * h;
    float ss = 0.f;
    // Unrolled so a thread's loads are in flight together (not one L2 round trip each).
#pragma unroll 4
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        float v = xr[i];
        if (delta) {
            v += bf2f(delta[(u64)r * h + i]);
            xr[i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = rsqrtf(ss / (float)h + eps);
    bf16* o = out + (u64)b * h;
#pragma unroll 4
    for (int i = threadIdx.x; i < h; i += blockDim.x) o[i] = f2bf(xr[i] * inv * bf2f(gain[i]));
}

// RoPE (rotate-half) on the q and k parts of each fused QKV row, then K and V written to
// the token's cache slot (bf16, or e4m3 with a per-tensor scale of 1: `rope_kv_write_fp8`).
// With xs set, the row is the unscaled product of the FP8 QKV GEMM: element j of row t is
// multiplied by xs[t] · ws[j] (per-token activation scale, per-channel weight scale) as it is
// read, and the whole row is written back scaled. Grid: n tokens.
// The token's angles' sines and cosines are computed once per frequency into shared memory
// (every head uses the same ones; the same sincosf of the same argument, so the same values as
// computing them per head), and head dims that are multiples of 8 move two values per access in
// the rotation and 8 per access in the cache write.
#define ROPE_MAX_HALF 256
template <bool FP8>
__device__ __forceinline__ void rope_kv_impl(bf16* qkv, const u32* pos, const u32* slots, const float* inv_freq,
                                             void* kcv, void* vcv, int qh, int kvh, int hd, const float* xs,
                                             const float* ws) {
    __shared__ float sn[ROPE_MAX_HALF], cs[ROPE_MAX_HALF];
    int t = blockIdx.x;
    int half = hd / 2;
    u64 qkv_dim = (u64)(qh + 2 * kvh) * hd;
    bf16* row = qkv + (u64)t * qkv_dim;
    float p = (float)pos[t];
    const float a = xs ? xs[t] : 1.f;
    const bool vec = (hd & 7) == 0 && half <= ROPE_MAX_HALF;
    if (vec) {
        for (int j = threadIdx.x; j < half; j += blockDim.x) sincosf(p * inv_freq[j], &sn[j], &cs[j]);
        __syncthreads();
        const int pairs = half >> 1;
        for (int i = threadIdx.x; i < (qh + kvh) * pairs; i += blockDim.x) {
            int head = i / pairs, j = (i - head * pairs) * 2;
            bf16* hp = row + head * hd;
            float2 x1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(hp + j));
            float2 x2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(hp + j + half));
            if (xs) {
                float2 w1 = *reinterpret_cast<const float2*>(ws + head * hd + j);
                float2 w2 = *reinterpret_cast<const float2*>(ws + head * hd + j + half);
                x1.x *= a * w1.x;
                x1.y *= a * w1.y;
                x2.x *= a * w2.x;
                x2.y *= a * w2.y;
            }
            const float c0 = cs[j], c1 = cs[j + 1], s0 = sn[j], s1 = sn[j + 1];
            __nv_bfloat162 o1, o2;
            o1.x = f2bf(x1.x * c0 - x2.x * s0);
            o1.y = f2bf(x1.y * c1 - x2.y * s1);
            o2.x = f2bf(x2.x * c0 + x1.x * s0);
            o2.y = f2bf(x2.y * c1 + x1.y * s1);
            *reinterpret_cast<__nv_bfloat162*>(hp + j) = o1;
            *reinterpret_cast<__nv_bfloat162*>(hp + j + half) = o2;
        }
        if (xs) {
            for (u64 i = (u64)(qh + kvh) * hd / 2 + threadIdx.x; i < qkv_dim / 2; i += blockDim.x) {
                __nv_bfloat162* rp = reinterpret_cast<__nv_bfloat162*>(row) + i;
                float2 v = __bfloat1622float2(*rp);
                float2 w = reinterpret_cast<const float2*>(ws)[i];
                *rp = __floats2bfloat162_rn(v.x * (a * w.x), v.y * (a * w.y));
            }
        }
    } else {
        for (int i = threadIdx.x; i < (qh + kvh) * half; i += blockDim.x) {
            int head = i / half, j = i % half;
            float s, c;
            sincosf(p * inv_freq[j], &s, &c);
            bf16* hp = row + head * hd;
            float x1 = bf2f(hp[j]), x2 = bf2f(hp[j + half]);
            if (xs) {
                x1 *= a * ws[head * hd + j];
                x2 *= a * ws[head * hd + j + half];
            }
            hp[j] = f2bf(x1 * c - x2 * s);
            hp[j + half] = f2bf(x2 * c + x1 * s);
        }
        if (xs) {
            for (int i = (qh + kvh) * hd + threadIdx.x; i < (int)qkv_dim; i += blockDim.x)
                row[i] = f2bf(bf2f(row[i]) * (a * ws[i]));
        }
    }
    __syncthreads();
    if (slots[t] == 0xffffffffu) return;  // padding token of a CUDA-graph bucket
    u64 slot = slots[t];
    int kvd = kvh * hd;
    if (vec) {
        // 8 values per access: K then V of the row, 16-byte aligned (hd a multiple of 8).
        const uint4* kr = reinterpret_cast<const uint4*>(row + qh * hd);
        const uint4* vr = reinterpret_cast<const uint4*>(row + (qh + kvh) * hd);
        for (int i = threadIdx.x; i < kvd / 8; i += blockDim.x) {
            uint4 k8 = kr[i], v8 = vr[i];
            if (FP8) {
                const __nv_bfloat162* kh = reinterpret_cast<const __nv_bfloat162*>(&k8);
                const __nv_bfloat162* vh = reinterpret_cast<const __nv_bfloat162*>(&v8);
                unsigned char kq[8], vq[8];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float2 kf = __bfloat1622float2(kh[e]), vf = __bfloat1622float2(vh[e]);
                    kq[2 * e] = __nv_cvt_float_to_fp8(kf.x, __NV_SATFINITE, __NV_E4M3);
                    kq[2 * e + 1] = __nv_cvt_float_to_fp8(kf.y, __NV_SATFINITE, __NV_E4M3);
                    vq[2 * e] = __nv_cvt_float_to_fp8(vf.x, __NV_SATFINITE, __NV_E4M3);
                    vq[2 * e + 1] = __nv_cvt_float_to_fp8(vf.y, __NV_SATFINITE, __NV_E4M3);
                }
                reinterpret_cast<uint2*>(reinterpret_cast<unsigned char*>(kcv) + slot * kvd)[i] =
                    *reinterpret_cast<const uint2*>(kq);
                reinterpret_cast<uint2*>(reinterpret_cast<unsigned char*>(vcv) + slot * kvd)[i] =
                    *reinterpret_cast<const uint2*>(vq);
            } else {
                reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(kcv) + slot * kvd)[i] = k8;
                reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(vcv) + slot * kvd)[i] = v8;
            }
        }
        return;
    }
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        if (FP8) {
            unsigned char* kc = reinterpret_cast<unsigned char*>(kcv);
            unsigned char* vc = reinterpret_cast<unsigned char*>(vcv);
            kc[slot * kvd + i] = __nv_cvt_float_to_fp8(bf2f(row[qh * hd + i]), __NV_SATFINITE, __NV_E4M3);
            vc[slot * kvd + i] = __nv_cvt_float_to_fp8(bf2f(row[(qh + kvh) * hd + i]), __NV_SATFINITE, __NV_E4M3);
        } else {
            reinterpret_cast<bf16*>(kcv)[slot * kvd + i] = row[qh * hd + i];
            reinterpret_cast<bf16*>(vcv)[slot * kvd + i] = row[(qh + kvh) * hd + i];
        }
    }
}
extern "C" __global__ void rope_kv_write(bf16* qkv, const u32* pos, const u32* slots, const float* inv_freq,
                                         bf16* kc, bf16* vc, int qh, int kvh, int hd, const float* xs,
                                         const float* ws) {
    rope_kv_impl<false>(qkv, pos, slots, inv_freq, kc, vc, qh, kvh, hd, xs, ws);
}
extern "C" __global__ void rope_kv_write_fp8(bf16* qkv, const u32* pos, const u32* slots, const float* inv_freq,
                                             unsigned char* kc, unsigned char* vc, int qh, int kvh, int hd,
                                             const float* xs, const float* ws) {
    rope_kv_impl<true>(qkv, pos, slots, inv_freq, kc, vc, qh, kvh, hd, xs, ws);
}

#define ATTN_WARPS 8
#define ATTN_MAX_G 8
#define ATTN_UNROLL 4
// Fixed context chunk (positions) of the split-KV attention. Batch invariance: a token's
// reduction order depends only on its own position, never on the step's shape.
#define ATTN_CHUNK 128

// Paged causal GQA attention (PagedAttention) split over the context in fixed chunks of
// ATTN_CHUNK positions (flash-decoding with position-aligned splits): grid (tokens, kv_heads,
// chunks), ATTN_WARPS warps. Block (t, g, z) handles the G = qh / kvh query heads sharing KV
// head g over positions [z·CHUNK, min(pos[t]+1, (z+1)·CHUNK)); blocks past the token's own
// context exit. Each warp takes ATTN_UNROLL positions at a time (loads in flight together) with
// an online softmax in f32; the warps merge in shared memory in warp order. A token whose
// context fits one chunk writes bf16 output; otherwise each chunk writes (max, sum, acc[hd])
// partials that attn_combine folds in chunk order. Every order above depends only on the
// token's position, so the result is the same whatever else is in the step.
// Token index t = t0 + blockIdx.x; partial rows are relative to t0. Each lane holds EPL = hd/32
// dims. tok_bt[t]: offset in bts of token t's block table.
template <int EPL, int G>
__device__ void attn_impl(bf16* out, float* part, const bf16* qkv, const bf16* kc, const bf16* vc, const u32* pos,
                          const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0,
                          int window) {
    const int hd = EPL * 32;
    static_assert(G * EPL * 32 <= 1024, "sm_acc holds 1024 values per warp");
    int tr = blockIdx.x, t = t0 + tr, g = blockIdx.y, z = blockIdx.z, S = gridDim.z;
    int L = (int)pos[t] + 1;
    // Sliding window: positions before `lo` are masked (never loaded).
    int lo = window > 0 ? max(0, L - window) : 0;
    int p_begin = z * ATTN_CHUNK;
    if (p_begin >= L) return;
    int p_end = min(L, p_begin + ATTN_CHUNK);
    bool single = L <= ATTN_CHUNK;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    u64 qkv_dim = (u64)(qh + 2 * kvh) * hd;
    u64 kvd = (u64)kvh * hd;
    const bf16* qrow = qkv + (u64)t * qkv_dim + (u64)g * G * hd;
    float q[G][EPL], acc[G][EPL], m[G], l[G];
#pragma unroll
    for (int gi = 0; gi < G; gi++) {
        m[gi] = NEG_INF;
        l[gi] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            q[gi][e] = bf2f(qrow[gi * hd + lane * EPL + e]) * scale;
            acc[gi][e] = 0.f;
        }
    }
    const u32* bt = bts + tok_bt[t];
    for (int p0 = p_begin + w * ATTN_UNROLL; p0 < p_end; p0 += ATTN_WARPS * ATTN_UNROLL) {
        // Wholly before the window: skipped, so a warp (or chunk) with nothing to attend keeps
        // m = -inf, l = 0 and drops out of the merges.
        if (p0 + ATTN_UNROLL <= lo) continue;
        float k[ATTN_UNROLL][EPL], v[ATTN_UNROLL][EPL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; u++) {
            int p = p0 + u;
            if (p < p_end && p >= lo) {
                u64 slot = (u64)bt[p / bs] * bs + (p % bs);
                const bf16* kp = kc + slot * kvd + (u64)g * hd + lane * EPL;
                const bf16* vp = vc + slot * kvd + (u64)g * hd + lane * EPL;
#pragma unroll
                for (int e = 0; e < EPL; e += 2) {
                    float2 kf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(kp + e));
                    float2 vf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(vp + e));
                    k[u][e] = kf.x; k[u][e + 1] = kf.y;
                    v[u][e] = vf.x; v[u][e + 1] = vf.y;
                }
            } else {
#pragma unroll
                for (int e = 0; e < EPL; e++) { k[u][e] = 0.f; v[u][e] = 0.f; }
            }
        }
#pragma unroll
        for (int gi = 0; gi < G; gi++) {
            {
                float s[ATTN_UNROLL];
                float mx = m[gi];
#pragma unroll
                for (int u = 0; u < ATTN_UNROLL; u++) {
                    float d = 0.f;
#pragma unroll
                    for (int e = 0; e < EPL; e++) d += q[gi][e] * k[u][e];
                    d = warp_sum(d);
                    s[u] = (p0 + u < p_end && p0 + u >= lo) ? d : NEG_INF;
                    mx = fmaxf(mx, s[u]);
                }
                float corr = __expf(m[gi] - mx);
                float lsum = l[gi] * corr;
#pragma unroll
                for (int e = 0; e < EPL; e++) acc[gi][e] *= corr;
#pragma unroll
                for (int u = 0; u < ATTN_UNROLL; u++) {
                    float pe = __expf(s[u] - mx);
                    lsum += pe;
#pragma unroll
                    for (int e = 0; e < EPL; e++) acc[gi][e] += pe * v[u][e];
                }
                l[gi] = lsum;
                m[gi] = mx;
            }
        }
    }
    __shared__ float sm_m[ATTN_WARPS][ATTN_MAX_G], sm_l[ATTN_WARPS][ATTN_MAX_G];
    __shared__ float sm_acc[ATTN_WARPS * 1024];
#pragma unroll
    for (int gi = 0; gi < G; gi++) {
        {
            if (lane == 0) {
                sm_m[w][gi] = m[gi];
                sm_l[w][gi] = l[gi];
            }
#pragma unroll
            for (int e = 0; e < EPL; e++) sm_acc[w * G * hd + gi * hd + lane * EPL + e] = acc[gi][e];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * hd; idx += blockDim.x) {
        int gi = idx / hd, d = idx % hd;
        float M = NEG_INF;
        for (int ww = 0; ww < ATTN_WARPS; ww++) M = fmaxf(M, sm_m[ww][gi]);
        float den = 0.f, num = 0.f;
        for (int ww = 0; ww < ATTN_WARPS; ww++) {
            float f = sm_l[ww][gi] > 0.f ? __expf(sm_m[ww][gi] - M) : 0.f;
            den += sm_l[ww][gi] * f;
            num += sm_acc[ww * G * hd + gi * hd + d] * f;
        }
        int head = g * G + gi;
        if (single) {
            out[(u64)t * qh * hd + (u64)head * hd + d] = f2bf(num / den);
        } else {
            float* pp = part + (((u64)tr * qh + head) * S + z) * (hd + 2);
            if (d == 0) { pp[0] = M; pp[1] = den; }
            pp[2 + d] = num;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd64_g1(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<2, 1>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd64_g2(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<2, 2>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd64_g4(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<2, 4>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd64_g8(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<2, 8>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd128_g1(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<4, 1>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd128_g2(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<4, 2>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd128_g4(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<4, 4>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd128_g8(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<4, 8>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

// head_dim 256 (Gemma 3): up to 4 query heads per KV head (sm_acc holds G · hd ≤ 1024 per warp).
extern "C" __global__ void __launch_bounds__(256) paged_attention_hd256_g1(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<8, 1>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd256_g2(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<8, 2>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

extern "C" __global__ void __launch_bounds__(256) paged_attention_hd256_g4(bf16* out, float* part, const bf16* qkv,
        const bf16* kc, const bf16* vc, const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int t0, int window) {
    attn_impl<8, 4>(out, part, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, t0, window);
}

// Folds the context chunks of paged attention in chunk order (a left fold starting from chunk
// 0 exactly, so the result depends only on the token's own context): grid (tokens, q heads), hd
// threads. Tokens whose context fits one chunk were written by the attention kernel.
extern "C" __global__ void attn_combine(bf16* out, const float* part, const u32* pos, int qh, int hd, int S, int t0) {
    int tr = blockIdx.x, t = t0 + tr, head = blockIdx.y, d = threadIdx.x;
    int C = ((int)pos[t] + ATTN_CHUNK) / ATTN_CHUNK;
    if (C <= 1) return;
    const float* pp = part + ((u64)tr * qh + head) * S * (hd + 2);
    float M = pp[0], den = pp[1], num = pp[2 + d];
    for (int z = 1; z < C; z++) {
        const float* pz = pp + z * (hd + 2);
        float Mz = pz[0];
        float Mn = fmaxf(M, Mz);
        // A chunk wholly before a sliding window has den 0 (and M = -inf): weight 0.
        float a = den > 0.f ? __expf(M - Mn) : 0.f, b = pz[1] > 0.f ? __expf(Mz - Mn) : 0.f;
        den = den * a + pz[1] * b;
        num = num * a + pz[2 + d] * b;
        M = Mn;
    }
    out[(u64)t * qh * hd + (u64)head * hd + d] = f2bf(num / den);
}

// Counts 16-bit words that differ between a and b (GEMM batch-invariance check). Grid-stride.
extern "C" __global__ void count_neq_u16(const unsigned short* a, const unsigned short* b, u64 n, u32* count) {
    u32 c = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) c += a[i] != b[i];
    c = (u32)warp_sum((float)c);
    if ((threadIdx.x & 31) == 0 && c) atomicAdd(count, c);
}

// act[t, i] = silu(gu[t, i]) * gu[t, inter + i]. Grid-stride over n * inter.
extern "C" __global__ void silu_mul(bf16* act, const bf16* gu, int n, int inter) {
    u64 total = (u64)n * inter;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / inter, j = i % inter;
        float g = bf2f(gu[t * 2 * inter + j]);
        float u = bf2f(gu[t * 2 * inter + inter + j]);
        act[i] = f2bf(g / (1.f + __expf(-g)) * u);
    }
}

// logits[rows[i], toks[i]] += vals[i] (logit_bias, -inf bans); atomic, as several edits may
// name one logit. Grid-stride over n.
extern "C" __global__ void logit_edits(float* logits, const u32* rows, const u32* toks, const float* vals, int n,
                                       int vocab) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        if (toks[i] < (u32)vocab) atomicAdd(logits + (u64)rows[i] * vocab + toks[i], vals[i]);
    }
}

// Block-wide (value, index) maximum: the larger value, the lower index on ties (NaN never
// wins: it compares false). The result is in thread 0.
__device__ __forceinline__ void argmax_block(float& best, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    __shared__ float sv[32];
    __shared__ int si[32];
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) { sv[w] = best; si[w] = bi; }
    __syncthreads();
    if (w == 0) {
        int nw = blockDim.x >> 5;
        best = l < nw ? sv[l] : NEG_INF;
        bi = l < nw ? si[l] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
    }
}

// out[r] = argmax(logits[r, :]) (first index on ties, as torch.argmax). With `masks`, a row
// r whose mask_of_row[r] >= 0 only considers tokens whose bit is set in its mask of `words`
// u32 words (bit t % 32 of word t / 32; tokens beyond the mask are out). Grid (rows, splits):
// block (r, z) takes the z-th of `splits` equal ranges of row r (one block per row reads a
// 128K-token row from L2 at one SM's rate, several microseconds at batch 1). With more than one
// split each block leaves its (value, index) in part_v / part_i [rows, splits], and the row's
// last block to finish (done[r] counts them; it resets it for the next launch) folds them: the
// maximum with the lowest index on ties is the same in any order, so the result does not depend
// on which block finishes last.
extern "C" __global__ void argmax_rows(u32* out, const float* logits, int vocab, const u32* masks,
                                       const int* mask_of_row, int words, float* part_v, int* part_i, u32* done) {
    const int r = blockIdx.x, z = blockIdx.y, splits = gridDim.y;
    const float* row = logits + (u64)r * vocab;
    const u32* mask = nullptr;
    if (masks != nullptr && mask_of_row[r] >= 0) mask = masks + (u64)mask_of_row[r] * words;
    const int per = (vocab + splits - 1) / splits;
    const int lo = z * per, hi = min(vocab, lo + per);
    float best = NEG_INF;
    int bi = 0x7fffffff;
#pragma unroll 4
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float v = row[i];
        if (mask != nullptr && ((i >> 5) >= words || ((mask[i >> 5] >> (i & 31)) & 1u) == 0u)) continue;
        if (v > best) { best = v; bi = i; }
    }
    argmax_block(best, bi);
    if (splits == 1) {
        if (threadIdx.x == 0) out[r] = bi == 0x7fffffff ? 0u : (u32)bi;
        return;
    }
    __shared__ bool last;
    if (threadIdx.x == 0) {
        part_v[(u64)r * splits + z] = best;
        part_i[(u64)r * splits + z] = bi;
        __threadfence();
        last = atomicAdd(&done[r], 1u) == (u32)splits - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x >= 32) return;
    __threadfence();
    const volatile float* pv = part_v + (u64)r * splits;
    const volatile int* pi = part_i + (u64)r * splits;
    best = NEG_INF;
    bi = 0x7fffffff;
    for (int k = threadIdx.x; k < splits; k += 32) {
        float v = pv[k];
        int i = pi[k];
        if (v > best || (v == best && i < bi)) { best = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    if (threadIdx.x == 0) {
        out[r] = bi == 0x7fffffff ? 0u : (u32)bi;
        done[r] = 0;
    }
}

// Seeded uniform values in [-scale, scale) (synthetic benchmark weights). Grid-stride.
extern "C" __global__ void fill_uniform(bf16* p, u64 n, u32 seed, float scale) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 z = i * 0x9E3779B97F4A7C15ull + ((u64)seed << 32) + seed;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        p[i] = f2bf((2.f * u - 1.f) * scale);
    }
}

// p[i] = v. Grid-stride.
extern "C" __global__ void fill_const(bf16* p, u64 n, float v) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) p[i] = f2bf(v);
}

// ---- Model-family variants (Qwen2, Qwen3, Mistral, Gemma 3); the Llama path never runs these.

// x[i] *= s over n values (Gemma's embedding scale). Grid-stride.
extern "C" __global__ void scale_f32(float* x, u64 n, float s) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) x[i] *= s;
}

// rope_kv_write with, first, the q/k/v bias added (bias: [qkv_dim] or null) and a per-head
// RMSNorm of every q and k head (qn, kn: [hd] gains, or null), in f32 in dynamic shared memory
// (qkv_dim floats). Grid: n tokens.
extern "C" __global__ void qkv_prep_rope_kv_write(bf16* qkv, const bf16* bias, const bf16* qn, const bf16* kn,
                                                  const u32* pos, const u32* slots, const float* inv_freq, bf16* kc,
                                                  bf16* vc, int qh, int kvh, int hd, float eps) {
    extern __shared__ float rs[];
    int t = blockIdx.x;
    int half = hd / 2;
    int qkv_dim = (qh + 2 * kvh) * hd;
    bf16* row = qkv + (u64)t * qkv_dim;
    for (int i = threadIdx.x; i < qkv_dim; i += blockDim.x) {
        float v = bf2f(row[i]);
        // The projection (with its bias) is a bf16 tensor, as in the reference.
        rs[i] = bias ? bf2f(f2bf(v + bf2f(bias[i]))) : v;
    }
    __syncthreads();
    if (qn) {
        int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
        for (int head = threadIdx.x >> 5; head < qh + kvh; head += nw) {
            float* hp = rs + head * hd;
            const bf16* gain = head < qh ? qn : kn;
            float ss = 0.f;
            for (int j = lane; j < hd; j += 32) ss += hp[j] * hp[j];
            ss = warp_sum(ss);
            float inv = rsqrtf(ss / (float)hd + eps);
            for (int j = lane; j < hd; j += 32) hp[j] = bf2f(f2bf(hp[j] * inv * bf2f(gain[j])));
        }
        __syncthreads();
    }
    float p = (float)pos[t];
    for (int i = threadIdx.x; i < (qh + kvh) * half; i += blockDim.x) {
        int head = i / half, j = i % half;
        float s, c;
        sincosf(p * inv_freq[j], &s, &c);
        float* hp = rs + head * hd;
        float x1 = hp[j], x2 = hp[j + half];
        row[head * hd + j] = f2bf(x1 * c - x2 * s);
        row[head * hd + j + half] = f2bf(x2 * c + x1 * s);
    }
    for (int i = (qh + kvh) * hd + threadIdx.x; i < qkv_dim; i += blockDim.x) row[i] = f2bf(rs[i]);
    __syncthreads();
    if (slots[t] == 0xffffffffu) return;  // padding token of a CUDA-graph bucket
    u64 slot = slots[t];
    int kvd = kvh * hd;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        kc[slot * kvd + i] = row[qh * hd + i];
        vc[slot * kvd + i] = row[(qh + kvh) * hd + i];
    }
}

// add_rmsnorm whose delta is RMS-normalised first (Gemma 3's norms of the attention and MLP
// outputs): x[r] += bf16(delta[r] / rms(delta[r]) * dgain); out[b] = bf16(x[r] / rms(x[r]) * gain).
extern "C" __global__ void add_normed_rmsnorm(float* x, const bf16* delta, const bf16* dgain, const bf16* gain,
                                              bf16* out, const u32* rows, int h, float eps) {
    int b = blockIdx.x;
    int r = rows ? (int)rows[b] : b;
    float* xr = x + (u64)r * h;
    const bf16* dr = delta + (u64)r * h;
    float ds = 0.f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        float v = bf2f(dr[i]);
        ds += v * v;
    }
    ds = block_sum(ds);
    float dinv = rsqrtf(ds / (float)h + eps);
    float ss = 0.f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) {
        float v = xr[i] + bf2f(f2bf(bf2f(dr[i]) * dinv * bf2f(dgain[i])));
        xr[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    float inv = rsqrtf(ss / (float)h + eps);
    bf16* o = out + (u64)b * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) o[i] = f2bf(xr[i] * inv * bf2f(gain[i]));
}

// act[t, i] = gelu_tanh(gu[t, i]) * gu[t, inter + i] (GeGLU). Grid-stride over n * inter.
extern "C" __global__ void gelu_tanh_mul(bf16* act, const bf16* gu, int n, int inter) {
    u64 total = (u64)n * inter;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 t = i / inter, j = i % inter;
        float g = bf2f(gu[t * 2 * inter + j]);
        float u = bf2f(gu[t * 2 * inter + inter + j]);
        float ge = 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        act[i] = f2bf(ge * u);
    }
}

// p[i] = cap * tanh(p[i] / cap) (final logit soft-capping). Grid-stride.
extern "C" __global__ void softcap_f32(float* p, u64 n, float cap) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        p[i] = cap * tanhf(p[i] / cap);
}

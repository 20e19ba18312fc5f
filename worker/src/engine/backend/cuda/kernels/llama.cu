// Prism CUDA backend kernels (compiled at run time with NVRTC for the device's arch).
// Storage is bf16, arithmetic f32. The residual stream is kept in f32 ([n, hidden]).
// Layouts follow backend/mod.rs: fused QKV rows [q_heads*hd | kv_heads*hd | kv_heads*hd],
// K/V caches [num_blocks, block_size, kv_heads, head_dim], RoPE rotate-half (HF layout).
#include <cuda_bf16.h>

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
    for (int i = threadIdx.x; i < h; i += blockDim.x) o[i] = f2bf(xr[i] * inv * bf2f(gain[i]));
}

// RoPE (rotate-half) on the q and k parts of each fused QKV row, then K and V written to
// the token's cache slot. Grid: n tokens.
extern "C" __global__ void rope_kv_write(bf16* qkv, const u32* pos, const u32* slots, const float* inv_freq,
                                         bf16* kc, bf16* vc, int qh, int kvh, int hd) {
    int t = blockIdx.x;
    int half = hd / 2;
    u64 qkv_dim = (u64)(qh + 2 * kvh) * hd;
    bf16* row = qkv + (u64)t * qkv_dim;
    float p = (float)pos[t];
    for (int i = threadIdx.x; i < (qh + kvh) * half; i += blockDim.x) {
        int head = i / half, j = i % half;
        float s, c;
        sincosf(p * inv_freq[j], &s, &c);
        bf16* hp = row + head * hd;
        float x1 = bf2f(hp[j]), x2 = bf2f(hp[j + half]);
        hp[j] = f2bf(x1 * c - x2 * s);
        hp[j + half] = f2bf(x2 * c + x1 * s);
    }
    __syncthreads();
    u64 slot = slots[t];
    int kvd = kvh * hd;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        kc[slot * kvd + i] = row[qh * hd + i];
        vc[slot * kvd + i] = row[(qh + kvh) * hd + i];
    }
}

#define ATTN_WARPS 8
#define ATTN_MAX_G 8

// Paged causal GQA attention (PagedAttention), one query token per block row and one KV head
// per block column: grid (n tokens, kv_heads), ATTN_WARPS warps. The block handles the
// G = qh / kvh query heads sharing the KV head; warps stride over context positions with an
// online softmax (f32), then merge. Each lane holds EPL = hd / 32 dims.
// tok_bt[t] is the offset in bts of token t's sequence block table; pos[t] its position.
template <int EPL>
__device__ void attn_impl(bf16* out, const bf16* qkv, const bf16* kc, const bf16* vc, const u32* pos,
                          const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale) {
    const int hd = EPL * 32;
    int t = blockIdx.x, g = blockIdx.y;
    int G = qh / kvh;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    u64 qkv_dim = (u64)(qh + 2 * kvh) * hd;
    u64 kvd = (u64)kvh * hd;
    const bf16* qrow = qkv + (u64)t * qkv_dim + (u64)g * G * hd;
    float q[ATTN_MAX_G][EPL], acc[ATTN_MAX_G][EPL], m[ATTN_MAX_G], l[ATTN_MAX_G];
#pragma unroll
    for (int gi = 0; gi < ATTN_MAX_G; gi++) {
        m[gi] = NEG_INF;
        l[gi] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            q[gi][e] = gi < G ? bf2f(qrow[gi * hd + lane * EPL + e]) * scale : 0.f;
            acc[gi][e] = 0.f;
        }
    }
    int L = (int)pos[t] + 1;
    const u32* bt = bts + tok_bt[t];
    for (int p = w; p < L; p += ATTN_WARPS) {
        u64 slot = (u64)bt[p / bs] * bs + (p % bs);
        const bf16* kp = kc + slot * kvd + (u64)g * hd + lane * EPL;
        const bf16* vp = vc + slot * kvd + (u64)g * hd + lane * EPL;
        float k[EPL], v[EPL];
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            k[e] = bf2f(kp[e]);
            v[e] = bf2f(vp[e]);
        }
#pragma unroll
        for (int gi = 0; gi < ATTN_MAX_G; gi++) {
            if (gi < G) {
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < EPL; e++) s += q[gi][e] * k[e];
                s = warp_sum(s);
                float mn = fmaxf(m[gi], s);
                float corr = __expf(m[gi] - mn);
                float pe = __expf(s - mn);
                l[gi] = l[gi] * corr + pe;
#pragma unroll
                for (int e = 0; e < EPL; e++) acc[gi][e] = acc[gi][e] * corr + pe * v[e];
                m[gi] = mn;
            }
        }
    }
    __shared__ float sm_m[ATTN_WARPS][ATTN_MAX_G], sm_l[ATTN_WARPS][ATTN_MAX_G];
    __shared__ float sm_acc[ATTN_WARPS * 1024];
#pragma unroll
    for (int gi = 0; gi < ATTN_MAX_G; gi++) {
        if (gi < G) {
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
        out[(u64)t * qh * hd + (u64)(g * G + gi) * hd + d] = f2bf(num / den);
    }
}

extern "C" __global__ void paged_attention_hd64(bf16* out, const bf16* qkv, const bf16* kc, const bf16* vc,
                                                const u32* pos, const u32* tok_bt, const u32* bts, int qh,
                                                int kvh, int bs, float scale) {
    attn_impl<2>(out, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale);
}

extern "C" __global__ void paged_attention_hd128(bf16* out, const bf16* qkv, const bf16* kc, const bf16* vc,
                                                 const u32* pos, const u32* tok_bt, const u32* bts, int qh,
                                                 int kvh, int bs, float scale) {
    attn_impl<4>(out, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale);
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

// out[r] = argmax(logits[r, :]) (first index on ties, as torch.argmax). Grid: rows; 1024 threads.
extern "C" __global__ void argmax_rows(u32* out, const float* logits, int vocab) {
    const float* row = logits + (u64)blockIdx.x * vocab;
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = row[i];
        if (v > best) { best = v; bi = i; }
    }
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
        if (l == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0u : (u32)bi;
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

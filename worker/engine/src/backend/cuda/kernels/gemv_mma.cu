// FP8 decode GEMVs on tensor cores (GEMV_FP8MMA, built with GEMV_FP8). The backend appends this
// file to gemv.cu and compiles them as one module; the entry points, modes, prologues and
// epilogues are those of gemv.cu (gv_store), only the inner product differs.
//
// Why: the CUDA-core FP8 kernels decode every e4m3 weight to f16 (one conversion per two codes)
// and multiply on the FP32/FP16 pipes, about 25 instructions per 16 bytes of weights; they
// stream FP8 weights at ~3.2 TB/s where the bf16 kernels reach ~3.9. Here the weight bytes go
// to `mma.sync.m16n8k32.e4m3` (sm_89+) untouched, a 16-byte load per lane and row feeding two
// instructions, so the kernel is left with its loads.
//
// The activations are e4m3 too: the prologue stages each token's row in shared memory as codes
// with one f32 scale per token by the FP8 GEMM path's rule (fp8.cu: scale = max|x| / 448, 1 for a
// row of zeros, code = satfinite_rn(x / scale); x the bf16 activations, normed from the f32
// residual rows as gemv.cu's prologue does for the norm kinds). So a decode step of 1..4 tokens
// computes what the FP8 GEMMs of larger steps compute (vLLM's W8A8 with dynamic per-token
// activation scales), up to summation order; the result is code products summed in f32 by the
// tensor cores, times the weight row's scale and the token's.
//
// Tiles: a warp's mma covers 16 weight rows (A, 16 × 32 codes) against the staged rows (B,
// 32 × 8: column n = token n, columns ≥ M repeat token M − 1 and are dropped). Lane (gid, tig) =
// (lane / 4, lane % 4) loads 16 bytes of rows gid and gid + 8 of the tile at byte 16·tig of a
// 64-byte piece of k; its four registers per row are the A registers of two mma (PTX ISA,
// "Matrix fragments for mma.m16n8k32": a0/a2 row gid, a1/a3 row gid + 8, k offsets 4·tig and
// 16 + 4·tig), which fixes the order of k inside each instruction; the B registers of lane
// (n, tig) are then the same 16 bytes of token n's codes (one 16-byte shared load). The sum over
// k does not depend on that order. Tile rows: single-row modes take logical rows 16t .. 16t + 15
// (rows gid and gid + 8 in lane gid); MODE 3 and 4 take 8 logical rows, row gid and its partner
// (the up row, the other RoPE half) as rows gid and gid + 8, so the lane holding a row's sum
// also holds its partner's (accumulator c0/c1: row gid, tokens 2·tig, 2·tig + 1; c2/c3: row
// gid + 8).
//
// Work split: a block's 8 warps share one tile and split its k range in 64-byte pieces (warp w
// takes pieces w, w + 8, …, GEMV_MMA_U of them in flight per lane and row); partial sums meet in
// shared memory in warp order (deterministic), one warp per tile applies the scales and the
// epilogue. Blocks are persistent over tiles t = blockIdx.x, + gridDim.x, …; a warp's last
// refills of a tile already load its first pieces of the next one, so HBM stays busy through the
// reduction and the epilogue. Requires inp % 64 == 0 and 16-byte aligned rows (the backend falls
// back to the CUDA-core kernels otherwise).
//
// Shared memory: M · inp bytes of codes, then f32 xs[4] (token scales), red[GEMV_WARPS · 4]
// (block reductions), then float4 tred[2][GEMV_WARPS][32] (per-tile partial sums, double
// buffered): M · inp + 144 + 8192 bytes.
#ifdef GEMV_FP8MMA
#ifndef GEMV_MMA_U
#define GEMV_MMA_U 4
#endif

typedef unsigned char u8;

#if GEMV_FP8MMA >= 2
// The 16 codes of a 16-byte load as 8 f16 pairs in mma A-register order: 2 decodes codes 2t,
// 2t + 1 into register t in hardware (decode16); 3 (mixed) does so for codes 0..7 and decodes
// codes 8..15 with integer ops into the f16 places (the value · 2^-8, pairs (8, 10), (9, 11),
// (12, 14), (13, 15): stage_f16 stores their activations in that order, times 2^8), so the
// conversion unit and the integer unit share the work.
__device__ __forceinline__ void gm_decode(const uint4& v, u32 (&h)[8]) {
    __half2 d[8];
    decode16(v, d);
#pragma unroll
    for (int t = 0; t < 8; t++) h[t] = h2_bits(d[t]);
#if GEMV_FP8MMA == 3
    const u32 q[2] = {v.z, v.w};
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 a = q[i], b = q[i] << 8;
        h[4 + 2 * i] = (b & 0x80008000u) | ((b >> 1) & 0x3f803f80u);
        h[5 + 2 * i] = (a & 0x80008000u) | ((a >> 1) & 0x3f803f80u);
    }
#endif
}

// f16 products on tensor cores (mma.m16n8k16, native on sm_80+): A = weights decoded in
// hardware (decode16, two codes per instruction), B = the f16 activations of stage_f16.
__device__ __forceinline__ void gm_mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

__device__ __forceinline__ void gm_mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// v[m] summed (or maxed) over the block; every thread gets the results. red: GEMV_WARPS · M f32.
template <int M, bool MAX>
__device__ __forceinline__ void gm_block_reduce(float (&v)[M], float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < M; m++) {
        float a = v[m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float b = __shfl_xor_sync(0xffffffffu, a, o);
            a = MAX ? fmaxf(a, b) : a + b;
        }
        if (lane == 0) red[warp * M + m] = a;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M; m++) {
        float a = red[m];
#pragma unroll
        for (int ww = 1; ww < GEMV_WARPS; ww++) a = MAX ? fmaxf(a, red[ww * M + m]) : a + red[ww * M + m];
        v[m] = a;
    }
    __syncthreads();
}

// Four activations (4i .. 4i + 3) of token m as f32: the bf16 input, or for NORM the bf16 of
// x · rs · gain from the f32 residual row (gemv.cu's prologue, same expression).
template <bool NORM>
__device__ __forceinline__ void gm_x4(const void* __restrict__ xin, const bf16* __restrict__ gain, int n4, int m,
                                      int i, float rs, float (&f)[4]) {
    if (NORM) {
        const float4 v = reinterpret_cast<const float4*>(xin)[(u64)m * n4 + i];
        const uint2 gw = reinterpret_cast<const uint2*>(gain)[i];
        const float g0 = __uint_as_float(gw.x << 16), g1 = __uint_as_float(gw.x & 0xffff0000u);
        const float g2 = __uint_as_float(gw.y << 16), g3 = __uint_as_float(gw.y & 0xffff0000u);
        const float2 lo = __bfloat1622float2(__floats2bfloat162_rn(v.x * rs * g0, v.y * rs * g1));
        const float2 hi = __bfloat1622float2(__floats2bfloat162_rn(v.z * rs * g2, v.w * rs * g3));
        f[0] = lo.x, f[1] = lo.y, f[2] = hi.x, f[3] = hi.y;
    } else {
        const uint2 r = reinterpret_cast<const uint2*>(xin)[(u64)m * n4 + i];
        f[0] = __uint_as_float(r.x << 16), f[1] = __uint_as_float(r.x & 0xffff0000u);
        f[2] = __uint_as_float(r.y << 16), f[3] = __uint_as_float(r.y & 0xffff0000u);
    }
}

// Stages the M activation rows as e4m3 codes (codes[m · inp + k]) with their scales xs[m] (see
// the top). Three passes over the (L2-resident) input for NORM, two otherwise.
template <int M, bool NORM>
__device__ __forceinline__ void gm_stage(const void* __restrict__ xin, const bf16* __restrict__ gain, int inp,
                                         float eps, u8* codes, float* xs, float* red) {
    const int n4 = inp >> 2;
    float rs[M], am[M];
#pragma unroll
    for (int m = 0; m < M; m++) rs[m] = 1.f;
    if (NORM) {
        const float4* x4 = reinterpret_cast<const float4*>(xin);
#pragma unroll
        for (int m = 0; m < M; m++) {
            float s = 0.f;
#pragma unroll 4
            for (int i = threadIdx.x; i < n4; i += blockDim.x) {
                const float4 v = x4[(u64)m * n4 + i];
                s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
            rs[m] = s;
        }
        gm_block_reduce<M, false>(rs, red);
#pragma unroll
        for (int m = 0; m < M; m++) rs[m] = rsqrtf(rs[m] / (float)inp + eps);
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
        float a = 0.f;
#pragma unroll 4
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            float f[4];
            gm_x4<NORM>(xin, gain, n4, m, i, rs[m], f);
            a = fmaxf(a, fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3]))));
        }
        am[m] = a;
    }
    gm_block_reduce<M, true>(am, red);
#pragma unroll
    for (int m = 0; m < M; m++) {
        const float s = am[m] > 0.f ? am[m] / 448.f : 1.f;
        if (threadIdx.x == 0) xs[m] = s;
#pragma unroll 4
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            float f[4];
            gm_x4<NORM>(xin, gain, n4, m, i, rs[m], f);
            u32 q = 0;
#pragma unroll
            for (int e = 0; e < 4; e++) q |= (u32)__nv_cvt_float_to_fp8(f[e] / s, __NV_SATFINITE, __NV_E4M3) << (8 * e);
            reinterpret_cast<u32*>(codes)[(u64)m * n4 + i] = q;
        }
    }
    __syncthreads();
}

template <int M, int MODE, bool NORM>
__device__ __forceinline__ void gemv_mma_impl(void* y, const u8* __restrict__ w, const void* __restrict__ xin,
                                              const bf16* __restrict__ gain, int out, int inp, float eps,
                                              const float* __restrict__ wscale, RopeKv rk) {
    constexpr bool PAIR = MODE == 3 || MODE == 4;
    constexpr int LR = PAIR ? 8 : 16;  // logical rows per tile
    constexpr int U = GEMV_MMA_U;
    extern __shared__ uint4 gv_smem[];
    u8* codes = reinterpret_cast<u8*>(gv_smem);
#if GEMV_FP8MMA >= 2
    // stage_f16's rows and reduction slots come first.
    float* xs = reinterpret_cast<float*>(codes + (u64)M * inp * 2 + 2 * GEMV_WARPS * M * 4);
    xs = reinterpret_cast<float*>(((unsigned long long)xs + 15) & ~15ull);
#else
    float* xs = reinterpret_cast<float*>(codes + (u64)M * inp);
#endif
    float* red = xs + 4;
    float4* tred = reinterpret_cast<float4*>(red + GEMV_WARPS * 4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tig = lane & 3;
    const int tiles = (out + LR - 1) / LR;
    const int pieces = inp >> 6;
    // This warp's pieces of k: warp, warp + GEMV_WARPS, …; U of them per round.
    const int mine = pieces > warp ? (pieces - warp + GEMV_WARPS - 1) / GEMV_WARPS : 0;
    const int rounds = (mine + U - 1) / U;
    auto piece = [&](int r, int u) { return warp + GEMV_WARPS * (u + U * r); };
    // Physical rows of tile rows gid and gid + 8 of tile t (rows past `out` clamped, results
    // dropped).
    auto rows_of = [&](int t, int& a, int& b) {
        if (PAIR) {
            const int j = min(t * 8 + gid, out - 1);
            a = phys_row<MODE>(j, 0, out, rk.hd);
            b = phys_row<MODE>(j, GEMV_R, out, rk.hd);
        } else {
            a = min(t * 16 + gid, out - 1);
            b = min(t * 16 + 8 + gid, out - 1);
        }
    };
    int tile = blockIdx.x;
    pdl_launch_dependents();
    int pa, pb;
    rows_of(tile, pa, pb);
    const u8* ra = w + (u64)pa * inp + tig * 16;
    const u8* rb = w + (u64)pb * inp + tig * 16;
    uint4 va[U], vb[U];
    // The first weight loads go out before the wait on the previous kernel and the prologue.
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int p = piece(0, u);
        if (p < pieces) {
            va[u] = ld_weight(ra + p * 64);
            vb[u] = ld_weight(rb + p * 64);
        }
    }
    pdl_wait();
#if GEMV_FP8MMA >= 2
    {
        float xun[M];
        stage_f16<M, NORM>(xin, gain, inp, eps, xun);
        if (threadIdx.x == 0) {
#pragma unroll
            for (int m = 0; m < M; m++) xs[m] = xun[m];
        }
    }
    const __half* xrow = reinterpret_cast<const __half*>(gv_smem) + (u64)(gid < M ? gid : M - 1) * inp + tig * 16;
#else
    gm_stage<M, NORM>(xin, gain, inp, eps, codes, xs, red);
    const u8* xrow = codes + (u64)(gid < M ? gid : M - 1) * inp + tig * 16;
#endif

    for (int it = 0;; it++) {
        const int next = tile + gridDim.x;
        const u8* na = ra;
        const u8* nb = rb;
        if (next < tiles) {
            int qa, qb;
            rows_of(next, qa, qb);
            na = w + (u64)qa * inp + tig * 16;
            nb = w + (u64)qb * inp + tig * 16;
        }
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        for (int r = 0; r < rounds; r++) {
            float e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int p = piece(r, u);
                if (p < pieces) {
#if GEMV_FP8MMA >= 2
                    // Lane (n, tig)'s 16 activations at the lane's 16 weight columns; mma j
                    // takes columns 4j .. 4j + 3 (A: decoded pairs 2j, 2j + 1 of both rows).
                    const uint4* xp = reinterpret_cast<const uint4*>(xrow + p * 64);
                    const uint4 x0 = xp[0], x1 = xp[1];
                    const u32 xb[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                    u32 ha[8], hb[8];
                    gm_decode(va[u], ha);
                    gm_decode(vb[u], hb);
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        gm_mma_f16(e, ha[2 * j], hb[2 * j], ha[2 * j + 1], hb[2 * j + 1], xb[2 * j], xb[2 * j + 1]);
#else
                    const uint4 xb = *reinterpret_cast<const uint4*>(xrow + p * 64);
                    gm_mma(e, va[u].x, vb[u].x, va[u].y, vb[u].y, xb.x, xb.y);
                    gm_mma(e, va[u].z, vb[u].z, va[u].w, vb[u].w, xb.z, xb.w);
#endif
                }
                // Refill the slot: this tile's next round, else the next tile's first.
                if (r + 1 < rounds) {
                    const int pn = piece(r + 1, u);
                    if (pn < pieces) {
                        va[u] = ld_weight(ra + pn * 64);
                        vb[u] = ld_weight(rb + pn * 64);
                    }
                } else if (next < tiles && piece(0, u) < pieces) {
                    va[u] = ld_weight(na + piece(0, u) * 64);
                    vb[u] = ld_weight(nb + piece(0, u) * 64);
                }
            }
#pragma unroll
            for (int c = 0; c < 4; c++) d[c] += e[c];
        }
        float4* buf = tred + (it & 1) * GEMV_WARPS * 32;
        buf[warp * 32 + lane] = make_float4(d[0], d[1], d[2], d[3]);
        __syncthreads();
        if (warp == it % GEMV_WARPS) {
            float4 s = buf[lane];
#pragma unroll
            for (int ww = 1; ww < GEMV_WARPS; ww++) {
                const float4 t = buf[ww * 32 + lane];
                s.x += t.x, s.y += t.y, s.z += t.z, s.w += t.w;
            }
            const int m0 = 2 * tig;
            if (m0 < M) {
                const float x0 = xs[m0], x1 = m0 + 1 < M ? xs[m0 + 1] : 0.f;
                if (PAIR) {
                    const int j = tile * 8 + gid;
                    if (j < out) {
                        const float wa = wscale[phys_row<MODE>(j, 0, out, rk.hd)];
                        const float wb = wscale[phys_row<MODE>(j, GEMV_R, out, rk.hd)];
                        gv_store<MODE>(y, j, m0, out, s.x * (wa * x0), s.z * (wb * x0), rk);
                        if (m0 + 1 < M) gv_store<MODE>(y, j, m0 + 1, out, s.y * (wa * x1), s.w * (wb * x1), rk);
                    }
                } else {
                    const int ja = tile * 16 + gid, jb = ja + 8;
                    if (ja < out) {
                        const float wa = wscale[ja];
                        gv_store<MODE>(y, ja, m0, out, s.x * (wa * x0), 0.f, rk);
                        if (m0 + 1 < M) gv_store<MODE>(y, ja, m0 + 1, out, s.y * (wa * x1), 0.f, rk);
                    }
                    if (jb < out) {
                        const float wb = wscale[jb];
                        gv_store<MODE>(y, jb, m0, out, s.z * (wb * x0), 0.f, rk);
                        if (m0 + 1 < M) gv_store<MODE>(y, jb, m0 + 1, out, s.w * (wb * x1), 0.f, rk);
                    }
                }
            }
        }
        if (next >= tiles) return;
        tile = next;
        ra = na;
        rb = nb;
    }
}

#define GEMV_MMA_KERNEL(NAME, M, MODE, NORM)                                                              \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) NAME(                                   \
        void* y, const wtype* w, const void* x, const bf16* gain, int out, int inp, float eps,           \
        const float* wscale) {                                                                            \
        RopeKv rk = {nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 2, 0};                            \
        gemv_mma_impl<M, MODE, NORM>(y, w, x, gain, out, inp, eps, wscale, rk);                           \
    }

#define GEMV_MMA_QKV_ROPE(M)                                                                               \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_qkv_rope_m##M(                     \
        void* y, const wtype* w, const void* x, const bf16* gain, int out, int inp, float eps,            \
        const float* wscale, const u32* pos, const u32* slots, const float* inv_freq, bf16* kc, bf16* vc, \
        int qh, int kvh, int hd, int kv_fp8) {                                                             \
        RopeKv rk = {pos, slots, inv_freq, kc, vc, qh, kvh, hd, kv_fp8};                                  \
        gemv_mma_impl<M, 4, true>(y, w, x, gain, out, inp, eps, wscale, rk);                              \
    }

#define GEMV_MMA_FAMILY(M)                                  \
    GEMV_MMA_QKV_ROPE(M)                                    \
    GEMV_MMA_KERNEL(gemv_logits_m##M, M, 1, false)          \
    GEMV_MMA_KERNEL(gemv_residual_m##M, M, 2, false)        \
    GEMV_MMA_KERNEL(gemv_gate_up_m##M, M, 3, true)

GEMV_MMA_FAMILY(1)
GEMV_MMA_FAMILY(2)
GEMV_MMA_FAMILY(3)
GEMV_MMA_FAMILY(4)
#endif

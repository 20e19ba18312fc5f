// Tensor-core causal GQA attention for prefill chunks over the paged KV cache
// (FlashAttention-2, Dao 2023: "FlashAttention-2: Faster Attention with Better Parallelism and
// Work Partitioning", Algorithm 1 forward pass, one query tile per thread block, the K/V tiles
// streamed through shared memory, online softmax in registers). Compiled as its own NVRTC
// module (attn_prefill.rs); storage bf16, softmax and accumulation f32.
//
// Layouts (backend/mod.rs, cuda.rs):
//   qkv   bf16 [T, (qh + 2·kvh)·HD]  fused rows [q heads | k heads | v heads], q RoPE'd
//   kc/vc bf16 [num_blocks, bs, kvh, HD]; position p of a sequence lives in slot
//         bt[p / bs]·bs + p % bs, bt = bts + bt_offset
//   out   bf16 [T, qh·HD]
//   work  u32 [tiles, PF_TILE_WORDS] = {query_start, query_len, context_len, bt_offset, tok0,
//         ntok, 0, 0}: a tile is the query tokens tok0..tok0+ntok of one sequence (token i of the
//         sequence is step row query_start + i at position context_len − query_len + i)
//
// Grid: tiles·kvh blocks (block b: tile b / kvh, KV head b % kvh), PF_THREADS threads, dynamic
// shared memory PF_SMEM_BYTES(HD). GQA: the rows of the Q tile are (token, head) pairs, row
// r = (token r / G, query head h·G + r % G), so the G query heads of KV head h share every K/V
// tile loaded (PF_BM / G tokens per tile). Warp w owns rows 16w..16w+15.
//
// Per K/V tile of PF_BN positions n0.. (in position order from 0, double-buffered with cp.async,
// K and V in separate commit groups so S = Q·Kᵀ starts before V has landed):
//   S = Q·Kᵀ (mma m16n8k16, bf16 in, f32 out), scaled by softmax_scale·log2(e);
//   causal mask: position > own position → −inf (only on tiles that reach past the tile's first
//   query position); rows of padding tokens copy the last token's position;
//   online softmax: m' = max(m, rowmax S), l = l·2^(m−m') + Σ 2^(S−m'), O = O·2^(m−m');
//   O += bf16(P)·V (P stays in registers: the C fragment of two n-tiles is the A fragment of
//   one k-step). Output O / l as bf16.
//
// Batch invariance: a row's reduction order depends only on its own position (tiles aligned to
// position 0, fixed order); tiles past a row's position are fully masked and leave m, l and O
// unchanged, so a token's output does not depend on which other tokens share its tile.
//
// Shared-memory tiles are [rows][HD] bf16 with the 16-byte chunks of row r XOR-swizzled by
// (r & 7), so the 8 rows read by one ldmatrix 8×8 matrix hit 8 distinct bank groups.
//
// PF_SCALAR_FRAGS (define before this file) builds every mma fragment with plain shared-memory
// loads written directly from the PTX ISA fragment tables instead of ldmatrix: a slower,
// independent path to tell a wrong ldmatrix address from a wrong fragment layout.
//
// KV_FP8 (compile-time define): the caches hold e4m3 values (per-tensor scale 1). The raw bytes of
// K/V tile j + 1 are copied with cp.async (double-buffered, half the bytes of a bf16 tile) while
// tile j is widened to f16 into single-stage swizzled tiles (exact; cvt.rn.f16x2.e4m3x2) and
// computed; the Q tile is stored as f16, both products run as f16 mma with P rounded to f16.
// Shared memory: the same PF_SMEM_BYTES (Q, one f16 K and V tile, two raw stages of K and V).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifdef KV_FP8
#include <cuda_fp8.h>
#endif

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;
typedef unsigned long long u64;
#ifdef KV_FP8
typedef unsigned char kvt;
#define PF_MMA_T "f16.f16"
#else
typedef bf16 kvt;
#define PF_MMA_T "bf16.bf16"
#endif

#define PF_BM 64                          // Q-tile rows ((token, head) pairs)
#define PF_BN 64                          // K/V positions per tile
#define PF_WARPS 4
#define PF_THREADS (PF_WARPS * 32)
#define PF_TILE_WORDS 8
#define PF_NEG_INF __int_as_float(0xff800000)
// Q tile + 2 stages of K and V tiles.
#define PF_SMEM_BYTES(HD) ((PF_BM + 4 * PF_BN) * (HD) * 2)

// ---------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte global → shared copy; `ok == false` writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8×8 b16 matrices; lane l gives the address of row (l & 7) of matrix (l >> 3) and
// receives, in register i, row l / 4, columns 2·(l % 4) + {0, 1} of matrix i.
__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
// As ldsm_x4, transposed: register i holds rows 2·(l % 4) + {0, 1}, column l / 4 of matrix i.
__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// d[16×8] += a[16×16] · b[16×8] (bf16 in, f32 accumulate).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." PF_MMA_T ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x (ex2.approx.ftz: 2^-inf = +0).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats → bf16x2 register, `lo` in the low half (the lower column / k index).
// (f16x2 with KV_FP8: the mma's pair type.)
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
#ifdef KV_FP8
    __half2 v = __floats2half2_rn(lo, hi);
#else
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#endif
    return *reinterpret_cast<u32*>(&v);
}

#ifdef KV_FP8
__device__ __forceinline__ void st_shared4(u32 dst, const u32 (&h)[4]) {
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst), "r"(h[0]), "r"(h[1]), "r"(h[2]), "r"(h[3]) : "memory");
}
// Two e4m3 codes (low 16 bits of v, the first in the low byte) → an f16 pair, the first low
// (one instruction from sm_89 on; cuda_fp8.h's software conversion before).
__device__ __forceinline__ u32 e4m3x2_to_h2(u32 v) {
#if __CUDA_ARCH__ >= 890
    u32 r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"((unsigned short)(v & 0xffffu)));
    return r;
#else
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    return (u32)h.x | ((u32)h.y << 16);
#endif
}
// 8 bf16 values at src (zeros when !ok) → 8 f16 at shared address dst.
__device__ __forceinline__ void bf16_row8_as_f16(u32 dst, const bf16* src, bool ok) {
    uint4 v = ok ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    u32 h[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
        h[i] = pack_bf16(f.x, f.y);
    }
    st_shared4(dst, h);
}
#endif

// ---------------------------------------------------------------- swizzled [rows][HD] tiles

// Byte offset of 16-byte chunk c (columns 8c..8c+7) of row r.
template <int HD>
__device__ __forceinline__ u32 tile_off(int r, int c) {
    return (u32)(r * HD * 2 + ((c ^ (r & 7)) << 4));
}
// Element offset of (r, col).
template <int HD>
__device__ __forceinline__ int tile_elem(int r, int col) {
    return r * HD + ((((col >> 3) ^ (r & 7))) << 3) + (col & 7);
}

// ---------------------------------------------------------------- mma fragments
// PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type" (.bf16), with
// g = lane >> 2 and t = lane & 3:
//   A (16×16, row-major), register j = 0..3: A[g + 8·(j & 1)][2t + 8·(j >> 1) + {0, 1}]
//   B (16×8, k × n),      register j = 0..1: B[2t + 8j + {0, 1}][g]
//   C/D (16×8 f32),       element  e = 0..3: C[g + 8·(e >> 1)][2t + (e & 1)]
// (two bf16 per register, the first index in the low half).

// A fragment of rows row0..row0+15, columns col0..col0+15 of a [rows][HD] tile.
template <int HD>
__device__ __forceinline__ void frag_a(u32 (&a)[4], const bf16* tile, int row0, int col0, int lane) {
#ifdef PF_SCALAR_FRAGS
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int r = row0 + g + 8 * (j & 1), c = col0 + 2 * t + 8 * (j >> 1);
        a[j] = *reinterpret_cast<const u32*>(tile + tile_elem<HD>(r, c));
    }
#else
    // Matrix i ↔ register i: 0 = (rows 0-7, cols 0-7), 1 = (rows 8-15, cols 0-7),
    // 2 = (rows 0-7, cols 8-15), 3 = (rows 8-15, cols 8-15).
    const int mi = lane >> 3;
    const int r = row0 + (lane & 7) + 8 * (mi & 1), c = (col0 >> 3) + (mi >> 1);
    ldsm_x4(a[0], a[1], a[2], a[3], smem_addr(tile) + tile_off<HD>(r, c));
#endif
}

// B fragments of S = Q·Kᵀ from a K tile stored [n = position][k = dim]: B[k][n] = K[n][k].
// b[0..1]: n-tile n0..n0+7, b[2..3]: n-tile n0+8..n0+15, both over k0..k0+15.
template <int HD>
__device__ __forceinline__ void frag_b_k(u32 (&b)[4], const bf16* tile, int n0, int k0, int lane) {
#ifdef PF_SCALAR_FRAGS
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int n = n0 + 8 * nt + g, k = k0 + 2 * t + 8 * j;
            b[2 * nt + j] = *reinterpret_cast<const u32*>(tile + tile_elem<HD>(n, k));
        }
    }
#else
    // Matrix i ↔ b[i]: 0 = (n 0-7, k 0-7), 1 = (n 0-7, k 8-15), 2 = (n 8-15, k 0-7),
    // 3 = (n 8-15, k 8-15); stored rows are n, so no transpose.
    const int mi = lane >> 3;
    const int n = n0 + (lane & 7) + 8 * (mi >> 1), c = (k0 >> 3) + (mi & 1);
    ldsm_x4(b[0], b[1], b[2], b[3], smem_addr(tile) + tile_off<HD>(n, c));
#endif
}

// B fragments of O = P·V from a V tile stored [k = position][n = dim].
// b[0..1]: n-tile d0..d0+7, b[2..3]: n-tile d0+8..d0+15, both over positions k0..k0+15.
template <int HD>
__device__ __forceinline__ void frag_b_v(u32 (&b)[4], const bf16* tile, int k0, int d0, int lane) {
#ifdef PF_SCALAR_FRAGS
    const int g = lane >> 2, t = lane & 3;
    const unsigned short* raw = reinterpret_cast<const unsigned short*>(tile);
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int n = d0 + 8 * nt + g, k = k0 + 2 * t + 8 * j;
            u32 lo = raw[tile_elem<HD>(k, n)], hi = raw[tile_elem<HD>(k + 1, n)];
            b[2 * nt + j] = lo | (hi << 16);
        }
    }
#else
    // Matrix i ↔ b[i]: 0 = (k 0-7, n 0-7), 1 = (k 8-15, n 0-7), 2 = (k 0-7, n 8-15),
    // 3 = (k 8-15, n 8-15); stored rows are k, so transposed.
    const int mi = lane >> 3;
    const int k = k0 + (lane & 7) + 8 * (mi & 1), c = (d0 >> 3) + (mi >> 1);
    ldsm_x4_t(b[0], b[1], b[2], b[3], smem_addr(tile) + tile_off<HD>(k, c));
#endif
}

// ---------------------------------------------------------------- tile loads
// Thread tid copies 16-byte chunk tid % (HD / 8) of rows tid / (HD / 8) + k · PF_THREADS / (HD / 8)
// of a K or V tile: PF_KV_ROWS(HD) rows, whose cache slots it looks up once for both K and V.
#define PF_KV_ROWS(HD) (PF_BN * ((HD) / 8) / PF_THREADS)
#define PF_NO_SLOT 0xffffffffu

// Block size as a shift when it is a power of two (else −1: divide).
struct BlockSize {
    int bs, shift;
};
__device__ __forceinline__ BlockSize block_size(int bs) {
    BlockSize b;
    b.bs = bs;
    b.shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;
    return b;
}

// Cache slots of this thread's rows of the tile at positions n0..; PF_NO_SLOT past kv_len.
template <int HD>
__device__ __forceinline__ void tile_slots(u32 (&slot)[PF_KV_ROWS(HD)], const u32* bt, int n0, int kv_len, BlockSize b,
                                           int tid) {
    constexpr int CH = HD / 8;
    static_assert(PF_THREADS % CH == 0 && PF_BN % (PF_THREADS / CH) == 0, "thread ↔ chunk mapping");
    const u32 p0 = (u32)(n0 + tid / CH);
    if (b.shift >= 0) {  // uniform branch: shifts for power-of-two block sizes
#pragma unroll
        for (int k = 0; k < PF_KV_ROWS(HD); k++) {
            u32 p = p0 + k * (PF_THREADS / CH);
            slot[k] = (int)p < kv_len ? (bt[p >> b.shift] << b.shift) + (p & (u32)(b.bs - 1)) : PF_NO_SLOT;
        }
    } else {
#pragma unroll
        for (int k = 0; k < PF_KV_ROWS(HD); k++) {
            u32 p = p0 + k * (PF_THREADS / CH);
            u32 blk = p / (u32)b.bs;
            slot[k] = (int)p < kv_len ? bt[blk] * (u32)b.bs + (p - blk * (u32)b.bs) : PF_NO_SLOT;
        }
    }
}

// Issues cp.async for this thread's chunks of a [PF_BN][HD] K or V tile of KV head h; rows
// without a slot (positions ≥ kv_len) are zero-filled (never NaN garbage: P·V multiplies them
// by 0).
template <int HD>
__device__ __forceinline__ void load_kv_tile(bf16* dst, const kvt* cache, const u32 (&slot)[PF_KV_ROWS(HD)], int kvh,
                                             int h, int tid) {
    constexpr int CH = HD / 8;
    const int c = tid % CH;
    const u32 base = smem_addr(dst);
#pragma unroll
    for (int k = 0; k < PF_KV_ROWS(HD); k++) {
        const int r = tid / CH + k * (PF_THREADS / CH);
        const bool ok = slot[k] != PF_NO_SLOT;
        const kvt* src = cache + ((u64)(ok ? slot[k] : 0u) * kvh + h) * HD + c * 8;
        cp_async16(base + tile_off<HD>(r, c), src, ok);
    }
}

#ifdef KV_FP8
// FP8 KV: thread tid copies 16-byte chunk tid % (HD / 16) (16 codes) of rows tid / (HD / 16) +
// k · PF_THREADS / (HD / 16) of a raw [PF_BN][HD] e4m3 tile, and later widens the same chunks.
#define PF_KV_ROWS8(HD) (PF_BN * ((HD) / 16) / PF_THREADS)

// Cache slots of this thread's rows of the tile at positions n0..; PF_NO_SLOT past kv_len.
template <int HD>
__device__ __forceinline__ void tile_slots8(u32 (&slot)[PF_KV_ROWS8(HD)], const u32* bt, int n0, int kv_len,
                                            BlockSize b, int tid) {
    constexpr int CH8 = HD / 16;
    const u32 p0 = (u32)(n0 + tid / CH8);
#pragma unroll
    for (int k = 0; k < PF_KV_ROWS8(HD); k++) {
        const u32 p = p0 + k * (PF_THREADS / CH8);
        u32 sl = PF_NO_SLOT;
        if ((int)p < kv_len) {
            if (b.shift >= 0) {
                sl = (bt[p >> b.shift] << b.shift) + (p & (u32)(b.bs - 1));
            } else {
                const u32 blk = p / (u32)b.bs;
                sl = bt[blk] * (u32)b.bs + (p - blk * (u32)b.bs);
            }
        }
        slot[k] = sl;
    }
}

// cp.async of this thread's chunks of a raw e4m3 K or V tile of KV head h into shared address
// dst (plain [PF_BN][HD] bytes); rows without a slot are zero-filled.
template <int HD>
__device__ __forceinline__ void load_kv_raw(u32 dst, const kvt* cache, const u32 (&slot)[PF_KV_ROWS8(HD)], int kvh,
                                            int h, int tid) {
    constexpr int CH8 = HD / 16;
    const int c = tid % CH8;
#pragma unroll
    for (int k = 0; k < PF_KV_ROWS8(HD); k++) {
        const int r = tid / CH8 + k * (PF_THREADS / CH8);
        const bool ok = slot[k] != PF_NO_SLOT;
        const kvt* src = cache + ((u64)(ok ? slot[k] : 0u) * kvh + h) * HD + c * 16;
        cp_async16(dst + (u32)(r * HD + c * 16), src, ok);
    }
}

// This thread's chunks of the raw tile at shared address src → f16 (exact) in the swizzled
// [PF_BN][HD] tile dst: 16 codes become f16 chunks 2c and 2c + 1 of the row, the one stored
// first alternating with c / 4 so that 8 neighbouring threads hit 8 distinct bank groups.
template <int HD>
__device__ __forceinline__ void widen_kv_tile(bf16* dst, u32 src, int tid) {
    constexpr int CH8 = HD / 16;
    const int c = tid % CH8;
    const u32 base = smem_addr(dst);
#pragma unroll
    for (int k = 0; k < PF_KV_ROWS8(HD); k++) {
        const int r = tid / CH8 + k * (PF_THREADS / CH8);
        u32 v[4];
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
                     : "r"(src + (u32)(r * HD + c * 16))
                     : "memory");
        u32 h[2][4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            h[i >> 1][2 * (i & 1)] = e4m3x2_to_h2(v[i]);            // codes 4i, 4i + 1
            h[i >> 1][2 * (i & 1) + 1] = e4m3x2_to_h2(v[i] >> 16);  // codes 4i + 2, 4i + 3
        }
        const bool swap = (c >> 2) & 1;
        u32 a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            a[i] = swap ? h[1][i] : h[0][i];
            b[i] = swap ? h[0][i] : h[1][i];
        }
        st_shared4(base + tile_off<HD>(r, 2 * c + swap), a);
        st_shared4(base + tile_off<HD>(r, 2 * c + !swap), b);
    }
}
#endif

// ---------------------------------------------------------------- one K/V tile

// S = Q·Kᵀ of the warp's 16 rows over the PF_BN positions of the K tile `skt`.
template <int HD>
// qf: the warp's Q fragments, all KS of them when they stay in registers (head_dim ≤ 128), else one
// that each k-step re-reads from the Q tile sq (see prefill_impl).
__device__ __forceinline__ void pf_scores(float (&s)[PF_BN / 8][4], u32 (&qf)[HD <= 128 ? HD / 16 : 1][4],
                                          const bf16* sq, int warp, const bf16* skt, int lane) {
    constexpr int KS = HD / 16, NT = PF_BN / 8;
    constexpr bool QREG = HD <= 128;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        if (!QREG) frag_a<HD>(qf[0], sq, warp * 16, kk * 16, lane);
        const u32(&qa)[4] = qf[QREG ? kk : 0];
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            u32 b[4];
            frag_b_k<HD>(b, skt, np * 16, kk * 16, lane);
            mma_bf16(s[2 * np], qa, b[0], b[1]);
            mma_bf16(s[2 * np + 1], qa, b[2], b[3]);
        }
    }
}

// Causal mask and online softmax on rows g (hf 0) and g + 8 (hf 1) of the tile at positions
// n0..: S becomes P in place, m, l and O are updated.
template <int HD>
__device__ __forceinline__ void pf_softmax(float (&s)[PF_BN / 8][4], float (&m)[2], float (&l)[2], float (&o)[HD / 8][4],
                                           int n0, int pos_first, const int (&qpos)[2], int t, float scale_log2) {
    constexpr int NT = PF_BN / 8, DT = HD / 8;
    // m is the running max of the raw scores; P = 2^(S·c − m·c) with c = scale·log2(e) (one FFMA + ex2).
    const bool need_mask = n0 + PF_BN - 1 > pos_first;
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float mx = m[hf];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                if (need_mask && n0 + nt * 8 + 2 * t + e > qpos[hf]) s[nt][2 * hf + e] = PF_NEG_INF;
                mx = fmaxf(mx, s[nt][2 * hf + e]);
            }
        }
        // The 4 lanes of a group hold the row's PF_BN columns.
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Position 0 is in tile 0 and never masked, so mx is finite from tile 0 on; the first
        // correction is 2^-inf = 0, and exactly 1 when the max did not move (a fully masked
        // tile then leaves O and l bit-for-bit unchanged, whatever ex2.approx(0) returns).
        const float corr = mx == m[hf] ? 1.f : ex2((m[hf] - mx) * scale_log2);
        const float mc = mx * scale_log2;
        m[hf] = mx;
        float ls = l[hf] * corr;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            o[dt][2 * hf] *= corr;
            o[dt][2 * hf + 1] *= corr;
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float p = ex2(fmaf(s[nt][2 * hf + e], scale_log2, -mc));
                s[nt][2 * hf + e] = p;
                ls += p;
            }
        }
        l[hf] = ls;
    }
}

// O += P·V over the V tile `svt` (P in registers: the C fragment of two n-tiles is the A
// fragment of one k-step).
template <int HD>
__device__ __forceinline__ void pf_pv(float (&o)[HD / 8][4], const float (&s)[PF_BN / 8][4], const bf16* svt, int lane) {
#pragma unroll
    for (int kk = 0; kk < PF_BN / 16; kk++) {
        // C fragments of n-tiles 2kk, 2kk+1 = A fragment of k-step kk.
        u32 a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                    pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < HD / 16; dp++) {
            u32 b[4];
            frag_b_v<HD>(b, svt, kk * 16, dp * 16, lane);
            mma_bf16(o[2 * dp], a, b[0], b[1]);
            mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
        }
    }
}

// ---------------------------------------------------------------- the kernel

template <int HD, int G>
__device__ __forceinline__ void prefill_impl(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                                             const kvt* __restrict__ kc, const kvt* __restrict__ vc,
                                             const u32* __restrict__ bts, const u32* __restrict__ work, int qh,
                                             int kvh, int bs, float scale_log2) {
    constexpr int CH = HD / 8;   // 16-byte chunks per row
    constexpr int KS = HD / 16;  // k-steps of Q·Kᵀ
    constexpr int NT = PF_BN / 8;  // n-tiles of S
    constexpr int DT = HD / 8;   // n-tiles of O
    static_assert(16 % G == 0, "G divides the 16 rows of a warp");
    extern __shared__ __align__(128) unsigned char pf_smem[];
    bf16* sq = reinterpret_cast<bf16*>(pf_smem);  // [PF_BM][HD]
#ifdef KV_FP8
    bf16* sk = sq + PF_BM * HD;                   // [PF_BN][HD] f16 (then the raw e4m3 stages)
    bf16* sv = sk + PF_BN * HD;                   // [PF_BN][HD] f16
#else
    bf16* sk = sq + PF_BM * HD;                   // [2][PF_BN][HD]
    bf16* sv = sk + 2 * PF_BN * HD;               // [2][PF_BN][HD]
#endif

    const int tile = blockIdx.x / kvh, h = blockIdx.x % kvh;
    const u32* wk = work + (u64)tile * PF_TILE_WORDS;
    const int q_start = (int)wk[0], q_len = (int)wk[1], ctx = (int)wk[2], tok0 = (int)wk[4], ntok = (int)wk[5];
    const u32* bt = bts + wk[3];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int pos_first = ctx - q_len + tok0;  // position of the tile's first token
    const int pos_last = pos_first + ntok - 1;
    const int kv_len = pos_last + 1;           // positions any row of the tile attends to
    const int n_kv = (kv_len + PF_BN - 1) / PF_BN;
    const u64 qkv_dim = (u64)(qh + 2 * kvh) * HD;

    // Q tile (rows of padding tokens zero-filled), then K/V tile 0.
    {
        const u32 base = smem_addr(sq);
#pragma unroll
        for (int i = tid; i < PF_BM * CH; i += PF_THREADS) {
            int r = i / CH, c = i % CH, tk = r / G;
            bool ok = tk < ntok;
            const bf16* src =
                qkv + (u64)(q_start + tok0 + (ok ? tk : 0)) * qkv_dim + (u64)(h * G + r % G) * HD + c * 8;
#ifdef KV_FP8
            bf16_row8_as_f16(base + tile_off<HD>(r, c), src, ok);
#else
            cp_async16(base + tile_off<HD>(r, c), src, ok);
#endif
        }
    }
#ifdef KV_FP8
    const BlockSize bsz = block_size(bs);
    // Raw e4m3 tiles: [2 stages][K, V][PF_BN][HD] bytes after the f16 K and V tiles.
    const u32 raw = smem_addr(sv + PF_BN * HD);
    u32 slot[PF_KV_ROWS8(HD)];
    tile_slots8<HD>(slot, bt, 0, kv_len, bsz, tid);
    load_kv_raw<HD>(raw, kc, slot, kvh, h, tid);
    load_kv_raw<HD>(raw + PF_BN * HD, vc, slot, kvh, h, tid);
    cp_async_commit();

#else
    const BlockSize bsz = block_size(bs);
    u32 slot[PF_KV_ROWS(HD)];  // slots of the next tile to load (K then V)
    tile_slots<HD>(slot, bt, 0, kv_len, bsz, tid);
    load_kv_tile<HD>(sk, kc, slot, kvh, h, tid);
    cp_async_commit();
    load_kv_tile<HD>(sv, vc, slot, kvh, h, tid);
    cp_async_commit();

#endif
    // This thread's two rows (g and g + 8 of the warp's 16) and their positions.
    int qpos[2];
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        int tk = (warp * 16 + g + 8 * hf) / G;
        qpos[hf] = min(pos_first + tk, pos_last);
    }

    // Q fragments stay in registers for the whole K/V loop at head_dim ≤ 128; at 256 they would
    // take 64 of the 255 registers next to O's 128, so each k-step re-reads its fragment from
    // the Q tile (which stays in shared memory, never overwritten).
    constexpr bool QREG = HD <= 128;
    u32 qf[QREG ? KS : 1][4];
    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
    float m[2] = {PF_NEG_INF, PF_NEG_INF}, l[2] = {0.f, 0.f};

#ifdef KV_FP8
    // Tile j + 1's bytes are copied (cp.async) while tile j is converted and computed.
    for (int j = 0; j < n_kv; j++) {
        const int st = j & 1, n0 = j * PF_BN;
        // Raw stage st ^ 1 was converted in iteration j − 1, before its second barrier.
        if (j + 1 < n_kv) {
            const u32 nxt = raw + (u32)((st ^ 1) * 2 * PF_BN * HD);
            tile_slots8<HD>(slot, bt, n0 + PF_BN, kv_len, bsz, tid);
            load_kv_raw<HD>(nxt, kc, slot, kvh, h, tid);
            load_kv_raw<HD>(nxt + PF_BN * HD, vc, slot, kvh, h, tid);
        }
        cp_async_commit();
        cp_async_wait<1>();  // tile j landed (tile j + 1 may be in flight)
        __syncthreads();     // every thread's bytes visible; every warp is past tile j − 1's P·V
        const u32 cur = raw + (u32)(st * 2 * PF_BN * HD);
        widen_kv_tile<HD>(sk, cur, tid);
        widen_kv_tile<HD>(sv, cur + PF_BN * HD, tid);
        __syncthreads();
        if (QREG && j == 0) {
#pragma unroll
            for (int kk = 0; kk < KS; kk++) frag_a<HD>(qf[QREG ? kk : 0], sq, warp * 16, kk * 16, lane);
        }
        float s[NT][4];
        pf_scores<HD>(s, qf, sq, warp, sk, lane);
        pf_softmax<HD>(s, m, l, o, n0, pos_first, qpos, t, scale_log2);
        pf_pv<HD>(o, s, sv, lane);
    }
#else
    for (int j = 0; j < n_kv; j++) {
        const int st = j & 1, n0 = j * PF_BN;
        const bf16* skt = sk + st * PF_BN * HD;
        const bf16* svt = sv + st * PF_BN * HD;
        cp_async_wait<1>();  // K_j (and Q) landed; V_j may be in flight
        __syncthreads();
        if (QREG && j == 0) {
#pragma unroll
            for (int kk = 0; kk < KS; kk++) frag_a<HD>(qf[QREG ? kk : 0], sq, warp * 16, kk * 16, lane);
        }
        // Prefetch K_{j+1} into the other stage (read in iteration j−1, all warps are past it).
        if (j + 1 < n_kv) {
            tile_slots<HD>(slot, bt, n0 + PF_BN, kv_len, bsz, tid);
            load_kv_tile<HD>(sk + (st ^ 1) * PF_BN * HD, kc, slot, kvh, h, tid);
        }
        cp_async_commit();

        float s[NT][4];
        pf_scores<HD>(s, qf, sq, warp, skt, lane);
        pf_softmax<HD>(s, m, l, o, n0, pos_first, qpos, t, scale_log2);

        cp_async_wait<1>();  // V_j landed (K_{j+1} may be in flight)
        __syncthreads();
        pf_pv<HD>(o, s, svt, lane);
        // Prefetch V_{j+1} (its stage was read in iteration j−1; all warps passed the sync above).
        if (j + 1 < n_kv) load_kv_tile<HD>(sv + (st ^ 1) * PF_BN * HD, vc, slot, kvh, h, tid);
        cp_async_commit();
    }
#endif
    cp_async_wait<0>();

#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float lt = l[hf];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        const float inv = 1.f / lt;
        const int r = warp * 16 + g + 8 * hf, tk = r / G;
        if (tk < ntok) {
            bf16* dst = out + (u64)(q_start + tok0 + tk) * qh * HD + (u64)(h * G + r % G) * HD;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                *reinterpret_cast<__nv_bfloat162*>(dst + dt * 8 + 2 * t) =
                    __floats2bfloat162_rn(o[dt][2 * hf] * inv, o[dt][2 * hf + 1] * inv);
            }
        }
    }
}

// Entry points by head_dim (64, 128, 256) and query heads per KV head. Arguments: out, qkv, k cache, v cache,
// block tables, work list, qh, kvh, block size, softmax scale · log2(e).
#define PF_KERNEL(HD, G, MINB)                                                                             \
    extern "C" __global__ void __launch_bounds__(PF_THREADS, MINB)                                         \
        attn_prefill_hd##HD##_g##G(bf16* out, const bf16* qkv, const kvt* kc, const kvt* vc, const u32* bts,   \
                                   const u32* work, int qh, int kvh, int bs, float scale_log2) {           \
        prefill_impl<HD, G>(out, qkv, kc, vc, bts, work, qh, kvh, bs, scale_log2);                         \
    }

PF_KERNEL(64, 1, 3)
PF_KERNEL(64, 2, 3)
PF_KERNEL(64, 4, 3)
PF_KERNEL(64, 8, 3)
PF_KERNEL(128, 1, 2)
PF_KERNEL(128, 2, 2)
PF_KERNEL(128, 4, 2)
PF_KERNEL(128, 8, 2)
// head_dim 256 (Gemma 3's 1, 2 or 4 query heads per KV head): 160 KiB of dynamic shared
// memory, one block per SM.
PF_KERNEL(256, 1, 1)
PF_KERNEL(256, 2, 1)
PF_KERNEL(256, 4, 1)

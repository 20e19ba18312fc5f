// Paged decode attention of Prism's CUDA backend (one query token per row), compiled at run time
// by NVRTC as its own module (sm_80 or newer: cp.async, ldmatrix, bf16 mma.sync).
// Storage bf16, softmax and accumulation f32, output bf16.
//
// Layouts (as backend/cuda.rs):
//   qkv    bf16 [T, (qh + 2·kvh)·HD]  fused rows [q heads | k heads | v heads]; q already RoPE'd
//   kc, vc bf16 [num_blocks, bs, kvh, HD]  paged caches; this step's K/V already written
//   pos    u32 [T]   position of each token (its context is L = pos + 1 positions)
//   tok_bt u32 [T]   offset into bts of the token's block table;  bts u32 concatenated tables
//   out    bf16 [T, qh·HD]
// Slot of position p: bts[tok_bt[t] + p / bs] · bs + p % bs.
//
// Algorithm (FlashDecoding, Dao et al. 2023, with FlashAttention-2's register-level softmax):
// grid (splits, kvh, T), DA_THREADS threads. CTA (z, g, t) computes the G = qh / kvh query heads
// that share KV head g over split z of token t's context, so K/V are read once for the whole
// group (GQA). The context is cut into DA_TILE-position tiles and a token's tiles into splits:
//   tiles = ceil(L / 64), tiles_per_split = ceil(tiles / cap), splits = ceil(tiles / tiles_per_split)
// where cap (1..DA_MAX_SPLITS) is a launch argument. The split of a token depends only on its own
// L and cap, never on gridDim or the other tokens: with a constant cap the result is batch
// invariant. Tiles are copied into shared memory with 16-byte cp.async, double-buffered (the
// next tile is in flight while the current one is computed), each warp owns 16 positions of a tile and computes
//   S[16 × 16] = Q[16 heads (G used, rest zero) × HD] · K_tileᵀ      (mma m16n8k16, bf16 → f32)
// then an online softmax in f32 (log2 domain, exp2) over its positions and
//   O[16 × HD] += bf16(P)[16 × 16] · V_tile[16 × HD]                (mma m16n8k16)
// (fragment layouts: PTX ISA, "Matrix fragments for mma.m16n8k16" and "ldmatrix"). The four
// warps merge in warp order through shared memory. A one-split token writes bf16 output; else
// each split writes (max, sum, acc[HD]) f32 partials and the CTA that finishes last (atomic
// counter per (token, kv head), reset by that CTA so CUDA-graph replays start from zero) folds
// the splits in split order 0, 1, … and writes the output. Every reduction order above is fixed
// by (L, cap), so results are deterministic. A grid with fewer splits than a token needs is still
// correct (CTAs loop over splits z, z + gridDim.x, …); one with more lets the extra CTAs exit.
// With `early` (launched with programmatic dependent launch right behind the QKV GEMV) a CTA reads
// the step metadata and its block-table entries and prefetches its first K/V tiles into L2
// before griddepcontrol.wait, so those latencies overlap the GEMV's tail.
//
// KV_FP8 (compile-time define): the caches hold e4m3 values (per-tensor scale 1). The raw bytes
// stream through shared memory as the bf16 tiles do (16-byte cp.async, DA_STAGES = 4 stages: three
// tiles in flight while one is computed, half the bytes of a bf16 tile each) and each warp builds
// its mma B fragments from them, two codes per cvt.rn.f16x2.e4m3x2 (exact), so the products run
// as f16 mma with Q and P rounded to f16 (Q after RoPE and P in [0, 1] are well inside f16's
// range). Fragments without ldmatrix (a 16-bit element per matrix entry is what ldmatrix moves):
//   S = Q·Kᵀ: the head dims are a sum, so their order is free. Lane (gid, tig) takes dims
//     tig·HD/4 + 4ks + {0, 1} (register 0) and + {2, 3} (register 1) of k-step ks, for Q (loaded
//     so from global memory) and for K: HD/4 contiguous bytes of K row gid (16-byte loads), one
//     cvt per register.
//   O += P·V: the B register of lane (gid, tig) pairs positions 2tig, 2tig + 1 (and + 8) of one
//     dim; the dims of the 8 columns of output n-tile nd are c·HD/8 + nd (c = 0..7), so lane gid
//     reads HD/8 contiguous bytes of each of its 4 rows, pairs the two rows' bytes with one prmt
//     per two dims and converts each pair with one cvt. The accumulator element (n-tile nd,
//     column 2tig + e) is output dim (2tig + e)·HD/8 + nd.
// The byte tiles are [DA_TILE][HD] with 16-byte chunk c of row r at chunk c ^ (r & 7) (HD 128;
// (r >> 1) & 3 for HD 64), so the K and V fragment loads and the copies of 8 lanes hit distinct
// bank groups. Sums run in the same fixed order for any batch: the FP8-KV build is deterministic
// and batch invariant as the bf16 one.
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
#define DA_MMA_T "f16.f16"
#else
typedef bf16 kvt;
#define DA_MMA_T "bf16.bf16"
#endif

#define DA_WARPS 4
#define DA_THREADS (DA_WARPS * 32)
#define DA_TILE (DA_WARPS * 16)
#define DA_MAX_SPLITS 16
#ifdef KV_FP8
#define DA_STAGES 4      // cp.async pipeline depth (tiles)
#define DA_MIN_BLOCKS 3  // blocks per SM (__launch_bounds__)
#else
#define DA_STAGES 2
#define DA_MIN_BLOCKS 3
#endif
#define DA_NEG_INF __int_as_float(0xff800000)
#define DA_LOG2E 1.4426950408889634f

__device__ __forceinline__ u32 da_smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte async copy global → shared; src_bytes 0 writes zeros (tail positions of a tile).
__device__ __forceinline__ void da_cp16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void da_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void da_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Four 8×8 b16 matrices from shared memory; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void da_ldsm4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void da_ldsm4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// D = A·B + C for m16n8k16 (bf16 in, f32 accumulate) where rows 8..15 of A are zero: the A
// registers a1, a3 (rows groupID + 8) are 0 and the outputs of those rows (d2, d3) are dropped,
// so only (d0, d1) += row groupID, columns 2·(lane % 4) + {0, 1}.
#pragma nv_diagnostic push
#pragma nv_diag_suppress 550  // x0, x1 set but never used
__device__ __forceinline__ void da_mma_top(float& d0, float& d1, u32 a0, u32 a2, u32 b0, u32 b1) {
    float x0, x1;  // rows 8..15: discarded
    asm("mma.sync.aligned.m16n8k16.row.col.f32." DA_MMA_T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d0), "=f"(d1), "=f"(x0), "=f"(x1)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(d0), "f"(d1), "f"(0.f), "f"(0.f));
}
#pragma nv_diagnostic pop

// Two floats → the mma's 16-bit pair type (bf16, or f16 with KV_FP8), `lo` in the low half.
__device__ __forceinline__ u32 da_pack_mma(float lo, float hi) {
#ifdef KV_FP8
    __half2 v = __floats2half2_rn(lo, hi);
#else
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#endif
    return *reinterpret_cast<u32*>(&v);
}
// Two floats → a bf16 pair (the output type whatever the cache type), `lo` in the low half.
__device__ __forceinline__ u32 da_pack_out(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

#ifdef KV_FP8
// Two e4m3 codes (low 16 bits of v, the first in the low byte) → an f16 pair, the first low.
// (One instruction from sm_89 on; cuda_fp8.h's software conversion before.)
__device__ __forceinline__ u32 da_e4m3x2(u32 v) {
#if __CUDA_ARCH__ >= 890
    u32 r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"((unsigned short)(v & 0xffffu)));
    return r;
#else
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
    return (u32)h.x | ((u32)h.y << 16);
#endif
}
__device__ __forceinline__ uint4 da_lds128(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ uint2 da_lds64(u32 addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    return v;
}
// A bf16 pair (one u32) as an f16 pair.
__device__ __forceinline__ u32 da_bf2_to_h2(u32 v) {
    __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&v);
    float2 f = __bfloat1622float2(b);
    return da_pack_mma(f.x, f.y);
}
// Byte offset of 16-byte chunk c of row r in a [DA_TILE][HD] e4m3 tile (swizzle: file header).
template <int HD>
__device__ __forceinline__ u32 da8_off(int r, int c) {
    const int sw = HD == 128 ? (r & 7) : ((r >> 1) & 3);
    return (u32)(r * HD + ((c ^ sw) << 4));
}
#endif

// Positions per split and number of splits of a context of L positions (see the file header).
__device__ __forceinline__ void da_split(int L, int cap, int& chunk, int& nsplits) {
    int tiles = (L + DA_TILE - 1) / DA_TILE;
    int tps = (tiles + cap - 1) / cap;
    chunk = tps * DA_TILE;
    nsplits = (tiles + tps - 1) / tps;
}

// Byte offset of 16-byte chunk c of row r in a [DA_TILE][HD] bf16 tile, XOR-swizzled by r % 8 so
// that ldmatrix (8 rows, same chunk) and cp.async touch 8 distinct bank groups.
template <int HD>
__device__ __forceinline__ u32 da_tile_off(int r, int c) {
    return (u32)(r * HD * 2 + ((c ^ (r & 7)) << 4));
}

// Online-softmax step over a warp's 16 positions pw .. pw + 15: s[j][e] holds this lane's raw
// scores of positions pw + 8j + 2tig + e (head row gid). Scales them by sl2 (log2 units), masks
// positions ≥ p_end, updates the running max m and sum l, rescales the accumulator o, and
// returns P as the A fragment of P·V (k = positions: n-tile 0 → k 0..7, n-tile 1 → k 8..15).
template <int HD>
__device__ __forceinline__ void da_softmax(float (&s)[2][2], int pw, int tig, int p_end, float sl2, float& m, float& l,
                                           float (&o)[HD / 8][2], u32& pa0, u32& pa2) {
    float mx = DA_NEG_INF;
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int p = pw + 8 * j + 2 * tig + e;
            s[j][e] = p < p_end ? s[j][e] * sl2 : DA_NEG_INF;
            mx = fmaxf(mx, s[j][e]);
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m, mx);  // finite: position pw is valid
    const float corr = exp2f(m - mn);
    m = mn;
    float ps = 0.f;
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            s[j][e] = exp2f(s[j][e] - mn);
            ps += s[j][e];
        }
    l = l * corr + ps;
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
        o[n][0] *= corr;
        o[n][1] *= corr;
    }
    pa0 = da_pack_mma(s[0][0], s[0][1]);
    pa2 = da_pack_mma(s[1][0], s[1][1]);
}

// Programmatic dependent launch (Hopper): waits until the previous grid has completed and its
// writes are visible. A no-op for a kernel launched without the attribute.
__device__ __forceinline__ void da_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// *p += v at device scope with acquire-release semantics; returns the old value.
__device__ __forceinline__ u32 da_atom_add_acq_rel(u32* p, u32 v) {
    u32 old;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
#else
    __threadfence();
    old = atomicAdd(p, v);
    __threadfence();
#endif
    return old;
}

// L2 prefetch of the K and V rows of positions p_begin .. min(p_end, p_begin + DA_STAGES tiles)
// (the tiles the copy pipeline issues first), one 128-byte line per thread and step.
template <int HD>
__device__ __forceinline__ void da_prefetch_tiles(const u32* bt, const kvt* kbase, const kvt* vbase, u64 kvd, int bs,
                                                  int p_begin, int p_end, int tid) {
    constexpr int ROW = HD * (int)sizeof(kvt);      // bytes of one K (or V) row of a head
    constexpr int LPR = ROW >= 128 ? ROW / 128 : 1;  // lines per row
    const int n = min(p_end - p_begin, DA_STAGES * DA_TILE);
    for (int i = tid; i < n * 2 * LPR; i += DA_THREADS) {
        const int p = p_begin + i / (2 * LPR);
        const int kv = (i / LPR) & 1, line = i % LPR;
        const u64 slot = (u64)(bt[p / bs] * (u32)bs + (u32)(p % bs));
        const char* a = reinterpret_cast<const char*>((kv ? vbase : kbase) + slot * kvd) + line * 128;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
    }
}

// DA_TRACE (benchmarks): thread 0 of every CTA that has a split stamps %globaltimer (ns) at
// entry [2], once pos is read [3], when its first K/V tile is in shared memory [4], after its
// tiles are computed [5], after its split's output or partial is written [6], after the split
// counter [7] and at exit [8], and appends one record of DA_TRACE_WORDS u64 to da_trace:
// [0] z | g << 8 | t << 16 | nsplits << 32 | last << 40,
// [1] SM id, then the stamps. da_trace_n counts the records.
#ifdef DA_TRACE
#define DA_TRACE_WORDS 9
#define DA_TRACE_CAP 65536
__device__ u64 da_trace[DA_TRACE_CAP * DA_TRACE_WORDS];
__device__ u32 da_trace_n;
__shared__ u64 da_tr[DA_TRACE_WORDS];
__device__ __forceinline__ void da_stamp(int i) {
    if (threadIdx.x == 0) {
        u64 t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        da_tr[i] = t;
    }
}
__device__ __forceinline__ void da_trace_end(u64 head) {
    da_stamp(8);
    if (threadIdx.x == 0) {
        const u32 i = atomicAdd(&da_trace_n, 1u);
        if (i < DA_TRACE_CAP) {
            u32 smid;
            asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
            u64* r = da_trace + (u64)i * DA_TRACE_WORDS;
            r[0] = head;
            r[1] = smid;
            for (int k = 2; k < DA_TRACE_WORDS; k++) r[k] = da_tr[k];
        }
    }
}
#define DA_STAMP(i) da_stamp(i)
#define DA_TRACE_END(last) \
    da_trace_end((u64)z0 | ((u64)g << 8) | ((u64)t << 16) | ((u64)nsplits << 32) | ((u64)(last) << 40))
#else
#define DA_STAMP(i)
#define DA_TRACE_END(last)
#endif

// part_o: f32 [T·kvh, DA_MAX_SPLITS, G, HD]; part_ml: f32 [T·kvh, DA_MAX_SPLITS, G, 2] (max in
// log2 units, sum); cnt: u32 [T·kvh], zero between launches.
// Dynamic shared memory: 2 stages · (K + V tile) = 4 · DA_TILE · HD · 2 bytes (128 KiB at HD 256:
// one block per SM; KV_FP8: DA_STAGES · (K + V e4m3 tile) = 8 · DA_TILE · HD bytes).
template <int HD, int G>
__device__ __forceinline__ void attn_decode_impl(bf16* __restrict__ out, float* __restrict__ part_o,
                                                 float* __restrict__ part_ml, u32* __restrict__ cnt,
                                                 const bf16* __restrict__ qkv, const kvt* __restrict__ kc,
                                                 const kvt* __restrict__ vc, const u32* __restrict__ pos,
                                                 const u32* __restrict__ tok_bt, const u32* __restrict__ bts, int qh,
                                                 int kvh, int bs, float scale, int cap, int early) {
    static_assert(HD == 64 || HD == 128 || HD == 256, "head_dim 64, 128 or 256");
    static_assert(G >= 1 && G <= 8, "1..8 query heads per KV head");
#ifdef KV_FP8
    constexpr int CPR8 = HD / 16;            // 16-byte chunks per e4m3 K/V row
    constexpr int RPP8 = DA_THREADS / CPR8;  // rows per pass of the copy loop
    constexpr int TILE8 = DA_TILE * HD;      // one e4m3 K (or V) tile, bytes
#else
    constexpr int CPR = HD / 8;                  // 16-byte chunks per K/V row
    constexpr int RPP = DA_THREADS / CPR;        // rows per pass of the copy loop
    constexpr int TILE_BYTES = DA_TILE * HD * 2; // one K (or V) tile
#endif
    constexpr int OSTRIDE = HD + 8;              // f32 row stride of the warp-merge buffer
    extern __shared__ __align__(128) unsigned char da_smem[];
    __shared__ float s_m[DA_WARPS][8], s_l[DA_WARPS][8];
    __shared__ float s_w[DA_MAX_SPLITS][8], s_lz[DA_MAX_SPLITS][8], s_den[8];
    __shared__ int s_last;

    const int z0 = blockIdx.x, g = blockIdx.y, t = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int gid = lane >> 2, tig = lane & 3;  // mma groupID (query head row) and thread in group
    cap = min(max(cap, 1), DA_MAX_SPLITS);
#ifdef DA_TRACE
    if (tid == 0)
        for (int k = 2; k < DA_TRACE_WORDS; k++) da_tr[k] = 0;
#endif
    DA_STAMP(2);
    const u32 bt_off = tok_bt[t];  // loaded with pos: they do not depend on each other
    const int L = (int)pos[t] + 1;
    int chunk, nsplits;
    da_split(L, cap, chunk, nsplits);
    if (z0 >= nsplits) return;
    DA_STAMP(3);

    const u64 kvd = (u64)kvh * HD;
    const u32* bt = bts + bt_off;
    const kvt* kbase = kc + (u64)g * HD;
    const kvt* vbase = vc + (u64)g * HD;
    const float sl2 = scale * DA_LOG2E;
    if (early) {
        // Launched with programmatic dependent launch behind the QKV GEMV: the step metadata
        // (copied from the host before the step) and the block table are read now, and the K/V
        // lines of this block's first tiles are prefetched into L2, while the GEMV still runs.
        // L2 is coherent for the whole device, so a line the GEMV writes afterwards (this
        // step's position) is read fresh by the copies below; nothing is read into registers
        // or shared memory before the wait.
        // early 1: the wait only (benchmarks).
        if (early > 1) da_prefetch_tiles<HD>(bt, kbase, vbase, kvd, bs, z0 * chunk, min(L, z0 * chunk + chunk), tid);
        da_pdl_wait();
    }

    // Q as mma A fragments (rows = query heads of the group, zero past G): for k-step ks,
    // qa[ks][0] holds head gid, dims 16ks + 2tig + {0,1}; qa[ks][1] dims 16ks + 8 + 2tig + {0,1}
    // (KV_FP8: dims tig·HD/4 + 4ks + {0,1} and + {2,3}, as f16; see the file header).
    u32 qa[HD / 16][2];
    {
        const bf16* qrow = qkv + (u64)t * (u64)(qh + 2 * kvh) * HD + (u64)(g * G + gid) * HD;
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) {
#ifdef KV_FP8
            const bf16* q4 = qrow + tig * (HD / 4) + 4 * ks;
            qa[ks][0] = gid < G ? da_bf2_to_h2(*reinterpret_cast<const u32*>(q4)) : 0u;
            qa[ks][1] = gid < G ? da_bf2_to_h2(*reinterpret_cast<const u32*>(q4 + 2)) : 0u;
#else
            qa[ks][0] = gid < G ? *reinterpret_cast<const u32*>(qrow + ks * 16 + 2 * tig) : 0u;
            qa[ks][1] = gid < G ? *reinterpret_cast<const u32*>(qrow + ks * 16 + 8 + 2 * tig) : 0u;
#endif
        }
    }

    const u32 sbase = da_smem_addr(da_smem);
    float* s_o = reinterpret_cast<float*>(da_smem);  // [DA_WARPS][8][OSTRIDE], after the tiles
    const u64 tk = (u64)t * kvh + g;
#ifdef KV_FP8
    // Copy-loop coordinates (r & 7 and (r >> 1) & 3 are the same for all rows of a thread) and
    // the fragment-load offsets: K rows w·16 + 8j + gid, chunks of dims tig·HD/4 ..; V rows
    // w·16 + 2tig + {0, 1, 8, 9}, bytes gid·HD/8 .. (see the file header).
    const int cp_row = tid / CPR8, cp_col = (tid % CPR8) * 16;
    const int bs_shift = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1;  // block size as a shift
    const u32 cp_off = da8_off<HD>(cp_row, tid % CPR8);
    u32 k_off[2][HD / 64];
#pragma unroll
    for (int j = 0; j < 2; j++)
#pragma unroll
        for (int c = 0; c < HD / 64; c++) k_off[j][c] = da8_off<HD>(w * 16 + 8 * j + gid, tig * (HD / 64) + c);
    u32 v_off[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int row = w * 16 + 2 * tig + (r & 1) + 8 * (r >> 1);
        v_off[r] = HD == 128 ? da8_off<HD>(row, gid) : da8_off<HD>(row, gid >> 1) + 8 * (gid & 1);
    }
#else
    // Copy-loop coordinates and the ldmatrix row offsets (swizzle: see da_tile_off; the chunk
    // index of k-step ks is XORed in as ks << 5 since 2ks and the low bit are disjoint).
    const int cp_row = tid / CPR, cp_col = (tid % CPR) * 8;
    const int mi = lane >> 3;
    const int krow = w * 16 + ((mi >> 1) << 3) + (lane & 7);
    const int vrow = w * 16 + ((mi & 1) << 3) + (lane & 7);
    const u32 k_off = da_tile_off<HD>(krow, mi & 1);
    const u32 v_off = da_tile_off<HD>(vrow, mi >> 1);
#endif

    for (int z = z0; z < nsplits; z += gridDim.x) {
        const int p_begin = z * chunk;
        const int p_end = min(L, p_begin + chunk);
        const int n_tiles = (p_end - p_begin + DA_TILE - 1) / DA_TILE;

        float m = DA_NEG_INF;  // running max of head row gid (log2 units), same in the 4 lanes
        float l = 0.f;         // this lane's part of the running sum
        float o[HD / 8][2];    // head gid, dims 8n + 2tig + {0,1} (KV_FP8: (2tig + {0,1})·HD/8 + n)
#pragma unroll
        for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = 0.f;

#ifdef KV_FP8
        // Copies positions tile0 .. tile0 + DA_TILE of K and V into stage `st` (zeros past
        // p_end). Thread: chunk tid % CPR8 of rows tid / CPR8 + j·RPP8.
        auto issue = [&](int tile0, int st) {
            const u32 dst = sbase + (u32)(st * 2 * TILE8) + cp_off;
#pragma unroll
            for (int j = 0; j < DA_TILE / RPP8; j++) {
                const int p = tile0 + cp_row + j * RPP8;
                const bool ok = p < p_end;
                u64 slot = 0;
                if (ok) {
                    const u32 up = (u32)p;
                    slot = bs_shift >= 0 ? (u64)((bt[up >> bs_shift] << bs_shift) + (up & (u32)(bs - 1)))
                                         : (u64)(bt[up / (u32)bs] * (u32)bs + up % (u32)bs);
                }
                const u64 src = slot * kvd + cp_col;
                const u32 d = dst + (u32)(j * RPP8 * HD);
                da_cp16(d, kbase + src, ok ? 16 : 0);
                da_cp16(d + TILE8, vbase + src, ok ? 16 : 0);
            }
        };

        // DA_STAGES-deep pipeline, one commit group per tile (empty past the split): tile i is
        // complete once at most DA_STAGES − 2 younger groups are pending; the stage refilled
        // after the barrier is the one computed in iteration i − 1, which every warp has left.
#pragma unroll
        for (int i = 0; i < DA_STAGES - 1; i++) {
            if (i < n_tiles) issue(p_begin + i * DA_TILE, i);
            da_cp_commit();
        }
        int st = 0;  // stage of tile i
        for (int i = 0; i < n_tiles; i++) {
            da_cp_wait<DA_STAGES - 2>();
            __syncthreads();
            if (i == 0 && z == z0) DA_STAMP(4);
            {
                const int nx = i + DA_STAGES - 1;
                if (nx < n_tiles) issue(p_begin + nx * DA_TILE, st == 0 ? DA_STAGES - 1 : st - 1);
                da_cp_commit();
            }
            const int pw = p_begin + i * DA_TILE + w * 16;  // this warp's first position
            if (pw < p_end) {
                const u32 sk = sbase + (u32)(st * 2 * TILE8);
                const u32 sv = sk + TILE8;
                // S = Q · Kᵀ: n-tile j covers positions pw + 8j .. +7; word ks of kw[j] holds
                // the 4 codes of k-step ks (low half: register 0, high half: register 1).
                u32 kw[2][HD / 16];
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int c = 0; c < HD / 64; c++) {
                        const uint4 v = da_lds128(sk + k_off[j][c]);
                        kw[j][4 * c] = v.x;
                        kw[j][4 * c + 1] = v.y;
                        kw[j][4 * c + 2] = v.z;
                        kw[j][4 * c + 3] = v.w;
                    }
                float s[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
                for (int ks = 0; ks < HD / 16; ks++) {
#pragma unroll
                    for (int j = 0; j < 2; j++)
                        da_mma_top(s[j][0], s[j][1], qa[ks][0], qa[ks][1], da_e4m3x2(kw[j][ks]),
                                   da_e4m3x2(kw[j][ks] >> 16));
                }
                u32 pa0, pa2;
                da_softmax<HD>(s, pw, tig, p_end, sl2, m, l, o, pa0, pa2);
                // O += P · V: vw[r][i] holds dims gid·HD/8 + 4i .. + 3 of row 2tig + (r & 1) +
                // 8·(r >> 1); the two rows of a register pair byte by byte (prmt), two dims per
                // word, n-tile nd = dim offset within the lane's HD/8.
                constexpr int VW = HD / 32;  // words per row and lane
                u32 vw[4][VW];
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    if constexpr (VW == 4) {
                        const uint4 v = da_lds128(sv + v_off[r]);
                        vw[r][0] = v.x;
                        vw[r][1] = v.y;
                        vw[r][2] = v.z;
                        vw[r][3] = v.w;
                    } else {
                        const uint2 v = da_lds64(sv + v_off[r]);
                        vw[r][0] = v.x;
                        vw[r][1] = v.y;
                    }
                }
#pragma unroll
                for (int i4 = 0; i4 < VW; i4++) {
                    const u32 lo0 = __byte_perm(vw[0][i4], vw[1][i4], 0x5140);  // dims 4i4, 4i4+1
                    const u32 hi0 = __byte_perm(vw[0][i4], vw[1][i4], 0x7362);  // dims 4i4+2, 4i4+3
                    const u32 lo1 = __byte_perm(vw[2][i4], vw[3][i4], 0x5140);
                    const u32 hi1 = __byte_perm(vw[2][i4], vw[3][i4], 0x7362);
                    da_mma_top(o[4 * i4][0], o[4 * i4][1], pa0, pa2, da_e4m3x2(lo0), da_e4m3x2(lo1));
                    da_mma_top(o[4 * i4 + 1][0], o[4 * i4 + 1][1], pa0, pa2, da_e4m3x2(lo0 >> 16), da_e4m3x2(lo1 >> 16));
                    da_mma_top(o[4 * i4 + 2][0], o[4 * i4 + 2][1], pa0, pa2, da_e4m3x2(hi0), da_e4m3x2(hi1));
                    da_mma_top(o[4 * i4 + 3][0], o[4 * i4 + 3][1], pa0, pa2, da_e4m3x2(hi0 >> 16), da_e4m3x2(hi1 >> 16));
                }
            }
            st = st + 1 == DA_STAGES ? 0 : st + 1;
        }
        __syncthreads();  // every warp is past its tiles before the merge reuses shared memory
#else
        // Copies positions tile0 .. tile0 + DA_TILE of K and V into stage `st` (zeros past
        // p_end). Thread: chunk tid % CPR of rows tid / CPR + j·RPP (each row swizzled by its own
        // r % 8: with RPP = 4 at HD 256, r % 8 alternates between passes).
        auto issue = [&](int tile0, int st) {
            const u32 dst = sbase + (u32)(st * 2 * TILE_BYTES);
#pragma unroll
            for (int j = 0; j < DA_TILE / RPP; j++) {
                const int p = tile0 + cp_row + j * RPP;
                const bool ok = p < p_end;
                const u64 slot = ok ? (u64)(bt[p / bs] * (u32)bs + (u32)(p % bs)) : 0ull;
                const u64 src = slot * kvd + cp_col;
                const u32 d = dst + da_tile_off<HD>(cp_row + j * RPP, tid % CPR);
                da_cp16(d, kbase + src, ok ? 16 : 0);
                da_cp16(d + TILE_BYTES, vbase + src, ok ? 16 : 0);
            }
            da_cp_commit();
        };

        issue(p_begin, 0);
        for (int i = 0; i < n_tiles; i++) {
            const int tile0 = p_begin + i * DA_TILE;
            const int st = i & 1;
            if (i + 1 < n_tiles) {
                issue(tile0 + DA_TILE, (i + 1) & 1);
                da_cp_wait<1>();
            } else {
                da_cp_wait<0>();
            }
            __syncthreads();
            if (i == 0 && z == z0) DA_STAMP(4);
            const int pw = tile0 + w * 16;  // this warp's first position
            if (pw < p_end) {
                const u32 sk = sbase + (u32)(st * 2 * TILE_BYTES);
                const u32 sv = sk + TILE_BYTES;
                // S = Q · Kᵀ: n-tile j covers positions pw + 8j .. +7.
                float s[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
                for (int ks = 0; ks < HD / 16; ks++) {
                    u32 b0, b1, b2, b3;
                    da_ldsm4(sk + (k_off ^ (u32)(ks << 5)), b0, b1, b2, b3);
                    da_mma_top(s[0][0], s[0][1], qa[ks][0], qa[ks][1], b0, b1);
                    da_mma_top(s[1][0], s[1][1], qa[ks][0], qa[ks][1], b2, b3);
                }
                u32 pa0, pa2;
                da_softmax<HD>(s, pw, tig, p_end, sl2, m, l, o, pa0, pa2);
#pragma unroll
                for (int nd = 0; nd < HD / 16; nd++) {
                    u32 b0, b1, b2, b3;
                    da_ldsm4_t(sv + (v_off ^ (u32)(nd << 5)), b0, b1, b2, b3);
                    da_mma_top(o[2 * nd][0], o[2 * nd][1], pa0, pa2, b0, b1);
                    da_mma_top(o[2 * nd + 1][0], o[2 * nd + 1][1], pa0, pa2, b2, b3);
                }
            }
            __syncthreads();  // stage st is refilled by the next iteration's issue
        }
#endif

        DA_STAMP(5);
        // Merge the warps in warp order (shared memory reused: every warp is past its tiles).
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (gid < G) {
            float* row = s_o + (w * 8 + gid) * OSTRIDE;
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
#ifdef KV_FP8
                row[2 * tig * (HD / 8) + n] = o[n][0];
                row[(2 * tig + 1) * (HD / 8) + n] = o[n][1];
#else
                *reinterpret_cast<float2*>(row + 8 * n + 2 * tig) = make_float2(o[n][0], o[n][1]);
#endif
            }
            if (tig == 0) {
                s_m[w][gid] = m;
                s_l[w][gid] = l;
            }
        }
        __syncthreads();
        for (int idx = tid; idx < G * HD; idx += DA_THREADS) {
            const int gi = idx / HD, d = idx % HD;
            float M = DA_NEG_INF;
#pragma unroll
            for (int ww = 0; ww < DA_WARPS; ww++) M = fmaxf(M, s_m[ww][gi]);
            float den = 0.f, num = 0.f;
#pragma unroll
            for (int ww = 0; ww < DA_WARPS; ww++) {
                const float f = s_l[ww][gi] > 0.f ? exp2f(s_m[ww][gi] - M) : 0.f;
                den += s_l[ww][gi] * f;
                num += s_o[(ww * 8 + gi) * OSTRIDE + d] * f;
            }
            if (nsplits == 1) {
                out[(u64)t * qh * HD + (u64)(g * G + gi) * HD + d] = __float2bfloat16_rn(num / den);
            } else {
                const u64 row = (tk * DA_MAX_SPLITS + z) * G + gi;
                part_o[row * HD + d] = num;
                if (d == 0) {
                    part_ml[row * 2] = M;
                    part_ml[row * 2 + 1] = den;
                }
            }
        }
        __syncthreads();  // shared memory is reused by the next split of this CTA
        DA_STAMP(6);
    }
    if (nsplits == 1) {
        DA_TRACE_END(1);
        return;
    }

    // The CTA that finishes last for (t, g) folds the splits: every thread's partials are ordered
    // before thread 0's counter increment by the barrier, and the increment is a release (for
    // them) and an acquire (for the other CTAs' partials, which the last CTA then reads through
    // L2) at device scope, so no separate fences.
    __syncthreads();
    if (tid == 0) {
        const u32 participants = (u32)min(nsplits, (int)gridDim.x);
        const u32 prev = da_atom_add_acq_rel(cnt + tk, 1u);
        const int last = prev + 1 == participants;
        if (last) atomicExch(cnt + tk, 0u);  // ready for the next launch or graph replay
        s_last = last;
    }
    __syncthreads();
    DA_STAMP(7);
    if (!s_last) {
        DA_TRACE_END(0);
        return;
    }
    // Each thread folds 4 consecutive dims of one head over the splits in split order. The
    // partials of its first 4 dims are loaded before the split weights are computed, so both
    // round trips to L2 overlap.
    const float* src0 = part_o + tk * DA_MAX_SPLITS * G * HD;
    auto load_acc = [&](int e, float4 (&v)[DA_MAX_SPLITS]) {
        const int gi = e / (HD / 4), d = (e % (HD / 4)) * 4;
#pragma unroll
        for (int z = 0; z < DA_MAX_SPLITS; z++)
            v[z] = z < nsplits ? __ldcg(reinterpret_cast<const float4*>(src0 + ((u64)z * G + gi) * HD + d))
                               : make_float4(0.f, 0.f, 0.f, 0.f);
    };
    float4 v[DA_MAX_SPLITS];
    if (tid < G * HD / 4) load_acc(tid, v);
    // Split weights 2^(m_z − M) per head (all (m, l) loaded at once: nsplits · G ≤ 128).
    if (tid < nsplits * G) {
        const u64 row = tk * DA_MAX_SPLITS * G + tid;  // split tid / G, head tid % G
        s_w[tid / G][tid % G] = __ldcg(part_ml + row * 2);
        s_lz[tid / G][tid % G] = __ldcg(part_ml + row * 2 + 1);
    }
    __syncthreads();
    if (tid < G) {
        float M = DA_NEG_INF;
        for (int z = 0; z < nsplits; z++) M = fmaxf(M, s_w[z][tid]);
        float den = 0.f;
        for (int z = 0; z < nsplits; z++) {
            const float f = exp2f(s_w[z][tid] - M);
            s_w[z][tid] = f;
            den += s_lz[z][tid] * f;
        }
        s_den[tid] = den;
    }
    __syncthreads();
    for (int e = tid; e < G * HD / 4; e += DA_THREADS) {
        const int gi = e / (HD / 4), d = (e % (HD / 4)) * 4;
        if (e != tid) load_acc(e, v);
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
        for (int z = 0; z < DA_MAX_SPLITS; z++) {
            const float f = z < nsplits ? s_w[z][gi] : 0.f;
            a0 += v[z].x * f;
            a1 += v[z].y * f;
            a2 += v[z].z * f;
            a3 += v[z].w * f;
        }
        const float inv = 1.f / s_den[gi];
        bf16* o4 = out + (u64)t * qh * HD + (u64)(g * G + gi) * HD + d;
        *reinterpret_cast<uint2*>(o4) = make_uint2(da_pack_out(a0 * inv, a1 * inv), da_pack_out(a2 * inv, a3 * inv));
    }
    __syncthreads();
    DA_TRACE_END(1);
}

// DA_EARLY_DEPENDENTS: each block lets the next kernel's blocks launch at once (Hopper's
// griddepcontrol.launch_dependents): a decode GEMV launched with programmatic dependent launch
// then becomes resident beside this kernel's blocks and waits (griddepcontrol.wait) for the
// whole grid before it reads the output. A no-op for kernels launched without the attribute.
__device__ __forceinline__ void da_early_dependents() {
#if defined(DA_EARLY_DEPENDENTS) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Kernels attn_decode_hd{HD}_g{G}. Defining DA_HD and DA_G (NVRTC -D options) compiles only that
// one, which keeps the run-time compile short; otherwise all eleven are compiled
// (head_dim 256 with 1, 2 or 4 query heads per KV head, as the split-KV kernel of llama.cu).
#define DA_KERNEL_(HD, G)                                                                                           \
    extern "C" __global__ void __launch_bounds__(DA_THREADS, DA_MIN_BLOCKS) attn_decode_hd##HD##_g##G(                          \
        bf16* out, float* part_o, float* part_ml, u32* cnt, const bf16* qkv, const kvt* kc, const kvt* vc,          \
        const u32* pos, const u32* tok_bt, const u32* bts, int qh, int kvh, int bs, float scale, int cap,           \
        int early) {                                                                                                \
        da_early_dependents();                                                                                      \
        attn_decode_impl<HD, G>(out, part_o, part_ml, cnt, qkv, kc, vc, pos, tok_bt, bts, qh, kvh, bs, scale, cap, \
                                early);                                                                             \
    }
#define DA_KERNEL(HD, G) DA_KERNEL_(HD, G)

#if defined(DA_HD) && defined(DA_G)
DA_KERNEL(DA_HD, DA_G)
#else
DA_KERNEL(64, 1)
DA_KERNEL(64, 2)
DA_KERNEL(64, 4)
DA_KERNEL(64, 8)
DA_KERNEL(128, 1)
DA_KERNEL(128, 2)
DA_KERNEL(128, 4)
DA_KERNEL(128, 8)
DA_KERNEL(256, 1)
DA_KERNEL(256, 2)
DA_KERNEL(256, 4)
#endif

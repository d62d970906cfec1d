/* Device helpers of the HSTU kernels: tensor-core MMA (mma.sync m16n8k16, fp32 accumulate), ldmatrix,
 * cp.async tile loads, and the per-sequence setup shared by the forward and backward kernels.
 *
 * Fragment layouts (PTX ISA, m16n8k16, 16-bit inputs), with g = lane / 4, t = lane % 4:
 *   A (16x16, row-major) a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
 *   B (16x8, k x n)      b0: (k 2t..2t+1, n g)  b1: (k 2t+8.., n g)
 *   C (16x8, fp32)       c0,c1: (g, 2t..2t+1)  c2,c3: (g+8, 2t..2t+1)
 * so a C fragment pair of 16 columns packs straight into an A fragment (the P @ V trick of FA2). */
#ifndef TF_HSTU_MMA_CUH
#define TF_HSTU_MMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "hstu_kernels.h"
#include "tf_cp_async.cuh"

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* The forward grid: one block per (query tile of bm rows, sequence, head); err is
 * cudaErrorInvalidConfiguration past the grid's limit, blocks 0 when there is nothing to do. */
struct HstuFwdGrid {
    int q_tiles;
    int64_t blocks;
    cudaError_t err;
};
static inline HstuFwdGrid hstu_fwd_grid(const tf_hstu_params &p, int bm) {
    const int64_t nq = p.delta > 0 ? p.delta : p.max_seq_len;
    HstuFwdGrid g;
    g.q_tiles = (int)((nq + bm - 1) / bm);
    g.blocks = (int64_t)g.q_tiles * p.B * p.H;
    g.err = g.blocks > 0x7fffffff ? cudaErrorInvalidConfiguration : cudaSuccess;
    return g;
}

/* Runs f(std::integral_constant<int, D>) with D the head-dim template (64, 128, 256) that covers
 * max(Dqk, Dv): the one place the launchers map a run-time head dim to their instantiations. */
template <typename F>
auto hstu_with_head_dim(const tf_hstu_params &p, F &&f) {
    const int64_t d = p.dqk > p.dv ? p.dqk : p.dv;
    if (d <= 64) return f(std::integral_constant<int, 64>{});
    if (d <= 128) return f(std::integral_constant<int, 128>{});
    return f(std::integral_constant<int, 256>{});
}

/* The sm_90a backward's key tile at head dim D (64, 128 or 256): 128 keys up to 128, 64 past it (the
 * consumers split dK and dV's columns there). The two-part backward stores dZ tiles of this many keys
 * and hstu_bwd_dq_sm90.cu reads them with the same count. */
constexpr int hstu_sm90_key_tile(int D) { return D > 128 ? 64 : 128; }

/* f(std::integral_constant<int, D>{}) for the head dim the two-part sm_90a backward runs (dZ stored,
 * then dQ = dZ K; head dims 65-256): 128, or 256 past 128. */
template <typename F>
auto hstu_two_part_head_dim(const tf_hstu_params &p, F &&f) {
    const int64_t d = p.dqk > p.dv ? p.dqk : p.dv;
    if (d <= 128) return f(std::integral_constant<int, 128>{});
    return f(std::integral_constant<int, 256>{});
}

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}


template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* One 16-byte chunk of an accumulator row for a vector store. In the m16n8 / wgmma accumulator layout a
 * quad (lanes t4 = 0..3 of a row group) holds columns 8 j .. 8 j + 7 of its rows, two per thread:
 * acc[4 j + 2 hh], acc[4 j + 2 hh + 1] for the row of half hh. A 4 x 4 transpose over j = 4 m .. 4 m + 3
 * (thread = row, j = column) gives lane t4 all eight columns of chunk j = 4 m + t4, packed to 16 bits: two
 * butterfly stages, 4 shuffles and ~12 selects (lane-indexed rounds took 28 selects). Every lane of the
 * warp must call it (shuffles). */
template <typename T, int N>
__device__ __forceinline__ uint4 quad_chunk(const float (&acc)[N], int hh, int m) {
    const int t4 = threadIdx.x % 4;
    const bool odd = t4 & 1, hi = t4 & 2;
    uint32_t u[4];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) u[jj] = pack2<T>(acc[4 * (4 * m + jj) + 2 * hh], acc[4 * (4 * m + jj) + 2 * hh + 1]);
    // stage 1 (lanes t4, t4 ^ 1): each keeps the columns of its parity, c = t4 & 1 and c + 2, for both rows
    const uint32_t r0 = __shfl_xor_sync(0xffffffffu, odd ? u[0] : u[1], 1);
    const uint32_t r1 = __shfl_xor_sync(0xffffffffu, odd ? u[2] : u[3], 1);
    const uint32_t c_even = odd ? r0 : u[0], c_odd = odd ? u[1] : r0;        // column c, rows 2k, 2k + 1
    const uint32_t c2_even = odd ? r1 : u[2], c2_odd = odd ? u[3] : r1;      // column c + 2, the same rows
    // stage 2 (lanes t4, t4 ^ 2): the low pair keeps column c and takes its rows 2, 3; the high pair keeps
    // column c + 2 and takes its rows 0, 1
    const uint32_t y0 = __shfl_xor_sync(0xffffffffu, hi ? c_even : c2_even, 2);
    const uint32_t y1 = __shfl_xor_sync(0xffffffffu, hi ? c_odd : c2_odd, 2);
    return hi ? make_uint4(y0, y1, c2_even, c2_odd) : make_uint4(c_even, c_odd, y0, y1);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* four 8 x 8 16-bit matrices (mma.sync fragment layout) -> shared memory: lane 8 m + i gives the address of
 * row i of matrix m */
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}
/* A warpgroup's wgmma accumulator (64 rows x N columns, fp32, acc[4 j + 2 hh + e] at row 16 warp + g + 8 hh,
 * column 8 j + 2 t4 + e) -> 16 bits in 128-byte-swizzled panels at dst (panel c: columns 64 c.., 64 rows of
 * 128 bytes, 16-byte chunk k of row r at chunk k ^ (r % 8); panels panel_bytes apart, dst 1024-aligned), the
 * layout a TMA store with CU_TENSOR_MAP_SWIZZLE_128B reads. Step q stores the 8 x 8 blocks (rows 8 (m & 1),
 * columns 8 (2 q + (m >> 1))) of this warp's 16 rows: accumulator chunks 4 j + 2 hh, j = 2 q + (m >> 1). */
template <typename T, int N>
__device__ __forceinline__ void stage_acc(const float (&acc)[N / 2], uint32_t dst, uint32_t panel_bytes) {
    const int lane = threadIdx.x % 32, m = lane / 8, i = lane % 8;
    const int r = 16 * ((threadIdx.x / 32) % 4) + 8 * (m & 1) + i;
#pragma unroll
    for (int q = 0; q < N / 16; ++q) {
        const uint32_t f[4] = {pack2<T>(acc[8 * q], acc[8 * q + 1]), pack2<T>(acc[8 * q + 2], acc[8 * q + 3]),
                               pack2<T>(acc[8 * q + 4], acc[8 * q + 5]), pack2<T>(acc[8 * q + 6], acc[8 * q + 7])};
        const int jj = 2 * q + (m >> 1);  // this lane's row's 16-byte chunk (column 8 jj)
        stmatrix_x4(dst + (jj / 8) * panel_bytes + r * 128 + (((jj % 8) ^ (r % 8)) * 16), f);
    }
}
#endif

__device__ __forceinline__ float tf_bias_load(const void *b, int dt, int64_t i) {
    if (dt == TF_F32) return ((const float *)b)[i];
    if (dt == TF_BF16) return __bfloat162float(((const __nv_bfloat16 *)b)[i]);
    return __half2float(((const __half *)b)[i]);
}

__device__ __forceinline__ int64_t tf_idx_load(const void *base, int i64, int64_t i) {
    return i64 ? ((const int64_t *)base)[i] : (int64_t)((const int32_t *)base)[i];
}

/* One sequence as a kernel sees it: k/v rows [start, start + n), query rows [q_start, q_start + nq) at
 * positions n - nq .. n - 1, and its mask. */
struct HstuSeq {
    int64_t start, q_start;
    int n, nq;
    tf_hstu_mask mask;
};

__device__ __forceinline__ HstuSeq hstu_seq(const tf_hstu_params &p, int64_t b) {
    HstuSeq s;
    /* Unvalidated metadata (validate=False) may be anything: the sequence is clamped into k's rows
     * [0, L), to at most max_seq_len (attn_bias's extent and the grids' size) and its targets to
     * [0, n], so that no access leaves a tensor. Validated metadata is unchanged by it. */
    const int64_t a = tf_idx_load(p.offsets, p.offsets_i64, b), e = tf_idx_load(p.offsets, p.offsets_i64, b + 1);
    s.start = a < 0 ? 0 : (a > p.L ? p.L : a);
    int64_t n = (e < s.start ? s.start : (e > p.L ? p.L : e)) - s.start;
    if (p.kv_lengths) {  // a cache with room past each sequence: its first kv_lengths[b] rows
        const int64_t kl = tf_idx_load(p.kv_lengths, p.kv_lengths_i64, b);
        n = kl < 0 ? 0 : (kl < n ? kl : n);
    }
    s.n = (int)(n < p.max_seq_len ? n : p.max_seq_len);
    s.q_start = p.delta > 0 ? b * p.delta : s.start;
    s.nq = p.delta > 0 ? (int)p.delta : s.n;
    const int64_t t = p.num_targets ? tf_idx_load(p.num_targets, p.targets_i64, b) : 0;
    s.mask = tf_hstu_mask_make(s.n, (int)(t < 0 ? 0 : (t > s.n ? s.n : t)), p.contextual, p.max_attn_len,
                               p.min_full, p.group);
    return s;
}

/* The query tiles (of QT rows) that see keys [k0, k1) of a sequence: context tiles [0, nctx), then the
 * causal (or windowed) range [lo_t, hi_t] (empty when hi_t < lo_t). The sm_90a backward visits a key
 * tile's query tiles by it, and its two-part dQ kernel finds by it the dZ tiles that backward stored:
 * one definition, so the two cannot disagree. */
struct HstuQueryTiles {
    int nctx, lo_t, hi_t;
};
template <int QT>
__device__ __forceinline__ HstuQueryTiles hstu_query_tiles(const tf_hstu_mask &m, int k0, int k1) {
    int ctx_end, lo, hi;
    tf_hstu_row_range(&m, k0, k1, &ctx_end, &lo, &hi);
    HstuQueryTiles r;
    r.lo_t = lo / QT;
    r.hi_t = hi / QT;
    r.nctx = min((ctx_end + QT - 1) / QT, r.lo_t);
    return r;
}

/* Zeroes rows [r0, ROWS) of a tile of D / 64 panels of 64 16-bit columns (128-byte rows) in shared
 * memory, by one warpgroup. TMA reads whole tiles, so rows past a sequence's end hold the next
 * sequence's rows: masked elements are 0, but 0 x inf is not. The caller fences (fence_proxy_async) and
 * synchronizes before the wgmmas read it. */
template <int D, int ROWS>
__device__ __forceinline__ void zero_rows(uint8_t *tile, int r0) {
    const int chunks = (ROWS - r0) * 8;  // 16-byte chunks per panel
    for (int i = threadIdx.x % 128; i < chunks * (D / 64); i += 128) {
        const int c = i / chunks, x = i % chunks;
        *(uint4 *)(tile + c * ROWS * 128 + (r0 + x / 8) * 128 + (x % 8) * 16) = make_uint4(0, 0, 0, 0);
    }
}

/* Loads a tile of a (rows, H, d) tensor's head h into smem (ROWS x LDS elements): tile row r comes
 * from global row base + r when r_lo <= r < nrows, columns below d; everything else is zero. */
template <int ROWS, int D, int LDS, int NT>
__device__ __forceinline__ void load_tile(uint16_t *smem, const void *g, int64_t sr, int64_t sh, int64_t base,
                                          int r_lo, int nrows, int h, int d) {
    constexpr int CH = D / 8;  // 16-byte chunks per row
    for (int i = threadIdx.x; i < ROWS * CH; i += NT) {
        const int r = i / CH, c = i % CH;
        const bool ok = r >= r_lo && r < nrows && c * 8 < d;
        const uint16_t *src = (const uint16_t *)g + (ok ? (base + r) * sr + (int64_t)h * sh + c * 8 : 0);
        cp_async16(smem + r * LDS + c * 8, src, ok);
    }
}

__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
/* sigmoid(z) = (1 + tanh(z / 2)) / 2: one special-function op (exp + reciprocal would be two). */
__device__ __forceinline__ float sigmoid_fast(float z) { return fmaf(0.5f, tanh_approx(0.5f * z), 0.5f); }
/* SiLU(z) * scale */
/* 16 bits -> the even bits of 32 (bit j -> bit 2 j) */
__device__ __forceinline__ uint32_t spread_even(uint32_t x) {
    x &= 0xffffu;
    x = (x | (x << 8)) & 0x00ff00ffu;
    x = (x | (x << 4)) & 0x0f0f0f0fu;
    x = (x | (x << 2)) & 0x33333333u;
    return (x | (x << 1)) & 0x55555555u;
}

/* je[e] |= bit j for each x0 + 8 j + e (j < J) in [lo, hi) */
template <int J>
__device__ __forceinline__ void span_or(uint32_t (&je)[2], int lo, int hi, int x0) {
    static_assert(J >= 1 && J <= 16, "32 bits");
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int a = min(max(lo - x0 - e, 0), 8 * J), z = min(max(hi - x0 - e, 0), 8 * J);
        const int j0 = (a + 7) >> 3, j1 = (z + 7) >> 3;  // j in [j0, j1)
        je[e] |= ((1u << j1) - 1u) & ~((1u << j0) - 1u);
    }
}
/* The mask of query row `pos` over the columns key0 + 8 j + e (j < J <= 16, e < 2), at bit 2 j + e: the
 * columns one thread holds in an mma.sync / wgmma accumulator (key0 = the tile's first key + 2 (lane % 4)).
 * From the row's spans (tf_hstu_row_spans), a few integer ops per span, not a mask test per element.
 * Rows outside [0, n) get 0. */
template <int J, int NS>
__device__ __forceinline__ uint32_t hstu_span_bits(const int (&lo)[NS], const int (&hi)[NS], int x0) {
    uint32_t je[2] = {0u, 0u};  // per e: bit j set when x0 + 8 j + e lies in a span
#pragma unroll
    for (int i = 0; i < NS; ++i) span_or<J>(je, lo[i], hi[i], x0);
    return spread_even(je[0]) | (spread_even(je[1]) << 1);
}
template <int J>
__device__ __forceinline__ uint32_t hstu_row_bits(const tf_hstu_mask &m, int pos, int key0) {
    if (pos < 0 || pos >= m.n) return 0;
    int lo[4], hi[4];
    tf_hstu_row_spans(&m, pos, lo, hi);
    return hstu_span_bits<J>(lo, hi, key0);
}
/* Masks of plain causal sequences (no context, targets or window: tf_hstu_causal) in a few integer ops
 * instead of hstu_row_bits' spans (the sm_90a forward). Bit 2 j + e stands for offset 8 j + e from the
 * thread's first column (row), increasing with the bit, so "offset <= d" is the lowest `count` bits. The
 * span forms evaluate four or five spans and spread two 16-bit sets per row: on the diagonal tile of
 * every item that made the forward's masked element-wise step 2.8x a full tile's; this form gained
 * 1-4% (the ping-pong hid most of it). The same for the backward's key-major bits (rows
 * key <= row0 + 8 j + e < n: prefix(n - 1 - row0) & ~prefix(key - 1 - row0)) measured +1.4% at head dim
 * 128 and -3..-5% at 64: not kept (docs/design/hstu.md). */
template <int J>
__device__ __forceinline__ uint32_t hstu_prefix_bits(int d) {
    if (d < 0) return 0;
    const int count = min(2 * (d >> 3) + 1 + ((d & 7) != 0 ? 1 : 0), 2 * J);  // bits b with 8 (b / 2) + b % 2 <= d
    return count >= 32 ? ~0u : (1u << count) - 1u;
}
/* hstu_row_bits of a plain causal sequence: columns key0 + 8 j + e <= pos (all < n when pos is) */
template <int J>
__device__ __forceinline__ uint32_t hstu_causal_row_bits(int n, int pos, int key0) {
    return pos < 0 || pos >= n ? 0u : hstu_prefix_bits<J>(pos - key0);
}
__device__ __forceinline__ bool tf_hstu_causal(const tf_hstu_mask &m) { return m.c == 0 && m.t == 0 && m.m == 0; }
/* A plain window (no context, targets or exempt rows): row pos keeps the band of keys [pos - m, pos], two
 * prefixes instead of the spans (the sm_90a forward: +5% with a window of 256 at 16x4096x128 on an H100) */
__device__ __forceinline__ bool tf_hstu_band(const tf_hstu_mask &m) { return m.c == 0 && m.t == 0 && m.m > 0 && m.f == 0; }
template <int J>
__device__ __forceinline__ uint32_t hstu_band_row_bits(int n, int m, int pos, int key0) {
    return pos < 0 || pos >= n ? 0u : hstu_prefix_bits<J>(pos - key0) & ~hstu_prefix_bits<J>(pos - m - 1 - key0);
}

/* The transpose, for key-major tiles: key `key`'s mask over the rows row0 + 8 j + e at bit 2 j + e, from
 * tf_hstu_col_spans' five spans written out, so that those the sequence's options leave empty (window
 * exemptions, context, target groups) are skipped by branches uniform over the sequence: a causal or
 * windowed tile computes two (all five: the window case's backward 3% slower, results/hstu_h100.md).
 * Keep it in step with tf_hstu_col_spans (hstu_kernels.h, the CPU path's): test_backward's mask cases check both
 * against the reference. */
template <int J>
__device__ __forceinline__ uint32_t hstu_col_bits(const tf_hstu_mask &m, int key, int row0) {
    if (key < 0 || key >= m.n) return 0;
    uint32_t je[2] = {0u, 0u};
    const int iq = tf_hstu_id(&m, key), lo1 = tf_hstu_first_id_ge(&m, iq + 1);
    span_or<J>(je, key, key + 1, row0);
    span_or<J>(je, lo1, m.m > 0 ? tf_hstu_first_id_ge(&m, iq + m.m + 1) : m.n, row0);
    if (m.m > 0 && m.f > 0) {
        const int e = tf_hstu_first_id_ge(&m, m.max_id - m.f);
        span_or<J>(je, lo1 > e ? lo1 : e, m.n, row0);
    }
    if (m.c > 0) {
        const bool ctx = iq < m.max_id;
        span_or<J>(je, ctx ? tf_hstu_first_id_ge(&m, 0) : 0, ctx ? tf_hstu_first_id_ge(&m, 1) : 0, row0);
    }
    if (m.g > 1 && m.t > 0) {
        const bool tg = key >= m.u;
        const int end = m.u + ((key - m.u) / m.g + 1) * m.g;
        span_or<J>(je, tg ? key + 1 : 0, tg ? (end < m.n ? end : m.n) : 0, row0);
    }
    return spread_even(je[0]) | (spread_even(je[1]) << 1);
}
/* An mma.sync / wgmma accumulator's element i (= 4 j + 2 h + e) -> its bit in the two masks above (h: the
 * thread's row, or key, + 8 h) */
__device__ __forceinline__ bool pair_bit(const uint32_t (&bits)[2], int i) {
    return (bits[(i >> 1) & 1] >> (2 * (i >> 2) + (i & 1))) & 1u;
}

__device__ __forceinline__ float silu_scaled(float z, float scale) {
    const float hz = 0.5f * z * scale;
    return fmaf(hz, tanh_approx(0.5f * z), hz);
}
__device__ __forceinline__ float silu_of(float z) { return __fdividef(z, 1.f + __expf(-z)); }

#endif /* TF_HSTU_MMA_CUH */

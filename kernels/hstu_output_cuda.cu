/* HSTU output section on CUDA (semantics: hstu_output_kernels.h).
 *
 * Two kernel families. LayerNorm rows of up to 2048 columns (the common case) go to the rows kernels
 * (hstu_output_fwd_rows / _bwd_rows, described at their definition): a group of threads per row sized
 * so each thread holds one or two 8-element chunks per tensor, several rows per block for narrow rows;
 * their compile-time-typed forms (hstu_output_fwd_typed, hstu_output_fwd_warp, hstu_output_bwd_typed)
 * take the common dtype and option choices.
 * GroupNorm and wider rows go to the warp kernels: one warp per (row, group) task, a persistent grid
 * striding over the tasks, chunk j of a group (8 elements, tf_vec.cuh: 16-byte vectors where whole and
 * aligned, element by element otherwise) lane j % 32's. Their forward holds groups of up to 1024
 * columns in registers (wider ones are read three times: mean, variance about it, the write pass; the
 * re-reads come from L1/L2); their backward reads a group twice.
 *
 * Dropout: a chunk's 8 elements of the concatenated output span one Philox block of 8 consecutive
 * elements (16 bits each, tf_philox_keep16) where the chunk starts at a multiple of 8 in the output,
 * two otherwise; each block is drawn once per chunk.
 *
 * Warp backward's weight gradients: each warp adds into its own partial row as it goes (LayerNorm: a
 * lane's columns; GroupNorm: a warp sum per task), so the order of additions is fixed: deterministic. */
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "hstu_output_act.cuh"
#include "hstu_output_kernels.h"
#include "norm_fwd_typed.cuh"
#include "tf_cp_async.cuh"
#include "tf_vec.cuh"

namespace {

constexpr int kWarps = 8; /* per block */
/* Blocks per SM the register budget is set for: a memory-bound kernel wants many warps in flight, but
 * the backward's register-held weight-gradient sums (K > 0) need more than 128 registers to run
 * unspilled (ptxas, sm_90a: 162 to 232). */
template <int K>
constexpr int fwd_min_blocks() { return K >= 2 ? 2 : 3; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* tf_load_chunk / tf_store_chunk, plus 4-byte words for whole 16-bit chunks that are 4- but not
 * 16-byte aligned: narrow rows (n = 50: 100-byte rows) start at every 4-byte boundary, and half as many
 * accesses per chunk keep those rows near the vectorised rate. */
__device__ __forceinline__ void tf_ld_chunk(const void *row, int dt, int64_t col, int n, float (&v)[TF_VEC]) {
    const uint16_t *h = (const uint16_t *)row + col;
    if (dt != TF_F32 && n == TF_VEC && !tf_aligned16(h) && ((uintptr_t)h & 3u) == 0) {
        uint32_t q[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) q[i] = ((const uint32_t *)h)[i];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint16_t lo = (uint16_t)(q[i] & 0xffffu), hi = (uint16_t)(q[i] >> 16);
            v[2 * i] = dt == TF_BF16 ? __bfloat162float(__ushort_as_bfloat16(lo)) : __half2float(__ushort_as_half(lo));
            v[2 * i + 1] =
                dt == TF_BF16 ? __bfloat162float(__ushort_as_bfloat16(hi)) : __half2float(__ushort_as_half(hi));
        }
        return;
    }
    tf_load_chunk(row, dt, col, n, v);
}

__device__ __forceinline__ void tf_st_chunk(void *row, int dt, int64_t col, int n, const float (&v)[TF_VEC]) {
    uint16_t *h = (uint16_t *)row + col;
    if (dt != TF_F32 && n == TF_VEC && !tf_aligned16(h) && ((uintptr_t)h & 3u) == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            uint16_t lo, hi;
            if (dt == TF_BF16) {
                lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i]));
                hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[2 * i + 1]));
            } else {
                lo = __half_as_ushort(__float2half_rn(v[2 * i]));
                hi = __half_as_ushort(__float2half_rn(v[2 * i + 1]));
            }
            ((uint32_t *)h)[i] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
        return;
    }
    tf_store_chunk(row, dt, col, n, v);
}

struct Dropout {
    uint64_t seed, offset;
    uint32_t threshold; /* tf_philox_threshold16(p) */
    float scale;
    bool on;
};

/* The keep bits of Philox block `blk`'s 8 elements (elements 8 * blk .. 8 * blk + 7): one draw, its
 * eight 16-bit halves compared with the threshold; bit i for element 8 * blk + i. */
__device__ __forceinline__ uint32_t block_bits(const Dropout &d, uint64_t blk) {
    uint32_t w[4], bits = 0u;
    tf_philox4x32_10(d.seed, d.offset, blk, w);
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) bits |= (uint32_t)tf_philox_keep16(w[q], h, d.threshold) << (2 * q + h);
    return bits;
}

/* keep(e0 + i) as bit i, for i < n <= 8. The chunk's elements span at most two Philox blocks of 8: each
 * is drawn once (bit 8 * j + element for the j-th, shifted by the chunk's phase afterwards), so only
 * four words and a bit mask are live at a time. */
__device__ __forceinline__ uint32_t mask_bits(const Dropout &d, uint64_t e0, int n) {
    if (!d.on || n <= 0) return 0u;
    const uint64_t b0 = e0 >> 3;
    const unsigned ph = (unsigned)(e0 & 7), end = ph + (unsigned)n;
    uint32_t bits = 0u;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        if (8u * j >= end) break;
        bits |= block_bits(d, b0 + j) << (8 * j);
    }
    return bits >> ph;
}

/* mask_bits(d, e0, 8) for e0 a multiple of 8: one Philox block (the typed kernels' chunks, whose rows
 * and parts all start at multiples of 8 elements). */
__device__ __forceinline__ uint32_t mask_bits8(const Dropout &d, uint64_t e0) {
    return d.on ? block_bits(d, e0 >> 3) : 0u;
}

/* v * keep(i) / (1 - p), keep(i) bit i of mask_bits' word. */
__device__ __forceinline__ float keep_scaled(const Dropout &d, uint32_t bits, int i, float v) {
    if (!d.on) return v;
    return (bits >> i) & 1u ? v * d.scale : 0.f;
}

/* v[i] = keep_scaled(v[i]) for i < n. */
__device__ __forceinline__ void apply_bits(const Dropout &d, uint32_t bits, int n, float (&v)[TF_VEC]) {
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i)
        if (i < n) v[i] = keep_scaled(d, bits, i, v[i]);
}

__device__ __forceinline__ void apply_mask(const Dropout &d, uint64_t e0, int n, float (&v)[TF_VEC]) {
    apply_bits(d, mask_bits(d, e0, n), n, v);
}

__device__ __forceinline__ void load_params(const void *w, const void *b, int dt, int group_weights, int64_t g,
                                            int64_t col, int n, float (&wv)[TF_VEC], float (&bv)[TF_VEC]) {
    if (!group_weights) {
        if (w) tf_load_chunk(w, dt, col, n, wv);
        else for (int i = 0; i < TF_VEC; ++i) wv[i] = 1.f;
        if (b) tf_load_chunk(b, dt, col, n, bv);
        else for (int i = 0; i < TF_VEC; ++i) bv[i] = 0.f;
    } else {
        float t[TF_VEC];
        float ws = 1.f, bs = 0.f;
        if (w) { tf_load_chunk(w, dt, g, 1, t); ws = t[0]; }
        if (b) { tf_load_chunk(b, dt, g, 1, t); bs = t[0]; }
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) { wv[i] = ws; bv[i] = bs; }
    }
}

__device__ __forceinline__ int chunk_n(int64_t j, int64_t gs) {
    const int64_t left = gs - j * TF_VEC;
    return left <= 0 ? 0 : (left < TF_VEC ? (int)left : TF_VEC);
}

__device__ __forceinline__ Dropout make_dropout(const tf_philox_args &rng, int on, float p) {
    Dropout d{};
    d.on = on != 0;
    d.threshold = tf_philox_threshold16(p);
    d.scale = on ? 1.f / (1.f - p) : 1.f;
    if (on) tf_philox_resolve(&rng, &d.seed, &d.offset);
    return d;
}

/* make_dropout with dropout on or off known at compile time (the typed kernels). */
template <bool DROP>
__device__ __forceinline__ Dropout make_dropout_fixed(const tf_philox_args &rng, float p) {
    Dropout d{};
    d.on = DROP;
    if constexpr (DROP) {
        d.threshold = tf_philox_threshold16(p);
        d.scale = 1.f / (1.f - p);
        tf_philox_resolve(&rng, &d.seed, &d.offset);
    }
    return d;
}

/* The forward's resolved (seed, offset), from which its backward draws the same mask, written by the
 * grid's first thread where asked for. */
__device__ __forceinline__ void write_rng_out(const tf_philox_args &rng, int64_t *out) {
    if (out && blockIdx.x == 0 && threadIdx.x == 0) {
        uint64_t s, o;
        tf_philox_resolve(&rng, &s, &o);
        out[0] = (int64_t)s;
        out[1] = (int64_t)o;
    }
}

/* y's element from attn's normalized value, u's activation and the norm parameters, each rounding
 * spelled out: the backward writes y again (recompute_y_in_backward) and must land on the same bits,
 * whatever contraction the compiler would choose in each kernel (ptxas fused a rematerialized
 * mean = sum * inv into a - mean in one forward kernel: fp32 ulps apart from the stored mean's). */
__device__ __forceinline__ float y_of(float xhat, float act_u, float w, float b) {
    return __fmul_rn(act_u, __fmaf_rn(xhat, w, b));
}
__device__ __forceinline__ float xhat_of(float a, float mean, float rstd) {
    return __fmul_rn(__fsub_rn(a, mean), rstd);
}

/* The three parts of one chunk of the output row, dropped out and rounded. y's part first: the norm
 * weight and bias (and, after attn's part, attn) are dead before the later parts' mask draws. */
__device__ __forceinline__ void fwd_write_chunk(const tf_hstu_output_fwd_params &p, const Dropout &d, void *yrow,
                                                uint64_t e_row, int64_t ou, int64_t ox, int64_t oy,
                                                int64_t col, int cn, float mean, float rstd,
                                                const float (&a)[TF_VEC], const float (&u)[TF_VEC],
                                                const float (&w)[TF_VEC], const float (&b)[TF_VEC]) {
    float v[TF_VEC], fm[TF_VEC];
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) {
        fm[i] = hstu_act(u[i], p.mul_act);
        v[i] = y_of(xhat_of(a[i], mean, rstd), fm[i], w[i], b[i]);
    }
    apply_mask(d, e_row + oy + col, cn, v);
    tf_st_chunk(yrow, p.y_dtype, oy + col, cn, v);
    if (ox >= 0) {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) v[i] = a[i];
        apply_mask(d, e_row + ox + col, cn, v);
        tf_st_chunk(yrow, p.y_dtype, ox + col, cn, v);
    }
    if (ou >= 0) {
        if (p.cat_act == p.mul_act) /* one exponential per element when the activations agree */
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) v[i] = fm[i];
        else
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) v[i] = hstu_act(u[i], p.cat_act);
        apply_mask(d, e_row + ou + col, cn, v);
        tf_st_chunk(yrow, p.y_dtype, ou + col, cn, v);
    }
}

/* K > 0: groups of at most 32 * 8 * K columns, held in registers (all of a group's loads issued before
 * the first is used). K == 0: any width, three passes over the group. */
template <int K>
__global__ void __launch_bounds__(kWarps * 32, fwd_min_blocks<K>()) hstu_output_fwd_kernel(
    const tf_hstu_output_fwd_params p) {
    const int lane = threadIdx.x & 31;
    const int64_t warp0 = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    const int64_t n_warps = (int64_t)gridDim.x * kWarps;
    const Dropout d = make_dropout(p.rng, p.dropout, p.p);
    write_rng_out(p.rng, p.rng_out);
    const int64_t G = p.groups, n = p.cols, gs = n / G, nch = (gs + TF_VEC - 1) / TF_VEC;
    const int64_t ou = p.cat_u ? 0 : -1, ox = p.cat_x ? (p.cat_u ? n : 0) : -1, oy = (p.cat_u + p.cat_x) * n;
    const float inv = 1.f / (float)gs;
    for (int64_t task = warp0; task < p.rows * G; task += n_warps) {
        const int64_t r = task / G, g = task - r * G, c0 = g * gs;
        const void *arow = tf_row(p.attn, p.attn_dtype, r, p.attn_stride);
        const void *urow = tf_row(p.u, p.u_dtype, r, p.u_stride);
        void *yrow = tf_row(p.y, p.y_dtype, r, p.y_cols);
        const uint64_t e_row = (uint64_t)r * (uint64_t)p.y_cols;
        float s = 0.f, q = 0.f;
        if constexpr (K > 0) {
            float a[K][TF_VEC], u[K][TF_VEC];
            int cn[K];
#pragma unroll
            for (int k = 0; k < K; ++k) {
                cn[k] = chunk_n(lane + 32 * k, gs);
                tf_load_chunk(arow, p.attn_dtype, c0 + (lane + 32 * k) * TF_VEC, cn[k], a[k]);
                tf_load_chunk(urow, p.u_dtype, c0 + (lane + 32 * k) * TF_VEC, cn[k], u[k]);
            }
#pragma unroll
            for (int k = 0; k < K; ++k)
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) s += a[k][i]; /* zero past cn */
            const float mean = warp_sum(s) * inv;
#pragma unroll
            for (int k = 0; k < K; ++k)
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) if (i < cn[k]) q += (a[k][i] - mean) * (a[k][i] - mean);
            const float rstd = rsqrtf(warp_sum(q) * inv + p.eps);
            if (lane == 0) {
                p.mean[task] = mean;
                p.rstd[task] = rstd;
            }
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (cn[k] > 0) {
                    const int64_t col = c0 + (lane + 32 * k) * TF_VEC;
                    float w[TF_VEC], b[TF_VEC];
                    load_params(p.w, p.b, p.w_dtype, p.group_weights, g, col, cn[k], w, b);
                    fwd_write_chunk(p, d, yrow, e_row, ou, ox, oy, col, cn[k], mean, rstd, a[k], u[k], w, b);
                }
        } else {
            float a[TF_VEC], u[TF_VEC];
            for (int64_t j = lane; j < nch; j += 32) {
                tf_load_chunk(arow, p.attn_dtype, c0 + j * TF_VEC, chunk_n(j, gs), a);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) s += a[i]; /* zero past cn */
            }
            const float mean = warp_sum(s) * inv;
            for (int64_t j = lane; j < nch; j += 32) {
                const int cn = chunk_n(j, gs);
                tf_load_chunk(arow, p.attn_dtype, c0 + j * TF_VEC, cn, a);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) if (i < cn) q += (a[i] - mean) * (a[i] - mean);
            }
            const float rstd = rsqrtf(warp_sum(q) * inv + p.eps);
            if (lane == 0) {
                p.mean[task] = mean;
                p.rstd[task] = rstd;
            }
            for (int64_t j = lane; j < nch; j += 32) {
                const int cn = chunk_n(j, gs);
                const int64_t col = c0 + j * TF_VEC;
                tf_load_chunk(arow, p.attn_dtype, col, cn, a);
                tf_load_chunk(urow, p.u_dtype, col, cn, u);
                float w[TF_VEC], b[TF_VEC];
                load_params(p.w, p.b, p.w_dtype, p.group_weights, g, col, cn, w, b);
                fwd_write_chunk(p, d, yrow, e_row, ou, ox, oy, col, cn, mean, rstd, a, u, w, b);
            }
        }
    }
}

/* The backward's per-chunk work: gy (the masked gradient of y), xhat, dn = gy * act(u), dxhat. */
struct BwdChunk {
    float a[TF_VEC], u[TF_VEC], gy[TF_VEC], xhat[TF_VEC], dn[TF_VEC], w[TF_VEC], b[TF_VEC];
};

__device__ __forceinline__ void bwd_load(const tf_hstu_output_bwd_params &p, const Dropout &d, const void *arow,
                                         const void *urow, const void *dyrow, uint64_t e_row, int64_t oy,
                                         int64_t g, int64_t col, int cn, float mean, float rstd, BwdChunk &c) {
    tf_load_chunk(arow, p.attn_dtype, col, cn, c.a);
    tf_load_chunk(urow, p.u_dtype, col, cn, c.u);
    tf_load_chunk(dyrow, p.dy_dtype, oy + col, cn, c.gy);
    apply_mask(d, e_row + oy + col, cn, c.gy);
    load_params(p.w, p.b, p.w_dtype, p.group_weights, g, col, cn, c.w, c.b);
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) {
        c.xhat[i] = i < cn ? xhat_of(c.a[i], mean, rstd) : 0.f;
        c.dn[i] = i < cn ? c.gy[i] * hstu_act(c.u[i], p.mul_act) : 0.f;
    }
}

/* GroupNorm, and LayerNorm rows wider than the rows kernels take: any width, each chunk read twice. Y:
 * y written again in the second pass, each part's keep bits shared with dY's part. */
template <bool Y>
__global__ void __launch_bounds__(kWarps * 32, 2) hstu_output_bwd_kernel(
    const tf_hstu_output_bwd_params p) {
    const int lane = threadIdx.x & 31;
    const int64_t slot = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
    const int64_t n_warps = (int64_t)gridDim.x * kWarps;
    const Dropout d = make_dropout(p.rng, p.dropout, p.p);
    const int64_t G = p.groups, n = p.cols, gs = n / G, nch = (gs + TF_VEC - 1) / TF_VEC;
    const int64_t wcols = p.group_weights ? G : n;
    const int64_t ou = p.cat_u ? 0 : -1, ox = p.cat_x ? (p.cat_u ? n : 0) : -1, oy = (p.cat_u + p.cat_x) * n;
    const float inv = 1.f / (float)gs;
    float *dwp = p.dw_part ? p.dw_part + slot * wcols : nullptr;
    float *dbp = p.db_part ? p.db_part + slot * wcols : nullptr;

    for (int64_t task = slot; task < p.rows * G; task += n_warps) {
        const int64_t r = task / G, g = task - r * G, c0 = g * gs;
        const void *arow = tf_row(p.attn, p.attn_dtype, r, p.attn_stride);
        const void *urow = tf_row(p.u, p.u_dtype, r, p.u_stride);
        const void *dyrow = tf_row(p.dy, p.dy_dtype, r, p.dy_stride);
        const float mean = p.mean[task], rstd = p.rstd[task];
        const uint64_t e_row = (uint64_t)r * (uint64_t)p.y_cols;
        float s1 = 0.f, s2 = 0.f, gw = 0.f, gb = 0.f;
        BwdChunk c;
        for (int64_t j = lane; j < nch; j += 32) {
            const int cn = chunk_n(j, gs);
            const int64_t col = c0 + j * TF_VEC;
            bwd_load(p, d, arow, urow, dyrow, e_row, oy, g, col, cn, mean, rstd, c);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                const float dx = __fmul_rn(c.dn[i], c.w[i]); /* rounded as in da below */
                s1 += dx;
                s2 += dx * c.xhat[i];
                gw += c.dn[i] * c.xhat[i];
                gb += c.dn[i];
            }
            if (!p.group_weights) { /* this lane's columns of the warp's own partial row */
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) {
                    if (i >= cn) break;
                    if (dwp) dwp[col + i] += c.dn[i] * c.xhat[i];
                    if (dbp) dbp[col + i] += c.dn[i];
                }
            }
        }
        if (p.group_weights) {
            gw = warp_sum(gw);
            gb = warp_sum(gb);
            if (lane == 0) {
                if (dwp) dwp[g] += gw;
                if (dbp) dbp[g] += gb;
            }
        }
        const float m1 = warp_sum(s1) * inv, m2 = warp_sum(s2) * inv;
        void *darow = tf_row(p.dattn, p.dattn_dtype, r, n);
        void *durow = tf_row(p.du, p.du_dtype, r, n);
        void *yrow = Y ? tf_row(p.y, p.y_dtype, r, p.y_cols) : nullptr;
        for (int64_t j = lane; j < nch; j += 32) {
            const int cn = chunk_n(j, gs);
            const int64_t col = c0 + j * TF_VEC;
            bwd_load(p, d, arow, urow, dyrow, e_row, oy, g, col, cn, mean, rstd, c);
            float da[TF_VEC], du[TF_VEC], t[TF_VEC];
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                /* the product rounded before the subtraction, as in m1's terms: an FMA here would leave
                 * the product's rounding error, which rstd magnifies when the row is constant */
                da[i] = rstd * (__fmul_rn(c.dn[i], c.w[i]) - m1 - c.xhat[i] * m2);
                du[i] = c.gy[i] * (c.xhat[i] * c.w[i] + c.b[i]) * hstu_act_grad(c.u[i], p.mul_act);
            }
            if constexpr (Y) { /* y's part */
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) t[i] = y_of(c.xhat[i], hstu_act(c.u[i], p.mul_act), c.w[i], c.b[i]);
                apply_mask(d, e_row + oy + col, cn, t);
                tf_store_chunk(yrow, p.y_dtype, oy + col, cn, t);
            }
            if (ox >= 0) {
                const uint32_t bits = mask_bits(d, e_row + ox + col, cn);
                if constexpr (Y) {
                    apply_bits(d, bits, cn, c.a);
                    tf_store_chunk(yrow, p.y_dtype, ox + col, cn, c.a);
                }
                tf_load_chunk(dyrow, p.dy_dtype, ox + col, cn, t);
                apply_bits(d, bits, cn, t);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) da[i] += t[i];
            }
            if (ou >= 0) {
                const uint32_t bits = mask_bits(d, e_row + ou + col, cn);
                if constexpr (Y) {
#pragma unroll
                    for (int i = 0; i < TF_VEC; ++i) t[i] = hstu_act(c.u[i], p.cat_act);
                    apply_bits(d, bits, cn, t);
                    tf_store_chunk(yrow, p.y_dtype, ou + col, cn, t);
                }
                tf_load_chunk(dyrow, p.dy_dtype, ou + col, cn, t);
                apply_bits(d, bits, cn, t);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) du[i] += t[i] * hstu_act_grad(c.u[i], p.cat_act);
            }
            tf_store_chunk(darow, p.dattn_dtype, col, cn, da);
            tf_store_chunk(durow, p.du_dtype, col, cn, du);
        }
    }
}

/* ---- LayerNorm rows of up to kRowBlock * 8 * kRowMaxK columns: a group of tpr threads per row ----
 *
 * tpr (a power of two, 1 to kRowBlock) threads share a row, each holding K chunks per tensor in
 * registers (chunk t + tpr * k is thread t's); a block of kRowBlock threads holds kRowBlock / tpr rows
 * at a time, so narrow rows fill a block with many rows and a 1024-column bf16 row gets 128 threads of
 * one chunk each. Few registers per thread leave room for many blocks per SM: the bytes in flight
 * that a memory-bound kernel needs. The grid is persistent (sized by occupancy); the norm weight and
 * bias chunks a thread needs are the same for every row and are read once. The backward keeps a row's
 * attn, u and dY chunks in registers from the statistics to the write phase (no second read). Weight
 * gradients: per-thread column sums in registers across the block's rows, combined over the block's
 * row groups in a fixed order at the end into the block's own partial row: deterministic. */
constexpr int kRowBlock = 128;
constexpr int kRowMaxK = 2;
/* Blocks per SM the register budgets are set for: the largest counts whose kernels compile unspilled
 * (ptxas, sm_90a); the staged forward's prefetch keeps loads in flight with one block fewer. The staged
 * backward keeps little in registers across rows (norm parameters read per row, dn * w parked in the
 * stage): 5 blocks, their 40 KB stages 200 KB of shared memory; one block fewer where the backward also
 * writes y (Y), whose values would spill at the smaller budget. */
template <int K, bool STAGED>
constexpr int rows_fwd_min_blocks() { return K == 1 ? (STAGED ? 5 : 6) : 4; }
template <int K, bool STAGED, bool Y>
constexpr int rows_bwd_min_blocks() { return K == 1 ? (STAGED ? 5 : 4) - (Y ? 1 : 0) : 2; }

/* v summed over aligned runs of `width` lanes (a power of two up to 32) by butterflies: every lane of a
 * run gets the same bits. */
__device__ __forceinline__ void butterfly_sum(float &v, int width) {
    for (int off = width >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
}

/* v summed over the tpr threads of each row group (a fixed order: the same result in every thread of
 * the group, run to run). Every thread of the block calls it; above 32 threads per row it meets the
 * others at __syncthreads and goes through red. */
template <int NV>
__device__ __forceinline__ void group_sum(float (&v)[NV], int tpr, float (*red)[NV]) {
#pragma unroll
    for (int i = 0; i < NV; ++i) butterfly_sum(v[i], tpr < 32 ? tpr : 32);
    if (tpr <= 32) return;
    const int warp = threadIdx.x >> 5, nw = tpr >> 5, first = (threadIdx.x / tpr) * nw;
    __syncthreads(); /* the previous call's reads of red are done */
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int i = 0; i < NV; ++i) red[warp][i] = v[i];
    __syncthreads();
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        float t = 0.f;
        for (int j = 0; j < nw; ++j) t += red[first + j][i];
        v[i] = t;
    }
}

/* (sum, sum of squares)-style pairs summed over each row group of tpr threads with one barrier at most:
 * butterflies within a warp, then the warps' sums through red[parity], the buffer alternating with the
 * row's parity (a warp can only overwrite a buffer after every warp has passed the barrier of the row
 * between, i.e. after all have read it). The typed kernels' reduction; every thread gets the same bits. */
__device__ __forceinline__ float2 group_sum2(float2 g, int tpr, float2 (*red)[kRowBlock / 32], int parity) {
    butterfly_sum(g.x, tpr < 32 ? tpr : 32);
    butterfly_sum(g.y, tpr < 32 ? tpr : 32);
    if (tpr <= 32) return g;
    const int lane = threadIdx.x & 31, nw = tpr >> 5, first = (threadIdx.x / tpr) * nw;
    if (lane == 0) red[parity][threadIdx.x >> 5] = g;
    __syncthreads();
    g = red[parity][first + (lane & (nw - 1))]; /* each aligned run of nw lanes folds the nw sums */
    butterfly_sum(g.x, nw);
    butterfly_sum(g.y, nw);
    return g;
}

/* A block's weight-gradient sums of one chunk per thread (tpr threads per row, kRowBlock / tpr row groups)
 * into its partial rows: the row groups' sums added in group order, a fixed order. `part`: kRowBlock x
 * TF_VEC floats of shared memory, used when a block holds several rows (the kernel's own stages, free by
 * then, where it has them: a static array would cost a block's worth of occupancy). */
__device__ __forceinline__ void store_partials_one_chunk(float *dwp, float *dbp, const float (&acc_w)[TF_VEC],
                                                         const float (&acc_b)[TF_VEC], int tpr, int cn, float *part) {
    const int t = threadIdx.x & (tpr - 1), grp = threadIdx.x / tpr, rpb = kRowBlock / tpr;
    for (int which = 0; which < 2; ++which) {
        float *dst = which == 0 ? dwp : dbp;
        if (!dst) continue;
        if (rpb == 1) {
            for (int i = 0; i < cn; ++i) dst[(int64_t)t * TF_VEC + i] = which == 0 ? acc_w[i] : acc_b[i];
            continue;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) part[threadIdx.x * TF_VEC + i] = which == 0 ? acc_w[i] : acc_b[i];
        __syncthreads();
        if (grp == 0) {
            for (int i = 0; i < cn; ++i) {
                float v = 0.f;
                for (int g = 0; g < rpb; ++g) v += part[(g * tpr + t) * TF_VEC + i];
                dst[(int64_t)t * TF_VEC + i] = v;
            }
        }
    }
}

/* STAGED (every chunk of attn and u whole and 16-byte aligned, the launch checks): each thread copies
 * its chunks of the next row into shared memory with cp.async while it works on this row, so a row's
 * loads are in flight during the previous row's reductions and writes, without registers to hold
 * them (the fused add+LayerNorm measured register prefetch capped near 70% of copy by occupancy). A
 * thread reads back only what it copied itself: no barrier guards the buffers. Layout: planes of 16
 * bytes x kRowBlock threads, (stage, chunk, tensor, 16-byte piece), conflict-free for a warp. */
constexpr int kStagePlanes = 4; /* per chunk and stage: attn, u, each one (16-bit) or two (fp32) pieces */

template <int K>
constexpr size_t rows_fwd_stage_bytes() { return (size_t)2 * K * kStagePlanes * kRowBlock * 16; }

/* A chunk's raw pieces as floats: one 16-byte piece for 16-bit dtypes, two for fp32. */
__device__ __forceinline__ void stage_to_float(const uint4 *pl0, const uint4 *pl1, int dt, float (&v)[TF_VEC]) {
    if (dt == TF_F32) {
        TfRaw<4> r;
        r.q[0] = *pl0;
        r.q[1] = *pl1;
        tf_raw_to_float(r, dt, v);
    } else {
        TfRaw<2> r;
        r.q[0] = *pl0;
        tf_raw_to_float(r, dt, v);
    }
}

/* cp.async of chunk `col` of attn's and u's row `row` (one 16-byte piece each, two for fp32) into the
 * planes at pa and pu, a piece per plane (planes are kRowBlock vectors apart): the staged forward and
 * backward load these two tensors alike. */
template <class P>
__device__ __forceinline__ void issue_attn_u(const P &p, int64_t row, int64_t col, uint4 *pa, uint4 *pu) {
    const int apc = p.attn_dtype == TF_F32 ? 2 : 1, upc = p.u_dtype == TF_F32 ? 2 : 1;
    const char *ar = (const char *)tf_row(p.attn, p.attn_dtype, row, p.attn_stride);
    const char *ur = (const char *)tf_row(p.u, p.u_dtype, row, p.u_stride);
    for (int q = 0; q < apc; ++q) cp_async16(pa + q * kRowBlock, ar + col * 2 * apc + 16 * q);
    for (int q = 0; q < upc; ++q) cp_async16(pu + q * kRowBlock, ur + col * 2 * upc + 16 * q);
}

template <int K, bool STAGED>
__global__ void __launch_bounds__(kRowBlock, rows_fwd_min_blocks<K, STAGED>()) hstu_output_fwd_rows(
    const tf_hstu_output_fwd_params p, int tpr) {
    __shared__ float red[kRowBlock / 32][1];
    extern __shared__ uint4 stage_buf[];
    const int t = threadIdx.x & (tpr - 1), rpb = kRowBlock / tpr;
    const Dropout d = make_dropout(p.rng, p.dropout, p.p);
    write_rng_out(p.rng, p.rng_out);
    const int64_t n = p.cols;
    const int64_t ou = p.cat_u ? 0 : -1, ox = p.cat_x ? (p.cat_u ? n : 0) : -1, oy = (p.cat_u + p.cat_x) * n;
    const float inv = 1.f / (float)n;
    int cn[K];
    float w[K][TF_VEC], b[K][TF_VEC];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        cn[k] = chunk_n(t + tpr * k, n);
        load_params(p.w, p.b, p.w_dtype, 0, 0, (int64_t)(t + tpr * k) * TF_VEC, cn[k], w[k], b[k]);
    }
    const int64_t step = (int64_t)gridDim.x * rpb;
    auto plane = [&](int stage, int k, int idx) -> uint4 * {
        return stage_buf + (size_t)((stage * K + k) * kStagePlanes + idx) * kRowBlock + threadIdx.x;
    };
    auto issue = [&](int64_t row, int stage) {
        if (row < p.rows) {
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (cn[k] > 0)
                    issue_attn_u(p, row, (int64_t)(t + tpr * k) * TF_VEC, plane(stage, k, 0), plane(stage, k, 2));
        }
        cp_async_commit(); /* one group per row, empty or not, so wait_group counts rows */
    };
    int stage = 0;
    if constexpr (STAGED) issue((int64_t)blockIdx.x * rpb + threadIdx.x / tpr, 0);
    for (int64_t r0 = (int64_t)blockIdx.x * rpb; r0 < p.rows; r0 += step, stage ^= 1) {
        const int64_t r = r0 + threadIdx.x / tpr;
        const bool live = r < p.rows; /* dead groups still meet the others in group_sum */
        float a[K][TF_VEC], u[K][TF_VEC];
        if constexpr (STAGED) {
            issue(r + step, stage ^ 1);
            cp_async_wait<1>(); /* this row's group has landed */
#pragma unroll
            for (int k = 0; k < K; ++k) {
                if (!live || cn[k] == 0) {
#pragma unroll
                    for (int i = 0; i < TF_VEC; ++i) a[k][i] = u[k][i] = 0.f;
                    continue;
                }
                stage_to_float(plane(stage, k, 0), plane(stage, k, 1), p.attn_dtype, a[k]);
                stage_to_float(plane(stage, k, 2), plane(stage, k, 3), p.u_dtype, u[k]);
            }
        } else {
            const void *arow = tf_row(p.attn, p.attn_dtype, r, p.attn_stride);
            const void *urow = tf_row(p.u, p.u_dtype, r, p.u_stride);
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int m = live ? cn[k] : 0;
                tf_ld_chunk(arow, p.attn_dtype, (int64_t)(t + tpr * k) * TF_VEC, m, a[k]);
                tf_ld_chunk(urow, p.u_dtype, (int64_t)(t + tpr * k) * TF_VEC, m, u[k]);
            }
        }
        float s[1] = {0.f};
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) s[0] += a[k][i]; /* zero past cn */
        group_sum(s, tpr, red);
        const float mean = s[0] * inv;
        float q[1] = {0.f};
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) if (i < cn[k]) q[0] += (a[k][i] - mean) * (a[k][i] - mean);
        group_sum(q, tpr, red);
        const float rstd = rsqrtf(q[0] * inv + p.eps);
        if (!live) continue;
        if (t == 0) {
            p.mean[r] = mean;
            p.rstd[r] = rstd;
        }
        void *yrow = tf_row(p.y, p.y_dtype, r, p.y_cols);
        const uint64_t e_row = (uint64_t)r * (uint64_t)p.y_cols;
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (cn[k] > 0)
                fwd_write_chunk(p, d, yrow, e_row, ou, ox, oy, (int64_t)(t + tpr * k) * TF_VEC, cn[k], mean, rstd,
                                a[k], u[k], w[k], b[k]);
    }
    if constexpr (STAGED) asm volatile("cp.async.wait_all;\n" ::); /* nothing left in flight at exit */
}

/* A 16-byte store, streaming (evict first) with STREAM. */
template <bool STREAM>
__device__ __forceinline__ void store16(void *dst, const uint4 &v) {
    if constexpr (STREAM) __stcs((uint4 *)dst, v);
    else *(uint4 *)dst = v;
}

/* The typed forwards' writes of one whole chunk of a row (the [u, attn, y] concatenation with CAT, y alone
 * at oy = 0 without), from the chunk's raw attn and u, dropped out and rounded: u's part first, then
 * y's over the activation in place, then attn's (as read, without dropout), so few values are live at
 * once. STREAM: streaming stores. */
template <typename T, bool CAT, bool DROP, bool STREAM>
__device__ __forceinline__ void typed_write_chunk(const Dropout &d, T *yrow, uint64_t e_row, int64_t n, int64_t oy,
                                                  int64_t col, const uint4 araw, const uint4 uraw, float mean,
                                                  float rstd, const float (&w)[TF_VEC], const float (&b)[TF_VEC]) {
    float f[TF_VEC];
    tf_norm_typed::unpack8<T>(uraw, f);
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) f[i] = hstu_act(f[i], TF_ACT_SILU);
    if constexpr (CAT) {
        if constexpr (DROP) {
            float v[TF_VEC];
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) v[i] = f[i];
            apply_mask(d, e_row + col, TF_VEC, v);
            store16<STREAM>(yrow + col, tf_norm_typed::pack8<T>(v));
        } else {
            store16<STREAM>(yrow + col, tf_norm_typed::pack8<T>(f));
        }
    }
    float a[TF_VEC];
    tf_norm_typed::unpack8<T>(araw, a);
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) f[i] = y_of(xhat_of(a[i], mean, rstd), f[i], w[i], b[i]);
    if constexpr (DROP) apply_mask(d, e_row + oy + col, TF_VEC, f);
    store16<STREAM>(yrow + oy + col, tf_norm_typed::pack8<T>(f));
    if constexpr (CAT) {
        if constexpr (DROP) {
            apply_mask(d, e_row + n + col, TF_VEC, a);
            store16<STREAM>(yrow + n + col, tf_norm_typed::pack8<T>(a));
        } else {
            store16<STREAM>(yrow + n + col, araw);
        }
    }
}

/* The typed forward: the common case with every choice known at compile time. attn, u and y of one
 * 16-bit type T, LayerNorm rows of up to 1024 columns whose chunks are all whole and aligned, SiLU for
 * both activations, the [u, attn, y] concatenation (CAT) or y alone, dropout on or off (DROP); rows of
 * 513-1024 columns go to the warp-per-row form of it (hstu_output_fwd_warp) instead. Why a
 * kernel of its own: the rows kernel is issue-bound (ncu, H100: an instruction on 66% of scheduler
 * cycles, DRAM at 56-64%), on run-time dtype, activation and concatenation branches, alignment checks in
 * every store and four barriers per row (two reductions of a block-wide group). Here:
 *  - attn and u of the next row are staged with cp.async as in the staged rows kernel, and the row's
 *    first attn element (the statistics' shift) is read a row ahead;
 *  - the mean and variance come from one reduction of (sum, sum of squares) about that shift, one
 *    barrier per row (the cross-warp buffer alternates with the row's parity), as in the norm's typed
 *    forward; the stored mean and rstd are the ones y is computed from, so the backward's y agrees bit
 *    for bit;
 *  - stores are whole 16-byte vectors, and attn's part without dropout is the staged bits themselves. */
template <typename T, bool CAT, bool DROP>
__global__ void __launch_bounds__(kRowBlock, DROP ? 6 : 8) hstu_output_fwd_typed(const tf_hstu_output_fwd_params p, int tpr) {
    __shared__ float2 red[2][kRowBlock / 32];
    extern __shared__ uint4 stage_buf[];
    const int t = threadIdx.x & (tpr - 1), rpb = kRowBlock / tpr;
    const int64_t rows = p.rows, n = p.cols, ycols = p.y_cols, step = (int64_t)gridDim.x * rpb;
    const int64_t col = (int64_t)t * TF_VEC;
    const bool have = col < n;
    const float inv = 1.f / (float)n;
    const Dropout d = make_dropout_fixed<DROP>(p.rng, p.p);
    write_rng_out(p.rng, p.rng_out);
    const int64_t oy = CAT ? 2 * n : 0;
    float w[TF_VEC], b[TF_VEC];
    if (have) load_params(p.w, p.b, p.w_dtype, 0, 0, col, TF_VEC, w, b);

    uint4 *const mine = stage_buf + threadIdx.x;
    const uint32_t mine_s = (uint32_t)__cvta_generic_to_shared(mine);
    constexpr int kPlanes = 2; /* per stage: attn, u */
    T c_next{};
    auto issue = [&](int64_t row, int stage) {
        if (row < rows) {
            const T *arow = (const T *)p.attn + row * p.attn_stride;
            if (have) {
                const uint32_t dst = mine_s + (uint32_t)(stage * kPlanes * kRowBlock) * 16u;
                tf_norm_typed::cp_async16_s(dst, arow + col);
                tf_norm_typed::cp_async16_s(dst + kRowBlock * 16u, (const T *)p.u + row * p.u_stride + col);
            }
            c_next = arow[0];
        }
        cp_async_commit(); /* one group per row, empty or not, so wait_group counts rows */
    };
    int stage = 0;
    issue((int64_t)blockIdx.x * rpb + threadIdx.x / tpr, 0);
    for (int64_t r0 = (int64_t)blockIdx.x * rpb; r0 < rows; r0 += step, stage ^= 1) {
        const int64_t r = r0 + threadIdx.x / tpr;
        const bool live = r < rows; /* dead groups still meet the others in the reduction */
        const float c = tf_norm_typed::Pack<T>::to_f(c_next);
        issue(r + step, stage ^ 1);
        tf_norm_typed::cp_async_wait_but_newest(); /* this row's group has landed */
        const uint4 *const staged = mine + stage * kPlanes * kRowBlock;
        uint4 araw = make_uint4(0u, 0u, 0u, 0u); /* attn's chunk as staged: converted again for y */
        float sum = 0.f, sumsq = 0.f;
        if (live && have) {
            float a[TF_VEC];
            araw = staged[0];
            tf_norm_typed::unpack8<T>(araw, a);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                const float v = a[i] - c;
                sum += v;
                sumsq = fmaf(v, v, sumsq);
            }
        }
        const float2 g = group_sum2(make_float2(sum, sumsq), tpr, red, stage);
        const float m = g.x * inv; /* mean - c */
        const float mean = c + m, rstd = rsqrtf(fmaxf(fmaf(-m, m, g.y * inv), 0.f) + p.eps);
        if (!live) continue;
        if (t == 0) {
            p.mean[r] = mean;
            p.rstd[r] = rstd;
        }
        if (!have) continue;
        typed_write_chunk<T, CAT, DROP, false>(d, (T *)p.y + r * ycols, (uint64_t)r * (uint64_t)ycols, n, oy, col,
                                               araw, staged[kRowBlock], mean, rstd, w, b);
    }
    asm volatile("cp.async.wait_all;\n" ::); /* nothing left in flight at exit */
}

/* The typed forward's cases (see hstu_output_fwd_typed) at rows of 513 to 1024 columns: a warp per row,
 * each lane holding K = 4 chunks of attn and u in registers (chunk lane + 32 k), loaded with streaming
 * loads before any is used; the row's (sum, sum of squares) about its first element reduced by
 * butterflies (no barrier, no shared memory); the three parts stored with streaming stores. A block of
 * 4 rows, a grid over the rows (not persistent): the resident warps, each with 128 bytes a lane in
 * flight, are what keeps the loads in flight. Against the staged kernel, bf16 98304x1024 with the
 * [u, attn, y] concatenation (5 bytes moved per output byte of attn: read attn, u, write 3 parts):
 * H200 314 -> 273 us (78% -> 90% of a copy timed the same way), dropout 0.1 474 -> 447 us. At
 * 64 registers (8 blocks an SM) it spills: 291 us; at 128 (4 blocks), 302 us. */
template <typename T, bool CAT, bool DROP>
__global__ void __launch_bounds__(kRowBlock, 6) hstu_output_fwd_warp(const tf_hstu_output_fwd_params p) {
    constexpr int K = 4;
    const int lane = threadIdx.x & 31;
    const int64_t rows = p.rows, n = p.cols, ycols = p.y_cols;
    const int64_t nwarps = (int64_t)gridDim.x * (kRowBlock / 32);
    const float inv = 1.f / (float)n;
    const Dropout d = make_dropout_fixed<DROP>(p.rng, p.p);
    write_rng_out(p.rng, p.rng_out);
    const int64_t oy = CAT ? 2 * n : 0;
    for (int64_t r = (int64_t)blockIdx.x * (kRowBlock / 32) + threadIdx.x / 32; r < rows; r += nwarps) {
        const T *arow = (const T *)p.attn + r * p.attn_stride, *urow = (const T *)p.u + r * p.u_stride;
        uint4 ar[K], ur[K];
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t col = (int64_t)(lane + 32 * k) * TF_VEC;
            ar[k] = col < n ? __ldcs((const uint4 *)(arow + col)) : make_uint4(0u, 0u, 0u, 0u);
            ur[k] = col < n ? __ldcs((const uint4 *)(urow + col)) : make_uint4(0u, 0u, 0u, 0u);
        }
        float c; /* the statistics' shift: the row's first element, lane 0's */
        {
            float a0[TF_VEC];
            tf_norm_typed::unpack8<T>(ar[0], a0);
            c = __shfl_sync(0xffffffffu, a0[0], 0);
        }
        float sum = 0.f, sumsq = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if ((int64_t)(lane + 32 * k) * TF_VEC >= n) continue;
            float a[TF_VEC];
            tf_norm_typed::unpack8<T>(ar[k], a);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                const float v = a[i] - c;
                sum += v;
                sumsq = fmaf(v, v, sumsq);
            }
        }
        butterfly_sum(sum, 32);
        butterfly_sum(sumsq, 32);
        const float m = sum * inv; /* mean - c */
        const float mean = c + m, rstd = rsqrtf(fmaxf(fmaf(-m, m, sumsq * inv), 0.f) + p.eps);
        if (lane == 0) {
            p.mean[r] = mean;
            p.rstd[r] = rstd;
        }
        T *const yrow = (T *)p.y + r * ycols;
        const uint64_t e_row = (uint64_t)r * (uint64_t)ycols;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t col = (int64_t)(lane + 32 * k) * TF_VEC;
            if (col >= n) continue;
            float w[TF_VEC], b[TF_VEC];
            load_params(p.w, p.b, p.w_dtype, 0, 0, col, TF_VEC, w, b);
            typed_write_chunk<T, CAT, DROP, true>(d, yrow, e_row, n, oy, col, ar[k], ur[k], mean, rstd, w, b);
        }
    }
}

/* The staged backward (K == 1, every chunk of attn, u and dY whole and 16-byte aligned): the next row's
 * attn, u and dY chunks (y's part, and attn's and u's when concatenated) are copied into shared memory
 * with cp.async while this row is worked on, as in the staged forward. Planes per stage: (tensor,
 * 16-byte piece) for attn, u, dY[y], dY[attn], dY[u], two pieces each for fp32.
 * Y: also writes the forward's y again (recompute_y_in_backward), bit for bit: the row's attn, u and
 * statistics are in hand, and each part's keep bits are the ones dY's part is masked with, drawn once. */
constexpr int kBwdStagePlanes = 10;
constexpr size_t rows_bwd_stage_bytes() { return (size_t)2 * kBwdStagePlanes * kRowBlock * 16; }

template <int K, bool STAGED, bool Y>
__global__ void __launch_bounds__(kRowBlock, rows_bwd_min_blocks<K, STAGED, Y>()) hstu_output_bwd_rows(
    const tf_hstu_output_bwd_params p, int tpr) {
    static_assert(!STAGED || K == 1, "the staged backward holds one chunk per thread");
    __shared__ float red[kRowBlock / 32][2];
    extern __shared__ uint4 stage_buf[];
    const int t = threadIdx.x & (tpr - 1), rpb = kRowBlock / tpr;
    const Dropout d = make_dropout(p.rng, p.dropout, p.p);
    const int64_t n = p.cols;
    const int64_t ou = p.cat_u ? 0 : -1, ox = p.cat_x ? (p.cat_u ? n : 0) : -1, oy = (p.cat_u + p.cat_x) * n;
    const float inv = 1.f / (float)n;
    int cn[K];
    float w[K][TF_VEC], b[K][TF_VEC], acc_w[K][TF_VEC], acc_b[K][TF_VEC];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        cn[k] = chunk_n(t + tpr * k, n);
        if constexpr (!STAGED) /* staged: read per row instead (L1 hits), not held across rows */
            load_params(p.w, p.b, p.w_dtype, 0, 0, (int64_t)(t + tpr * k) * TF_VEC, cn[k], w[k], b[k]);
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) acc_w[k][i] = acc_b[k][i] = 0.f;
    }
    const int64_t step = (int64_t)gridDim.x * rpb;
    const int dpc = p.dy_dtype == TF_F32 ? 2 : 1; /* 16-byte pieces per chunk of dY */
    auto plane = [&](int stage, int idx) -> uint4 * {
        return stage_buf + (size_t)(stage * kBwdStagePlanes + idx) * kRowBlock + threadIdx.x;
    };
    auto issue = [&](int64_t row, int stage) {
        if (row < p.rows && cn[0] > 0) {
            const char *dr = (const char *)tf_row(p.dy, p.dy_dtype, row, p.dy_stride);
            const int64_t col = (int64_t)t * TF_VEC;
            issue_attn_u(p, row, col, plane(stage, 0), plane(stage, 2));
            for (int q = 0; q < dpc; ++q) cp_async16(plane(stage, 4 + q), dr + (oy + col) * 2 * dpc + 16 * q);
            if (ox >= 0)
                for (int q = 0; q < dpc; ++q) cp_async16(plane(stage, 6 + q), dr + (ox + col) * 2 * dpc + 16 * q);
            if (ou >= 0)
                for (int q = 0; q < dpc; ++q) cp_async16(plane(stage, 8 + q), dr + (ou + col) * 2 * dpc + 16 * q);
        }
        cp_async_commit(); /* one group per row, empty or not, so wait_group counts rows */
    };
    int stage = 0;
    if constexpr (STAGED) issue((int64_t)blockIdx.x * rpb + threadIdx.x / tpr, 0);
    for (int64_t r0 = (int64_t)blockIdx.x * rpb; r0 < p.rows; r0 += step, stage ^= 1) {
        const int64_t r = r0 + threadIdx.x / tpr;
        const bool live = r < p.rows; /* dead groups still meet the others in group_sum */
        const void *dyrow = tf_row(p.dy, p.dy_dtype, r, p.dy_stride);
        const float mean = live ? p.mean[r] : 0.f, rstd = live ? p.rstd[r] : 0.f;
        const uint64_t e_row = (uint64_t)r * (uint64_t)p.y_cols;
        /* every load of the row issued before the first is used; then a -> xhat, gy -> its masked value */
        float xh[K][TF_VEC], u[K][TF_VEC], gy[K][TF_VEC], tx[K][TF_VEC], tu[K][TF_VEC];
        if constexpr (STAGED) {
            issue(r + step, stage ^ 1);
            cp_async_wait<1>(); /* this row's group has landed */
            /* dY's u and attn parts are read from the stage where they are used (the stage holds this
             * row until the next iteration's issue): fewer registers live across the reduction */
            if (live && cn[0] > 0) {
                stage_to_float(plane(stage, 0), plane(stage, 1), p.attn_dtype, xh[0]);
                stage_to_float(plane(stage, 2), plane(stage, 3), p.u_dtype, u[0]);
                stage_to_float(plane(stage, 4), plane(stage, 5), p.dy_dtype, gy[0]);
            } else {
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) xh[0][i] = u[0][i] = gy[0][i] = 0.f;
            }
        } else {
            const void *arow = tf_row(p.attn, p.attn_dtype, r, p.attn_stride);
            const void *urow = tf_row(p.u, p.u_dtype, r, p.u_stride);
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int m = live ? cn[k] : 0;
                const int64_t col = (int64_t)(t + tpr * k) * TF_VEC;
                tf_ld_chunk(arow, p.attn_dtype, col, m, xh[k]);
                tf_ld_chunk(urow, p.u_dtype, col, m, u[k]);
                tf_ld_chunk(dyrow, p.dy_dtype, oy + col, m, gy[k]);
                if (K == 1 && ox >= 0) tf_ld_chunk(dyrow, p.dy_dtype, ox + col, m, tx[k]);
                if (K == 1 && ou >= 0) tf_ld_chunk(dyrow, p.dy_dtype, ou + col, m, tu[k]);
            }
        }
        float s[2] = {0.f, 0.f};
        float dx[K][TF_VEC]; /* dn * w, rounded as in da below */
        uint32_t bx[K];      /* Y: the keep bits of attn's part, for y's and then dY's */
        void *durow = tf_row(p.du, p.du_dtype, r, n);
        void *yrow = Y ? tf_row(p.y, p.y_dtype, r, p.y_cols) : nullptr;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int m = live ? cn[k] : 0;
            const int64_t col = (int64_t)(t + tpr * k) * TF_VEC;
            const uint32_t by = mask_bits(d, e_row + oy + col, m);
            apply_bits(d, by, m, gy[k]);
            if constexpr (STAGED) /* after the mask's draws: not live across them */
                load_params(p.w, p.b, p.w_dtype, 0, 0, col, cn[k], w[k], b[k]);
            float du[TF_VEC], gm[TF_VEC], fmv[TF_VEC], yv[TF_VEC], ya[TF_VEC];
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                float fm;
                hstu_act_fg(u[k][i], p.mul_act, fm, gm[i]); /* the one exponential of this element */
                if constexpr (Y) {
                    fmv[i] = fm;
                    ya[i] = xh[k][i]; /* attn as read */
                }
                xh[k][i] = i < m ? xhat_of(xh[k][i], mean, rstd) : 0.f;
                const float dn = i < m ? gy[k][i] * fm : 0.f;
                dx[k][i] = __fmul_rn(dn, w[k][i]);
                s[0] += dx[k][i];
                s[1] += dx[k][i] * xh[k][i];
                acc_w[k][i] += dn * xh[k][i];
                acc_b[k][i] += dn;
                du[i] = gy[k][i] * (xh[k][i] * w[k][i] + b[k][i]) * gm[i];
                if constexpr (Y) yv[i] = y_of(xh[k][i], fm, w[k][i], b[k][i]);
            }
            if constexpr (STAGED) { /* dn * w waits in dY[y]'s planes (read above) for the second phase */
                *reinterpret_cast<float4 *>(plane(stage, 4)) = make_float4(dx[k][0], dx[k][1], dx[k][2], dx[k][3]);
                *reinterpret_cast<float4 *>(plane(stage, 5)) = make_float4(dx[k][4], dx[k][5], dx[k][6], dx[k][7]);
            }
            /* d u needs no row statistic: written before the row's reduction, so that only xhat, dn * w
             * and dY's attn part stay live across it (staged: nothing of the row) */
            if (m == 0) continue;
            if constexpr (Y) {
                apply_bits(d, by, m, yv);
                tf_st_chunk(yrow, p.y_dtype, oy + col, m, yv);
                if (ox >= 0) {
                    bx[k] = mask_bits(d, e_row + ox + col, m);
                    apply_bits(d, bx[k], m, ya);
                    tf_st_chunk(yrow, p.y_dtype, ox + col, m, ya);
                }
            }
            if (ou >= 0) {
                if (K > 1) tf_ld_chunk(dyrow, p.dy_dtype, ou + col, m, tu[k]); /* read only now: registers */
                if constexpr (STAGED) stage_to_float(plane(stage, 8), plane(stage, 9), p.dy_dtype, tu[k]);
                const uint32_t bu = mask_bits(d, e_row + ou + col, m);
                apply_bits(d, bu, m, tu[k]);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i)
                    du[i] += tu[k][i] * (p.cat_act == p.mul_act ? gm[i] : hstu_act_grad(u[k][i], p.cat_act));
                if constexpr (Y) {
#pragma unroll
                    for (int i = 0; i < TF_VEC; ++i)
                        yv[i] = p.cat_act == p.mul_act ? fmv[i] : hstu_act(u[k][i], p.cat_act);
                    apply_bits(d, bu, m, yv);
                    tf_st_chunk(yrow, p.y_dtype, ou + col, m, yv);
                }
            }
            tf_st_chunk(durow, p.du_dtype, col, m, du);
        }
        group_sum(s, tpr, red);
        if (!live) continue;
        const float m1 = s[0] * inv, m2 = s[1] * inv;
        void *darow = tf_row(p.dattn, p.dattn_dtype, r, n);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (cn[k] == 0) continue;
            const int64_t col = (int64_t)(t + tpr * k) * TF_VEC;
            if constexpr (STAGED) { /* xhat again from the stage, bit for bit, and dn * w back */
                float a[TF_VEC];
                stage_to_float(plane(stage, 0), plane(stage, 1), p.attn_dtype, a);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) xh[k][i] = xhat_of(a[i], mean, rstd);
                const float4 d0 = *reinterpret_cast<const float4 *>(plane(stage, 4));
                const float4 d1 = *reinterpret_cast<const float4 *>(plane(stage, 5));
                dx[k][0] = d0.x; dx[k][1] = d0.y; dx[k][2] = d0.z; dx[k][3] = d0.w;
                dx[k][4] = d1.x; dx[k][5] = d1.y; dx[k][6] = d1.z; dx[k][7] = d1.w;
            }
            float da[TF_VEC];
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                /* the product rounded before the subtraction, as in m1's terms: an FMA here would leave
                 * the product's rounding error, which rstd magnifies when the row is constant */
                da[i] = rstd * (dx[k][i] - m1 - xh[k][i] * m2);
            }
            if (ox >= 0) {
                if (K > 1) tf_ld_chunk(dyrow, p.dy_dtype, ox + col, cn[k], tx[k]); /* read only now: registers */
                if constexpr (STAGED) stage_to_float(plane(stage, 6), plane(stage, 7), p.dy_dtype, tx[k]);
                if constexpr (Y) apply_bits(d, bx[k], cn[k], tx[k]);
                else apply_mask(d, e_row + ox + col, cn[k], tx[k]);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) da[i] += tx[k][i];
            }
            tf_st_chunk(darow, p.dattn_dtype, col, cn[k], da);
        }
    }
    if constexpr (STAGED) asm volatile("cp.async.wait_all;\n" ::); /* nothing left in flight at exit */
    if (!p.dw_part && !p.db_part) return;
    float *dwp = p.dw_part ? p.dw_part + (int64_t)blockIdx.x * n : nullptr;
    float *dbp = p.db_part ? p.db_part + (int64_t)blockIdx.x * n : nullptr;
    if constexpr (K == 1) {
        __shared__ float part[kRowBlock * TF_VEC];
        store_partials_one_chunk(dwp, dbp, acc_w[0], acc_b[0], tpr, cn[0], part);
    } else { /* two chunks a thread: 128 threads a row, one row group */
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t c = (int64_t)(t + tpr * k) * TF_VEC;
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                if (i >= cn[k]) break;
                if (dwp) dwp[c + i] = acc_w[k][i];
                if (dbp) dbp[c + i] = acc_b[k][i];
            }
        }
    }
}

/* The typed backward: the typed forward's configuration (attn, u, dY, d attn, d u, y and the norm weight
 * and bias of one 16-bit type T; LayerNorm rows of a multiple of 8 columns up to 1024; SiLU), CAT (the
 * [u, attn, y] output) and DROP fixed at compile time, Y: y written again, bit for bit. Why: the staged
 * rows kernel above is issue-bound on run-time dtype, activation and concatenation branches and
 * per-store alignment checks (96 registers, 5 blocks per SM). Here one chunk of 8 per thread and tensor:
 *  - the next row's attn, u and dY parts are staged with cp.async (16-bit: one plane each), its mean and
 *    rstd read a row ahead;
 *  - the first phase forms xhat, the activation and its derivative (one exponential), d u and the
 *    weight-gradient terms, and writes d u (and y's parts); dn * w waits in the block's dx planes (shared
 *    memory) across the row's reduction (one barrier: group_sum2), so no value of the row stays in
 *    registers; the second phase forms d attn from xhat again (from the stage, bit for bit);
 *  - every gradient term's rounding is spelled out (__fmaf_rn, __fmul_rn), so the instantiations with
 *    and without Y, which share the grid, give the same gradients bit for bit. */
constexpr int bwd_typed_planes(bool cat) { return cat ? 5 : 3; } /* attn, u, dY[y] (, dY[attn], dY[u]) */

template <typename T, bool CAT, bool DROP, bool Y>
__global__ void __launch_bounds__(kRowBlock, DROP ? 5 : 6) hstu_output_bwd_typed(const tf_hstu_output_bwd_params p, int tpr) {
    constexpr int kPlanes = bwd_typed_planes(CAT);
    __shared__ float2 red[2][kRowBlock / 32];
    extern __shared__ uint4 stage_buf[];
    const int t = threadIdx.x & (tpr - 1), rpb = kRowBlock / tpr;
    const int64_t rows = p.rows, n = p.cols, step = (int64_t)gridDim.x * rpb;
    const int64_t col = (int64_t)t * TF_VEC, oy = CAT ? 2 * n : 0;
    const bool have = col < n;
    const float inv = 1.f / (float)n;
    const Dropout d = make_dropout(p.rng, DROP, p.p);
    float acc_w[TF_VEC], acc_b[TF_VEC];
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) acc_w[i] = acc_b[i] = 0.f;

    uint4 *const mine = stage_buf + threadIdx.x;
    float4 *const dx_buf = reinterpret_cast<float4 *>(stage_buf + 2 * kPlanes * kRowBlock); /* 2 planes */
    const uint32_t mine_s = (uint32_t)__cvta_generic_to_shared(mine);
    float mean_next = 0.f, rstd_next = 0.f;
    auto issue = [&](int64_t row, int stage) {
        if (row < rows) {
            if (have) {
                const uint32_t dst = mine_s + (uint32_t)(stage * kPlanes * kRowBlock) * 16u;
                const T *dyr = (const T *)p.dy + row * p.dy_stride;
                tf_norm_typed::cp_async16_s(dst, (const T *)p.attn + row * p.attn_stride + col);
                tf_norm_typed::cp_async16_s(dst + kRowBlock * 16u, (const T *)p.u + row * p.u_stride + col);
                tf_norm_typed::cp_async16_s(dst + 2 * kRowBlock * 16u, dyr + oy + col);
                if constexpr (CAT) {
                    tf_norm_typed::cp_async16_s(dst + 3 * kRowBlock * 16u, dyr + n + col);
                    tf_norm_typed::cp_async16_s(dst + 4 * kRowBlock * 16u, dyr + col);
                }
            }
            mean_next = p.mean[row];
            rstd_next = p.rstd[row];
        }
        cp_async_commit(); /* one group per row, empty or not, so wait_group counts rows */
    };
    int stage = 0;
    issue((int64_t)blockIdx.x * rpb + threadIdx.x / tpr, 0);
    for (int64_t r0 = (int64_t)blockIdx.x * rpb; r0 < rows; r0 += step, stage ^= 1) {
        const int64_t r = r0 + threadIdx.x / tpr;
        const bool live = r < rows; /* dead groups still meet the others in the reduction */
        const float mean = mean_next, rstd = rstd_next;
        issue(r + step, stage ^ 1);
        tf_norm_typed::cp_async_wait_but_newest(); /* this row's group has landed */
        const uint4 *const st = mine + stage * kPlanes * kRowBlock;
        const uint64_t e_row = (uint64_t)r * (uint64_t)p.y_cols;
        /* dn * w, rounded (m1's terms and d attn's), waits for the second phase in this thread's own slots
         * of the block's dx planes rather than in registers */
        float4 *const dx4 = dx_buf + threadIdx.x;
        float2 s = make_float2(0.f, 0.f);
        uint32_t bx = 0u; /* Y with CAT and DROP: attn's keep bits, for y's part and then dY's */
        if (live && have) {
            /* element pairs from the staged words, results packed as they come: few values live at once */
            using P = tf_norm_typed::Pack<T>;
            const uint32_t by = DROP ? mask_bits8(d, e_row + oy + col) : 0u;
            const uint32_t bu = CAT && DROP ? mask_bits8(d, e_row + col) : 0u;
            /* the norm weight and bias (of type T) read per row, L1 hits, and kept packed */
            const uint4 wraw = *(const uint4 *)((const T *)p.w + col), braw = *(const uint4 *)((const T *)p.b + col);
            const uint32_t ww[4] = {wraw.x, wraw.y, wraw.z, wraw.w}, bw[4] = {braw.x, braw.y, braw.z, braw.w};
            const uint4 araw = st[0], uraw = st[kRowBlock], graw = st[2 * kRowBlock];
            const uint4 turaw = CAT ? st[4 * kRowBlock] : make_uint4(0u, 0u, 0u, 0u);
            const uint32_t aw[4] = {araw.x, araw.y, araw.z, araw.w}, uw[4] = {uraw.x, uraw.y, uraw.z, uraw.w};
            const uint32_t gw[4] = {graw.x, graw.y, graw.z, graw.w}, tw[4] = {turaw.x, turaw.y, turaw.z, turaw.w};
            uint32_t du_p[4], yv_p[4], yu_p[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 a2 = P::to_f2(aw[j]), u2 = P::to_f2(uw[j]), g2 = P::to_f2(gw[j]), t2 = P::to_f2(tw[j]);
                const float2 w2 = P::to_f2(ww[j]), b2 = P::to_f2(bw[j]);
                float du2[2], yv2[2], yu2[2], dxv[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int i = 2 * j + h;
                    const float av = h ? a2.y : a2.x, uv = h ? u2.y : u2.x, wv = h ? w2.y : w2.x, bv = h ? b2.y : b2.x;
                    const float gy = keep_scaled(d, by, i, h ? g2.y : g2.x);
                    float fm, gm;
                    hstu_act_fg(uv, TF_ACT_SILU, fm, gm); /* the one exponential of this element */
                    const float xh = xhat_of(av, mean, rstd), dn = __fmul_rn(gy, fm);
                    const float dxi = __fmul_rn(dn, wv);
                    dxv[h] = dxi;
                    s.x = __fadd_rn(s.x, dxi);
                    s.y = __fmaf_rn(dxi, xh, s.y);
                    acc_w[i] = __fmaf_rn(dn, xh, acc_w[i]);
                    acc_b[i] = __fadd_rn(acc_b[i], dn);
                    du2[h] = __fmul_rn(__fmul_rn(gy, __fmaf_rn(xh, wv, bv)), gm);
                    if constexpr (CAT) du2[h] = __fmaf_rn(keep_scaled(d, bu, i, h ? t2.y : t2.x), gm, du2[h]);
                    if constexpr (Y) {
                        yv2[h] = keep_scaled(d, by, i, y_of(xh, fm, wv, bv));
                        yu2[h] = keep_scaled(d, bu, i, fm);
                    }
                }
                reinterpret_cast<float2 *>(dx4 + (j >> 1) * kRowBlock)[j & 1] = make_float2(dxv[0], dxv[1]);
                du_p[j] = P::from_f2(du2[0], du2[1]);
                if constexpr (Y) {
                    yv_p[j] = P::from_f2(yv2[0], yv2[1]);
                    yu_p[j] = P::from_f2(yu2[0], yu2[1]);
                }
            }
            /* d u needs no row statistic: written before the reduction, as are y's parts */
            *(uint4 *)((T *)p.du + r * n + col) = make_uint4(du_p[0], du_p[1], du_p[2], du_p[3]);
            if constexpr (Y) {
                T *const yrow = (T *)p.y + r * p.y_cols;
                *(uint4 *)(yrow + oy + col) = make_uint4(yv_p[0], yv_p[1], yv_p[2], yv_p[3]);
                if constexpr (CAT) {
                    *(uint4 *)(yrow + col) = make_uint4(yu_p[0], yu_p[1], yu_p[2], yu_p[3]);
                    if constexpr (DROP) {
                        float a[TF_VEC];
                        tf_norm_typed::unpack8<T>(araw, a);
                        bx = mask_bits8(d, e_row + n + col);
                        apply_bits(d, bx, TF_VEC, a);
                        *(uint4 *)(yrow + n + col) = tf_norm_typed::pack8<T>(a);
                    } else {
                        *(uint4 *)(yrow + n + col) = araw; /* attn as read */
                    }
                }
            }
        }
        const float2 g = group_sum2(s, tpr, red, stage);
        if (!live || !have) continue;
        const float m1 = g.x * inv, m2 = g.y * inv;
        float a[TF_VEC], da[TF_VEC];
        tf_norm_typed::unpack8<T>(st[0], a);
        const float4 d0 = dx4[0], d1 = dx4[kRowBlock];
        const float dx[TF_VEC] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) da[i] = __fmul_rn(rstd, __fmaf_rn(-xhat_of(a[i], mean, rstd), m2, __fsub_rn(dx[i], m1)));
        if constexpr (CAT) {
            float tx[TF_VEC];
            tf_norm_typed::unpack8<T>(st[3 * kRowBlock], tx);
            if constexpr (DROP) apply_bits(d, Y ? bx : mask_bits8(d, e_row + n + col), TF_VEC, tx);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) da[i] = __fadd_rn(da[i], tx[i]);
        }
        *(uint4 *)((T *)p.dattn + r * n + col) = tf_norm_typed::pack8<T>(da);
    }
    asm volatile("cp.async.wait_all;\n" ::); /* nothing left in flight at exit */
    float *dwp = p.dw_part ? p.dw_part + (int64_t)blockIdx.x * n : nullptr;
    float *dbp = p.db_part ? p.db_part + (int64_t)blockIdx.x * n : nullptr;
    /* the stages are free: every thread's copies have landed, and the first barrier there orders the
     * last reads of them before the partial sums' writes */
    if (dwp || dbp) store_partials_one_chunk(dwp, dbp, acc_w, acc_b, tpr, have ? TF_VEC : 0, reinterpret_cast<float *>(stage_buf));
}

/* The rows kernels' threads per row and chunks per thread for these params, or K = 0 when they do not
 * apply (GroupNorm, wider rows, no columns). */
struct RowMap {
    int tpr, k;
};

RowMap row_map(int64_t cols, int64_t groups, int group_weights) {
    if (group_weights || groups != 1 || cols <= 0) return {0, 0};
    const int64_t nch = (cols + TF_VEC - 1) / TF_VEC;
    if (nch > (int64_t)kRowBlock * kRowMaxK) return {0, 0};
    const int k = nch <= kRowBlock ? 1 : 2;
    const int64_t need = (nch + k - 1) / k;
    int tpr = 1;
    while (tpr < need) tpr <<= 1;
    return {tpr, k};
}

constexpr int kMaxK = 4;

/* The kernel for these params, its block size and threads per row (0: the warp-per-task kernels). */
struct Launch {
    const void *fn;
    int threads, tpr;
    size_t smem;            /* dynamic shared memory */
    bool row_grid = false;  /* a block per kRowBlock / 32 rows, not persistent; the kernel takes p alone */
};

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Every chunk of attn and u whole and 16-byte aligned in every row: the staged forward applies. */
bool fwd_stageable(const tf_hstu_output_fwd_params *p) {
    const int64_t ab = p->attn_dtype == TF_F32 ? 4 : 2, ub = p->u_dtype == TF_F32 ? 4 : 2;
    return p->cols % TF_VEC == 0 && aligned16(p->attn) && aligned16(p->u) && (p->attn_stride * ab) % 16 == 0 &&
           (p->u_stride * ub) % 16 == 0;
}

template <typename T>
const void *fwd_typed_fn(bool cat, bool drop, bool warp) {
    if (warp) {
        if (cat) return drop ? (const void *)hstu_output_fwd_warp<T, true, true> : (const void *)hstu_output_fwd_warp<T, true, false>;
        return drop ? (const void *)hstu_output_fwd_warp<T, false, true> : (const void *)hstu_output_fwd_warp<T, false, false>;
    }
    if (cat) return drop ? (const void *)hstu_output_fwd_typed<T, true, true> : (const void *)hstu_output_fwd_typed<T, true, false>;
    return drop ? (const void *)hstu_output_fwd_typed<T, false, true> : (const void *)hstu_output_fwd_typed<T, false, false>;
}

/* The typed forward's cases: LayerNorm rows of up to 1024 columns, whole aligned chunks, one 16-bit
 * dtype, SiLU (see hstu_output_fwd_typed). */
bool fwd_typed_case(const tf_hstu_output_fwd_params *p, const RowMap &m) {
    const int dt = p->attn_dtype;
    if (m.k != 1 || dt == TF_F32 || p->u_dtype != dt || p->y_dtype != dt || !fwd_stageable(p) || !aligned16(p->y))
        return false;
    const bool cat = p->cat_u && p->cat_x;
    return p->mul_act == TF_ACT_SILU && p->cat_u == p->cat_x && (!cat || p->cat_act == TF_ACT_SILU);
}

/* The typed case's kernel: a warp per row past 512 columns (hstu_output_fwd_warp), else the staged one. */
Launch fwd_typed(const tf_hstu_output_fwd_params *p, const RowMap &m) {
    const bool cat = p->cat_u && p->cat_x, drop = p->dropout != 0, warp = p->cols > 512;
    const void *fn = p->attn_dtype == TF_BF16 ? fwd_typed_fn<__nv_bfloat16>(cat, drop, warp)
                                              : fwd_typed_fn<__half>(cat, drop, warp);
    if (warp) return {fn, kRowBlock, 0, 0, true};
    return {fn, kRowBlock, m.tpr, (size_t)2 * 2 * kRowBlock * 16};
}

Launch fwd_launch(const tf_hstu_output_fwd_params *p) {
    const RowMap m = row_map(p->cols, p->groups, p->group_weights);
    if (fwd_typed_case(p, m)) return fwd_typed(p, m);
    const bool st = m.k > 0 && fwd_stageable(p);
    if (m.k == 1 && st)
        return {(const void *)hstu_output_fwd_rows<1, true>, kRowBlock, m.tpr, rows_fwd_stage_bytes<1>()};
    if (m.k == 2 && st)
        return {(const void *)hstu_output_fwd_rows<2, true>, kRowBlock, m.tpr, rows_fwd_stage_bytes<2>()};
    if (m.k == 1) return {(const void *)hstu_output_fwd_rows<1, false>, kRowBlock, m.tpr, 0};
    if (m.k == 2) return {(const void *)hstu_output_fwd_rows<2, false>, kRowBlock, m.tpr, 0};
    const int64_t nch = (p->cols / p->groups + TF_VEC - 1) / TF_VEC;
    const int w = kWarps * 32;
    if (nch <= 32) return {(const void *)hstu_output_fwd_kernel<1>, w, 0, 0};
    if (nch <= 64) return {(const void *)hstu_output_fwd_kernel<2>, w, 0, 0};
    if (nch <= 32 * kMaxK) return {(const void *)hstu_output_fwd_kernel<4>, w, 0, 0};
    return {(const void *)hstu_output_fwd_kernel<0>, w, 0, 0};
}

/* Every chunk of attn, u and dY (each of its parts) whole and 16-byte aligned: the staged backward applies. */
bool bwd_stageable(const tf_hstu_output_bwd_params *p) {
    auto bytes = [](int dt) -> int64_t { return dt == TF_F32 ? 4 : 2; };
    return p->cols % TF_VEC == 0 && aligned16(p->attn) && aligned16(p->u) && aligned16(p->dy) &&
           (p->attn_stride * bytes(p->attn_dtype)) % 16 == 0 && (p->u_stride * bytes(p->u_dtype)) % 16 == 0 &&
           (p->dy_stride * bytes(p->dy_dtype)) % 16 == 0;
}

template <typename T, bool Y>
const void *bwd_typed_fn(bool cat, bool drop) {
    if (cat)
        return drop ? (const void *)hstu_output_bwd_typed<T, true, true, Y> : (const void *)hstu_output_bwd_typed<T, true, false, Y>;
    return drop ? (const void *)hstu_output_bwd_typed<T, false, true, Y> : (const void *)hstu_output_bwd_typed<T, false, false, Y>;
}

/* The typed backward where it applies (see its definition), else a null fn. Without y (bwd_grid asks
 * what the Y kernel would be for a call that writes none) the answer must be the one a call writing y
 * gets, or the two would launch different grids: y is the attn-typed fresh tensor the op allocates. */
template <bool Y>
Launch bwd_typed(const tf_hstu_output_bwd_params *p, const RowMap &m) {
    const int dt = p->attn_dtype;
    const bool cat = p->cat_u && p->cat_x;
    if (m.k != 1 || dt == TF_F32 || p->u_dtype != dt || p->dy_dtype != dt || p->dattn_dtype != dt ||
        p->w_dtype != dt || !p->w || !p->b || !aligned16(p->w) || !aligned16(p->b) ||
        p->du_dtype != dt || (Y && p->y && (p->y_dtype != dt || !aligned16(p->y))) || !bwd_stageable(p) ||
        !aligned16(p->dattn) || !aligned16(p->du) || p->mul_act != TF_ACT_SILU || p->cat_u != p->cat_x ||
        (cat && p->cat_act != TF_ACT_SILU))
        return {nullptr, 0, 0, 0};
    const bool drop = p->dropout != 0;
    const void *fn = dt == TF_BF16 ? bwd_typed_fn<__nv_bfloat16, Y>(cat, drop) : bwd_typed_fn<__half, Y>(cat, drop);
    return {fn, kRowBlock, m.tpr, (size_t)(2 * bwd_typed_planes(cat) + 2) * kRowBlock * 16};
}

template <bool Y>
Launch bwd_rows_launch(const tf_hstu_output_bwd_params *p, const RowMap &m) {
    if (const Launch l = bwd_typed<Y>(p, m); l.fn) return l;
    if (m.k == 1 && bwd_stageable(p))
        return {(const void *)hstu_output_bwd_rows<1, true, Y>, kRowBlock, m.tpr, rows_bwd_stage_bytes()};
    if (m.k == 1) return {(const void *)hstu_output_bwd_rows<1, false, Y>, kRowBlock, m.tpr, 0};
    return {(const void *)hstu_output_bwd_rows<2, false, Y>, kRowBlock, m.tpr, 0};
}

/* The backward's kernel when it writes y again (Y) or not. */
Launch bwd_launch(const tf_hstu_output_bwd_params *p, bool y) {
    const RowMap m = row_map(p->cols, p->groups, p->group_weights);
    if (m.k > 0) return y ? bwd_rows_launch<true>(p, m) : bwd_rows_launch<false>(p, m);
    return {y ? (const void *)hstu_output_bwd_kernel<true> : (const void *)hstu_output_bwd_kernel<false>, kWarps * 32,
            0, 0};
}
Launch bwd_launch(const tf_hstu_output_bwd_params *p) { return bwd_launch(p, p->y != nullptr); }

/* Blocks of `fn` resident on the current device at once (looked up once per device and kernel). */
int64_t resident_blocks(const void *fn, int threads, size_t smem) {
    static std::mutex mu;
    static std::map<std::pair<int, const void *>, int64_t> cache;
    int dev = 0;
    cudaGetDevice(&dev);
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find({dev, fn});
    if (it != cache.end()) return it->second;
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem);
    const int64_t n = (int64_t)sms * (per_sm < 1 ? 1 : per_sm);
    cache[{dev, fn}] = n;
    return n;
}

/* Persistent grid: as many blocks as fit at once, fewer when the rows run out. The backward's rows
 * kernels own one weight-gradient partial row per block; each block there gets at least
 * kRowsPerPartial rows, so the partials stay small next to the rows for narrow rows. */
constexpr int64_t kRowsPerPartial = 16;

unsigned grid_for(const Launch &l, int64_t tasks, bool partials) {
    const int64_t per_block = l.tpr ? (int64_t)(l.threads / l.tpr) : kWarps;
    int64_t needed = (tasks + per_block - 1) / per_block;
    if (l.tpr && partials) {
        const int64_t cap = (tasks + kRowsPerPartial - 1) / kRowsPerPartial;
        if (needed > cap) needed = cap;
    }
    const int64_t res = resident_blocks(l.fn, l.threads, l.smem);
    const int64_t g = needed < res ? needed : res;
    return (unsigned)(g < 1 ? 1 : g);
}

/* The backward's grid. Each block owns a weight-gradient partial row, so the grid fixes how the rows'
 * sums are grouped; the kernels with and without the y write (recompute_y_in_backward) hold different
 * numbers of blocks per SM, and a grid sized by each one's own occupancy would group them differently
 * (the weight gradients then differ by an ulp of their dtype now and then). Both launch the grid of the
 * one that holds fewer, so the option leaves the gradients unchanged bit for bit. */
unsigned bwd_grid(const tf_hstu_output_bwd_params *p) {
    const Launch a = bwd_launch(p, false), b = bwd_launch(p, true);
    const bool a_fewer = resident_blocks(a.fn, a.threads, a.smem) <= resident_blocks(b.fn, b.threads, b.smem);
    return grid_for(a_fewer ? a : b, p->rows * p->groups, true);
}

} // namespace

extern "C" int tf_hstu_output_fwd_cuda(const tf_hstu_output_fwd_params *p, void *stream) {
    const Launch l = fwd_launch(p);
    /* with no rows one block still runs: it writes rng_out */
    const int64_t row_blocks = (p->rows + kRowBlock / 32 - 1) / (kRowBlock / 32);
    const unsigned grid = p->rows == 0 ? 1u
                          : l.row_grid  ? (unsigned)(row_blocks < 0x7fffffff ? row_blocks : 0x7fffffff)
                                        : grid_for(l, p->rows * p->groups, false);
    tf_hstu_output_fwd_params params = *p;
    int tpr = l.tpr;
    void *args_rows[] = {&params, &tpr};
    void *args_warp[] = {&params};
    return (int)cudaLaunchKernel(l.fn, dim3(grid), dim3(l.threads), l.tpr ? args_rows : args_warp, l.smem,
                                 (cudaStream_t)stream);
}

extern "C" int64_t tf_hstu_output_bwd_cuda_partials(const tf_hstu_output_bwd_params *p) {
    if (p->rows == 0) return 1;
    const Launch l = bwd_launch(p);
    const int64_t grid = bwd_grid(p);
    return l.tpr ? grid : grid * kWarps;
}

extern "C" int tf_hstu_output_bwd_cuda_writes_partials(const tf_hstu_output_bwd_params *p) {
    return p->rows > 0 && bwd_launch(p).tpr != 0; /* the rows kernels store whole partial rows at their end */
}

extern "C" int tf_hstu_output_bwd_cuda(const tf_hstu_output_bwd_params *p, void *stream) {
    if (p->rows == 0) return 0;
    const Launch l = bwd_launch(p);
    const unsigned grid = bwd_grid(p);
    if ((l.tpr ? (int64_t)grid : (int64_t)grid * kWarps) != p->n_partials) return (int)cudaErrorInvalidValue;
    tf_hstu_output_bwd_params params = *p;
    int tpr = l.tpr;
    void *args_rows[] = {&params, &tpr};
    void *args_warp[] = {&params};
    return (int)cudaLaunchKernel(l.fn, dim3(grid), dim3(l.threads), l.tpr ? args_rows : args_warp, l.smem,
                                 (cudaStream_t)stream);
}

/* Fused residual add + LayerNorm / RMSNorm on CUDA (semantics: norm_kernels.h).
 *
 * Thread mapping. A row of `cols` elements is split into chunks of 8 (tf_vec.cuh). A group of
 * blockDim.x threads (a power of two, 1..1024; in the one-row forward a multiple of 32 above 32)
 * owns one row at a time; chunk j of the row belongs to thread j % blockDim.x. Groups of at most 32
 * threads pack blockDim.y rows into a 128-thread block and reduce with warp shuffles; larger groups
 * are a whole block and reduce through shared memory.
 *
 * Six tiers of kernels, chosen per call by fwd_launch / bwd_launch:
 *  - generic (norm_fwd_kernel, norm_bwd_kernel): any dtype combination and any row length. K > 0
 *    chunks per thread in registers, or K == 0 for long rows: several passes over the row, the later
 *    ones re-reading it from L2.
 *  - fast (norm_*_fast_kernel): element sizes known at compile time, so a row's loads are all issued
 *    into raw registers before the first is converted, a row ahead of use; persistent grid. Rows up
 *    to 8192 elements.
 *  - staged forward (norm_fwd_staged_kernel): as fast, but rows whose chunks are all whole and
 *    aligned are prefetched into shared memory with cp.async, so the bytes in flight are not bounded
 *    by registers (85-88% of copy bandwidth against 70% for the fast kernel on an H100).
 *  - typed forward (norm_fwd_typed.cuh): the staged kernel's scheme with every dtype a template
 *    parameter, for x, residual and s of one 16-bit dtype; weights in registers across a block's
 *    rows, one group reduction and one barrier per row.
 *  - one-row typed forward (norm_fwd_row_kernel in norm_fwd_typed.cuh): the typed case with weights
 *    of x's dtype, a block per row group instead of a persistent grid, the row in registers (see
 *    row_launch for where it runs).
 *  - typed backward (norm_bwd_typed.cuh): the same for the backward of one 16-bit dtype throughout;
 *    s, dy and ds staged a row ahead, nothing of a row held in registers across its reduction.
 * The backward's weight gradients are summed per row slot into fp32 partial rows, then reduced by
 * column_sum_kernel in a fixed order: deterministic, no atomics.
 */
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "norm_bwd_typed.cuh"
#include "norm_fwd_typed.cuh"
#include "norm_kernels.h"
#include "tf_cp_async.cuh"
#include "tf_vec.cuh"

namespace {

constexpr int kSmallBlock = 128; /* threads per block when a group is at most one warp */
constexpr int kMaxFwdK = 4;        /* chunks per thread held in registers by the forward */
constexpr int kMaxBwdK = 2;        /* ... and by the backward */
constexpr int kMaxRegThreads = 512; /* group size of the register variants (128 registers each) */
constexpr int kMaxThreads = 1024;  /* group size of the looping variants */
constexpr int kMaxRowThreads = 512; /* group size of the one-row typed forward (1, 2 or 4 chunks a thread) */

__device__ __forceinline__ int64_t y_stride(const tf_norm_fwd_params &p) { return p.y_stride ? p.y_stride : p.cols; }

__device__ __forceinline__ int chunk_len(bool active, int64_t col, int64_t cols) {
    return active && col < cols ? (int)(cols - col < TF_VEC ? cols - col : TF_VEC) : 0;
}

/* s for one chunk: x (+ res) (+ res2), each add rounded as Python would round it. */
__device__ __forceinline__ void fwd_sum_chunk(const tf_norm_fwd_params &p, int64_t row, int64_t col, int n,
                                              float (&s)[TF_VEC]) {
    tf_load_chunk(tf_row(p.x, p.x_dtype, row, p.x_stride), p.x_dtype, col, n, s);
    if (p.res) {
        float r[TF_VEC];
        tf_load_chunk(tf_row(p.res, p.res_dtype, row, p.res_stride), p.res_dtype, col, n, r);
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) s[i] = tf_round(s[i] + r[i], p.add1_dtype);
        if (p.res2) {
            tf_load_chunk(tf_row(p.res2, p.res2_dtype, row, p.res2_stride), p.res2_dtype, col, n, r);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) s[i] = tf_round(s[i] + r[i], p.add2_dtype);
        }
    }
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) s[i] = tf_round(s[i], p.s_dtype);
}

/* y for one chunk from s and the row statistics; w/b may be NULL. */
__device__ __forceinline__ void fwd_out_chunk(const tf_norm_fwd_params &p, const void *w, const void *b,
                                              void *yrow, int64_t col, int n, float mean, float rstd,
                                              const float (&s)[TF_VEC]) {
    float wv[TF_VEC], bv[TF_VEC], y[TF_VEC];
    if (w) tf_load_chunk(w, p.w_dtype, col, n, wv);
    else {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) wv[i] = 1.f;
    }
    if (p.norm_type == TF_LAYER_NORM) {
        if (b) tf_load_chunk(b, p.w_dtype, col, n, bv);
        else {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) bv[i] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) y[i] = (s[i] - mean) * rstd * wv[i] + bv[i];
    } else if (p.norm_type == TF_RMS_NORM_LLAMA) {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i)
            y[i] = tf_round(tf_round(s[i] * rstd, p.s_dtype) * (wv[i] + p.weight_offset), p.mul_dtype);
    } else {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) y[i] = s[i] * rstd * (wv[i] + p.weight_offset);
    }
    tf_store_chunk(yrow, p.y_dtype, col, n, y);
}

template <int K>
__global__ void __launch_bounds__(K > 0 ? kMaxRegThreads : kMaxThreads) norm_fwd_kernel(const tf_norm_fwd_params p) {
    __shared__ float red[32];
    const int tpr = blockDim.x, tid = threadIdx.x;
    const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    const bool active = row < p.rows;
    const int64_t cols = p.cols;
    const bool layer = p.norm_type == TF_LAYER_NORM;
    void *srow = p.s ? tf_row(p.s, p.s_dtype, row, cols) : nullptr;
    void *yrow = tf_row(p.y, p.y_dtype, row, y_stride(p));
    void *y2row = p.y2 ? tf_row(p.y2, p.y_dtype, row, y_stride(p)) : nullptr;
    float mean = 0.f, rstd;

    if constexpr (K > 0) {
        float v[K][TF_VEC];
        int len[K];
        float sum = 0.f, sumsq = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            len[k] = chunk_len(active, col, cols);
            if (len[k] > 0) {
                fwd_sum_chunk(p, row, col, len[k], v[k]);
                if (srow) tf_store_chunk(srow, p.s_dtype, col, len[k], v[k]);
            } else {
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) v[k][i] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) { sum += v[k][i]; sumsq += v[k][i] * v[k][i]; }
        }
        if (layer) {
            mean = tf_group_sum(sum, red) / (float)cols;
            float m2 = 0.f;
#pragma unroll
            for (int k = 0; k < K; ++k)
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) {
                    const float d = v[k][i] - mean;
                    m2 += i < len[k] ? d * d : 0.f;
                }
            rstd = rsqrtf(tf_group_sum(m2, red) / (float)cols + p.eps);
        } else {
            rstd = rsqrtf(tf_group_sum(sumsq, red) / (float)cols + p.eps);
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (len[k] == 0) continue;
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            fwd_out_chunk(p, p.w, p.b, yrow, col, len[k], mean, rstd, v[k]);
            if (y2row) fwd_out_chunk(p, p.w2, p.b2, y2row, col, len[k], mean, rstd, v[k]);
        }
    } else {
        /* Long rows: pass 1 computes (and stores) s, later passes re-read it. Each thread re-reads
         * only the chunks it wrote itself, so no barrier is needed between passes. */
        float sum = 0.f, sumsq = 0.f, v[TF_VEC];
        const int64_t step = (int64_t)tpr * TF_VEC;
        for (int64_t col = (int64_t)tid * TF_VEC; col < cols; col += step) {
            const int n = chunk_len(active, col, cols);
            fwd_sum_chunk(p, row, col, n, v);
            if (srow) tf_store_chunk(srow, p.s_dtype, col, n, v);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) { sum += v[i]; sumsq += v[i] * v[i]; }
        }
        auto reload = [&](int64_t col, int n) {
            if (srow) tf_load_chunk(srow, p.s_dtype, col, n, v);
            else fwd_sum_chunk(p, row, col, n, v);
        };
        if (layer) {
            mean = tf_group_sum(sum, red) / (float)cols;
            float m2 = 0.f;
            for (int64_t col = (int64_t)tid * TF_VEC; col < cols; col += step) {
                const int n = chunk_len(active, col, cols);
                reload(col, n);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) { const float d = v[i] - mean; m2 += i < n ? d * d : 0.f; }
            }
            rstd = rsqrtf(tf_group_sum(m2, red) / (float)cols + p.eps);
        } else {
            rstd = rsqrtf(tf_group_sum(sumsq, red) / (float)cols + p.eps);
        }
        for (int64_t col = (int64_t)tid * TF_VEC; col < cols; col += step) {
            const int n = chunk_len(active, col, cols);
            reload(col, n);
            fwd_out_chunk(p, p.w, p.b, yrow, col, n, mean, rstd, v);
            if (y2row) fwd_out_chunk(p, p.w2, p.b2, y2row, col, n, mean, rstd, v);
        }
    }
    if (active && tid == 0) {
        if (p.mean) p.mean[row] = mean;
        if (p.rstd) p.rstd[row] = rstd;
    }
}

/* Weight-gradient accumulators of one thread for one chunk of columns. */
struct WGrad {
    float dw[TF_VEC], db[TF_VEC], dw2[TF_VEC], db2[TF_VEC];
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) dw[i] = db[i] = dw2[i] = db2[i] = 0.f;
    }
};

/* The backward's per-chunk work before the row reduction: xhat, g = dL/dxhat, and the chunk's
 * contribution to the weight gradients (added to acc when acc is not NULL). TWO: a second norm. */
template <bool TWO>
__device__ __forceinline__ void bwd_chunk(const tf_norm_bwd_params &p, int64_t row, int64_t col, int n,
                                          float mean, float rstd, float (&xhat)[TF_VEC], float (&g)[TF_VEC],
                                          WGrad *acc) {
    float s[TF_VEC], dy[TF_VEC], w[TF_VEC];
    tf_load_chunk(tf_row(p.s, p.s_dtype, row, p.s_stride), p.s_dtype, col, n, s);
    if (p.dy) tf_load_chunk(tf_row(p.dy, p.dy_dtype, row, p.dy_stride), p.dy_dtype, col, n, dy);
    else {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) dy[i] = 0.f;
    }
    if (p.w) tf_load_chunk(p.w, p.w_dtype, col, n, w);
    else {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) w[i] = 1.f;
    }
    float xw[TF_VEC]; /* the normalized value the weight multiplied in the forward */
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) {
        xhat[i] = i < n ? (s[i] - mean) * rstd : 0.f;
        g[i] = dy[i] * (w[i] + p.weight_offset);
        xw[i] = p.norm_type == TF_RMS_NORM_LLAMA ? tf_round(xhat[i], p.s_dtype) : xhat[i];
    }
    if (acc) {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) { acc->dw[i] += dy[i] * xw[i]; acc->db[i] += dy[i]; }
    }
    if constexpr (TWO) {
        if (p.dy2) tf_load_chunk(tf_row(p.dy2, p.dy_dtype, row, p.dy2_stride), p.dy_dtype, col, n, dy);
        else {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) dy[i] = 0.f;
        }
        tf_load_chunk(p.w2, p.w_dtype, col, n, w);
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) g[i] += dy[i] * (w[i] + p.weight_offset);
        if (acc) {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) { acc->dw2[i] += dy[i] * xw[i]; acc->db2[i] += dy[i]; }
        }
    }
}

__device__ __forceinline__ void bwd_write_chunk(const tf_norm_bwd_params &p, int64_t row, int64_t col, int n,
                                                float rstd, float mean_g, float mean_gx,
                                                const float (&xhat)[TF_VEC], const float (&g)[TF_VEC]) {
    float ds[TF_VEC];
    if (p.ds_in) tf_load_chunk(tf_row(p.ds_in, p.ds_in_dtype, row, p.ds_in_stride), p.ds_in_dtype, col, n, ds);
    else {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) ds[i] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) ds[i] += rstd * (g[i] - mean_g - xhat[i] * mean_gx);
    if (p.dx) tf_store_chunk(tf_row(p.dx, p.dx_dtype, row, p.cols), p.dx_dtype, col, n, ds);
    if (p.dres) tf_store_chunk(tf_row(p.dres, p.dres_dtype, row, p.cols), p.dres_dtype, col, n, ds);
    if (p.dres2) tf_store_chunk(tf_row(p.dres2, p.dres2_dtype, row, p.cols), p.dres2_dtype, col, n, ds);
}

/* Add (or, when `first`, store) a chunk of accumulators into partial row `slot`. */
template <bool TWO>
__device__ __forceinline__ void flush_partials(const tf_norm_bwd_params &p, int64_t slot, int64_t col, int n,
                                               const WGrad &a, bool first) {
    float *dst[4] = {p.dw_part, p.db_part, p.dw2_part, p.db2_part};
    const float *src[4] = {a.dw, a.db, a.dw2, a.db2};
#pragma unroll
    for (int t = 0; t < (TWO ? 4 : 2); ++t) {
        if (!dst[t]) continue;
        float *q = dst[t] + slot * p.cols + col;
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i)
            if (i < n) q[i] = first ? src[t][i] : q[i] + src[t][i];
    }
}

/* K > 0: K chunks per thread in registers. K == 0: rows too long for that, two passes. */
template <int K, bool TWO>
__global__ void __launch_bounds__(kMaxRegThreads) norm_bwd_kernel(const tf_norm_bwd_params p) {
    __shared__ float red[32];
    const int tpr = blockDim.x, tid = threadIdx.x;
    const int64_t slot = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    const int64_t n_slots = (int64_t)gridDim.x * blockDim.y;
    const int64_t cols = p.cols;
    const bool layer = p.norm_type == TF_LAYER_NORM;
    const float inv_cols = 1.f / (float)cols;
    constexpr int KR = K > 0 ? K : 1;
    WGrad acc[KR];
#pragma unroll
    for (int k = 0; k < KR; ++k) acc[k].zero();

    /* The trip count is uniform across the block, so every lane reaches every group reduction. */
    for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < p.rows; base += n_slots) {
        const int64_t row = base + threadIdx.y;
        const bool active = row < p.rows;
        const float mean = active && layer ? p.mean[row] : 0.f;
        const float rstd = active ? p.rstd[row] : 0.f;
        float sum_g = 0.f, sum_gx = 0.f;
        if constexpr (K > 0) {
            float xhat[K][TF_VEC], g[K][TF_VEC];
            int len[K];
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
                len[k] = chunk_len(active, col, cols);
                if (len[k] > 0) bwd_chunk<TWO>(p, row, col, len[k], mean, rstd, xhat[k], g[k], &acc[k]);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i)
                    if (i < len[k]) { sum_g += g[k][i]; sum_gx += g[k][i] * xhat[k][i]; }
            }
            const float mean_g = layer ? tf_group_sum(sum_g, red) * inv_cols : 0.f;
            const float mean_gx = tf_group_sum(sum_gx, red) * inv_cols;
#pragma unroll
            for (int k = 0; k < K; ++k)
                if (len[k] > 0)
                    bwd_write_chunk(p, row, (int64_t)(k * tpr + tid) * TF_VEC, len[k], rstd, mean_g, mean_gx,
                                    xhat[k], g[k]);
        } else {
            const bool first = base == (int64_t)blockIdx.x * blockDim.y;
            float xhat[TF_VEC], g[TF_VEC];
            for (int64_t col = (int64_t)tid * TF_VEC; col < cols; col += (int64_t)tpr * TF_VEC) {
                const int n = chunk_len(active, col, cols);
                acc[0].zero();
                bwd_chunk<TWO>(p, row, col, n, mean, rstd, xhat, g, &acc[0]);
                if (active) flush_partials<TWO>(p, slot, col, n, acc[0], first);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) if (i < n) { sum_g += g[i]; sum_gx += g[i] * xhat[i]; }
            }
            const float mean_g = layer ? tf_group_sum(sum_g, red) * inv_cols : 0.f;
            const float mean_gx = tf_group_sum(sum_gx, red) * inv_cols;
            for (int64_t col = (int64_t)tid * TF_VEC; col < cols; col += (int64_t)tpr * TF_VEC) {
                const int n = chunk_len(active, col, cols);
                bwd_chunk<TWO>(p, row, col, n, mean, rstd, xhat, g, nullptr);
                bwd_write_chunk(p, row, col, n, rstd, mean_g, mean_gx, xhat, g);
            }
        }
    }
    if constexpr (K > 0) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            const int n = chunk_len(true, col, cols);
            if (n > 0) flush_partials<TWO>(p, slot, col, n, acc[k], true);
        }
    }
}

/* ---- fast paths ----
 * For the common dtype combinations the element sizes are compile-time (x: XB, residuals: RB with
 * 0 for none; backward: gradients GB, s SB). Then all of a row's loads are issued into raw
 * registers before the first is converted, instead of one load round trip per chunk as in the
 * generic kernels above, and the grid is persistent with the weights held in registers across the
 * rows a group visits. At most kMaxFastK chunks per thread (rows up to 8192 elements). */
constexpr int kMaxFastK = 2;

__device__ __forceinline__ void load_param(const void *w, int dt, int64_t col, int n, float fill,
                                           float (&v)[TF_VEC]) {
    if (w && n > 0) tf_load_chunk(w, dt, col, n, v);
    else {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) v[i] = fill;
    }
}

template <int K, int XB, int RB>
__global__ void __launch_bounds__(kMaxRegThreads) norm_fwd_fast_kernel(const tf_norm_fwd_params p) {
    /* Registers decide how many groups an SM holds, and so how many loads are in flight: the x and
     * residual chunks are prefetched a row ahead, while the weights (L1-resident) and the rarer
     * second residual are read when needed. */
    constexpr int RS = RB ? RB : 2; /* storage size when there is no residual (unused) */
    __shared__ float red[32];
    const int tpr = blockDim.x, tid = threadIdx.x;
    const int64_t cols = p.cols, n_slots = (int64_t)gridDim.x * blockDim.y;
    const bool layer = p.norm_type == TF_LAYER_NORM;
    int len[K];
#pragma unroll
    for (int k = 0; k < K; ++k) len[k] = chunk_len(true, (int64_t)(k * tpr + tid) * TF_VEC, cols);

    TfRaw<XB> xr[K];
    TfRaw<RS> rr[K];
    auto issue_loads = [&](int64_t row) {
        if (row >= p.rows) return;
        const void *xrow = tf_row(p.x, p.x_dtype, row, p.x_stride);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (len[k] == 0) continue;
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            tf_raw_load(xr[k], xrow, col, len[k]);
            if constexpr (RB > 0) tf_raw_load(rr[k], tf_row(p.res, p.res_dtype, row, p.res_stride), col, len[k]);
        }
    };

    /* Software pipeline: once a row's raw chunks are converted to floats, the next row's loads are
     * issued into the same registers, so they are in flight during this row's reductions and
     * stores. The trip count is uniform across the block, so every lane reaches every reduction. */
    issue_loads((int64_t)blockIdx.x * blockDim.y + threadIdx.y);
    for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < p.rows; base += n_slots) {
        const int64_t row = base + threadIdx.y;
        const bool active = row < p.rows;
        float v[K][TF_VEC], sum = 0.f, sumsq = 0.f;
        void *srow = p.s ? tf_row(p.s, p.s_dtype, row, cols) : nullptr;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!active || len[k] == 0) {
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) v[k][i] = 0.f;
                continue;
            }
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            tf_raw_to_float(xr[k], p.x_dtype, v[k]);
            if constexpr (RB > 0) {
                float r[TF_VEC];
                tf_raw_to_float(rr[k], p.res_dtype, r);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) v[k][i] = tf_round(v[k][i] + r[i], p.add1_dtype);
                if (p.res2) {
                    tf_load_chunk(tf_row(p.res2, p.res2_dtype, row, p.res2_stride), p.res2_dtype, col, len[k], r);
#pragma unroll
                    for (int i = 0; i < TF_VEC; ++i) v[k][i] = tf_round(v[k][i] + r[i], p.add2_dtype);
                }
            }
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                v[k][i] = tf_round(v[k][i], p.s_dtype);
                sum += v[k][i];
                sumsq += v[k][i] * v[k][i];
            }
            if (srow) tf_store_chunk(srow, p.s_dtype, col, len[k], v[k]);
        }
        issue_loads(row + n_slots);
        float mean = 0.f, rstd;
        if (layer) {
            mean = tf_group_sum(sum, red) / (float)cols;
            float m2 = 0.f;
#pragma unroll
            for (int k = 0; k < K; ++k)
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) {
                    const float d = v[k][i] - mean;
                    m2 += i < len[k] && active ? d * d : 0.f;
                }
            rstd = rsqrtf(tf_group_sum(m2, red) / (float)cols + p.eps);
        } else {
            rstd = rsqrtf(tf_group_sum(sumsq, red) / (float)cols + p.eps);
        }
        if (!active) continue;
        void *yrow = tf_row(p.y, p.y_dtype, row, y_stride(p));
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (len[k] == 0) continue;
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            fwd_out_chunk(p, p.w, p.b, yrow, col, len[k], mean, rstd, v[k]);
            if (p.y2) fwd_out_chunk(p, p.w2, p.b2, tf_row(p.y2, p.y_dtype, row, y_stride(p)), col, len[k], mean, rstd, v[k]);
        }
        if (tid == 0) {
            if (p.mean) p.mean[row] = mean;
            if (p.rstd) p.rstd[row] = rstd;
        }
    }
}

/* Staged variant of the fast forward for aligned rows whose length is a multiple of 8 (every chunk
 * whole and 16-byte aligned): each thread copies its chunks of x and the residual for the next row
 * into shared memory with cp.async while it works on this row. The bytes in flight are then bounded
 * by shared memory rather than registers (profiling the register-prefetch kernel showed occupancy,
 * limited by registers, capping DRAM throughput near 70%). A thread reads back only what it copied
 * itself, so no barrier guards the staging buffers. Layout: planes of 16 bytes x threads, indexed
 * (stage, chunk, tensor part), so a warp's accesses are conflict-free. */

/* Planes per chunk and stage: x, then the residual, then residual2 (R2B > 0: GPT-NeoX's parallel
 * residual, whose third input would otherwise be loaded at its use, a row's latency exposed). */
template <int XB, int RB, int R2B>
__host__ __device__ constexpr int staged_chunk_planes() { return XB / 2 + RB / 2 + R2B / 2; }

template <int K, int XB, int RB, int R2B>
__global__ void __launch_bounds__(kMaxRegThreads) norm_fwd_staged_kernel(const tf_norm_fwd_params p) {
    extern __shared__ uint4 stage_buf[];
    constexpr int CP = staged_chunk_planes<XB, RB, R2B>();
    constexpr int PLANES = K * CP;
    __shared__ float red[32];
    const int tpr = blockDim.x, tid = threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y, flat = threadIdx.y * blockDim.x + tid;
    const int64_t cols = p.cols, n_slots = (int64_t)gridDim.x * blockDim.y;
    const bool layer = p.norm_type == TF_LAYER_NORM;
    bool have[K];
#pragma unroll
    for (int k = 0; k < K; ++k) have[k] = (int64_t)(k * tpr + tid) * TF_VEC < cols;
    auto plane = [&](int stage, int idx) -> uint4 * { return stage_buf + (size_t)(stage * PLANES + idx) * nthreads + flat; };

    auto issue = [&](int64_t row, int stage) {
        if (row < p.rows) {
            const char *xrow = (const char *)tf_row(p.x, p.x_dtype, row, p.x_stride);
            const char *rrow = RB ? (const char *)tf_row(p.res, p.res_dtype, row, p.res_stride) : nullptr;
            const char *r2row = R2B ? (const char *)tf_row(p.res2, p.res2_dtype, row, p.res2_stride) : nullptr;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                if (!have[k]) continue;
                const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
#pragma unroll
                for (int q = 0; q < XB / 2; ++q) cp_async16(plane(stage, k * CP + q), xrow + col * XB + 16 * q);
#pragma unroll
                for (int q = 0; q < RB / 2; ++q) cp_async16(plane(stage, k * CP + XB / 2 + q), rrow + col * RB + 16 * q);
#pragma unroll
                for (int q = 0; q < R2B / 2; ++q)
                    cp_async16(plane(stage, k * CP + XB / 2 + RB / 2 + q), r2row + col * R2B + 16 * q);
            }
        }
        cp_async_commit(); /* one group per row, empty or not, so wait_group counts rows */
    };

    int stage = 0;
    issue((int64_t)blockIdx.x * blockDim.y + threadIdx.y, 0);
    for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < p.rows; base += n_slots, stage ^= 1) {
        const int64_t row = base + threadIdx.y;
        const bool active = row < p.rows;
        issue(row + n_slots, stage ^ 1);
        cp_async_wait<1>(); /* this row's group has landed */
        float v[K][TF_VEC], sum = 0.f, sumsq = 0.f;
        void *srow = p.s ? tf_row(p.s, p.s_dtype, row, cols) : nullptr;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!active || !have[k]) {
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) v[k][i] = 0.f;
                continue;
            }
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            TfRaw<XB> xr;
#pragma unroll
            for (int q = 0; q < XB / 2; ++q) xr.q[q] = *plane(stage, k * CP + q);
            tf_raw_to_float(xr, p.x_dtype, v[k]);
            if constexpr (RB > 0) {
                TfRaw<RB> rr;
#pragma unroll
                for (int q = 0; q < RB / 2; ++q) rr.q[q] = *plane(stage, k * CP + XB / 2 + q);
                float r[TF_VEC];
                tf_raw_to_float(rr, p.res_dtype, r);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) v[k][i] = tf_round(v[k][i] + r[i], p.add1_dtype);
                if constexpr (R2B > 0) {
                    TfRaw<R2B> r2r;
#pragma unroll
                    for (int q = 0; q < R2B / 2; ++q) r2r.q[q] = *plane(stage, k * CP + XB / 2 + RB / 2 + q);
                    tf_raw_to_float(r2r, p.res2_dtype, r);
#pragma unroll
                    for (int i = 0; i < TF_VEC; ++i) v[k][i] = tf_round(v[k][i] + r[i], p.add2_dtype);
                } else if (p.res2) {
                    tf_load_chunk(tf_row(p.res2, p.res2_dtype, row, p.res2_stride), p.res2_dtype, col, TF_VEC, r);
#pragma unroll
                    for (int i = 0; i < TF_VEC; ++i) v[k][i] = tf_round(v[k][i] + r[i], p.add2_dtype);
                }
            }
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                v[k][i] = tf_round(v[k][i], p.s_dtype);
                sum += v[k][i];
                sumsq += v[k][i] * v[k][i];
            }
            if (srow) tf_store_chunk(srow, p.s_dtype, col, TF_VEC, v[k]);
        }
        float mean = 0.f, rstd;
        if (layer) {
            mean = tf_group_sum(sum, red) / (float)cols;
            float m2 = 0.f;
#pragma unroll
            for (int k = 0; k < K; ++k)
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) {
                    const float d = v[k][i] - mean;
                    m2 += have[k] && active ? d * d : 0.f;
                }
            rstd = rsqrtf(tf_group_sum(m2, red) / (float)cols + p.eps);
        } else {
            rstd = rsqrtf(tf_group_sum(sumsq, red) / (float)cols + p.eps);
        }
        if (!active) continue;
        void *yrow = tf_row(p.y, p.y_dtype, row, y_stride(p));
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!have[k]) continue;
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            fwd_out_chunk(p, p.w, p.b, yrow, col, TF_VEC, mean, rstd, v[k]);
            if (p.y2) fwd_out_chunk(p, p.w2, p.b2, tf_row(p.y2, p.y_dtype, row, y_stride(p)), col, TF_VEC, mean, rstd, v[k]);
        }
        if (tid == 0) {
            if (p.mean) p.mean[row] = mean;
            if (p.rstd) p.rstd[row] = rstd;
        }
    }
    asm volatile("cp.async.wait_all;\n" ::); /* nothing left in flight at exit */
}

template <int K, bool TWO, int GB, int SB>
__global__ void __launch_bounds__(kMaxRegThreads) norm_bwd_fast_kernel(const tf_norm_bwd_params p) {
    constexpr int K2 = TWO ? K : 1;
    __shared__ float red[32];
    const int tpr = blockDim.x, tid = threadIdx.x;
    const int64_t slot = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    const int64_t cols = p.cols, n_slots = (int64_t)gridDim.x * blockDim.y;
    const bool layer = p.norm_type == TF_LAYER_NORM, llama = p.norm_type == TF_RMS_NORM_LLAMA;
    const float inv_cols = 1.f / (float)cols;
    WGrad acc[K];
    int len[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        len[k] = chunk_len(true, (int64_t)(k * tpr + tid) * TF_VEC, cols);
        acc[k].zero();
    }

    /* Raw loads of a row's chunks, issued a row ahead (see the forward): s, dy, dy2 as soon as the
     * current row's are converted, ds_in (needed until the row's last step) after its stores. */
    TfRaw<SB> sr[K], dsr[K];
    TfRaw<GB> dyr[K], dy2r[K2];
    float mean_next = 0.f, rstd_next = 0.f;
    auto issue_grads = [&](int64_t row) {
        if (row >= p.rows) return;
        mean_next = layer ? p.mean[row] : 0.f;
        rstd_next = p.rstd[row];
        const void *srow = tf_row(p.s, p.s_dtype, row, p.s_stride);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (len[k] == 0) continue;
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            tf_raw_load(sr[k], srow, col, len[k]);
            if (p.dy) tf_raw_load(dyr[k], tf_row(p.dy, p.dy_dtype, row, p.dy_stride), col, len[k]);
            if constexpr (TWO)
                if (p.dy2) tf_raw_load(dy2r[k], tf_row(p.dy2, p.dy_dtype, row, p.dy2_stride), col, len[k]);
        }
    };
    auto issue_ds = [&](int64_t row) {
        if (row >= p.rows || !p.ds_in) return;
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (len[k] > 0)
                tf_raw_load(dsr[k], tf_row(p.ds_in, p.ds_in_dtype, row, p.ds_in_stride),
                            (int64_t)(k * tpr + tid) * TF_VEC, len[k]);
    };

    const int64_t first = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    issue_grads(first);
    issue_ds(first);
    for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < p.rows; base += n_slots) {
        const int64_t row = base + threadIdx.y;
        const bool active = row < p.rows;
        const float mean = mean_next, rstd = rstd_next;
        float xhat[K][TF_VEC], g[K][TF_VEC], sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!active || len[k] == 0) continue;
            const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
            float dy[TF_VEC], w[TF_VEC];
            tf_raw_to_float(sr[k], p.s_dtype, xhat[k]);
            if (p.dy) tf_raw_to_float(dyr[k], p.dy_dtype, dy);
            else {
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) dy[i] = 0.f;
            }
            load_param(p.w, p.w_dtype, col, len[k], 1.f, w);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                xhat[k][i] = (xhat[k][i] - mean) * rstd;
                g[k][i] = dy[i] * (w[i] + p.weight_offset);
                const float xw = llama ? tf_round(xhat[k][i], p.s_dtype) : xhat[k][i];
                acc[k].dw[i] += dy[i] * xw;
                acc[k].db[i] += dy[i];
            }
            if constexpr (TWO) {
                if (p.dy2) tf_raw_to_float(dy2r[k], p.dy_dtype, dy);
                else {
#pragma unroll
                    for (int i = 0; i < TF_VEC; ++i) dy[i] = 0.f;
                }
                load_param(p.w2, p.w_dtype, col, len[k], 1.f, w);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) {
                    g[k][i] += dy[i] * (w[i] + p.weight_offset);
                    const float xw = llama ? tf_round(xhat[k][i], p.s_dtype) : xhat[k][i];
                    acc[k].dw2[i] += dy[i] * xw;
                    acc[k].db2[i] += dy[i];
                }
            }
            /* padding lanes have dy = 0, hence g = 0: they add nothing */
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                sum_g += g[k][i];
                sum_gx += g[k][i] * xhat[k][i];
            }
        }
        issue_grads(row + n_slots);
        const float mean_g = layer ? tf_group_sum(sum_g, red) * inv_cols : 0.f;
        const float mean_gx = tf_group_sum(sum_gx, red) * inv_cols;
        if (active) {
#pragma unroll
            for (int k = 0; k < K; ++k) {
                if (len[k] == 0) continue;
                const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
                float ds[TF_VEC];
                if (p.ds_in) tf_raw_to_float(dsr[k], p.ds_in_dtype, ds);
                else {
#pragma unroll
                    for (int i = 0; i < TF_VEC; ++i) ds[i] = 0.f;
                }
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) ds[i] += rstd * (g[k][i] - mean_g - xhat[k][i] * mean_gx);
                if (p.dx) tf_store_chunk(tf_row(p.dx, p.dx_dtype, row, cols), p.dx_dtype, col, len[k], ds);
                if (p.dres) tf_store_chunk(tf_row(p.dres, p.dres_dtype, row, cols), p.dres_dtype, col, len[k], ds);
                if (p.dres2)
                    tf_store_chunk(tf_row(p.dres2, p.dres2_dtype, row, cols), p.dres2_dtype, col, len[k], ds);
            }
        }
        issue_ds(row + n_slots);
    }
#pragma unroll
    for (int k = 0; k < K; ++k)
        if (len[k] > 0) flush_partials<TWO>(p, slot, (int64_t)(k * tpr + tid) * TF_VEC, len[k], acc[k], true);
}

/* out[c] = sum_k part[k][c] in a fixed order, for each of gridDim.y planes of partial rows (plane z at
 * part + z * plane, summed into outs[z]). Block (32, kSumLanes): x picks the column, lane y sums the
 * partial rows y, y + kSumLanes, ... in order, eight loads in flight; the kSumLanes sums are then added in
 * y order. Why so many lanes per column: a persistent grid leaves one partial row per row slot (about a
 * thousand at 1024 columns) while few columns make few blocks, so each column's chain of loads must be
 * short and overlapped; the weight's and the bias's planes go in one launch for the same reason. */
constexpr int kSumLanes = 32;
constexpr int kSumInFlight = 8;

struct SumOuts {
    void *out[2];
};

__global__ void __launch_bounds__(32 * kSumLanes) column_sum_kernel(const float *part, int64_t plane,
                                                                    int64_t n_partials, int64_t cols, SumOuts outs,
                                                                    int out_dtype) {
    __shared__ float acc[kSumLanes][33];
    const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
    part += (int64_t)blockIdx.y * plane;
    float a = 0.f;
    if (c < cols) {
        int64_t k = threadIdx.y;
        for (; k + (kSumInFlight - 1) * kSumLanes < n_partials; k += kSumInFlight * kSumLanes) {
            float v[kSumInFlight];
#pragma unroll
            for (int i = 0; i < kSumInFlight; ++i) v[i] = part[(k + i * kSumLanes) * cols + c];
#pragma unroll
            for (int i = 0; i < kSumInFlight; ++i) a += v[i];
        }
        for (; k < n_partials; k += kSumLanes) a += part[k * cols + c];
    }
    acc[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        float t = 0.f;
        for (int y = 0; y < kSumLanes; ++y) t += acc[y][threadIdx.x];
        void *out = outs.out[blockIdx.y];
        if (out_dtype == TF_F32) ((float *)out)[c] = t;
        else if (out_dtype == TF_BF16) ((__nv_bfloat16 *)out)[c] = __float2bfloat16_rn(t);
        else ((__half *)out)[c] = __float2half_rn(t);
    }
}

int next_pow2(int64_t v) {
    int p = 1;
    while (p < v) p <<= 1;
    return p;
}

struct Launch {
    dim3 block;
    int k;          /* chunks per thread in registers; 0: looping variant */
    const void *fn; /* the kernel */
    bool persistent;
    size_t smem = 0; /* dynamic shared memory */
};

/* Groups of up to a warp for short rows; otherwise the fewest threads that keep at most kmax
 * chunks each in registers, or the looping variant (loop_threads) when even kMaxRegThreads cannot. */
Launch shape(int64_t cols, int kmax, int loop_threads) {
    const int64_t chunks = (cols + TF_VEC - 1) / TF_VEC;
    if (chunks <= 32) {
        const int tpr = next_pow2(chunks);
        return {dim3(tpr, kSmallBlock / tpr), 1, nullptr, false};
    }
    int tpr = next_pow2((chunks + kmax - 1) / kmax);
    if (tpr < 32) tpr = 32;
    if (tpr > kMaxRegThreads) return {dim3(loop_threads, 1), 0, nullptr, false};
    return {dim3(tpr, tpr == 32 ? kSmallBlock / 32 : 1), (int)((chunks + tpr - 1) / tpr), nullptr, false};
}

int elem_size(int dt) { return dt == TF_F32 ? 4 : 2; }

template <int K>
const void *fwd_fast(int xb, int rb) {
    if (xb == 2) {
        if (rb == 0) return (const void *)norm_fwd_fast_kernel<K, 2, 0>;
        if (rb == 2) return (const void *)norm_fwd_fast_kernel<K, 2, 2>;
        return (const void *)norm_fwd_fast_kernel<K, 2, 4>;
    }
    if (rb == 0) return (const void *)norm_fwd_fast_kernel<K, 4, 0>;
    if (rb == 4) return (const void *)norm_fwd_fast_kernel<K, 4, 4>;
    return nullptr; /* fp32 x with a 16-bit residual: generic kernel */
}

template <int K>
const void *fwd_staged(int xb, int rb, int r2b) {
    if (xb == 2) {
        if (rb == 0) return (const void *)norm_fwd_staged_kernel<K, 2, 0, 0>;
        if (rb == 2) return r2b == 2 ? (const void *)norm_fwd_staged_kernel<K, 2, 2, 2>
                                     : (const void *)norm_fwd_staged_kernel<K, 2, 2, 0>;
        return (const void *)norm_fwd_staged_kernel<K, 2, 4, 0>;
    }
    if (rb == 0) return (const void *)norm_fwd_staged_kernel<K, 4, 0, 0>;
    if (rb == 4) return (const void *)norm_fwd_staged_kernel<K, 4, 4, 0>;
    return nullptr;
}

bool aligned_rows(const void *base, int64_t stride, int dt) {
    return ((uintptr_t)base & 15u) == 0 && (stride * elem_size(dt)) % 16 == 0;
}

/* The typed forwards' instances, picked by (K, residual, norm type) at run time: the persistent typed
 * kernel (K 1 or 2) and the one-row kernel (K 1 or 2, and 4 without a residual). */
struct TypedKernels {
    static constexpr int kMaxK = 2;
    template <typename T, int K, bool RES, int NT>
    static const void *fn() { return (const void *)tf_norm_typed::norm_fwd_typed_kernel<T, K, RES, NT>; }
};
struct RowKernels {
    static constexpr int kMaxK = 4;
    template <typename T, int K, bool RES, int NT>
    static const void *fn() { return (const void *)tf_norm_typed::norm_fwd_row_kernel<T, K, RES, NT>; }
};

template <class Kernels, typename T, int K, bool RES>
const void *fwd_instance_nt(int nt) {
    if (nt == TF_LAYER_NORM) return Kernels::template fn<T, K, RES, TF_LAYER_NORM>();
    if (nt == TF_RMS_NORM_LLAMA) return Kernels::template fn<T, K, RES, TF_RMS_NORM_LLAMA>();
    return Kernels::template fn<T, K, RES, TF_RMS_NORM_GEMMA>();
}

template <class Kernels, typename T>
const void *fwd_instance(int k, bool res, int nt) {
    if (k == 1) return res ? fwd_instance_nt<Kernels, T, 1, true>(nt) : fwd_instance_nt<Kernels, T, 1, false>(nt);
    if (k == 2) return res ? fwd_instance_nt<Kernels, T, 2, true>(nt) : fwd_instance_nt<Kernels, T, 2, false>(nt);
    if constexpr (Kernels::kMaxK >= 4)
        if (!res) return fwd_instance_nt<Kernels, T, 4, false>(nt);
    return nullptr;
}

/* The compile-time-dtype kernel (norm_fwd_typed.cuh) where it applies: x, residual, s (and so y) of
 * one 16-bit dtype, no second residual or norm. The llama cast's product is then rounded to that
 * dtype or not at all (mul_dtype is s's dtype or fp32), which the store's rounding covers. */
bool typed_case(const tf_norm_fwd_params *p) {
    const int dt = p->x_dtype;
    if (dt == TF_F32 || p->res2 || p->y2 || p->s_dtype != dt || (p->res && p->res_dtype != dt)) return false;
    return !(p->norm_type == TF_RMS_NORM_LLAMA && p->mul_dtype != dt && p->mul_dtype != TF_F32);
}

const void *fwd_typed(const tf_norm_fwd_params *p, int k) {
    if (!typed_case(p)) return nullptr;
    const int dt = p->x_dtype;
    const bool res = p->res != nullptr;
    return dt == TF_BF16 ? fwd_instance<TypedKernels, __nv_bfloat16>(k, res, p->norm_type)
                         : fwd_instance<TypedKernels, __half>(k, res, p->norm_type);
}

/* The one-row forward (norm_fwd_row_kernel) for the typed case with a weight and bias of x's dtype
 * (16-byte aligned) or none. Where it runs is measured against the persistent typed kernel, bf16:
 * - with a residual, rows up to 8192 elements: 0.93-0.96x the time on an H100 (360 against 384 us at
 *   32768x4096), 0.91-0.94x on an H200 (262 against 288);
 * - without one, rows of 512-8192 elements with two chunks a thread, four past 2048 elements (32
 *   or 64 bytes in flight a thread): on an H100 0.92-0.96x the time (RMSNorm 95 against 102 us at
 *   65536x1024, 183 against 198 at 65536x2048; LayerNorm 182 against 194 at 16384x8192), on an
 *   H200 0.90-0.95x (RMSNorm 69 against 77 us at 65536x1024, 131 against 144 at 65536x2048, 132
 *   against 147 at 16384x8192). One chunk a thread lost on the H200 (LayerNorm 87 against 77 us at
 *   65536x1024, 185 against 143 at 65536x2048), and two at 8192 (LayerNorm 161 against 148): the
 *   faster memory needs more bytes in flight a thread than one row's chunk holds.
 * Launch: K chunks per thread (with a residual 2 past 2048 columns; plain rows 2 from 512 columns
 * and 4 past 2048), a group of chunks / K threads rounded up to a multiple of 32 (a power of two
 * below 32, several rows per 128-thread block); not persistent. */
bool row_launch(const tf_norm_fwd_params *p, Launch &l) {
    const int64_t chunks = p->cols / TF_VEC;
    if (chunks > 2 * kMaxRowThreads || !typed_case(p)) return false;
    if (p->w && (p->w_dtype != p->x_dtype || ((uintptr_t)p->w & 15u) != 0)) return false;
    if (p->norm_type == TF_LAYER_NORM && p->b && ((uintptr_t)p->b & 15u) != 0) return false;
    const int k = p->res ? (chunks > 256 ? 2 : 1) : (chunks > 256 ? 4 : chunks >= 64 ? 2 : 1);
    int tpr = (int)((chunks + k - 1) / k);
    tpr = tpr <= 32 ? next_pow2(tpr) : (tpr + 31) / 32 * 32;
    const bool res = p->res != nullptr;
    l.block = dim3(tpr, tpr <= 32 ? kSmallBlock / tpr : 1);
    l.k = k;
    l.fn = p->x_dtype == TF_BF16 ? fwd_instance<RowKernels, __nv_bfloat16>(k, res, p->norm_type)
                                 : fwd_instance<RowKernels, __half>(k, res, p->norm_type);
    l.persistent = false;
    l.smem = 0;
    return true;
}

Launch fwd_launch(const tf_norm_fwd_params *p) {
    Launch l = shape(p->cols, kMaxFastK, kMaxThreads);
    const int rb = p->res ? elem_size(p->res_dtype) : 0;
    const bool res2_ok = !p->res2 || elem_size(p->res2_dtype) == rb;
    if (l.k > 0 && res2_ok) {
        const int xb = elem_size(p->x_dtype);
        const bool staged = p->cols % TF_VEC == 0 && aligned_rows(p->x, p->x_stride, p->x_dtype) &&
                            (!p->res || aligned_rows(p->res, p->res_stride, p->res_dtype));
        /* residual2 is staged too where all three inputs are 16-bit and its rows aligned */
        const int r2b = p->res2 && xb == 2 && rb == 2 && aligned_rows(p->res2, p->res2_stride, p->res2_dtype) ? 2 : 0;
        if (staged && row_launch(p, l)) return l;
        if (staged && (l.fn = fwd_typed(p, l.k)) != nullptr) {
            l.smem = (size_t)2 * l.k * (p->res ? 2 : 1) * l.block.x * l.block.y * 16;
        } else if (staged) {
            l.fn = l.k == 1 ? fwd_staged<1>(xb, rb, r2b) : fwd_staged<2>(xb, rb, r2b);
            l.smem = (size_t)2 * l.k * (xb / 2 + rb / 2 + r2b / 2) * l.block.x * l.block.y * 16;
        } else {
            l.fn = l.k == 1 ? fwd_fast<1>(xb, rb) : fwd_fast<2>(xb, rb);
        }
        l.persistent = l.fn != nullptr;
    }
    if (!l.fn) { /* generic kernels: up to 4 chunks per thread, then the looping variant */
        l = shape(p->cols, kMaxFwdK, kMaxThreads);
        const void *fns[] = {(const void *)norm_fwd_kernel<0>, (const void *)norm_fwd_kernel<1>,
                             (const void *)norm_fwd_kernel<2>, (const void *)norm_fwd_kernel<3>,
                             (const void *)norm_fwd_kernel<4>};
        l.fn = fns[l.k];
    }
    return l;
}

template <bool TWO>
const void *bwd_fast(int gb, int sb) { /* one chunk per thread */
    if (gb == 2) return sb == 2 ? (const void *)norm_bwd_fast_kernel<1, TWO, 2, 2> : (const void *)norm_bwd_fast_kernel<1, TWO, 2, 4>;
    return sb == 2 ? (const void *)norm_bwd_fast_kernel<1, TWO, 4, 2> : (const void *)norm_bwd_fast_kernel<1, TWO, 4, 4>;
}

template <typename T, bool DS>
const void *bwd_typed_nt(int nt) {
    using tf_norm_typed::norm_bwd_typed_kernel;
    if (nt == TF_LAYER_NORM) return (const void *)norm_bwd_typed_kernel<T, TF_LAYER_NORM, DS>;
    if (nt == TF_RMS_NORM_LLAMA) return (const void *)norm_bwd_typed_kernel<T, TF_RMS_NORM_LLAMA, DS>;
    return (const void *)norm_bwd_typed_kernel<T, TF_RMS_NORM_GEMMA, DS>;
}

/* The compile-time-dtype backward (norm_bwd_typed.cuh) where it applies: s, dy, ds_in and every
 * written gradient of one 16-bit dtype, one norm, whole aligned chunks, one chunk per thread. */
bool bwd_typed(const tf_norm_bwd_params *p, Launch &l) {
    const int dt = p->s_dtype;
    const int64_t chunks = p->cols / TF_VEC;
    if (dt == TF_F32 || p->w2 || !p->dy || p->dy_dtype != dt || p->cols % TF_VEC != 0 ||
        chunks > tf_norm_typed::kBwdThreads)
        return false;
    if (p->ds_in && p->ds_in_dtype != dt) return false;
    if (!aligned_rows(p->s, p->s_stride, dt) || !aligned_rows(p->dy, p->dy_stride, dt) ||
        (p->ds_in && !aligned_rows(p->ds_in, p->ds_in_stride, dt)))
        return false;
    void *const outs[3] = {p->dx, p->dres, p->dres2};
    const int out_dt[3] = {p->dx_dtype, p->dres_dtype, p->dres2_dtype};
    for (int i = 0; i < 3; ++i)
        if (outs[i] && (out_dt[i] != dt || ((uintptr_t)outs[i] & 15u) != 0)) return false;
    const bool ds = p->ds_in != nullptr;
    l.fn = dt == TF_BF16 ? (ds ? bwd_typed_nt<__nv_bfloat16, true>(p->norm_type)
                               : bwd_typed_nt<__nv_bfloat16, false>(p->norm_type))
                         : (ds ? bwd_typed_nt<__half, true>(p->norm_type) : bwd_typed_nt<__half, false>(p->norm_type));
    const int tpr = next_pow2(chunks);
    l.block = dim3(tpr, tpr < 32 ? kSmallBlock / tpr : (tpr == 32 ? kSmallBlock / 32 : 1));
    l.k = 1;
    l.persistent = true;
    l.smem = (size_t)2 * (ds ? 3 : 2) * l.block.x * l.block.y * 16;
    return true;
}

Launch bwd_launch(const tf_norm_bwd_params *p) {
    {
        Launch t{};
        if (bwd_typed(p, t)) return t;
    }
    const bool two = p->w2 != nullptr;
    const int gb = elem_size(p->dy_dtype), sb = elem_size(p->s_dtype);
    const bool ds_ok = !p->ds_in || elem_size(p->ds_in_dtype) == sb;
    /* Two norms, or fp32 s / gradients, enlarge the per-chunk state: one chunk per thread keeps
     * those variants unspilled; two chunks per thread only for 16-bit s and gradients, one norm.
     * (A cp.async-staged backward like the forward's measured no faster: its occupancy stays
     * register-bound by the weight-gradient sums.) */
    const bool wide = two || gb == 4 || sb == 4;
    Launch l = shape(p->cols, wide ? 1 : kMaxBwdK, kMaxRegThreads);
    l.persistent = true;
    if (l.k > 0 && ds_ok) {
        if (two) l.fn = bwd_fast<true>(gb, sb);
        else l.fn = l.k == 1 ? bwd_fast<false>(gb, sb) : (const void *)norm_bwd_fast_kernel<2, false, 2, 2>;
        return l;
    }
    l = shape(p->cols, two ? 1 : kMaxBwdK, kMaxRegThreads);
    l.persistent = true;
    const void *fns[3][2] = {{(const void *)norm_bwd_kernel<0, false>, (const void *)norm_bwd_kernel<0, true>},
                             {(const void *)norm_bwd_kernel<1, false>, (const void *)norm_bwd_kernel<1, true>},
                             {(const void *)norm_bwd_kernel<2, false>, nullptr}};
    l.fn = fns[l.k][two];
    return l;
}

/* Blocks of this kernel that fit on the device at once, looked up once per kernel, block shape,
 * shared memory and device (which also raises the kernel's dynamic shared memory limit). */
int64_t resident_blocks(const void *fn, int threads, size_t smem) {
    static std::mutex mu;
    static std::map<std::tuple<int, const void *, int, size_t>, int64_t> cache;
    int dev = 0;
    cudaGetDevice(&dev);
    std::lock_guard<std::mutex> lock(mu);
    auto key = std::make_tuple(dev, fn, threads, smem);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    if (smem > 0) {
        /* Opt in once to all the dynamic shared memory the device allows this kernel (static +
         * dynamic over 48 KB needs it). Setting just this launch's size could lower the limit
         * below what an earlier, larger launch of the same kernel relies on. */
        static std::set<std::pair<int, const void *>> opted;
        if (opted.insert({dev, fn}).second) {
            int optin = 0;
            cudaFuncAttributes attr{};
            cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
            cudaFuncGetAttributes(&attr, fn);
            cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, optin - (int)attr.sharedSizeBytes);
        }
    }
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem);
    const int64_t n = (int64_t)sms * (per_sm < 1 ? 1 : per_sm);
    cache[key] = n;
    return n;
}

unsigned grid_for(const Launch &l, int64_t rows) {
    const int64_t needed = (rows + l.block.y - 1) / l.block.y;
    if (!l.persistent) return (unsigned)needed;
    const int64_t res = resident_blocks(l.fn, l.block.x * l.block.y, l.smem);
    return (unsigned)(res < needed ? res : needed);
}

cudaError_t launch(const Launch &l, unsigned grid, void *params, cudaStream_t st) {
    void *args[] = {params};
    return cudaLaunchKernel(l.fn, dim3(grid), l.block, args, l.smem, st);
}

} // namespace

extern "C" int tf_norm_fwd_cuda(const tf_norm_fwd_params *p, void *stream) {
    if (p->rows == 0) return 0;
    const Launch l = fwd_launch(p);
    tf_norm_fwd_params params = *p;
    return (int)launch(l, grid_for(l, p->rows), &params, (cudaStream_t)stream);
}

extern "C" int64_t tf_norm_bwd_cuda_partials(const tf_norm_bwd_params *p) {
    if (p->rows == 0) return 1;
    const Launch l = bwd_launch(p);
    return (int64_t)grid_for(l, p->rows) * l.block.y;
}

extern "C" int tf_norm_bwd_cuda(const tf_norm_bwd_params *p, void *stream) {
    if (p->rows == 0) return 0;
    const Launch l = bwd_launch(p);
    const unsigned grid = grid_for(l, p->rows);
    if ((int64_t)grid * l.block.y != p->n_partials) return (int)cudaErrorInvalidValue;
    tf_norm_bwd_params params = *p;
    return (int)launch(l, grid, &params, (cudaStream_t)stream);
}

extern "C" int tf_column_sum_cuda(const float *part, int64_t n_partials, int64_t cols, void *out, int out_dtype,
                                  void *stream) {
    if (cols == 0) return 0;
    const dim3 grid((unsigned)((cols + 31) / 32)), block(32, kSumLanes);
    column_sum_kernel<<<grid, block, 0, (cudaStream_t)stream>>>(part, 0, n_partials, cols, SumOuts{{out, out}},
                                                                 out_dtype);
    return (int)cudaGetLastError();
}

extern "C" int tf_column_sum2_cuda(const float *part, int64_t n_partials, int64_t cols, void *out0, void *out1,
                                   int out_dtype, void *stream) {
    if (cols == 0) return 0;
    const dim3 grid((unsigned)((cols + 31) / 32), 2), block(32, kSumLanes);
    column_sum_kernel<<<grid, block, 0, (cudaStream_t)stream>>>(part, n_partials * cols, n_partials, cols,
                                                                 SumOuts{{out0, out1}}, out_dtype);
    return (int)cudaGetLastError();
}

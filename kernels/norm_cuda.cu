/* Fused residual add + LayerNorm / RMSNorm on CUDA (semantics: norm.h).
 *
 * Thread mapping. A row of `cols` elements is split into chunks of 8 (tf_vec.cuh). A group of
 * blockDim.x threads (a power of two, 1..1024) owns one row; chunk j of the row belongs to thread
 * j % blockDim.x. Groups of at most 32 threads pack blockDim.y rows into a 128-thread block and
 * reduce with warp shuffles; larger groups are a whole block and reduce through shared memory.
 *
 * Forward, K > 0: each thread keeps its K (<= 4) chunks of s in registers, so a row is read once
 * and written once (y, s). K == 0, for rows too long for registers (over 16384 elements): three
 * passes over the row, the second and third re-reading s (or x) from L2.
 *
 * Backward, K > 0 (<= 2 chunks, rows up to 8192): chunks in registers; the grid is persistent (row
 * slots = resident groups), each slot sums its rows' weight gradients in registers and writes one
 * partial row. K == 0: longer rows, two passes per row, the partial weight gradients
 * read-modify-written in the slot's own partial row. A column-sum kernel then reduces the partials
 * in a fixed order: deterministic, no atomics.
 */
#include <cuda_runtime.h>

#include "norm.h"
#include "tf_vec.cuh"

namespace {

constexpr int kSmallBlock = 128; /* threads per block when a group is at most one warp */
constexpr int kMaxFwdK = 4;        /* chunks per thread held in registers by the forward */
constexpr int kMaxBwdK = 2;        /* ... and by the backward */
constexpr int kMaxRegThreads = 512; /* group size of the register variants (128 registers each) */
constexpr int kMaxThreads = 1024;  /* group size of the looping variants */

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
    void *yrow = tf_row(p.y, p.y_dtype, row, cols);
    void *y2row = p.y2 ? tf_row(p.y2, p.y_dtype, row, cols) : nullptr;
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

/* out[c] = sum_k part[k][c] in a fixed order. Block (32, 8): x picks the column, y strides over the
 * partial rows; the 8 sums are then added in y order. */
__global__ void column_sum_kernel(const float *part, int64_t n_partials, int64_t cols, void *out, int out_dtype) {
    __shared__ float acc[8][33];
    const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
    float a = 0.f;
    if (c < cols)
        for (int64_t k = threadIdx.y; k < n_partials; k += 8) a += part[k * cols + c];
    acc[threadIdx.y][threadIdx.x] = a;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        float t = 0.f;
        for (int y = 0; y < 8; ++y) t += acc[y][threadIdx.x];
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
    int k; /* chunks per thread in registers; 0: looping variant */
};

/* Groups of up to a warp for short rows; otherwise the fewest threads that keep at most kmax
 * chunks each in registers, or the looping variant (loop_threads) when even kMaxRegThreads cannot. */
Launch config(int64_t cols, int kmax, int loop_threads) {
    const int64_t chunks = (cols + TF_VEC - 1) / TF_VEC;
    if (chunks <= 32) {
        const int tpr = next_pow2(chunks);
        return {dim3(tpr, kSmallBlock / tpr), 1};
    }
    int tpr = next_pow2((chunks + kmax - 1) / kmax);
    if (tpr < 32) tpr = 32;
    if (tpr > kMaxRegThreads) return {dim3(loop_threads, 1), 0};
    return {dim3(tpr, tpr == 32 ? kSmallBlock / 32 : 1), (int)((chunks + tpr - 1) / tpr)};
}

Launch fwd_config(int64_t cols) { return config(cols, kMaxFwdK, kMaxThreads); }
/* Two norms double the weight-gradient accumulators: one chunk per thread keeps them unspilled. */
Launch bwd_config(int64_t cols, bool two) { return config(cols, two ? 1 : kMaxBwdK, kMaxRegThreads); }

typedef void (*BwdKernel)(tf_norm_bwd_params);

BwdKernel bwd_kernel(int k, bool two) {
    switch (k) {
    case 1: return two ? norm_bwd_kernel<1, true> : norm_bwd_kernel<1, false>;
    case 2: return norm_bwd_kernel<2, false>; /* bwd_config never pairs k = 2 with two norms */
    default: return two ? norm_bwd_kernel<0, true> : norm_bwd_kernel<0, false>;
    }
}

/* Persistent grid: as many groups as can be resident, at most one per row. */
int64_t bwd_grid(int64_t rows, int64_t cols, bool two) {
    const Launch l = bwd_config(cols, two);
    const int threads = l.block.x * l.block.y;
    int dev = 0, lg = 0;
    cudaGetDevice(&dev);
    while ((1 << lg) < threads) ++lg;
    static int64_t cache[64][3][2][11]; /* device, k, two, log2(threads): resident blocks */
    int64_t &res = cache[dev & 63][l.k][two][lg];
    if (res == 0) {
        int sms = 0, per_sm = 0;
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, bwd_kernel(l.k, two), threads, 0);
        res = (int64_t)sms * (per_sm < 1 ? 1 : per_sm);
    }
    const int64_t needed = (rows + l.block.y - 1) / l.block.y;
    return res < needed ? res : needed;
}

} // namespace

extern "C" int tf_norm_fwd_cuda(const tf_norm_fwd_params *p, void *stream) {
    if (p->rows == 0) return 0;
    const Launch l = fwd_config(p->cols);
    const dim3 grid((unsigned)((p->rows + l.block.y - 1) / l.block.y));
    cudaStream_t st = (cudaStream_t)stream;
    switch (l.k) {
    case 1: norm_fwd_kernel<1><<<grid, l.block, 0, st>>>(*p); break;
    case 2: norm_fwd_kernel<2><<<grid, l.block, 0, st>>>(*p); break;
    case 3: norm_fwd_kernel<3><<<grid, l.block, 0, st>>>(*p); break;
    case 4: norm_fwd_kernel<4><<<grid, l.block, 0, st>>>(*p); break;
    default: norm_fwd_kernel<0><<<grid, l.block, 0, st>>>(*p); break;
    }
    return (int)cudaGetLastError();
}

extern "C" int64_t tf_norm_bwd_cuda_partials(int64_t rows, int64_t cols, int two_norms) {
    if (rows == 0) return 1;
    return bwd_grid(rows, cols, two_norms != 0) * bwd_config(cols, two_norms != 0).block.y;
}

extern "C" int tf_norm_bwd_cuda(const tf_norm_bwd_params *p, void *stream) {
    if (p->rows == 0) return 0;
    const bool two = p->w2 != nullptr;
    const Launch l = bwd_config(p->cols, two);
    const dim3 grid((unsigned)bwd_grid(p->rows, p->cols, two));
    if ((int64_t)grid.x * l.block.y != p->n_partials) return (int)cudaErrorInvalidValue;
    bwd_kernel(l.k, two)<<<grid, l.block, 0, (cudaStream_t)stream>>>(*p);
    return (int)cudaGetLastError();
}

extern "C" int tf_column_sum_cuda(const float *part, int64_t n_partials, int64_t cols, void *out, int out_dtype,
                                  void *stream) {
    if (cols == 0) return 0;
    const dim3 grid((unsigned)((cols + 31) / 32)), block(32, 8);
    column_sum_kernel<<<grid, block, 0, (cudaStream_t)stream>>>(part, n_partials, cols, out, out_dtype);
    return (int)cudaGetLastError();
}

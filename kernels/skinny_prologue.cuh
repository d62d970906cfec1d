/* Prologues of skinny_linear_kernel (kernels/skinny_linear_cuda.cu): what fills a block's rows of a in
 * shared memory before the GEMM.
 *
 *   skinny_row_stats: the block's LayerNorm statistics of every row from each thread's partial sums
 *     (the NORM variant's norm of a, and the HSTU output variant's norm of attn).
 *   hstu_output_rows: HSTU's output section (semantics: tf_skinny_hstu_output_params in
 *     skinny_linear_kernels.h). A block multiplies only its K-range of the concatenation [u', attn, y],
 *     so it builds only that range, but the norm of y's part needs attn's whole row: every block
 *     recomputes the statistics from global memory (a row of attn is kilobytes, the block's slice of
 *     the weight tens of kilobytes), then writes its range as fp32 values already rounded to T, which is
 *     what the output op would have stored in y and the linear read back. */
#ifndef TF_SKINNY_PROLOGUE_CUH
#define TF_SKINNY_PROLOGUE_CUH

#include <stdint.h>

#include "hstu_output_act.cuh"
#include "hstu_output_kernels.h"
#include "skinny_linear_kernels.h"
#include "tf_typed.cuh"
#include "tf_vec.cuh"

template <typename T>
__device__ __forceinline__ float skinny_rounded(float v) { return to_f<T>(from_f<T>(v)); }

/* (mean, rstd) of every row, from each thread's sums of (v - shift[m]) and of its squares; shift[m] is
 * the row's first element, the same in every thread (a one-pass variance that stays exact for
 * |mean| >> std). Rows without data have zero sums. Ends with a barrier, after which the returned
 * shared array holds the statistics. */
template <int MR, int WARPS>
__device__ __forceinline__ const float2 *skinny_row_stats(float (&sum)[MR], float (&sq)[MR], const float (&shift)[MR],
                                                          int count, float eps) {
    __shared__ float2 wsum[WARPS][MR];
    __shared__ float2 stats[MR];
    __shared__ float shifts[MR];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        if (tid == 0) shifts[m] = shift[m];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            sum[m] += __shfl_xor_sync(0xffffffffu, sum[m], o);
            sq[m] += __shfl_xor_sync(0xffffffffu, sq[m], o);
        }
        if (lane == 0) wsum[warp][m] = make_float2(sum[m], sq[m]);
    }
    __syncthreads();
    if (tid < MR) {
        float2 t = make_float2(0.f, 0.f);
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            t.x += wsum[w][tid].x;
            t.y += wsum[w][tid].y;
        }
        const float dm = t.x / (float)count;  // mean - shift
        stats[tid] = make_float2(shifts[tid] + dm, rsqrtf(fmaxf(t.y / (float)count - dm * dm, 0.f) + eps));
    }
    __syncthreads();
    return stats;
}

/* Rows m < MR of the concatenation, columns [k_lo, k_hi), into a_s[m * span + k - k_lo] (zeros for rows
 * past M). The prologue is a chain of global reads with nothing else to hide them, so each loop issues
 * its loads in batches before using any: attn's row for the statistics; u' and attn columns, which need
 * no statistics; then the first batch of y's inputs is put in flight before the statistics' reduction
 * and used after it. The caller syncs before reading a_s. */
template <typename T, int MR, int THREADS>
__device__ __forceinline__ void hstu_output_rows(const tf_skinny_hstu_output_params &q, float *a_s, int span,
                                                 int k_lo, int k_hi) {
    constexpr int B = 2;  // loads of a tensor in flight per thread
    const int M = (int)q.lin.M, n = (int)q.cols, tid = threadIdx.x;
    const int oy = (q.cat_u + q.cat_x) * n, ox = q.cat_u ? n : 0;  // y's and (with cat_x) attn's offsets
    const T *attn = (const T *)q.attn, *u = (const T *)q.u;
    float sum[MR], sq[MR], shift[MR];
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        sum[m] = sq[m] = shift[m] = 0.f;
        if (m >= M) continue;
        const T *arow = attn + (int64_t)m * q.attn_stride;
        shift[m] = to_f<T>(arow[0]);
        for (int c0 = tid; c0 < n; c0 += 2 * B * THREADS) {
            float v[2 * B];
#pragma unroll
            for (int j = 0; j < 2 * B; ++j) {
                const int c = c0 + j * THREADS;
                v[j] = c < n ? to_f<T>(arow[c]) : shift[m];
            }
#pragma unroll
            for (int j = 0; j < 2 * B; ++j) {
                const float d = v[j] - shift[m];
                sum[m] += d;
                sq[m] = fmaf(d, d, sq[m]);
            }
        }
    }
    const int pre_hi = min(k_hi, oy);  // [k_lo, pre_hi): u' and attn
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        const T *arow = attn + (int64_t)m * q.attn_stride, *urow = u + (int64_t)m * q.u_stride;
        const int hi = m < M ? pre_hi : k_hi;  // rows past M: zeros over the whole range
        for (int k0 = k_lo + tid; k0 < hi; k0 += B * THREADS) {
            float v[B];
#pragma unroll
            for (int j = 0; j < B; ++j) {
                const int k = k0 + j * THREADS;
                v[j] = m < M && k < hi ? to_f<T>(q.cat_u && k < n ? urow[k] : arow[k - ox]) : 0.f;
            }
#pragma unroll
            for (int j = 0; j < B; ++j) {
                const int k = k0 + j * THREADS;
                if (k >= hi) break;
                a_s[m * span + k - k_lo] = m < M && q.cat_u && k < n ? skinny_rounded<T>(hstu_act(v[j], q.cat_act))
                                                                      : v[j];
            }
        }
    }
    // y's columns [ky, k_hi) of rows < M, in batches t = m * nb + i of B * THREADS columns
    const int ky = max(k_lo, oy);
    const int nb = ky < k_hi ? (k_hi - ky + B * THREADS - 1) / (B * THREADS) : 0, batches = M * nb;
    float ya[B], yu[B], yw[B], yb[B];
    auto load_y = [&](int t) {
        const int m = t / nb, k0 = ky + (t - m * nb) * B * THREADS + tid;
        const T *arow = attn + (int64_t)m * q.attn_stride, *urow = u + (int64_t)m * q.u_stride;
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const int k = k0 + j * THREADS, c = k - oy;
            const bool in = k < k_hi;
            ya[j] = in ? to_f<T>(arow[c]) : 0.f;
            yu[j] = in ? to_f<T>(urow[c]) : 0.f;
            yw[j] = in && q.norm_w ? tf_load_one(q.norm_w, q.norm_dtype, c) : 1.f;
            yb[j] = in && q.norm_b ? tf_load_one(q.norm_b, q.norm_dtype, c) : 0.f;
        }
    };
    if (batches > 0) load_y(0);
    const float2 *stats = skinny_row_stats<MR, THREADS / 32>(sum, sq, shift, n, q.lin.eps);
    for (int t = 0; t < batches; ++t) {
        if (t > 0) load_y(t);
        const int m = t / nb, k0 = ky + (t - m * nb) * B * THREADS + tid;
        const float mean = stats[m].x, rstd = stats[m].y;
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const int k = k0 + j * THREADS;
            if (k >= k_hi) break;
            const float nrm = (ya[j] - mean) * rstd * yw[j] + yb[j];
            a_s[m * span + k - k_lo] = skinny_rounded<T>(hstu_act(yu[j], q.mul_act) * nrm);
        }
    }
}

#endif

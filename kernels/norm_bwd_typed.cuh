/* The norm backward of the common case, every dtype known at compile time (included by norm_cuda.cu
 * after norm_fwd_typed.cuh, whose conversions, staging and group sum it shares).
 *
 * s, dy, the gradient of s itself (ds_in, when given) and the written gradients (dx, and dres / dres2
 * when they are written) all of one 16-bit type T; one norm (no dy2 / w2); rows whose chunks are all
 * whole and 16-byte aligned, one chunk of 8 per thread (rows of up to 8192 elements). The weight may
 * be of any dtype: each block reads its columns once into fp32 registers.
 *
 * Why a kernel of its own: the fast backward converts through run-time dtype branches and prefetches
 * a row ahead in registers, which its weight-gradient sums already crowd (2 blocks per SM), so on an
 * H200 it moved a little over half of copy bandwidth. Here:
 *  - the next row of s, dy (and ds_in) is staged into shared memory with cp.async while this row is
 *    reduced and written, and its mean and rstd are read a row ahead; a thread reads back only what it
 *    copied, so no barrier guards the buffers;
 *  - nothing of the row is held in registers across its reduction: xhat and g = dy * w are formed from
 *    the stage before it (for the sums) and again after it (for dx), with the same operations, so the
 *    registers left over hold the weight and the weight-gradient sums (at most 64 per thread, 47-63
 *    by ptxas for sm_90a: at least 32 warps per SM);
 *  - (sum g, sum g * xhat) take one group reduction and one barrier per row (the cross-warp buffer
 *    alternates with the row's parity, as in the forward).
 * Each row slot (a row group of a block) adds its rows' dw = dy * xhat and db = dy into fp32 registers
 * and writes them once, as its partial row, at the end: column_sum_kernel reduces the partial rows in
 * a fixed order, so the weight gradients are the same run to run. */
#ifndef TF_NORM_BWD_TYPED_CUH
#define TF_NORM_BWD_TYPED_CUH

#include "norm_fwd_typed.cuh"

namespace tf_norm_typed {

constexpr int kBwdThreads = 1024; /* the largest block; __launch_bounds__(kBwdThreads, 1): 64 registers */

/* NT: TF_LAYER_NORM, TF_RMS_NORM_LLAMA or TF_RMS_NORM_GEMMA. DS: ds_in is given. */
template <typename T, int NT, bool DS>
__global__ void __launch_bounds__(kBwdThreads, 1) norm_bwd_typed_kernel(const tf_norm_bwd_params p) {
    extern __shared__ uint4 stage_buf[];
    __shared__ float2 red[2][32];
    constexpr bool LN = NT == TF_LAYER_NORM;
    constexpr int CP = DS ? 3 : 2; /* 16-byte planes per stage: s, dy, then ds_in */
    const int nthreads = blockDim.x * blockDim.y;
    uint4 *const mine = stage_buf + threadIdx.y * blockDim.x + threadIdx.x;
    const int64_t rows = p.rows, cols = p.cols, n_slots = (int64_t)gridDim.x * blockDim.y;
    const int64_t slot = (int64_t)blockIdx.x * blockDim.y + threadIdx.y;
    const int64_t col = (int64_t)threadIdx.x * TF_VEC;
    const bool have = col < cols;
    const float inv_cols = 1.f / (float)cols;
    const T *const s_base = (const T *)p.s;
    const T *const dy_base = (const T *)p.dy;
    const T *const ds_base = (const T *)p.ds_in;

    /* the thread's columns of w + weight_offset (the factor dy meets), once; its gradient sums */
    float w[TF_VEC], dw[TF_VEC], db[LN ? TF_VEC : 1];
    if (p.w && have) tf_load_chunk(p.w, p.w_dtype, col, TF_VEC, w);
    else {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) w[i] = 1.f;
    }
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) {
        w[i] += p.weight_offset;
        dw[i] = 0.f;
        if constexpr (LN) db[i] = 0.f;
    }

    /* staging planes: (stage, tensor) x threads of 16 bytes, conflict-free for a warp */
    const int stage_planes = CP * nthreads;
    const uint32_t mine_s = (uint32_t)__cvta_generic_to_shared(mine);
    float mean_next = 0.f, rstd_next = 0.f;
    auto issue = [&](int64_t row, int stage) {
        if (row < rows) {
            if (have) {
                const uint32_t dst = mine_s + (uint32_t)(stage * stage_planes) * 16u;
                cp_async16_s(dst, s_base + row * p.s_stride + col);
                cp_async16_s(dst + (uint32_t)nthreads * 16u, dy_base + row * p.dy_stride + col);
                if constexpr (DS) cp_async16_s(dst + (uint32_t)(2 * nthreads) * 16u, ds_base + row * p.ds_in_stride + col);
            }
            if constexpr (LN) mean_next = p.mean[row];
            rstd_next = p.rstd[row];
        }
        cp_async_commit(); /* one group per row, empty or not, so wait_group counts rows */
    };
    /* xhat and g = dy * w of the staged chunk: the same operations before and after the reduction */
    auto form = [&](const uint4 *staged, float mean, float rstd, float (&xh)[TF_VEC], float (&g)[TF_VEC],
                    float (&dy)[TF_VEC]) {
        unpack8<T>(staged[0], xh);
        unpack8<T>(staged[nthreads], dy);
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) {
            xh[i] = (xh[i] - mean) * rstd;
            g[i] = dy[i] * w[i];
        }
    };

    int stage = 0;
    issue(slot, 0);
    for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < rows; base += n_slots, stage ^= 1) {
        const int64_t row = base + threadIdx.y;
        const bool active = row < rows && have;
        const float mean = mean_next, rstd = rstd_next;
        issue(row + n_slots, stage ^ 1);
        cp_async_wait_but_newest(); /* this row's group has landed */
        const uint4 *const staged = mine + stage * stage_planes;

        float sum_g = 0.f, sum_gx = 0.f;
        if (active) {
            float xh[TF_VEC], g[TF_VEC], dy[TF_VEC];
            form(staged, mean, rstd, xh, g, dy);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                /* llama: the weight multiplied xhat rounded to s's dtype in the forward */
                const float xw = NT == TF_RMS_NORM_LLAMA ? Pack<T>::round(xh[i]) : xh[i];
                dw[i] += dy[i] * xw;
                if constexpr (LN) db[i] += dy[i];
                sum_g += g[i];
                sum_gx += g[i] * xh[i];
            }
        }
        float mean_g = 0.f, mean_gx;
        if constexpr (LN) {
            const float2 t = group_sum<2>(make_float2(sum_g, sum_gx), red[stage]);
            mean_g = t.x * inv_cols;
            mean_gx = t.y * inv_cols;
        } else {
            mean_gx = group_sum<1>(make_float2(sum_gx, 0.f), red[stage]).x * inv_cols;
        }
        if (!active) continue;

        float xh[TF_VEC], g[TF_VEC], o[TF_VEC];
        form(staged, mean, rstd, xh, g, o);
        if constexpr (DS) unpack8<T>(staged[2 * nthreads], o);
        else {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) o[i] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) o[i] += rstd * (g[i] - mean_g - xh[i] * mean_gx);
        const uint4 out = pack8<T>(o);
        const int64_t at = row * cols + col; /* the gradients are contiguous */
        if (p.dx) *(uint4 *)((T *)p.dx + at) = out;
        if (p.dres) *(uint4 *)((T *)p.dres + at) = out;
        if (p.dres2) *(uint4 *)((T *)p.dres2 + at) = out;
    }
    asm volatile("cp.async.wait_all;\n" ::); /* nothing left in flight at exit */

    if (!have) return;
    if (p.dw_part) {
        float4 *q = (float4 *)(p.dw_part + slot * cols + col);
        q[0] = make_float4(dw[0], dw[1], dw[2], dw[3]);
        q[1] = make_float4(dw[4], dw[5], dw[6], dw[7]);
    }
    if constexpr (LN) {
        if (p.db_part) {
            float4 *q = (float4 *)(p.db_part + slot * cols + col);
            q[0] = make_float4(db[0], db[1], db[2], db[3]);
            q[1] = make_float4(db[4], db[5], db[6], db[7]);
        }
    }
}

} // namespace tf_norm_typed

#endif /* TF_NORM_BWD_TYPED_CUH */

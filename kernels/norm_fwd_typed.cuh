/* The norm forward of the common case, every dtype known at compile time (included by norm_cuda.cu).
 *
 * x, the residual, s and y all of one 16-bit type T; no second residual or second norm; rows whose
 * chunks are all whole and 16-byte aligned. Within those, weight / bias may be of any dtype: they
 * are read once per block into fp32 registers and kept across the rows the block visits.
 *
 * Why a kernel of its own: the dtype-generic kernels spend most of their issue slots on run-time
 * dtype and norm-type branches, alignment checks and per-row weight reloads (profiled on an H100:
 * ~9 cycles per issued instruction over 32 warps per SM, so issue-bound at 54% of DRAM bandwidth).
 * Here a row costs each thread a handful of instructions per element:
 *  - the next row of x (and the residual) is staged into shared memory with cp.async while this
 *    row is reduced and written (a thread reads back only what it copied, so no barrier);
 *  - LayerNorm's mean and variance come from one group reduction of (sum, sum of squares), taken
 *    about a shift c = the row's first element of s, so E[(s-c)^2] - E[s-c]^2 does not cancel
 *    catastrophically when |mean| >> std (c is within a few std of the mean unless s[0] is an
 *    outlier); RMSNorm reduces the sum of squares alone;
 *  - the cross-warp partials go through a shared buffer chosen by row parity, so a row needs one
 *    barrier: a warp can only overwrite a buffer after every warp has passed the barrier of the row
 *    between, i.e. after all have read it.
 * Results: s is PyTorch's rounded add, bit for bit; y agrees with the generic kernels up to the
 * fp32 rounding of the statistics. */
#ifndef TF_NORM_FWD_TYPED_CUH
#define TF_NORM_FWD_TYPED_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "norm_kernels.h"
#include "tf_cp_async.cuh"
#include "tf_vec.cuh"

namespace tf_norm_typed {

constexpr int kThreads = 512; /* the largest block; __launch_bounds__(kThreads, 2) caps registers at 64 */

/* cp.async of 16 bytes to a shared-space address, and the wait for all but the newest group. The
 * memory clobbers keep the compiler from moving shared-memory reads across either. */
__device__ __forceinline__ void cp_async16_s(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_but_newest() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

/* 16-bit T <-> fp32, two at a time from a 32-bit word (bf16 widens by a shift). */
template <typename T>
struct Pack {
    static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
    using T2 = std::conditional_t<kBf16, __nv_bfloat162, __half2>;
    static __device__ __forceinline__ float2 to_f2(uint32_t w) {
        if constexpr (kBf16) {
            return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
        } else {
            __half2 h;
            memcpy(&h, &w, 4);
            return __half22float2(h);
        }
    }
    static __device__ __forceinline__ uint32_t from_f2(float a, float b) {
        T2 h;
        if constexpr (kBf16) h = __floats2bfloat162_rn(a, b);
        else h = __floats2half2_rn(a, b);
        uint32_t w;
        memcpy(&w, &h, 4);
        return w;
    }
    static __device__ __forceinline__ float to_f(T v) {
        if constexpr (kBf16) return __bfloat162float(v);
        else return __half2float(v);
    }
    static __device__ __forceinline__ float round(float v) {
        if constexpr (kBf16) return __bfloat162float(__float2bfloat16_rn(v));
        else return __half2float(__float2half_rn(v));
    }
};

template <typename T>
__device__ __forceinline__ void unpack8(const uint4 &u, float (&v)[TF_VEC]) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = Pack<T>::to_f2(w[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

/* each value rounded to nearest even, as PyTorch rounds */
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&v)[TF_VEC]) {
    return make_uint4(Pack<T>::from_f2(v[0], v[1]), Pack<T>::from_f2(v[2], v[3]), Pack<T>::from_f2(v[4], v[5]),
                      Pack<T>::from_f2(v[6], v[7]));
}

/* Group sums (groups as in tf_group_sum) of N = 1 or 2 values, with one barrier when the group is
 * a whole block: the warp sums are then folded by a second butterfly over the first nw lanes.
 * xor butterflies add the same two operands on both sides of each exchange, so every thread of a
 * group gets the same bits, run to run. */
template <int N>
__device__ __forceinline__ void butterfly(float2 &v, int from) {
    for (int off = from; off > 0; off >>= 1) {
        v.x += __shfl_xor_sync(0xffffffffu, v.x, off);
        if (N == 2) v.y += __shfl_xor_sync(0xffffffffu, v.y, off);
    }
}
/* The first step of both group sums: each warp's sum (or each sub-warp group's); true when that is
 * already the group's. */
template <int N>
__device__ __forceinline__ bool sum_within_warps(float2 &v) {
    const int tpr = blockDim.x;
    butterfly<N>(v, tpr < 32 ? tpr / 2 : 16);
    return tpr <= 32;
}
template <int N>
__device__ __forceinline__ float2 group_sum(float2 v, float2 *red) {
    const int tpr = blockDim.x;
    if (sum_within_warps<N>(v)) return v;
    const int lane = threadIdx.x & 31, nw = tpr >> 5;
    if (lane == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[lane & (nw - 1)]; /* each aligned run of nw lanes folds all nw warp sums */
    butterfly<N>(v, nw / 2);
    return v;
}

/* NT: TF_LAYER_NORM, TF_RMS_NORM_LLAMA or TF_RMS_NORM_GEMMA. K chunks of 8 per thread (1 or 2). */
template <typename T, int K, bool RES, int NT>
__global__ void __launch_bounds__(kThreads, 2) norm_fwd_typed_kernel(const tf_norm_fwd_params p) {
    extern __shared__ uint4 stage_buf[];
    __shared__ float2 red[2][32];
    constexpr bool LN = NT == TF_LAYER_NORM;
    constexpr int CP = RES ? 2 : 1; /* 16-byte planes per chunk and stage: x, then the residual */
    const int tpr = blockDim.x, tid = threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;
    uint4 *const mine = stage_buf + threadIdx.y * blockDim.x + tid;
    const int64_t rows = p.rows, cols = p.cols, n_slots = (int64_t)gridDim.x * blockDim.y;
    const float inv_cols = 1.f / (float)cols;
    const T *const x = (const T *)p.x;
    const T *const res = (const T *)p.res;

    /* the thread's columns of the parameters, once: w (+ weight_offset for RMSNorm), b */
    bool have[K];
    float w[K][TF_VEC], b[LN ? K : 1][TF_VEC];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
        have[k] = col < cols;
        if (p.w && have[k]) tf_load_chunk(p.w, p.w_dtype, col, TF_VEC, w[k]);
        else {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) w[k][i] = 1.f;
        }
        if constexpr (LN) {
            if (p.b && have[k]) tf_load_chunk(p.b, p.w_dtype, col, TF_VEC, b[k]);
            else {
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) b[k][i] = 0.f;
            }
        } else {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) w[k][i] += p.weight_offset;
        }
    }
    /* staging planes: (stage, chunk, tensor) x threads of 16 bytes, so a warp's accesses are
     * conflict-free; a stage is K * CP planes */
    const int stage_planes = K * CP * nthreads;
    const uint32_t mine_s = (uint32_t)__cvta_generic_to_shared(mine);

    /* the shift's inputs for LayerNorm, loaded with the row's staging, a row ahead of use */
    T cx_next{}, cr_next{};
    auto issue = [&](int64_t row, int stage) {
        if (row < rows) {
            const T *xrow = x + row * p.x_stride;
            const T *rrow = RES ? res + row * p.res_stride : nullptr;
            const uint32_t dst = mine_s + (uint32_t)(stage * stage_planes) * 16u;
#pragma unroll
            for (int k = 0; k < K; ++k) {
                if (!have[k]) continue;
                const int col = (k * tpr + tid) * TF_VEC;
                cp_async16_s(dst + (uint32_t)(k * CP * nthreads) * 16u, xrow + col);
                if constexpr (RES) cp_async16_s(dst + (uint32_t)((k * CP + 1) * nthreads) * 16u, rrow + col);
            }
            if constexpr (LN) {
                cx_next = xrow[0];
                if constexpr (RES) cr_next = rrow[0];
            }
        }
        cp_async_commit(); /* one group per row, empty or not, so wait_group counts rows */
    };

    int stage = 0;
    issue((int64_t)blockIdx.x * blockDim.y + threadIdx.y, 0);
    for (int64_t base = (int64_t)blockIdx.x * blockDim.y; base < rows; base += n_slots, stage ^= 1) {
        const int64_t row = base + threadIdx.y;
        const bool active = row < rows;
        float c = 0.f;
        if constexpr (LN)
            c = RES ? Pack<T>::round(Pack<T>::to_f(cx_next) + Pack<T>::to_f(cr_next)) : Pack<T>::to_f(cx_next);
        issue(row + n_slots, stage ^ 1);
        cp_async_wait_but_newest(); /* this row's group has landed */

        float v[K][TF_VEC], sum = 0.f, sumsq = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!active || !have[k]) {
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) v[k][i] = 0.f;
                continue;
            }
            const uint4 *staged = mine + stage * stage_planes + k * CP * nthreads;
            uint4 u = staged[0];
            if constexpr (RES) {
                float a[TF_VEC], r[TF_VEC];
                unpack8<T>(u, a);
                unpack8<T>(staged[nthreads], r);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) a[i] += r[i];
                u = pack8<T>(a); /* s, rounded once as PyTorch's x + residual */
                if (p.s) *(uint4 *)((T *)p.s + row * cols + (k * tpr + tid) * TF_VEC) = u;
            }
            unpack8<T>(u, v[k]);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                if constexpr (LN) v[k][i] -= c;
                sum += v[k][i];
                sumsq = fmaf(v[k][i], v[k][i], sumsq);
            }
        }

        float mean = 0.f, rstd, shift_rstd = 0.f;
        if constexpr (LN) {
            const float2 t = group_sum<2>(make_float2(sum, sumsq), red[stage]);
            const float m = t.x * inv_cols; /* mean - c */
            rstd = rsqrtf(fmaxf(fmaf(-m, m, t.y * inv_cols), 0.f) + p.eps);
            mean = c + m;
            shift_rstd = -m * rstd;
        } else {
            rstd = rsqrtf(group_sum<1>(make_float2(sumsq, 0.f), red[stage]).x * inv_cols + p.eps);
        }
        if (!active) continue;

        T *const yrow = (T *)p.y + row * (p.y_stride ? p.y_stride : cols);
#pragma unroll
        for (int k = 0; k < K; ++k) {
            if (!have[k]) continue;
            float o[TF_VEC];
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) o[i] = LN ? fmaf(v[k][i], rstd, shift_rstd) : v[k][i] * rstd;
            if constexpr (LN) {
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) o[i] = fmaf(o[i], w[k][i], b[k][i]);
            } else {
                /* llama: the normalized value rounded to s's dtype before the weight; the product's
                 * own rounding (to T, or none for fp32) is then the store's */
                if constexpr (NT == TF_RMS_NORM_LLAMA) unpack8<T>(pack8<T>(o), o);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) o[i] *= w[k][i];
            }
            *(uint4 *)(yrow + (k * tpr + tid) * TF_VEC) = pack8<T>(o);
        }
        if (tid == 0) {
            if (p.mean) p.mean[row] = mean;
            if (p.rstd) p.rstd[row] = rstd;
        }
    }
    asm volatile("cp.async.wait_all;\n" ::); /* nothing left in flight at exit */
}

/* Sums of N = 1 or 2 values over a group of any multiple of 32 threads (a whole block), or of a
 * power of two below 32 (several groups a block): warp butterflies, then every thread adds the warp
 * sums in warp order, so all threads get the same bits, run to run. */
template <int N>
__device__ __forceinline__ float2 row_group_sum(float2 v, float2 *red) {
    const int tpr = blockDim.x;
    if (sum_within_warps<N>(v)) return v;
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float2 t = red[0];
    for (int w = 1; w < (tpr >> 5); ++w) {
        t.x += red[w].x;
        if (N == 2) t.y += red[w].y;
    }
    return t;
}

/* The same op with one row per thread group and no persistence: each thread loads its K chunks of x
 * (and the residual) into registers at entry, and the SM's resident groups are what keep loads in
 * flight (up to 2048 threads x K x 16 or 32 bytes per SM), against the persistent kernel's one
 * staged row per slot. Block: (threads per row, rows per block); a row's chunks go to threads
 * round-robin (chunk k * tpr + t to thread t), tpr a multiple of 32 (or a power of two below) so no
 * warp of a 2560-column row idles. Registers are what bound the threads per SM, so the row's s and
 * the weight and bias (of T or absent, re-read per row from L2) stay packed, 4 registers a chunk
 * each, and s is unpacked again after the reduction; the caps are 32 registers at K = 1, 40 at
 * K = 2 (64 for LayerNorm with a residual, which would spill at 40) and 64 at K = 4 (no residual).
 * On an H100, bf16 32768x4096 LayerNorm without a residual: 216 us holding s as floats with the 40
 * cap (spilling), 193 with a 64 cap, 181 packed with the 40 cap (the persistent kernel: 195). Same
 * arithmetic per element as norm_fwd_typed_kernel; the reduction's order follows the thread count. */
template <typename T, int K, bool RES, int NT>
__global__ void __launch_bounds__(K == 1 ? 1024 : K == 4 ? 256 : 512, K == 1 ? 2 : K == 4 ? 4 : (RES && NT == TF_LAYER_NORM ? 2 : 3))
norm_fwd_row_kernel(const tf_norm_fwd_params p) {
    __shared__ float2 red[32];
    constexpr bool LN = NT == TF_LAYER_NORM;
    const int tid = threadIdx.x, tpr = blockDim.x;
    const int64_t row = (int64_t)blockIdx.x * blockDim.y + threadIdx.y, cols = p.cols;
    const bool active = row < p.rows;
    const float inv_cols = 1.f / (float)cols;
    const T *const xrow = (const T *)p.x + (active ? row : 0) * p.x_stride;
    const T *const rrow = RES ? (const T *)p.res + (active ? row : 0) * p.res_stride : nullptr;

    bool have[K];
    uint4 ux[K], ur[K], uw[K], ub[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
        have[k] = active && col < cols;
        ux[k] = ur[k] = uw[k] = ub[k] = make_uint4(0, 0, 0, 0);
        if (have[k]) {
            ux[k] = __ldg((const uint4 *)(xrow + col));
            if constexpr (RES) ur[k] = __ldg((const uint4 *)(rrow + col));
        }
    }
    /* the weights (of T) stay packed until the output: 4 registers a chunk, not 8 */
    const bool hw = p.w != nullptr, hb = LN && p.b != nullptr;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int64_t col = (int64_t)(k * tpr + tid) * TF_VEC;
        if (hw && have[k]) uw[k] = __ldg((const uint4 *)((const T *)p.w + col));
        if (hb && have[k]) ub[k] = __ldg((const uint4 *)((const T *)p.b + col));
    }
    float c = 0.f;
    if constexpr (LN) {
        const float c0 = Pack<T>::to_f(xrow[0]);
        c = RES ? Pack<T>::round(c0 + Pack<T>::to_f(rrow[0])) : c0;
    }

    /* s stays packed across the reduction and is unpacked again for the output: 4 registers a chunk */
    float sum = 0.f, sumsq = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        float v[TF_VEC];
        if constexpr (RES) {
            float r[TF_VEC];
            unpack8<T>(ux[k], v);
            unpack8<T>(ur[k], r);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) v[i] += r[i];
            ux[k] = pack8<T>(v); /* s, rounded once as PyTorch's x + residual */
            if (p.s && have[k]) *(uint4 *)((T *)p.s + row * cols + (int64_t)(k * tpr + tid) * TF_VEC) = ux[k];
        }
        unpack8<T>(ux[k], v);
        if (have[k]) {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                if constexpr (LN) v[i] -= c;
                sum += v[i];
                sumsq = fmaf(v[i], v[i], sumsq);
            }
        }
    }
    float mean = 0.f, rstd, shift_rstd = 0.f;
    if constexpr (LN) {
        const float2 t = row_group_sum<2>(make_float2(sum, sumsq), red);
        const float m = t.x * inv_cols; /* mean - c */
        rstd = rsqrtf(fmaxf(fmaf(-m, m, t.y * inv_cols), 0.f) + p.eps);
        mean = c + m;
        shift_rstd = -m * rstd;
    } else {
        rstd = rsqrtf(row_group_sum<1>(make_float2(sumsq, 0.f), red).x * inv_cols + p.eps);
    }
    if (!active) return;
    T *const yrow = (T *)p.y + row * (p.y_stride ? p.y_stride : cols);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        if (!have[k]) continue;
        float v[TF_VEC], o[TF_VEC], w[TF_VEC], b[TF_VEC];
        unpack8<T>(ux[k], v);
        if constexpr (LN) {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) v[i] -= c;
        }
        unpack8<T>(uw[k], w);
        unpack8<T>(ub[k], b);
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) {
            if (!hw) w[i] = 1.f;
            if (!LN) w[i] += p.weight_offset;
        }
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) o[i] = LN ? fmaf(v[i], rstd, shift_rstd) : v[i] * rstd;
        if constexpr (LN) {
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) o[i] = fmaf(o[i], w[i], b[i]);
        } else {
            if constexpr (NT == TF_RMS_NORM_LLAMA) unpack8<T>(pack8<T>(o), o);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) o[i] *= w[i];
        }
        *(uint4 *)(yrow + (int64_t)(k * tpr + tid) * TF_VEC) = pack8<T>(o);
    }
    if (tid == 0) {
        if (p.mean) p.mean[row] = mean;
        if (p.rstd) p.rstd[row] = rstd;
    }
}

} // namespace tf_norm_typed

#endif /* TF_NORM_FWD_TYPED_CUH */

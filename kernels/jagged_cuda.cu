/* Jagged ops, CUDA kernels.
 *
 * jagged_copy_kernel<U, SEARCH>: a grid of one pass over the op's task rows (jagged_kernels.h; the loop
 * is there for grids past the launch limit). A group of G threads (a power of two up to 32, so small
 * rows share a warp) owns TFJ_RUN_ROWS (8) consecutive rows per iteration. tfj_resolve (jagged_map.h)
 * finds a row's sample (a step or two forward from a hint, the block's first row's sample, which the
 * block's first warp finds; a binary search over the offsets when that fails) and returns the source
 * and destination row addresses, plus the run: how many of the following rows continue both
 * contiguously inside the same tensors. For rows of >= TFJ_RUN_MIN_UNITS units, when the group's 8 rows
 * are one run (away from sample and piece boundaries) one resolve serves them all and each thread has 8
 * loads in flight before its first store. Otherwise the rows are resolved one by one, TFJ_ROWS at a
 * time, all before the first load. The G threads move a row as U-byte units (16-byte vectors whenever
 * the row length and every base pointer allow, else the widest unit that does).
 * Rows are raw bytes: one instantiation per unit width (5), with and without the search (SEARCH: the
 * modes whose sample is found in the offsets), serves every dtype and op. Row and byte indices are
 * 64-bit.
 *
 * jagged_arith_kernel: jagged_dense_add / mul, the same row mapping, element by element in fp32
 * (fp64 for double), rounded once to the dtype, as PyTorch's own add / mul. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "jagged_kernels.h"
#include "jagged_map.h"
#include "tf_dtype.h"

#define TFJ_THREADS 256
#define TFJ_ROWS 4
/* The run fast path only for rows of at least this many units (16 or 32 threads per row). On the H100
 * (same process, CUDA-graph kernel time) it took concat / split from 310-312 to 300-301 us at D = 128
 * bf16 and from 1176-1178 to 1153-1154 us at D = 512, but made D = 1 int64 rows (one 8-byte unit, one
 * thread per row, a thread's 8 loads 8 bytes apart and 64 bytes from its neighbour's) 9% to 35% slower
 * (docs/design/jagged.md). Rows of 2 to 8 threads are not measured yet and keep the per-row path. */
#define TFJ_RUN_MIN_UNITS 16

template <int U> struct TfjUnit;
template <> struct TfjUnit<1> { typedef uint8_t T; };
template <> struct TfjUnit<2> { typedef uint16_t T; };
template <> struct TfjUnit<4> { typedef uint32_t T; };
template <> struct TfjUnit<8> { typedef uint2 T; };
template <> struct TfjUnit<16> { typedef uint4 T; };

/* The sample of row r, found by a warp together: each round the 32 lanes test 32 offsets spread over
 * the range left and keep the span from the last one at or below r to the next, so B = 1024 samples
 * take 2 rounds of dependent loads where tfj_find takes 10. The same answer as tfj_find for monotone
 * offsets (the last b with off[b] <= r, 0 when none); for any offsets some b in [0, n). 1 <= n < 2^30. */
__device__ __forceinline__ int tfj_find_warp(const int64_t *off, int n, int64_t r, int lane) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {  /* b in [lo, hi]; off[lo] <= r unless lo == 0 */
        const int step = (hi - lo + 31) / 32, q = lo + 1 + lane * step;  /* q <= hi + 32: no overflow */
        const unsigned m = __ballot_sync(0xffffffffu, q <= hi && off[q] <= r);
        if (m == 0) {
            hi = lo;
        } else {
            const int qj = lo + 1 + (31 - __clz(m)) * step;
            lo = qj;
            hi = qj + step - 1 < hi ? qj + step - 1 : hi;
        }
    }
    return lo;
}

template <int U, bool SEARCH>
__global__ void __launch_bounds__(TFJ_THREADS, 4)
    jagged_copy_kernel(const __grid_constant__ tfj_copy_params p, int group_log2, int64_t units,
                       typename TfjUnit<U>::T fill, int use_runs) {
    typedef typename TfjUnit<U>::T T;
    const int G = 1 << group_log2;
    const int lane = threadIdx.x & (G - 1);
    const int64_t rb = p.row_bytes;
    const int64_t n_groups = ((int64_t)gridDim.x * blockDim.x) >> group_log2;
    const int64_t group = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> group_log2;
    int64_t hint = -1;
    if (SEARCH) {
        /* The block's first row's sample, found by its first warp and shared: each group's rows start
         * from it (tfj_resolve checks it and steps forward). A group alone would search from nothing:
         * in a one-pass grid every group resolves a single run, so tfj_find's 10 dependent loads (B =
         * 1024) stood before its first row load. */
        __shared__ int block_hint;
        if (threadIdx.x < 32) {
            const int64_t r = tfj_min(((int64_t)blockIdx.x * blockDim.x >> group_log2) * TFJ_RUN_ROWS, p.tasks - 1);
            const int b = tfj_find_warp(p.offsets, (int)p.n_samples, r, threadIdx.x);
            if (threadIdx.x == 0) block_hint = b;
        }
        __syncthreads();
        hint = block_hint;
    }
    for (int64_t r0 = group * TFJ_RUN_ROWS; r0 < p.tasks; r0 += TFJ_RUN_ROWS * n_groups) {
        /* Fast path: the group's TFJ_RUN_ROWS rows are one run (tfj_resolve: consecutive rows of the
         * same tensors, all inside them), so one resolve serves them all and all their loads are
         * issued before the first store. */
        if (use_runs) {
            const char *s;
            int64_t run;
            char *d = tfj_resolve(&p, r0, &s, &hint, &run);
            if (run >= TFJ_RUN_ROWS) {
                for (int64_t u = lane; u < units; u += G) {
                    T v[TFJ_RUN_ROWS];
#pragma unroll
                    for (int k = 0; k < TFJ_RUN_ROWS; ++k) v[k] = s ? __ldg((const T *)(s + k * rb) + u) : fill;
#pragma unroll
                    for (int k = 0; k < TFJ_RUN_ROWS; ++k) ((T *)(d + k * rb))[u] = v[k];
                }
                continue;
            }
        }
        /* Rows across a sample or piece boundary (or bad offsets): each row resolved on its own,
         * TFJ_ROWS at a time, all resolved before the first load. */
        for (int64_t c = r0; c < r0 + TFJ_RUN_ROWS && c < p.tasks; c += TFJ_ROWS) {
            const char *src[TFJ_ROWS];
            char *dst[TFJ_ROWS];
#pragma unroll
            for (int k = 0; k < TFJ_ROWS; ++k) {
                const int64_t r = c + k;
                int64_t run;
                src[k] = 0;
                dst[k] = r < p.tasks ? tfj_resolve(&p, r, &src[k], &hint, &run) : 0;
            }
            for (int64_t u = lane; u < units; u += G) {
                T v[TFJ_ROWS];
#pragma unroll
                for (int k = 0; k < TFJ_ROWS; ++k)
                    if (dst[k]) v[k] = src[k] ? __ldg((const T *)src[k] + u) : fill;
#pragma unroll
                for (int k = 0; k < TFJ_ROWS; ++k)
                    if (dst[k]) ((T *)dst[k])[u] = v[k];
            }
        }
    }
}

/* Threads per row: the power of two nearest above the row's unit count, at most a warp. */
static int group_log2_for(int64_t units) {
    int g = 0;
    while (g < 5 && ((int64_t)1 << g) < units) ++g;
    return g;
}

/* Blocks for one pass over the tasks, at most the launch limit: a persistent grid of one resident wave
 * moved the same rows 3% slower (H100, docs/design/jagged.md). */
static unsigned copy_grid(int64_t tasks, int group_log2) {
    const int64_t rows_per_block = (int64_t)(TFJ_THREADS >> group_log2) * TFJ_RUN_ROWS;
    const int64_t blocks = (tasks + rows_per_block - 1) / rows_per_block;
    return (unsigned)(blocks < 0x7fffffff ? blocks : 0x7fffffff);
}

/* Enough blocks for the tasks, at most one resident wave (blocks_per_sm from the occupancy API). */
static int64_t grid_for(int64_t tasks, int group_log2, int rows_per_group, int blocks_per_sm) {
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int64_t rows_per_block = (int64_t)(TFJ_THREADS >> group_log2) * rows_per_group;
    int64_t blocks = (tasks + rows_per_block - 1) / rows_per_block;
    const int64_t cap = (int64_t)sms * (blocks_per_sm > 0 ? blocks_per_sm : 1);
    return blocks < cap ? blocks : cap;
}

template <class K>
static int blocks_per_sm(K kernel) {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, TFJ_THREADS, 0) != cudaSuccess) n = 4;
    return n;
}

template <int U>
static int launch_copy(const tfj_copy_params *p, cudaStream_t stream) {
    typedef typename TfjUnit<U>::T T;
    unsigned char bytes[U];
    for (int i = 0; i < U; ++i) bytes[i] = (unsigned char)(p->fill >> (8 * (i % p->elem_size)));
    T fill;
    memcpy(&fill, bytes, U);
    const int64_t units = p->row_bytes / U;
    const int g = group_log2_for(units);
    const int use_runs = units >= TFJ_RUN_MIN_UNITS;
    /* the modes that search the offsets for a row's sample */
    const bool search = p->mode != TFJ_TO_PADDED && p->n_samples > 0 && p->n_samples < (1 << 30);
    if (search)
        jagged_copy_kernel<U, true><<<copy_grid(p->tasks, g), TFJ_THREADS, 0, stream>>>(*p, g, units, fill, use_runs);
    else
        jagged_copy_kernel<U, false><<<copy_grid(p->tasks, g), TFJ_THREADS, 0, stream>>>(*p, g, units, fill, use_runs);
    return (int)cudaGetLastError();
}

static uintptr_t addr_bits(const void *ptr) { return (uintptr_t)ptr; }

extern "C" int tfj_copy_cuda(const tfj_copy_params *p, void *stream_) {
    cudaStream_t stream = (cudaStream_t)stream_;
    if (p->tasks <= 0 || p->row_bytes <= 0) return 0;
    /* The widest unit that divides the row length and the alignment of every base pointer. */
    uintptr_t bits = (uintptr_t)p->row_bytes | addr_bits(p->src.data) | addr_bits(p->dst.data);
    for (int i = 0; i < p->n_parts && i < TFJ_MAX_PARTS; ++i) bits |= addr_bits(p->parts[i].data);
    int u = 16;
    while (u > 1 && (bits & (uintptr_t)(u - 1))) u >>= 1;
    if (u < p->elem_size) return (int)cudaErrorMisalignedAddress;
    switch (u) {
    case 16: return launch_copy<16>(p, stream);
    case 8: return launch_copy<8>(p, stream);
    case 4: return launch_copy<4>(p, stream);
    case 2: return launch_copy<2>(p, stream);
    default: return launch_copy<1>(p, stream);
    }
}

__device__ __forceinline__ float tfj_load(const void *base, int dt, int64_t i) {
    if (dt == TF_F32) return ((const float *)base)[i];
    if (dt == TF_BF16) return __bfloat162float(((const __nv_bfloat16 *)base)[i]);
    return __half2float(((const __half *)base)[i]);
}

__device__ __forceinline__ void tfj_store(void *base, int dt, int64_t i, float v) {
    if (dt == TF_F32) ((float *)base)[i] = v;
    else if (dt == TF_BF16) ((__nv_bfloat16 *)base)[i] = __float2bfloat16_rn(v);
    else ((__half *)base)[i] = __float2half_rn(v);
}

__global__ void __launch_bounds__(TFJ_THREADS)
    jagged_arith_kernel(const __grid_constant__ tfj_arith_params p, int group_log2) {
    const int G = 1 << group_log2;
    const int lane = threadIdx.x & (G - 1);
    const int64_t n_groups = ((int64_t)gridDim.x * blockDim.x) >> group_log2;
    const int es = p.dtype == TFJ_F64 ? 8 : (p.dtype == TF_F32 ? 4 : 2);
    const int64_t rb = p.cols * es;
    int64_t hint = -1;
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> group_log2; r < p.rows; r += n_groups) {
        const char *d = tfj_arith_dense_row(&p, r, rb, &hint);
        const char *v = (const char *)p.values + r * rb;
        char *o = (char *)p.out + r * rb;
        for (int64_t c = lane; c < p.cols; c += G) {
            if (p.dtype == TFJ_F64) {
                const double a = ((const double *)v)[c];
                ((double *)o)[c] = d ? (p.mul ? a * ((const double *)d)[c] : a + ((const double *)d)[c])
                                     : (p.mul ? 0.0 : a);
            } else {
                const float a = tfj_load(v, p.dtype, c);
                const float r_ = d ? (p.mul ? a * tfj_load(d, p.dtype, c) : a + tfj_load(d, p.dtype, c))
                                   : (p.mul ? 0.f : a);
                tfj_store(o, p.dtype, c, r_);
            }
        }
    }
}

extern "C" int tfj_arith_cuda(const tfj_arith_params *p, void *stream) {
    if (p->rows <= 0 || p->cols <= 0) return 0;
    const int g = group_log2_for(p->cols);
    static const int per_sm = blocks_per_sm(jagged_arith_kernel);
    jagged_arith_kernel<<<(unsigned)grid_for(p->rows, g, TFJ_ROWS, per_sm), TFJ_THREADS, 0, (cudaStream_t)stream>>>(*p, g);
    return (int)cudaGetLastError();
}

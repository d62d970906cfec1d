/* Skinny linear (semantics: skinny_linear_kernels.h): out = [LayerNorm(a)] @ w + bias + residual for
 * M <= 8 rows, bound by reading w once; and the same GEMM with a's rows built from HSTU's output
 * section (kernels/skinny_prologue.cuh), so that op's kernel and its y buffer drop out of a serving step.
 *
 *   skinny_linear_kernel: a block of 256 threads owns TILE = 8 x VEC columns of w (16 bytes a thread, a
 *     128-byte line of a bf16 row per 8 threads) and one K-range: 32 row groups of 8 threads, row group g
 *     reading w's rows k_lo + g, k_lo + g + 32, ... in batches of U 16-byte loads, two batches in flight
 *     from the start and each reloaded as it is consumed. a's rows (normalized first with the norm) sit
 *     in shared memory as fp32; every thread accumulates MR rows x VEC columns. The 4 row groups of a
 *     warp add by shuffles, the 8 warps through shared memory in a fixed order.
 *   Where the column tiles alone would leave SMs idle (a 1024-wide output is 16 tiles), the K range is
 *     split over a cluster of S blocks (Hopper thread-block clusters) that add their partial rows
 *     through distributed shared memory, in rank order, with no workspace and no second kernel; each
 *     rank writes an interleaved share of the tile's outputs. Before sm_90, S = 1.
 *   The norm's statistics need whole rows: every block stages a's M whole rows (kilobytes) and takes
 *   their sums and sums of squares about each row's first element as it stages them.
 *   The HSTU output variant (a template parameter: the prologue, kernels/skinny_prologue.cuh) reads no a:
 *   each block takes attn's row statistics from global memory and builds only its K-range of the
 *   concatenation [u', attn, act(u) * LayerNorm(attn)] in shared memory; tiles, split and epilogue are
 *   the same kernel's. */
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "skinny_linear_kernels.h"
#include "skinny_prologue.cuh"
#include "tf_typed.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kColThreads = 8;                    // threads across a tile's columns (128 bytes of a bf16 row)
constexpr int kRowGroups = kThreads / kColThreads;  // 32
constexpr int kMaxSplits = 8;                     // the portable cluster size
constexpr size_t kMaxSmem = 96 * 1024;

/* What fills the rows of a: a read as is, a normalized, or HSTU's output section (params
 * tf_skinny_hstu_output_params) */
enum Prologue { kPlain = 0, kNorm = 1, kHstuOutput = 2 };

__host__ __device__ __forceinline__ const tf_skinny_linear_params &lin_of(const tf_skinny_linear_params &p) {
    return p;
}
__host__ __device__ __forceinline__ const tf_skinny_linear_params &lin_of(const tf_skinny_hstu_output_params &q) {
    return q.lin;
}

template <typename T, int U>
__device__ __forceinline__ void load_batch(uint4 (&w)[U], const T *col_ptr, int64_t w_stride, int k, int k_hi) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int kk = k + u * kRowGroups;
        w[u] = kk < k_hi ? __ldg((const uint4 *)(col_ptr + (int64_t)kk * w_stride)) : make_uint4(0, 0, 0, 0);
    }
}

/* smem: a_s [MR][span] | red [kWarps][MR][TILE] | part [MR][TILE] | (NORM) nw_s, nb_s [span] (fp32).
 * P: tf_skinny_linear_params, or tf_skinny_hstu_output_params for kHstuOutput. */
template <typename T, int MR, int PRO, int U, typename P>
__global__ void __launch_bounds__(kThreads, 2) skinny_linear_kernel(const P q, int splits, int k_per_split) {
    constexpr bool NORM = PRO == kNorm;
    const tf_skinny_linear_params &p = lin_of(q);
    constexpr int VEC = 16 / sizeof(T);
    constexpr int TILE = kColThreads * VEC;
    constexpr int OUTS = (MR * TILE + kThreads - 1) / kThreads;  // epilogue outputs a thread may own
    constexpr int STEP = U * kRowGroups;                         // w rows a batch covers
    extern __shared__ float smem[];
    const int K = (int)p.K, M = (int)p.M;
    const int rank = (int)(blockIdx.x % (unsigned)splits);
    const int64_t col0 = (int64_t)(blockIdx.x / (unsigned)splits) * TILE;
    const int k_lo = rank * k_per_split, k_hi = min(K, k_lo + k_per_split);
    const int s_lo = NORM ? 0 : k_lo, span = NORM ? K : k_per_split;
    float *a_s = smem, *red = a_s + MR * span, *part = red + kWarps * MR * TILE, *nw_s = part + MR * TILE;
    float *nb_s = nw_s + span;
    const int tid = threadIdx.x, cgi = tid % kColThreads, rg = tid / kColThreads;
    const int warp = tid / 32, lane = tid % 32;
    const int64_t col = col0 + cgi * VEC;
    const bool col_ok = col < p.N;
    const T *wcol = (const T *)p.w + (col_ok ? col : 0);
    const int k_first = col_ok ? k_lo + rg : k_hi;

    // Everything the block reads is independent of everything else it reads, so all of it is put in
    // flight first: two batches of w (the next ones are loaded as these are consumed), the bias and
    // residual of the outputs this thread writes, then the rows of a (with the norm's parameters, or
    // built from attn and u) into shared memory.
    uint4 b0[U], b1[U];
    load_batch<T, U>(b0, wcol, p.w_stride, k_first, k_hi);
    load_batch<T, U>(b1, wcol, p.w_stride, k_first + STEP, k_hi);
    float extra[OUTS];
#pragma unroll
    for (int j = 0; j < OUTS; ++j) {
        const int i = tid + rank * kThreads + j * kThreads * splits, m = i / TILE;
        const int64_t c = col0 + i % TILE;
        float e = 0.f;
        if (i < MR * TILE && m < M && c < p.N) {
            if (p.bias) e += to_f<T>(((const T *)p.bias)[c]);
            if (p.res) e += to_f<T>(((const T *)p.res)[(int64_t)m * p.res_stride + c]);
        }
        extra[j] = e;
    }
    if constexpr (PRO == kHstuOutput) {
        hstu_output_rows<T, MR, kThreads>(q, a_s, span, k_lo, k_hi);
    } else {
        // a's rows as fp32 (zeros past M and K); with the norm, each thread's share of every row's sum and sum
        // of squares about the row's first element (a one-pass variance that stays exact for |mean| >> std)
        const T *a = (const T *)p.a;
        float sum[MR], sq[MR], shift[MR];
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            const T *arow = a + (int64_t)m * p.a_stride;
            shift[m] = NORM && m < M ? to_f<T>(arow[0]) : 0.f;
            sum[m] = sq[m] = 0.f;
            for (int k = tid; k < span; k += kThreads) {
                const float v = m < M && s_lo + k < K ? to_f<T>(arow[s_lo + k]) : 0.f;
                a_s[m * span + k] = v;
                if (NORM && m < M) {
                    const float d = v - shift[m];
                    sum[m] += d;
                    sq[m] = fmaf(d, d, sq[m]);
                }
            }
        }
        if constexpr (NORM) {
            const T *nw = (const T *)p.norm_w, *nb = (const T *)p.norm_b;
            for (int k = k_lo + tid; k < k_hi; k += kThreads) {
                nw_s[k] = to_f<T>(nw[k]);
                nb_s[k] = nb ? to_f<T>(nb[k]) : 0.f;
            }
            const float2 *stats = skinny_row_stats<MR, kWarps>(sum, sq, shift, K, p.eps);
            // only this block's K range is multiplied: normalize (and round, as the norm op's output is) that
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                if (m >= M) break;
                const float mean = stats[m].x, rstd = stats[m].y;
                for (int k = k_lo + tid; k < k_hi; k += kThreads)
                    a_s[m * span + k] = skinny_rounded<T>((a_s[m * span + k] - mean) * rstd * nw_s[k] + nb_s[k]);
            }
        }
    }
    __syncthreads();

    float acc[MR][VEC];
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[m][j] = 0.f;
    auto consume = [&](const uint4(&w)[U], int k) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kk = k + u * kRowGroups;
            if (kk >= k_hi) break;
            T wv[VEC];
            memcpy(wv, &w[u], 16);
            float wf[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) wf[j] = to_f<T>(wv[j]);
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                const float av = a_s[m * span + kk - s_lo];
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[m][j] = fmaf(av, wf[j], acc[m][j]);
            }
        }
    };
    for (int k = k_first; k < k_hi; k += 2 * STEP) {  // batch b0 at k, b1 at k + STEP; each reloaded 2 STEPs on
        consume(b0, k);
        load_batch<T, U>(b0, wcol, p.w_stride, k + 2 * STEP, k_hi);
        consume(b1, k + STEP);
        load_batch<T, U>(b1, wcol, p.w_stride, k + 3 * STEP, k_hi);
    }

    // the warp's 4 row groups (lanes l ^ 8, l ^ 16), then the 8 warps in order
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int j = 0; j < VEC; ++j)
#pragma unroll
            for (int o = kColThreads; o < 32; o <<= 1) acc[m][j] += __shfl_xor_sync(0xffffffffu, acc[m][j], o);
    if (lane < kColThreads) {
#pragma unroll
        for (int m = 0; m < MR; ++m)
#pragma unroll
            for (int j = 0; j < VEC; ++j) red[(warp * MR + m) * TILE + lane * VEC + j] = acc[m][j];
    }
    __syncthreads();
    for (int i = tid; i < MR * TILE; i += kThreads) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) s += red[w * MR * TILE + i];
        part[i] = s;
    }

    // the cluster's ranks in order (each rank its share of the outputs), then bias and residual
    __syncthreads();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::cluster_group cluster = cg::this_cluster();
    if (splits > 1) cluster.sync();  // the other ranks' parts written too
#endif
#pragma unroll
    for (int j = 0; j < OUTS; ++j) {
        const int i = tid + rank * kThreads + j * kThreads * splits, m = i / TILE;
        const int64_t c = col0 + i % TILE;
        if (i >= MR * TILE || m >= M || c >= p.N) continue;
        float s = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        for (int r = 0; r < splits; ++r) s += splits > 1 ? cluster.map_shared_rank(part, r)[i] : part[i];
#else
        s = part[i];
#endif
        ((T *)p.out)[(int64_t)m * p.out_stride + c] = from_f<T>(s + extra[j]);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (splits > 1) cluster.sync();  // a block's part stays until every rank has read it
#endif
}

int rows_tier(int64_t M) { return M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : 8; }

struct Plan {
    int splits, k_per_split;
    size_t smem;
};

struct DeviceInfo {
    int sms, major, smem_optin;
};

DeviceInfo device_info() {
    static DeviceInfo cached[64];
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 0 || dev >= 64) dev = 0;
    if (cached[dev].sms == 0) {
        DeviceInfo d{0, 0, 0};
        cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev);
        cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (d.sms <= 0) d.sms = 1;
        cached[dev] = d;
    }
    return cached[dev];
}

/* Splits of K: doubled while the blocks still fit the SMs once and each keeps >= 64 of w's rows (tiles
 * of 64-byte row segments at two blocks an SM measured slower: 11.9 against 7.8 us for 1 x 3072 x 1024
 * bf16 on an H100). */
Plan plan(const tf_skinny_linear_params *p) {
    const int vec = 16 / tf_dtype_size(p->dtype), tile = kColThreads * vec, mr = rows_tier(p->M);
    const int64_t tiles = (p->N + tile - 1) / tile;
    const DeviceInfo d = device_info();
    int s = 1;
#if defined(TF_BUILT_SM90A)
    if (d.major >= 9)
        while (s < kMaxSplits && tiles * s * 2 <= d.sms && p->K / (s * 2) >= 64) s *= 2;
#endif
    Plan pl;
    pl.splits = s;
    pl.k_per_split = (int)((p->K + s - 1) / s);
    const int64_t span = p->norm_w ? p->K : pl.k_per_split;
    pl.smem = sizeof(float) * ((size_t)mr * span + (size_t)kWarps * mr * tile + (size_t)mr * tile +
                               (p->norm_w ? 2 * (size_t)span : 0));
    return pl;
}

template <typename T, int MR, int PRO, typename P>
cudaError_t launch(const P &q, const Plan &pl, cudaStream_t st) {
    constexpr int U = MR <= 2 ? 8 : 4;
    const tf_skinny_linear_params &p = lin_of(q);
    const void *fn = (const void *)skinny_linear_kernel<T, MR, PRO, U, P>;
    static bool opted[64] = {false};
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev >= 0 && dev < 64 && !opted[dev]) {  // once per device: the most this kernel ever asks for
        const int most = device_info().smem_optin - 1024 < (int)kMaxSmem ? device_info().smem_optin - 1024 : (int)kMaxSmem;
        const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
        if (e != cudaSuccess) return e;
        opted[dev] = true;
    }
    const int vec = 16 / (int)sizeof(T);
    const int64_t tiles = (p.N + kColThreads * vec - 1) / (kColThreads * vec);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(tiles * pl.splits));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = pl.smem;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    if (pl.splits > 1) {
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = (unsigned)pl.splits;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, skinny_linear_kernel<T, MR, PRO, U, P>, q, pl.splits, pl.k_per_split);
}

template <typename T, int PRO, typename P>
cudaError_t launch_rows(const P &q, const Plan &pl, cudaStream_t st) {
    switch (rows_tier(lin_of(q).M)) {
    case 1: return launch<T, 1, PRO>(q, pl, st);
    case 2: return launch<T, 2, PRO>(q, pl, st);
    case 4: return launch<T, 4, PRO>(q, pl, st);
    default: return launch<T, 8, PRO>(q, pl, st);
    }
}

template <typename T>
cudaError_t launch_typed(const tf_skinny_linear_params &p, const Plan &pl, cudaStream_t st) {
    return p.norm_w ? launch_rows<T, kNorm>(p, pl, st) : launch_rows<T, kPlain>(p, pl, st);
}

template <typename T>
cudaError_t launch_typed(const tf_skinny_hstu_output_params &q, const Plan &pl, cudaStream_t st) {
    return launch_rows<T, kHstuOutput>(q, pl, st);
}

template <typename P>
cudaError_t launch_dtype(const P &q, const Plan &pl, cudaStream_t st) {
    const tf_skinny_linear_params &p = lin_of(q);
    if (p.dtype == TF_BF16) return launch_typed<__nv_bfloat16>(q, pl, st);
    if (p.dtype == TF_F16) return launch_typed<__half>(q, pl, st);
    return launch_typed<float>(q, pl, st);
}

/* Whether the kernel takes p and, if so, its plan in *pl (one plan per call: the entry points below
 * share it). */
bool applies(const tf_skinny_linear_params *p, Plan *pl) {
    const int es = tf_dtype_size(p->dtype), vec = 16 / es;
    if (p->M < 1 || p->M > TF_SKINNY_MAX_ROWS || p->K < 1 || p->N < 1 || p->K > (1 << 24)) return false;
    // whole 16-byte slices of w's rows: N and the row stride multiples of VEC, w 16-byte aligned
    if (p->N % vec || p->w_stride % vec || ((uintptr_t)p->w & 15)) return false;
    if ((p->N + kColThreads * vec - 1) / (kColThreads * vec) * kMaxSplits > 0x7fffffff) return false;
    *pl = plan(p);
    const size_t optin = (size_t)device_info().smem_optin;
    return pl->smem <= kMaxSmem && pl->smem + 1024 <= optin;  // + the static statistics
}

}  // namespace

extern "C" int tf_skinny_linear_cuda_applies(const tf_skinny_linear_params *p) {
    Plan pl;
    return applies(p, &pl) ? 1 : 0;
}

extern "C" int tf_skinny_linear_cuda(const tf_skinny_linear_params *p, void *stream) {
    Plan pl;
    if (!applies(p, &pl)) return (int)cudaErrorInvalidValue;
    return (int)launch_dtype(*p, pl, (cudaStream_t)stream);
}

/* The linear's own conditions, with a's rows the concatenation's: no staged a, no norm of a (plan() then
 * sizes a_s to the block's K-range); the plan in *pl. */
static bool hstu_output_applies(const tf_skinny_hstu_output_params *q, Plan *pl) {
    const tf_skinny_linear_params *p = &q->lin;
    if (p->a || p->norm_w || p->norm_b || !q->attn || !q->u || q->cols < 1 || q->cols > (1 << 22)) return false;
    if (q->mul_act < TF_ACT_NONE || q->mul_act > TF_ACT_SIGMOID || q->cat_act < TF_ACT_NONE ||
        q->cat_act > TF_ACT_SIGMOID)
        return false;
    if (p->K != (1 + (q->cat_u != 0) + (q->cat_x != 0)) * q->cols) return false;
    return applies(p, pl);
}

extern "C" int tf_skinny_hstu_output_cuda_applies(const tf_skinny_hstu_output_params *q) {
    Plan pl;
    return hstu_output_applies(q, &pl);
}

extern "C" int tf_skinny_hstu_output_cuda(const tf_skinny_hstu_output_params *q, void *stream) {
    Plan pl;
    if (!hstu_output_applies(q, &pl)) return (int)cudaErrorInvalidValue;
    return (int)launch_dtype(*q, pl, (cudaStream_t)stream);
}

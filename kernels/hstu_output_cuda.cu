/* HSTU output section on CUDA (semantics: hstu_output_kernels.h).
 *
 * One warp per (row, group) task, a persistent grid striding over the tasks. Chunk j of a group (8
 * elements, tf_vec.cuh: 16-byte vectors where whole and aligned, element by element otherwise) is lane
 * j % 32's. The forward holds groups of up to 1024 columns in registers, all their loads issued at once
 * (wider ones are read three times: mean, variance about it, the write pass; the re-reads come from
 * L1/L2); the backward reads a group twice. Dropout draws one Philox block per 4 consecutive
 * elements of the concatenated output; a chunk's elements start at the same phase mod 4 in every lane,
 * so the lanes draw in step.
 *
 * Weight gradients: LayerNorm rows of up to 32 * 8 * K columns (K <= 4) keep each lane's column sums in
 * registers across the rows its warp visits and store them once into the warp's partial row; longer
 * rows, and GroupNorm (one weight per group: a warp sum per task), add into the warp's partial row as
 * they go. A warp owns its partial row, so the order of additions is fixed: deterministic. */
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "hstu_output_kernels.h"
#include "tf_vec.cuh"

namespace {

constexpr int kWarps = 8; /* per block */
/* Blocks per SM the register budget is set for: a memory-bound kernel wants many warps in flight, but
 * the backward's register-held weight-gradient sums (K > 0) need more than 128 registers to run
 * unspilled (ptxas, sm_90a: 162 to 232). */
template <int K>
constexpr int fwd_min_blocks() { return K >= 2 ? 2 : 3; }
template <int K>
constexpr int bwd_min_blocks() { return K > 0 ? 1 : 2; }

__device__ __forceinline__ float act_f(float x, int act) {
    if (act == TF_ACT_SILU) return x / (1.f + expf(-x));
    if (act == TF_ACT_SIGMOID) return 1.f / (1.f + expf(-x));
    return x;
}

__device__ __forceinline__ float act_grad(float x, int act) {
    if (act == TF_ACT_NONE) return 1.f;
    const float s = 1.f / (1.f + expf(-x));
    return act == TF_ACT_SILU ? s * (1.f + x * (1.f - s)) : s * (1.f - s);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

struct Dropout {
    uint64_t seed, offset;
    float p, scale;
    bool on;
};

/* v[i] *= keep(e0 + i) / (1 - p) for i < n. */
__device__ __forceinline__ void apply_mask(const Dropout &d, uint64_t e0, int n, float (&v)[TF_VEC]) {
    if (!d.on) return;
    uint64_t blk = ~(uint64_t)0;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) {
        if (i >= n) break;
        const uint64_t e = e0 + i;
        if ((e >> 2) != blk) {
            blk = e >> 2;
            tf_philox4x32_10(d.seed, d.offset, blk, w);
        }
        const unsigned k = (unsigned)(e & 3); /* selects, not a local-memory index */
        const uint32_t word = k == 0 ? w[0] : k == 1 ? w[1] : k == 2 ? w[2] : w[3];
        v[i] = tf_philox_uniform(word) >= d.p ? v[i] * d.scale : 0.f;
    }
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
    d.p = p;
    d.scale = on ? 1.f / (1.f - p) : 1.f;
    if (on) tf_philox_resolve(&rng, &d.seed, &d.offset);
    return d;
}

/* The three parts of one chunk of the output row, dropped out and rounded. */
__device__ __forceinline__ void fwd_write_chunk(const tf_hstu_output_fwd_params &p, const Dropout &d, void *yrow,
                                                uint64_t e_row, int64_t ou, int64_t ox, int64_t oy, int64_t g,
                                                int64_t col, int cn, float mean, float rstd,
                                                const float (&a)[TF_VEC], const float (&u)[TF_VEC]) {
    float v[TF_VEC], w[TF_VEC], b[TF_VEC];
    load_params(p.w, p.b, p.w_dtype, p.group_weights, g, col, cn, w, b);
    if (ou >= 0) {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) v[i] = act_f(u[i], p.cat_act);
        apply_mask(d, e_row + ou + col, cn, v);
        tf_store_chunk(yrow, p.y_dtype, ou + col, cn, v);
    }
    if (ox >= 0) {
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) v[i] = a[i];
        apply_mask(d, e_row + ox + col, cn, v);
        tf_store_chunk(yrow, p.y_dtype, ox + col, cn, v);
    }
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) v[i] = act_f(u[i], p.mul_act) * ((a[i] - mean) * rstd * w[i] + b[i]);
    apply_mask(d, e_row + oy + col, cn, v);
    tf_store_chunk(yrow, p.y_dtype, oy + col, cn, v);
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
    if (p.rng_out && blockIdx.x == 0 && threadIdx.x == 0) {
        uint64_t s, o;
        tf_philox_resolve(&p.rng, &s, &o);
        p.rng_out[0] = (int64_t)s;
        p.rng_out[1] = (int64_t)o;
    }
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
                if (cn[k] > 0)
                    fwd_write_chunk(p, d, yrow, e_row, ou, ox, oy, g, c0 + (lane + 32 * k) * TF_VEC, cn[k], mean,
                                    rstd, a[k], u[k]);
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
                fwd_write_chunk(p, d, yrow, e_row, ou, ox, oy, g, col, cn, mean, rstd, a, u);
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
        c.xhat[i] = i < cn ? (c.a[i] - mean) * rstd : 0.f;
        c.dn[i] = i < cn ? c.gy[i] * act_f(c.u[i], p.mul_act) : 0.f;
    }
}

/* K > 0: LayerNorm with at most K chunks per lane, weight-gradient sums in registers. K == 0: any. */
template <int K>
__global__ void __launch_bounds__(kWarps * 32, bwd_min_blocks<K>()) hstu_output_bwd_kernel(
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
    constexpr int KR = K > 0 ? K : 1;
    float acc_w[KR][TF_VEC], acc_b[KR][TF_VEC];
#pragma unroll
    for (int k = 0; k < KR; ++k)
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) acc_w[k][i] = acc_b[k][i] = 0.f;

    for (int64_t task = slot; task < p.rows * G; task += n_warps) {
        const int64_t r = task / G, g = task - r * G, c0 = g * gs;
        const void *arow = tf_row(p.attn, p.attn_dtype, r, p.attn_stride);
        const void *urow = tf_row(p.u, p.u_dtype, r, p.u_stride);
        const void *dyrow = tf_row(p.dy, p.dy_dtype, r, p.dy_stride);
        const float mean = p.mean[task], rstd = p.rstd[task];
        const uint64_t e_row = (uint64_t)r * (uint64_t)p.y_cols;
        float s1 = 0.f, s2 = 0.f, gw = 0.f, gb = 0.f;
        BwdChunk c;
        if constexpr (K > 0) {
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const int64_t j = lane + 32 * k;
                const int cn = chunk_n(j, gs);
                if (cn == 0) continue;
                bwd_load(p, d, arow, urow, dyrow, e_row, oy, g, c0 + j * TF_VEC, cn, mean, rstd, c);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) {
                    const float dx = __fmul_rn(c.dn[i], c.w[i]); /* rounded as in da below */
                    s1 += dx;
                    s2 += dx * c.xhat[i];
                    acc_w[k][i] += c.dn[i] * c.xhat[i];
                    acc_b[k][i] += c.dn[i];
                }
            }
        } else {
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
        }
        const float m1 = warp_sum(s1) * inv, m2 = warp_sum(s2) * inv;
        void *darow = tf_row(p.dattn, p.dattn_dtype, r, n);
        void *durow = tf_row(p.du, p.du_dtype, r, n);
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
                du[i] = c.gy[i] * (c.xhat[i] * c.w[i] + c.b[i]) * act_grad(c.u[i], p.mul_act);
            }
            if (ox >= 0) {
                tf_load_chunk(dyrow, p.dy_dtype, ox + col, cn, t);
                apply_mask(d, e_row + ox + col, cn, t);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) da[i] += t[i];
            }
            if (ou >= 0) {
                tf_load_chunk(dyrow, p.dy_dtype, ou + col, cn, t);
                apply_mask(d, e_row + ou + col, cn, t);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) du[i] += t[i] * act_grad(c.u[i], p.cat_act);
            }
            tf_store_chunk(darow, p.dattn_dtype, col, cn, da);
            tf_store_chunk(durow, p.du_dtype, col, cn, du);
        }
    }
    if constexpr (K > 0) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int64_t j = lane + 32 * k;
            const int cn = chunk_n(j, n);
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                if (i >= cn) break;
                if (dwp) dwp[j * TF_VEC + i] = acc_w[k][i];
                if (dbp) dbp[j * TF_VEC + i] = acc_b[k][i];
            }
        }
    }
}

constexpr int kMaxK = 4;

const void *fwd_fn(const tf_hstu_output_fwd_params *p) {
    const int64_t nch = (p->cols / p->groups + TF_VEC - 1) / TF_VEC;
    if (nch <= 32) return (const void *)hstu_output_fwd_kernel<1>;
    if (nch <= 64) return (const void *)hstu_output_fwd_kernel<2>;
    if (nch <= 32 * kMaxK) return (const void *)hstu_output_fwd_kernel<4>;
    return (const void *)hstu_output_fwd_kernel<0>;
}

const void *bwd_fn(const tf_hstu_output_bwd_params *p) {
    const int64_t nch = (p->cols + TF_VEC - 1) / TF_VEC;
    if (p->group_weights || p->groups != 1 || nch > 32 * kMaxK) return (const void *)hstu_output_bwd_kernel<0>;
    if (nch <= 32) return (const void *)hstu_output_bwd_kernel<1>;
    if (nch <= 64) return (const void *)hstu_output_bwd_kernel<2>;
    return (const void *)hstu_output_bwd_kernel<4>;
}

/* Blocks of `fn` resident on the current device at once (looked up once per device and kernel). */
int64_t resident_blocks(const void *fn) {
    static std::mutex mu;
    static std::map<std::pair<int, const void *>, int64_t> cache;
    int dev = 0;
    cudaGetDevice(&dev);
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find({dev, fn});
    if (it != cache.end()) return it->second;
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kWarps * 32, 0);
    const int64_t n = (int64_t)sms * (per_sm < 1 ? 1 : per_sm);
    cache[{dev, fn}] = n;
    return n;
}

unsigned grid_for(const void *fn, int64_t tasks) {
    const int64_t needed = (tasks + kWarps - 1) / kWarps, res = resident_blocks(fn);
    return (unsigned)(needed < res ? needed : res);
}

} // namespace

extern "C" int tf_hstu_output_fwd_cuda(const tf_hstu_output_fwd_params *p, void *stream) {
    const void *fn = fwd_fn(p);
    /* with no rows one block still runs: it writes rng_out */
    const unsigned grid = p->rows == 0 ? 1u : grid_for(fn, p->rows * p->groups);
    tf_hstu_output_fwd_params params = *p;
    void *args[] = {&params};
    return (int)cudaLaunchKernel(fn, dim3(grid), dim3(kWarps * 32), args, 0, (cudaStream_t)stream);
}

extern "C" int64_t tf_hstu_output_bwd_cuda_partials(const tf_hstu_output_bwd_params *p) {
    if (p->rows == 0) return 1;
    return (int64_t)grid_for(bwd_fn(p), p->rows * p->groups) * kWarps;
}

extern "C" int tf_hstu_output_bwd_cuda(const tf_hstu_output_bwd_params *p, void *stream) {
    if (p->rows == 0) return 0;
    const void *fn = bwd_fn(p);
    const unsigned grid = grid_for(fn, p->rows * p->groups);
    if ((int64_t)grid * kWarps != p->n_partials) return (int)cudaErrorInvalidValue;
    tf_hstu_output_bwd_params params = *p;
    void *args[] = {&params};
    return (int)cudaLaunchKernel(fn, dim3(grid), dim3(kWarps * 32), args, 0, (cudaStream_t)stream);
}

/* Sampled softmax loss on CUDA (semantics and the A and B gradient forms: sampled_softmax_kernels.h).
 *
 * Row kernels give one warp to a row of D elements: the row is cut into chunks of 8 (tf_vec.cuh: 16-byte
 * accesses where whole and aligned), chunk j read by lane j % 32, and per-row sums reduce with warp
 * shuffles. Per-row negatives take one warp per query row t: the warp walks the row's R negatives, each
 * read once from memory per pass (the backward's second look at a negative row, to write its gradient,
 * hits L1), keeping the query gradient's running sum A in shared memory (D floats per warp, each lane
 * owning its chunks); rows of at most 128 elements split the warp into groups of 4, 8 or 16 lanes, each
 * group on its own negative, with the query's chunk and A in registers. Block kernels (shared negatives)
 * turn the caller's (rows x R) GEMM block into the row losses (a warp per row, online log-sum-exp over its
 * R columns) or into E / c (one thread per element). */
#include <cuda_runtime.h>

#include "sampled_softmax_kernels.h"
#include "tf_vec.cuh"

namespace {

constexpr int kWarps = 4;   /* warps (rows) per block of the row kernels */
constexpr int kThreads = 256; /* threads per block of the element-wise kernel */

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float inv_norm(const tf_ssm_params &p, float sq) {
    return p.l2_norm ? 1.f / fmaxf(sqrtf(sq), p.eps) : 1.f;
}

__device__ __forceinline__ bool projects(const tf_ssm_params &p, float r) { return p.l2_norm && r < 1.f / p.eps; }

__device__ __forceinline__ bool masked(const tf_ssm_params &p, int64_t t, int64_t r) {
    return p.pos_ids && p.neg_ids[t * p.neg_ids_stride + r] == p.pos_ids[t];
}

__device__ __forceinline__ int chunk_n(int64_t col, int64_t D) { return (int)(D - col < TF_VEC ? D - col : TF_VEC); }

__device__ __forceinline__ float dot8(const float (&a)[TF_VEC], const float (&b)[TF_VEC]) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < TF_VEC; ++i) s += a[i] * b[i];
    return s;
}

/* (m, l) of an online log-sum-exp merged with (m2, l2); m = -inf stands for an empty sum. */
__device__ __forceinline__ void lse_merge(float &m, float &l, float m2, float l2) {
    const float M = fmaxf(m, m2);
    if (M == -INFINITY) return;
    l = (m == -INFINITY ? 0.f : l * expf(m - M)) + (m2 == -INFINITY ? 0.f : l2 * expf(m2 - M));
    m = M;
}

/* x added to an online log-sum-exp (m, l): one exp per element (the same sums as lse_merge(m, l, x, 1)). */
__device__ __forceinline__ void lse_push(float &m, float &l, float x) {
    if (x > m) {
        l = l * expf(m - x) + 1.f;
        m = x;
    } else {
        l += expf(x - m);
    }
}

/* a and b summed over each group of L lanes (every lane of the group gets the sums). */
template <int L>
__device__ __forceinline__ void sub_sum2(float &a, float &b) {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
}

/* logsumexp(pos, negatives) - pos from the negatives' online (m, l): log1p where the positive dominates
 * (sampled_softmax_kernels.h says why the row loss is what is kept). */
__device__ __forceinline__ float row_loss(float pos, float m, float l) {
    if (m <= pos) return log1pf(l * expf(m - pos)); /* also no negatives: m = -inf, l = 0 */
    return (m - pos) + logf(l + expf(pos - m));
}

/* f(a, b) on each of this lane's TF_VEC-column chunks of rows ra and rb (D elements; zeros past D). */
template <typename F>
__device__ __forceinline__ void lane_chunks(const tf_ssm_params &p, int lane, const void *ra, const void *rb, F f) {
    for (int64_t col = (int64_t)lane * TF_VEC; col < p.D; col += 32 * TF_VEC) {
        const int n = chunk_n(col, p.D);
        float a[TF_VEC], b[TF_VEC];
        tf_load_chunk(ra, p.dtype, col, n, a);
        tf_load_chunk(rb, p.dtype, col, n, b);
        f(a, b);
    }
}

/* rq, rp, pos of a row (every lane gets them). */
__device__ __forceinline__ void row_stats(const tf_ssm_params &p, int64_t t, int lane, float &rq, float &rp,
                                          float &pos) {
    const void *qr = tf_row(p.q, p.dtype, t, p.D), *pr = tf_row(p.p, p.dtype, t, p.D);
    float qq = 0.f, pp = 0.f, qp = 0.f;
    lane_chunks(p, lane, qr, pr, [&](const float (&q)[TF_VEC], const float (&v)[TF_VEC]) {
        qq += dot8(q, q);
        pp += dot8(v, v);
        qp += dot8(q, v);
    });
    qq = warp_sum(qq);
    pp = warp_sum(pp);
    qp = warp_sum(qp);
    rq = inv_norm(p, qq);
    rp = inv_norm(p, pp);
    pos = p.scale * qp * rq * rp;
}

__global__ void row_stats_kernel(tf_ssm_params p, float *rq, float *rp, float *pos) {
    const int64_t t = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (t >= p.T) return;
    float a, b, c;
    row_stats(p, t, lane, a, b, c);
    if (lane == 0) {
        rq[t] = a;
        rp[t] = b;
        pos[t] = c;
    }
}

__global__ void neg_norms_kernel(tf_ssm_params p, float *rn) {
    const int64_t r = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= p.R) return;
    const void *nr = tf_row(p.n, p.dtype, r, p.D);
    float nn = 0.f;
    for (int64_t col = (int64_t)lane * TF_VEC; col < p.D; col += 32 * TF_VEC) {
        float v[TF_VEC];
        tf_load_chunk(nr, p.dtype, col, chunk_n(col, p.D), v);
        nn += dot8(v, v);
    }
    nn = warp_sum(nn);
    if (lane == 0) rn[r] = inv_norm(p, nn);
}

__global__ void block_lse_kernel(tf_ssm_params p, const float *S, int64_t t0, int64_t rows, const float *rq,
                                 const float *rn, const float *pos, float *loss) {
    const int64_t i = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (i >= rows) return;
    const int64_t t = t0 + i;
    const float k = p.scale * rq[t];
    const float *row = S + i * p.R;
    float m = -INFINITY, l = 0.f;
    for (int64_t r = lane; r < p.R; r += 32) {
        const float x = masked(p, t, r) ? TF_SSM_MASKED_LOGIT : k * row[r] * rn[r];
        lse_push(m, l, x);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
        lse_merge(m, l, m2, l2);
    }
    if (lane == 0) loss[t] = row_loss(pos[t], m, l);
}

__global__ void block_dlogits_kernel(tf_ssm_params p, const float *S, void *E, int e_dtype, int64_t t0, int64_t rows,
                                     const float *rq, const float *rn, const float *pos, const float *loss,
                                     const float *g, const float *c) {
    const int64_t total = rows * p.R;
    const float inv_c = 1.f / *c;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (int64_t)gridDim.x * blockDim.x) {
        const int64_t i = idx / p.R, r = idx - i * p.R, t = t0 + i;
        float e = 0.f;
        if (!masked(p, t, r)) {
            const float rqt = rq[t], rnr = rn[r];
            e = p.scale * g[t] * rqt * inv_c * expf(p.scale * rqt * S[idx] * rnr - pos[t] - loss[t]) * rnr;
        }
        if (e_dtype == TF_F32) ((float *)E)[idx] = e;
        else if (e_dtype == TF_BF16) ((__nv_bfloat16 *)E)[idx] = __float2bfloat16_rn(e);
        else ((__half *)E)[idx] = __float2half_rn(e);
    }
}

/* dq, dp of row t from A (fp32 row of D, times cmul: the negatives' part; NULL: none); A is read, not
 * written. Every lane of the warp calls this. */
__device__ void finish_row(const tf_ssm_params &p, int64_t t, int lane, const float *A, float cmul, float rq, float rp,
                           float pos, float loss, float g, void *dq, void *dp) {
    const float s = p.scale, dpos = g * expm1f(-loss);
    const float ka = s * dpos * rq * rp;
    const void *qr = tf_row(p.q, p.dtype, t, p.D), *pr = tf_row(p.p, p.dtype, t, p.D);
    float aq = 0.f;
    for (int64_t col = (int64_t)lane * TF_VEC; col < p.D; col += 32 * TF_VEC) {
        const int n = chunk_n(col, p.D);
        float q[TF_VEC], v[TF_VEC], a[TF_VEC] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        tf_load_chunk(qr, p.dtype, col, n, q);
        tf_load_chunk(pr, p.dtype, col, n, v);
        if (A) tf_load_chunk(A, TF_F32, col, n, a);
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) a[i] = cmul * a[i] + ka * v[i];
        aq += dot8(a, q);
    }
    aq = projects(p, rq) ? warp_sum(aq) * rq * rq : 0.f;
    const float kq = s * dpos * rp * rq, kp = projects(p, rp) ? s * dpos * rp * rp * (pos / s) : 0.f;
    void *dqr = tf_row(dq, p.dtype, t, p.D), *dpr = tf_row(dp, p.dtype, t, p.D);
    for (int64_t col = (int64_t)lane * TF_VEC; col < p.D; col += 32 * TF_VEC) {
        const int n = chunk_n(col, p.D);
        float q[TF_VEC], v[TF_VEC], a[TF_VEC] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, o[TF_VEC];
        tf_load_chunk(qr, p.dtype, col, n, q);
        tf_load_chunk(pr, p.dtype, col, n, v);
        if (A) tf_load_chunk(A, TF_F32, col, n, a);
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) o[i] = cmul * a[i] + ka * v[i] - aq * q[i];
        tf_store_chunk(dqr, p.dtype, col, n, o);
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) o[i] = kq * q[i] - kp * v[i];
        tf_store_chunk(dpr, p.dtype, col, n, o);
    }
}

__global__ void rows_bwd_kernel(tf_ssm_params p, const float *Ac, int64_t t0, int64_t rows, const float *rq,
                                const float *rp, const float *pos, const float *loss, const float *g,
                                const float *c, void *dq, void *dp) {
    const int64_t i = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (i >= rows) return;
    const int64_t t = t0 + i;
    finish_row(p, t, lane, Ac ? Ac + i * p.D : nullptr, *c, rq[t], rp[t], pos[t], loss[t], g[t], dq, dp);
}

__global__ void neg_bwd_kernel(tf_ssm_params p, const float *Bc, const float *rn, const float *c, void *dn) {
    const int64_t r = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (r >= p.R) return;
    const float cm = *c, rnr = rn[r];
    const void *nr = tf_row(p.n, p.dtype, r, p.D);
    const float *br = Bc + r * p.D;
    float bn = 0.f;
    for (int64_t col = (int64_t)lane * TF_VEC; col < p.D; col += 32 * TF_VEC) {
        const int n = chunk_n(col, p.D);
        float v[TF_VEC], b[TF_VEC];
        tf_load_chunk(nr, p.dtype, col, n, v);
        tf_load_chunk(br, TF_F32, col, n, b);
        bn += dot8(b, v);
    }
    bn = projects(p, rnr) ? warp_sum(bn) * cm * rnr * rnr : 0.f;
    void *dr = tf_row(dn, p.dtype, r, p.D);
    for (int64_t col = (int64_t)lane * TF_VEC; col < p.D; col += 32 * TF_VEC) {
        const int n = chunk_n(col, p.D);
        float v[TF_VEC], b[TF_VEC];
        tf_load_chunk(nr, p.dtype, col, n, v);
        tf_load_chunk(br, TF_F32, col, n, b);
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) b[i] = cm * b[i] - bn * v[i];
        tf_store_chunk(dr, p.dtype, col, n, b);
    }
}

/* <q_t, n> and ||n||^2 of negative row nr (every lane gets them). */
__device__ __forceinline__ void neg_dots(const tf_ssm_params &p, const void *qr, const void *nr, int lane, float &qn,
                                         float &nn) {
    qn = 0.f;
    nn = 0.f;
    lane_chunks(p, lane, qr, nr, [&](const float (&q)[TF_VEC], const float (&v)[TF_VEC]) {
        qn += dot8(q, v);
        nn += dot8(v, v);
    });
    qn = warp_sum(qn);
    nn = warp_sum(nn);
}

__global__ void per_row_fwd_kernel(tf_ssm_params p, float *loss) {
    const int64_t t = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (t >= p.T) return;
    float rq, rp, pos;
    row_stats(p, t, lane, rq, rp, pos);
    const void *qr = tf_row(p.q, p.dtype, t, p.D);
    float m = -INFINITY, l = 0.f;
    for (int64_t r = 0; r < p.R; ++r) {
        float x = TF_SSM_MASKED_LOGIT;
        if (!masked(p, t, r)) {
            float qn, nn;
            neg_dots(p, qr, tf_row(p.n, p.dtype, t * p.R + r, p.D), lane, qn, nn);
            x = p.scale * qn * rq * inv_norm(p, nn);
        }
        lse_push(m, l, x);
    }
    if (lane == 0) loss[t] = row_loss(pos, m, l);
}

__global__ void per_row_bwd_kernel(tf_ssm_params p, const float *loss, const float *g, void *dq, void *dp, void *dn) {
    extern __shared__ float smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = (int64_t)blockIdx.x * kWarps + warp;
    if (t >= p.T) return;
    float *A = smem + (int64_t)warp * p.D;  /* lane-owned chunks: no synchronisation needed */
    for (int64_t col = (int64_t)lane * TF_VEC; col < p.D; col += 32 * TF_VEC)
        for (int i = 0; i < chunk_n(col, p.D); ++i) A[col + i] = 0.f;
    float rq, rp, pos;
    row_stats(p, t, lane, rq, rp, pos);
    const float s = p.scale, gt = g[t], lt = loss[t];
    const void *qr = tf_row(p.q, p.dtype, t, p.D);
    for (int64_t r = 0; r < p.R; ++r) {
        const int64_t row = t * p.R + r;
        const void *nr = tf_row(p.n, p.dtype, row, p.D);
        void *dr = tf_row(dn, p.dtype, row, p.D);
        float e = 0.f, bn = 0.f;
        const bool live = !masked(p, t, r);
        if (live) {
            float qn, nn;
            neg_dots(p, qr, nr, lane, qn, nn);
            const float rn = inv_norm(p, nn);
            e = s * gt * expf(s * qn * rq * rn - pos - lt) * rq * rn;
            bn = projects(p, rn) ? e * qn * rn * rn : 0.f;
        }
        for (int64_t col = (int64_t)lane * TF_VEC; col < p.D; col += 32 * TF_VEC) {
            const int n = chunk_n(col, p.D);
            float q[TF_VEC], v[TF_VEC], o[TF_VEC];
            if (live) {
                tf_load_chunk(qr, p.dtype, col, n, q);
                tf_load_chunk(nr, p.dtype, col, n, v);
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) {
                    o[i] = e * q[i] - bn * v[i];
                    if (i < n) A[col + i] += e * v[i];
                }
            } else {
#pragma unroll
                for (int i = 0; i < TF_VEC; ++i) o[i] = 0.f;
            }
            tf_store_chunk(dr, p.dtype, col, n, o);
        }
    }
    finish_row(p, t, lane, A, 1.f, rq, rp, pos, lt, gt, dq, dp);
}

/* Per-row negatives with short rows (at most L chunks, L = 4, 8 or 16 lanes): the warp splits into
 * 32 / L groups of L lanes, each group on its own negative at a time, so that a row of D <= 8 L elements
 * still occupies the whole warp; the query chunk and the negative's chunk stay in registers. */
template <int L>
__global__ void per_row_fwd_short_kernel(tf_ssm_params p, float *loss) {
    constexpr int G = 32 / L;
    const int64_t t = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32, sub = lane / L;
    if (t >= p.T) return;
    float rq, rp, pos;
    row_stats(p, t, lane, rq, rp, pos);
    const int64_t col = (int64_t)(lane % L) * TF_VEC;
    const int n = col < p.D ? chunk_n(col, p.D) : 0;
    float q[TF_VEC];
    tf_load_chunk(tf_row(p.q, p.dtype, t, p.D), p.dtype, col, n, q); /* n = 0: zeros, nothing read */
    float m = -INFINITY, l = 0.f;
    for (int64_t r0 = 0; r0 < p.R; r0 += G) {
        const int64_t r = r0 + sub;
        const bool live = r < p.R && !masked(p, t, r);
        float qn = 0.f, nn = 0.f;
        if (live) {
            float v[TF_VEC];
            tf_load_chunk(tf_row(p.n, p.dtype, t * p.R + r, p.D), p.dtype, col, n, v);
            qn = dot8(q, v);
            nn = dot8(v, v);
        }
        sub_sum2<L>(qn, nn);
        if (r < p.R) {
            const float x = live ? p.scale * qn * rq * inv_norm(p, nn) : TF_SSM_MASKED_LOGIT;
            lse_push(m, l, x);
        }
    }
#pragma unroll
    for (int o = 16; o >= L; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
        lse_merge(m, l, m2, l2);
    }
    if (lane == 0) loss[t] = row_loss(pos, m, l);
}

template <int L>
__global__ void per_row_bwd_short_kernel(tf_ssm_params p, const float *loss, const float *g, void *dq, void *dp,
                                         void *dn) {
    constexpr int G = 32 / L;
    __shared__ __align__(16) float smem[kWarps][L * TF_VEC];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane / L;
    const int64_t t = (int64_t)blockIdx.x * kWarps + warp;
    if (t >= p.T) return;
    float rq, rp, pos;
    row_stats(p, t, lane, rq, rp, pos);
    const float s = p.scale, gt = g[t], lt = loss[t];
    const int64_t col = (int64_t)(lane % L) * TF_VEC;
    const int n = col < p.D ? chunk_n(col, p.D) : 0;
    float q[TF_VEC], a[TF_VEC] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    tf_load_chunk(tf_row(p.q, p.dtype, t, p.D), p.dtype, col, n, q);
    for (int64_t r0 = 0; r0 < p.R; r0 += G) {
        const int64_t r = r0 + sub;
        const bool live = r < p.R && !masked(p, t, r);
        float qn = 0.f, nn = 0.f, v[TF_VEC] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (live) {
            tf_load_chunk(tf_row(p.n, p.dtype, t * p.R + r, p.D), p.dtype, col, n, v);
            qn = dot8(q, v);
            nn = dot8(v, v);
        }
        sub_sum2<L>(qn, nn);
        if (r < p.R && n > 0) {
            float e = 0.f, bn = 0.f, o[TF_VEC];
            if (live) {
                const float rn = inv_norm(p, nn);
                e = s * gt * expf(s * qn * rq * rn - pos - lt) * rq * rn;
                bn = projects(p, rn) ? e * qn * rn * rn : 0.f;
            }
#pragma unroll
            for (int i = 0; i < TF_VEC; ++i) {
                o[i] = e * q[i] - bn * v[i];
                a[i] += e * v[i];
            }
            tf_store_chunk(tf_row(dn, p.dtype, t * p.R + r, p.D), p.dtype, col, n, o);
        }
    }
    /* the groups' partial sums of A, then A through shared memory into finish_row's lane-to-chunk
     * layout (lane j < L of group 0 holds chunk j, which finish_row gives to lane j) */
#pragma unroll
    for (int o = 16; o >= L; o >>= 1)
#pragma unroll
        for (int i = 0; i < TF_VEC; ++i) a[i] += __shfl_xor_sync(0xffffffffu, a[i], o);
    float *A = smem[warp];
    if (sub == 0 && n > 0) tf_store_chunk(A, TF_F32, col, n, a);
    __syncwarp();
    finish_row(p, t, lane, A, 1.f, rq, rp, pos, lt, gt, dq, dp);
}

unsigned rows_grid(int64_t rows) { return (unsigned)((rows + kWarps - 1) / kWarps); }

/* Lanes per negative for rows of D elements: 4, 8 or 16 for short rows, else 32 (the whole warp). */
int lanes_for(int64_t D) {
    const int64_t chunks = (D + TF_VEC - 1) / TF_VEC;
    return chunks <= 4 ? 4 : chunks <= 8 ? 8 : chunks <= 16 ? 16 : 32;
}

int launched() { return (int)cudaGetLastError(); }

}  // namespace

extern "C" {

int tf_ssm_row_stats_cuda(const tf_ssm_params *p, float *rq, float *rp, float *pos, void *stream) {
    if (p->T == 0) return 0;
    row_stats_kernel<<<rows_grid(p->T), kWarps * 32, 0, (cudaStream_t)stream>>>(*p, rq, rp, pos);
    return launched();
}

int tf_ssm_neg_norms_cuda(const tf_ssm_params *p, float *rn, void *stream) {
    if (p->R == 0) return 0;
    neg_norms_kernel<<<rows_grid(p->R), kWarps * 32, 0, (cudaStream_t)stream>>>(*p, rn);
    return launched();
}

int tf_ssm_block_lse_cuda(const tf_ssm_params *p, float *S, int64_t t0, int64_t rows, const float *rq,
                          const float *rn, const float *pos, float *loss, void *stream) {
    if (rows == 0) return 0;
    block_lse_kernel<<<rows_grid(rows), kWarps * 32, 0, (cudaStream_t)stream>>>(*p, S, t0, rows, rq, rn, pos, loss);
    return launched();
}

int tf_ssm_block_dlogits_cuda(const tf_ssm_params *p, const float *S, void *E, int e_dtype, int64_t t0, int64_t rows,
                              const float *rq, const float *rn, const float *pos, const float *loss, const float *g,
                              const float *c, void *stream) {
    const int64_t total = rows * p->R;
    if (total == 0) return 0;
    const int64_t blocks = (total + kThreads - 1) / kThreads;
    block_dlogits_kernel<<<(unsigned)(blocks < 65536 * 8 ? blocks : 65536 * 8), kThreads, 0, (cudaStream_t)stream>>>(
        *p, S, E, e_dtype, t0, rows, rq, rn, pos, loss, g, c);
    return launched();
}

int tf_ssm_rows_bwd_cuda(const tf_ssm_params *p, const float *Ac, int64_t t0, int64_t rows, const float *rq,
                         const float *rp, const float *pos, const float *loss, const float *g, const float *c,
                         void *dq, void *dp, void *stream) {
    if (rows == 0) return 0;
    rows_bwd_kernel<<<rows_grid(rows), kWarps * 32, 0, (cudaStream_t)stream>>>(*p, Ac, t0, rows, rq, rp, pos, loss,
                                                                             g, c, dq, dp);
    return launched();
}

int tf_ssm_neg_bwd_cuda(const tf_ssm_params *p, const float *Bc, const float *rn, const float *c, void *dn,
                        void *stream) {
    if (p->R == 0) return 0;
    neg_bwd_kernel<<<rows_grid(p->R), kWarps * 32, 0, (cudaStream_t)stream>>>(*p, Bc, rn, c, dn);
    return launched();
}

int tf_ssm_per_row_fwd_cuda(const tf_ssm_params *p, float *loss, void *stream) {
    if (p->T == 0) return 0;
    const unsigned grid = rows_grid(p->T);
    cudaStream_t st = (cudaStream_t)stream;
    switch (lanes_for(p->D)) {
    case 4: per_row_fwd_short_kernel<4><<<grid, kWarps * 32, 0, st>>>(*p, loss); break;
    case 8: per_row_fwd_short_kernel<8><<<grid, kWarps * 32, 0, st>>>(*p, loss); break;
    case 16: per_row_fwd_short_kernel<16><<<grid, kWarps * 32, 0, st>>>(*p, loss); break;
    default: per_row_fwd_kernel<<<grid, kWarps * 32, 0, st>>>(*p, loss);
    }
    return launched();
}

int tf_ssm_per_row_bwd_cuda(const tf_ssm_params *p, const float *loss, const float *g, void *dq, void *dp, void *dn,
                            void *stream) {
    if (p->T == 0) return 0;
    const unsigned grid = rows_grid(p->T);
    cudaStream_t st = (cudaStream_t)stream;
    switch (lanes_for(p->D)) {
    case 4: per_row_bwd_short_kernel<4><<<grid, kWarps * 32, 0, st>>>(*p, loss, g, dq, dp, dn); return launched();
    case 8: per_row_bwd_short_kernel<8><<<grid, kWarps * 32, 0, st>>>(*p, loss, g, dq, dp, dn); return launched();
    case 16: per_row_bwd_short_kernel<16><<<grid, kWarps * 32, 0, st>>>(*p, loss, g, dq, dp, dn); return launched();
    default: break;
    }
    const size_t smem = (size_t)kWarps * (size_t)p->D * sizeof(float);
    if (smem > 48 * 1024) {
        /* wide rows: opt in to more shared memory (an error past the device's limit, D > ~14k) */
        const cudaError_t err =
            cudaFuncSetAttribute(per_row_bwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) return (int)err;
    }
    per_row_bwd_kernel<<<rows_grid(p->T), kWarps * 32, smem, (cudaStream_t)stream>>>(*p, loss, g, dq, dp, dn);
    return launched();
}

}  /* extern "C" */

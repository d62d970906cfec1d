/* Sampled softmax loss on the CPU: plain C (semantics and the A and B gradient forms: sampled_softmax_kernels.h).
 * A row is converted to fp32 once into a buffer, then dot products and sums of squares run over plain
 * float arrays in 8 interleaved lanes (a single running sum is a chain of dependent adds that the
 * compiler may not reorder; 8 lanes vectorise). */
#include <math.h>
#include <stdlib.h>

#include "sampled_softmax_kernels.h"

#define LANES 8

static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t c = 0;
    for (; c + LANES <= n; c += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += a[c + l] * b[c + l];
    for (; c < n; ++c) acc[c % LANES] += a[c] * b[c];
    float t = 0.f;
    for (int l = 0; l < LANES; ++l) t += acc[l];
    return t;
}

static float *alloc_floats(int64_t n) {
    float *p = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!p) abort();
    return p;
}

/* 1 / max(||x||, eps) from ||x||^2, or 1 without normalisation. */
static float inv_norm(const tf_ssm_params *p, float sq) { return p->l2_norm ? 1.f / fmaxf(sqrtf(sq), p->eps) : 1.f; }

/* Whether the normalisation of a row with this inverse norm is unclamped (its backward projects). */
static int projects(const tf_ssm_params *p, float r) { return p->l2_norm && r < 1.f / p->eps; }

static int masked(const tf_ssm_params *p, int64_t t, int64_t r) {
    return p->pos_ids && p->neg_ids[t * p->neg_ids_stride + r] == p->pos_ids[t];
}

/* logsumexp(pos, v[0..n)) - pos. The negatives' sum is kept apart from the positive's term, so that a
 * row whose positive dominates gets log1p of a small sum rather than the log of 1 + it. */
static float row_loss(float pos, const float *v, int64_t n) {
    float m = -INFINITY;
    for (int64_t r = 0; r < n; ++r) m = fmaxf(m, v[r]);
    float l = 0.f;
    for (int64_t r = 0; r < n; ++r) l += expf(v[r] - m);
    if (m <= pos) return log1pf(l * expf(m - pos)); /* also n = 0: m = -inf, l = 0 */
    return (m - pos) + logf(l + expf(pos - m));
}

void tf_ssm_row_stats_cpu(const tf_ssm_params *p, float *rq, float *rp, float *pos, int64_t begin, int64_t end) {
    const int64_t D = p->D;
    float *q = alloc_floats(2 * D), *pv = q + D;
    for (int64_t t = begin; t < end; ++t) {
        tf_row_to_f32(p->q, p->dtype, t * D, D, q);
        tf_row_to_f32(p->p, p->dtype, t * D, D, pv);
        rq[t] = inv_norm(p, dot(q, q, D));
        rp[t] = inv_norm(p, dot(pv, pv, D));
        pos[t] = p->scale * dot(q, pv, D) * rq[t] * rp[t];
    }
    free(q);
}

void tf_ssm_neg_norms_cpu(const tf_ssm_params *p, float *rn, int64_t begin, int64_t end) {
    const int64_t D = p->D;
    float *n = alloc_floats(D);
    for (int64_t r = begin; r < end; ++r) {
        tf_row_to_f32(p->n, p->dtype, r * D, D, n);
        rn[r] = inv_norm(p, dot(n, n, D));
    }
    free(n);
}

void tf_ssm_block_lse_cpu(const tf_ssm_params *p, float *S, int64_t t0, const float *rq, const float *rn,
                          const float *pos, float *loss, int64_t begin, int64_t end) {
    const int64_t R = p->R;
    for (int64_t i = begin; i < end; ++i) {
        const int64_t t = t0 + i;
        float *row = S + i * R;
        const float k = p->scale * rq[t];
        for (int64_t r = 0; r < R; ++r) row[r] = masked(p, t, r) ? TF_SSM_MASKED_LOGIT : k * row[r] * rn[r];
        loss[t] = row_loss(pos[t], row, R);
    }
}

void tf_ssm_block_dlogits_cpu(const tf_ssm_params *p, const float *S, void *E, int e_dtype, int64_t t0,
                              const float *rq, const float *rn, const float *pos, const float *loss, const float *g,
                              const float *c, int64_t begin, int64_t end) {
    const int64_t R = p->R;
    const float inv_c = 1.f / *c;
    for (int64_t i = begin; i < end; ++i) {
        const int64_t t = t0 + i;
        const float k = p->scale * rq[t], ge = p->scale * g[t] * rq[t] * inv_c;
        for (int64_t r = 0; r < R; ++r) {
            float e = 0.f;
            if (!masked(p, t, r)) e = ge * expf(k * S[i * R + r] * rn[r] - pos[t] - loss[t]) * rn[r];
            tf_store_f32(E, e_dtype, i * R + r, e);
        }
    }
}

/* dq, dp of row t from A (fp32, D; the negatives' part, already multiplied back by c); q, pv are the
 * row's inputs in fp32; `out` a scratch row. */
static void rows_bwd_one(const tf_ssm_params *p, int64_t t, float *A, const float *q, const float *pv, float rq,
                         float rp, float pos, float loss, float g, void *dq, void *dp, float *out) {
    const int64_t D = p->D;
    const float s = p->scale, dpos = g * expm1f(-loss);
    const float ka = s * dpos * rq * rp;
    for (int64_t d = 0; d < D; ++d) A[d] += ka * pv[d];
    const float aq = projects(p, rq) ? dot(A, q, D) * rq * rq : 0.f; /* <A, q^> q^ = <A, q> rq^2 q */
    for (int64_t d = 0; d < D; ++d) out[d] = A[d] - aq * q[d];
    tf_row_from_f32(dq, p->dtype, t * D, D, out);
    /* dp = s dpos rp (q^ - p^ <q^, p^>), <q^, p^> = pos / s */
    const float kq = s * dpos * rp * rq, kp = projects(p, rp) ? s * dpos * rp * rp * (pos / s) : 0.f;
    for (int64_t d = 0; d < D; ++d) out[d] = kq * q[d] - kp * pv[d];
    tf_row_from_f32(dp, p->dtype, t * D, D, out);
}

void tf_ssm_rows_bwd_cpu(const tf_ssm_params *p, const float *Ac, int64_t t0, const float *rq, const float *rp,
                         const float *pos, const float *loss, const float *g, const float *c, void *dq, void *dp,
                         int64_t begin, int64_t end) {
    const int64_t D = p->D;
    float *buf = alloc_floats(4 * D), *q = buf + D, *pv = q + D, *out = pv + D;
    for (int64_t i = begin; i < end; ++i) {
        const int64_t t = t0 + i;
        tf_row_to_f32(p->q, p->dtype, t * D, D, q);
        tf_row_to_f32(p->p, p->dtype, t * D, D, pv);
        for (int64_t d = 0; d < D; ++d) buf[d] = Ac ? *c * Ac[i * D + d] : 0.f;
        rows_bwd_one(p, t, buf, q, pv, rq[t], rp[t], pos[t], loss[t], g[t], dq, dp, out);
    }
    free(buf);
}

void tf_ssm_neg_bwd_cpu(const tf_ssm_params *p, const float *Bc, const float *rn, const float *c, void *dn,
                        int64_t begin, int64_t end) {
    const int64_t D = p->D;
    float *n = alloc_floats(2 * D), *out = n + D;
    for (int64_t r = begin; r < end; ++r) {
        tf_row_to_f32(p->n, p->dtype, r * D, D, n);
        for (int64_t d = 0; d < D; ++d) out[d] = *c * Bc[r * D + d];
        const float bn = projects(p, rn[r]) ? dot(out, n, D) * rn[r] * rn[r] : 0.f;
        for (int64_t d = 0; d < D; ++d) out[d] -= bn * n[d];
        tf_row_from_f32(dn, p->dtype, r * D, D, out);
    }
    free(n);
}

void tf_ssm_per_row_fwd_cpu(const tf_ssm_params *p, float *loss, int64_t begin, int64_t end) {
    const int64_t D = p->D, R = p->R;
    float *q = alloc_floats(3 * D + R), *pv = q + D, *n = pv + D, *logit = n + D;
    for (int64_t t = begin; t < end; ++t) {
        tf_row_to_f32(p->q, p->dtype, t * D, D, q);
        tf_row_to_f32(p->p, p->dtype, t * D, D, pv);
        const float rq = inv_norm(p, dot(q, q, D)), rp = inv_norm(p, dot(pv, pv, D));
        const float pos = p->scale * dot(q, pv, D) * rq * rp;
        for (int64_t r = 0; r < R; ++r) {
            if (masked(p, t, r)) {
                logit[r] = TF_SSM_MASKED_LOGIT;
                continue;
            }
            tf_row_to_f32(p->n, p->dtype, (t * R + r) * D, D, n);
            logit[r] = p->scale * dot(q, n, D) * rq * inv_norm(p, dot(n, n, D));
        }
        loss[t] = row_loss(pos, logit, R);
    }
    free(q);
}

void tf_ssm_per_row_bwd_cpu(const tf_ssm_params *p, const float *loss, const float *g, void *dq, void *dp, void *dn,
                            int64_t begin, int64_t end) {
    const int64_t D = p->D, R = p->R;
    const float s = p->scale;
    float *buf = alloc_floats(5 * D), *A = buf, *q = A + D, *pv = q + D, *n = pv + D, *out = n + D;
    for (int64_t t = begin; t < end; ++t) {
        tf_row_to_f32(p->q, p->dtype, t * D, D, q);
        tf_row_to_f32(p->p, p->dtype, t * D, D, pv);
        const float rq = inv_norm(p, dot(q, q, D)), rp = inv_norm(p, dot(pv, pv, D));
        const float pos = s * dot(q, pv, D) * rq * rp;
        memset(A, 0, (size_t)D * sizeof(float));
        for (int64_t r = 0; r < R; ++r) {
            const int64_t off = (t * R + r) * D;
            if (masked(p, t, r)) {
                memset(out, 0, (size_t)D * sizeof(float));
                tf_row_from_f32(dn, p->dtype, off, D, out);
                continue;
            }
            tf_row_to_f32(p->n, p->dtype, off, D, n);
            const float qn = dot(q, n, D), rn = inv_norm(p, dot(n, n, D));
            const float e = s * g[t] * expf(s * qn * rq * rn - pos - loss[t]) * rq * rn;
            for (int64_t d = 0; d < D; ++d) A[d] += e * n[d];
            /* dn = B - n^ <B, n^> with B = e q: <B, n^> n^ = e <q, n> rn^2 n */
            const float bn = projects(p, rn) ? e * qn * rn * rn : 0.f;
            for (int64_t d = 0; d < D; ++d) out[d] = e * q[d] - bn * n[d];
            tf_row_from_f32(dn, p->dtype, off, D, out);
        }
        rows_bwd_one(p, t, A, q, pv, rq, rp, pos, loss[t], g[t], dq, dp, out);
    }
    free(buf);
}

/* HSTU attention on the CPU: the reference path, plain C, all arithmetic in double.
 * Semantics are those of hstu_kernels.h. One sequence at a time: its q, k, v (and dO) rows of one head are
 * widened to double once, then each query row walks the columns tf_hstu_col_range() allows, testing
 * the row's spans (tf_hstu_row_spans()) only in 16-column blocks that tf_hstu_tile_full() does not clear, the
 * decisions the CUDA kernels make per tile (so these tests exercise them too). The backward makes two
 * passes: by rows for dQ, by columns (over tf_hstu_row_range(), testing the column's spans) for dK, dV
 * and dbias. Dropout multiplies P (and so dZ) by the factor tf_philox_keep draws per element, in every pass. */
#include <math.h>
#include <stdlib.h>

#include "hstu_kernels.h"

static double ld(const void *base, int dt, int64_t i) {
    if (dt == TF_HSTU_F64) return ((const double *)base)[i];
    return (double)tf_load_f32(base, dt, i);
}

static void st(void *base, int dt, int64_t i, double v) {
    if (dt == TF_HSTU_F64) ((double *)base)[i] = v;
    else tf_store_f32(base, dt, i, (float)v);
}

static int64_t ld_index(const void *base, int i64, int64_t i) {
    return i64 ? ((const int64_t *)base)[i] : (int64_t)((const int32_t *)base)[i];
}

/* rows [r0, r0 + n) of head h of a (rows, H, d) tensor into out[n][d] */
static void load_rows(const void *base, int dt, int64_t sr, int64_t sh, int64_t r0, int64_t n, int64_t h,
                      int64_t d, double *out) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < d; ++j) out[i * d + j] = ld(base, dt, (r0 + i) * sr + h * sh + j);
}

static double dot(const double *a, const double *b, int64_t d) {
    double s = 0;
    for (int64_t j = 0; j < d; ++j) s += a[j] * b[j];
    return s;
}

typedef struct {
    int64_t start, n;        /* k/v rows */
    int64_t q_start, nq;     /* query rows: positions n - nq .. n - 1 */
    tf_hstu_mask mask;
} seq_info;

static seq_info seq_of(const tf_hstu_params *p, int64_t b) {
    seq_info s;
    s.start = ld_index(p->offsets, p->offsets_i64, b);
    s.n = ld_index(p->offsets, p->offsets_i64, b + 1) - s.start;
    if (p->kv_lengths) { /* validated: 0 <= kv_lengths[b] <= n */
        const int64_t kl = ld_index(p->kv_lengths, p->kv_lengths_i64, b);
        s.n = kl < 0 ? 0 : (kl < s.n ? kl : s.n);
    }
    s.q_start = p->delta > 0 ? b * p->delta : s.start;
    s.nq = p->delta > 0 ? p->delta : s.n;
    const int t = p->num_targets ? (int)ld_index(p->num_targets, p->targets_i64, b) : 0;
    s.mask = tf_hstu_mask_make((int)s.n, t, p->contextual, p->max_attn_len, p->min_full, p->group);
    return s;
}

/* z = alpha (q.k + bias) for row position pos, column col */
static double z_of(const tf_hstu_params *p, int64_t b, int64_t h, int64_t pos, int64_t col, const double *qrow,
                   const double *krow) {
    double s = dot(qrow, krow, p->dqk);
    if (p->bias) s += ld(p->bias, p->bias_dtype, b * p->bias_sb + h * p->bias_sh + pos * p->bias_sr + col);
    return p->alpha * s;
}

/* Dropout on P: its seed and offset, resolved once per call (on the CPU the pointers are never set). */
typedef struct {
    int on;
    uint64_t seed, offset;
    float p;       /* the keep test's threshold, as the CUDA kernels compare it */
    double scale;  /* 1 / (1 - p) */
} drop_state;

static drop_state drop_of(const tf_hstu_params *p) {
    drop_state d = {0, 0, 0, 0.f, 1.0};
    if (p->dropout_p > 0 && p->delta == 0) {
        d.on = 1;
        tf_philox_resolve(&p->philox, &d.seed, &d.offset);
        d.p = (float)p->dropout_p;
        d.scale = 1.0 / (1.0 - p->dropout_p);
    }
    return d;
}

/* P's factor at (row of q, head h, column col): 1 without dropout, else 0 or 1 / (1 - p) */
static double drop_factor(const tf_hstu_params *p, const drop_state *d, int64_t row, int64_t h, int64_t col) {
    if (!d->on) return 1.0;
    return tf_philox_keep(d->seed, d->offset, tf_hstu_drop_index(row, h, p->H, p->max_seq_len, col), d->p) ? d->scale
                                                                                                         : 0.0;
}

/* x lies in one of the n half-open spans [lo[i], hi[i]) */
static int in_any_span(const int *lo, const int *hi, int n, int x) {
    for (int i = 0; i < n; ++i)
        if (x >= lo[i] && x < hi[i]) return 1;
    return 0;
}

/* tf_hstu_valid() through the row's spans (the row passes: forward, dQ) or the column's (the dK / dV
 * pass), as the GPU kernels test it, so the tests hold both against the reference. */
static int in_spans(const tf_hstu_mask *mk, int pos, int col) {
    int lo[4], hi[4];
    tf_hstu_row_spans(mk, pos, lo, hi);
    return in_any_span(lo, hi, 4, col);
}
static int in_col_spans(const tf_hstu_mask *mk, int pos, int col) {
    int lo[5], hi[5];
    tf_hstu_col_spans(mk, col, lo, hi);
    return in_any_span(lo, hi, 5, pos);
}

/* Visits the valid columns of row `pos` in increasing order. */
#define FOR_VALID_COLS(mk, pos, col)                                                           \
    for (int lo_, hi_, blk_ = (tf_hstu_col_range(mk, (int)(pos), (int)(pos) + 1, &lo_, &hi_), lo_ / 16 * 16); \
         blk_ <= hi_; blk_ += 16)                                                              \
        for (int full_ = tf_hstu_tile_full(mk, (int)(pos), (int)(pos) + 1, blk_, blk_ + 16), col = blk_; \
             col < blk_ + 16 && col <= hi_; ++col)                                             \
            if (col >= lo_ && (full_ || in_spans(mk, (int)(pos), col)))

void tf_hstu_fwd_cpu(const tf_hstu_params *p, int64_t b0, int64_t b1) {
    const int64_t dqk = p->dqk, dv = p->dv;
    const drop_state dr = drop_of(p);
    for (int64_t b = b0; b < b1; ++b) {
        const seq_info s = seq_of(p, b);
        double *Q = (double *)malloc(sizeof(double) * (size_t)(s.nq * dqk + s.n * (dqk + dv) + dv + 1));
        double *K = Q + s.nq * dqk, *V = K + s.n * dqk, *acc = V + s.n * dv;
        for (int64_t h = 0; h < p->H; ++h) {
            load_rows(p->q, p->dtype, p->q_sr, p->q_sh, s.q_start, s.nq, h, dqk, Q);
            load_rows(p->k, p->dtype, p->k_sr, p->k_sh, s.start, s.n, h, dqk, K);
            load_rows(p->v, p->dtype, p->v_sr, p->v_sh, s.start, s.n, h, dv, V);
            for (int64_t i = 0; i < s.nq; ++i) {
                const int64_t pos = s.n - s.nq + i;
                for (int64_t j = 0; j < dv; ++j) acc[j] = 0;
                if (pos >= 0) {
                    FOR_VALID_COLS(&s.mask, pos, col) {
                        const double z = z_of(p, b, h, pos, col, Q + i * dqk, K + col * dqk);
                        const double w =
                            z / (1.0 + exp(-z)) * p->inv_scale * drop_factor(p, &dr, s.start + pos, h, col);
                        for (int64_t j = 0; j < dv; ++j) acc[j] += w * V[col * dv + j];
                    }
                }
                for (int64_t j = 0; j < dv; ++j) st(p->o, p->dtype, ((s.q_start + i) * p->H + h) * dv + j, acc[j]);
            }
        }
        free(Q);
    }
}

/* dZ (without the alpha of dQ/dK) for one valid pair: dP * inv_scale * s (1 + z (1 - s)) */
static double dz_of(const tf_hstu_params *p, double z, const double *dorow, const double *vrow) {
    const double sg = 1.0 / (1.0 + exp(-z));
    return dot(dorow, vrow, p->dv) * p->inv_scale * sg * (1.0 + z * (1.0 - sg));
}

void tf_hstu_bwd_cpu(const tf_hstu_params *p, int64_t b0, int64_t b1) {
    const int64_t dqk = p->dqk, dv = p->dv;
    const double alpha = p->alpha;
    const drop_state dr = drop_of(p);
    for (int64_t b = b0; b < b1; ++b) {
        const seq_info s = seq_of(p, b);
        const int64_t n = s.n;
        double *Q = (double *)malloc(sizeof(double) * (size_t)(n * (2 * dqk + 2 * dv) + dqk + dv + 1));
        double *K = Q + n * dqk, *V = K + n * dqk, *DO = V + n * dv, *acc = DO + n * dv, *acc2 = acc + dqk;
        for (int64_t h = 0; h < p->H; ++h) {
            load_rows(p->q, p->dtype, p->q_sr, p->q_sh, s.start, n, h, dqk, Q);
            load_rows(p->k, p->dtype, p->k_sr, p->k_sh, s.start, n, h, dqk, K);
            load_rows(p->v, p->dtype, p->v_sr, p->v_sh, s.start, n, h, dv, V);
            load_rows(p->dout, p->dtype, p->do_sr, p->do_sh, s.start, n, h, dv, DO);
            /* dQ by rows */
            for (int64_t pos = 0; pos < n; ++pos) {
                for (int64_t j = 0; j < dqk; ++j) acc[j] = 0;
                FOR_VALID_COLS(&s.mask, pos, col) {
                    const double z = z_of(p, b, h, pos, col, Q + pos * dqk, K + col * dqk);
                    const double dz = alpha * dz_of(p, z, DO + pos * dv, V + col * dv) *
                                      drop_factor(p, &dr, s.start + pos, h, col);
                    for (int64_t j = 0; j < dqk; ++j) acc[j] += dz * K[col * dqk + j];
                }
                for (int64_t j = 0; j < dqk; ++j) st(p->dq, p->dtype, (s.start + pos) * p->dq_sr + h * dqk + j, acc[j]);
            }
            /* dK, dV, dbias by columns */
            for (int col = 0; col < (int)n; ++col) {
                for (int64_t j = 0; j < dqk; ++j) acc[j] = 0;
                for (int64_t j = 0; j < dv; ++j) acc2[j] = 0;
                int ctx_end, lo, hi;
                tf_hstu_row_range(&s.mask, col, col + 1, &ctx_end, &lo, &hi);
                for (int pos = 0; pos <= hi; ++pos) {
                    if (pos >= ctx_end && pos < lo) pos = lo;
                    if (!in_col_spans(&s.mask, pos, col)) continue;
                    const double z = z_of(p, b, h, pos, col, Q + pos * dqk, K + col * dqk);
                    const double sg = 1.0 / (1.0 + exp(-z));
                    const double f = drop_factor(p, &dr, s.start + pos, h, col);
                    const double pw = z * sg * p->inv_scale * f;
                    const double dz = alpha * dz_of(p, z, DO + pos * dv, V + col * dv) * f;
                    for (int64_t j = 0; j < dqk; ++j) acc[j] += dz * Q[pos * dqk + j];
                    for (int64_t j = 0; j < dv; ++j) acc2[j] += pw * DO[pos * dv + j];
                    if (p->dbias) ((double *)p->dbias)[b * p->bias_sb + h * p->bias_sh + pos * p->bias_sr + col] += dz;
                }
                for (int64_t j = 0; j < dqk; ++j) st(p->dk, p->dtype, (s.start + col) * p->dk_sr + h * dqk + j, acc[j]);
                for (int64_t j = 0; j < dv; ++j) st(p->dvv, p->dtype, (s.start + col) * p->dv_sr + h * dv + j, acc2[j]);
            }
        }
        free(Q);
    }
}

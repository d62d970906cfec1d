/* HSTU output section on the CPU (semantics: hstu_output_kernels.h). Element math in fp32 as the CUDA
 * kernels do it, statistics summed in fp64; also the reference the CUDA path's dropout mask is
 * compared with. */
#include <math.h>
#include <stdlib.h>

#include "hstu_output_kernels.h"

static inline float act_f(float x, int act) {
    if (act == TF_ACT_SILU) return x / (1.f + expf(-x));
    if (act == TF_ACT_SIGMOID) return 1.f / (1.f + expf(-x));
    return x;
}

static inline float act_grad(float x, int act) {
    if (act == TF_ACT_NONE) return 1.f;
    const float s = 1.f / (1.f + expf(-x));
    return act == TF_ACT_SILU ? s * (1.f + x * (1.f - s)) : s * (1.f - s);
}

/* Keep decisions walked in element order: one Philox block per 8 elements (tf_philox_keep16). */
typedef struct {
    uint64_t seed, offset, block;
    uint32_t w[4];
    int have;
    uint32_t threshold;
    float scale;
} mask_walk;

static inline float mask_factor(mask_walk *m, uint64_t e) {
    if (!m->have || (e >> 3) != m->block) {
        m->block = e >> 3;
        tf_philox4x32_10(m->seed, m->offset, m->block, m->w);
        m->have = 1;
    }
    return tf_philox_keep16(m->w[(e >> 1) & 3], (int)(e & 1), m->threshold) ? m->scale : 0.f;
}

static void mask_init(mask_walk *m, const tf_philox_args *rng, int dropout, float p) {
    m->have = 0;
    m->threshold = tf_philox_threshold16(p);
    m->scale = dropout ? 1.f / (1.f - p) : 1.f;
    m->seed = m->offset = 0;
    if (dropout) tf_philox_resolve(rng, &m->seed, &m->offset);
}

/* Column offsets of the concatenated parts (-1: absent). */
static void part_offsets(int64_t cols, int cat_u, int cat_x, int64_t *ou, int64_t *ox, int64_t *oy) {
    *ou = cat_u ? 0 : -1;
    *ox = cat_x ? (cat_u ? cols : 0) : -1;
    *oy = (int64_t)(cat_u + cat_x) * cols;
}

static void row_stats(const float *a, int64_t n, float eps, float *mean, float *rstd) {
    double s = 0.0, v = 0.0;
    for (int64_t c = 0; c < n; ++c) s += a[c];
    const double m = s / (double)n;
    for (int64_t c = 0; c < n; ++c) v += ((double)a[c] - m) * ((double)a[c] - m);
    *mean = (float)m;
    *rstd = (float)(1.0 / sqrt(v / (double)n + (double)eps));
}

/* dst[c] = src[c] * keep(e0 + c) / (1 - p), c < n: one segment of the concatenation, in element order. */
static void drop_segment(mask_walk *m, int dropout, uint64_t e0, int64_t n, float *v) {
    if (!dropout) return;
    for (int64_t c = 0; c < n; ++c) v[c] *= mask_factor(m, e0 + (uint64_t)c);
}

/* What one row of y is made from: the parts' offsets, the norm parameters and activations. */
typedef struct {
    int64_t n, G, ou, ox, oy;
    const void *w, *b;
    int w_dtype, group_weights, mul_act, cat_act, dropout;
} y_layout;

/* Row r of y, its three parts dropped out and rounded, from the row's attn a and u and each group's
 * (mean, rstd): written by the forward, and again by the backward for recompute_y_in_backward. */
static void write_y_row(const y_layout *l, mask_walk *mw, const float *a, const float *u, const float *mean,
                        const float *rstd, uint64_t e_row, void *y, int y_dtype, int64_t y_row, float *v) {
    const int64_t n = l->n, gs = n / l->G;
    if (l->ou >= 0) {
        for (int64_t c = 0; c < n; ++c) v[c] = act_f(u[c], l->cat_act);
        drop_segment(mw, l->dropout, e_row + l->ou, n, v);
        tf_row_from_f32(y, y_dtype, y_row + l->ou, n, v);
    }
    if (l->ox >= 0) {
        for (int64_t c = 0; c < n; ++c) v[c] = a[c];
        drop_segment(mw, l->dropout, e_row + l->ox, n, v);
        tf_row_from_f32(y, y_dtype, y_row + l->ox, n, v);
    }
    for (int64_t g = 0; g < l->G; ++g)
        for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
            const int64_t wi = l->group_weights ? g : c;
            const float w = tf_load_f32(l->w, l->w_dtype, wi), b = tf_load_f32(l->b, l->w_dtype, wi);
            v[c] = act_f(u[c], l->mul_act) * ((a[c] - mean[g]) * rstd[g] * w + b);
        }
    drop_segment(mw, l->dropout, e_row + l->oy, n, v);
    tf_row_from_f32(y, y_dtype, y_row + l->oy, n, v);
}

#define Y_LAYOUT(p) {(p)->cols, (p)->groups, 0, 0, 0, (p)->w, (p)->b, (p)->w_dtype, (p)->group_weights, \
                      (p)->mul_act, (p)->cat_act, (p)->dropout}

void tf_hstu_output_fwd_cpu(const tf_hstu_output_fwd_params *p, int64_t row_begin, int64_t row_end) {
    const int64_t n = p->cols, G = p->groups, gs = n / G;
    y_layout l = Y_LAYOUT(p);
    part_offsets(n, p->cat_u, p->cat_x, &l.ou, &l.ox, &l.oy);
    mask_walk mw;
    mask_init(&mw, &p->rng, p->dropout, p->p);
    float *buf = (float *)malloc((size_t)(3 * n + 1) * sizeof(float));
    if (!buf) return;
    float *a = buf, *u = buf + n, *v = buf + 2 * n;
    for (int64_t r = row_begin; r < row_end; ++r) {
        tf_row_to_f32(p->attn, p->attn_dtype, r * p->attn_stride, n, a);
        tf_row_to_f32(p->u, p->u_dtype, r * p->u_stride, n, u);
        for (int64_t g = 0; g < G; ++g)
            row_stats(a + g * gs, gs, p->eps, &p->mean[r * G + g], &p->rstd[r * G + g]);
        write_y_row(&l, &mw, a, u, p->mean + r * G, p->rstd + r * G, (uint64_t)r * (uint64_t)p->y_cols, p->y,
                    p->y_dtype, r * p->y_cols, v);
    }
    free(buf);
}

void tf_hstu_output_bwd_cpu(const tf_hstu_output_bwd_params *p, int64_t row_begin, int64_t row_end, int64_t part) {
    const int64_t n = p->cols, G = p->groups, gs = n / G;
    const int64_t wcols = p->group_weights ? G : n;
    y_layout l = Y_LAYOUT(p);
    part_offsets(n, p->cat_u, p->cat_x, &l.ou, &l.ox, &l.oy);
    const int64_t ou = l.ou, ox = l.ox, oy = l.oy;
    mask_walk mw;
    mask_init(&mw, &p->rng, p->dropout, p->p);
    float *buf = (float *)malloc((size_t)(8 * n + 1) * sizeof(float));
    if (!buf) return;
    float *a = buf, *u = buf + n, *gy = buf + 2 * n, *xhat = buf + 3 * n, *dxhat = buf + 4 * n;
    float *gu = buf + 5 * n, *gx = buf + 6 * n, *v = buf + 7 * n;
    float *dw = p->dw_part ? p->dw_part + part * wcols : NULL;
    float *db = p->db_part ? p->db_part + part * wcols : NULL;
    for (int64_t r = row_begin; r < row_end; ++r) {
        tf_row_to_f32(p->attn, p->attn_dtype, r * p->attn_stride, n, a);
        tf_row_to_f32(p->u, p->u_dtype, r * p->u_stride, n, u);
        const uint64_t e_row = (uint64_t)r * (uint64_t)p->y_cols;
        const int64_t dy_row = r * p->dy_stride;
        if (p->y) /* the forward's y again, from its statistics */
            write_y_row(&l, &mw, a, u, p->mean + r * G, p->rstd + r * G, e_row, p->y, p->y_dtype, r * p->y_cols, v);
        /* the masked gradients of the three parts */
        tf_row_to_f32(p->dy, p->dy_dtype, dy_row + oy, n, gy);
        drop_segment(&mw, p->dropout, e_row + oy, n, gy);
        if (ou >= 0) {
            tf_row_to_f32(p->dy, p->dy_dtype, dy_row + ou, n, gu);
            drop_segment(&mw, p->dropout, e_row + ou, n, gu);
        }
        if (ox >= 0) {
            tf_row_to_f32(p->dy, p->dy_dtype, dy_row + ox, n, gx);
            drop_segment(&mw, p->dropout, e_row + ox, n, gx);
        }
        for (int64_t g = 0; g < G; ++g) {
            const float mean = p->mean[r * G + g], rstd = p->rstd[r * G + g];
            double s1 = 0.0, s2 = 0.0, gw = 0.0, gb = 0.0;
            for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
                const int64_t wi = p->group_weights ? g : c;
                const float w = tf_load_f32(p->w, p->w_dtype, wi);
                xhat[c] = (a[c] - mean) * rstd;
                const float dn = gy[c] * act_f(u[c], p->mul_act);
                dxhat[c] = dn * w;
                s1 += dxhat[c];
                s2 += (double)dxhat[c] * xhat[c];
                if (!p->group_weights) {
                    if (dw) dw[c] += dn * xhat[c];
                    if (db) db[c] += dn;
                } else { /* a group's sum first: one rounding per row and group in the partial */
                    gw += (double)dn * xhat[c];
                    gb += dn;
                }
            }
            if (p->group_weights) {
                if (dw) dw[g] += (float)gw;
                if (db) db[g] += (float)gb;
            }
            const float m1 = (float)(s1 / (double)gs), m2 = (float)(s2 / (double)gs);
            for (int64_t c = g * gs; c < (g + 1) * gs; ++c) {
                const int64_t wi = p->group_weights ? g : c;
                const float w = tf_load_f32(p->w, p->w_dtype, wi), b = tf_load_f32(p->b, p->w_dtype, wi);
                float da = rstd * (dxhat[c] - m1 - xhat[c] * m2);
                float du = gy[c] * (xhat[c] * w + b) * act_grad(u[c], p->mul_act);
                if (ox >= 0) da += gx[c];
                if (ou >= 0) du += gu[c] * act_grad(u[c], p->cat_act);
                a[c] = da; /* a[c] is not read again */
                u[c] = du; /* nor u[c] */
            }
        }
        tf_row_from_f32(p->dattn, p->dattn_dtype, r * n, n, a);
        tf_row_from_f32(p->du, p->du_dtype, r * n, n, u);
    }
    free(buf);
}

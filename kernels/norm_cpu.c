/* Fused residual add + LayerNorm / RMSNorm on the CPU: the reference path, plain C.
 * Semantics are those of norm.h; one row at a time, fp32 accumulation, two passes for the
 * variance (sum of squared deviations from the mean, not E[x^2] - E[x]^2). */
#include <math.h>
#include <stdlib.h>

#include "norm.h"

static inline float load_opt(const void *base, int dt, int64_t i, float fallback) {
    return base ? tf_load_f32(base, dt, i) : fallback;
}

/* s for one element: the adds rounded in Python's order. */
static inline float fwd_sum(const tf_norm_fwd_params *p, int64_t r, int64_t c) {
    float t = tf_load_f32(p->x, p->x_dtype, r * p->x_stride + c);
    if (p->res) t = tf_round_f32(t + tf_load_f32(p->res, p->res_dtype, r * p->res_stride + c), p->add1_dtype);
    if (p->res2) t = tf_round_f32(t + tf_load_f32(p->res2, p->res2_dtype, r * p->res2_stride + c), p->add2_dtype);
    return tf_round_f32(t, p->s_dtype);
}

static inline float norm_out(const tf_norm_fwd_params *p, float s, float mean, float rstd, const void *w,
                             const void *b, int64_t c) {
    float wv = load_opt(w, p->w_dtype, c, 1.0f);
    float y;
    if (p->norm_type == TF_LAYER_NORM) {
        y = (s - mean) * rstd * wv + load_opt(b, p->w_dtype, c, 0.0f);
    } else if (p->norm_type == TF_RMS_NORM_LLAMA) {
        y = tf_round_f32(tf_round_f32(s * rstd, p->s_dtype) * (wv + p->weight_offset), p->mul_dtype);
    } else {
        y = s * rstd * (wv + p->weight_offset);
    }
    return y;
}

void tf_norm_fwd_cpu(const tf_norm_fwd_params *p, int64_t row_begin, int64_t row_end) {
    const int64_t n = p->cols;
    float *buf = (float *)malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!buf) abort();
    for (int64_t r = row_begin; r < row_end; ++r) {
        float sum = 0.f;
        for (int64_t c = 0; c < n; ++c) {
            float s = fwd_sum(p, r, c);
            buf[c] = s;
            sum += s;
            if (p->s) tf_store_f32(p->s, p->s_dtype, r * n + c, s);
        }
        float mean = 0.f, m2 = 0.f;
        if (p->norm_type == TF_LAYER_NORM) {
            mean = sum / (float)n;
            for (int64_t c = 0; c < n; ++c) m2 += (buf[c] - mean) * (buf[c] - mean);
        } else {
            for (int64_t c = 0; c < n; ++c) m2 += buf[c] * buf[c];
        }
        float rstd = 1.0f / sqrtf(m2 / (float)n + p->eps);
        if (p->mean) p->mean[r] = mean;
        if (p->rstd) p->rstd[r] = rstd;
        for (int64_t c = 0; c < n; ++c) {
            tf_store_f32(p->y, p->y_dtype, r * n + c, norm_out(p, buf[c], mean, rstd, p->w, p->b, c));
            if (p->y2) tf_store_f32(p->y2, p->y_dtype, r * n + c, norm_out(p, buf[c], mean, rstd, p->w2, p->b2, c));
        }
    }
    free(buf);
}

void tf_norm_bwd_cpu(const tf_norm_bwd_params *p, int64_t row_begin, int64_t row_end, int64_t part) {
    const int64_t n = p->cols;
    const int layer = p->norm_type == TF_LAYER_NORM;
    float *xhat = (float *)malloc((size_t)(n > 0 ? n : 1) * 2 * sizeof(float));
    if (!xhat) abort();
    float *g = xhat + (n > 0 ? n : 1);
    float *dw = p->dw_part ? p->dw_part + part * n : NULL;
    float *db = p->db_part ? p->db_part + part * n : NULL;
    float *dw2 = p->dw2_part ? p->dw2_part + part * n : NULL;
    float *db2 = p->db2_part ? p->db2_part + part * n : NULL;
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float mean = layer ? p->mean[r] : 0.f, rstd = p->rstd[r];
        float sum_g = 0.f, sum_gx = 0.f;
        for (int64_t c = 0; c < n; ++c) {
            float s = tf_load_f32(p->s, p->s_dtype, r * p->s_stride + c);
            float xh = (s - mean) * rstd;
            /* HF Llama multiplies the weight by the normalized value rounded to s's dtype. */
            float xh_w = p->norm_type == TF_RMS_NORM_LLAMA ? tf_round_f32(xh, p->s_dtype) : xh;
            float dy = p->dy ? tf_load_f32(p->dy, p->dy_dtype, r * p->dy_stride + c) : 0.f;
            float gc = dy * (load_opt(p->w, p->w_dtype, c, 1.0f) + p->weight_offset);
            if (dw) dw[c] += dy * xh_w;
            if (db) db[c] += dy;
            if (p->w2) {
                float dy2 = p->dy2 ? tf_load_f32(p->dy2, p->dy_dtype, r * p->dy2_stride + c) : 0.f;
                gc += dy2 * (tf_load_f32(p->w2, p->w_dtype, c) + p->weight_offset);
                if (dw2) dw2[c] += dy2 * xh_w;
                if (db2) db2[c] += dy2;
            }
            xhat[c] = xh;
            g[c] = gc;
            sum_g += gc;
            sum_gx += gc * xh;
        }
        const float mean_g = layer ? sum_g / (float)n : 0.f, mean_gx = sum_gx / (float)n;
        for (int64_t c = 0; c < n; ++c) {
            float ds = rstd * (g[c] - mean_g - xhat[c] * mean_gx);
            if (p->ds_in) ds += tf_load_f32(p->ds_in, p->ds_in_dtype, r * p->ds_in_stride + c);
            if (p->dx) tf_store_f32(p->dx, p->dx_dtype, r * n + c, ds);
            if (p->dres) tf_store_f32(p->dres, p->dres_dtype, r * n + c, ds);
            if (p->dres2) tf_store_f32(p->dres2, p->dres2_dtype, r * n + c, ds);
        }
    }
    free(xhat);
}

void tf_column_sum_cpu(const float *part, int64_t n_partials, int64_t cols, void *out, int out_dtype,
                       int64_t col_begin, int64_t col_end) {
    for (int64_t c = col_begin; c < col_end; ++c) {
        float acc = 0.f;
        for (int64_t k = 0; k < n_partials; ++k) acc += part[k * cols + c];
        tf_store_f32(out, out_dtype, c, acc);
    }
}

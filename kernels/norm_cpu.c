/* Fused residual add + LayerNorm / RMSNorm on the CPU: the reference path, plain C.
 * Semantics are those of norm_kernels.h. A row at a time: each input row is converted to fp32 once into a
 * buffer by a loop specialised for its dtype (so the compiler can vectorise it), then the adds,
 * roundings and the two-pass statistics (sum of squared deviations from the mean, not
 * E[x^2] - E[x]^2) run over plain float arrays; sums use a fixed order of 8 interleaved lanes. */
#include <math.h>
#include <stdlib.h>

#include "norm_kernels.h"

/* v rounded to dt in place (what storing into a tensor of that dtype keeps). */
static void round_row(float *v, int64_t n, int dt) {
    if (dt == TF_F32) return;
    for (int64_t c = 0; c < n; ++c) v[c] = tf_round_f32(v[c], dt);
}

/* A parameter vector in fp32 (fill where it is NULL), plus `offset`. */
static void param_f32(const void *w, int dt, int64_t n, float fill, float offset, float *out) {
    if (w) tf_row_to_f32(w, dt, 0, n, out);
    else
        for (int64_t c = 0; c < n; ++c) out[c] = fill;
    if (offset != 0.f)
        for (int64_t c = 0; c < n; ++c) out[c] += offset;
}

/* Sums over a row in 8 interleaved partial sums (then added in a fixed order): a single running
 * sum is a chain of dependent adds the compiler may not reorder, 8 lanes vectorise. */
#define TF_LANES 8
static float lanes_total(const float *acc) {
    float t = 0.f;
    for (int l = 0; l < TF_LANES; ++l) t += acc[l];
    return t;
}

static float row_sum(const float *v, int64_t n) {
    float acc[TF_LANES] = {0};
    int64_t c = 0;
    for (; c + TF_LANES <= n; c += TF_LANES)
        for (int l = 0; l < TF_LANES; ++l) acc[l] += v[c + l];
    for (; c < n; ++c) acc[c % TF_LANES] += v[c];
    return lanes_total(acc);
}

/* sum of (a - shift) * b over the row */
static float row_dot(const float *a, float shift, const float *b, int64_t n) {
    float acc[TF_LANES] = {0};
    int64_t c = 0;
    for (; c + TF_LANES <= n; c += TF_LANES)
        for (int l = 0; l < TF_LANES; ++l) acc[l] += (a[c + l] - shift) * b[c + l];
    for (; c < n; ++c) acc[c % TF_LANES] += (a[c] - shift) * b[c];
    return lanes_total(acc);
}

static float *alloc_rows(int64_t n, int count) {
    float *p = (float *)malloc((size_t)(n > 0 ? n : 1) * (size_t)count * sizeof(float));
    if (!p) abort();
    return p;
}

/* y (one norm) of a row from s and its statistics, into out (fp32), then stored. */
static void norm_out_row(const tf_norm_fwd_params *p, const float *s, float mean, float rstd, const float *w,
                         const float *b, float *out, void *y, int64_t off) {
    const int64_t n = p->cols;
    if (p->norm_type == TF_LAYER_NORM) {
        for (int64_t c = 0; c < n; ++c) out[c] = (s[c] - mean) * rstd * w[c] + b[c];
    } else if (p->norm_type == TF_RMS_NORM_LLAMA) {
        for (int64_t c = 0; c < n; ++c) out[c] = s[c] * rstd;
        round_row(out, n, p->s_dtype);
        for (int64_t c = 0; c < n; ++c) out[c] *= w[c];
        round_row(out, n, p->mul_dtype);
    } else {
        for (int64_t c = 0; c < n; ++c) out[c] = s[c] * rstd * w[c];
    }
    tf_row_from_f32(y, p->y_dtype, off, n, out);
}

void tf_norm_fwd_cpu(const tf_norm_fwd_params *p, int64_t row_begin, int64_t row_end) {
    const int64_t n = p->cols;
    const int layer = p->norm_type == TF_LAYER_NORM;
    float *buf = alloc_rows(n, 7);
    float *tmp = buf + n, *w = tmp + n, *b = w + n, *w2 = b + n, *b2 = w2 + n, *out = b2 + n;
    param_f32(p->w, p->w_dtype, n, 1.f, layer ? 0.f : p->weight_offset, w);
    param_f32(layer ? p->b : NULL, p->w_dtype, n, 0.f, 0.f, b);
    if (p->y2) {
        param_f32(p->w2, p->w_dtype, n, 1.f, layer ? 0.f : p->weight_offset, w2);
        param_f32(layer ? p->b2 : NULL, p->w_dtype, n, 0.f, 0.f, b2);
    }
    for (int64_t r = row_begin; r < row_end; ++r) {
        tf_row_to_f32(p->x, p->x_dtype, r * p->x_stride, n, buf);
        if (p->res) {
            tf_row_to_f32(p->res, p->res_dtype, r * p->res_stride, n, tmp);
            for (int64_t c = 0; c < n; ++c) buf[c] += tmp[c];
            round_row(buf, n, p->add1_dtype);
            if (p->res2) {
                tf_row_to_f32(p->res2, p->res2_dtype, r * p->res2_stride, n, tmp);
                for (int64_t c = 0; c < n; ++c) buf[c] += tmp[c];
                round_row(buf, n, p->add2_dtype);
            }
        }
        round_row(buf, n, p->s_dtype);
        if (p->s) tf_row_from_f32(p->s, p->s_dtype, r * n, n, buf);
        float mean = 0.f;
        if (layer) mean = row_sum(buf, n) / (float)n;
        for (int64_t c = 0; c < n; ++c) tmp[c] = buf[c] - mean;
        const float m2 = row_dot(tmp, 0.f, tmp, n);
        const float rstd = 1.0f / sqrtf(m2 / (float)n + p->eps);
        if (p->mean) p->mean[r] = mean;
        if (p->rstd) p->rstd[r] = rstd;
        const int64_t yoff = r * (p->y_stride ? p->y_stride : n);
        norm_out_row(p, buf, mean, rstd, w, b, out, p->y, yoff);
        if (p->y2) norm_out_row(p, buf, mean, rstd, w2, b2, out, p->y2, yoff);
    }
    free(buf);
}

void tf_norm_bwd_cpu(const tf_norm_bwd_params *p, int64_t row_begin, int64_t row_end, int64_t part) {
    const int64_t n = p->cols;
    const int layer = p->norm_type == TF_LAYER_NORM;
    float *xhat = alloc_rows(n, 7);
    float *xw = xhat + n, *g = xw + n, *dy = g + n, *w = dy + n, *w2 = w + n, *ds = w2 + n;
    float *dw = p->dw_part ? p->dw_part + part * n : NULL;
    float *db = p->db_part ? p->db_part + part * n : NULL;
    float *dw2 = p->dw2_part ? p->dw2_part + part * n : NULL;
    float *db2 = p->db2_part ? p->db2_part + part * n : NULL;
    param_f32(p->w, p->w_dtype, n, 1.f, p->weight_offset, w);
    if (p->w2) param_f32(p->w2, p->w_dtype, n, 1.f, p->weight_offset, w2);
    for (int64_t r = row_begin; r < row_end; ++r) {
        const float mean = layer ? p->mean[r] : 0.f, rstd = p->rstd[r];
        tf_row_to_f32(p->s, p->s_dtype, r * p->s_stride, n, xhat);
        for (int64_t c = 0; c < n; ++c) xhat[c] = (xhat[c] - mean) * rstd;
        /* HF Llama multiplies the weight by the normalized value rounded to s's dtype. */
        memcpy(xw, xhat, (size_t)n * sizeof(float));
        if (p->norm_type == TF_RMS_NORM_LLAMA) round_row(xw, n, p->s_dtype);
        if (p->dy) tf_row_to_f32(p->dy, p->dy_dtype, r * p->dy_stride, n, dy);
        else memset(dy, 0, (size_t)n * sizeof(float));
        for (int64_t c = 0; c < n; ++c) g[c] = dy[c] * w[c];
        if (dw)
            for (int64_t c = 0; c < n; ++c) dw[c] += dy[c] * xw[c];
        if (db)
            for (int64_t c = 0; c < n; ++c) db[c] += dy[c];
        if (p->w2) {
            if (p->dy2) tf_row_to_f32(p->dy2, p->dy_dtype, r * p->dy2_stride, n, dy);
            else memset(dy, 0, (size_t)n * sizeof(float));
            for (int64_t c = 0; c < n; ++c) g[c] += dy[c] * w2[c];
            if (dw2)
                for (int64_t c = 0; c < n; ++c) dw2[c] += dy[c] * xw[c];
            if (db2)
                for (int64_t c = 0; c < n; ++c) db2[c] += dy[c];
        }
        const float sum_g = row_sum(g, n), sum_gx = row_dot(g, 0.f, xhat, n);
        const float mean_g = layer ? sum_g / (float)n : 0.f, mean_gx = sum_gx / (float)n;
        if (p->ds_in) tf_row_to_f32(p->ds_in, p->ds_in_dtype, r * p->ds_in_stride, n, ds);
        else memset(ds, 0, (size_t)n * sizeof(float));
        for (int64_t c = 0; c < n; ++c) ds[c] += rstd * (g[c] - mean_g - xhat[c] * mean_gx);
        if (p->dx) tf_row_from_f32(p->dx, p->dx_dtype, r * n, n, ds);
        if (p->dres) tf_row_from_f32(p->dres, p->dres_dtype, r * n, n, ds);
        if (p->dres2) tf_row_from_f32(p->dres2, p->dres2_dtype, r * n, n, ds);
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

/* Skinny linear on the CPU (semantics: skinny_linear_kernels.h): a's rows normalized and rounded,
 * then each output row accumulated over k in fp32 (w read row by row, so the inner loop runs along
 * w's contiguous columns), bias and residual added, rounded once. */
#include <math.h>
#include <stdlib.h>

#include "skinny_linear_kernels.h"

int tf_skinny_linear_cpu(const tf_skinny_linear_params *p) {
    const int dt = p->dtype;
    const int64_t K = p->K, N = p->N;
    float *arow = (float *)malloc(sizeof(float) * (size_t)(K > 0 ? K : 1));
    float *acc = (float *)malloc(sizeof(float) * (size_t)(N > 0 ? N : 1));
    float *wrow = (float *)malloc(sizeof(float) * (size_t)(N > 0 ? N : 1));
    if (!arow || !acc || !wrow) {
        free(arow); free(acc); free(wrow);
        return 1;
    }
    for (int64_t m = 0; m < p->M; ++m) {
        tf_row_to_f32(p->a, dt, m * p->a_stride, K, arow);
        if (p->norm_w) {
            /* the mean about the row's first element: a plain fp32 sum of values far from zero loses the
             * digits that the normalized row keeps */
            const float shift = arow[0];
            float s = 0.f, v = 0.f;
            for (int64_t k = 0; k < K; ++k) s += arow[k] - shift;
            const float mean = shift + s / (float)K;
            for (int64_t k = 0; k < K; ++k) v += (arow[k] - mean) * (arow[k] - mean);
            const float rstd = 1.f / sqrtf(v / (float)K + p->eps);
            for (int64_t k = 0; k < K; ++k) {
                const float b = p->norm_b ? tf_load_f32(p->norm_b, dt, k) : 0.f;
                arow[k] = tf_round_f32((arow[k] - mean) * rstd * tf_load_f32(p->norm_w, dt, k) + b, dt);
            }
        }
        for (int64_t n = 0; n < N; ++n) acc[n] = 0.f;
        for (int64_t k = 0; k < K; ++k) {
            tf_row_to_f32(p->w, dt, k * p->w_stride, N, wrow);
            const float a = arow[k];
            for (int64_t n = 0; n < N; ++n) acc[n] += a * wrow[n];
        }
        for (int64_t n = 0; n < N; ++n) {
            float s = acc[n];
            if (p->bias) s += tf_load_f32(p->bias, dt, n);
            if (p->res) s += tf_load_f32(p->res, dt, m * p->res_stride + n);
            tf_store_f32(p->out, dt, m * p->out_stride + n, s);
        }
    }
    free(arow); free(acc); free(wrow);
    return 0;
}

/* Fused residual add + LayerNorm / RMSNorm: the C ABI of the kernel family.
 *
 * Forward, per row of `cols` elements (all arithmetic in fp32):
 *   t  = x (+ res, rounded to add1_dtype) (+ res2, rounded to add2_dtype)
 *   s  = t rounded to s_dtype                   (written to `s` when it is not NULL)
 *   LayerNorm:   y = (s - mean) * rstd * w + b
 *   RMSNorm llama: y = round(mul_dtype, round(s_dtype, s * rstd) * (w + weight_offset))
 *   RMSNorm gemma: y = s * rstd * (w + weight_offset)
 *   y rounded to y_dtype; y2 likewise from w2/b2 when y2 is not NULL.
 * The adds are rounded one at a time so that s is bit-identical to PyTorch's `x + res + res2`.
 *
 * Backward, per row: ds = dL/ds from y, y2 and the gradient of s itself (ds_in); written once per
 * requested dtype (dx, dres, dres2). Weight/bias gradients are summed in fp32 into `partials`
 * (n_partials rows of cols each, one per row slot of the grid) and then reduced in a fixed order:
 * deterministic, no atomics.
 *
 * Matrices are row-major with a row stride (in elements) and unit column stride. Pointers that may
 * be NULL say so. Weights (w, b, w2, b2) share w_dtype. */
#ifndef TF_NORM_KERNELS_H
#define TF_NORM_KERNELS_H

#include <stdint.h>

#include "tf_dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { TF_LAYER_NORM = 0, TF_RMS_NORM_LLAMA = 1, TF_RMS_NORM_GEMMA = 2 };

typedef struct {
    int64_t rows, cols;
    const void *x; int64_t x_stride; int x_dtype;
    const void *res; int64_t res_stride; int res_dtype;    /* NULL: no residual */
    const void *res2; int64_t res2_stride; int res2_dtype; /* NULL: no second residual */
    int add1_dtype, add2_dtype;                            /* rounding of x+res, then +res2 */
    const void *w, *b, *w2, *b2; int w_dtype;              /* any may be NULL (w: ones, b: zeros) */
    void *y; int y_dtype;                                  /* rows x cols, rows y_stride apart */
    void *y2;                                              /* NULL: no second norm; y's layout */
    int64_t y_stride;                                      /* 0: cols (contiguous) */
    void *s; int s_dtype;                                  /* NULL: s not stored */
    float *mean, *rstd;                                    /* NULL: not stored */
    float eps, weight_offset;
    int norm_type, mul_dtype;
} tf_norm_fwd_params;

typedef struct {
    int64_t rows, cols;
    const void *dy; int64_t dy_stride;    /* NULL: zero */
    const void *dy2; int64_t dy2_stride;  /* NULL: zero */
    int dy_dtype;
    const void *ds_in; int64_t ds_in_stride; int ds_in_dtype; /* NULL: zero */
    const void *s; int64_t s_stride; int s_dtype;             /* the normalized input */
    const float *mean, *rstd;                                  /* mean unused for RMSNorm */
    const void *w, *w2; int w_dtype;                           /* w2 NULL: no second norm */
    void *dx; int dx_dtype;                                    /* contiguous outputs, NULL: skip */
    void *dres; int dres_dtype;
    void *dres2; int dres2_dtype;
    int want_db;                      /* LayerNorm with bias: bias gradients wanted */
    float weight_offset;
    int norm_type;
    /* fp32 partial sums, each n_partials x cols: dw, db, dw2, db2 (NULL: not wanted) */
    float *dw_part, *db_part, *dw2_part, *db2_part;
    int64_t n_partials;
} tf_norm_bwd_params;

/* ---- CPU (kernels/norm_cpu.c) ---- */
/* Rows [row_begin, row_end) of the forward. */
void tf_norm_fwd_cpu(const tf_norm_fwd_params *p, int64_t row_begin, int64_t row_end);
/* Rows [row_begin, row_end) of the backward; the weight gradients of those rows are summed, in row
 * order, into partial row `part` of the partial buffers (which the caller zeroes). */
void tf_norm_bwd_cpu(const tf_norm_bwd_params *p, int64_t row_begin, int64_t row_end, int64_t part);
/* out[c] = sum over k of part[k*cols + c], in order k = 0, 1, ..., rounded to out_dtype. */
void tf_column_sum_cpu(const float *part, int64_t n_partials, int64_t cols, void *out, int out_dtype,
                       int64_t col_begin, int64_t col_end);

/* ---- CUDA (kernels/norm_cuda.cu); return a cudaError_t as int ---- */
int tf_norm_fwd_cuda(const tf_norm_fwd_params *p, void *stream);
/* The number of partial rows the backward will use for these params on this device. */
int64_t tf_norm_bwd_cuda_partials(const tf_norm_bwd_params *p);
/* p->n_partials must equal tf_norm_bwd_cuda_partials(...); partial buffers need no zeroing. */
int tf_norm_bwd_cuda(const tf_norm_bwd_params *p, void *stream);
/* out[c] = sum over k of part[k * cols + c], k < n_partials, in a fixed order (deterministic). */
int tf_column_sum_cuda(const float *part, int64_t n_partials, int64_t cols, void *out, int out_dtype,
                       void *stream);
/* The same for two planes of partial rows in one launch: part[0 .. n_partials) into out0, the n_partials
 * rows after them into out1 (both of out_dtype). */
int tf_column_sum2_cuda(const float *part, int64_t n_partials, int64_t cols, void *out0, void *out1,
                        int out_dtype, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TF_NORM_KERNELS_H */

/* HSTU output section (generative-recommenders' norm-mul-dropout before the output projection): the C
 * ABI of the kernel family.
 *
 * Per row r of attn and u (n = cols elements each), all arithmetic in fp32:
 *   LayerNorm (group_weights 0, groups 1): statistics over the row,  nrm[c] = xhat[c] * w[c] + b[c]
 *   GroupNorm (group_weights 1): G = groups contiguous groups of n / G columns, each with its own
 *   statistics,                                                      nrm[c] = xhat[c] * w[g] + b[g]
 *   y[c] = act(u[c], mul_act) * nrm[c]
 * and the output row of y_cols elements is the concatenation of, in this order,
 *   act(u, cat_act)   when cat_u,   attn   when cat_x,   y   always,
 * each element e = r * y_cols + col multiplied by keep(e) / (1 - p) when dropout is on, keep(e) being
 * tf_philox_keep16 of e's 16 bits of Philox block e / 8 (kernels/tf_philox.h), then rounded to y_dtype.
 * The mask is a pure function of (seed, offset, e): the backward regenerates it, and CPU and CUDA draw
 * the same one.
 *
 * Backward: from dY (the gradient of that concatenated output) to d attn, d u and the weight/bias
 * gradients, which are summed in fp32 into `partials` (n_partials rows of wcols = group_weights ?
 * groups : cols entries each; zeroed by the caller unless tf_hstu_output_bwd_cuda_writes_partials says
 * the kernel stores them whole) and reduced in a fixed order afterwards (tf_column_sum_* of
 * norm_kernels.h): deterministic, no atomics.
 *
 * Inputs are row-major with a row stride (elements) and unit column stride; outputs are contiguous. */
#ifndef TF_HSTU_OUTPUT_KERNELS_H
#define TF_HSTU_OUTPUT_KERNELS_H

#include <stdint.h>

#include "tf_dtype.h"
#include "tf_philox.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { TF_ACT_NONE = 0, TF_ACT_SILU = 1, TF_ACT_SIGMOID = 2 };

typedef struct {
    int64_t rows, cols, groups, y_cols;
    const void *attn; int64_t attn_stride; int attn_dtype;
    const void *u; int64_t u_stride; int u_dtype;
    const void *w, *b; int w_dtype;          /* cols elements each, or groups with group_weights */
    int group_weights;
    int mul_act, cat_act, cat_u, cat_x;
    float eps;
    int dropout; float p;                    /* dropout on: keep with probability 1 - p */
    tf_philox_args rng;
    int64_t *rng_out;  /* CUDA: NULL, or 2 entries for the resolved (seed, offset); the CPU ignores it */
    void *y; int y_dtype;                    /* rows x y_cols */
    float *mean, *rstd;                      /* rows x groups */
} tf_hstu_output_fwd_params;

typedef struct {
    int64_t rows, cols, groups, y_cols;
    const void *attn; int64_t attn_stride; int attn_dtype;
    const void *u; int64_t u_stride; int u_dtype;
    const void *w, *b; int w_dtype;
    int group_weights;
    int mul_act, cat_act, cat_u, cat_x;
    int dropout; float p;
    tf_philox_args rng;                      /* the forward's (seed_ptr / offset_ptr: its rng_out) */
    const void *dy; int64_t dy_stride; int dy_dtype;  /* rows x y_cols */
    const float *mean, *rstd;
    void *dattn; int dattn_dtype;            /* rows x cols */
    void *du; int du_dtype;
    float *dw_part, *db_part;                /* n_partials x wcols each, zeroed; NULL: not wanted */
    int64_t n_partials;
    void *y; int y_dtype;                    /* NULL: none; else the forward's y (rows x y_cols) written
                                              * again, bit for bit (recompute_y_in_backward) */
} tf_hstu_output_bwd_params;

/* ---- CPU (kernels/hstu_output_cpu.c) ---- */
/* Rows [row_begin, row_end). */
void tf_hstu_output_fwd_cpu(const tf_hstu_output_fwd_params *p, int64_t row_begin, int64_t row_end);
/* Rows [row_begin, row_end); their weight gradients summed, in row order, into partial row `part`. */
void tf_hstu_output_bwd_cpu(const tf_hstu_output_bwd_params *p, int64_t row_begin, int64_t row_end, int64_t part);

/* ---- CUDA (kernels/hstu_output_cuda.cu); return a cudaError_t as int ---- */
int tf_hstu_output_fwd_cuda(const tf_hstu_output_fwd_params *p, void *stream);
/* The number of partial rows the backward uses for these params on the current device. */
int64_t tf_hstu_output_bwd_cuda_partials(const tf_hstu_output_bwd_params *p);
/* 1 when the backward stores every entry of its partial rows (they need no zeroing), else 0. */
int tf_hstu_output_bwd_cuda_writes_partials(const tf_hstu_output_bwd_params *p);
int tf_hstu_output_bwd_cuda(const tf_hstu_output_bwd_params *p, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TF_HSTU_OUTPUT_KERNELS_H */

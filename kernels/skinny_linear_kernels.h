/* Skinny linear: out = [LayerNorm(a)] @ w + bias + residual for a few rows of a (M <= TF_SKINNY_MAX_ROWS),
 * and the same GEMM with HSTU's output section building a's rows (tf_skinny_hstu_output_params).
 *
 * The GEMMs of a serving step (one or a few new events per user) have M of 1 to 8 against weights of
 * megabytes: a matrix-vector product bound by reading w once. cuBLAS runs them as tiled GEMMs, with a
 * split-K reduction as a second kernel and the residual copied into the output first; an input
 * LayerNorm is a kernel of its own before it. Here it is one kernel: the norm of a's few rows is
 * recomputed by every block (a row is kilobytes, the weights megabytes), the bias and residual are
 * added in the epilogue.
 *
 * Semantics, for every dtype (float32, float16, bfloat16; a, w, bias, residual, out and the norm's
 * parameters all of one dtype):
 *   a' = round(LayerNorm(a) * norm_w + norm_b)   (with norm_w given; mean and variance over a row, eps)
 *      = a                                       (without)
 *   out = round(sum_k a'[m, k] w[k, n] + bias[n] + residual[m, n])   (fp32 sum, rounded once)
 * which is what the norm op followed by torch.addmm(residual or bias, a', w) computes, up to the
 * order of the fp32 sum. Plain C ABI. */
#ifndef TF_SKINNY_LINEAR_KERNELS_H
#define TF_SKINNY_LINEAR_KERNELS_H

#include <stdint.h>

#include "tf_dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TF_SKINNY_MAX_ROWS 8

typedef struct {
    const void *a;        /* (M, K), row stride a_stride, unit column stride */
    const void *w;        /* (K, N), row stride w_stride, unit column stride */
    const void *bias;     /* (N,) or NULL */
    const void *res;      /* (M, N), row stride res_stride, or NULL */
    const void *norm_w;   /* (K,) LayerNorm weight, or NULL: no norm */
    const void *norm_b;   /* (K,) LayerNorm bias (with norm_w), or NULL */
    void *out;            /* (M, N), row stride out_stride */
    int64_t a_stride, w_stride, res_stride, out_stride;
    int64_t M, K, N;
    float eps;
    int dtype;            /* tf_dtype */
} tf_skinny_linear_params;

/* HSTU's output section for a few rows (torchfuse.hstu_compute_output without autograd, LayerNorm over
 * the row, no dropout): out = x + y @ w with y never in memory. The rows of a are built in the kernel
 * from attn and u, exactly as tf_hstu_output_fwd writes them (hstu_output_kernels.h, groups 1, no
 * dropout), each element rounded to dtype:
 *   y[m] = [act(u[m], cat_act)] [attn[m]] act(u[m], mul_act) * (LayerNorm(attn[m]) * norm_w + norm_b)
 *          (with cat_u)         (with cat_x)
 * statistics over attn's row of `cols` elements with lin.eps; K = (1 + cat_u + cat_x) * cols. lin.a,
 * lin.norm_w and lin.norm_b are NULL; lin.res is x, lin.w the output weight, lin.bias NULL or a bias. */
typedef struct {
    tf_skinny_linear_params lin;
    const void *attn, *u;         /* (M, cols) in lin.dtype, row strides below, unit column stride */
    int64_t attn_stride, u_stride, cols;
    const void *norm_w, *norm_b;  /* (cols,) in norm_dtype (a tf_dtype); NULL: weight 1, bias 0 */
    int norm_dtype;
    int mul_act, cat_act;         /* TF_ACT_NONE / TF_ACT_SILU / TF_ACT_SIGMOID of hstu_output_kernels.h */
    int cat_u, cat_x;
} tf_skinny_hstu_output_params;

/* Whether the CUDA kernel takes these params (M, alignment, shared memory): 1 yes, 0 no (the caller
 * then composes the norm op and a GEMM). */
int tf_skinny_linear_cuda_applies(const tf_skinny_linear_params *p);
int tf_skinny_linear_cuda(const tf_skinny_linear_params *p, void *stream);
/* The same for the HSTU output section's rows (the caller then runs the output op and the linear). */
int tf_skinny_hstu_output_cuda_applies(const tf_skinny_hstu_output_params *p);
int tf_skinny_hstu_output_cuda(const tf_skinny_hstu_output_params *p, void *stream);
/* 0, or nonzero when its row buffers could not be allocated */
int tf_skinny_linear_cpu(const tf_skinny_linear_params *p);

#ifdef __cplusplus
}
#endif

#endif

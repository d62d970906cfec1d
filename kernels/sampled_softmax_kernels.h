/* Sampled softmax loss (generative-recommenders' SampledSoftmaxLoss): the C ABI of the kernel family.
 *
 * Per row t of T (all arithmetic in fp32, s = 1 / temperature):
 *   rq_t = 1 / max(||q_t||, eps), rp_t and rn_r likewise (l2_norm; else all 1)
 *   pos_t  = s <q_t, p_t> rq_t rp_t
 *   neg_tr = s <q_t, n_r> rq_t rn_r, or -5e4 where neg_ids[t, r] == pos_ids[t] (GR's masked value)
 *   loss_t = logsumexp(pos_t, neg_t0, ..., neg_t(R-1)) - pos_t
 * The row loss is what the forward keeps for the backward (not the log-sum-exp): near a one-hot softmax
 * it is small, and log1p / expm1 of it keep P_t - 1 = expm1(-loss_t) accurate where the difference of
 * two fp32 numbers of the logits' size (log-sum-exp - pos_t) would have lost it.
 * n_r is row r of negatives (R, D), shared by all rows, or row (t, r) of negatives (T, R, D).
 *
 * Backward with g_t = dL/dloss_t. Gradients are written in "A form": A_t = rq_t dL/dq^_t (q^ = q rq)
 * has dL/dq_t = A_t - q^_t <A_t, q^_t> when ||q_t|| > eps (else A_t: the clamp passes the gradient
 * through scaled by 1/eps = rq_t), so the normalisation's backward is one dot product per row:
 *   E_tr = s g_t softmax_tr rq_t rn_r (0 where masked),  A_t = sum_r E_tr n_r + s g_t (P_t - 1) rq_t p^_t
 *   B_r  = sum_t E_tr q_t,  dL/dn_r = B_r - n^_r <B_r, n^_r>  (when ||n_r|| > eps)
 *   dL/dp_t = s g_t (P_t - 1) rp_t (q^_t - p^_t <q^_t, p^_t>)  (the projection only when ||p_t|| > eps)
 * where P_t = exp(-loss_t) and softmax_tr = exp(neg_tr - pos_t - loss_t). For shared negatives the sums
 * over r and t are GEMMs made by the caller on blocks of rows: the block kernels turn a (rows x R) block
 * of raw dot products <q_t, n_r> into the row losses (forward) or into E / c (backward; c a positive
 * scale read from device memory, so that E / c fits the range of a 16-bit GEMM operand), and the caller
 * multiplies back by c.
 *
 * Inputs are contiguous; pointers that may be NULL say so. */
#ifndef TF_SAMPLED_SOFTMAX_KERNELS_H
#define TF_SAMPLED_SOFTMAX_KERNELS_H

#include <stdint.h>

#include "tf_dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TF_SSM_MASKED_LOGIT (-5e4f)

typedef struct {
    int64_t T, R, D;
    const void *q, *p, *n; /* (T, D), (T, D), (R, D) or (T, R, D) */
    int dtype;             /* of q, p, n and of the gradients */
    int per_row;           /* n is (T, R, D) */
    const int64_t *pos_ids;                 /* (T,); NULL: no mask */
    const int64_t *neg_ids; int64_t neg_ids_stride; /* row t's ids at neg_ids + t * stride (0: shared) */
    float scale;           /* 1 / temperature */
    float eps;
    int l2_norm;
} tf_ssm_params;

/* ---- CPU (kernels/sampled_softmax_cpu.c); rows [begin, end) ---- */
/* rq, rp, pos of rows t. */
void tf_ssm_row_stats_cpu(const tf_ssm_params *p, float *rq, float *rp, float *pos, int64_t begin, int64_t end);
/* rn of shared negative rows r. */
void tf_ssm_neg_norms_cpu(const tf_ssm_params *p, float *rn, int64_t begin, int64_t end);
/* Block rows i (query row t0 + i) of S (fp32, rows x R, row stride R) hold <q_t, n_r>: turned into
 * logits in place; loss (indexed by t) written. */
void tf_ssm_block_lse_cpu(const tf_ssm_params *p, float *S, int64_t t0, const float *rq, const float *rn,
                          const float *pos, float *loss, int64_t begin, int64_t end);
/* Block rows i of S (as above) -> E / c into E (e_dtype, same layout; may be S itself when fp32). */
void tf_ssm_block_dlogits_cpu(const tf_ssm_params *p, const float *S, void *E, int e_dtype, int64_t t0,
                              const float *rq, const float *rn, const float *pos, const float *loss, const float *g,
                              const float *c, int64_t begin, int64_t end);
/* dq, dp of rows t0 + i from Ac = sum_r (E / c) n_r (fp32, rows x D; NULL: no negatives' part). */
void tf_ssm_rows_bwd_cpu(const tf_ssm_params *p, const float *Ac, int64_t t0, const float *rq, const float *rp,
                         const float *pos, const float *loss, const float *g, const float *c, void *dq, void *dp,
                         int64_t begin, int64_t end);
/* dn of shared negative rows r from Bc = sum_t (E / c) q_t (fp32, R x D). */
void tf_ssm_neg_bwd_cpu(const tf_ssm_params *p, const float *Bc, const float *rn, const float *c, void *dn,
                        int64_t begin, int64_t end);
/* Per-row negatives: forward (loss) and backward (dq, dp, dn) of rows t, n read once each. */
void tf_ssm_per_row_fwd_cpu(const tf_ssm_params *p, float *loss, int64_t begin, int64_t end);
void tf_ssm_per_row_bwd_cpu(const tf_ssm_params *p, const float *loss, const float *g, void *dq, void *dp, void *dn,
                            int64_t begin, int64_t end);

/* ---- CUDA (kernels/sampled_softmax_cuda.cu): the same over all rows; return a cudaError_t as int ---- */
int tf_ssm_row_stats_cuda(const tf_ssm_params *p, float *rq, float *rp, float *pos, void *stream);
int tf_ssm_neg_norms_cuda(const tf_ssm_params *p, float *rn, void *stream);
int tf_ssm_block_lse_cuda(const tf_ssm_params *p, float *S, int64_t t0, int64_t rows, const float *rq,
                          const float *rn, const float *pos, float *loss, void *stream);
int tf_ssm_block_dlogits_cuda(const tf_ssm_params *p, const float *S, void *E, int e_dtype, int64_t t0, int64_t rows,
                              const float *rq, const float *rn, const float *pos, const float *loss, const float *g,
                              const float *c, void *stream);
int tf_ssm_rows_bwd_cuda(const tf_ssm_params *p, const float *Ac, int64_t t0, int64_t rows, const float *rq,
                         const float *rp, const float *pos, const float *loss, const float *g, const float *c,
                         void *dq, void *dp, void *stream);
int tf_ssm_neg_bwd_cuda(const tf_ssm_params *p, const float *Bc, const float *rn, const float *c, void *dn,
                        void *stream);
int tf_ssm_per_row_fwd_cuda(const tf_ssm_params *p, float *loss, void *stream);
int tf_ssm_per_row_bwd_cuda(const tf_ssm_params *p, const float *loss, const float *g, void *dq, void *dp, void *dn,
                            void *stream);

#ifdef __cplusplus
}
#endif
#endif /* TF_SAMPLED_SOFTMAX_KERNELS_H */

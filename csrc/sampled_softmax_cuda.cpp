// Sampled softmax loss: the CUDA implementation (checks and the chunked driver live in sampled_softmax.cpp;
// GEMMs on cuBLAS through ATen, 16-bit operands with fp32 results).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "sampled_softmax.h"

namespace torchfuse {
namespace {

void check(int err, const char *what) {
    TORCH_CHECK(err == 0, "torchfuse.sampled_softmax_loss: ", what, " failed: ",
                cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void *stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void cuda_row_stats(const tf_ssm_params &p, float *rq, float *rp, float *pos) {
    check(tf_ssm_row_stats_cuda(&p, rq, rp, pos, stream()), "row norms kernel");
}
void cuda_neg_norms(const tf_ssm_params &p, float *rn) {
    check(tf_ssm_neg_norms_cuda(&p, rn, stream()), "negative norms kernel");
}
void cuda_block_lse(const tf_ssm_params &p, float *S, int64_t t0, int64_t rows, const float *rq, const float *rn,
                    const float *pos, float *loss) {
    check(tf_ssm_block_lse_cuda(&p, S, t0, rows, rq, rn, pos, loss, stream()), "log-sum-exp kernel");
}
void cuda_block_dlogits(const tf_ssm_params &p, const float *S, void *E, int e_dtype, int64_t t0, int64_t rows,
                        const float *rq, const float *rn, const float *pos, const float *loss, const float *g,
                        const float *c) {
    check(tf_ssm_block_dlogits_cuda(&p, S, E, e_dtype, t0, rows, rq, rn, pos, loss, g, c, stream()),
          "dlogits kernel");
}
void cuda_rows_bwd(const tf_ssm_params &p, const float *Ac, int64_t t0, int64_t rows, const float *rq,
                   const float *rp, const float *pos, const float *loss, const float *g, const float *c, void *dq,
                   void *dp) {
    check(tf_ssm_rows_bwd_cuda(&p, Ac, t0, rows, rq, rp, pos, loss, g, c, dq, dp, stream()), "row gradient kernel");
}
void cuda_neg_bwd(const tf_ssm_params &p, const float *Bc, const float *rn, const float *c, void *dn) {
    check(tf_ssm_neg_bwd_cuda(&p, Bc, rn, c, dn, stream()), "negative gradient kernel");
}
void cuda_per_row_fwd(const tf_ssm_params &p, float *loss) {
    check(tf_ssm_per_row_fwd_cuda(&p, loss, stream()), "per-row forward kernel");
}
void cuda_per_row_bwd(const tf_ssm_params &p, const float *loss, const float *g, void *dq, void *dp, void *dn) {
    check(tf_ssm_per_row_bwd_cuda(&p, loss, g, dq, dp, dn, stream()), "per-row backward kernel");
}

const SsmBackend kCuda = {cuda_row_stats,   cuda_neg_norms,   cuda_block_lse,   cuda_block_dlogits, cuda_rows_bwd,
                          cuda_neg_bwd,     cuda_per_row_fwd, cuda_per_row_bwd, /*low_precision_gemm=*/true};

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) { register_ssm<&kCuda, c10::cuda::CUDAGuard>(m); }

}  // namespace torchfuse

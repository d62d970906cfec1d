// Sampled softmax loss: argument checks and the chunked forward / backward shared by the CPU and CUDA
// implementations of torchfuse::sampled_softmax_fwd / _bwd (schemas: registration.cpp). The device
// paths differ only in their kernels (a Backend) and in the GEMMs' operand dtype.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../kernels/sampled_softmax_kernels.h"

namespace torchfuse {

// Checked, contiguous inputs (kept alive while the kernels read them) and the kernel params.
struct SsmInputs {
    tf_ssm_params p;
    at::Tensor q, pos, neg, pos_ids, neg_ids, weights;  // ids int64; weights fp32 or undefined
};

SsmInputs prepare_ssm(const at::Tensor &query, const at::Tensor &positive, const at::Tensor &negatives,
                      const std::optional<at::Tensor> &positive_ids, const std::optional<at::Tensor> &negative_ids,
                      const std::optional<at::Tensor> &weights, double temperature, bool l2_norm, double eps,
                      const char *op);

// The device kernels (all rows of a call; a CPU backend splits them over threads).
struct SsmBackend {
    void (*row_stats)(const tf_ssm_params &, float *rq, float *rp, float *pos);
    void (*neg_norms)(const tf_ssm_params &, float *rn);
    void (*block_lse)(const tf_ssm_params &, float *S, int64_t t0, int64_t rows, const float *rq, const float *rn,
                      const float *pos, float *loss);
    void (*block_dlogits)(const tf_ssm_params &, const float *S, void *E, int e_dtype, int64_t t0, int64_t rows,
                          const float *rq, const float *rn, const float *pos, const float *loss, const float *g,
                          const float *c);
    void (*rows_bwd)(const tf_ssm_params &, const float *Ac, int64_t t0, int64_t rows, const float *rq,
                     const float *rp, const float *pos, const float *loss, const float *g, const float *c, void *dq,
                     void *dp);
    void (*neg_bwd)(const tf_ssm_params &, const float *Bc, const float *rn, const float *c, void *dn);
    void (*per_row_fwd)(const tf_ssm_params &, float *loss);
    void (*per_row_bwd)(const tf_ssm_params &, const float *loss, const float *g, void *dq, void *dp, void *dn);
    // GEMMs on 16-bit operands with fp32 results (CUDA's mm with out_dtype); else on fp32 copies
    bool low_precision_gemm;
};

// Returns (loss, row_loss): the 0-dim fp32 loss, and the per-row losses (fp32, T) for the backward.
std::tuple<at::Tensor, at::Tensor> ssm_forward(const SsmBackend &be, const at::Tensor &query,
                                               const at::Tensor &positive, const at::Tensor &negatives,
                                               const std::optional<at::Tensor> &positive_ids,
                                               const std::optional<at::Tensor> &negative_ids,
                                               const std::optional<at::Tensor> &weights, double temperature,
                                               bool l2_norm, double eps, int64_t chunk_rows);

// Returns (dquery, dpositive, dnegatives) in the inputs' dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ssm_backward(
    const SsmBackend &be, const at::Tensor &dloss, const at::Tensor &query, const at::Tensor &positive,
    const at::Tensor &negatives, const std::optional<at::Tensor> &positive_ids,
    const std::optional<at::Tensor> &negative_ids, const std::optional<at::Tensor> &weights, const at::Tensor &row_loss,
    double temperature, bool l2_norm, double eps, int64_t chunk_rows);

// The device guard of the CPU: nothing to make current.
struct SsmNoGuard {
    explicit SsmNoGuard(at::Device) {}
};

// Registers sampled_softmax_fwd / _bwd for one device with its kernels (sampled_softmax.cpp: CPU,
// sampled_softmax_cuda.cpp: CUDA); Guard makes the query's device current around the call.
template <const SsmBackend *Be, typename Guard>
void register_ssm(torch::Library &m) {
    m.impl("sampled_softmax_fwd",
           [](const at::Tensor &query, const at::Tensor &positive, const at::Tensor &negatives,
              const std::optional<at::Tensor> &positive_ids, const std::optional<at::Tensor> &negative_ids,
              const std::optional<at::Tensor> &weights, double temperature, bool l2_norm, double eps,
              int64_t chunk_rows) {
               const Guard guard(query.device());
               return ssm_forward(*Be, query, positive, negatives, positive_ids, negative_ids, weights, temperature,
                                  l2_norm, eps, chunk_rows);
           });
    m.impl("sampled_softmax_bwd",
           [](const at::Tensor &dloss, const at::Tensor &query, const at::Tensor &positive, const at::Tensor &negatives,
              const std::optional<at::Tensor> &positive_ids, const std::optional<at::Tensor> &negative_ids,
              const std::optional<at::Tensor> &weights, const at::Tensor &row_loss, double temperature, bool l2_norm,
              double eps, int64_t chunk_rows) {
               const Guard guard(query.device());
               return ssm_backward(*Be, dloss, query, positive, negatives, positive_ids, negative_ids, weights,
                                   row_loss, temperature, l2_norm, eps, chunk_rows);
           });
}

}  // namespace torchfuse

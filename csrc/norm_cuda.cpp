// Fused residual add + norm: the CUDA implementation (checks and setup live in norm.cpp).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "norm.h"
#include "tf_check.h"

namespace torchfuse {
namespace {

void check_launch(int err, const char *what) {
    TORCH_CHECK(err == 0, "torchfuse: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

NormFwdResult norm_fwd_cuda(const at::Tensor &x, const std::optional<at::Tensor> &residual,
                            const std::optional<at::Tensor> &residual2, const std::optional<at::Tensor> &weight,
                            const std::optional<at::Tensor> &bias, const std::optional<at::Tensor> &weight2,
                            const std::optional<at::Tensor> &bias2, double eps, int64_t norm_type,
                            double weight_offset, std::optional<at::ScalarType> residual_dtype, bool save_stats) {
    const c10::cuda::CUDAGuard guard(x.device());
    NormFwd f = prepare_norm_fwd(x, residual, residual2, weight, bias, weight2, bias2, eps, norm_type, weight_offset,
                                 residual_dtype, save_stats);
    check_launch(tf_norm_fwd_cuda(&f.p, c10::cuda::getCurrentCUDAStream().stream()), "norm forward kernel");
    return f.result();
}

std::tuple<at::Tensor, at::Tensor> add_norm_cuda(const at::Tensor &x, const std::optional<at::Tensor> &residual,
                                                 const std::optional<at::Tensor> &weight,
                                                 const std::optional<at::Tensor> &bias, double eps,
                                                 int64_t norm_type, double weight_offset) {
    const c10::cuda::CUDAGuard guard(x.device());
    NormFwd f = prepare_norm_fwd(x, residual, std::nullopt, weight, bias, std::nullopt, std::nullopt, eps, norm_type,
                                 weight_offset, std::nullopt, false);
    check_launch(tf_norm_fwd_cuda(&f.p, c10::cuda::getCurrentCUDAStream().stream()), "norm forward kernel");
    return f.infer_result();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_with_ones_cuda(const at::Tensor &x,
                                                                        const std::optional<at::Tensor> &weight,
                                                                        const std::optional<at::Tensor> &bias,
                                                                        double eps, bool save_stats) {
    const c10::cuda::CUDAGuard guard(x.device());
    NormFwd f = prepare_norm_with_ones(x, weight, bias, eps, save_stats);
    check_launch(tf_norm_fwd_cuda(&f.p, c10::cuda::getCurrentCUDAStream().stream()), "norm forward kernel");
    return norm_with_ones_result(f);
}

NormBwdResult norm_bwd_cuda(const std::optional<at::Tensor> &dy, const std::optional<at::Tensor> &dy2,
                            const std::optional<at::Tensor> &ds, const at::Tensor &s, const at::Tensor &mean,
                            const at::Tensor &rstd, const std::optional<at::Tensor> &weight,
                            const std::optional<at::Tensor> &weight2, int64_t norm_type, double weight_offset,
                            bool has_bias, bool has_bias2, at::ScalarType x_dtype,
                            std::optional<at::ScalarType> residual_dtype,
                            std::optional<at::ScalarType> residual2_dtype, bool weight_grad) {
    const c10::cuda::CUDAGuard guard(s.device());
    NormBwd g = prepare_norm_bwd(dy, dy2, ds, s, mean, rstd, weight, weight2, norm_type, weight_offset, has_bias,
                                 has_bias2, x_dtype, residual_dtype, residual2_dtype, weight_grad);
    const bool any_wgrad = g.want_dw || g.want_db || g.want_dw2 || g.want_db2;
    if (g.p.rows == 0) {  // no rows: zero weight gradients, nothing else to compute
        for (at::Tensor *t : {&g.dw, &g.db, &g.dw2, &g.db2}) t->zero_();
        return g.result();
    }
    const int64_t n_partials = tf_norm_bwd_cuda_partials(&g.p);
    at::Tensor partials;
    if (any_wgrad) partials = alloc_norm_partials(g, n_partials, /*zero=*/false);
    else g.p.n_partials = n_partials;
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    check_launch(tf_norm_bwd_cuda(&g.p, stream), "norm backward kernel");
    const std::pair<const float *, at::Tensor *> sums[] = {
        {g.p.dw_part, &g.dw}, {g.p.db_part, &g.db}, {g.p.dw2_part, &g.dw2}, {g.p.db2_part, &g.db2}};
    for (const auto &[part, out] : sums) {
        if (!part) continue;
        const int dt = kernel_dtype(out->scalar_type(), "torchfuse.norm_bwd", "weight");
        check_launch(tf_column_sum_cuda(part, n_partials, g.p.cols, out->data_ptr(), dt, stream),
                     "weight-gradient reduction kernel");
    }
    return g.result();
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
    m.impl("norm_fwd", &norm_fwd_cuda);
    m.impl("add_norm", &add_norm_cuda);
    m.impl("layer_norm_with_ones", &layer_norm_with_ones_cuda);
    m.impl("norm_bwd", &norm_bwd_cuda);
}

}  // namespace torchfuse

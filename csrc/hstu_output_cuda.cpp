// HSTU output section: the CUDA implementation (checks and setup live in hstu_output.cpp).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../kernels/norm_kernels.h"
#include "hstu_output.h"
#include "tf_check.h"
#include "tf_philox_glue_cuda.h"

namespace torchfuse {
namespace {

void check_launch(int err, const char *what) {
    TORCH_CHECK(err == 0, "torchfuse: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

HstuOutputResult hstu_output_fwd_cuda(const at::Tensor &attn, const at::Tensor &u, const at::Tensor &weight,
                                      const at::Tensor &bias, double eps, int64_t groups, int64_t mul_act,
                                      int64_t cat_act, bool concat_u, bool concat_x, double dropout_ratio,
                                      std::optional<int64_t> seed, const std::optional<at::Tensor> &rng_state) {
    const c10::cuda::CUDAGuard guard(attn.device());
    HstuOutputFwd f = prepare_hstu_output_fwd(attn, u, weight, bias, eps, groups, mul_act, cat_act, concat_u,
                                              concat_x, dropout_ratio, rng_state);
    if (!rng_state.has_value()) {
        // only a call that drops draws from the generator (as F.dropout): eval calls leave its offset alone
        f.p.rng = philox_args_cuda(dropout_ratio > 0 ? seed : std::optional<int64_t>(seed.value_or(0)));
        f.p.rng_out = f.rng_state.data_ptr<int64_t>();  // resolved on the device (graph replays included)
    }
    check_launch(tf_hstu_output_fwd_cuda(&f.p, c10::cuda::getCurrentCUDAStream().stream()),
                 "hstu_compute_output forward kernel");
    return f.result();
}

HstuOutputBwdResult hstu_output_bwd_cuda(const at::Tensor &dy, const at::Tensor &attn, const at::Tensor &u,
                                         const at::Tensor &weight, const at::Tensor &bias, const at::Tensor &mean,
                                         const at::Tensor &rstd, const at::Tensor &rng_state, int64_t groups,
                                         int64_t mul_act, int64_t cat_act, bool concat_u, bool concat_x,
                                         double dropout_ratio, bool weight_grad, bool recompute_y) {
    const c10::cuda::CUDAGuard guard(attn.device());
    HstuOutputBwd g = prepare_hstu_output_bwd(dy, attn, u, weight, bias, mean, rstd, rng_state, groups, mul_act,
                                              cat_act, concat_u, concat_x, dropout_ratio, weight_grad,
                                              recompute_y);
    const int64_t n_partials = tf_hstu_output_bwd_cuda_partials(&g.p);
    at::Tensor partials =
        alloc_hstu_output_partials(g, n_partials, /*zero=*/!tf_hstu_output_bwd_cuda_writes_partials(&g.p));
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    check_launch(tf_hstu_output_bwd_cuda(&g.p, stream), "hstu_compute_output backward kernel");
    if (g.want_wgrad) {  // both planes of partials (dw's, then db's) in one launch
        const int64_t wcols = g.p.group_weights ? g.p.groups : g.p.cols;
        const int dt = kernel_dtype(g.dw.scalar_type(), "torchfuse.hstu_compute_output", "norm_weight");
        check_launch(
            tf_column_sum2_cuda(g.p.dw_part, n_partials, wcols, g.dw.data_ptr(), g.db.data_ptr(), dt, stream),
            "weight- and bias-gradient reduction kernel");
    }
    return g.result();
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
    m.impl("hstu_output_fwd", &hstu_output_fwd_cuda);
    m.impl("hstu_output_bwd", &hstu_output_bwd_cuda);
}

}  // namespace torchfuse

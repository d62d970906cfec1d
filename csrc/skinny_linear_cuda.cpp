// Skinny linear: the CUDA implementation (checks and setup live in skinny_linear.cpp).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "skinny_linear.h"

namespace torchfuse {
namespace {

at::Tensor skinny_linear_cuda(const at::Tensor &a, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                              const std::optional<at::Tensor> &residual, const std::optional<at::Tensor> &norm_weight,
                              const std::optional<at::Tensor> &norm_bias, double eps) {
    const c10::cuda::CUDAGuard guard(a.device());
    SkinnyLinear s = prepare_skinny_linear(a, weight, bias, residual, norm_weight, norm_bias, eps);
    if (s.p.M == 0 || s.p.N == 0) return s.out;
    if (!tf_skinny_linear_cuda_applies(&s.p)) {  // e.g. weight rows not 16-byte aligned, K = 0
        skinny_linear_composed(s);
        return s.out;
    }
    const int err = tf_skinny_linear_cuda(&s.p, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == 0, "torchfuse.skinny_linear: kernel launch failed: ",
                cudaGetErrorString(static_cast<cudaError_t>(err)));
    return s.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) { m.impl("skinny_linear", skinny_linear_cuda); }

}  // namespace torchfuse

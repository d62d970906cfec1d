// Skinny linear (torchfuse.skinny_linear: [LayerNorm(a)] @ weight + bias + residual for a few rows):
// argument checks and kernel-parameter setup shared by the CPU and CUDA implementations of
// torchfuse::skinny_linear (schema: registration.cpp; semantics: kernels/skinny_linear_kernels.h).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../kernels/skinny_linear_kernels.h"

namespace torchfuse {

struct SkinnyLinear {
    tf_skinny_linear_params p;
    at::Tensor a, w, bias, res, norm_w, norm_b;  // as the kernel reads them (kept alive)
    at::Tensor out;
};

SkinnyLinear prepare_skinny_linear(const at::Tensor &a, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                                   const std::optional<at::Tensor> &residual,
                                   const std::optional<at::Tensor> &norm_weight,
                                   const std::optional<at::Tensor> &norm_bias, double eps);

// The same result composed of ATen ops (fp32 accumulation, one rounding): for inputs the kernel does
// not take (e.g. a weight whose rows are not 16-byte aligned on CUDA).
void skinny_linear_composed(SkinnyLinear &s);

}  // namespace torchfuse

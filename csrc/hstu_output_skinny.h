// HSTU's output section fused into the skinny linear for a few rows (torch.ops.torchfuse.
// hstu_output_skinny: x + y @ output_weight, y built inside the GEMM's kernel): argument checks and
// kernel-parameter setup shared by the CPU and CUDA implementations (schema: registration.cpp;
// semantics: tf_skinny_hstu_output_params in kernels/skinny_linear_kernels.h).
#pragma once

#include <ATen/ATen.h>

#include "../kernels/skinny_linear_kernels.h"

namespace torchfuse {

struct HstuOutputSkinny {
    tf_skinny_hstu_output_params p;
    at::Tensor attn, u, x, norm_w, norm_b, w;  // as the kernel reads them (kept alive)
    at::Tensor out;
};

HstuOutputSkinny prepare_hstu_output_skinny(const at::Tensor &attn, const at::Tensor &u, const at::Tensor &x,
                                            const at::Tensor &norm_weight, const at::Tensor &norm_bias, double eps,
                                            const at::Tensor &output_weight, int64_t mul_act, int64_t cat_act,
                                            bool concat_u, bool concat_x);

}  // namespace torchfuse

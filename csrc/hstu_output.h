// HSTU output section (torchfuse.hstu_compute_output's fused norm-mul-concat-dropout): argument checks
// and kernel-parameter setup shared by the CPU and CUDA implementations of torchfuse::hstu_output_fwd /
// hstu_output_bwd (schemas: registration.cpp; semantics: kernels/hstu_output_kernels.h).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../kernels/hstu_output_kernels.h"

namespace torchfuse {

// norm_weight and norm_bias (1-D, `count` elements, attn's device, one kernel dtype between them) and
// the activation codes, checked for `op` (shape_note: what count is, for the message).
void check_hstu_output_norm_and_acts(const at::Tensor &weight, const at::Tensor &bias, const at::Tensor &attn,
                                     int64_t count, const char *shape_note, int64_t mul_act, int64_t cat_act,
                                     const char *op);

using HstuOutputResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct HstuOutputFwd {
    tf_hstu_output_fwd_params p;
    at::Tensor attn, u, w, b;               // as the kernel reads them
    at::Tensor y, mean, rstd, rng_state;    // outputs
    HstuOutputResult result() const { return {y, mean, rstd, rng_state}; }
};

// With rng_state (a forward's fourth output) the mask is that forward's; without it the caller sets
// p.rng (from `seed` or torch's generator) and fills rng_state.
HstuOutputFwd prepare_hstu_output_fwd(const at::Tensor &attn, const at::Tensor &u, const at::Tensor &weight,
                                      const at::Tensor &bias, double eps, int64_t groups, int64_t mul_act,
                                      int64_t cat_act, bool concat_u, bool concat_x, double dropout_ratio,
                                      const std::optional<at::Tensor> &rng_state);

using HstuOutputBwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct HstuOutputBwd {
    tf_hstu_output_bwd_params p;
    at::Tensor dy, attn, u, w, b, mean, rstd, rng_state;
    at::Tensor dattn, du, dw, db, y;  // y: the forward's, written again (recompute_y), else empty
    bool want_wgrad;
    HstuOutputBwdResult result() const { return {dattn, du, dw, db, y}; }
};

HstuOutputBwd prepare_hstu_output_bwd(const at::Tensor &dy, const at::Tensor &attn, const at::Tensor &u,
                                      const at::Tensor &weight, const at::Tensor &bias, const at::Tensor &mean,
                                      const at::Tensor &rstd, const at::Tensor &rng_state, int64_t groups,
                                      int64_t mul_act, int64_t cat_act, bool concat_u, bool concat_x,
                                      double dropout_ratio, bool weight_grad, bool recompute_y);

// fp32 partial sums (2 x n_partials x wcols; zeroed when `zero`: the kernels that add into them), wired
// into g.p when weight gradients are wanted.
at::Tensor alloc_hstu_output_partials(HstuOutputBwd &g, int64_t n_partials, bool zero);

}  // namespace torchfuse

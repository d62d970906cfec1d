// Fused residual add + norm: argument checking and kernel-parameter setup shared by the CPU and
// CUDA implementations of torchfuse::norm_fwd / torchfuse::norm_bwd (schemas: registration.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../kernels/norm_kernels.h"

namespace torchfuse {

using NormFwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using NormBwdResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Checked inputs (kept alive while the kernel reads them), allocated outputs and kernel params.
struct NormFwd {
    tf_norm_fwd_params p;
    at::Tensor x, res, res2;  // possibly contiguous copies
    at::Tensor w, b, w2, b2;  // the parameters as the kernel reads them (contiguous copies of strided ones)
    at::Tensor y, y2, s, mean, rstd;  // y2, s, mean, rstd undefined when not asked for
    NormFwdResult result() const;                          // norm_fwd's outputs
    std::tuple<at::Tensor, at::Tensor> infer_result() const;  // add_norm's: (y, s)
};

NormFwd prepare_norm_fwd(const at::Tensor &x, const std::optional<at::Tensor> &residual,
                         const std::optional<at::Tensor> &residual2, const std::optional<at::Tensor> &weight,
                         const std::optional<at::Tensor> &bias, const std::optional<at::Tensor> &weight2,
                         const std::optional<at::Tensor> &bias2, double eps, int64_t norm_type,
                         double weight_offset, std::optional<at::ScalarType> residual_dtype, bool save_stats,
                         int64_t y_width = 0);

// LayerNorm(x) of a 2-D x written into the first cols columns of a (rows, width) tensor whose column
// cols is ones and the rest zeros, width = cols + 1 rounded up to 8 (16-byte rows): [LN(x), 1] @ [W; b]
// is LN(x) @ W + b, and one GEMM [LN(x), 1]^T @ dY gives W's gradient and, in its row cols, b's.
// f.y is that tensor; the kernel writes its first cols columns (p.y_stride = width; prepare_norm_fwd's
// y_width > 0 allocates y so for a 2-D x).
NormFwd prepare_norm_with_ones(const at::Tensor &x, const std::optional<at::Tensor> &weight,
                               const std::optional<at::Tensor> &bias, double eps, bool save_stats);
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_with_ones_result(const NormFwd &f);

struct NormBwd {
    tf_norm_bwd_params p;
    at::Tensor dy, dy2, ds, s;  // inputs, possibly copied
    at::Tensor w, w2;           // the weights as the kernel reads them (contiguous copies of strided ones)
    at::Tensor dx, dres, dres2;
    at::Tensor dw, db, dw2, db2;  // final weight gradients (allocated by prepare, filled by the device path)
    bool want_dw, want_db, want_dw2, want_db2;
    NormBwdResult result() const { return {dx, dres, dres2, dw, db, dw2, db2}; }
};

NormBwd prepare_norm_bwd(const std::optional<at::Tensor> &dy, const std::optional<at::Tensor> &dy2,
                         const std::optional<at::Tensor> &ds, const at::Tensor &s, const at::Tensor &mean,
                         const at::Tensor &rstd, const std::optional<at::Tensor> &weight,
                         const std::optional<at::Tensor> &weight2, int64_t norm_type, double weight_offset,
                         bool has_bias, bool has_bias2, at::ScalarType x_dtype,
                         std::optional<at::ScalarType> residual_dtype, std::optional<at::ScalarType> residual2_dtype,
                         bool weight_grad);

// Partial sums for the weight gradients: one fp32 buffer of n_partials x cols per wanted gradient,
// its slices wired into g.p (zeroed when `zero`). The returned tensor owns the memory.
at::Tensor alloc_norm_partials(NormBwd &g, int64_t n_partials, bool zero);

}  // namespace torchfuse

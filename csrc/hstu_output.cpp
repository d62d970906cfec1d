// HSTU output section: argument checks, parameter setup and the CPU implementation.
#include "hstu_output.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "../kernels/norm_kernels.h"
#include "tf_check.h"
#include "tf_philox_glue.h"

namespace torchfuse {

void check_hstu_output_norm_and_acts(const at::Tensor &weight, const at::Tensor &bias, const at::Tensor &attn,
                                     int64_t count, const char *shape_note, int64_t mul_act, int64_t cat_act,
                                     const char *op) {
    for (auto [t, name] : {std::pair<const at::Tensor &, const char *>{weight, "norm_weight"}, {bias, "norm_bias"}}) {
        check_same_device(t, attn, op, name, "attn");
        TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == count, op, ": ", name, " must be 1-D with ", count,
                          " elements", shape_note, ", got shape ", t.sizes());
        kernel_dtype(t.scalar_type(), op, name);
    }
    TORCH_CHECK_TYPE(weight.scalar_type() == bias.scalar_type(), op, ": norm_weight and norm_bias must share one "
                     "dtype, got ", weight.scalar_type(), " and ", bias.scalar_type());
    TORCH_CHECK_VALUE(mul_act >= TF_ACT_NONE && mul_act <= TF_ACT_SIGMOID, op,
                      ": mul_u_activation_type code must be 0 (none), 1 (silu) or 2 (sigmoid), got ", mul_act);
    TORCH_CHECK_VALUE(cat_act == TF_ACT_NONE || cat_act == TF_ACT_SILU, op,
                      ": the concatenated u's activation must be 0 (none) or 1 (silu), got ", cat_act);
}

namespace {

constexpr const char *kOp = "torchfuse.hstu_compute_output";

struct Shape {
    int64_t rows, cols, wcols, y_cols;
};

Shape check_common(const at::Tensor &attn, const at::Tensor &u, const at::Tensor &weight, const at::Tensor &bias,
                   int64_t groups, int64_t mul_act, int64_t cat_act, bool concat_u, bool concat_x,
                   double dropout_ratio) {
    TORCH_CHECK_VALUE(attn.dim() == 2 && attn.size(1) >= 1, kOp, ": attn must be 2-D (L, num_heads * linear_dim) "
                      "with at least one column, got shape ", attn.sizes());
    TORCH_CHECK_VALUE(u.sizes() == attn.sizes(), kOp, ": u must have attn's shape ", attn.sizes(), ", got ",
                      u.sizes());
    check_same_device(u, attn, kOp, "u", "attn");
    kernel_dtype(attn.scalar_type(), kOp, "attn");
    kernel_dtype(u.scalar_type(), kOp, "u");
    const int64_t cols = attn.size(1);
    TORCH_CHECK_VALUE(groups == 0 || (groups >= 1 && cols % groups == 0), kOp, ": num_heads (", groups,
                      ") must be positive and divide attn's width ", cols, " for group_norm");
    const int64_t wcols = groups == 0 ? cols : groups;
    check_hstu_output_norm_and_acts(weight, bias, attn, wcols,
                                    groups == 0 ? " (LayerNorm over attn's width)" : " (one per head with group_norm)",
                                    mul_act, cat_act, kOp);
    TORCH_CHECK_VALUE(std::isfinite(dropout_ratio) && dropout_ratio >= 0 && dropout_ratio < 1, kOp,
                      ": dropout_ratio must be in [0, 1), got ", dropout_ratio);
    return {attn.size(0), cols, wcols, cols * (1 + (int64_t)concat_u + (int64_t)concat_x)};
}

at::Tensor rows_view(const at::Tensor &t, int64_t &stride) {
    RowMatrix m = as_rows(t);
    stride = m.row_stride;
    return m.t;
}

void check_rng_state(const at::Tensor &s, const at::Tensor &attn) {
    check_same_device(s, attn, kOp, "rng_state", "attn");
    TORCH_CHECK_VALUE(s.scalar_type() == at::kLong && s.numel() == 2 && s.is_contiguous(), kOp,
                      ": rng_state must be a forward's (seed, offset): 2 contiguous int64, got ", s.scalar_type(),
                      " with ", s.numel(), " elements");
}

tf_philox_args philox_from_state(const at::Tensor &s) {
    tf_philox_args a{};
    a.seed_ptr = s.data_ptr<int64_t>();
    a.offset_ptr = a.seed_ptr + 1;
    return a;
}

}  // namespace

// What the forward's and the backward's kernel parameters share (h: HstuOutputFwd or HstuOutputBwd,
// which hold the tensors the kernel reads): the shape, attn and u as row views, the norm's weight and
// bias, the activations, the concatenation and the dropout rate. The inputs passed check_common.
template <typename Held>
void set_common(Held &h, const Shape &sh, const at::Tensor &attn, const at::Tensor &u, const at::Tensor &weight,
                const at::Tensor &bias, int64_t groups, int64_t mul_act, int64_t cat_act, bool concat_u,
                bool concat_x, double dropout_ratio) {
    auto &p = h.p;
    p.rows = sh.rows;
    p.cols = sh.cols;
    p.groups = std::max<int64_t>(groups, 1);
    p.group_weights = groups > 0;
    p.y_cols = sh.y_cols;
    h.attn = rows_view(attn, p.attn_stride);
    h.u = rows_view(u, p.u_stride);
    p.attn = h.attn.data_ptr();
    p.u = h.u.data_ptr();
    p.attn_dtype = kernel_dtype(attn.scalar_type(), kOp, "attn");
    p.u_dtype = kernel_dtype(u.scalar_type(), kOp, "u");
    h.w = weight.contiguous();
    h.b = bias.contiguous();
    p.w = h.w.data_ptr();
    p.b = h.b.data_ptr();
    p.w_dtype = kernel_dtype(weight.scalar_type(), kOp, "norm_weight");
    p.mul_act = (int)mul_act;
    p.cat_act = (int)cat_act;
    p.cat_u = concat_u;
    p.cat_x = concat_x;
    p.dropout = dropout_ratio > 0;
    p.p = (float)dropout_ratio;
}

HstuOutputFwd prepare_hstu_output_fwd(const at::Tensor &attn, const at::Tensor &u, const at::Tensor &weight,
                                      const at::Tensor &bias, double eps, int64_t groups, int64_t mul_act,
                                      int64_t cat_act, bool concat_u, bool concat_x, double dropout_ratio,
                                      const std::optional<at::Tensor> &rng_state) {
    const Shape sh = check_common(attn, u, weight, bias, groups, mul_act, cat_act, concat_u, concat_x,
                                  dropout_ratio);
    TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0, kOp, ": eps must be a positive finite number, got ", eps);
    HstuOutputFwd f{};
    tf_hstu_output_fwd_params &p = f.p;
    set_common(f, sh, attn, u, weight, bias, groups, mul_act, cat_act, concat_u, concat_x, dropout_ratio);
    p.eps = (float)eps;
    if (rng_state.has_value()) {
        check_rng_state(*rng_state, attn);
        f.rng_state = rng_state->clone();  // an output must not alias an input
        p.rng = philox_from_state(f.rng_state);
    } else {
        f.rng_state = at::empty({2}, attn.options().dtype(at::kLong));
    }
    f.y = at::empty({p.rows, p.y_cols}, attn.options());
    p.y = f.y.data_ptr();
    p.y_dtype = p.attn_dtype;
    const at::TensorOptions fo = attn.options().dtype(at::kFloat);
    f.mean = at::empty({p.rows, p.groups}, fo);
    f.rstd = at::empty({p.rows, p.groups}, fo);
    p.mean = f.mean.data_ptr<float>();
    p.rstd = f.rstd.data_ptr<float>();
    return f;
}

HstuOutputBwd prepare_hstu_output_bwd(const at::Tensor &dy, const at::Tensor &attn, const at::Tensor &u,
                                      const at::Tensor &weight, const at::Tensor &bias, const at::Tensor &mean,
                                      const at::Tensor &rstd, const at::Tensor &rng_state, int64_t groups,
                                      int64_t mul_act, int64_t cat_act, bool concat_u, bool concat_x,
                                      double dropout_ratio, bool weight_grad, bool recompute_y) {
    const Shape sh = check_common(attn, u, weight, bias, groups, mul_act, cat_act, concat_u, concat_x,
                                  dropout_ratio);
    HstuOutputBwd g{};
    tf_hstu_output_bwd_params &p = g.p;
    set_common(g, sh, attn, u, weight, bias, groups, mul_act, cat_act, concat_u, concat_x, dropout_ratio);
    check_same_device(dy, attn, kOp, "dy", "attn");
    TORCH_CHECK_VALUE(dy.dim() == 2 && dy.size(0) == sh.rows && dy.size(1) == sh.y_cols, kOp,
                      ": dy must be (", sh.rows, ", ", sh.y_cols, "), got ", dy.sizes());
    for (auto [t, name] : {std::pair<const at::Tensor &, const char *>{mean, "mean"}, {rstd, "rstd"}}) {
        check_same_device(t, attn, kOp, name, "attn");
        TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.numel() == sh.rows * p.groups && t.is_contiguous(), kOp,
                          ": ", name, " must be a forward's float32 (L, groups) statistics");
    }
    check_rng_state(rng_state, attn);
    g.dy = rows_view(dy, p.dy_stride);
    g.mean = mean;
    g.rstd = rstd;
    g.rng_state = rng_state;
    p.dy = g.dy.data_ptr();
    p.dy_dtype = kernel_dtype(dy.scalar_type(), kOp, "dy");
    p.rng = philox_from_state(g.rng_state);
    p.mean = g.mean.data_ptr<float>();
    p.rstd = g.rstd.data_ptr<float>();
    g.dattn = at::empty({p.rows, p.cols}, attn.options());
    g.du = at::empty({p.rows, p.cols}, u.options());
    p.dattn = g.dattn.data_ptr();
    p.dattn_dtype = p.attn_dtype;
    p.du = g.du.data_ptr();
    p.du_dtype = p.u_dtype;
    g.want_wgrad = weight_grad;
    if (weight_grad) {
        g.dw = at::empty({sh.wcols}, weight.options());
        g.db = at::empty({sh.wcols}, bias.options());
    } else {
        g.dw = no_output(attn);
        g.db = no_output(attn);
    }
    if (recompute_y) {
        g.y = at::empty({p.rows, p.y_cols}, attn.options());
        p.y = g.y.data_ptr();
        p.y_dtype = p.attn_dtype;
    } else {
        g.y = no_output(attn);
    }
    return g;
}

at::Tensor alloc_hstu_output_partials(HstuOutputBwd &g, int64_t n_partials, bool zero) {
    tf_hstu_output_bwd_params &p = g.p;
    p.n_partials = n_partials;
    if (!g.want_wgrad) return at::Tensor();
    const int64_t wcols = p.group_weights ? p.groups : p.cols;
    const auto opts = g.attn.options().dtype(at::kFloat);
    at::Tensor buf = zero ? at::zeros({2, n_partials, wcols}, opts) : at::empty({2, n_partials, wcols}, opts);
    p.dw_part = buf[0].data_ptr<float>();
    p.db_part = buf[1].data_ptr<float>();
    return buf;
}

namespace {

constexpr int64_t kCpuRowsPerPartial = 64;

HstuOutputResult hstu_output_fwd_cpu(const at::Tensor &attn, const at::Tensor &u, const at::Tensor &weight,
                                     const at::Tensor &bias, double eps, int64_t groups, int64_t mul_act,
                                     int64_t cat_act, bool concat_u, bool concat_x, double dropout_ratio,
                                     std::optional<int64_t> seed, const std::optional<at::Tensor> &rng_state) {
    HstuOutputFwd f = prepare_hstu_output_fwd(attn, u, weight, bias, eps, groups, mul_act, cat_act, concat_u,
                                              concat_x, dropout_ratio, rng_state);
    if (!rng_state.has_value()) {
        // only a call that drops draws from the generator (as F.dropout): eval calls leave it alone
        f.p.rng = philox_args_cpu(dropout_ratio > 0 ? seed : std::optional<int64_t>(seed.value_or(0)));
        int64_t *s = f.rng_state.data_ptr<int64_t>();
        s[0] = (int64_t)f.p.rng.seed;
        s[1] = (int64_t)f.p.rng.offset;
    }
    const tf_hstu_output_fwd_params p = f.p;
    at::parallel_for(0, p.rows, 16, [&](int64_t r0, int64_t r1) { tf_hstu_output_fwd_cpu(&p, r0, r1); });
    return f.result();
}

HstuOutputBwdResult hstu_output_bwd_cpu(const at::Tensor &dy, const at::Tensor &attn, const at::Tensor &u,
                                        const at::Tensor &weight, const at::Tensor &bias, const at::Tensor &mean,
                                        const at::Tensor &rstd, const at::Tensor &rng_state, int64_t groups,
                                        int64_t mul_act, int64_t cat_act, bool concat_u, bool concat_x,
                                        double dropout_ratio, bool weight_grad, bool recompute_y) {
    HstuOutputBwd g = prepare_hstu_output_bwd(dy, attn, u, weight, bias, mean, rstd, rng_state, groups, mul_act,
                                              cat_act, concat_u, concat_x, dropout_ratio, weight_grad,
                                              recompute_y);
    // fixed blocks of rows, each summing into its own partial row: the result does not depend on threads
    const int64_t blocks = std::max<int64_t>(1, (g.p.rows + kCpuRowsPerPartial - 1) / kCpuRowsPerPartial);
    at::Tensor partials = alloc_hstu_output_partials(g, blocks, /*zero=*/true);
    const tf_hstu_output_bwd_params p = g.p;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b)
            tf_hstu_output_bwd_cpu(&p, b * kCpuRowsPerPartial, std::min(p.rows, (b + 1) * kCpuRowsPerPartial), b);
    });
    if (g.want_wgrad) {
        const int64_t wcols = p.group_weights ? p.groups : p.cols;
        const int dt = kernel_dtype(g.dw.scalar_type(), kOp, "norm_weight");
        tf_column_sum_cpu(p.dw_part, blocks, wcols, g.dw.data_ptr(), dt, 0, wcols);
        tf_column_sum_cpu(p.db_part, blocks, wcols, g.db.data_ptr(), dt, 0, wcols);
    }
    return g.result();
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
    m.impl("hstu_output_fwd", &hstu_output_fwd_cpu);
    m.impl("hstu_output_bwd", &hstu_output_bwd_cpu);
}

}  // namespace torchfuse

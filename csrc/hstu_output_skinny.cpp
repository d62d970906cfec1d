// HSTU output section + skinny linear for a few rows: checks, setup, and the CPU implementation, which
// is the two-kernel path itself (the output op's rows, then the skinny linear over them).
#include "hstu_output_skinny.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "hstu_output.h"
#include "skinny_linear.h"
#include "tf_check.h"

namespace torchfuse {
namespace {
constexpr const char *kOp = "torchfuse.hstu_compute_output";

at::Tensor unit_columns(const at::Tensor &t) { return t.stride(1) == 1 || t.size(1) <= 1 ? t : t.contiguous(); }
}  // namespace

HstuOutputSkinny prepare_hstu_output_skinny(const at::Tensor &attn, const at::Tensor &u, const at::Tensor &x,
                                            const at::Tensor &norm_weight, const at::Tensor &norm_bias, double eps,
                                            const at::Tensor &output_weight, int64_t mul_act, int64_t cat_act,
                                            bool concat_u, bool concat_x) {
    TORCH_CHECK_VALUE(attn.dim() == 2 && attn.size(1) >= 1, kOp, ": attn must be 2-D (L, num_heads * linear_dim) "
                      "with at least one column, got shape ", attn.sizes());
    TORCH_CHECK_VALUE(attn.size(0) <= TF_SKINNY_MAX_ROWS, kOp, ": attn must have at most ", TF_SKINNY_MAX_ROWS,
                      " rows for the fused few-row path, got ", attn.size(0));
    const int dt = kernel_dtype(attn.scalar_type(), kOp, "attn");
    const int64_t M = attn.size(0), n = attn.size(1), K = n * (1 + (int64_t)concat_u + (int64_t)concat_x);
    TORCH_CHECK_VALUE(u.sizes() == attn.sizes(), kOp, ": u must have attn's shape ", attn.sizes(), ", got ",
                      u.sizes());
    TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) == M, kOp, ": x must be 2-D with attn's ", M, " rows, got shape ",
                      x.sizes());
    const int64_t N = x.size(1);
    TORCH_CHECK_VALUE(output_weight.dim() == 2 && output_weight.size(0) == K && output_weight.size(1) == N, kOp,
                      ": output_weight must be (", K, ", ", N, ") (the concatenation's columns by x's width), got ",
                      output_weight.sizes());
    for (auto [t, name] : {std::pair<const at::Tensor &, const char *>{u, "u"}, {x, "x"},
                           {output_weight, "output_weight"}}) {
        check_same_device(t, attn, kOp, name, "attn");
        TORCH_CHECK_TYPE(t.scalar_type() == attn.scalar_type(), kOp, ": ", name, " must have attn's dtype ",
                         attn.scalar_type(), ", got ", t.scalar_type());
    }
    check_hstu_output_norm_and_acts(norm_weight, norm_bias, attn, n, " (LayerNorm over attn's width)", mul_act,
                                    cat_act, kOp);
    TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0, kOp, ": eps must be a positive finite number, got ", eps);

    HstuOutputSkinny s{};
    RowMatrix a = as_rows(attn), uu = as_rows(u);
    s.attn = a.t;
    s.u = uu.t;
    s.x = unit_columns(x);
    s.w = unit_columns(output_weight);
    s.norm_w = norm_weight.contiguous();
    s.norm_b = norm_bias.contiguous();
    s.out = at::empty({M, N}, x.options());
    tf_skinny_hstu_output_params &p = s.p;
    p.attn = s.attn.data_ptr();
    p.attn_stride = a.row_stride;
    p.u = s.u.data_ptr();
    p.u_stride = uu.row_stride;
    p.cols = n;
    p.norm_w = s.norm_w.data_ptr();
    p.norm_b = s.norm_b.data_ptr();
    p.norm_dtype = kernel_dtype(norm_weight.scalar_type(), kOp, "norm_weight");
    p.mul_act = (int)mul_act;
    p.cat_act = (int)cat_act;
    p.cat_u = concat_u;
    p.cat_x = concat_x;
    tf_skinny_linear_params &l = p.lin;
    l.w = s.w.data_ptr();
    l.w_stride = K > 1 ? s.w.stride(0) : N;
    l.res = s.x.data_ptr();
    l.res_stride = M > 1 ? s.x.stride(0) : N;
    l.out = s.out.data_ptr();
    l.out_stride = N;
    l.M = M;
    l.K = K;
    l.N = N;
    l.eps = (float)eps;
    l.dtype = dt;
    return s;
}

namespace {
at::Tensor hstu_output_skinny_cpu(const at::Tensor &attn, const at::Tensor &u, const at::Tensor &x,
                                  const at::Tensor &norm_weight, const at::Tensor &norm_bias, double eps,
                                  const at::Tensor &output_weight, int64_t mul_act, int64_t cat_act, bool concat_u,
                                  bool concat_x) {
    HstuOutputSkinny s = prepare_hstu_output_skinny(attn, u, x, norm_weight, norm_bias, eps, output_weight, mul_act,
                                                    cat_act, concat_u, concat_x);
    if (s.p.lin.M == 0 || s.p.lin.N == 0) return s.out;
    // no dropout: the mask's generator arguments are never read
    HstuOutputFwd f = prepare_hstu_output_fwd(attn, u, norm_weight, norm_bias, eps, 0, mul_act, cat_act, concat_u,
                                              concat_x, 0.0, std::nullopt);
    const tf_hstu_output_fwd_params fp = f.p;
    at::parallel_for(0, fp.rows, 16, [&](int64_t r0, int64_t r1) { tf_hstu_output_fwd_cpu(&fp, r0, r1); });
    SkinnyLinear l = prepare_skinny_linear(f.y, output_weight, std::nullopt, x, std::nullopt, std::nullopt, eps);
    TORCH_CHECK(tf_skinny_linear_cpu(&l.p) == 0, kOp, ": out of host memory for a row buffer");
    return l.out;
}
}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) { m.impl("hstu_output_skinny", hstu_output_skinny_cpu); }

}  // namespace torchfuse

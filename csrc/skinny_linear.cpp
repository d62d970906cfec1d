// Skinny linear: checks, setup and the CPU implementation (schema: registration.cpp).
#include "skinny_linear.h"

#include <torch/library.h>

#include <cmath>

#include "tf_check.h"

namespace torchfuse {
namespace {
constexpr const char *kOp = "torchfuse.skinny_linear";

at::Tensor rows_of_matrix(const at::Tensor &t) {  // unit column stride, any row stride
    return t.stride(1) == 1 || t.size(1) <= 1 ? t : t.contiguous();
}

void check_vector(const at::Tensor &t, const at::Tensor &a, int64_t n, const char *name) {
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, kOp, ": ", name, " must have shape (", n, "), got ", t.sizes());
    TORCH_CHECK_TYPE(t.scalar_type() == a.scalar_type(), kOp, ": ", name, " must have a's dtype ", a.scalar_type(),
                     ", got ", t.scalar_type());
    check_same_device(t, a, kOp, name, "a");
}
}  // namespace

SkinnyLinear prepare_skinny_linear(const at::Tensor &a, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                                   const std::optional<at::Tensor> &residual,
                                   const std::optional<at::Tensor> &norm_weight,
                                   const std::optional<at::Tensor> &norm_bias, double eps) {
    const int dt = kernel_dtype(a.scalar_type(), kOp, "a");
    TORCH_CHECK_VALUE(a.dim() == 2, kOp, ": a must be 2-D (M, K), got shape ", a.sizes());
    TORCH_CHECK_VALUE(a.size(0) <= TF_SKINNY_MAX_ROWS, kOp, ": a must have at most ", TF_SKINNY_MAX_ROWS,
                      " rows (the serving GEMV; use torch.addmm for more), got ", a.size(0));
    TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) == a.size(1), kOp, ": weight must be (K, N) with K = ",
                      a.size(1), " (a's columns), got shape ", weight.sizes());
    TORCH_CHECK_TYPE(weight.scalar_type() == a.scalar_type(), kOp, ": weight must have a's dtype ", a.scalar_type(),
                     ", got ", weight.scalar_type());
    check_same_device(weight, a, kOp, "weight", "a");
    const int64_t M = a.size(0), K = a.size(1), N = weight.size(1);
    SkinnyLinear s{};
    s.a = rows_of_matrix(a);
    s.w = rows_of_matrix(weight);
    if (bias.has_value()) {
        check_vector(*bias, a, N, "bias");
        s.bias = bias->contiguous();
    }
    if (residual.has_value()) {
        const at::Tensor &r = *residual;
        TORCH_CHECK_VALUE(r.dim() == 2 && r.size(0) == M && r.size(1) == N, kOp, ": residual must have shape (", M,
                          ", ", N, "), got ", r.sizes());
        TORCH_CHECK_TYPE(r.scalar_type() == a.scalar_type(), kOp, ": residual must have a's dtype ", a.scalar_type(),
                         ", got ", r.scalar_type());
        check_same_device(r, a, kOp, "residual", "a");
        s.res = rows_of_matrix(r);
    }
    TORCH_CHECK_VALUE(norm_weight.has_value() || !norm_bias.has_value(), kOp,
                      ": norm_bias needs norm_weight (the LayerNorm applied to a)");
    if (norm_weight.has_value()) {
        TORCH_CHECK_VALUE(K > 0, kOp, ": the LayerNorm needs a with at least one column");
        TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0, kOp, ": eps must be a positive finite number, got ", eps);
        check_vector(*norm_weight, a, K, "norm_weight");
        s.norm_w = norm_weight->contiguous();
        if (norm_bias.has_value()) {
            check_vector(*norm_bias, a, K, "norm_bias");
            s.norm_b = norm_bias->contiguous();
        }
    }
    s.out = at::empty({M, N}, a.options());
    tf_skinny_linear_params &p = s.p;
    p.a = s.a.data_ptr();
    p.a_stride = M > 1 ? s.a.stride(0) : K;
    p.w = s.w.data_ptr();
    p.w_stride = K > 1 ? s.w.stride(0) : N;
    p.bias = s.bias.defined() ? s.bias.data_ptr() : nullptr;
    p.res = s.res.defined() ? s.res.data_ptr() : nullptr;
    p.res_stride = s.res.defined() && M > 1 ? s.res.stride(0) : N;
    p.norm_w = s.norm_w.defined() ? s.norm_w.data_ptr() : nullptr;
    p.norm_b = s.norm_b.defined() ? s.norm_b.data_ptr() : nullptr;
    p.out = s.out.data_ptr();
    p.out_stride = N;
    p.M = M;
    p.K = K;
    p.N = N;
    p.eps = (float)eps;
    p.dtype = dt;
    return s;
}

void skinny_linear_composed(SkinnyLinear &s) {
    at::Tensor a = s.a.to(at::kFloat);
    if (s.norm_w.defined()) {
        const at::Tensor mean = a.mean(1, true);
        const at::Tensor var = (a - mean).square().mean(1, true);
        a = (a - mean) * at::rsqrt(var + (double)s.p.eps) * s.norm_w.to(at::kFloat);
        if (s.norm_b.defined()) a = a + s.norm_b.to(at::kFloat);
        a = a.to(s.a.scalar_type()).to(at::kFloat);  // the norm's output is rounded, as the norm op's is
    }
    at::Tensor out = at::mm(a, s.w.to(at::kFloat));
    if (s.bias.defined()) out = out + s.bias.to(at::kFloat);
    if (s.res.defined()) out = out + s.res.to(at::kFloat);
    s.out.copy_(out);
}

namespace {
at::Tensor skinny_linear_cpu(const at::Tensor &a, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                             const std::optional<at::Tensor> &residual, const std::optional<at::Tensor> &norm_weight,
                             const std::optional<at::Tensor> &norm_bias, double eps) {
    SkinnyLinear s = prepare_skinny_linear(a, weight, bias, residual, norm_weight, norm_bias, eps);
    if (s.p.M == 0 || s.p.N == 0) return s.out;
    if (s.p.K == 0) {
        skinny_linear_composed(s);
        return s.out;
    }
    TORCH_CHECK(tf_skinny_linear_cpu(&s.p) == 0, kOp, ": out of host memory for a row buffer");
    return s.out;
}
}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) { m.impl("skinny_linear", skinny_linear_cpu); }

}  // namespace torchfuse

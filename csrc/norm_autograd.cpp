// Autograd kernels of the norm ops, in C++ so that a differentiable call costs about what an ATen op's
// does: no Python autograd.Function in the forward, no Python frame in the backward (at decode sizes
// the host's cost is the call's whole cost).
//
// norm_fwd: a torch::autograd::Function whose backward is norm_bwd. add_norm has no backward: its
// Autograd kernel refuses inputs that need gradients (rather than returning outputs silently cut from
// the graph) and otherwise goes straight to the device kernel.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace torchfuse {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

bool needs_grad(const OptTensor &t) { return t.has_value() && t->defined() && t->requires_grad(); }
OptTensor defined_or_none(const at::Tensor &t) { return t.defined() ? OptTensor(t) : std::nullopt; }

using NormFwdOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

NormFwdOut norm_fwd_below_autograd(const at::Tensor &x, const OptTensor &residual, const OptTensor &residual2,
                                   const OptTensor &weight, const OptTensor &bias, const OptTensor &weight2,
                                   const OptTensor &bias2, double eps, int64_t norm_type, double weight_offset,
                                   std::optional<at::ScalarType> residual_dtype, bool save_stats) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchfuse::norm_fwd", "")
                         .typed<NormFwdOut(const at::Tensor &, const OptTensor &, const OptTensor &, const OptTensor &,
                                           const OptTensor &, const OptTensor &, const OptTensor &, double, int64_t,
                                           double, std::optional<at::ScalarType>, bool)>();
    return op.call(x, residual, residual2, weight, bias, weight2, bias2, eps, norm_type, weight_offset,
                   residual_dtype, save_stats);
}

// (dx, dresidual, dresidual2, dweight, dbias, dweight2, dbias2), as the schema in registration.cpp says
using NormBwdOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

NormBwdOut norm_bwd_call(const OptTensor &dy, const OptTensor &dy2, const OptTensor &ds, const at::Tensor &s,
                         const at::Tensor &mean, const at::Tensor &rstd, const OptTensor &weight,
                         const OptTensor &weight2, int64_t norm_type, double weight_offset, bool has_bias,
                         bool has_bias2, at::ScalarType x_dtype, std::optional<at::ScalarType> residual_dtype,
                         std::optional<at::ScalarType> residual2_dtype, bool weight_grad) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchfuse::norm_bwd", "")
                         .typed<NormBwdOut(const OptTensor &, const OptTensor &, const OptTensor &, const at::Tensor &,
                                           const at::Tensor &, const at::Tensor &, const OptTensor &, const OptTensor &,
                                           int64_t, double, bool, bool, at::ScalarType,
                                           std::optional<at::ScalarType>, std::optional<at::ScalarType>, bool)>();
    return op.call(dy, dy2, ds, s, mean, rstd, weight, weight2, norm_type, weight_offset, has_bias, has_bias2,
                   x_dtype, residual_dtype, residual2_dtype, weight_grad);
}

}  // namespace

// Outside the anonymous namespace: its name is the autograd node's (grad_fn.name(), profiles).
// The twelve inputs of norm_fwd in schema order; the tensors among them are 0-6.
enum { kX, kRes, kRes2, kW, kB, kW2, kB2, kInputs = 12 };

struct NormFunction : public torch::autograd::Function<NormFunction> {
    static variable_list forward(AutogradContext *ctx, const at::Tensor &x, const OptTensor &residual,
                                 const OptTensor &residual2, const OptTensor &weight, const OptTensor &bias,
                                 const OptTensor &weight2, const OptTensor &bias2, double eps, int64_t norm_type,
                                 double weight_offset, std::optional<at::ScalarType> residual_dtype, bool save_stats) {
        auto [y, y2, s, mean, rstd] = norm_fwd_below_autograd(x, residual, residual2, weight, bias, weight2, bias2, eps,
                                                              norm_type, weight_offset, residual_dtype, save_stats);
        ctx->mark_non_differentiable({mean, rstd});
        ctx->set_materialize_grads(false);
        // the normalized input: s with a residual, else x itself
        ctx->save_for_backward({residual.has_value() ? s : x, mean, rstd, weight.value_or(at::Tensor()),
                                weight2.value_or(at::Tensor())});
        const bool need[7] = {x.requires_grad(),       needs_grad(residual), needs_grad(residual2), needs_grad(weight),
                              needs_grad(bias),        needs_grad(weight2),  needs_grad(bias2)};
        int64_t need_bits = 0;
        for (int i = 0; i < 7; ++i) need_bits |= (int64_t)need[i] << i;
        auto &d = ctx->saved_data;
        d["need"] = need_bits;
        d["norm_type"] = norm_type;
        d["weight_offset"] = weight_offset;
        d["save_stats"] = save_stats;
        d["x_dtype"] = x.scalar_type();
        d["res_dtype"] = residual.has_value() ? c10::IValue(residual->scalar_type()) : c10::IValue();
        d["res2_dtype"] = residual2.has_value() ? c10::IValue(residual2->scalar_type()) : c10::IValue();
        d["has_bias"] = bias.has_value();
        d["has_bias2"] = bias2.has_value();
        d["two"] = weight2.has_value();
        return {y, y2, s, mean, rstd};
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        auto &d = ctx->saved_data;
        TORCH_CHECK(d["save_stats"].toBool(),
                    "torchfuse.norm_fwd: the forward ran with save_stats=False, so it cannot be differentiated; "
                    "call torchfuse.layer_norm / rms_norm, which set it when gradients are needed");
        const variable_list saved = ctx->get_saved_variables();
        const int64_t need = d["need"].toInt();
        auto needs = [need](int i) { return (need >> i) & 1; };
        const at::ScalarType x_dt = d["x_dtype"].toScalarType();
        const auto opt_dtype = [](const c10::IValue &v) {
            return v.isNone() ? std::optional<at::ScalarType>() : std::optional<at::ScalarType>(v.toScalarType());
        };
        const std::optional<at::ScalarType> r_dt = opt_dtype(d["res_dtype"]), r2_dt = opt_dtype(d["res2_dtype"]);
        // A residual gradient is the same values as dx in another dtype: materialized only then.
        const std::optional<at::ScalarType> r_sep = r_dt.has_value() && *r_dt != x_dt ? r_dt : std::nullopt;
        const std::optional<at::ScalarType> r2_sep =
            r2_dt.has_value() && *r2_dt != x_dt && r2_dt != r_dt ? r2_dt : std::nullopt;
        const bool weight_grad = needs(kW) || needs(kB) || needs(kW2) || needs(kB2);
        const bool two = d["two"].toBool();
        auto [dx, dres, dres2, dw, db, dw2, db2] = norm_bwd_call(
            defined_or_none(grads[0]), two ? defined_or_none(grads[1]) : std::nullopt,
            r_dt.has_value() ? defined_or_none(grads[2]) : std::nullopt, saved[0], saved[1], saved[2],
            defined_or_none(saved[3]), defined_or_none(saved[4]), d["norm_type"].toInt(), d["weight_offset"].toDouble(),
            d["has_bias"].toBool(), d["has_bias2"].toBool(), x_dt, r_sep, r2_sep, weight_grad);
        at::Tensor gres, gres2;
        if (r_dt.has_value()) gres = r_sep.has_value() ? dres : dx;
        if (r2_dt.has_value()) gres2 = r2_sep.has_value() ? dres2 : (*r2_dt == x_dt ? dx : gres);
        variable_list out(kInputs);
        const at::Tensor got[7] = {dx, gres, gres2, dw, db, dw2, db2};
        for (int i = 0; i < 7; ++i)
            if (needs(i)) out[i] = got[i];
        return out;
    }
};

namespace {

NormFwdOut norm_fwd_autograd(const at::Tensor &x, const OptTensor &residual, const OptTensor &residual2,
                             const OptTensor &weight, const OptTensor &bias, const OptTensor &weight2,
                             const OptTensor &bias2, double eps, int64_t norm_type, double weight_offset,
                             std::optional<at::ScalarType> residual_dtype, bool save_stats) {
    const bool grad = at::GradMode::is_enabled() &&
                      (x.requires_grad() || needs_grad(residual) || needs_grad(residual2) || needs_grad(weight) ||
                       needs_grad(bias) || needs_grad(weight2) || needs_grad(bias2));
    if (!grad)  // nothing to record: the kernel, without the autograd node's setup
        return norm_fwd_below_autograd(x, residual, residual2, weight, bias, weight2, bias2, eps, norm_type,
                                       weight_offset, residual_dtype, save_stats);
    variable_list o = NormFunction::apply(x, residual, residual2, weight, bias, weight2, bias2, eps, norm_type,
                                          weight_offset, residual_dtype, save_stats);
    return {o[0], o[1], o[2], o[3], o[4]};
}

std::tuple<at::Tensor, at::Tensor> add_norm_autograd(const at::Tensor &x, const OptTensor &residual,
                                                     const OptTensor &weight, const OptTensor &bias, double eps,
                                                     int64_t norm_type, double weight_offset) {
    TORCH_CHECK(!(at::GradMode::is_enabled() &&
                  (x.requires_grad() || needs_grad(residual) || needs_grad(weight) || needs_grad(bias))),
                "torchfuse.add_norm is inference-only and an input requires grad; use torchfuse.layer_norm / "
                "torchfuse.rms_norm (torch.ops.torchfuse.norm_fwd), which are differentiable");
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchfuse::add_norm", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor &, const OptTensor &,
                                                                   const OptTensor &, const OptTensor &, double,
                                                                   int64_t, double)>();
    return op.call(x, residual, weight, bias, eps, norm_type, weight_offset);
}

// A building block inside hstu_preprocess's autograd Function (which runs it with grad mode off), not
// differentiable itself: refused, by name, where autograd would have to record it.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_with_ones_autograd(const at::Tensor &x,
                                                                            const OptTensor &weight,
                                                                            const OptTensor &bias, double eps,
                                                                            bool save_stats) {
    TORCH_CHECK(!(at::GradMode::is_enabled() && (x.requires_grad() || needs_grad(weight) || needs_grad(bias))),
                "torchfuse.layer_norm_with_ones is not differentiable and an input requires grad; use "
                "torchfuse.layer_norm (torch.ops.torchfuse.norm_fwd) for a differentiable LayerNorm");
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchfuse::layer_norm_with_ones", "")
                         .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor &, const OptTensor &,
                                                                               const OptTensor &, double, bool)>();
    return op.call(x, weight, bias, eps, save_stats);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
    m.impl("norm_fwd", &norm_fwd_autograd);
    m.impl("add_norm", &add_norm_autograd);
    m.impl("layer_norm_with_ones", &layer_norm_with_ones_autograd);
}

}  // namespace torchfuse

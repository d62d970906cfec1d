// torchfuse::add_norm has no backward: its Autograd kernel refuses inputs that need gradients (rather
// than returning outputs silently cut from the graph) and otherwise goes straight to the device
// kernel, without the cost of a Python autograd layer. The differentiable op is norm_fwd.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/library.h>

namespace torchfuse {
namespace {

bool needs_grad(const std::optional<at::Tensor> &t) { return t.has_value() && t->requires_grad(); }

std::tuple<at::Tensor, at::Tensor> add_norm_autograd(const at::Tensor &x, const std::optional<at::Tensor> &residual,
                                                     const std::optional<at::Tensor> &weight,
                                                     const std::optional<at::Tensor> &bias, double eps,
                                                     int64_t norm_type, double weight_offset) {
    TORCH_CHECK(!(at::GradMode::is_enabled() &&
                  (x.requires_grad() || needs_grad(residual) || needs_grad(weight) || needs_grad(bias))),
                "torchfuse.add_norm is inference-only and an input requires grad; use torchfuse.layer_norm / "
                "torchfuse.rms_norm (torch.ops.torchfuse.norm_fwd), which are differentiable");
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchfuse::add_norm", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(
                             const at::Tensor &, const std::optional<at::Tensor> &, const std::optional<at::Tensor> &,
                             const std::optional<at::Tensor> &, double, int64_t, double)>();
    return op.call(x, residual, weight, bias, eps, norm_type, weight_offset);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) { m.impl("add_norm", &add_norm_autograd); }

}  // namespace torchfuse

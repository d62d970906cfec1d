// Fused residual add + norm: argument checks, parameter setup, and the CPU implementation.
#include "norm.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "tf_check.h"

namespace torchfuse {
namespace {

const char *op_name(int64_t norm_type) {
    return norm_type == TF_LAYER_NORM ? "torchfuse.layer_norm" : "torchfuse.rms_norm";
}

void check_norm_type(int64_t norm_type) {
    TORCH_CHECK(norm_type == TF_LAYER_NORM || norm_type == TF_RMS_NORM_LLAMA || norm_type == TF_RMS_NORM_GEMMA,
                "torchfuse.norm: norm_type must be 0 (LayerNorm), 1 (RMSNorm, llama cast) or 2 (RMSNorm, gemma "
                "cast), got ",
                norm_type);
}

// A weight-like vector: 1-D of `cols` elements on x's device, contiguous (copied if not).
at::Tensor check_param(const std::optional<at::Tensor> &t, const at::Tensor &x, const char *op, const char *arg) {
    if (!t.has_value()) return at::Tensor();
    const at::Tensor &w = *t;
    check_same_device(w, x, op, arg, "x");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), op, ": ", arg,
                " must be 1-D with x.shape[-1] = ", x.size(-1), " elements, got shape ", w.sizes());
    kernel_dtype(w.scalar_type(), op, arg);
    return w.contiguous();
}

const void *ptr_or_null(const at::Tensor &t) { return t.defined() ? t.data_ptr() : nullptr; }

}  // namespace

NormFwd prepare_norm_fwd(const at::Tensor &x, const std::optional<at::Tensor> &residual,
                         const std::optional<at::Tensor> &residual2, const std::optional<at::Tensor> &weight,
                         const std::optional<at::Tensor> &bias, const std::optional<at::Tensor> &weight2,
                         const std::optional<at::Tensor> &bias2, double eps, int64_t norm_type,
                         double weight_offset, std::optional<at::ScalarType> residual_dtype, bool save_stats,
                         int64_t y_width) {
    check_norm_type(norm_type);
    const char *op = op_name(norm_type);
    const bool layer = norm_type == TF_LAYER_NORM;
    NormFwd f{};
    tf_norm_fwd_params &p = f.p;

    TORCH_CHECK(x.dim() >= 1 && x.size(-1) >= 1, op, ": x must have at least one dimension and a non-empty last "
                "dimension, got shape ", x.sizes());
    p.x_dtype = kernel_dtype(x.scalar_type(), op, "x");
    TORCH_CHECK(std::isfinite(eps) && eps > 0, op, ": eps must be a positive finite number, got ", eps);
    p.rows = rows_of(x);
    p.cols = x.size(-1);
    p.eps = (float)eps;
    p.weight_offset = (float)weight_offset;
    p.norm_type = (int)norm_type;

    RowMatrix xm = as_rows(x);
    f.x = xm.t;
    p.x = f.x.data_ptr();
    p.x_stride = xm.row_stride;

    at::ScalarType s_type = x.scalar_type();
    if (residual.has_value()) {
        const at::Tensor &r = *residual;
        check_same_device(r, x, op, "residual", "x");
        TORCH_CHECK(r.sizes() == x.sizes(), op, ": residual must have the shape of x ", x.sizes(), ", got ",
                    r.sizes());
        p.res_dtype = kernel_dtype(r.scalar_type(), op, "residual");
        RowMatrix rm = as_rows(r);
        f.res = rm.t;
        p.res = f.res.data_ptr();
        p.res_stride = rm.row_stride;
        at::ScalarType add1 = at::promote_types(x.scalar_type(), r.scalar_type());
        p.add1_dtype = kernel_dtype(add1, op, "x + residual");
        p.add2_dtype = p.add1_dtype;
        s_type = r.scalar_type();
        if (residual2.has_value()) {
            const at::Tensor &r2 = *residual2;
            check_same_device(r2, x, op, "residual2", "x");
            TORCH_CHECK(r2.sizes() == x.sizes(), op, ": residual2 must have the shape of x ", x.sizes(), ", got ",
                        r2.sizes());
            p.res2_dtype = kernel_dtype(r2.scalar_type(), op, "residual2");
            RowMatrix r2m = as_rows(r2);
            f.res2 = r2m.t;
            p.res2 = f.res2.data_ptr();
            p.res2_stride = r2m.row_stride;
            p.add2_dtype = kernel_dtype(at::promote_types(add1, r2.scalar_type()), op, "x + residual + residual2");
        }
        if (residual_dtype.has_value()) s_type = *residual_dtype;
    } else {
        TORCH_CHECK(!residual2.has_value(), op, ": residual2 needs residual");
        TORCH_CHECK(!residual_dtype.has_value(), op, ": residual_dtype needs residual");
    }
    p.s_dtype = kernel_dtype(s_type, op, "residual_dtype");

    // held by f: a strided parameter's contiguous copy must outlive this function (the kernel reads it)
    at::Tensor &w = f.w, &b = f.b, &w2 = f.w2, &b2 = f.b2;
    w = check_param(weight, x, op, "weight");
    b = check_param(bias, x, op, "bias");
    w2 = check_param(weight2, x, op, "weight2");
    b2 = check_param(bias2, x, op, "bias2");
    TORCH_CHECK(layer || (!b.defined() && !b2.defined()), op, ": RMSNorm takes no bias");
    TORCH_CHECK(!b.defined() || w.defined(), op, ": bias needs weight (pass torch.ones for an identity weight)");
    TORCH_CHECK(!b2.defined() || w2.defined(), op, ": bias2 needs weight2");
    for (const at::Tensor *t : {&b, &w2, &b2})
        TORCH_CHECK(!t->defined() || t->scalar_type() == w.scalar_type(), op,
                    ": weight, bias, weight2 and bias2 must share one dtype, got ", w.scalar_type(), " and ",
                    t->scalar_type());
    TORCH_CHECK(w.defined() || !w2.defined(), op, ": weight2 needs weight");
    p.w = ptr_or_null(w);
    p.b = ptr_or_null(b);
    p.w2 = ptr_or_null(w2);
    p.b2 = ptr_or_null(b2);
    p.w_dtype = w.defined() ? kernel_dtype(w.scalar_type(), op, "weight") : TF_F32;
    p.mul_dtype = w.defined() ? kernel_dtype(at::promote_types(w.scalar_type(), s_type), op, "weight") : p.s_dtype;

    if (y_width > 0) {
        TORCH_INTERNAL_ASSERT(x.dim() == 2 && y_width >= x.size(1) && !weight2.has_value());
        f.y = at::empty({x.size(0), y_width}, x.options().memory_format(at::MemoryFormat::Contiguous));
        p.y_stride = y_width;
    } else {
        f.y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    }
    p.y = f.y.data_ptr();
    p.y_dtype = p.x_dtype;
    if (w2.defined()) {
        f.y2 = at::empty_like(f.y);
        p.y2 = f.y2.data_ptr();
    }
    if (residual.has_value()) {
        f.s = at::empty(x.sizes(), x.options().dtype(s_type).memory_format(at::MemoryFormat::Contiguous));
        p.s = f.s.data_ptr();
    }
    if (save_stats) {
        const at::TensorOptions fopt = x.options().dtype(at::kFloat);
        f.rstd = at::empty({p.rows}, fopt);
        p.rstd = f.rstd.data_ptr<float>();
        if (layer) {
            f.mean = at::empty({p.rows}, fopt);
            p.mean = f.mean.data_ptr<float>();
        }
    }
    return f;
}

NormFwdResult NormFwd::result() const {
    auto out = [this](const at::Tensor &t) { return t.defined() ? t : no_output(y); };
    return {y, out(y2), out(s), out(mean), out(rstd)};
}

std::tuple<at::Tensor, at::Tensor> NormFwd::infer_result() const { return {y, s.defined() ? s : no_output(y)}; }

NormFwd prepare_norm_with_ones(const at::Tensor &x, const std::optional<at::Tensor> &weight,
                               const std::optional<at::Tensor> &bias, double eps, bool save_stats) {
    const char *op = "torchfuse.layer_norm_with_ones";
    TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1, op, ": x must be 2-D (rows, cols) with cols >= 1, got shape ",
                x.sizes());
    const int64_t cols = x.size(1), width = (cols + 1 + 7) / 8 * 8;
    NormFwd f = prepare_norm_fwd(x, std::nullopt, std::nullopt, weight, bias, std::nullopt, std::nullopt, eps,
                                 TF_LAYER_NORM, 0.0, std::nullopt, save_stats, width);
    f.y.narrow(1, cols, 1).fill_(1);
    if (width > cols + 1) f.y.narrow(1, cols + 1, width - cols - 1).zero_();
    return f;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_with_ones_result(const NormFwd &f) {
    auto out = [&f](const at::Tensor &t) { return t.defined() ? t : no_output(f.y); };
    return {f.y, out(f.mean), out(f.rstd)};
}

NormBwd prepare_norm_bwd(const std::optional<at::Tensor> &dy, const std::optional<at::Tensor> &dy2,
                         const std::optional<at::Tensor> &ds, const at::Tensor &s, const at::Tensor &mean,
                         const at::Tensor &rstd, const std::optional<at::Tensor> &weight,
                         const std::optional<at::Tensor> &weight2, int64_t norm_type, double weight_offset,
                         bool has_bias, bool has_bias2, at::ScalarType x_dtype,
                         std::optional<at::ScalarType> residual_dtype, std::optional<at::ScalarType> residual2_dtype,
                         bool weight_grad) {
    check_norm_type(norm_type);
    const char *op = "torchfuse.norm_bwd";
    const bool layer = norm_type == TF_LAYER_NORM;
    NormBwd g{};
    tf_norm_bwd_params &p = g.p;
    TORCH_CHECK(s.dim() >= 1 && s.size(-1) >= 1, op, ": s must have a non-empty last dimension");
    p.rows = rows_of(s);
    p.cols = s.size(-1);
    p.norm_type = (int)norm_type;
    p.weight_offset = (float)weight_offset;
    p.s_dtype = kernel_dtype(s.scalar_type(), op, "s");
    RowMatrix sm = as_rows(s);
    g.s = sm.t;
    p.s = g.s.data_ptr();
    p.s_stride = sm.row_stride;

    TORCH_CHECK(rstd.numel() == p.rows && rstd.scalar_type() == at::kFloat, op,
                ": rstd must hold one float32 per row (", p.rows, "); was the forward run with save_stats=False?");
    TORCH_CHECK(!layer || (mean.numel() == p.rows && mean.scalar_type() == at::kFloat), op,
                ": mean must hold one float32 per row (", p.rows, ")");
    check_same_device(rstd, s, op, "rstd", "s");
    p.rstd = rstd.data_ptr<float>();
    p.mean = layer ? mean.data_ptr<float>() : nullptr;

    auto grad_in = [&](const std::optional<at::Tensor> &t, const char *arg, at::Tensor &keep, int64_t &stride,
                       std::optional<at::ScalarType> as) -> const void * {
        if (!t.has_value() || !t->defined()) return nullptr;
        check_same_device(*t, s, op, arg, "s");
        TORCH_CHECK(t->sizes() == s.sizes(), op, ": ", arg, " must have the shape of s ", s.sizes(), ", got ",
                    t->sizes());
        RowMatrix m = as_rows(as.has_value() && t->scalar_type() != *as ? t->to(*as) : *t);
        keep = m.t;
        stride = m.row_stride;
        return keep.data_ptr();
    };
    p.dy = grad_in(dy, "dy", g.dy, p.dy_stride, std::nullopt);
    p.dy_dtype = g.dy.defined() ? kernel_dtype(g.dy.scalar_type(), op, "dy") : TF_F32;
    std::optional<at::ScalarType> dy_type;
    if (g.dy.defined()) dy_type = g.dy.scalar_type();
    p.dy2 = weight2.has_value() ? grad_in(dy2, "dy2", g.dy2, p.dy2_stride, dy_type) : nullptr;
    if (p.dy2 && !p.dy) p.dy_dtype = kernel_dtype(g.dy2.scalar_type(), op, "dy2");
    p.ds_in = grad_in(ds, "ds", g.ds, p.ds_in_stride, std::nullopt);
    p.ds_in_dtype = g.ds.defined() ? kernel_dtype(g.ds.scalar_type(), op, "ds") : TF_F32;

    at::Tensor &w = g.w, &w2 = g.w2;  // held by g, as in prepare_norm_fwd
    if (weight.has_value()) {
        w = weight->contiguous();
        check_same_device(w, s, op, "weight", "s");
        TORCH_CHECK(w.dim() == 1 && w.size(0) == p.cols, op, ": weight must have ", p.cols, " elements");
        p.w = w.data_ptr();
        p.w_dtype = kernel_dtype(w.scalar_type(), op, "weight");
    }
    if (weight2.has_value()) {
        TORCH_CHECK(w.defined(), op, ": weight2 needs weight");
        w2 = weight2->contiguous();
        check_same_device(w2, s, op, "weight2", "s");
        TORCH_CHECK(w2.dim() == 1 && w2.size(0) == p.cols && w2.scalar_type() == w.scalar_type(), op,
                    ": weight2 must match weight");
        p.w2 = w2.data_ptr();
    }

    const at::TensorOptions opt = s.options().memory_format(at::MemoryFormat::Contiguous);
    g.dx = at::empty(s.sizes(), opt.dtype(x_dtype));
    p.dx = g.dx.data_ptr();
    p.dx_dtype = kernel_dtype(x_dtype, op, "x_dtype");
    g.dres = residual_dtype.has_value() ? at::empty(s.sizes(), opt.dtype(*residual_dtype)) : no_output(s);
    p.dres = residual_dtype.has_value() ? g.dres.data_ptr() : nullptr;
    p.dres_dtype = residual_dtype.has_value() ? kernel_dtype(*residual_dtype, op, "residual_dtype") : TF_F32;
    g.dres2 = residual2_dtype.has_value() ? at::empty(s.sizes(), opt.dtype(*residual2_dtype)) : no_output(s);
    p.dres2 = residual2_dtype.has_value() ? g.dres2.data_ptr() : nullptr;
    p.dres2_dtype = residual2_dtype.has_value() ? kernel_dtype(*residual2_dtype, op, "residual2_dtype") : TF_F32;

    g.want_dw = weight_grad && w.defined();
    g.want_db = weight_grad && has_bias && layer;
    g.want_dw2 = weight_grad && w2.defined();
    g.want_db2 = weight_grad && has_bias2 && layer && w2.defined();
    TORCH_CHECK(!(weight_grad && has_bias && !w.defined()), op, ": bias needs weight");
    const at::ScalarType wt = w.defined() ? w.scalar_type() : at::kFloat;
    auto grad_out = [&](bool want) { return want ? at::empty({p.cols}, s.options().dtype(wt)) : no_output(s); };
    g.dw = grad_out(g.want_dw);
    g.db = grad_out(g.want_db);
    g.dw2 = grad_out(g.want_dw2);
    g.db2 = grad_out(g.want_db2);
    return g;
}

at::Tensor alloc_norm_partials(NormBwd &g, int64_t n_partials, bool zero) {
    const at::Tensor &like = g.s;
    const int64_t n = (int64_t)g.want_dw + g.want_db + g.want_dw2 + g.want_db2;
    tf_norm_bwd_params &p = g.p;
    p.n_partials = n_partials;
    const at::TensorOptions o = like.options().dtype(at::kFloat);
    at::Tensor buf = zero ? at::zeros({n > 0 ? n : 1, n_partials, p.cols}, o)
                          : at::empty({n > 0 ? n : 1, n_partials, p.cols}, o);
    int64_t i = 0;
    auto take = [&](bool want) { return want ? buf[i++].data_ptr<float>() : nullptr; };
    p.dw_part = take(g.want_dw);
    p.db_part = take(g.want_db);
    p.dw2_part = take(g.want_dw2);
    p.db2_part = take(g.want_db2);
    return buf;
}

namespace {

constexpr int64_t kCpuRowsPerPartial = 64;

void run_fwd_cpu(const tf_norm_fwd_params &p) {
    at::parallel_for(0, p.rows, 16, [&](int64_t begin, int64_t end) { tf_norm_fwd_cpu(&p, begin, end); });
}

NormFwdResult norm_fwd_cpu(const at::Tensor &x, const std::optional<at::Tensor> &residual,
                           const std::optional<at::Tensor> &residual2, const std::optional<at::Tensor> &weight,
                           const std::optional<at::Tensor> &bias, const std::optional<at::Tensor> &weight2,
                           const std::optional<at::Tensor> &bias2, double eps, int64_t norm_type,
                           double weight_offset, std::optional<at::ScalarType> residual_dtype, bool save_stats) {
    NormFwd f = prepare_norm_fwd(x, residual, residual2, weight, bias, weight2, bias2, eps, norm_type, weight_offset,
                                 residual_dtype, save_stats);
    run_fwd_cpu(f.p);
    return f.result();
}

std::tuple<at::Tensor, at::Tensor> add_norm_cpu(const at::Tensor &x, const std::optional<at::Tensor> &residual,
                                                const std::optional<at::Tensor> &weight,
                                                const std::optional<at::Tensor> &bias, double eps,
                                                int64_t norm_type, double weight_offset) {
    NormFwd f = prepare_norm_fwd(x, residual, std::nullopt, weight, bias, std::nullopt, std::nullopt, eps, norm_type,
                                 weight_offset, std::nullopt, false);
    run_fwd_cpu(f.p);
    return f.infer_result();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_with_ones_cpu(const at::Tensor &x,
                                                                       const std::optional<at::Tensor> &weight,
                                                                       const std::optional<at::Tensor> &bias,
                                                                       double eps, bool save_stats) {
    NormFwd f = prepare_norm_with_ones(x, weight, bias, eps, save_stats);
    run_fwd_cpu(f.p);
    return norm_with_ones_result(f);
}

NormBwdResult norm_bwd_cpu(const std::optional<at::Tensor> &dy, const std::optional<at::Tensor> &dy2,
                           const std::optional<at::Tensor> &ds, const at::Tensor &s, const at::Tensor &mean,
                           const at::Tensor &rstd, const std::optional<at::Tensor> &weight,
                           const std::optional<at::Tensor> &weight2, int64_t norm_type, double weight_offset,
                           bool has_bias, bool has_bias2, at::ScalarType x_dtype,
                           std::optional<at::ScalarType> residual_dtype,
                           std::optional<at::ScalarType> residual2_dtype, bool weight_grad) {
    NormBwd g = prepare_norm_bwd(dy, dy2, ds, s, mean, rstd, weight, weight2, norm_type, weight_offset, has_bias,
                                 has_bias2, x_dtype, residual_dtype, residual2_dtype, weight_grad);
    // Rows are cut into fixed blocks, each summing its weight gradients into its own partial row, so
    // the result does not depend on the thread count.
    const int64_t blocks = std::max<int64_t>(1, (g.p.rows + kCpuRowsPerPartial - 1) / kCpuRowsPerPartial);
    at::Tensor partials = alloc_norm_partials(g, blocks, /*zero=*/true);
    const tf_norm_bwd_params p = g.p;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b)
            tf_norm_bwd_cpu(&p, b * kCpuRowsPerPartial, std::min(p.rows, (b + 1) * kCpuRowsPerPartial), b);
    });
    const std::pair<const float *, at::Tensor *> sums[] = {
        {p.dw_part, &g.dw}, {p.db_part, &g.db}, {p.dw2_part, &g.dw2}, {p.db2_part, &g.db2}};
    for (const auto &[part, out] : sums) {
        if (!part) continue;
        const int dt = kernel_dtype(out->scalar_type(), "torchfuse.norm_bwd", "weight");
        at::parallel_for(0, p.cols, 256, [&](int64_t c0, int64_t c1) {
            tf_column_sum_cpu(part, p.n_partials, p.cols, out->data_ptr(), dt, c0, c1);
        });
    }
    return g.result();
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
    m.impl("norm_fwd", &norm_fwd_cpu);
    m.impl("add_norm", &add_norm_cpu);
    m.impl("layer_norm_with_ones", &layer_norm_with_ones_cpu);
    m.impl("norm_bwd", &norm_bwd_cpu);
}

}  // namespace torchfuse


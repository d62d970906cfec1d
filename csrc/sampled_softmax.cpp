// Sampled softmax loss: argument checks, the chunked forward / backward over a device's kernels, and
// the CPU implementation.
#include "sampled_softmax.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "tf_check.h"

namespace torchfuse {
namespace {

// Shared negatives: the (rows x R) fp32 block of similarities a chunk holds at once (64 MiB).
constexpr int64_t kChunkElems = int64_t(1) << 24;

at::Tensor check_ids(const at::Tensor &ids, const at::Tensor &query, const char *op, const char *arg) {
    check_same_device(ids, query, op, arg, "query");
    TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, op, ": ", arg,
                     " must be int64 or int32, got ", ids.scalar_type());
    return ids.to(at::kLong).contiguous();
}

int64_t chunk_of(int64_t T, int64_t R, int64_t chunk_rows) {
    const int64_t rows = chunk_rows > 0 ? chunk_rows : kChunkElems / std::max<int64_t>(R, 1);
    return std::max<int64_t>(1, std::min(rows, T));
}

// out = a @ b in fp32: on 16-bit operands straight from cuBLAS (mm with out_dtype), else fp32 operands.
void gemm_f32(at::Tensor &out, const at::Tensor &a, const at::Tensor &b) {
    if (a.scalar_type() == at::kFloat) at::mm_out(out, a, b);
    else at::mm_out(out, a, b, at::kFloat);
}

}  // namespace

SsmInputs prepare_ssm(const at::Tensor &query, const at::Tensor &positive, const at::Tensor &negatives,
                      const std::optional<at::Tensor> &positive_ids, const std::optional<at::Tensor> &negative_ids,
                      const std::optional<at::Tensor> &weights, double temperature, bool l2_norm, double eps,
                      const char *op) {
    SsmInputs in{};
    tf_ssm_params &p = in.p;
    TORCH_CHECK(query.dim() == 2 && query.size(1) >= 1, op, ": query must be (T, D) with D >= 1, got shape ",
                query.sizes());
    const int64_t T = query.size(0), D = query.size(1);
    p.dtype = kernel_dtype(query.scalar_type(), op, "query");
    check_same_device(positive, query, op, "positive", "query");
    TORCH_CHECK(positive.sizes() == query.sizes(), op, ": positive must have the shape of query ", query.sizes(),
                ", got ", positive.sizes());
    TORCH_CHECK_TYPE(positive.scalar_type() == query.scalar_type(), op, ": positive must have query's dtype (",
                     query.scalar_type(), "), got ", positive.scalar_type());
    check_same_device(negatives, query, op, "negatives", "query");
    TORCH_CHECK((negatives.dim() == 2 || negatives.dim() == 3) && negatives.size(-1) == D &&
                    (negatives.dim() == 2 || negatives.size(0) == T),
                op, ": negatives must be (R, D) or (T, R, D) with query's T = ", T, " and D = ", D, ", got shape ",
                negatives.sizes());
    TORCH_CHECK_TYPE(negatives.scalar_type() == query.scalar_type(), op, ": negatives must have query's dtype (",
                     query.scalar_type(), "), got ", negatives.scalar_type());
    TORCH_CHECK(std::isfinite(temperature) && temperature > 0, op,
                ": temperature must be a positive finite number, got ", temperature);
    TORCH_CHECK(std::isfinite(eps) && eps > 0, op, ": eps must be a positive finite number, got ", eps);
    p.per_row = negatives.dim() == 3;
    const int64_t R = negatives.size(-2);
    p.T = T;
    p.R = R;
    p.D = D;
    p.scale = (float)(1.0 / temperature);
    p.eps = (float)eps;
    p.l2_norm = l2_norm ? 1 : 0;

    in.q = query.contiguous();
    in.pos = positive.contiguous();
    in.neg = negatives.contiguous();
    p.q = in.q.data_ptr();
    p.p = in.pos.data_ptr();
    p.n = in.neg.data_ptr();

    TORCH_CHECK(positive_ids.has_value() == negative_ids.has_value(), op,
                ": positive_ids and negative_ids go together (the mask compares them), got only ",
                positive_ids.has_value() ? "positive_ids" : "negative_ids");
    if (positive_ids.has_value()) {
        TORCH_CHECK(positive_ids->dim() == 1 && positive_ids->size(0) == T, op, ": positive_ids must be (T,) = (",
                    T, ",), got shape ", positive_ids->sizes());
        const at::Tensor &nid = *negative_ids;
        TORCH_CHECK((nid.dim() == 1 && nid.size(0) == R) || (nid.dim() == 2 && nid.size(0) == T && nid.size(1) == R),
                    op, ": negative_ids must be (R,) = (", R, ",) or (T, R) = (", T, ", ", R, "), got shape ",
                    nid.sizes());
        in.pos_ids = check_ids(*positive_ids, query, op, "positive_ids");
        in.neg_ids = check_ids(nid, query, op, "negative_ids");
        p.pos_ids = in.pos_ids.data_ptr<int64_t>();
        p.neg_ids = in.neg_ids.data_ptr<int64_t>();
        p.neg_ids_stride = nid.dim() == 2 ? R : 0;
    }
    if (weights.has_value()) {
        const at::Tensor &w = *weights;
        check_same_device(w, query, op, "weights", "query");
        TORCH_CHECK(w.dim() == 1 && w.size(0) == T, op, ": weights must be (T,) = (", T, ",), got shape ", w.sizes());
        TORCH_CHECK_TYPE(at::isFloatingType(w.scalar_type()), op, ": weights must be a float tensor, got ",
                         w.scalar_type());
        in.weights = w.to(at::kFloat).contiguous();
    }
    return in;
}

std::tuple<at::Tensor, at::Tensor> ssm_forward(const SsmBackend &be, const at::Tensor &query,
                                               const at::Tensor &positive, const at::Tensor &negatives,
                                               const std::optional<at::Tensor> &positive_ids,
                                               const std::optional<at::Tensor> &negative_ids,
                                               const std::optional<at::Tensor> &weights, double temperature,
                                               bool l2_norm, double eps, int64_t chunk_rows) {
    SsmInputs in = prepare_ssm(query, positive, negatives, positive_ids, negative_ids, weights, temperature, l2_norm,
                               eps, "torchfuse.sampled_softmax_loss");
    const tf_ssm_params &p = in.p;
    const int64_t T = p.T, R = p.R;
    const at::TensorOptions f32 = in.q.options().dtype(at::kFloat);
    at::Tensor loss_rows = at::empty({T}, f32);
    if (T > 0 && p.per_row) {
        be.per_row_fwd(p, loss_rows.data_ptr<float>());
    } else if (T > 0) {
        at::Tensor stats = at::empty({3, T}, f32), rn = at::empty({R}, f32);
        float *rq = stats[0].data_ptr<float>(), *rp = stats[1].data_ptr<float>(), *pos = stats[2].data_ptr<float>();
        be.row_stats(p, rq, rp, pos);
        if (R > 0) be.neg_norms(p, rn.data_ptr<float>());
        const bool f32_gemm = !be.low_precision_gemm && p.dtype != TF_F32;
        const at::Tensor ng = f32_gemm ? in.neg.to(at::kFloat) : in.neg;
        const int64_t tc = chunk_of(T, R, chunk_rows);
        at::Tensor S = at::empty({tc, R}, f32);
        for (int64_t t0 = 0; t0 < T; t0 += tc) {
            const int64_t n = std::min(tc, T - t0);
            at::Tensor Sv = S.narrow(0, 0, n);
            if (R > 0) {
                at::Tensor qc = in.q.narrow(0, t0, n);
                gemm_f32(Sv, f32_gemm ? qc.to(at::kFloat) : qc, ng.t());
            }
            be.block_lse(p, Sv.data_ptr<float>(), t0, n, rq, rn.data_ptr<float>(), pos, loss_rows.data_ptr<float>());
        }
    }
    // the (weighted) mean over rows; a batch of total weight 0 (e.g. no rows) has loss 0, not 0/0
    at::Tensor loss;
    if (!in.weights.defined()) {
        loss = T > 0 ? loss_rows.sum() / (double)T : at::zeros({}, f32);
    } else {
        const at::Tensor W = in.weights.sum();
        loss = at::where(W.ne(0), (loss_rows * in.weights).sum() / W, at::zeros({}, f32));
    }
    return {loss, loss_rows};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ssm_backward(
    const SsmBackend &be, const at::Tensor &dloss, const at::Tensor &query, const at::Tensor &positive,
    const at::Tensor &negatives, const std::optional<at::Tensor> &positive_ids,
    const std::optional<at::Tensor> &negative_ids, const std::optional<at::Tensor> &weights, const at::Tensor &row_loss,
    double temperature, bool l2_norm, double eps, int64_t chunk_rows) {
    const char *op = "torchfuse.sampled_softmax_loss (backward)";
    SsmInputs in = prepare_ssm(query, positive, negatives, positive_ids, negative_ids, weights, temperature, l2_norm,
                               eps, op);
    const tf_ssm_params &p = in.p;
    const int64_t T = p.T, R = p.R, D = p.D;
    check_same_device(dloss, query, op, "dloss", "query");
    check_same_device(row_loss, query, op, "row_loss", "query");
    TORCH_CHECK(dloss.numel() == 1, op, ": dloss must hold one element, got shape ", dloss.sizes());
    TORCH_CHECK(row_loss.dim() == 1 && row_loss.size(0) == T && row_loss.scalar_type() == at::kFloat, op,
                ": row_loss must be the forward's float32 (T,) = (", T, ",) row losses, got ", row_loss.scalar_type(),
                " ", row_loss.sizes());
    const at::Tensor lr = row_loss.contiguous();
    const float *loss = lr.data_ptr<float>();
    const at::TensorOptions f32 = in.q.options().dtype(at::kFloat);
    at::Tensor dq = at::empty_like(in.q), dp = at::empty_like(in.pos), dn = at::empty_like(in.neg);
    if (T == 0) {
        dn.zero_();
        return {dq, dp, dn};
    }
    // g_t = dL / dloss_t
    const at::Tensor dl = dloss.reshape({}).to(at::kFloat);
    at::Tensor g;
    if (!in.weights.defined()) {
        g = (dl / (double)T).expand({T}).contiguous();
    } else {
        const at::Tensor W = in.weights.sum();
        g = at::where(W.ne(0), in.weights * (dl / W), at::zeros({}, f32)).contiguous();
    }
    if (p.per_row) {
        be.per_row_bwd(p, loss, g.data_ptr<float>(), dq.data_ptr(), dp.data_ptr(), dn.data_ptr());
        return {dq, dp, dn};
    }
    at::Tensor stats = at::empty({3, T}, f32), rn = at::empty({R}, f32);
    float *rq = stats[0].data_ptr<float>(), *rp = stats[1].data_ptr<float>(), *pos = stats[2].data_ptr<float>();
    be.row_stats(p, rq, rp, pos);
    // c bounds |E| = s |g_t| softmax rq_t rn_r, so E / c is at most 1: 16-bit GEMM operands keep it
    // in range however small the per-row gradients are
    at::Tensor c = at::ones({}, f32);
    if (R > 0) {
        be.neg_norms(p, rn.data_ptr<float>());
        const at::Tensor m = (g.abs() * stats[0]).max() * rn.max() * (double)p.scale;
        c = at::where(m.gt(0) & m.isfinite(), m, c).contiguous();
    }
    const float *cp = c.data_ptr<float>();
    if (R == 0) {
        be.rows_bwd(p, nullptr, 0, T, rq, rp, pos, loss, g.data_ptr<float>(), cp, dq.data_ptr(), dp.data_ptr());
        return {dq, dp, dn};
    }
    const bool f32_gemm = !be.low_precision_gemm && p.dtype != TF_F32;
    const bool e_f32 = f32_gemm || p.dtype == TF_F32;
    const at::Tensor ng = f32_gemm ? in.neg.to(at::kFloat) : in.neg;
    const int64_t tc = chunk_of(T, R, chunk_rows);
    at::Tensor S = at::empty({tc, R}, f32);
    at::Tensor E = e_f32 ? S : at::empty({tc, R}, in.q.options());  // dlogits / c, the GEMMs' operand
    at::Tensor Ac = at::empty({tc, D}, f32), Bc = at::empty({R, D}, f32), Bt;
    if (!e_f32) Bt = at::empty({R, D}, f32);
    for (int64_t t0 = 0; t0 < T; t0 += tc) {
        const int64_t n = std::min(tc, T - t0);
        at::Tensor qc = in.q.narrow(0, t0, n);
        if (f32_gemm) qc = qc.to(at::kFloat);
        at::Tensor Sv = S.narrow(0, 0, n), Ev = E.narrow(0, 0, n), Av = Ac.narrow(0, 0, n);
        gemm_f32(Sv, qc, ng.t());
        be.block_dlogits(p, Sv.data_ptr<float>(), Ev.data_ptr(), e_f32 ? TF_F32 : p.dtype, t0, n, rq,
                         rn.data_ptr<float>(), pos, loss, g.data_ptr<float>(), cp);
        gemm_f32(Av, Ev, ng);
        if (t0 == 0) {
            gemm_f32(Bc, Ev.t(), qc);
        } else if (e_f32) {
            Bc.addmm_(Ev.t(), qc);
        } else {
            gemm_f32(Bt, Ev.t(), qc);
            Bc.add_(Bt);
        }
        be.rows_bwd(p, Av.data_ptr<float>(), t0, n, rq, rp, pos, loss, g.data_ptr<float>(), cp, dq.data_ptr(),
                    dp.data_ptr());
    }
    be.neg_bwd(p, Bc.data_ptr<float>(), rn.data_ptr<float>(), cp, dn.data_ptr());
    return {dq, dp, dn};
}

namespace {

// ---- CPU backend: the C kernels over threads ----
constexpr int64_t kGrain = 16;

void cpu_row_stats(const tf_ssm_params &p, float *rq, float *rp, float *pos) {
    at::parallel_for(0, p.T, kGrain, [&](int64_t b, int64_t e) { tf_ssm_row_stats_cpu(&p, rq, rp, pos, b, e); });
}
void cpu_neg_norms(const tf_ssm_params &p, float *rn) {
    at::parallel_for(0, p.R, kGrain, [&](int64_t b, int64_t e) { tf_ssm_neg_norms_cpu(&p, rn, b, e); });
}
void cpu_block_lse(const tf_ssm_params &p, float *S, int64_t t0, int64_t rows, const float *rq, const float *rn,
                   const float *pos, float *loss) {
    at::parallel_for(0, rows, 1,
                     [&](int64_t b, int64_t e) { tf_ssm_block_lse_cpu(&p, S, t0, rq, rn, pos, loss, b, e); });
}
void cpu_block_dlogits(const tf_ssm_params &p, const float *S, void *E, int e_dtype, int64_t t0, int64_t rows,
                       const float *rq, const float *rn, const float *pos, const float *loss, const float *g,
                       const float *c) {
    at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
        tf_ssm_block_dlogits_cpu(&p, S, E, e_dtype, t0, rq, rn, pos, loss, g, c, b, e);
    });
}
void cpu_rows_bwd(const tf_ssm_params &p, const float *Ac, int64_t t0, int64_t rows, const float *rq, const float *rp,
                  const float *pos, const float *loss, const float *g, const float *c, void *dq, void *dp) {
    at::parallel_for(0, rows, kGrain, [&](int64_t b, int64_t e) {
        tf_ssm_rows_bwd_cpu(&p, Ac, t0, rq, rp, pos, loss, g, c, dq, dp, b, e);
    });
}
void cpu_neg_bwd(const tf_ssm_params &p, const float *Bc, const float *rn, const float *c, void *dn) {
    at::parallel_for(0, p.R, kGrain, [&](int64_t b, int64_t e) { tf_ssm_neg_bwd_cpu(&p, Bc, rn, c, dn, b, e); });
}
void cpu_per_row_fwd(const tf_ssm_params &p, float *loss) {
    at::parallel_for(0, p.T, 1, [&](int64_t b, int64_t e) { tf_ssm_per_row_fwd_cpu(&p, loss, b, e); });
}
void cpu_per_row_bwd(const tf_ssm_params &p, const float *loss, const float *g, void *dq, void *dp, void *dn) {
    at::parallel_for(0, p.T, 1, [&](int64_t b, int64_t e) { tf_ssm_per_row_bwd_cpu(&p, loss, g, dq, dp, dn, b, e); });
}

const SsmBackend kCpu = {cpu_row_stats,   cpu_neg_norms, cpu_block_lse,   cpu_block_dlogits, cpu_rows_bwd,
                         cpu_neg_bwd,     cpu_per_row_fwd, cpu_per_row_bwd, /*low_precision_gemm=*/false};

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) { register_ssm<&kCpu, SsmNoGuard>(m); }

}  // namespace torchfuse

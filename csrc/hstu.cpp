// HSTU attention: argument checks, parameter setup, and the CPU implementation.
#include "hstu.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "tf_check.h"
#include "tf_philox_glue.h"

namespace torchfuse {
namespace {

int hstu_dtype(at::ScalarType t, const char *op, const char *arg, bool cuda) {
    if (t == at::kDouble && !cuda) return TF_HSTU_F64;
    TORCH_CHECK_TYPE(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble, op, ": ", arg,
                     " must be bfloat16, float16, float32 (or float64 on the CPU), got ", t);
    TORCH_CHECK_TYPE(t != at::kDouble, op, ": ", arg, " is float64, which only the CPU path supports");
    return kernel_dtype(t, op, arg);
}

bool head_dim_ok(int64_t d) { return d >= 1 && d <= 256; }

// A (rows, H, D) tensor with unit last stride (and, for CUDA, 16-byte aligned rows and heads).
at::Tensor rows_heads(const at::Tensor &t, bool cuda) {
    const int64_t esz = t.element_size();
    bool ok = t.stride(2) == 1 || t.size(2) == 1;
    if (cuda)
        ok = ok && (t.stride(0) * esz) % 16 == 0 && (t.stride(1) * esz) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    return ok ? t : t.contiguous();
}

int64_t lens_ok_index_dtype(const at::Tensor &t, const char *op, const char *arg) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", arg,
                     " must be int32 or int64, got ", t.scalar_type());
    return t.scalar_type() == at::kLong;
}

}  // namespace

namespace {

int backend_code(const std::string &name, const char *op, const char *what) {
    if (name == "auto") return TF_HSTU_AUTO;
    if (name == "sm90") return TF_HSTU_SM90;
    if (name == "mma") return TF_HSTU_MMA;
    TORCH_CHECK_VALUE(false, op, ": ", what, " must be \"auto\", \"sm90\" or \"mma\", got \"", name, "\"");
}

}  // namespace

int hstu_backend(const std::optional<c10::string_view> &backend, const char *op) {
    if (backend.has_value()) return backend_code(std::string(backend->data(), backend->size()), op, "backend");
    // the process default, read once: later changes of the environment do not switch kernels mid-run
    static const int process_default = [op] {
        const char *env = std::getenv("TORCHFUSE_HSTU_BACKEND");
        return env && env[0] ? backend_code(env, op, "TORCHFUSE_HSTU_BACKEND") : (int)TF_HSTU_AUTO;
    }();
    return process_default;
}

Hstu prepare_hstu(const char *op, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                  const at::Tensor &seq_offsets, const std::optional<at::Tensor> &num_targets,
                  const std::optional<at::Tensor> &attn_bias, const HstuOpts &o, bool cuda) {
    Hstu g{};
    tf_hstu_params &p = g.p;
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
                ": q, k and v must be 3-D (rows, heads, head_dim), got shapes ", q.sizes(), ", ", k.sizes(), ", ",
                v.sizes());
    check_same_device(k, q, op, "k", "q");
    check_same_device(v, q, op, "v", "q");
    check_same_device(seq_offsets, q, op, "seq_offsets", "q");
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                ": q, k and v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
                v.scalar_type());
    p.dtype = hstu_dtype(q.scalar_type(), op, "q", cuda);
    p.H = q.size(1);
    p.dqk = q.size(2);
    p.dv = v.size(2);
    p.L = k.size(0);
    TORCH_CHECK(p.H >= 1 && k.size(1) == p.H && v.size(1) == p.H, op,
                ": q, k and v must have the same number of heads (>= 1), got ", q.size(1), ", ", k.size(1), ", ",
                v.size(1));
    TORCH_CHECK(k.size(2) == p.dqk, op, ": k's head dim must equal q's (", p.dqk, "), got ", k.size(2));
    TORCH_CHECK(head_dim_ok(p.dqk) && head_dim_ok(p.dv), op,
                ": head dims must lie in [1, 256], got Dqk=", p.dqk, " Dv=", p.dv);
    TORCH_CHECK(v.size(0) == p.L, op, ": k and v must have the same number of rows, got ", p.L, " and ", v.size(0));
    TORCH_CHECK(seq_offsets.dim() == 1 && seq_offsets.size(0) >= 1, op,
                ": seq_offsets must be 1-D with B + 1 entries, got shape ", seq_offsets.sizes());
    p.offsets_i64 = (int)lens_ok_index_dtype(seq_offsets, op, "seq_offsets");
    p.B = seq_offsets.size(0) - 1;
    p.delta = o.delta;
    TORCH_CHECK(o.delta >= 0, op, ": the number of cached query rows must be >= 0");
    if (o.delta > 0) {
        TORCH_CHECK(q.size(0) == p.B * o.delta, op, ": delta_q must have B * D = ", p.B, " * ", o.delta,
                    " rows, got ", q.size(0));
    } else {
        TORCH_CHECK(q.size(0) == p.L, op, ": q, k and v must have the same number of rows, got ", q.size(0),
                    " and ", p.L);
    }
    TORCH_CHECK(o.max_seq_len >= 0, op, ": max_seq_len must be >= 0, got ", o.max_seq_len);
    TORCH_CHECK(std::isfinite(o.alpha), op, ": alpha must be finite, got ", o.alpha);
    TORCH_CHECK(o.contextual_seq_len >= 0 && o.max_attn_len >= 0 && o.min_full_attn_seq_len >= 0, op,
                ": contextual_seq_len, max_attn_len and min_full_attn_seq_len must be >= 0");
    TORCH_CHECK(o.target_group_size >= 1, op, ": target_group_size must be >= 1, got ", o.target_group_size);
    const int64_t S = o.scaling_seqlen.has_value() ? *o.scaling_seqlen : o.max_seq_len;
    TORCH_CHECK(!o.scaling_seqlen.has_value() || S > 0, op, ": scaling_seqlen must be > 0, got ", S);
    TORCH_CHECK(o.max_seq_len < (int64_t(1) << 30), op, ": max_seq_len too large");
    p.max_seq_len = o.max_seq_len;
    p.alpha = o.alpha;
    p.inv_scale = S > 0 ? 1.0 / (double)S : 0.0;
    p.contextual = (int)o.contextual_seq_len;
    p.max_attn_len = (int)o.max_attn_len;
    p.min_full = (int)o.min_full_attn_seq_len;
    p.group = (int)o.target_group_size;

    g.q = rows_heads(q, cuda);
    g.k = rows_heads(k, cuda);
    g.v = rows_heads(v, cuda);
    p.q = g.q.data_ptr(); p.q_sr = g.q.stride(0); p.q_sh = g.q.stride(1);
    p.k = g.k.data_ptr(); p.k_sr = g.k.stride(0); p.k_sh = g.k.stride(1);
    p.v = g.v.data_ptr(); p.v_sr = g.v.stride(0); p.v_sh = g.v.stride(1);
    g.offsets = seq_offsets.contiguous();
    p.offsets = g.offsets.data_ptr();

    if (num_targets.has_value()) {
        const at::Tensor &t = *num_targets;
        check_same_device(t, q, op, "num_targets", "q");
        TORCH_CHECK(t.dim() == 1 && t.size(0) == p.B, op, ": num_targets must be 1-D with B = ", p.B,
                    " entries, got shape ", t.sizes());
        p.targets_i64 = (int)lens_ok_index_dtype(t, op, "num_targets");
        g.targets = t.contiguous();
        p.num_targets = g.targets.data_ptr();
    }
    if (o.kv_lengths) {
        const at::Tensor &kl = *o.kv_lengths;
        check_same_device(kl, q, op, "kv_lengths", "q");
        TORCH_CHECK(o.delta > 0, op, ": kv_lengths is for cached inference (delta > 0)");
        TORCH_CHECK(kl.dim() == 1 && kl.size(0) == p.B, op, ": kv_lengths must be 1-D with B = ", p.B,
                    " entries, got shape ", kl.sizes());
        p.kv_lengths_i64 = (int)lens_ok_index_dtype(kl, op, "kv_lengths");
        g.kv_lengths = kl.contiguous();
        p.kv_lengths = g.kv_lengths.data_ptr();
    }
    if (attn_bias.has_value()) {
        const at::Tensor &b = *attn_bias;
        check_same_device(b, q, op, "attn_bias", "q");
        TORCH_CHECK(b.dim() == 4 && b.size(0) == p.B && (b.size(1) == 1 || b.size(1) == p.H) &&
                        b.size(2) == o.max_seq_len && b.size(3) == o.max_seq_len,
                    op, ": attn_bias must have shape (B, 1 or H, max_seq_len, max_seq_len) = (", p.B, ", 1 or ", p.H,
                    ", ", o.max_seq_len, ", ", o.max_seq_len, "), got ", b.sizes());
        p.bias_dtype = hstu_dtype(b.scalar_type(), op, "attn_bias", cuda);
        g.bias = b.contiguous();
        p.bias = g.bias.data_ptr();
        p.bias_sr = o.max_seq_len;
        p.bias_sh = b.size(1) == 1 ? 0 : o.max_seq_len * o.max_seq_len;
        p.bias_sb = b.size(1) * o.max_seq_len * o.max_seq_len;
    }

    // Offsets, lengths and targets checked on the host (one small copy; a sync on a GPU).
    g.covered = false;  // unknown without validation: outputs start zeroed
    if (!o.validate) {
    } else if (p.B > 0) {
        const at::Tensor off = g.offsets.to(at::kLong);
        const at::Tensor spans = off.slice(0, 1) - off.slice(0, 0, p.B);
        // with kv_lengths a sequence is the first kv_lengths[b] rows of its span
        const at::Tensor lens = p.kv_lengths ? g.kv_lengths.to(at::kLong) : spans;
        std::vector<at::Tensor> parts = {spans.min().view(1), lens.max().view(1), off.slice(0, 0, 1),
                                         off.slice(0, p.B, p.B + 1)};
        if (p.num_targets) {
            const at::Tensor t = g.targets.to(at::kLong);
            parts.push_back(t.min().view(1));
            parts.push_back((lens - t).min().view(1));
        }
        if (p.kv_lengths) {
            parts.push_back(lens.min().view(1));
            parts.push_back((spans - lens).min().view(1));
        }
        const at::Tensor st = at::cat(parts).cpu();
        const int64_t *s = st.data_ptr<int64_t>();
        TORCH_CHECK(s[0] >= 0, op, ": seq_offsets must be non-decreasing");
        if (p.kv_lengths) {
            const int64_t *kl = s + (p.num_targets ? 6 : 4);
            TORCH_CHECK(kl[0] >= 0 && kl[1] >= 0, op, ": kv_lengths must lie in [0, seq_offsets[b + 1] - "
                        "seq_offsets[b]]");
        }
        TORCH_CHECK(s[2] >= 0 && s[3] <= p.L, op, ": seq_offsets must lie in [0, ", p.L, "] (the rows of k), got ",
                    s[2], " .. ", s[3]);
        TORCH_CHECK(s[1] <= o.max_seq_len, op, ": max_seq_len (", o.max_seq_len,
                    ") is smaller than the longest sequence (", s[1], ")");
        if (p.num_targets) {
            TORCH_CHECK(s[4] >= 0 && s[5] >= 0, op, ": num_targets must lie in [0, sequence length]");
        }
        g.covered = s[2] == 0 && s[3] == p.L;
    } else {
        g.covered = p.L == 0;
    }
    const int64_t qrows = o.delta > 0 ? p.B * o.delta : p.L;
    const at::TensorOptions opt = q.options().memory_format(at::MemoryFormat::Contiguous);
    // On CUDA the rows no sequence covers are zeroed by the caller (zero_uncovered_rows): a full memset
    // of an unvalidated call's outputs cost 5-9% of the forward at 128 x 1024
    g.o = g.covered || o.delta > 0 || cuda ? at::empty({qrows, p.H, p.dv}, opt) : at::zeros({qrows, p.H, p.dv}, opt);
    p.o = g.o.data_ptr();
    return g;
}

void prepare_hstu_dropout(Hstu &g, const char *op, double dropout_p, const std::optional<at::Tensor> &rng_state,
                          bool cuda) {
    TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout_p must lie in [0, 1), got ", dropout_p);
    if (dropout_p == 0.0) return;
    TORCH_CHECK_VALUE(g.p.delta == 0, op, ": the cached-inference form has no dropout (dropout_p must be 0)");
    TORCH_CHECK_VALUE(rng_state.has_value(), op, ": dropout_p > 0 needs rng_state (hstu_dropout_state)");
    const at::Tensor &r = *rng_state;
    check_same_device(r, g.q, op, "rng_state", "q");
    TORCH_CHECK(r.scalar_type() == at::kLong && r.dim() == 1 && r.size(0) == 2, op,
                ": rng_state must be int64 of shape (2,) (seed, offset), got ", r.scalar_type(), " of shape ",
                r.sizes());
    g.rng = r.contiguous();
    g.p.dropout_p = dropout_p;
    const int64_t *st = g.rng.data_ptr<int64_t>();
    if (cuda) {
        g.p.philox.seed_ptr = st;
        g.p.philox.offset_ptr = st + 1;
    } else {
        g.p.philox.seed = (uint64_t)st[0];
        g.p.philox.offset = (uint64_t)st[1];
    }
}

void prepare_hstu_bwd(Hstu &g, const at::Tensor &dout, bool bias_grad, bool cuda, const HstuGradOuts *outs) {
    tf_hstu_params &p = g.p;
    const char *op = "torchfuse.hstu_bwd";
    TORCH_CHECK(p.delta == 0, op, ": the cached-inference form has no backward");
    TORCH_CHECK(dout.dim() == 3 && dout.size(0) == p.L && dout.size(1) == p.H && dout.size(2) == p.dv, op,
                ": dout must have the output's shape (", p.L, ", ", p.H, ", ", p.dv, "), got ", dout.sizes());
    check_same_device(dout, g.q, op, "dout", "q");
    g.dout = rows_heads(dout.scalar_type() == g.q.scalar_type() ? dout : dout.to(g.q.scalar_type()), cuda);
    p.dout = g.dout.data_ptr(); p.do_sr = g.dout.stride(0); p.do_sh = g.dout.stride(1);
    const at::TensorOptions opt = g.q.options().memory_format(at::MemoryFormat::Contiguous);
    auto out = [&](int64_t d) { return g.covered || cuda ? at::empty({p.L, p.H, d}, opt) : at::zeros({p.L, p.H, d}, opt); };
    // the caller's: on the CPU zeroed whole where the sequences leave rows the kernels do not write (on
    // CUDA the glue zeroes just those rows, as it does for its own outputs)
    auto given = [&](const at::Tensor &t) { return g.covered || cuda ? t : t.zero_(); };
    g.dk = outs ? given(outs->dk) : out(p.dqk);
    g.dv = outs ? given(outs->dv) : out(p.dv);
    p.dk = g.dk.data_ptr();
    p.dvv = g.dv.data_ptr();
    p.dk_sr = g.dk.stride(0);
    p.dv_sr = g.dv.stride(0);
    if (cuda) {
        // dq's form depends on the kernels that will run: the CUDA glue sets it (hstu_cuda.cpp)
        p.dq_acc = nullptr;
        p.dq = nullptr;
        p.dq_sr = p.H * p.dqk;
    } else {
        g.dq = outs ? given(outs->dq) : out(p.dqk);
        p.dq = g.dq.data_ptr();
        p.dq_sr = g.dq.stride(0);
    }
    if (bias_grad) {
        TORCH_CHECK(g.bias.defined(), op, ": bias_grad needs attn_bias");
        g.dbias = at::zeros(g.bias.sizes(), g.bias.options().dtype(cuda ? at::kFloat : at::kDouble));
        p.dbias = g.dbias.data_ptr();
    }
}

void check_hstu_grad_outs(const char *op, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                          const at::Tensor &dout, const HstuGradOuts &outs) {
    if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3) return;  // prepare_hstu refuses them by name
    const at::Tensor *ins[3] = {&q, &k, &v}, *gs[3] = {&outs.dq, &outs.dk, &outs.dv};
    const char *in_names[3] = {"q", "k", "v"}, *names[3] = {"dq", "dk", "dv"};
    auto shares = [](const at::Tensor &a, const at::Tensor &b) {
        return a.numel() > 0 && b.numel() > 0 && a.storage().is_alias_of(b.storage());
    };
    for (int i = 0; i < 3; ++i) {
        const at::Tensor &t = *gs[i];
        TORCH_CHECK(t.sizes() == ins[i]->sizes(), op, ": ", names[i], " must have ", in_names[i], "'s shape ",
                    ins[i]->sizes(), ", got ", t.sizes());
        TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", names[i], " must have q's dtype ", q.scalar_type(),
                    ", got ", t.scalar_type());
        TORCH_CHECK(t.device() == q.device(), op, ": ", names[i], " must be on q's device ", q.device(), ", got ",
                    t.device());
        const bool rows_ok = t.numel() == 0 || (t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2)) &&
                                                (t.size(0) == 1 || t.stride(0) >= t.size(1) * t.size(2)));
        TORCH_CHECK(rows_ok, op, ": ", names[i], " must hold each row's heads contiguously (strides (>= H x d, d, 1)), got ",
                    t.strides());
        for (const at::Tensor *x : {&q, &k, &v, &dout})
            TORCH_CHECK(!shares(t, *x), op, ": ", names[i], " shares memory with an input");
    }
    // outputs in one buffer: disjoint column ranges of rows a common stride apart (or, single rows, disjoint
    // element ranges)
    for (int i = 0; i < 3; ++i)
        for (int j = i + 1; j < 3; ++j) {
            const at::Tensor &a = *gs[i], &b = *gs[j];
            if (!shares(a, b)) continue;
            const int64_t wa = a.size(1) * a.size(2), wb = b.size(1) * b.size(2);
            int64_t oa = a.storage_offset(), ob = b.storage_offset();
            bool ok;
            if (a.size(0) == 1 && b.size(0) == 1) {
                ok = oa + wa <= ob || ob + wb <= oa;
            } else {
                const int64_t sr = a.stride(0);
                ok = b.stride(0) == sr && sr > 0;
                if (ok) {
                    oa %= sr;
                    ob %= sr;
                    ok = oa + wa <= sr && ob + wb <= sr && (oa + wa <= ob || ob + wb <= oa);
                }
            }
            TORCH_CHECK(ok, op, ": ", names[i], " and ", names[j], " overlap (outputs that share memory must be "
                        "disjoint columns of rows one stride apart)");
        }
}

namespace {

HstuOpts opts(int64_t max_seq_len, double alpha, std::optional<int64_t> scaling_seqlen, int64_t c, int64_t m,
              int64_t f, int64_t g, int64_t delta, bool validate) {
    return HstuOpts{max_seq_len, alpha, scaling_seqlen, c, m, f, g, delta, validate};
}

at::Tensor hstu_fwd_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &seq_offsets,
                        const std::optional<at::Tensor> &num_targets, const std::optional<at::Tensor> &attn_bias,
                        int64_t max_seq_len, double alpha, std::optional<int64_t> scaling_seqlen,
                        int64_t contextual_seq_len, int64_t max_attn_len, int64_t min_full_attn_seq_len,
                        int64_t target_group_size, int64_t delta, bool validate,
                        std::optional<c10::string_view> backend, double dropout_p,
                        const std::optional<at::Tensor> &rng_state, const std::optional<at::Tensor> &kv_lengths) {
    hstu_backend(backend, "torchfuse.hstu_attention");  // checked; the CPU has one path
    HstuOpts o = opts(max_seq_len, alpha, scaling_seqlen, contextual_seq_len, max_attn_len, min_full_attn_seq_len,
                      target_group_size, delta, /*validate=*/true);  // on the CPU checking costs nothing: always
    o.kv_lengths = kv_lengths.has_value() ? &*kv_lengths : nullptr;
    Hstu g = prepare_hstu("torchfuse.hstu_attention", q, k, v, seq_offsets, num_targets, attn_bias, o, false);
    prepare_hstu_dropout(g, "torchfuse.hstu_attention", dropout_p, rng_state, false);
    const tf_hstu_params p = g.p;
    at::parallel_for(0, p.B, 1, [&](int64_t b0, int64_t b1) { tf_hstu_fwd_cpu(&p, b0, b1); });
    return g.o;
}

HstuBwdResult hstu_bwd_cpu(const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                           const at::Tensor &seq_offsets, const std::optional<at::Tensor> &num_targets,
                           const std::optional<at::Tensor> &attn_bias, int64_t max_seq_len, double alpha,
                           std::optional<int64_t> scaling_seqlen, int64_t contextual_seq_len, int64_t max_attn_len,
                           int64_t min_full_attn_seq_len, int64_t target_group_size, bool bias_grad,
                           std::optional<c10::string_view> backend, double dropout_p,
                           const std::optional<at::Tensor> &rng_state) {
    hstu_backend(backend, "torchfuse.hstu_bwd");
    Hstu g = prepare_hstu("torchfuse.hstu_bwd", q, k, v, seq_offsets, num_targets, attn_bias,
                          opts(max_seq_len, alpha, scaling_seqlen, contextual_seq_len, max_attn_len,
                               min_full_attn_seq_len, target_group_size, 0, true),
                          false);
    prepare_hstu_dropout(g, "torchfuse.hstu_bwd", dropout_p, rng_state, false);
    prepare_hstu_bwd(g, dout, bias_grad, false);
    const tf_hstu_params p = g.p;
    at::parallel_for(0, p.B, 1, [&](int64_t b0, int64_t b1) { tf_hstu_bwd_cpu(&p, b0, b1); });
    at::Tensor db = g.dbias.defined() ? g.dbias.to(g.bias.scalar_type()) : no_output(g.o);
    return {g.dq, g.dk, g.dv, db};
}

void hstu_bwd_into_cpu(const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                       const at::Tensor &seq_offsets, const std::optional<at::Tensor> &num_targets,
                       const std::optional<at::Tensor> &attn_bias, int64_t max_seq_len, double alpha,
                       std::optional<int64_t> scaling_seqlen, int64_t contextual_seq_len, int64_t max_attn_len,
                       int64_t min_full_attn_seq_len, int64_t target_group_size, at::Tensor dq, at::Tensor dk,
                       at::Tensor dv, std::optional<c10::string_view> backend, double dropout_p,
                       const std::optional<at::Tensor> &rng_state) {
    const char *op = "torchfuse.hstu_bwd_into";
    const HstuGradOuts outs{dq, dk, dv};
    check_hstu_grad_outs(op, q, k, v, dout, outs);
    hstu_backend(backend, op);
    Hstu g = prepare_hstu(op, q, k, v, seq_offsets, num_targets, attn_bias,
                          opts(max_seq_len, alpha, scaling_seqlen, contextual_seq_len, max_attn_len,
                               min_full_attn_seq_len, target_group_size, 0, true),
                          false);
    prepare_hstu_dropout(g, op, dropout_p, rng_state, false);
    prepare_hstu_bwd(g, dout, false, false, &outs);
    const tf_hstu_params p = g.p;
    at::parallel_for(0, p.B, 1, [&](int64_t b0, int64_t b1) { tf_hstu_bwd_cpu(&p, b0, b1); });
}

at::Tensor hstu_dropout_state_cpu(const at::Tensor &like, std::optional<int64_t> seed) {
    const tf_philox_args a = philox_args_cpu(seed);
    at::Tensor r = at::empty({2}, at::TensorOptions().dtype(at::kLong));
    r.data_ptr<int64_t>()[0] = (int64_t)a.seed;
    r.data_ptr<int64_t>()[1] = (int64_t)a.offset;
    return r;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
    m.impl("hstu_fwd", &hstu_fwd_cpu);
    m.impl("hstu_bwd", &hstu_bwd_cpu);
    m.impl("hstu_bwd_into", &hstu_bwd_into_cpu);
    m.impl("hstu_dropout_state", &hstu_dropout_state_cpu);
}

}  // namespace torchfuse

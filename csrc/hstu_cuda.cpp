// HSTU attention: the CUDA implementation (checks and setup live in hstu.cpp).
#include <initializer_list>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "hstu.h"
#include "hstu_decode_counters_cuda.h"
#include "tf_check.h"
#include "tf_philox_glue_cuda.h"

namespace torchfuse {
namespace {

// Head dims the 16-bit kernels take: multiples of 8, rows of 16-byte multiples that cp.async and the copy
// engine address; the kernels zero-fill their tiles past the real dim (as 96 and 192 always ran in the
// 128 / 256 tiles). Any other head dim runs on a copy zero-padded to the next multiple of 8, exact: zero
// columns of q and k add nothing to q k^T, zero columns of v give zero output columns (sliced off), and
// alpha and the scaling take no part in the padding. fp32 runs every dim directly.
int64_t kernel_head_dim(int64_t d) { return (d + 7) / 8 * 8; }

struct HeadPad {
    bool on;
    int64_t dqk, dv, pqk, pv;  // the real dims and the kernels'
};

// Inputs the op will accept except for their head dims (16-bit, on q's device); anything else goes to the
// checks unpadded, which refuse it by name.
HeadPad head_pad(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v) {
    HeadPad h{};
    if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3) return h;
    const at::ScalarType t = q.scalar_type();
    if ((t != at::kHalf && t != at::kBFloat16) || k.scalar_type() != t || v.scalar_type() != t) return h;
    if (!q.is_cuda() || k.device() != q.device() || v.device() != q.device()) return h;
    h.dqk = q.size(2);
    h.dv = v.size(2);
    if (k.size(2) != h.dqk || h.dqk < 1 || h.dqk > 256 || h.dv < 1 || h.dv > 256) return h;
    h.pqk = kernel_head_dim(h.dqk);
    h.pv = kernel_head_dim(h.dv);
    h.on = h.pqk != h.dqk || h.pv != h.dv;
    return h;
}

void check_launch(int err, const char *what) {
    TORCH_CHECK(err == 0, "torchfuse: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// Each (L, H, d) tensor ts[i] as a contiguous (L, H, dims[i]) tensor of dtype `out`, zero-padded past d
// or cut to dims[i], all in one launch (kernels/hstu_head_dims.cu); one already of that width and dtype
// is passed on as it is.
std::vector<at::Tensor> head_copies(std::initializer_list<at::Tensor> ts, std::initializer_list<int64_t> dims,
                                    at::ScalarType out) {
    TORCH_INTERNAL_ASSERT(ts.size() == dims.size() && ts.size() <= TF_HSTU_HEAD_PLANES);
    tf_hstu_head_copy_params p{};
    std::vector<at::Tensor> res, srcs;
    auto d = dims.begin();
    for (const at::Tensor &t : ts) {
        const int64_t width = *d++;
        if (t.size(2) == width && t.scalar_type() == out) {
            res.push_back(t);
            continue;
        }
        const at::Tensor s = t.stride(2) == 1 ? t : t.contiguous();  // rows and heads may be strided
        res.push_back(at::empty({t.size(0), t.size(1), width}, t.options().dtype(out)));
        p.planes[p.n++] = tf_hstu_head_plane{s.data_ptr(), res.back().data_ptr(), s.size(0), s.size(1), s.stride(0),
                                             s.stride(1), 0, 0, (int)s.size(2), (int)width,
                                             kernel_dtype(s.scalar_type(), "torchfuse.hstu_attention", "q/k/v"),
                                             kernel_dtype(out, "torchfuse.hstu_attention", "q/k/v")};
        srcs.push_back(s);
    }
    if (p.n > 0)
        check_launch(tf_hstu_head_copy_cuda(&p, c10::cuda::getCurrentCUDAStream().stream()), "HSTU head-dim copy");
    return res;
}

void check_kernel_dims(const tf_hstu_params &p) {
    TORCH_INTERNAL_ASSERT(p.dtype == TF_F32 || (kernel_head_dim(p.dqk) == p.dqk && kernel_head_dim(p.dv) == p.dv),
                          "torchfuse: HSTU head dims ", p.dqk, ", ", p.dv, " reached the 16-bit kernels unpadded");
}

// Outputs are allocated uninitialised on CUDA (prepare_hstu), and hstu_bwd_into's are the caller's: the
// kernels write every row inside the sequences, and the rows outside them are zeroed here, when the
// offsets may not cover all L rows. Rows may be strided (each row's elements contiguous).
void zero_uncovered_rows(const Hstu &g, std::initializer_list<at::Tensor> outs) {
    if (g.covered || g.p.delta > 0 || g.p.L == 0) return;
    void *rows[3];
    int64_t bytes[3], stride[3];
    int n = 0;
    for (const at::Tensor &t : outs) {
        rows[n] = t.data_ptr();
        bytes[n] = t.numel() / g.p.L * (int64_t)t.element_size();
        stride[n] = g.p.L > 1 ? t.stride(0) * (int64_t)t.element_size() : bytes[n];
        ++n;
    }
    check_launch(tf_hstu_zero_outside(rows, bytes, stride, n, g.p.L, g.p.offsets, g.p.offsets_i64, g.p.B,
                                      c10::cuda::getCurrentCUDAStream().stream()),
                 "HSTU zeroing of uncovered rows");
}

at::Tensor hstu_fwd_cuda(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &seq_offsets,
                         const std::optional<at::Tensor> &num_targets, const std::optional<at::Tensor> &attn_bias,
                         int64_t max_seq_len, double alpha, std::optional<int64_t> scaling_seqlen,
                         int64_t contextual_seq_len, int64_t max_attn_len, int64_t min_full_attn_seq_len,
                         int64_t target_group_size, int64_t delta, bool validate,
                         std::optional<c10::string_view> backend, double dropout_p,
                         const std::optional<at::Tensor> &rng_state, const std::optional<at::Tensor> &kv_lengths) {
    const int kernels = hstu_backend(backend, "torchfuse.hstu_attention");
    // the decode kernels read any head dim as it is: no padded copy of a whole K/V cache per call
    const bool decode = tf_hstu_decode_applies(delta, attn_bias.has_value(), dropout_p, kernels);
    if (const HeadPad hp = head_pad(q, k, v); hp.on && !decode) {
        const c10::cuda::CUDAGuard guard(q.device());
        const auto padded = head_copies({q, k, v}, {hp.pqk, hp.pqk, hp.pv}, q.scalar_type());
        const at::Tensor o = hstu_fwd_cuda(padded[0], padded[1], padded[2], seq_offsets, num_targets, attn_bias,
                                           max_seq_len, alpha, scaling_seqlen, contextual_seq_len, max_attn_len,
                                           min_full_attn_seq_len, target_group_size, delta, validate, backend,
                                           dropout_p, rng_state, kv_lengths);
        return head_copies({o}, {hp.dv}, o.scalar_type())[0];
    }
    const c10::cuda::CUDAGuard guard(q.device());
    Hstu g = prepare_hstu("torchfuse.hstu_attention", q, k, v, seq_offsets, num_targets, attn_bias,
                          HstuOpts{max_seq_len, alpha, scaling_seqlen, contextual_seq_len, max_attn_len,
                                   min_full_attn_seq_len, target_group_size, delta, validate,
                                   kv_lengths.has_value() ? &*kv_lengths : nullptr},
                          true);
    prepare_hstu_dropout(g, "torchfuse.hstu_attention", dropout_p, rng_state, true);
    g.p.backend = kernels;
    if (decode) {
        const int64_t ws_floats = tf_hstu_decode_ws_floats(&g.p);
        if (ws_floats == 0) return g.o.zero_();  // no sequence, head or position: every row is zero
        const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
        // the partials: fresh per call (each chunk's are written before they are read); the counters:
        // kept zero between calls on this stream (hstu_decode_counters_cuda.cpp)
        const at::Tensor ws = at::empty({ws_floats}, q.options().dtype(at::kFloat));
        g.p.decode_ws = ws.data_ptr<float>();
        g.p.decode_cnt = hstu_decode_counters(stream, g.p.B * g.p.H);
        check_launch(tf_hstu_fwd_cuda(&g.p, stream), "HSTU decode kernels");
        return g.o;
    }
    check_kernel_dims(g.p);
    // the sm_90a kernel's work counter (it zeroes it on the stream before its launch)
    const at::Tensor sched = at::empty({1}, q.options().dtype(at::kInt));
    g.p.sched = sched.data_ptr<int>();
    zero_uncovered_rows(g, {g.o});
    check_launch(tf_hstu_fwd_cuda(&g.p, c10::cuda::getCurrentCUDAStream().stream()), "HSTU forward kernel");
    return g.o;
}

// hstu_bwd's and hstu_bwd_into's arguments but for the gradients.
struct BwdArgs {
    const at::Tensor &dout, &q, &k, &v, &seq_offsets;
    const std::optional<at::Tensor> &num_targets, &attn_bias;
    int64_t max_seq_len;
    double alpha;
    std::optional<int64_t> scaling_seqlen;
    int64_t contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size;
    std::optional<c10::string_view> backend;
    double dropout_p;
    const std::optional<at::Tensor> &rng_state;
};

// The two-part backward's dZ tiles (head dims 65-256, sm_90a): 2 bytes per (query, key, head) of
// max_seq_len's square, in 64-row tiles, for as many sequences at a time as fit in this (the rest in later
// chunks).
constexpr int64_t kDzScratchBytes = int64_t(2) << 30;

// The backward of a (with dq as the kernels leave it: q's dtype, and then in the caller's outs->dq when
// given, or fp32; dbias in its own dtype), dk and dv written into the caller's `outs` when given.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hstu_bwd_kernels(const BwdArgs &a, bool bias_grad,
                                                                            const HstuGradOuts *outs = nullptr) {
    const char *op = outs ? "torchfuse.hstu_bwd_into" : "torchfuse.hstu_bwd";
    const c10::cuda::CUDAGuard guard(a.q.device());
    const int kernels = hstu_backend(a.backend, op);
    Hstu g = prepare_hstu(op, a.q, a.k, a.v, a.seq_offsets, a.num_targets, a.attn_bias,
                          HstuOpts{a.max_seq_len, a.alpha, a.scaling_seqlen, a.contextual_seq_len, a.max_attn_len,
                                   a.min_full_attn_seq_len, a.target_group_size, 0, false},
                          true);
    prepare_hstu_dropout(g, op, a.dropout_p, a.rng_state, true);
    prepare_hstu_bwd(g, a.dout, bias_grad, true, outs);
    g.p.backend = kernels;
    check_kernel_dims(g.p);
    // the persistent sm_90a backward's work counter, its own (zeroed by the launch on the stream)
    const at::Tensor sched = at::empty({1}, a.q.options().dtype(at::kInt));
    g.p.sched = sched.data_ptr<int>();
    // dQ: at head dims 65-256 on sm_90a the two-part backward writes it in q's dtype (into the caller's dq
    // when given), its dZ tiles in a scratch of at most kDzScratchBytes; elsewhere the kernels add into a
    // zeroed fp32 accumulator, converted by the callers
    int64_t dz_seqs = 0;
    const int64_t dz_bytes = tf_hstu_bwd_sm90_dz_bytes(&g.p, kDzScratchBytes, &dz_seqs);
    at::Tensor dz;
    if (dz_bytes > 0) {
        g.dq = outs ? outs->dq : at::empty({g.p.L, g.p.H, g.p.dqk}, g.q.options());
        g.p.dq = g.dq.data_ptr();
        g.p.dq_sr = g.dq.size(0) > 1 ? g.dq.stride(0) : g.p.H * g.p.dqk;
        dz = at::empty({dz_bytes}, g.q.options().dtype(at::kByte));
        g.p.dz = dz.data_ptr();
        g.p.dz_seqs = dz_seqs;
        zero_uncovered_rows(g, {g.dq, g.dk, g.dv});
    } else {
        g.dq = at::zeros({g.p.L, g.p.H, g.p.dqk}, g.q.options().dtype(at::kFloat));
        g.p.dq_acc = g.dq.data_ptr<float>();
        g.p.dq_sr = g.p.H * g.p.dqk;
        zero_uncovered_rows(g, {g.dk, g.dv});
    }
    check_launch(tf_hstu_bwd_cuda(&g.p, c10::cuda::getCurrentCUDAStream().stream()), "HSTU backward kernel");
    at::Tensor db = g.dbias.defined() ? g.dbias.to(g.bias.scalar_type()) : no_output(g.o);
    return {g.dq, g.dk, g.dv, db};
}

// The kernels' own contiguous gradients, cut back from padded head dims where the inputs needed them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hstu_bwd_any_dims(const BwdArgs &a, bool bias_grad) {
    if (const HeadPad hp = head_pad(a.q, a.k, a.v); hp.on && a.dout.dim() == 3 && a.dout.size(2) == hp.dv &&
                                                    a.dout.scalar_type() == a.q.scalar_type() &&
                                                    a.dout.device() == a.q.device()) {
        const c10::cuda::CUDAGuard guard(a.q.device());
        const auto in = head_copies({a.dout, a.q, a.k, a.v}, {hp.pv, hp.pqk, hp.pqk, hp.pv}, a.q.scalar_type());
        const BwdArgs padded{in[0], in[1], in[2], in[3], a.seq_offsets, a.num_targets, a.attn_bias, a.max_seq_len,
                             a.alpha, a.scaling_seqlen, a.contextual_seq_len, a.max_attn_len,
                             a.min_full_attn_seq_len, a.target_group_size, a.backend, a.dropout_p, a.rng_state};
        auto [dq, dk, dv, db] = hstu_bwd_kernels(padded, bias_grad);
        // cut back to the real dims, dq converted from fp32 in the same launch
        const auto out = head_copies({dq, dk, dv}, {hp.dqk, hp.dqk, hp.dv}, a.q.scalar_type());
        return {out[0], out[1], out[2], db};
    }
    auto [dq, dk, dv, db] = hstu_bwd_kernels(a, bias_grad);
    return {dq.to(a.q.scalar_type()), dk, dv, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hstu_bwd_cuda(
    const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const at::Tensor &seq_offsets, const std::optional<at::Tensor> &num_targets,
    const std::optional<at::Tensor> &attn_bias, int64_t max_seq_len, double alpha,
    std::optional<int64_t> scaling_seqlen, int64_t contextual_seq_len, int64_t max_attn_len,
    int64_t min_full_attn_seq_len, int64_t target_group_size, bool bias_grad,
    std::optional<c10::string_view> backend, double dropout_p, const std::optional<at::Tensor> &rng_state) {
    return hstu_bwd_any_dims(BwdArgs{dout, q, k, v, seq_offsets, num_targets, attn_bias, max_seq_len, alpha,
                                     scaling_seqlen, contextual_seq_len, max_attn_len, min_full_attn_seq_len,
                                     target_group_size, backend, dropout_p, rng_state},
                             bias_grad);
}

void hstu_bwd_into_cuda(const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                        const at::Tensor &seq_offsets, const std::optional<at::Tensor> &num_targets,
                        const std::optional<at::Tensor> &attn_bias, int64_t max_seq_len, double alpha,
                        std::optional<int64_t> scaling_seqlen, int64_t contextual_seq_len, int64_t max_attn_len,
                        int64_t min_full_attn_seq_len, int64_t target_group_size, at::Tensor dq, at::Tensor dk,
                        at::Tensor dv, std::optional<c10::string_view> backend, double dropout_p,
                        const std::optional<at::Tensor> &rng_state) {
    const HstuGradOuts outs{dq, dk, dv};
    check_hstu_grad_outs("torchfuse.hstu_bwd_into", q, k, v, dout, outs);
    const BwdArgs a{dout, q, k, v, seq_offsets, num_targets, attn_bias, max_seq_len, alpha, scaling_seqlen,
                    contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size, backend, dropout_p,
                    rng_state};
    // the 16-bit kernels store dK / dV two columns (4 bytes) at a time: rows 4-byte aligned
    auto direct = [&](const at::Tensor &t) {
        return q.scalar_type() == at::kFloat ||
               (reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0 && (t.size(0) <= 1 || t.stride(0) % 2 == 0));
    };
    if (head_pad(q, k, v).on || !direct(dk) || !direct(dv)) {  // the kernels' own outputs, copied
        auto [gq, gk, gv, db] = hstu_bwd_any_dims(a, false);
        dq.copy_(gq);
        dk.copy_(gk);
        dv.copy_(gv);
        return;
    }
    auto [acc, gk, gv, db] = hstu_bwd_kernels(a, false, &outs);
    if (acc.is_same(dq)) return;  // written in place
    if (acc.scalar_type() == dq.scalar_type()) {
        dq.copy_(acc);
        return;
    }
    // fp32 -> q's dtype into dq's rows, a 16-byte chunk a thread (ATen's copy into strided rows moves an
    // element per load)
    tf_hstu_head_copy_params p{};
    p.planes[p.n++] = tf_hstu_head_plane{acc.data_ptr(), dq.data_ptr(), acc.size(0), acc.size(1), acc.stride(0),
                                         acc.stride(1), dq.stride(0), dq.stride(1), (int)acc.size(2),
                                         (int)dq.size(2), TF_F32,
                                         kernel_dtype(dq.scalar_type(), "torchfuse.hstu_bwd_into", "dq")};
    check_launch(tf_hstu_head_copy_cuda(&p, c10::cuda::getCurrentCUDAStream().stream()), "HSTU dq conversion");
}

// Reserved from the CUDA generator as PyTorch's fused dropout does; under graph capture the values are
// read from the generator's device slots by the two small ops here, so each replay draws a fresh mask.
at::Tensor hstu_dropout_state_cuda(const at::Tensor &like, std::optional<int64_t> seed) {
    const c10::cuda::CUDAGuard guard(like.device());
    const at::TensorOptions opt = like.options().dtype(at::kLong);
    const tf_philox_args a = philox_args_cuda(seed);
    if (a.seed_ptr) {
        const at::Tensor s = at::from_blob(const_cast<int64_t *>(a.seed_ptr), {1}, opt);
        const at::Tensor o = at::from_blob(const_cast<int64_t *>(a.offset_ptr), {1}, opt);
        return at::cat({s, o + (int64_t)a.offset_intragraph});
    }
    at::Tensor r = at::full({2}, (int64_t)a.seed, opt);
    r.narrow(0, 1, 1).fill_((int64_t)a.offset);
    return r;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
    m.impl("hstu_fwd", &hstu_fwd_cuda);
    m.impl("hstu_bwd", &hstu_bwd_cuda);
    m.impl("hstu_bwd_into", &hstu_bwd_into_cuda);
    m.impl("hstu_dropout_state", &hstu_dropout_state_cuda);
}

}  // namespace torchfuse

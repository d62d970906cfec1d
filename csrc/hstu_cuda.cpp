// HSTU attention: the CUDA implementation (checks and setup live in hstu.cpp).
#include <initializer_list>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "hstu.h"
#include "tf_check.h"

namespace torchfuse {
namespace {

void check_launch(int err, const char *what) {
    TORCH_CHECK(err == 0, "torchfuse: ", what, " failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// Outputs are allocated uninitialised on CUDA (prepare_hstu): the kernels write every row inside the
// sequences, and the rows outside them are zeroed here, when the offsets may not cover all L rows.
void zero_uncovered_rows(const Hstu &g, std::initializer_list<at::Tensor> outs) {
    if (g.covered || g.p.delta > 0 || g.p.L == 0) return;
    void *rows[3];
    int64_t bytes[3];
    int n = 0;
    for (const at::Tensor &t : outs) {
        rows[n] = t.data_ptr();
        bytes[n] = t.numel() / g.p.L * (int64_t)t.element_size();
        ++n;
    }
    check_launch(tf_hstu_zero_outside(rows, bytes, n, g.p.L, g.p.offsets, g.p.offsets_i64, g.p.B,
                                      c10::cuda::getCurrentCUDAStream().stream()),
                 "HSTU zeroing of uncovered rows");
}

at::Tensor hstu_fwd_cuda(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &seq_offsets,
                         const std::optional<at::Tensor> &num_targets, const std::optional<at::Tensor> &attn_bias,
                         int64_t max_seq_len, double alpha, std::optional<int64_t> scaling_seqlen,
                         int64_t contextual_seq_len, int64_t max_attn_len, int64_t min_full_attn_seq_len,
                         int64_t target_group_size, int64_t delta, bool validate,
                         std::optional<c10::string_view> backend) {
    const c10::cuda::CUDAGuard guard(q.device());
    const int kernels = hstu_backend(backend, "torchfuse.hstu_attention");
    Hstu g = prepare_hstu("torchfuse.hstu_attention", q, k, v, seq_offsets, num_targets, attn_bias,
                          HstuOpts{max_seq_len, alpha, scaling_seqlen, contextual_seq_len, max_attn_len,
                                   min_full_attn_seq_len, target_group_size, delta, validate},
                          true);
    g.p.backend = kernels;
    // the sm_90a kernel's work counter (it zeroes it on the stream before its launch)
    const at::Tensor sched = at::empty({1}, q.options().dtype(at::kInt));
    g.p.sched = sched.data_ptr<int>();
    zero_uncovered_rows(g, {g.o});
    check_launch(tf_hstu_fwd_cuda(&g.p, c10::cuda::getCurrentCUDAStream().stream()), "HSTU forward kernel");
    return g.o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hstu_bwd_cuda(
    const at::Tensor &dout, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
    const at::Tensor &seq_offsets, const std::optional<at::Tensor> &num_targets,
    const std::optional<at::Tensor> &attn_bias, int64_t max_seq_len, double alpha,
    std::optional<int64_t> scaling_seqlen, int64_t contextual_seq_len, int64_t max_attn_len,
    int64_t min_full_attn_seq_len, int64_t target_group_size, bool bias_grad,
    std::optional<c10::string_view> backend) {
    const c10::cuda::CUDAGuard guard(q.device());
    const int kernels = hstu_backend(backend, "torchfuse.hstu_bwd");
    Hstu g = prepare_hstu("torchfuse.hstu_bwd", q, k, v, seq_offsets, num_targets, attn_bias,
                          HstuOpts{max_seq_len, alpha, scaling_seqlen, contextual_seq_len, max_attn_len,
                                   min_full_attn_seq_len, target_group_size, 0, false},
                          true);
    prepare_hstu_bwd(g, dout, bias_grad, true);
    g.p.backend = kernels;
    // the persistent sm_90a backward's work counter, its own (zeroed by the launch on the stream)
    const at::Tensor sched = at::empty({1}, q.options().dtype(at::kInt));
    g.p.sched = sched.data_ptr<int>();
    zero_uncovered_rows(g, {g.dk, g.dv});
    check_launch(tf_hstu_bwd_cuda(&g.p, c10::cuda::getCurrentCUDAStream().stream()), "HSTU backward kernel");
    at::Tensor dq = g.dq.to(g.q.scalar_type());
    at::Tensor db = g.dbias.defined() ? g.dbias.to(g.bias.scalar_type()) : no_output(g.o);
    return {dq, g.dk, g.dv, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
    m.impl("hstu_fwd", &hstu_fwd_cuda);
    m.impl("hstu_bwd", &hstu_bwd_cuda);
}

}  // namespace torchfuse

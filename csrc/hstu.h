// HSTU attention: argument checking and kernel-parameter setup shared by the CPU and CUDA
// implementations of torchfuse::hstu_fwd / torchfuse::hstu_bwd (schemas: registration.cpp).
#pragma once

#include <ATen/ATen.h>

#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

#include "../kernels/hstu_kernels.h"

namespace torchfuse {

using HstuBwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Checked inputs (kept alive while the kernels read them), outputs and kernel params.
struct Hstu {
    tf_hstu_params p;
    at::Tensor q, k, v, offsets, targets, bias, dout, rng, kv_lengths;  // possibly contiguous copies
    at::Tensor o, dq, dk, dv, dbias;                   // outputs (dbias: the accumulation buffer)
    bool covered;  // the sequences cover every row of k / v (else outputs start zeroed)
};

// The options shared by both ops. `cuda` tightens the layout rules (16-byte aligned rows).
struct HstuOpts {
    int64_t max_seq_len;
    double alpha;
    std::optional<int64_t> scaling_seqlen;
    int64_t contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size, delta;
    bool validate;  // check offsets, lengths and targets on the host (a sync on a GPU)
    const at::Tensor *kv_lengths = nullptr;  // cached inference: keys per sequence (hstu_kernels.h)
};

Hstu prepare_hstu(const char *op, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                  const at::Tensor &seq_offsets, const std::optional<at::Tensor> &num_targets,
                  const std::optional<at::Tensor> &attn_bias, const HstuOpts &o, bool cuda);

// The CUDA kernels to run (TF_HSTU_AUTO / SM90 / MMA) for the ops' `backend` argument: "auto", "sm90" or
// "mma"; None: the process default, TORCHFUSE_HSTU_BACKEND (read once; unset: auto). The CPU path checks
// the name only.
int hstu_backend(const std::optional<c10::string_view> &backend, const char *op);

// Dropout on top of prepare_hstu: checks dropout_p (in [0, 1)) and, when it is > 0, rng_state (int64 (2,):
// seed, offset, on q's device), read by the kernels (on CUDA from the device, so that CUDA graphs replay it).
void prepare_hstu_dropout(Hstu &g, const char *op, double dropout_p, const std::optional<at::Tensor> &rng_state,
                          bool cuda);

// Gradient outputs the caller provides (hstu_bwd_into), checked by check_hstu_grad_outs.
struct HstuGradOuts {
    at::Tensor dq, dk, dv;
};

// Backward extras on top of prepare_hstu: dout and the gradient outputs / accumulators (the caller's
// dk, dv and, on the CPU, dq when `outs` is given; CUDA's dq always goes through the fp32 accumulator).
void prepare_hstu_bwd(Hstu &g, const at::Tensor &dout, bool bias_grad, bool cuda, const HstuGradOuts *outs = nullptr);

// hstu_bwd_into's rules for dq, dk, dv (each named in its message): q's, k's, v's shapes, q's dtype and
// device, each row's heads contiguous (strides (>= H x d, d, 1)), no memory shared with an input, and
// among themselves only as disjoint columns of one row layout (views of one fused projection's buffer).
void check_hstu_grad_outs(const char *op, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                          const at::Tensor &dout, const HstuGradOuts &outs);

}  // namespace torchfuse

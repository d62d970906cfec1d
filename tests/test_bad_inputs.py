"""Bad input across the public API, one table: every row is a call and what it must give.

Kinds of row (the helpers below build them):
  bad        a Python exception of the given type whose message names the argument (``match``)
  same       a result equal to plain PyTorch's on the same input (NaN/Inf compared with equal_nan)
  unchecked  metadata that only the device holds: on the CPU the op raises naming the argument; on
             CUDA it reads no offsets on the host (no sync, CUDA-graph safe, results unspecified), so
             it only runs (this half is meant to run under compute-sanitizer memcheck: no out-of-bounds
             access), and the check the docs point to (validate_jagged / validate=True) raises
  cross      a tensor on the CPU with the others on CUDA: an exception naming it (CUDA machines only)

Case families (row id = family/case):
  norm/      layer_norm, rms_norm, nn.LayerNorm, nn.RMSNorm: int / float64 x, int weight, int residual,
             int residual_dtype, weight and bias of different dtypes, 0-d x, 2-D weight, weight / bias /
             weight2 / residual / residual2 of the wrong size (inference and training paths), module
             input of the wrong width, eps <= 0, unknown cast, empty last dim; empty rows and
             N = 65537 (= F.layer_norm / HF RMSNorm); non-contiguous x, residual and weight, forward
             and backward (= contiguous); NaN/Inf rows (= PyTorch); weight / residual on another device
  jagged/    every op of torchfuse.jagged, its compat forms (gr concat/split, fbgemm to/from dense) and
             validate_jagged: float offsets / lengths / indices, 2-D offsets, 0-d values, 1-D dense,
             bool / int values where floats are needed, dtypes or row shapes that differ; offsets of
             the wrong length for dense, for the other offsets, within a list; a dense side of the
             wrong row count; negative max_length / total_length / prefixes / totals, totals that do
             not add up, empty or mismatched lists, out-of-range indices, negative lengths, lengths
             past the values, a total_length that disagrees; offsets that are negative, decreasing,
             past the values (near and 2^40 away), short of the values (concat / split) or empty;
             empty batches, zero-length samples, max_length 0, 11 parts (= reference); non-contiguous
             values / dense / offsets / indices (= contiguous); NaN/Inf values (= reference); offsets,
             dense, values_right, lengths, indices on another device
  hstu/      hstu_attention (plain, cached, with attn_bias), compat.gr.hstu_mha: int q, q/k/v dtypes
             that differ, float64 on CUDA, int attn_bias, float seq_offsets / num_targets, 2-D q or
             seq_offsets or num_targets, 3-D attn_bias, heads / head dims / rows that differ, head dims
             0, 512 and Dv 257, max_seq_len < 0 or 2^30, scaling_seqlen 0, target_group_size 0,
             contextual_seq_len < 0, alpha NaN, dropout_p < 0, 1 or NaN (op, wrapper, gr's
             dropout_pr), rng_state of the wrong shape; num_targets / attn_bias / delta_q sized for another
             batch, empty or 2-D seq_offsets (cached too), causal=False (gr); head dims 16, 48 / 25 and 1
             (= reference); seq_offsets
             negative (near and -2^40), decreasing, past k's rows (near and 2^31 - 1), num_targets
             negative or past a sequence, a sequence longer than max_seq_len with attn_bias (unchecked:
             forward and backward, fp32 and bf16 on CUDA); empty batches, zero-length sequences,
             cached with B = 0 or D = 0 (= reference); non-contiguous q/k/v and seq_offsets
             (= contiguous); NaN/Inf rows of q and of k (= reference whose masked pairs are exactly 0);
             k / seq_offsets / num_targets / attn_bias on another device
  dynemb/    DynamicEmbedding, DynamicEmbeddingBag and their forward / find / find_or_insert / insert /
             contains / erase / export: float ids and keys, bool keys, float scores, values of the
             wrong shape, scores of the wrong count, bag ids of the wrong rank, float / 2-D / empty
             offsets, offsets negative, decreasing, past the ids (near and 2^40 away), not starting at
             0, short with include_last_offset (sum and mean, train and eval), per_sample_weights of
             the wrong shape or with mode='mean', constructor arguments past their limits; ids at the
             int64 extremes, rows 1027 wide, empty ids, empty bags, B = 0 (= F.embedding_bag);
             non-contiguous ids and inserted values (= contiguous); NaN/Inf rows (= F.embedding_bag);
             ids / values / offsets on another device
  torchrec/  DynamicEmbeddingBagCollection, DynamicEmbeddingCollection, swap_embedding_modules (with a
             stand-in KJT when torchrec is absent): unknown / missing keys, lengths that do not add up
             to the values, negative lengths (batched and per table), a lengths count that is no
             multiple of the keys, float ids, a weights count that differs, weights with MEAN pooling,
             no tables, duplicate names, unknown pooling, the collection itself or a non-module given
             to swap; B = 0 (= zeros); a KJT on another device
  hf/        patch_hf / unpatch_hf: a non-model, a string, no argument, an unsupported model type
             (model and model_type=), a model_type that disagrees with the model
  bmm/       jagged_dense_bmm_broadcast_add: jagged of the wrong width, bias of the wrong shape, offsets
             of the wrong length for dense's batch, mixed dtypes, negative max_seq_len
  ssm/       sampled_softmax_loss: temperature 0, positive / negatives / weights of the wrong shape,
             float ids, an int query
  stu/       nn.STULayer: x of the wrong width, cached_forward with an empty cache; hstu_preprocess: int x,
             parameters of another dtype, 1-D x, norm_bias / uvqk_weight / uvqk_bias of the wrong size,
             num_heads 0, eps 0; no rows (= reference); non-contiguous x and uvqk_weight; uvqk_weight on
             another device; compat.gr: hstu_preprocess_and_attention with causal=False,
             hstu_compute_output given both concat_ux and concat_u
  hout/      hstu_compute_output: int inputs, attn / u / x of different dtypes, u / x / norm_weight /
             output_weight of the wrong shape, group_norm with num_heads * linear_dim != width, unknown
             activation, dropout_ratio outside [0, 1), eps 0, norm_weight and norm_bias of different
             dtypes; L = 0 (= reference); non-contiguous attn and u (= contiguous); norm_weight on
             another device
"""
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F

import torchfuse
from torchfuse import torchrec as tftr
from torchfuse.compat import fbgemm, gr

CUDA = torch.cuda.is_available()


@dataclass
class Row:
    id: str
    kind: str                      # "bad", "same", "unchecked", "cross"
    call: Callable                 # call(device): runs the op (bad/unchecked/cross) or returns (got, want)
    exc: type = RuntimeError       # bad / cross / unchecked on the CPU
    match: str = ""
    validate: Optional[Callable] = None  # unchecked: validate(device) runs the check that must raise
    vexc: type = ValueError
    vmatch: str = ""
    tol: Optional[dict] = None


def bad(id, exc, match, call):
    return Row(id, "bad", call, exc, match)


def same(id, call, **tol):
    return Row(id, "same", call, tol=tol or None)


def unchecked(id, match, call, validate, vexc=ValueError, vmatch=""):
    return Row(id, "unchecked", call, RuntimeError, match, validate, vexc, vmatch or match)


def cross(id, exc, match, call):
    return Row(id, "cross", call, exc, match)


def t(x, d, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype, device=d)


def rand(*shape, d, dtype=torch.float32):
    return torch.randn(*shape, device=d).to(dtype)


def nonfinite(x, rows=(1,)):
    """x with NaN and +-Inf in the given rows (dim 0)."""
    x = x.clone()
    for i, r in enumerate(rows):
        x[r] = (float("nan"), float("inf"), float("-inf"))[i % 3]
    x[rows[0], ..., 0] = float("inf")
    return x


# ---------------------------------------------------------------- norms

N = 8


def X(d, rows=4, dtype=torch.float32):
    return rand(rows, N, d=d, dtype=dtype)


def W(d, n=N, dtype=torch.float32):
    return 1.0 + 0.1 * rand(n, d=d, dtype=dtype)


def hf_rms(x, w, eps=1e-6):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


ln, rms = torchfuse.layer_norm, torchfuse.rms_norm


def _norm_grads_strided_weight(d):
    """Gradients through a strided weight equal those through its contiguous copy."""
    x, r, wb = X(d).requires_grad_(), X(d), W(d, 2 * N).requires_grad_()
    out = []
    for w in (wb[::2], wb[::2].contiguous()):
        y, s = rms(x, w, residual=r)
        out.append(torch.autograd.grad((y * y).sum() + s.sum(), (x, wb)))
    return out[0], out[1]

NORM_ROWS = [
    bad("norm/dtype/x-int", TypeError, r"layer_norm: x must be float", lambda d: ln(X(d).long(), W(d))),
    bad("norm/dtype/x-float64", TypeError, r"rms_norm: x must be float", lambda d: rms(X(d).double(), W(d))),
    bad("norm/dtype/weight-int", TypeError, r"weight must be float", lambda d: ln(X(d), W(d).int())),
    bad("norm/dtype/residual-int", TypeError, r"residual must be float",
        lambda d: ln(X(d), W(d), residual=X(d).long())),
    bad("norm/dtype/residual_dtype-int", TypeError, r"residual_dtype must be float",
        lambda d: ln(X(d), W(d), residual=X(d), residual_dtype=torch.int32)),
    bad("norm/dtype/weight-bias-differ", RuntimeError, r"weight, bias.*share one dtype",
        lambda d: ln(X(d), W(d, dtype=torch.float16), W(d))),
    bad("norm/rank/x-0d", RuntimeError, r"x must have at least one dimension",
        lambda d: ln(t(1.0, d, torch.float32), W(d))),
    bad("norm/rank/weight-2d", RuntimeError, r"weight must be 1-D", lambda d: rms(X(d), W(d).view(2, 4))),
    bad("norm/size/weight", RuntimeError, r"weight must be 1-D with x.shape\[-1\] = 8", lambda d: ln(X(d), W(d, 7))),
    bad("norm/size/bias", RuntimeError, r"bias must be 1-D with x.shape\[-1\] = 8", lambda d: ln(X(d), W(d), W(d, 9))),
    bad("norm/size/weight2", RuntimeError, r"weight2 must be 1-D", lambda d: ln(X(d), W(d), weight2=W(d, 3))),
    bad("norm/size/residual", RuntimeError, r"residual must have the shape of x",
        lambda d: rms(X(d), W(d), residual=X(d, rows=3))),
    bad("norm/size/residual2", RuntimeError, r"residual2 must have the shape of x",
        lambda d: ln(X(d), W(d), residual=X(d), residual2=rand(4, 7, d=d))),
    bad("norm/size/module-LayerNorm-input", ValueError, r"nn.LayerNorm: expected input ending in \(8,\)",
        lambda d: torchfuse.nn.LayerNorm(N, device=d)(rand(4, 7, d=d))),
    bad("norm/size/module-RMSNorm-input", ValueError, r"nn.RMSNorm: expected hidden_states ending in \(8,\)",
        lambda d: torchfuse.nn.RMSNorm(N, device=d)(rand(4, 7, d=d))),
    bad("norm/size/module-RMSNorm-residual", RuntimeError, r"residual must have the shape of x",
        lambda d: torchfuse.nn.RMSNorm(N, device=d)(X(d), rand(4, 7, d=d))),
    bad("norm/size/empty-last-dim", RuntimeError, r"x must have .*non-empty last dimension",
        lambda d: ln(rand(4, 0, d=d), None)),
    bad("norm/value/eps-zero", RuntimeError, r"eps must be a positive finite number",
        lambda d: rms(X(d), W(d), eps=0.0)),
    bad("norm/value/eps-negative", RuntimeError, r"eps must be a positive", lambda d: ln(X(d), W(d), eps=-1.0)),
    bad("norm/value/cast", ValueError, r"cast must be 'llama' or 'gemma'", lambda d: rms(X(d), W(d), cast="t5")),
    same("norm/empty/rows", lambda d: (ln(rand(0, N, d=d), W(d), W(d)),
                                       F.layer_norm(rand(0, N, d=d), (N,), W(d), W(d)))),
    same("norm/empty/rows-3d-residual", lambda d: (
        rms(rand(2, 0, N, d=d), W(d), residual=rand(2, 0, N, d=d))[1], rand(2, 0, N, d=d))),
    same("norm/size/N-65537", lambda d: (lambda x, w: (ln(x, w, w), F.layer_norm(x, (65537,), w, w)))(
        rand(2, 65537, d=d), W(d, 65537)), rtol=1e-4, atol=1e-4),
    same("norm/noncontig/x-transposed", lambda d: (lambda x, w: (ln(x, w, w), ln(x.contiguous(), w, w)))(
        rand(N, 4, d=d).t(), W(d))),
    same("norm/noncontig/x-sliced-residual", lambda d: (lambda x, r, w: (
        rms(x, w, residual=r), rms(x.contiguous(), w, residual=r.contiguous())))(
        rand(6, 2 * N, d=d)[::2, ::2], rand(3, N, 2, d=d)[..., 0], W(d))),
    same("norm/noncontig/weight", lambda d: (lambda x, w: (rms(x, w), hf_rms(x, w)))(X(d), W(d, 2 * N)[::2])),
    same("norm/noncontig/weight-backward", lambda d: _norm_grads_strided_weight(d)),
    bad("norm/size/weight-training", RuntimeError, r"weight must be 1-D with x.shape\[-1\] = 8",
        lambda d: ln(X(d).requires_grad_(), W(d, 7), residual=X(d))),
    same("norm/nonfinite/layer_norm", lambda d: (lambda x, w: (ln(x, w, w), F.layer_norm(x, (N,), w, w, 1e-5)))(
        nonfinite(X(d, rows=6), (1, 3, 4)), W(d)), equal_nan=True),
    same("norm/nonfinite/rms_norm-residual", lambda d: (lambda x, r, w: (
        rms(x, w, residual=r)[0], hf_rms(x + r, w)))(nonfinite(X(d, rows=6), (0, 5)), X(d, rows=6), W(d)),
        equal_nan=True),
    cross("norm/device/weight", RuntimeError, r"weight must be on the same device as x",
          lambda d: ln(X(d), W("cpu"))),
    cross("norm/device/residual", RuntimeError, r"residual must be on the same device as x",
          lambda d: ln(X(d), W(d), residual=X("cpu"))),
]


# ---------------------------------------------------------------- jagged ops

T, D, L = 10, 3, 5  # rows, row width, dense length of the jagged fixtures: 3 samples of 3, 4, 3 rows
GOOD = [0, 3, 7, 10]
BAD_OFFSETS = {  # name: (offsets over T rows, the CPU message)
    "negative": ([-2, 3, 7, 10], r"\[0\] must be 0"),
    "decreasing": ([0, 7, 3, 10], r" must be non-decreasing"),
    "past-values": ([0, 3, 7, 12], r"\[-1\] = 12 is past the end"),
    "far-past-values": ([0, 3, 2**40, 2**41], r"\[-1\] = \d+ is past the end"),
}
EXACT_MSG = r"\[-1\] = \d+ must equal the row count"


def V(d, rows=T, dtype=torch.float32):
    return rand(rows, D, d=d, dtype=dtype)


def DENSE(d, B=3, dtype=torch.float32):
    return rand(B, L, D, d=d, dtype=dtype)


def ref_to_padded(values, offsets, max_len, pad=0.0):
    o = offsets.tolist()
    out = values.new_full((len(o) - 1, max_len, *values.shape[1:]), pad)
    for b in range(len(o) - 1):
        n = min(o[b + 1] - o[b], max_len)
        out[b, :n] = values[o[b]:o[b] + n]
    return out


def ref_to_jagged(dense, offsets, total):
    o = offsets.tolist()
    out = dense.new_zeros((total, *dense.shape[2:]))
    for b in range(len(o) - 1):
        n = min(o[b + 1] - o[b], dense.shape[1])
        out[o[b]:o[b] + n] = dense[b, :n]
    return out


def ref_arith(values, offsets, dense, mul):
    """Every sample no longer than dense's L here: the same op on the padded rows."""
    return values * ref_to_jagged(dense, offsets, values.shape[0]) if mul else \
        values + ref_to_jagged(dense, offsets, values.shape[0])


def ref_concat_2d(vl, ol, vr, orr):
    a, b = ol.tolist(), orr.tolist()
    return torch.cat([torch.cat([vl[a[i]:a[i + 1]], vr[b[i]:b[i + 1]]]) for i in range(len(a) - 1)]
                     + [vl[:0]])


J = torchfuse
_ops_with_offsets = {
    # name: (call(values, offsets, device), argument named, validate(d, offsets) -> raises, exact)
    "jagged_to_padded_dense": (lambda d, o: J.jagged_to_padded_dense(V(d), o, L), "offsets", T, False),
    "dense_to_jagged": (lambda d, o: J.dense_to_jagged(DENSE(d), o, total_length=T), "offsets", T, False),
    "jagged_dense_add": (lambda d, o: J.jagged_dense_add(V(d), o, DENSE(d)), "offsets", T, False),
    "jagged_dense_mul": (lambda d, o: J.jagged_dense_mul(V(d), o, DENSE(d)), "offsets", T, False),
    "concat_2d_jagged-left": (lambda d, o: J.concat_2d_jagged(V(d), o, V(d), t(GOOD, d), n_prefix_from_right=1),
                              "offsets_left", T, True),
    "concat_2d_jagged-right": (lambda d, o: J.concat_2d_jagged(V(d), t(GOOD, d), V(d), o), "offsets_right", T, True),
    "concat_2d_jagged-dense-right": (lambda d, o: J.concat_2d_jagged(V(d), o, V(d, 6), None, None, 2),
                                     "offsets_left", T, True),
    "split_2d_jagged": (lambda d, o: J.split_2d_jagged(V(d, 2 * T), o, t(GOOD, d), total_len_left=T,
                                                       total_len_right=T), "offsets_left", T, True),
    "split_2d_jagged-right": (lambda d, o: J.split_2d_jagged(V(d, 2 * T), t(GOOD, d), o, total_len_left=T,
                                                             total_len_right=T), "offsets_right", T, True),
    "jagged_concat": (lambda d, o: J.jagged_concat([V(d), V(d)], [t(GOOD, d), o]), "offsets_list[1]", T, True),
    "jagged_split": (lambda d, o: J.jagged_split(V(d, 2 * T), [o, t(GOOD, d)], [T, T]), "offsets_list[0]", T, True),
    "gr.concat_2D_jagged": (lambda d, o: gr.concat_2D_jagged(L, V(d), V(d), offsets_left=o, offsets_right=t(GOOD, d)),
                            "offsets_left", T, True),
    "gr.split_2D_jagged": (lambda d, o: gr.split_2D_jagged(L, V(d, 2 * T), T, T, offsets_left=t(GOOD, d),
                                                           offsets_right=o), "offsets_right", T, True),
    "fbgemm.jagged_to_padded_dense": (lambda d, o: fbgemm.jagged_to_padded_dense(V(d), [o], [L]), "offsets", T, False),
    "fbgemm.dense_to_jagged": (lambda d, o: fbgemm.dense_to_jagged(DENSE(d), [o], T), "offsets", T, False),
}


def _offset_rows():
    rows = []
    for op, (call, arg, rows_of_values, exact) in _ops_with_offsets.items():
        for name, (off, msg) in BAD_OFFSETS.items():
            rows.append(unchecked(
                f"jagged/offsets-{name}/{op}", re.escape(arg) + msg,
                lambda d, call=call, off=off: call(d, t(off, d)),
                lambda d, off=off, n=rows_of_values, exact=exact: J.validate_jagged(V(d, n), t(off, d), exact=exact),
                vmatch=r"validate_jagged: offsets"))
        if exact:  # concat / split: every row must belong to a sample
            rows.append(unchecked(
                f"jagged/offsets-short-of-values/{op}", re.escape(arg) + EXACT_MSG,
                lambda d, call=call: call(d, t([0, 3, 7, 9], d)),
                lambda d, n=rows_of_values: J.validate_jagged(V(d, n), t([0, 3, 7, 9], d), exact=True),
                vmatch=r"validate_jagged: offsets\[-1\] = 9 but values has 10 rows \(must be equal\)"))
        rows.append(bad(f"jagged/offsets-empty/{op}", RuntimeError, re.escape(arg) + r" must be 1-D with B\+1 >= 1",
                        lambda d, call=call: call(d, t([], d))))
        rows.append(bad(f"jagged/offsets-float/{op}", TypeError, re.escape(arg) + r" must be int32 or int64, got Float",
                        lambda d, call=call: call(d, t(GOOD, d, torch.float32))))
        rows.append(bad(f"jagged/offsets-2d/{op}", RuntimeError, re.escape(arg) + r" must be 1-D",
                        lambda d, call=call: call(d, t([GOOD], d))))
    return rows


def cumsum0(lengths):
    """Offsets of lengths, negative ones included (what the op computes on CUDA, where it checks nothing)."""
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def _parts(d, n):
    lengths = [torch.randint(0, 4, (3,), device=d) for _ in range(n)]
    return [V(d, int(ln_.sum())) for ln_ in lengths], [cumsum0(ln_) for ln_ in lengths]


def _concat_parts(d, n):
    """More parts than one launch takes (TFJ_MAX_PARTS = 8): grouped launches."""
    vals, offs = _parts(d, n)
    ref = torch.cat([v[o[b]:o[b + 1]] for b in range(3) for v, o in zip(vals, offs)])
    return J.jagged_concat(vals, offs)[0], ref


def _split_parts(d, n):
    vals, offs = _parts(d, n)
    cat = torch.cat([v[o[b]:o[b + 1]] for b in range(3) for v, o in zip(vals, offs)])
    return torch.cat(J.jagged_split(cat, offs, [v.shape[0] for v in vals])), torch.cat(vals)


def _ref_index_select(values, lengths, indices):
    o = [0] + torch.cumsum(lengths, 0).tolist()
    parts = [values[o[i]:o[i + 1]] for i in indices.tolist()]
    return torch.cat(parts + [values[:0]]), lengths[indices]


def _index_select_oob(d):
    """On CUDA out-of-range indices select nothing (csrc/jagged.cpp); no check reads them there."""
    out, out_len = J.jagged_index_select(V(d), t([3, 4, 3], d), t([0, 3, -1, 2], d), total_length=6)
    assert out_len.tolist() == [3, 0, 0, 3]


JAGGED_ROWS = _offset_rows() + [
    # dtypes and ranks of the other arguments
    bad("jagged/dtype/values-bool", TypeError, r"values must be a float dtype, int32 or int64, got Bool",
        lambda d: J.jagged_to_padded_dense(V(d).bool(), t(GOOD, d), L)),
    bad("jagged/dtype/add-int-values", TypeError, r"jagged_dense_add: values must be float32",
        lambda d: J.jagged_dense_add(V(d).long(), t(GOOD, d), DENSE(d).long())),
    bad("jagged/dtype/mul-dense-differs", TypeError, r"dense must have values' dtype",
        lambda d: J.jagged_dense_mul(V(d), t(GOOD, d), DENSE(d).double())),
    bad("jagged/dtype/concat-values_right", TypeError, r"values_left and values_right must share a dtype",
        lambda d: J.concat_2d_jagged(V(d), t(GOOD, d), V(d).half(), t(GOOD, d))),
    bad("jagged/dtype/concat-list", TypeError, r"values_list\[0\] and values_list\[1\] must share a dtype",
        lambda d: J.jagged_concat([V(d), V(d).half()], [t(GOOD, d), t(GOOD, d)])),
    bad("jagged/dtype/lengths-float", TypeError, r"lengths must be int32 or int64, got Float",
        lambda d: J.jagged_index_select(V(d), t([3, 4, 3], d, torch.float32), t([0], d))),
    bad("jagged/dtype/indices-float", TypeError, r"indices must be int32 or int64, got Float",
        lambda d: J.jagged_index_select(V(d), t([3, 4, 3], d), t([0.0], d, torch.float32))),
    bad("jagged/dtype/complete_cumsum-float", TypeError, r"lengths must be int32 or int64, got Float",
        lambda d: J.complete_cumsum(t([1.0, 2.0], d, torch.float32))),
    bad("jagged/dtype/validate-float-offsets", ValueError, r"validate_jagged: offsets must be int32 or int64",
        lambda d: J.validate_jagged(V(d), t(GOOD, d, torch.float32))),
    bad("jagged/rank/values-0d", RuntimeError, r"values must have a row dimension",
        lambda d: J.jagged_to_padded_dense(t(1.0, d, torch.float32), t(GOOD, d), L)),
    bad("jagged/rank/dense-1d", RuntimeError, r"dense must be \(B, L, \*D\)",
        lambda d: J.dense_to_jagged(rand(5, d=d), t(GOOD, d))),
    bad("jagged/rank/add-dense-2d", RuntimeError, r"dense must be \(B, L, \*D\)",
        lambda d: J.jagged_dense_add(V(d), t(GOOD, d), rand(3, L, d=d))),
    bad("jagged/rank/lengths-2d", RuntimeError, r"lengths must be 1-D",
        lambda d: J.jagged_index_select(V(d), t([[3, 4, 3]], d), t([0], d))),
    bad("jagged/rank/indices-2d", RuntimeError, r"indices must be 1-D",
        lambda d: J.jagged_index_select(V(d), t([3, 4, 3], d), t([[0]], d))),
    bad("jagged/rank/complete_cumsum-2d", RuntimeError, r"lengths must be 1-D",
        lambda d: J.complete_cumsum(t([[1, 2]], d))),
    bad("jagged/rank/validate-values-0d", ValueError, r"validate_jagged: values must have a row dimension",
        lambda d: J.validate_jagged(t(1.0, d, torch.float32), t(GOOD, d))),
    bad("jagged/rank/validate-offsets-2d", ValueError, r"validate_jagged: offsets must be 1-D",
        lambda d: J.validate_jagged(V(d), t([GOOD], d))),
    bad("jagged/rank/validate-offsets-empty", ValueError, r"validate_jagged: offsets must be 1-D with B\+1 >= 1",
        lambda d: J.validate_jagged(V(d), t([], d))),
    # sizes that disagree; offsets of the wrong length where another argument fixes the batch size
    bad("jagged/size/dense_to_jagged-batch", RuntimeError, r"dense.shape\[0\] = 3 must equal .* len\(offsets\) - 1 = 2",
        lambda d: J.dense_to_jagged(DENSE(d), t([0, 3, 10], d))),
    bad("jagged/size/add-batch", RuntimeError, r"dense.shape\[0\] = 3 must equal .* len\(offsets\) - 1 = 4",
        lambda d: J.jagged_dense_add(V(d), t([0, 3, 7, 9, 10], d), DENSE(d))),
    bad("jagged/size/mul-row-shape", RuntimeError, r"dense.shape\[2:\] must equal values.shape\[1:\]",
        lambda d: J.jagged_dense_mul(V(d), t(GOOD, d), rand(3, L, D + 1, d=d))),
    bad("jagged/size/concat-offsets-lengths", RuntimeError, r"offsets_left and offsets_right must have the same length",
        lambda d: J.concat_2d_jagged(V(d), t(GOOD, d), V(d), t([0, 10], d))),
    bad("jagged/size/concat-dense-side-rows", RuntimeError, r"dense values_right must have B \* max_len_right = 3 \* 2",
        lambda d: J.concat_2d_jagged(V(d), t(GOOD, d), V(d, 7), None, None, 2)),
    bad("jagged/size/concat-dense-side-batch", RuntimeError,
        r"dense values_right must have B \* max_len_right = 2 \* 2",
        lambda d: J.concat_2d_jagged(V(d), t([0, 4, 10], d), V(d, 6), None, None, 2)),
    bad("jagged/size/concat-row-shape", RuntimeError, r"values_left and values_right must have the same row shape",
        lambda d: J.concat_2d_jagged(V(d), t(GOOD, d), rand(T, D + 1, d=d), t(GOOD, d))),
    bad("jagged/size/split-offsets-lengths", RuntimeError, r"offsets_left and offsets_right must have the same length",
        lambda d: J.split_2d_jagged(V(d, 2 * T), t(GOOD, d), t([0, 10], d))),
    bad("jagged/size/split-totals-add-up", RuntimeError,
        r"row counts 5 \+ 5 must be >= 0 and add up to values.shape\[0\] = 20",
        lambda d: J.split_2d_jagged(V(d, 2 * T), t(GOOD, d), t(GOOD, d), total_len_left=5, total_len_right=5)),
    bad("jagged/size/jagged_concat-batch", RuntimeError, r"B\+1 = 4 entries, offsets_list\[1\] has 2",
        lambda d: J.jagged_concat([V(d), V(d)], [t(GOOD, d), t([0, 10], d)])),
    bad("jagged/size/jagged_concat-list-lengths", RuntimeError,
        r"values_list and offsets_list must have the same length",
        lambda d: J.jagged_concat([V(d), V(d)], [t(GOOD, d)])),
    bad("jagged/size/jagged_concat-empty-list", ValueError, r"jagged_concat: values_list must not be empty",
        lambda d: J.jagged_concat([], [])),
    bad("jagged/size/jagged_split-batch", RuntimeError, r"B\+1 = 4 entries, offsets_list\[1\] has 2",
        lambda d: J.jagged_split(V(d, 2 * T), [t(GOOD, d), t([0, 10], d)], [T, T])),
    bad("jagged/size/jagged_split-totals-add-up", RuntimeError, r"totals must add up to values.shape\[0\] = 20, got 19",
        lambda d: J.jagged_split(V(d, 2 * T), [t(GOOD, d), t([0, 3, 7, 9], d)], [T, T - 1])),
    bad("jagged/size/jagged_split-list-lengths", RuntimeError,
        r"offsets_list and totals must be non-empty and of the same",
        lambda d: J.jagged_split(V(d, 2 * T), [t(GOOD, d)], [T, T])),
    bad("jagged/size/fbgemm-two-jagged-dims", NotImplementedError, r"only one jagged dimension.*got 2 offsets",
        lambda d: fbgemm.jagged_to_padded_dense(V(d), [t(GOOD, d), t(GOOD, d)], [L, L])),
    bad("jagged/size/fbgemm-max_lengths", ValueError, r"max_lengths must have one entry per offsets tensor",
        lambda d: fbgemm.jagged_to_padded_dense(V(d), [t(GOOD, d)], [L, L])),
    bad("jagged/value/max_length-negative", RuntimeError, r"max_length must be >= 0, got -1",
        lambda d: J.jagged_to_padded_dense(V(d), t(GOOD, d), -1)),
    bad("jagged/value/total_length-negative", RuntimeError, r"total_length must be >= 0, got -1",
        lambda d: J.dense_to_jagged(DENSE(d), t(GOOD, d), -1)),
    bad("jagged/value/n_prefix_from_right-negative", RuntimeError, r"n_prefix_from_right must be >= 0",
        lambda d: J.concat_2d_jagged(V(d), t(GOOD, d), V(d), t(GOOD, d), n_prefix_from_right=-1)),
    bad("jagged/value/n_prefix_to_right-negative", RuntimeError, r"n_prefix_to_right must be >= 0",
        lambda d: J.split_2d_jagged(V(d, 2 * T), t(GOOD, d), t(GOOD, d), n_prefix_to_right=-1)),
    bad("jagged/value/max_len_left-missing", RuntimeError, r"max_len_left \(>= 0\) is needed when offsets_left is None",
        lambda d: J.concat_2d_jagged(V(d), None, V(d), t(GOOD, d))),
    bad("jagged/value/totals-negative", RuntimeError, r"totals must be >= 0, got -1",
        lambda d: J.jagged_split(V(d, 2 * T), [t(GOOD, d), t(GOOD, d)], [-1, 2 * T + 1])),
    bad("jagged/value/index_select-total_length-negative", RuntimeError, r"total_length must be >= 0",
        lambda d: J.jagged_index_select(V(d), t([3, 4, 3], d), t([0], d), -1)),
    unchecked("jagged/value/index_select-lengths-negative", r"lengths must be >= 0, got -1",
              lambda d: J.jagged_index_select(V(d), t([3, -1, 3], d), t([0, 2], d), total_length=6),
              lambda d: J.validate_jagged(V(d), cumsum0(t([3, -1, 3], d))), vmatch=r"non-decreasing"),
    unchecked("jagged/value/index_select-lengths-past-values",
              r"sum\(lengths\) = 12 is more than values.shape\[0\] = 10",
              lambda d: J.jagged_index_select(V(d), t([3, 4, 5], d), t([2, 0], d), total_length=8),
              lambda d: J.validate_jagged(V(d), cumsum0(t([3, 4, 5], d))), vmatch=r"offsets\[-1\] = 12"),
    unchecked("jagged/value/complete_cumsum-negative", r"lengths must be >= 0, got -2",
              lambda d: J.complete_cumsum(t([1, -2, 3], d)),
              lambda d: J.validate_jagged(V(d), cumsum0(t([1, -2, 3], d))), vmatch=r"non-decreasing"),
    unchecked("jagged/value/index_select-total_length-disagrees", r"total_length = 5 but the selected samples hold 3",
              lambda d: J.jagged_index_select(V(d), t([3, 4, 3], d), t([0], d), 5), None),
    unchecked("jagged/value/index_select-indices-out-of-range", r"indices must be in \[0, 3\), got values in \[-1, 3\]",
              _index_select_oob, None),
    # valid empties: empty batches and zero-length samples equal the references
    same("jagged/empty/to_padded-B0", lambda d: (J.jagged_to_padded_dense(V(d, 0), t([0], d), L),
                                                 torch.zeros(0, L, D, device=d))),
    same("jagged/empty/to_padded-zero-length", lambda d: (lambda v, o: (J.jagged_to_padded_dense(v, o, L, 7.0),
                                                                        ref_to_padded(v, o, L, 7.0)))(
        V(d, 4), t([0, 0, 4, 4], d))),
    same("jagged/empty/to_padded-L0", lambda d: (J.jagged_to_padded_dense(V(d), t(GOOD, d), 0),
                                                 torch.zeros(3, 0, D, device=d))),
    same("jagged/empty/to_jagged-B0", lambda d: (J.dense_to_jagged(rand(0, L, D, d=d), t([0], d)),
                                                 torch.zeros(0, D, device=d))),
    same("jagged/empty/to_jagged-zero-length", lambda d: (lambda x, o: (
        J.dense_to_jagged(x, o), ref_to_jagged(x, o, 4)))(DENSE(d), t([0, 0, 4, 4], d))),
    same("jagged/empty/add-B0", lambda d: (J.jagged_dense_add(V(d, 0), t([0], d), rand(0, L, D, d=d)),
                                           torch.zeros(0, D, device=d))),
    same("jagged/empty/mul-zero-length", lambda d: (lambda v, o, x: (
        J.jagged_dense_mul(v, o, x), ref_arith(v, o, x, True)))(V(d, 4), t([0, 0, 4, 4], d), DENSE(d))),
    same("jagged/empty/concat_2d-B0", lambda d: (J.concat_2d_jagged(V(d, 0), t([0], d), V(d, 0), t([0], d))[0],
                                                 torch.zeros(0, D, device=d))),
    same("jagged/empty/concat_2d-zero-length", lambda d: (lambda vl, ol, vr, orr: (
        J.concat_2d_jagged(vl, ol, vr, orr)[0], ref_concat_2d(vl, ol, vr, orr)))(
        V(d, 2), t([0, 0, 2, 2], d), V(d, 0), t([0, 0, 0, 0], d))),
    same("jagged/empty/split_2d-B0", lambda d: (torch.cat(J.split_2d_jagged(V(d, 0), t([0], d), t([0], d))),
                                                torch.zeros(0, D, device=d))),
    same("jagged/empty/jagged_concat-B0", lambda d: (J.jagged_concat([V(d, 0), V(d, 0)], [t([0], d), t([0], d)])[1],
                                                     t([0], d))),
    same("jagged/empty/jagged_split-zero-length", lambda d: (lambda v: (
        torch.cat(J.jagged_split(v, [t([0, 0, 3], d), t([0, 0, 0], d)], [3, 0])), v))(V(d, 3))),
    same("jagged/limit/jagged_concat-11-parts", lambda d: _concat_parts(d, 11)),
    same("jagged/limit/jagged_split-11-parts", lambda d: _split_parts(d, 11)),
    same("jagged/empty/index_select-K0", lambda d: (J.jagged_index_select(V(d), t([3, 4, 3], d), t([], d))[0],
                                                    torch.zeros(0, D, device=d))),
    same("jagged/empty/index_select-zero-length", lambda d: (lambda v, ln_, i: (
        J.jagged_index_select(v, ln_, i)[0], _ref_index_select(v, ln_, i)[0]))(
        V(d, 7), t([3, 0, 4], d), t([1, 2, 1], d))),
    same("jagged/empty/complete_cumsum-B0", lambda d: (J.complete_cumsum(t([], d)), t([0], d))),
    # non-contiguous inputs equal the contiguous result
    same("jagged/noncontig/to_padded-values", lambda d: (lambda v, o: (J.jagged_to_padded_dense(v, o, L),
                                                                       J.jagged_to_padded_dense(v.contiguous(), o, L)))(
        rand(D, T, d=d).t(), t(GOOD, d))),
    same("jagged/noncontig/offsets", lambda d: (lambda v, o: (J.jagged_to_padded_dense(v, o, L),
                                                              J.jagged_to_padded_dense(v, o.contiguous(), L)))(
        V(d), t([0, 9, 3, 9, 7, 9, 10], d)[::2])),
    same("jagged/noncontig/add-dense", lambda d: (lambda v, o, x: (J.jagged_dense_add(v, o, x),
                                                                   J.jagged_dense_add(v, o, x.contiguous())))(
        V(d), t(GOOD, d), rand(3, D, L, d=d).transpose(1, 2))),
    same("jagged/noncontig/concat_2d-values", lambda d: (lambda vl, o: (
        J.concat_2d_jagged(vl, o, vl, o)[0], J.concat_2d_jagged(vl.contiguous(), o, vl, o)[0]))(
        rand(2 * T, D, d=d)[::2], t(GOOD, d))),
    same("jagged/noncontig/index_select-indices", lambda d: (lambda v, i: (
        J.jagged_index_select(v, t([3, 4, 3], d), i)[0], J.jagged_index_select(v, t([3, 4, 3], d), i.contiguous())[0]))(
        V(d), t([2, 9, 0, 9, 1], d)[::2])),
    # NaN / Inf in the values move or add as PyTorch's ops do
    same("jagged/nonfinite/to_padded", lambda d: (lambda v, o: (J.jagged_to_padded_dense(v, o, L),
                                                                ref_to_padded(v, o, L)))(
        nonfinite(V(d), (0, 4, 9)), t(GOOD, d)), equal_nan=True),
    same("jagged/nonfinite/add", lambda d: (lambda v, o, x: (J.jagged_dense_add(v, o, x), ref_arith(v, o, x, False)))(
        nonfinite(V(d), (2, 5)), t(GOOD, d), nonfinite(DENSE(d), (1,))), equal_nan=True),
    same("jagged/nonfinite/mul", lambda d: (lambda v, o, x: (J.jagged_dense_mul(v, o, x), ref_arith(v, o, x, True)))(
        nonfinite(V(d), (2, 5)), t(GOOD, d), nonfinite(DENSE(d), (1,))), equal_nan=True),
    same("jagged/nonfinite/concat_2d", lambda d: (lambda v, o: (J.concat_2d_jagged(v, o, v, o)[0],
                                                                ref_concat_2d(v, o, v, o)))(
        nonfinite(V(d), (3, 8)), t(GOOD, d)), equal_nan=True),
    cross("jagged/device/offsets", RuntimeError, r"offsets must be on the same device as values",
          lambda d: J.jagged_to_padded_dense(V(d), t(GOOD, "cpu"), L)),
    cross("jagged/device/dense", RuntimeError, r"dense must be on the same device as values",
          lambda d: J.jagged_dense_add(V(d), t(GOOD, d), DENSE("cpu"))),
    cross("jagged/device/values_right", RuntimeError, r"values_right must be on the same device as values_left",
          lambda d: J.concat_2d_jagged(V(d), t(GOOD, d), V("cpu"), t(GOOD, d))),
    cross("jagged/device/offsets_right", RuntimeError, r"offsets_right must be on the same device as values",
          lambda d: J.concat_2d_jagged(V(d), t(GOOD, d), V(d), t(GOOD, "cpu"))),
    cross("jagged/device/lengths", RuntimeError, r"lengths must be on the same device as values",
          lambda d: J.jagged_index_select(V(d), t([3, 4, 3], "cpu"), t([0], d))),
    cross("jagged/device/indices", RuntimeError, r"indices must be on the same device as values",
          lambda d: J.jagged_index_select(V(d), t([3, 4, 3], d), t([0], "cpu"))),
    cross("jagged/device/validate", ValueError, r"validate_jagged: offsets are on cpu",
          lambda d: J.validate_jagged(V(d), t(GOOD, "cpu"))),
]


# ---------------------------------------------------------------- HSTU

HL, HH, HD, MSL = 10, 2, 32, 5  # rows, heads, head dim, max_seq_len of the fixtures (sequences of GOOD)


def QKV(d, rows=HL, dqk=HD, dv=HD, dtype=torch.float32):
    return rand(rows, HH, dqk, d=d, dtype=dtype), rand(rows, HH, dqk, d=d, dtype=dtype), \
        rand(rows, HH, dv, d=d, dtype=dtype)


def hstu_ref(q, k, v, offsets, max_seq_len, alpha):
    """The formula in float64, sequence by sequence (causal mask, no targets or context)."""
    o = offsets.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64, device=q.device)
    for b in range(len(o) - 1):
        s, e = o[b], o[b + 1]
        qb, kb, vb = (x[s:e].transpose(0, 1).double() for x in (q, k, v))
        mask = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril()
        # masked pairs are exactly 0 (a NaN key reaches only the rows that attend it)
        p = torch.where(mask, F.silu(alpha * qb @ kb.transpose(1, 2)) / max_seq_len, 0.0)
        out[s:e] = (p @ vb).transpose(0, 1)
    return out


hstu, hstu_cached = torchfuse.hstu_attention, torchfuse.hstu_attention_cached
HTOL = dict(rtol=1e-4, atol=1e-5)


def _hstu_same(q, k, v, offsets, msl=MSL, alpha=0.5):
    return hstu(q, k, v, offsets, msl, alpha).double(), hstu_ref(q, k, v, offsets, msl, alpha)


def _hstu_run(d, offsets, msl=MSL, validate=False, num_targets=None, bias=False, cached=False):
    """Forward and backward (fp32 and bf16 on CUDA: both kernel families) with the given metadata."""
    for dtype in ([torch.float32, torch.bfloat16] if d != "cpu" else [torch.float32]):
        q, k, v = (x.requires_grad_() for x in QKV(d, dtype=dtype))
        nt = t(num_targets, d) if num_targets is not None else None
        ab = rand(offsets.shape[0] - 1, 1, msl, msl, d=d, dtype=dtype).requires_grad_() if bias else None
        if cached:
            hstu_cached(q[:2 * (offsets.shape[0] - 1)].detach(), k.detach(), v.detach(), offsets, msl, 0.5,
                        num_targets=nt, attn_bias=ab, validate=validate)
            continue
        out = hstu(q, k, v, offsets, msl, 0.5, num_targets=nt, attn_bias=ab, validate=validate)
        out.backward(torch.randn_like(out))
    if d != "cpu":
        torch.cuda.synchronize()


def _hstu_strided(d):
    q = rand(HL, HD, HH, d=d).transpose(1, 2)
    k = rand(HH, HL, HD, d=d).transpose(0, 1)
    v = rand(HL, HH, 2 * HD, d=d)[..., ::2]
    o = t(GOOD, d)
    return hstu(q, k, v, o, MSL, 0.5), hstu(q.contiguous(), k.contiguous(), v.contiguous(), o, MSL, 0.5)


BAD_SEQ_OFFSETS = {  # name: (offsets over HL rows, dtype, the message)
    "negative": ([-2, 3, 7, 10], torch.int64, r"seq_offsets must lie in \[0, 10\]"),
    "decreasing": ([0, 7, 3, 10], torch.int64, r"seq_offsets must be non-decreasing"),
    "past-rows": ([0, 3, 7, 12], torch.int32, r"seq_offsets must lie in \[0, 10\]"),
    "far-past-rows": ([0, 3, 2**30, 2**31 - 1], torch.int32, r"seq_offsets must lie in \[0, 10\]"),
    "far-negative": ([-2**40, 3, 7, 10], torch.int64, r"seq_offsets must lie in \[0, 10\]"),
}
BAD_HSTU_META = {  # name: (keyword arguments of _hstu_run, the message)
    "num_targets-negative": (dict(num_targets=[1, -1, 1]), r"num_targets must lie in \[0, sequence length\]"),
    "num_targets-past-sequence": (dict(num_targets=[1, 9, 1]), r"num_targets must lie in \[0, sequence length\]"),
    "longer-than-max_seq_len-with-attn_bias": (dict(msl=3, bias=True),
                                               r"max_seq_len \(3\) is smaller than the longest sequence \(4\)"),
}


def _hstu_rows():
    rows = []
    for name, (off, odt, msg) in BAD_SEQ_OFFSETS.items():
        for form in ("", "-cached", "-attn_bias"):
            kw = dict(cached=form == "-cached", bias=form == "-attn_bias")
            rows.append(unchecked(f"hstu/offsets-{name}/hstu_attention{form}", msg,
                                  lambda d, off=off, odt=odt, kw=kw: _hstu_run(d, t(off, d, odt), **kw),
                                  lambda d, off=off, odt=odt, kw=kw: _hstu_run(d, t(off, d, odt), validate=True, **kw),
                                  vexc=RuntimeError))
    for name, (kw, msg) in BAD_HSTU_META.items():
        rows.append(unchecked(f"hstu/value/{name}", msg, lambda d, kw=kw: _hstu_run(d, t(GOOD, d), **kw),
                              lambda d, kw=kw: _hstu_run(d, t(GOOD, d), validate=True, **kw), vexc=RuntimeError))
    # gr.hstu_mha validates (hstu_attention's default) on every device
    rows.append(bad("hstu/offsets-past-rows/gr.hstu_mha", RuntimeError, r"seq_offsets must lie in \[0, 10\]",
                    lambda d: gr.hstu_mha(MSL, 0.5, *QKV(d), t([0, 3, 7, 12], d))))
    return rows


HSTU_ROWS = _hstu_rows() + [
    bad("hstu/dtype/q-int", TypeError, r"q must be bfloat16, float16, float32",
        lambda d: hstu(*(x.int() for x in QKV(d)), t(GOOD, d), MSL, 0.5)),
    bad("hstu/dtype/k-differs", RuntimeError, r"q, k and v must share one dtype",
        lambda d: (lambda q, k, v: hstu(q, k.half(), v, t(GOOD, d), MSL, 0.5))(*QKV(d))),
    bad("hstu/dtype/attn_bias-int", TypeError, r"attn_bias must be bfloat16",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5,
                       attn_bias=torch.zeros(3, 1, MSL, MSL, dtype=torch.int32, device=d))),
    bad("hstu/dtype/seq_offsets-float", TypeError, r"seq_offsets must be int32 or int64, got Float",
        lambda d: hstu(*QKV(d), t(GOOD, d, torch.float32), MSL, 0.5)),
    bad("hstu/dtype/num_targets-float", TypeError, r"num_targets must be int32 or int64, got Float",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, num_targets=t([1, 1, 1], d, torch.float32))),
    bad("hstu/rank/q-2d", RuntimeError, r"q, k and v must be 3-D",
        lambda d: (lambda q, k, v: hstu(q[:, 0], k, v, t(GOOD, d), MSL, 0.5))(*QKV(d))),
    bad("hstu/rank/seq_offsets-2d", RuntimeError, r"seq_offsets must be 1-D with B \+ 1 entries",
        lambda d: hstu(*QKV(d), t([GOOD], d), MSL, 0.5)),
    bad("hstu/rank/num_targets-2d", RuntimeError, r"num_targets must be 1-D with B = 3 entries",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, num_targets=t([[1, 1, 1]], d))),
    bad("hstu/rank/attn_bias-3d", RuntimeError, r"attn_bias must have shape \(B, 1 or H, max_seq_len, max_seq_len\)",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, attn_bias=rand(3, MSL, MSL, d=d))),
    bad("hstu/size/heads-differ", RuntimeError, r"same number of heads",
        lambda d: (lambda q, k, v: hstu(q, k[:, :1], v, t(GOOD, d), MSL, 0.5))(*QKV(d))),
    bad("hstu/size/k-head-dim-differs", RuntimeError, r"k's head dim must equal q's",
        lambda d: (lambda q, k, v: hstu(q, rand(HL, HH, 64, d=d), v, t(GOOD, d), MSL, 0.5))(*QKV(d))),
    bad("hstu/size/rows-differ", RuntimeError, r"k and v must have the same number of rows",
        lambda d: (lambda q, k, v: hstu(q, k, v[:-1], t(GOOD, d), MSL, 0.5))(*QKV(d))),
    bad("hstu/size/q-rows-differ", RuntimeError, r"q, k and v must have the same number of rows",
        lambda d: (lambda q, k, v: hstu(q[:-1], k, v, t(GOOD, d), MSL, 0.5))(*QKV(d))),
    same("hstu/head-dim/16", lambda d: _hstu_same(*QKV(d, dqk=16, dv=16), t(GOOD, d)), **HTOL),
    same("hstu/head-dim/48-dv-25", lambda d: _hstu_same(*QKV(d, dqk=48, dv=25), t(GOOD, d)), **HTOL),
    same("hstu/head-dim/1-bf16", lambda d: _hstu_same(*QKV(d, dqk=1, dv=1, dtype=torch.bfloat16), t(GOOD, d)),
         rtol=2e-2, atol=2e-2),
    bad("hstu/limit/head-dim-0", RuntimeError, r"head dims must lie in \[1, 256\], got Dqk=0",
        lambda d: hstu(*QKV(d, dqk=0), t(GOOD, d), MSL, 0.5)),
    bad("hstu/limit/head-dim-512", RuntimeError, r"head dims must lie in \[1, 256\], got Dqk=512",
        lambda d: hstu(*QKV(d, dqk=512, dv=512), t(GOOD, d), MSL, 0.5)),
    bad("hstu/limit/dv-257", RuntimeError, r"head dims must lie in \[1, 256\], got Dqk=32 Dv=257",
        lambda d: hstu(*QKV(d, dv=257), t(GOOD, d), MSL, 0.5)),
    bad("hstu/limit/dv-257-bf16", RuntimeError, r"head dims must lie in \[1, 256\], got Dqk=32 Dv=257",
        lambda d: hstu(*QKV(d, dv=257, dtype=torch.bfloat16), t(GOOD, d), MSL, 0.5)),
    bad("hstu/dropout/p-negative", ValueError, r"hstu_attention: dropout_p must lie in \[0, 1\), got -0.1",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, dropout_p=-0.1)),
    bad("hstu/dropout/p-1", ValueError, r"hstu_attention: dropout_p must lie in \[0, 1\), got 1.0",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, dropout_p=1.0)),
    bad("hstu/dropout/p-nan", ValueError, r"hstu_attention: dropout_p must lie in \[0, 1\), got nan",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, dropout_p=float("nan"))),
    bad("hstu/dropout/op-p-1", ValueError, r"hstu_attention: dropout_p must lie in \[0, 1\), got 1",
        lambda d: torch.ops.torchfuse.hstu_fwd(*QKV(d), t(GOOD, d), None, None, MSL, 0.5, None, 0, 0, 0, 1, 0, True,
                                               None, 1.0, t([1, 0], d))),
    bad("hstu/dropout/gr-dropout_pr-1", ValueError, r"dropout_p must lie in \[0, 1\), got 1.0",
        lambda d: gr.hstu_mha(MSL, 0.5, *QKV(d), t(GOOD, d), dropout_pr=1.0)),
    bad("hstu/dropout/rng_state-shape", RuntimeError, r"rng_state must be int64 of shape \(2,\)",
        lambda d: torch.ops.torchfuse.hstu_fwd(*QKV(d), t(GOOD, d), None, None, MSL, 0.5, None, 0, 0, 0, 1, 0, True,
                                               None, 0.5, t([1, 0, 0], d))),
    bad("hstu/limit/max_seq_len-negative", RuntimeError, r"max_seq_len must be >= 0, got -1",
        lambda d: hstu(*QKV(d), t(GOOD, d), -1, 0.5)),
    bad("hstu/limit/max_seq_len-2^30", RuntimeError, r"max_seq_len too large",
        lambda d: hstu(*QKV(d), t(GOOD, d), 2**30, 0.5)),
    bad("hstu/limit/scaling_seqlen-0", RuntimeError, r"scaling_seqlen must be > 0, got 0",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, scaling_seqlen=0)),
    bad("hstu/limit/target_group_size-0", RuntimeError, r"target_group_size must be >= 1, got 0",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, target_group_size=0)),
    bad("hstu/limit/contextual_seq_len-negative", RuntimeError, r"contextual_seq_len, max_attn_len and .* must be >= 0",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, contextual_seq_len=-1)),
    bad("hstu/value/alpha-nan", RuntimeError, r"alpha must be finite, got nan",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, float("nan"))),
    bad("hstu/size/num_targets-batch", RuntimeError, r"num_targets must be 1-D with B = 3 entries, got shape \[2\]",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, num_targets=t([1, 1], d))),
    bad("hstu/size/seq_offsets-for-num_targets", RuntimeError,
        r"num_targets must be 1-D with B = 2 entries, got shape \[3\]",
        lambda d: hstu(*QKV(d), t([0, 5, 10], d), MSL, 0.5, num_targets=t([1, 1, 1], d))),
    bad("hstu/size/seq_offsets-for-attn_bias", RuntimeError,
        r"attn_bias must have shape \(B, 1 or H, max_seq_len, max_seq_len\) = \(4,",
        lambda d: hstu(*QKV(d), t([0, 3, 5, 7, 10], d), MSL, 0.5, attn_bias=rand(3, 1, MSL, MSL, d=d))),
    bad("hstu/size/attn_bias-heads", RuntimeError, r"attn_bias must have shape",
        lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, attn_bias=rand(3, 3, MSL, MSL, d=d))),
    bad("hstu/size/seq_offsets-empty", RuntimeError, r"seq_offsets must be 1-D with B \+ 1 entries, got shape \[0\]",
        lambda d: hstu(*QKV(d), t([], d), MSL, 0.5)),
    bad("hstu/size/cached-delta_q-rows", ValueError, r"delta_q must have B \* D rows \(B = 3\), got 7",
        lambda d: (lambda q, k, v: hstu_cached(q[:7], k, v, t(GOOD, d), MSL, 0.5))(*QKV(d))),
    bad("hstu/size/cached-seq_offsets-empty", ValueError, r"hstu_attention_cached: seq_offsets must be 1-D with B \+ 1",
        lambda d: (lambda q, k, v: hstu_cached(q[:6], k, v, t([], d), MSL, 0.5))(*QKV(d))),
    bad("hstu/size/cached-seq_offsets-2d", ValueError, r"hstu_attention_cached: seq_offsets must be 1-D with B \+ 1",
        lambda d: (lambda q, k, v: hstu_cached(q[:6], k, v, t([GOOD], d), MSL, 0.5))(*QKV(d))),
    bad("hstu/value/gr-causal-false", NotImplementedError, r"hstu_mha: only causal=True",
        lambda d: gr.hstu_mha(MSL, 0.5, *QKV(d), t(GOOD, d), causal=False)),
    same("hstu/empty/B0", lambda d: (hstu(*QKV(d, rows=0), t([0], d), 0, 1.0), torch.zeros(0, HH, HD, device=d))),
    same("hstu/empty/zero-length-sequences", lambda d: _hstu_same(*QKV(d), t([0, 0, 4, 4, 4, 10], d), 6), **HTOL),
    same("hstu/empty/cached-B0", lambda d: (hstu_cached(*QKV(d, rows=0), t([0], d), MSL, 0.5),
                                            torch.zeros(0, HH, HD, device=d))),
    same("hstu/empty/cached-D0", lambda d: (hstu_cached(QKV(d)[0][:0], *QKV(d)[1:], t(GOOD, d), MSL, 0.5),
                                            torch.zeros(0, HH, HD, device=d))),
    same("hstu/noncontig/q-k-v", lambda d: _hstu_strided(d)),
    same("hstu/noncontig/seq_offsets", lambda d: (lambda q, k, v, o: (
        hstu(q, k, v, o, MSL, 0.5), hstu(q, k, v, o.contiguous(), MSL, 0.5)))(
        *QKV(d), t([0, 9, 3, 9, 7, 9, 10], d)[::2])),
    same("hstu/nonfinite/q-rows", lambda d: (lambda q, k, v: _hstu_same(nonfinite(q, (1, 4, 8)), k, v, t(GOOD, d)))(
        *QKV(d)), equal_nan=True, **HTOL),
    same("hstu/nonfinite/k-rows", lambda d: (lambda q, k, v: _hstu_same(q, nonfinite(k, (2, 5)), v, t(GOOD, d)))(
        *QKV(d)), equal_nan=True, **HTOL),
    cross("hstu/device/k", RuntimeError, r"k must be on the same device as q",
          lambda d: (lambda q, k, v: hstu(q, k.cpu(), v, t(GOOD, d), MSL, 0.5))(*QKV(d))),
    cross("hstu/device/seq_offsets", RuntimeError, r"seq_offsets must be on the same device as q",
          lambda d: hstu(*QKV(d), t(GOOD, "cpu"), MSL, 0.5)),
    cross("hstu/device/num_targets", RuntimeError, r"num_targets must be on the same device as q",
          lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, num_targets=t([1, 1, 1], "cpu"))),
    cross("hstu/device/attn_bias", RuntimeError, r"attn_bias must be on the same device as q",
          lambda d: hstu(*QKV(d), t(GOOD, d), MSL, 0.5, attn_bias=rand(3, 1, MSL, MSL, d="cpu"))),
    cross("hstu/dtype/float64-on-cuda", TypeError, r"q is float64, which only the CPU path supports",
          lambda d: hstu(*QKV(d, dtype=torch.float64), t(GOOD, d), MSL, 0.5)),
]


# ---------------------------------------------------------------- dynamic embeddings and bags

DIM = 4


def table(d, **kw):
    return torchfuse.DynamicEmbedding(DIM, 64, device=d, bucket_size=8, **kw)


def bag(d, **kw):
    return torchfuse.DynamicEmbeddingBag(DIM, 64, device=d, bucket_size=8, **kw)


def filled(d, cls=table, rows=None, **kw):
    """A table holding ids 0..15 with known rows (eval mode: lookups insert nothing)."""
    m = cls(d, **kw)
    w = rows if rows is not None else rand(16, DIM, d=d)
    m.insert(torch.arange(16, device=d), w)
    return m.eval(), w


def _bag_same(d, ids, offsets, rows=None, **kw):
    m, w = filled(d, bag, rows, **kw)
    with torch.no_grad():
        got = m(ids, offsets)
    return got, F.embedding_bag(ids, w, offsets, mode=m.mode, include_last_offset=m.include_last_offset)


def _noncontig_ids(d):
    m, w = filled(d)
    ids = t([3, 99, 7, 99, 0, 99, 15], d)[::2]
    with torch.no_grad():
        return m(ids), m(ids.contiguous())


def _extreme_ids(d):
    """Any int64 is a key, the extremes and -1 included."""
    m = table(d)
    keys, w = t([-1, 0, 2**63 - 1, -2**63, 12345], d), rand(5, DIM, d=d)
    m.insert(keys, w)
    with torch.no_grad():
        return (m.find(keys)[0], m.eval()(keys)), (w, w)


def _wide_bag(d):
    m = torchfuse.DynamicEmbeddingBag(1027, 16, device=d, bucket_size=8)
    w = rand(3, 1027, d=d)
    m.insert(torch.arange(3, device=d), w)
    ids, offsets = t([0, 1, 2], d), t([0, 2], d)
    with torch.no_grad():
        return m.eval()(ids, offsets), F.embedding_bag(ids, w, offsets, mode="sum")


def _insert_strided(d):
    w = rand(DIM, 6, d=d).t()  # (6, DIM), column-major
    m = table(d)
    m.insert(torch.arange(6, device=d), w)
    return m.find(torch.arange(6, device=d))[0], w


def _insert_nothing(d):
    m = table(d)
    m.insert(t([], d), rand(0, DIM, d=d))
    return torch.tensor(len(m)), torch.tensor(0)


BAD_BAG_OFFSETS = {  # over 3 ids
    "negative": [-1, 2],
    "decreasing": [0, 2, 1],
    "past-ids": [0, 4],
    "far-past-ids": [0, 2**40],
    "not-starting-at-0": [1, 2],
}

DYNEMB_ROWS = [
    bad("dynemb/dtype/forward-ids-float", TypeError, r"DynamicEmbedding: ids must be an integer tensor",
        lambda d: table(d)(t([1.0, 2.0], d, torch.float32))),
    bad("dynemb/dtype/find-keys-float", TypeError, r"keys must be an integer tensor",
        lambda d: table(d).find(t([1.0], d, torch.float64))),
    bad("dynemb/dtype/find_or_insert-keys-float", TypeError, r"keys must be an integer tensor",
        lambda d: table(d).find_or_insert(t([1.0], d, torch.float32))),
    bad("dynemb/dtype/contains-keys-bool", TypeError, r"keys must be an integer tensor",
        lambda d: table(d).contains(t([True], d, torch.bool))),
    bad("dynemb/dtype/erase-keys-float", TypeError, r"keys must be an integer tensor",
        lambda d: table(d).erase(t([1.0], d, torch.float32))),
    bad("dynemb/dtype/insert-keys-float", TypeError, r"keys must be an integer tensor",
        lambda d: table(d).insert(t([1.0], d, torch.float32), rand(1, DIM, d=d))),
    bad("dynemb/dtype/insert-scores-float", TypeError, r"scores must be an integer tensor",
        lambda d: table(d).insert(t([1], d), rand(1, DIM, d=d), scores=t([1.0], d, torch.float32))),
    bad("dynemb/dtype/bag-ids-float", TypeError, r"DynamicEmbeddingBag: ids must be an integer tensor",
        lambda d: bag(d)(t([1.0, 2.0], d, torch.float32), t([0], d))),
    bad("dynemb/dtype/bag-offsets-float", TypeError, r"offsets must be a 1-D int32 or int64 tensor",
        lambda d: bag(d)(t([1, 2], d), t([0.0], d, torch.float32))),
    bad("dynemb/dtype/constructor-int", TypeError, r"dtype must be float32, float16 or bfloat16",
        lambda d: table(d, dtype=torch.int32)),
    bad("dynemb/rank/bag-ids-2d-with-offsets", ValueError, r"ids must be 1-D with offsets",
        lambda d: bag(d)(t([[1, 2]], d), t([0], d))),
    bad("dynemb/rank/bag-ids-1d-without-offsets", ValueError, r"ids must be 2-D \(bags, ids per bag\) without offsets",
        lambda d: bag(d)(t([1, 2], d))),
    bad("dynemb/rank/bag-offsets-2d", TypeError, r"offsets must be a 1-D int32 or int64 tensor",
        lambda d: bag(d)(t([1, 2], d), t([[0]], d))),
    bad("dynemb/size/insert-values", ValueError, r"insert: values must be \(2, 4\), got \(2, 5\)",
        lambda d: table(d).insert(t([1, 2], d), rand(2, DIM + 1, d=d))),
    bad("dynemb/size/insert-scores", ValueError, r"insert: scores must have 2 entries, got 1",
        lambda d: table(d).insert(t([1, 2], d), rand(2, DIM, d=d), scores=t([1], d))),
    bad("dynemb/size/bag-per_sample_weights", ValueError, r"per_sample_weights must have the shape \(3,\)",
        lambda d: bag(d)(t([1, 2, 3], d), t([0], d), per_sample_weights=rand(2, d=d))),
    bad("dynemb/value/bag-per_sample_weights-mean", ValueError, r"per_sample_weights need mode='sum'",
        lambda d: bag(d, mode="mean")(t([1, 2, 3], d), t([0], d), per_sample_weights=rand(3, d=d))),
    bad("dynemb/size/bag-offsets-empty", ValueError, r"empty offsets with 3 ids",
        lambda d: bag(d)(t([1, 2, 3], d), t([], d))),
    bad("dynemb/size/bag-offsets-short-include_last_offset", ValueError,
        r"offsets must .* end at most at len\(ids\) = 3 \(exactly",
        lambda d: bag(d, include_last_offset=True)(t([1, 2, 3], d), t([0, 2], d))),
    bad("dynemb/limit/embedding_dim-0", ValueError, r"embedding_dim must be a positive int",
        lambda d: torchfuse.DynamicEmbedding(0, 64, device=d)),
    bad("dynemb/limit/capacity-0", ValueError, r"capacity must be a positive int",
        lambda d: torchfuse.DynamicEmbedding(DIM, 0, device=d)),
    bad("dynemb/limit/bucket_size-3", ValueError, r"bucket_size must be a power of two in \[4, 128\]",
        lambda d: torchfuse.DynamicEmbedding(DIM, 64, device=d, bucket_size=3)),
    bad("dynemb/limit/max_capacity-below", ValueError, r"max_capacity must be an int >= capacity",
        lambda d: table(d, max_capacity=8)),
    bad("dynemb/limit/max_load_factor", ValueError, r"max_load_factor must be in \(0, 1\]",
        lambda d: table(d, max_load_factor=1.5)),
    bad("dynemb/value/bag-mode", ValueError, r"mode must be 'sum' or 'mean'", lambda d: bag(d, mode="max")),
    bad("dynemb/value/initializer", ValueError, r"initializer", lambda d: table(d, initializer=("xavier",))),
    bad("dynemb/value/export-batch_size", ValueError, r"export: batch_size must be >= 1",
        lambda d: next(table(d).export(0))),
] + [
    bad(f"dynemb/offsets-{name}/bag-{mode}-{'train' if train else 'eval'}", ValueError,
        r"DynamicEmbeddingBag: offsets must start at 0, be non-decreasing and end at most at len\(ids\) = 3",
        lambda d, off=off, mode=mode, train=train: bag(d, mode=mode).train(train)(t([1, 2, 3], d), t(off, d)))
    for name, off in BAD_BAG_OFFSETS.items() for mode in ("sum", "mean") for train in (True, False)
] + [
    same("dynemb/empty/forward-no-ids", lambda d: (table(d)(t([], d)), torch.zeros(0, DIM, device=d))),
    same("dynemb/empty/forward-2d-no-ids", lambda d: (table(d)(torch.zeros(3, 0, dtype=torch.int64, device=d)),
                                                      torch.zeros(3, 0, DIM, device=d))),
    same("dynemb/empty/find-no-keys", lambda d: (table(d).find(t([], d))[0], torch.zeros(0, DIM, device=d))),
    same("dynemb/empty/insert-no-keys", _insert_nothing),
    same("dynemb/empty/bag-empty-bags", lambda d: _bag_same(d, t([3, 5], d), t([0, 0, 2, 2], d))),
    same("dynemb/empty/bag-no-ids", lambda d: _bag_same(d, t([], d), t([0, 0], d))),
    same("dynemb/empty/bag-B0", lambda d: _bag_same(d, t([], d), t([], d))),
    same("dynemb/empty/bag-2d-no-ids", lambda d: (bag(d).eval()(torch.zeros(2, 0, dtype=torch.int64, device=d)),
                                                  torch.zeros(2, DIM, device=d))),
    same("dynemb/empty/bag-mean-empty-bags", lambda d: _bag_same(d, t([3, 5], d), t([0, 2, 2], d), mode="mean")),
    same("dynemb/noncontig/ids", _noncontig_ids),
    same("dynemb/value/extreme-ids", _extreme_ids),
    same("dynemb/noncontig/insert-values", _insert_strided),
    same("dynemb/limit/embedding_dim-1027", _wide_bag),
    same("dynemb/nonfinite/find", lambda d: (lambda m, w: (m.find(t([0, 1, 2, 3, 4], d))[0], w[:5]))(
        *filled(d, rows=nonfinite(rand(16, DIM, d=d), (1, 2, 3)))), equal_nan=True),
    same("dynemb/nonfinite/bag-sum", lambda d: _bag_same(
        d, t([0, 1, 5, 2, 3, 4], d), t([0, 2, 3], d), rows=nonfinite(rand(16, DIM, d=d), (1, 2, 3))), equal_nan=True),
    same("dynemb/nonfinite/bag-mean", lambda d: _bag_same(d, t([0, 1, 5, 2, 3, 4], d), t([0, 2, 3], d),
                                                          rows=nonfinite(rand(16, DIM, d=d), (1, 3)), mode="mean"),
         equal_nan=True),
    cross("dynemb/device/ids", ValueError, r"ids must be on the table's device cuda",
          lambda d: table(d)(t([1], "cpu"))),
    cross("dynemb/device/insert-values", ValueError, r"insert: values must be on cuda",
          lambda d: table(d).insert(t([1], d), rand(1, DIM, d="cpu"))),
    cross("dynemb/device/bag-offsets", ValueError, r"offsets must be on cuda",
          lambda d: bag(d)(t([1, 2], d), t([0], "cpu"))),
]


# ---------------------------------------------------------------- TorchRec collections

KJT = tftr.StandInKJT


def tables_cfg(pooling=("sum", "mean")):
    return [SimpleNamespace(name="t_a", embedding_dim=3, num_embeddings=10, feature_names=["a"], pooling=pooling[0]),
            SimpleNamespace(name="t_b", embedding_dim=5, num_embeddings=10, feature_names=["b", "c"],
                            pooling=pooling[1])]


def ebc(d, **kw):
    return tftr.DynamicEmbeddingBagCollection(tables_cfg(), device=d, **kw)


def ec(d):
    return tftr.DynamicEmbeddingCollection(tables_cfg(), device=d)


def kjt(d, keys=("a", "b", "c"), lengths=(1, 2, 0, 1, 2, 1), n=None, values_dtype=torch.int64, weights=False):
    n = sum(lengths) if n is None else n
    vals = torch.randint(0, 10, (n,), device=d).to(values_dtype)
    return KJT(keys, vals, t(list(lengths), d), rand(n, d=d) if weights else None)


def _ebc_b0(d):
    m = ebc(d).eval()
    with torch.no_grad():
        out = m(kjt(d, lengths=()))
    return out.values(), torch.zeros(0, 3 + 5 + 5, device=d)


def _swap_the_collection_itself(d):
    try:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        mod = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=5,
                                                                feature_names=["f"])], device=torch.device(d))
    except Exception:  # torchrec absent (or its native deps fail to load): a stand-in, known by its class name
        mod = type("EmbeddingBagCollection", (torch.nn.Module,), {})()
    tftr.swap_embedding_modules(mod)


TORCHREC_ROWS = [
    bad("torchrec/keys/unknown", KeyError, r"the KJT has feature keys \['z'\] that no table reads",
        lambda d: ebc(d)(kjt(d, keys=("a", "b", "c", "z"), lengths=(1,) * 8))),
    bad("torchrec/keys/missing", KeyError, r"the KJT lacks feature keys \['c'\]",
        lambda d: ebc(d)(kjt(d, keys=("a", "b"), lengths=(1,) * 4))),
    bad("torchrec/keys/missing-collection", KeyError, r"the KJT lacks feature keys",
        lambda d: ec(d)(kjt(d, keys=("a", "b"), lengths=(1,) * 4))),
    bad("torchrec/lengths/not-adding-up", ValueError, r"the KJT's lengths do not match its values",
        lambda d: ebc(d)(kjt(d, n=5))),
    bad("torchrec/lengths/not-adding-up-collection", ValueError, r"the KJT's lengths do not match its values",
        lambda d: ec(d)(kjt(d, n=9))),
    bad("torchrec/lengths/negative", ValueError, r"the KJT's lengths do not match its values",
        lambda d: ebc(d)(kjt(d, lengths=(1, 2, 0, 1, -1, 4)))),
    bad("torchrec/lengths/negative-unbatched", ValueError, r"the KJT's lengths do not match its values",
        lambda d: ebc(d, table_batched=False)(kjt(d, lengths=(1, 2, 0, 1, -1, 4)))),
    bad("torchrec/lengths/count-not-keys-x-batch", ValueError, r"offsets/lengths must have 3 keys x 2 samples",
        lambda d: ebc(d)(kjt(d, lengths=(1, 2, 0, 1, 2, 1, 1)))),
    bad("torchrec/dtype/ids-float", TypeError, r"ids must be an integer tensor",
        lambda d: ebc(d)(kjt(d, values_dtype=torch.float32))),
    bad("torchrec/dtype/ids-float-collection", TypeError, r"ids must be an integer tensor",
        lambda d: ec(d)(kjt(d, values_dtype=torch.float32))),
    bad("torchrec/size/weights-count", ValueError, r"the KJT has 3 weights for 7 values",
        lambda d: ebc(d)(KJT(["a", "b", "c"], t([1] * 7, d), t([1, 2, 0, 1, 2, 1], d), rand(3, d=d)))),
    bad("torchrec/value/weights-with-mean", ValueError, r"table 't_b' has MEAN pooling but the KJT carries weights",
        lambda d: ebc(d)(kjt(d, weights=True))),
    bad("torchrec/value/no-tables", ValueError, r"tables must not be empty",
        lambda d: tftr.DynamicEmbeddingBagCollection([], device=d)),
    bad("torchrec/value/duplicate-tables", ValueError, r"duplicate table names",
        lambda d: tftr.DynamicEmbeddingCollection(tables_cfg()[:1] * 2, device=d)),
    bad("torchrec/value/pooling", ValueError, r"pooling must be SUM or MEAN, got MAX",
        lambda d: tftr.DynamicEmbeddingBagCollection(tables_cfg(("max", "sum")), device=d)),
    bad("torchrec/swap/the-collection-itself", TypeError, r"pass the model that contains the collection",
        _swap_the_collection_itself),
    bad("torchrec/swap/non-model", TypeError, r"swap_embedding_modules: model must be a torch.nn.Module, got str",
        lambda d: tftr.swap_embedding_modules("model")),
    same("torchrec/empty/B0", _ebc_b0),
    cross("torchrec/device/kjt", ValueError, r"ids must be on the table's device cuda",
          lambda d: ebc(d)(kjt("cpu"))),
    cross("torchrec/device/kjt-collection", ValueError, r"ids must be on the table's device cuda",
          lambda d: ec(d)(kjt("cpu"))),
]


# ---------------------------------------------------------------- HF patching

def _hf():
    return pytest.importorskip("transformers", reason="HF patching needs transformers (CI installs it)")


def _bert():
    tr = _hf()
    return tr.BertModel(tr.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=20))


def _llama():
    tr = _hf()
    return tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=20, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1))


HF_ROWS = [
    bad("hf/model/non-model", TypeError, r"patch_hf: model must be a transformers PreTrainedModel .*got Linear",
        lambda d: _hf() and torchfuse.patch_hf(torch.nn.Linear(2, 2))),
    bad("hf/model/string", TypeError, r"patch_hf: model must be a transformers PreTrainedModel .*got str",
        lambda d: _hf() and torchfuse.patch_hf("llama")),
    bad("hf/model/none", TypeError, r"patch_hf: pass a model or model_type=", lambda d: _hf() and torchfuse.patch_hf()),
    bad("hf/model/unsupported", ValueError, r"model type 'bert' is not supported",
        lambda d: torchfuse.patch_hf(_bert())),
    bad("hf/model_type/unsupported", ValueError, r"model type 'bert' is not supported",
        lambda d: _hf() and torchfuse.patch_hf(model_type="bert")),
    bad("hf/model_type/disagrees", ValueError, r"model_type='qwen2' but the model is 'llama'",
        lambda d: torchfuse.patch_hf(_llama(), model_type="qwen2")),
    bad("hf/unpatch/non-model", TypeError, r"unpatch_hf: model must be a torch.nn.Module, got str",
        lambda d: torchfuse.unpatch_hf("llama")),
]


# ---------------------------------------------------------------- jagged bmm, sampled softmax, STU layer

BMM = torchfuse.jagged_dense_bmm_broadcast_add
SSM = torchfuse.sampled_softmax_loss


def _stu(d):
    from torchfuse.nn import STULayer, STULayerConfig
    return STULayer(STULayerConfig(embedding_dim=8, num_heads=1, hidden_dim=8, attention_dim=8)).to(d)


LATER_ROWS = [
    bad("bmm/shape/jagged-columns", ValueError, r"jagged has 3 columns but dense has K = 4",
        lambda d: BMM(4, t([0, 2, 5], d), rand(5, 3, d=d), rand(2, 4, 3, d=d), rand(2, 3, d=d))),
    bad("bmm/shape/bias", ValueError, r"bias must be \(B, N\)",
        lambda d: BMM(4, t([0, 2, 5], d), rand(5, 4, d=d), rand(2, 4, 3, d=d), rand(3, 3, d=d))),
    bad("bmm/offsets/wrong-length", ValueError, r"seq_offsets must have B \+ 1 = 3 entries",
        lambda d: BMM(4, t([0, 5], d), rand(5, 4, d=d), rand(2, 4, 3, d=d), rand(2, 3, d=d))),
    bad("bmm/dtype/mixed", ValueError, r"one float dtype",
        lambda d: BMM(4, t([0, 2, 5], d), rand(5, 4, d=d), rand(2, 4, 3, d=d, dtype=torch.float16), rand(2, 3, d=d))),
    bad("bmm/max_seq_len/negative", ValueError, r"max_seq_len must be >= 0",
        lambda d: BMM(-1, t([0, 2, 5], d), rand(5, 4, d=d), rand(2, 4, 3, d=d), rand(2, 3, d=d))),
    bad("ssm/temperature/zero", RuntimeError, r"temperature must be a positive finite number",
        lambda d: SSM(rand(3, 4, d=d), rand(3, 4, d=d), rand(5, 4, d=d), 0.0)),
    bad("ssm/shape/positive", RuntimeError, r"positive must have the shape of query",
        lambda d: SSM(rand(3, 4, d=d), rand(2, 4, d=d), rand(5, 4, d=d), 0.05)),
    bad("ssm/shape/negatives", RuntimeError, r"negatives must be \(R, D\) or \(T, R, D\)",
        lambda d: SSM(rand(3, 4, d=d), rand(3, 4, d=d), rand(5, 3, d=d), 0.05)),
    bad("ssm/dtype/float-ids", TypeError, r"positive_ids must be int64 or int32",
        lambda d: SSM(rand(3, 4, d=d), rand(3, 4, d=d), rand(5, 4, d=d), 0.05, positive_ids=rand(3, d=d),
                      negative_ids=t(list(range(5)), d))),
    bad("ssm/shape/weights", RuntimeError, r"weights must be \(T,\)",
        lambda d: SSM(rand(3, 4, d=d), rand(3, 4, d=d), rand(5, 4, d=d), 0.05, weights=rand(4, d=d))),
    bad("ssm/dtype/int-query", TypeError, r"query must be float32, float16 or bfloat16",
        lambda d: SSM(t([[1, 2, 3, 4]] * 3, d), rand(3, 4, d=d), rand(5, 4, d=d), 0.05)),
    bad("stu/x/width", ValueError, r"x must be \(L, 8\)",
        lambda d: _stu(d)(rand(3, 9, d=d), t([3], d), t([0, 3], d), 3, None)),
    bad("stu/cache/empty", RuntimeError, r"the K/V cache is empty",
        lambda d: _stu(d).cached_forward(rand(2, 8, d=d), None)),
]


# hstu_preprocess (the STU layer's input section): E = 8, H = 2, attn_dim 3, hidden_dim 2 -> 20 columns
PRE = torchfuse.hstu_preprocess


def _pre(d, L=4, dtype=torch.float32, **bad_args):
    a = dict(x=rand(L, 8, d=d, dtype=dtype), norm_weight=W(d, dtype=dtype), norm_bias=W(d, dtype=dtype) - 1,
             eps=1e-6, uvqk_weight=rand(8, 20, d=d, dtype=dtype), uvqk_bias=rand(20, d=d, dtype=dtype), num_heads=2,
             attn_dim=3, hidden_dim=2)
    a.update(bad_args)
    return a


def _pre_ref(a):
    from torchfuse.reference import hstu_preprocess
    return hstu_preprocess(**{k: (v.double() if isinstance(v, torch.Tensor) else v)
                              for k, v in a.items()})


LATER_ROWS += [
    bad("stu/preprocess/x-int", TypeError, r"hstu_preprocess: x must be float32, bfloat16 or float16",
        lambda d: PRE(**_pre(d, x=t([[1] * 8] * 4, d)))),
    bad("stu/preprocess/norm_weight-dtype", TypeError, r"norm_weight must have x's dtype",
        lambda d: PRE(**_pre(d, norm_weight=W(d, dtype=torch.float16)))),
    bad("stu/preprocess/x-1d", ValueError, r"x must be 2-D \(L, E\)", lambda d: PRE(**_pre(d, x=rand(8, d=d)))),
    bad("stu/preprocess/norm_bias-size", ValueError, r"norm_bias must be \(8,\)",
        lambda d: PRE(**_pre(d, norm_bias=W(d, 7)))),
    bad("stu/preprocess/uvqk_weight-columns", ValueError, r"uvqk_weight must be .* = \(8, 20\), got \(8, 18\)",
        lambda d: PRE(**_pre(d, uvqk_weight=rand(8, 18, d=d)))),
    bad("stu/preprocess/uvqk_bias-size", ValueError, r"uvqk_bias must be \(20,\)",
        lambda d: PRE(**_pre(d, uvqk_bias=rand(21, d=d)))),
    bad("stu/preprocess/num_heads-0", ValueError, r"num_heads must be an int >= 1, got 0",
        lambda d: PRE(**_pre(d, num_heads=0))),
    bad("stu/preprocess/eps-0", ValueError, r"eps must be a positive finite number", lambda d: PRE(**_pre(d, eps=0.0))),
    same("stu/preprocess/empty-rows", lambda d: (lambda a: (PRE(**a), _pre_ref(a)))(_pre(d, L=0))),
    same("stu/preprocess/noncontig-x", lambda d: (lambda a: (
        PRE(**a), PRE(**dict(a, x=a["x"].contiguous()))))(_pre(d, x=rand(8, 4, d=d).t()))),
    same("stu/preprocess/noncontig-uvqk_weight", lambda d: (lambda a: (
        PRE(**a), _pre_ref(a)))(_pre(d, uvqk_weight=rand(20, 8, d=d).t())), rtol=1e-5, atol=1e-5),
    cross("stu/preprocess/uvqk_weight-device", RuntimeError, r"uvqk_weight must be on x's device",
          lambda d: PRE(**_pre(d, uvqk_weight=rand(8, 20, d="cpu")))),
    bad("stu/gr/preprocess_and_attention-noncausal", NotImplementedError, r"only causal=True",
        lambda d: gr.hstu_preprocess_and_attention(**dict(
            {k: v for k, v in _pre(d).items() if k != "eps"}, norm_eps=1e-6, uvqk_weight=rand(8, 20, d=d),
            max_seq_len=4, seq_offsets=t([0, 4], d), attn_alpha=0.5, causal=False, num_targets=None,
            max_attn_len=0, contextual_seq_len=0, recompute_uvqk_in_backward=False,
            recompute_normed_x_in_backward=False, sort_by_length=False))),
    bad("stu/gr/compute_output-concat_ux-and-concat_u", ValueError, r"pass concat_ux or concat_u / concat_x",
        lambda d: gr.hstu_compute_output(rand(2, 4, d=d), rand(2, 4, d=d), rand(2, 3, d=d), W(d, 4), W(d, 4), 1e-6,
                                         rand(12, 3, d=d), 1, 4, 0.0, False, concat_u=True, concat_ux=True)),
]


# ---------------------------------------------------------------- hstu_compute_output


def _hout(d, L=4, H=2, D=3, E=5, dtype=torch.float32, group_norm=False, concat=(True, True), **over):
    """Arguments of a valid hstu_compute_output call, with `over` replacing any of them."""
    n = H * D
    parts = (3 if all(concat) else 1) if group_norm else 1 + sum(concat)
    wn = H if group_norm else n
    a = dict(attn=rand(L, n, d=d, dtype=dtype), u=rand(L, n, d=d, dtype=dtype), x=rand(L, E, d=d, dtype=dtype),
             norm_weight=rand(wn, d=d), norm_bias=rand(wn, d=d), eps=1e-5, output_weight=rand(parts * n, E, d=d),
             num_heads=H, linear_dim=D, dropout_ratio=0.1, training=True, concat_u=concat[0], concat_x=concat[1],
             mul_u_activation_type="silu", group_norm=group_norm, seed=3)
    a.update(over)
    return a


def HOUT(a):
    pos = [a.pop(k) for k in ("attn", "u", "x", "norm_weight", "norm_bias", "eps", "output_weight")]
    return torchfuse.hstu_compute_output(*pos, **a)


def _hout_ref(a):
    a = dict(a)
    a.pop("seed")
    a["training"] = False
    pos = [a.pop(k) for k in ("attn", "u", "x", "norm_weight", "norm_bias", "eps", "output_weight")]
    from torchfuse import reference
    return reference.hstu_compute_output(*pos, **a)


def _hout_strided(d):
    a = _hout(d)
    b = dict(a, attn=torch.stack([a["attn"], a["attn"]], 2)[:, :, 0],  # column stride 2
             u=a["u"].t().contiguous().t())  # column-major
    return HOUT(b), HOUT(a)


HOUT_ROWS = [
    bad("hout/dtype/int", TypeError, r"attn must be float32, float16 or bfloat16",
        lambda d: HOUT(_hout(d, dtype=torch.int64))),
    bad("hout/dtype/mixed", TypeError, r"attn, u and x must share one dtype",
        lambda d: HOUT(_hout(d, u=rand(4, 6, d=d, dtype=torch.bfloat16)))),
    bad("hout/dtype/norm-params", TypeError, r"norm_weight and norm_bias must share one dtype",
        lambda d: HOUT(_hout(d, norm_bias=rand(6, d=d, dtype=torch.float16)))),
    bad("hout/shape/u", ValueError, r"u must have attn's shape",
        lambda d: HOUT(_hout(d, u=rand(4, 5, d=d)))),
    bad("hout/shape/x-rows", ValueError, r"x must have attn's 4 rows",
        lambda d: HOUT(_hout(d, x=rand(3, 5, d=d)))),
    bad("hout/shape/norm_weight", ValueError, r"norm_weight must be 1-D with 6 elements",
        lambda d: HOUT(_hout(d, norm_weight=rand(2, d=d)))),
    bad("hout/shape/norm_bias-group", ValueError, r"norm_bias must be 1-D with 2 elements \(one per head",
        lambda d: HOUT(_hout(d, group_norm=True, norm_bias=rand(6, d=d)))),
    bad("hout/shape/output_weight", ValueError, r"output_weight must be \(18, 5\)",
        lambda d: HOUT(_hout(d, output_weight=rand(12, 5, d=d)))),
    bad("hout/shape/attn-1d", ValueError, r"attn must be a 2-D tensor",
        lambda d: HOUT(_hout(d, attn=rand(6, d=d)))),
    bad("hout/group_norm/heads", ValueError, r"group_norm needs attn's width 6 = num_heads \* linear_dim",
        lambda d: HOUT(_hout(d, group_norm=True, num_heads=4))),
    bad("hout/activation/unknown", ValueError, r"mul_u_activation_type must be 'none', 'silu' or 'sigmoid'",
        lambda d: HOUT(_hout(d, mul_u_activation_type="relu"))),
    bad("hout/dropout/one", ValueError, r"dropout_ratio must be in \[0, 1\)",
        lambda d: HOUT(_hout(d, dropout_ratio=1.0))),
    bad("hout/dropout/negative", ValueError, r"dropout_ratio must be in \[0, 1\)",
        lambda d: HOUT(_hout(d, dropout_ratio=-0.1, training=False))),
    bad("hout/eps/zero", ValueError, r"eps must be a positive finite number",
        lambda d: HOUT(_hout(d, eps=0.0))),
    same("hout/empty/L0", lambda d: (HOUT(_hout(d, L=0)), _hout_ref(_hout(d, L=0)))),
    same("hout/strided/attn-u", _hout_strided, rtol=0, atol=0),
    cross("hout/device/norm_weight", RuntimeError, r"norm_weight must be on the same device as attn",
          lambda d: HOUT(_hout(d, norm_weight=rand(6, d="cpu")))),
]


# ---------------------------------------------------------------- the test

ROWS = NORM_ROWS + JAGGED_ROWS + HSTU_ROWS + DYNEMB_ROWS + TORCHREC_ROWS + HF_ROWS + LATER_ROWS + HOUT_ROWS


def _sync(device):
    if device != "cpu":
        torch.cuda.synchronize()


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(device, row):
    if row.kind == "cross":
        if device == "cpu":
            pytest.skip("a second device is needed: this row runs on CUDA machines")
        with pytest.raises(row.exc, match=row.match):
            row.call(device)
    elif row.kind == "bad" or (row.kind == "unchecked" and device == "cpu"):
        with pytest.raises(row.exc, match=row.match):
            row.call(device)
            _sync(device)
    elif row.kind == "unchecked":
        row.call(device)  # results unspecified; runs without a fault (memcheck on the GPU machine)
        _sync(device)
        if row.validate is not None:
            with pytest.raises(row.vexc, match=row.vmatch):
                row.validate(device)
    else:
        got, want = row.call(device)
        for g, w in zip(got if isinstance(got, (tuple, list)) else [got],
                        want if isinstance(want, (tuple, list)) else [want]):
            assert g.shape == w.shape and g.device == w.device, (g.shape, w.shape, g.device, w.device)
            torch.testing.assert_close(g, w.to(g.dtype), **(row.tol or {}))


def test_rows_are_unique_and_cover_every_family():
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids))
    families = {i.split("/")[0] for i in ids}
    assert families == {"norm", "jagged", "hstu", "dynemb", "torchrec", "hf", "bmm", "ssm", "stu", "hout"}
    exported = set(torchfuse.jagged.__dict__) & set(torchfuse.__all__)
    tried = {i.split("/")[-1].split("-")[0] for i in ids if i.startswith("jagged/offsets-")}
    # jagged_dense_bmm_broadcast_add reads its offsets through jagged_to_padded_dense and dense_to_jagged,
    # whose offset rows cover them; its own checks are the bmm/ rows
    assert {n for n in exported if n not in ("complete_cumsum", "jagged_index_select", "validate_jagged",
                                             "jagged_dense_bmm_broadcast_add")} <= tried

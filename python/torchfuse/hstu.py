"""HSTU attention (pointwise SiLU attention over jagged sequences): entry points, fake kernels, autograd.

The compute is ``torch.ops.torchfuse.hstu_fwd`` / ``hstu_bwd`` (csrc/hstu*.cpp, kernels/hstu*).
"""
from typing import Optional

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.torchfuse)
from . import backends
from ._autograd import function_for
from ._stats import count

_fwd = torch.ops.torchfuse.hstu_fwd.default
_bwd = torch.ops.torchfuse.hstu_bwd.default
_bwd_into = torch.ops.torchfuse.hstu_bwd_into.default
_dropout_state = torch.ops.torchfuse.hstu_dropout_state.default


def _check_dropout_p(op: str, dropout_p: float) -> None:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"torchfuse.{op}: dropout_p must lie in [0, 1), got {dropout_p!r}")


def hstu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    alpha: float,
    *,
    num_targets: Optional[Tensor] = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    min_full_attn_seq_len: int = 0,
    target_group_size: int = 1,
    scaling_seqlen: Optional[int] = None,
    attn_bias: Optional[Tensor] = None,
    validate: bool = True,
    dropout_p: float = 0.0,
    training: bool = True,
    seed: Optional[int] = None,
) -> Tensor:
    """HSTU attention ("Actions Speak Louder than Words", Zhai et al. 2024) over jagged sequences.

    Per sequence b (rows ``seq_offsets[b]:seq_offsets[b+1]``) and head h, with
    ``z = alpha * (Q K^T + attn_bias)``: ``O = (M * SiLU(z)) / S @ V``, ``S = scaling_seqlen`` if
    given, else ``max_seq_len``. M is generative-recommenders' causal mask (``_get_valid_attn_mask``):
    with ``c = contextual_seq_len`` context tokens first and ``t = num_targets[b]`` targets last
    (``u = n - t``), context rows see every non-target key, history rows see keys ``q <= p``, target
    rows see the history and themselves (and, with ``target_group_size = g > 1``, the earlier targets
    of their group of g); ``max_attn_len = m > 0`` keeps only pairs whose renumbered positions are at
    most m apart (context rows exempt; with ``min_full_attn_seq_len = f > 0`` also rows ``p >= u - f``).

    Args:
        q, k: (L, H, Dqk); v: (L, H, Dv); bf16/fp16 (tensor cores on CUDA), fp32, or fp64 (CPU).
            Any head dims from 1 to 256; Dqk may differ from Dv. On CUDA the 16-bit kernels take
            multiples of 8 directly; other dims run on a copy zero-padded to the next multiple of 8
            (exact; the copy is one extra pass over q, k and v, which a model avoids with a multiple
            of 8).
        seq_offsets: (B + 1,) int32/int64, non-decreasing; sequence lengths at most ``max_seq_len``.
        num_targets: (B,) int32/int64 or None.
        attn_bias: (B, 1 or H, max_seq_len, max_seq_len) or None, indexed by position in the sequence.
        validate: check offsets, lengths (<= max_seq_len) and num_targets, raising clear errors; on a GPU
            that is one small device-to-host copy (a sync). Pass False in a training loop whose jagged
            metadata is known good (GR's kernels never check): bad metadata then gives unspecified
            results, though the kernels clamp what they read to the tensors (no out-of-bounds access).
            On the CPU the checks always run (they cost nothing there).
        dropout_p, training, seed: dropout on the attention weights (after SiLU, mask and 1 / S; kept
            weights scaled by 1 / (1 - dropout_p)) when ``training`` and ``dropout_p > 0``, as
            generative-recommenders' ``F.dropout`` there. The mask comes from Philox4x32-10 keyed by
            ``(seed, offset)`` and each element's (row, head, column), and is regenerated in the
            backward, never stored. ``seed=None`` draws seed and offset from torch's default generator
            of q's device as PyTorch's fused dropout does (CUDA-graph safe); an explicit seed gives the
            same mask on the CPU and on CUDA. On CUDA, dropout runs on the mma.sync kernels on every GPU
            (the sm_90a wgmma kernels have no dropout form yet).

    Returns:
        (L, H, Dv) in q's dtype. Differentiable in q, k, v and attn_bias (its gradient is summed over
        heads when it has one head).

    The CUDA kernels follow ``torchfuse.backends.hstu`` (see :mod:`torchfuse.backends`).
    """
    count("hstu_fwd")
    _check_dropout_p("hstu_attention", dropout_p)
    args = (q, k, v, seq_offsets, num_targets, attn_bias, max_seq_len, alpha, scaling_seqlen,
            contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size, 0, validate,
            backends.hstu)
    if training and dropout_p > 0.0:
        args += (float(dropout_p), _dropout_state(q, seed))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                    (attn_bias is not None and attn_bias.requires_grad)):
        return _HstuAttention.apply(*args)  # see _autograd.py: the same gradients, less host time
    return _fwd(*args)


def hstu_attention_cached(
    delta_q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    alpha: float,
    *,
    num_targets: Optional[Tensor] = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    min_full_attn_seq_len: int = 0,
    target_group_size: int = 1,
    scaling_seqlen: Optional[int] = None,
    attn_bias: Optional[Tensor] = None,
    validate: bool = True,
    kv_lengths: Optional[Tensor] = None,
) -> Tensor:
    """Cached inference: the rows of :func:`hstu_attention` for the last D tokens of every sequence.

    ``delta_q`` is (B * D, H, Dqk): row ``b * D + i`` is the query at position ``n_b - D + i`` of
    sequence b; k and v are the full jagged tensors. Returns (B * D, H, Dv), equal to those rows of the
    full computation (same mask rows, same S); rows at negative positions (n_b < D) are zero.
    Inference only (no backward).

    ``kv_lengths`` (B,) int32/int64, optional: sequence b is then the first ``kv_lengths[b]`` rows of its
    ``seq_offsets`` span (n_b = kv_lengths[b]), so a cache can keep room after each sequence and grow in
    place (``STULayer.reserve_kv_cache``).
    """
    count("hstu_fwd")
    if not isinstance(seq_offsets, Tensor) or seq_offsets.dim() != 1 or seq_offsets.shape[0] < 1:
        raise ValueError("torchfuse.hstu_attention_cached: seq_offsets must be 1-D with B + 1 entries, got "
                         f"{tuple(seq_offsets.shape) if isinstance(seq_offsets, Tensor) else type(seq_offsets).__name__}")
    B = seq_offsets.shape[0] - 1
    if (B == 0 and delta_q.shape[0] != 0) or (B > 0 and delta_q.shape[0] % B != 0):
        raise ValueError(f"torchfuse.hstu_attention_cached: delta_q must have B * D rows (B = {B}), "
                         f"got {delta_q.shape[0]}")
    # an empty batch takes any D: 1 lets the op check the other arguments and return (0, H, Dv)
    D = delta_q.shape[0] // B if B > 0 else 1
    if D == 0:
        return delta_q.new_empty((0, k.shape[1], v.shape[2]))
    return _fwd(delta_q, k, v, seq_offsets, num_targets, attn_bias, max_seq_len, alpha, scaling_seqlen,
                contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size, D, validate,
                backends.hstu, kv_lengths=kv_lengths)


# ---- fake (meta) kernels: shapes and dtypes only, for torch.compile and meta tensors ----


@torch.library.register_fake("torchfuse::hstu_fwd")
def _hstu_fwd_fake(q, k, v, seq_offsets, num_targets, attn_bias, max_seq_len, alpha, scaling_seqlen,
                   contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size, delta, validate=True,
                   backend=None, dropout_p=0.0, rng_state=None, kv_lengths=None):
    torch._check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
                 lambda: "torchfuse.hstu_attention: q, k, v must be 3-D")
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.register_fake("torchfuse::hstu_bwd")
def _hstu_bwd_fake(dout, q, k, v, seq_offsets, num_targets, attn_bias, max_seq_len, alpha, scaling_seqlen,
                   contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size, bias_grad, backend=None,
                   dropout_p=0.0, rng_state=None):
    db = attn_bias.new_empty(attn_bias.shape) if bias_grad else q.new_empty(0, dtype=torch.float32)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), db


@torch.library.register_fake("torchfuse::hstu_bwd_into")
def _hstu_bwd_into_fake(dout, q, k, v, seq_offsets, num_targets, attn_bias, max_seq_len, alpha, scaling_seqlen,
                        contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size, dq, dk, dv,
                        backend=None, dropout_p=0.0, rng_state=None):
    return None


@torch.library.register_fake("torchfuse::hstu_dropout_state")
def _hstu_dropout_state_fake(like, seed=None):
    return like.new_empty((2,), dtype=torch.int64)


# ---- autograd ----


def _setup_context(ctx, inputs, output):
    (q, k, v, seq_offsets, num_targets, attn_bias, max_seq_len, alpha, scaling_seqlen, c, m, f, g, delta) = inputs[:14]
    dropout_p = inputs[16] if len(inputs) > 16 else 0.0
    rng_state = inputs[17] if len(inputs) > 17 else None
    ctx.save_for_backward(q, k, v, seq_offsets, num_targets, attn_bias, rng_state)
    ctx.opts = (max_seq_len, alpha, scaling_seqlen, c, m, f, g)
    ctx.delta = delta
    ctx.backend = inputs[15] if len(inputs) > 15 else None  # the backward runs the forward's selection
    ctx.dropout_p = dropout_p


def _grads_like(q: Tensor, k: Tensor, v: Tensor):
    """dq, dk, dv as views of one new buffer laid out as q, k, v lie in theirs, when q, k, v are disjoint
    column views of one row-major buffer (a fused projection's output, as hstu_preprocess makes them):
    the projection's backward then reads the three gradients as one tensor, no concatenation. None
    otherwise, and while tracing (fake tensors have no storage to compare). None too where the 16-bit CUDA
    kernels run on copies padded to head dims of multiples of 8 (csrc/hstu_cuda.cpp, kernel_head_dim):
    their gradients would be copied in, three copies where the projection's concatenation is one."""
    ts = (q, k, v)
    if torch.compiler.is_compiling() or any(type(t) is not Tensor for t in ts) or q.shape[0] < 2:
        return None
    if q.is_cuda and q.element_size() == 2 and (q.shape[2] % 8 or v.shape[2] % 8):
        return None
    storage = q.untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() or t.dtype != q.dtype for t in ts[1:]):
        return None
    sr = q.stride(0)
    if any(t.dim() != 3 or t.shape[0] != q.shape[0] or t.stride() != (sr, t.shape[2], 1) for t in ts):
        return None
    spans = sorted((t.storage_offset() % sr, t.shape[1] * t.shape[2]) for t in ts)
    if any(a + w > b for (a, w), (b, _) in zip(spans, spans[1:])) or spans[-1][0] + spans[-1][1] > sr:
        return None
    elems = storage.nbytes() // q.element_size()
    if elems > 2 * sum(t.numel() for t in ts):  # views of a much larger buffer: not worth its size
        return None
    buf = q.new_empty(elems)
    return tuple(buf.as_strided(t.shape, t.stride(), t.storage_offset()) for t in ts)


def _backward(ctx, dout):
    if ctx.delta != 0:
        raise RuntimeError("torchfuse.hstu_attention_cached is inference-only; use hstu_attention for training")
    q, k, v, seq_offsets, num_targets, attn_bias, rng_state = ctx.saved_tensors
    need = ctx.needs_input_grad
    bias_grad = attn_bias is not None and need[5]
    grads = None if bias_grad or not all(need[:3]) else _grads_like(q, k, v)
    if grads is not None:
        dq, dk, dv = grads
        _bwd_into(dout, q, k, v, seq_offsets, num_targets, attn_bias, *ctx.opts, dq, dk, dv, ctx.backend,
                  ctx.dropout_p, rng_state)
        return (dq, dk, dv) + (None,) * (len(need) - 3)
    dq, dk, dv, db = _bwd(dout, q, k, v, seq_offsets, num_targets, attn_bias, *ctx.opts, bias_grad, ctx.backend,
                          ctx.dropout_p, rng_state)
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None,
            db if bias_grad else None) + (None,) * (len(need) - 6)


torch.library.register_autograd("torchfuse::hstu_fwd", _backward, setup_context=_setup_context)
_HstuAttention = function_for("HstuAttention", _fwd, _setup_context, _backward)

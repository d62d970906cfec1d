"""Jagged tensor ops: Python entry points, fake kernels and autograd.

A jagged tensor is ``values`` of shape (T, *D) plus ``offsets`` of shape (B+1,): sample b owns rows
``offsets[b]:offsets[b+1]``. Offsets may be int32 or int64; values any float dtype, or int32 / int64
for the ops that only move rows (everything except jagged_dense_add / mul).

The compute is ``torch.ops.torchfuse.*`` (csrc/jagged.cpp, kernels/jagged_*). On the CPU every op
validates its offsets (start at 0, non-decreasing, in range) and raises on bad ones; on the GPU the
kernels never read or write out of bounds whatever the offsets hold, but do not check them (that
would cost a device sync): call :func:`validate_jagged` where the offsets are not trusted.

Sizes that shape an output (``total_length``, ``total_len_left`` ...) may be passed in; then no op
waits on the GPU. Without them, the ops that must size an output from the offsets read
``offsets[-1]`` (one device-to-host sync).
"""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.torchfuse)
from ._autograd import function_for
from ._stats import count

_ops = torch.ops.torchfuse


def complete_cumsum(lengths: Tensor) -> Tensor:
    """Offsets (B+1,) from lengths (B,): ``[0, l0, l0+l1, ...]``, in lengths' dtype (int32 / int64)."""
    count("complete_cumsum")
    return _ops.complete_cumsum(lengths)


def jagged_to_padded_dense(values: Tensor, offsets: Tensor, max_length: int, padding_value: float = 0.0) -> Tensor:
    """(T, *D) jagged -> (B, max_length, *D) dense; rows past a sample's length are ``padding_value``.
    Rows at positions >= max_length are dropped (their gradient is 0). Differentiable in values."""
    count("jagged_to_padded_dense")
    return _call("jagged_to_padded_dense", values, offsets, max_length, padding_value)


def dense_to_jagged(dense: Tensor, offsets: Tensor, total_length: Optional[int] = None) -> Tensor:
    """(B, L, *D) dense -> (T, *D) jagged with T = total_length (default offsets[-1], a device sync).
    Row ``offsets[b] + p`` is ``dense[b, p]``; positions p >= L give zeros. Differentiable in dense."""
    count("dense_to_jagged")
    return _call("dense_to_jagged", dense, offsets, total_length)


def jagged_dense_add(values: Tensor, offsets: Tensor, dense: Tensor) -> Tensor:
    """Jagged ``values[offsets[b] + p] + dense[b, p]`` (dense (B, L, *D), same dtype); positions
    p >= L keep ``values``. Float dtypes only; differentiable in values and dense."""
    count("jagged_dense_add")
    return _call("jagged_dense_add", values, offsets, dense)


def jagged_dense_mul(values: Tensor, offsets: Tensor, dense: Tensor) -> Tensor:
    """Jagged ``values[offsets[b] + p] * dense[b, p]``; positions p >= L become 0."""
    count("jagged_dense_mul")
    return _call("jagged_dense_mul", values, offsets, dense)


def concat_2d_jagged(
    values_left: Tensor,
    offsets_left: Optional[Tensor],
    values_right: Tensor,
    offsets_right: Optional[Tensor],
    max_len_left: Optional[int] = None,
    max_len_right: Optional[int] = None,
    n_prefix_from_right: int = 0,
) -> Tuple[Tensor, Tensor]:
    """Per-sample concatenation: sample b of the result is ``[right_b[:P]; left_b; right_b[P:]]`` with
    P = n_prefix_from_right. Returns ``(values, offsets)`` with offsets = offsets_left + offsets_right.

    Either offsets may be None, or both: that side is dense, every sample has exactly its max_len rows
    (values shaped (B * max_len, *D), as in generative-recommenders). max_len of a jagged side is not
    needed (the kernel is sized by rows, not by max_len x B). Every row of each input must belong to a
    sample (offsets[-1] = T).
    Never syncs. Differentiable in both values."""
    count("concat_2d_jagged")
    return _call("concat_2d_jagged", values_left, offsets_left, values_right, offsets_right, max_len_left,
                                 max_len_right, n_prefix_from_right)


def split_2d_jagged(
    values: Tensor,
    offsets_left: Optional[Tensor],
    offsets_right: Optional[Tensor],
    max_len_left: Optional[int] = None,
    max_len_right: Optional[int] = None,
    n_prefix_to_right: int = 0,
    total_len_left: Optional[int] = None,
    total_len_right: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """The exact inverse of :func:`concat_2d_jagged`: returns ``(values_left, values_right)``.
    Either offsets may be None (that side dense, max_len rows per sample); with both None, values has
    B * (max_len_left + max_len_right) rows. With a dense side, or with total_len_left /
    total_len_right given, no device sync; otherwise offsets_left[-1] is read. Differentiable in values."""
    count("split_2d_jagged")
    return _call("split_2d_jagged", values, offsets_left, offsets_right, max_len_left, max_len_right,
                                n_prefix_to_right, total_len_left, total_len_right)


def jagged_concat(values_list: Sequence[Tensor], offsets_list: Sequence[Tensor]) -> Tuple[Tensor, Tensor]:
    """N-way per-sample concatenation: sample b of the result is ``[v0_b; v1_b; ...]``. Returns
    ``(values, offsets)``, offsets = sum of the offsets. Never syncs. Differentiable in every values."""
    count("jagged_concat")
    if len(values_list) == 0:  # the op would get no tensor to dispatch on: an unclear dispatcher error
        raise ValueError("torchfuse.jagged_concat: values_list must not be empty")
    return _ops.jagged_concat(list(values_list), list(offsets_list))


def jagged_split(values: Tensor, offsets_list: Sequence[Tensor], totals: Sequence[int]) -> List[Tensor]:
    """The inverse of :func:`jagged_concat`: part i has totals[i] rows and offsets offsets_list[i]."""
    count("jagged_split")
    return _ops.jagged_split(values, list(offsets_list), list(totals))


def jagged_index_select(values: Tensor, lengths: Tensor, indices: Tensor,
                        total_length: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Gathers whole samples: sample k of the result is sample ``indices[k]`` of the input (given by
    its lengths). Returns ``(values, lengths)``. total_length (the selected rows, default read from
    the device) spares a sync. Differentiable in values (repeated indices add up)."""
    count("jagged_index_select")
    return _call("jagged_index_select", values, lengths, indices, total_length)


def jagged_dense_bmm_broadcast_add(max_seq_len: int, seq_offsets: Tensor, jagged: Tensor, dense: Tensor,
                                   bias: Tensor) -> Tensor:
    """generative-recommenders' ``jagged_dense_bmm_broadcast_add``: per sequence b, rows
    ``jagged[seq_offsets[b]:seq_offsets[b+1]] @ dense[b] + bias[b]``. jagged (T, K), dense (B, K, N), bias
    (B, N), one float dtype; returns (T, N). Rows at positions >= max_seq_len give zeros (as GR's padded
    formulation). Computed as jagged_to_padded_dense, one batched GEMM with the bias in its epilogue (fp32
    accumulation, one rounding) and dense_to_jagged; differentiable in jagged, dense and bias."""
    count("jagged_dense_bmm_broadcast_add")
    name = "torchfuse.jagged_dense_bmm_broadcast_add"
    if jagged.dim() != 2 or dense.dim() != 3 or bias.dim() != 2:
        raise ValueError(f"{name}: jagged must be (T, K), dense (B, K, N) and bias (B, N), got {tuple(jagged.shape)}, "
                         f"{tuple(dense.shape)} and {tuple(bias.shape)}")
    B, K, N = dense.shape
    if jagged.shape[1] != K:
        raise ValueError(f"{name}: jagged has {jagged.shape[1]} columns but dense has K = {K} rows per sequence")
    if tuple(bias.shape) != (B, N):
        raise ValueError(f"{name}: bias must be (B, N) = {(B, N)}, got {tuple(bias.shape)}")
    if seq_offsets.dim() != 1 or seq_offsets.numel() != B + 1:
        raise ValueError(f"{name}: seq_offsets must have B + 1 = {B + 1} entries (B from dense), got shape "
                         f"{tuple(seq_offsets.shape)}")
    if not (jagged.dtype == dense.dtype == bias.dtype) or not jagged.is_floating_point():
        raise ValueError(f"{name}: jagged, dense and bias must share one float dtype, got {jagged.dtype}, "
                         f"{dense.dtype} and {bias.dtype}")
    if not (jagged.device == dense.device == bias.device == seq_offsets.device):
        raise ValueError(f"{name}: jagged, dense, bias and seq_offsets must be on one device")
    if max_seq_len < 0:
        raise ValueError(f"{name}: max_seq_len must be >= 0, got {max_seq_len}")
    padded = jagged_to_padded_dense(jagged, seq_offsets, max_seq_len)
    return dense_to_jagged(torch.baddbmm(bias.unsqueeze(1), padded, dense), seq_offsets, total_length=jagged.shape[0])


def validate_jagged(values: Tensor, offsets: Tensor, exact: bool = False) -> None:
    """Raise ValueError unless ``offsets`` describe a jagged tensor over ``values``: 1-D int32/int64 on
    values' device with B+1 >= 1 entries, offsets[0] == 0, non-decreasing, offsets[-1] <= T (== T with
    ``exact``, as concat/split need). Reads the offsets on the host: one device sync."""
    if values.dim() < 1:
        raise ValueError("torchfuse.validate_jagged: values must have a row dimension (T, *D)")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"torchfuse.validate_jagged: offsets must be 1-D with B+1 >= 1 entries, got shape "
                         f"{tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"torchfuse.validate_jagged: offsets must be int32 or int64, got {offsets.dtype}")
    if offsets.device != values.device:
        raise ValueError(f"torchfuse.validate_jagged: offsets are on {offsets.device}, values on {values.device}")
    o = offsets.long()
    bad_step = (o[1:] < o[:-1]).nonzero()
    first, last, n_bad = torch.stack([o[0], o[-1], bad_step.new_tensor(bad_step.shape[0])]).tolist()
    T = values.shape[0]
    if first != 0:
        raise ValueError(f"torchfuse.validate_jagged: offsets[0] must be 0, got {first}")
    if n_bad:
        i = int(bad_step[0, 0]) + 1
        raise ValueError(f"torchfuse.validate_jagged: offsets must be non-decreasing, but offsets[{i}] = "
                         f"{int(o[i])} < offsets[{i - 1}] = {int(o[i - 1])}")
    if last > T or (exact and last != T):
        raise ValueError(f"torchfuse.validate_jagged: offsets[-1] = {last} but values has {T} rows"
                         + (" (must be equal)" if exact else ""))


# ---- fake (meta) kernels: shapes and dtypes only, for torch.compile and meta tensors ----


def _dyn():
    return torch.library.get_ctx().new_dynamic_size()


@torch.library.register_fake("torchfuse::complete_cumsum")
def _cumsum_fake(lengths):
    return lengths.new_empty(lengths.shape[0] + 1)


@torch.library.register_fake("torchfuse::jagged_to_padded_dense")
def _to_padded_fake(values, offsets, max_length, padding_value=0.0):
    return values.new_empty((offsets.shape[0] - 1, max_length, *values.shape[1:]))


@torch.library.register_fake("torchfuse::dense_to_jagged")
def _to_jagged_fake(dense, offsets, total_length=None):
    T = total_length if total_length is not None else _dyn()
    return dense.new_empty((T, *dense.shape[2:]))


@torch.library.register_fake("torchfuse::jagged_dense_add")
def _add_fake(values, offsets, dense):
    return values.new_empty(values.shape)


@torch.library.register_fake("torchfuse::jagged_dense_mul")
def _mul_fake(values, offsets, dense):
    return values.new_empty(values.shape)


def _batch(offsets_a, offsets_b, rows_a, max_len_a, rows_b, max_len_b):
    if offsets_a is not None:
        return offsets_a.shape[0] - 1
    if offsets_b is not None:
        return offsets_b.shape[0] - 1
    return rows_a // max_len_a if max_len_a else rows_b // max_len_b


def _off_dtype(a, b):
    return a.dtype if a is not None else (b.dtype if b is not None else torch.int64)


@torch.library.register_fake("torchfuse::concat_2d_jagged")
def _concat_2d_fake(values_left, offsets_left, values_right, offsets_right, max_len_left=None, max_len_right=None,
                    n_prefix_from_right=0):
    B = _batch(offsets_left, offsets_right, values_left.shape[0], max_len_left, values_right.shape[0], max_len_right)
    out = values_left.new_empty((values_left.shape[0] + values_right.shape[0], *values_left.shape[1:]))
    return out, values_left.new_empty(B + 1, dtype=_off_dtype(offsets_left, offsets_right))


def _split_totals(T, B, offsets_left, offsets_right, max_len_left, max_len_right, total_len_left, total_len_right):
    """Row counts of split_2d's outputs, as the C++ op computes them (None: known on the device only)."""
    if offsets_left is None:
        tl = B * max_len_left
        return tl, (total_len_right if total_len_right is not None else T - tl)
    if offsets_right is None:
        tr = B * max_len_right
        return (total_len_left if total_len_left is not None else T - tr), tr
    if total_len_left is not None:
        return total_len_left, (total_len_right if total_len_right is not None else T - total_len_left)
    if total_len_right is not None:
        return T - total_len_right, total_len_right
    return None, None


@torch.library.register_fake("torchfuse::split_2d_jagged")
def _split_2d_fake(values, offsets_left, offsets_right, max_len_left=None, max_len_right=None, n_prefix_to_right=0,
                   total_len_left=None, total_len_right=None):
    if offsets_left is not None or offsets_right is not None:
        B = (offsets_left if offsets_left is not None else offsets_right).shape[0] - 1
    else:  # both dense: every sample has max_len_left + max_len_right rows
        for name, m in (("max_len_left", max_len_left), ("max_len_right", max_len_right)):
            if m is None:
                raise RuntimeError(f"torchfuse.split_2d_jagged: {name} (>= 0) is needed when offsets_"
                                   f"{name[8:]} is None (a dense side)")
        per = max_len_left + max_len_right
        B = values.shape[0] // per if per else 0
    tl, tr = _split_totals(values.shape[0], B, offsets_left, offsets_right, max_len_left, max_len_right,
                           total_len_left, total_len_right)
    if tl is None:
        tl = _dyn()
        tr = values.shape[0] - tl
    return values.new_empty((tl, *values.shape[1:])), values.new_empty((tr, *values.shape[1:]))


@torch.library.register_fake("torchfuse::jagged_concat")
def _concat_fake(values_list, offsets_list):
    T = sum(v.shape[0] for v in values_list)
    v0 = values_list[0]
    return v0.new_empty((T, *v0.shape[1:])), offsets_list[0].new_empty(offsets_list[0].shape[0])


@torch.library.register_fake("torchfuse::jagged_split")
def _split_fake(values, offsets_list, totals):
    return [values.new_empty((t, *values.shape[1:])) for t in totals]


@torch.library.register_fake("torchfuse::jagged_index_select")
def _index_select_fake(values, lengths, indices, total_length=None):
    T = total_length if total_length is not None else _dyn()
    return values.new_empty((T, *values.shape[1:])), lengths.new_empty(indices.shape[0])


# ---- autograd: every backward is another jagged op ----


def _setup_to_padded(ctx, inputs, output):
    values, offsets, _max_length, _pad = inputs
    ctx.save_for_backward(offsets)
    ctx.T = values.shape[0]


def _bwd_to_padded(ctx, grad):
    (offsets,) = ctx.saved_tensors
    return _ops.dense_to_jagged(grad, offsets, ctx.T), None, None, None


def _setup_to_jagged(ctx, inputs, output):
    dense, offsets, _T = inputs
    ctx.save_for_backward(offsets)
    ctx.L = dense.shape[1]


def _bwd_to_jagged(ctx, grad):
    (offsets,) = ctx.saved_tensors
    return _ops.jagged_to_padded_dense(grad, offsets, ctx.L, 0.0), None, None


def _setup_arith(ctx, inputs, output):
    values, offsets, dense = inputs
    ctx.save_for_backward(values, offsets, dense)
    ctx.L = dense.shape[1]


def _bwd_add(ctx, grad):
    _, offsets, _ = ctx.saved_tensors
    gd = _ops.jagged_to_padded_dense(grad, offsets, ctx.L, 0.0) if ctx.needs_input_grad[2] else None
    return grad, None, gd


def _bwd_mul(ctx, grad):
    values, offsets, dense = ctx.saved_tensors
    gv = _ops.jagged_dense_mul(grad, offsets, dense) if ctx.needs_input_grad[0] else None
    gd = _ops.jagged_to_padded_dense(grad * values, offsets, ctx.L, 0.0) if ctx.needs_input_grad[2] else None
    return gv, None, gd


def _setup_concat_2d(ctx, inputs, output):
    values_left, offsets_left, values_right, offsets_right, max_len_left, max_len_right, prefix = inputs
    ctx.save_for_backward(offsets_left, offsets_right)
    ctx.args = (max_len_left, max_len_right, prefix, values_left.shape[0], values_right.shape[0])


def _bwd_concat_2d(ctx, grad, _goff):
    offsets_left, offsets_right = ctx.saved_tensors
    max_len_left, max_len_right, prefix, tl, tr = ctx.args
    gl, gr = _ops.split_2d_jagged(grad, offsets_left, offsets_right, max_len_left, max_len_right, prefix, tl, tr)
    return gl, None, gr, None, None, None, None


def _setup_split_2d(ctx, inputs, output):
    values, offsets_left, offsets_right, max_len_left, max_len_right, prefix, _tl, _tr = inputs
    ctx.save_for_backward(offsets_left, offsets_right)
    ctx.args = (max_len_left, max_len_right, prefix)
    ctx.shapes = (output[0].shape, output[1].shape)
    ctx.set_materialize_grads(False)


def _bwd_split_2d(ctx, gl, gr):
    offsets_left, offsets_right = ctx.saved_tensors
    max_len_left, max_len_right, prefix = ctx.args
    ref = gl if gl is not None else gr
    if ref is None:
        return (None,) * 8
    gl = gl if gl is not None else ref.new_zeros(ctx.shapes[0])
    gr = gr if gr is not None else ref.new_zeros(ctx.shapes[1])
    g, _ = _ops.concat_2d_jagged(gl, offsets_left, gr, offsets_right, max_len_left, max_len_right, prefix)
    return g, None, None, None, None, None, None, None


def _setup_concat(ctx, inputs, output):
    values_list, offsets_list = inputs
    ctx.save_for_backward(*offsets_list)
    ctx.totals = [v.shape[0] for v in values_list]


def _bwd_concat(ctx, grad, _goff):
    offsets = list(ctx.saved_tensors)
    return list(_ops.jagged_split(grad, offsets, ctx.totals)), [None] * len(offsets)


def _setup_split(ctx, inputs, output):
    values, offsets_list, totals = inputs
    ctx.save_for_backward(*offsets_list)
    ctx.shapes = [o.shape for o in output]
    ctx.set_materialize_grads(False)


def _bwd_split(ctx, grads):
    # list inputs take a list of gradients (None for the offsets)
    offsets = list(ctx.saved_tensors)
    ref = next((g for g in grads if g is not None), None)
    if ref is None:
        return None, [None] * len(offsets), None
    grads = [g if g is not None else ref.new_zeros(s) for g, s in zip(grads, ctx.shapes)]
    g, _ = _ops.jagged_concat(grads, offsets)
    return g, [None] * len(offsets), None


def _setup_index_select(ctx, inputs, output):
    values, lengths, indices, _T = inputs
    ctx.save_for_backward(lengths, indices, output[1])
    ctx.values_shape = values.shape


def _bwd_index_select(ctx, grad, _glen):
    # Repeated indices add up: an index_add over the rows each output row came from.
    lengths, indices, out_lengths = ctx.saved_tensors
    T_out, K = grad.shape[0], indices.shape[0]
    out_lengths = out_lengths.long()
    in_off = _ops.complete_cumsum(lengths.long())
    out_off = _ops.complete_cumsum(out_lengths)
    k_of_row = torch.repeat_interleave(torch.arange(K, device=grad.device), out_lengths, output_size=T_out)
    src = in_off[indices.long()[k_of_row]] + torch.arange(T_out, device=grad.device) - out_off[k_of_row]
    gv = grad.new_zeros(ctx.values_shape).index_add_(0, src, grad)
    return gv, None, None, None


_OPS, _FUNCTIONS = {}, {}
for _name, _bwd, _setup in [
    ("jagged_to_padded_dense", _bwd_to_padded, _setup_to_padded),
    ("dense_to_jagged", _bwd_to_jagged, _setup_to_jagged),
    ("jagged_dense_add", _bwd_add, _setup_arith),
    ("jagged_dense_mul", _bwd_mul, _setup_arith),
    ("concat_2d_jagged", _bwd_concat_2d, _setup_concat_2d),
    ("split_2d_jagged", _bwd_split_2d, _setup_split_2d),
    ("jagged_concat", _bwd_concat, _setup_concat),
    ("jagged_split", _bwd_split, _setup_split),
    ("jagged_index_select", _bwd_index_select, _setup_index_select),
]:
    torch.library.register_autograd(f"torchfuse::{_name}", _bwd, setup_context=_setup)
    if _name not in ("jagged_concat", "jagged_split"):  # list arguments: Function.apply does not track those
        _OPS[_name] = getattr(_ops, _name).default
        _FUNCTIONS[_name] = function_for(_name, _OPS[_name], _setup, _bwd)


def _call(name: str, *args):
    """The op, through its autograd.Function when a gradient can flow (_autograd.py: the same gradients
    as the op's registered autograd, without its per-call Python layer)."""
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        return _FUNCTIONS[name].apply(*args)
    return _OPS[name](*args)

"""The plain PyTorch code that each torchfuse op replaces: used by ``python -m torchfuse`` for its
self-check and by benchmarks/ as the eager (and torch.compile) baseline. Written for clarity, not
speed: the jagged and HSTU references loop over samples."""
from typing import List, Optional

import torch
import torch.nn.functional as F


def add_layer_norm(x, residual, weight, bias, eps=1e-5):
    s = x + residual
    return F.layer_norm(s, (s.shape[-1],), weight, bias, eps), s


def add_rms_norm(x, residual, weight, eps=1e-6):
    """HF LlamaRMSNorm applied to x + residual (its fp32 upcast; float64 stays float64, so the same
    code is the exact reference)."""
    s = x + residual
    h = s.to(torch.promote_types(s.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s


# ---- jagged tensors: values (T, *D) with offsets (B + 1,) ----


def _bounds(offsets) -> List[int]:
    return [int(o) for o in offsets.tolist()]


def jagged_to_padded_dense(values, offsets, max_length, padding_value=0.0):
    o = _bounds(offsets)
    out = values.new_full((len(o) - 1, max_length) + tuple(values.shape[1:]), padding_value)
    for b in range(len(o) - 1):
        n = min(o[b + 1] - o[b], max_length)
        out[b, :n] = values[o[b]:o[b] + n]
    return out


def dense_to_jagged(dense, offsets):
    o = _bounds(offsets)
    rows = []
    for b in range(len(o) - 1):
        n = o[b + 1] - o[b]
        part = dense[b, :n]
        rows.append(torch.cat([part, part.new_zeros((n - part.shape[0],) + part.shape[1:])]))
    return torch.cat(rows) if rows else dense.new_zeros((0,) + tuple(dense.shape[2:]))


def jagged_dense_add(values, offsets, dense):
    """Positions past the dense tensor's length keep ``values``."""
    o = _bounds(offsets)
    L = dense.shape[1]
    parts = []
    for b in range(len(o) - 1):
        v = values[o[b]:o[b + 1]]
        n = min(v.shape[0], L)
        parts.append(torch.cat([v[:n] + dense[b, :n], v[n:]]))
    return torch.cat(parts) if parts else values[:0]


def jagged_concat(values_list, offsets_list):
    """Sample b: ``[v0_b; v1_b; ...]``. Returns (values, offsets)."""
    bounds = [_bounds(o) for o in offsets_list]
    parts = [v[o[b]:o[b + 1]] for b in range(len(bounds[0]) - 1) for v, o in zip(values_list, bounds)]
    return torch.cat(parts), sum(offsets_list[1:], offsets_list[0])


def concat_2d_jagged(values_left, offsets_left, values_right, offsets_right):
    """Sample b: ``[left_b; right_b]``. Returns (values, offsets)."""
    return jagged_concat([values_left, values_right], [offsets_left, offsets_right])


def jagged_index_select(values, lengths, indices):
    """Samples ``indices[k]`` of the input, in that order. Returns (values, lengths)."""
    o = [0] + torch.cumsum(lengths, 0).tolist()
    parts = [values[o[i]:o[i + 1]] for i in indices.tolist()]
    return (torch.cat(parts) if parts else values[:0]), lengths[indices]


# ---- HSTU attention ----


def hstu_valid_mask(n, num_targets, contextual_seq_len=0, max_attn_len=0, min_full_attn_seq_len=0,
                    target_group_size=1, has_targets=False, device=None):
    """generative-recommenders' ``_get_valid_attn_mask`` for one sequence of length n (causal), plus
    FBGEMM's target groups: (n, n) bool, [query row, key column]."""
    c, m, f, g, t = contextual_seq_len, max_attn_len, min_full_attn_seq_len, target_group_size, num_targets
    ids = torch.arange(n, device=device).view(1, n)
    max_ids = torch.tensor(n, device=device)
    if c > 0:
        ids = torch.clamp(ids - c + 1, min=0)
        max_ids = max_ids - c + 1
    if has_targets:
        max_ids = max_ids - t
        ids = torch.clamp(ids, max=max_ids)
    row_ids, col_ids = ids.view(n, 1).expand(n, n), ids.view(1, n).expand(n, n)
    dist = row_ids - col_ids
    valid = torch.eye(n, dtype=torch.bool, device=device) | (dist > 0)
    if m > 0:
        valid = valid & ((dist <= m) | (row_ids >= max_ids - f)) if f > 0 else valid & (dist <= m)
    if c > 0:
        valid = valid | ((row_ids == 0) & (col_ids < max_ids))
    if has_targets and g > 1:
        u = n - t
        p, qq = torch.arange(n, device=device).view(n, 1), torch.arange(n, device=device).view(1, n)
        valid = valid | ((p >= u) & (qq >= u) & (qq < p) & ((p - u) // g == (qq - u) // g))
    return valid


def hstu_attention(q, k, v, seq_offsets, max_seq_len, alpha, num_targets: Optional[torch.Tensor] = None,
                   contextual_seq_len=0, max_attn_len=0, min_full_attn_seq_len=0, target_group_size=1,
                   scaling_seqlen=None, attn_bias=None):
    """``torchfuse.hstu_attention``'s formula in q's dtype, sequence by sequence (differentiable):
    ``O = (M * SiLU(alpha * (Q K^T + bias))) / S @ V``."""
    S = scaling_seqlen if scaling_seqlen is not None else max_seq_len
    o = _bounds(seq_offsets)
    outs = []
    for b in range(len(o) - 1):
        s, e = o[b], o[b + 1]
        qb, kb, vb = q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)  # (H, n, D)
        t = int(num_targets[b]) if num_targets is not None else 0
        mask = hstu_valid_mask(e - s, t, contextual_seq_len, max_attn_len, min_full_attn_seq_len,
                               target_group_size, num_targets is not None, q.device)
        qk = qb @ kb.transpose(1, 2)
        if attn_bias is not None:
            qk = qk + attn_bias[b, :, :e - s, :e - s]
        outs.append(((F.silu(alpha * qk) / S * mask) @ vb).transpose(0, 1))
    return torch.cat(outs, 0) if outs else v.new_zeros((0,) + tuple(v.shape[1:]))


def hstu_attention_cached(delta_q, k, v, seq_offsets, max_seq_len, alpha, **kw):
    """The rows of :func:`hstu_attention` for the last D = len(delta_q) / B positions of each
    sequence (zeros where a sequence is shorter than D), with ``delta_q`` as those rows' queries."""
    o = _bounds(seq_offsets)
    B = len(o) - 1
    D = delta_q.shape[0] // B
    q = torch.zeros(k.shape[0], k.shape[1], delta_q.shape[2], dtype=delta_q.dtype, device=delta_q.device)
    rows, keep = [], []
    for b in range(B):
        for i in range(D):
            p = o[b + 1] - D + i
            if p >= o[b]:
                rows.append(p)
                keep.append(b * D + i)
    rows_t = torch.tensor(rows, dtype=torch.long, device=q.device)
    keep_t = torch.tensor(keep, dtype=torch.long, device=q.device)
    q = q.index_copy(0, rows_t, delta_q[keep_t])
    full = hstu_attention(q, k, v, seq_offsets, max_seq_len, alpha, **kw)
    out = full.new_zeros((B * D,) + tuple(full.shape[1:]))
    return out.index_copy(0, keep_t, full[rows_t])

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


# ---- HSTU: generative-recommenders' PyTorch formulations (the oracle for the STU layer and the recommender) ----


def hstu_mask_batched(N, lengths, num_targets=None, contextual_seq_len=0, max_attn_len=0):
    """generative-recommenders' ``_get_valid_attn_mask`` for a padded batch: (B, N, N) bool for
    sequences of ``lengths`` (B,) (rows and columns past a sequence's end are don't-cares)."""
    dev = lengths.device
    ids = torch.arange(N, device=dev).view(1, N)
    max_ids = lengths.view(-1, 1, 1)
    c = contextual_seq_len
    if c > 0:
        ids = torch.clamp(ids - c + 1, min=0)
        max_ids = max_ids - c + 1
    if num_targets is not None:
        max_ids = max_ids - num_targets.view(-1, 1, 1)
        ids = torch.clamp(ids, max=max_ids)
        row, col = ids.view(-1, N, 1).expand(-1, N, N), ids.view(-1, 1, N).expand(-1, N, N)
    else:
        row, col = ids.view(1, N, 1).expand(1, N, N), ids.view(1, 1, N).expand(1, N, N)
    dist = row - col
    valid = torch.eye(N, dtype=torch.bool, device=dev).view(1, N, N) | (dist > 0)
    if max_attn_len > 0:
        valid = valid & (dist <= max_attn_len)
    if c > 0:
        valid = valid | ((row == 0) & (col < max_ids))
    return valid.expand(lengths.numel(), N, N)


def hstu_attention_reference(q, k, v, offsets, max_seq_len, alpha, num_targets=None, contextual_seq_len=0,
                             max_attn_len=0):
    """generative-recommenders' ``pytorch_hstu_mha``: pad to (B, N), (M * SiLU(alpha q k^T)) / N @ v,
    back to jagged; in q's dtype, differentiable."""
    L, H, _ = q.shape
    B, N = offsets.numel() - 1, max_seq_len
    lengths = offsets[1:] - offsets[:-1]
    seg = torch.repeat_interleave(torch.arange(B, device=q.device), lengths, output_size=L)
    pos = torch.arange(L, device=q.device) - offsets[:-1].to(q.device)[seg]

    def pad(t):
        out = t.new_zeros((B, N) + tuple(t.shape[1:]))
        return out.index_put((seg, pos), t)

    qp, kp, vp = pad(q), pad(k), pad(v)  # (B, N, H, D)
    p = F.silu(alpha * torch.einsum("bxhd,byhd->bhxy", qp, kp)) / N
    mask = hstu_mask_batched(N, lengths.to(q.device), num_targets.to(q.device) if num_targets is not None else None,
                             contextual_seq_len, max_attn_len)
    p = p * mask.unsqueeze(1).to(p.dtype)
    return torch.einsum("bhxy,byhd->bxhd", p, vp)[seg, pos]


def stu_layer_reference(params, cfg, x, offsets, max_seq_len, num_targets=None, dtype=None, training=False):
    """generative-recommenders' STULayer forward in plain PyTorch: ``params`` is its state_dict (names
    ``_uvqk_weight`` ...), cast to ``dtype`` (default x's); the output norm and product in fp32
    (fp64 when dtype is fp64), as GR's ``pytorch_norm_mul_dropout`` computes them."""
    dtype = dtype or x.dtype
    P = {k: v.to(dtype) for k, v in params.items()}
    x = x.to(dtype)
    H, Dh, Da = cfg.num_heads, cfg.hidden_dim, cfg.attention_dim
    normed = F.layer_norm(x, (x.shape[1],), P["_input_norm_weight"], P["_input_norm_bias"], eps=1e-6)
    uvqk = torch.addmm(P["_uvqk_beta"], normed, P["_uvqk_weight"])
    u, v, q, k = torch.split(uvqk, [Dh * H, Dh * H, Da * H, Da * H], dim=1)
    u = F.silu(u)
    alpha = cfg.attn_alpha or 1.0 / Da ** 0.5
    attn = hstu_attention_reference(q.reshape(-1, H, Da), k.reshape(-1, H, Da), v.reshape(-1, H, Dh), offsets,
                                    max_seq_len, alpha, num_targets if cfg.target_aware else None,
                                    cfg.contextual_seq_len, cfg.max_attn_len or 0).reshape(-1, H * Dh)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    a, u = attn.to(acc), u.to(acc)
    w, b = P["_output_norm_weight"].to(acc), P["_output_norm_bias"].to(acc)
    if cfg.use_group_norm:
        normed_a = F.group_norm(a.view(-1, H, Dh), H, w, b, eps=1e-6).view(-1, H * Dh)
    else:
        normed_a = F.layer_norm(a, (H * Dh,), w, b, eps=1e-6)
    y = F.dropout(torch.cat([u, a, u * normed_a], dim=1), p=cfg.output_dropout_ratio, training=training).to(dtype)
    return torch.addmm(x, y, P["_output_weight"])


def sampled_softmax_loss(query, positive, negatives, temperature, l2_norm=True, eps=1e-6, positive_ids=None,
                         negative_ids=None, weights=None):
    """generative-recommenders' ``SampledSoftmaxLoss`` on given negatives: (R, D) shared or (T, R, D) per
    row; a negative whose id equals the row's positive id gets the logit -5e4; weighted mean over rows.
    Computed in the inputs' dtype, the log-softmax in at least float32 (as autocast runs it)."""
    if l2_norm:
        query, positive, negatives = (F.normalize(t, dim=-1, eps=eps) for t in (query, positive, negatives))
    pos = (query * positive).sum(-1, keepdim=True) / temperature
    neg = (query @ negatives.t() if negatives.dim() == 2 else torch.einsum("td,trd->tr", query, negatives))
    neg = neg / temperature
    if positive_ids is not None and negative_ids is not None:
        neg = torch.where(positive_ids.unsqueeze(1) == negative_ids, torch.full_like(neg, -5e4), neg)
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    loss = -F.log_softmax(torch.cat([pos, neg], dim=1).to(acc), dim=1)[:, 0]
    w = torch.ones_like(loss) if weights is None else weights.to(acc)
    return (loss * w).sum() / w.sum()


def hstu_preprocess(x, norm_weight, norm_bias, eps, uvqk_weight, uvqk_bias, num_heads, attn_dim, hidden_dim):
    """generative-recommenders' ``hstu_compute_uqvk`` (PyTorch kernel) in the inputs' dtype:
    LayerNorm, addmm, split as u, v, q, k, SiLU on u; returns (u, q, k, v) with q, k, v (L, H, d)."""
    normed = F.layer_norm(x, (x.shape[-1],), norm_weight, norm_bias, eps)
    uvqk = torch.addmm(uvqk_bias, normed, uvqk_weight)
    H = num_heads
    u, v, q, k = torch.split(uvqk, [hidden_dim * H, hidden_dim * H, attn_dim * H, attn_dim * H], dim=1)
    return (F.silu(u), q.reshape(-1, H, attn_dim), k.reshape(-1, H, attn_dim), v.reshape(-1, H, hidden_dim))


# ---- HSTU output section ----


def hstu_compute_output(attn, u, x, norm_weight, norm_bias, eps, output_weight, *, num_heads, linear_dim,
                        dropout_ratio, training, concat_u, concat_x, mul_u_activation_type, group_norm,
                        silu_u=False, dropout_mask=None):
    """generative-recommenders' ``pytorch_hstu_compute_output``: norm, multiply and concatenate in fp32
    (fp64 for fp64 inputs), dropout, rounded to attn's dtype, then ``x + y @ output_weight``.
    ``dropout_mask`` (bool, the concatenation's shape) replaces F.dropout's random mask when dropping."""
    dtype = attn.dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    a, uu = attn.to(acc), u.to(acc)
    w, b = norm_weight.to(acc), norm_bias.to(acc)
    silu_or_id = F.silu if silu_u else (lambda t: t)
    if group_norm:
        uu = silu_or_id(uu)
        y = uu * F.group_norm(a.view(-1, num_heads, linear_dim), num_heads, w, b, eps).view(-1, num_heads * linear_dim)
        parts = [uu, a, y] if concat_u and concat_x else [y]
    else:
        act = {"none": lambda t: t, "silu": F.silu, "sigmoid": torch.sigmoid}[mul_u_activation_type]
        y = act(uu) * F.layer_norm(a, (a.shape[-1],), w, b, eps)
        parts = ([silu_or_id(uu)] if concat_u else []) + ([a] if concat_x else []) + [y]
    y = torch.cat(parts, dim=1)
    if training and dropout_ratio > 0:
        if dropout_mask is None:
            y = F.dropout(y, p=dropout_ratio, training=True)
        else:
            y = y * dropout_mask.to(acc) / (1.0 - dropout_ratio)
    return torch.addmm(x, y.to(dtype), output_weight.to(x.dtype))

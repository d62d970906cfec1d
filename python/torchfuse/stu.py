"""STU layers (the HSTU encoder's layer, "Actions Speak Louder than Words", Zhai et al. 2024) on
torchfuse ops, as drop-ins for generative-recommenders' ``modules/stu.py``: the same configuration,
parameter names, shapes and ``state_dict`` keys, so checkpoints load either way.

One layer, for jagged input x (L, E) with sequence offsets:
    u, q, k, v = hstu_preprocess(x)    LayerNorm, one GEMM, u = SiLU(u), q/k/v views of its output
    attn = hstu_attention(q, k, v)                      (torchfuse kernel)
    y = dropout(cat[u, attn, u * LayerNorm(attn)])      (GroupNorm per head with use_group_norm)
    out = x + y @ W_out                                  hstu_compute_output: one kernel and the GEMM
Any head dims from 1 to 256.
"""
import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .hstu import hstu_attention, hstu_attention_cached
from .hstu_output import hstu_compute_output
from .hstu_preprocess import hstu_preprocess, hstu_preprocess_with_residual
from .jagged import complete_cumsum, concat_2d_jagged, split_2d_jagged

__all__ = ["STULayerConfig", "STULayer", "STUStack"]

@dataclasses.dataclass
class STULayerConfig:
    """generative-recommenders' ``STULayerConfig``: the same fields and defaults."""

    embedding_dim: int
    num_heads: int
    hidden_dim: int
    attention_dim: int
    output_dropout_ratio: float = 0.3
    causal: bool = True
    target_aware: bool = True
    max_attn_len: Optional[int] = None
    attn_alpha: Optional[float] = None
    use_group_norm: bool = False
    recompute_normed_x: bool = True
    recompute_uvqk: bool = True
    recompute_y: bool = True
    sort_by_length: bool = True
    contextual_seq_len: int = 0


def _attention(q, k, v, offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len,
               delta: int = 0, kv_lengths: Optional[Tensor] = None) -> Tensor:
    """hstu_attention (delta = 0) or its cached rows (delta > 0); offsets were checked by the caller's
    forward, so the kernels skip re-validating them."""
    kw = dict(num_targets=num_targets, contextual_seq_len=contextual_seq_len, max_attn_len=max_attn_len, validate=False)
    if delta:
        return hstu_attention_cached(q, k, v, offsets, max_seq_len, alpha, kv_lengths=kv_lengths, **kw)
    return hstu_attention(q, k, v, offsets, max_seq_len, alpha, **kw)


class STULayer(torch.nn.Module):
    """One STU layer (generative-recommenders' ``STULayer``). ``forward`` takes jagged x (L, E) with
    ``x_offsets`` (B + 1,) and returns (L, E); ``cached_forward`` scores the last ``delta`` positions of
    every sequence against the K/V cache that ``forward(..., kv_caching_lengths=...)`` filled."""

    max_kv_caching_len: int
    k_cache: Optional[Tensor]
    v_cache: Optional[Tensor]
    kv_caching_offsets: Optional[Tensor]

    def __init__(self, config: STULayerConfig, is_inference: bool = False) -> None:
        super().__init__()
        if not config.causal:
            raise ValueError("torchfuse.nn.STULayer: only causal=True is supported (as in generative-recommenders)")
        for name in ("embedding_dim", "num_heads", "hidden_dim", "attention_dim"):
            if getattr(config, name) < 1:
                raise ValueError(f"torchfuse.nn.STULayer: {name} must be >= 1, got {getattr(config, name)}")
        for name in ("hidden_dim", "attention_dim"):
            if getattr(config, name) > 256:
                raise ValueError(f"torchfuse.nn.STULayer: {name} must be at most 256 (the attention's head dims), "
                                 f"got {getattr(config, name)}")
        self._is_inference = is_inference
        self.reset_kv_cache()
        # generative-recommenders' attribute names, one per config field
        for name in ("num_heads", "embedding_dim", "hidden_dim", "attention_dim", "output_dropout_ratio",
                     "target_aware", "causal", "use_group_norm", "recompute_normed_x", "recompute_uvqk",
                     "recompute_y", "sort_by_length", "contextual_seq_len"):
            setattr(self, "_" + name, getattr(config, name))
        self._max_attn_len = config.max_attn_len or 0
        self._attn_alpha = config.attn_alpha or 1.0 / (self._attention_dim ** 0.5)
        H, E, Dh, Da = self._num_heads, self._embedding_dim, self._hidden_dim, self._attention_dim
        self._uvqk_weight = torch.nn.Parameter(torch.empty((E, (Dh * 2 + Da * 2) * H)))
        torch.nn.init.xavier_uniform_(self._uvqk_weight)
        self._uvqk_beta = torch.nn.Parameter(torch.zeros((Dh * 2 + Da * 2) * H))
        self._input_norm_weight = torch.nn.Parameter(torch.ones(E))
        self._input_norm_bias = torch.nn.Parameter(torch.zeros(E))
        self._output_weight = torch.nn.Parameter(torch.empty((Dh * H * 3, E)))
        torch.nn.init.xavier_uniform_(self._output_weight)
        norm_shape = Dh * H if not self._use_group_norm else H
        self._output_norm_weight = torch.nn.Parameter(torch.ones(norm_shape))
        self._output_norm_bias = torch.nn.Parameter(torch.zeros(norm_shape))

    # ---- the K/V cache (generative-recommenders' names and semantics) ----

    def reset_kv_cache(self) -> None:
        self.k_cache = None
        self.v_cache = None
        self.kv_caching_offsets = None
        self.max_kv_caching_len = 0
        self._kv_slots = None  # (capacity, lengths) once reserve_kv_cache has run
        self._kv_slots_shared = False  # the lengths are the stack's, shared by its layers
        self._kv_pair = None  # the slots' (v, k) row pairs that k_cache and v_cache view, where widths match

    def reserve_kv_cache(self, capacity: int) -> None:
        """Move the cache into a slot of ``capacity`` rows per sequence (a torchfuse extension for serving).
        ``cached_forward`` then writes each call's new rows into the slots in place and attends over the
        first ``length`` rows of each (``hstu_attention_cached(kv_lengths=)``), instead of copying the whole
        cache into a new jagged tensor every call; the memory stays fixed at B x capacity rows. Afterwards
        ``k_cache`` / ``v_cache`` are the slot buffers (B * capacity, H * D) and ``kv_caching_offsets`` the
        slots' starts; where K and V rows have one width both are views (row stride 2 * H * D) of one
        buffer of (v, k) row pairs, so a call's new rows go in with one copy. A full ``forward`` with
        ``kv_caching_lengths`` or ``reset_kv_cache`` makes the cache jagged again."""
        if self.k_cache is None or self.kv_caching_offsets is None:
            raise RuntimeError("torchfuse.nn.STULayer.reserve_kv_cache: the K/V cache is empty; run forward(..., "
                               "kv_caching_lengths=...) first")
        if self._kv_slots is not None:
            raise RuntimeError("torchfuse.nn.STULayer.reserve_kv_cache: the cache already has slots")
        if capacity < self.max_kv_caching_len:
            raise ValueError(f"torchfuse.nn.STULayer.reserve_kv_cache: capacity {capacity} is below the longest "
                             f"cached sequence ({self.max_kv_caching_len})")
        offsets = self.kv_caching_offsets.long()
        B, rows = offsets.numel() - 1, self.k_cache.shape[0]
        lengths = offsets[1:] - offsets[:-1]
        starts = torch.arange(B, device=offsets.device) * capacity
        dest = torch.arange(rows, device=offsets.device) + torch.repeat_interleave(starts - offsets[:-1], lengths,
                                                                                   output_size=rows)
        # zeroed, not empty: a slot's unused rows then hold finite values for kernels that load whole tiles
        kw, vw = self.k_cache.shape[1], self.v_cache.shape[1]
        if kw == vw and self.k_cache.dtype == self.v_cache.dtype:
            # one buffer of (v, k) row pairs: a call's new rows, which sit at a fixed distance in the
            # uvqk output, then go in with one index_copy_ instead of two (_append_rows)
            pair = self.k_cache.new_zeros((B * capacity, 2, kw))
            k, v = pair[:, 1], pair[:, 0]
        else:
            pair = None
            k = self.k_cache.new_zeros((B * capacity, kw))
            v = self.v_cache.new_zeros((B * capacity, vw))
        k.index_copy_(0, dest, self.k_cache)
        v.index_copy_(0, dest, self.v_cache)
        self.k_cache, self.v_cache, self._kv_pair = k, v, pair
        self.kv_caching_offsets = torch.arange(B + 1, device=offsets.device) * capacity
        self._kv_slots = (capacity, lengths)

    def update_kv_cache(self, max_seq_len: int, seq_offsets: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                        max_kv_caching_len: int, kv_caching_lengths: Optional[Tensor]) -> None:
        """Keep the first ``kv_caching_lengths[b]`` rows of every sequence's k and v; with no lengths
        the cache stays as it is."""
        if kv_caching_lengths is None:
            return
        self._kv_slots = None
        self._kv_slots_shared = False
        self._kv_pair = None
        kv_offsets = complete_cumsum(kv_caching_lengths).to(seq_offsets.dtype)
        delta_offsets = seq_offsets - kv_offsets
        # k, v: (L, H, D) from forward, or (L, H * D) from cached_forward's full K/V
        self.k_cache, _ = split_2d_jagged(k.reshape(k.shape[0], -1), kv_offsets, delta_offsets)
        self.v_cache, _ = split_2d_jagged(v.reshape(v.shape[0], -1), kv_offsets, delta_offsets)
        if max_kv_caching_len == 0:
            max_kv_caching_len = int(kv_caching_lengths.max().item()) if kv_caching_lengths.numel() else 0
        self.max_kv_caching_len = max_kv_caching_len
        self.kv_caching_offsets = kv_offsets

    def construct_full_kv(self, delta_k: Tensor, delta_v: Tensor) -> Tuple[Tensor, Tensor, int, Tensor]:
        """The cache with every sequence's ``delta`` new rows appended: (k, v, max_len, offsets)."""
        if self.k_cache is None or self.kv_caching_offsets is None:
            raise RuntimeError("torchfuse.nn.STULayer.cached_forward: the K/V cache is empty; run forward(..., "
                               "kv_caching_lengths=...) first")
        B = self.kv_caching_offsets.shape[0] - 1
        if B == 0 or delta_k.shape[0] % B:
            raise ValueError(f"torchfuse.nn.STULayer.cached_forward: delta_x must have B * delta rows (B = {B}), "
                             f"got {delta_k.shape[0]}")
        delta = delta_k.shape[0] // B
        # the new rows are a dense side: (B * delta, H * D), every sequence exactly delta of them
        full_k, _ = concat_2d_jagged(self.k_cache, self.kv_caching_offsets, delta_k, None,
                                     max_len_left=self.max_kv_caching_len, max_len_right=delta)
        full_v, offsets = concat_2d_jagged(self.v_cache, self.kv_caching_offsets, delta_v, None,
                                           max_len_left=self.max_kv_caching_len, max_len_right=delta)
        return full_k, full_v, self.max_kv_caching_len + delta, offsets

    # ---- the layer ----

    def _param(self, name: str, dtype: torch.dtype) -> Tensor:
        """Parameter ``name`` in ``dtype``. Without autograd (serving) the cast is kept and reused until the
        parameter changes (its version counter, or its storage), so a cached forward does not convert
        every weight of every layer on every call: 56 conversions per call of an 8-layer model."""
        p = getattr(self, name)
        if p.dtype == dtype:
            return p
        if (torch.is_grad_enabled() and p.requires_grad) or torch.compiler.is_compiling():
            return p.to(dtype)
        casts = self.__dict__.setdefault("_serving_casts", {})
        hit = casts.get((name, dtype))
        if hit is not None and hit[0] == p._version and hit[1] == p.data_ptr():
            return hit[2]
        t = p.detach().to(dtype)
        casts[(name, dtype)] = (p._version, p.data_ptr(), t)
        return t

    def _uvqk(self, x: Tensor, residual: bool = False):
        """u, q, k, v; with ``residual``, x as well, to be the output's residual (its gradient then joins
        the input norm's backward kernel)."""
        w = self._param
        fn = hstu_preprocess_with_residual if residual else hstu_preprocess
        return fn(x, w("_input_norm_weight", x.dtype), w("_input_norm_bias", x.dtype), 1e-6,
                  w("_uvqk_weight", x.dtype), w("_uvqk_beta", x.dtype), self._num_heads, self._attention_dim,
                  self._hidden_dim, recompute_normed_x=self._recompute_normed_x, recompute_uvqk=self._recompute_uvqk,
                  silu_u=False)

    def _output(self, attn: Tensor, u: Tensor, x: Tensor) -> Tensor:
        # u arrives before its SiLU: the output op applies it as it reads u (one pass less over u)
        w = self._param
        return hstu_compute_output(attn, u, x, w("_output_norm_weight", x.dtype), w("_output_norm_bias", x.dtype),
                                   1e-6, w("_output_weight", x.dtype), num_heads=self._num_heads,
                                   linear_dim=self._hidden_dim, dropout_ratio=self._output_dropout_ratio,
                                   training=self.training, concat_u=True, concat_x=True, mul_u_activation_type="silu",
                                   group_norm=self._use_group_norm, silu_u=True,
                                   recompute_y_in_backward=self._recompute_y)

    def forward(self, x: Tensor, x_lengths: Tensor, x_offsets: Tensor, max_seq_len: int, num_targets: Optional[Tensor],
                max_kv_caching_len: int = 0, kv_caching_lengths: Optional[Tensor] = None) -> Tensor:
        if x.dim() != 2 or x.shape[1] != self._embedding_dim:
            raise ValueError(f"torchfuse.nn.STULayer: x must be (L, {self._embedding_dim}), got {tuple(x.shape)}")
        u, q, k, v, residual = self._uvqk(x, residual=True)
        attn = _attention(q, k, v, x_offsets, max_seq_len, self._attn_alpha,
                          num_targets if self._target_aware else None, self._contextual_seq_len,
                          self._max_attn_len).reshape(-1, self._hidden_dim * self._num_heads)
        self.update_kv_cache(max_seq_len, x_offsets, k, v, max_kv_caching_len, kv_caching_lengths)
        return self._output(attn, u, residual)

    def cached_forward(self, delta_x: Tensor, num_targets: Optional[Tensor], max_kv_caching_len: int = 0,
                       kv_caching_lengths: Optional[Tensor] = None, append_to_cache: bool = False,
                       _slot_step: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
        """The last ``delta`` positions of every cached sequence: delta_x (B * delta, E), row
        ``b * delta + i`` the i-th new event of sequence b. Equal to those rows of ``forward`` over the
        whole histories. Costs O(delta x history) per sequence instead of O(history^2).

        ``append_to_cache=True`` (a torchfuse extension) keeps every sequence's K/V with the new rows as
        the cache, the common serving case, without the copy that ``kv_caching_lengths`` costs."""
        if append_to_cache and kv_caching_lengths is not None:
            raise ValueError("torchfuse.nn.STULayer.cached_forward: pass kv_caching_lengths or "
                             "append_to_cache=True, not both")
        u, q, k, v = self._uvqk(delta_x)
        if self._kv_slots is not None:
            return self._slotted_forward(delta_x, u, q, k, v, num_targets, kv_caching_lengths, append_to_cache,
                                         _slot_step)
        full_k, full_v, max_seq_len, offsets = self.construct_full_kv(k.flatten(1, 2), v.flatten(1, 2))
        if append_to_cache:
            self.k_cache, self.v_cache, self.kv_caching_offsets = full_k, full_v, offsets
            self.max_kv_caching_len = max_seq_len
        else:
            self.update_kv_cache(max_seq_len, offsets, full_k, full_v, max_kv_caching_len, kv_caching_lengths)
        H = self._num_heads
        attn = _attention(q, full_k.view(-1, H, self._attention_dim), full_v.view(-1, H, self._hidden_dim), offsets,
                          max_seq_len, self._attn_alpha, num_targets if self._target_aware else None,
                          self._contextual_seq_len, self._max_attn_len, delta=1)
        return self._output(attn.reshape(-1, self._hidden_dim * H), u, delta_x)

    def _slot_delta(self, delta_x: Tensor) -> int:
        """New rows per sequence of a cached_forward on the reserved cache, checked against the slots."""
        capacity, lengths = self._kv_slots
        B = lengths.numel()
        if B == 0 or delta_x.shape[0] % B:
            raise ValueError(f"torchfuse.nn.STULayer.cached_forward: delta_x must have B * delta rows (B = {B}), "
                             f"got {delta_x.shape[0]}")
        delta = delta_x.shape[0] // B
        if self.max_kv_caching_len + delta > capacity:  # a bound kept on the host: no sync for the check
            raise ValueError(f"torchfuse.nn.STULayer.cached_forward: {delta} new rows overflow the reserved "
                             f"capacity {capacity} (cached up to {self.max_kv_caching_len})")
        return delta

    def _slot_step(self, delta: int) -> Tuple[Tensor, Tensor]:
        """(dest, full): the cache rows that a call's new K/V go to (each slot's next ``delta`` rows)
        and the slot lengths with them."""
        _, lengths = self._kv_slots
        dest = (self.kv_caching_offsets[:-1] + lengths).unsqueeze(1) + torch.arange(delta, device=lengths.device)
        return dest.reshape(-1), lengths + delta

    @staticmethod
    def _advance_slots(lengths: Tensor, full: Tensor, kv_caching_lengths: Optional[Tensor],
                       append_to_cache: bool) -> None:
        if append_to_cache:
            lengths.copy_(full)  # in place: a captured CUDA graph replays it
        elif kv_caching_lengths is not None:  # keep the first kv_caching_lengths[b] rows of each sequence
            lengths.copy_(torch.minimum(kv_caching_lengths.to(lengths.dtype), full))

    def _append_rows(self, dest: Tensor, k: Tensor, v: Tensor) -> None:
        """k_cache[dest] = k, v_cache[dest] = v. k and v are views of one uvqk output, each row's k a fixed
        distance after its v: where the cache is one buffer of (v, k) pairs, a strided view pairs them up
        and one index_copy_ writes both (a kernel less per layer and call)."""
        pair = self._kv_pair
        if (pair is not None and k._base is not None and k._base is v._base and k.dtype == pair.dtype
                and k.shape == v.shape and k.stride() == v.stride() and k.stride(1) == 1):
            gap = k.storage_offset() - v.storage_offset()
        else:
            gap = 0
        if gap > 0:  # k after v in the same storage (hstu_preprocess's u, v, q, k order)
            rows = torch.as_strided(v, (v.shape[0], 2, v.shape[1]), (v.stride(0), gap, 1), v.storage_offset())
            pair.index_copy_(0, dest, rows)
            return
        self.k_cache.index_copy_(0, dest, k)
        self.v_cache.index_copy_(0, dest, v)

    def _slotted_forward(self, delta_x, u, q, k, v, num_targets, kv_caching_lengths, append_to_cache, slot_step=None):
        """cached_forward on a reserved cache: the new rows go into each slot after its cached rows.
        ``slot_step``: (dest, full) from the stack, which computes them once for all its layers and
        advances the lengths they share after the last layer."""
        if slot_step is None and self._kv_slots_shared:
            raise RuntimeError("torchfuse.nn.STULayer.cached_forward: this layer's cache slots were reserved by "
                               "its STUStack (STUStack.reserve_kv_cache) and advance with it: call "
                               "STUStack.cached_forward")
        delta = self._slot_delta(delta_x)
        dest, full = slot_step if slot_step is not None else self._slot_step(delta)
        self._append_rows(dest, k.flatten(1, 2), v.flatten(1, 2))
        max_seq_len = self.max_kv_caching_len + delta
        H = self._num_heads
        attn = _attention(q, self.k_cache.view(-1, H, self._attention_dim), self.v_cache.view(-1, H, self._hidden_dim),
                          self.kv_caching_offsets, max_seq_len, self._attn_alpha,
                          num_targets if self._target_aware else None, self._contextual_seq_len, self._max_attn_len,
                          delta=1, kv_lengths=full)
        if append_to_cache or kv_caching_lengths is not None:
            self.max_kv_caching_len = max_seq_len
            if slot_step is None:
                self._advance_slots(self._kv_slots[1], full, kv_caching_lengths, append_to_cache)
        return self._output(attn.reshape(-1, self._hidden_dim * H), u, delta_x)


class STUStack(torch.nn.Module):
    """generative-recommenders' ``STUStack``: layers applied in order (``_stu_layers``, a ModuleList)."""

    def __init__(self, stu_list: List[torch.nn.Module], is_inference: bool = False) -> None:
        super().__init__()
        self._is_inference = is_inference
        self._stu_layers = torch.nn.ModuleList(modules=stu_list)

    def forward(self, x: Tensor, x_lengths: Tensor, x_offsets: Tensor, max_seq_len: int, num_targets: Optional[Tensor],
                max_kv_caching_len: int = 0, kv_caching_lengths: Optional[Tensor] = None) -> Tensor:
        for layer in self._stu_layers:
            x = layer(x=x, x_lengths=x_lengths, x_offsets=x_offsets, max_seq_len=max_seq_len, num_targets=num_targets,
                      max_kv_caching_len=max_kv_caching_len, kv_caching_lengths=kv_caching_lengths)
        return x

    def cached_forward(self, delta_x: Tensor, num_targets: Optional[Tensor], max_kv_caching_len: int = 0,
                       kv_caching_lengths: Optional[Tensor] = None, append_to_cache: bool = False) -> Tensor:
        if append_to_cache and kv_caching_lengths is not None:
            raise ValueError("torchfuse.nn.STUStack.cached_forward: pass kv_caching_lengths or "
                             "append_to_cache=True, not both")
        layers = list(self._stu_layers)
        step = None
        if layers and getattr(layers[0], "_kv_slots_shared", False):  # layers of other kinds have no slots
            # slots reserved by the stack: the rows the new K/V go to and the lengths after them are the
            # same for every layer, computed once here, and the shared lengths advance once at the end
            step = layers[0]._slot_step(layers[0]._slot_delta(delta_x))
        for layer in layers:
            delta_x = layer.cached_forward(delta_x=delta_x, num_targets=num_targets,
                                           max_kv_caching_len=max_kv_caching_len,
                                           kv_caching_lengths=kv_caching_lengths, append_to_cache=append_to_cache,
                                           _slot_step=step)
        if step is not None:
            STULayer._advance_slots(layers[0]._kv_slots[1], step[1], kv_caching_lengths, append_to_cache)
        return delta_x

    def reset_kv_cache(self) -> None:
        for layer in self._stu_layers:
            layer.reset_kv_cache()

    def reserve_kv_cache(self, capacity: int) -> None:
        """Every layer's :meth:`STULayer.reserve_kv_cache`. The layers' slot lengths are then one tensor
        that :meth:`cached_forward` advances once per call (the layers of a stack cache the same
        sequences), so a call's index work is not repeated per layer; a layer's own ``cached_forward``
        then refuses to run alone on these slots."""
        layers = list(self._stu_layers)
        for layer in layers:
            layer.reserve_kv_cache(capacity)
        if not layers:
            return
        first = layers[0]
        same = all(torch.equal(layer._kv_slots[1], first._kv_slots[1])
                   and torch.equal(layer.kv_caching_offsets, first.kv_caching_offsets)
                   and layer.max_kv_caching_len == first.max_kv_caching_len for layer in layers)
        if same:  # one sync, at reserve time
            for layer in layers:
                layer._kv_slots = (capacity, first._kv_slots[1])
                layer._kv_slots_shared = True

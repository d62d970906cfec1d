"""HSTURecommender: a generative (next-item) retrieval model on torchfuse.

ids -> item rows from a ``torchfuse.DynamicEmbedding`` (any int64 id, LRU eviction at a capacity)
-> optional contextual rows (the user's id, from a second table) put in front of each history with
``concat_2d_jagged`` -> scaled item rows + learned positions -> an ``STUStack`` -> the contextual rows
split off -> L2-normalised user vectors, one per history position. Items are scored by the inner
product of L2-normalised vectors (cosine), as generative-recommenders' retrieval recipe does.
"""
import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import optim as _optim
from ..dynamic_embedding import DynamicEmbedding
from ..jagged import concat_2d_jagged, split_2d_jagged
from ..stu import STULayer, STULayerConfig, STUStack

__all__ = ["HSTURecommenderConfig", "HSTURecommender"]


@dataclasses.dataclass
class HSTURecommenderConfig:
    """The model's shape. ``item_capacity`` rows are kept (LRU eviction past it, growth from
    ``item_initial_capacity``); ``user_context`` puts one row per user id in front of its history, as
    an ordinary causal first token (not GR's contextual rows, which attend the whole sequence: through
    a stack of layers that would leak later items into earlier positions' vectors)."""

    embedding_dim: int = 64
    num_layers: int = 2
    num_heads: int = 2
    attention_dim: int = 32
    hidden_dim: int = 32
    max_seq_len: int = 200
    dropout: float = 0.2
    item_capacity: int = 1 << 20
    item_initial_capacity: int = 1 << 12
    user_context: bool = False
    user_capacity: int = 1 << 20
    embedding_lr: float = 1e-3
    embedding_optimizer: str = "adam"   # "adam" | "sgd" | "rowwise_adagrad"
    init_std: float = 0.02
    seed: int = 0
    compute_dtype: torch.dtype = torch.float32  # the STU stack's dtype (bfloat16 on GPUs for speed)

    @property
    def num_contextual(self) -> int:
        return 1 if self.user_context else 0


def _table_optimizer(name: str, lr: float):
    if name == "adam":
        return _optim.Adam(lr=lr)
    if name == "sgd":
        return _optim.SGD(lr=lr)
    if name == "rowwise_adagrad":
        return _optim.RowWiseAdagrad(lr=lr)
    raise ValueError(f"HSTURecommenderConfig.embedding_optimizer: expected 'adam', 'sgd' or 'rowwise_adagrad', "
                     f"got {name!r}")


class HSTURecommender(torch.nn.Module):
    """Encodes jagged item histories into per-position user vectors and scores items against them.

    The embedding tables train themselves (their backward applies their own optimizer in place, one
    step per backward); the dense part (positions, STU layers) trains with any torch optimizer over
    ``dense_parameters()``."""

    def __init__(self, config: HSTURecommenderConfig, device="cuda"):
        super().__init__()
        self.config = c = config
        device = torch.device(device)
        self.items = DynamicEmbedding(
            c.embedding_dim, min(c.item_initial_capacity, c.item_capacity), max_capacity=c.item_capacity,
            device=device, eviction="lru", initializer=("normal", 0.0, c.init_std),
            optimizer=_table_optimizer(c.embedding_optimizer, c.embedding_lr), seed=c.seed)
        self.users = DynamicEmbedding(
            c.embedding_dim, min(1 << 12, c.user_capacity), max_capacity=c.user_capacity, device=device,
            eviction="lru", initializer=("normal", 0.0, c.init_std),
            optimizer=_table_optimizer(c.embedding_optimizer, c.embedding_lr), seed=c.seed + 1) \
            if c.user_context else None
        # the dense part's initial values are a function of config.seed alone (the tables' already are),
        # drawn on the CPU so no device's generator is touched
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(c.seed)
            self.positions = torch.nn.Embedding(c.max_seq_len + c.num_contextual, c.embedding_dim)
            torch.nn.init.normal_(self.positions.weight, std=math.sqrt(1.0 / c.embedding_dim))
            self.positions.to(device)
            layer_cfg = STULayerConfig(embedding_dim=c.embedding_dim, num_heads=c.num_heads, hidden_dim=c.hidden_dim,
                                       attention_dim=c.attention_dim, output_dropout_ratio=c.dropout,
                                       target_aware=False)
            self.stack = STUStack([STULayer(layer_cfg) for _ in range(c.num_layers)]).to(device)
        if c.compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"HSTURecommenderConfig.compute_dtype: float32, bfloat16 or float16, got {c.compute_dtype}")

    def dense_parameters(self):
        return [p for n, p in self.named_parameters()]

    def _positions(self, offsets: Tensor, total: int) -> Tensor:
        lengths = offsets[1:] - offsets[:-1]
        starts = torch.repeat_interleave(offsets[:-1], lengths, output_size=total)
        return torch.arange(total, device=offsets.device) - starts

    def encode(self, items: Tensor, offsets: Tensor, max_len: int, user_ids: Optional[Tensor] = None,
               item_rows: Optional[Tensor] = None) -> Tensor:
        """Per-position user vectors (T, E), L2-normalised: row i summarises its history up to and
        including item i (causal). ``item_rows`` (T, E) skips the table lookup (the caller looked
        the items up together with others, so the table takes one optimizer step per backward)."""
        return self._encode(items, offsets, max_len, user_ids, item_rows)

    def forward(self, items: Tensor, offsets: Tensor, max_len: int, user_ids: Optional[Tensor] = None,
                item_rows: Optional[Tensor] = None) -> Tensor:
        """:meth:`encode` (``DistributedDataParallel`` reaches the model through its forward)."""
        return self._encode(items, offsets, max_len, user_ids, item_rows)

    def _encode(self, items, offsets, max_len, user_ids, item_rows, kv_caching_lengths=None):
        c = self.config
        if max_len > c.max_seq_len:
            raise ValueError(f"HSTURecommender.encode: max_len {max_len} exceeds max_seq_len {c.max_seq_len}")
        T = items.numel()
        x = self.items(items) if item_rows is None else item_rows
        x = x * math.sqrt(c.embedding_dim)
        B = offsets.numel() - 1
        n_ctx = c.num_contextual
        hist_offsets = offsets
        if n_ctx:
            if user_ids is None or user_ids.numel() != B:
                raise ValueError("HSTURecommender.encode: user_ids (B,) is required with user_context")
            ctx = self.users(user_ids) * math.sqrt(c.embedding_dim)
            x, offsets = concat_2d_jagged(ctx, None, x, offsets, max_len_left=1, max_len_right=max_len)
        total = T + B * n_ctx
        pos = self._positions(offsets, total)
        x = F.dropout(x + self.positions(pos), p=c.dropout, training=self.training)
        lengths = offsets[1:] - offsets[:-1]
        # the attention's 1/N scale uses the configured N, as generative-recommenders' training does, so a
        # user's vectors do not depend on which other users share the batch (and serving equals training)
        y = self.stack(x.to(c.compute_dtype), lengths, offsets, c.max_seq_len + n_ctx, None,
                       kv_caching_lengths=kv_caching_lengths).float()
        if n_ctx:
            _, y = split_2d_jagged(y, None, hist_offsets, max_len_left=n_ctx, total_len_left=B * n_ctx,
                                   total_len_right=T)
        return F.normalize(y, dim=-1, eps=1e-6)

    def item_vectors(self, item_ids: Tensor) -> Tensor:
        """L2-normalised rows of ``item_ids`` (no insertion in eval mode: unseen ids read as zeros)."""
        return F.normalize(self.items(item_ids), dim=-1, eps=1e-6)

    # ---- serving: the STU stack's K/V cache ----

    @torch.no_grad()
    def prefill(self, items: Tensor, offsets: Tensor, max_len: int, user_ids: Optional[Tensor] = None) -> Tensor:
        """Encode whole histories once and keep every layer's K/V for :meth:`extend`. Returns the last
        position's user vector of each history (B, E). Every history needs at least one item. A cache
        from an earlier prefill is dropped first, so two caches never share the memory."""
        self.stack.reset_kv_cache()
        self._cached_lengths = None
        self.__dict__.pop("_extend_graphs", None)  # recorded against the previous cache
        lengths = offsets[1:] - offsets[:-1]
        n_ctx = self.config.num_contextual
        y = self._encode(items, offsets, max_len, user_ids, None, kv_caching_lengths=lengths + n_ctx)
        # a slot of max_seq_len rows per user: extend then appends in place, never copying the cache
        self.stack.reserve_kv_cache(self.config.max_seq_len + n_ctx)
        self._cached_lengths = lengths.clone()
        self._cached_max = int(lengths.max()) if lengths.numel() else 0  # kept on the host: extend needs no sync
        return y[offsets[1:] - 1]

    @torch.no_grad()
    def extend(self, new_items: Tensor, user_ids: Optional[Tensor] = None, *, cuda_graph: bool = False) -> Tensor:
        """Score d new events per cached user: ``new_items`` (B * d,), row ``b * d + i`` the i-th new
        event of user b. Returns their user vectors (B * d, E), equal to :meth:`encode` over the
        extended histories at those positions, at O(d x history) cost; the cache grows by d.

        ``cuda_graph=True`` (CUDA): the call runs as a CUDA graph, recorded on the first call of each
        shape (that call runs eagerly) and replayed after; the same results, without the host's per-op
        cost that dominates small requests (``recsys/_serving_graphs.py``). In eval mode the graph holds
        the whole call, the item lookup included; in training mode the lookup (which inserts) runs
        before it."""
        if getattr(self, "_cached_lengths", None) is None:
            raise RuntimeError("HSTURecommender.extend: no cached histories; call prefill first")
        c = self.config
        B = self._cached_lengths.numel()
        if B == 0 or new_items.numel() % B:
            raise ValueError(f"HSTURecommender.extend: new_items must have B * d entries (B = {B}), "
                             f"got {new_items.numel()}")
        d = new_items.numel() // B
        if self._cached_max + d > c.max_seq_len:
            raise ValueError(f"HSTURecommender.extend: histories would exceed max_seq_len {c.max_seq_len}")
        self._cached_max += d
        new_items = new_items.reshape(-1)
        lookup_in_graph = cuda_graph and not self.items.training
        if not lookup_in_graph:
            new_items = self.items(new_items)  # the rows, looked up (inserted in training mode) eagerly
        if not cuda_graph:
            return self._extend_step(new_items, d, looked_up=True)
        if not new_items.is_cuda:
            raise ValueError("HSTURecommender.extend: cuda_graph=True needs the model on a CUDA device")
        if any(layer._kv_slots is None for layer in self.stack._stu_layers):
            raise RuntimeError("HSTURecommender.extend: cuda_graph=True needs the slotted cache that prefill "
                               "reserves (STUStack.reserve_kv_cache)")
        from ._serving_graphs import ServingGraphs
        graphs = self.__dict__.setdefault("_extend_graphs", ServingGraphs())
        return graphs.run(self._graph_token(lookup_in_graph), new_items,
                          lambda inp: self._extend_step(inp, d, looked_up=not lookup_in_graph))

    def _extend_step(self, new: Tensor, d: int, looked_up: bool) -> Tensor:
        """extend's device work for ``new``: item ids (B * d,), or their rows (B * d, E) when
        ``looked_up``. It reads and writes only buffers that stay in place (the slotted cache, the
        lengths), so a CUDA graph can replay it."""
        c = self.config
        x = (new if looked_up else self.items(new)) * math.sqrt(c.embedding_dim)
        pos = (self._cached_lengths.unsqueeze(1) + c.num_contextual
               + torch.arange(d, device=x.device)).reshape(-1)
        x = x + self.positions(pos)
        self._cached_lengths.add_(d)
        # cached_forward scales by (cached max length + d): pin that to the configured N, as encode does; the
        # same value passed on spares each layer's cache update a device sync for the new maximum
        pinned = c.max_seq_len + c.num_contextual - d
        for layer in self.stack._stu_layers:
            layer.max_kv_caching_len = pinned
        y = self.stack.cached_forward(x.to(c.compute_dtype), None, append_to_cache=True).float()
        return F.normalize(y, dim=-1, eps=1e-6)

    def _graph_token(self, lookup_in_graph: bool) -> tuple:
        """What a recorded extend graph depends on beyond its input: every parameter's storage and
        version (the layers keep reduced-precision copies of them while they are unchanged), the cache
        buffers and, with the lookup inside, the item table's storage."""
        token = [lookup_in_graph, self._cached_lengths.data_ptr()]
        for mod in self.modules():  # each module's own parameters: about a third of parameters()'s host time
            for p in mod._parameters.values():
                if p is not None:
                    token += (p.data_ptr(), p._version)
        for layer in self.stack._stu_layers:
            token += (layer.k_cache.data_ptr(), layer.v_cache.data_ptr())
        if lookup_in_graph:
            token += [t.data_ptr() for t in self.items._tensors]
        return tuple(token)

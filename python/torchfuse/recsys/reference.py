"""The recommender in plain PyTorch: ``torch.nn.Embedding`` tables over a fixed catalog, generative-
recommenders' STU formulation with eager attention (``torchfuse.reference``), the same positions and
parameter names as :class:`HSTURecommender`'s dense part, so the two load each other's weights. It is
the oracle of the recommender's tests and the eager baseline of its benchmark."""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..reference import stu_layer_reference
from ..stu import STULayerConfig
from .model import HSTURecommender, HSTURecommenderConfig

__all__ = ["ReferenceRecommender"]


class _Layer(torch.nn.Module):
    """An STU layer's parameters under GR's names; forward is ``layer_fn``, ``stu_layer_reference``
    unless replaced (the benchmark puts a ``torch.compile`` of it there)."""

    def __init__(self, cfg: STULayerConfig, like: torch.nn.Module):
        super().__init__()
        self.cfg = cfg
        self.layer_fn = stu_layer_reference
        for name, p in like.named_parameters():
            setattr(self, name, torch.nn.Parameter(p.detach().clone()))

    def forward(self, x, offsets, max_seq_len):
        params = {n: p for n, p in self.named_parameters()}
        return self.layer_fn(params, self.cfg, x, offsets, max_seq_len, None, training=self.training)


class ReferenceRecommender(torch.nn.Module):
    """Built from a :class:`HSTURecommender` and the catalog of item ids (and user ids) it will see: the
    tables start as copies of the dynamic tables' rows for those ids (``find_or_insert`` fills them
    first), the dense part as a copy of its parameters. Trains with sparse gradients
    (``torch.optim.SGD`` over ``sparse_parameters()`` matches the dynamic tables' SGD)."""

    def __init__(self, model: HSTURecommender, item_ids: Tensor, user_ids: Optional[Tensor] = None):
        super().__init__()
        c: HSTURecommenderConfig = model.config
        self.config = c
        self.item_ids = torch.unique(item_ids)
        with torch.no_grad():
            rows = model.items.find_or_insert(self.item_ids.to(model.items.device)).detach().float().cpu()
        self.item_table = torch.nn.Embedding.from_pretrained(rows.to(model.positions.weight.device), freeze=False,
                                                             sparse=True)
        if c.user_context:
            self.user_ids = torch.unique(user_ids)
            with torch.no_grad():
                urows = model.users.find_or_insert(self.user_ids.to(model.users.device)).detach().float().cpu()
            self.user_table = torch.nn.Embedding.from_pretrained(urows.to(model.positions.weight.device),
                                                                 freeze=False, sparse=True)
        self.positions = torch.nn.Embedding.from_pretrained(model.positions.weight.detach().clone(), freeze=False)
        cfg = STULayerConfig(embedding_dim=c.embedding_dim, num_heads=c.num_heads, hidden_dim=c.hidden_dim,
                             attention_dim=c.attention_dim, output_dropout_ratio=c.dropout, target_aware=False)
        self.layers = torch.nn.ModuleList(_Layer(cfg, m) for m in model.stack._stu_layers)

    def sparse_parameters(self):
        return [self.item_table.weight] + ([self.user_table.weight] if self.config.user_context else [])

    def dense_parameters(self):
        return [self.positions.weight] + [p for layer in self.layers for p in layer.parameters()]

    def _index(self, ids: Tensor, catalog: Tensor) -> Tensor:
        catalog = catalog.to(ids.device)
        idx = torch.searchsorted(catalog, ids)
        if bool((idx >= catalog.numel()).any()) or not torch.equal(catalog[idx.clamp(max=catalog.numel() - 1)], ids):
            raise KeyError("ReferenceRecommender: an id outside the catalog it was built with")
        return idx

    def item_rows(self, ids: Tensor) -> Tensor:
        return self.item_table(self._index(ids, self.item_ids))

    def encode(self, items: Tensor, offsets: Tensor, max_len: int, user_ids: Optional[Tensor] = None,
               item_rows: Optional[Tensor] = None) -> Tensor:
        c = self.config
        x = (self.item_rows(items) if item_rows is None else item_rows) * math.sqrt(c.embedding_dim)
        B = offsets.numel() - 1
        n_ctx = c.num_contextual
        bounds = offsets.tolist()
        if n_ctx:
            ctx = self.user_table(self._index(user_ids, self.user_ids)) * math.sqrt(c.embedding_dim)
            x = torch.cat([torch.cat([ctx[b:b + 1], x[bounds[b]:bounds[b + 1]]]) for b in range(B)]) if B else x
            offsets = offsets + torch.arange(B + 1, device=offsets.device) * n_ctx
            bounds = offsets.tolist()
        pos = torch.cat([torch.arange(bounds[b + 1] - bounds[b]) for b in range(B)]) if B else \
            torch.empty(0, dtype=torch.long)
        x = F.dropout(x + self.positions(pos.to(x.device)), p=c.dropout, training=self.training)
        for layer in self.layers:
            x = layer(x, offsets, c.max_seq_len + n_ctx)
        if n_ctx:
            keep = torch.cat([torch.arange(bounds[b] + n_ctx, bounds[b + 1]) for b in range(B)]) if B else pos
            x = x[keep.to(x.device)]
        return F.normalize(x, dim=-1, eps=1e-6)

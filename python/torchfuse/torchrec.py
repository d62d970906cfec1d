"""TorchRec drop-ins: embedding collections backed by :class:`torchfuse.DynamicEmbedding` tables.

``DynamicEmbeddingBagCollection`` / ``DynamicEmbeddingCollection`` take a ``KeyedJaggedTensor`` (KJT)
and return what TorchRec's ``EmbeddingBagCollection`` / ``EmbeddingCollection`` return (a
``KeyedTensor``, a ``Dict[str, JaggedTensor]``), with one hash table per table config shared by its
features. ``swap_embedding_modules(model)`` replaces TorchRec's static collections inside a model.

Inputs are read only through the KJT interface (``keys()``, ``values()``, ``offsets()`` /
``lengths()``, ``weights_or_none()``, ``stride()``), and torchrec is imported lazily: without it the
modules accept any object with that interface and return the stand-ins :class:`KeyedTensor` /
:class:`JaggedTensor` defined here.
"""
import functools
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import dynemb_tables as _tables
from .dynamic_embedding import DynamicEmbedding, DynamicEmbeddingBag, _compiled
from .dynamic_embedding._training import with_step

__all__ = ["DynamicEmbeddingBagCollection", "DynamicEmbeddingCollection", "StandInKJT", "swap_embedding_modules",
           "KeyedTensor", "JaggedTensor"]


def _torchrec():
    try:
        import torchrec  # noqa: F401
        from torchrec.sparse import jagged_tensor
        return jagged_tensor
    except Exception:  # not installed, or its native deps fail to load
        return None


class KeyedTensor:
    """Stand-in for ``torchrec.KeyedTensor`` when torchrec is not installed: ``values()`` is
    (B, sum of length_per_key), key k owning a block of columns."""

    def __init__(self, keys: List[str], length_per_key: List[int], values: Tensor, key_dim: int = 1):
        self._keys, self._length_per_key, self._values, self._key_dim = list(keys), list(length_per_key), values, key_dim

    def keys(self) -> List[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def length_per_key(self) -> List[int]:
        return self._length_per_key

    def key_dim(self) -> int:
        return self._key_dim

    def to_dict(self) -> Dict[str, Tensor]:
        return dict(zip(self._keys, torch.split(self._values, self._length_per_key, dim=self._key_dim)))

    def __getitem__(self, key: str) -> Tensor:
        return self.to_dict()[key]


class JaggedTensor:
    """Stand-in for ``torchrec.JaggedTensor``: ``values()`` (n, dim) with per-sample ``lengths()``."""

    def __init__(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None):
        self._values, self._lengths, self._weights = values, lengths, weights

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        return self._lengths

    def offsets(self) -> Tensor:
        return torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> Optional[Tensor]:
        return self._weights


class StandInKJT:
    """The part of TorchRec's ``KeyedJaggedTensor`` the collections read (keys, values, lengths,
    offsets, weights, stride), to feed them where torchrec is not installed: ``StandInKJT(keys,
    values, lengths, weights=None)``, lengths (len(keys) * B,) feature-major as in a KJT."""

    def __init__(self, keys, values: Tensor, lengths: Tensor, weights: Optional[Tensor] = None):
        self._keys, self._values, self._lengths, self._weights = list(keys), values, lengths, weights
        self._offsets = None

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def offsets(self):
        if self._offsets is None:
            self._offsets = torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])
        return self._offsets

    def weights_or_none(self):
        return self._weights

    def stride(self):
        return self._lengths.numel() // max(len(self._keys), 1)


def _field(cfg, name, default=None):
    return getattr(cfg, name, default)


def _pooling(cfg) -> str:
    """'sum' or 'mean' from a config's pooling (a torchrec PoolingType, or a string)."""
    p = _field(cfg, "pooling", "sum")
    p = getattr(p, "name", p)
    p = str(p).lower()
    if p not in ("sum", "mean"):
        raise ValueError(f"torchfuse.torchrec: table {cfg.name!r}: pooling must be SUM or MEAN, got {p.upper()}")
    return p


def _embedding_names(tables) -> List[List[str]]:
    """Output names per table, as TorchRec names them: the feature name, or 'feature@table' when a
    feature feeds several tables."""
    seen: Dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            seen[f] = seen.get(f, 0) + 1
    return [[f if seen[f] == 1 else f"{f}@{t.name}" for f in t.feature_names] for t in tables]


def _capacity_for(capacity, cfg) -> int:
    """A table's initial capacity: `capacity` (an int, or a mapping table name -> int), default room
    for the static table's rows at half load."""
    if isinstance(capacity, Mapping):
        capacity = capacity.get(cfg.name)
    if capacity is None:
        return max(2 * int(_field(cfg, "num_embeddings", 1) or 1), 128)
    return int(capacity)


class _KJTView:
    """The parts of a KJT the collections need, read once per forward with at most one host sync:
    per key, the [start, end) of its ids in values() and its slice of offsets.

    sync=False defers that sync: ``pending`` (a device int64 vector) is to be read by the caller
    together with its own next host read, and handed to ``finish``, which checks the KJT (until then
    nothing may read ids through the offsets)."""

    def __init__(self, features, wanted: Sequence[str], owner: str, sync: bool = True):
        keys = list(features.keys())
        unknown = [k for k in keys if k not in wanted]
        if unknown:
            raise KeyError(f"{owner}: the KJT has feature keys {unknown} that no table reads "
                           f"(features: {list(wanted)})")
        missing = [k for k in wanted if k not in keys]
        if missing:
            raise KeyError(f"{owner}: the KJT lacks feature keys {missing} (it has {keys})")
        self.index = {k: i for i, k in enumerate(keys)}
        self.B = int(features.stride())
        self.values = features.values()
        self.weights = features.weights_or_none()
        offsets = _offsets_of(features)
        F = len(keys)
        if offsets.dim() != 1 or offsets.numel() != F * self.B + 1:
            raise ValueError(f"{owner}: the KJT's offsets/lengths must have {F} keys x {self.B} samples "
                             f"(+1) entries, got {offsets.numel()}")
        self.offsets = offsets
        self.owner = owner
        n = self.values.numel()
        if self.weights is not None and self.weights.numel() != n:
            raise ValueError(f"{owner}: the KJT has {self.weights.numel()} weights for {n} values")
        bounds = offsets[:: self.B] if self.B > 0 else offsets[:1].expand(F + 1)
        # per-key bounds, and whether any length is negative
        decreasing = (offsets[1:] < offsets[:-1]).any().view(1).to(bounds.dtype)
        self.pending = torch.cat([bounds, decreasing]).to(torch.int64)
        self.bounds: Optional[List[int]] = None
        if sync:
            self.finish(self.pending.tolist())  # the one host sync

    def finish(self, host: List[int]):
        *bounds, bad = host
        self.bounds = [int(b) for b in bounds]
        n = self.values.numel()
        if bad or self.bounds[0] != 0 or self.bounds[-1] != n or any(a > b for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"{self.owner}: the KJT's lengths do not match its values: per-key offsets "
                             f"{self.bounds} for {n} values")

    def segment(self, names: Sequence[str], with_weights: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """(ids, offsets (len(names)*B + 1, starting at 0), weights) of the named keys, in that order.
        Keys adjacent in the KJT in the same order are a view; others are concatenated."""
        idx = [self.index[k] for k in names]
        B = self.B
        runs: List[Tuple[int, int]] = []  # maximal runs of consecutive key indices
        for i in idx:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        ids, offs, wts, base = [], [], [], 0
        for a, b in runs:
            lo, hi = self.bounds[a], self.bounds[b]
            ids.append(self.values[lo:hi])
            if with_weights and self.weights is not None:
                wts.append(self.weights[lo:hi])
            o = self.offsets[a * B: b * B + 1]
            offs.append(o[:-1] - (lo - base))  # rebased onto the gathered ids
            base += hi - lo
        ids_t = ids[0] if len(ids) == 1 else torch.cat(ids)
        last = self.offsets.new_full((1,), base)
        off_t = torch.cat(offs + [last])
        w_t = None
        if wts:
            w_t = wts[0] if len(wts) == 1 else torch.cat(wts)
        return ids_t, off_t, w_t


def _offsets_of(features) -> Tensor:
    offsets_fn = getattr(features, "offsets", None)
    if offsets_fn is not None:
        try:
            return offsets_fn()
        except Exception:
            pass
    lengths = features.lengths()
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


class _Tables(torch.nn.ModuleDict):
    """The collections' tables by name; calling it returns their configs, as TorchRec's planner reads
    a pooled-embedding module's ``tables()``."""

    def __init__(self, modules, configs):
        super().__init__(modules)
        self._table_configs = list(configs)

    def forward(self):
        return self._table_configs


class _Collection(torch.nn.Module):
    def __init__(self, tables, table_cls, *, device, capacity, max_capacity, eviction, optimizer,
                 initializer, extra):
        super().__init__()
        if not tables:
            raise ValueError(f"torchfuse.torchrec.{type(self).__name__}: tables must not be empty")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"torchfuse.torchrec.{type(self).__name__}: duplicate table names in {names}")
        self._configs = list(tables)
        self._feature_names = [list(t.feature_names or [t.name]) for t in tables]
        for t, f in zip(tables, self._feature_names):
            if not t.feature_names:
                t.feature_names = f
        self._embedding_names = _embedding_names(tables)
        self._all_features = list(dict.fromkeys(f for fs in self._feature_names for f in fs))
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        # the output classes, torchrec's when it imports: resolved here, because compiled code cannot
        # try an import that fails
        jt = _torchrec()
        self._keyed_tensor_cls = jt.KeyedTensor if jt is not None else KeyedTensor
        self._jagged_tensor_cls = jt.JaggedTensor if jt is not None else JaggedTensor
        mods = {}
        for t in tables:
            kw = dict(extra(t))
            if max_capacity is not None:
                kw["max_capacity"] = max_capacity.get(t.name) if isinstance(max_capacity, Mapping) else max_capacity
            if optimizer is not None:
                kw["optimizer"] = optimizer
            if initializer is not None:
                kw["initializer"] = initializer
            cap = _capacity_for(capacity, t)
            if kw.get("max_capacity") is not None:
                kw["max_capacity"] = max(int(kw["max_capacity"]), cap)
            mods[t.name] = table_cls(int(t.embedding_dim), cap, device=self._device, eviction=eviction, **kw)
        self.tables = _Tables(mods, self._configs)
        _compiled.register(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        _compiled.register(self)  # a copy finds itself, not the original, from compiled code

    @property
    def device(self) -> torch.device:
        return self._device

    # ---- torch.compile (dynamic_embedding/_compiled.py): the forward as one opaque op ----

    def _compiled_tables(self):
        return [self.tables[c.name] for c in self._configs]

    def _need_grad(self) -> bool:
        return torch.is_grad_enabled() and any(t._trainable for t in self.tables.values())

    def _compiled_inputs(self, features) -> List[Optional[Tensor]]:
        """The KJT as the op's inputs: values, lengths, weights and its keys (their indices in
        _all_features, a constant of the graph)."""
        keys = list(features.keys())
        unknown = [k for k in keys if k not in self._all_features]
        if unknown:
            raise KeyError(f"torchfuse.torchrec.{type(self).__name__}: the KJT has feature keys {unknown} that no "
                           f"table reads (features: {self._all_features})")
        idx = torch.tensor([self._all_features.index(k) for k in keys], dtype=torch.int64)
        return [features.values(), features.lengths(), features.weights_or_none(), idx]

    def _kjt_of(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor], idx: Tensor) -> "StandInKJT":
        return StandInKJT([self._all_features[i] for i in idx.tolist()], values, lengths, weights)

    def table_configs(self):
        return self._configs


class DynamicEmbeddingBagCollection(_Collection):
    """Drop-in for ``torchrec.EmbeddingBagCollection`` with one :class:`torchfuse.DynamicEmbeddingBag`
    hash table per table config: ids are arbitrary int64 (rows are created on first sight in
    training mode), not indices below ``num_embeddings``.

    ``forward(features: KeyedJaggedTensor) -> KeyedTensor`` with TorchRec's keys, key order,
    ``length_per_key`` and values layout (B, sum of dims, float32). SUM and MEAN pooling; per-id
    weights from the KJT are used when ``is_weighted`` (default: whenever the KJT has weights).

    Args:
        tables: ``EmbeddingBagConfig``s (or objects with name, embedding_dim, num_embeddings,
            feature_names, pooling).
        device: where the tables live.
        capacity: initial slots per table (int or {table name: int}); default 2 x num_embeddings.
        max_capacity, eviction, optimizer, initializer: as :class:`torchfuse.DynamicEmbedding`
            (max_capacity may also be a {table name: int} mapping).
        is_weighted: use the KJT's weights (None: when it has them).
        table_batched: run all tables in one set of launches per step (torchfuse.dynemb_tables) when
            they share a row width, device and optimizer configuration (default True); False: one
            table after another. The results are the same; pooled values are accumulated in float32
            and returned in float32 without rounding to a 16-bit table dtype first.
        **table_options: further :class:`torchfuse.DynamicEmbedding` arguments (dtype, seed,
            hbm_budget_bytes, ...), applied to every table.

    ``torch.compile(fullgraph=True)`` works over it and models around it, with eager mode's results:
    the forward is one opaque op (as :class:`torchfuse.DynamicEmbedding`'s: the inserts' host
    decisions run inside it) and the KeyedTensor is built around it. KJT weights that require grad
    are not supported under torch.compile.
    """

    def __init__(self, tables, *, device=None, capacity=None, max_capacity=None, eviction: str = "lru",
                 optimizer=None, initializer=None, is_weighted: Optional[bool] = None, table_batched: bool = True,
                 **table_options):
        super().__init__(tables, DynamicEmbeddingBag, device=device, capacity=capacity, max_capacity=max_capacity,
                         eviction=eviction, optimizer=optimizer, initializer=initializer,
                         extra=lambda t: dict(table_options, mode=_pooling(t), include_last_offset=True))
        self._is_weighted = is_weighted
        self._length_per_key = [int(t.embedding_dim) for t, fs in zip(self._configs, self._feature_names) for _ in fs]
        self.table_batched = bool(table_batched)
        self._feature_order = [f for fs in self._feature_names for f in fs]
        self._feature_info = None  # (device, feature -> table index, feature -> MEAN), built on first use

    def _features_on(self, device):
        if self._feature_info is None or self._feature_info[0] != device:
            tab = [i for i, fs in enumerate(self._feature_names) for _ in fs]
            mean = [self.tables[c.name].mode == "mean" for c, fs in zip(self._configs, self._feature_names) for _ in fs]
            # a narrow dtype: the batched path radix-sorts ids by table index (fewer passes)
            tdt = torch.int16 if len(self._configs) < 2**15 else torch.int32
            self._feature_info = (device, torch.tensor(tab, dtype=tdt, device=device),
                                  torch.tensor(mean, dtype=torch.bool, device=device))
        return self._feature_info[1:]

    def _forward_batched(self, view, tables, use_w, need_grad: bool):
        """All tables in one batch. A KJT whose keys are the tables' features in order (the usual
        case) is used as is and its check rides on the batch's first host read (view.bounds None);
        otherwise the features are gathered in table order first."""
        feats = [f for fs in self._feature_names for f in fs]
        if view.bounds is None and not tables[0].training:  # eval needs the per-table id ranges now
            view.finish(view.pending.tolist())
        if view.bounds is None:
            ids, offsets, w = view.values, view.offsets, (view.weights if use_w else None)
        else:
            ids, offsets, w = view.segment(feats, use_w)
        ids = tables[0]._check_keys(ids)
        id_starts = None
        if view.bounds is not None:
            counts = [view.bounds[view.index[f] + 1] - view.bounds[view.index[f]] for f in feats]
            id_starts, k = [0], 0
            for fs in self._feature_names:
                id_starts.append(id_starts[-1] + sum(counts[k:k + len(fs)]))
                k += len(fs)
        table_of, mean_of = self._features_on(ids.device)
        return _tables.pooled_parts(tables, ids, offsets.to(torch.int64),
                                    w.float().contiguous() if w is not None else None, view.B,
                                    [len(fs) for fs in self._feature_names], [t.mode == "mean" for t in tables],
                                    id_starts, table_of, mean_of,
                                    pending=view.pending if view.bounds is None else None, on_pending=view.finish,
                                    need_grad=need_grad)

    def is_weighted(self) -> bool:
        return bool(self._is_weighted)

    def embedding_bag_configs(self):
        return self._configs

    def _compiled_out(self, values: Tensor, lengths: Tensor, weights: Optional[Tensor], idx: Tensor):
        return (lengths.shape[0] // max(idx.shape[0], 1), sum(self._length_per_key)), torch.float32

    def _backward(self, record, grad: Tensor):
        """The optimizer steps of a _pooled record with the gradient of its values."""
        kind, rec = record
        if kind == "tables":
            _tables.apply_pooled_gradient(self._compiled_tables(), rec, grad)
            return
        col = 0
        for bag, bag_rec, n_feats in rec:
            dim = bag.embedding_dim
            g = grad[:, col:col + n_feats * dim]
            col += n_feats * dim
            if bag_rec is not None:  # the inverse of the forward's (features, B, dim) -> (B, features * dim)
                g = g.reshape(-1, n_feats, dim).transpose(0, 1).reshape(-1, dim).to(bag.dtype)
                bag._backward(bag_rec, g)

    def _run(self, need_grad: bool, values: Tensor, lengths: Tensor, weights: Optional[Tensor], idx: Tensor):
        return self._pooled(self._kjt_of(values, lengths, weights, idx), need_grad)

    def forward(self, features):
        names = [n for ns in self._embedding_names for n in ns]
        cls = self._keyed_tensor_cls
        need_grad = self._need_grad()
        if torch.compiler.is_compiling():
            w = features.weights_or_none()
            if w is not None and w.requires_grad and torch.is_grad_enabled() and self._is_weighted is not False:
                raise NotImplementedError("torchfuse.torchrec.DynamicEmbeddingBagCollection: KJT weights that require "
                                          "grad are not supported under torch.compile")
            values = _compiled.forward(self, need_grad, self._compiled_inputs(features))
        else:
            values, record = self._pooled(features, need_grad)
            if record is not None:
                values = with_step(values, functools.partial(self._backward, record))
        return cls(keys=names, length_per_key=self._length_per_key, values=values)

    def _pooled(self, features, need_grad: bool):
        """(values (B, sum of dims) float32, the record of the optimizer steps _backward applies or
        None). Per-id weights that need their gradient flow through autograd in the values."""
        # the batched path reads a KJT in table-feature order without a sync of its own
        lazy = self.table_batched and list(features.keys()) == self._feature_order
        view = _KJTView(features, self._all_features, "torchfuse.torchrec.DynamicEmbeddingBagCollection",
                        sync=not lazy)
        B = view.B
        use_w = self._is_weighted is not False
        tables = [self.tables[c.name] for c in self._configs]
        if use_w and view.weights is not None:
            for t, cfg in zip(tables, self._configs):
                if t.mode != "sum":
                    raise ValueError(f"torchfuse.torchrec.DynamicEmbeddingBagCollection: table {cfg.name!r} has "
                                     f"MEAN pooling but the KJT carries weights (TorchRec allows weights with SUM only)")
        if self.table_batched and _tables.can_batch(tables, view.weights if use_w else None):
            values, rec = self._forward_batched(view, tables, use_w, need_grad and tables[0]._trainable)
            return values, (None if rec is None else ("tables", rec))
        if view.bounds is None:
            view.finish(view.pending.tolist())
        pooled, recs = [], []
        for cfg, feats in zip(self._configs, self._feature_names):
            bag = self.tables[cfg.name]
            ids, offsets, w = view.segment(feats, use_w)
            if w is not None and bag.mode != "sum":
                raise ValueError(f"torchfuse.torchrec.DynamicEmbeddingBagCollection: table {cfg.name!r} has "
                                 f"MEAN pooling but the KJT carries weights (TorchRec allows weights with SUM only)")
            out, rec = bag._run(need_grad and bag._trainable, ids, offsets, w)  # (len(feats) * B, dim)
            recs.append((bag, rec, len(feats)))
            dim = bag.embedding_dim
            pooled.append(out.float().view(len(feats), B, dim).transpose(0, 1).reshape(B, len(feats) * dim))
        values = torch.cat(pooled, dim=1) if pooled else torch.empty(B, 0, device=self._device)
        return values, (("bags", recs) if any(r[1] is not None for r in recs) else None)


class DynamicEmbeddingCollection(_Collection):
    """Drop-in for ``torchrec.EmbeddingCollection`` with one :class:`torchfuse.DynamicEmbedding` per
    table config: ``forward(features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]``, each feature's
    (number of ids, dim) float32 rows with the KJT's lengths. Arguments as
    :class:`DynamicEmbeddingBagCollection` (no pooling, no weights).

    Not one graph under ``torch.compile(fullgraph=True)``: the sizes of its outputs (each feature's
    number of ids) are read from the KJT on the host. Compile around it, or use one
    :class:`torchfuse.DynamicEmbedding` per table inside the compiled region."""

    def __init__(self, tables, *, device=None, capacity=None, max_capacity=None, eviction: str = "lru",
                 optimizer=None, initializer=None, **table_options):
        super().__init__(tables, DynamicEmbedding, device=device, capacity=capacity, max_capacity=max_capacity,
                         eviction=eviction, optimizer=optimizer, initializer=initializer,
                         extra=lambda t: dict(table_options))

    def embedding_configs(self):
        return self._configs

    def forward(self, features):
        view = _KJTView(features, self._all_features, "torchfuse.torchrec.DynamicEmbeddingCollection")
        cls = self._jagged_tensor_cls
        out: Dict[str, object] = {}
        for cfg, feats, names in zip(self._configs, self._feature_names, self._embedding_names):
            ids, offsets, _ = view.segment(feats, False)
            rows = self.tables[cfg.name](ids).float()                 # one lookup per table
            starts = [0]
            for f in feats:
                i = view.index[f]
                starts.append(starts[-1] + view.bounds[i + 1] - view.bounds[i])
            for j, (f, name) in enumerate(zip(feats, names)):
                i = view.index[f]
                lengths = (view.offsets[(i * view.B) + 1: (i + 1) * view.B + 1]
                           - view.offsets[i * view.B: (i + 1) * view.B])
                out[name] = cls(values=rows[starts[j]:starts[j + 1]], lengths=lengths)
        return out


def _is_collection(mod, cls_name: str) -> bool:
    jt = _torchrec()
    if jt is not None:
        from torchrec.modules import embedding_modules as em
        return isinstance(mod, getattr(em, cls_name))
    return type(mod).__name__ == cls_name


def swap_embedding_modules(model: torch.nn.Module, **dynamic_options) -> Dict[str, torch.nn.Module]:
    """Replace every TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection`` inside `model` (in
    place) with :class:`DynamicEmbeddingBagCollection` / :class:`DynamicEmbeddingCollection`. Each
    static table's rows become the initial rows of ids ``0..num_embeddings-1``, so the swapped model
    gives the same outputs on those ids and grows for ids outside that range.

    ``dynamic_options`` go to the collections (capacity, max_capacity, eviction, optimizer,
    initializer, dtype, ...); the device defaults to the static table's. Returns
    ``{qualified name: the module it replaced}``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"torchfuse.torchrec.swap_embedding_modules: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    replaced: Dict[str, torch.nn.Module] = {}
    targets = [(name, mod) for name, mod in model.named_modules()
               if _is_collection(mod, "EmbeddingBagCollection") or _is_collection(mod, "EmbeddingCollection")]
    if isinstance(model, (DynamicEmbeddingBagCollection, DynamicEmbeddingCollection)):
        return replaced
    for name, mod in targets:
        if name == "":
            raise TypeError("torchfuse.torchrec.swap_embedding_modules: pass the model that contains the "
                            "collection, not the collection itself (it is replaced in its parent)")
        bag = _is_collection(mod, "EmbeddingBagCollection")
        configs = mod.embedding_bag_configs() if bag else mod.embedding_configs()
        static = mod.embedding_bags if bag else mod.embeddings
        device = next(iter(static.values())).weight.device
        opts = dict(dynamic_options)
        opts.setdefault("device", device)
        if bag:
            opts.setdefault("is_weighted", bool(mod.is_weighted()))
            new = DynamicEmbeddingBagCollection(configs, **opts)
        else:
            new = DynamicEmbeddingCollection(configs, **opts)
        with torch.no_grad():
            for cfg in configs:
                w = static[cfg.name].weight.detach()
                table = new.tables[cfg.name]
                ev = table.insert(torch.arange(w.shape[0], device=table.device), w.to(table.device, table.dtype),
                                  return_evicted=True)
                if ev[0].numel() or len(table) != w.shape[0]:
                    raise RuntimeError(
                        f"torchfuse.torchrec.swap_embedding_modules: table {cfg.name!r}: the {w.shape[0]} static "
                        f"rows do not fit in capacity {table.capacity}; pass a larger capacity or max_capacity")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
        replaced[name] = mod
    return replaced


def __getattr__(name):
    # the TorchRec sharder subclasses torchrec's ModuleSharder: built when first asked for
    if name in ("DynamicEmbeddingSharder", "ShardedDynamicEmbeddingCollection"):
        from .distributed import _torchrec
        return getattr(_torchrec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

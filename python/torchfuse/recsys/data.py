"""User histories for sequential recommendation: a synthetic generator with structure to learn, a
MovieLens reader, a leave-one-out split and a jagged batch iterator.

A set of histories is jagged: ``items[offsets[u]:offsets[u + 1]]`` are user u's items in time order.
Item ids are any int64 (the dynamic embedding takes them as they are); nothing is re-indexed.
"""
import csv
import dataclasses
import math
import os
from typing import Iterator, Optional

import torch

__all__ = ["Histories", "Batch", "synthetic_histories", "load_movielens", "leave_one_out", "batches", "batch_users",
           "window_batch", "windows", "item_popularity"]


@dataclasses.dataclass
class Histories:
    """Jagged user histories: ``items`` (T,) int64 in time order per user, ``offsets`` (U + 1,) int64,
    ``user_ids`` (U,) int64, ``timestamps`` (T,) int64 or None."""

    items: torch.Tensor
    offsets: torch.Tensor
    user_ids: torch.Tensor
    timestamps: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.offsets.dim() != 1 or self.offsets.numel() < 1:
            raise ValueError("Histories: offsets must be 1-D with at least one element")
        if self.user_ids.numel() != self.offsets.numel() - 1:
            raise ValueError(f"Histories: user_ids has {self.user_ids.numel()} entries for "
                             f"{self.offsets.numel() - 1} histories")
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.items.numel():
            raise ValueError("Histories: offsets must start at 0 and end at items.numel()")
        if bool((self.offsets[1:] < self.offsets[:-1]).any()):
            raise ValueError("Histories: offsets must be non-decreasing")

    @property
    def num_users(self) -> int:
        return self.user_ids.numel()

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def history(self, u: int) -> torch.Tensor:
        return self.items[int(self.offsets[u]):int(self.offsets[u + 1])]


@dataclasses.dataclass
class Batch:
    """One training or evaluation batch. ``items`` (T,) int64 are the inputs, ``targets`` (T,) the next
    item at each position (what the model predicts there), ``offsets`` (B + 1,) int64, ``max_len`` the
    longest history in the batch (a Python int, so no op needs to read it from the device)."""

    items: torch.Tensor
    targets: torch.Tensor
    offsets: torch.Tensor
    user_ids: torch.Tensor
    max_len: int

    def to(self, device) -> "Batch":
        return Batch(self.items.to(device), self.targets.to(device), self.offsets.to(device),
                     self.user_ids.to(device), self.max_len)


def synthetic_histories(num_users: int, num_items: int, *, min_len: int = 8, max_len: int = 64,
                        zipf_exponent: float = 1.05, successors: int = 4, follow_prob: float = 0.8,
                        id_stride: int = 1, seed: int = 0) -> Histories:
    """Histories with planted structure: item popularity is Zipf-distributed, and each item has
    ``successors`` likely next items (a sparse transition model). Each step follows one of the current
    item's successors with probability ``follow_prob``, else draws by popularity, so the next item is
    predictable from the last one and a model that learns beats the most-popular baseline.

    Item ids are ``1 + rank * id_stride`` (rank 0 the most popular); a large ``id_stride`` gives sparse
    int64 ids like real catalogues. Lengths are uniform in [min_len, max_len]."""
    if num_users < 0 or num_items < 1:
        raise ValueError("synthetic_histories: num_users must be >= 0 and num_items >= 1")
    if not 1 <= min_len <= max_len:
        raise ValueError("synthetic_histories: need 1 <= min_len <= max_len")
    if not 0.0 <= follow_prob <= 1.0:
        raise ValueError("synthetic_histories: follow_prob must be in [0, 1]")
    g = torch.Generator().manual_seed(seed)
    popularity = torch.arange(1, num_items + 1, dtype=torch.float64).pow(-zipf_exponent)
    popularity /= popularity.sum()
    succ = torch.multinomial(popularity, num_items * successors, replacement=True, generator=g)
    succ = succ.view(num_items, successors)
    lengths = torch.randint(min_len, max_len + 1, (num_users,), generator=g)
    # step every user at once: column t holds each user's t-th item
    cur = torch.multinomial(popularity, num_users, replacement=True, generator=g) if num_users else \
        torch.empty(0, dtype=torch.long)
    cols = [cur]
    for _ in range(1, max_len):
        follow = torch.rand(num_users, generator=g) < follow_prob
        pick = torch.randint(0, successors, (num_users,), generator=g)
        fresh = torch.multinomial(popularity, num_users, replacement=True, generator=g) if num_users else cur
        cur = torch.where(follow, succ[cur, pick], fresh)
        cols.append(cur)
    grid = torch.stack(cols, dim=1)  # (U, max_len) item ranks
    keep = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)
    ranks = grid[keep]
    offsets = torch.zeros(num_users + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    times = (torch.arange(max_len).unsqueeze(0).expand(num_users, -1))[keep]
    return Histories(1 + ranks * id_stride, offsets, torch.arange(num_users, dtype=torch.long), times)


def load_movielens(path: str, *, min_rating: float = 0.0) -> Histories:
    """MovieLens ratings as histories, each user's items sorted by (timestamp, file order).

    ``path`` is a ``ratings.dat`` file ("user::item::rating::time", ML-1M / ML-10M), a ``ratings.csv``
    ("userId,movieId,rating,timestamp" with a header, ML-20M / ML-25M / latest), or a directory holding
    one of them. Ratings below ``min_rating`` are dropped. Nothing is downloaded."""
    if os.path.isdir(path):
        for name in ("ratings.dat", "ratings.csv"):
            if os.path.exists(os.path.join(path, name)):
                path = os.path.join(path, name)
                break
        else:
            raise FileNotFoundError(f"load_movielens: no ratings.dat or ratings.csv in {path}")
    users, items, times = [], [], []
    with open(path, newline="", encoding="latin-1") as f:
        if path.endswith(".csv"):
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None or [h.strip().lower() for h in header[:4]] != ["userid", "movieid", "rating", "timestamp"]:
                raise ValueError(f"load_movielens: {path} has no 'userId,movieId,rating,timestamp' header")
            rows = reader
        else:
            rows = (line.rstrip("\r\n").split("::") for line in f if line.strip())
        for n, row in enumerate(rows, start=1):
            if len(row) < 4:
                raise ValueError(f"load_movielens: {path} line {n}: expected 4 fields, got {len(row)}")
            try:
                u, i, r, t = int(row[0]), int(row[1]), float(row[2]), int(row[3])
            except ValueError as e:
                raise ValueError(f"load_movielens: {path} line {n}: {e}") from None
            if r >= min_rating:
                users.append(u)
                items.append(i)
                times.append(t)
    u = torch.tensor(users, dtype=torch.long)
    i = torch.tensor(items, dtype=torch.long)
    t = torch.tensor(times, dtype=torch.long)
    # stable sort by time, then by user: each user's items come out in time order, ties in file order
    order = torch.sort(t, stable=True).indices
    order = order[torch.sort(u[order], stable=True).indices]
    u, i, t = u[order], i[order], t[order]
    user_ids, counts = torch.unique_consecutive(u, return_counts=True)
    offsets = torch.zeros(user_ids.numel() + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(counts, 0)
    return Histories(i, offsets, user_ids, t)


def leave_one_out(h: Histories, min_len: int = 2):
    """Split off each user's last item: returns (train histories without it, targets (U',)) over the
    users with at least ``min_len`` items (the others have nothing to train on and predict)."""
    lengths = h.lengths
    keep = lengths >= max(min_len, 2)
    idx = keep.nonzero().flatten()
    new_len = lengths[idx] - 1
    starts = h.offsets[idx]
    offsets = torch.zeros(idx.numel() + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(new_len, 0)
    gather = _ranges(starts, new_len)
    targets = h.items[h.offsets[idx + 1] - 1]
    ts = h.timestamps[gather] if h.timestamps is not None else None
    return Histories(h.items[gather], offsets, h.user_ids[idx], ts), targets


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated arange(starts[k], starts[k] + lengths[k])."""
    total = int(lengths.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=total)
    # each range's start less its offset in the output, gathered once (index_select: several times
    # faster than advanced indexing on the host, where the training batches are built)
    return (starts - (torch.cumsum(lengths, 0) - lengths)).index_select(0, seg) + torch.arange(total)


def batch_users(h: Histories, batch_size: int, *, shuffle: bool = True, generator: Optional[torch.Generator] = None,
                drop_last: bool = False) -> Iterator[torch.Tensor]:
    """The users (indices into ``h``) of each batch :func:`batches` yields, in the same order: users
    with at least 2 items, shuffled by ``generator`` when ``shuffle``."""
    if batch_size < 1:
        raise ValueError(f"batch_users: batch_size must be >= 1, got {batch_size}")
    users = (h.lengths >= 2).nonzero().flatten()
    if shuffle:
        users = users[torch.randperm(users.numel(), generator=generator)]
    n_batches = users.numel() // batch_size if drop_last else math.ceil(users.numel() / batch_size)
    for b in range(n_batches):
        yield users[b * batch_size:(b + 1) * batch_size]


def window_batch(h: Histories, users: torch.Tensor, *, max_len: int) -> Batch:
    """The training batch of ``users`` (indices into ``h``, each with at least 2 items): each user's most
    recent ``max_len + 1`` items give the inputs (all but the last) and the targets (all but the first)."""
    take = torch.clamp(h.lengths[users], max=max_len + 1)
    starts = h.offsets[users + 1] - take
    window = h.items.index_select(0, _ranges(starts, take))
    n = take - 1
    offsets = torch.zeros(users.numel() + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(n, 0)
    wo = torch.zeros_like(offsets)
    wo[1:] = torch.cumsum(take, 0)
    inputs = window.index_select(0, _ranges(wo[:-1], n))
    targets = window.index_select(0, _ranges(wo[:-1] + 1, n))
    return Batch(inputs, targets, offsets, h.user_ids[users], int(n.max()) if n.numel() else 0)


def batches(h: Histories, batch_size: int, *, max_len: int, shuffle: bool = True,
            generator: Optional[torch.Generator] = None, drop_last: bool = False) -> Iterator[Batch]:
    """Autoregressive training batches: each user's most recent ``max_len + 1`` items give the inputs
    (all but the last) and the targets (all but the first). Users with fewer than 2 items are skipped.
    (:func:`batch_users` then :func:`window_batch`.)"""
    if batch_size < 1 or max_len < 1:
        raise ValueError("batches: batch_size and max_len must be >= 1")
    for users in batch_users(h, batch_size, shuffle=shuffle, generator=generator, drop_last=drop_last):
        yield window_batch(h, users, max_len=max_len)


def windows(h: Histories, batch_size: int, *, max_len: int) -> Iterator[Batch]:
    """Evaluation batches in user order: each user's most recent ``max_len`` items as the input, no
    targets (``targets`` is empty). Users with no items are skipped."""
    if batch_size < 1 or max_len < 1:
        raise ValueError("windows: batch_size and max_len must be >= 1")
    lengths = h.lengths
    users = (lengths >= 1).nonzero().flatten()
    for b in range(0, users.numel(), batch_size):
        sel = users[b:b + batch_size]
        take = torch.clamp(lengths[sel], max=max_len)
        offsets = torch.zeros(sel.numel() + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(take, 0)
        items = h.items[_ranges(h.offsets[sel + 1] - take, take)]
        yield Batch(items, items.new_empty(0), offsets, h.user_ids[sel], int(take.max()))


def item_popularity(h: Histories):
    """(item ids, counts) sorted by count, most popular first (ties by id)."""
    ids, counts = torch.unique(h.items, return_counts=True)
    order = torch.sort(counts, descending=True, stable=True).indices
    return ids[order], counts[order]

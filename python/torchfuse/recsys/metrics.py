"""Retrieval metrics by exact top-k over the whole item set (brute-force maximum inner product search,
in chunks of items so memory stays bounded): HR@K and NDCG@K of a next-item target."""
from typing import Dict, Optional, Tuple

import torch

__all__ = ["topk_items", "hr_ndcg", "evaluate", "most_popular_metrics"]


def topk_items(queries: torch.Tensor, item_embeddings: torch.Tensor, k: int, *,
               chunk_size: int = 1 << 16) -> Tuple[torch.Tensor, torch.Tensor]:
    """The k highest inner products of each query with every item: (scores (B, k), indices (B, k))
    into ``item_embeddings``' rows, best first. Items are scored ``chunk_size`` at a time and merged
    with the running top-k, so no (B, num_items) score matrix exists at once. Scores are computed in
    the embeddings' dtype and accumulated by the matmul in fp32 on the GPU."""
    if queries.dim() != 2 or item_embeddings.dim() != 2 or queries.size(1) != item_embeddings.size(1):
        raise ValueError(f"topk_items: queries (B, D) and item_embeddings (N, D) must share D, got "
                         f"{tuple(queries.shape)} and {tuple(item_embeddings.shape)}")
    n = item_embeddings.size(0)
    if not 1 <= k <= n:
        raise ValueError(f"topk_items: k must be in [1, {n}] (the number of items), got {k}")
    if chunk_size < 1:
        raise ValueError("topk_items: chunk_size must be >= 1")
    best_s = best_i = None
    for start in range(0, n, chunk_size):
        chunk = item_embeddings[start:start + chunk_size]
        s = (queries @ chunk.t()).float()
        s, i = torch.topk(s, min(k, s.size(1)), dim=1)
        i = i + start
        if best_s is not None:
            merged = torch.cat([best_s, s], 1)
            s, j = torch.topk(merged, min(k, merged.size(1)), dim=1)
            i = torch.gather(torch.cat([best_i, i], 1), 1, j)
        best_s, best_i = s, i
    return best_s, best_i


def hr_ndcg(ranked_ids: torch.Tensor, targets: torch.Tensor) -> Dict[str, float]:
    """HR@K and NDCG@K of ``targets`` (B,) in ``ranked_ids`` (B, K), best first: a hit at 0-based
    rank r scores 1 for HR and 1 / log2(r + 2) for NDCG; a miss scores 0 for both."""
    if ranked_ids.dim() != 2 or targets.shape != ranked_ids.shape[:1]:
        raise ValueError("hr_ndcg: ranked_ids must be (B, K) and targets (B,)")
    if targets.numel() == 0:
        return {"hr": float("nan"), "ndcg": float("nan")}
    hit = ranked_ids == targets.unsqueeze(1)
    any_hit = hit.any(1)
    rank = hit.float().argmax(1).double()
    ndcg = torch.where(any_hit, 1.0 / torch.log2(rank + 2.0), torch.zeros_like(rank))
    return {"hr": any_hit.double().mean().item(), "ndcg": ndcg.mean().item()}


def evaluate(queries: torch.Tensor, item_embeddings: torch.Tensor, item_ids: torch.Tensor,
             targets: torch.Tensor, k: int = 10, *, chunk_size: int = 1 << 16) -> Dict[str, float]:
    """HR@k and NDCG@k of each query's target among all items (``item_ids`` (N,) names the rows of
    ``item_embeddings``). Keys: ``hr@k``, ``ndcg@k``."""
    if item_ids.shape != item_embeddings.shape[:1]:
        raise ValueError("evaluate: item_ids must have one id per row of item_embeddings")
    _, idx = topk_items(queries, item_embeddings, k, chunk_size=chunk_size)
    m = hr_ndcg(item_ids[idx], targets.to(item_ids.device))
    return {f"hr@{k}": m["hr"], f"ndcg@{k}": m["ndcg"]}


def most_popular_metrics(popular_ids: torch.Tensor, targets: torch.Tensor, k: int = 10) -> Dict[str, float]:
    """The most-popular baseline: every user gets the same top-k list, ``popular_ids[:k]``."""
    ranked = popular_ids[:k].unsqueeze(0).expand(targets.numel(), -1)
    m = hr_ndcg(ranked, targets)
    return {f"hr@{k}": m["hr"], f"ndcg@{k}": m["ndcg"]}

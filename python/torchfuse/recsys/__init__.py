"""A generative recommender on torchfuse: user histories (``data``), retrieval metrics (``metrics``)."""
from . import data, metrics
from .data import Batch, Histories, batches, leave_one_out, load_movielens, synthetic_histories
from .metrics import evaluate, hr_ndcg, most_popular_metrics, topk_items

__all__ = ["data", "metrics", "Batch", "Histories", "batches", "leave_one_out", "load_movielens",
           "synthetic_histories", "evaluate", "hr_ndcg", "most_popular_metrics", "topk_items"]

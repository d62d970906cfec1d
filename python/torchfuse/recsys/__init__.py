"""A generative recommender on torchfuse: the model (``model``), its training loop (``train``, also
``python -m torchfuse.recsys.train``), user histories (``data``) and retrieval metrics (``metrics``)."""
from . import data, metrics
from .data import Batch, Histories, batches, leave_one_out, load_movielens, synthetic_histories
from .metrics import evaluate, hr_ndcg, most_popular_metrics, topk_items
from .model import HSTURecommender, HSTURecommenderConfig


def __getattr__(name):  # train is also run as ``python -m torchfuse.recsys.train``: not imported eagerly
    if name in ("Trainer", "TrainConfig"):
        from . import train
        return getattr(train, name)
    raise AttributeError(f"module 'torchfuse.recsys' has no attribute {name!r}")

__all__ = ["data", "metrics", "Batch", "Histories", "batches", "leave_one_out", "load_movielens",
           "synthetic_histories", "evaluate", "hr_ndcg", "most_popular_metrics", "topk_items", "HSTURecommender",
           "HSTURecommenderConfig", "Trainer", "TrainConfig"]

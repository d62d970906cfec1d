"""Fused optimizers for :class:`torchfuse.DynamicEmbedding`: configurations, not ``torch.optim``
optimizers. The table applies the update to each touched row inside the backward pass, with the
optimizer state stored beside the row in the table (exported, evicted and saved with it).

Each matches a PyTorch reference on the rows a batch touches:
  SGD            torch.optim.SGD (no momentum, no weight decay)
  Adagrad        torch.optim.Adagrad (lr_decay 0, initial_accumulator_value 0)
  RowWiseAdagrad fbgemm's EXACT_ROWWISE_ADAGRAD: one accumulator per row, sum += mean(g^2)
  Adam           torch.optim.SparseAdam (lazy Adam: rows not in the batch keep their moments);
                 the bias-correction step counts backward passes of the table
"""
import math
from typing import Tuple

__all__ = ["SGD", "Adagrad", "RowWiseAdagrad", "Adam"]


class _Fused:
    code = -1
    lr = 0.0
    eps = 0.0
    betas = (0.0, 0.0)

    def state_dim(self, dim: int) -> int:
        raise NotImplementedError

    def step_size(self, step: int) -> float:
        return self.lr

    def config(self) -> dict:
        return {"name": type(self).__name__, "lr": self.lr, "eps": self.eps, "betas": tuple(self.betas)}

    def __repr__(self):
        return f"{type(self).__name__}(lr={self.lr}, eps={self.eps})"

    @staticmethod
    def _check_lr(name, lr):
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"torchfuse.optim.{name}: lr must be a finite number >= 0, got {lr!r}")
        return float(lr)


class SGD(_Fused):
    """``w -= lr * g``."""
    code = 0

    def __init__(self, lr: float = 0.01):
        self.lr = self._check_lr("SGD", lr)

    def state_dim(self, dim):
        return 0


class Adagrad(_Fused):
    """``s += g*g; w -= lr * g / (sqrt(s) + eps)`` per element (torch.optim.Adagrad)."""
    code = 1

    def __init__(self, lr: float = 0.01, eps: float = 1e-10):
        self.lr, self.eps = self._check_lr("Adagrad", lr), float(eps)

    def state_dim(self, dim):
        return dim


class RowWiseAdagrad(_Fused):
    """``s += mean(g*g); w -= lr * g / (sqrt(s) + eps)`` with one ``s`` per row (fbgemm)."""
    code = 2

    def __init__(self, lr: float = 0.01, eps: float = 1e-8):
        self.lr, self.eps = self._check_lr("RowWiseAdagrad", lr), float(eps)

    def state_dim(self, dim):
        return 1


class Adam(_Fused):
    """Lazy Adam, exactly torch.optim.SparseAdam's update: moments in fp32 beside the row."""
    code = 3

    def __init__(self, lr: float = 0.001, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.lr, self.eps = self._check_lr("Adam", lr), float(eps)
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"torchfuse.optim.Adam: betas must be in [0, 1), got {betas!r}")
        self.betas = (float(betas[0]), float(betas[1]))

    def state_dim(self, dim):
        return 2 * dim

    def step_size(self, step):
        b1, b2 = self.betas
        return self.lr * math.sqrt(1 - b2**step) / (1 - b1**step)


def from_config(cfg: dict) -> _Fused:
    name = cfg["name"]
    if name == "SGD":
        return SGD(cfg["lr"])
    if name == "Adagrad":
        return Adagrad(cfg["lr"], cfg["eps"])
    if name == "RowWiseAdagrad":
        return RowWiseAdagrad(cfg["lr"], cfg["eps"])
    if name == "Adam":
        return Adam(cfg["lr"], tuple(cfg["betas"]), cfg["eps"])
    raise ValueError(f"torchfuse.optim: unknown optimizer {name!r}")

"""The plain PyTorch code that each torchfuse op replaces: used by ``python -m torchfuse`` for its
self-check and by benchmarks/ as the eager (and torch.compile) baseline."""
import torch
import torch.nn.functional as F


def add_layer_norm(x, residual, weight, bias, eps=1e-5):
    s = x + residual
    return F.layer_norm(s, (s.shape[-1],), weight, bias, eps), s


def add_rms_norm(x, residual, weight, eps=1e-6):
    """HF LlamaRMSNorm applied to x + residual."""
    s = x + residual
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(s.dtype), s

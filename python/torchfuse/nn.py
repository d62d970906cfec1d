"""Drop-in modules backed by torchfuse ops."""
import math

import torch
from torch import Tensor

from .norm import layer_norm, rms_norm


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same arguments, parameters and state_dict keys) with the residual add
    fused in: ``forward(x)`` returns ``y``; ``forward(x, residual)`` returns ``(y, x + residual)``."""

    def forward(self, x: Tensor, residual: Tensor = None):
        k = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - k:]) != tuple(self.normalized_shape):
            raise ValueError(
                f"torchfuse.nn.LayerNorm: expected input ending in {tuple(self.normalized_shape)}, got {tuple(x.shape)}"
            )
        weight, bias = self.weight, self.bias
        if k != 1:  # normalizing the last k dims is normalizing their flattened product
            n = math.prod(self.normalized_shape)
            lead = x.shape[: x.dim() - k]
            x = x.reshape(*lead, n)
            residual = residual.reshape(*lead, n) if residual is not None else None
            weight = weight.reshape(n) if weight is not None else None
            bias = bias.reshape(n) if bias is not None else None
            out = layer_norm(x, weight, bias, self.eps, residual=residual)
            shape = (*lead, *self.normalized_shape)
            return out.reshape(shape) if residual is None else (out[0].reshape(shape), out[1].reshape(shape))
        return layer_norm(x, weight, bias, self.eps, residual=residual)


class RMSNorm(torch.nn.Module):
    """HF ``LlamaRMSNorm``'s drop-in (``RMSNorm(hidden_size, eps=1e-6)``, parameter ``weight``,
    attribute ``variance_epsilon``) with the residual add fused in: ``forward(x)`` returns ``y``;
    ``forward(x, residual)`` returns ``(y, x + residual)``. ``cast``/``weight_offset`` select Gemma's
    variant (see :func:`torchfuse.rms_norm`)."""

    def __init__(self, hidden_size, eps=1e-6, *, cast="llama", weight_offset=0.0, device=None, dtype=None):
        super().__init__()
        # the identity at initialisation: weight + weight_offset == 1 (Gemma stores zeros, offset 1)
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), 1.0 - weight_offset, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.cast = cast
        self.weight_offset = weight_offset

    def forward(self, hidden_states: Tensor, residual: Tensor = None):
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"torchfuse.nn.RMSNorm: expected hidden_states ending in ({self.weight.shape[0]},), "
                             f"got {tuple(hidden_states.shape)}")
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, residual=residual, cast=self.cast,
                        weight_offset=self.weight_offset)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
from .stu import STULayer, STULayerConfig, STUStack  # noqa: E402,F401  (HSTU encoder layers)

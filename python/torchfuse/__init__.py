"""torchfuse: fused C/CUDA kernels for PyTorch models, registered as ``torch.ops.torchfuse.*``.

    import torchfuse
    y, s = torchfuse.layer_norm(x, weight, bias, residual=hidden)   # s = x + hidden, y = LN(s)
"""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C  # noqa: F401  (registers the ops)
from ._stats import stats
from ._version import __version__
from .norm import layer_norm, rms_norm
from . import nn  # noqa: E402

__all__ = ["__version__", "layer_norm", "rms_norm", "nn", "stats", "compat"]

# ---- jagged tensor ops ----


# ---- HSTU attention ----
from .hstu import hstu_attention, hstu_attention_cached  # noqa: E402

__all__ += ["hstu_attention", "hstu_attention_cached"]


# ---- dynamic embeddings ----


# ---- HuggingFace patching ----


from . import compat  # noqa: E402,F401

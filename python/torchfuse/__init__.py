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
from . import backends  # noqa: E402

__all__ = ["__version__", "layer_norm", "rms_norm", "nn", "stats", "compat", "backends"]

# ---- jagged tensor ops ----
from .jagged import (  # noqa: E402
    complete_cumsum, concat_2d_jagged, dense_to_jagged, jagged_concat, jagged_dense_add, jagged_dense_bmm_broadcast_add,
    jagged_dense_mul, jagged_index_select, jagged_split, jagged_to_padded_dense, split_2d_jagged, validate_jagged,
)

__all__ += ["complete_cumsum", "concat_2d_jagged", "dense_to_jagged", "jagged_concat", "jagged_dense_add",
            "jagged_dense_bmm_broadcast_add",
            "jagged_dense_mul", "jagged_index_select", "jagged_split", "jagged_to_padded_dense", "split_2d_jagged",
            "validate_jagged"]


# ---- HSTU attention ----
from .hstu import hstu_attention, hstu_attention_cached  # noqa: E402

__all__ += ["hstu_attention", "hstu_attention_cached"]
from .hstu_output import hstu_compute_output  # noqa: E402
__all__ += ["hstu_compute_output"]


# ---- dynamic embeddings ----
from . import optim  # noqa: E402
from .dynamic_embedding import DynamicEmbedding, DynamicEmbeddingBag  # noqa: E402

__all__ += ["DynamicEmbedding", "DynamicEmbeddingBag", "optim"]
from . import torchrec  # noqa: E402  (TorchRec drop-ins; imports torchrec itself lazily)

__all__ += ["torchrec"]
from . import distributed  # noqa: E402  (sharded dynamic embeddings over torch.distributed)

__all__ += ["distributed"]


# ---- HuggingFace patching ----
from . import hf  # noqa: E402  (imports transformers only when patching)
from .hf import patch_hf, unpatch_hf  # noqa: E402

__all__ += ["hf", "patch_hf", "unpatch_hf"]


from . import compat  # noqa: E402,F401


# ---- sampled softmax loss ----
from .losses import sampled_softmax_loss  # noqa: E402

__all__ += ["sampled_softmax_loss"]


# ---- the HSTU layer's input section ----
from .hstu_preprocess import hstu_preprocess  # noqa: E402
from .skinny_linear import skinny_linear  # noqa: E402

__all__ += ["hstu_preprocess", "skinny_linear"]

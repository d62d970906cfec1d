"""Drop-in replacements with the exact signatures of other libraries' ops.

- ``torchfuse.compat.fbgemm``: ``torch.ops.fbgemm`` jagged ops.
- ``torchfuse.compat.gr``: meta-recsys/generative-recommenders' jagged and HSTU ops.
"""
from . import fbgemm, gr  # noqa: F401

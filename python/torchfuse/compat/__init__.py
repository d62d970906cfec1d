"""Drop-in replacements with the exact signatures of other libraries' ops.

- ``torchfuse.compat.fbgemm``: ``torch.ops.fbgemm`` jagged ops.
- ``torchfuse.compat.gr``: meta-recsys/generative-recommenders' jagged, norm and HSTU ops, and
  ``gr.patch()`` / ``gr.unpatch()`` to route an installed generative_recommenders to them.
"""
from . import fbgemm, gr  # noqa: F401

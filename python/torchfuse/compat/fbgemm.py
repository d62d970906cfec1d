"""Functions with the signatures and semantics of ``torch.ops.fbgemm``'s ops, backed by torchfuse."""

# ---- jagged tensor ops ----

"""Functions with the signatures and semantics of meta-recsys/generative-recommenders' ops, backed by
torchfuse, so existing code can swap them in."""

# ---- jagged tensor ops (concat_2D_jagged, split_2D_jagged) ----


# ---- HSTU attention (hstu_mha) ----

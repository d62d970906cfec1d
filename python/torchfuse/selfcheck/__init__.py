"""The self-check and benchmark behind ``python -m torchfuse``: one module per op family (each with
``checks(ctx)`` and ``bench(ctx)``), and ``runner`` that runs them, prints and exits."""
from .runner import FAMILIES, main, run  # noqa: F401

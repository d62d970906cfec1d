"""Counting torchfuse op calls, so a user (or a test) can check that a patched model really reaches
the kernels. Off unless a ``torchfuse.stats()`` block is open: the hot path pays one global read."""
import contextlib
from typing import Dict, Iterator, Optional

_counts: Optional[Dict[str, int]] = None


def count(name: str) -> None:
    if _counts is not None:
        _counts[name] = _counts.get(name, 0) + 1


@contextlib.contextmanager
def stats() -> Iterator[Dict[str, int]]:
    """Count torchfuse op calls made inside the block, by op name (the Python entry points are
    counted when called; under torch.compile that is when a graph is traced, not per replay).

        with torchfuse.stats() as calls:
            model(x)
        assert calls["norm_fwd"] == expected
    """
    global _counts
    outer, _counts = _counts, {}
    try:
        yield _counts
    finally:
        inner, _counts = _counts, outer
        if outer is not None:
            for k, v in inner.items():
                outer[k] = outer.get(k, 0) + v

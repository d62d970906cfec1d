"""Which kernels a family runs, where it has more than one production form.

    import torchfuse
    torchfuse.backends.hstu = "mma"            # from now on
    with torchfuse.backends.use(hstu="sm90"):  # inside the block only
        out = torchfuse.hstu_attention(...)

``hstu``: the CUDA kernels of HSTU attention. ``"auto"``: the Hopper (sm_90a: TMA, wgmma) kernels
wherever they are faster (16-bit dtypes on a compute capability 9.0 GPU, every shape but cached inference
at head dims up to 128), mma.sync elsewhere; ``"sm90"``: the Hopper kernels wherever they can run;
``"mma"``: never. fp32, other GPUs and builds without sm_90a always run mma.sync / the fp32 kernels.
``None`` (the initial value): the environment variable ``TORCHFUSE_HSTU_BACKEND`` (``auto`` / ``sm90`` /
``mma``, read once per process), else ``"auto"``. The selection is read when an op is called (under
``torch.compile``, when it is traced); a backward uses its forward's. The ops check the name.
"""
import contextlib
from typing import Iterator, Optional

FAMILIES = {"hstu": ("auto", "sm90", "mma")}

hstu: Optional[str] = None


def _check(family: str, value: Optional[str]) -> None:
    if family not in FAMILIES:
        raise ValueError(f"torchfuse.backends: no backend choice for {family!r}; families: {sorted(FAMILIES)}")
    if value is not None and value not in FAMILIES[family]:
        raise ValueError(f"torchfuse.backends.{family} must be one of {FAMILIES[family]} or None, got {value!r}")


@contextlib.contextmanager
def use(**selection: Optional[str]) -> Iterator[None]:
    """Select backends inside a ``with`` block, e.g. ``use(hstu="mma")``; the previous ones come back after."""
    for family, value in selection.items():
        _check(family, value)
    saved = {family: globals()[family] for family in selection}
    globals().update(selection)
    try:
        yield
    finally:
        globals().update(saved)

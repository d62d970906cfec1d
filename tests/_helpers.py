"""Helpers shared by the test files (pytest puts tests/ on sys.path)."""
import torch

# one machine epsilon of the dtype (scaled by the reference's magnitude): the rounding of a single
# output can cost that much even where PyTorch's own result happens to round the other way
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def check_close(name, ours, ref64, lowp, dtype, *, expect_dtype=None, scale_floor=0.0):
    """`ours` against the float64 reference `ref64`: within twice the error of `lowp` (PyTorch's own
    computation in the low precision) plus ATOL[dtype] times the reference's magnitude (at least
    scale_floor). expect_dtype: the dtype `ours` must have (default: lowp's)."""
    expect = lowp.dtype if expect_dtype is None else expect_dtype
    assert ours.dtype == expect, f"{name}: dtype {ours.dtype}, expected {expect}"
    assert ours.shape == ref64.shape, f"{name}: shape {tuple(ours.shape)}, expected {tuple(ref64.shape)}"
    if ours.numel() == 0:
        return
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    err = (ours.double() - ref64).abs().max().item()
    err_pt = (lowp.double() - ref64).abs().max().item()
    tol = 2 * err_pt + ATOL[dtype] * max(scale_floor, ref64.abs().max().item()) + 1e-12
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} (PyTorch's own error {err_pt:.3g})"


def check_close_elementwise(name, got, want, spread, rtol, atol):
    """|got - want| <= atol + rtol |want| + 2 spread at every element; spread: how far PyTorch's own
    low-precision run is off the float64 one there (|ref_lp - ref64|), so the tolerance widens only
    where that run shows rounding or cancellation."""
    err = (got.double() - want.double()).abs().flatten()
    tol = (atol + rtol * want.double().abs() + 2 * spread.double()).flatten()
    if (err > tol).any():
        i = (err - tol).argmax().item()
        raise AssertionError(f"{name}: error {err[i].item():.3g} > {tol[i].item():.3g} at flat index {i}")


def exit_failed_rank(rank):
    """In a spawned rank whose check raised: print its traceback, then exit at once. Destroying the
    process group instead would wait on the other ranks, themselves waiting in their next collective
    (with NCCL the run hung until the group's timeout instead of failing); mp.spawn stops the others."""
    import os
    import sys
    import traceback
    print(f"[rank {rank}] failed:", file=sys.stderr)
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)

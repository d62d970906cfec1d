"""The shard hash: which rank owns a key.

``owner(key) = ((fmix64(key) >> 32) * world_size) >> 32`` with fmix64 MurmurHash3's 64-bit finalizer
(unsigned arithmetic). The table's bucket hash is splitmix64's mixer (kernels/dynemb_kernels.h,
tf_mix64): a different function, so the keys one rank owns still spread over all of its buckets
(an owner chosen by the bucket hash's own bits would leave most buckets of every rank empty). The
top 32 bits scaled by the world size (Lemire's multiply-shift range reduction) avoid a 64-bit
modulo and are unbiased to within 2**-32 for any world size below 2**31.
"""
import torch
from torch import Tensor

SHARD_HASH = "fmix64-mulshift32"  # written into checkpoints' shard header

_M64 = 2**64 - 1
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53


def _signed(c: int) -> int:
    return c - 2**64 if c >= 2**63 else c


_C1_S, _C2_S = _signed(_C1), _signed(_C2)


def fmix64_int(key: int) -> int:
    """fmix64 of one key (Python int, any sign), as an unsigned 64-bit int."""
    k = key & _M64
    k ^= k >> 33
    k = (k * _C1) & _M64
    k ^= k >> 33
    k = (k * _C2) & _M64
    return k ^ (k >> 33)


def owner_of_int(key: int, world_size: int) -> int:
    """The owner rank of one key (Python int)."""
    return ((fmix64_int(key) >> 32) * world_size) >> 32


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def owner_of(keys: Tensor, world_size: int) -> Tensor:
    """The owner rank (int64) of each int64 key; int64 products wrap modulo 2**64 as the unsigned
    mixer's do."""
    if not 1 <= world_size < 2**31:
        raise ValueError(f"torchfuse.distributed: world_size must be in [1, 2**31), got {world_size}")
    k = keys.to(torch.int64)
    if world_size == 1:
        return torch.zeros_like(k)
    k = k ^ _shr(k, 33)
    k = k * _C1_S
    k = k ^ _shr(k, 33)
    k = k * _C2_S
    k = k ^ _shr(k, 33)
    return (_shr(k, 32) * world_size) >> 32

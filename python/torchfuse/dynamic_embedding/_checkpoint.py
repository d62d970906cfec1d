"""Checkpoints of a dynamic embedding: the occupied slots' keys, rows, optimizer state and scores
with the table's configuration and a checksum; a load checks everything before it changes anything."""
import zlib
from typing import Tuple

import torch
from torch import Tensor

from .. import optim as _optim
from ._table import _DTYPES, _EVICTIONS, _check_initializer, _pow2_at_least


class CheckpointMixin:
    """state_dict / load_state_dict of :class:`DynamicEmbedding` (nn.Module's hooks)."""

    def _config(self) -> dict:
        return {
            "embedding_dim": self.embedding_dim, "capacity": self.capacity, "max_capacity": self.max_capacity,
            "dtype": _DTYPES[self.dtype], "eviction": self.eviction, "initializer": tuple(self.initializer),
            "optimizer": self.optimizer.config(), "hbm_budget_bytes": self.hbm_budget_bytes, "seed": self.seed,
            "max_load_factor": self.max_load_factor, "bucket_size": self.bucket_size, "clock": self._clock,
            "step": self._step,
        }

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        tensors = self._compact()
        for k, t in zip(_STATE_NAMES, tensors):
            destination[prefix + k] = t
        cfg = self._config()
        cfg["checksum"] = _checkpoint_checksum(tensors, cfg)
        destination[prefix + "config"] = cfg

    def _checked_checkpoint(self, state_dict, prefix) -> Tuple[dict, int, Tuple[Tensor, ...]]:
        """(config, capacity, (keys, values, optimizer_state, scores)) of a state_dict entry, every
        field checked; ValueError naming what is wrong. Reads nothing of self but its dim and dtype."""
        name = f"torchfuse.{type(self).__name__}"
        cfg = state_dict[prefix + "config"]
        tensors = tuple(state_dict[prefix + k] for k in _STATE_NAMES)
        if not isinstance(cfg, dict):
            raise ValueError(f"{name}: {prefix}config must be a dict, got {type(cfg).__name__}")
        missing = [k for k in _CONFIG_TYPES if k not in cfg]
        if missing:
            raise ValueError(f"{name}: {prefix}config lacks {missing}")
        for k, types in _CONFIG_TYPES.items():
            v = cfg[k]
            if not isinstance(v, types) or isinstance(v, bool):
                raise ValueError(f"{name}: {prefix}config[{k!r}] has the wrong type: {v!r}")
        if cfg["embedding_dim"] != self.embedding_dim:
            raise ValueError(f"{name}: the checkpoint has embedding_dim {cfg['embedding_dim']}, this table "
                             f"{self.embedding_dim}")
        if cfg["dtype"] != _DTYPES[self.dtype]:
            raise ValueError(f"{name}: the checkpoint has rows of dtype {cfg['dtype']}, this table "
                             f"{_DTYPES[self.dtype]}")
        bucket = cfg["bucket_size"]
        if bucket not in (4, 8, 16, 32, 64, 128) or cfg["capacity"] < bucket or cfg["capacity"] % bucket or \
                cfg["capacity"] & (cfg["capacity"] - 1) or cfg["max_capacity"] < cfg["capacity"]:
            raise ValueError(f"{name}: {prefix}config has inconsistent sizes: capacity {cfg['capacity']}, "
                             f"max_capacity {cfg['max_capacity']}, bucket_size {bucket}")
        for k, ok in (("eviction", cfg["eviction"] in _EVICTIONS), ("max_load_factor", 0 < cfg["max_load_factor"] <= 1),
                      ("clock", cfg["clock"] >= 0), ("step", cfg["step"] >= 0),
                      ("hbm_budget_bytes", cfg["hbm_budget_bytes"] is None or cfg["hbm_budget_bytes"] >= 0)):
            if not ok:
                raise ValueError(f"{name}: {prefix}config[{k!r}] is out of range: {cfg[k]!r}")
        try:
            _check_initializer(cfg["initializer"])
            opt = _optim.from_config(cfg["optimizer"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{name}: {prefix}config: {e}") from None
        keys, values, state, scores = tensors
        for k, t in zip(_STATE_NAMES, tensors):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name}: {prefix}{k} must be a tensor, got {type(t).__name__}")
        want = {"keys": torch.int64, "values": self.dtype, "optimizer_state": torch.float32, "scores": torch.int64}
        for k, t in zip(_STATE_NAMES, tensors):
            if t.dtype != want[k]:
                raise ValueError(f"{name}: the checkpoint's {k} are {t.dtype}, this table's {want[k]}")
        n = keys.shape[0] if keys.dim() == 1 else -1
        if (n < 0 or values.shape != (n, self.embedding_dim) or state.shape != (n, opt.state_dim(self.embedding_dim))
                or scores.shape != (n,)):
            raise ValueError(f"{name}: inconsistent state_dict shapes: keys {tuple(keys.shape)}, values "
                             f"{tuple(values.shape)}, optimizer_state {tuple(state.shape)}, scores "
                             f"{tuple(scores.shape)} (embedding_dim {self.embedding_dim}, optimizer "
                             f"{cfg['optimizer'].get('name')})")
        cap = max(cfg["capacity"], bucket * _pow2_at_least(-(-self.capacity // bucket)))
        if n > cap:
            raise ValueError(f"{name}: the checkpoint holds {n} keys, more than its capacity {cap}")
        if "checksum" in cfg:  # absent: a state_dict built or edited by hand
            got = _checkpoint_checksum(tensors, cfg)
            if got != cfg["checksum"]:
                raise ValueError(f"{name}: {prefix}config's checksum does not match the tensors: the checkpoint "
                                 "is corrupted (or was edited: drop config['checksum'] to load an edited one)")
        if n and torch.unique(keys).numel() != n:
            raise ValueError(f"{name}: the checkpoint's keys repeat")
        return cfg, cap, tensors

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = _STATE_NAMES + ("config",)
        if any(prefix + k not in state_dict for k in names):
            missing_keys.extend(prefix + k for k in names if prefix + k not in state_dict)
            return
        # Every check before any change: a checkpoint that fails one leaves the table as it was.
        try:
            cfg, cap, tensors = self._checked_checkpoint(state_dict, prefix)
        except ValueError as e:
            error_msgs.append(str(e))
            return
        before = dict(self.__dict__)  # _rebuild allocates new tensors, so the old ones stay intact
        try:
            self.optimizer = _optim.from_config(cfg["optimizer"])
            self.eviction = cfg["eviction"]
            self.initializer = _check_initializer(cfg["initializer"])
            self.hbm_budget_bytes = cfg["hbm_budget_bytes"]
            self.seed = cfg["seed"]
            self.max_load_factor = float(cfg["max_load_factor"])
            self.bucket_size = cfg["bucket_size"]
            self.max_capacity = max(cfg["max_capacity"], self._round_capacity(self.max_capacity), cap)
            self._clock, self._step = cfg["clock"], cfg["step"]
            d = self.device
            self._rebuild(cap, *(t.to(d).contiguous() for t in tensors))
            self._evicted, self._evicted_count = [], 0
        except Exception as e:
            self.__dict__.clear()
            self.__dict__.update(before)
            error_msgs.append(f"torchfuse.{type(self).__name__}: loading {prefix or 'the table'} failed, the table "
                              f"is unchanged: {e}")


def _checkpoint_checksum(tensors, cfg: dict) -> int:
    """A position-weighted sum (Fletcher's, modulo 2**31 - 1) of the tensors' 16-bit words and a CRC
    of the config: any one changed word or value changes it. Computed on the tensors' device."""
    p = (1 << 31) - 1
    sums = []
    for t in tensors:
        words = t.detach().contiguous().reshape(-1).view(torch.int16).reshape(-1)
        acc = torch.zeros(2, dtype=torch.int64, device=t.device)
        for lo in range(0, words.numel(), _CHECKSUM_CHUNK):
            w = words[lo:lo + _CHECKSUM_CHUNK].to(torch.int64) + 32769  # every word >= 1
            pos = torch.arange(lo, lo + w.numel(), device=w.device) % 65521 + 1
            # per chunk: < 2**22 words of < 2**16, times weights < 2**16: no int64 overflow
            acc = (acc + torch.stack([w.sum(), (w * pos).sum()]) % p) % p
        sums.append(acc)
    s1 = s2 = 0
    for t, (a, b) in zip(tensors, [a.tolist() for a in sums]):
        s1, s2 = (s1 + a) % p, (s2 * 31 + b + t.numel()) % p  # the tensors' order and sizes count too
    fields = repr(sorted((k, v) for k, v in cfg.items() if k != "checksum")).encode()
    return (s2 << 32 | s1) ^ zlib.crc32(fields)


_STATE_NAMES = ("keys", "values", "optimizer_state", "scores")


_CHECKSUM_CHUNK = 1 << 22


_CONFIG_TYPES = {
    "embedding_dim": int, "capacity": int, "max_capacity": int, "dtype": str, "eviction": str,
    "initializer": (tuple, list), "optimizer": dict, "hbm_budget_bytes": (int, type(None)), "seed": int,
    "max_load_factor": (float, int), "bucket_size": int, "clock": int, "step": int,
}

"""Checkpoints of a sharded dynamic embedding: each rank's state_dict is its table's (under
``local.``) plus a shard header; loading into another world size re-hashes every key to its new
owner."""
from typing import Iterable, Mapping

import torch

from ._hash import SHARD_HASH

_STATE = ("keys", "values", "optimizer_state", "scores")


class ShardCheckpointMixin:
    """state_dict / load_state_dict (same world size, same rank) and load_resharded (any world size)."""

    def _header(self) -> dict:
        h = {"world_size": self.world_size, "rank": self.rank, "shard_hash": SHARD_HASH}
        if self.owner_rank is not None:  # table-wise
            h["owner_rank"] = self.owner_rank
        return h

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "shard"] = self._header()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        header = state_dict.get(prefix + "shard")
        if header is None:
            missing_keys.append(prefix + "shard")
            return
        if header != self._header():
            error_msgs.append(
                f"torchfuse.distributed.{type(self).__name__}: {prefix}shard is {header}, this module is "
                f"{self._header()}: load another world size's (or rank's) checkpoint with load_resharded, "
                "passing every rank's state_dict")

    def load_resharded(self, state_dicts: Iterable[Mapping], prefix: str = ""):
        """Load a checkpoint saved by any number of ranks: ``state_dicts`` are every rank's
        state_dict of a sharded module (each rank of this group passes them all, e.g. read from the
        per-rank files), or one single-device DynamicEmbedding's state_dict. This rank keeps the keys
        it owns at this world size, with their rows, optimizer state and scores. Each shard's
        checksum and configuration are checked first (nothing changes if one fails); any placement
        loads into any other (row-wise or table-wise: the keys go where this module places them); this
        rank's table is sized for its keys (its capacity at least the checkpoint's, doubled while its keys
        would pass max_load_factor). Not collective."""
        name = f"torchfuse.distributed.{type(self).__name__}"
        parts, cfgs, seen, world = [], [], set(), None
        for sd in state_dicts:
            header = sd.get(prefix + "shard")
            lp = prefix + "local." if header is not None else prefix
            if header is None:
                header = {"world_size": 1, "rank": 0, "shard_hash": SHARD_HASH}
            if not isinstance(header, Mapping) or header.get("shard_hash") != SHARD_HASH:
                raise ValueError(f"{name}: a shard header {header!r} is not one of this shard hash ({SHARD_HASH})")
            w, r = header.get("world_size"), header.get("rank")
            if world is None:
                world = w
            if w != world or not isinstance(r, int) or not 0 <= r < world or r in seen:
                raise ValueError(f"{name}: shard headers disagree: rank {r} of world size {w} after "
                                 f"ranks {sorted(seen)} of world size {world}")
            seen.add(r)
            if any(lp + k not in sd for k in _STATE + ("config",)):
                raise ValueError(f"{name}: the state_dict of rank {r} lacks {lp}keys/values/optimizer_state/scores/config")
            cfg, _, tensors = self.local._checked_checkpoint(sd, lp)
            keys = tensors[0]
            mine = self.owner(keys) == self.rank
            parts.append(tuple(t[mine] for t in tensors))
            cfgs.append(cfg)
        if world is None or len(seen) != world:
            raise ValueError(f"{name}: got the state_dicts of ranks {sorted(seen)} of world size {world}; "
                             "every rank's is needed")
        tensors = [torch.cat([p[i] for p in parts]) for i in range(4)]
        n = tensors[0].numel()
        cfg = dict(cfgs[0])
        cfg.pop("checksum", None)
        cfg["clock"] = max(c["clock"] for c in cfgs)
        cfg["step"] = max(c["step"] for c in cfgs)
        elsewhere = self.owner_rank is not None and self.owner_rank != self.rank  # table-wise: holds no key
        cap = self.local.capacity if elsewhere else max(max(c["capacity"] for c in cfgs), self.local.capacity)
        while n > cfg["max_load_factor"] * cap:
            cap *= 2
        for _ in range(8):  # a bucket may still overflow where the keys cluster: double and retry
            cfg["capacity"] = cap
            cfg["max_capacity"] = cap if elsewhere else max(max(c["max_capacity"] for c in cfgs), cap)
            sd = dict(zip(("local." + k for k in _STATE), tensors))
            sd["local.config"] = dict(cfg)
            sd["shard"] = self._header()
            try:
                self.load_state_dict(sd)
                return
            except RuntimeError as e:
                if "did not fit" not in str(e):
                    raise
                cap *= 2
        raise RuntimeError(f"{name}: {n} keys did not fit a table of {cap} slots")

"""Does the training step's segment update gain from visiting the rows in slot order? (NOTES item 0: the
data flow "probe first, sort by slot in the backward" counts on it.) On bench_dynamic_embedding.py's SGD
training protocol (1M ids in bags of 64 from 4M keys in the table, dim 128), one process: the same
batch's dynemb_segment_update

    by id   the unique ids in key order, as the module runs it now (dynemb_sort_group's grouping):
            rows at random addresses;
    by slot the same groups renumbered in slot order (occurrences still in batch order within a
            group): rows at ascending addresses.

Each form is timed in turns (single synced calls, best of --rounds), with the pool of the forward
(dynemb_pool over the batch's slots in bag order) and a plain gather of the unique rows in either
order beside them, for the DRAM rates. The table's rows change with every update (SGD steps): only
the times are compared.

    python benchmarks/probe_dynemb_slot_order.py [--rounds 5] [--opt sgd|adam]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_dynamic_embedding as bd  # noqa: E402
from torchfuse import dynamic_embedding as de  # noqa: E402

ops = torch.ops.torchfuse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--opt", default="sgd", choices=["sgd", "adam"])
    a = ap.parse_args()
    bd.training_step(a.opt, bd.M, 4 * bd.M, 128)
    bag, ids, offsets, g = bd.LAST_STEP
    n = ids.numel()
    full, bag_of, scale, _ = ops.dynemb_bag_layout(offsets, n, False, False, True)
    perm, uniq, seg, inv, n_unique = de._sort_group(ids)
    nu = int(n_unique)
    uniq, seg = uniq[:nu], seg[:nu + 1]
    slots = bag._lookup(uniq)
    assert bool((slots >= 0).all()), "every id is in the table"
    # the same groups renumbered in slot order
    order = torch.argsort(slots)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(nu, device=order.device)
    inv2 = rank[inv.long()]
    perm2 = torch.argsort(inv2, stable=True).to(perm.dtype)
    counts = torch.bincount(inv2, minlength=nu)
    seg2 = torch.zeros(nu + 1, dtype=seg.dtype, device=seg.device)
    seg2[1:] = torch.cumsum(counts, 0).to(seg.dtype)
    slots2 = slots[order]
    sc = None if scale.numel() == 0 else scale
    grad = g.contiguous()
    slots_id = slots[inv.long()]  # each id's slot, bag order (the pool's input)

    def update(p, s, sl):
        return lambda: bag._apply_segment_gradient(sl, grad, p, s, bag_of, sc)

    forms = {
        "segment update, by id": update(perm, seg, slots),
        "segment update, by slot": update(perm2, seg2, slots2),
        "pool (forward, bag order)": lambda: ops.dynemb_pool(slots_id, full, None, bag._values, bag._values_host, False),
        "gather unique rows, by id": lambda: bag._gather(slots, bag._values, bag._values_host),
        "gather unique rows, by slot": lambda: bag._gather(slots2, bag._values, bag._values_host),
    }
    best = {k: float("inf") for k in forms}
    for _ in range(a.rounds):
        for k, fn in forms.items():
            best[k] = min(best[k], bd.timed(fn, 1))
    row = bag._values.shape[1] * bag._values.element_size()
    moved = {  # bytes counted: table rows read and written, one gradient row per occurrence (L2-resident: the
               # 16384 bags' gradient is 8 MB), the pool's output
        "segment update, by id": 2 * nu * row + n * row,
        "segment update, by slot": 2 * nu * row + n * row,
        "pool (forward, bag order)": n * row + grad.numel() * 4,
        "gather unique rows, by id": 2 * nu * row,
        "gather unique rows, by slot": 2 * nu * row,
    }
    print(f"{torch.cuda.get_device_name()}, {n} ids, {nu} unique, dim {bag._values.shape[1]}, {a.opt}")
    print("| form | us | GB/s (table rows read + written, a gradient row per occurrence, the pool's output) |")
    print("|---|---:|---:|")
    for k in forms:
        print(f"| {k} | {best[k] * 1e6:.0f} | {moved[k] / best[k] / 1e9:.0f} |")


if __name__ == "__main__":
    main()

"""Where the GPU time of one training step goes (bench_dynamic_embedding.py's training protocol: 1M
ids in bags of 64, dim 128, ids from 4M keys already in the table, SGD): torch.profiler kernel tables
of torchfuse's step and of nn.EmbeddingBag(sparse=True) + torch.optim.SGD.
Usage: python benchmarks/profile_dynemb_train.py [--opt sgd|adam]"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import bench_dynamic_embedding as bd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--opt", default="sgd")
    a = ap.parse_args()
    ours, theirs = bd.training_step(a.opt, bd.M, 4 * bd.M, 128)

    for name, fn in (("torchfuse", ours), ("PyTorch sparse", theirs)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            fn()
            torch.cuda.synchronize()
        print(f"== {name} ({a.opt})")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70))
    with profile(activities=[ProfilerActivity.CPU]) as p:  # where our host time goes
        ours()
        torch.cuda.synchronize()
    print("== torchfuse host ops (self CPU)")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()

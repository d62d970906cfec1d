"""Run every family's benchmark on this GPU and write benchmarks/results/<family>_<gpu>.md (gpu: h100,
h200, ... from the device name), each with its date, device, torch version, command, roofline and the
peers measured in the same run.

    python benchmarks/run_all.py [--quick] [--only hstu,norm] [--peers DIR]

--peers DIR: a folder holding the peers that are not pip packages (never committed): generative_recommenders/
(its Triton jagged and HSTU kernels) and hkv_bench (HierarchicalKV's benchmark binary). Pip-installed
peers (Liger-Kernel, transformers) are used when importable.
"""
import argparse
import importlib
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _common as C  # noqa: E402

# one GPU each; bench_distributed.py runs on a machine of several GPUs by itself
FAMILIES = ["norm", "jagged", "hstu", "hstu_layer", "dynamic_embedding", "hf", "torchrec", "sampled_softmax", "recsys"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (a few minutes in all)")
    ap.add_argument("--only", default=",".join(FAMILIES), help=f"comma list of: {', '.join(FAMILIES)}")
    ap.add_argument("--peers", default=os.environ.get("TORCHFUSE_PEERS"), help="the peers folder (see above)")
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="where the tables go")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("run_all: needs a CUDA GPU")
        return 1
    only = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = sorted(set(only) - set(FAMILIES))
    if unknown:
        ap.error(f"--only: unknown families {unknown}; known: {FAMILIES}")
    os.makedirs(args.results, exist_ok=True)
    command = C.command_line()
    failed = []
    for family in only:
        t0 = time.time()
        print(f"== {family}", flush=True)
        try:
            mod = importlib.import_module(f"bench_{family}")
            torch.manual_seed(0)
            ns = argparse.Namespace(quick=args.quick, peers=args.peers, out=None, tiny=False, only=None)
            text = mod.run(ns).markdown(command)
        except Exception:  # noqa: BLE001  (one family's failure must not lose the others' tables)
            traceback.print_exc()
            failed.append(family)
            continue
        finally:
            torch.cuda.empty_cache()
        path = os.path.join(args.results, f"{family}_{C.gpu_tag()}.md")
        with open(path, "w") as f:
            f.write(text)
        print(text, flush=True)
        print(f"== {family}: {time.time() - t0:.0f} s, written to {os.path.relpath(path)}", flush=True)
    if failed:
        print(f"run_all: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

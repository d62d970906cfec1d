"""``python -m torchfuse``: report the environment, check every op once against its PyTorch
reference on the available device, then print a short benchmark table. Exit status 1 if a check fails."""
import sys

import torch

import torchfuse
from torchfuse import reference
from torchfuse._timing import device_time_us


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _rel_err(a, ref):
    return _max_err(a, ref) / max(1.0, ref.abs().max().item())


def _norm_checks(device):
    """(name, shape, max error, tolerance) for each norm variant, forward and backward."""
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 2.0**-6 if dt == torch.bfloat16 else 1e-4  # relative to the largest reference value
    rows, n = 257, 1000
    out = []
    x = torch.randn(rows, n, device=device, dtype=dt, requires_grad=True)
    r = torch.randn(rows, n, device=device, dtype=dt)
    w = torch.randn(n, device=device, dtype=dt, requires_grad=True)
    b = torch.randn(n, device=device, dtype=dt, requires_grad=True)
    gy = torch.randn(rows, n, device=device, dtype=dt)
    cases = [
        ("layer_norm(residual)", lambda: torchfuse.layer_norm(x, w, b, residual=r),
         lambda: reference.add_layer_norm(x.float(), r.float(), w.float(), b.float())),
        ("rms_norm(residual)", lambda: torchfuse.rms_norm(x, w, residual=r),
         lambda: reference.add_rms_norm(x.float(), r.float(), w.float())),
    ]
    for name, ours_fn, ref_fn in cases:
        (y, s), (y_ref, s_ref) = ours_fn(), ref_fn()
        out.append((name, (rows, n), max(_rel_err(y, y_ref), _rel_err(s, s_ref)), tol))
        g = torch.autograd.grad(y, (x, w), gy)
        g_ref = torch.autograd.grad(y_ref, (x, w), gy.float())
        err = max(_rel_err(a, c) for a, c in zip(g, g_ref))
        out.append((name + " backward", (rows, n), err, tol))
    return out


def _bench(device):
    """(op, shape, dtype, torchfuse us, eager us) for a few shapes."""
    shapes = [((32768, 4096), torch.bfloat16), ((1, 2560), torch.float16)] if device == "cuda" else \
        [((512, 1024), torch.float32), ((1, 2560), torch.float32)]
    rows = []
    with torch.no_grad():
        for shape, dt in shapes:
            x = torch.randn(shape, device=device, dtype=dt)
            r = torch.randn(shape, device=device, dtype=dt)
            w = torch.randn(shape[-1], device=device, dtype=dt)
            b = torch.randn(shape[-1], device=device, dtype=dt)
            for op, ours, eager in (
                ("add+layer_norm", lambda: torchfuse.layer_norm(x, w, b, residual=r),
                 lambda: reference.add_layer_norm(x, r, w, b)),
                ("add+rms_norm", lambda: torchfuse.rms_norm(x, w, residual=r),
                 lambda: reference.add_rms_norm(x, r, w)),
            ):
                rows.append((op, shape, dt, device_time_us(ours, device), device_time_us(eager, device)))
    return rows


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torchfuse {torchfuse.__version__} | torch {torch.__version__} | CUDA {torch.version.cuda}")
    if device == "cuda":
        print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    else:
        print("device: CPU (no GPU found: checking and timing the CPU paths)")
    torch.manual_seed(0)

    print("\nself-check against the PyTorch reference")
    print(f"{'op':<30} {'shape':<14} {'rel err':>10} {'tol':>8}  result")
    ok = True
    for name, shape, err, tol in _norm_checks(device):
        passed = err <= tol
        ok &= passed
        print(f"{name:<30} {str(shape):<14} {err:>10.3g} {tol:>8.3g}  {'PASS' if passed else 'FAIL'}")

    print(f"\nbenchmark ({device}; median time per call, inference)")
    print(f"{'op':<16} {'shape':<14} {'dtype':<9} {'torchfuse us':>12} {'eager us':>10} {'speedup':>8}")
    for op, shape, dt, t_ours, t_eager in _bench(device):
        dts = str(dt).replace("torch.", "")
        print(f"{op:<16} {str(shape):<14} {dts:<9} {t_ours:>12.1f} {t_eager:>10.1f} {t_eager / t_ours:>7.2f}x")
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

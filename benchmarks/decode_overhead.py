"""Where the host time of one decode-size norm call goes: the public API, the raw op, the op below
the autograd layer, and eager's plain add. Wall time per call of back-to-back calls."""
import torch

import torchfuse
from torchfuse._timing import wall_times_us

dev = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.randn(1, 2560, device=dev, dtype=torch.float16)
r = torch.randn_like(x)
w = torch.randn(2560, device=dev, dtype=torch.float16)
b = torch.randn_like(w)
op = torch.ops.torchfuse.norm_fwd.default


def below():
    with torch._C._AutoDispatchBelowAutograd():
        return op(x, r, None, w, b, None, None, 1e-5, 0, 0.0, None, False)


with torch.no_grad():
    cases = [("plain add", lambda: x + r),
                    ("torch.ops.aten.add (floor of a torch.ops call)", lambda: torch.ops.aten.add.Tensor(x, r)),
                    ("torchfuse.layer_norm", lambda: torchfuse.layer_norm(x, w, b, residual=r)),
                    ("torch.ops norm_fwd", lambda: op(x, r, None, w, b, None, None, 1e-5, 0, 0.0, None, False)),
                    ("norm_fwd below autograd", below),
                    ("torch.ops add_norm", lambda: torch.ops.torchfuse.add_norm.default(x, r, w, b, 1e-5, 0, 0.0)),
                    ("torch.empty_like x2", lambda: (torch.empty_like(x), torch.empty_like(x)))]
    for (name, _), t in zip(cases, wall_times_us([f for _, f in cases], dev)):
        print(f"{name:<48} {t:6.2f} us/call")

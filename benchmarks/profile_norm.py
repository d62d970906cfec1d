"""One add+LayerNorm forward and backward at a large shape, for `ncu` (see run_profile.sh)."""
import sys

import torch

import torchfuse

rows, cols = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (32768, 4096)
x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
r = torch.randn_like(x)
w = torch.randn(cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn_like(w, requires_grad=True)
for _ in range(2):
    y, s = torchfuse.layer_norm(x, w, b, residual=r)
    torch.autograd.grad((y, s), (x, w, b), (torch.ones_like(y), torch.ones_like(s)))
torch.cuda.synchronize()

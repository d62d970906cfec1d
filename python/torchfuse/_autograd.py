"""Training calls without torch.library's Python autograd layer.

Ops keep their ``torch.library.register_autograd`` registration, so ``torch.ops.torchfuse.<op>`` is
differentiable wherever it is called from. That layer, though, re-reads the op's whole schema on every
differentiable call (``torch._library.utils.fill_defaults``): 40-60 us per call on a CPU core for
ops of 12-15 arguments, longer than the kernels themselves at small shapes. The public wrappers
therefore run training calls through a plain ``torch.autograd.Function`` built here from the same
setup_context and backward, so both paths compute the same gradients. (The norms' autograd is in C++,
csrc/norm_autograd.cpp, one path for the op and the wrappers, cheaper still.)
"""
from typing import Callable

import torch


def function_for(name: str, op, setup_context: Callable, backward: Callable):
    """An autograd.Function whose forward is ``op(*args)`` followed by ``setup_context(ctx, args,
    output)`` and whose backward is ``backward(ctx, *grads)``: register_autograd's contract. In eager
    mode the forward calls the op below the Autograd dispatch key, straight to its kernels: with grad
    mode off the op's inputs that require grad still reach its registered autograd, whose no-grad
    redispatch is another Python layer. (Traced by torch.compile, the op is called as it is.)"""

    def forward(ctx, *args):
        if torch.compiler.is_compiling():
            out = op(*args)
        else:
            with torch._C._AutoDispatchBelowAutograd():
                out = op(*args)
        setup_context(ctx, args, out)
        return out

    def bwd(ctx, *grads):
        return backward(ctx, *grads)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(bwd)})

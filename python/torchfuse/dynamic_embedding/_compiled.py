"""torch.compile over the modules: a forward that inserts or trains is one opaque op.

Such a forward makes host decisions that a graph cannot hold: the insert's counts decide growth,
eviction records and errors; the batch's distinct ids decide the sizes. So under torch.compile the
module's forward calls ``torchfuse::dynemb_module_forward``: its kernel runs the eager forward of
the module (found by ``handle``) on the table state passed in, and keeps what the backward needs
under a token; ``torchfuse::dynemb_module_backward`` applies the fused optimizer from that record,
as the eager backward does. The graph around them compiles with ``fullgraph=True``.

The forward op declares the tables' state lists (``tables``, _table.STATE_FIELDS per table) as
written (``Tensor(a!)[]``), so functionalization orders it against other uses of the state and
writes back whatever it writes. It may hand the op copies of the state: the kernel then runs the
table on those copies (_bound) and the graph copies them back. A table that grows inside the op
keeps its new, larger tensors (the compiled graph guards on the old ones and recompiles). The
backward op writes the tables of the record it is handed (not arguments of its own: the backward
graph does not take the forward's inputs), and returns the gradient of the forward's anchor so that
it is part of the backward graph.
"""
import itertools
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._table import STATE_FIELDS

_FIELDS = len(STATE_FIELDS)
_VALUES = STATE_FIELDS.index("_values")
_modules: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
_handles = itertools.count(1)
_tokens = itertools.count(1)
_records: Dict[int, tuple] = {}  # token -> (module, backward record), until the backward runs


def register(module) -> int:
    """Gives `module` the handle the ops find it by (its ``_compile_handle``; a copy of the module gets
    its own) and the anchor its outputs hang from in autograd (a leaf of no elements: the table has no
    parameters, and the backward must run for the optimizer step)."""
    h = next(_handles)
    module.__dict__["_compile_handle"] = h
    module.__dict__["_compile_anchor"] = torch.empty(0, requires_grad=True)
    _modules[h] = module
    return h


def state_of(tables: Sequence) -> List[Tensor]:
    """The tables' state lists, one after another (the ops' `tables`)."""
    return [x for t in tables for x in t._tensors]


class _bound:
    """The op's tensors as the tables' state while the kernel runs; the tables' own afterwards,
    unless a table reallocated its state meanwhile (growth)."""

    def __init__(self, tables, flat: List[Tensor]):
        self.swapped = []
        for i, t in enumerate(tables):
            mine = list(flat[i * _FIELDS:(i + 1) * _FIELDS])
            own = t._tensors
            if any(a is not b for a, b in zip(mine, own)):
                t._set_tensors(mine)
                self.swapped.append((t, own, t._tensors))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for t, own, bound in self.swapped:
            if t._tensors is bound:
                t._set_tensors(own)
        return False


def _module(handle: int):
    m = _modules.get(handle)
    if m is None:
        raise RuntimeError(f"torchfuse.dynemb_module_forward: no live module with handle {handle}")
    return m


@torch.library.custom_op("torchfuse::dynemb_module_forward", mutates_args=("tables",))
def _forward_op(handle: int, tables: List[Tensor], inputs: List[Optional[Tensor]],
                need_grad: bool) -> Tuple[Tensor, Tensor]:
    m = _module(handle)
    with _bound(m._compiled_tables(), tables):
        out, record = m._run(need_grad, *inputs)
    token = 0
    if record is not None:
        token = next(_tokens)
        _records[token] = (m, record)
    return out, torch.tensor([token], dtype=torch.int64)


@_forward_op.register_fake
def _forward_fake(handle, tables, inputs, need_grad):
    shape, dtype = _module(handle)._compiled_out(*inputs)
    return tables[_VALUES].new_empty(shape, dtype=dtype), torch.empty(1, dtype=torch.int64)


# The forward's output hung from the module's anchor (a functional op: autograd formulas are for
# those only); its backward is the optimizer step of the forward's record.
@torch.library.custom_op("torchfuse::dynemb_module_output", mutates_args=())
def _output_op(anchor: Tensor, out: Tensor, token: Tensor) -> Tensor:
    return out.clone()


@_output_op.register_fake
def _output_fake(anchor, out, token):
    return torch.empty_like(out)


@torch.library.custom_op("torchfuse::dynemb_module_backward", mutates_args=())
def _backward_op(token: Tensor, grad: Tensor) -> Tensor:
    entry = _records.pop(int(token[0]), None)  # token 0: a forward that recorded nothing (frozen table)
    if entry is not None:
        entry[0]._backward(entry[1], grad)
    return torch.zeros(0)  # the anchor's gradient


@_backward_op.register_fake
def _backward_fake(token, grad):
    return torch.empty(0)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _grad(ctx, grad):
    (token,) = ctx.saved_tensors
    return _backward_op(token, grad.contiguous()), None, None


torch.library.register_autograd("torchfuse::dynemb_module_output", _grad, setup_context=_setup)

# The backward op reads and writes hidden state (the tables of its record): never dropped or merged.
torch.fx.node.has_side_effect(torch.ops.torchfuse.dynemb_module_backward.default)


def forward(module, need_grad: bool, inputs: List[Optional[Tensor]]) -> Tensor:
    """The module's forward as the ops above. The module provides _compiled_tables() (the tables it
    reads and writes), _compiled_out(*inputs) (its output's shape and dtype), _run(need_grad, *inputs)
    ((output, backward record or None), as its eager forward computes them) and _backward(record,
    grad) (the optimizer steps)."""
    out, token = torch.ops.torchfuse.dynemb_module_forward(module._compile_handle,
                                                           state_of(module._compiled_tables()), inputs, need_grad)
    if not need_grad:
        return out
    return torch.ops.torchfuse.dynemb_module_output(module._compile_anchor, out, token)

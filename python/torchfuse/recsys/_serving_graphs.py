"""CUDA graphs of a serving call, for ``HSTURecommender.extend(cuda_graph=True)``.

Scoring a few new events of a few users is host-bound: eight layers of small ops cost ~3 ms of Python
and launches on an H100 against well under 1 ms of kernels. A graph replays those kernels in one
launch. It is recorded against fixed buffers, so it needs the slotted K/V cache
(``STUStack.reserve_kv_cache``, which ``prefill`` sets up): appending rows then writes into the same
memory every call, and the lengths advance on the device inside the graph.

A graph is kept per (shape, dtype) of the call's input and replayed while the caller's token (what
the recording depends on: parameter storage and versions, cache buffers) is the one it was recorded
with; otherwise the call runs eagerly and records a new one."""
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor


class ServingGraphs:
    def __init__(self):
        self._graphs: Dict[Tuple, Tuple] = {}

    def clear(self) -> None:
        self._graphs.clear()

    def run(self, token: Tuple, x: Tensor, forward: Callable[[Tensor], Tensor]) -> Tensor:
        """``forward(x)`` for this call: a replay when a graph recorded for this input shape under the
        same ``token`` exists, else an eager run (on a side stream, as graph warm-up asks) followed by a
        recording for the next call. ``forward`` must write only to buffers that stay in place and
        must advance them as a replay would: the recording itself does not run."""
        key = (tuple(x.shape), x.dtype)
        entry = self._graphs.get(key)
        if entry is not None and entry[0] == token:
            _, graph, static_x, static_y = entry
            static_x.copy_(x)
            graph.replay()
            return static_y.clone()
        self._graphs.pop(key, None)
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            y = forward(x)  # this call's result; also every kernel's first launch before the recording
        torch.cuda.current_stream(x.device).wait_stream(side)
        static_x = x.clone()
        # each graph its own memory pool: a shared pool's handle dies with the last graph using it
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records only: the cache does not advance here
            static_y = forward(static_x)
        self._graphs[key] = (token, graph, static_x, static_y)
        return y

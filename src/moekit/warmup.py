"""``warmup``: compile a module's kernels ahead of a timed run or a CUDA-graph capture, and leave the
module as it was.

A moekit module launches the same kernels for every batch of the same shape: the sizes its kernels
are compiled for (rows T * K, dims, dtypes, the tile each launcher picks) follow from the input's shape,
never from the routing, which stays on the device. One forward and backward on an input of the real
shape therefore compiles all of them. What ``warmup`` adds to running the module once is that the run
leaves no trace: parameters and their ``.grad``, buffers (the routed-token counts of aux-loss-free
balancing), the last ``aux_loss`` and the NVFP4 stochastic-rounding counters are as before, so a
training run that warms up rounds with the same random bits as one that does not.
"""

from __future__ import annotations

import torch
from torch import nn

from .nvfp4.train import NVFP4Training


def warmup(module: nn.Module, x: torch.Tensor, *, backward: bool = True) -> None:
    """Run ``module(x)`` once, and its backward when ``backward`` (the gradients are computed and
    dropped), so that every Triton and Gluon kernel it launches for inputs of ``x``'s shape, dtype and
    device is compiled; then restore the module's state (module docstring).

    ``module``: any module called as ``module(x)``, such as :class:`moekit.MoE` or the drop-ins; an
    expert-parallel module must be warmed up on every rank, as it runs collectives. ``x``: an input
    of the real shape and dtype (its values only drive the routing). Call it before capturing a CUDA
    graph, or before timing. No host sync beyond what the module's own step has."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"warmup: module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"warmup: x must be a tensor, got {type(x).__name__}")
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    streams = [(m.stream, m.stream.offset) for m in module.modules() if isinstance(m, NVFP4Training)]
    aux = [(m, m.aux_loss) for m in module.modules() if hasattr(m, "aux_loss")]
    params = [p for p in module.parameters() if p.requires_grad]
    try:
        with torch.set_grad_enabled(backward and torch.is_grad_enabled()):
            inp = x.detach().requires_grad_(backward and x.is_floating_point())
            out = module(inp)
            tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if backward and tensors:
                wrt = params + ([inp] if inp.requires_grad else [])
                # autograd.grad, not .backward(): the parameters' .grad stay as they are
                torch.autograd.grad(tensors, wrt, [torch.ones_like(t) for t in tensors], allow_unused=True)
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for stream, offset in streams:
            stream.offset = offset
        for m, value in aux:
            m.aux_loss = value


__all__ = ["warmup"]

"""``graphed``: a :class:`moekit.MoE` whose training step replays CUDA graphs, for loops that do not
``torch.compile``.

At the token counts of a training step (T = 1k-8k per GPU and layer) an eager block step spends more
time on the host (Python, checks, ~20 kernel launches, ~40 torch ops) than on the GPU.
``moekit.graphed(moe)`` makes the block's forward and backward two CUDA graph replays each: the
host's work per step is then two copies in, two replays, and a few checks.

How it works. On the first training-mode, grad-enabled call with a given input signature (shape,
dtype, device, whether x requires grad, the autocast state), the block is run twice on a side stream
(which compiles every kernel), then its forward and its backward are captured into graphs (the
backward twice: see below). The captures differentiate with respect to aliases of the parameters
(new leaves on the same storage), never the parameters themselves: the parameters' gradient
accumulators belong to the caller's autograd graphs, which may be alive (a loss kept for logging) and
were made on the caller's stream, and a capture that reached them would have to synchronize with that
stream, which CUDA refuses during a capture.
A later call with that signature copies x into the graph's static input, replays the forward, and
returns a copy of the static output; the backward copies the output gradient in, replays, and returns
a copy of dx. The block's state behaves as in eager mode: ``tokens_per_expert`` accumulates inside the
graph, ``expert_bias`` and the parameters are read at their addresses (an optimizer's in-place update
is seen by the next replay), and ``aux_loss`` is an output of the graph with its own gradient.

Parameter gradients are written by the backward graph, as eager autograd writes them: after
``zero_grad()`` (gradients set to None) the backward's own gradient tensors become ``.grad``, with no
copy; with gradients present (the micro-batches after the first, or ``zero_grad(set_to_none=False)``)
a second backward graph adds into them in place. So ``.grad`` is one static tensor per parameter that
each step rewrites: keep a copy of it, not a reference, across steps. Hooks on the parameters'
gradients do not run (``AccumulateGrad`` never sees these gradients): DDP's gradient hooks, for one,
do not fire; reduce the gradients after ``backward()`` instead.

What runs eagerly: eval mode, ``torch.no_grad()``, CPU tensors. What is refused, with an error that
says so: a second grad-enabled forward while the first one's output is alive and its backward has not
run (activation checkpointing, interleaved micro-batches: the second replay would overwrite the saved
activations of the first); NVFP4 training with stochastic rounding (a graph would replay the same
random bits every step); any other module than :class:`moekit.MoE`. Parameters moved to new storage
(``.to()``, ``load_state_dict(assign=True)``) are noticed, and the graphs are captured again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .layers import MoE

_PENDING_ERROR = (
    "moekit.graphed: a second forward while the previous forward's output is alive and its backward has "
    "not run; its replay would overwrite the activations that backward needs. Run each micro-batch's "
    "backward before the next forward, or leave this block eager (activation checkpointing and "
    "interleaved pipeline schedules need the eager block)"
)


@dataclass
class _Graphs:
    """One input signature's captured forward and two backwards, with their static tensors. ``fresh``
    writes the parameters' gradients into its own static tensors (they become ``.grad``: the step after a
    ``zero_grad()`` that set them to None, as eager autograd's first accumulation takes the gradient
    itself); ``accumulate`` adds its gradients into those same tensors (micro-batches after the first)."""

    fwd: torch.cuda.CUDAGraph
    fresh: torch.cuda.CUDAGraph
    accumulate: torch.cuda.CUDAGraph
    x: torch.Tensor  # static input (..., D)
    y: torch.Tensor  # static output
    aux: torch.Tensor | None  # static aux loss (a scalar), or None
    gy: torch.Tensor  # static output gradient
    gaux: torch.Tensor | None
    dx_fresh: torch.Tensor | None  # static input gradient of each backward, or None when x needs none
    dx_accumulate: torch.Tensor | None
    params: tuple  # the parameters with a gradient, and their static gradients (the fresh graph's)
    grads: tuple
    param_ptrs: tuple


class _GraphedStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, graphs: _Graphs, x, *params):
        ctx.state, ctx.graphs = state, graphs
        graphs.x.copy_(x)
        graphs.fwd.replay()
        y = graphs.y.clone()
        aux = graphs.aux.clone() if graphs.aux is not None else y.new_zeros(())
        return y, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, gaux):
        g, state = ctx.graphs, ctx.state
        state.pending = None
        _copy_or_zero(g.gy, gy)
        if g.gaux is not None:
            _copy_or_zero(g.gaux, gaux)
        if all(p.grad is None for p in g.params):
            g.fresh.replay()
            dx = g.dx_fresh
        else:
            for p, static in zip(g.params, g.grads, strict=True):
                if p.grad is not static:  # a None .grad among others, or one the caller assigned
                    _copy_or_zero(static, p.grad)
            g.accumulate.replay()
            dx = g.dx_accumulate
        for p, static in zip(g.params, g.grads, strict=True):
            p.grad = static
        return (None, None, dx.clone() if dx is not None else None, *(None for _ in g.params))


def _in_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad``, or a copy of it with ``param``'s strides where they differ."""
    return grad if grad.stride() == param.stride() else torch.empty_like(param).copy_(grad)


def _copy_or_zero(dst: torch.Tensor, src: torch.Tensor | None) -> None:
    if src is None:
        dst.zero_()
    else:
        dst.copy_(src)


class _GraphedForward:
    """The forward installed on a graphed module: replays where it can, runs eagerly where it must."""

    def __init__(self, moe: MoE):
        self.moe = weakref.proxy(moe)  # (the module holds this object: no reference cycle through it)
        self.entries: dict = {}
        self.pending = None  # a weak reference to the output whose backward has not run yet
        self.capturing = False  # inside _capture: the module's own forward, on the parameters' aliases

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        if self.capturing or not (moe.training and torch.is_grad_enabled() and x.is_cuda):
            return MoE.forward(moe, x)
        if self.pending is not None and self.pending() is not None:
            raise RuntimeError(_PENDING_ERROR)
        key = (tuple(x.shape), x.dtype, x.device, x.requires_grad, torch.is_autocast_enabled("cuda"),
               torch.get_autocast_dtype("cuda"))
        graphs = self.entries.get(key)
        if graphs is None or graphs.param_ptrs != tuple(p.data_ptr() for p in graphs.params):
            graphs = self.entries[key] = _capture(self, moe, x)
        y, aux = _GraphedStep.apply(self, graphs, x, *graphs.params)
        self.pending = weakref.ref(y)
        moe.aux_loss = aux if graphs.aux is not None else None
        return y


def _outputs(state: _GraphedForward, moe: MoE, aliases: dict, x: torch.Tensor):
    """The block's forward on the parameters' aliases: (y, aux loss or None)."""
    state.capturing = True
    try:
        y = torch.func.functional_call(moe, aliases, (x,), strict=False)
    finally:
        state.capturing = False
    aux, moe.aux_loss = moe.aux_loss, None  # (the module keeps no reference to a captured graph)
    return y, aux


def _capture(state: _GraphedForward, moe: MoE, x: torch.Tensor) -> _Graphs:
    named = [(n, p) for n, p in moe.named_parameters() if p.requires_grad]
    params = tuple(p for _, p in named)
    aliases = {n: p.detach().requires_grad_() for n, p in named}  # the same storage, leaves of their own
    static_x = x.detach().clone().requires_grad_(x.requires_grad)
    inputs = ((static_x,) if x.requires_grad else ()) + tuple(aliases.values())
    counts = moe.tokens_per_expert.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles every kernel; the gradients are dropped, not accumulated
        for _ in range(2):
            y, aux = _outputs(state, moe, aliases, static_x)
            outs, grads = (y,) if aux is None else (y, aux), (torch.zeros_like(y),)
            grads += () if aux is None else (torch.zeros_like(aux),)
            torch.autograd.grad(outs, inputs, grads, allow_unused=True)
    # The warm-up's autograd graph goes before the capture: the aliases' gradient accumulators it holds
    # were made on the side stream, and the capture would otherwise reuse them and synchronize with it.
    del y, aux, outs, grads
    torch.cuda.current_stream().wait_stream(side)
    moe.tokens_per_expert.copy_(counts)  # the warm-up's routed counts do not count
    # Two pools: a forward replay never writes where the backward's outputs (the parameters'
    # gradients, kept as .grad across micro-batches) live.
    fwd = torch.cuda.CUDAGraph()
    with torch.cuda.graph(fwd, pool=torch.cuda.graph_pool_handle()):
        y, aux = _outputs(state, moe, aliases, static_x)
    gy = torch.zeros_like(y)
    gaux = torch.zeros_like(aux) if aux is not None else None
    outs, out_grads = ((y,), (gy,)) if aux is None else ((y, aux), (gy, gaux))
    n_x = len(inputs) - len(params)
    bwd_pool = torch.cuda.graph_pool_handle()
    fresh, accumulate = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(fresh, pool=bwd_pool):
        got = torch.autograd.grad(outs, inputs, out_grads, allow_unused=True, retain_graph=True)
        used = [i for i, g in enumerate(got[n_x:]) if g is not None]  # parameters the block uses
        # .grad in the parameter's layout, as eager AccumulateGrad leaves it (it copies a gradient that
        # a kernel wrote transposed into the layout of its parameter, and so does this graph)
        grads = tuple(_in_layout(got[n_x + i], params[i]) for i in used)
    params = tuple(params[i] for i in used)
    dx_fresh = got[0] if n_x else None
    with torch.cuda.graph(accumulate, pool=bwd_pool):
        got = torch.autograd.grad(outs, inputs, out_grads, allow_unused=True)
        for static, i in zip(grads, used, strict=True):
            static.add_(got[n_x + i])
    dx_accumulate = got[0] if n_x else None
    return _Graphs(fwd, fresh, accumulate, static_x, y.detach(), aux.detach() if aux is not None else None, gy,
                   gaux, dx_fresh, dx_accumulate, params, grads, tuple(p.data_ptr() for p in params))


def graphed(moe: MoE) -> MoE:
    """Make ``moe``'s training steps replay CUDA graphs (the module docstring says how and what it
    needs); returns ``moe`` itself, with its parameters, state dict and eager behaviour elsewhere
    unchanged. ``moekit.graphs.ungraphed(moe)`` takes it back.

    x (..., D) on a CUDA device, any T; each new input signature captures its own pair of graphs (the
    memory of one step's saved activations each)."""
    if not isinstance(moe, MoE):
        raise TypeError(f"moekit.graphed: takes a moekit.MoE, got {type(moe).__name__}")
    recipe = getattr(moe.experts.nvfp4, "recipe", None)
    if recipe is not None and recipe.stochastic_rounding:
        raise ValueError("moekit.graphed: NVFP4 training with stochastic rounding draws from a host counter, "
                         "and a graph would replay the same random bits every step; use "
                         "TrainingRecipe(stochastic_rounding=False) or the eager block")
    if not isinstance(moe.__dict__.get("forward"), _GraphedForward):
        moe.forward = _GraphedForward(moe)
    return moe


def ungraphed(moe: MoE) -> MoE:
    """Undo :func:`graphed`: ``moe`` runs eagerly again and its graphs are freed."""
    if isinstance(moe.__dict__.get("forward"), _GraphedForward):
        del moe.forward
    return moe


__all__ = ["graphed", "ungraphed"]

"""The :class:`moekit.MoE` step as one autograd node (eager) or two custom ops (under ``torch.compile``).

Composed of the public ops, a block step makes five autograd nodes (router, sorted weights, the two
expert GEMMs, combine), each with its custom-op call, argument checks and saved-tensor bookkeeping,
and the autograd engine walks them on the way back: host time that, below T ~ 4096, the GPU waits for
(docs/design.md, section 9). :func:`moe_step` runs the same launchers, in the same order and on the
same tensors, inside one ``autograd.Function``: the forward calls the router, routing-metadata,
expert-GEMM and combine launchers directly, and the backward the gradient helpers the ops' own
backwards use (``experts.up_grads``, ``routing.router_grads``). Outputs and gradients are the
composed path's bit for bit (tests/test_block.py). Under ``torch.compile`` the same forward and backward
are two custom ops, ``moekit::moe_step`` and ``moekit::moe_step_backward`` (with their fakes and an
autograd formula), so that a compiled step calls two of moekit's ops where the composed block's traced
graphs call 11-14 (a CPU trace); same bits.

:func:`step_inputs` says when the block may take it: plain tensors (no dispatch mode in eager mode, no
tensor subclass such as FSDP2's DTensor), no hooks on the experts module (FSDP2 gathers parameters
there), no aux loss, no NVFP4 or FP8, contiguous parameters on x's device, and the ``fused_block`` option
on. Anything else composes the ops, whose checks then raise the usual errors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.modules import module as _module

from . import config
from .dispatch import PLAIN_TYPES, custom_op
from .epilogue import SwiGLU
from .experts import downproj_bwd, grouped_mm_swiglu_fwd, up_grads
from .grouped_gemm import ragged_m
from .plans import planned
from .routing import (
    combine_bwd,
    combine_fwd,
    gather_weights_fwd,
    router_grads,
    router_op,
    routing_metadata_fwd,
    scatter_weights_fwd,
)
from .validation import IN_DTYPES, matrix_ready


class StepPlan(NamedTuple):
    """What a block step decides from its module's settings: the router's top-k, score function and
    renormalization, E, and the SwiGLU."""

    top_k: int
    sigmoid: bool
    renormalize: bool
    num_experts: int
    spec: SwiGLU


@planned
def _forward(x, gate_w, gate_b, expert_bias, w1, b1, w2, b2, plan: StepPlan, keep_h: bool):
    """The step's forward launches -> (out, counts, then the tensors its backward reads)."""
    w1c = w1 if w1.dtype == x.dtype else w1.to(x.dtype)
    w2c = w2 if w2.dtype == x.dtype else w2.to(x.dtype)
    weights, experts, scores = router_op.impl(x, gate_w, gate_b, expert_bias, plan.top_k, plan.sigmoid,
                                              plan.renormalize)
    counts, offs, token_idx, row_of = routing_metadata_fwd(experts, plan.num_experts)
    scale = scatter_weights_fwd(weights, row_of) if b2 is None else None
    h, aux = grouped_mm_swiglu_fwd(x, w1c.mT, offs, b1, plan.spec, token_idx=token_idx, row_scale=scale)
    ys = ragged_m(h, w2c.mT, offs, x.dtype, None, bias=b2)
    out = combine_fwd(ys, weights if scale is None else None, row_of)
    weighted = scale is None
    return (out, counts, x, gate_w, gate_b, experts, scores, offs, token_idx, row_of, aux, h if keep_h else None,
            w1c, w2c, b1, b2, scale, weights if weighted else None, ys if weighted else None)


@planned
def _backward(dout, x, gate_w, gate_b, experts, scores, offs, token_idx, row_of, aux, h, w1, w2, b1, b2, scale,
              weights, ys, plan: StepPlan, needs: tuple):
    """The step's backward launches -> the gradients of ``_MoEStepFn.forward``'s inputs."""
    need_x, need_gw, need_gb, _, need_w1, need_b1, need_w2, need_b2, _ = needs
    dout = dout.contiguous()
    need_route = need_x or need_gw or need_gb  # the routing weights' gradient
    if scale is None:  # the weighted combine
        dys, d_weights = combine_bwd(dout, ys, weights, row_of, need_route)
    else:
        dys, d_weights = combine_bwd(dout, None, None, row_of, False, rows=aux.shape[0])[0], None
    d_aux, dw2, db2, d_scale = downproj_bwd(matrix_ready(dys), w2.mT, offs, aux, plan.spec, need_w=need_w2,
                                            need_b=need_b2, h=h, scale=scale)
    if scale is not None and need_route:
        d_weights = gather_weights_fwd(d_scale, row_of)
    dx = dw1 = db1 = dgw = dgb = None
    if need_x or need_w1 or need_b1:
        dx, dw1, db1 = up_grads(matrix_ready(d_aux), x, w1.mT, offs, b1, token_idx, row_of, need_x, need_w1,
                                need_b1, True)
    if need_route:
        dx, dgw, dgb = router_grads(d_weights, None, x, gate_w, gate_b, experts, scores, plan.sigmoid,
                                    plan.renormalize, need_x, need_gw, need_gb, dx_add=dx)
    return (dx, dgw, dgb, None, None if dw1 is None else dw1.mT, db1, None if dw2 is None else dw2.mT,
            None if db2 is None else db2.to(b2.dtype), None)


class _MoEStepFn(torch.autograd.Function):
    """(x (T, D), gate weight (E, D), gate bias (E,) or None, expert_bias (E,) or None, w_up (E, 2F, D),
    b_up (E, 2F) or None, w_down (E, D, F), b_down (E, D) or None, plan) -> (out (T, D), counts (E,)
    int32, not differentiable). Without b_down the routing weights scale the SwiGLU output and the
    combine is a plain sum (``MoE``'s docstring). Forward and backward are launch plans
    (``moekit.plans``) of ``_forward`` and ``_backward``."""

    @staticmethod
    def forward(ctx, x, gate_w, gate_b, expert_bias, w1, b1, w2, b2, plan):
        keep_h = config.save_h() and ctx.needs_input_grad[6]
        out, counts, *saved = _forward(x, gate_w, gate_b, expert_bias, w1, b1, w2, b2, plan, keep_h)
        ctx.save_for_backward(*saved)
        ctx.plan = plan
        ctx.mark_non_differentiable(counts)
        ctx.set_materialize_grads(False)
        return out, counts

    @staticmethod
    def backward(ctx, dout, _):
        if dout is None:
            return (None,) * 9
        return _backward(dout, *ctx.saved_tensors, ctx.plan, ctx.needs_input_grad)


# Under torch.compile the step is two custom ops, the forward's and the backward's launch plans, so that
# Inductor calls two ops a step where the composed block's graphs call 11-14 (each a dispatch and a launcher).
# Their outputs are tensors only: an absent one is an empty (0,) tensor, and the weights come in already cast
# to x's dtype (the cast is an op of the traced graph, so its backward is too).


def _absent(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if t is None else t


@custom_op("moekit::moe_step")
def _step_op(x: torch.Tensor, gate_w: torch.Tensor, gate_b: torch.Tensor | None, expert_bias: torch.Tensor | None,
             w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None, top_k: int,
             sigmoid: bool, renormalize: bool, alpha: float, limit: float | None, linear_offset: float, layout: str,
             keep_h: bool) -> list[torch.Tensor]:
    """``_forward`` as one op: [out, counts, experts, scores, offs, token_idx, row_of, aux, h, scale, weights,
    ys], each absent one an empty (0,) tensor of its dtype."""
    plan = StepPlan(top_k, sigmoid, renormalize, w1.shape[0], SwiGLU(alpha, limit, linear_offset, layout))
    got = _forward(x, gate_w, gate_b, expert_bias, w1, b1, w2, b2, plan, keep_h)
    out, counts, _, _, _, experts, scores, offs, token_idx, row_of, aux, h, _, _, _, _, scale, weights, ys = got
    f32 = x.new_empty(0, dtype=torch.float32)
    return [out, counts, experts, scores, offs, token_idx, row_of, aux, _absent(h, x), _absent(scale, f32),
            _absent(weights, f32), _absent(ys, x)]


@_step_op.register_fake
def _(x, gate_w, gate_b, expert_bias, w1, b1, w2, b2, top_k, sigmoid, renormalize, alpha, limit, linear_offset,
      layout, keep_h):
    t, d = x.shape
    e, two_f, f, r = w1.shape[0], w1.shape[1], w2.shape[2], x.shape[0] * top_k
    i32, f32 = torch.int32, torch.float32
    weighted = b2 is not None
    return [x.new_empty((t, d)), x.new_empty(e, dtype=i32), x.new_empty((t, top_k), dtype=i32),
            x.new_empty((t, e), dtype=f32), x.new_empty(e, dtype=i32), x.new_empty(r, dtype=i32),
            x.new_empty((t, top_k), dtype=i32), x.new_empty((r, two_f)), x.new_empty((r, f) if keep_h else 0),
            x.new_empty(0 if weighted else r, dtype=f32), x.new_empty((t, top_k) if weighted else 0, dtype=f32),
            x.new_empty((r, d) if weighted else 0)]


@custom_op("moekit::moe_step_backward")
def _step_backward_op(dout: torch.Tensor, x: torch.Tensor, gate_w: torch.Tensor, gate_b: torch.Tensor | None,
                      experts: torch.Tensor, scores: torch.Tensor, offs: torch.Tensor, token_idx: torch.Tensor,
                      row_of: torch.Tensor, aux: torch.Tensor, h: torch.Tensor | None, w1: torch.Tensor,
                      w2: torch.Tensor, b1: torch.Tensor | None, b2: torch.Tensor | None, scale: torch.Tensor | None,
                      weights: torch.Tensor | None, ys: torch.Tensor | None, top_k: int, sigmoid: bool,
                      renormalize: bool, alpha: float, limit: float | None, linear_offset: float, layout: str,
                      needs: list[bool]) -> list[torch.Tensor]:
    """``_backward`` as one op: [dx, d gate_w, d gate_b, d w1, d b1, d w2, d b2], contiguous, each one not
    needed an empty (0,) tensor."""
    plan = StepPlan(top_k, sigmoid, renormalize, w1.shape[0], SwiGLU(alpha, limit, linear_offset, layout))
    grads = _backward(dout, x, gate_w, gate_b, experts, scores, offs, token_idx, row_of, aux, h, w1, w2, b1, b2,
                      scale, weights, ys, plan, tuple(needs))
    dx, dgw, dgb, _, dw1, db1, dw2, db2, _ = grads
    return [x.new_empty(0) if g is None else g.contiguous() for g in (dx, dgw, dgb, dw1, db1, dw2, db2)]


@_step_backward_op.register_fake
def _(dout, x, gate_w, gate_b, experts, scores, offs, token_idx, row_of, aux, h, w1, w2, b1, b2, scale, weights, ys,
      top_k, sigmoid, renormalize, alpha, limit, linear_offset, layout, needs):
    need_x, need_gw, need_gb, _, need_w1, need_b1, need_w2, need_b2, _ = needs

    def grad(t, need, dtype=None):
        return t.new_empty(t.shape, dtype=dtype) if need and t is not None else x.new_empty(0)

    return [grad(x, need_x), grad(gate_w, need_gw), grad(gate_b, need_gb, torch.float32), grad(w1, need_w1),
            grad(b1, need_b1), grad(w2, need_w2), grad(b2, need_b2)]


def _step_setup(ctx, inputs, output):
    x, gate_w, gate_b, _, w1, b1, w2, b2, *flags = inputs
    _, _, experts, scores, offs, token_idx, row_of, aux, h, scale, weights, ys = output
    ctx.save_for_backward(x, gate_w, gate_b, experts, scores, offs, token_idx, row_of, aux, h, w1, w2, b1, b2,
                          scale, weights, ys)
    ctx.flags, ctx.keep_h = (*flags[:7],), flags[7]  # top_k .. layout; whether h was kept
    ctx.mark_non_differentiable(*output[1:])


def _step_backward(ctx, grads):
    dout = grads[0]  # (the op's one output, a list: its gradients come as one list)
    if dout is None:
        return (None,) * 16
    x, gate_w, gate_b, experts, scores, offs, token_idx, row_of, aux, h, w1, w2, b1, b2, scale, weights, ys = (
        ctx.saved_tensors)
    weighted = b2 is not None  # (which of the forward's optional outputs are real: never read from their sizes)
    h, scale = (h if ctx.keep_h else None), (None if weighted else scale)
    weights, ys = (weights, ys) if weighted else (None, None)
    needs = [*ctx.needs_input_grad[:8], False]
    got = _step_backward_op(dout.contiguous(), x, gate_w, gate_b, experts, scores, offs, token_idx, row_of, aux, h,
                            w1, w2, b1, b2, scale, weights, ys, *ctx.flags, needs)
    dx, dgw, dgb, dw1, db1, dw2, db2 = (g if need else None for g, need in zip(got, needs[:3] + needs[4:8],
                                                                               strict=True))
    return dx, dgw, dgb, None, dw1, db1, dw2, db2, *(None,) * 8


_step_op.register_autograd(_step_backward, setup_context=_step_setup)


def _hooked(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or _module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)


def step_inputs(moe, x: torch.Tensor) -> tuple | None:
    """The parameters ``moe`` (a :class:`moekit.MoE` whose ``route`` and experts' ``forward`` are its own)
    hands its one-node step for x (T, D), already in its compute dtype: (gate weight, gate bias,
    expert_bias, w_up, b_up, w_down, b_down), each read once (a module attribute costs microseconds of
    host); None where the step may not run as one node (the module docstring's conditions)."""
    experts = moe.experts
    if not (config.get_options().fused_block and experts.nvfp4 is None and experts.fp8 is None
            and not moe.use_aux_loss
            and x.dtype in IN_DTYPES and x.dim() == 2 and x.shape[1] == experts.dim and type(x) in PLAIN_TYPES):
        return None
    if _hooked(experts) or (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack()):
        return None
    router = moe.router
    params = (router.weight, router.bias, moe.expert_bias, experts.mlp1_weight_EGD, experts.mlp1_bias_EG,
              experts.mlp2_weight_EDF, experts.mlp2_bias_ED)
    if params[3].dtype != params[5].dtype or not config.uses_triton(x.device):
        return None
    dev = x.device
    for t in params:
        if t is not None and (type(t) not in PLAIN_TYPES or t.device != dev or not t.is_contiguous()):
            return None
    return params


def moe_step(moe, x: torch.Tensor, params: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe``'s routed experts on x (T, D) as one autograd node -> (out (T, D) in x.dtype, counts (E,)
    int32). ``params``: what :func:`step_inputs` returned for them."""
    experts, sw = moe.experts, moe.experts.swiglu
    sigmoid = moe.score_func == "sigmoid"
    if torch.compiler.is_compiling():  # two custom ops (above), the weights cast in the traced graph
        gate_w, gate_b, expert_bias, w1, b1, w2, b2 = params
        keep_h = config.save_h() and w2.requires_grad
        if w1.dtype != x.dtype:
            w1, w2 = w1.to(x.dtype), w2.to(x.dtype)
        limit = sw["swiglu_limit"]
        got = _step_op(x, gate_w, gate_b, expert_bias, w1, b1, w2, b2, moe.top_k, sigmoid, moe.renormalize,
                       float(sw["swiglu_alpha"]), None if limit is None else float(limit),
                       float(sw["swiglu_linear_offset"]), sw["gate_up_layout"], keep_h)
        return got[0], got[1]
    plan = StepPlan(moe.top_k, sigmoid, moe.renormalize, experts.num_experts,
                    SwiGLU(sw["swiglu_alpha"], sw["swiglu_limit"], sw["swiglu_linear_offset"], sw["gate_up_layout"]))
    return _MoEStepFn.apply(x, *params, plan)


__all__ = ["StepPlan", "moe_step", "step_inputs"]

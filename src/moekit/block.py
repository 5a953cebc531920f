"""The eager :class:`moekit.MoE` step as one autograd node.

Composed of the public ops, a block step makes five autograd nodes (router, sorted weights, the two
expert GEMMs, combine), each with its custom-op call, argument checks and saved-tensor bookkeeping,
and the autograd engine walks them on the way back: host time that, below T ~ 4096, the GPU waits for
(docs/design.md, section 9). :func:`moe_step` runs the same launchers, in the same order and on the
same tensors, inside one ``autograd.Function``: the forward calls the router, routing-metadata,
expert-GEMM and combine launchers directly, and the backward the gradient helpers the ops' own
backwards use (``experts.up_grads``, ``routing.router_grads``). Outputs and gradients are the
composed path's bit for bit (tests/test_block.py).

:func:`step_inputs` says when the block may take it: plain eager tensors (not compiling, no dispatch mode,
no tensor subclass such as FSDP2's DTensor), no hooks on the experts module (FSDP2 gathers
parameters there), no aux loss, no NVFP4 or FP8, contiguous
parameters on x's device, and the ``fused_block`` option on. Anything else composes the ops, whose
checks then raise the usual errors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.modules import module as _module

from . import config
from .dispatch import PLAIN_TYPES
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
    if _hooked(experts) or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
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
    plan = StepPlan(moe.top_k, moe.score_func == "sigmoid", moe.renormalize, experts.num_experts,
                    SwiGLU(sw["swiglu_alpha"], sw["swiglu_limit"], sw["swiglu_linear_offset"], sw["gate_up_layout"]))
    return _MoEStepFn.apply(x, *params, plan)


__all__ = ["StepPlan", "moe_step", "step_inputs"]

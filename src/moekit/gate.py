"""The router's gate GEMM: fp32 logits of bf16 tokens and the fp32 gate weight, and its backward.

Legend: T tokens, E experts, D model dim.

bf16 tokens meet the fp32 gate weight split into two bf16 terms, hi = bf16(w) and lo = bf16(w - hi)
(~16 mantissa bits: routing then agrees with an fp32 GEMM up to near-ties), on the tensor cores with
fp32 accumulation, in one kernel that splits the weight per tile in registers
(``split_router_logits_fwd``; ``split_router_logits_ref`` its twin). The backward is one kernel too
(``router_logits_bwd_fwd``, ``router_logits_bwd_ref``): dx and dW from the logits' gradient rounded to
bf16, with the other gradient of x added where a caller has one. Anything but bf16 tokens and an fp32
gate on a GPU takes an fp32 GEMM on an fp32 copy (``router_logits``).
"""

from __future__ import annotations

import torch

from . import config, launch
from ._kernels.gate import _router_logits_bwd_kernel, _router_logits_kernel
from .dispatch import custom_op
from .plans import planned


def split_logits_ref(both: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits (T, E) from the split GEMM's product both (T, 2E) fp32, [x.hi | x.lo], and the bias
    (E,) or None: hi + lo, except hi where hi is an inf (an inf in x makes x.hi an inf of w's sign, the
    fp32 product's; x.lo may be an inf of the other sign, lo holding hi's rounding error, or NaN, inf
    times a zero lo, which would make the sum NaN), then + bias."""
    e = both.shape[1] // 2
    hi, lo = both[:, :e], both[:, e:]
    logits = torch.where(hi.isinf(), hi, hi + lo)
    return logits if bias is None else logits + bias.float()


def split_router_logits_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits (T, E) of tokens x (T, D) and a gate weight (E, D) split into two bf16 terms, hi =
    bf16(w) and lo = bf16(w - hi) (round to nearest even, as torch's casts), and the bias (E,) or None:
    the fp32 products [x.hi | x.lo] combined by ``split_logits_ref``. ``split_router_logits_fwd``'s
    reference (the same bits up to the order of the fp32 sums)."""
    w = weight.float()
    hi = w.to(torch.bfloat16)
    split = torch.cat([hi, (w - hi.float()).to(torch.bfloat16)])
    return split_logits_ref(x.float() @ split.float().t(), bias)


@planned
def split_router_logits_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``split_router_logits_ref`` in one kernel: x (T, D) bf16, weight (E, D) fp32, bias (E,) fp32
    contiguous or None -> (T, E) fp32. The weight is split per tile in registers; both products
    accumulate in fp32 on the tensor cores."""
    t, d = x.shape
    e = weight.shape[0]
    if x.dtype != torch.bfloat16 or weight.dtype != torch.float32 or weight.shape[1] != d:
        raise ValueError(f"split_router_logits: need x (T, D) bf16 and weight (E, D) fp32, got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    bias = None if bias is None else bias.contiguous()  # (the kernel reads it at unit stride)
    out = config.empty((t, e), dtype=torch.float32, device=x.device)
    if t and e:
        block_e = min(128, max(16, launch.next_power_of_2(e)))
        grid = (launch.cdiv(t, 64), launch.cdiv(e, block_e))
        launch.kernel(_router_logits_kernel)[grid](
            x, weight, bias if bias is not None else out, out, t, e, d, x.stride(0), x.stride(1), weight.stride(0),
            weight.stride(1), HAS_BIAS=bias is not None, BLOCK_T=64, BLOCK_E=block_e, BLOCK_D=64,
            DOT_F32=config.is_interpreting(), num_warps=8 if block_e == 128 else 4,
        )
    return out


@custom_op("moekit::router_logits")
def router_logits_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of bf16 tokens on the tensor cores: x (T, D) bf16 times the fp32 gate weight (E, D)
    split into two bf16 terms (hi + lo, ~16 mantissa bits: routing then agrees with an fp32 GEMM up
    to near-ties), in one kernel with fp32 accumulation and output (``split_router_logits_fwd``), and no
    fp32 copy of x. A custom op, so that torch.compile keeps the fp32 output instead of decomposing it.
    Off Triton (a CPU, for tests of this arithmetic), ``split_router_logits_ref``."""
    if config.uses_triton(x.device):
        return split_router_logits_fwd(x, weight.float(), None if bias is None else bias.float().contiguous())
    return split_router_logits_ref(x, weight, bias)


@router_logits_op.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


# Tokens up to which the backward is one kernel on a GPU. Past them its dW, a reduction over T on
# E/64 x D/64 programs, ran up to 2.3x slower than cuBLAS on the H200 (T = 16384: 262-429 us against
# 113-201), while the step there is bound by the GPU and hides the host's ~30 us more per call.
KERNEL_MAX_TOKENS = 2048


def _check_dx_add(dx_add: torch.Tensor, x: torch.Tensor) -> None:
    if dx_add.shape != x.shape or dx_add.dtype != x.dtype:
        raise ValueError(f"router_logits_bwd: dx_add must be {tuple(x.shape)} {x.dtype}, got {tuple(dx_add.shape)} "
                         f"{dx_add.dtype}")


def router_logits_bwd_ref(grad: torch.Tensor, x: torch.Tensor,
                          weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The split router GEMM's input gradients from the logits' fp32 gradient (T, E): (dx (T, D) in
    x.dtype, dW (E, D) fp32), with the gradient rounded to x.dtype and fp32 products and sums."""
    g = grad.to(x.dtype).float()
    return (g @ weight.to(x.dtype).float()).to(x.dtype), g.t() @ x.float()


@planned
def router_logits_bwd_fwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool,
                          need_w: bool, dx_add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits_bwd_ref`` in one kernel: grad (T, E) fp32, x (T, D) bf16, weight (E, D) fp32 ->
    (dx (T, D) bf16, dW (E, D) fp32), each an empty tensor where not needed. With ``dx_add`` (T, D) bf16
    (and ``need_x``), dx is ``dx_add + dx`` with torch's bf16 rounding, and no (T, D) tensor more."""
    t, d = x.shape
    e = weight.shape[0]
    grad = grad.float().contiguous()
    add = dx_add is not None and need_x
    if add:
        _check_dx_add(dx_add, x)
        dx_add = dx_add.contiguous()
    dx = config.empty((t, d) if need_x else (0,), dtype=x.dtype, device=x.device)
    dw = config.empty((e, d) if need_w else (0,), dtype=torch.float32, device=x.device)
    if need_w and not t:
        dw.zero_()
    block_e = min(64, max(16, launch.next_power_of_2(e)))
    n_d = launch.cdiv(d, 64)
    n_dx = launch.cdiv(t, 64) * n_d if need_x and t and e else 0
    n_dw = launch.cdiv(e, block_e) * n_d if need_w and t else 0
    if n_dx + n_dw:
        launch.kernel(_router_logits_bwd_kernel)[(n_dx + n_dw,)](
            grad, x, weight, dx_add if add else dx, dx, dw, t, e, d, x.stride(0), x.stride(1), weight.stride(0),
            weight.stride(1), n_dx, int(add), BLOCK_T=64, BLOCK_E=block_e, BLOCK_D=64,
            DOT_F32=config.is_interpreting(),
        )
    elif need_x and t and add:  # (E = 0)
        dx.copy_(dx_add)
    elif need_x and t:
        dx.zero_()
    return dx, dw


@custom_op("moekit::router_logits_bwd")
def router_logits_bwd_op(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_x: bool, need_w: bool,
    dx_add: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (T, D) in x.dtype, dW (E, D) in weight.dtype) on the tensor cores, with the logits' gradient
    rounded to x.dtype; empty tensors stand in for gradients not needed; dx plus ``dx_add`` where given.
    One kernel where Triton runs (``router_logits_bwd_fwd``), up to ``KERNEL_MAX_TOKENS`` tokens on a GPU;
    past them two cuBLAS GEMMs."""
    tensor_cores = config.uses_triton(x.device) and x.dtype == torch.bfloat16 and weight.dtype == torch.float32
    if tensor_cores and not (x.is_cuda and x.shape[0] > KERNEL_MAX_TOKENS):
        return router_logits_bwd_fwd(grad, x, weight, need_x, need_w, dx_add)  # (it checks dx_add)
    if dx_add is not None and need_x:
        _check_dx_add(dx_add, x)
    if tensor_cores:
        g = grad.to(x.dtype)
        dx = torch.mm(g, weight.to(x.dtype)) if need_x else x.new_empty(0)
        if need_x and dx_add is not None:
            dx = dx_add + dx
        return dx, torch.mm(g.t(), x, out_dtype=torch.float32) if need_w else weight.new_empty(0)
    dx, dw = router_logits_bwd_ref(grad, x, weight)
    if need_x and dx_add is not None:
        dx = dx_add + dx
    return (dx if need_x else x.new_empty(0)), (dw.to(weight.dtype) if need_w else weight.new_empty(0))


@router_logits_bwd_op.register_fake
def _(grad, x, weight, need_x, need_w, dx_add=None):
    return x.new_empty(x.shape if need_x else (0,)), weight.new_empty(weight.shape if need_w else (0,))


def _router_logits_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _router_logits_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    dx, dw = router_logits_bwd_op(grad, x, weight, need_x, need_w)
    db = grad.sum(0) if ctx.has_bias and need_b else None
    return (dx if need_x else None), (dw if need_w else None), db


router_logits_op.register_autograd(_router_logits_backward, setup_context=_router_logits_setup)


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 gate logits x (T, D) @ weight (E, D)^T + bias (E,) -> (T, E). bf16 tokens on a GPU take
    the tensor cores (``router_logits_op``); anything else an fp32 GEMM on an fp32 copy of x. fp32
    inside an autocast region too, so that the fused router's backward recomputes the forward's
    logits."""
    with torch.autocast(x.device.type, enabled=False):
        if x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.float32:
            return router_logits_op(x, weight, bias)
        return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())

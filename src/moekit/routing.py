"""Router top-k and the device-side routing metadata; the weighted combine and the row gather.

Legend: T tokens, K experts per token, E experts, R = T*K routed rows, D model dim.

``topk_router`` computes fp32 gate logits and their softmax or sigmoid scores, then one Triton kernel
picks each token's K experts and gathers their scores (``router_topk_ref`` is its torch twin;
differentiable, no sync), and
three Triton kernels turn the (T, K) expert ids into the expert-sorted order: per-expert ``counts``
and ``offs``, ``token_idx`` (R,) (the token of each sorted row) and ``row_of`` (T, K) (the sorted row
of each token's k-th choice). The order is exactly that of a stable argsort of the flattened ids.
``combine`` sums each token's K expert rows weighted by its scores, in fp32, as a gather-reduce:
deterministic forward and backward, no atomics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import config, launch
from ._kernels.routing import (
    _combine_bwd_kernel,
    _combine_kernel,
    _gather_rows_ones_kernel,
    _gather_weights_kernel,
    _route_histogram_kernel,
    _route_scan_kernel,
    _route_scatter_kernel,
    _router_topk_kernel,
    _scatter_weights_kernel,
    _topk_weights_grad_kernel,
)
from .dispatch import custom_op
from .gate import router_logits, router_logits_bwd_op
from .plans import planned
from .validation import unit_columns

_BLOCK = 128  # routed entries per program of the metadata kernels


class Dispatch(NamedTuple):
    """Where a routing's rows go: the expert-sorted order that the expert ops and :func:`combine` read.

    ``counts`` / ``offs`` (E,) int32 rows per expert and cumulative row ends; ``token_idx`` (R,) int32
    the token of each sorted row; ``row_of`` (T, K) int32 the sorted row of each choice (negative:
    absent). :func:`routing_metadata` returns one (it unpacks as the 4-tuple it was), and
    :attr:`Routing.dispatch` is a router's."""

    counts: torch.Tensor
    offs: torch.Tensor
    token_idx: torch.Tensor
    row_of: torch.Tensor


@dataclass
class Routing:
    """The result of :func:`topk_router`.

    ``weights`` (T, K) fp32 scores of the chosen experts (renormalized if asked), differentiable;
    ``experts`` (T, K) int32; ``counts`` / ``offs`` (E,) int32 rows per expert and cumulative row
    ends; ``token_idx`` (R,) int32; ``row_of`` (T, K) int32; ``aux_loss``: a scalar or None.
    """

    weights: torch.Tensor
    experts: torch.Tensor
    counts: torch.Tensor
    offs: torch.Tensor
    token_idx: torch.Tensor
    row_of: torch.Tensor
    aux_loss: torch.Tensor | None = None

    @property
    def dispatch(self) -> Dispatch:
        """The routing's rows as one :class:`Dispatch` (what ``GroupedExperts.routed`` takes)."""
        return Dispatch(self.counts, self.offs, self.token_idx, self.row_of)


# --------------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------------


def routing_metadata_ref(experts: torch.Tensor, num_experts: int):
    """(counts, offs, token_idx, row_of) from (T, K) expert ids, by a stable argsort."""
    flat = experts.reshape(-1).long()
    k = experts.shape[1] if experts.dim() == 2 else 1
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).to(torch.int32)
    row_of = torch.empty_like(order)
    row_of[order] = torch.arange(order.numel(), device=order.device)
    offs = counts.cumsum(0).to(torch.int32)
    return counts, offs, (order // k).to(torch.int32), row_of.view_as(experts).to(torch.int32)


def router_topk_ref(logits: torch.Tensor, top_k: int, *, score_func: str = "softmax", renormalize: bool = True,
                    expert_bias: torch.Tensor | None = None):
    """(weights (T, K) fp32, experts (T, K) int64) from fp32 logits (T, E), differentiable in the logits.

    experts: per token, the K largest logits in descending order (softmax and sigmoid are increasing,
    so these are the K largest scores), or with ``expert_bias`` (E,) the K largest scores + bias; ties
    go to the lower index and NaN counts as the largest, as in a stable descending sort. weights: the
    chosen experts' softmax or sigmoid scores, divided by their sum when ``renormalize``."""
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    key = logits if expert_bias is None else scores + expert_bias.float()
    experts = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    return weights, experts


def topk_weights_grad_ref(dw: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                          renormalize: bool, score_func: str | None = None) -> torch.Tensor:
    """The scores' gradient (T, E) of ``router_topk_ref``'s weights (the chosen experts' scores, divided
    by their sum when ``renormalize``), given dw (T, K) and the chosen experts (T, K) int32 or int64. With
    ``score_func`` "softmax" or "sigmoid" (scores = that function of the logits), the logits' gradient
    (T, E) instead: torch's softmax or sigmoid backward of the scores' gradient."""
    _check_score_func(score_func)
    dw = dw.to(scores.dtype)
    experts = experts.long()
    if renormalize:
        picked = scores.gather(1, experts)
        total = picked.sum(-1, keepdim=True)
        kept = total >= 1e-20  # (below, the clamp holds the divisor constant)
        w = picked / total.clamp_min(1e-20)
        dw = (dw - kept * (w * dw).sum(-1, keepdim=True)) / total.clamp_min(1e-20)
    ds = torch.zeros_like(scores).scatter(1, experts, dw)
    return ds if score_func is None else _score_backward(ds, scores, score_func)


def _score_backward(ds: torch.Tensor, scores: torch.Tensor, score_func: str) -> torch.Tensor:
    """The logits' gradient from the scores' ds, torch's backward of ``score_func`` (scores fp32)."""
    if score_func == "sigmoid":
        return torch.ops.aten.sigmoid_backward(ds, scores)
    return torch.ops.aten._softmax_backward_data(ds, scores, -1, scores.dtype)


def _check_score_func(score_func) -> None:
    if score_func not in (None, "softmax", "sigmoid"):
        raise ValueError(f"topk_weights_grad: score_func must be None, 'softmax' or 'sigmoid', got {score_func!r}")


def combine_ref(y: torch.Tensor, weights: torch.Tensor | None, row_of: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y[row_of[t, k]] in fp32 (weights=None: plain sum), in y.dtype; a
    negative row_of entry is an absent choice, which adds nothing."""
    idx = row_of.long()
    y = torch.cat([y, y.new_zeros((1, *y.shape[1:]))])  # absent choices read this zero row
    gathered = y[torch.where(idx >= 0, idx, y.shape[0] - 1)].float()  # (T, K, D)
    if weights is not None:
        gathered = gathered * weights.float()[..., None]
    return gathered.sum(1).to(y.dtype)


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------


@planned
def routing_metadata_fwd(experts: torch.Tensor, num_experts: int):
    """Triton twin of ``routing_metadata_ref``: three kernels (histogram, scan, scatter), no sync."""
    t, k = experts.shape
    r = t * k
    dev = experts.device
    token_idx = config.empty((r,), dtype=torch.int32, device=dev)
    row_of = config.empty((t, k), dtype=torch.int32, device=dev)
    if r == 0:
        zeros = torch.zeros(num_experts, dtype=torch.int32, device=dev)
        return zeros, zeros.clone(), token_idx, row_of
    flat = experts.reshape(-1).to(torch.int32).contiguous()
    blocks = launch.cdiv(r, _BLOCK)
    block_e = launch.next_power_of_2(num_experts)
    block_counts = config.empty((blocks, num_experts), dtype=torch.int32, device=dev)
    launch.kernel(_route_histogram_kernel)[(blocks,)](flat, block_counts, r, num_experts, BLOCK=_BLOCK, BLOCK_E=block_e)
    counts = config.empty((num_experts,), dtype=torch.int32, device=dev)
    offs = config.empty((num_experts,), dtype=torch.int32, device=dev)
    block_base = config.empty((blocks, num_experts), dtype=torch.int32, device=dev)
    block_c = min(8, block_e)  # experts per scan program
    block_b = 16 if config.is_interpreting() else 4096 // block_c  # (the tests' tables loop too)
    launch.kernel(_route_scan_kernel)[(launch.cdiv(num_experts, block_c),)](
        block_counts, counts, block_base, blocks, num_experts, BLOCK_B=block_b, BLOCK_C=block_c
    )
    launch.kernel(_route_scatter_kernel)[(blocks,)](
        flat, counts, offs, block_base, row_of, token_idx, r, num_experts, k, BLOCK=_BLOCK, BLOCK_E=block_e
    )
    return counts, offs, token_idx, row_of


@planned
def router_topk_fwd(key: torch.Tensor, scores: torch.Tensor, top_k: int, renormalize: bool,
                    bias: torch.Tensor | None = None):
    """Triton twin of ``router_topk_ref``'s choice: key, scores (T, E) fp32 -> (weights (T, K) fp32,
    experts (T, K) int32): the K largest keys, or with ``bias`` (E,) fp32 of ``key + bias`` (the fp32 sum
    torch's add rounds to, never stored), ties to the lower index, NaN first, and the scores there,
    divided by their sum when ``renormalize``."""
    t, e = key.shape
    if not 1 <= top_k <= e or scores.shape != key.shape:
        raise ValueError(f"router_topk: need 1 <= top_k <= E and key, scores of one shape (T, E), got top_k={top_k}, "
                         f"{tuple(key.shape)} and {tuple(scores.shape)}")
    if bias is not None and (bias.shape != (e,) or bias.dtype != torch.float32 or bias.device != key.device):
        raise ValueError(f"router_topk: the expert bias must be fp32 (E,) = ({e},) on the key's device, got "
                         f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")
    weights = config.empty((t, top_k), dtype=torch.float32, device=key.device)
    experts = config.empty((t, top_k), dtype=torch.int32, device=key.device)
    if t:
        block_e = launch.next_power_of_2(e)
        block_t = max(1, min(64, 4096 // block_e))
        launch.kernel(_router_topk_kernel)[(launch.cdiv(t, block_t),)](
            key, key if bias is None else bias.contiguous(), scores, weights, experts, t, e, key.stride(0),
            scores.stride(0), K=top_k, RENORM=renormalize, BIAS=bias is not None,
            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=launch.next_power_of_2(top_k),
        )
    return weights, experts


_SCORE_GRAD = {None: 0, "softmax": 1, "sigmoid": 2}  # the kernel's SCORES


@planned
def topk_weights_grad_fwd(dw: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                          renormalize: bool, score_func: str | None = None) -> torch.Tensor:
    """Triton twin of ``topk_weights_grad_ref``: dw (T, K), scores (T, E) fp32, experts (T, K) int32
    -> the scores' gradient (T, E) fp32, or with ``score_func`` the logits', in one kernel (the softmax
    backward's row sum in the kernel's order, not torch's: the last bits may differ; the sigmoid's are
    torch's)."""
    _check_score_func(score_func)
    t, e = scores.shape
    k = experts.shape[1]
    scores = scores.contiguous()  # the kernel reads a row's entries at unit stride
    ds = config.empty((t, e), dtype=torch.float32, device=scores.device)
    if t:
        block_e, block_k = launch.next_power_of_2(e), launch.next_power_of_2(k)
        block_t = max(1, min(32, 8192 // (block_e * block_k)))
        launch.kernel(_topk_weights_grad_kernel)[(launch.cdiv(t, block_t),)](
            dw.float().contiguous(), scores, experts.contiguous(), ds, t, e, scores.stride(0), K=k,
            RENORM=renormalize, SCORES=_SCORE_GRAD[score_func], BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k,
        )
    return ds


@planned
def scatter_weights_fwd(weights: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """out (T*K,) fp32 with out[row_of[t, k]] = weights[t, k], in one kernel. A negative entry is skipped
    (``sorted_weights``' absent choices); rows that no entry names are left unwritten."""
    n = weights.numel()
    out = config.empty((n,), dtype=torch.float32, device=weights.device)
    if n:
        launch.kernel(_scatter_weights_kernel)[(launch.cdiv(n, 1024),)](
            weights.contiguous(), row_of.contiguous(), out, n, BLOCK=1024)
    return out


@planned
def gather_weights_fwd(grad: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """``scatter_weights_fwd``'s backward: grad (R,) fp32, row_of (T, K) int32 -> (T, K) fp32 with
    out[t, k] = grad[row_of[t, k]], and zero where row_of[t, k] < 0, in one kernel."""
    out = config.empty(row_of.shape, dtype=torch.float32, device=grad.device)
    n = row_of.numel()
    if n:
        launch.kernel(_gather_weights_kernel)[(launch.cdiv(n, 1024),)](
            grad.float().contiguous(), row_of.contiguous(), out, n, BLOCK=1024)
    return out


@planned
def gather_rows_with_ones(x: torch.Tensor, token_idx: torch.Tensor) -> torch.Tensor:
    """x (T, D), token_idx (R,) int32 -> [x[token_idx] | 1] as a (R, D + 1) view of a buffer whose rows
    are padded to a multiple of 64 elements (``index_select`` cannot write into such a buffer)."""
    x = unit_columns(x)
    r, d = token_idx.numel(), x.shape[1]
    cols = launch.cdiv(d + 1, 64) * 64
    out = config.empty((r, cols), dtype=x.dtype, device=x.device)
    if r:
        br, bd = (4, 32) if config.is_interpreting() else (8, 256)
        launch.kernel(_gather_rows_ones_kernel)[(launch.cdiv(r, br), launch.cdiv(cols, bd))](
            x, token_idx, out, r, d, cols, x.stride(0), out.stride(0), BLOCK_R=br, BLOCK_D=bd
        )
    return out[:, : d + 1]


def _combine_blocks():
    return (4, 32) if config.is_interpreting() else (8, 256)


@planned
def combine_fwd(y, weights, row_of):
    t, k = row_of.shape
    d = y.shape[1]
    out = config.empty((t, d), dtype=y.dtype, device=y.device)
    if out.numel():
        bt, bd = _combine_blocks()
        launch.kernel(_combine_kernel)[(launch.cdiv(t, bt), launch.cdiv(d, bd))](
            y, weights, row_of, out, t, d, y.stride(0), out.stride(0), K=k, BLOCK_T=bt, BLOCK_D=bd
        )
    return out


@planned
def combine_bwd(dout, y, weights, row_of, need_weights: bool, rows: int | None = None):
    """dy (R, D) = weights[t, k] * dout[t] at row row_of[t, k], and, with ``need_weights``, dw (T, K)
    fp32 = <dout[t], y[row_of[t, k]]>. ``weights=None`` (a plain sum): dy rows are copies of dout
    rows, y is not read and may be None (``rows`` then gives R)."""
    t, k = row_of.shape
    d = dout.shape[1]
    rows = y.shape[0] if rows is None else rows
    dy = config.empty((rows, d), dtype=dout.dtype if y is None else y.dtype, device=dout.device)
    dw = config.empty((t, k), dtype=torch.float32, device=dout.device) if need_weights else None
    if t:
        bt, bd = _combine_blocks()
        launch.kernel(_combine_bwd_kernel)[(launch.cdiv(t, bt),)](
            dout, y, weights, row_of, dy, dw, t, d, dout.stride(0), y.stride(0) if y is not None else 0,
            dy.stride(0), K=k, BLOCK_T=bt, BLOCK_D=bd,
        )
    return dy, dw


# --------------------------------------------------------------------------------------------------
# custom ops
# --------------------------------------------------------------------------------------------------


@custom_op("moekit::routing_metadata")
def _routing_metadata_op(
    experts: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return routing_metadata_fwd(experts, num_experts)


@_routing_metadata_op.register_fake
def _(experts, num_experts):
    i32 = dict(dtype=torch.int32)
    return (experts.new_empty(num_experts, **i32), experts.new_empty(num_experts, **i32),
            experts.new_empty(experts.numel(), **i32), experts.new_empty(experts.shape, **i32))


@custom_op("moekit::router_topk")
def _router_topk_op(key: torch.Tensor, scores: torch.Tensor, top_k: int,
                    renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return router_topk_fwd(key, scores, top_k, renormalize)


@_router_topk_op.register_fake
def _(key, scores, top_k, renormalize):
    t = key.shape[0]
    return key.new_empty((t, top_k), dtype=torch.float32), key.new_empty((t, top_k), dtype=torch.int32)


def _router_topk_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], output[1])
    ctx.renormalize = inputs[3]


def _router_topk_backward(ctx, dw, _):
    scores, experts = ctx.saved_tensors
    return None, topk_weights_grad(dw, scores, experts, ctx.renormalize), None, None


_router_topk_op.register_autograd(_router_topk_backward, setup_context=_router_topk_setup)


@custom_op("moekit::topk_weights_grad")
def _topk_weights_grad_op(dw: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor,
                          renormalize: bool, score_func: str | None) -> torch.Tensor:
    return topk_weights_grad_fwd(dw, scores, experts, renormalize, score_func)


@_topk_weights_grad_op.register_fake
def _(dw, scores, experts, renormalize, score_func):
    return scores.new_empty(scores.shape, dtype=torch.float32)


def topk_weights_grad(dw: torch.Tensor, scores: torch.Tensor, experts: torch.Tensor, renormalize: bool,
                      score_func: str | None = None):
    """The scores' gradient of the top-k weights, or with ``score_func`` the logits'
    (``topk_weights_grad_ref``), one kernel where Triton runs. While autograd records (a double backward,
    ``create_graph=True``) the differentiable reference runs."""
    recording = torch.is_grad_enabled() and (dw.requires_grad or scores.requires_grad)
    if recording or not config.uses_triton(scores.device):
        return topk_weights_grad_ref(dw, scores, experts, renormalize, score_func)
    return _topk_weights_grad_op(dw, scores, experts, renormalize, score_func)


@custom_op("moekit::scatter_weights")
def _scatter_weights_op(weights: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    return scatter_weights_fwd(weights, row_of)


@_scatter_weights_op.register_fake
def _(weights, row_of):
    return weights.new_empty((weights.numel(),), dtype=torch.float32)


@custom_op("moekit::gather_weights")
def _gather_weights_op(grad: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    return gather_weights_fwd(grad, row_of)


@_gather_weights_op.register_fake
def _(grad, row_of):
    return grad.new_empty(row_of.shape, dtype=torch.float32)


def _scores(logits, sigmoid: bool):
    return logits.sigmoid() if sigmoid else logits.softmax(-1)


@custom_op("moekit::router")
def router_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, expert_bias: torch.Tensor | None,
               top_k: int, sigmoid: bool,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights (T, K) fp32, experts (T, K) int32, scores (T, E) fp32) of ``topk_router`` without aux
    loss, in one op. The scores are returned so that its backward reads them instead of recomputing the
    logits (a GEMM and five small ops, ~0.1 ms of an eager step's host time, for T * E * 4 bytes kept);
    the backward takes the gradients the composition of ``router_logits``, the scores and
    ``_router_topk_op`` would (bit for bit where the top-k kernel runs, but for the softmax backward's row
    sum, which the top-k weights' gradient kernel takes in its own order; on the pure-PyTorch path the
    composition differentiates ``router_topk_ref`` by autograd, which rounds differently)."""
    logits = router_logits(x, weight, bias)
    scores = _scores(logits, sigmoid)
    if config.uses_triton(logits.device):  # (the kernel adds the expert bias: no (T, E) key tensor)
        if expert_bias is None:
            return *router_topk_fwd(logits, scores, top_k, renormalize), scores
        return *router_topk_fwd(scores, scores, top_k, renormalize, expert_bias.float()), scores
    weights, experts = router_topk_ref(logits, top_k, score_func="sigmoid" if sigmoid else "softmax",
                                       renormalize=renormalize, expert_bias=expert_bias)
    return weights, experts.to(torch.int32), scores


@router_op.register_fake
def _(x, weight, bias, expert_bias, top_k, sigmoid, renormalize):
    t = x.shape[0]
    return (x.new_empty((t, top_k), dtype=torch.float32), x.new_empty((t, top_k), dtype=torch.int32),
            x.new_empty((t, weight.shape[0]), dtype=torch.float32))


def _router_setup(ctx, inputs, output):
    x, weight, bias, _, _, sigmoid, renormalize = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.sigmoid, ctx.renormalize = sigmoid, renormalize
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the ids and the unused scores


def _router_backward(ctx, dw, _, d_scores):
    x, weight, bias, experts, scores = ctx.saved_tensors
    if dw is None and d_scores is None:
        return None, None, None, None, None, None, None
    dx, dwt, db = router_grads(dw, d_scores, x, weight, bias, experts, scores, ctx.sigmoid, ctx.renormalize,
                               *ctx.needs_input_grad[:3])
    return dx, dwt, db, None, None, None, None


def router_grads(dw, d_scores, x, weight, bias, experts, scores, sigmoid: bool, renormalize: bool,
                 need_x: bool, need_w: bool, need_b: bool, dx_add: torch.Tensor | None = None):
    """The fused router's input gradients (dx, dW, db; None where not needed) from the gradients of its
    top-k weights dw (T, K) and of its scores d_scores (T, E), either one None, given what its forward
    saved: x (T, D), the gate weight (E, D) and bias (E,) or None, experts (T, K) int32, scores (T, E).
    With ``dx_add`` (another gradient of x, x's dtype and shape), dx is ``dx_add + dx`` (where x is bf16
    on a GPU, in the same kernel)."""
    score_func = "sigmoid" if sigmoid else "softmax"
    if d_scores is None:  # the logits' gradient in the top-k weights' kernel (topk_router returns no scores)
        dl = topk_weights_grad(dw, scores, experts, renormalize, score_func)
    else:  # (a direct caller of the op: the scores' gradient from both, then the score function's backward)
        ds = d_scores if dw is None else topk_weights_grad(dw, scores, experts, renormalize) + d_scores
        dl = _score_backward(ds, scores, score_func)
    db = dl.sum(0) if bias is not None and need_b else None
    if x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.float32:
        dx, dwt = router_logits_bwd_op(dl, x, weight, need_x, need_w, dx_add)
    else:  # F.linear on fp32 copies: its backward, then the casts'
        dx = (dl @ weight.float()).to(x.dtype) if need_x else None
        dwt = (dl.t() @ x.float()).to(weight.dtype) if need_w else None
        if need_x and dx_add is not None:
            dx = dx_add + dx
    return (dx if need_x else None), (dwt if need_w else None), db


router_op.register_autograd(_router_backward, setup_context=_router_setup)


@custom_op("moekit::combine")
def _combine_op(y: torch.Tensor, weights: torch.Tensor | None, row_of: torch.Tensor) -> torch.Tensor:
    return combine_fwd(y, weights, row_of)


@_combine_op.register_fake
def _(y, weights, row_of):
    return y.new_empty((row_of.shape[0], y.shape[1]))


@custom_op("moekit::combine_bwd")
def _combine_bwd_op(
    dout: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, row_of: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return combine_bwd(dout, y, weights, row_of, True)


@_combine_bwd_op.register_fake
def _(dout, y, weights, row_of):
    return torch.empty_like(y), weights.new_empty(weights.shape, dtype=torch.float32)


@custom_op("moekit::scatter_rows")
def _scatter_rows_op(dout: torch.Tensor, row_of: torch.Tensor, rows: int) -> torch.Tensor:
    """The plain combine's backward: dy[row_of[t, k]] = dout[t], (R, D); no weights, no y."""
    return combine_bwd(dout, None, None, row_of, False, rows=rows)[0]


@_scatter_rows_op.register_fake
def _(dout, row_of, rows):
    return dout.new_empty((rows, dout.shape[1]))


def _combine_setup(ctx, inputs, output):
    y, weights, row_of = inputs
    ctx.rows = y.shape[0]
    ctx.save_for_backward(y if weights is not None else None, weights, row_of)


def _combine_backward(ctx, dout):
    y, weights, row_of = ctx.saved_tensors
    if weights is None:  # a plain sum: y is not needed
        return _scatter_rows_op(dout.contiguous(), row_of, ctx.rows), None, None
    dy, dw = _combine_bwd_op(dout.contiguous(), y, weights, row_of)
    return dy, dw.to(weights.dtype), None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


@custom_op("moekit::gather_rows")
def gather_op(x: torch.Tensor, token_idx: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    # out[row_of[t, k]] = x[t], which is x[token_idx]: the plain combine's backward kernel, which
    # reads each token row once
    return combine_bwd(x, None, None, row_of, False, rows=token_idx.shape[0])[0]


@gather_op.register_fake
def _(x, token_idx, row_of):
    return x.new_empty((token_idx.shape[0], x.shape[1]))


@custom_op("moekit::gather_rows_bwd")
def gather_bwd_op(dxs: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    return combine_fwd(dxs, None, row_of)  # dx[t] = sum_k dxs[row_of[t, k]]: no atomics


@gather_bwd_op.register_fake
def _(dxs, row_of):
    return dxs.new_empty((row_of.shape[0], dxs.shape[1]))


def _gather_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _gather_backward(ctx, dxs):
    (row_of,) = ctx.saved_tensors
    return gather_bwd_op(dxs.contiguous(), row_of), None, None


gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)

# --------------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------------


def check_router_args(name: str, num_experts: int, top_k, score_func: str) -> None:
    """The router's settings, checked where they are given (a block's constructor, ``topk_router``)."""
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError(f"{name}: top_k must be a Python int, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{name}: top_k must be in [1, {num_experts}], got {top_k}")
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"{name}: score_func must be 'softmax' or 'sigmoid', got {score_func!r}")


def topk_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    top_k: int,
    score_func: str = "softmax",
    renormalize: bool = True,
    expert_bias: torch.Tensor | None = None,
    aux_loss: bool = False,
) -> Routing:
    """Route tokens x (T, D) to ``top_k`` of E experts with gate ``weight`` (E, D) and ``bias`` (E,).

    Logits are computed in fp32; ``score_func`` is "softmax" or "sigmoid". Each token goes to the
    experts of its K largest logits, ties to the lower index (``router_topk_ref``). ``expert_bias``
    (E,) is added to the scores for the choice only (aux-loss-free balancing); the returned weights
    are the unbiased scores, renormalized over the K choices when ``renormalize``. ``aux_loss=True`` also
    returns the switch-style load-balancing loss ``E * sum_e f_e * P_e`` (f_e: fraction of routed
    entries on e, P_e: mean score of e). Nothing here reads the device from the host.
    """
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"topk_router: x (T, D) and weight (E, D), got {tuple(x.shape)} and {tuple(weight.shape)}")
    num_experts = weight.shape[0]
    check_router_args("topk_router", num_experts, top_k, score_func)
    if any(t is not None and t.device != x.device for t in (weight, bias, expert_bias)):
        raise ValueError("topk_router: x, weight, bias and expert_bias must be on one device")
    if not aux_loss:  # one op, whose backward reads the scores it saved
        weights, experts, _ = router_op(x, weight, bias, expert_bias, top_k, score_func == "sigmoid", renormalize)
        counts, offs, token_idx, row_of = _metadata(experts, num_experts)
        return Routing(weights, experts, counts, offs, token_idx, row_of, None)
    logits = router_logits(x, weight, bias)
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    if config.uses_triton(logits.device):  # the choice and the gather in one kernel, no sort
        key = logits if expert_bias is None else scores + expert_bias.float()
        weights, experts = _router_topk_op(key, scores, top_k, renormalize)
    else:
        weights, experts = router_topk_ref(logits, top_k, score_func=score_func, renormalize=renormalize,
                                           expert_bias=expert_bias)
        experts = experts.to(torch.int32)
    counts, offs, token_idx, row_of = _metadata(experts, num_experts)  # the chosen ids are all in range
    frac = counts.float() / max(experts.numel(), 1)
    loss = num_experts * (frac * (scores.sum(0) / max(scores.shape[0], 1))).sum()  # 0, not NaN, for no tokens
    return Routing(weights, experts, counts, offs, token_idx, row_of, loss)


def _metadata(experts: torch.Tensor, num_experts: int):
    meta = _routing_metadata_op if config.uses_triton(experts.device) else routing_metadata_ref
    return meta(experts.to(torch.int32), num_experts)


def routing_metadata(experts: torch.Tensor, num_experts: int) -> Dispatch:
    """:class:`Dispatch` (counts (E,), offs (E,), token_idx (R,), row_of (T, K)), all int32, for (T, K)
    expert ids chosen elsewhere (e.g. by a model's own router; (T,) ids, one choice per token, give a (T,) row_of): the
    expert-sorted order of a stable argsort, from the Triton kernels where they run.

    An id outside [0, E) (a "not on this rank" sentinel of expert parallelism: E in Hugging Face's,
    -1 in :class:`moekit.distributed.ExpertParallelMoE`; or a bad id) is dropped without a sync: it is
    sorted after every expert's rows, past ``offs[-1]``, where the grouped GEMMs compute nothing and
    output zeros (or, with the expert ops' ``tail="unwritten"``, leave their rows unwritten: then mark
    such choices absent, -1, in row_of, as :class:`moekit.distributed.ExpertParallelMoE` does), so it
    contributes nothing to a combine."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 0:
        raise TypeError(f"routing_metadata: num_experts must be a Python int >= 0, got {num_experts!r}")
    if experts.dim() not in (1, 2):
        raise ValueError(f"routing_metadata: expert ids (T, K) or (T,) (one choice each), got {tuple(experts.shape)}")
    ids = experts.to(torch.int32).reshape(experts.shape[0], experts.shape[1] if experts.dim() == 2 else 1)
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    counts, offs, token_idx, row_of = _metadata(ids, num_experts + 1)  # the extra group: dropped ids
    return Dispatch(counts[:num_experts], offs[:num_experts], token_idx, row_of.view(experts.shape))


def combine(y: torch.Tensor, weights: torch.Tensor | None, row_of: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * y[row_of[t, k]], accumulated in fp32, returned in y.dtype.

    y (R, D) expert outputs in expert-sorted order; weights (T, K) float (used in fp32), or None for a
    plain sum (rows already weighted, as :class:`moekit.MoE` does when its experts have no output
    bias); row_of (T, K) int32 rows of y, each in [0, R) or negative for an absent choice, which adds
    nothing and gets a zero weight gradient (not checked on the device: a row at or past R reads out
    of bounds). Deterministic forward and backward (gradients to y and weights; the rows of y that no
    entry names get no gradient written: the caller must not read them)."""
    if y.dim() != 2 or row_of.dim() != 2 or (weights is not None and weights.shape != row_of.shape):
        got = "None" if weights is None else tuple(weights.shape)
        raise ValueError(f"combine: y (R, D), weights (T, K) or None and row_of (T, K), got {tuple(y.shape)}, "
                         f"{got} and {tuple(row_of.shape)}")
    float_weights = weights is None or weights.is_floating_point()
    if row_of.dtype != torch.int32 or not y.is_floating_point() or not float_weights:
        raise TypeError(f"combine: y and weights must be floating point and row_of int32, got {y.dtype}, "
                        f"{None if weights is None else weights.dtype} and {row_of.dtype}")
    if len({y.device, row_of.device} | ({weights.device} if weights is not None else set())) != 1:
        raise ValueError("combine: y, weights and row_of must be on one device")
    if not config.uses_triton(y.device):
        return combine_ref(y, weights, row_of)
    w = None if weights is None else weights.float().contiguous()
    return _combine_op(y.contiguous(), w, row_of.contiguous())


class _SortedWeightsFn(torch.autograd.Function):
    """``sorted_weights``: one scatter kernel where Triton runs, and one gather kernel back; the backward
    gathers through row_of itself (int32, which the block keeps anyway), where ``index_copy``'s would
    save an int64 copy of it."""

    @staticmethod
    def forward(ctx, weights, row_of):
        ctx.save_for_backward(row_of)
        ctx.weights_dtype = weights.dtype
        if config.uses_triton(weights.device):
            return _scatter_weights_op(weights, row_of)
        flat, rows = weights.float().reshape(-1), row_of.reshape(-1).long()
        n = flat.numel()  # absent entries land in an extra row, dropped: static shapes (torch.compile)
        return flat.new_zeros(n + 1).index_copy(0, torch.where(rows >= 0, rows, n), flat)[:n]

    @staticmethod
    def backward(ctx, grad):
        (row_of,) = ctx.saved_tensors
        if config.uses_triton(grad.device):
            return _gather_weights_op(grad, row_of).to(ctx.weights_dtype), None
        g = grad.index_select(0, row_of.reshape(-1).clamp(min=0)).view(row_of.shape)
        return torch.where(row_of >= 0, g, 0.0).to(ctx.weights_dtype), None


def sorted_weights(weights: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """(T, K) routing weights -> (R,) float32 in expert-sorted row order: out[row_of[t, k]] = weights[t, k].
    Differentiable (the backward gathers). row_of names each of [0, R) at most once, as the router's
    does (its values are not checked: that would read the device); a negative entry (an absent
    choice) scatters nothing and gets a zero gradient, and a row that no entry names is left
    unwritten (zero on the reference), for a caller that never reads it."""
    if weights.dim() != 2 or weights.shape != row_of.shape:
        raise ValueError(f"sorted_weights: weights and row_of of one shape (T, K), got {tuple(weights.shape)} "
                         f"and {tuple(row_of.shape)}")
    if not weights.is_floating_point() or row_of.dtype != torch.int32:
        raise TypeError(f"sorted_weights: float weights and int32 row_of, got {weights.dtype} and {row_of.dtype}")
    if weights.device != row_of.device:
        raise ValueError("sorted_weights: weights and row_of must be on one device")
    return _SortedWeightsFn.apply(weights, row_of)


def gather_rows(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """x (T, D) -> (R, D) rows in expert-sorted order; the backward sums each token's K rows (no atomics)."""
    return gather_token_rows(x, routing.token_idx, routing.row_of)


def gather_token_rows(x: torch.Tensor, token_idx: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """x (T, D) -> (R, D) with row r = x[token_idx[r]], given both directions of the map: token_idx (R,)
    and row_of (T, K) int32, where the non-negative row_of[t, k] are the rows of token t
    (token_idx[row_of[t, k]] = t), each named once, and every row is named. The backward sums
    dx[t] = sum_k grad[row_of[t, k]] without atomics. (The maps' values are not checked: that would
    read the device.)"""
    if x.dim() != 2 or token_idx.dim() != 1 or row_of.dim() != 2 or row_of.shape[0] != x.shape[0]:
        raise ValueError(f"gather_token_rows: x (T, D), token_idx (R,) and row_of (T, K), got {tuple(x.shape)}, "
                         f"{tuple(token_idx.shape)} and {tuple(row_of.shape)}")
    if token_idx.dtype != torch.int32 or row_of.dtype != torch.int32:
        raise TypeError(f"gather_token_rows: token_idx and row_of must be int32, got {token_idx.dtype} and "
                        f"{row_of.dtype}")
    if len({x.device, token_idx.device, row_of.device}) != 1:
        raise ValueError("gather_token_rows: x, token_idx and row_of must be on one device")
    if not config.uses_triton(x.device):
        return x[token_idx.long()]
    return gather_op(x.contiguous(), token_idx.contiguous(), row_of.contiguous())

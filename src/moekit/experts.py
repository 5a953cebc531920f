"""Fused expert MLP ops: ``grouped_mm_swiglu`` (up-projection) and ``grouped_mm_downproj``.

Legend: M routed rows (sorted by expert), D model dim, F expert hidden dim, E experts.

Forward: one grouped GEMM computes ``aux = x @ w_up[g] + b_up[g]`` (M, 2F) and ``h = SwiGLU(aux)``
(M, F) in its epilogue; a second computes ``out = h @ w_down[g] + b_down[g]`` (M, D).

Backward (the fused-only contract): the gradient flows through ``aux``, not ``h``. The down-projection
dgrad computes dH = dOut @ w_down^T, and one pass turns (aux, dH) into d_aux = dSwiGLU(aux) * dH; then
dW_down = h^T @ dOut, dX = d_aux @ w_up^T, dW_up = x^T @ d_aux (without biases, as (d_aux^T @ x)^T and
(dOut^T @ h)^T, in the layout of the (E, N, K) parameters behind ``w.mT``: ``grouped_gemm.weight_grad``).
The forward saves only ``aux`` by default, and the pass also recomputes h (on Hopper the dgrad's own
epilogue partition can do the pass's work, opt-in: ``grouped_mm_dswiglu``); with the ``save_h`` option
it saves h too.
With row scales (``row_scale``: h = s * SwiGLU(aux), the MoE block's routing weights) the pass also
applies s to dH and yields the scales' gradient <dH, SwiGLU(aux)> per row.
The bias gradients are per-expert column sums. db_up and, from a saved h, db_down come out of their
weight gradient GEMMs on Hopper when D (resp. F) % 128 == 64: a constant row of ones that the
warp-specialized kernel multiplies in the empty half of its last row tile.
db_down from a recomputed h comes out of the dW_down GEMM through a column of ones appended to h.
Otherwise a pass sums them.

Reads as: references (``reference.py``) -> kernels (``_kernels/experts.py``) -> launchers
(``*_fwd`` / ``grouped_mm_dswiglu`` / ``grouped_colsum``) -> custom ops with fakes and autograd ->
public functions.
"""

from __future__ import annotations

import torch
import triton.language as tl

from . import config, launch
from ._kernels.epilogue import _swiglu_bwd_kernel, _swiglu_kernel
from ._kernels.experts import _grouped_colsum_kernel, _grouped_mm_swiglu_kernel
from ._kernels.hopper_modes import Epilogue
from .descriptors import TensorDescriptor, descriptor, row_bounded, tma_ok, weight_descriptor
from .dispatch import custom_op
from .epilogue import SwiGLU
from .grouped_gemm import grouped_mm_fwd, grouped_mm_op, k_major, op_mm, ragged_k, ragged_m, weight_grad
from .hopper import ws_dswiglu, ws_dswiglu_ok, ws_gemm, ws_ok
from .plans import planned
from .reference import H_GRADIENT_ERROR, ROW_SCALE_ERROR, grouped_mm_downproj_ref, grouped_mm_swiglu_ref, swiglu_ref
from .routing import gather_bwd_op, gather_op, gather_rows_with_ones
from .validation import autocast, check_layout, matrix_ready, unit_columns

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------


def _pair_views(t: torch.Tensor, spec: SwiGLU):
    """The (M, 2F) tensor as the kernels address it: all of it (interleaved) or its two halves."""
    if spec.halves:
        f = t.shape[1] // 2
        return t[:, :f], t[:, f:]
    return t, t


def tma_views_ok(x, w, tensors) -> bool:
    return (
        TensorDescriptor is not None
        and config.use_tma(x.device)
        and x.stride(1) == 1
        and tma_ok(x, 1)
        and tma_ok(w, 2 if w.stride(2) == 1 else 1)
        and all(tma_ok(t, 1) for t in tensors)
    )


@planned
def grouped_mm_swiglu_fwd(x, w, offs, bias, spec: SwiGLU, cfg: config.TileConfig | None = None, token_idx=None,
                          row_scale=None, zero_tail: bool = True):
    """x (M, D), w (E, D, 2F), bias (E, 2F) or None -> (h (M, F), aux (M, 2F)) in x.dtype.

    With ``token_idx`` (R,) int32, x is (T, D) and row r of the GEMM is x[token_idx[r]] (M = R). With
    ``row_scale`` (M,) fp32, h[r] = row_scale[r] * SwiGLU(aux[r]) (on the Triton kernel). Rows past
    offs[-1] are zeros, or left unwritten without ``zero_tail``."""
    d = x.shape[1]
    m = x.shape[0] if token_idx is None else token_idx.numel()
    e, two_f = w.shape[0], w.shape[2]
    f = two_f // 2
    aux = config.empty((m, two_f), dtype=x.dtype, device=x.device)
    h = config.empty((m, f), dtype=x.dtype, device=x.device)
    if m == 0 or f == 0:
        return h, aux
    if cfg is None and token_idx is None and row_scale is None and not spec.halves and ws_ok(x, w, aux, h):
        ws_gemm(x, w, offs, aux, epilogue=Epilogue.SWIGLU, bias=bias, out2=h, spec=spec, zero_tail=zero_tail)
        return h, aux
    sms = config.num_sms(x.device)
    cfg = cfg or config.grouped_mm_config(
        m // e, two_f, d, e, ragged_k=False, tma=config.use_tma(x.device), out_bytes=x.element_size(),
        device=x.device, epilogue="swiglu",
    )
    aux_a, aux_b = _pair_views(aux, spec)
    tma = d > 0 and tma_views_ok(x, w, (aux_a, aux_b, h))
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    bf = bn // 2
    if tma:  # the epilogue stores in two halves: quarter-width h boxes (see the kernel)
        aux_block = [bm, bf // 2] if spec.halves else [bm, bn // 2]
        args = (
            descriptor(x, [m, d], [x.stride(0), 1], [bm, bk]) if token_idx is None else x,
            weight_descriptor(w, bk, bf if spec.halves else bn),
            row_bounded(aux_a, aux_block),
            row_bounded(aux_b, aux_block),
            row_bounded(h, [bm, bf // 2]),
        )
    else:
        args = (x, w, aux_a, aux_b, h)
    tiles = (launch.cdiv(m, bm) + e + 1) * launch.cdiv(f, bf)
    launch.kernel(_grouped_mm_swiglu_kernel)[(min(sms * cfg.programs_per_sm, tiles),)](
        *args, offs, bias, token_idx, row_scale,
        m, f, d, e,
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        aux.stride(0), h.stride(0), bias.stride(0) if bias is not None else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, BLOCK_E=launch.next_power_of_2(e + 1),
        B_TRANS=w.stride(2) != 1, USE_TMA=tma, DOT_F32=config.is_interpreting(), FLATTEN=cfg.flatten,
        OUT_DTYPE=TL_DTYPES[x.dtype], **spec.constexprs(), ZERO_TAIL=zero_tail,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return h, aux


def grouped_mm_dswiglu(grad, w, offs, aux, spec: SwiGLU, *, ones_col: bool = False, scale=None,
                       zero_tail: bool = True):
    """Down-projection dgrad with the SwiGLU backward: grad (M, D) = dOut, w (E, F, D) the down weight,
    aux (M, 2F) -> (d_aux (M, 2F), h, dscale), with dH = grad @ w[g]^T, d_aux = dSwiGLU(aux) * dH and the
    recomputed h = SwiGLU(aux) that dW_down needs. h is (M, F); with ``ones_col`` it is a (M, F + 1)
    view of a row-padded buffer whose last column is ones, so that ``h^T @ dOut`` also yields db_down
    (``ragged_k(..., ones_row=True)``). With ``scale`` (M,) fp32 row scales s (the forward's h was
    s * SwiGLU(aux)): d_aux = dSwiGLU(aux) * (s * dH), h = s * SwiGLU(aux) and dscale (M,) fp32 =
    <dH, SwiGLU(aux)> per row; otherwise dscale is None.

    Rows past offs[-1]: with ``zero_tail``, d_aux and dscale are zero there and h is SwiGLU of aux's
    rows (zero where aux's are, as the zero-tail up-projection leaves them; the fused kernel writes
    zeros); without it, d_aux and h stay unwritten there and dscale is zero.

    By default dH is a grouped GEMM and one bandwidth-bound pass turns (aux, dH) into d_aux and h.
    With ``config.fused_dswiglu()`` on Hopper (interleaved layout, bf16), one warp-specialized GEMM
    does it all (``hopper.ws_dswiglu``): dH never reaches memory, and an epilogue partition computes
    each tile's outputs while the tensor cores run the next tile. Both round dH to bf16 first, so
    d_aux and h agree bit for bit; dscale is summed in another order (fp32 rounding).
    """
    m, two_f = aux.shape
    f = two_f // 2
    w_t = w.mT
    h_cols = launch.cdiv(f + 1, 64) * 64 if ones_col else f  # as swiglu_bwd pads it
    fused = config.fused_dswiglu() and not spec.halves
    if fused and m and f and ws_dswiglu_ok(grad, w_t, aux, h_cols, scale):
        d_aux = config.empty((m, two_f), dtype=aux.dtype, device=aux.device)
        h = config.empty((m, h_cols), dtype=aux.dtype, device=aux.device)
        dscale = ws_dswiglu(grad, w_t, offs, aux, d_aux, h, spec, scale=scale, zero_tail=zero_tail)
        return d_aux, h[:, : f + 1] if ones_col else h, dscale
    dh = ragged_m(grad, w_t, offs, grad.dtype, None, zero_tail=zero_tail)
    return swiglu_bwd(aux, dh, spec, with_h=True, ones_col=ones_col, scale=scale, bound=None if zero_tail else offs)


def downproj_bwd(grad, w, offs, aux, spec: SwiGLU, *, need_w: bool, need_b: bool, h=None, scale=None,
                 zero_tail: bool = True):
    """Backward of the fused down-projection: grad (M, D), w (E, F, D), aux (M, 2F), h (M, F) saved
    from the forward or None, scale (M,) fp32 row scales or None -> (d_aux (M, 2F), dW_down (E, F, D)
    or None, db_down (E, D) fp32 or None, d_scale (M,) fp32 or None).

    Without h, the dSwiGLU pass recomputes it from aux. db_down rides on the dW_down GEMM where F
    leaves that GEMM a partial row tile, where an extra row of ones costs nothing (a ones column
    appended to the recomputed h; with a saved h, F % 128 == 64 and a virtual row of ones); otherwise
    it is a column-sum pass over dOut."""
    f = aux.shape[1] // 2
    if h is not None:
        dh = ragged_m(grad, w.mT, offs, grad.dtype, None, zero_tail=zero_tail)
        d_aux, _, dscale = swiglu_bwd(aux, dh, spec, scale=scale, bound=None if zero_tail else offs)
        dw = db = None
        if need_w and need_b:
            dw, db = ragged_k(h.mT, grad, offs, grad.dtype, None, colsum=True)
        elif need_w:
            dw = weight_grad(h, grad, offs, w, grouped_mm_fwd)
        if need_b and db is None:
            db = grouped_colsum(grad, offs)
        return d_aux, dw, db, dscale
    ones = need_w and need_b and config.ones_row_is_free(f)
    d_aux, h, dscale = grouped_mm_dswiglu(grad, w, offs, aux, spec, ones_col=ones, scale=scale, zero_tail=zero_tail)
    if ones:
        dw, db = ragged_k(h.mT, grad, offs, grad.dtype, None, ones_row=True)
    else:
        if need_w:  # (the layout rule of the fake below: w's layout where no bias gradient rides along)
            dw = grouped_mm_fwd(h.mT, grad, offs) if need_b else weight_grad(h, grad, offs, w, grouped_mm_fwd)
        else:
            dw = None
        db = grouped_colsum(grad, offs) if need_b else None
    return d_aux, dw, db, dscale


@planned
def grouped_colsum(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-group column sums of a row-ragged (M, N) matrix -> (E, N) fp32; empty groups are 0."""
    x = unit_columns(x)
    m, n = x.shape
    e = offs.shape[0]
    out = config.empty((e, n), dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    block_r, block_c = (16, 32) if config.is_interpreting() else (32, 128)
    launch.kernel(_grouped_colsum_kernel)[(launch.cdiv(n, block_c), e)](
        x, offs, out, m, n, e, x.stride(0), out.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4
    )
    return out


def _elementwise_grid(m, f):
    block_r, block_f = (16, 16) if config.is_interpreting() else (16, 128)
    return (launch.cdiv(m, block_r), launch.cdiv(f, block_f)), dict(BLOCK_R=block_r, BLOCK_F=block_f)


def swiglu_fwd(pre: torch.Tensor, spec: SwiGLU) -> torch.Tensor:
    """Standalone SwiGLU: pre (M, 2F) -> h (M, F), the same device function as the fused epilogue."""
    pre = unit_columns(pre)
    m, two_f = pre.shape
    h = config.empty((m, two_f // 2), dtype=pre.dtype, device=pre.device)
    if h.numel():
        grid, blocks = _elementwise_grid(m, two_f // 2)
        launch.kernel(_swiglu_kernel)[grid](pre, h, m, two_f // 2, pre.stride(0), h.stride(0), **spec.constexprs(),
                                            **blocks)
    return h


@planned
def swiglu_bwd(pre: torch.Tensor, dh: torch.Tensor, spec: SwiGLU, *, with_h: bool = False, ones_col: bool = False,
               scale: torch.Tensor | None = None, bound: torch.Tensor | None = None):
    """SwiGLU backward pass: pre (M, 2F), dh (M, F) -> (d_pre (M, 2F), h or None, d_scale or None).

    ``with_h``: also the recomputed h (M, F), and with ``ones_col`` that h as a (M, F + 1) view whose
    last column is ones (``grouped_mm_dswiglu``). ``scale`` (M,) fp32: the forward's h was
    s * SwiGLU(pre), so d_pre = dSwiGLU(pre) * (s * dh), h = s * SwiGLU(pre), and d_scale (M,) fp32 is
    <dh, SwiGLU(pre)> per row. ``bound``: the grouped GEMMs' offs (E,); rows past offs[-1] are then
    neither read nor written (d_pre and h stay unwritten there, d_scale is zero)."""
    pre, dh = unit_columns(pre), unit_columns(dh)
    m, two_f = pre.shape
    f = two_f // 2
    dpre = config.empty((m, two_f), dtype=pre.dtype, device=pre.device)
    h = h_cols = None
    if with_h:  # a padded row of 64-element multiples keeps the ones column's stores vectorized
        h_cols = launch.cdiv(f + 1, 64) * 64 if ones_col else f
        h = config.empty((m, h_cols), dtype=pre.dtype, device=pre.device)
    block_r, block_f, warps, col_programs = config.swiglu_bwd_blocks()
    col_blocks = col_programs or max(launch.cdiv(h_cols if ones_col else f, block_f), 1)
    # d_scale: one partial row sum per column program, added up below (deterministic, no atomics); with a
    # bound, zeros past it, as the fused kernel gives them
    alloc = config.empty if bound is None else torch.zeros
    parts = None if scale is None else alloc((col_blocks, m), dtype=torch.float32, device=pre.device)
    if m:
        launch.kernel(_swiglu_bwd_kernel)[(launch.cdiv(m, block_r), col_blocks)](
            pre, dh, dpre, h, m, f, pre.stride(0), dh.stride(0), dpre.stride(0),
            h.stride(0) if with_h else 0, h_cols or 0, scale, parts, None if bound is None else bound[-1:],
            **spec.constexprs(),
            ONES_COL=ones_col, BLOCK_R=block_r, BLOCK_F=block_f, num_warps=warps,
        )
    if with_h and ones_col:
        h = h[:, : f + 1]
    dscale = None if parts is None else parts[0] if col_blocks == 1 else parts.sum(0)
    return dpre, h, dscale


# --------------------------------------------------------------------------------------------------
# custom ops
# --------------------------------------------------------------------------------------------------


@custom_op("moekit::swiglu")
def _swiglu_op(
    pre: torch.Tensor, alpha: float, limit: float | None, linear_offset: float, layout: str
) -> torch.Tensor:
    return swiglu_fwd(pre, _spec(alpha, limit, linear_offset, layout))


@_swiglu_op.register_fake
def _(pre, alpha, limit, linear_offset, layout):
    return pre.new_empty((pre.shape[0], pre.shape[1] // 2))


@custom_op("moekit::swiglu_bwd")
def _swiglu_bwd_op(
    pre: torch.Tensor, dh: torch.Tensor, alpha: float, limit: float | None, linear_offset: float, layout: str
) -> torch.Tensor:
    return swiglu_bwd(pre, dh, _spec(alpha, limit, linear_offset, layout))[0]


@_swiglu_bwd_op.register_fake
def _(pre, dh, alpha, limit, linear_offset, layout):
    return torch.empty_like(pre)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.spec = inputs[1:]


def _swiglu_backward(ctx, grad):
    (pre,) = ctx.saved_tensors
    return _swiglu_bwd_op(pre, matrix_ready(grad.to(pre.dtype)), *ctx.spec), None, None, None, None


_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)



def _spec(alpha, limit, linear_offset, layout) -> SwiGLU:
    return SwiGLU(alpha=alpha, limit=limit, linear_offset=linear_offset, layout=layout)


@custom_op("moekit::grouped_mm_swiglu")
def _grouped_mm_swiglu_op(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None,
    token_idx: torch.Tensor | None, row_of: torch.Tensor | None, row_scale: torch.Tensor | None,
    alpha: float, limit: float | None, linear_offset: float, layout: str, zero_tail: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    spec = _spec(alpha, limit, linear_offset, layout)
    return grouped_mm_swiglu_fwd(x, w, offs, bias, spec, token_idx=token_idx, row_scale=row_scale, zero_tail=zero_tail)


@_grouped_mm_swiglu_op.register_fake
def _(x, w, offs, bias, token_idx, row_of, row_scale, alpha, limit, linear_offset, layout, zero_tail):
    two_f = w.shape[2]
    rows = x.shape[0] if token_idx is None else token_idx.shape[0]
    return x.new_empty((rows, two_f // 2)), x.new_empty((rows, two_f))


@custom_op("moekit::grouped_mm_downproj_bwd")
def _grouped_mm_downproj_bwd_op(
    grad: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, aux: torch.Tensor, h: torch.Tensor | None,
    row_scale: torch.Tensor | None, need_w: bool, need_b: bool,
    alpha: float, limit: float | None, linear_offset: float, layout: str, zero_tail: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    d_aux, dw, db, ds = downproj_bwd(grad, w, offs, aux, _spec(alpha, limit, linear_offset, layout),
                                     need_w=need_w, need_b=need_b, h=h, scale=row_scale, zero_tail=zero_tail)
    # custom ops return no None: an empty tensor stands in
    dw = grad.new_empty(0) if dw is None else dw
    db = grad.new_empty(0, dtype=torch.float32) if db is None else db
    ds = grad.new_empty(0, dtype=torch.float32) if ds is None else ds
    return d_aux, dw, db, ds


@_grouped_mm_downproj_bwd_op.register_fake
def _(grad, w, offs, aux, h, row_scale, need_w, need_b, alpha, limit, linear_offset, layout, zero_tail):
    e, f, d = w.shape
    if not need_w:
        dw = grad.new_empty(0)
    elif k_major(w) and not need_b:  # weight_grad's layout
        dw = grad.new_empty((e, d, f)).mT
    else:
        dw = grad.new_empty((e, f, d))
    return (
        torch.empty_like(aux),
        dw,
        grad.new_empty((e, d) if need_b else (0,), dtype=torch.float32),
        grad.new_empty((aux.shape[0],) if row_scale is not None else (0,), dtype=torch.float32),
    )


@custom_op("moekit::grouped_colsum")
def _colsum_op(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grouped_colsum(x, offs)


@_colsum_op.register_fake
def _(x, offs):
    return x.new_empty((offs.shape[0], x.shape[1]), dtype=torch.float32)


@custom_op("moekit::gathered_wgrad_bias")
def _gathered_wgrad_op(
    x: torch.Tensor, token_idx: torch.Tensor, d_aux: torch.Tensor, offs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Permute-free up-projection weight and bias gradients: x (T, D), token_idx (R,), d_aux (R, 2F)
    -> (dW_up (E, D, 2F), db_up (E, 2F) fp32), through a gathered copy of x with a ones column."""
    xa = gather_rows_with_ones(x, token_idx)
    return ragged_k(xa.mT, d_aux, offs, d_aux.dtype, None, ones_row=True)


@_gathered_wgrad_op.register_fake
def _(x, token_idx, d_aux, offs):
    e = offs.shape[0]
    return d_aux.new_empty((e, x.shape[1], d_aux.shape[1])), d_aux.new_empty((e, d_aux.shape[1]), dtype=torch.float32)


@custom_op("moekit::wgrad_with_colsum")
def _wgrad_colsum_op(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias gradients of a rows-ragged GEMM with a bias: x (M, K), grad (M, N) ->
    (dW (E, K, N), db (E, N) fp32, the per-group column sums of grad). The sums come out of the wgrad
    GEMM where its kernel yields them for free (``ragged_k(..., colsum=True)``), else from a pass."""
    dw, db = ragged_k(x.mT, grad, offs, grad.dtype, None, colsum=True)
    return dw, db if db is not None else grouped_colsum(grad, offs)


@_wgrad_colsum_op.register_fake
def _(x, grad, offs):
    e = offs.shape[0]
    return grad.new_empty((e, x.shape[1], grad.shape[1])), grad.new_empty((e, grad.shape[1]), dtype=torch.float32)


@custom_op("moekit::grouped_mm_downproj")
def _grouped_mm_downproj_op(
    h: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None, aux: torch.Tensor | None,
    row_scale: torch.Tensor | None, alpha: float, limit: float | None, linear_offset: float, layout: str,
    zero_tail: bool,
) -> torch.Tensor:
    return ragged_m(h, w, offs, h.dtype, None, bias=bias, zero_tail=zero_tail)


@_grouped_mm_downproj_op.register_fake
def _(h, w, offs, bias, aux, row_scale, alpha, limit, linear_offset, layout, zero_tail):
    return h.new_empty((h.shape[0], w.shape[2]))


@custom_op("moekit::grouped_mm_rows")
def _rows_dgrad_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, zero_tail: bool) -> torch.Tensor:
    # a (M, K) @ b (E, K, N) in a's dtype, the rows past offs[-1] zeros or unwritten: the dgrads of the
    # expert ops, which pass their callers' tail contract on
    return ragged_m(a, b, offs, a.dtype, None, zero_tail=zero_tail)


@_rows_dgrad_op.register_fake
def _(a, b, offs, zero_tail):
    return a.new_empty((a.shape[0], b.shape[2]))


def _rows_dgrad(a, b, offs, zero_tail: bool):
    return grouped_mm_op(a, b, offs, None) if zero_tail else _rows_dgrad_op(a, b, offs, False)


def _bias_grad(grad, offs, bias):
    return None if bias is None else _colsum_op(grad, offs).to(bias.dtype)


def _grouped_mm_swiglu_setup(ctx, inputs, output):
    x, w, offs, bias, token_idx, row_of, *_ = inputs  # (row_scale gets its gradient from the down-projection)
    ctx.zero_tail = inputs[-1]
    ctx.save_for_backward(x, w, offs, bias, token_idx, row_of)
    ctx.set_materialize_grads(False)  # an unused h must arrive as None, not as zeros


def _grouped_mm_swiglu_backward(ctx, grad_h, grad_aux):
    if grad_h is not None:
        raise RuntimeError(H_GRADIENT_ERROR)
    x, w, offs, bias, token_idx, row_of = ctx.saved_tensors
    if grad_aux is None:
        return (None,) * 12
    need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
    grad_x, grad_w, grad_b = up_grads(matrix_ready(grad_aux), x, w, offs, bias, token_idx, row_of,
                                      need_x, need_w, need_b, ctx.zero_tail)
    return grad_x, grad_w, None, grad_b, None, None, None, None, None, None, None, None


def up_grads(d_aux, x, w, offs, bias, token_idx, row_of, need_x: bool, need_w: bool, need_b: bool,
             zero_tail: bool):
    """The fused up-projection's input gradients from d_aux (M, 2F), its forward's x (M, D) or (T, D)
    with ``token_idx`` (R,) / ``row_of`` (T, K), w (E, D, 2F) and bias (E, 2F) or None -> (dx, dw in w's
    layout, db in bias's dtype), each None where not needed."""
    grad_x = _rows_dgrad(d_aux, w.mT, offs, zero_tail) if need_x else None
    grad_b = None
    if token_idx is None:
        if need_w and need_b:
            grad_w, grad_b = _wgrad_colsum_op(x, d_aux, offs)
            grad_b = grad_b.to(bias.dtype)
        else:
            grad_w = weight_grad(x, d_aux, offs, w, op_mm) if need_w else None
    else:  # permute-free: sum each token's K rows (no atomics)
        grad_x = gather_bwd_op(grad_x, row_of) if need_x else None
        # dW_up re-gathers x's token rows into a transient copy: a gathered (pointer-loaded) A^T in the
        # wgrad GEMM measured 2.7 ms slower per gpt-oss-20b step than this ~0.4 ms copy plus TMA loads.
        # The copy is written by the row scatter (each token row read once, written to its K rows), or
        # carries a column of ones where that is free, which hands db_up to the same GEMM.
        if need_w and need_b and config.ones_row_is_free(x.shape[1]):
            grad_w, grad_b = _gathered_wgrad_op(x, token_idx, d_aux, offs)
            grad_b = grad_b.to(bias.dtype)
        elif need_w:
            grad_w = weight_grad(gather_op(x.contiguous(), token_idx, row_of), d_aux, offs, w, op_mm)
        else:
            grad_w = None
    if need_b and grad_b is None:
        grad_b = _bias_grad(d_aux, offs, bias)
    return grad_x, grad_w, grad_b


_grouped_mm_swiglu_op.register_autograd(_grouped_mm_swiglu_backward, setup_context=_grouped_mm_swiglu_setup)


def _grouped_mm_downproj_setup(ctx, inputs, output):
    h, w, offs, bias, aux, row_scale, alpha, limit, linear_offset, layout, zero_tail = inputs
    ctx.spec = (alpha, limit, linear_offset, layout)
    ctx.zero_tail = zero_tail
    ctx.fused = aux is not None
    # With aux, the weight gradient takes h saved (the save_h option) or recomputed from aux; h is kept
    # only for a weight that needs a gradient.
    keep_h = ctx.fused and config.save_h() and ctx.needs_input_grad[1]
    ctx.save_for_backward(aux if ctx.fused else h, h if keep_h else None, w, offs, bias, row_scale)


def _grouped_mm_downproj_backward(ctx, grad):
    saved, h, w, offs, bias, row_scale = ctx.saved_tensors
    grad = matrix_ready(grad.to(w.dtype))
    need_h, need_w, _, need_b, need_aux, need_s = ctx.needs_input_grad[:6]
    grad_h = grad_aux = grad_s = None
    if ctx.fused:
        grad_aux, grad_w, grad_b, grad_s = _grouped_mm_downproj_bwd_op(
            grad, w, offs, saved, h, row_scale, need_w, need_b, *ctx.spec, ctx.zero_tail
        )
        grad_aux = grad_aux if need_aux else None
        grad_w = grad_w if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        grad_s = grad_s.to(row_scale.dtype) if need_s else None
    else:
        grad_h = _rows_dgrad(grad, w.mT, offs, ctx.zero_tail) if need_h else None
        grad_w = weight_grad(saved, grad, offs, w, op_mm) if need_w else None
        grad_b = _bias_grad(grad, offs, bias) if need_b else None
    return grad_h, grad_w, None, grad_b, grad_aux, grad_s, None, None, None, None, None


_grouped_mm_downproj_op.register_autograd(_grouped_mm_downproj_backward, setup_context=_grouped_mm_downproj_setup)

# --------------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------------


def check_expert_inputs(name, x, w, offs, bias, n_bias):
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{name}: expects x (M, K) and w (E, K, N), got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in TL_DTYPES or w.dtype != x.dtype:
        raise TypeError(f"{name}: x and w must both be bfloat16 or float16, got {x.dtype} and {w.dtype}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: K mismatch, x {tuple(x.shape)} vs w {tuple(w.shape)}")
    if w.shape[0] == 0:
        raise ValueError(f"{name}: w must hold at least one expert (E >= 1), got {tuple(w.shape)}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32:
        got = offs.dtype if isinstance(offs, torch.Tensor) else type(offs).__name__
        raise TypeError(f"{name}: offs must be an int32 tensor, got {got}")
    if offs.shape != (w.shape[0],):
        raise ValueError(f"{name}: offs must have shape (E,) = ({w.shape[0]},), got {tuple(offs.shape)}")
    if len({x.device, w.device, offs.device} | ({bias.device} if bias is not None else set())) != 1:
        raise ValueError(f"{name}: all tensors must be on one device")
    if bias is not None and not bias.is_floating_point():
        raise TypeError(f"{name}: bias must be a floating-point tensor, got {bias.dtype}")
    if bias is not None and (bias.shape != (w.shape[0], n_bias) or bias.stride(-1) != 1):
        raise ValueError(f"{name}: bias must be (E, N) = ({w.shape[0]}, {n_bias}) with unit column stride")
    check_layout("x", x)
    check_layout("w", w)


def _check_row_scale(name, row_scale, rows, device):
    if row_scale is None:
        return
    if not isinstance(row_scale, torch.Tensor) or row_scale.dtype != torch.float32 or row_scale.shape != (rows,):
        got = tuple(row_scale.shape) if isinstance(row_scale, torch.Tensor) else type(row_scale).__name__
        raise ValueError(f"{name}: row_scale must be a float32 tensor of shape (M,) = ({rows},), got {got}")
    if row_scale.device != device or row_scale.stride(0) != 1:
        raise ValueError(f"{name}: row_scale must be contiguous and on the inputs' device")


def grouped_mm_swiglu(
    x: torch.Tensor,
    w_up: torch.Tensor,
    offs: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float | None = 7.0,
    swiglu_linear_offset: float = 1.0,
    gate_up_layout: str = "interleaved",
    token_idx: torch.Tensor | None = None,
    row_of: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    tail: str = "zeros",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up-projection with bias and SwiGLU fused: returns ``(h, aux)``.

    x (M, D) bf16/fp16 rows sorted by expert (under ``torch.autocast``, fp32 x and w_up run in the
    autocast dtype); w_up (E, D, 2F), e.g. a ``(E, 2F, D)`` torchtitan weight passed as ``w.mT`` (no
    copy); bias (E, 2F) or None; offs (E,) int32 cumulative row ends.
    ``aux`` = x @ w_up[g] + bias[g] (M, 2F) in x.dtype, ``h`` = SwiGLU(aux) (M, F); rows past
    offs[-1] are zero in both (``tail="unwritten"``: left unwritten there, and in the gradients the
    backward computes, for a caller that reads none of those rows, such as expert parallelism's fixed
    slots; the row_of entries of the choices past offs[-1] are then taken as absent, so that the
    gradient to x skips them). See :class:`moekit.epilogue.SwiGLU` for the activation and layouts.

    Permute-free dispatch: with ``token_idx`` (R,) and ``row_of`` (T, K) int32 from
    :func:`moekit.topk_router`, x is the (T, D) token matrix and the GEMM reads row r as
    x[token_idx[r]] itself; no permuted copy of x is made or saved, and the gradient to x sums each
    token's K rows without atomics. h and aux then have R rows. R may be less than T*K (expert
    parallelism keeps only the choices on its rank): a negative row_of entry is a choice with no row,
    and the non-negative entries name every row once.

    Row scales: with ``row_scale`` (M,) float32 (in the MoE block, each routed row's routing weight),
    ``h`` = row_scale[:, None] * SwiGLU(aux), multiplied in fp32 before rounding. Since the
    down-projection is linear, its output then arrives weighted, and the block's combine is a plain
    sum. Pass the same ``row_scale`` to :func:`grouped_mm_downproj`, which returns its gradient.

    Backward contract: ``h`` carries no gradient. Feed it to :func:`grouped_mm_downproj` together
    with ``aux_biased_acc=aux``; the gradient then reaches x, w_up and bias through ``aux``. A
    gradient that reaches ``h`` raises an error explaining this.
    """
    spec = SwiGLU(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout)
    x, w_up = autocast(x), autocast(w_up)
    check_expert_inputs("grouped_mm_swiglu", x, w_up, offs, bias, w_up.shape[2])
    offs = offs.contiguous()  # the kernels read offs by position: a strided view becomes a copy
    if w_up.shape[2] % 2:
        raise ValueError(f"grouped_mm_swiglu: w_up's last dim must be 2F (even), got {w_up.shape[2]}")
    if (token_idx is None) != (row_of is None):
        raise ValueError("grouped_mm_swiglu: token_idx and row_of go together (both from topk_router)")
    if token_idx is not None:
        ok = token_idx.dtype == row_of.dtype == torch.int32 and token_idx.dim() == 1 and row_of.dim() == 2
        if not ok or row_of.shape[0] != x.shape[0] or token_idx.numel() > row_of.numel():
            raise ValueError("grouped_mm_swiglu: token_idx (R,) and row_of (T, K) must be int32 with R <= T*K")
        token_idx, row_of = token_idx.contiguous(), row_of.contiguous()  # (read by position, as offs)
    _check_row_scale("grouped_mm_swiglu", row_scale, x.shape[0] if token_idx is None else token_idx.numel(), x.device)
    zero_tail = _zero_tail("grouped_mm_swiglu", tail)
    if token_idx is not None and not zero_tail:  # the choices past offs[-1] have unwritten rows: absent
        row_of = torch.where(row_of < offs[-1:], row_of, -1)
    if not config.uses_triton(x.device):
        rows = x if token_idx is None else x[token_idx.long()]
        return grouped_mm_swiglu_ref(rows, w_up, offs, bias=bias, row_scale=row_scale, **_spec_kwargs(spec))
    return _grouped_mm_swiglu_op(x, w_up, offs, bias, token_idx, row_of, row_scale, *_spec_args(spec), zero_tail)


def grouped_mm_downproj(
    h: torch.Tensor,
    w_down: torch.Tensor,
    offs: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    aux_biased_acc: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float | None = 7.0,
    swiglu_linear_offset: float = 1.0,
    gate_up_layout: str = "interleaved",
    tail: str = "zeros",
) -> torch.Tensor:
    """Down-projection with bias fused: ``out = h @ w_down[g] + bias[g]`` (M, D).

    h (M, F); w_down (E, F, D), e.g. a ``(E, D, F)`` torchtitan weight as ``w.mT``; bias (E, D) or
    None. With ``aux_biased_acc=aux`` from :func:`grouped_mm_swiglu` (with the same SwiGLU settings and
    row scales: nothing checks that they match), the forward uses h as given and the backward runs
    fused: the gradient goes to aux (dSwiGLU(aux) applied to dH), not to h, and the weight gradient
    takes h recomputed from aux, so that only aux stays alive (with the option ``save_h=True``, h as
    saved). Without it, this is a plain grouped GEMM + bias whose gradient flows
    to ``h``.

    ``row_scale`` (M,) float32, with ``aux_biased_acc``: the row scales that :func:`grouped_mm_swiglu`
    applied to h (h = row_scale * SwiGLU(aux)); the backward then also returns their gradient,
    <dOut @ w_down[g]^T, SwiGLU(aux)> per row, computed in the SwiGLU backward pass from values it
    reads anyway. The bias is not scaled: ``out = h @ w_down[g] + bias[g]``.

    Rows past offs[-1] of ``out`` (and of the gradients the backward computes) are zeros, or left
    unwritten with ``tail="unwritten"`` (see :func:`grouped_mm_swiglu`).
    """
    spec = SwiGLU(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout)
    h, w_down = autocast(h), autocast(w_down)
    check_expert_inputs("grouped_mm_downproj", h, w_down, offs, bias, w_down.shape[2])
    offs = offs.contiguous()  # the kernels read offs by position: a strided view becomes a copy
    aux = aux_biased_acc
    if aux is not None and aux.shape != (h.shape[0], 2 * h.shape[1]):
        raise ValueError(f"grouped_mm_downproj: aux must be (M, 2F) = ({h.shape[0]}, {2 * h.shape[1]})")
    if aux is not None and (aux.dtype != h.dtype or aux.device != h.device or aux.stride(1) != 1):
        raise ValueError(f"grouped_mm_downproj: aux must be h's dtype and device with unit column stride, as "
                         f"grouped_mm_swiglu returns it; got {aux.dtype} on {aux.device}, strides {aux.stride()}")
    if row_scale is not None and aux_biased_acc is None:
        raise ValueError(ROW_SCALE_ERROR)
    _check_row_scale("grouped_mm_downproj", row_scale, h.shape[0], h.device)
    zero_tail = _zero_tail("grouped_mm_downproj", tail)
    if not config.uses_triton(h.device):
        return grouped_mm_downproj_ref(
            h, w_down, offs, bias=bias, aux_biased_acc=aux_biased_acc, row_scale=row_scale, **_spec_kwargs(spec)
        )
    return _grouped_mm_downproj_op(h, w_down, offs, bias, aux_biased_acc, row_scale, *_spec_args(spec), zero_tail)


def swiglu(
    pre: torch.Tensor,
    *,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float | None = 7.0,
    swiglu_linear_offset: float = 1.0,
    gate_up_layout: str = "interleaved",
) -> torch.Tensor:
    """SwiGLU of a (M, 2F) pre-activation -> (M, F), differentiable; the fused epilogues' math standalone.

    bf16/fp16/fp32 in, same dtype out, computed in fp32. See :class:`moekit.epilogue.SwiGLU`.
    """
    spec = SwiGLU(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout)
    if pre.dim() != 2 or pre.shape[1] % 2 or pre.stride(1) != 1:
        raise ValueError(f"swiglu: pre must be (M, 2F) with unit column stride, got {tuple(pre.shape)}")
    if not config.uses_triton(pre.device):
        return swiglu_ref(pre, **_spec_kwargs(spec))
    return _swiglu_op(pre, *_spec_args(spec))


TAILS = ("zeros", "unwritten")


def _zero_tail(name: str, tail: str) -> bool:
    """The ``tail`` argument of the expert ops: rows past offs[-1] of the outputs and of the gradients
    their backward computes are zeros ("zeros"), or may be left unwritten ("unwritten", for callers
    that never read them: it saves writing them; the reference writes zeros either way)."""
    if tail not in TAILS:
        raise ValueError(f"{name}: tail must be one of {TAILS}, got {tail!r}")
    return tail == "zeros"


def _spec_args(spec: SwiGLU):
    return spec.alpha, spec.limit, spec.linear_offset, spec.layout


def _spec_kwargs(spec: SwiGLU) -> dict:
    return dict(swiglu_alpha=spec.alpha, swiglu_limit=spec.limit, swiglu_linear_offset=spec.linear_offset,
                gate_up_layout=spec.layout)

"""``grouped_mm``: GEMM over ragged expert groups, a drop-in for ``torch._grouped_mm`` with autograd.

Reads as: reference (``reference.grouped_mm_ref``) -> kernels (``_kernels/grouped_gemm.py``, and
the warp-specialized ``_kernels/hopper_gemm.py`` through ``hopper.py``) -> launchers (``ragged_m``,
``ragged_k``, ``grouped_mm_fwd``) -> custom op ``moekit::grouped_mm`` with a fake and an autograd formula
(``grouped_mm_bwd``; eager calls skip the dispatcher, ``dispatch.py``) -> public ``grouped_mm``.

Legend: E groups (experts), M rows, N output columns, K reduction length, Kt the ragged reduction
length of the 2D x 2D form.
"""

from __future__ import annotations

import torch

from . import config, launch
from ._kernels.grouped_gemm import _grouped_mm_ragged_k_kernel, _grouped_mm_ragged_m_kernel
from ._kernels.hopper_modes import ColSum
from .descriptors import TensorDescriptor, descriptor, row_bounded, tma_ok, weight_descriptor
from .dispatch import custom_op
from .hopper import WS_TILE, ws_gemm, ws_ragged_k, ws_rows_ragged
from .plans import planned
from .reference import grouped_mm_ref
from .validation import autocast, check_inputs, check_offs, matrix_ready

# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------


@planned
def ragged_m(a, b, offs, out_dtype, cfg: config.TileConfig | None, bias=None, group_scale=None,
              zero_tail: bool = True):
    """2D x 3D: a (M, K), b (E, K, N), optional bias (E, N) -> (M, N); rows past offs[-1] are zero
    (left unwritten without ``zero_tail``). ``group_scale`` (E,) fp32, contiguous: group g's product
    times group_scale[g] in fp32, before the bias (the Triton kernel; the warp-specialized one has no
    such epilogue)."""
    (m, k), (e, _, n) = a.shape, b.shape
    out = config.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0 and bias is None:
        return out.zero_()
    a_trans, b_trans = a.stride(1) != 1, b.stride(2) != 1
    if cfg is None and group_scale is None and ws_rows_ragged(a, b, out, b_trans):
        return ws_gemm(a, b, offs, out, bias=bias, zero_tail=zero_tail)
    # A TMA box must start 16-byte aligned along the unit-stride axis; groups start at any row, so an
    # `a` with unit stride along M (a.mT views) takes the pointer path.
    tma = (
        TensorDescriptor is not None
        and config.use_tma(a.device)
        and not a_trans
        and k > 0
        and tma_ok(a, 1)
        and tma_ok(b, 1 if b_trans else 2)
        and tma_ok(out, 1)
    )
    cfg = cfg or config.grouped_mm_config(
        m // e, n, k, e, ragged_k=False, tma=tma, out_bytes=out.element_size(), device=a.device
    )
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if tma:
        a_arg = descriptor(a, [m, k], [a.stride(0), 1], [bm, bk])
        b_arg = weight_descriptor(b, bk, bn)
        c_arg = row_bounded(out, [bm, bn // 2 if cfg.split_store else bn])
    else:
        a_arg, b_arg, c_arg = a, b, out
    max_tiles = (launch.cdiv(m, bm) + e + 1) * launch.cdiv(n, bn)  # each group adds <= 1 partial row tile
    programs = min(config.num_sms(a.device) * cfg.programs_per_sm, max_tiles)
    launch.kernel(_grouped_mm_ragged_m_kernel)[(programs,)](
        a_arg, b_arg, c_arg, offs, bias, group_scale,
        m, n, k, e,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), bias.stride(0) if bias is not None else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=cfg.group_m, BLOCK_E=launch.next_power_of_2(e + 1),
        B_TRANS=b_trans,
        USE_TMA=tma, DOT_F32=config.is_interpreting(), FLATTEN=cfg.flatten, SPLIT_STORE=cfg.split_store,
        ZERO_TAIL=zero_tail, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out



@planned
def ragged_k(a, b, offs, out_dtype, cfg: config.TileConfig | None, *, ones_row: bool = False,
              colsum: bool = False):
    """2D x 2D: a (M, Kt), b (Kt, N), offs over Kt -> (E, M, N); empty groups are zero.

    ``ones_row``: a's last row holds ones; returns ``(out (E, M - 1, N), colsum (E, N) fp32)``, the
    product without that row and the per-group column sums of b that it yields.
    ``colsum``: returns ``(out (E, M, N), colsum (E, N) fp32 or None)``: b's per-group column sums
    where the warp-specialized kernel yields them for free (M % 128 == 64, so that a row of ones fits
    in the empty half of the last row tile), else None, for the caller to sum another way."""
    (m, kt), n, e = a.shape, b.shape[1], offs.numel()
    out = config.empty((e, m - ones_row, n), dtype=out_dtype, device=a.device)
    sums = config.empty((e, n), dtype=torch.float32, device=a.device) if ones_row else None

    def result():
        return (out, sums) if ones_row or colsum else out

    if m == 0 or n == 0 or kt == 0:
        for t in (out, sums) if ones_row else (out,):
            t.zero_()
        return result()
    # TMA bounds the ragged reduction dim only on a memory-row axis: a's unit stride must run along
    # M and b's along N (the layout autograd hands over: x.mT and dy). Otherwise the pointer path.
    tma = (
        TensorDescriptor is not None
        and config.use_tma(a.device)
        and tma_ok(a, 0)
        and tma_ok(b, 1)
        and tma_ok(out, 2)
    )
    if (cfg is None and tma and config.use_warp_specialized(a.device) and a.dtype == torch.bfloat16
            and out.dtype == torch.bfloat16):
        mode = ColSum.ROW if ones_row else ColSum.NONE
        if colsum and m % WS_TILE[0] == WS_TILE[0] // 2:
            mode = ColSum.VIRTUAL
            sums = config.empty((e, n), dtype=torch.float32, device=a.device)
        ws_ragged_k(a, b, offs, out, sums, mode)
        return result()
    cfg = cfg or config.grouped_mm_config(
        m, n, kt // e, e, ragged_k=True, tma=tma, out_bytes=out.element_size(), device=a.device
    )
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if tma:
        a_arg = row_bounded(a.mT, [bk, bm])
        b_arg = row_bounded(b, [bk, bn])
        c_arg = descriptor(out, list(out.shape), [out.stride(0), out.stride(1), 1],
                                 [1, bm, bn // 2 if cfg.split_store else bn])
    else:
        a_arg, b_arg, c_arg = a, b, out
    programs = min(config.num_sms(a.device) * cfg.programs_per_sm, e * launch.cdiv(m, bm) * launch.cdiv(n, bn))
    launch.kernel(_grouped_mm_ragged_k_kernel)[(programs,)](
        a_arg, b_arg, c_arg, offs, sums,
        m, n, kt, e,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2), sums.stride(0) if sums is not None else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
        USE_TMA=tma, DOT_F32=config.is_interpreting(), FLATTEN=cfg.flatten, SPLIT_STORE=cfg.split_store,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return result()


def grouped_mm_fwd(a, b, offs, out_dtype=None, cfg: config.TileConfig | None = None):
    """Launch the grouped GEMM for a validated 2D x 3D or 2D x 2D problem (see ``grouped_mm``)."""
    out_dtype = out_dtype or a.dtype
    if b.dim() == 3:
        return ragged_m(a, b, offs, out_dtype, cfg)
    return ragged_k(a, b, offs, out_dtype, cfg)



# --------------------------------------------------------------------------------------------------


@custom_op("moekit::grouped_mm")
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    return grouped_mm_fwd(a, b, offs, out_dtype)


@grouped_mm_op.register_fake
def _(a, b, offs, out_dtype):
    dtype = out_dtype or a.dtype
    if b.dim() == 3:
        return a.new_empty((a.shape[0], b.shape[2]), dtype=dtype)
    return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]), dtype=dtype)


def grouped_mm_bwd(grad, a, b, offs, needs_a: bool, needs_b: bool, mm):
    """Gradients of ``grouped_mm`` through the same two kernels; ``mm(a, b, offs)`` runs one GEMM.

    2D x 3D: dgrad is ragged-M (``grad @ b[g]^T``), wgrad ragged-K (``a^T @ grad`` per group).
    2D x 2D: the mirror images. An empty group's gradient is exactly zero.
    """
    grad = matrix_ready(grad.to(a.dtype))
    if b.dim() == 3:
        grad_a = mm(grad, b.mT, offs) if needs_a else None
        grad_b = weight_grad(a, grad, offs, b, mm) if needs_b else None
    else:
        grad_a = mm(b, grad.mT, offs).mT if needs_a else None
        grad_b = mm(a.mT, grad, offs) if needs_b else None
    return grad_a, grad_b


def k_major(b: torch.Tensor) -> bool:
    """Whether an (E, K, N) weight is a transposed view with its unit stride along K: the ``w.mT`` of an
    (E, N, K) parameter stored the torchtitan way."""
    return b.stride(1) == 1 and b.stride(2) != 1


def weight_grad(a, grad, offs, b, mm):
    """dB (E, K, N) of ``a (M, K) @ b[g]`` from grad (M, N), in b's layout: for a K-major b it is
    computed as ``(grad^T @ a)^T``, so that the gradient of the (E, N, K) parameter behind ``b`` comes
    out contiguous and autograd's gradient accumulation need not copy it into the parameter's strides."""
    return mm(grad.mT, a, offs).mT if k_major(b) else mm(a.mT, grad, offs)


def op_mm(a, b, offs):
    return grouped_mm_op(a, b, offs, None)


def _setup_context(ctx, inputs, output):
    a, b, offs, _ = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    # Under torch.compile the backward is traced too, so it runs through the op itself.
    a, b, offs = ctx.saved_tensors
    grad_a, grad_b = grouped_mm_bwd(grad, a, b, offs, *ctx.needs_input_grad[:2], mm=op_mm)
    return grad_a, grad_b, None, None


grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# public op
# --------------------------------------------------------------------------------------------------


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """Grouped GEMM over ragged groups with ``torch._grouped_mm`` semantics, differentiable.

    Forms (bf16 or fp16 inputs of one dtype, fp32 accumulation, output ``out_dtype`` = input dtype
    by default, or ``torch.float32``):

    - 2D x 3D: ``a`` (M, K), ``b`` (E, K, N), ``offs`` (E,) int32 cumulative row ends with
      ``offs[-1] <= M``. Returns (M, N) with ``out[offs[g-1]:offs[g]] = a[...] @ b[g]``; rows at or
      past ``offs[-1]`` are **zero** (torch leaves them undefined).
    - 2D x 2D (ragged K, the weight-gradient form): ``a`` (M, Kt), ``b`` (Kt, N), ``offs`` (E,) over
      Kt. Returns (E, M, N) with ``out[g] = a[:, ks:ke] @ b[ks:ke]``; an empty group is exactly zero.
    - 3D x 3D: ``a`` (E, M, K), ``b`` (E, K, N), no ``offs``: a batched product.

    Layout: each operand needs a unit stride along one of its last two dims (so ``w.mT`` views work
    without a copy) and 16-byte aligned other strides and base. ``offs`` stays on the device and is
    never read by the host; ``validate=True`` (or the ``debug`` option) checks that it is
    non-decreasing and in bounds, at the cost of a device sync.

    Under ``torch.autocast``, float inputs run in the autocast dtype, as ``torch.matmul``'s do.

    Runs Triton kernels on CUDA (TMA + wgmma on Hopper) and under ``TRITON_INTERPRET=1``; otherwise
    the pure-PyTorch ``grouped_mm_ref``. On sm_90, bf16 problems with TMA-ready layouts take the
    warp-specialized Gluon kernels instead (the rows-ragged form from 128 rows per group on average,
    with K-major weights or K <= N); the ``warp_specialized`` option turns them off.
    """
    a, b = autocast(a), autocast(b)
    form = check_inputs(a, b, offs, out_dtype)
    if form == "3d3d":
        e, m, k = a.shape
        if e == 0:  # an empty batch: (0, M, N), as torch.bmm and torch._grouped_mm give it
            return torch.matmul(a, b).to(out_dtype or a.dtype)
        rows = torch.arange(1, e + 1, device=a.device, dtype=torch.int32) * m
        out = grouped_mm(a.reshape(e * m, k), b, rows, out_dtype=out_dtype)
        return out.view(e, m, b.shape[-1])
    offs = offs.contiguous()  # the kernels read offs by position: a strided view becomes a copy
    if validate or config.get_options().debug:
        check_offs(offs, a.shape[0] if form == "2d3d" else a.shape[1])
    if not config.uses_triton(a.device):
        return grouped_mm_ref(a, b, offs, out_dtype=out_dtype)
    return grouped_mm_op(a, b, offs, out_dtype)

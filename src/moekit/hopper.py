"""Launchers of the warp-specialized Gluon GEMMs for Hopper (``_kernels/hopper_gemm.py``).

Each ``*_ok`` says whether a problem takes the Gluon kernel; the launchers build the Gluon TMA
descriptors and the device-side tile table and launch one persistent program per SM. The kernel
module is imported only where it runs (sm_90 with Gluon), so moekit imports anywhere.
"""

from __future__ import annotations

import functools

import torch

from . import config, launch
from ._kernels.hopper_modes import ColSum, Epilogue
from .descriptors import descriptor, row_bounded, tma_ok, weight_descriptor
from .plans import constant
from .validation import ALIGN

WS_TILE = (128, 256, 64)  # (block_m, block_n, block_k): two consumer warpgroups of 64 rows
WS_STAGES = 3  # 3 x 48 KB ring + 2 x 32 KB epilogue buffers: 208 KB of the 227 KB
WS_GROUP_M = 8  # row tiles walked together, for L2 reuse
WS_MIN_ROWS = 128  # average rows per group below which the rows-ragged GEMM keeps Triton's smaller tiles
WS_DSWIGLU_STEP_ROWS = 4  # rows per step of the dSwiGLU epilogue partition (8 spilled: hopper_dswiglu.py)



def ws_rows_ragged(a, b, out, b_trans: bool) -> bool:
    """Whether a plain rows-ragged GEMM takes the warp-specialized kernel: bf16, >= WS_MIN_ROWS rows
    per group on average, and weights K-major or K <= N. (H100: the kernel wins on every
    gpt-oss GEMM but the up-projection's dgrad, K = 2F = 2N with N-major weights, where it trails the
    Triton kernel by 2-3%.)"""
    (m, k), (e, _, n) = a.shape, b.shape
    return (out.dtype == torch.bfloat16 and m >= WS_MIN_ROWS * e and (b_trans or k <= n)
            and ws_ok(a, b, out))


def ws_dswiglu_ok(a, b, aux, h_cols: int, scale=None) -> bool:
    """Whether the down-projection's dgrad a (M, K) @ b (E, K, N) takes the warp-specialized kernel
    with the dSwiGLU epilogue (``ws_dswiglu``), writing into fresh row-major d_aux (M, 2N) and
    h (M, h_cols) (d_aux's rows are aux's): bf16 aux, fp32 row scales (or none), and the weights'
    layouts that the plain dgrad also runs on this kernel (``ws_rows_ragged``), so that both paths
    compute the same dH bits."""
    (m, k), (e, _, n) = a.shape, b.shape
    return (m >= WS_MIN_ROWS * e and (b.stride(2) != 1 or k <= n) and aux.dtype == torch.bfloat16
            and (scale is None or (scale.dtype == torch.float32 and scale.is_contiguous()))
            and h_cols <= launch.cdiv(n, WS_TILE[1]) * WS_TILE[1]
            and all(cols * a.element_size() % ALIGN == 0 for cols in (aux.shape[1], h_cols)) and ws_ok(a, b, aux))


@functools.cache
def _bf16_smem_layout(block: tuple):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def ws_desc(t, shape, strides, block):
    """A Gluon TMA descriptor over bf16 ``t`` with the default swizzled layout for ``block`` (the layout
    built once per box shape: ~10 us of host time per call otherwise)."""
    return descriptor(t, shape, strides, block, _bf16_smem_layout(tuple(block)))


def ws_ok(a: torch.Tensor, b: torch.Tensor, *outs: torch.Tensor) -> bool:
    """Whether the warp-specialized Hopper kernel takes ``a (M, K) @ b (E, K, N)`` into ``outs``."""
    return (
        config.use_warp_specialized(a.device)
        and a.dtype == torch.bfloat16
        and a.shape[0] > 0
        and a.shape[1] > 0
        and tma_ok(a, 1)
        and tma_ok(b, 2 if b.stride(2) == 1 else 1)
        and all(tma_ok(t, 1) for t in outs)
    )


def ws_rows_setup(a, b, offs, c, out2, *, box_n: int, zero_tail: bool = True):
    """What every rows-ragged warp-specialized launch needs, for a (M, K) bf16 row-major, b (E, K, N)
    with a unit stride along K or N, offs (E,) int32, and outputs c (M, N) and out2 (M, N2) (c again
    when there is one output): the TMA descriptors of a and b (``box_n`` columns per B box), the
    device-side row-tile table (its kernel also zero-fills the rows of c and out2 past offs[-1], with
    ``zero_tail``), and the number of persistent programs. Returns (a_desc, b_desc, table, programs)."""
    from ._kernels import hopper_gemm as hk  # Gluon: imported only where it runs

    (m, k), (e, _, n) = a.shape, b.shape
    bm, bn, bk = WS_TILE
    a_desc = ws_desc(a, [m, k], [a.stride(0), 1], [bm, bk])
    b_desc = weight_descriptor(b, bk, box_n, make=ws_desc)
    max_row_tiles = launch.cdiv(m, bm) + e
    table = torch.empty(4 * (max_row_tiles + 1), dtype=torch.int32, device=a.device)  # (filled before read)
    launch.kernel(hk._tile_table_kernel)[(max(launch.cdiv(max_row_tiles, 32), 8),)](
        offs, table, c, out2, m, c.shape[1], out2.shape[1] if out2 is not c else 0, e,
        c.stride(0), out2.stride(0), max_row_tiles,
        BLOCK_M=bm, BLOCK_E=launch.next_power_of_2(e + 1), BLOCK_T=32, BLOCK_Z=32, ZERO_TAIL=zero_tail, num_warps=4,
    )
    return a_desc, b_desc, table, min(config.num_sms(a.device), max_row_tiles * launch.cdiv(n, bn))


def ws_gemm(a, b, offs, c, *, epilogue: Epilogue = Epilogue.PLAIN, bias=None, out2=None, spec=None,
            zero_tail: bool = True):
    """Rows-ragged GEMM on the warp-specialized Hopper kernel (check ``ws_ok`` first).

    a (M, K) bf16 row-major; b (E, K, N) with a unit stride along K or N; bias (E, N) or None.

    * Epilogue.PLAIN: c (M, N) = a @ b[g] (+ bias).
    * Epilogue.SWIGLU: c = aux (M, N) and out2 = h = SwiGLU(aux) (M, N / 2), gate and linear columns
      interleaved.

    Rows past offs[-1] of c and out2 are zero (left unwritten without ``zero_tail``)."""
    from ._kernels import hopper_gemm as hk  # Gluon: imported only where it runs

    (m, k), n = a.shape, b.shape[2]
    bm, bn, bk = WS_TILE
    out2 = c if out2 is None else out2
    a_desc, b_desc, table, programs = ws_rows_setup(a, b, offs, c, out2, box_n=bn, zero_tail=zero_tail)
    # aux as int32 words of bf16 pairs
    c_arg = c.view(torch.int32) if epilogue == Epilogue.SWIGLU else c
    c_desc = ws_desc(c, [m, c.shape[1]], [c.stride(0), 1], [bm // 2, bn])
    launch.kernel(hk._grouped_mm_ws_kernel)[(programs,)](
        a_desc, b_desc, c_desc,
        c_arg, c_arg.stride(0), out2, out2.stride(0),
        bias if bias is not None else c, bias.stride(0) if bias is not None else 0, table, c,
        n, k, HAS_BIAS=bias is not None, EPILOGUE=int(epilogue), num_warps=4, **_ws_constexprs(a, b, spec),
        maxnreg=168,
    )
    return c


def _ws_constexprs(a, b, spec) -> dict:
    """The constexprs every rows-ragged warp-specialized launch passes. The tile stride is the device's
    program count, not this launch's grid (min of it and the tiles): correct either way (a grid below
    it covers every tile in one pass), and a constexpr that does not follow M, N and E keeps one
    compiled kernel per device instead of one per small problem size."""
    sw = spec.constexprs() if spec is not None else dict(ALPHA=1.0, LIMIT=None, OFFSET=0.0)
    return dict(NUM_SMS=config.num_sms(a.device), GROUP_M=WS_GROUP_M, STAGES=WS_STAGES, B_TRANS=b.stride(2) != 1,
                ALPHA=sw["ALPHA"], LIMIT=sw["LIMIT"], OFFSET=sw["OFFSET"])


def ws_dswiglu(a, b, offs, aux, d_aux, h, spec, *, scale=None, zero_tail: bool = True):
    """The down-projection's dgrad with the SwiGLU backward (``_kernels/hopper_dswiglu.py``); check
    ``ws_dswiglu_ok`` first. a = dOut (M, K) bf16 row-major, b (E, K, N) with a unit stride along K
    or N, aux (M, 2N) interleaved (gate, linear) pairs, scale (M,) fp32 row scales or None.

    dH = a @ b[g] is never stored. Writes d_aux = dSwiGLU(aux) * (s * dH) (M, 2N) and h = s * SwiGLU(aux)
    (M, N2), N2 >= N: column N of h is ones when N2 > N (N2 within the last 256-column tile), later
    columns zeros; rows past offs[-1] of both are zeros (left unwritten without ``zero_tail``). Returns
    d_scale (M,) fp32 = <dH, SwiGLU(aux)> per row (zero past offs[-1]) with ``scale``, else None."""
    from ._kernels import hopper_dswiglu as hd  # Gluon: imported only where it runs

    (m, k), n = a.shape, b.shape[2]
    bn = WS_TILE[1]
    a_desc, b_desc, table, programs = ws_rows_setup(a, b, offs, d_aux, h, box_n=bn, zero_tail=zero_tail)
    tiles_n = launch.cdiv(n, bn)
    # one partial row sum per column tile, added up below; rows past offs[-1] are in no tile
    parts = None if scale is None else torch.zeros(tiles_n, m, dtype=torch.float32, device=a.device)
    aux_w, d_aux_w = aux.view(torch.int32), d_aux.view(torch.int32)
    launch.kernel(hd._grouped_mm_ws_dswiglu_kernel)[(programs,)](
        a_desc, b_desc, aux_w, aux_w.stride(0), d_aux_w, d_aux_w.stride(0), h, h.stride(0),
        scale if scale is not None else h, parts if parts is not None else h,
        table, m, n, h.shape[1], k, BLOCK_N=bn, HAS_SCALE=scale is not None, ONES_COL=h.shape[1] > n,
        EPI_ROWS=WS_DSWIGLU_STEP_ROWS, num_warps=4,
        **_ws_constexprs(a, b, spec), maxnreg=168,  # three warpgroups (the kernel's module doc)
    )
    if parts is None:
        return None
    return parts[0] if tiles_n == 1 else parts.sum(0)


def ws_swiglu_nvfp4_ok(a, b) -> bool:
    """Whether the up-projection a (M, D) @ b (E, D, 2F) takes the warp-specialized kernel with the
    SwiGLU -> NVFP4 epilogue (``ws_swiglu_nvfp4``), which reads interleaved gate/up columns (the
    caller checks the layout)."""
    return ws_ok(a, b)


@functools.cache
def _staging_tile(device: torch.device) -> torch.Tensor:
    """A bf16 tile of the epilogue buffer's shape: the descriptor that sizes the shared-memory staging
    of a kernel whose output leaves by pointer stores (never read or written through)."""
    return constant(torch.zeros(WS_TILE[0] // 2, WS_TILE[1], dtype=torch.bfloat16, device=device))


def ws_swiglu_nvfp4(a, b, offs, values, scales, gscale, *, bias=None, spec=None):
    """The up-projection with SwiGLU and NVFP4 quantization of h fused (``Epilogue.SWIGLU_NVFP4``):
    a (M, D) bf16 row-major, b (E, D, 2F) with a unit stride along D or 2F, interleaved (gate, linear)
    columns, bias (E, 2F) or None, gscale (1,) fp32 -> values (M, F / 2) and scales (M, F / 16), uint8,
    contiguous: the bytes of ``nvfp4.quantize(h, g)`` for ``ws_gemm(..., Epilogue.SWIGLU)``'s h. Rows
    past offs[-1] get zero codes and zero scales. Check ``ws_swiglu_nvfp4_ok`` first."""
    from ._kernels import hopper_gemm as hk  # Gluon: imported only where it runs

    k, n = a.shape[1], b.shape[2]
    bm, bn, _ = WS_TILE
    a_desc, b_desc, table, programs = ws_rows_setup(a, b, offs, values, scales, box_n=bn)
    staging = _staging_tile(a.device)
    c_desc = ws_desc(staging, list(staging.shape), [staging.stride(0), 1], [bm // 2, bn])
    launch.kernel(hk._grouped_mm_ws_kernel)[(programs,)](
        a_desc, b_desc, c_desc,
        values, values.stride(0), scales, scales.stride(0),
        bias if bias is not None else values, bias.stride(0) if bias is not None else 0, table, gscale,
        n, k, HAS_BIAS=bias is not None, EPILOGUE=int(Epilogue.SWIGLU_NVFP4), num_warps=4,
        **_ws_constexprs(a, b, spec), maxnreg=168,
    )
    return values, scales


@functools.cache
def _ones_tile(device: torch.device, rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) bf16 tile whose first column is ones: the A operand of a virtual ones row."""
    t = torch.zeros(rows, cols, dtype=torch.bfloat16, device=device)
    t[:, 0] = 1.0
    return constant(t)


def ws_ragged_k(a, b, offs, out, colsum, mode: ColSum):
    """2D x 2D on the warp-specialized Hopper kernel: out (E, M_C, N) = a (M, Kt) @ b (Kt, N) per group,
    a with unit stride along M, b along N. ``mode`` (``ColSum``): none; ``ROW``: a's last row is ones
    (M_C = M - 1) and its product row goes to ``colsum`` (E, N) fp32; ``VIRTUAL``: M % 128 == 64, and
    the kernel multiplies a constant row of ones in the empty half of the last row tile into
    ``colsum``. The caller checked the layouts (``ragged_k``)."""
    from ._kernels import hopper_gemm as hk  # Gluon: imported only where it runs

    (m, kt), n, e = a.shape, b.shape[1], offs.numel()
    bm, bn, bk = WS_TILE
    a_desc = row_bounded(a.mT, [bk, bm // 2], ws_desc)
    ones = _ones_tile(a.device, bk, bm // 2) if mode == ColSum.VIRTUAL else None
    ones_desc = ws_desc(ones, [1, 1, bk, bm // 2], [bk * bm // 2, bk * bm // 2, bm // 2, 1],
                         [1, 1, bk, bm // 2]) if ones is not None else a_desc
    b_desc = row_bounded(b, [bk, bn], ws_desc)
    c_desc = ws_desc(out, list(out.shape), [out.stride(0), out.stride(1), 1], [1, bm // 2, bn])
    programs = min(config.num_sms(a.device), e * launch.cdiv(m, bm) * launch.cdiv(n, bn))
    launch.kernel(hk._grouped_mm_ws_ragged_k_kernel)[(programs,)](
        a_desc, ones_desc, b_desc, c_desc,
        colsum if colsum is not None else out, colsum.stride(0) if colsum is not None else 0,
        offs, m, n, kt, e,
        NUM_SMS=config.num_sms(a.device), GROUP_M=WS_GROUP_M, STAGES=WS_STAGES, COLSUM=int(mode),  # see ws_gemm
        num_warps=4, maxnreg=168,
    )


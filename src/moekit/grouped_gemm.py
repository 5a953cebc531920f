"""``grouped_mm``: GEMM over ragged expert groups, a drop-in for ``torch._grouped_mm`` with autograd.

Reads as: reference (``reference.grouped_mm_ref``) -> kernels (``_kernels/grouped_gemm.py``) ->
launcher (``grouped_mm_fwd``) -> custom op ``moekit::grouped_mm`` with a fake and an autograd formula
(``grouped_mm_bwd``) -> ``GroupedMMFn``, the lean eager autograd path -> public ``grouped_mm``.

Legend: E groups (experts), M rows, N output columns, K reduction length, Kt the ragged reduction
length of the 2D x 2D form.
"""

from __future__ import annotations

import functools

import torch
import triton

from . import config
from ._kernels.grouped_gemm import (
    ROW_BOUND_BIG,
    _grouped_mm_ragged_k_kernel,
    _grouped_mm_ragged_m_kernel,
)
from .reference import grouped_mm_ref

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton without host descriptors: pointer path only
    TensorDescriptor = None

_IN_DTYPES = (torch.bfloat16, torch.float16)
_ALIGN = 16  # bytes: TMA base/stride alignment, and the contract torch._grouped_mm has too

# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


def _check_layout(name: str, t: torch.Tensor) -> None:
    """One of the two matrix dims must have unit stride; every other stride and the base 16-byte aligned."""
    item = t.element_size()
    inner = t.stride()[-2:]
    if 1 not in inner and not (t.shape[-1] <= 1 or t.shape[-2] <= 1):
        raise ValueError(
            f"grouped_mm: {name} needs a unit stride along one of its last two dims, got strides "
            f"{tuple(t.stride())} for shape {tuple(t.shape)}; call .contiguous() first"
        )
    unit_dim = t.dim() - 1 if t.stride(-1) == 1 else t.dim() - 2
    for d in range(t.dim()):
        if d != unit_dim and t.shape[d] > 1 and (t.stride(d) * item) % _ALIGN:
            raise ValueError(
                f"grouped_mm: {name}.stride({d}) = {t.stride(d)} elements is not a multiple of "
                f"{_ALIGN} bytes ({_ALIGN // item} elements of {t.dtype}); pad that dim or copy"
            )
    # storage_offset() is not traceable under torch.compile; the launcher re-checks real pointers and
    # takes the pointer path for a misaligned base, so skipping it there is safe.
    if not torch.compiler.is_compiling() and (t.storage_offset() * item) % _ALIGN:
        raise ValueError(
            f"grouped_mm: {name} starts {t.storage_offset()} elements into its storage, not on a "
            f"{_ALIGN}-byte boundary; copy it or slice at an aligned offset"
        )


def _check_inputs(a, b, offs, out_dtype) -> str:
    """Validate everything that needs no host sync; return the form ('2d3d', '2d2d', '3d3d')."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grouped_mm: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype not in _IN_DTYPES:
            raise TypeError(f"grouped_mm: {name} must be bfloat16 or float16, got {t.dtype}")
    if a.dtype != b.dtype:
        raise TypeError(f"grouped_mm: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if out_dtype not in (None, a.dtype, torch.float32):
        raise TypeError(f"grouped_mm: out_dtype must be None, {a.dtype} or torch.float32, got {out_dtype}")
    if a.device != b.device:
        raise ValueError(f"grouped_mm: a is on {a.device} but b is on {b.device}")
    form = f"{a.dim()}d{b.dim()}d"
    if form not in ("2d3d", "2d2d", "3d3d"):
        raise ValueError(f"grouped_mm: supported forms are 2D x 3D, 2D x 2D and 3D x 3D, got {form}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"grouped_mm: K mismatch, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    if form == "3d3d":
        if offs is not None:
            raise ValueError("grouped_mm: 3D x 3D takes no offs (each batch is one group)")
        if a.shape[0] != b.shape[0]:
            raise ValueError(f"grouped_mm: batch mismatch, a {tuple(a.shape)} vs b {tuple(b.shape)}")
    else:
        if offs is None:
            raise ValueError(f"grouped_mm: the {form} form needs offs (E,) int32")
        if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
            got = f"{offs.dtype} {offs.dim()}-D" if isinstance(offs, torch.Tensor) else type(offs).__name__
            raise TypeError(f"grouped_mm: offs must be a 1-D int32 tensor, got {got}")
        if offs.device != a.device:
            raise ValueError(f"grouped_mm: offs is on {offs.device} but a is on {a.device}")
        if offs.numel() == 0:
            raise ValueError("grouped_mm: offs must hold at least one group")
        if form == "2d3d" and offs.numel() != b.shape[0]:
            raise ValueError(f"grouped_mm: offs has {offs.numel()} entries but b has E = {b.shape[0]} groups")
    _check_layout("a", a)
    _check_layout("b", b)
    return form


def check_offs(offs: torch.Tensor, bound: int) -> None:
    """Check ``0 <= offs[0] <= offs[1] <= ... <= offs[-1] <= bound``. Syncs with the device."""
    ok_start = bool(offs[0] >= 0)
    ok_mono = bool((offs[1:] >= offs[:-1]).all()) if offs.numel() > 1 else True
    ok_end = bool(offs[-1] <= bound)
    if not (ok_start and ok_mono and ok_end):
        raise ValueError(
            f"grouped_mm: offs must be non-decreasing cumulative ends within [0, {bound}], got {offs.tolist()}"
        )


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------


def _tma_ok(t: torch.Tensor, unit_dim: int) -> bool:
    """Whether ``t`` can back a TMA descriptor with ``unit_dim`` as its contiguous axis."""
    item = t.element_size()
    if t.stride(unit_dim) != 1 or t.data_ptr() % _ALIGN:
        return False
    return all((t.stride(d) * item) % _ALIGN == 0 for d in range(t.dim()) if d != unit_dim % t.dim())


def _row_bounded(t: torch.Tensor, block: list[int], make=None):
    """Descriptor over a 2-D row-major ``t`` whose row bound is set per access (see the kernels' doc).
    ``make(t, shape, strides, block)`` builds it: Triton's ``TensorDescriptor`` by default, or
    ``_ws_desc`` for the Gluon kernels."""
    s = t.stride(0)
    big = ROW_BOUND_BIG.value
    make = make or TensorDescriptor
    return make(t, [0x7FFF0000, 0x7FFF0000, big, t.shape[1]], [2**34 - s, s, s, 1], [1, 1, *block])


def _ragged_m(a, b, offs, out_dtype, cfg: config.TileConfig | None, bias=None):
    """2D x 3D: a (M, K), b (E, K, N), optional bias (E, N) -> (M, N); rows past offs[-1] are zero."""
    (m, k), (e, _, n) = a.shape, b.shape
    out = config.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0 and bias is None:
        return out.zero_()
    a_trans, b_trans = a.stride(1) != 1, b.stride(2) != 1
    if cfg is None and _ws_rows_ragged(a, b, out, b_trans):
        return ws_gemm(a, b, offs, out, bias=bias)
    # A TMA box must start 16-byte aligned along the unit-stride axis; groups start at any row, so an
    # `a` with unit stride along M (a.mT views) takes the pointer path.
    tma = (
        TensorDescriptor is not None
        and config.use_tma(a.device)
        and not a_trans
        and k > 0
        and _tma_ok(a, 1)
        and _tma_ok(b, 1 if b_trans else 2)
        and _tma_ok(out, 1)
    )
    cfg = cfg or config.grouped_mm_config(
        m // e, n, k, e, ragged_k=False, tma=tma, out_bytes=out.element_size(), device=a.device
    )
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if tma:
        a_arg = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, bk])
        b_arg = (TensorDescriptor(b, [e, n, k], [b.stride(0), b.stride(2), 1], [1, bn, bk]) if b_trans
                 else TensorDescriptor(b, [e, k, n], [b.stride(0), b.stride(1), 1], [1, bk, bn]))
        c_arg = _row_bounded(out, [bm, bn // 2 if cfg.split_store else bn])
    else:
        a_arg, b_arg, c_arg = a, b, out
    max_tiles = (triton.cdiv(m, bm) + e + 1) * triton.cdiv(n, bn)  # each group adds <= 1 partial row tile
    programs = min(config.num_sms(a.device) * cfg.programs_per_sm, max_tiles)
    _grouped_mm_ragged_m_kernel[(programs,)](
        a_arg, b_arg, c_arg, offs, bias,
        m, n, k, e,
        a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), bias.stride(0) if bias is not None else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=cfg.group_m, BLOCK_E=triton.next_power_of_2(e + 1),
        B_TRANS=b_trans,
        USE_TMA=tma, DOT_F32=config.is_interpreting(), FLATTEN=cfg.flatten, SPLIT_STORE=cfg.split_store,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


_WS_TILE = (128, 256, 64)  # (block_m, block_n, block_k): two consumer warpgroups of 64 rows
_WS_STAGES = 3  # 3 x 48 KB ring + 2 x 32 KB epilogue buffers: 208 KB of the 227 KB
_WS_GROUP_M = 8  # row tiles walked together, for L2 reuse
_WS_MIN_ROWS = 128  # average rows per group below which the rows-ragged GEMM keeps Triton's smaller tiles

WS_PLAIN, WS_SWIGLU, WS_DSWIGLU = 0, 1, 2  # the epilogues of _kernels/hopper_gemm.py
WS_COLSUM_NONE, WS_COLSUM_ROW, WS_COLSUM_VIRTUAL = 0, 1, 2  # its ragged-K kernel's column-sum modes


def _ws_rows_ragged(a, b, out, b_trans: bool) -> bool:
    """Whether a plain rows-ragged GEMM takes the warp-specialized kernel: bf16, >= _WS_MIN_ROWS rows
    per group on average, and weights K-major or K <= N. (probe_ws.py, H100: the kernel wins on every
    gpt-oss GEMM but the up-projection's dgrad, K = 2F = 2N with N-major weights, where it trails the
    Triton kernel by 2-3%.)"""
    (m, k), (e, _, n) = a.shape, b.shape
    return (out.dtype == torch.bfloat16 and m >= _WS_MIN_ROWS * e and (b_trans or k <= n)
            and ws_ok(a, b, out))


def ws_dswiglu_ok(a, b, aux, h_cols: int) -> bool:
    """Whether the down-projection's dgrad a (M, K) @ b (E, K, N) takes the warp-specialized kernel
    with the dSwiGLU epilogue (``ws_gemm(..., epilogue=WS_DSWIGLU)``), writing into fresh row-major
    d_aux (M, 2N) and h (M, h_cols) (d_aux's rows are aux's)."""
    (m, _), (e, _, n) = a.shape, b.shape
    return (m >= _WS_MIN_ROWS * e and h_cols <= triton.cdiv(n, _WS_TILE[1]) * _WS_TILE[1]
            and all(cols * a.element_size() % _ALIGN == 0 for cols in (aux.shape[1], h_cols)) and ws_ok(a, b, aux))


def _ws_desc(t, shape, strides, block):
    """A Gluon TMA descriptor over bf16 ``t`` with the default swizzled layout for ``block``."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    return GluonDescriptor(t, shape, strides, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def ws_ok(a: torch.Tensor, b: torch.Tensor, *outs: torch.Tensor) -> bool:
    """Whether the warp-specialized Hopper kernel takes ``a (M, K) @ b (E, K, N)`` into ``outs``."""
    return (
        config.use_warp_specialized(a.device)
        and a.dtype == torch.bfloat16
        and a.shape[0] > 0
        and a.shape[1] > 0
        and _tma_ok(a, 1)
        and _tma_ok(b, 2 if b.stride(2) == 1 else 1)
        and all(_tma_ok(t, 1) for t in outs)
    )


def ws_rows_setup(a, b, offs, c, out2, *, box_n: int):
    """What every rows-ragged warp-specialized launch needs, for a (M, K) bf16 row-major, b (E, K, N)
    with a unit stride along K or N, offs (E,) int32, and outputs c (M, N) and out2 (M, N2) (c again
    when there is one output): the TMA descriptors of a and b (``box_n`` columns per B box), the
    device-side row-tile table (its kernel also zero-fills the rows of c and out2 past offs[-1]), and
    the number of persistent programs. Returns (a_desc, b_desc, table, programs)."""
    from ._kernels import hopper_gemm as hk  # Gluon: imported only where it runs

    (m, k), (e, _, n) = a.shape, b.shape
    bm, bn, bk = _WS_TILE
    a_desc = _ws_desc(a, [m, k], [a.stride(0), 1], [bm, bk])
    b_desc = (_ws_desc(b, [e, n, k], [b.stride(0), b.stride(2), 1], [1, box_n, bk]) if b.stride(2) != 1
              else _ws_desc(b, [e, k, n], [b.stride(0), b.stride(1), 1], [1, bk, box_n]))
    max_row_tiles = triton.cdiv(m, bm) + e
    table = torch.empty(4 * (max_row_tiles + 1), dtype=torch.int32, device=a.device)
    hk._tile_table_kernel[(max(triton.cdiv(max_row_tiles, 128), 8),)](
        offs, table, c, out2, m, c.shape[1], out2.shape[1] if out2 is not c else 0, e,
        c.stride(0), out2.stride(0), max_row_tiles,
        BLOCK_M=bm, BLOCK_E=triton.next_power_of_2(e + 1), BLOCK_T=128, BLOCK_Z=32, num_warps=4,
    )
    return a_desc, b_desc, table, min(config.num_sms(a.device), max_row_tiles * triton.cdiv(n, bn))


def ws_gemm(a, b, offs, c, *, epilogue: int = WS_PLAIN, bias=None, out2=None, aux=None, spec=None):
    """Rows-ragged GEMM on the warp-specialized Hopper kernel (check ``ws_ok`` first).

    a (M, K) bf16 row-major; b (E, K, N) with a unit stride along K or N; bias (E, N) or None.

    * WS_PLAIN: c (M, N) = a @ b[g] (+ bias).
    * WS_SWIGLU: c = aux (M, N) and out2 = h = SwiGLU(aux) (M, N / 2), gate and linear columns
      interleaved.
    * WS_DSWIGLU (the down-projection's dgrad): dH = a @ b[g] (M, N) is never stored; from it and
      ``aux`` (M, 2N), c = d_aux = dSwiGLU(aux) * dH (M, 2N) and out2 = h = SwiGLU(aux), (M, N2)
      with N2 >= N: column N of out2 is ones when N2 > N (N2 must then stay within the last
      256-column tile), later columns are zeros.

    Rows past offs[-1] of c and out2 are zero."""
    from ._kernels import hopper_gemm as hk  # Gluon: imported only where it runs

    (m, k), n = a.shape, b.shape[2]
    bm, bn, bk = _WS_TILE
    dsw = epilogue == WS_DSWIGLU
    out2 = c if out2 is None else out2
    box_n = bn // 2 if dsw else bn  # DSWIGLU: one B box per accumulator
    a_desc, b_desc, table, programs = ws_rows_setup(a, b, offs, c, out2, box_n=box_n)
    b_trans = b.stride(2) != 1
    # aux / d_aux as int32 words of bf16 pairs
    c_arg = c.view(torch.int32) if epilogue in (WS_SWIGLU, WS_DSWIGLU) else c
    sw = spec.constexprs() if spec is not None else dict(ALPHA=1.0, LIMIT=None, OFFSET=0.0)
    common = dict(NUM_SMS=programs, GROUP_M=_WS_GROUP_M, STAGES=_WS_STAGES, B_TRANS=b_trans,
                  ALPHA=sw["ALPHA"], LIMIT=sw["LIMIT"], OFFSET=sw["OFFSET"], maxnreg=168)
    if dsw:  # one 8-warp consumer partition (hopper_gemm.py)
        aux_desc = _ws_desc(aux, [m, aux.shape[1]], [aux.stride(0), 1], [bm, bn])
        hk._grouped_mm_ws_dswiglu_kernel[(programs,)](
            a_desc, b_desc, aux_desc, c_arg, c_arg.stride(0), out2, out2.stride(0), table, n, out2.shape[1], k,
            num_warps=8, **common,
        )
        return c
    c_desc = _ws_desc(c, [m, c.shape[1]], [c.stride(0), 1], [bm // 2, bn])
    hk._grouped_mm_ws_kernel[(programs,)](
        a_desc, b_desc, c_desc,
        c_arg, c_arg.stride(0), out2, out2.stride(0),
        bias if bias is not None else c, bias.stride(0) if bias is not None else 0, table,
        n, k, HAS_BIAS=bias is not None, EPILOGUE=epilogue, num_warps=4, **common,
    )
    return c


@functools.cache
def _ones_tile(device: torch.device, rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) bf16 tile whose first column is ones: the A operand of a virtual ones row."""
    t = torch.zeros(rows, cols, dtype=torch.bfloat16, device=device)
    t[:, 0] = 1.0
    return t


def _ws_ragged_k(a, b, offs, out, colsum, mode: int):
    """2D x 2D on the warp-specialized Hopper kernel: out (E, M_C, N) = a (M, Kt) @ b (Kt, N) per group,
    a with unit stride along M, b along N. ``mode`` (WS_COLSUM_*): none; ``ROW``: a's last row is ones
    (M_C = M - 1) and its product row goes to ``colsum`` (E, N) fp32; ``VIRTUAL``: M % 128 == 64, and
    the kernel multiplies a constant row of ones in the empty half of the last row tile into
    ``colsum``. The caller checked the layouts (``_ragged_k``)."""
    from ._kernels import hopper_gemm as hk  # Gluon: imported only where it runs

    (m, kt), n, e = a.shape, b.shape[1], offs.numel()
    bm, bn, bk = _WS_TILE
    a_desc = _row_bounded(a.mT, [bk, bm // 2], _ws_desc)
    ones = _ones_tile(a.device, bk, bm // 2) if mode == WS_COLSUM_VIRTUAL else None
    ones_desc = _ws_desc(ones, [1, 1, bk, bm // 2], [bk * bm // 2, bk * bm // 2, bm // 2, 1],
                         [1, 1, bk, bm // 2]) if ones is not None else a_desc
    b_desc = _row_bounded(b, [bk, bn], _ws_desc)
    c_desc = _ws_desc(out, list(out.shape), [out.stride(0), out.stride(1), 1], [1, bm // 2, bn])
    programs = min(config.num_sms(a.device), e * triton.cdiv(m, bm) * triton.cdiv(n, bn))
    hk._grouped_mm_ws_ragged_k_kernel[(programs,)](
        a_desc, ones_desc, b_desc, c_desc,
        colsum if colsum is not None else out, colsum.stride(0) if colsum is not None else 0,
        offs, m, n, kt, e,
        NUM_SMS=programs, GROUP_M=_WS_GROUP_M, STAGES=_WS_STAGES, COLSUM=mode,
        num_warps=4, maxnreg=168,
    )


def _ragged_k(a, b, offs, out_dtype, cfg: config.TileConfig | None, *, ones_row: bool = False,
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
        and _tma_ok(a, 0)
        and _tma_ok(b, 1)
        and _tma_ok(out, 2)
    )
    if (cfg is None and tma and config.use_warp_specialized(a.device) and a.dtype == torch.bfloat16
            and out.dtype == torch.bfloat16):
        mode = WS_COLSUM_ROW if ones_row else WS_COLSUM_NONE
        if colsum and m % _WS_TILE[0] == _WS_TILE[0] // 2:
            mode = WS_COLSUM_VIRTUAL
            sums = config.empty((e, n), dtype=torch.float32, device=a.device)
        _ws_ragged_k(a, b, offs, out, sums, mode)
        return result()
    cfg = cfg or config.grouped_mm_config(
        m, n, kt // e, e, ragged_k=True, tma=tma, out_bytes=out.element_size(), device=a.device
    )
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if tma:
        a_arg = _row_bounded(a.mT, [bk, bm])
        b_arg = _row_bounded(b, [bk, bn])
        c_arg = TensorDescriptor(out, list(out.shape), [out.stride(0), out.stride(1), 1],
                                 [1, bm, bn // 2 if cfg.split_store else bn])
    else:
        a_arg, b_arg, c_arg = a, b, out
    programs = min(config.num_sms(a.device) * cfg.programs_per_sm, e * triton.cdiv(m, bm) * triton.cdiv(n, bn))
    _grouped_mm_ragged_k_kernel[(programs,)](
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
        return _ragged_m(a, b, offs, out_dtype, cfg)
    return _ragged_k(a, b, offs, out_dtype, cfg)


def _matrix_ready(t: torch.Tensor) -> torch.Tensor:
    """Gradients can arrive expanded (stride 0) or misaligned; copy only then (shape-level test, so
    it also traces under torch.compile)."""
    item = t.element_size()
    if 1 in t.stride()[-2:] and (t.storage_offset() * item) % _ALIGN == 0:
        unit = t.dim() - 1 if t.stride(-1) == 1 else t.dim() - 2
        if all((t.stride(d) * item) % _ALIGN == 0 for d in range(t.dim()) if d != unit):
            return t
    return t.contiguous()


# --------------------------------------------------------------------------------------------------
# custom op + autograd
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("moekit::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    return grouped_mm_fwd(a, b, offs, out_dtype)


@_grouped_mm_op.register_fake
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
    grad = _matrix_ready(grad.to(a.dtype))
    if b.dim() == 3:
        grad_a = mm(grad, b.mT, offs) if needs_a else None
        grad_b = mm(a.mT, grad, offs) if needs_b else None
    else:
        grad_a = mm(b, grad.mT, offs).mT if needs_a else None
        grad_b = mm(a.mT, grad, offs) if needs_b else None
    return grad_a, grad_b


def _op_mm(a, b, offs):
    return _grouped_mm_op(a, b, offs, None)


def _setup_context(ctx, inputs, output):
    a, b, offs, _ = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    # Under torch.compile the backward is traced too, so it runs through the op itself.
    a, b, offs = ctx.saved_tensors
    grad_a, grad_b = grouped_mm_bwd(grad, a, b, offs, *ctx.needs_input_grad[:2], mm=_op_mm)
    return grad_a, grad_b, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


class GroupedMMFn(torch.autograd.Function):
    """Eager autograd path: calls the launchers directly.

    ``torch.library.custom_op`` dispatch costs ~150 us of host time per call (measured with
    benchmarks/launch_overhead.py on an H100 host), as much as a decode-sized GEMM takes on the GPU;
    eager calls skip it. Under torch.compile, ``grouped_mm`` uses the custom op instead.
    """

    @staticmethod
    def forward(ctx, a, b, offs, out_dtype):
        ctx.save_for_backward(a, b, offs)
        return grouped_mm_fwd(a, b, offs, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        grad_a, grad_b = grouped_mm_bwd(grad, a, b, offs, *ctx.needs_input_grad[:2], mm=grouped_mm_fwd)
        return grad_a, grad_b, None, None


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
    never read by the host; ``validate=True`` (or ``moekit.set_debug(True)``) checks that it is
    non-decreasing and in bounds, at the cost of a device sync.

    Runs Triton kernels on CUDA (TMA + wgmma on Hopper) and under ``TRITON_INTERPRET=1``; otherwise
    the pure-PyTorch ``grouped_mm_ref``. On sm_90, bf16 problems with TMA-ready layouts take the
    warp-specialized Gluon kernels instead (the rows-ragged form from 128 rows per group on average,
    with K-major weights or K <= N); ``MOEKIT_NO_WS=1`` turns them off.
    """
    form = _check_inputs(a, b, offs, out_dtype)
    if form == "3d3d":
        e, m, k = a.shape
        rows = torch.arange(1, e + 1, device=a.device, dtype=torch.int32) * m
        out = grouped_mm(a.reshape(e * m, k), b, rows, out_dtype=out_dtype)
        return out.view(e, m, b.shape[-1])
    if validate or config.debug_enabled():
        check_offs(offs, a.shape[0] if form == "2d3d" else a.shape[1])
    if not config.uses_triton(a.device):
        return grouped_mm_ref(a, b, offs, out_dtype=out_dtype)
    if torch.compiler.is_compiling():
        return _grouped_mm_op(a, b, offs, out_dtype)
    return GroupedMMFn.apply(a, b, offs, out_dtype)

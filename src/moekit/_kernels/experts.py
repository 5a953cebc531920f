"""Fused expert-MLP kernels: the grouped GEMM of ``grouped_gemm.py`` with SwiGLU epilogues.

* ``_grouped_mm_swiglu_kernel`` (up-projection forward): pre = x @ w_up[g] + b_up[g], rounded to the
  output dtype and stored as ``aux`` (M, 2F); h = SwiGLU(aux) (M, F) is computed from that rounded
  ``aux`` so that the backward's recompute reproduces it bit for bit. With ``row_scale`` (M,) fp32, h
  is each row's SwiGLU times its scale, multiplied in fp32 before rounding (the MoE block's routing
  weights, applied before the down-projection).
* ``_grouped_colsum_kernel``: per-group column sums of a row-ragged matrix (the bias gradients),
  deterministic: one program per (column block, group), no atomics.

Layouts of the (M, 2F) tensors: interleaved (gate, linear alternate) uses one descriptor/pointer
``*_a`` over all 2F columns; halves uses ``*_a`` over the gate half and ``*_b`` over the linear half,
so hardware bounds checks stop at F on each.
"""

import triton
import triton.language as tl

from .epilogue import split_pairs, swiglu_apply
from .grouped_gemm import (
    _add_bias,
    _dot,
    _gather_rows_of,
    _group_table,
    _halves,
    _load_2d,
    _load_a,
    _load_b,
    _locate,
    _mainloop,
    _store_rows,
)


@triton.jit
def _mainloop_pair(
    a, b, acc_g, acc_l, g, row, col_g, col_l, k_iters, M, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
    B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, a_rows=None,
):
    """Two accumulators sharing each A tile: b[g][:, col_g:+BF] and b[g][:, col_l:+BF] (halves layout).
    ``a_rows``: gathered A rows, as in ``_mainloop``."""
    b_base = g.to(tl.int64) * stride_be
    for ki in range(k_iters):
        k = ki * BLOCK_K
        a_tile = _load_a(a, a_rows, row, k, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K, USE_TMA)
        bg = _load_b(b, b_base, g, k, col_g, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_F, B_TRANS, USE_TMA)
        bl = _load_b(b, b_base, g, k, col_l, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_F, B_TRANS, USE_TMA)
        acc_g = _dot(a_tile, bg, acc_g, DOT_F32)
        acc_l = _dot(a_tile, bl, acc_l, DOT_F32)
    return acc_g, acc_l


@triton.jit
def _swiglu_epilogue(
    x_g, x_l, aux_a, aux_b, h, real, end, row, j, F, stride_aux_m, stride_h_m, scale,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, USE_TMA: tl.constexpr, OUT_DTYPE: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr, HALVES: tl.constexpr,
):
    """Store aux and h for h columns [j, j + BLOCK_F) of one row tile.

    HALVES: x_g, x_l are the gate and linear pre-activations [BLOCK_M, BLOCK_F]. Interleaved: x_g is
    the [BLOCK_M, 2 * BLOCK_F] interleaved pre-activation and x_l is unused. h is computed from the
    rounded aux, exactly what the backward recomputes. ``scale``: None or the tile's [BLOCK_M] fp32 row
    scales, which multiply h before it is rounded."""
    if HALVES:
        _store_rows(aux_a, stride_aux_m, end, row, j, F, x_g, BLOCK_M, BLOCK_F, USE_TMA)
        _store_rows(aux_b, stride_aux_m, end, row, j, F, x_l, BLOCK_M, BLOCK_F, USE_TMA)
        gate = x_g.to(OUT_DTYPE).to(tl.float32)
        lin = x_l.to(OUT_DTYPE).to(tl.float32)
    else:
        _store_rows(aux_a, stride_aux_m, end, row, 2 * j, 2 * F, x_g, BLOCK_M, 2 * BLOCK_F, USE_TMA)
        gate, lin = split_pairs(x_g.to(OUT_DTYPE).to(tl.float32), BLOCK_M, BLOCK_F)
    out = swiglu_apply(gate, lin, ALPHA, LIMIT, OFFSET)
    if scale is not None:
        out = out * scale[:, None]
    out = tl.where(real, out, 0.0)
    _store_rows(h, stride_h_m, end, row, j, F, out, BLOCK_M, BLOCK_F, USE_TMA)


@triton.jit
def _grouped_mm_swiglu_kernel(
    a, b, aux_a, aux_b, h, offs_ptr, bias,  # a (M, D); b (E, D, 2F); aux (M, 2F) out; h (M, F) out; bias (E, 2F)
    a_index,  # None, or (M,) int32: row r of A is row a_index[r] of the (T, D) pointer a (permute-free)
    row_scale,  # None, or (M,) fp32: h[r] is scaled by row_scale[r]
    M, F, K, E,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_aux_m, stride_h_m, stride_bias_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, FLATTEN: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr, HALVES: tl.constexpr,
    ZERO_TAIL: tl.constexpr,  # rows past offs[-1] of aux and h: zeros, or left unwritten
):
    # A tile covers BLOCK_N pre-activation columns, i.e. BLOCK_F = BLOCK_N // 2 columns of h. The
    # epilogue runs in two halves of BLOCK_F // 2 h columns each, to bound registers and store buffers.
    BLOCK_F: tl.constexpr = BLOCK_N // 2
    QUARTER: tl.constexpr = BLOCK_F // 2
    tiles_n = tl.cdiv(F, BLOCK_F)
    k_tiles = tl.cdiv(K, BLOCK_K)
    e, starts, ends, tiles, tiles_end, total = _group_table(offs_ptr, M, E, tiles_n, BLOCK_M, BLOCK_E, ZERO_TAIL)

    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
        g, start, end, row, pid_n = _locate(tile, e, starts, ends, tiles, tiles_end, tiles_n, BLOCK_M, GROUP_M)
        j = pid_n * BLOCK_F  # first h column of the tile
        real = g < E  # group E: rows past offs[-1], which get aux = h = 0
        k_iters = tl.where(real, k_tiles, 0)
        gb = tl.minimum(g, E - 1)
        if a_index is not None:
            a_rows = _gather_rows_of(a_index, row, end, BLOCK_M)
        else:
            a_rows = None
        if row_scale is not None:
            rows = row + tl.arange(0, BLOCK_M)
            scale = tl.load(row_scale + rows, mask=rows < end, other=0.0)
        else:
            scale = None
        if HALVES:
            acc_g = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
            acc_l = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
            acc_g, acc_l = _mainloop_pair(a, b, acc_g, acc_l, g, row, j, F + j, k_iters, M, 2 * F, K,
                                          stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                                          BLOCK_M, BLOCK_F, BLOCK_K, B_TRANS, USE_TMA, DOT_F32, a_rows)
            acc_g = _add_bias(acc_g, bias, stride_bias_e, gb, j, tl.where(real, F, 0), BLOCK_F)
            acc_l = _add_bias(acc_l, bias, stride_bias_e, gb, F + j, tl.where(real, 2 * F, 0), BLOCK_F)
            g_lo, g_hi = _halves(acc_g, BLOCK_M, BLOCK_F)
            l_lo, l_hi = _halves(acc_l, BLOCK_M, BLOCK_F)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _mainloop(a, b, acc, g, row, 2 * j, k_iters, M, 2 * F, K,
                            stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS, USE_TMA, DOT_F32, a_rows)
            acc = _add_bias(acc, bias, stride_bias_e, gb, 2 * j, tl.where(real, 2 * F, 0), BLOCK_N)
            g_lo, g_hi = _halves(acc, BLOCK_M, BLOCK_N)  # each holds QUARTER whole (gate, linear) pairs
            l_lo, l_hi = g_lo, g_hi
        _swiglu_epilogue(g_lo, l_lo, aux_a, aux_b, h, real, end, row, j, F, stride_aux_m, stride_h_m, scale,
                         BLOCK_M, QUARTER, USE_TMA, OUT_DTYPE, ALPHA, LIMIT, OFFSET, HALVES)
        _swiglu_epilogue(g_hi, l_hi, aux_a, aux_b, h, real, end, row, j + QUARTER, F, stride_aux_m, stride_h_m,
                         scale, BLOCK_M, QUARTER, USE_TMA, OUT_DTYPE, ALPHA, LIMIT, OFFSET, HALVES)


@triton.jit
def _grouped_colsum_kernel(
    x, offs_ptr, out, M, N, E, stride_xm, stride_oe,  # x (M, N) rows ragged by offs; out (E, N) fp32
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    g = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), M)
    start = tl.minimum(tl.maximum(tl.load(offs_ptr + g - 1, mask=g > 0, other=0), 0), end)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r in range(start, end, BLOCK_R):
        acc += _load_2d(x, 0, r, tl.program_id(0) * BLOCK_C, end, N, stride_xm, 1, BLOCK_R, BLOCK_C).to(tl.float32)
    tl.store(out + g.to(tl.int64) * stride_oe + cols, tl.sum(acc, 0), mask=cols < N)

"""SwiGLU fused with NVFP4 quantization of its output h (the format: ``moekit.nvfp4``).

* ``_swiglu_quantize_kernel``: a (M, 2F) pre-activation in any gate/up layout -> h = SwiGLU(pre),
  quantized along F to packed e2m1 codes (M, F / 2) and e4m3 block scales (M, F / 16).
* ``_grouped_mm_swiglu_nvfp4_kernel``: the up-projection ``pre = x @ w_up[g]`` over ragged expert rows
  (the tiling of ``_grouped_mm_swiglu_kernel``), whose epilogue applies SwiGLU and writes h as NVFP4.

Both compute h with ``swiglu_apply``, round it to the activation dtype (what the unfused path's h
holds), and quantize it with ``nvfp4_quantize_tile``: their bytes are those of ``nvfp4.quantize`` of
``moekit.swiglu(pre)`` (or of ``grouped_mm_swiglu``'s h) on the same device. A tile of h spans whole
16-element blocks (BLOCK_F a multiple of 16, F % 16 == 0), so no scale straddles two programs.

Gate/up layouts of the (M, 2F) pre-activation (``LAYOUT``, a string constexpr):
- ``"interleaved"``: gate, up = pre[:, 0::2], pre[:, 1::2];
- ``"halves"``: gate, up = pre[:, :F], pre[:, F:];
- ``"interleaved8"``: 8 gate columns, then 8 up columns, and so on (``nvfp4.interleave8_ref``).
"""

import triton
import triton.language as tl

from .epilogue import _load_pairs, split_pairs, swiglu_apply
from .experts import _mainloop_pair
from .grouped_gemm import _add_bias, _group_table, _locate, _mainloop
from .nvfp4 import _read_global_scale, nvfp4_quantize_tile


@triton.jit
def _load_gate_up(pre, rows, j, F, stride_m, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, LAYOUT: tl.constexpr):
    """Gate and up values (fp32, [BLOCK_R, BLOCK_F]) for h columns [j, j + BLOCK_F) of a (M, 2F) tensor
    with unit column stride; rows < 0 and columns >= F read 0."""
    if LAYOUT == "interleaved8":
        c = j + tl.arange(0, BLOCK_F)
        gate_col = (c // 8) * 16 + c % 8  # 8 contiguous elements per run: 16-byte vector loads
        ptrs = pre + rows[:, None].to(tl.int64) * stride_m + gate_col[None, :]
        mask = (rows[:, None] >= 0) & (c[None, :] < F)
        gate = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        lin = tl.load(ptrs + 8, mask=mask, other=0.0).to(tl.float32)
    else:
        gate, lin = _load_pairs(pre, rows, j, F, stride_m, BLOCK_R, BLOCK_F, LAYOUT == "halves")
    return gate, lin


@triton.jit
def _quantize_h(gate, lin, g, H_DTYPE: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
                OFFSET: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """SwiGLU of a [BLOCK_R, BLOCK_F] tile, rounded to ``H_DTYPE`` (as the unfused h is stored) and
    quantized with global scale g -> (packed codes [BLOCK_R, BLOCK_F / 2], scale codes
    [BLOCK_R, BLOCK_F / 16]), both uint8."""
    h = swiglu_apply(gate, lin, ALPHA, LIMIT, OFFSET).to(H_DTYPE).to(tl.float32)
    return nvfp4_quantize_tile(h, g, BLOCK_R, BLOCK_F, False)


@triton.jit
def _store_nvfp4(values, scales, rows, row_ok, j, F, packed, s_code, BLOCK_F: tl.constexpr):
    """Store a tile's packed codes and scale codes at h columns [j, j + BLOCK_F) of rows ``rows``
    (where ``row_ok``): values (M, F / 2) and scales (M, F / 16), contiguous uint8."""
    r = rows[:, None].to(tl.int64)
    vcols = j // 2 + tl.arange(0, BLOCK_F // 2)
    tl.store(values + r * (F // 2) + vcols[None, :], packed, mask=row_ok[:, None] & (vcols < F // 2)[None, :])
    scols = j // 16 + tl.arange(0, BLOCK_F // 16)
    tl.store(scales + r * (F // 16) + scols[None, :], s_code, mask=row_ok[:, None] & (scols < F // 16)[None, :])


@triton.jit
def _swiglu_quantize_kernel(
    pre, values, scales, gscale,  # pre (M, 2F), unit column stride; gscale (1,) fp32
    # values (M, F/2) and scales (M, F/16) uint8 out
    M, F, stride_pre_m,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr, LAYOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.where(rows < M, rows, -1)  # -1: read as 0 by _load_gate_up, not stored
    j = tl.program_id(1) * BLOCK_F
    gate, lin = _load_gate_up(pre, rows, j, F, stride_pre_m, BLOCK_M, BLOCK_F, LAYOUT)
    packed, s_code = _quantize_h(gate, lin, _read_global_scale(gscale), pre.dtype.element_ty, ALPHA, LIMIT, OFFSET,
                                 BLOCK_M, BLOCK_F)
    _store_nvfp4(values, scales, rows, rows >= 0, j, F, packed, s_code, BLOCK_F)


@triton.jit
def _split_gate_up(acc, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, LAYOUT: tl.constexpr):
    """A [BLOCK_M, 2 * BLOCK_F] pre-activation tile in the interleaved or interleaved8 layout -> gate and
    up [BLOCK_M, BLOCK_F] (BLOCK_F a multiple of 8 for interleaved8)."""
    if LAYOUT == "interleaved8":
        runs = tl.permute(tl.reshape(acc, [BLOCK_M, BLOCK_F // 8, 2, 8]), [0, 1, 3, 2])
        gate, up = tl.split(runs)
        gate = tl.reshape(gate, [BLOCK_M, BLOCK_F])
        up = tl.reshape(up, [BLOCK_M, BLOCK_F])
    else:
        gate, up = split_pairs(acc, BLOCK_M, BLOCK_F)
    return gate, up


@triton.jit
def _grouped_mm_swiglu_nvfp4_kernel(
    a, b, values, scales,  # a (M, D); b (E, D, 2F); values (M, F/2) and scales (M, F/16) uint8 out
    offs_ptr, bias, gscale,  # offs (E,) int32 row ends; bias (E, 2F) or None; gscale (1,) fp32
    M, F, K, E,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_bias_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, FLATTEN: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr, LAYOUT: tl.constexpr,
):
    # The tile walk of _grouped_mm_swiglu_kernel: BLOCK_N pre-activation columns, BLOCK_F = BLOCK_N // 2
    # columns of h (a multiple of 16: whole scale blocks), group E the rows past offs[-1] (h = 0, which
    # quantizes to zero codes and zero scales). The epilogue rounds pre to OUT_DTYPE first, as the
    # unfused kernel's aux, so h is the bits that kernel would store.
    BLOCK_F: tl.constexpr = BLOCK_N // 2
    tiles_n = tl.cdiv(F, BLOCK_F)
    k_tiles = tl.cdiv(K, BLOCK_K)
    e, starts, ends, tiles, tiles_end, total = _group_table(offs_ptr, M, E, tiles_n, BLOCK_M, BLOCK_E)
    g_scale = _read_global_scale(gscale)

    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
        g, start, end, row, pid_n = _locate(tile, e, starts, ends, tiles, tiles_end, tiles_n, BLOCK_M, GROUP_M)
        j = pid_n * BLOCK_F  # first h column of the tile
        real = g < E
        k_iters = tl.where(real, k_tiles, 0)
        gb = tl.minimum(g, E - 1)
        if LAYOUT == "halves":
            acc_g = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
            acc_l = tl.zeros((BLOCK_M, BLOCK_F), dtype=tl.float32)
            acc_g, acc_l = _mainloop_pair(a, b, acc_g, acc_l, g, row, j, F + j, k_iters, M, 2 * F, K,
                                          stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                                          BLOCK_M, BLOCK_F, BLOCK_K, B_TRANS, USE_TMA, DOT_F32)
            acc_g = _add_bias(acc_g, bias, stride_bias_e, gb, j, tl.where(real, F, 0), BLOCK_F)
            acc_l = _add_bias(acc_l, bias, stride_bias_e, gb, F + j, tl.where(real, 2 * F, 0), BLOCK_F)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc = _mainloop(a, b, acc, g, row, 2 * j, k_iters, M, 2 * F, K,
                            stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                            BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS, USE_TMA, DOT_F32)
            acc = _add_bias(acc, bias, stride_bias_e, gb, 2 * j, tl.where(real, 2 * F, 0), BLOCK_N)
            acc_g, acc_l = _split_gate_up(acc, BLOCK_M, BLOCK_F, LAYOUT)
        gate = acc_g.to(OUT_DTYPE).to(tl.float32)
        lin = acc_l.to(OUT_DTYPE).to(tl.float32)
        packed, s_code = _quantize_h(gate, lin, g_scale, OUT_DTYPE, ALPHA, LIMIT, OFFSET, BLOCK_M, BLOCK_F)
        s_code = tl.where(real, s_code, 0)  # the tail's zero h has zero scales whatever the global scale
        rows = row + tl.arange(0, BLOCK_M)
        _store_nvfp4(values, scales, rows, rows < end, j, F, packed, s_code, BLOCK_F)

"""The rows-ragged grouped GEMM on blockwise FP8 operands (``moekit.fp8.gemm``).

out[m, n] = sum over 128-wide K groups kb of (a[m, kb] . b[e, n, kb]) * a_scale[m, kb] * b_scale[e, n // 128, kb],
with e the expert of row m. Each K group's partial product comes from the tensor cores in fp32 and is
promoted into the fp32 accumulator with its two scales (Hopper's FP8 accumulator keeps ~14 bits, so the
recipe promotes every 128 of K). One program per (row tile of one expert, 128 output columns): the row
tiles are each expert's rows in tiles of BLOCK_M, found on the device from ``offs``; the programs past
the last expert's tiles zero the rows past offs[-1]. Not persistent, no warp specialization.

Operands: with USE_TMA, ``a`` is a TMA descriptor over a (M, K) e4m3 and ``b`` one over b viewed as
(E * N, K), boxes (BLOCK_M, BLOCK_K) and (BLOCK_N, BLOCK_K); a tile's rows past its expert's end and
columns past N are read (the next expert's, or zeros past the tensor) but never stored. Otherwise both
are their e4m3 bytes (uint8) read through masked pointers, bitcast to e4m3 (the interpreter's path: it
reads fp8 exactly from bytes).
"""

import triton
import triton.language as tl


@triton.jit
def _grouped_mm_fp8_kernel(
    a, a_scales, b, b_scales, offs, out,  # a (M, K) e4m3 bytes, a_scales (M, GK) fp32; offs (E,) int32
    M, N, K, E,  # b (E, N, K) e4m3 bytes, unit stride along K; b_scales (E, GN, GK) fp32, unit stride along GK
    stride_am, stride_as, stride_be, stride_bn, stride_bse, stride_bsn, stride_om,  # out (M, N)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    t, pn = tl.program_id(0), tl.program_id(1)
    ex = tl.arange(0, BLOCK_E)
    in_e = ex < E
    end = tl.minimum(tl.maximum(tl.load(offs + ex, mask=in_e, other=0), 0), M)
    start = tl.minimum(tl.maximum(tl.load(offs + ex - 1, mask=in_e & (ex > 0), other=0), 0), M)
    tiles = tl.cumsum(tl.where(in_e, (tl.maximum(end - start, 0) + BLOCK_M - 1) // BLOCK_M, 0), 0)
    e = tl.sum((in_e & (tiles <= t)).to(tl.int32), 0)  # this tile's expert (E: past the last tile)
    first = tl.sum(tl.where(ex == e - 1, tiles, 0), 0)
    row0 = tl.sum(tl.where(ex == e, start, 0), 0) + (t - first) * BLOCK_M
    row_end = tl.minimum(row0 + BLOCK_M, tl.sum(tl.where(ex == e, end, 0), 0))
    tail = e == E  # a slice of the rows past offs[-1], written as zeros
    row0 = tl.where(tail, tl.sum(tl.where(ex == E - 1, end, 0), 0)
                    + (t - tl.sum(tl.where(ex == E - 1, tiles, 0), 0)) * BLOCK_M, row0)
    row_end = tl.where(tail, M, row_end)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    r64 = rows.to(tl.int64)
    if not USE_TMA:
        a_rows = a + r64[:, None] * stride_am
        b_cols = b + e.to(tl.int64) * stride_be + cols[:, None].to(tl.int64) * stride_bn
    for kb in range(0, tl.where(tail, 0, tl.cdiv(K, BLOCK_K))):
        if USE_TMA:
            x = a.load([row0, kb * BLOCK_K])
            w = b.load([e * N + pn * BLOCK_N, kb * BLOCK_K])
        else:
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
            w = tl.load(b_cols + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
            x, w = x.to(tl.float8e4nv, bitcast=True), w.to(tl.float8e4nv, bitcast=True)
        part = tl.dot(x, tl.trans(w))  # (BLOCK_M, BLOCK_N) fp32
        sa = tl.load(a_scales + r64 * stride_as + kb, mask=row_ok, other=0.0)
        sb = tl.load(b_scales + e.to(tl.int64) * stride_bse + pn * stride_bsn + kb)  # BLOCK_N = 128: one
        acc += part * (sa[:, None] * sb)
    tl.store(out + r64[:, None] * stride_om + cols[None, :], acc.to(out.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])

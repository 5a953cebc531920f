"""The grouped GEMMs on blockwise FP8 operands (``moekit.fp8.gemm``): the rows-ragged one
(``_grouped_mm_fp8_kernel``, below) and the weight gradient over each expert's rows
(``_weight_grad_fp8_kernel``, its own docstring).

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


@triton.jit
def _weight_grad_fp8_kernel(
    dy_t, dy_scales, x_t, x_scales, offs, out,  # dy_t (N, M), x_t (K, M) e4m3 bytes; offs (E,) int32
    M, N, K, E,  # dy_scales (G, N), x_scales (G, K) fp32, G = cdiv(M, 128) + E; out (E, N, K)
    stride_dy, stride_dys, stride_x, stride_xs, stride_oe, stride_on,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """out[e, n, k] = sum over expert e's 128-row groups g (``quantize_ragged_t``'s: an expert's rows from
    its start, the last group its tail) of (dy_t[n, g] . x_t[k, g]) * dy_scale[g, n] * x_scale[g, k]: a
    weight gradient dY_e^T X_e, each group's fp32 partial product promoted with its two scales. One
    program per (expert, BLOCK_N x BLOCK_K output tile); an expert without rows writes zeros.

    The rows run along the operands' unit stride, and an expert's groups start anywhere: the loads walk
    128-aligned windows of rows (vectorized), each of which holds parts of at most two of the expert's
    groups; x's rows outside a group are zeroed in registers, a product per group (the second only where
    the window holds one). Zeroed codes suffice on one operand: e4m3 codes are finite."""
    pid = tl.program_id(0)
    tiles_n, tiles_k = tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K)
    e = pid // (tiles_n * tiles_k)
    pn = pid % (tiles_n * tiles_k) // tiles_k
    pk = pid % tiles_k
    ex = tl.arange(0, BLOCK_E)
    in_e = ex < E
    end = tl.minimum(tl.maximum(tl.load(offs + ex, mask=in_e, other=0), 0), M)
    start = tl.minimum(tl.maximum(tl.load(offs + ex - 1, mask=in_e & (ex > 0), other=0), 0), end)
    groups = tl.where(in_e, (end - start + GROUP - 1) // GROUP, 0)
    first = tl.sum(tl.where(ex == e, tl.cumsum(groups, 0) - groups, 0), 0)  # e's first group
    row_start = tl.sum(tl.where(ex == e, start, 0), 0)
    row_end = tl.sum(tl.where(ex == e, end, 0), 0)
    ns = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok, k_ok = ns < N, ks < K
    dy_rows = dy_t + ns[:, None].to(tl.int64) * stride_dy
    x_rows = x_t + ks[:, None].to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    lo = row_start // GROUP * GROUP
    for w in range(lo, row_end, GROUP):
        w = tl.multiple_of(w, GROUP)
        rows = w + tl.arange(0, GROUP)
        dy = tl.load(dy_rows + rows[None, :], mask=n_ok[:, None] & (rows < M)[None, :], other=0)
        xx = tl.load(x_rows + rows[None, :], mask=k_ok[:, None] & (rows < M)[None, :], other=0)
        dy = dy.to(tl.float8e4nv, bitcast=True)
        j = tl.maximum(w - row_start, 0) // GROUP  # the expert's group holding the window's first row in it
        split = tl.minimum(row_start + (j + 1) * GROUP, row_end)  # where group j ends in this window
        in_a = (rows >= row_start) & (rows < split)
        xa = tl.where(in_a[None, :], xx, 0).to(tl.float8e4nv, bitcast=True)
        part = tl.dot(dy, tl.trans(xa))
        g = (first + j).to(tl.int64)
        sd = tl.load(dy_scales + g * stride_dys + ns, mask=n_ok, other=0.0)
        sx = tl.load(x_scales + g * stride_xs + ks, mask=k_ok, other=0.0)
        acc += part * (sd[:, None] * sx[None, :])
        if split < tl.minimum(w + GROUP, row_end):  # the window also holds group j + 1's first rows
            in_b = (rows >= split) & (rows < row_end)
            xb = tl.where(in_b[None, :], xx, 0).to(tl.float8e4nv, bitcast=True)
            part = tl.dot(dy, tl.trans(xb))
            sd = tl.load(dy_scales + (g + 1) * stride_dys + ns, mask=n_ok, other=0.0)
            sx = tl.load(x_scales + (g + 1) * stride_xs + ks, mask=k_ok, other=0.0)
            acc += part * (sd[:, None] * sx[None, :])
    ptrs = out + e.to(tl.int64) * stride_oe + ns[:, None].to(tl.int64) * stride_on + ks[None, :]
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])

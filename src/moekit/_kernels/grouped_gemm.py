"""Persistent grouped GEMM kernels over ragged expert groups.

Two kernels cover every form of ``moekit.grouped_mm``:

* ``_grouped_mm_ragged_m_kernel``: ``c[rows_g] = a[rows_g] @ b[g]``, rows of ``a`` split into groups by
  ``offs`` (forward and dgrad). Rows at or past ``offs[-1]`` are written as zeros.
* ``_grouped_mm_ragged_k_kernel``: ``c[g] = a[:, ks_g:ke_g] @ b[ks_g:ke_g]``, the reduction dim split by
  ``offs`` (wgrad). An empty group gets an exact zero.

Both run one program per SM, walk a tile list that only exists on the device (derived from ``offs``),
and never read the host. Memory access goes through either TMA tensor descriptors (Hopper) or plain
masked pointers (any other target and the CPU interpreter), chosen by the ``USE_TMA`` constexpr.

Row-bounded descriptors: a group's rows end at a run-time ``end``; TMA can only bound a box by a
descriptor's static shape. ``descriptors.row_bounded`` (host side) prepends two dimensions whose
strides wrap around in 64-bit address arithmetic, so that the coordinates
``(BIG, end, BIG - end + row)`` address row ``row`` while the hardware bounds check on the third
coordinate (``< BIG``) becomes ``row < end``. Reads past ``end`` return zeros and writes past it are
dropped. The idea is the one behind ``triton.tools.ragged_tma``; this is a separate, interpreter-safe
formulation with a single upper bound.
"""

import triton
import triton.language as tl

ROW_BOUND_BIG = tl.constexpr(1 << 30)  # the BIG of the row-bounded descriptors (module docstring)


# --------------------------------------------------------------------------------------------------
# tile helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def _swizzle(local, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Map a tile index inside one group to (pid_m, pid_n), GROUP_M row-tiles at a time for L2 reuse."""
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (local % width) % rows
    pid_n = (local % width) // rows
    return pid_m, pid_n


@triton.jit
def _bounded_load(desc, end, row, col, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Load a [BLOCK_R, BLOCK_C] box at (row, col) from a row-bounded descriptor; rows >= end read 0."""
    x = desc.load([ROW_BOUND_BIG, end, ROW_BOUND_BIG - end + row, col])
    return tl.reshape(x, [BLOCK_R, BLOCK_C])


@triton.jit
def _bounded_store(desc, end, row, col, x, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Store a [BLOCK_R, BLOCK_C] box at (row, col) into a row-bounded descriptor; rows >= end drop."""
    desc.store([ROW_BOUND_BIG, end, ROW_BOUND_BIG - end + row, col], tl.reshape(x, [1, 1, BLOCK_R, BLOCK_C]))


@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split a [BLOCK_M, BLOCK_N] tile into its left and right [BLOCK_M, BLOCK_N // 2] halves."""
    return tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1]))


@triton.jit
def _load_2d(src, base, row, col, row_end, col_end, stride_r, stride_c,
             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pointer path: the [BLOCK_R, BLOCK_C] tile at (row, col) of ``src + base``; out of range reads 0."""
    rows = row + tl.arange(0, BLOCK_R)
    cols = col + tl.arange(0, BLOCK_C)
    ptrs = src + base + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
    mask = (rows[:, None] < row_end) & (cols[None, :] < col_end)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _gather_rows_of(index, row, row_end, BLOCK_R: tl.constexpr):
    """Source rows index[row : row + BLOCK_R] (int64), -1 past ``row_end``: the permute-free dispatch."""
    r = row + tl.arange(0, BLOCK_R)
    return tl.load(index + r, mask=r < row_end, other=-1).to(tl.int64)


@triton.jit
def _load_gathered(src, src_rows, col, col_end, stride_r, stride_c, BLOCK_C: tl.constexpr):
    """[len(src_rows), BLOCK_C] tile of ``src`` whose rows are ``src_rows`` (-1: a zero row)."""
    cols = col + tl.arange(0, BLOCK_C)
    ptrs = src + src_rows[:, None] * stride_r + cols[None, :].to(tl.int64) * stride_c
    return tl.load(ptrs, mask=(src_rows[:, None] >= 0) & (cols[None, :] < col_end), other=0.0)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    # The CPU interpreter computes tl.dot on bf16/fp16 operands wrongly; upcast there.
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


# --------------------------------------------------------------------------------------------------
# 2D x 3D: rows ragged (forward, dgrad); the pieces the fused expert kernels share
# --------------------------------------------------------------------------------------------------
@triton.jit
def _group_table(offs_ptr, M, E, tiles_n, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                 ZERO_TAIL: tl.constexpr = True):
    """Per-group row ranges and tile counts, in registers: E real groups plus group E, the tail rows
    [offs[-1], M) that get zeros (no tiles without ZERO_TAIL: the tail is left unwritten). Returns
    (e, starts, ends, tiles, tiles_end, total)."""
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e, mask=e < E, other=M)
    starts = tl.load(offs_ptr + e - 1, mask=(e >= 1) & (e <= E), other=0)
    starts = tl.where(e > E, M, starts)
    ends = tl.minimum(tl.maximum(ends, 0), M)  # clamp: a bad offs must never write out of bounds
    starts = tl.minimum(tl.maximum(starts, 0), ends)
    tiles = tl.cdiv(ends - starts, BLOCK_M) * tiles_n
    if not ZERO_TAIL:
        tiles = tl.where(e < E, tiles, 0)
    tiles_end = tl.cumsum(tiles, 0)
    return e, starts, ends, tiles, tiles_end, tl.sum(tiles, 0)


@triton.jit
def _locate(tile, e, starts, ends, tiles, tiles_end, tiles_n, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile index -> (group, group start row, group end row, tile's first row, pid_n)."""
    g = tl.sum((tiles_end <= tile).to(tl.int32), 0)
    hit = e == g
    first = tl.sum(tl.where(hit, tiles_end - tiles, 0), 0)
    start = tl.sum(tl.where(hit, starts, 0), 0)
    end = tl.sum(tl.where(hit, ends, 0), 0)
    pid_m, pid_n = _swizzle(tile - first, tl.cdiv(end - start, BLOCK_M), tiles_n, GROUP_M)
    return g, start, end, start + pid_m * BLOCK_M, pid_n


@triton.jit
def _load_a(a, a_rows, row, k, M, K, stride_am, stride_ak,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr):
    """The [BLOCK_M, BLOCK_K] A tile at (row, k): gathered rows (``a_rows`` not None), TMA, or pointers."""
    if a_rows is not None:  # permute-free gather: TMA cannot gather on Hopper, so plain loads
        tile = _load_gathered(a, a_rows, k, K, stride_am, stride_ak, BLOCK_K)
    elif USE_TMA:
        tile = a.load([row, k])
    else:
        tile = _load_2d(a, 0, row, k, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K)
    return tile


@triton.jit
def _load_b(b, b_base, g, k, col, K, N, stride_bk, stride_bn,
            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, B_TRANS: tl.constexpr, USE_TMA: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile at (k, col) of expert g's weights b[g] (E, K, N)."""
    if USE_TMA:
        if B_TRANS:  # memory is (E, N, K): read [BLOCK_N, BLOCK_K] and transpose
            tile = tl.reshape(b.load([g, col, k]), [BLOCK_N, BLOCK_K]).T
        else:
            tile = tl.reshape(b.load([g, k, col]), [BLOCK_K, BLOCK_N])
    else:
        tile = _load_2d(b, b_base, k, col, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N)
    return tile


@triton.jit
def _mainloop(
    a, b, acc, g, row, col, k_iters, M, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    B_TRANS: tl.constexpr, USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, a_rows=None,
):
    """acc += a[row:row+BM, :] @ b[g][:, col:col+BN] over ``k_iters`` steps of BLOCK_K.

    ``a_rows`` (BLOCK_M,) int64 or None: read A's rows from those rows of the pointer ``a`` instead."""
    b_base = g.to(tl.int64) * stride_be
    for ki in range(k_iters):
        k = ki * BLOCK_K
        a_tile = _load_a(a, a_rows, row, k, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K, USE_TMA)
        b_tile = _load_b(b, b_base, g, k, col, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N, B_TRANS, USE_TMA)
        acc = _dot(a_tile, b_tile, acc, DOT_F32)
    return acc


@triton.jit
def _store_rows(dst, stride_m, end, row, col, n_end, x, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                USE_TMA: tl.constexpr):
    """Write a [BLOCK_R, BLOCK_C] tile at (row, col); rows >= end and cols >= n_end are dropped.
    TMA path: ``dst`` is a row-bounded descriptor; pointer path: a pointer with unit column stride."""
    if USE_TMA:
        _bounded_store(dst, end, row, col, x.to(dst.dtype), BLOCK_R, BLOCK_C)
    else:
        rows = row + tl.arange(0, BLOCK_R)
        cols = col + tl.arange(0, BLOCK_C)
        ptrs = dst + rows[:, None].to(tl.int64) * stride_m + cols[None, :]
        tl.store(ptrs, x.to(dst.dtype.element_ty), mask=(rows[:, None] < end) & (cols[None, :] < n_end))


@triton.jit
def _load_rows(src, stride_m, end, row, col, n_end, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Read a [BLOCK_R, BLOCK_C] tile at (row, col); rows >= end and cols >= n_end read 0."""
    # (an explicit else: Triton compiles the code after a constexpr-guarded return as well)
    if USE_TMA:
        x = _bounded_load(src, end, row, col, BLOCK_R, BLOCK_C)
    else:
        x = _load_2d(src, 0, row, col, end, n_end, stride_m, 1, BLOCK_R, BLOCK_C)
    return x


@triton.jit
def _add_bias(acc, bias, stride_bias_e, g, col, n_end, BLOCK_N: tl.constexpr):
    """acc + bias[g, col:col+BLOCK_N] (fp32) broadcast over rows; ``bias=None`` leaves acc as is."""
    if bias is not None:
        cols = col + tl.arange(0, BLOCK_N)
        vals = tl.load(bias + g.to(tl.int64) * stride_bias_e + cols, mask=cols < n_end, other=0.0)
        acc = acc + vals.to(tl.float32)[None, :]
    return acc


@triton.jit
def _grouped_mm_ragged_m_kernel(
    a, b, c, offs_ptr, bias,  # a (M, K); b (E, K, N); c (M, N); offs (E,) int32 row ends; bias (E, N) or None
    group_scale,  # None, or (E,) fp32: each group's product is multiplied by its scale (before the bias)
    # TMA path: a is a (M, K) descriptor, b an (E, K, N) one or, with B_TRANS, (E, N, K); c is
    # row-bounded. Pointer path: raw pointers and the strides below.
    M, N, K, E,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_bias_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    B_TRANS: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, FLATTEN: tl.constexpr, SPLIT_STORE: tl.constexpr,
    ZERO_TAIL: tl.constexpr,  # rows past offs[-1] of c: zeros, or left unwritten
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    e, starts, ends, tiles, tiles_end, total = _group_table(offs_ptr, M, E, tiles_n, BLOCK_M, BLOCK_E, ZERO_TAIL)

    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0), flatten=FLATTEN):
        g, start, end, row, pid_n = _locate(tile, e, starts, ends, tiles, tiles_end, tiles_n, BLOCK_M, GROUP_M)
        col = pid_n * BLOCK_N
        real = g < E  # group E is the tail: zeros, no bias
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _mainloop(a, b, acc, g, row, col, tl.where(real, k_tiles, 0), M, N, K,
                        stride_am, stride_ak, stride_be, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS, USE_TMA, DOT_F32)
        if group_scale is not None:  # the tail stays 0 even for a non-finite scale
            acc = tl.where(real, acc * tl.load(group_scale + tl.minimum(g, E - 1)), 0.0)
        if bias is not None:
            acc = _add_bias(acc, bias, stride_bias_e, tl.minimum(g, E - 1), col, tl.where(real, N, 0), BLOCK_N)
        if SPLIT_STORE:  # half the epilogue's shared memory, which buys a pipeline stage
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            _store_rows(c, stride_cm, end, row, col, N, left, BLOCK_M, BLOCK_N // 2, USE_TMA)
            _store_rows(c, stride_cm, end, row, col + BLOCK_N // 2, N, right, BLOCK_M, BLOCK_N // 2, USE_TMA)
        else:
            _store_rows(c, stride_cm, end, row, col, N, acc, BLOCK_M, BLOCK_N, USE_TMA)


# --------------------------------------------------------------------------------------------------
# 2D x 2D: reduction dim ragged (wgrad)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _grouped_mm_ragged_k_kernel(
    a, b, c, offs_ptr,  # a (M, Kt); b (Kt, N); c (E, M, N) or (E, M - 1, N); offs (E,) int32 cumulative ends along Kt
    colsum,  # None, or (E, N) fp32: a's last row is all ones, and its output row goes here, not to c
    M, N, KT, E,
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_ce, stride_cm, stride_cn, stride_colsum_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_F32: tl.constexpr, FLATTEN: tl.constexpr, SPLIT_STORE: tl.constexpr,
):
    # On the TMA path the launcher hands over a with its unit stride along M and b with its unit
    # stride along N, so the ragged reduction dim is the memory-row axis of both descriptors and can
    # be row-bounded: rows of the next group read as zero, whatever they hold.
    # ``colsum``: a row of ones appended to a makes row M - 1 of each group's product the per-group
    # column sums of b (a bias gradient) at the cost of one row of a tile that is usually padding.
    pid = tl.program_id(0)
    m_c = M - 1 if colsum is not None else M  # rows of c
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = tiles_m * tiles_n
    total = E * per_group

    for tile in tl.range(pid, total, tl.num_programs(0), flatten=FLATTEN):
        g = tile // per_group
        pid_m, pid_n = _swizzle(tile % per_group, tiles_m, tiles_n, GROUP_M)
        row = pid_m * BLOCK_M
        col = pid_n * BLOCK_N
        k_end = tl.minimum(tl.maximum(tl.load(offs_ptr + g), 0), KT)
        k_start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        k_start = tl.minimum(tl.maximum(k_start, 0), k_end)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            if USE_TMA:
                a_tile = _bounded_load(a, k_end, k, row, BLOCK_K, BLOCK_M).T
                b_tile = _bounded_load(b, k_end, k, col, BLOCK_K, BLOCK_N)
            else:
                a_tile = _load_2d(a, 0, row, k, M, k_end, stride_am, stride_ak, BLOCK_M, BLOCK_K)
                b_tile = _load_2d(b, 0, k, col, k_end, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N)
            acc = _dot(a_tile, b_tile, acc, DOT_F32)

        if colsum is not None:
            if (m_c >= row) & (m_c < row + BLOCK_M):  # this tile holds the ones row's output
                # (any second read of acc lifts ptxas' register count from ~154 to ~254, with no
                # spills: benchmarks/compiler_report.py, "tma ones-row")
                rows = row + tl.arange(0, BLOCK_M)
                sums = tl.sum(tl.where(rows[:, None] == m_c, acc, 0.0), 0)
                cols = col + tl.arange(0, BLOCK_N)
                tl.store(colsum + g.to(tl.int64) * stride_colsum_e + cols, sums, mask=cols < N)
        if USE_TMA:  # c's descriptor has m_c rows: the ones row's output is dropped by the bounds check
            if SPLIT_STORE:
                left, right = _halves(acc, BLOCK_M, BLOCK_N)
                c.store([g, row, col], tl.reshape(left.to(c.dtype), [1, BLOCK_M, BLOCK_N // 2]))
                c.store([g, row, col + BLOCK_N // 2], tl.reshape(right.to(c.dtype), [1, BLOCK_M, BLOCK_N // 2]))
            else:
                c.store([g, row, col], tl.reshape(acc.to(c.dtype), [1, BLOCK_M, BLOCK_N]))
        else:
            out = acc.to(c.dtype.element_ty)
            rows = row + tl.arange(0, BLOCK_M)
            cols = col + tl.arange(0, BLOCK_N)
            ptrs = (c + g.to(tl.int64) * stride_ce + rows[:, None].to(tl.int64) * stride_cm
                    + cols[None, :] * stride_cn)
            tl.store(ptrs, out, mask=(rows[:, None] < m_c) & (cols[None, :] < N))

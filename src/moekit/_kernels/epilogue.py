"""Epilogue device functions shared by the fused GEMMs and the standalone kernels, plus those kernels.

The SwiGLU math lives here once: ``swiglu_apply`` is called by the up-projection's epilogue and by
``_swiglu_kernel``; ``swiglu_apply_bwd`` by ``_swiglu_bwd_kernel``, which the down-projection's
backward runs right after its dgrad GEMM. Their torch twins are in ``moekit.epilogue``.
"""

import triton
import triton.language as tl


@triton.jit
def swiglu_apply(g, lin, ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr):
    """h = g_c * sigmoid(ALPHA * g_c) * (l_c + OFFSET), g_c = min(g, LIMIT), l_c = clamp(l, +-LIMIT).

    LIMIT=None turns both clamps off. Inputs and result are fp32. NaN stays NaN, as in torch.clamp."""
    if LIMIT is not None:
        g, lin = _clamp_gate_linear(g, lin, LIMIT)
    return g * tl.sigmoid(ALPHA * g) * (lin + OFFSET)


@triton.jit
def _clamp_gate_linear(g, lin, LIMIT: tl.constexpr):
    """(min(g, LIMIT), clamp(lin, +-LIMIT)) as selects, which keep a NaN input NaN as torch.clamp does:
    ``tl.minimum`` compiles to ``min.f32`` on the GPU, which returns the other operand for a NaN (the
    interpreter's numpy minimum would propagate it, so the two would disagree)."""
    g = tl.where(g > LIMIT, LIMIT, g)
    lin = tl.where(lin > LIMIT, LIMIT, tl.where(lin < -LIMIT, -LIMIT, lin))
    return g, lin


@triton.jit
def swiglu_apply_bwd(g, lin, dh, ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr):
    """(dg, dl, h) for the SwiGLU above. Clamp masks follow torch.clamp's backward: the gradient
    passes where the input lies within the bounds, bounds included."""
    if LIMIT is not None:
        pass_g = g <= LIMIT
        pass_l = (lin >= -LIMIT) & (lin <= LIMIT)
        g, lin = _clamp_gate_linear(g, lin, LIMIT)
    s = tl.sigmoid(ALPHA * g)
    gs = g * s
    lo = lin + OFFSET
    dg = dh * lo * (s + ALPHA * gs * (1.0 - s))
    dl = dh * gs
    if LIMIT is not None:
        dg = tl.where(pass_g, dg, 0.0)
        dl = tl.where(pass_l, dl, 0.0)
    return dg, dl, gs * lo


@triton.jit
def split_pairs(x, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """[BLOCK_R, 2 * BLOCK_F] interleaved (g0, l0, g1, l1, ...) -> g, l of [BLOCK_R, BLOCK_F]."""
    return tl.split(tl.reshape(x, [BLOCK_R, BLOCK_F, 2]))


@triton.jit
def join_pairs(g, lin, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """Inverse of ``split_pairs``."""
    return tl.reshape(tl.join(g, lin), [BLOCK_R, 2 * BLOCK_F])


@triton.jit
def _load_pairs(pre, rows, j, F, stride_m, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, HALVES: tl.constexpr):
    """Gate and linear values (fp32, [BLOCK_R, BLOCK_F]) for SwiGLU columns [j, j + BLOCK_F) of a
    (M, 2F) tensor, read as contiguous blocks (interleaved pairs are split in registers)."""
    base = pre + rows[:, None].to(tl.int64) * stride_m
    row_ok = rows[:, None] >= 0
    if HALVES:
        cols = j + tl.arange(0, BLOCK_F)
        mask = row_ok & (cols[None, :] < F)
        gate = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        lin = tl.load(base + F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        cols = 2 * j + tl.arange(0, 2 * BLOCK_F)
        x = tl.load(base + cols[None, :], mask=row_ok & (cols[None, :] < 2 * F), other=0.0)
        gate, lin = split_pairs(x.to(tl.float32), BLOCK_R, BLOCK_F)
    return gate, lin


@triton.jit
def _store_pairs(dst, rows, j, F, stride_m, gate, lin, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
                 HALVES: tl.constexpr):
    """Inverse of ``_load_pairs`` (rows are pre-clamped by the caller's mask through ``rows``)."""
    base = dst + rows[:, None].to(tl.int64) * stride_m
    row_ok = rows[:, None] >= 0
    if HALVES:
        cols = j + tl.arange(0, BLOCK_F)
        mask = row_ok & (cols[None, :] < F)
        tl.store(base + cols[None, :], gate.to(dst.dtype.element_ty), mask=mask)
        tl.store(base + F + cols[None, :], lin.to(dst.dtype.element_ty), mask=mask)
    else:
        cols = 2 * j + tl.arange(0, 2 * BLOCK_F)
        both = join_pairs(gate, lin, BLOCK_R, BLOCK_F)
        tl.store(base + cols[None, :], both.to(dst.dtype.element_ty), mask=row_ok & (cols[None, :] < 2 * F))


@triton.jit
def _swiglu_kernel(
    pre, h, M, F, stride_pre_m, stride_h_m,  # pre (M, 2F) -> h (M, F)
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr, HALVES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = tl.where(rows < M, rows, -1)  # -1: masked out by _load_pairs / the store below
    j = tl.program_id(1) * BLOCK_F
    gate, lin = _load_pairs(pre, rows, j, F, stride_pre_m, BLOCK_R, BLOCK_F, HALVES)
    out = swiglu_apply(gate, lin, ALPHA, LIMIT, OFFSET)
    cols = j + tl.arange(0, BLOCK_F)
    ptrs = h + rows[:, None].to(tl.int64) * stride_h_m + cols[None, :]
    tl.store(ptrs, out.to(h.dtype.element_ty), mask=(rows[:, None] >= 0) & (cols[None, :] < F))


@triton.jit
def _swiglu_bwd_kernel(
    pre, dh, dpre, h, M, F, stride_pre_m, stride_dh_m, stride_dpre_m, stride_h_m,  # pre, dpre (M, 2F); dh (M, F)
    H_COLS,  # h (M, H_COLS) or None: F columns, or with ONES_COL F + 1 padded to a multiple of 64
    scale, dscale,  # None, or (M,) fp32 row scales s (h = s * SwiGLU(pre)) and (grid dim 1, M) fp32 partial sums
    last,  # None, or a pointer to offs[-1]: rows at or past it are neither read nor written
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr, HALVES: tl.constexpr,
    ONES_COL: tl.constexpr,  # h[:, F] = 1 and h[:, F + 1:H_COLS] = 0 (see grouped_mm_dswiglu)
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    # dpre = dSwiGLU(pre) * (s * dh); the recomputed h = s * SwiGLU(pre) where asked; and the
    # gradient of s, <dh, SwiGLU(pre)> per row, as one partial sum per program column (the launcher
    # adds them up: deterministic, no atomics). A program walks its rows' column blocks in steps of
    # the grid's second dim.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_end = M  # (M stays the row stride of dscale's partial sums)
    if last is not None:
        rows_end = tl.minimum(tl.maximum(tl.load(last), 0), M)
        if tl.program_id(0) * BLOCK_R >= rows_end:  # every row of this program is past offs[-1]
            return
    rows = tl.where(rows < rows_end, rows, -1)
    if scale is not None:
        s = tl.load(scale + rows, mask=rows >= 0, other=0.0)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    n_cols = H_COLS if ONES_COL else F
    for j in range(tl.program_id(1) * BLOCK_F, n_cols, tl.num_programs(1) * BLOCK_F):
        gate, lin = _load_pairs(pre, rows, j, F, stride_pre_m, BLOCK_R, BLOCK_F, HALVES)
        cols = j + tl.arange(0, BLOCK_F)
        mask = (rows[:, None] >= 0) & (cols[None, :] < F)
        grad = tl.load(dh + rows[:, None].to(tl.int64) * stride_dh_m + cols[None, :], mask=mask, other=0.0)
        grad = grad.to(tl.float32)
        if scale is not None:
            dg, dl, out = swiglu_apply_bwd(gate, lin, grad * s[:, None], ALPHA, LIMIT, OFFSET)
        else:
            dg, dl, out = swiglu_apply_bwd(gate, lin, grad, ALPHA, LIMIT, OFFSET)
        _store_pairs(dpre, rows, j, F, stride_dpre_m, dg, dl, BLOCK_R, BLOCK_F, HALVES)
        if dscale is not None:
            dot += tl.sum(grad * out, 1)
        if h is not None:  # the recomputed forward value, for a weight gradient that needs it
            if scale is not None:
                out = out * s[:, None]
            if ONES_COL:  # past F, gate and linear read as 0 and out is 0
                # H_COLS, a multiple of 64, keeps the mask provably uniform over 8 columns, so the store
                # stays vectorized; ``cols <= F`` made this pass 40% slower on an H100.
                out = tl.where(cols[None, :] == F, 1.0, out)
                mask = (rows[:, None] >= 0) & (cols[None, :] < H_COLS)
            tl.store(h + rows[:, None].to(tl.int64) * stride_h_m + cols[None, :], out.to(h.dtype.element_ty),
                     mask=mask)
    if dscale is not None:
        tl.store(dscale + tl.program_id(1) * M + rows, dot, mask=rows >= 0)

"""Epilogue device functions shared by the fused GEMMs and the standalone kernels, plus those kernels.

The SwiGLU math lives here once: ``swiglu_apply`` and ``swiglu_apply_bwd`` are called by the up-projection's
epilogue, the down-projection dgrad's epilogue, and the elementwise ``_swiglu_kernel`` /
``_swiglu_bwd_kernel``. Their torch twins are in ``moekit.epilogue``.
"""

import triton
import triton.language as tl


@triton.jit
def swiglu_apply(g, lin, ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr):
    """h = g_c * sigmoid(ALPHA * g_c) * (l_c + OFFSET), g_c = min(g, LIMIT), l_c = clamp(l, +-LIMIT).

    LIMIT=None turns both clamps off. Inputs and result are fp32."""
    if LIMIT is not None:
        g = tl.minimum(g, LIMIT)
        lin = tl.minimum(tl.maximum(lin, -LIMIT), LIMIT)
    return g * tl.sigmoid(ALPHA * g) * (lin + OFFSET)


@triton.jit
def swiglu_apply_bwd(g, lin, dh, ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr):
    """(dg, dl, h) for the SwiGLU above. Clamp masks follow torch.clamp's backward: the gradient
    passes where the input lies within the bounds, bounds included."""
    if LIMIT is not None:
        pass_g = g <= LIMIT
        pass_l = (lin >= -LIMIT) & (lin <= LIMIT)
        g = tl.minimum(g, LIMIT)
        lin = tl.minimum(tl.maximum(lin, -LIMIT), LIMIT)
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
def _pair_offsets(rows, cols, F, stride_m, HALVES: tl.constexpr):
    """Element offsets of the gate and linear halves of SwiGLU columns ``cols`` in a (M, 2F) tensor."""
    base = rows[:, None].to(tl.int64) * stride_m
    if HALVES:
        off_g = base + cols[None, :]
        off_l = off_g + F
    else:
        off_g = base + 2 * cols[None, :]
        off_l = off_g + 1
    return off_g, off_l


@triton.jit
def _swiglu_kernel(
    pre, h, M, F, stride_pre_m, stride_h_m,  # pre (M, 2F) -> h (M, F)
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr, HALVES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    off_g, off_l = _pair_offsets(rows, cols, F, stride_pre_m, HALVES)
    g = tl.load(pre + off_g, mask=mask, other=0.0).to(tl.float32)
    lin = tl.load(pre + off_l, mask=mask, other=0.0).to(tl.float32)
    out = swiglu_apply(g, lin, ALPHA, LIMIT, OFFSET)
    ptrs = h + rows[:, None].to(tl.int64) * stride_h_m + cols[None, :]
    tl.store(ptrs, out.to(h.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    pre, dh, dpre, M, F, stride_pre_m, stride_dh_m, stride_dpre_m,  # pre, dpre (M, 2F); dh (M, F)
    ALPHA: tl.constexpr, LIMIT: tl.constexpr, OFFSET: tl.constexpr, HALVES: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows[:, None] < M) & (cols[None, :] < F)
    off_g, off_l = _pair_offsets(rows, cols, F, stride_pre_m, HALVES)
    g = tl.load(pre + off_g, mask=mask, other=0.0).to(tl.float32)
    lin = tl.load(pre + off_l, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(dh + rows[:, None].to(tl.int64) * stride_dh_m + cols[None, :], mask=mask, other=0.0)
    dg, dl, _ = swiglu_apply_bwd(g, lin, grad.to(tl.float32), ALPHA, LIMIT, OFFSET)
    out_g, out_l = _pair_offsets(rows, cols, F, stride_dpre_m, HALVES)
    tl.store(dpre + out_g, dg.to(dpre.dtype.element_ty), mask=mask)
    tl.store(dpre + out_l, dl.to(dpre.dtype.element_ty), mask=mask)

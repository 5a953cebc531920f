"""The router's gate GEMM (``moekit.gate``).

* ``_router_logits_kernel``: the fp32 logits x @ w^T (+ bias) of bf16 tokens and an fp32 gate weight in
  one kernel: w split per tile into hi = bf16(w) and lo = bf16(w - hi) (round to nearest even, as
  torch's casts), two bf16 products accumulated in fp32, then hi + lo (hi where hi is an inf) plus the
  bias: the split GEMM with no split weight in memory, no (T, 2E) product and no library GEMM call.
* ``_router_logits_bwd_kernel``: the router GEMM's two input gradients from the logits' fp32 gradient
  g (T, E), rounded to bf16 as it is read: dx = g @ bf16(w) (T, D) bf16 (plus another bf16 gradient of
  x, added as torch adds two bf16 tensors) and dW = g^T @ x (E, D) fp32, in one launch (the first
  programs take dx's tiles, the rest dW's).
"""

import triton
import triton.language as tl

from .grouped_gemm import _dot


@triton.jit
def _router_logits_kernel(
    x, w, bias, out, T, E, D, stride_xt, stride_xd, stride_we, stride_wd,  # x (T, D) bf16; w (E, D) fp32
    HAS_BIAS: tl.constexpr,  # bias (E,) fp32; out (T, E) fp32, contiguous
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok, col_ok = rows < T, cols < E
    xp = x + rows[:, None].to(tl.int64) * stride_xt
    wp = w + cols[:, None].to(tl.int64) * stride_we
    acc_hi = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    acc_lo = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_ok = ds < D
        a = tl.load(xp + ds[None, :] * stride_xd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(wp + ds[None, :] * stride_wd, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        hi = v.to(tl.bfloat16)
        lo = (v - hi.to(tl.float32)).to(tl.bfloat16)
        acc_hi = _dot(a, tl.trans(hi), acc_hi, DOT_F32)
        acc_lo = _dot(a, tl.trans(lo), acc_lo, DOT_F32)
    # an inf in x makes x.hi an inf of w's sign, the fp32 product's; x.lo may be an inf of the other
    # sign (lo holds hi's rounding error) or NaN (inf * a zero lo), which would make the sum NaN
    v = tl.where(tl.abs(acc_hi) == float("inf"), acc_hi, acc_hi + acc_lo)
    if HAS_BIAS:
        v = v + tl.load(bias + cols, mask=col_ok, other=0.0)[None, :]
    tl.store(out + rows[:, None].to(tl.int64) * E + cols[None, :], v, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["N_DX", "ADD"])  # (one compiled kernel whichever gradients a step needs)
def _router_logits_bwd_kernel(
    g, x, w, dx_add, dx, dw, T, E, D, stride_xt, stride_xd, stride_we, stride_wd,  # g (T, E) fp32 contiguous;
    N_DX, ADD,  # x (T, D) bf16; w (E, D) fp32; dx_add, dx (T, D) bf16 and dw (E, D) fp32, contiguous
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = (pid % tl.cdiv(D, BLOCK_D)) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = cols < D
    if pid < N_DX:  # dx[rows, cols] = sum over E of bf16(g) * bf16(w)
        rows = (pid // tl.cdiv(D, BLOCK_D)) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for e0 in range(0, E, BLOCK_E):
            es = e0 + tl.arange(0, BLOCK_E)
            e_ok = es < E
            a = tl.load(g + rows[:, None].to(tl.int64) * E + es[None, :], mask=row_ok[:, None] & e_ok[None, :],
                        other=0.0).to(tl.bfloat16)
            b = tl.load(w + es[:, None].to(tl.int64) * stride_we + cols[None, :] * stride_wd,
                        mask=e_ok[:, None] & d_ok[None, :], other=0.0).to(tl.bfloat16)
            acc = _dot(a, b, acc, DOT_F32)
        at = rows[:, None].to(tl.int64) * D + cols[None, :]
        ok = row_ok[:, None] & d_ok[None, :]
        out = acc.to(tl.bfloat16)
        if ADD != 0:  # (each term rounded to bf16, summed in fp32, rounded again: torch's bf16 add)
            out = (tl.load(dx_add + at, mask=ok, other=0.0).to(tl.float32) + out.to(tl.float32)).to(tl.bfloat16)
        tl.store(dx + at, out, mask=ok)
    else:  # dw[ew, cols] = sum over T of bf16(g)^T * x, in fp32 (names apart from the dx branch's:
        ew = ((pid - N_DX) // tl.cdiv(D, BLOCK_D)) * BLOCK_E + tl.arange(0, BLOCK_E)  # a name in both branches
        ew_ok = ew < E  # must keep one type)
        acc_w = tl.zeros([BLOCK_E, BLOCK_D], tl.float32)
        for t0 in range(0, T, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            t_ok = ts < T
            gt = tl.load(g + ts[None, :].to(tl.int64) * E + ew[:, None], mask=ew_ok[:, None] & t_ok[None, :],
                         other=0.0).to(tl.bfloat16)
            xt = tl.load(x + ts[:, None].to(tl.int64) * stride_xt + cols[None, :] * stride_xd,
                         mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            acc_w = _dot(gt, xt, acc_w, DOT_F32)
        tl.store(dw + ew[:, None].to(tl.int64) * D + cols[None, :], acc_w, mask=ew_ok[:, None] & d_ok[None, :])

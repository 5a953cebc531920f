"""NVFP4 quantization in Gluon, where the layout is explicit: each thread holds whole 16-element blocks.

``_quantize_rows_kernel`` computes ``_quantize_kernel``'s output for 1x16 blocks rounded to nearest
(the activations' quantize), bit for bit. In plain Triton a block's 16 elements land on 16 lanes, so
every value derived per block (the amax, the e4m3 scale and its decode, the divisor) is computed once
per element, replicated across those lanes. Here the tile is [BLOCK_M, NB, 8, 2] (rows, blocks, byte,
nibble) and a thread owns the last three dims of its rows: a block's amax, scale and reciprocal are
computed once, in the thread, and each element pays only its own rounding.

The division. Each element needs q = RN(x / d), correctly rounded, with d the block's divisor (the
e4m3 scale times the global scale). With y = RN(1 / d) computed once per block (``div_rn``), two
residual corrections give RN(x / d) (Markstein's theorem, for binary32 with FMA):
    q0 = x * y;  q1 = q0 + (x - d * q0) * y;  q = q1 + (x - d * q1) * y    (each ``a + b * c`` one FMA)
The first correction makes q1 faithful, the second rounds it correctly; the residuals are exact. The
theorem needs no overflow and no underflow:
- a subnormal d (a tiny global scale) has no finite reciprocal: such blocks scale x and d by 2^64
  first (exact), which leaves the quotient unchanged;
- where q0 overflows, the correction would give NaN; q0 (+-inf, or NaN for a NaN x) is kept, which
  is the quotient's value too;
- a quotient below 2^-126 may come out an ulp off, but every value below 0.25 rounds to e2m1 code 0,
  so the codes, which are all this kernel writes, do not change.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .nvfp4 import _e2m1_code, _e4m3_code, _e4m3_value, _finite_abs

FLT_MAX = gl.constexpr(3.4028234663852886e38)
FLT_MIN = gl.constexpr(1.1754943508222875e-38)  # 2^-126, the smallest normal fp32
TWO_64 = gl.constexpr(18446744073709551616.0)


@triton.jit
def _div_rn(a, b):
    return tl.math.div_rn(a, b)


@triton.jit
def _fma(a, b, c):
    return tl.fma(a, b, c)


@gluon.jit
def _quantize_rows_kernel(
    x, values, scales, gscale,  # as _quantize_kernel's (1x16 blocks, round to nearest)
    R, K, stride_g, stride_r, stride_k,
    G_STRIDE,  # 1: gscale (G,) holds one global scale per group; 0: gscale[0] for all
    BLOCK_M: gl.constexpr, NB: gl.constexpr, TPW_B: gl.constexpr,
):
    # [rows, blocks, bytes, nibbles]: a thread holds the 8 x 2 elements of a block, TPW_B threads of a
    # warp cover NB blocks of a row, the rest of the warp and the warps cover rows
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 8, 2], [32 // TPW_B, TPW_B, 1, 1], [gl.num_warps(), 1, 1, 1],
                                        [3, 2, 1, 0])
    L3: gl.constexpr = gl.SliceLayout(3, L4)  # [rows, blocks, bytes]
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [rows, blocks]
    pid_m, pid_k, gi = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    BLOCK_K: gl.constexpr = NB * 16

    rows2 = pid_m * BLOCK_M + gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L2)), 1)
    blk2 = pid_k * NB + gl.expand_dims(gl.arange(0, NB, layout=gl.SliceLayout(0, L2)), 0)
    ok2 = (rows2 < R) & (blk2 < K // 16)  # K % 16 == 0: whole blocks are in or out
    byte3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1)
    nib4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4)))), 0), 1), 2)
    # the load: a 2-D tile whose threads hold 16 consecutive elements (two 16-byte vectors for bf16),
    # viewed as the 4-D tile without moving data
    LX: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_B, TPW_B], [gl.num_warps(), 1], [1, 0])
    rx = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LX))
    cx = pid_k * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LX))
    src = (x + gi.to(gl.int64) * stride_g + gl.expand_dims(rx.to(gl.int64) * stride_r, 1)
           + gl.expand_dims(cx.to(gl.int64) * stride_k, 0))
    x2 = gl.load(src, mask=gl.expand_dims(rx < R, 1) & gl.expand_dims(cx < K, 0), other=0.0)
    xt = gl.convert_layout(gl.reshape(x2.to(gl.float32), [BLOCK_M, NB, 8, 2]), L4, assert_trivial=True)
    g = gl.load(gscale + gi * G_STRIDE)

    # per block, once per thread
    amax = gl.max(gl.max(_finite_abs(xt), axis=3), axis=2)  # [BLOCK_M, NB]
    ratio = _div_rn(amax, gl.zeros_like(amax) + 6.0 * g)
    ratio = gl.where(ratio > 448.0, 448.0, ratio)  # a NaN ratio stays NaN, as in torch
    s_code = _e4m3_code(ratio)
    denom = gl.where(ratio == ratio, _e4m3_value(s_code), ratio) * g
    ok = denom > 0  # a scale that underflowed e4m3 (or a NaN one): zero codes
    d = gl.where(ok, denom, 1.0)
    lift = gl.where(d < FLT_MIN, TWO_64, 1.0)
    d = d * lift
    y = _div_rn(gl.zeros_like(d) + 1.0, d)

    # per element: q = RN(x / d)
    d4 = gl.expand_dims(gl.expand_dims(d, 2), 3)
    y4 = gl.expand_dims(gl.expand_dims(y, 2), 3)
    xs = xt * gl.expand_dims(gl.expand_dims(lift, 2), 3)
    q0 = xs * y4
    q1 = _fma(_fma(-q0, d4, xs), y4, q0)
    q = _fma(_fma(-q1, d4, xs), y4, q1)
    q = gl.where(gl.abs(q0) <= FLT_MAX, q, q0)
    codes = gl.where(gl.expand_dims(gl.expand_dims(ok, 2), 3), _e2m1_code(q), 0)
    packed = gl.sum(codes << (nib4 * 4), axis=3).to(gl.uint8)  # [BLOCK_M, NB, 8]: even element low

    out_rows2 = gi.to(gl.int64) * R + rows2
    vdst = values + gl.expand_dims(out_rows2 * (K // 2) + blk2 * 8, 2) + byte3
    gl.store(vdst, packed, mask=gl.expand_dims(ok2, 2))
    gl.store(scales + out_rows2 * (K // 16) + blk2, s_code.to(gl.uint8), mask=ok2)

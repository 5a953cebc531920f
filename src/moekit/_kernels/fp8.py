"""FP8 (e4m3) blockwise quantization kernels: one fp32 scale per group of 128 elements.

* ``_quantize_rows_kernel``: x (M, K) in groups of 1 x 128 along K (activations, and output gradients
  along N): one program per BLOCK_M rows and one group of columns.
* ``_quantize_blocks_kernel``: w (E, A, B) in blocks of 128 x 128 (weights): one program per block.
* ``_quantize_ragged_t_kernel``: x (M, K) in groups of 128 x 1, 128 consecutive rows of one expert per
  group (the operands of a weight gradient, whose reduction runs over each expert's rows), stored
  transposed, (K, M), as the FP8 tensor cores read a K-major operand; also the groups' cumulative
  counts, and zeros past the last expert's rows.

Every group's scale follows one rule (``_group_scale``), which ``moekit.fp8.formats`` states and its
references reproduce bit for bit. The e4m3 code of a scaled value is computed in integer arithmetic
(``_e4m3_code``: round to nearest, ties to even), because Triton's interpreter converts to fp8 wrongly;
on a GPU ``HW_CVT`` uses the hardware conversion (``cvt.rn.satfinite.e4m3x2.f32``), which gives the
same codes for the values it sees (finite, within +-448).
"""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-12)  # the amax of an all-zero (or tiny) group is taken as this


@triton.jit
def _e4m3_code(v):
    """fp32 v, |v| <= 448 -> the uint8 code of v rounded to e4m3fn (to nearest, ties to even)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # normal codes: round the mantissa from 23 bits to 3, then re-bias the exponent (127 -> 7); a carry
    # out of the mantissa moves to the next exponent, as rounding should
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # below 2^-6 the codes are multiples of 2^-9: round a * 2^9 to an integer with the 2^23 magic number
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def _encode(q, HW_CVT: tl.constexpr):
    if HW_CVT:
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return _e4m3_code(q)


@triton.jit
def _group_scale(amax, POW2: tl.constexpr):
    """(scale, inverse) of a group of amax ``amax`` (fp32): amax / 448 and 448 / amax, each rounded
    once; with POW2, the power of two at or above amax / 448, and its exact inverse. amax is floored at
    AMAX_FLOOR."""
    a = tl.maximum(amax, AMAX_FLOOR)
    s = tl.math.div_rn(a, E4M3_MAX)
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        up = tl.where((bits & 0x7FFFFF) != 0, (bits & 0x7F800000) + 0x800000, bits & 0x7F800000)
        return up.to(tl.float32, bitcast=True), ((254 << 23) - up).to(tl.float32, bitcast=True)
    return s, tl.math.div_rn(E4M3_MAX, a)


@triton.jit
def _codes(x, inv, bad, HW_CVT: tl.constexpr):
    """The codes of x scaled by inv (broadcast), clamped to +-448; zero codes where ``bad``."""
    q = tl.minimum(tl.maximum(x * inv, -E4M3_MAX), E4M3_MAX)
    q = tl.where(bad, 0.0, q)  # (a NaN scaled value would not survive the clamp's min/max)
    return _encode(q, HW_CVT)


@triton.jit
def _quantize_rows_kernel(
    x, values, scales, M, K, stride_x, stride_v, stride_s,  # x (M, K); values (M, K) uint8; scales (M, G) fp32
    POW2: tl.constexpr, HW_CVT: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = (rows[:, None] < M) & (cols[None, :] < K)
    r64 = rows[:, None].to(tl.int64)
    v = tl.load(x + r64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    av = tl.abs(v)
    bad = tl.max(((v != v) | (av == float("inf"))).to(tl.int32), 1) != 0  # a NaN or an inf in the group
    s, inv = _group_scale(tl.max(av, 1), POW2)
    codes = _codes(v, inv[:, None], bad[:, None], HW_CVT)
    tl.store(values + r64 * stride_v + cols[None, :], codes, mask=ok)
    tl.store(scales + rows.to(tl.int64) * stride_s + g, tl.where(bad, float("nan"), s), mask=rows < M)


@triton.jit
def _quantize_blocks_kernel(
    w, values, scales, A, B,  # w (E, A, B) any strides; values (E, A, B) uint8 contiguous
    stride_we, stride_wa, stride_wb, stride_se, stride_sa,  # scales (E, GA, GB) fp32, unit stride along GB
    POW2: tl.constexpr, HW_CVT: tl.constexpr, BLOCK: tl.constexpr,
):
    e, ga, gb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ra = ga * BLOCK + tl.arange(0, BLOCK)
    rb = gb * BLOCK + tl.arange(0, BLOCK)
    ok = (ra[:, None] < A) & (rb[None, :] < B)
    base = e.to(tl.int64) * stride_we
    v = tl.load(w + base + ra[:, None].to(tl.int64) * stride_wa + rb[None, :].to(tl.int64) * stride_wb,
                mask=ok, other=0.0).to(tl.float32)
    av = tl.abs(v)
    bad = tl.max(tl.max(((v != v) | (av == float("inf"))).to(tl.int32), 1), 0) != 0
    s, inv = _group_scale(tl.max(tl.max(av, 1), 0), POW2)
    codes = _codes(v, inv, bad, HW_CVT)
    out = values + e.to(tl.int64) * A * B + ra[:, None].to(tl.int64) * B + rb[None, :]
    tl.store(out, codes, mask=ok)
    tl.store(scales + e.to(tl.int64) * stride_se + ga * stride_sa + gb, tl.where(bad, float("nan"), s))


@triton.jit
def _quantize_ragged_t_kernel(
    x, offs, values_t, scales, group_offs,  # x (M, K); offs, group_offs (E,) int32; values_t (K, M) uint8
    M, K, E, stride_x, stride_vt, stride_s,  # scales (G, K) fp32, G = cdiv(M, 128) + E
    POW2: tl.constexpr, HW_CVT: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_E: tl.constexpr,
):
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    # each expert's rows [start, end) (offs clamped into [0, M]) and its groups' cumulative count
    ex = tl.arange(0, BLOCK_E)
    in_e = ex < E
    end = tl.minimum(tl.maximum(tl.load(offs + ex, mask=in_e, other=0), 0), M)
    start = tl.minimum(tl.maximum(tl.load(offs + ex - 1, mask=in_e & (ex > 0), other=0), 0), M)
    gend = tl.cumsum(tl.where(in_e, (tl.maximum(end - start, 0) + GROUP - 1) // GROUP, 0), 0)
    if (g == 0) & (tl.program_id(1) == 0):
        tl.store(group_offs + ex, gend, mask=in_e)
    last_row = tl.sum(tl.where(ex == E - 1, end, 0), 0)
    used = tl.sum(tl.where(ex == E - 1, gend, 0), 0)
    # this group's expert: the first whose cumulative group count exceeds g (E: past the last group,
    # a program that zeroes a slice of the rows past offs[-1] and writes a zero scale row)
    mine = tl.sum((in_e & (gend <= g)).to(tl.int32), 0)
    first_group = tl.sum(tl.where(ex == mine - 1, gend, 0), 0)
    row0 = tl.sum(tl.where(ex == mine, start, 0), 0) + (g - first_group) * GROUP
    row_end = tl.minimum(row0 + GROUP, tl.sum(tl.where(ex == mine, end, 0), 0))
    tail = mine == E
    row0 = tl.where(tail, last_row + (g - used) * GROUP, row0)
    row_end = tl.where(tail, M, row_end)
    rows = row0 + tl.arange(0, GROUP)
    ok = (rows < row_end)[:, None] & col_ok[None, :]
    v = tl.load(x + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=ok & ~tail, other=0.0)
    v = v.to(tl.float32)
    av = tl.abs(v)
    bad = tl.max(((v != v) | (av == float("inf"))).to(tl.int32), 0) != 0  # per column
    s, inv = _group_scale(tl.max(av, 0), POW2)
    codes = _codes(v, inv[None, :], bad[None, :], HW_CVT)
    tl.store(values_t + cols[None, :].to(tl.int64) * stride_vt + rows[:, None], codes, mask=ok)
    s = tl.where(bad, float("nan"), s)
    tl.store(scales + g.to(tl.int64) * stride_s + cols, tl.where(tail, 0.0, s), mask=col_ok)

"""NVFP4 quantization, dequantization and the tiled block-scale layout (the format: ``moekit.nvfp4``).

* ``_amax_kernel``: the largest finite |x| of a strided (G, R, K) tensor, per group, as partial maxima
  (one per program), ``_global_scale_kernel``: those partials -> amax / (6 * 448) per group (1.0 for an
  all-zero group). Together they compute a global scale on the device, without a host sync.
* ``_quantize_kernel``: (G, R, K) -> packed e2m1 codes (G * R, K / 2) and e4m3 block scales
  (G * R, K / 16), from one global scale per group (or one for all); 1x16 blocks along K, or 16x16
  blocks (16 rows x 16 elements along K share one scale); a block holding a NaN or an inf gets the
  NaN scale and zero codes; e2m1 rounding to nearest even, or stochastic
  on Philox random bits (element i takes word i % 4 of ``tl.randint4x(seed, offset + i // 4)``,
  reproduced by ``random_bits_ref``).
* ``_dequantize_kernel``: the inverse, to fp32 (or a narrower float).
* ``_to_blocked_kernel`` / ``_to_blocked_ragged_kernel``: block scales -> 128 x 4 tiles of 512 bytes.

Every rounding here is written out in compare or integer form rather than left to a conversion
instruction, so that the GPU and the interpreter give the bits of the torch references:
- fp32 divisions use ``div_rn`` (Triton's ``/`` on fp32 is the approximate ``div.full.f32`` on NVIDIA);
- e2m1 rounding is RNE at the e2m1 spacing of each value's binade, from its fp32 bits (``_e2m1_magnitude``);
- the fp32 -> e4m3 cast of a block scale rounds the fp32 bits (``_e4m3_code``) as torch's cast does;
- codes decode to fp32 by assembling the fp32 bits (``_e2m1_value``, ``_e4m3_value``).
Bytes travel as uint8: the launchers pass ``float4_e2m1fn_x2`` / ``float8_e4m3fn`` tensors as uint8 views.
"""

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2^-6
E4M3_SUBNORMAL = tl.constexpr(0.001953125)  # 2^-9, the e4m3 subnormal step
TILE_BYTES = tl.constexpr(512)  # one 128 x 4 tile of the block-scale layout


# --------------------------------------------------------------------------------------------------
# device functions: the format's roundings
# --------------------------------------------------------------------------------------------------


@triton.jit
def _finite_abs(x):
    """|x| in fp32 with NaN and +-inf as 0: what the amaxes see."""
    a = tl.abs(x.to(tl.float32))
    return tl.where(a <= FLT_MAX, a, 0.0)  # NaN compares false too


@triton.jit
def _block_abs(x):
    """|x| in fp32 with NaN and +-inf as +inf: what a block's amax sees (``nvfp4._block_abs``)."""
    a = tl.abs(x.to(tl.float32))
    return tl.where(a <= FLT_MAX, a, float("inf"))


@triton.jit
def _block_ratio(ratio, amax):
    """A block's amax / (6 g) and its amax (``_block_abs``) -> the ratio clamped to 448, NaN for a block
    with a non-finite value (an infinite amax) or a NaN quotient: the scale before its e4m3 cast."""
    ratio = tl.where(ratio > 448.0, 448.0, ratio)  # not tl.minimum: a NaN ratio stays NaN, as in torch
    return tl.where(amax <= FLT_MAX, ratio, float("nan"))


@triton.jit
def _with_sign(v, negative):
    """v (fp32, sign bit clear) with its sign bit set where ``negative``: a -0.0 code gives -0.0, which
    ``-v`` (computed as 0 - v) would not."""
    bits = v.to(tl.uint32, bitcast=True) | (negative.to(tl.uint32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _packed_to_k_order(b, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """A [BLOCK_R, BLOCK_C] tile of code bytes (int32, 0-255) in ``nvfp4_gemm.pack_weights``'s order -> K
    order (BLOCK_C a multiple of 32). First the signs, per 32-bit word (bytes 4i..4i+3): the sign of
    code k (bits 4k..4k+3 of the word) goes back to bit 4k + 3 from bit 7 of byte k (k < 4) or bit 3 of
    byte k - 4; then the bytes: byte 8t + 2g + h of each 32-byte chunk is byte 8g + 4h + t."""
    q = tl.reshape(b, [BLOCK_R, BLOCK_C // 4, 2, 2])  # [row, word, byte // 2, byte % 2]
    q02, q13 = tl.split(q)  # bytes 0, 2 and 1, 3 of each word: [row, word, 2]
    q0, q2 = tl.split(q02)
    q1, q3 = tl.split(q13)
    # byte j of the word in K order holds codes 2j and 2j + 1: magnitudes in place, signs gathered
    o0 = (q0 & 0x77) | ((q0 >> 4) & 0x08) | (q1 & 0x80)
    o1 = (q1 & 0x77) | ((q2 >> 4) & 0x08) | (q3 & 0x80)
    o2 = (q2 & 0x77) | (q0 & 0x08) | ((q1 << 4) & 0x80)
    o3 = (q3 & 0x77) | (q2 & 0x08) | ((q3 << 4) & 0x80)
    b = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [BLOCK_R, BLOCK_C])  # [.., j // 2, j % 2]
    return tl.reshape(tl.permute(tl.reshape(b, [BLOCK_R, BLOCK_C // 32, 4, 4, 2]), [0, 1, 3, 4, 2]),
                      [BLOCK_R, BLOCK_C])


@triton.jit
def _read_global_scale(ptr):
    """The global scale at ``ptr`` as every quantizer reads it: a negative one (outside the format) as
    NaN, -0 as +0 (``nvfp4._quantizing_scale``)."""
    g = tl.load(ptr)
    return tl.where(g >= 0, tl.abs(g), float("nan"))


@triton.jit
def _e4m3_code(r):
    """fp32 r in [0, 448] -> its e4m3fn code (int32), rounded to nearest even like torch's
    ``.to(torch.float8_e4m3fn)``, subnormals included; NaN -> 0x7F. The clamp to 448 is the caller's."""
    u = r.to(tl.int32, bitcast=True)
    # Normal range: round the fp32 mantissa to 3 bits (a carry moves into the exponent on its own),
    # then rebias the exponent from 127 to 7.
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2^-6: a multiple of 2^-9; code m means m * 2^-9 (m = 8 is the smallest normal, 2^-6).
    y = tl.where(r < E4M3_MIN_NORMAL, r, 0.0) * 512.0  # exact; NaN is kept out of the int cast
    whole = y.to(tl.int32)
    frac = y - whole.to(tl.float32)
    sub = whole + ((frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))).to(tl.int32)
    code = tl.where(r < E4M3_MIN_NORMAL, sub, normal)
    return tl.where(r == r, code, 0x7F)


@triton.jit
def _e4m3_value(code):
    """e4m3fn codes (int32, 0-255) -> fp32 values, exactly (0x7F / 0xFF are NaN)."""
    mag = code & 0x7F
    exp = mag >> 3
    man = mag & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    v = tl.where(exp > 0, normal, man.to(tl.float32) * E4M3_SUBNORMAL)
    v = tl.where(mag == 0x7F, float("nan"), v)
    return _with_sign(v, code >= 0x80)


@triton.jit
def _e2m1_magnitude_bits(m):
    """fp32 magnitudes m in [0, 6] (no NaN) -> 0x4B400000 + the e2m1 magnitude code 0..7 (int32):
    nearest, ties to the even code. The magnitudes are 0.5 * (0..4) below 2, 2 and 3, then 4 and 6:
    with E = max(floor(log2 m), 0), the code is 2E + RNE(m * 2^(1 - E)), and each tie (0.25, 0.75, ...,
    5) goes to the even code as RNE's tie goes to the even integer. The exponent field of
    max(m, 1) is E + 127, and its complement is 2^(1 - E)'s; m * 2^(1 - E) is exact. RNE(v) + j for
    0 <= v < 2^22 and a small integer j is the low bits of fp32 v + (1.5 * 2^23 + j), one FMA."""
    p2 = ~tl.maximum(m, 1.0).to(tl.int32, bitcast=True) & 0x7F800000  # 2^(1 - E): (128 - E) << 23
    k = (0x4B400000 + 256) - (p2 >> 22)  # 1.5 * 2^23 + 2E
    return tl.fma(m, p2.to(tl.float32, bitcast=True), k.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)


@triton.jit
def _e2m1_magnitude(m):
    """fp32 magnitudes m in [0, 6] (no NaN) -> e2m1 magnitude codes 0..7 (int32), nearest, ties to the
    even code (``_e2m1_magnitude_bits``)."""
    return _e2m1_magnitude_bits(m) - 0x4B400000


@triton.jit
def _e2m1_code(q):
    """fp32 values already divided by their scales -> 4-bit e2m1 codes (int32, sign in bit 3): nearest,
    ties to the even code, saturating at +-6, NaN -> 0 (``_e2m1_magnitude``)."""
    mag = tl.where(q == q, tl.abs(q), 0.0)
    code = _e2m1_magnitude(tl.where(mag <= 6.0, mag, 6.0))
    return code + 8 * ((q < 0) & (code > 0)).to(tl.int32)


@triton.jit
def _e2m1_value(code):
    """4-bit e2m1 codes (int32) -> fp32 values: m * 0.5 for magnitudes 0, 0.5, and 2^(e-1) * (1 + m/2)
    assembled from the fp32 bits for the rest."""
    mag = code & 7
    big = ((((mag >> 1) + 126) << 23) | ((mag & 1) << 22)).to(tl.float32, bitcast=True)
    v = tl.where(mag >= 2, big, mag.to(tl.float32) * 0.5)
    return _with_sign(v, (code & 8) != 0)


@triton.jit
def _e2m1_code_sr(q, rbits):
    """fp32 values already divided by their scales, and 32 random bits per value (uint32) -> 4-bit e2m1
    codes, stochastically rounded: up to the next magnitude with probability (|q| - lo) / (hi - lo), lo
    and hi the neighbouring e2m1 magnitudes, so that the expected value is q. Saturates at +-6 first;
    NaN -> 0. Exact: ``|q| - lo`` is exact (lo <= |q| <= 2 lo), the gaps are powers of two, and the
    uniform is the random word's top 24 bits times 2^-24 (P(up) is the fraction rounded up to 2^-24)."""
    mag = tl.where(q == q, tl.abs(q), 0.0)
    mag = tl.where(mag > 6.0, 6.0, mag)
    code = (mag >= 0.5).to(tl.int32) + (mag >= 1.0).to(tl.int32) + (mag >= 1.5).to(tl.int32)
    code += (mag >= 2.0).to(tl.int32) + (mag >= 3.0).to(tl.int32) + (mag >= 4.0).to(tl.int32)
    code += (mag >= 6.0).to(tl.int32)
    inv_gap = tl.where(code >= 6, 0.5, tl.where(code >= 4, 1.0, 2.0))
    frac = (mag - _e2m1_value(code)) * inv_gap
    u = (rbits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
    code += ((u < frac) & (code < 7)).to(tl.int32)
    return code + 8 * ((q < 0) & (code > 0)).to(tl.int32)


@triton.jit
def _quantize_tile(x, g, rbits, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_2D: tl.constexpr,
                   STOCHASTIC: tl.constexpr):
    """``nvfp4_quantize_tile``, and with ``STOCHASTIC`` the e2m1 rounding of ``_e2m1_code_sr`` on the
    random bits ``rbits`` [BLOCK_M, BLOCK_K] uint32 (unused otherwise)."""
    NB: tl.constexpr = BLOCK_K // 16
    blocks = tl.reshape(x, [BLOCK_M, NB, 16])
    amax = tl.max(_block_abs(blocks), axis=2)  # [BLOCK_M, NB]; +inf for a block with a NaN or inf
    if BLOCK_2D:
        tile = tl.max(tl.reshape(amax, [BLOCK_M // 16, 16, NB]), axis=1)
        amax = tl.reshape(tl.broadcast_to(tile[:, None, :], [BLOCK_M // 16, 16, NB]), [BLOCK_M, NB])
    ratio = _block_ratio(tl.math.div_rn(amax, tl.zeros_like(amax) + 6.0 * g), amax)
    s_code = _e4m3_code(ratio)
    denom = tl.where(ratio == ratio, _e4m3_value(s_code), ratio) * g
    ok = denom > 0  # a scale that underflowed e4m3 (or a NaN one): zero codes
    q = tl.math.div_rn(blocks, tl.broadcast_to(tl.where(ok, denom, 1.0)[:, :, None], [BLOCK_M, NB, 16]))
    if STOCHASTIC:
        c = _e2m1_code_sr(q, tl.reshape(rbits, [BLOCK_M, NB, 16]))
    else:
        c = _e2m1_code(q)
    codes = tl.where(ok[:, :, None], c, 0)
    lo, hi = tl.split(tl.reshape(codes, [BLOCK_M, BLOCK_K // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8), s_code.to(tl.uint8)


@triton.jit
def nvfp4_quantize_tile(x, g, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_2D: tl.constexpr):
    """Quantize a [BLOCK_M, BLOCK_K] fp32 tile with global scale ``g`` (fp32 scalar) -> (packed codes
    [BLOCK_M, BLOCK_K / 2] uint8, the even element in the low nibble; e4m3 scale codes
    [BLOCK_M, BLOCK_K / 16] uint8). ``BLOCK_2D``: each 16 x 16 sub-tile shares the scale of its amax
    (BLOCK_M a multiple of 16, the tile's rows aligned to the 16-row blocks)."""
    return _quantize_tile(x, g, 0, BLOCK_M, BLOCK_K, BLOCK_2D, False)


# --------------------------------------------------------------------------------------------------
# global scale
# --------------------------------------------------------------------------------------------------


@triton.jit
def _amax_kernel(
    x, partial,  # x (G, R, K) strided, any float dtype; partial (G, P) fp32, P = programs along axis 0
    R, K, stride_g, stride_r, stride_k,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    p, gi = tl.program_id(0), tl.program_id(1)
    num_p = tl.num_programs(0)
    base = x + gi.to(tl.int64) * stride_g
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)  # |x| >= 0: 0 is the identity
    for r0 in range(p * BLOCK_R, R, num_p * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ptr = base + rows[:, None].to(tl.int64) * stride_r
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = (rows < R)[:, None] & (cols < K)[None, :]
            v = tl.load(row_ptr + cols[None, :].to(tl.int64) * stride_k, mask=mask, other=0.0)
            acc = tl.maximum(acc, _finite_abs(v))
    tl.store(partial + gi * num_p + p, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _global_scale_kernel(
    partial, gscale,  # partial (G, P) fp32 amaxes; gscale (G,) fp32
    P, BLOCK_P: tl.constexpr,
):
    gi = tl.program_id(0)
    acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        idx = p0 + tl.arange(0, BLOCK_P)
        acc = tl.maximum(acc, tl.load(partial + gi * P + idx, mask=idx < P, other=0.0))
    amax = tl.max(acc, axis=0)
    g = tl.math.div_rn(amax, 2688.0)  # 6 * 448: the largest block scale times the largest e2m1 value
    tl.store(gscale + gi, tl.where(amax > 0, g, 1.0))


# --------------------------------------------------------------------------------------------------
# quantize / dequantize
# --------------------------------------------------------------------------------------------------


@triton.jit
def _quantize_kernel(
    x, values, scales, gscale,  # x (G, R, K) strided; values (G*R, K/2), scales (G*R, K/16) uint8; gscale fp32
    R, K, stride_g, stride_r, stride_k,
    G_STRIDE,  # 1: gscale (G,) holds one global scale per group; 0: gscale[0] for all
    seed, offset,  # STOCHASTIC: element i of the (G*R, K) output draws word i % 4 of randint4x(seed, offset + i // 4)
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_2D: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    pid_m, pid_k, gi = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < R
    src = x + gi.to(tl.int64) * stride_g + rows[:, None].to(tl.int64) * stride_r
    xt = tl.load(src + cols[None, :].to(tl.int64) * stride_k, mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    g = _read_global_scale(gscale + gi * G_STRIDE)
    out_rows = (gi.to(tl.int64) * R + rows)[:, None]
    rbits = 0
    if STOCHASTIC:  # one Philox counter per 4 consecutive elements (K % 16 == 0: never across rows)
        quad = pid_k * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
        c0, c1, c2, c3 = tl.randint4x(seed, offset + out_rows * (K // 4) + quad[None, :])  # int64: hi word in c1
        rbits = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [BLOCK_M, BLOCK_K])  # c0 c1 c2 c3 c0 ...
    packed, s_code = _quantize_tile(xt.to(tl.float32), g, rbits, BLOCK_M, BLOCK_K, BLOCK_2D, STOCHASTIC)
    vcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(values + out_rows * (K // 2) + vcols[None, :], packed, mask=row_ok[:, None] & (vcols < K // 2)[None, :])
    scols = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    tl.store(scales + out_rows * (K // 16) + scols[None, :], s_code,
             mask=row_ok[:, None] & (scols < K // 16)[None, :])


@triton.jit
def _dequantize_kernel(
    values, scales, gscale, out,  # values (G, R, K/2), scales (G, R, K/16) uint8, strided; out (G*R, K)
    R, K,
    stride_vg, stride_vr, stride_vk, stride_sg, stride_sr, stride_sk,
    G_STRIDE,  # as in _quantize_kernel
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr = False,  # values in nvfp4_gemm.pack_weights's order (BLOCK_K % 64 == 0)
):
    pid_m, pid_k, gi = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB: tl.constexpr = BLOCK_K // 16
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < R)[:, None]
    r64 = rows[:, None].to(tl.int64)
    vcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    b = tl.load(values + gi.to(tl.int64) * stride_vg + r64 * stride_vr + vcols[None, :] * stride_vk,
                mask=row_ok & (vcols < K // 2)[None, :], other=0).to(tl.int32)
    if PACKED:
        b = _packed_to_k_order(b, BLOCK_M, BLOCK_K // 2)
    v = _e2m1_value(tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_M, BLOCK_K]))
    scols = pid_k * NB + tl.arange(0, NB)
    sc = tl.load(scales + gi.to(tl.int64) * stride_sg + r64 * stride_sr + scols[None, :] * stride_sk,
                 mask=row_ok & (scols < K // 16)[None, :], other=0).to(tl.int32)
    g = tl.load(gscale + gi * G_STRIDE)
    # (value * scale) is exact in fp32; the global scale rounds once, as in the reference
    y = tl.reshape(tl.reshape(v, [BLOCK_M, NB, 16]) * _e4m3_value(sc)[:, :, None] * g, [BLOCK_M, BLOCK_K])
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    dst = out + (gi.to(tl.int64) * R + r64) * K + cols[None, :]
    tl.store(dst, y.to(out.dtype.element_ty), mask=row_ok & (cols < K)[None, :])


# --------------------------------------------------------------------------------------------------
# the tiled block-scale layout
# --------------------------------------------------------------------------------------------------


@triton.jit
def _blocked_tiles(
    src, out,  # src: a (rows, cols) byte matrix; out: the tiles of one 128-row tile, tile ct at out + ct * 512
    row0, n_rows, cols, stride_r, stride_c, ct0, tiles_per_row,
    BLOCK_T: tl.constexpr,
):
    """Write tiles [ct0, ct0 + BLOCK_T) of a 128-row tile whose rows are src rows row0 + [0, n_rows)
    (rows past n_rows, and columns past cols, are padding: 0). Walks the output in its own order, so
    every byte of the tiles is written and the stores are contiguous."""
    i = tl.arange(0, BLOCK_T * TILE_BYTES)
    ct = ct0 + i // TILE_BYTES
    o = i % TILE_BYTES  # = (r % 32) * 16 + (r // 32) * 4 + c within the tile
    r = o // 16 + 32 * ((o // 4) % 4)
    c = ct * 4 + o % 4
    ok = (r < n_rows) & (c < cols)
    v = tl.load(src + (row0 + r).to(tl.int64) * stride_r + c.to(tl.int64) * stride_c, mask=ok, other=0)
    tl.store(out + ct.to(tl.int64) * TILE_BYTES + o, v, mask=ct < tiles_per_row)


@triton.jit
def _to_blocked_kernel(
    src, out,  # src (E, rows, cols) uint8 strided; out (E, row_tiles * tiles_per_row * 512) uint8
    rows, cols, stride_e, stride_r, stride_c, tiles_per_row,
    BLOCK_T: tl.constexpr,
):
    rt, cb, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row_tiles = tl.cdiv(rows, 128)
    dst = out + (e.to(tl.int64) * row_tiles + rt) * tiles_per_row * TILE_BYTES
    _blocked_tiles(src + e.to(tl.int64) * stride_e, dst, rt * 128, rows - rt * 128, cols, stride_r, stride_c,
                   cb * BLOCK_T, tiles_per_row, BLOCK_T)


@triton.jit
def _to_blocked_ragged_kernel(
    src, offs, out,  # src (M, cols) uint8 strided; offs (E,) int32 row ends; out (bound * tiles_per_row * 512,)
    M, cols, E, stride_r, stride_c, tiles_per_row,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rt, cb = tl.program_id(0), tl.program_id(1)
    # Each program derives the expert of its row tile from offs, on the device: expert g owns the row
    # tiles [tile_end[g] - tiles[g], tile_end[g]), tiles[g] = ceil(count[g] / 128); none owns the rest.
    g = tl.arange(0, BLOCK_E)
    ends = tl.load(offs + g, mask=g < E, other=0)
    starts = tl.load(offs + g - 1, mask=(g >= 1) & (g < E), other=0)
    counts = tl.maximum(ends - starts, 0)
    tiles = (counts + 127) // 128
    tile_end = tl.cumsum(tiles, 0)
    mine = (tile_end - tiles <= rt) & (rt < tile_end)
    local = rt - tl.sum(tl.where(mine, tile_end - tiles, 0), 0)  # this row tile's index within its expert
    row0 = tl.sum(tl.where(mine, starts, 0), 0) + local * 128
    n_rows = tl.where(tl.sum(mine.to(tl.int32), 0) > 0, tl.sum(tl.where(mine, counts, 0), 0) - local * 128, 0)
    n_rows = tl.minimum(n_rows, M - row0)  # offs past M: read no row outside src
    n_rows = tl.where(row0 >= 0, n_rows, 0)  # nor before it (negative offs)
    dst = out + rt.to(tl.int64) * tiles_per_row * TILE_BYTES
    _blocked_tiles(src, dst, row0, n_rows, cols, stride_r, stride_c, cb * BLOCK_T, tiles_per_row, BLOCK_T)

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
- a subnormal d has no finite reciprocal. d is at least 2^-9 times the global scale, so only a global
  scale below 2^-117 makes one: programs with such a scale run a copy of the loop that scales x and d
  by 2^64 (exact), which leaves the quotient unchanged; the others skip that multiply;
- where the quotient overflows (or x is infinite), the corrections give NaN, and the code saturates
  as the quotient's would (``_rn_codes``);
- a quotient below 2^-126 may come out an ulp off, but every value below 0.25 rounds to e2m1 code 0,
  so the codes, which are all this kernel writes, do not change.

The rest, per element: the e2m1 code is ``_e2m1_magnitude_bits`` of min(|q|, 6) (an exponent-indexed
RNE, one FMA), x's sign is or-ed in with integer operations, and two codes pack into a byte. Per
block, the e4m3 scale is rounded and decoded by the conversion instructions (``cvt`` e4m3x2, sm_89 and
newer, which this kernel requires anyway), which round as ``_e4m3_code`` does.

Two paths, the same bits. bf16 input with a unit column stride, even strides and a 4-byte aligned start
takes ``_quantize_words``: its rows are read as 32-bit words of two elements, and inline PTX takes the
block amax as a NaN-keeping bf16x2 maximum (a block holding a NaN or an inf then takes the NaN scale)
and packs four code bytes with their signs per word; that kernel is persistent over all of a group's
tiles. Other inputs go element by element (``_quantize_blocks``), persistent along the rows of a
column tile. Both issue a tile's loads before the arithmetic of the one
before it. The SwiGLU pass takes the same two paths for its h.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .epilogue import swiglu_apply
from .nvfp4 import _block_abs, _block_ratio, _e2m1_magnitude_bits, _read_global_scale

TWO_64 = gl.constexpr(18446744073709551616.0)
NO_LIFT = gl.constexpr(2.0**-117)  # global scales from here up give normal divisors d
# _quantize_blocks' LIFT: never, always (the caller checked g < NO_LIFT), or by g at run time
LIFT_NEVER = gl.constexpr(0)
LIFT_ALWAYS = gl.constexpr(1)
LIFT_BY_SCALE = gl.constexpr(2)


@triton.jit
def _div_rn(a, b):
    return tl.math.div_rn(a, b)


@gluon.jit
def _e4m3_code_cvt(r):
    """``_e4m3_code`` by the conversion instruction (sm_89 and newer): fp32 r in [0, 448] or NaN -> the
    e4m3fn code (int32), nearest even, subnormals included; NaN -> 0x7F."""
    c = gl.inline_asm_elementwise(
        "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $1; cvt.u32.u16 $0, t; }",
        "=r,f", [r], dtype=gl.int32, is_pure=True, pack=1)
    return gl.where(r == r, c & 0xFF, 0x7F)


@gluon.jit
def _e4m3_value_cvt(code):
    """``_e4m3_value`` by the conversion instruction: e4m3fn codes (int32, 0-255) -> fp32, exactly."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 t, lo, hi; .reg .b32 h; cvt.u16.u32 t, $1; cvt.rn.f16x2.e4m3x2 h, t; "
        "mov.b32 {lo, hi}, h; cvt.f32.f16 $0, lo; }",
        "=f,r", [code], dtype=gl.float32, is_pure=True, pack=1)


@triton.jit
def _rn_magnitude_bits(xs, nd, y):
    """``_e2m1_magnitude_bits`` of min(|q|, 6) for q = RN(xs / d), given nd = -d and y = RN(1 / d): q0 = xs * y
    and two corrections (each one FMA for the residual, whose product by nd is exact, and one for the
    step). Where the quotient overflows, or xs is infinite, q comes out NaN, and the minimum with 6
    (``min.f32`` returns the number) saturates it as the quotient's code would be."""
    q0 = xs * y
    q1 = tl.fma(tl.fma(q0, nd, xs), y, q0)
    q = tl.fma(tl.fma(q1, nd, xs), y, q1)
    return _e2m1_magnitude_bits(tl.minimum(tl.abs(q), 6.0))


@triton.jit
def _rn_codes(xs, x, nd, y, keep):
    """e2m1 codes of q = RN(xs / d) (``_rn_magnitude_bits``) in the low 4 bits of int32s (the bits above
    them arbitrary). The sign is x's (d > 0), and a NaN x, or a block whose scale underflowed (``keep``
    false), gets code 0, as in ``_e2m1_code``."""
    t = _rn_magnitude_bits(xs, nd, y)  # the code is its low 4 bits (the rest is 0x4B400000, which the packing drops)
    t = t | ((x.to(tl.int32, bitcast=True) >> 28) & (t + 7) & 8)  # x's sign, where the code is not 0
    return tl.where(keep & (x == x), t, 0)


@gluon.jit
def _load_tile(x, pid_m, pid_k, gi, R, K, stride_g, stride_r, stride_k,
               BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, LX: gl.constexpr):
    """Row tile pid_m, column tile pid_k of group gi of x as [BLOCK_M, BLOCK_K] in LX (each thread 16
    consecutive elements); zeros past the tensor (and for a row tile past the last)."""
    rx = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LX))
    cx = pid_k * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LX))
    src = (x + gi.to(gl.int64) * stride_g + gl.expand_dims(rx.to(gl.int64) * stride_r, 1)
           + gl.expand_dims(cx.to(gl.int64) * stride_k, 0))
    return gl.load(src, mask=gl.expand_dims(rx < R, 1) & gl.expand_dims(cx < K, 0), other=0.0)


@gluon.jit
def _block_scales(amax, g):
    """Per block: its amax (``_block_abs``: +inf for a block with a NaN or an inf) and the global scale
    g -> (e4m3 scale code (int32), the divisor d = decoded scale * g, or 1 where the scale underflowed
    e4m3 or is NaN, and ``ok``, false there: such a block gets zero codes)."""
    ratio = _block_ratio(_div_rn(amax, gl.zeros_like(amax) + 6.0 * g), amax)
    s_code = _e4m3_code_cvt(ratio)
    denom = gl.where(ratio == ratio, _e4m3_value_cvt(s_code), ratio) * g
    ok = denom > 0
    return s_code, gl.where(ok, denom, 1.0), ok


@gluon.jit
def _quantize_blocks(xt, g, nib4, LIFT: gl.constexpr):
    """One tile [rows, blocks, 8, 2] fp32 (a thread holding whole blocks) and its global scale g ->
    (packed codes [rows, blocks, 8] uint8, the even element low; e4m3 scale codes [rows, blocks]
    int32). ``LIFT``: whether x and d are scaled by 2^64 first, which g < NO_LIFT needs (d can be
    subnormal there): LIFT_NEVER, LIFT_ALWAYS, or LIFT_BY_SCALE (a factor of 2^64 or 1 from g, one
    multiply per element)."""
    # per block, once per thread
    amax = gl.max(gl.max(_block_abs(xt), axis=3), axis=2)  # [rows, blocks]
    s_code, d, ok = _block_scales(amax, g)
    if LIFT == LIFT_ALWAYS:
        d = d * TWO_64
    if LIFT == LIFT_BY_SCALE:
        lift = gl.where(g < NO_LIFT, TWO_64, 1.0)
        d = d * lift
    y = _div_rn(gl.zeros_like(d) + 1.0, d)
    # per element: q = RN(x / d), then its code
    d4 = gl.expand_dims(gl.expand_dims(d, 2), 3)
    y4 = gl.expand_dims(gl.expand_dims(y, 2), 3)
    keep4 = gl.expand_dims(gl.expand_dims(ok, 2), 3)
    if LIFT == LIFT_ALWAYS:
        codes = _rn_codes(xt * TWO_64, xt, -d4, y4, keep4)
    elif LIFT == LIFT_BY_SCALE:
        codes = _rn_codes(xt * lift, xt, -d4, y4, keep4)
    else:
        codes = _rn_codes(xt, xt, -d4, y4, keep4)
    return gl.sum(codes << (nib4 * 4), axis=3).to(gl.uint8), s_code  # the sum's carries land above bit 7


# The bf16 path works on 32-bit words, each two bf16 elements (the even one in the low half), which is
# also one byte of output codes. The block's amax is a ``max.NaN.bf16x2`` over the words' |x| (the
# sign bits cleared), which keeps a NaN, then ``_WORDS_AMAX``: the two halves' maximum as fp32, with a
# NaN or an inf (bits 0x7F80 and up) as +inf, so that a block holding one takes the NaN scale and zero
# codes (``_block_ratio``); a NaN or inf element thus needs no care of its own in the arithmetic below.
_WORDS_AMAX = gl.constexpr("{ .reg .b32 t, u; prmt.b32 t, $1, 0, 0x1032; max.NaN.bf16x2 u, $1, t; "
                           "and.b32 u, u, 0xFFFF; min.u32 u, u, 0x7F80; shl.b32 $0, u, 16; }")
# Four words' magnitude bytes ($1-$4: code_lo + 16 code_hi in the low byte) and the four input words
# ($5-$8) -> the four output bytes with the signs: a sign goes to bit 3 (even element) or 7 of
# its byte where that code is not 0 (a negative value rounding to 0 gets the code of +0). The signs
# come from ``prmt``'s sign-replicate selectors (bytes 1 and 3 of each word hold its halves' sign bits).
_WORDS_PACK4 = gl.constexpr("{ .reg .b32 a, b, p, s01, s23, sl, sh, nz; "
                "prmt.b32 a, $1, $2, 0x0040; prmt.b32 b, $3, $4, 0x0040; prmt.b32 p, a, b, 0x5410; "
                "prmt.b32 s01, $5, $6, 0xFDB9; prmt.b32 s23, $7, $8, 0xFDB9; "
                "prmt.b32 sl, s01, s23, 0x6420; prmt.b32 sh, s01, s23, 0x7531; "
                "and.b32 sl, sl, 0x08080808; and.b32 sh, sh, 0x80808080; or.b32 sl, sl, sh; "
                "add.u32 nz, p, 0x77777777; and.b32 sl, sl, nz; or.b32 $0, p, sl; }")


_BF16X2_MAX_NAN = gl.constexpr("max.NaN.bf16x2 $0, $1, $2;")  # a NaN half in either gives NaN


@gluon.jit
def _bf16x2_max_nan(a, b):
    return gl.inline_asm_elementwise(_BF16X2_MAX_NAN, "=r,r,r", [a, b], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _split4(t):
    """[rows, blocks, 8] -> its elements 4a, 4a + 1, 4a + 2, 4a + 3 as four [rows, blocks, 2] (index a)."""
    rows: gl.constexpr = t.shape[0]
    nb: gl.constexpr = t.shape[1]
    even, odd = gl.split(gl.reshape(t, [rows, nb, 2, 2, 2]))
    e0, e2 = gl.split(even)
    e1, e3 = gl.split(odd)
    return e0, e1, e2, e3


@gluon.jit
def _quantize_words(w, g, LIFT: gl.constexpr, LP: gl.constexpr):
    """``_quantize_blocks`` for bf16 input: one tile [rows, blocks, 8] of int32 words (a thread holding
    whole blocks) -> (packed codes [rows, blocks, 2] int32, four code bytes each, the even element's
    code low, in LP; e4m3 scale codes [rows, blocks] int32), the same bits. ``LIFT``: LIFT_NEVER or
    LIFT_ALWAYS."""
    gl.static_assert(LIFT != LIFT_BY_SCALE, "_quantize_words: LIFT_NEVER or LIFT_ALWAYS")
    amax = gl.inline_asm_elementwise(_WORDS_AMAX, "=f,r", [gl.reduce(w & 0x7FFF7FFF, 2, _bf16x2_max_nan)],
                                     dtype=gl.float32, is_pure=True, pack=1)
    s_code, d, ok = _block_scales(amax, g)
    lo = (w << 16).to(gl.float32, bitcast=True)
    hi = (w & -65536).to(gl.float32, bitcast=True)
    if LIFT == LIFT_ALWAYS:
        d = d * TWO_64
        lo = lo * TWO_64
        hi = hi * TWO_64
    y = _div_rn(gl.zeros_like(d) + 1.0, d)
    nd3 = gl.expand_dims(-d, 2)
    y3 = gl.expand_dims(y, 2)
    mags = _rn_magnitude_bits(lo, nd3, y3) + (_rn_magnitude_bits(hi, nd3, y3) << 4)
    m0, m1, m2, m3 = _split4(mags)
    w0, w1, w2, w3 = _split4(w)
    packed = gl.inline_asm_elementwise(_WORDS_PACK4, "=r,r,r,r,r,r,r,r,r", [m0, m1, m2, m3, w0, w1, w2, w3],
                                       dtype=gl.int32, is_pure=True, pack=1)
    packed = gl.convert_layout(packed, LP, assert_trivial=True)
    ok3 = gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(2, LP), assert_trivial=True), 2)
    return gl.where(ok3, packed, 0), gl.convert_layout(s_code, gl.SliceLayout(2, LP), assert_trivial=True)


@gluon.jit
def _load_words(x, pid_m, pid_k, gi, R, K, stride_g, stride_r, BLOCK_M: gl.constexpr, NW: gl.constexpr,
                LW: gl.constexpr):
    """Row tile pid_m, column tile pid_k of group gi of bf16 x (unit column stride, even strides, a 4-byte
    aligned start) as [BLOCK_M, NW] int32 words of two elements; zeros past the tensor."""
    xw = x.to(gl.pointer_type(gl.int32))
    rx = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LW))
    cx = pid_k * NW + gl.arange(0, NW, layout=gl.SliceLayout(0, LW))
    src = (xw + gi.to(gl.int64) * (stride_g // 2) + gl.expand_dims(rx.to(gl.int64) * (stride_r // 2), 1)
           + gl.expand_dims(cx, 0))
    return gl.load(src, mask=gl.expand_dims(rx < R, 1) & gl.expand_dims(cx < K // 2, 0), other=0)


@gluon.jit
def _tile_indices(ROWS: gl.constexpr, NB: gl.constexpr, L4: gl.constexpr):
    """The index tensors of a [ROWS, NB, 8, 2] tile in L4: row offsets [ROWS, 1] and block offsets
    [1, NB] (in L4's [rows, blocks] slice), byte offsets [1, 1, 8] and nibble offsets [1, 1, 1, 2]."""
    L3: gl.constexpr = gl.SliceLayout(3, L4)  # [rows, blocks, bytes]
    L2: gl.constexpr = gl.SliceLayout(2, L3)  # [rows, blocks]
    r_off = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, L2)), 1)
    b_off = gl.expand_dims(gl.arange(0, NB, layout=gl.SliceLayout(0, L2)), 0)
    byte3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3))), 0), 1)
    nib4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(
        gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4)))), 0), 1), 2)
    return r_off, b_off, byte3, nib4


@gluon.jit
def _store_blocks(values, scales, packed, s_code, out_rows2, blk2, ok2, K, byte3):
    """Store a tile's packed codes and scale codes: rows out_rows2 [rows, 1] (int64), 16-element blocks
    blk2 [1, blocks] of a (.., K) tensor, where ok2; values (.., K / 2), scales (.., K / 16), uint8."""
    vdst = values + gl.expand_dims(out_rows2 * (K // 2) + blk2 * 8, 2) + byte3
    gl.store(vdst, packed, mask=gl.expand_dims(ok2, 2))
    gl.store(scales + out_rows2 * (K // 16) + blk2, s_code.to(gl.uint8), mask=ok2)


@gluon.jit
def _quantize_rows_kernel(
    x, values, scales, gscale,  # as _quantize_kernel's (1x16 blocks, round to nearest)
    R, K, stride_g, stride_r, stride_k,
    G_STRIDE,  # 1: gscale (G,) holds one global scale per group; 0: gscale[0] for all
    BLOCK_M: gl.constexpr, NB: gl.constexpr, TPW_B: gl.constexpr,
    WORDS: gl.constexpr = False,  # bf16 x with a unit column stride and even strides: ``_quantize_words``,
    # persistent over all of a group's tiles (grid (P, 1, groups))
):
    # Element by element: persistent along the rows, grid (P, column tiles, groups), and program p takes
    # row tiles p, p + P, ... of its column tile (the word path: grid (P, 1, groups), ``_quantize_words_loop``).
    # It loads the next tile's x before it quantizes the current one, so that
    # its loads are in flight while it computes (one tile per program, each program's loads and its
    # chain of per-block divisions would alternate, with nothing to overlap them).
    # [rows, blocks, bytes, nibbles]: a thread holds the 8 x 2 elements of a block, TPW_B threads of a
    # warp cover NB blocks of a row, the rest of the warp and the warps cover rows
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 8, 2], [32 // TPW_B, TPW_B, 1, 1], [gl.num_warps(), 1, 1, 1],
                                        [3, 2, 1, 0])
    # the load: a 2-D tile whose threads hold 16 consecutive elements (two 16-byte vectors for bf16),
    # viewed as the 4-D tile without moving data
    LX: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_B, TPW_B], [gl.num_warps(), 1], [1, 0])
    pid, programs, pid_k, gi = gl.program_id(0), gl.num_programs(0), gl.program_id(1), gl.program_id(2)
    g = _read_global_scale(gscale + gi * G_STRIDE)
    if WORDS:
        # the same tile as 32-bit words: [rows, words] loaded (eight per block, two 16-byte vectors),
        # viewed as [rows, blocks, 8]; the packed codes leave as [rows, blocks, 2] words
        LW: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_B, TPW_B], [gl.num_warps(), 1], [1, 0])
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // TPW_B, TPW_B, 1], [gl.num_warps(), 1, 1], [2, 1, 0])
        if g >= NO_LIFT:
            _quantize_words_loop(x, values, scales, g, R, K, stride_g, stride_r, pid, programs, gi,
                                 BLOCK_M, NB, LW, L3, LIFT_NEVER)
        else:
            _quantize_words_loop(x, values, scales, g, R, K, stride_g, stride_r, pid, programs, gi,
                                 BLOCK_M, NB, LW, L3, LIFT_ALWAYS)
    elif g >= NO_LIFT:  # (a loop per case: the common one without the lift's multiply per element)
        _quantize_rows_loop(x, values, scales, g, R, K, stride_g, stride_r, stride_k, pid, programs, pid_k, gi,
                            BLOCK_M, NB, L4, LX, LIFT_NEVER)
    else:
        _quantize_rows_loop(x, values, scales, g, R, K, stride_g, stride_r, stride_k, pid, programs, pid_k, gi,
                            BLOCK_M, NB, L4, LX, LIFT_ALWAYS)


@gluon.jit
def _quantize_rows_loop(x, values, scales, g, R, K, stride_g, stride_r, stride_k, pid, programs, pid_k, gi,
                        BLOCK_M: gl.constexpr, NB: gl.constexpr, L4: gl.constexpr, LX: gl.constexpr,
                        LIFT: gl.constexpr):
    BLOCK_K: gl.constexpr = NB * 16
    tiles_m = (R + BLOCK_M - 1) // BLOCK_M
    r_off, b_off, byte3, nib4 = _tile_indices(BLOCK_M, NB, L4)
    blk2 = pid_k * NB + b_off

    x_next = _load_tile(x, pid, pid_k, gi, R, K, stride_g, stride_r, stride_k, BLOCK_M, BLOCK_K, LX)
    for pid_m in range(pid, tiles_m, programs):
        x2 = x_next
        x_next = _load_tile(x, pid_m + programs, pid_k, gi, R, K, stride_g, stride_r, stride_k, BLOCK_M, BLOCK_K, LX)
        xt = gl.convert_layout(gl.reshape(x2.to(gl.float32), [BLOCK_M, NB, 8, 2]), L4, assert_trivial=True)
        packed, s_code = _quantize_blocks(xt, g, nib4, LIFT)
        rows2 = pid_m * BLOCK_M + r_off
        ok2 = (rows2 < R) & (blk2 < K // 16)  # K % 16 == 0: whole blocks are in or out
        _store_blocks(values, scales, packed, s_code, gi.to(gl.int64) * R + rows2, blk2, ok2, K, byte3)


@gluon.jit
def _word_indices(ROWS: gl.constexpr, NB: gl.constexpr, LP: gl.constexpr):
    """The index tensors of ``_store_words``'s [ROWS, NB, 2] tile in LP: row offsets [ROWS, 1] and block
    offsets [1, NB] (in LP's [rows, blocks] slice), word offsets [1, 1, 2]."""
    L2: gl.constexpr = gl.SliceLayout(2, LP)
    r_off = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, L2)), 1)
    b_off = gl.expand_dims(gl.arange(0, NB, layout=gl.SliceLayout(0, L2)), 0)
    half3 = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LP))), 0), 1)
    return r_off, b_off, half3


@gluon.jit
def _store_words(values, scales, packed, s_code, out_rows2, blk2, ok2, K, half3):
    """``_store_blocks`` for ``_quantize_words``' output: packed codes [rows, blocks, 2] int32 (8 bytes
    per block), scale codes [rows, blocks]."""
    dst = values.to(gl.pointer_type(gl.int32)) + gl.expand_dims(out_rows2 * (K // 8) + blk2 * 2, 2) + half3
    gl.store(dst, packed, mask=gl.expand_dims(ok2, 2))
    gl.store(scales + out_rows2 * (K // 16) + blk2, s_code.to(gl.uint8), mask=ok2)


@gluon.jit
def _quantize_words_tile(w2, tm, tk, values, scales, g, R, K, gi, r_off, b_off, half3,
                         BLOCK_M: gl.constexpr, NB: gl.constexpr, L3: gl.constexpr, LP: gl.constexpr,
                         LIFT: gl.constexpr):
    """Quantize and store the tile at row tile tm, column tile tk from its loaded words."""
    w = gl.convert_layout(gl.reshape(w2, [BLOCK_M, NB, 8]), L3, assert_trivial=True)
    packed, s_code = _quantize_words(w, g, LIFT, LP)
    rows2 = tm * BLOCK_M + r_off
    blk2 = tk * NB + b_off
    ok2 = (rows2 < R) & (blk2 < K // 16)
    _store_words(values, scales, packed, s_code, gi.to(gl.int64) * R + rows2, blk2, ok2, K, half3)


@gluon.jit
def _step_tile(tm, tk, dm, dk, tiles_k):
    """(row tile, column tile) of tile index tm * tiles_k + tk + P, given (dm, dk) = divmod(P, tiles_k)."""
    tk = tk + dk
    wrap = tk >= tiles_k
    return tm + dm + wrap.to(gl.int32), gl.where(wrap, tk - tiles_k, tk)


@gluon.jit
def _quantize_words_loop(x, values, scales, g, R, K, stride_g, stride_r, pid, programs, gi,
                         BLOCK_M: gl.constexpr, NB: gl.constexpr, LW: gl.constexpr, L3: gl.constexpr,
                         LIFT: gl.constexpr):
    # Persistent over the group's tiles, row-major (neighbouring programs take neighbouring column tiles
    # of the same rows): program p takes tiles p, p + P, p + 2P, ..., two per trip, from two register
    # buffers. Each buffer is reloaded with its tile two strides ahead as soon as its tile is read, so one
    # tile's loads are in flight while the other is computed, and no buffer is copied. Tile indices
    # advance as (row tile, column tile) pairs, without a division per tile.
    NW: gl.constexpr = NB * 8
    tiles_k = (K + NB * 16 - 1) // (NB * 16)
    tiles_m = (R + BLOCK_M - 1) // BLOCK_M
    LP: gl.constexpr = gl.BlockedLayout([1, 1, 2], L3.threads_per_warp, L3.warps_per_cta, [2, 1, 0])  # packed codes
    r_off, b_off, half3 = _word_indices(BLOCK_M, NB, LP)
    dm = programs // tiles_k
    dk = programs % tiles_k

    # a tile past the last one loads nothing: its rows lie past R
    am, ak = pid // tiles_k, pid % tiles_k
    bm, bk = _step_tile(am, ak, dm, dk, tiles_k)
    wa = _load_words(x, am, ak, gi, R, K, stride_g, stride_r, BLOCK_M, NW, LW)
    wb = _load_words(x, bm, bk, gi, R, K, stride_g, stride_r, BLOCK_M, NW, LW)
    while am < tiles_m:
        _quantize_words_tile(wa, am, ak, values, scales, g, R, K, gi, r_off, b_off, half3, BLOCK_M, NB, L3, LP,
                             LIFT)
        am, ak = _step_tile(bm, bk, dm, dk, tiles_k)
        wa = _load_words(x, am, ak, gi, R, K, stride_g, stride_r, BLOCK_M, NW, LW)
        if bm < tiles_m:
            _quantize_words_tile(wb, bm, bk, values, scales, g, R, K, gi, r_off, b_off, half3, BLOCK_M, NB, L3,
                                 LP, LIFT)
        bm, bk = _step_tile(am, ak, dm, dk, tiles_k)
        wb = _load_words(x, bm, bk, gi, R, K, stride_g, stride_r, BLOCK_M, NW, LW)


@gluon.jit
def _load_gate_up_raw(pre, pid_m, pid_f, M, F, stride_m, BLOCK_M: gl.constexpr, BLOCK_F: gl.constexpr,
                      LAYOUT: gl.constexpr, LX: gl.constexpr, LX2: gl.constexpr):
    """The pre-activation behind h columns [pid_f * BLOCK_F, +BLOCK_F) of row tile pid_m, as loaded:
    "halves": (gate, up), each [BLOCK_M, BLOCK_F] in LX; the interleaved layouts: ([BLOCK_M,
    2 * BLOCK_F] in LX2, the same tensor again), a thread's 32 consecutive elements. Zeros past the
    tensor."""
    if LAYOUT == "halves":
        r = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LX))
        c = pid_f * BLOCK_F + gl.arange(0, BLOCK_F, layout=gl.SliceLayout(0, LX))
        src = pre + gl.expand_dims(r.to(gl.int64) * stride_m, 1) + gl.expand_dims(c, 0)
        mask = gl.expand_dims(r < M, 1) & gl.expand_dims(c < F, 0)
        a = gl.load(src, mask=mask, other=0.0)
        b = gl.load(src + F, mask=mask, other=0.0)
    else:
        r = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LX2))
        c = 2 * pid_f * BLOCK_F + gl.arange(0, 2 * BLOCK_F, layout=gl.SliceLayout(0, LX2))
        src = pre + gl.expand_dims(r.to(gl.int64) * stride_m, 1) + gl.expand_dims(c, 0)
        a = gl.load(src, mask=gl.expand_dims(r < M, 1) & gl.expand_dims(c < 2 * F, 0), other=0.0)
        b = a
    return a, b


@gluon.jit
def _gate_up_blocks(a, b, BLOCK_M: gl.constexpr, NB: gl.constexpr, LAYOUT: gl.constexpr, L4: gl.constexpr):
    """``_load_gate_up_raw``'s tiles -> gate and up as [BLOCK_M, NB, 8, 2] fp32 in L4 (h column
    16 * block + 2 * byte + nibble), moved within each thread only."""
    if LAYOUT == "halves":
        gate = gl.reshape(a.to(gl.float32), [BLOCK_M, NB, 8, 2])
        up = gl.reshape(b.to(gl.float32), [BLOCK_M, NB, 8, 2])
    elif LAYOUT == "interleaved":  # g0, u0, g1, u1, ...
        gate, up = gl.split(gl.reshape(a.to(gl.float32), [BLOCK_M, NB, 8, 2, 2]))
    else:  # interleaved8: per block, gate 0-7, up 0-7, gate 8-15, up 8-15
        runs = gl.permute(gl.reshape(a.to(gl.float32), [BLOCK_M, NB, 2, 2, 8]), [0, 1, 2, 4, 3])
        gate, up = gl.split(runs)  # [BLOCK_M, NB, 2, 8] each: (run, element of the run)
        gate = gl.reshape(gate, [BLOCK_M, NB, 8, 2])
        up = gl.reshape(up, [BLOCK_M, NB, 8, 2])
    return gl.convert_layout(gate, L4), gl.convert_layout(up, L4)


@gluon.jit
def _swiglu_quantize_rows_kernel(
    pre, values, scales, gscale,  # as _swiglu_quantize_kernel's
    M, F, stride_pre_m,
    ALPHA: gl.constexpr, LIMIT: gl.constexpr, OFFSET: gl.constexpr, LAYOUT: gl.constexpr,
    BLOCK_M: gl.constexpr, NB: gl.constexpr, TPW_B: gl.constexpr,
    WORDS: gl.constexpr = True,  # bf16 h through ``_quantize_words``; False (for comparisons): element by
    # element, the same bits
):
    # ``_swiglu_quantize_kernel``'s bytes (h = SwiGLU(pre) rounded to pre's dtype, then quantized with
    # 1x16 blocks) with ``_quantize_rows_kernel``'s layout and loop: grid (P, column tiles of h),
    # persistent along the rows, the next tile's pre-activation loaded before the current tile's
    # arithmetic. A thread loads the 32 (interleaved layouts) or 2 x 16 (halves) pre-activation
    # elements behind one 16-element block of h.
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 8, 2], [32 // TPW_B, TPW_B, 1, 1], [gl.num_warps(), 1, 1, 1],
                                        [3, 2, 1, 0])
    LX: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_B, TPW_B], [gl.num_warps(), 1], [1, 0])
    LX2: gl.constexpr = gl.BlockedLayout([1, 32], [32 // TPW_B, TPW_B], [gl.num_warps(), 1], [1, 0])
    pid, programs, pid_f = gl.program_id(0), gl.num_programs(0), gl.program_id(1)
    g = _read_global_scale(gscale)
    if g >= NO_LIFT:
        _swiglu_quantize_loop(pre, values, scales, g, M, F, stride_pre_m, pid, programs, pid_f, ALPHA, LIMIT,
                              OFFSET, LAYOUT, BLOCK_M, NB, L4, LX, LX2, LIFT_NEVER, WORDS)
    else:
        _swiglu_quantize_loop(pre, values, scales, g, M, F, stride_pre_m, pid, programs, pid_f, ALPHA, LIMIT,
                              OFFSET, LAYOUT, BLOCK_M, NB, L4, LX, LX2, LIFT_ALWAYS, WORDS)


@gluon.jit
def _swiglu_quantize_loop(pre, values, scales, g, M, F, stride_pre_m, pid, programs, pid_f,
                          ALPHA: gl.constexpr, LIMIT: gl.constexpr, OFFSET: gl.constexpr, LAYOUT: gl.constexpr,
                          BLOCK_M: gl.constexpr, NB: gl.constexpr, L4: gl.constexpr, LX: gl.constexpr,
                          LX2: gl.constexpr, LIFT: gl.constexpr, WORDS: gl.constexpr):
    BLOCK_F: gl.constexpr = NB * 16
    tiles_m = (M + BLOCK_M - 1) // BLOCK_M
    r_off, b_off, byte3, nib4 = _tile_indices(BLOCK_M, NB, L4)
    blk2 = pid_f * NB + b_off
    # bf16 h: rounded and paired into 32-bit words by one cvt per pair, then ``_quantize_words``
    BF16_WORDS: gl.constexpr = WORDS and pre.dtype.element_ty == gl.bfloat16
    LP: gl.constexpr = gl.BlockedLayout([1, 1, 2], [L4.threads_per_warp[0], L4.threads_per_warp[1], 1],
                                        [gl.num_warps(), 1, 1], [2, 1, 0])
    r_offw, b_offw, half3 = _word_indices(BLOCK_M, NB, LP)
    blk2w = pid_f * NB + b_offw

    a_next, b_next = _load_gate_up_raw(pre, pid, pid_f, M, F, stride_pre_m, BLOCK_M, BLOCK_F, LAYOUT, LX, LX2)
    for pid_m in range(pid, tiles_m, programs):
        a, b = a_next, b_next
        a_next, b_next = _load_gate_up_raw(pre, pid_m + programs, pid_f, M, F, stride_pre_m, BLOCK_M, BLOCK_F,
                                           LAYOUT, LX, LX2)
        gate, up = _gate_up_blocks(a, b, BLOCK_M, NB, LAYOUT, L4)
        h = swiglu_apply(gate, up, ALPHA, LIMIT, OFFSET)
        if BF16_WORDS:
            h_even, h_odd = gl.split(h)
            words = gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [h_even, h_odd],
                                              dtype=gl.int32, is_pure=True, pack=1)
            packed, s_code = _quantize_words(words, g, LIFT, LP)
            rows2 = pid_m * BLOCK_M + r_offw
            ok2 = (rows2 < M) & (blk2w < F // 16)
            _store_words(values, scales, packed, s_code, rows2.to(gl.int64), blk2w, ok2, F, half3)
        else:
            h = h.to(pre.dtype.element_ty).to(gl.float32)
            packed, s_code = _quantize_blocks(h, g, nib4, LIFT)
            rows2 = pid_m * BLOCK_M + r_off
            ok2 = (rows2 < M) & (blk2 < F // 16)
            _store_blocks(values, scales, packed, s_code, rows2.to(gl.int64), blk2, ok2, F, byte3)

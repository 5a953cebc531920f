"""The NVFP4 grouped GEMM, emulated for GPUs without FP4 tensor cores (Hopper): ``moekit.nvfp4_gemm``.

``_grouped_mm_nvfp4_kernel``: ``c[rows_g] = (a[rows_g] @ w[g]^T) * a_global * w_global[g]`` with both
operands in NVFP4 (packed e2m1 codes + one e4m3 scale per 16 elements along K). Each K step loads the
packed bytes and the scale bytes of an A tile and a W tile, decodes them in registers to
``e2m1 value * e4m3 block scale`` and feeds ``tl.dot`` with an fp32 accumulator; the two global scales
multiply the accumulator in the epilogue. ``SWAP``: the tile is computed transposed, ``w @ a^T`` (the
weights' rows as the MMA's M, the few rows of an expert as its N), for few rows per expert: a
[BLOCK_N, BLOCK_K] weight tile decoded in registers can then feed a Hopper wgmma as its register
operand, and the rows' tile (BLOCK_M, as small as 16) is the one that goes through shared memory.
With it the launcher decodes A once beforehand (``A_DECODED``: value * block scale, exact in bf16),
since every column tile would decode the same few rows again, and the kernel loads A as it is.

Two decodes, the same values (``PTX``):

- in inline PTX (sm_89 and newer GPUs; ``OP_DTYPE`` f16): per packed byte, one ``prmt`` looks both
  magnitudes' f16 high bytes up in an 8-byte table (the eight e2m1 magnitudes have zero low bytes in
  f16), a ``prmt`` spreads them into an f16 pair, a ``prmt`` + ``lop3`` put the two signs in, and one
  ``mul.rn.f16x2`` applies the block scale, which ``cvt.rn.f16x2.e4m3x2`` converts exactly;
- written out in Triton ops (the interpreter, older GPUs; ``OP_DTYPE`` bf16, or fp32 on the
  interpreter): each code's bits placed in an fp32 word (``_e2m1_placed``: the magnitude bits at the
  exponent's and mantissa's top, the sign at the top), which reads value * 2^-126 (an fp32 subnormal
  for 0.5), multiplied by the block scale times 2^63 and by 2^63: two exact multiplies per element.

Why the decoded operand is exact in bf16 and in f16: an e2m1 value has at most 2 significant bits, an
e4m3 scale at most 4 (fewer when subnormal), so their product has at most 6 and lies in [2^-10, 2688],
inside the normal range of f16 (from 2^-14) and bf16, whose significands hold 11 and 8 bits. The f16
multiply and the fp32 product's cast to bf16 therefore do not round. The products of two decoded
operands (<= 12 bits) are exact in the fp32 accumulator as well; the only roundings are the
accumulation's, the global-scale multiply's and the output cast's.

The tile schedule is the rows-ragged one of ``_kernels/grouped_gemm.py`` (``_group_table``/``_locate``):
built from ``offs`` in registers by every persistent program, never read by the host. Group E covers
the rows [offs[-1], M) and writes zeros.
"""

import triton
import triton.language as tl

from .grouped_gemm import _group_table, _load_2d, _locate, _store_rows
from .nvfp4 import _e4m3_value, _packed_to_k_order

TWO_63 = tl.constexpr(9.223372036854775808e18)  # 2^63: 2^126 in two exact steps (448 * 2^126 overflows)

# One packed byte per asm instance ($2, low byte; $3 its block scale in f16) -> its two elements in f16
# ($0 even, $1 odd). m (the two magnitudes) selects their f16 high bytes (0, 0.5, 1, 1.5, 2, 3, 4, 6
# have zero low bytes) from the table {ta, tb}; the second prmt moves them to bytes 1 and 3 (an f16
# pair); g carries the byte's bit 3 to bit 15 and bit 7 to bit 31, the signs, which lop3
# (a | (b & c)) puts in; one packed multiply by the scale.
_E2M1_PAIR_F16 = tl.constexpr("""{
.reg .b32 m, h, p, s, g, ta, tb, sc;
mov.b32 ta, 0x3E3C3800;
mov.b32 tb, 0x46444240;
and.b32 m, $2, 0x77;
prmt.b32 h, ta, tb, m;
prmt.b32 p, h, 0, 0x1404;
shl.b32 s, $2, 4;
prmt.b32 g, s, $2, 0x4000;
lop3.b32 p, p, g, 0x80008000, 0xf8;
mov.b32 sc, {$3, $3};
mul.rn.f16x2 p, p, sc;
mov.b32 {$0, $1}, p;
}""")

def _word_decode_ptx(word: str, sa: str, sb: str, out: int) -> str:
    """The PTX lines that decode one packed word (``word``, in ``pack_weights``'s order) into its 8
    elements in f16, written to the asm outputs ``$out`` .. ``$out+7``; ``sa`` and ``sb`` are the f16
    scales of the word's two blocks. Needs the registers m, mh, h0, h1, p0-p3, v4, sa, sb and the table
    halves ta, tb (``_E2M1_TABLE``) declared. Shared by this kernel and the warp-specialized one."""
    return f"""and.b32 m, {word}, 0x77777777;
shr.b32 mh, m, 16;
prmt.b32 h0, ta, tb, m;
prmt.b32 h1, ta, tb, mh;
shl.b32 v4, {word}, 4;
lop3.b32 h0, h0, {word}, 0x80808080, 0xf8;
lop3.b32 h1, h1, v4, 0x80808080, 0xf8;
prmt.b32 p0, h0, 0, 0x1404;
prmt.b32 p1, h0, 0, 0x3424;
prmt.b32 p2, h1, 0, 0x1404;
prmt.b32 p3, h1, 0, 0x3424;
mov.b32 sa, {{{sa}, {sa}}};
mov.b32 sb, {{{sb}, {sb}}};
mul.rn.f16x2 p0, p0, sa;
mul.rn.f16x2 p1, p1, sa;
mul.rn.f16x2 p2, p2, sb;
mul.rn.f16x2 p3, p3, sb;
mov.b32 {{${out}, ${out + 1}}}, p0;
mov.b32 {{${out + 2}, ${out + 3}}}, p1;
mov.b32 {{${out + 4}, ${out + 5}}}, p2;
mov.b32 {{${out + 6}, ${out + 7}}}, p3;
"""


# the f16 high bytes of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (their low bytes are 0), as prmt's
# 8-byte table
_E2M1_TABLE = """mov.b32 ta, 0x3E3C3800;
mov.b32 tb, 0x46444240;
"""

# Packed weights (``PACKED``; ``nvfp4_gemm.pack_weights``): one 32-bit word ($8) per asm instance, the
# four bytes a thread of the wgmma register layout needs from two 16-element blocks (its elements 2t,
# 2t+1 and 2t+8, 2t+9 of each), -> those 8 elements in f16 ($0-$7, two per byte, the low nibble
# first). $9 and $10 are the two blocks' scales in f16. The magnitudes (signs masked off) select f16
# high bytes from the table, four codes per prmt (h0: codes 0-3, h1: codes 4-7); the packed order
# keeps the signs of codes 0-3 in the top bits of the word's bytes and those of codes 4-7 in bit 3,
# so a lop3 ors them into h0 (and, shifted by 4, into h1); a prmt per byte spreads its pair into f16
# and a packed multiply applies the scale.
_E2M1_WORD_F16 = tl.constexpr("""{
.reg .b32 m, mh, h0, h1, p0, p1, p2, p3, v4, ta, tb, sa, sb;
""" + _E2M1_TABLE + _word_decode_ptx("$8", "$9", "$10", 0) + "}")

# An e4m3 scale code (the low byte of $1) as f16, exact (every e4m3 value is an f16 normal or 0; the
# NaN code 0x7F stays NaN).
_E4M3_F16 = tl.constexpr("""{
.reg .b16 t;
.reg .b32 r;
cvt.u16.u32 t, $1;
cvt.rn.f16x2.e4m3x2 r, t;
mov.b32 {$0, t}, r;
}""")


@triton.jit
def _e2m1_placed(b):
    """Packed bytes (int32, 0-255) -> (even, odd) elements as fp32 words reading e2m1 value * 2^-126:
    code bits 0-2 at fp32 bits 22-24 (the exponent's two low bits and the mantissa's top), bit 3 at
    the sign. Exact for every code: 0.5 (0b001) is the subnormal 2^-127, 1 (0b010) is 2^-126."""
    even = ((b << 22) & 0x01C00000) | ((b << 28) & -2147483648)
    odd = ((b << 18) & 0x01C00000) | ((b << 24) & -2147483648)
    return even.to(tl.float32, bitcast=True), odd.to(tl.float32, bitcast=True)


@triton.jit
def _load_byte_tile(ptr, row, col, row_end, col_end, stride_r, stride_c, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """The [BLOCK_R, BLOCK_C] uint8 tile at (row, col) of a strided byte matrix as int32: the packed
    codes or the scale codes of an operand. Rows >= row_end and columns >= col_end read as 0."""
    rows = row + tl.arange(0, BLOCK_R)
    cols = col + tl.arange(0, BLOCK_C)
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c,
                   mask=(rows < row_end)[:, None] & (cols < col_end)[None, :], other=0).to(tl.int32)


@triton.jit
def _load_words(values, row, k, row_end, K, stride_vr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """A packed weight tile's bytes as 32-bit words [BLOCK_R, BLOCK_K / 8] (unit byte stride, rows 4-byte
    aligned); rows >= row_end and words past K read as 0."""
    rows = row + tl.arange(0, BLOCK_R)
    cols = k // 8 + tl.arange(0, BLOCK_K // 8)
    words = (values + rows[:, None].to(tl.int64) * stride_vr).to(tl.pointer_type(tl.int32)) + cols[None, :]
    return tl.load(words, mask=(rows < row_end)[:, None] & (cols < K // 8)[None, :], other=0)


@triton.jit
def _decode_words(w, sc, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """A packed weight tile (``PACKED`` and ``PTX``) from its words (``_load_words``), decoded by
    ``_E2M1_WORD_F16`` and put back in K order; ``sc`` the tile's scale codes [BLOCK_R, BLOCK_K / 16].
    Word w of a 64-element chunk c holds, for t = (w // 2) and j = w % 2, the bytes t and t + 4 of blocks
    2j and 2j + 1 (``nvfp4_gemm.pack_weights``)."""
    C: tl.constexpr = BLOCK_K // 64
    s = tl.inline_asm_elementwise(_E4M3_F16, "=h,r", [sc], dtype=tl.float16, is_pure=True, pack=1)
    s0, s1 = tl.split(tl.reshape(s, [BLOCK_R, C, 2, 2]))  # the scales of blocks 2j and 2j + 1, [R, C, j]
    s0 = tl.reshape(tl.broadcast_to(s0[:, :, None, :], [BLOCK_R, C, 4, 2]), [BLOCK_R, BLOCK_K // 8])
    s1 = tl.reshape(tl.broadcast_to(s1[:, :, None, :], [BLOCK_R, C, 4, 2]), [BLOCK_R, BLOCK_K // 8])
    o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
        _E2M1_WORD_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [w, s0, s1], dtype=(tl.float16,) * 8, is_pure=True,
        pack=1)
    x = tl.join(tl.join(tl.join(o0, o1), tl.join(o2, o3)), tl.join(tl.join(o4, o5), tl.join(o6, o7)))
    x = tl.reshape(x, [BLOCK_R, C, 4, 2, 2, 2, 2])  # [R, c, t, j, e, h, gg] (each join adds a last dim)
    x = tl.permute(x, [0, 1, 3, 6, 5, 2, 4])  # [R, c, j, gg, h, t, e]: element 16g + 8h + 2t + e, g = 2j + gg
    return tl.reshape(x, [BLOCK_R, BLOCK_K])


@triton.jit
def _load_nvfp4_raw(
    values, scales,  # one operand's bytes: values (rows, K / 2), scales (rows, K / 16) uint8, strided
    row, k, row_end, K,
    stride_vr, stride_vk, stride_sr, stride_sk,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PTX: tl.constexpr, PACKED: tl.constexpr = False,
):
    """The [BLOCK_R, BLOCK_K] tile at (row, k) as loaded, before decoding: (its values, as 32-bit words
    [BLOCK_R, BLOCK_K / 8] where ``PACKED`` and ``PTX``, else bytes [BLOCK_R, BLOCK_K / 2]; its scale
    codes [BLOCK_R, BLOCK_K / 16]), int32. Rows >= row_end and columns >= K read as 0 (a zero code and
    scale)."""
    NB: tl.constexpr = BLOCK_K // 16
    sc = _load_byte_tile(scales, row, k // 16, row_end, K // 16, stride_sr, stride_sk, BLOCK_R, NB)
    if PACKED and PTX:  # (one return: Triton checks every return's type, even under a constexpr if)
        b = _load_words(values, row, k, row_end, K, stride_vr, BLOCK_R, BLOCK_K)
    else:
        b = _load_byte_tile(values, row, k // 2, row_end, K // 2, stride_vr, stride_vk, BLOCK_R, BLOCK_K // 2)
    return b, sc


@triton.jit
def _decode_nvfp4(b, sc, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, OP_DTYPE: tl.constexpr, PTX: tl.constexpr,
                  PACKED: tl.constexpr = False):
    """A tile loaded by ``_load_nvfp4_raw`` decoded to e2m1 value * block scale in ``OP_DTYPE`` (exact:
    module docstring; f16 when ``PTX``). ``PACKED``: the bytes are in ``nvfp4_gemm.pack_weights``'s
    order (BLOCK_K a multiple of 64, unit byte stride)."""
    NB: tl.constexpr = BLOCK_K // 16
    # (no early return: Triton compiles what follows a return under a constexpr if as well)
    if PACKED and PTX:  # b holds words
        x = _decode_words(b, sc, BLOCK_R, BLOCK_K)
    else:
        if PACKED:
            b = _packed_to_k_order(b, BLOCK_R, BLOCK_K // 2)
        if PTX:
            s = tl.inline_asm_elementwise(_E4M3_F16, "=h,r", [sc], dtype=tl.float16, is_pure=True, pack=1)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_R, NB, 8]), [BLOCK_R, BLOCK_K // 2])  # per byte
            even, odd = tl.inline_asm_elementwise(_E2M1_PAIR_F16, "=h,=h,r,h", [b, s],
                                                  dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
            x = tl.reshape(tl.join(even, odd), [BLOCK_R, BLOCK_K])  # the even element is the low nibble
        else:
            even, odd = _e2m1_placed(b)
            v = tl.reshape(tl.join(even, odd), [BLOCK_R, BLOCK_K])  # the even element is the low nibble
            x = tl.reshape(v, [BLOCK_R, NB, 16]) * (_e4m3_value(sc) * TWO_63)[:, :, None] * TWO_63
            x = tl.reshape(x, [BLOCK_R, BLOCK_K]).to(OP_DTYPE)
    return x


@triton.jit
def _load_nvfp4(
    values, scales, row, k, row_end, K, stride_vr, stride_vk, stride_sr, stride_sk,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, OP_DTYPE: tl.constexpr, PTX: tl.constexpr,
    PACKED: tl.constexpr = False,
):
    """``_load_nvfp4_raw`` then ``_decode_nvfp4``: the decoded [BLOCK_R, BLOCK_K] tile at (row, k)."""
    b, sc = _load_nvfp4_raw(values, scales, row, k, row_end, K, stride_vr, stride_vk, stride_sr, stride_sk,
                            BLOCK_R, BLOCK_K, PTX, PACKED)
    return _decode_nvfp4(b, sc, BLOCK_R, BLOCK_K, OP_DTYPE, PTX, PACKED)


@triton.jit
def _grouped_mm_nvfp4_kernel(
    a_values, a_scales, a_global,  # (M, K / 2), (M, K / 16) uint8 strided; () fp32
    # (A_DECODED: a_values is (M, K) in OP_DTYPE, value * block scale, and a_scales is unused)
    w_values, w_scales, w_global,  # (E, N, K / 2), (E, N, K / 16) uint8 strided; (E,) fp32 strided
    c, offs_ptr,  # c (M, N), unit column stride; offs (E,) int32 cumulative row ends
    M, N, K, E,
    stride_avm, stride_avk, stride_asm, stride_ask,
    stride_wve, stride_wvn, stride_wvk, stride_wse, stride_wsn, stride_wsk, stride_wg,
    stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
    OP_DTYPE: tl.constexpr,  # f16 with PTX; else bf16 on a GPU, fp32 on the interpreter (its bf16 tl.dot is wrong)
    PTX: tl.constexpr,  # the inline-PTX decode (sm_89 and newer)
    W_PACKED: tl.constexpr,  # w_values in nvfp4_gemm.pack_weights's order (contiguous, K % 64 == 0)
    SWAP: tl.constexpr, A_DECODED: tl.constexpr, NUM_STAGES: tl.constexpr,
    W_PREFETCH: tl.constexpr,  # the weights' next K step loaded a step ahead, in registers
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    e, starts, ends, tiles, tiles_end, total = _group_table(offs_ptr, M, E, tiles_n, BLOCK_M, BLOCK_E)
    ag = tl.load(a_global)

    for tile in tl.range(tl.program_id(0), total, tl.num_programs(0)):
        g, start, end, row, pid_n = _locate(tile, e, starts, ends, tiles, tiles_end, tiles_n, BLOCK_M, GROUP_M)
        col = pid_n * BLOCK_N
        real = g < E  # group E is the tail [offs[-1], M): no K steps, zeros
        ge = tl.minimum(g, E - 1).to(tl.int64)
        wv = w_values + ge * stride_wve
        ws = w_scales + ge * stride_wse
        if SWAP:
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # W_PREFETCH: the next K step's weight bytes load while this step's decode and MMA run (the
        # software pipeline does not take loads that reach the MMA through the decode's arithmetic)
        if W_PREFETCH:  # (a tail tile loads one step it does not use: masking it cost registers)
            w_raw, w_sc = _load_nvfp4_raw(wv, ws, col, 0, N, K, stride_wvn, stride_wvk, stride_wsn, stride_wsk,
                                          BLOCK_N, BLOCK_K, PTX, W_PACKED)
        for ki in tl.range(tl.where(real, k_tiles, 0), num_stages=NUM_STAGES):
            k = ki * BLOCK_K
            if A_DECODED:  # already value * block scale, in OP_DTYPE
                a_tile = _load_2d(a_values, 0, row, k, end, K, stride_avm, stride_avk, BLOCK_M, BLOCK_K)
            else:
                a_tile = _load_nvfp4(a_values, a_scales, row, k, end, K, stride_avm, stride_avk, stride_asm,
                                     stride_ask, BLOCK_M, BLOCK_K, OP_DTYPE, PTX)
            if W_PREFETCH:
                w_tile = _decode_nvfp4(w_raw, w_sc, BLOCK_N, BLOCK_K, OP_DTYPE, PTX, W_PACKED)
                w_raw, w_sc = _load_nvfp4_raw(wv, ws, col, k + BLOCK_K, N, K, stride_wvn, stride_wvk, stride_wsn,
                                              stride_wsk, BLOCK_N, BLOCK_K, PTX, W_PACKED)
            else:
                w_tile = _load_nvfp4(wv, ws, col, k, N, K, stride_wvn, stride_wvk, stride_wsn, stride_wsk,
                                     BLOCK_N, BLOCK_K, OP_DTYPE, PTX, W_PACKED)
            if SWAP:
                acc_t = tl.dot(w_tile, a_tile.T, acc_t)
            else:
                acc = tl.dot(a_tile, w_tile.T, acc)
        if SWAP:
            acc = acc_t.T
        # the global scales multiply the fp32 accumulator: their product first, then one multiply,
        # as the reference does (in float64 there)
        scale = ag * tl.load(w_global + ge * stride_wg)
        acc = tl.where(real, acc * scale, 0.0)  # the tail is 0 even for a non-finite global scale
        _store_rows(c, stride_cm, end, row, col, N, acc, BLOCK_M, BLOCK_N, False)

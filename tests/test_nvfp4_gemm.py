"""grouped_mm_nvfp4: the Triton kernel under the interpreter (CPU) and its reference, both against an
independent float64 oracle; the decode bit-exact on every e4m3 scale code; the edge cases of the
rows-ragged schedule; identical errors from both paths; opcheck of the custom op; the inline-PTX
decode's instructions emulated on the host for every byte. ``-m gpu``: moderate sizes, both decodes,
no host sync, CUDA-graph capture, torch.compile. Outputs start NaN-poisoned (conftest)."""

import dataclasses
import re

import numpy as np
import pytest
import torch
from ptx_emulator import _f16x2, _run_ptx

import moekit
from moekit import config, nvfp4
from moekit._kernels import nvfp4_gemm as kernels
from moekit.nvfp4.gemm import (
    _grouped_mm_nvfp4_op,
    grouped_mm_nvfp4,
    grouped_mm_nvfp4_fwd,
    grouped_mm_nvfp4_ref,
    pack_weights,
    unpack_weights,
    ws_ok,
)
from moekit.testing import offs_from_counts

FP4, E4M3, U8 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn, torch.uint8
BF16, F32 = torch.bfloat16, torch.float32
DEV = "cuda"
gpu = pytest.mark.gpu

# code c -> e2m1 value (bit 3 the sign): the oracle's own table, not the package's decoder
_E2M1 = torch.tensor(nvfp4.E2M1_VALUES + tuple(-v for v in nvfp4.E2M1_VALUES), dtype=torch.float64)


# --------------------------------------------------------------------------------------------------
# inputs and the oracle
# --------------------------------------------------------------------------------------------------


def _operands(counts, m, k, n, device="cpu"):
    """Activations (M, K) and weights (E, K, N) of very different block magnitudes (so that block scales
    span a wide range, subnormal e4m3 included), quantized by the references."""
    offs = offs_from_counts(counts, device)
    x = torch.randn(m, k, device=device) * torch.logspace(-5, 1, k, device=device)[torch.randperm(k, device=device)]
    w = torch.randn(len(counts), k, n, device=device) * torch.logspace(-4, 0, n, device=device)
    return (*nvfp4.quantize_ref(x), *nvfp4.quantize_weights_ref(w), offs)


def _decode(values, scales):
    b = values.view(U8).long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)  # the even element is the low nibble
    return _E2M1.to(values.device)[codes] * scales.double().repeat_interleave(16, dim=-1)


def _oracle(a_values, a_scales, a_global, w_values, w_scales, w_global, offs):
    """float64 (want, |a| @ |w|^T * |scale|) of every row; rows past offs[-1] are 0."""
    a, w = _decode(a_values, a_scales), _decode(w_values, w_scales)
    want = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float64, device=a.device)
    absdot = torch.zeros_like(want)
    start = 0
    for g, end in enumerate(offs.tolist()):
        scale = a_global.double() * w_global[g].double()
        want[start:end] = a[start:end] @ w[g].T * scale
        absdot[start:end] = a[start:end].abs() @ w[g].T.abs() * scale.abs()
        start = end
    return want, absdot


def _assert_matches_oracle(out, args):
    """|out - want| <= the output rounding (half an ulp, relative) + a K-term fp32 accumulation bound."""
    want, absdot = _oracle(*args)
    k = 2 * args[0].shape[1]
    rounding = {BF16: 2**-8, torch.float16: 2**-11, F32: 0.0}[out.dtype]
    accumulation = (k + 4) * 2**-23 * absdot  # fp32 sums of exact products, and the global-scale multiplies
    tol = rounding * (want.abs() + accumulation) + accumulation + (2**-25 if out.dtype == torch.float16 else 0.0)
    assert out.shape == want.shape and torch.isfinite(out).all()
    err = (out.double() - want).abs()
    assert (err <= tol).all(), (float(err.max()), float((err - tol).max()), (err > tol).nonzero()[:8].tolist())
    end = int(args[-1][-1]) if args[-1].numel() else 0
    assert (out[end:] == 0).all(), "rows past offs[-1] must be exactly zero"


# --------------------------------------------------------------------------------------------------
# the interpreter and the reference against the oracle
# --------------------------------------------------------------------------------------------------

# (counts per expert, M, K, N) and why the case exists
CASES = [
    pytest.param([9, 0, 14, 5], 28, 64, 40, id="uneven-with-empty"),  # two K steps, N past the 32-wide tile
    pytest.param([0, 0, 33, 0], 33, 32, 32, id="one-hot"),  # every row on one expert, the others empty
    pytest.param([7, 0, 4], 20, 48, 24, id="tail-rows"),  # rows past offs[-1]; a partial last K step
    pytest.param([13, 11, 13], 37, 16, 33, id="odd-m-n"),  # odd M and N, one scale block (K < BLOCK_K)
    pytest.param([0, 0], 0, 32, 16, id="m-zero"),  # no rows at all
    pytest.param([0, 0], 10, 16, 8, id="all-tail"),  # rows, but no expert owns any: all zeros
    pytest.param([1], 1, 16, 8, id="one-row"),  # T = 1, E = 1
    pytest.param([3, 0, 2, 5, 1, 0, 4, 2, 1], 20, 32, 16, id="e9"),  # many experts, E + 1 not a power of 2
    pytest.param([150, 0, 41], 200, 64, 40, id="dequantized"),  # > 64 rows per expert: dequantize + bf16 GEMM
]


@pytest.mark.parametrize("counts, m, k, n", CASES)
def test_kernel_and_reference_match_the_oracle(interpreter, counts, m, k, n):
    args = _operands(counts, m, k, n)
    if m > sum(counts):  # NaN scale codes in the rows no expert owns: they must not reach the output
        args[1].view(U8)[sum(counts):] = 0x7F
    out = grouped_mm_nvfp4(*args)
    assert out.dtype == BF16
    _assert_matches_oracle(out, args)
    _assert_matches_oracle(grouped_mm_nvfp4_ref(*args), args)


@pytest.mark.parametrize("out_dtype", [F32, torch.float16])
@pytest.mark.parametrize("counts, m, dequantized", [([6, 0, 11], 19, False), ([140, 0, 70], 215, True)],
                         ids=["decoded", "dequantized"])
def test_other_output_dtypes(interpreter, monkeypatch, out_dtype, counts, m, dequantized):
    """Each output dtype in both regimes; a spy on the dequantizing path shows which one ran."""
    import moekit.nvfp4.gemm as mod

    calls = []
    real = mod._dequantized_mm
    monkeypatch.setattr(mod, "_dequantized_mm", lambda *a: calls.append(1) or real(*a))
    args = _operands(counts, m, 32, 24)
    _assert_matches_oracle(grouped_mm_nvfp4(*args, out_dtype=out_dtype), args)
    assert bool(calls) == dequantized
    _assert_matches_oracle(grouped_mm_nvfp4_ref(*args, out_dtype=out_dtype), args)


# pinned tiles, and the code path each one covers
PINNED = [
    pytest.param(config.TileConfig(16, 16, 16, group_m=4, num_warps=4, num_stages=1), id="bk16-swizzle"),
    pytest.param(config.TileConfig(32, 64, 64, group_m=1, num_warps=4, num_stages=1), id="bk-wider-than-k"),
    pytest.param(config.TileConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=1, swap=True), id="swap"),
    pytest.param(config.TileConfig(32, 64, 64, group_m=2, num_warps=4, num_stages=1, swap=True),
                 id="swap-bk-wider-than-k"),
    pytest.param(config.TileConfig(16, 32, 16, group_m=1, num_warps=4, num_stages=1, swap=True, prefetch=True),
                 id="swap-prefetch"),  # the weights' next K step loaded ahead, and past K on the last
    pytest.param(config.TileConfig(16, 16, 32, group_m=4, num_warps=4, num_stages=1, prefetch=True),
                 id="prefetch-partial-last-k-step"),
]


@pytest.mark.parametrize("cfg", PINNED)
def test_pinned_tiles(interpreter, cfg):
    args = _operands([40, 0, 9], 52, 48, 40)
    _assert_matches_oracle(grouped_mm_nvfp4_fwd(*args, BF16, cfg=cfg), args)


def test_the_decode_is_exact_for_every_scale_code(interpreter):
    """One scale block (K = 16): every finite e4m3 code (subnormals, 448 and the negatives) on A's rows,
    a spread of them on W's, random e2m1 codes and power-of-two global scales. Every partial sum is
    then a multiple of sa * sw / 4 with at most 20 significant bits, so an exact decode gives the
    oracle's fp32 value bit for bit."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=U8)  # 254: no NaN codes
    m, n, e = codes.numel(), 24, 2
    a_scales = codes[:, None].view(E4M3)
    w_scales = codes[torch.randperm(m)[: e * n]].view(e, n, 1).view(E4M3)
    a_values = torch.randint(0, 256, (m, 8), dtype=U8).view(FP4)
    w_values = torch.randint(0, 256, (e, n, 8), dtype=U8).view(FP4)
    args = (a_values, a_scales, torch.tensor(2.0**-3), w_values, w_scales, torch.tensor([2.0**5, 0.5]),
            torch.tensor([100, m], dtype=torch.int32))
    want = _oracle(*args)[0].float()
    for got in (grouped_mm_nvfp4(*args, out_dtype=F32), grouped_mm_nvfp4_ref(*args, out_dtype=F32)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got - want).abs().max()


def test_any_strides(interpreter):
    """Column-sliced values, column-major scales and a strided w_global give the contiguous result."""
    args = _operands([5, 12], 20, 32, 16)
    a_v, a_s, a_g, w_v, w_s, w_g, offs = args
    wide = torch.randint(0, 256, (20, 24), dtype=U8)
    wide[:, :16] = a_v.view(U8)
    a_s_t = a_s.view(U8).T.contiguous().T.view(E4M3)
    w_v_sliced = torch.cat([w_v.view(U8), torch.randint(0, 256, (2, 3, 16), dtype=U8)], dim=1)[:, :16]
    w_g_strided = torch.stack([w_g, torch.full_like(w_g, float("nan"))], dim=1)[:, 0]
    strided = (wide[:, :16].view(FP4), a_s_t, a_g, w_v_sliced.view(FP4), w_s, w_g_strided, offs)
    assert not strided[0].is_contiguous() and not strided[1].is_contiguous() and not strided[5].is_contiguous()
    assert torch.equal(grouped_mm_nvfp4(*strided).view(torch.int16), grouped_mm_nvfp4(*args).view(torch.int16))


# --------------------------------------------------------------------------------------------------
# packed weights: the byte order, and the kernel reading it
# --------------------------------------------------------------------------------------------------


def _signs_packed(word: int) -> int:
    """A 32-bit word of eight codes in K order -> with pack_weights's sign bits: code k's sign from bit
    4k + 3 to bit 8k + 7 (k < 4) or 8(k - 4) + 3 (bit loops, not the package's)."""
    out = word & 0x77777777
    for k in range(8):
        out |= ((word >> (4 * k + 3)) & 1) << (8 * k + 7 if k < 4 else 8 * (k - 4) + 3)
    return out


def test_pack_weights_moves_each_byte_where_the_docstring_says():
    """Byte 8g + 4h + t of every 32-byte chunk goes to 8t + 2g + h, then each 32-bit word's sign bits
    move (loops, not the package's reshape); unpack inverts; shape, dtype and device kept; the output is
    contiguous even from a strided input."""
    w = torch.randint(0, 256, (3, 5, 96), dtype=U8)[:, :, :64]  # K = 128, a non-contiguous view
    packed = pack_weights(w.view(FP4))
    assert packed.dtype == FP4 and packed.shape == w.shape and packed.is_contiguous()
    want = torch.empty_like(w)
    for c in range(2):
        for g in range(4):
            for h in range(2):
                for t in range(4):
                    want[..., 32 * c + 8 * t + 2 * g + h] = w[..., 32 * c + 8 * g + 4 * h + t]
    flat = want.reshape(-1, 4).tolist()
    words = [_signs_packed(sum(x << 8 * i for i, x in enumerate(q))) for q in flat]
    want = torch.tensor([[(x >> 8 * i) & 0xFF for i in range(4)] for x in words], dtype=U8).view(want.shape)
    assert torch.equal(packed.view(U8), want)
    assert torch.equal(unpack_weights(packed).view(U8), w)
    assert torch.equal(unpack_weights(pack_weights(w)), w)  # uint8 in, uint8 out
    with pytest.raises(ValueError, match="K a multiple of 64, got K = 96"):
        pack_weights(w[..., :48])
    with pytest.raises(TypeError, match="expected NVFP4 codes"):
        pack_weights(w.float())


# (counts, M, K, N, pinned tile or None for the heuristic's) with packed weights
PACKED_CASES = [
    pytest.param([9, 0, 14, 5], 30, 128, 40, None, id="heuristic-tail-rows"),
    pytest.param([0, 21, 3], 24, 192, 33, None, id="three-k-steps-odd-n"),
    pytest.param([7, 0, 4], 11, 192, 24, config.TileConfig(16, 32, 128, group_m=1, num_warps=4, num_stages=1,
                                                           swap=True), id="swap-half-last-k-step"),
    pytest.param([13, 11], 24, 64, 16, config.TileConfig(16, 16, 64, group_m=2, num_warps=4, num_stages=1),
                 id="plain-one-chunk"),
    pytest.param([7, 0, 4], 11, 192, 24, config.TileConfig(16, 32, 64, group_m=1, num_warps=4, num_stages=1,
                                                           swap=True, prefetch=True), id="swap-prefetch"),
    pytest.param([150, 0, 41], 200, 128, 40, None, id="dequantized"),
]


@pytest.mark.parametrize("counts, m, k, n, cfg", PACKED_CASES)
def test_packed_weights_give_the_same_bits(interpreter, counts, m, k, n, cfg):
    args = _operands(counts, m, k, n)
    packed = list(args)
    packed[3] = pack_weights(args[3])
    if cfg is None:
        got, want = grouped_mm_nvfp4(*packed, w_packed=True), grouped_mm_nvfp4(*args)
    else:
        got, want = (grouped_mm_nvfp4_fwd(*packed, BF16, True, cfg=cfg),
                     grouped_mm_nvfp4_fwd(*args, BF16, cfg=dataclasses.replace(cfg, block_k=32)))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    _assert_matches_oracle(got, args)
    ref = grouped_mm_nvfp4_ref(*packed, w_packed=True)
    assert torch.equal(ref.view(torch.int16), grouped_mm_nvfp4_ref(*args).view(torch.int16))


# the warp-specialized kernel (Gluon, sm_90) has no interpreter path: compiled here for sm_90 in a child
# process without TRITON_INTERPRET, on whatever Triton the suite runs, and checked for spills
_WS_COMPILE = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from moekit._kernels.nvfp4_gemm_ws import _grouped_mm_nvfp4_ws_kernel
bm, stages, chunks, regs = {bm}, {stages}, {chunks}, {regs}
a_l = gl.NVMMASharedLayout.get_default_for([bm, 64], gl.float16)
w_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
sig = dict(a_desc=f"tensordesc<fp16[{{bm}}, 64],{{a_l!r}}>", w_desc=f"tensordesc<u8[128, 32],{{w_l!r}}>",
           w_scales="*i32", a_global="*fp32", w_global="*fp32", stride_wg="i32", out="*bf16", stride_out="i32",
           table="*i32", N="i32", K="i32", NUM_PROGRAMS="constexpr", GROUP_M="constexpr", STAGES="constexpr",
           CHUNKS="constexpr", REGS="constexpr")
const = dict(NUM_PROGRAMS=264, GROUP_M=1, STAGES=stages, CHUNKS=chunks, REGS=regs)
k = triton.compile(GluonASTSource(_grouped_mm_nvfp4_ws_kernel, sig, constexprs=const),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=regs))
import os, subprocess, tempfile
path = os.path.join(tempfile.mkdtemp(), "k.cubin")
open(path, "wb").write(k.asm["cubin"])
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
print(subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout)
"""


@pytest.mark.parametrize("bm, stages, chunks, regs", [(16, 3, 4, 104), (32, 3, 4, 104), (64, 4, 2, 160)])
def test_warp_specialized_kernel_compiles_for_sm90(bm, stages, chunks, regs):
    """The heuristic's three tiles (``config.nvfp4_gemm_config(..., ws=True)``)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _WS_COMPILE.format(bm=bm, stages=stages, chunks=chunks, regs=regs)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"REG:\d+ STACK:0 SHARED:\d+ LOCAL:0 ", run.stdout), run.stdout  # no spills


def test_warp_specialized_tile_needs_packed_weights_on_sm90(interpreter):
    """A pinned warp-specialized tile where the kernel cannot run (here: no sm_90) is an error, the same
    one the GPU gives for K-ordered weights."""
    args = _operands([3, 5], 8, 128, 128)
    packed = list(args)
    packed[3] = pack_weights(args[3])
    tile = config.TileConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=6, programs_per_sm=2, swap=True,
                             max_registers=104, warp_specialized=True)
    with pytest.raises(ValueError, match="warp-specialized"):
        grouped_mm_nvfp4_fwd(*packed, BF16, True, cfg=tile)
    assert not ws_ok(packed[0], packed[3], packed[4], True)
    ws = config.nvfp4_gemm_config(16 * 32, 32, torch.device("cuda"), packed=True, ptx=True, ws=True)
    assert ws.warp_specialized and ws.block_m == 16 and ws.max_registers


def test_packed_weights_errors(interpreter):
    """The same errors from the reference and the kernel path; a pinned tile whose BLOCK_K is not a
    multiple of 64 is refused."""
    args = _operands([5, 12], 20, 128, 16)
    packed = list(args)
    packed[3] = pack_weights(args[3])
    strided = list(packed)
    strided[3] = torch.cat([packed[3].view(U8)] * 2, dim=1)[:, ::2].view(FP4)
    short = _operands([5, 12], 20, 96, 16)  # K = 96
    flat = torch.empty(1 + packed[3].numel(), dtype=U8)
    flat[1:] = packed[3].view(U8).reshape(-1)
    shifted = list(packed)
    shifted[3] = flat[1:].view(packed[3].shape).view(FP4)  # contiguous, one byte into its storage
    for bad, message in ((strided, "must be contiguous"), (short, "K a multiple of 64, got K = 96"),
                         (shifted, "16-byte aligned in their storage, got a storage offset of 1")):
        for call in (grouped_mm_nvfp4, grouped_mm_nvfp4_ref):
            with pytest.raises(ValueError, match=message):
                call(*bad, w_packed=True)
    with pytest.raises(ValueError, match="block_k a multiple of 64, got 32"):
        grouped_mm_nvfp4_fwd(*packed, BF16, True, cfg=config.TileConfig(16, 16, 32, num_warps=4, num_stages=1))


# --------------------------------------------------------------------------------------------------
# the inline-PTX decode (GPU only), its instructions emulated on the host
# --------------------------------------------------------------------------------------------------


def test_ptx_decode_on_every_byte_and_scale_code():
    """``_E2M1_PAIR_F16`` on all 256 bytes with every finite e4m3 scale code as ``_E4M3_F16`` converts
    it, bit for bit against the oracle's e2m1 table times the scale, -0 included."""
    scale_codes = [c for c in range(256) if c & 0x7F != 0x7F]
    scales = {c: _run_ptx(kernels._E4M3_F16.value, {"$1": c})["$0"] for c in scale_codes}
    want_scales = torch.tensor(scale_codes, dtype=U8).view(E4M3).to(torch.float16).view(torch.int16)
    assert [scales[c] for c in scale_codes] == want_scales.numpy().view(np.uint16).tolist()
    assert np.isnan(_f16x2(_run_ptx(kernels._E4M3_F16.value, {"$1": 0x7F})["$0"])[0])  # NaN stays NaN
    for b in range(256):
        for c in scale_codes:
            r = _run_ptx(kernels._E2M1_PAIR_F16.value, {"$2": b, "$3": scales[c]})
            got = _f16x2(r["$0"] | r["$1"] << 16)
            want = _E2M1[[b & 15, b >> 4]] * float(torch.tensor([c], dtype=U8).view(E4M3).float())
            assert np.array_equal(got.astype(np.float64), want.numpy()), (b, c, got, want)
            assert np.array_equal(np.signbit(got), np.signbit(want.numpy())), (b, c, got)


def test_ptx_word_decode_on_every_byte_in_every_position():
    """``_E2M1_WORD_F16`` (packed weights, the signs moved as ``pack_weights`` moves them): each of the four
    bytes of a word decodes to its two elements times its block's scale ($9 for bytes 0-1, $10 for bytes
    2-3), bit for bit, for every byte value in every position beside random neighbours."""
    gen = np.random.default_rng(1)
    codes = [0x00, 0x01, 0x38, 0x7E, 0x80, 0xB9, 0xFE]  # zero, the smallest subnormal, 1, 448, -0, ...
    scale = {c: _run_ptx(kernels._E4M3_F16.value, {"$1": c})["$0"] for c in codes}
    value = {c: float(torch.tensor([c], dtype=U8).view(E4M3).float()) for c in codes}
    for pos in range(4):
        for b in range(256):
            word = [int(x) for x in gen.integers(0, 256, 4)]
            word[pos] = b
            c0, c1 = (int(x) for x in gen.choice(codes, 2))
            r = _run_ptx(kernels._E2M1_WORD_F16.value,
                         {"$8": _signs_packed(sum(x << 8 * i for i, x in enumerate(word))), "$9": scale[c0],
                          "$10": scale[c1]})
            got = _f16x2(r[f"${2 * pos}"] | r[f"${2 * pos + 1}"] << 16)
            want = _E2M1[[b & 15, b >> 4]] * value[c0 if pos < 2 else c1]
            assert np.array_equal(got.astype(np.float64), want.numpy()), (pos, b, got, want)
            assert np.array_equal(np.signbit(got), np.signbit(want.numpy())), (pos, b, got)


def test_ptx_two_word_decode_on_every_byte_in_every_position():
    """``_E2M1_2WORDS_SCALED_F16`` (the warp-specialized kernel): each byte of either word decodes to its
    two elements times its block's scale from the shared scale word (word j, byte p: block 2j + p // 2),
    bit for bit, signs and -0 included, for every byte value in every position beside random
    neighbours and random scale codes (finite, subnormal and zero)."""
    from moekit._kernels import nvfp4_gemm_ws

    gen = np.random.default_rng(2)
    codes = [0x00, 0x01, 0x07, 0x38, 0x7E, 0x80, 0xB9, 0xFE]
    value = {c: float(torch.tensor([c], dtype=U8).view(E4M3).float()) for c in codes}
    for j in range(2):
        for pos in range(4):
            for b in range(256):
                words = [[int(x) for x in gen.integers(0, 256, 4)] for _ in range(2)]
                words[j][pos] = b
                sc = [int(x) for x in gen.choice(codes, 4)]
                r = _run_ptx(nvfp4_gemm_ws._E2M1_2WORDS_SCALED_F16.value,
                             {"$16": _signs_packed(sum(x << 8 * i for i, x in enumerate(words[0]))),
                              "$17": _signs_packed(sum(x << 8 * i for i, x in enumerate(words[1]))),
                              "$18": sum(x << 8 * i for i, x in enumerate(sc))})
                out = 8 * j + 2 * pos
                got = _f16x2(r[f"${out}"] | r[f"${out + 1}"] << 16)
                want = _E2M1[[b & 15, b >> 4]] * value[sc[2 * j + pos // 2]]
                assert np.array_equal(got.astype(np.float64), want.numpy()), (j, pos, b, got, want)
                assert np.array_equal(np.signbit(got), np.signbit(want.numpy())), (j, pos, b, got)


# --------------------------------------------------------------------------------------------------
# errors: the same type and message from the reference, the kernel path and the reference option
# --------------------------------------------------------------------------------------------------


def _bad(i, value):
    """Replace argument i of a small valid call."""
    def edit(args):
        args = list(args)
        args[i] = value(args[i]) if callable(value) else value
        return args
    return edit


META = torch.device("meta")
# (how to break a valid call, the error, a piece of its message)
ERRORS = [
    pytest.param(_bad(0, lambda t: t.view(U8)), TypeError, "a_values must be a torch.float4", id="a-values-dtype"),
    pytest.param(_bad(1, lambda t: t.float()), TypeError, "a_scales must be a torch.float8", id="a-scales-dtype"),
    pytest.param(_bad(2, lambda t: t.double()), TypeError, "a_global must be a torch.float32", id="a-global-dtype"),
    pytest.param(_bad(5, lambda t: t.bfloat16()), TypeError, "w_global must be", id="w-global-dtype"),
    pytest.param(_bad(6, lambda t: t.long()), TypeError, "offs must be a torch.int32", id="offs-int64"),
    pytest.param(_bad(6, None), TypeError, "offs must be a torch.int32 tensor, got NoneType", id="offs-none"),
    pytest.param(_bad(6, lambda t: t[None]), ValueError, "offs must be 1-D", id="offs-2d"),
    pytest.param(_bad(6, lambda t: t[:1]), ValueError, "with E = 2 entries", id="offs-length"),
    pytest.param(_bad(0, lambda t: t[None]), ValueError, "expected a_values", id="a-values-3d"),
    pytest.param(_bad(0, lambda t: t[:, :4]), ValueError, "multiple of 16, got K = 8", id="k-not-16"),
    pytest.param(_bad(3, lambda t: t[..., :8]), ValueError, "K mismatch", id="k-mismatch"),
    pytest.param(_bad(1, lambda t: t[:, :1]), ValueError, "a_scales must be (20, 2)", id="a-scales-shape"),
    pytest.param(_bad(4, lambda t: t[:, :3]), ValueError, "w_scales must be (2, 16, 2)", id="w-scales-shape"),
    pytest.param(_bad(2, lambda t: t[None]), ValueError, "a_global must be 0-dim", id="a-global-1d"),
    pytest.param(_bad(5, lambda t: t[:1]), ValueError, "w_global must be (E,)", id="w-global-shape"),
    pytest.param(_bad(5, lambda t: t.to(META)), ValueError, "w_global is on meta", id="device"),
    pytest.param(lambda args: [*args[:7], torch.float64], TypeError, "out_dtype must be", id="out-dtype"),
    pytest.param(lambda args: [*args[:3], args[3][:0], args[4][:0], args[5][:0], args[6][:0]], ValueError,
                 "at least one expert", id="no-experts"),
]


@pytest.mark.parametrize("breaks, error, message", ERRORS)
def test_errors_are_identical_on_both_paths(interpreter, breaks, error, message):
    args = breaks(_operands([5, 12], 20, 32, 16))
    *tensors, out_dtype = args if len(args) == 8 else (*args, BF16)
    calls = {
        "ref": lambda: grouped_mm_nvfp4_ref(*tensors, out_dtype=out_dtype),
        "kernel": lambda: grouped_mm_nvfp4(*tensors, out_dtype=out_dtype),
    }
    seen = {}
    for name, call in calls.items():
        with pytest.raises(error) as info:
            call()
        seen[name] = str(info.value)
    with moekit.options(reference=True), pytest.raises(error) as info:
        calls["kernel"]()
    seen["reference option"] = str(info.value)
    assert len(set(seen.values())) == 1, seen
    assert message in seen["ref"] and seen["ref"].startswith("grouped_mm_nvfp4: "), seen["ref"]


# --------------------------------------------------------------------------------------------------
# the custom op
# --------------------------------------------------------------------------------------------------


def _op_args(args, out_dtype=BF16, w_packed=False):
    a_v, a_s, a_g, w_v, w_s, w_g, offs = args
    if w_packed:
        w_v = pack_weights(w_v)
    return (a_v.view(U8), a_s.view(U8), a_g, w_v.view(U8), w_s.view(U8), w_g, offs, out_dtype, w_packed)


@pytest.mark.parametrize("w_packed", [False, True])
def test_custom_op_passes_opcheck(interpreter, w_packed):
    args = _operands([6, 0, 9], 17, 64, 16)
    torch.library.opcheck(_grouped_mm_nvfp4_op, _op_args(args, w_packed=w_packed))


# --------------------------------------------------------------------------------------------------
# the same on a CUDA GPU, at moderate sizes; no host sync; CUDA-graph capture; torch.compile
# --------------------------------------------------------------------------------------------------

GPU_CASES = [
    pytest.param([300, 0, 900, 77, 512, 1, 0, 250], 2100, 1024, 768, id="uneven"),  # partial tiles, tail rows
    pytest.param([16, 40, 7, 64, 0, 33, 12, 64] * 4, 1000, 2048, 1536, id="few-rows-per-expert"),  # decode-sized
    pytest.param([0, 0, 0, 4096], 4096, 512, 1000, id="one-hot-odd-n"),  # one hot expert, N not a tile multiple
]


DECODES = [pytest.param(True, id="ptx"), pytest.param(False, id="triton-ops")]


@gpu
@pytest.mark.parametrize("ptx", DECODES)
@pytest.mark.parametrize("counts, m, k, n", GPU_CASES)
def test_kernel_matches_the_oracle_gpu(counts, m, k, n, ptx):
    args = _operands(counts, m, k, n, device=DEV)
    with moekit.options(nvfp4_ptx_decode=ptx):
        assert config.use_nvfp4_ptx_decode(torch.device(DEV)) == (ptx and torch.cuda.get_device_capability() >= (8, 9))
        _assert_matches_oracle(grouped_mm_nvfp4(*args), args)
        _assert_matches_oracle(grouped_mm_nvfp4(*args, out_dtype=F32), args)


# the transposed tiles on the GPU: the heuristic's at 16 rows per expert, a 64-row one, and both with
# the weights' prefetch (the 64-row one under the heuristic's register cap)
SWAP_TILES_GPU = [
    pytest.param(config.TileConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=3, programs_per_sm=4, swap=True),
                 id="swap16-bk128"),
    pytest.param(config.TileConfig(64, 128, 64, group_m=1, num_warps=4, num_stages=3, programs_per_sm=2, swap=True),
                 id="swap64-bk64"),
    pytest.param(config.TileConfig(16, 128, 128, group_m=1, num_warps=4, num_stages=3, programs_per_sm=4, swap=True,
                                   prefetch=True), id="swap16-bk128-prefetch"),
    pytest.param(config.TileConfig(64, 128, 64, group_m=1, num_warps=4, num_stages=3, programs_per_sm=4, swap=True,
                                   max_registers=168, prefetch=True), id="swap64-capped-prefetch"),
]


@gpu
@pytest.mark.parametrize("ptx", DECODES)
@pytest.mark.parametrize("cfg", [
    *SWAP_TILES_GPU,
    pytest.param(config.TileConfig(128, 128, 32, group_m=8, num_warps=8, num_stages=3), id="plain128-bk32"),
    pytest.param(config.TileConfig(64, 64, 64, group_m=4, num_warps=4, num_stages=2), id="plain64-bk64"),
])
def test_pinned_tiles_gpu(cfg, ptx):
    """Pinned tiles on the GPU (the transposed ones with experts past their M tile), an empty expert and
    tail rows, with each decode: the register layouts differ per tile, and the PTX decode must pair
    each thread's elements right in every one."""
    args = _operands([5, 70, 0, 16, 33, 1], 140, 1024, 640, device=DEV)
    with moekit.options(nvfp4_ptx_decode=ptx):
        _assert_matches_oracle(grouped_mm_nvfp4_fwd(*args, BF16, cfg=cfg), args)


@gpu
@pytest.mark.parametrize("ptx", DECODES)
@pytest.mark.parametrize("cfg", [
    pytest.param(None, id="heuristic"),
    *SWAP_TILES_GPU,
    pytest.param(config.TileConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=3), id="plain128-bk64"),
])
def test_packed_weights_gpu(cfg, ptx):
    """Packed weights (the word decode with ``ptx``) give the bits of the K-ordered ones on the same tile,
    K = 1088 (a last K step of 64 with BLOCK_K 128), experts past the M tile, an empty one, tail rows."""
    args = _operands([5, 70, 0, 16, 33, 1], 140, 1088, 640, device=DEV)
    packed = list(args)
    packed[3] = pack_weights(args[3])
    with moekit.options(nvfp4_ptx_decode=ptx):
        if cfg is None:
            got, want = grouped_mm_nvfp4(*packed, w_packed=True), grouped_mm_nvfp4(*args)
        else:
            got, want = grouped_mm_nvfp4_fwd(*packed, BF16, True, cfg=cfg), grouped_mm_nvfp4_fwd(*args, BF16, cfg=cfg)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    _assert_matches_oracle(got, args)


def _ws_tile(block_m, chunks, stages, programs, registers):
    return config.TileConfig(block_m, 128, 64 * chunks, group_m=1, num_warps=4, num_stages=stages,
                             programs_per_sm=programs, swap=True, max_registers=registers, warp_specialized=True)


# the warp-specialized kernel (sm_90, packed weights): the heuristic's tiles (16 and 32 rows: four chunks
# per stage, 3 stages, two programs per SM; 64 rows: two chunks, 4 stages, one program), two chunks in
# a deeper ring, and one chunk per stage
WS_TILES_GPU = [
    pytest.param(_ws_tile(16, 4, 3, 2, 104), id="ws16-c4"),
    pytest.param(_ws_tile(32, 4, 3, 2, 104), id="ws32-c4"),
    pytest.param(_ws_tile(64, 2, 4, 1, 160), id="ws64-c2"),
    pytest.param(_ws_tile(16, 2, 6, 2, 104), id="ws16-c2"),
    pytest.param(_ws_tile(16, 1, 8, 1, 160), id="ws16-c1"),
]

# (counts, M, K, N): experts past the M tile, an empty one and tail rows; N not a multiple of the
# 128-row weight tile (its last tile reads the next expert's rows, and past the last expert nothing);
# one hot expert; K of one chunk (the second chunk of the stage out of bounds); a single row
WS_CASES_GPU = [
    pytest.param([5, 70, 0, 16, 33, 1], 140, 1088, 600, id="ragged-odd-n"),
    pytest.param([0, 0, 0, 97], 97, 256, 136, id="one-hot"),
    pytest.param([3, 1], 4, 64, 128, id="one-chunk"),
    pytest.param([0, 1, 0], 1, 192, 264, id="one-row"),
]


@gpu
@pytest.mark.parametrize("cfg", WS_TILES_GPU)
@pytest.mark.parametrize("counts, m, k, n", WS_CASES_GPU)
def test_warp_specialized_gpu(counts, m, k, n, cfg):
    """The warp-specialized kernel against the oracle, and bit for bit against the Triton kernel's
    transposed tile of the same rows on the K-ordered weights (the same wgmma shape and K order)."""
    if not config.use_warp_specialized(torch.device(DEV)):
        pytest.skip("the warp-specialized kernel needs sm_90 with Gluon")
    args = _operands(counts, m, k, n, device=DEV)
    packed = list(args)
    packed[3] = pack_weights(args[3])
    got = grouped_mm_nvfp4_fwd(*packed, BF16, True, cfg=cfg)
    _assert_matches_oracle(got, args)
    tri = config.TileConfig(cfg.block_m, 128, 64, group_m=1, num_warps=4, num_stages=3, programs_per_sm=2, swap=True)
    assert torch.equal(got.view(torch.int16), grouped_mm_nvfp4_fwd(*args, BF16, cfg=tri).view(torch.int16))


@gpu
def test_warp_specialized_is_the_packed_default_gpu(monkeypatch):
    """On sm_90 the public op sends packed weights at <= 64 rows per expert to the warp-specialized
    kernel (and not K-ordered ones, nor packed ones with the option off), and a warp-specialized tile
    on K-ordered weights is an error."""
    from moekit.nvfp4 import gemm as nvfp4_gemm

    if not config.use_warp_specialized(torch.device(DEV)):
        pytest.skip("the warp-specialized kernel needs sm_90 with Gluon")
    calls = []
    real = nvfp4_gemm._ws_mm
    monkeypatch.setattr(nvfp4_gemm, "_ws_mm", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    args = _operands([5, 70, 0, 16, 33, 1], 140, 1088, 640, device=DEV)
    packed = list(args)
    packed[3] = pack_weights(args[3])
    got = grouped_mm_nvfp4(*packed, w_packed=True)
    assert len(calls) == 1 and calls[0].warp_specialized and calls[0].block_m == 32
    _assert_matches_oracle(got, args)
    grouped_mm_nvfp4(*args)
    with moekit.options(warp_specialized=False):
        grouped_mm_nvfp4(*packed, w_packed=True)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="warp-specialized"):
        grouped_mm_nvfp4_fwd(*args, BF16, cfg=_ws_tile(16, 2, 6, 2, 104))  # K-ordered weights


@gpu
@pytest.mark.parametrize("ptx", DECODES)
@pytest.mark.parametrize("swap", [True, False])
def test_the_decode_is_exact_for_every_scale_code_gpu(ptx, swap):
    """As the interpreter test above, on the GPU, each decode and each tile form: bit for bit."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=U8)
    m, n, e = codes.numel(), 128, 2
    a_scales = codes[:, None].view(E4M3)
    w_scales = codes[torch.randint(0, m, (e * n,))].view(e, n, 1).view(E4M3)
    a_values = torch.randint(0, 256, (m, 8), dtype=U8).view(FP4)
    w_values = torch.randint(0, 256, (e, n, 8), dtype=U8).view(FP4)
    args = [a_values, a_scales, torch.tensor(2.0**-3), w_values, w_scales, torch.tensor([2.0**5, 0.5]),
            torch.tensor([100, m], dtype=torch.int32)]
    want = _oracle(*args)[0].float()
    args = [t.to(DEV) for t in args]
    cfg = (config.TileConfig(16, 128, 16, group_m=1, num_warps=4, num_stages=2, swap=True) if swap
           else config.TileConfig(64, 64, 16, group_m=1, num_warps=4, num_stages=2))
    with moekit.options(nvfp4_ptx_decode=ptx):
        got = grouped_mm_nvfp4_fwd(*args, F32, cfg=cfg).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got - want).abs().max()


# (counts, M) in each regime of the op: decoded in the main loop (<= 64 rows per expert), dequantized first
REGIMES = [pytest.param([20, 0, 57, 31], 120, id="decoded"), pytest.param([100, 0, 257, 31], 400, id="dequantized")]


@gpu
@pytest.mark.parametrize("w_packed", [False, True])
@pytest.mark.parametrize("counts, m", REGIMES)
def test_no_host_sync_gpu(counts, m, w_packed):
    """No host sync in either regime; packed weights give the K-ordered ones' bits."""
    args = list(_operands(counts, m, 256, 384, device=DEV))
    want = grouped_mm_nvfp4(*args)  # compiles the kernels
    if w_packed:
        args[3] = pack_weights(args[3])
    grouped_mm_nvfp4(*args, w_packed=w_packed)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped_mm_nvfp4(*args, w_packed=w_packed)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@gpu
@pytest.mark.parametrize("m", [pytest.param(200, id="decoded"), pytest.param(512, id="dequantized")])
def test_cuda_graph_replays_with_new_routing_and_data(m):
    """Captured once; replayed after new operands and new offs are copied into the captured tensors."""
    k, n = 256, 320
    args = _operands([m // 5, 2 * m // 5, 0, m - 3 * m // 5], m, k, n, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        grouped_mm_nvfp4(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_mm_nvfp4(*args)
    new = _operands([0, 7, m - 10, 3], m, k, n, device=DEV)
    for dst, src in zip(args, new, strict=True):
        (dst.view(U8) if dst.dtype in (FP4, E4M3) else dst).copy_(src.view(U8) if src.dtype in (FP4, E4M3) else src)
    graph.replay()
    _assert_matches_oracle(out, args)


@gpu
@pytest.mark.parametrize("counts, m", REGIMES)
def test_torch_compile_gpu(counts, m):
    args = _operands(counts, m, 256, 192, device=DEV)
    compiled = torch.compile(lambda *a: grouped_mm_nvfp4(*a) * 2, fullgraph=True)
    assert torch.equal(compiled(*args), grouped_mm_nvfp4(*args) * 2)


@gpu
def test_custom_op_passes_opcheck_gpu():
    torch.library.opcheck(_grouped_mm_nvfp4_op, _op_args(_operands([60, 0, 90], 200, 128, 96, device=DEV)))

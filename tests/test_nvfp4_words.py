"""The NVFP4 quantize kernel's bf16 path, which reads rows as 32-bit words of two elements
(``_kernels/nvfp4_gluon._quantize_words``, Hopper and newer): its inline PTX run on the CPU in an
emulator of the instructions (the interpreter runs no PTX), which inputs take it, and (``-m gpu``) its
output bit for bit against the reference, in the quantize and in the SwiGLU -> NVFP4 pass."""

import numpy as np
import pytest
import torch
from ptx_emulator import _run_ptx
from test_nvfp4 import BAD_GLOBAL_SCALES, DEV, _assert_bit_equal, _special_inputs, gpu

import moekit
from moekit import config
from moekit._kernels import nvfp4_gluon as kernels
from moekit.nvfp4 import formats as nvfp4
from moekit.nvfp4 import swiglu as ns


def _block_amax_bits(halves: list[int]) -> int:
    """The fp32 bits of a block's amax as the quantizers see it (``nvfp4._block_abs``): the largest |x|
    over bf16 bit patterns, +inf when one of them is a NaN or an inf."""
    x = torch.tensor(halves, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().abs()
    x = torch.where(torch.isfinite(x), x, torch.full_like(x, float("inf")))
    return int(x.max().view(torch.int32)) & 0xFFFFFFFF


def test_word_path_asm_amax():
    """The NaN-keeping bf16x2 maximum over a block's eight words of |x| and ``_WORDS_AMAX`` give the
    block's amax, as fp32 bits, and +inf for a block holding a NaN or an inf (which then takes the NaN
    scale): every bf16 pattern against +1.0, and blocks of random patterns with NaN, inf, zeros,
    subnormals and the largest finite value mixed in."""
    amax = kernels._WORDS_AMAX.value
    for h in range(1 << 16):
        got = _run_ptx(amax, {"$1": (h & 0x7FFF) | (0x3F80 << 16)})["$0"]
        assert got == _block_amax_bits([h, 0x3F80]), hex(h)

    rng = np.random.default_rng(0)
    special = [0x7F80, 0xFF80, 0x7FC0, 0xFFFF, 0x7F81, 0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F]
    blocks = []
    for i in range(3000):
        h = rng.integers(0, 1 << 16, 16)
        h = np.where(rng.random(16) < 0.3, rng.choice(special, 16), h)
        if i % 3 == 0:
            h = np.where((h & 0x7F80) == 0x7F80, 0x3F80, h)  # all finite
        if i % 50 == 1:
            h = rng.choice([0x7F80, 0xFF80], 16)  # only infs
        blocks.append([int(v) for v in h])
    for h in blocks:
        words = [(h[2 * j] | h[2 * j + 1] << 16) & 0x7FFF7FFF for j in range(8)]
        m = words[0]
        for w in words[1:]:
            m = _run_ptx(kernels._BF16X2_MAX_NAN.value, {"$1": m, "$2": w})["$0"]
        assert _run_ptx(amax, {"$1": m})["$0"] == _block_amax_bits(h), h


def test_word_path_asm_pack4():
    """``_WORDS_PACK4`` on every pair of magnitude codes in each of the four bytes (with the junk bits
    ``_e2m1_magnitude_bits`` leaves above them) and every sign: each byte is the two codes, the even
    element's low, with a sign bit only where its code is not 0."""
    rng = np.random.default_rng(1)
    for case in range(4000):
        lo, hi = rng.integers(0, 8, 4), rng.integers(0, 8, 4)
        if case < 64:  # every code pair in byte 0
            lo[0], hi[0] = case % 8, case // 8
        neg_lo, neg_hi = rng.integers(0, 2, 4), rng.integers(0, 2, 4)
        mags = [(0x4B400000 + int(a)) + ((0x4B400000 + int(b)) << 4) & 0xFFFFFFFF for a, b in zip(lo, hi, strict=True)]
        words = [int(rng.integers(0, 1 << 15)) | int(sl) << 15 | int(rng.integers(0, 1 << 15)) << 16 | int(sh) << 31
                 for sl, sh in zip(neg_lo, neg_hi, strict=True)]
        regs = {f"${i + 1}": v for i, v in enumerate(mags + words)}
        got = _run_ptx(kernels._WORDS_PACK4.value, regs)["$0"]
        want = 0
        for i in range(4):
            code_lo = int(lo[i]) | (8 if neg_lo[i] and lo[i] else 0)
            code_hi = int(hi[i]) | (8 if neg_hi[i] and hi[i] else 0)
            want |= (code_lo | code_hi << 4) << 8 * i
        assert got == want, (case, hex(got), hex(want))


def test_which_inputs_are_read_as_words():
    """bf16 with a unit column stride, even strides and a 4-byte aligned start; nothing else."""
    x = torch.randn(64, 160).to(torch.bfloat16)
    assert nvfp4.quantize_reads_words(x.reshape(1, 64, 160))
    assert nvfp4.quantize_reads_words(x.reshape(4, 16, 160))
    assert nvfp4.quantize_reads_words(x[:, :128].reshape(1, 64, 128))  # even row stride, aligned
    assert not nvfp4.quantize_reads_words(x[:, 1:129].reshape(1, 64, 128))  # a 2-byte offset
    assert not nvfp4.quantize_reads_words(x.t().contiguous().t()[:, :32].reshape(1, 64, 32))  # column stride 64
    for dtype in (torch.float32, torch.float16):
        assert not nvfp4.quantize_reads_words(x.to(dtype).reshape(1, 64, 160))


def _bf16_neighbours(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values one ulp below and above each positive bf16 value of t."""
    bits = t.view(torch.int16)
    return (bits - 1).view(torch.bfloat16), (bits + 1).view(torch.bfloat16)


@gpu
def test_quantize_bf16_words_gpu():
    """The Gluon kernel's bf16 path (rows read as 32-bit words of two elements, NaN halves cleared and
    the amax taken as a bf16x2 maximum in inline PTX, four code bytes packed per word): every bf16 bit
    pattern, in blocks of neighbours (all-NaN, all-inf, subnormal, mixed blocks) and shuffled, each e2m1
    midpoint times each block scale with its bf16 neighbours, under ordinary, tiny, huge and bad global
    scales; bit for bit against the reference, and against the fp32-element path for inputs whose
    strides or alignment keep them off the word path."""
    assert config.use_gluon_quantize(torch.device(DEV))  # Hopper and newer: the Gluon kernel runs
    torch.manual_seed(0)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=DEV).to(torch.int16).view(torch.bfloat16)
    shuffled = every[torch.randperm(every.numel(), device=DEV)]
    s = torch.tensor([1.0, 2.0**-8, 0.5, 1.25, 3.0, 448.0], device=DEV)  # e4m3 values
    mids = (torch.tensor(nvfp4._MIDPOINTS, device=DEV)[None, :] * s[:, None]).to(torch.bfloat16)  # exact
    below, above = _bf16_neighbours(mids)
    grid = torch.cat([mids, below, above, (6.0 * s[:, None]).to(torch.bfloat16)], 1)  # 6 x 22: amax 6 s
    grid = grid[:, torch.randperm(grid.shape[1], device=DEV)]
    ties = torch.cat([grid, grid[:, :10]], 1) * (torch.randint(0, 2, (6, 32), device=DEV) * 2 - 1)
    specials = _special_inputs(DEV).to(torch.bfloat16)
    long = torch.randn(4099, 2880, device=DEV).to(torch.bfloat16)  # programs loop, column tiles wrap
    long[::97, ::13] = float("inf")
    for x in (every.view(256, 256), shuffled.view(512, 128), ties.to(torch.bfloat16), specials, long):
        assert nvfp4.quantize_reads_words(x.reshape(1, *x.shape))
        for g in (None, 1.0, 1 / 6, 0.25, 3e-5, 2.0**-140, 1e30, *BAD_GLOBAL_SCALES):
            g = g if g is None else torch.tensor(g, device=DEV)
            _assert_bit_equal(nvfp4.quantize(x, g), nvfp4.quantize_ref(x, g))
    experts = shuffled[: 300 * 3 * 64].view(300, 3, 64)  # more groups than SMs, a scale each
    scales = torch.rand(300, device=DEV) * 1e-3
    scales[::7] = 2.0**-140
    _assert_bit_equal(nvfp4.quantize(experts, scales), nvfp4.quantize_ref(experts, scales))
    wide = torch.cat([shuffled.view(512, 128), shuffled.view(512, 128)[:, :16]], 1)
    off = wide[:, 1:129]  # a 2-byte offset: elements, not words
    assert off.data_ptr() % 4 == 2 and not nvfp4.quantize_reads_words(off.reshape(1, 512, 128))
    for g in (None, torch.tensor(0.25, device=DEV)):
        _assert_bit_equal(nvfp4.quantize(off, g), nvfp4.quantize_ref(off, g))
        _assert_bit_equal(nvfp4.quantize(off, g), nvfp4.quantize(off.contiguous(), g))


@gpu
@pytest.mark.parametrize("layout", ns.LAYOUTS)
def test_swiglu_quantize_words_special_values_gpu(layout):
    """The SwiGLU pass's bf16 path (h rounded and paired by one cvt per pair, then the quantize's word
    code) with NaN, +-inf, huge and subnormal pre-activations, under ordinary, tiny (lifted) and huge
    global scales, both SwiGLU variants: bit for bit against the Triton pass."""
    torch.manual_seed(1)
    pre = torch.randn(333, 2 * 272, device=DEV) * 3
    pre[::5, ::7] = float("nan")
    pre[1::5, 3::11] = float("inf")
    pre[2::5, 5::13] = -float("inf")
    pre[3::5, ::17] = 3e38
    pre[4::5, 1::19] = 1e-40
    pre = pre.to(torch.bfloat16)
    for g in (0.002, 2.0**-140, 1e30):
        g = torch.tensor(g, device=DEV)
        for kw in ({}, {"swiglu_alpha": 1.0, "swiglu_limit": None, "swiglu_linear_offset": 0.0}):
            got = ns.swiglu_quantize_nvfp4(pre, g, gate_up_layout=layout, **kw)
            with moekit.options(gluon_quantize=False):
                want = ns.swiglu_quantize_nvfp4(pre, g, gate_up_layout=layout, **kw)
            _assert_bit_equal(got, want)

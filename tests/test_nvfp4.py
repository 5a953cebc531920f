"""NVFP4: the references (e2m1 rounding at every boundary, round trips, special values, the swizzled
scale layout against torch's own ``to_blocked``, the gate/up interleave), then the Triton kernels bit
for bit against them: on CPU tensors under the interpreter, and (``-m gpu``) on a CUDA GPU at larger
sizes, with no host sync and under CUDA-graph capture."""

import itertools
import re

import pytest
import torch

import moekit
from moekit import config
from moekit.nvfp4 import formats as nvfp4

E4M3 = torch.float8_e4m3fn
DEV = "cuda"
gpu = pytest.mark.gpu


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as integers of its width: equality is bit equality (-0.0 != 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_bit_equal(got, want):
    """Bit equality, except that a NaN equals any NaN in fp32 / fp16 / bf16 outputs (the GPU writes its
    canonical NaN, torch on the CPU keeps an operand's); the scales and codes are compared bit for bit."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), (i, a.dtype, b.dtype, a.shape, b.shape)
        bad = _bits(a) != _bits(b)
        if a.dtype in (torch.float32, torch.float16, torch.bfloat16):
            bad &= ~(a.isnan() & b.isnan())
        assert not bad.any(), (i, int(bad.sum()), bad.nonzero()[:8].tolist())


@pytest.fixture
def to_blocked_torch():
    """torch's implementation of the cuBLAS block-scale layout: the independent oracle for the swizzle
    (its module needs ``expecttest``, which the test extra installs)."""
    return pytest.importorskip("torch.testing._internal.common_quantized").to_blocked


def _nearest_even(v: float) -> float:
    """Brute force: the e2m1 value nearest to v (saturating at +-6), ties to the even code."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(nvfp4.E2M1_VALUES[c] - mag), c % 2))
    return -nvfp4.E2M1_VALUES[best] if v < 0 and best else nvfp4.E2M1_VALUES[best]


def test_e2m1_rounding_at_every_boundary():
    """Every representable value, every midpoint (ties to even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), points just beside them, saturation, both signs."""
    grid = list(nvfp4.E2M1_VALUES) + list(nvfp4._MIDPOINTS) + [5.25, 6.5, 100.0, 1e-30]
    eps = [0.0, 2**-12, -(2**-12)]
    vals = sorted({s * (g + e) for g, e, s in itertools.product(grid, eps, (1.0, -1.0)) if g + e >= 0})
    v = torch.tensor(vals, dtype=torch.float32)
    got = nvfp4.e2m1_values_ref(nvfp4.e2m1_codes_ref(v))
    want = torch.tensor([_nearest_even(float(x)) for x in v])
    assert torch.equal(got, want), [(float(a), float(b), float(c)) for a, b, c in zip(v, got, want, strict=True)
                                   if b != c]
    named = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0, 5.25: 6.0}
    for x, y in named.items():
        assert float(nvfp4.e2m1_values_ref(nvfp4.e2m1_codes_ref(torch.tensor([x])))) == y, x


def test_pack_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = nvfp4.pack_ref(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.view(torch.uint8).tolist() == [[0x21, 0x8F]]
    assert torch.equal(nvfp4.unpack_ref(packed), codes)


@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 32), (1, 16)], ids=["2d", "3d", "one-block"])
def test_round_trip_matches_a_brute_force_quantizer(shape):
    """quantize -> dequantize against an independent per-element computation: each block's e4m3 scale
    from its amax, each value to the nearest e2m1 of value / (scale * global), ties to even."""
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])  # blocks of very different magnitudes
    values, scales, g = nvfp4.quantize_ref(x)
    assert values.shape == (*shape[:-1], shape[-1] // 2) and scales.shape == (*shape[:-1], shape[-1] // 16)
    assert scales.dtype == torch.float8_e4m3fn and g.dtype == torch.float32 and g.dim() == 0
    assert torch.isclose(g, x.abs().max() / (6 * 448))
    blocks = x.unflatten(-1, (-1, 16))
    s = (blocks.abs().amax(-1) / (6 * g)).to(torch.float8_e4m3fn).float()
    want = torch.tensor([_nearest_even(float(v)) for v in (blocks / (s[..., None] * g)).flatten()])
    want = want.view(blocks.shape) * s[..., None] * g
    got = nvfp4.dequantize_ref(values, scales, g)
    assert torch.equal(got, want.flatten(-2))
    assert (got - x).abs().max() <= x.abs().max() / 6 * 1.01  # at most half the largest step of the grid


def test_zero_underflow_and_non_finite_inputs_give_documented_values():
    x = torch.zeros(2, 48)
    x[0, 16:32] = 1e-12  # far under the global amax: its e4m3 block scale underflows to 0
    x[0, 32:48] = torch.linspace(-3e3, 3e3, 16)
    x[1, :16] = float("nan")
    x[1, 16] = float("inf")
    x[1, 17] = -float("inf")
    x[1, 18:32] = 0.5
    values, scales, g = nvfp4.quantize_ref(x)
    out = nvfp4.dequantize_ref(values, scales, g)
    assert torch.isclose(g, torch.tensor(3e3 / (6 * 448)))  # the non-finite values are not in the amax
    assert scales.float()[0, 0] == 0 and scales.float()[0, 1] == 0 and not out[0, :32].any()
    # a block with a NaN or an inf: the NaN scale (code 0x7F), zero codes, NaN after dequantizing
    assert (scales.view(torch.uint8)[1, :2] == 0x7F).all() and not values.view(torch.uint8)[1, :16].any()
    assert out[1, :32].isnan().all() and torch.isfinite(out[0]).all()
    assert scales.view(torch.uint8)[1, 2] == 0 and not out[1, 32:].any()  # the row's third block is all zero
    zero = nvfp4.quantize_ref(torch.zeros(4, 16))
    assert float(zero[2]) == 1.0 and not zero[1].float().any()
    assert not nvfp4.dequantize_ref(*zero).any()


def test_per_expert_global_scales():
    w = torch.randn(3, 8, 32) * torch.tensor([1e-2, 1.0, 1e2])[:, None, None]
    g = nvfp4.global_scale_ref(w, per_expert=True)
    assert g.shape == (3,) and torch.allclose(g, w.abs().flatten(1).amax(1) / (6 * 448))
    values, scales, g_out = nvfp4.quantize_ref(w, g)
    assert g_out is g or torch.equal(g_out, g)
    for e in range(3):  # each expert as if quantized alone with its own scale
        alone = nvfp4.quantize_ref(w[e], g[e])
        assert torch.equal(values[e].view(torch.uint8), alone[0].view(torch.uint8))
        assert torch.equal(scales[e].view(torch.uint8), alone[1].view(torch.uint8))
    out = nvfp4.dequantize_ref(values, scales, g)
    for e in range(3):  # e2m1 keeps ~1.5 significant bits: Gaussian blocks land near 0.1 RMS relative error
        assert (out[e] - w[e]).norm() / w[e].norm() < 0.15


def _scales(rows, cols, device="cpu", e=None):
    """Random positive e4m3 scales (rows, cols), or (e, rows, cols)."""
    shape = (rows, cols) if e is None else (e, rows, cols)
    return (torch.rand(shape, device=device) * 400 + 0.01).to(E4M3)


@pytest.mark.parametrize("rows, cols", [(128, 4), (1, 1), (200, 5), (130, 180), (256, 8)])
def test_swizzle_is_byte_exact_against_torch(to_blocked_torch, rows, cols):
    s = _scales(rows, cols)
    got = nvfp4.to_blocked_ref(s)
    want = to_blocked_torch(s)
    assert got.numel() == nvfp4.blocked_size(rows, cols) == want.numel()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8).flatten())


@pytest.mark.parametrize("counts", [[130, 0, 1, 255], [0, 0], [128, 128], [5]],
                         ids=["odd-and-empty", "all-empty", "whole-tiles", "one-expert"])
def test_ragged_swizzle_starts_each_expert_on_a_tile(to_blocked_torch, counts):
    """Each expert's scale rows start a new 128-row tile; an empty expert takes no tile; the buffer
    has the static size of (ceil(M / 128) + E) row tiles, its unused tiles zero."""
    m, cols = sum(counts) + 3, 12  # 3 rows past offs[-1], whose scales are not laid out
    s = _scales(m, cols)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    got = nvfp4.to_blocked_ragged_ref(s, offs).view(torch.uint8)
    tiles = nvfp4.ragged_row_tiles(offs)
    assert tiles.tolist() == [sum(-(-c // 128) * 128 for c in counts[: g + 1]) for g in range(len(counts))]
    per_row_tile = nvfp4.blocked_size(128, cols)
    assert got.numel() == (-(-m // 128) + len(counts)) * per_row_tile
    start = 0
    for g, c in enumerate(counts):
        rows = s[start : start + c]
        first = (int(tiles[g - 1]) if g else 0) // 128 * per_row_tile
        n = -(-c // 128) * per_row_tile
        want = to_blocked_torch(rows).view(torch.uint8).flatten() if c else got[:0]
        assert torch.equal(got[first : first + n], want)
        start += c
    assert not got[int(tiles[-1]) // 128 * per_row_tile :].any()


def test_expert_weight_swizzle(to_blocked_torch):
    s = _scales(3 * 200, 6).view(3, 200, 6)
    got = nvfp4.to_blocked_experts_ref(s)
    assert got.shape == (3, nvfp4.blocked_size(200, 6))
    for e in range(3):
        assert torch.equal(got[e].view(torch.uint8), to_blocked_torch(s[e]).view(torch.uint8).flatten())


def test_interleave8_round_trip_and_order():
    f = 24
    t = torch.arange(2 * f).repeat(3, 1)  # [gate 0..23 | up 24..47]
    il = nvfp4.interleave8_ref(t)
    assert il[0, :16].tolist() == list(range(8)) + list(range(24, 32))
    assert torch.equal(nvfp4.deinterleave8_ref(il), t)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.interleave8_ref(torch.zeros(2, 24))


def test_quantize_rejects_partial_blocks():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_ref(torch.randn(4, 40))


def test_weight_quantization_reference():
    """``quantize_weights_ref``: 1x16 blocks are ``quantize_ref`` of w.mT with per-expert global scales; a
    16 x 16 block's scale comes from the amax of its whole tile (checked tile by tile here), and its
    values are quantized with it."""
    w = torch.randn(2, 32, 24) * torch.logspace(-2, 2, 24)
    w[1, :16, :16] *= 1e-9  # a tile whose scale underflows
    g = nvfp4.global_scale_ref(w, per_expert=True)
    _assert_bit_equal(nvfp4.quantize_weights_ref(w, g), nvfp4.quantize_ref(w.mT.contiguous(), g))
    values, scales, g_out = nvfp4.quantize_weights_ref(w, block_2d=True)
    assert torch.equal(g_out, g) and scales.shape == (2, 24, 2) and values.shape == (2, 24, 16)
    for e, kb, nb in itertools.product(range(2), range(2), range(2)):
        tile = w[e, 16 * kb : 16 * kb + 16, 16 * nb : 16 * nb + 16]
        want = (tile.abs().amax() / (6 * g[e])).clamp(max=448).to(E4M3).float()
        assert (scales[e, 16 * nb : 16 * nb + 16, kb].float() == want).all(), (e, kb, nb)
    assert not scales[1, :16, 0].float().any()
    out = nvfp4.dequantize_ref(values, scales, g)
    sc, g3 = scales.float().repeat_interleave(16, -1), g[:, None, None]
    denom = sc * g3
    want = torch.tensor([_nearest_even(float(v)) for v in (w.mT / torch.where(denom > 0, denom, 1)).flatten()])
    assert torch.equal(out, torch.where(denom > 0, want.view_as(sc) * sc * g3, 0.0))


# --------------------------------------------------------------------------------------------------
# the kernels against the references, bit for bit (CPU tensors: the Triton interpreter)
# --------------------------------------------------------------------------------------------------


def _activations(shape, dtype=torch.float32, device="cpu"):
    """Random blocks whose magnitudes span 13 decades (relative to the largest, some block scales are
    e4m3 subnormals and some underflow to 0), plus, where there is room, NaN, +-inf, -0.0, an fp32
    subnormal and an all-zero block."""
    k = shape[-1]
    mags = 10 ** (torch.rand(*shape[:-1], k // 16, 1, device=device) * 13 - 9)
    x = (torch.randn(*shape[:-1], k // 16, 16, device=device) * mags).flatten(-2)
    flat = x.view(-1)
    if flat.numel() >= 64:
        flat[16:32] = 0.0
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40], device=device)
        flat[torch.randperm(flat.numel(), device=device)[: len(specials)]] = specials
    return x.to(dtype)


def _finite(x):
    return torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)


def _global_scale(x, mode):
    """None; a given 0-dim scale (1.5x the amax's, or 1/16 of it so that block scales clamp at 448);
    or one per expert (E,) for x (E, ..., K)."""
    if mode == "none":
        return None
    if mode == "per-expert":
        return nvfp4.global_scale_ref(x, per_expert=True) * (0.5 + torch.rand(x.shape[0], device=x.device))
    g = nvfp4.global_scale_ref(x)
    return g / 16 if mode == "clamped" else g * 1.5


def _check_quantize(x, mode):
    g = _global_scale(x, mode)
    got, want = nvfp4.quantize(x, g), nvfp4.quantize_ref(x, g)
    _assert_bit_equal(got, want)
    assert got[0].dtype == torch.float4_e2m1fn_x2 and got[1].dtype == E4M3
    if mode == "clamped":
        assert (got[1].float() == 448).any()
    _assert_bit_equal([nvfp4.dequantize(*got)], [nvfp4.dequantize_ref(*want)])


QUANTIZE_CASES = [  # shape, dtype, global scale
    pytest.param((7, 48), torch.bfloat16, "none", id="odd-rows"),  # partial row and column tiles, 3 blocks
    pytest.param((33, 160), torch.float32, "given", id="tiles-both-ways"),  # 3 x 3 tiles, the last ones partial
    pytest.param((3, 5, 32), torch.float16, "per-expert", id="3d-per-expert"),  # (E,) scales for x (E, T, K)
    pytest.param((2, 9, 16), torch.float32, "none", id="3d-one-block"),  # one block a row, amax over all of x
    pytest.param((16,), torch.float32, "given", id="1d"),
    pytest.param((9, 64), torch.bfloat16, "clamped", id="scales-clamp-at-448"),
    pytest.param((0, 32), torch.float32, "none", id="m0"),  # nothing to reduce: global scale 1.0
    pytest.param((3, 0, 48), torch.bfloat16, "per-expert", id="empty-experts"),
]


@pytest.mark.parametrize("shape, dtype, mode", QUANTIZE_CASES)
def test_quantize_kernel(interpreter, shape, dtype, mode):
    _check_quantize(_activations(shape, dtype), mode)


def _check_ties(device):
    s = torch.tensor([1.0, 2.0**-8, 0.5, 1.25, 3.0, 448.0], device=device)  # e4m3 values; 2^-8 a subnormal
    mids = torch.tensor(nvfp4._MIDPOINTS, device=device)
    grid = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                      torch.tensor([*nvfp4.E2M1_VALUES, 5.25], device=device)])  # 30 values
    pattern = grid[torch.randperm(30, device=device)].view(2, 15)
    blocks = torch.cat([torch.full((6, 2, 1), 6.0, device=device), pattern.expand(6, 2, 15)], -1)
    blocks = blocks * (torch.randint(0, 2, blocks.shape, device=device) * 2 - 1)
    x = (blocks * s[:, None, None]).flatten(1)  # (6, 32)
    g = torch.tensor(1.0, device=device)
    got, want = nvfp4.quantize(x, g), nvfp4.quantize_ref(x, g)
    _assert_bit_equal(got, want)
    assert torch.equal(got[1].float(), s[:, None].expand(-1, 2))  # amax / 6 = s exactly
    q = nvfp4.dequantize_ref(*want).view_as(blocks) / s[:, None, None]
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    for m, even in ties.items():  # m * s is exact for every s here: each tie is hit
        on = blocks.abs() == m
        assert on.any() and (q.abs()[on] == even).all(), m
    exact = [0, 1, 2]  # powers of two: the values beside the midpoints are exact too
    want_q = torch.tensor([_nearest_even(float(v)) for v in blocks[exact].flatten()], device=device)
    assert torch.equal(q[exact].flatten(), want_q)


def test_quantize_kernel_ties(interpreter):
    """Global scale 1 and a block amax of 6 * s, s an e4m3 value: the block scale is s and each element
    divides by it exactly, so elements placed on every e2m1 midpoint (and one fp32 ulp either side)
    stay there: the kernel must pick the even code at each tie and the nearer one beside it."""
    _check_ties("cpu")


def _check_scale_rounding(device):
    g = torch.tensor(1 / 6, device=device)  # fp32: 6 * g rounds to exactly 1, so a block's scale is e4m3(amax)
    assert float(6.0 * g) == 1.0
    vals = torch.arange(127, dtype=torch.uint8, device=device).view(E4M3).float()  # the finite e4m3 >= 0
    mids = (vals[:-1] + vals[1:]) / 2  # exact in fp32; ties round to the even code
    extra = torch.tensor([2.0**-10, 2.0**-10 * 1.001, 2.0**-11, 448.5, 464.0, 1e6, 1e30], device=device)
    amax = torch.cat([vals[1:], mids, torch.nextafter(mids, vals[1:]), torch.nextafter(mids, vals[:-1]), extra])
    amax = torch.cat([amax, amax[: -amax.numel() % 4]])
    n = amax.numel()
    x = torch.rand(n, 16, device=device) * amax[:, None] * 0.999
    at = torch.randint(0, 16, (n,), device=device)
    x[torch.arange(n, device=device), at] = amax * torch.randn(n, device=device).sign()
    got, want = nvfp4.quantize(x.view(-1, 64), g), nvfp4.quantize_ref(x.view(-1, 64), g)
    _assert_bit_equal(got, want)
    assert torch.equal(_bits(want[1]).flatten(), _bits(amax.clamp(max=448).to(E4M3)))


def test_block_scales_round_like_torch_cast(interpreter):
    """Block amaxes at every e4m3 value, every midpoint between neighbours (ties to even), one fp32 ulp
    either side of each, across the subnormal range, at half the smallest subnormal (rounds to 0: the
    block underflows) and past 448 (clamped): the kernel's scales are torch's fp32 -> e4m3 cast."""
    _check_scale_rounding("cpu")


def _special_inputs(device):
    x = torch.randn(8, 32, device=device) * 1e3
    x[0, :16] = float("nan")  # all NaN: scale 0, codes 0
    x[1, :16] = torch.tensor([float("inf"), -float("inf")] * 8)  # all inf: nothing finite, scale 0
    x[2, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])  # beside finite values
    x[3, :16] = torch.randn(16) * 1e-40  # fp32 subnormals: the scale underflows
    x[4, 16:] = torch.randn(16) * 1e-12  # underflows against the global amax
    x[5] = 0.0
    x[6, 16:] = -0.0
    x[7, :16] = torch.randn(16) * 2.0**-128  # tiny, and the only block of its own tensor below
    return x


def _check_special_values(device):
    x = _special_inputs(device)
    nonfinite = torch.zeros(8, 32, dtype=torch.bool, device=device)
    nonfinite[:3, :16] = True  # the blocks holding a NaN or an inf
    for g in (None, torch.tensor(0.25, device=device), torch.tensor(2.0**-140, device=device)):
        got = nvfp4.quantize(x, g)
        _assert_bit_equal(got, nvfp4.quantize_ref(x, g))
        assert torch.equal(nvfp4.dequantize(*got).isnan(), nonfinite)
        assert (got[1].view(torch.uint8)[:3, 0] == 0x7F).all() and not got[0].view(torch.uint8)[:3, :8].any()
    values, scales, g = nvfp4.quantize(x)
    out = nvfp4.dequantize(values, scales, g)
    assert not scales.float()[3, 0].any() and not out[3, :16].any()
    assert not out[5].any() and not out[4, 16:].any()
    assert torch.isfinite(out[2, 16:]).all() and (out[2, 16:] != 0).any()  # the NaN's row, its other block
    tiny = x[7:, :16]  # a subnormal global scale: fp32 subnormal products and quotients
    _assert_bit_equal(nvfp4.quantize(tiny), nvfp4.quantize_ref(tiny))
    assert nvfp4.global_scale_ref(tiny) < 2.0**-126


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy: x / a tiny scale -> inf, on purpose
def test_quantize_kernel_special_values(interpreter):
    """NaN, +-inf, -0.0, fp32 subnormal inputs and global scales, underflowing and all-zero blocks:
    bit for bit the reference, and the documented values (a block with a NaN or an inf: the NaN scale,
    and NaN after dequantizing; every other block finite)."""
    _check_special_values("cpu")


# global scales outside the format: 0, -0, inf, NaN and negative ones, one rule everywhere
BAD_GLOBAL_SCALES = (0.0, -0.0, float("inf"), float("nan"), -1.5, -float("inf"), -2.0**-140)


def _check_bad_global_scales(device):
    """Each bad global scale: all-zero values and the reference's bytes, from the activation and the
    weight quantizers; a per-expert vector mixing good and bad ones leaves the good experts as they
    were alone."""
    x = _activations((37, 64), torch.bfloat16, device=device)
    for g in BAD_GLOBAL_SCALES:
        g = torch.tensor(g, device=device)
        got = nvfp4.quantize(x, g)
        _assert_bit_equal(got, nvfp4.quantize_ref(x, g))
        assert not got[0].view(torch.uint8).any(), g
    mixed = torch.tensor([0.01, -0.01, -0.0, float("nan")], device=device)
    w = _weights((4, 64, 48), "contiguous", device=device)
    for block_2d in (False, True):
        got = nvfp4.quantize_weights(w, mixed, block_2d=block_2d)
        _assert_bit_equal(got, nvfp4.quantize_weights_ref(w, mixed, block_2d=block_2d))
        alone = nvfp4.quantize_weights(w[:1], mixed[:1], block_2d=block_2d)
        _assert_bit_equal([t[:1] for t in got[:2]], alone[:2])
        assert not got[0][1:].view(torch.uint8).any()
    x4 = _activations((4, 9, 32), torch.float32, device=device)
    _assert_bit_equal(nvfp4.quantize(x4, mixed), nvfp4.quantize_ref(x4, mixed))


def test_bad_global_scales_give_zero_values(interpreter):
    _check_bad_global_scales("cpu")


def test_tiny_tensors_quantize_near_x(interpreter):
    """x ~ 2^-135 (fp32 subnormals, a subnormal global scale): a block's scale times the global scale
    is ~2^-135, whose reciprocal would overflow fp32 (so the values are divided by it, not multiplied
    by its reciprocal). The kernel matches the reference bit for bit, and the large values dequantize
    near x."""
    torch.manual_seed(0)
    x = torch.randn(32, 64) * 2.0**-135
    want = nvfp4.quantize_ref(x)
    _assert_bit_equal(nvfp4.quantize(x), want)
    deq = nvfp4.dequantize_ref(*want)
    big = x.abs() >= x.abs().max() / 2
    assert big.any() and ((deq - x).abs()[big] <= x.abs()[big] / 3).all()


def _weights(shape, layout, device="cpu"):
    e, k, n = shape
    w = torch.randn(e, n, k, device=device) * 10 ** (torch.rand(e, n, 1, device=device) * 6 - 3)
    w = w.mT if layout == "k-major" else w.mT.contiguous()
    if e > 1:
        w[1] = 0.0  # an all-zero expert: global scale 1.0, zero scales and codes
    w[0, :3, 0] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    return w


def _check_weights(w, mode, block_2d):
    g = None if mode == "none" else _global_scale(w, mode)
    got = nvfp4.quantize_weights(w, g, block_2d=block_2d)
    want = nvfp4.quantize_weights_ref(w, g, block_2d=block_2d)
    _assert_bit_equal(got, want)
    e, k, n = w.shape
    assert got[0].shape == (e, n, k // 2) and got[1].shape == (e, n, k // 16)


WEIGHT_CASES = [  # shape (E, K, N), layout
    pytest.param((3, 32, 40), "contiguous", id="partial-2d-block"),  # N = 40: the last 16-column block holds 8
    pytest.param((2, 48, 16), "k-major", id="k-major"),  # w as the .mT of an (E, N, K) parameter
    pytest.param((1, 16, 3), "contiguous", id="one-expert-thin"),
]


@pytest.mark.parametrize("shape, layout", WEIGHT_CASES)
@pytest.mark.parametrize("mode", ["none", "per-expert", "given"])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_quantize_weights_kernel(interpreter, shape, layout, mode, block_2d):
    _check_weights(_weights(shape, layout), mode, block_2d)


def _check_dequantize(device, dtype):
    codes = torch.arange(256, device=device)
    finite = codes[(codes & 0x7F) != 0x7F]  # every finite e4m3 scale: negative, zero and subnormal ones too
    values = torch.randint(0, 256, (3, 5, 40), dtype=torch.uint8, device=device).view(torch.float4_e2m1fn_x2)
    scales = finite[torch.randint(0, len(finite), (3, 5, 5), device=device)].to(torch.uint8).view(E4M3)
    for g in (torch.rand(3, device=device) + 0.5, torch.tensor(0.75, device=device)):
        for v, s in ((values, scales), (values[:, 1:], scales[:, 1:])):  # and a strided view
            got = nvfp4.dequantize(v, s, g, dtype=dtype)
            _assert_bit_equal([got], [nvfp4.dequantize_ref(v, s, g, dtype=dtype)])
    nan_scales = scales.clone()
    nan_scales.view(torch.uint8)[0, 0, 0] = 0x7F
    out = nvfp4.dequantize(values, nan_scales, g, dtype=dtype)
    assert out[0, 0, :16].isnan().all() and not out.flatten()[16:].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_kernel(interpreter, dtype):
    """Every code with every finite e4m3 scale, per-expert and single global scales, strided inputs:
    bit for bit the reference in each output dtype; a NaN scale gives NaN for its block only."""
    _check_dequantize("cpu", dtype)


@pytest.mark.parametrize("rows, cols", [(1, 1), (200, 5), (130, 9), (256, 40), (0, 4), (5, 0)])
def test_to_blocked_kernel(interpreter, rows, cols):
    s = _scales(rows, cols)
    _assert_bit_equal([nvfp4.to_blocked(s)], [nvfp4.to_blocked_ref(s)])
    strided = _scales(rows, 2 * cols)[:, ::2]
    _assert_bit_equal([nvfp4.to_blocked(strided)], [nvfp4.to_blocked_ref(strided)])
    raw = s.view(torch.uint8)
    _assert_bit_equal([nvfp4.to_blocked(raw)], [nvfp4.to_blocked_ref(raw)])


@pytest.mark.parametrize("e, rows, cols", [(3, 130, 6), (1, 1, 1), (2, 0, 3)])
def test_to_blocked_experts_kernel(interpreter, e, rows, cols):
    s = _scales(rows, cols, e=e)
    _assert_bit_equal([nvfp4.to_blocked_experts(s)], [nvfp4.to_blocked_experts_ref(s)])


RAGGED_CASES = [  # rows per expert, scale columns
    pytest.param([130, 0, 1, 255], 9, id="odd-and-empty"),
    pytest.param([0, 0], 4, id="all-empty"),
    pytest.param([128, 128], 4, id="whole-tiles"),
    pytest.param([5], 3, id="one-expert"),
    pytest.param([0, 0, 300, 0, 0], 40, id="one-hot-expert"),  # 10 column tiles: two programs a row tile
]


def _check_ragged(counts, cols, device, extra=3):
    """``extra`` rows past offs[-1] hold scales that must not be laid out."""
    s = _scales(sum(counts) + extra, cols, device=device)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    got = nvfp4.to_blocked_ragged(s, offs)
    _assert_bit_equal([got], [nvfp4.to_blocked_ragged_ref(s, offs)])
    assert got.numel() == (-(-s.shape[0] // 128) + len(counts)) * nvfp4.blocked_size(128, cols)


@pytest.mark.parametrize("counts, cols", RAGGED_CASES)
def test_to_blocked_ragged_kernel(interpreter, counts, cols):
    _check_ragged(counts, cols, "cpu")


def test_to_blocked_ragged_kernel_m0(interpreter):
    """No rows at all: E all-padding row tiles, zeros."""
    _check_ragged([0, 0, 0], 4, "cpu", extra=0)


def _every_op_inputs(device):
    x = _activations((7, 48), torch.bfloat16, device=device)
    w = _weights((2, 32, 24), "k-major", device=device)
    return x, w, nvfp4.global_scale_ref(x), torch.tensor([3, 3, 7], dtype=torch.int32, device=device)


def _run_every_op(x, w, g, offs):
    q = nvfp4.quantize(x, g)
    return [*nvfp4.quantize(x), *q, *nvfp4.quantize_weights(w, block_2d=True), nvfp4.dequantize(*q),
            nvfp4.to_blocked(q[1]), nvfp4.to_blocked_experts(q[1].view(7, 1, 3)), nvfp4.to_blocked_ragged(q[1], offs)]


def test_kernel_paths_never_read_the_device_from_the_host(interpreter, monkeypatch):
    """Every public op on its kernel path with the tensor-to-host conversions (what would sync a GPU)
    turned into errors; the results then match a normal run."""
    inputs = _every_op_inputs("cpu")
    want = _run_every_op(*inputs)

    def host_read(*args, **kwargs):
        raise AssertionError("a device tensor read from the host")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    got = _run_every_op(*inputs)
    monkeypatch.undo()
    _assert_bit_equal(got, want)


def test_custom_ops_pass_opcheck(interpreter):
    """The custom ops that torch.compile traces: schemas, fakes and dispatch (on finite inputs: opcheck
    compares outputs with assert_close, to which NaN scales are unequal)."""
    x3 = _finite(_activations((1, 7, 64)))
    g = nvfp4.global_scale_fwd(x3)
    v, s = nvfp4.quantize_fwd(x3, g, False, False)
    torch.library.opcheck(nvfp4._global_scale_op, (x3,))
    torch.library.opcheck(nvfp4._quantize_op, (x3, g, False, True))
    torch.library.opcheck(nvfp4._dequantize_op, (v.view(1, 7, 32), s.view(1, 7, 4), g, False, torch.bfloat16))
    torch.library.opcheck(nvfp4._to_blocked_op, (s.view(1, 7, 4),))
    torch.library.opcheck(nvfp4._to_blocked_ragged_op, (s, torch.tensor([2, 2, 6], dtype=torch.int32)))


def _error_cases():
    v, s, g = nvfp4.quantize_ref(torch.randn(4, 32))
    u8 = v.view(torch.uint8)
    return [  # op, args, kwargs, exception, message fragment
        ("quantize", (torch.randn(4, 40),), {}, ValueError, "multiple of 16"),
        ("quantize", (torch.randn(4, 32).double(),), {}, TypeError, "bfloat16, float16 or float32"),
        ("quantize", (torch.ones(4, 32, dtype=torch.int32),), {}, TypeError, "bfloat16, float16 or float32"),
        ("quantize", (torch.tensor(1.0),), {}, ValueError, "expected x"),
        ("quantize", (torch.randn(4, 32), 0.5), {}, TypeError, "global_scale must be a floating-point tensor"),
        ("quantize", (torch.randn(4, 32), torch.ones(3)), {}, ValueError, "global_scale must be 0-dim"),
        ("quantize", (torch.randn(4, 32), torch.ones(4, 1)), {}, ValueError, "global_scale must be 0-dim"),
        ("quantize_weights", (torch.randn(4, 32),), {}, ValueError, "w (E, K, N)"),
        ("quantize_weights", (torch.randn(2, 24, 8),), {}, ValueError, "multiple of 16"),
        ("quantize_weights", (torch.randn(2, 32, 8), torch.ones(3)), {}, ValueError, "global_scale must be"),
        ("dequantize", (u8, s, g), {}, TypeError, "float4_e2m1fn_x2"),
        ("dequantize", (v, s.float(), g), {}, TypeError, "float8_e4m3fn"),
        ("dequantize", (v, s[:, :1], g), {}, ValueError, "do not match"),
        ("dequantize", (v, s, None), {}, TypeError, "global_scale"),
        ("dequantize", (v, s, g), {"dtype": torch.int32}, TypeError, "dtype"),
        ("to_blocked", (torch.rand(4, 4),), {}, TypeError, "float8_e4m3fn or uint8"),
        ("to_blocked", (_scales(4, 4, e=2),), {}, ValueError, "(rows, cols)"),
        ("to_blocked_experts", (_scales(4, 4),), {}, ValueError, "(E, rows, cols)"),
        ("to_blocked_ragged", (_scales(4, 4), torch.tensor([4])), {}, TypeError, "1-D int32"),
        ("to_blocked_ragged", (_scales(4, 4), torch.tensor([[4]], dtype=torch.int32)), {}, TypeError, "1-D int32"),
    ]


def test_bad_inputs_raise_the_same_errors_from_kernel_and_reference():
    for name, args, kwargs, exc, fragment in _error_cases():
        messages = []
        for fn in (getattr(nvfp4, name), getattr(nvfp4, f"{name}_ref")):
            with pytest.raises(exc, match=re.escape(fragment)) as info:
                fn(*args, **kwargs)
            messages.append(str(info.value))
        assert messages[0] == messages[1], (name, messages)


# --------------------------------------------------------------------------------------------------
# the same on a CUDA GPU, at larger sizes; no host sync; CUDA-graph capture
# --------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("shape, dtype, mode", [
    pytest.param((4103, 2880), torch.bfloat16, "none", id="odd-rows"),
    pytest.param((4103, 2880), torch.bfloat16, "given", id="given"),
    pytest.param((8, 515, 1024), torch.bfloat16, "per-expert", id="per-expert"),
    pytest.param((333, 4096), torch.float32, "clamped", id="clamped-fp32"),
    pytest.param((129, 720), torch.float16, "none", id="fp16"),
    pytest.param((0, 2880), torch.bfloat16, "none", id="m0"),
])
def test_quantize_gpu(shape, dtype, mode):
    _check_quantize(_activations(shape, dtype, device=DEV), mode)


@gpu
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon-kernel", "triton-kernel"])
def test_rounding_and_special_values_gpu(gluon):
    with moekit.options(gluon_quantize=gluon):
        _check_ties(DEV)
        _check_scale_rounding(DEV)
        _check_special_values(DEV)


@gpu
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon-kernel", "triton-kernel"])
def test_bad_global_scales_gpu(gluon):
    with moekit.options(gluon_quantize=gluon):
        _check_bad_global_scales(DEV)


@gpu
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon-kernel", "triton-kernel"])
def test_quantize_kernels_match_the_reference_gpu(gluon):
    """Both activation quantize kernels, bit for bit, on 8M elements over 13 decades, with global scales
    from the data, ordinary, fp32-subnormal (the Gluon kernel's rescaled blocks) and huge (quotients
    that overflow): the Gluon kernel divides by a per-block reciprocal with two FMA corrections."""
    torch.manual_seed(0)
    x = _activations((4096, 2048), torch.bfloat16, device=DEV)
    with moekit.options(gluon_quantize=gluon):
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert config.use_gluon_quantize(torch.device(DEV)) == (gluon and hopper)  # the kernel under test
        for g in (None, 3e-5, 2.0**-140, 1e-30, 1e30):
            g = g if g is None else torch.tensor(g, device=DEV)
            _assert_bit_equal(nvfp4.quantize(x, g), nvfp4.quantize_ref(x, g))


@gpu
@pytest.mark.parametrize("shape, layout", [
    pytest.param((4, 1024, 1536), "contiguous", id="contiguous"),
    pytest.param((4, 2880, 1000), "k-major", id="k-major-partial-2d-block"),
])
@pytest.mark.parametrize("mode", ["none", "per-expert"])
@pytest.mark.parametrize("block_2d", [False, True], ids=["1x16", "16x16"])
def test_quantize_weights_gpu(shape, layout, mode, block_2d):
    _check_weights(_weights(shape, layout, device=DEV), mode, block_2d)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_gpu(dtype):
    _check_dequantize(DEV, dtype)
    x = _activations((8, 1000, 1440), torch.bfloat16, device=DEV)
    q = nvfp4.quantize(x, nvfp4.global_scale_ref(x, per_expert=True))
    _assert_bit_equal([nvfp4.dequantize(*q, dtype=dtype)], [nvfp4.dequantize_ref(*q, dtype=dtype)])


@gpu
def test_scale_layouts_gpu():
    for rows, cols in ((8197, 180), (128, 4), (1, 1)):
        s = _scales(rows, cols, device=DEV)
        _assert_bit_equal([nvfp4.to_blocked(s)], [nvfp4.to_blocked_ref(s)])
    s = _scales(2880, 180, device=DEV, e=8)
    _assert_bit_equal([nvfp4.to_blocked_experts(s)], [nvfp4.to_blocked_experts_ref(s)])
    counts = torch.randint(0, 700, (32,)).tolist()
    counts[3] = counts[17] = 0
    _check_ragged(counts, 180, DEV, extra=77)
    _check_ragged([0] * 7 + [9000], 180, DEV)  # one hot expert
    _check_ragged([0, 0, 0], 180, DEV, extra=0)


@gpu
def test_no_host_sync_gpu():
    inputs = _every_op_inputs(DEV)
    want = _run_every_op(*inputs)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _run_every_op(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_bit_equal(got, want)


@gpu
def test_quantize_in_a_cuda_graph():
    """quantize with a device global scale (and with one computed on the device), captured once and
    replayed on new data and a new scale."""
    x = _activations((1000, 2048), torch.bfloat16, device=DEV)
    g = nvfp4.global_scale_ref(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        nvfp4.quantize(x, g)
        nvfp4.quantize(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        given = nvfp4.quantize(x, g)
        computed = nvfp4.quantize(x)
    x.copy_(_activations((1000, 2048), torch.bfloat16, device=DEV))
    g.copy_(nvfp4.global_scale_ref(x) * 2)
    graph.replay()
    _assert_bit_equal(given, nvfp4.quantize_ref(x, g))
    _assert_bit_equal(computed, nvfp4.quantize_ref(x))


@gpu
def test_custom_ops_pass_opcheck_gpu():
    x3 = _finite(_activations((2, 100, 256), torch.bfloat16, device=DEV))
    g = nvfp4.global_scale_fwd(x3)
    v, s = nvfp4.quantize_fwd(x3, g, True, False)
    torch.library.opcheck(nvfp4._global_scale_op, (x3,))
    torch.library.opcheck(nvfp4._quantize_op, (x3, g, True, True))
    torch.library.opcheck(nvfp4._dequantize_op, (v.view(2, 100, 128), s.view(2, 100, 16), g, True, torch.float32))
    torch.library.opcheck(nvfp4._to_blocked_op, (s.view(2, 100, 16),))
    offs = torch.tensor([50, 50, 180], dtype=torch.int32, device=DEV)
    torch.library.opcheck(nvfp4._to_blocked_ragged_op, (s, offs))

"""NVFP4 references: e2m1 rounding at every boundary, round trips, special values, the swizzled scale
layout against torch's own ``to_blocked``, and the gate/up interleave."""

import itertools

import pytest
import torch

from moekit import nvfp4


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
    assert torch.isfinite(scales.float()).all() and torch.isfinite(out).all()
    assert torch.isclose(g, torch.tensor(3e3 / (6 * 448)))  # the non-finite values are not in the amax
    assert scales.float()[0, 0] == 0 and scales.float()[0, 1] == 0 and not out[0, :32].any()
    assert not out[1, :16].any()  # NaN -> 0
    assert out[1, 16] == 6 * scales.float()[1, 1] * g and out[1, 17] == -out[1, 16]  # inf saturates
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


def _scales(rows, cols):
    return (torch.rand(rows, cols) * 400 + 0.01).to(torch.float8_e4m3fn)


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

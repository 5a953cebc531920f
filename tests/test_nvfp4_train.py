"""NVFP4 training: stochastic rounding (Philox against Random123's vectors, the kernel bit for bit
against the reference under the interpreter, unbiasedness, range, reproducibility), the random
Hadamard transform, and the NVFP4 expert GEMMs' forward and backward against independent emulations."""

import pytest
import torch

from moekit import nvfp4

gpu = pytest.mark.gpu
SR = dict(rounding="stochastic")


def _bytes(t):
    return t.view(torch.uint8) if t.dtype != torch.float32 else t.view(torch.int32)


def _assert_bit_equal(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bytes(a), _bytes(b)), int((_bytes(a) != _bytes(b)).sum())


# --------------------------------------------------------------------------------------------------
# stochastic rounding
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("counter, key, want", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
], ids=["zeros", "ones", "pi"])
def test_philox_matches_random123_known_answers(counter, key, want):
    """Random123's philox4x32-10 known-answer vectors (the generator Triton's tl.randint implements)."""
    got = nvfp4.philox_ref(key, tuple(torch.tensor([c]) for c in counter))
    assert tuple(int(w) for w in got) == want


# (shape, seed, offset): why
SR_CASES = [
    ((7, 64), 1234, 77, "odd rows, a nonzero offset"),
    ((3, 5, 32), 0, 0, "3-D, seed and offset 0"),
    ((2, 48), 2**40 + 5, 2**33 + 1, "a 64-bit seed and an offset past 2^32 (the counter's high word)"),
]


@pytest.mark.parametrize("shape, seed, offset, why", SR_CASES, ids=[c[-1].split(",")[0] for c in SR_CASES])
def test_stochastic_quantize_kernel_matches_reference(interpreter, shape, seed, offset, why):
    x = torch.randn(shape) * torch.logspace(-2, 2, shape[-1])
    got = nvfp4.quantize(x, **SR, seed=seed, offset=offset)
    want = nvfp4.quantize_ref(x, **SR, seed=seed, offset=offset)
    _assert_bit_equal(got, want)
    nearest = nvfp4.quantize_ref(x)
    assert torch.equal(got[1].view(torch.uint8), nearest[1].view(torch.uint8))  # the same scales as RN
    assert not torch.equal(got[0].view(torch.uint8), nearest[0].view(torch.uint8))


def test_stochastic_quantize_kernel_with_a_given_per_expert_scale(interpreter):
    x = torch.randn(3, 20, 32, dtype=torch.bfloat16)
    g = torch.rand(3) * 1e-3 + 1e-4
    _assert_bit_equal(nvfp4.quantize(x, g, **SR, seed=9, offset=3), nvfp4.quantize_ref(x, g, **SR, seed=9, offset=3))


def _sr_values(x, seed, offset=0, g=None):
    return nvfp4.dequantize_ref(*nvfp4.quantize_ref(x, g, **SR, seed=seed, offset=offset))


def test_stochastic_rounding_is_unbiased():
    """Values between grid points (of every gap size, both signs): the mean of 4000 draws is the value
    within 5 standard errors, where round to nearest is off by far more; each draw is one of the two
    neighbours."""
    g = torch.tensor(2.0**-8)  # a block whose amax is 6 gets scale 256: x / (scale * g) is x, exactly
    mags = torch.tensor([0.1, 0.3, 0.6, 1.2, 1.6, 2.3, 2.9, 3.7, 4.4, 5.5, 0.05, 5.9, 2.5, 1.75, 6.0])
    x = torch.cat([mags, -mags.flip(0)]).repeat(1, 1) * torch.ones(4000, 1)  # (4000, 30): rows are draws
    x = torch.cat([x, torch.full((4000, 2), 6.0)], dim=1)  # amax 6 in every row: every block's scale is 1
    q = nvfp4.dequantize_ref(*nvfp4.quantize_ref(x, g, **SR, seed=5))[:, :30]
    lo = nvfp4.dequantize_ref(*nvfp4.quantize_ref(x, g))[:, :30]  # RN, for the bias comparison
    grid = torch.tensor(nvfp4.E2M1_VALUES)
    below = grid[torch.bucketize(x[0, :30].abs(), grid, right=True) - 1]
    above = grid[torch.bucketize(x[0, :30].abs(), grid, right=False).clamp(max=7)]
    assert ((q.abs() == below) | (q.abs() == above)).all()
    mean, se = q.mean(0), q.std(0) / 4000**0.5
    assert ((mean - x[0, :30]).abs() <= 5 * se + 1e-6).all(), (mean - x[0, :30])
    biased = (lo[0] - x[0, :30]).abs() > 0.02
    assert ((lo[0] - x[0, :30]).abs()[biased] > 10 * (se[biased] + 1e-3)).all()


def test_stochastic_rounding_is_reproducible_and_offset_moves_the_stream():
    x = torch.randn(8, 64)
    a, b = _sr_values(x, 3, 100), _sr_values(x, 3, 100)
    assert torch.equal(a, b)
    assert not torch.equal(a, _sr_values(x, 3, 101))
    assert not torch.equal(a, _sr_values(x, 4, 100))
    # offset + i is the counter: the stream of offset 64 is the one of offset 0 moved by a row
    bits = nvfp4.random_bits_ref(3, 0, (2, 64))
    assert torch.equal(nvfp4.random_bits_ref(3, 64, (1, 64)), bits[1:])


def test_stochastic_rounding_keeps_the_block_range_and_special_values():
    """Never past 6 x scale (values that the e4m3 scale's rounding pushes past 6 saturate), underflowing
    blocks -> 0, +-inf -> +-6 x scale, NaN -> 0, exact grid values stay, as with round to nearest."""
    x = torch.randn(64, 64) * torch.logspace(-3, 3, 64)
    x[0, :16] = 1e-30  # underflows e4m3 once divided by the global scale
    x[1, 0], x[1, 1], x[1, 2] = float("inf"), float("-inf"), float("nan")
    x[2, :16] = torch.linspace(-1, 1, 16) * 5.8
    x[2, 5] = 6.2  # with g = 1/6 the scale is 6.2 rounded down to e4m3's 6.0: 6.2 / (6 * g) saturates to 6
    values, scales, g = nvfp4.quantize_ref(x, torch.tensor(1 / 6), **SR, seed=11)
    assert scales[2, 0].float() == 6.0
    y = nvfp4.dequantize_ref(values, scales, g)
    bound = (6 * scales.float()[..., None] * g).expand(64, 4, 16).flatten(1)  # dequantize's order of products
    assert (y.abs() <= bound).all()
    for seed in range(8):
        assert nvfp4.dequantize_ref(*nvfp4.quantize_ref(x[2:3], g, **SR, seed=seed))[0, 5] == bound[2, 5]
    near = nvfp4.dequantize_ref(*nvfp4.quantize_ref(x, g))
    special = torch.zeros_like(x, dtype=torch.bool)
    special[0, :16] = special[1, :3] = True
    assert torch.equal(y[special], near[special]) and (y[0, :16] == 0).all() and y[1, 2] == 0
    assert torch.equal(_sr_values(near, 2, 0, g), near)  # values on the grid (same scales) do not move


def test_stochastic_rounding_checks_its_arguments():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="rounding must be one of"):
        nvfp4.quantize(x, rounding="up")
    with pytest.raises(ValueError, match="seed < 2\\^63"):
        nvfp4.quantize(x, **SR, seed=-1)
    with pytest.raises(ValueError, match="offset"):
        nvfp4.quantize_ref(x, **SR, offset=2**63 - 8)

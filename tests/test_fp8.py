"""moekit.fp8, the blockwise FP8 format: the kernels against their references bit for bit (CPU under the
interpreter, and the GPU twins with the hardware conversion), the references against float64, and the
stated handling of zeros, saturation, NaN and inf."""

import pytest
import torch

from moekit import fp8
from moekit.fp8.formats import _quantize_op, _quantize_ragged_t_op, _quantize_weights_op

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (numpy, on NaN)
BF16 = torch.bfloat16
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)]


def _device(device):
    """The device of a CPU / GPU twin: the CPU one runs the kernels under the interpreter."""
    if device == "cpu":
        from moekit import config

        assert config.is_interpreting()
    return device


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_bits_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        torch.testing.assert_close(_bits(g), _bits(w), rtol=0, atol=0, equal_nan=True)


def _within_rounding(deq: torch.Tensor, x: torch.Tensor, scale_of: torch.Tensor):
    """Dequantized values within e4m3's rounding of x: half a step, 2^-4 of |x| for normal codes and
    2^-10 of the scale for subnormal ones."""
    err = (deq.double() - x.double()).abs()
    bound = 2.0**-4 * x.double().abs() + 2.0**-10 * scale_of.double()
    assert bool((err <= bound).all()), float((err - bound).max())


ROWS = [  # (M, K): why
    ((0, 128), "no rows"),
    ((1, 1), "one element: a group of one"),
    ((3, 128), "one full group per row"),
    ((7, 300), "a last group of 44 columns"),
    ((129, 257), "odd rows, a last group of one column"),
    ((16, 1024), "eight groups per row"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [c[0] for c in ROWS], ids=[c[1] for c in ROWS])
def test_quantize_rows(device, pow2, dtype, shape):
    dev = _device(device)
    x = (torch.randn(shape, device=dev) * torch.logspace(-3, 3, shape[0] or 1, device=dev)[: shape[0], None])
    x = x.to(dtype)
    got = fp8.quantize(x, pow2_scales=pow2)
    want = fp8.quantize_ref(x, pow2_scales=pow2)
    assert_bits_equal(got, want)
    values, scales = got
    assert values.shape == shape and scales.shape == (shape[0], -(-shape[1] // 128))
    _within_rounding(fp8.dequantize(values, scales), x, scales.repeat_interleave(128, 1)[:, : shape[1]])
    if pow2:  # powers of two: no mantissa bits
        assert bool(((scales.view(torch.int32) & 0x7FFFFF) == 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_rounding_is_torchs(device):
    """Every e4m3 value, every midpoint between two (ties to even) and values just off them, in groups
    whose amax is 448 (scale 1): the codes are torch's own conversion."""
    dev = _device(device)
    codes = torch.arange(0, 127, dtype=torch.uint8)  # +0 .. 448 (0x7F is NaN)
    vals = codes.view(torch.float8_e4m3fn).float()
    mids = (vals[1:] + vals[:-1]) / 2
    off = torch.cat([mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    body = torch.cat([vals, mids, off, -vals, -mids, -off])
    n = body.numel()
    x = torch.cat([torch.full((n, 1), 448.0), body[:, None], torch.zeros(n, 126)], 1).to(dev)
    values, scales = fp8.quantize(x)
    assert bool((scales == 1).all())
    torch.testing.assert_close(values[:, 1].view(torch.uint8),
                               body.to(dev).to(torch.float8_e4m3fn).view(torch.uint8), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_saturated_and_nonfinite_groups(device):
    """An all-zero group: the floored scale and zero codes (dequantized: zeros). A group reaching 448
    after the inverse's rounding saturates, never NaN. A NaN or an inf: that group alone gets a NaN
    scale and zero codes, and dequantizes to NaN."""
    dev = _device(device)
    x = torch.randn(4, 512, device=dev)
    x[0, :128] = 0.0
    x[1, 130] = float("nan")
    x[2, 300] = float("-inf")
    x[3, 384:] = torch.linspace(-7.0, 7.0, 128, device=dev)  # amax 7: 448 / 7 is exact, near-448 codes
    for pow2 in (False, True):
        values, scales = fp8.quantize(x, pow2_scales=pow2)
        assert_bits_equal((values, scales), fp8.quantize_ref(x, pow2_scales=pow2))
        codes = values.view(torch.uint8)
        assert bool((codes[0, :128] == 0).all()) and scales[0, 0] == fp8.quantize_ref(
            torch.full((1, 1), 1e-12), pow2_scales=pow2)[1][0, 0]
        assert scales[1, 1].isnan() and bool((codes[1, 128:256] == 0).all())
        assert scales[2, 2].isnan() and bool((codes[2, 256:384] == 0).all())
        finite = scales.isfinite()
        assert int(finite.sum()) == 4 * 4 - 2
        assert bool(((codes & 0x7F) != 0x7F).all())  # no NaN code anywhere
        deq = fp8.dequantize(values, scales)
        assert bool(deq[1, 128:256].isnan().all()) and bool(deq[2, 256:384].isnan().all())
        assert bool(deq[0, :128].eq(0).all()) and bool(deq[:, :128][1:].isfinite().all())


WEIGHTS = [  # (E, A, B): why
    ((1, 128, 128), "one block"),
    ((3, 200, 130), "tails along both dims"),
    ((2, 1, 300), "one row"),
    ((2, 256, 384), "whole blocks both ways, no padding (the transposed view stays strided)"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("shape", [c[0] for c in WEIGHTS], ids=[c[1] for c in WEIGHTS])
def test_quantize_weights(device, pow2, shape):
    dev = _device(device)
    w = (torch.randn(shape, device=dev) * 0.02).to(BF16)
    got = fp8.quantize_weights(w, pow2_scales=pow2)
    assert_bits_equal(got, fp8.quantize_weights_ref(w, pow2_scales=pow2))
    values, scales = got
    full = scales.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, : shape[1], : shape[2]]
    _within_rounding(fp8.dequantize_weights(values, scales), w, full)
    # blocks are symmetric: the transposed weights quantize to the transposed values and scales
    values_t, scales_t = fp8.quantize_weights(w.mT, pow2_scales=pow2)
    assert_bits_equal((values_t, scales_t), fp8.quantize_weights_ref(w.mT, pow2_scales=pow2))  # (a strided view)
    assert values_t.is_contiguous()
    assert torch.equal(values_t.view(torch.uint8), values.view(torch.uint8).mT)
    assert torch.equal(scales_t, scales.mT)


RAGGED = [  # (M, K, counts): why
    ((300, 70, [0, 1, 129, 0, 160]), "empty experts, a group of one row, a tail of one, rows past offs[-1]"),
    ((256, 128, [256]), "one hot expert, two full groups"),
    ((128, 33, [128, 0]), "exactly one group, then an empty expert"),
    ((0, 64, [0, 0]), "no rows"),
    ((5, 300, [2, 3]), "tiny groups, columns over several programs"),
    ((1000, 40, [1, 130, 257, 1, 384, 100]), "mixed group tails"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("case", [c[0] for c in RAGGED], ids=[c[1] for c in RAGGED])
def test_quantize_ragged_t(device, pow2, case):
    dev = _device(device)
    m, k, counts = case
    x = torch.randn(m, k, device=dev).to(BF16)
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    got = fp8.quantize_ragged_t(x, offs, pow2_scales=pow2)
    assert_bits_equal(got, fp8.quantize_ragged_t_ref(x, offs, pow2_scales=pow2))
    values_t, scales, group_offs = got
    groups = [-(-c // 128) for c in counts]
    assert group_offs.tolist() == torch.tensor(groups).cumsum(0).tolist()
    assert values_t.shape == (k, m) and scales.shape == (-(-m // 128) + len(counts), k)
    used, end = sum(groups), sum(counts)
    assert bool((scales[used:] == 0).all()) and bool((values_t.view(torch.uint8)[:, end:] == 0).all())
    deq = fp8.dequantize_ragged_t(values_t, scales, offs)
    _, group = fp8.ragged_groups_ref(offs, m)
    scale_of = torch.cat([scales, scales.new_zeros(1, k)])[torch.where(group >= 0, group, scales.shape[0])]
    _within_rounding(deq[:end], x[:end], scale_of[:end])
    assert bool((deq[end:] == 0).all())
    # a group's scale is its own rows' amax / 448: a one-row group is that row's |x| / 448
    r = 0
    for e, c in enumerate(counts):
        for g0 in range(0, c, 128):
            rows = x[r + g0: r + min(c, g0 + 128)].float()
            gi = (group_offs[e - 1].item() if e else 0) + g0 // 128
            amax = rows.abs().amax(0).clamp_min(fp8.AMAX_FLOOR)
            want = amax / torch.full_like(amax, 448.0)
            if not pow2:
                torch.testing.assert_close(scales[gi], want, rtol=0, atol=0)
        r += c


@pytest.mark.parametrize("device", DEVICES)
def test_ragged_t_nonfinite_stays_in_its_group(device):
    dev = _device(device)
    x = torch.randn(300, 40, device=dev).to(BF16)
    offs = torch.tensor([100, 300], device=dev, dtype=torch.int32)
    x[5, 3] = float("nan")
    x[250, 7] = float("inf")
    x[299, 9] = float("nan")  # (the last row: its expert's second group holds rows 228-299)
    values_t, scales, group_offs = fp8.quantize_ragged_t(x, offs)
    assert_bits_equal((values_t, scales, group_offs), fp8.quantize_ragged_t_ref(x, offs))
    assert group_offs.tolist() == [1, 3]
    assert [tuple(i) for i in scales.isnan().nonzero().tolist()] == [(0, 3), (2, 7), (2, 9)]
    deq = fp8.dequantize_ragged_t(values_t, scales, offs)
    assert bool(deq[:100, 3].isnan().all()) and bool(deq[228:, 7].isnan().all())
    assert int(deq.isnan().sum()) == 100 + 72 + 72


@pytest.mark.parametrize("fn, args, err", [
    (fp8.quantize, (torch.zeros(4),), ValueError),
    (fp8.quantize, (torch.zeros(2, 4, dtype=torch.int32),), TypeError),
    (fp8.quantize_weights, (torch.zeros(2, 4),), ValueError),
    (fp8.quantize_ragged_t, (torch.zeros(4, 4), torch.tensor([4])), ValueError),  # int64 offs
    (fp8.quantize_ragged_t, (torch.zeros(4, 4), torch.zeros(0, dtype=torch.int32)), ValueError),
    (fp8.dequantize, (torch.zeros(2, 4), torch.zeros(2, 1)), TypeError),
], ids=["1-D x", "int x", "2-D weights", "int64 offs", "no experts", "dequantize bf16 values"])
def test_bad_input_raises_the_same_from_kernels_and_reference(interpreter, fn, args, err):
    ref = getattr(fp8, f"{fn.__name__}_ref")
    for f in (fn, ref):
        with pytest.raises(err):
            f(*args)


def test_custom_ops_pass_opcheck(interpreter):
    x = torch.randn(9, 200).to(BF16)
    offs = torch.tensor([3, 9], dtype=torch.int32)
    torch.library.opcheck(_quantize_op, (x, False))
    torch.library.opcheck(_quantize_weights_op, (x.view(3, 3, 200), True))
    torch.library.opcheck(_quantize_ragged_t_op, (x, offs, False))

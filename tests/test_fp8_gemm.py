"""moekit.fp8.grouped_mm_fp8: the rows-ragged grouped GEMM on blockwise FP8 operands, against a float64
product of the same dequantized operands, on the CPU under the interpreter (within 2x of the
fp32-accumulated reference's error) and on the GPU (within Hopper's FP8 accumulator: its tensor cores
keep ~14 bits of each 128-wide group's partial sum, measured 2^-12 of the largest output on the H200)."""

import pytest
import torch
from test_fp8 import BF16, DEVICES, _device

from moekit import fp8
from moekit.fp8.gemm import _grouped_mm_fp8_op, grouped_mm_fp8_fwd

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (numpy, on NaN)


def _operands(m, k, n, counts, device):
    x = torch.randn(m, k, device=device).to(BF16)
    w = (torch.randn(len(counts), n, k, device=device) * 0.05).to(BF16)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    return (*fp8.quantize(x), *fp8.quantize_weights(w), offs)


def _oracle(a, a_scales, b, b_scales, offs):
    """float64 product of the dequantized operands (exact products, float64 sums); rows past offs[-1]: 0."""
    (m, k), n = a.shape, b.shape[1]
    ad = a.double() * a_scales.double().repeat_interleave(128, 1)[:, :k]
    bd = b.double() * b_scales.double().repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
    out = torch.zeros(m, n, dtype=torch.float64, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = ad[start:end] @ bd[g].T
        start = end
    return out


CASES = [  # (M, K, N, counts): why (K % 16 == 0 takes TMA operands, the others masked pointers)
    ((200, 300, 260, [0, 70, 0, 120]), "empty experts, K and N tails, rows past offs[-1]"),
    ((256, 128, 128, [256]), "one hot expert, one K group"),
    ((65, 1000, 300, [1, 64]), "a one-row expert, a full tile, eight K groups"),
    ((300, 256, 260, [0, 100, 0, 150]), "TMA operands: empty experts, an N tail, rows past offs[-1]"),
    ((0, 64, 32, [0, 0]), "no rows"),
    ((9, 40, 7, [3, 3, 3]), "K below one group, N below one tile"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c[0] for c in CASES], ids=[c[1] for c in CASES])
def test_grouped_mm_fp8_against_float64(device, case):
    dev = _device(device)
    m, k, n, counts = case
    ops = _operands(m, k, n, counts, dev)
    want = _oracle(*ops)
    got = fp8.grouped_mm_fp8(*ops, out_dtype=torch.float32)
    ref = fp8.grouped_mm_fp8_ref(*ops, out_dtype=torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    ref_err = float((ref.double() - want).abs().max()) if m else 0.0
    err = float((got.double() - want).abs().max()) if m else 0.0
    top = float(want.abs().max()) if m else 0.0
    bound = 2 * ref_err + 2.0**-22 * top if device == "cpu" else 2.0**-10 * top
    assert err <= bound, (err, ref_err, top)
    assert bool((got[sum(counts):] == 0).all())  # rows past offs[-1]
    if m and k % 16 == 0:  # the masked-pointer operands on the same problem
        got_ptr = grouped_mm_fp8_fwd(*ops, torch.float32, tma=False)
        assert float((got_ptr.double() - want).abs().max()) <= bound
    # bf16 output: the fp32 result rounded once
    got16 = fp8.grouped_mm_fp8(*ops)
    assert got16.dtype == BF16
    torch.testing.assert_close(got16.float(), got.to(BF16).float(), rtol=2.0**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_group_reaches_only_its_rows(device):
    """A NaN in one 128-wide group of x makes that row's scale NaN there: the whole output row is NaN
    (every column reads that group), and no other row is."""
    dev = _device(device)
    x = torch.randn(70, 300, device=dev).to(BF16)
    x[5, 200] = float("nan")
    x[40, 3] = float("inf")
    w = (torch.randn(2, 130, 300, device=dev) * 0.05).to(BF16)
    offs = torch.tensor([30, 70], device=dev, dtype=torch.int32)
    out = fp8.grouped_mm_fp8(*fp8.quantize(x), *fp8.quantize_weights(w), offs)
    bad_rows = out.isnan().any(1).nonzero().flatten().tolist()
    assert bad_rows == [5, 40] and bool(out[[5, 40]].isnan().all())


@pytest.mark.parametrize("bad, err", [
    (dict(a=torch.zeros(4, 8, dtype=BF16)), TypeError),
    (dict(offs=torch.tensor([2, 4])), ValueError),
    (dict(offs=torch.tensor([4], dtype=torch.int32)), ValueError),
    (dict(a_scales=torch.zeros(4, 2)), ValueError),
    (dict(b_scales=torch.zeros(2, 1, 1, dtype=torch.float64)), TypeError),
    (dict(out_dtype=torch.int32), TypeError),
], ids=["bf16 a", "int64 offs", "one offs for two experts", "a scales shape", "fp64 b scales", "int out"])
def test_bad_input_raises_the_same_from_kernel_and_reference(interpreter, bad, err):
    a, a_scales, b, b_scales, offs = _operands(4, 8, 16, [2, 2], "cpu")
    args = dict(a=a, a_scales=a_scales, b=b, b_scales=b_scales, offs=offs, out_dtype=BF16) | bad
    for fn in (fp8.grouped_mm_fp8, fp8.grouped_mm_fp8_ref):
        with pytest.raises(err):
            fn(args["a"], args["a_scales"], args["b"], args["b_scales"], args["offs"], out_dtype=args["out_dtype"])


def test_custom_op_passes_opcheck(interpreter):
    a, a_scales, b, b_scales, offs = _operands(33, 200, 130, [10, 20], "cpu")
    args = (a.view(torch.uint8), a_scales, b.view(torch.uint8), b_scales, offs, BF16)
    torch.library.opcheck(_grouped_mm_fp8_op, args)

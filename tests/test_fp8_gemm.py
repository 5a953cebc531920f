"""moekit.fp8.grouped_mm_fp8: the rows-ragged grouped GEMM on blockwise FP8 operands, against a float64
product of the same dequantized operands, on the CPU under the interpreter (within 2x of the
fp32-accumulated reference's error) and on the GPU (within Hopper's FP8 accumulator: its tensor cores
keep ~14 bits of each 128-wide group's partial sum, measured 2^-12 of the largest output on the H200)."""

import pytest
import torch
from test_fp8 import BF16, DEVICES, _device

from moekit import fp8
from moekit.fp8.gemm import _grouped_mm_fp8_op, _weight_grad_fp8_op, grouped_mm_fp8_fwd

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


def _assert_within(got, want, ref, device, what="") -> None:
    """got against the float64 ``want``: within 2x the fp32-accumulated reference ``ref``'s error (plus
    2^-22 of the largest output) on the CPU; within 2^-10 of the largest output on the GPU (Hopper's FP8
    accumulator)."""
    if not want.numel():
        return
    top = float(want.abs().max())
    ref_err = float((ref.double() - want).abs().max())
    bound = 2 * ref_err + 2.0**-22 * top if device == "cpu" else 2.0**-10 * top
    err = float((got.double() - want).abs().max())
    assert err <= bound, (what, err, ref_err, top)


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
    _assert_within(got, want, ref, device)
    assert bool((got[sum(counts):] == 0).all())  # rows past offs[-1]
    if m and k % 16 == 0:  # the masked-pointer operands on the same problem
        _assert_within(grouped_mm_fp8_fwd(*ops, torch.float32, tma=False), want, ref, device, "pointers")
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


# --------------------------------------------------------------------------------------------------
# the weight gradient
# --------------------------------------------------------------------------------------------------


def _wgrad_operands(m, n, k, counts, device, scale=1.0):
    dy = (torch.randn(m, n, device=device) * scale).to(BF16)
    x = torch.randn(m, k, device=device).to(BF16)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    dy_t, dy_s, _ = fp8.quantize_ragged_t(dy, offs)
    x_t, x_s, _ = fp8.quantize_ragged_t(x, offs)
    return dy_t, dy_s, x_t, x_s, offs


def _wgrad_oracle(dy_t, dy_s, x_t, x_s, offs):
    """float64 dY_e^T X_e of the dequantized operands, per expert."""
    dy = fp8.dequantize_ragged_t_ref(dy_t, dy_s, offs).double()
    x = fp8.dequantize_ragged_t_ref(x_t, x_s, offs).double()
    out = torch.zeros(offs.numel(), dy.shape[1], x.shape[1], dtype=torch.float64, device=dy.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = dy[start:end].T @ x[start:end]
        start = end
    return out


WGRAD_CASES = [  # (M, N, K, counts): why
    ((300, 70, 90, [0, 129, 0, 150]), "empty experts, a 1-row tail group, N and K tails, rows past offs[-1]"),
    ((256, 64, 128, [256]), "one hot expert, two full groups"),
    ((5, 33, 17, [1, 1, 3]), "experts of one row"),
    ((0, 16, 16, [0, 0]), "no rows"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c[0] for c in WGRAD_CASES], ids=[c[1] for c in WGRAD_CASES])
def test_weight_grad_fp8_against_float64(device, case):
    dev = _device(device)
    m, n, k, counts = case
    ops = _wgrad_operands(m, n, k, counts, dev)
    want = _wgrad_oracle(*ops)
    got = fp8.weight_grad_fp8(*ops, out_dtype=torch.float32)
    ref = fp8.weight_grad_fp8_ref(*ops, out_dtype=torch.float32)
    assert got.shape == (len(counts), n, k) and got.dtype == torch.float32
    _assert_within(got, want, ref, device)
    for g, c in enumerate(counts):  # an expert without rows: zeros
        if c == 0:
            assert bool((got[g] == 0).all())
    got16 = fp8.weight_grad_fp8(*ops)
    assert got16.dtype == BF16
    torch.testing.assert_close(got16.float(), got.to(BF16).float(), rtol=2.0**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_weight_grad_fp8_nonfinite_group_reaches_only_its_expert(device):
    """A NaN in dY's column 3 within expert 1's rows: dW[1] row 3 is NaN, nothing else."""
    dev = _device(device)
    dy_t, dy_s, x_t, x_s, offs = _wgrad_operands(200, 20, 24, [60, 140], dev)
    dy = fp8.dequantize_ragged_t(dy_t, dy_s, offs).to(BF16)
    dy[100, 3] = float("nan")
    dy_t, dy_s, _ = fp8.quantize_ragged_t(dy, offs)
    out = fp8.weight_grad_fp8(dy_t, dy_s, x_t, x_s, offs)
    bad = out.isnan()
    assert bool(bad[1, 3].all()) and int(bad.sum()) == 24


@pytest.mark.parametrize("bad, err", [
    (dict(dy_t=torch.zeros(8, 4, dtype=BF16)), TypeError),
    (dict(x_t=torch.zeros(6, 5, dtype=torch.float8_e4m3fn)), ValueError),
    (dict(offs=torch.tensor([2, 4])), ValueError),
    (dict(dy_scales=torch.zeros(2, 8)), ValueError),
    (dict(x_scales=torch.zeros(3, 6, dtype=torch.float64)), TypeError),
    (dict(out_dtype=torch.int32), TypeError),
], ids=["bf16 dy", "x rows differ", "int64 offs", "dy scales shape", "fp64 x scales", "int out"])
def test_weight_grad_bad_input_raises_the_same_from_kernel_and_reference(interpreter, bad, err):
    dy_t, dy_s, x_t, x_s, offs = _wgrad_operands(4, 8, 6, [2, 2], "cpu")
    args = dict(dy_t=dy_t, dy_scales=dy_s, x_t=x_t, x_scales=x_s, offs=offs, out_dtype=BF16) | bad
    for fn in (fp8.weight_grad_fp8, fp8.weight_grad_fp8_ref):
        with pytest.raises(err):
            fn(*(args[a] for a in ("dy_t", "dy_scales", "x_t", "x_scales", "offs")), out_dtype=args["out_dtype"])


def test_weight_grad_custom_op_passes_opcheck(interpreter):
    dy_t, dy_s, x_t, x_s, offs = _wgrad_operands(150, 40, 24, [10, 0, 140], "cpu")
    args = (dy_t.view(torch.uint8), dy_s, x_t.view(torch.uint8), x_s, offs, BF16)
    torch.library.opcheck(_weight_grad_fp8_op, args)

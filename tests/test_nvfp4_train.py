"""NVFP4 training: stochastic rounding (Philox against Random123's vectors, the kernel bit for bit
against the reference under the interpreter, unbiasedness, range, reproducibility), the random
Hadamard transform, and the NVFP4 expert GEMMs' forward and backward against independent emulations."""

import pytest
import torch
import torch.nn.functional as F

import moekit
from moekit import nvfp4
from moekit.nvfp4 import TrainingRecipe, hadamard16
from moekit.nvfp4 import train as nvfp4_train

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
    # offset + i // 4 is element i's counter: the stream of offset 16 is the one of offset 0 moved by a row
    bits = nvfp4.random_bits_ref(3, 0, (2, 64))
    assert torch.equal(nvfp4.random_bits_ref(3, 16, (1, 64)), bits[1:])
    words = nvfp4.philox_ref((3, 0), tuple(torch.tensor([c]) for c in (5, 0, 0, 0)))  # counter 5: elements 20-23
    assert bits[0, 20:24].tolist() == [int(w) for w in words]


def test_stochastic_rounding_keeps_the_block_range_and_special_values():
    """Never past 6 x scale (values that the e4m3 scale's rounding pushes past 6 saturate), underflowing
    blocks -> 0, a block with a NaN or an inf -> NaN, exact grid values stay, as with round to nearest."""
    x = torch.randn(64, 64) * torch.logspace(-3, 3, 64)
    x[0, :16] = 1e-30  # underflows e4m3 once divided by the global scale
    x[1, 0], x[1, 1], x[1, 2] = float("inf"), float("-inf"), float("nan")
    x[2, :16] = torch.linspace(-1, 1, 16) * 5.8
    x[2, 5] = 6.2  # with g = 1/6 the scale is 6.2 rounded down to e4m3's 6.0: 6.2 / (6 * g) saturates to 6
    values, scales, g = nvfp4.quantize_ref(x, torch.tensor(1 / 6), **SR, seed=11)
    assert scales[2, 0].float() == 6.0
    y = nvfp4.dequantize_ref(values, scales, g)
    bound = (6 * scales.float()[..., None] * g).expand(64, 4, 16).flatten(1)  # dequantize's order of products
    assert y[1, :16].isnan().all() and not y[1, 16:].isnan().any()
    assert (y.abs() <= bound)[y == y].all()
    for seed in range(8):
        assert nvfp4.dequantize_ref(*nvfp4.quantize_ref(x[2:3], g, **SR, seed=seed))[0, 5] == bound[2, 5]
    near = nvfp4.dequantize_ref(*nvfp4.quantize_ref(x, g))
    special = torch.zeros_like(x, dtype=torch.bool)
    special[0, :16] = special[1, :3] = True
    assert torch.equal(y[special].isnan(), near[special].isnan()) and (y[0, :16] == 0).all()
    # values on the grid (same scales) do not move
    torch.testing.assert_close(_sr_values(near, 2, 0, g), near, rtol=0, atol=0, equal_nan=True)


def test_stochastic_rounding_checks_its_arguments():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="rounding must be one of"):
        nvfp4.quantize(x, rounding="up")
    with pytest.raises(ValueError, match="seed < 2\\^63"):
        nvfp4.quantize(x, **SR, seed=-1)
    with pytest.raises(ValueError, match="offset"):
        nvfp4.quantize_ref(x, **SR, offset=2**63 - 2)


# --------------------------------------------------------------------------------------------------
# the random Hadamard transform
# --------------------------------------------------------------------------------------------------


def test_hadamard16_is_orthonormal_and_inverts():
    signs = nvfp4_train.random_signs(3)
    assert set(signs.tolist()) == {-1.0, 1.0}
    q = hadamard16(torch.eye(16, dtype=torch.float64), signs)  # the rows of Q
    assert torch.allclose(q @ q.T, torch.eye(16, dtype=torch.float64), atol=1e-15)
    assert torch.equal(q.abs(), torch.full_like(q, 0.25))
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    y = hadamard16(x, signs)
    assert torch.allclose(hadamard16(y, signs, inverse=True), x, atol=1e-14)
    assert not torch.allclose(y, hadamard16(x, -signs))  # the signs take part
    x2 = x.clone()
    x2[..., 16:] = torch.randn_like(x2[..., 16:])
    assert torch.equal(hadamard16(x2, signs)[..., :16], y[..., :16])  # blocks of 16 are independent


def test_hadamard16_keeps_the_products_of_a_reduction():
    """(x Q) . (y Q) = x . y over the last dim, in fp64 exactly up to rounding; in fp32 to fp32 noise."""
    signs = nvfp4_train.random_signs(7)
    x, y = torch.randn(6, 96, dtype=torch.float64), torch.randn(9, 96, dtype=torch.float64)
    assert torch.allclose(hadamard16(x, signs) @ hadamard16(y, signs).T, x @ y.T, rtol=0, atol=1e-12)
    xf = x.float()
    assert torch.allclose((hadamard16(xf, signs) @ hadamard16(y.float(), signs).T).double(), x @ y.T, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of 16"):
        hadamard16(torch.randn(2, 24), signs)


# --------------------------------------------------------------------------------------------------
# the NVFP4 expert GEMMs
# --------------------------------------------------------------------------------------------------

# counts per expert: why
COUNT_CASES = [
    ([5, 0, 16, 9], "an empty expert, a full block, ragged ends"),
    ([0, 0, 33, 0], "all rows on one expert"),
    ([1, 2, 3, 4], "rows past offs[-1] (M = 14)"),
]


@pytest.fixture
def reference():
    """The pure-PyTorch path (the interpreter's kernels have their own test)."""
    with moekit.options(reference=True):
        yield


def _offs(counts):
    return torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("counts, why", COUNT_CASES, ids=[c[-1].split(",")[0] for c in COUNT_CASES])
def test_padded_rows_start_each_expert_on_a_block(counts, why):
    rows = max(sum(counts), 14)
    dest, padded_offs, bound = nvfp4_train.padded_rows(_offs(counts), rows)
    start = pstart = 0
    for c, pend in zip(counts, padded_offs.tolist(), strict=True):
        assert pstart % 16 == 0 and pend - pstart == -(-c // 16) * 16
        assert dest[start : start + c].tolist() == list(range(pstart, pstart + c))
        start, pstart = start + c, pend
    assert (dest[start:] == bound).all() and bound % 16 == 0 and bound >= pstart


def _nvfp4(t, **kw):
    return nvfp4.dequantize_ref(*nvfp4.quantize_ref(t, **kw)).double()


def _emulated(x, w, dy, offs, signs):
    """An independent fp64 emulation, expert by expert (round to nearest everywhere): y, dx, dW."""
    e = w.shape[0]
    wq = nvfp4.dequantize_ref(*nvfp4.quantize_weights_ref(w, block_2d=True)).double()  # (E, N, K)
    ends = offs.tolist()
    tail = torch.arange(x.shape[0]) >= ends[-1]  # rows of no expert: out of every global scale
    xq, dyq = _nvfp4(x.masked_fill(tail[:, None], 0)), _nvfp4(dy.masked_fill(tail[:, None], 0))
    y, dx = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64), torch.zeros_like(x, dtype=torch.float64)
    rot_x, rot_dy = [], []
    for g, (s, t) in enumerate(zip([0] + ends[:-1], ends, strict=True)):
        y[s:t], dx[s:t] = xq[s:t] @ wq[g].T, dyq[s:t] @ wq[g]
        pad = -(t - s) % 16
        rot_x.append(hadamard16(F.pad(x[s:t].double().T, (0, pad)), signs).float())  # (K, rows of g)
        rot_dy.append(hadamard16(F.pad(dy[s:t].double().T, (0, pad)), signs).float())
    gx = nvfp4.global_scale_ref(torch.cat(rot_x, 1))
    gdy = nvfp4.global_scale_ref(torch.cat(rot_dy, 1))
    dw = torch.stack([_nvfp4(rot_x[g], global_scale=gx) @ _nvfp4(rot_dy[g], global_scale=gdy).T for g in range(e)])
    return y, dx, dw


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("counts, why", COUNT_CASES, ids=[c[-1].split(",")[0] for c in COUNT_CASES])
def test_nvfp4_linear_matches_an_expert_by_expert_emulation(reference, counts, why):
    """Forward, dgrad and wgrad (padding, rotation, quantization along the rows) against the fp64
    emulation above, with stochastic rounding off: equal up to bf16 rounding of y and dx and fp32
    accumulation of dW."""
    offs = _offs(counts)
    m, k, n = max(sum(counts), 14), 32, 48
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(len(counts), k, n) * 0.1).requires_grad_()
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    rows = sum(counts)
    with torch.no_grad():  # large rows past offs[-1] must not move the real rows' global scales
        x[rows:], dy[rows:] = 1e4, -1e4
    state = nvfp4_train.NVFP4Training(TrainingRecipe(stochastic_rounding=False, seed=1))
    y = state.linear(x, w, offs)
    y.backward(dy)
    want_y, want_dx, want_dw = _emulated(x.detach(), w.detach(), dy, offs, state.signs)
    assert (y[rows:] == 0).all() and (x.grad[rows:] == 0).all()
    assert (y[:rows].double() - want_y[:rows]).abs().max() <= 2**-8 * want_y.abs().max()
    assert (x.grad[:rows].double() - want_dx[:rows]).abs().max() <= 2**-8 * want_dx.abs().max()
    assert w.grad.dtype == torch.float32 and _rel(w.grad, want_dw) < 1e-6
    assert _rel(w.grad, torch.einsum("mk,mn->kn", x, dy).expand_as(want_dw)) > 1e-3  # not trivially equal


def test_stochastic_gradients_are_unbiased_and_reproducible(reference):
    """dx over 128 draws of the stream averages to dy @ W_q (the SR-free dgrad), 6x closer than one
    draw; the same seed gives the same gradients, another seed others."""
    offs = _offs([10, 6, 16])
    x = torch.randn(32, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 32, 16) * 0.1
    dy = torch.randn(32, 16, dtype=torch.bfloat16)
    state = nvfp4_train.NVFP4Training(TrainingRecipe(seed=5))
    y = state.linear(x, w, offs)
    draws = torch.stack([torch.autograd.grad(y, x, dy, retain_graph=True)[0].double() for _ in range(128)])
    wq = nvfp4.dequantize_ref(*nvfp4.quantize_weights_ref(w, block_2d=True)).double()
    want = torch.cat([dy[s:t].double() @ wq[g] for g, (s, t) in enumerate([(0, 10), (10, 16), (16, 32)])])
    assert _rel(draws[0], want) > 6 * _rel(draws.mean(0), want)
    again = nvfp4_train.NVFP4Training(TrainingRecipe(seed=5))
    assert torch.equal(torch.autograd.grad(again.linear(x, w, offs), x, dy)[0], draws[0].to(torch.bfloat16))
    other = nvfp4_train.NVFP4Training(TrainingRecipe(seed=6))
    assert not torch.equal(torch.autograd.grad(other.linear(x, w, offs), x, dy)[0], draws[0].to(torch.bfloat16))


def _moe_pair(**recipe):
    kw = dict(bias=True, dtype=torch.bfloat16)
    torch.manual_seed(1)
    plain = moekit.MoE(64, 32, 4, 2, **kw)
    quant = moekit.MoE(64, 32, 4, 2, nvfp4=TrainingRecipe(seed=3, **recipe), **kw)
    quant.load_state_dict(plain.state_dict())
    return plain, quant


def _grads(moe, x, dy):
    params = [p for p in moe.parameters() if p.requires_grad]
    return torch.autograd.grad(moe(x), [x, *params], dy)


@pytest.mark.parametrize("recipe", [{}, dict(weight_block_2d=False, random_hadamard=False, stochastic_rounding=False)],
                         ids=["nvidia", "1x16-nearest"])
def test_moe_nvfp4_tracks_the_bf16_block(reference, recipe):
    """``MoE(..., nvfp4=...)``: the same parameters and state dict; output and every gradient near the
    bf16 block's (NVFP4 noise: a few to tens of percent), and the expert weights' gradients not equal to it."""
    plain, quant = _moe_pair(**recipe)
    assert plain.state_dict().keys() == quant.state_dict().keys()
    x = torch.randn(3, 10, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(3, 10, 64, dtype=torch.bfloat16)
    assert 0.01 < _rel(quant(x), plain(x)) < 0.2
    names = ["x"] + [n for n, p in plain.named_parameters() if p.requires_grad]
    for name, got, want in zip(names, _grads(quant, x, dy), _grads(plain, x, dy), strict=True):
        assert torch.isfinite(got).all() and _rel(got, want) < 0.5, name
        assert _rel(got, want) > 0.01 or not name.endswith(("EGD", "EDF")), name  # biases, router, x: barely moved


def test_moe_nvfp4_kernels_match_the_reference(interpreter):
    """The same block through the Triton kernels (interpreter) and through the reference: quantization
    is bit-exact on both, the GEMMs' accumulation order differs, so the results agree to bf16 noise."""
    _, quant = _moe_pair()
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    quant.experts.nvfp4.stream.offset = 0
    got = _grads(quant, x, dy)
    quant.experts.nvfp4.stream.offset = 0
    with moekit.options(reference=True):
        want = _grads(quant, x, dy)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) < 0.03


@gpu
def test_moe_nvfp4_on_cuda_has_no_host_sync_and_matches_the_reference():
    """On a GPU the kernels path: forward and backward without a host sync (sync debug mode "error"),
    and gradients near the reference path's (the same streams; bf16 accumulation-order noise)."""
    torch.manual_seed(1)
    moe = moekit.MoE(256, 128, 8, 2, nvfp4=TrainingRecipe(seed=3), dtype=torch.bfloat16, device="cuda")
    x = torch.randn(512, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(512, 256, dtype=torch.bfloat16, device="cuda")
    _grads(moe, x, dy)  # compile the kernels first
    moe.experts.nvfp4.stream.offset = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _grads(moe, x, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    moe.experts.nvfp4.stream.offset = 0
    with moekit.options(reference=True):
        want = _grads(moe, x, dy)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) < 0.03


@gpu
def test_random_signs_under_a_cuda_default_device():
    """The signs come from a CPU generator: a CUDA default device (``torch.set_default_device``, as
    the NCCL expert-parallel workers set) must not move the draw to CUDA, where a CPU generator fails."""
    want = nvfp4_train.random_signs(3)
    with torch.device("cuda"):
        got = nvfp4_train.random_signs(3, device="cuda")
    assert torch.equal(got.cpu(), want)

"""NaN and inf propagate through every op family, as through the float64 reference: a non-finite input
is never turned into a finite output (README, "Non-finite values").

- SwiGLU (standalone and fused into the up-projection, forward and backward): NaN in, NaN out, as
  ``torch.clamp`` gives. On the GPU ``tl.minimum`` would return the limit for a NaN (``min.f32``), while
  the interpreter propagates it; the kernels clamp with selects, so both agree with the reference.
- NVFP4 quantization: a block holding a NaN or an inf gets the NaN scale (``tests/test_nvfp4.py`` checks
  the bits); here the NVFP4 GEMM and the NVFP4 training block carry the NaN to their outputs and to
  every gradient the bf16 block makes NaN, instead of quantizing it to 0.

Each test runs on the CPU (the references, and the kernels under the interpreter) and on the GPU.
"""

import pytest
import torch

import moekit
from moekit import grouped_mm_swiglu, grouped_mm_swiglu_ref, nvfp4, swiglu
from moekit.epilogue import SwiGLU, swiglu_bwd_torch, swiglu_torch
from moekit.nvfp4 import TrainingRecipe
from moekit.testing import offs_from_counts

BF16 = torch.bfloat16
DEV = "cuda"
gpu = pytest.mark.gpu
GPT_OSS = dict(swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_linear_offset=1.0, gate_up_layout="interleaved")
PLAIN = dict(swiglu_alpha=1.0, swiglu_limit=None, swiglu_linear_offset=0.0, gate_up_layout="halves")


def _spec(kw):
    return SwiGLU(kw["swiglu_alpha"], kw["swiglu_limit"], kw["swiglu_linear_offset"], kw["gate_up_layout"])


def _pre_with_specials(m, f, device):
    """(m, 2f) bf16 pre-activations with NaN and +-inf in gate and linear columns of both layouts."""
    pre = torch.randn(m, 2 * f, device=device) * 4
    pre[0, 0] = pre[1, 1] = float("nan")  # interleaved: a gate, a linear
    pre[2, f] = pre[3, f + 1] = float("nan")  # halves: a linear
    pre[4, 2] = float("inf")
    pre[5, 3] = -float("inf")
    pre[6, 4] = -float("inf")
    return pre.to(BF16)


def _check_swiglu(device, kw):
    spec = _spec(kw)
    pre = _pre_with_specials(12, 24, device).requires_grad_()
    h = swiglu(pre, **kw)
    want = swiglu_torch(pre.detach().double(), spec)
    assert want.isnan().any()
    assert torch.equal(h.isnan(), want.isnan())
    torch.testing.assert_close(h.double(), want, rtol=2e-2, atol=2e-2, equal_nan=True)
    dh = torch.randn(12, 24, device=device).to(BF16)
    h.backward(dh)
    dwant = swiglu_bwd_torch(pre.detach().double(), dh.double(), spec)
    assert torch.equal(pre.grad.isnan(), dwant.isnan())


def _check_fused_up_projection(device, kw):
    """The up-projection's SwiGLU epilogue: a NaN and an inf token give the reference's NaN pattern."""
    counts = [5, 0, 11]
    offs = offs_from_counts(counts, device=device)
    x = torch.randn(16, 32, device=device).to(BF16)
    x[3, 7] = float("nan")
    x[9, 2] = float("inf")
    w = (torch.randn(3, 32, 64, device=device) * 0.2).to(BF16)
    h, _ = grouped_mm_swiglu(x, w, offs, **kw)
    want, _ = grouped_mm_swiglu_ref(x.double(), w.double(), offs, **kw)
    assert want[3].isnan().all() and want[9].isnan().any() and torch.isfinite(want[[0, 1, 2, 10]]).all()
    assert torch.equal(h.isnan(), want.isnan()) and torch.equal(h.isinf(), want.isinf())


@pytest.mark.parametrize("kw", [GPT_OSS, PLAIN], ids=["gpt-oss", "plain"])
def test_swiglu_propagates_nan(interpreter, kw):
    _check_swiglu("cpu", kw)
    _check_fused_up_projection("cpu", kw)


@gpu
@pytest.mark.parametrize("kw", [GPT_OSS, PLAIN], ids=["gpt-oss", "plain"])
def test_swiglu_propagates_nan_gpu(kw):
    _check_swiglu(DEV, kw)
    _check_fused_up_projection(DEV, kw)


def _check_nvfp4_gemm(device):
    """A NaN in one row of A: that row's output is NaN, and no other."""
    counts = [6, 10]
    offs = offs_from_counts(counts, device=device)
    a = torch.randn(16, 64, device=device).to(BF16)
    a[7, 40] = float("nan")
    w = torch.randn(2, 64, 32, device=device).to(BF16)
    out = nvfp4.grouped_mm_nvfp4(*nvfp4.quantize(a), *nvfp4.quantize_weights(w), offs)
    rows = out.isnan().any(1)
    assert out[7].isnan().all() and rows.sum() == 1


def _block_pair(device):
    torch.manual_seed(1)
    plain = moekit.MoE(64, 32, 4, 2, bias=True, dtype=BF16, device=device)
    quant = moekit.MoE(64, 32, 4, 2, bias=True, nvfp4=TrainingRecipe(seed=3), dtype=BF16, device=device)
    quant.load_state_dict(plain.state_dict())
    return plain, quant


def _check_nvfp4_block(device):
    """One NaN in one token of ``MoE(..., nvfp4=TrainingRecipe())``: the token's output is NaN as in the
    bf16 block, the other tokens' are finite, and every gradient the bf16 block makes NaN is NaN here
    too (the Hadamard rotation spreads the NaN over its 16-row block, whose quantization must not turn
    it into finite but wrong weight gradients)."""
    plain, quant = _block_pair(device)
    x = torch.randn(32, 64, device=device).to(BF16)
    x[5, 9] = float("nan")
    dy = torch.randn(32, 64, device=device).to(BF16)
    results = []
    for moe in (plain, quant):
        xi = x.clone().requires_grad_()
        out = moe(xi)
        params = [p for p in moe.parameters() if p.requires_grad]
        results.append((out, torch.autograd.grad(out, [xi, *params], dy)))
    (out_p, grads_p), (out_q, grads_q) = results
    assert out_p[5].isnan().all() and torch.equal(out_q.isnan(), out_p.isnan())
    names = ["x"] + [n for n, p in plain.named_parameters() if p.requires_grad]
    pairs = zip(names, grads_p, grads_q, strict=True)
    swallowed = [n for n, gp, gq in pairs if gp.isnan().any() and not gq.isnan().any()]
    assert not swallowed, swallowed
    assert grads_q[0][5].isnan().all()  # the NaN token's own input gradient


@pytest.mark.parametrize("path", ["reference", "interpreter"])
def test_nvfp4_propagates_nan(request, path):
    if path == "interpreter":
        request.getfixturevalue("interpreter")
    with moekit.options(reference=path == "reference"):
        _check_nvfp4_gemm("cpu")
        _check_nvfp4_block("cpu")


@gpu
def test_nvfp4_propagates_nan_gpu():
    _check_nvfp4_gemm(DEV)
    _check_nvfp4_block(DEV)

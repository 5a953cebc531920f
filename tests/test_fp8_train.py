"""FP8 training of the experts (``moekit.fp8.train``): each GEMM of the FP8 linear is the blockwise op on the
operands its recipe names, bit for bit; the layer against the bf16 layer within stated bounds (e4m3 keeps
3 mantissa bits: ~5% relative error per GEMM on random data); tails, empty experts, NaN, recipes, errors,
and a CPU-sized training run against bf16."""

import pytest
import torch
from test_fp8 import BF16, DEVICES, _device

import moekit
from moekit import fp8
from moekit.fp8.train import FP8GroupedLinearFn, TrainingRecipe
from moekit.grouped_gemm import grouped_mm
from moekit.layers import GroupedExperts, MoE

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (numpy, on NaN)

PLAIN = dict(bias=False, router_bias=False, activation="swiglu")
OUT_BOUND, GRAD_BOUND = 0.1, 0.12  # relative (Frobenius) error against the bf16 layer: measured 0.04-0.075


def _rel(a, b) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def _linear_case(device, counts=(0, 70, 1, 120), m=200, k=136, n=72):
    x = torch.randn(m, k, device=device).to(BF16).requires_grad_()
    param = (torch.randn(len(counts), n, k, device=device) * 0.05).to(BF16).requires_grad_()  # (E, N, K)
    offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    return x, param, offs, torch.randn(m, n, device=device).to(BF16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [TrainingRecipe(), TrainingRecipe(pow2_scales=True),
                                    TrainingRecipe(dgrad=False), TrainingRecipe(wgrad=False)],
                         ids=["fp8", "pow2-scales", "bf16-dgrad", "bf16-wgrad"])
def test_linear_runs_the_blockwise_ops_its_recipe_names(device, recipe):
    """Empty experts, a one-row expert, K and N tails, rows past offs[-1] (NaN in x and dy there)."""
    dev = _device(device)
    x, param, offs, dy = _linear_case(dev)
    with torch.no_grad():
        x[191:] = float("nan")
        dy[191:] = float("nan")
    y = FP8GroupedLinearFn.apply(x, param.mT, offs, recipe)
    dx, dw = torch.autograd.grad(y, [x, param], dy)
    p2 = recipe.pow2_scales
    xq, xs = fp8.quantize(x.detach(), pow2_scales=p2)
    want_y = fp8.grouped_mm_fp8(xq, xs, *fp8.quantize_weights(param.detach(), pow2_scales=p2), offs)
    assert torch.equal(y, want_y) and not y[191:].any() and y.isfinite().all()
    dyq = fp8.quantize(dy, pow2_scales=p2)
    if recipe.dgrad:
        want_dx = fp8.grouped_mm_fp8(*dyq, *fp8.quantize_weights(param.detach().mT, pow2_scales=p2), offs)
    else:
        want_dx = grouped_mm(dy, param.detach(), offs)
    assert torch.equal(dx, want_dx) and not dx[191:].any()
    if recipe.wgrad:
        dyt = fp8.quantize_ragged_t(dy, offs, pow2_scales=p2)[:2]
        xt = fp8.quantize_ragged_t(x.detach(), offs, pow2_scales=p2)[:2]
        want_dw = fp8.weight_grad_fp8(*dyt, *xt, offs, out_dtype=torch.float32).to(BF16)
    else:
        want_dw = grouped_mm(x.detach().mT, dy, offs, out_dtype=torch.float32).mT.to(BF16)
    assert torch.equal(dw, want_dw) and dw.shape == param.shape and dw.isfinite().all()
    assert not dw[0].any()  # an expert without rows
    full = slice(0, 191)  # against the unquantized bf16 product
    assert _rel(y[full], grouped_mm(x.detach()[full], param.detach().mT, offs)) < OUT_BOUND


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ["plain", "gpt-oss", "plain, pure-PyTorch reference"])
def test_fp8_layer_against_the_bf16_layer(device, config):
    """(The reference variant is what a CPU without TRITON_INTERPRET runs: its backward quantizes the
    transposed weight view, which the reference once refused to view.)"""
    dev = _device(device)
    kw = PLAIN if config.startswith("plain") else {}
    d, f = (256, 128) if config.endswith("reference") else (128, 64)  # (two 128-blocks each way)
    torch.manual_seed(0)
    ref = MoE(d, f, 4, 2, device=dev, dtype=BF16, **kw)
    q = MoE(d, f, 4, 2, device=dev, dtype=BF16, fp8=True, **kw)
    q.load_state_dict(ref.state_dict())
    x = torch.randn(50, d, device=dev, dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    got = {}
    for name, m in (("bf16", ref), ("fp8", q)):
        with moekit.options(reference=config.endswith("reference")):
            out = m(x)
            got[name] = (out, *torch.autograd.grad(out, [x, *m.parameters()], dy))
    assert _rel(got["fp8"][0], got["bf16"][0]) < OUT_BOUND
    for a, b in zip(got["fp8"][1:], got["bf16"][1:], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and _rel(a, b) < GRAD_BOUND
    assert torch.equal(q.tokens_per_expert, ref.tokens_per_expert)  # the same routing


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_experts_with_fp32_master_weights_and_rows_past_the_routed_ones(device):
    dev = _device(device)
    ex = GroupedExperts(64, 40, 3, bias=True, activation="gpt-oss", fp8=True, device=dev, dtype=torch.float32)
    counts = torch.tensor([5, 0, 9], device=dev)
    x = torch.randn(20, 64, device=dev).to(BF16).requires_grad_()
    with torch.autocast(dev, BF16):
        out = ex(x, counts)
    assert out.dtype == BF16 and not out[14:].any() and out[:14].isfinite().all()
    out.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()
               for p in ex.parameters())
    assert not x.grad[14:].any()


def test_fp8_argument_errors(interpreter):
    with pytest.raises(TypeError, match="fp8 must be a bool"):
        MoE(64, 32, 4, 2, fp8="yes")
    with pytest.raises(ValueError, match="choose one"):
        GroupedExperts(64, 32, 4, fp8=True, nvfp4=True)
    with pytest.raises(TypeError, match="with fp8"):
        GroupedExperts(64, 32, 4, fp8=True, dtype=torch.float64)
    with pytest.raises(TypeError, match="must be a bool"):
        TrainingRecipe(dgrad="no")
    moe = MoE(64, 32, 4, 2, dtype=BF16, fp8=fp8.TrainingRecipe(wgrad=False), **PLAIN)
    assert "wgrad=False" in repr(moe.experts)
    x = torch.randn(5, 64, dtype=BF16, requires_grad=True)
    fn = moe(x).grad_fn
    assert "_MoEStepFn" not in type(fn).__name__  # the fused bf16 node does not take a quantized block


def test_a_cpu_sized_training_run_tracks_bf16(interpreter):
    """A student MoE fits a fixed teacher for 12 Adam steps, in bf16 and in FP8 from the same seed, with
    fp32 master weights under autocast: the loss falls (6.9 -> 5.4 in bf16), and the FP8 loss stays within
    3% of the bf16 loss at every step (measured: within 1.1%)."""
    torch.manual_seed(0)
    teacher = MoE(64, 32, 4, 2, dtype=BF16, **PLAIN)
    teacher.experts.reset_parameters(0.25)
    data = torch.randn(4, 32, 64, dtype=BF16)
    with torch.no_grad():
        targets = [teacher(d) for d in data]
    losses = {}
    for name, kw in (("bf16", {}), ("fp8", dict(fp8=True))):
        torch.manual_seed(1)
        student = MoE(64, 32, 4, 2, dtype=torch.float32, **PLAIN, **kw)
        student.experts.reset_parameters(0.1)
        opt = torch.optim.Adam(student.parameters(), lr=1e-2)
        run = []
        for step in range(12):
            with torch.autocast("cpu", BF16):
                loss = (student(data[step % 4]).float() - targets[step % 4].float()).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses[name] = run
    assert losses["bf16"][-1] < 0.85 * losses["bf16"][0]
    for a, b in zip(losses["fp8"], losses["bf16"], strict=True):
        assert abs(a - b) <= 0.03 * b, (losses["fp8"], losses["bf16"])

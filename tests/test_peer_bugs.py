"""Known MoE bugs of the peers, each pinned by a test that would have caught it here (CPU: the kernels
under the interpreter, every output NaN-poisoned). The >2**31-element class (torchtitan#1932) needs a
GPU's memory: tests/test_huge_gpu.py."""

import torch

import moekit
from moekit import GptOssExperts, MoE, grouped_mm, grouped_mm_ref
from moekit.testing import offs_from_counts

BF16 = torch.bfloat16


def test_pytorch_172439_empty_experts_get_exact_zero_gradients(interpreter):
    """An expert that receives no rows must get exactly zero weight (and bias) gradients: through
    grouped_mm's autograd, and through the MoE block when the router sends no token to an expert."""
    offs = offs_from_counts([9, 0, 14, 0])
    a = torch.randn(25, 32).to(BF16).requires_grad_()
    b = torch.randn(4, 32, 24).to(BF16).requires_grad_()
    grouped_mm(a, b, offs).float().sum().backward()
    assert not b.grad[1].any() and not b.grad[3].any() and b.grad[0].any() and b.grad[2].any()

    for block in (dict(), dict(bias=False, router_bias=False, activation="swiglu")):
        moe = MoE(32, 24, 6, 2, dtype=BF16, **block)
        moe.expert_bias[4] = -1e4  # expert 4 is never chosen
        moe(torch.randn(40, 32).to(BF16)).float().square().sum().backward()
        for name, p in moe.experts.named_parameters():
            assert not p.grad[4].any(), name
            assert p.grad[:4].any(), name


def test_pytorch_193633_rows_past_offs_are_zero_not_nan(interpreter):
    """Rows past offs[-1] (capacity padding) come out as exact zeros, never as uninitialized memory,
    even when the inputs hold NaN there and every output buffer starts as NaN; their gradient is zero
    and the NaN does not leak into the weight gradient."""
    offs = offs_from_counts([7, 0, 5])
    a = torch.randn(20, 16).to(BF16)
    a[12:] = float("nan")
    a.requires_grad_()
    b = torch.randn(3, 16, 24).to(BF16).requires_grad_()
    out = grouped_mm(a, b, offs)
    assert not out[12:].any() and out[:12].isfinite().all()
    out.backward(torch.randn_like(out))
    assert not a.grad[12:].any() and b.grad.isfinite().all()
    torch.testing.assert_close(out[:12].double(), grouped_mm_ref(a.detach()[:12].double(), b.detach().double(), offs),
                               rtol=2e-2, atol=2e-2)


def test_megatron_6918_no_stale_clamp_under_compile(interpreter):
    """Changing the SwiGLU clamp between calls of a compiled module must take effect (the value must
    not be baked into a cached graph without a guard): the compiled output follows the eager one."""
    torch.manual_seed(2)
    ex = GptOssExperts(32, 24, 3, dtype=BF16)
    counts = torch.tensor([9, 0, 15])
    x = (torch.randn(24, 32) * 8).to(BF16)  # large pre-activations: the clamp decides the output
    compiled = torch.compile(ex, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        first = compiled(x, counts)
        torch.testing.assert_close(first, ex(x, counts), rtol=0, atol=0)
        ex.swiglu["swiglu_limit"] = 1.0
        second = compiled(x, counts)
        want = ex(x, counts)
    assert not torch.equal(first, want)
    torch.testing.assert_close(second, want, rtol=0, atol=0)
    with moekit.options(reference=True):
        torch.testing.assert_close(ex(x, counts).float(), want.float(), rtol=2e-2, atol=2e-2)

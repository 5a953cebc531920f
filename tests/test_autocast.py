"""Mixed precision: under ``torch.autocast`` the ops and layers take fp32 inputs and fp32 parameters, run
in the autocast dtype as ``torch.matmul`` does, and give fp32 gradients. An fp32 x under autocast is
x cast to the autocast dtype outside it: the same bits (the layers then cast their expert weights and
add their biases in fp32, as they do for bf16 tokens)."""

import copy

import pytest
import torch

import moekit
from moekit import GptOssExperts, MoE

BF16 = torch.bfloat16
BLOCKS = {
    "gpt-oss": dict(),
    "plain": dict(bias=False, router_bias=False, activation="swiglu"),
}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block", BLOCKS)
def test_fp32_block_under_autocast_is_the_bf16_block(block):
    dev = _device()
    torch.manual_seed(0)
    moe = MoE(32, 24, 4, 2, device=dev, **BLOCKS[block])  # fp32 parameters, as a mixed-precision recipe keeps
    twin = copy.deepcopy(moe)
    x = torch.randn(40, 32, device=dev, requires_grad=True)
    x16 = x.detach().to(BF16).requires_grad_()
    dy = torch.randn(40, 32, device=dev)
    with torch.autocast(dev, BF16):
        y = moe(x)
    y16 = twin(x16)
    assert y.dtype == BF16
    torch.testing.assert_close(y, y16, rtol=0, atol=0)
    y.backward(dy.to(BF16))
    y16.backward(dy.to(BF16))
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x16.grad.float(), rtol=0, atol=0)
    for (name, p), p16 in zip(moe.named_parameters(), twin.parameters(), strict=True):
        assert p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, p16.grad, rtol=0, atol=0, msg=name)


def test_experts_and_ops_under_autocast():
    dev = _device()
    torch.manual_seed(0)
    ex = GptOssExperts(32, 24, 4, device=dev)  # fp32
    counts = torch.tensor([3, 0, 9, 4], device=dev)
    x = torch.randn(16, 32, device=dev)
    with torch.autocast(dev, BF16):
        y = ex(x, counts)
        out = moekit.grouped_mm(x, ex.mlp1_weight_EGD.mT, torch.cumsum(counts, 0).to(torch.int32))
    assert y.dtype == out.dtype == BF16
    torch.testing.assert_close(y, ex(x.to(BF16), counts), rtol=0, atol=0)
    want = moekit.grouped_mm(x.to(BF16), ex.mlp1_weight_EGD.mT.to(BF16), torch.cumsum(counts, 0).to(torch.int32))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="bfloat16 or float16"):  # outside autocast fp32 is still refused
        moekit.grouped_mm(x, ex.mlp1_weight_EGD.mT, torch.cumsum(counts, 0).to(torch.int32))


def test_hf_experts_under_autocast():
    """An fp32 transformers experts module with moekit as its implementation, under autocast, as
    Trainer(bf16=True) runs it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.integrations.moe")
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

    from moekit.integrations import hf_experts_forward

    dev = _device()
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    experts = qm.Qwen3MoeExperts(cfg).to(dev)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    ids = torch.stack([torch.randperm(8, device=dev)[:2] for _ in range(12)])
    weights = torch.rand(12, 2, device=dev).softmax(-1)
    x = torch.randn(12, 64, device=dev)
    with torch.autocast(dev, BF16):
        y = hf_experts_forward(experts, x, ids, weights)
    want = hf_experts_forward(experts, x.to(BF16), ids, weights)
    assert y.dtype == BF16
    torch.testing.assert_close(y, want, rtol=0, atol=0)

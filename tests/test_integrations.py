"""Drop-ins: moekit behind transformers' gpt-oss experts and torchtitan's grouped experts, checked
against the original modules on the same weights."""

import pytest
import torch
from torch import nn

from moekit import GptOssExperts
from moekit.bench.baselines import TorchtitanExperts
from moekit.integrations import HFGptOssExperts, patch_hf_gpt_oss, patch_torchtitan
from moekit.testing import assert_within_baseline

BF16 = torch.bfloat16
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _hf_experts(dtype):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss import modeling_gpt_oss as hf

    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(11)
    experts = hf.GptOssExperts(cfg).to(device=DEV)
    router = hf.GptOssTopKRouter(cfg).to(device=DEV)
    with torch.no_grad():
        for p in (*experts.parameters(), *router.parameters()):
            p.normal_(0, 0.1)
    return experts.to(dtype), router, hf


def test_hf_gpt_oss_experts_drop_in():
    experts, router, _ = _hf_experts(BF16)
    x = (torch.randn(40, 64, device=DEV) * 3).to(BF16)
    _, scores, idx = router(x.float())
    want = experts(x, idx, scores.to(BF16))
    got = HFGptOssExperts(experts)(x, idx, scores)
    experts32, *_ = _hf_experts(torch.float32)
    oracle = experts32(x.float(), idx, scores)
    assert_within_baseline(got, oracle, want, what="hf experts")

    container = nn.Sequential(experts)
    assert patch_hf_gpt_oss(container) == 1 and isinstance(container[0], HFGptOssExperts)
    assert container[0].gate_up_proj is experts.gate_up_proj  # parameters shared, not copied
    xg = x.clone().requires_grad_()
    container[0](xg, idx, scores).float().sum().backward()
    assert xg.grad is not None and experts.gate_up_proj.grad is not None and experts.down_proj_bias.grad is not None


class GptOssGroupedExperts(nn.Module):
    """A stand-in with torchtitan's class name, parameters and forward (plain torch ops)."""

    def __init__(self, d, f, e):
        super().__init__()
        src = GptOssExperts(d, f, e, dtype=BF16, device=DEV)
        for name, p in src.named_parameters():
            setattr(self, name, p)
        self.swiglu = src.swiglu

    def forward(self, x, counts):
        return TorchtitanExperts(self)(x, counts)


def test_torchtitan_drop_in():
    torch.manual_seed(12)
    model = nn.ModuleDict({"experts": GptOssGroupedExperts(32, 24, 4)})
    counts = torch.tensor([6, 0, 9, 5], device=DEV)
    x = torch.randn(20, 32, device=DEV).to(BF16)
    want = model["experts"](x, counts)
    weight = model["experts"].mlp1_weight_EGD
    assert patch_torchtitan(model) == 1 and isinstance(model["experts"], GptOssExperts)
    assert model["experts"].mlp1_weight_EGD is weight
    got = model["experts"](x, counts)
    assert_within_baseline(got, TorchtitanExperts(_fp32(model["experts"]))(x.float(), counts), want)


def _fp32(experts):
    m = GptOssExperts(experts.dim, experts.hidden_dim, experts.num_experts, dtype=torch.float32, device=DEV)
    m.load_state_dict({k: v.float() for k, v in experts.state_dict().items()})
    return m

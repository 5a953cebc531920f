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


# transformers' experts interface: one tiny experts module per family, (module, config class, keywords)
HF_FAMILIES = {
    "qwen3-moe": ("qwen3_moe", "Qwen3MoeExperts", "Qwen3MoeConfig",
                  dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("mixtral", "MixtralExperts", "MixtralConfig",
                dict(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "gpt-oss": ("gpt_oss", "GptOssExperts", "GptOssConfig",
                dict(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": ("olmoe", "OlmoeExperts", "OlmoeConfig",
              dict(hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "deepseek-v2": ("deepseek_v2", "DeepseekV2Experts", "DeepseekV2Config",
                    dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)),
    "deepseek-v3": ("deepseek_v3", "DeepseekV3Experts", "DeepseekV3Config",
                    dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)),
}


def _hf_family(name, dtype, impl):
    import copy
    import importlib

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.integrations.moe")
    module_name, cls_name, cfg_name, kw = HF_FAMILIES[name]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    torch.manual_seed(13)
    experts = getattr(modeling, cls_name)(getattr(transformers, cfg_name)(**kw))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    experts = experts.to(device=DEV, dtype=dtype)
    experts.config = copy.copy(experts.config)  # each copy selects its own implementation
    experts.config._experts_implementation = impl
    return experts


def _routing(t, e, k):
    ids = torch.rand(t, e, device=DEV).topk(k, dim=1).indices
    return ids, torch.rand(t, k, device=DEV).softmax(-1)


@pytest.mark.parametrize("family", list(HF_FAMILIES))
@pytest.mark.parametrize("reference", [False, True], ids=["kernels", "reference"])
def test_hf_experts_interface(interpreter, family, reference):
    """moekit as transformers' experts implementation: outputs and gradients against the family's own
    eager experts in float64, held to the eager experts' own bf16 error."""
    pytest.importorskip("transformers.integrations.moe")  # (register_hf_experts needs it)
    import moekit
    from moekit.integrations import register_hf_experts

    name = register_hf_experts()
    ids, weights = _routing(40, 8, 2)
    x = (torch.randn(40, 64, device=DEV) * 2).to(BF16)
    dy = torch.randn(40, 64, device=DEV).to(BF16)
    runs = []
    for dtype, impl in ((BF16, name), (BF16, "eager"), (torch.float64, "eager")):
        experts = _hf_family(family, dtype, impl)
        xx = x.detach().to(dtype).clone().requires_grad_()
        with moekit.options(reference=reference):
            out = experts(xx, ids, weights.to(dtype))
            out.backward(dy.to(dtype))
        runs.append([out, xx.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    for what, got, base, oracle in zip(("out", "dx", "dgate_up", "ddown"), *runs, strict=True):
        assert_within_baseline(got, oracle, base, what=f"{family} {what}")


def test_hf_experts_interface_ignores_expert_parallel_sentinels(interpreter):
    """Ids equal to E (not on this rank) contribute nothing, as in transformers' own implementations."""
    pytest.importorskip("transformers.integrations.moe")  # (register_hf_experts needs it)
    from moekit.integrations import register_hf_experts

    name = register_hf_experts()
    ids, weights = _routing(24, 8, 2)
    ids[::3, 1] = 8
    mine, eager = _hf_family("qwen3-moe", BF16, name), _hf_family("qwen3-moe", torch.float64, "eager")
    x = torch.randn(24, 64, device=DEV).to(BF16)
    got = mine(x, ids, weights.to(BF16))
    want = eager(x.double(), ids, weights.double())
    assert (got.double() - want).norm() / want.norm() < 2e-2


def test_hf_model_loads_with_moekit_experts():
    """A whole transformers model built with experts_implementation="moekit": the same loss as eager."""
    import copy

    import moekit
    from moekit.integrations import register_hf_experts

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.integrations.moe")
    name = register_hf_experts()
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=100, head_dim=16)
    torch.manual_seed(0)
    models = [transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), experts_implementation=impl,
                                                            dtype=BF16).to(DEV) for impl in (name, "eager")]
    models[1].load_state_dict(models[0].state_dict())
    assert models[0].config._experts_implementation == name
    ids = torch.randint(0, 100, (2, 12), device=DEV)
    with moekit.options(reference=not torch.cuda.is_available()):  # the interpreter would take minutes here
        losses = [float(m(ids, labels=ids).loss.detach()) for m in models]
    assert abs(losses[0] - losses[1]) < 2e-2 * abs(losses[1])

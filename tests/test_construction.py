"""Construction: a meta-device build initializes every parameter and buffer, bad arguments are refused
where the user passes them (naming them), and an empty batch is a result, not an error."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moekit
from moekit import GptOssExperts, GroupedExperts, MoE
from moekit.integrations import HFGptOssExperts
from moekit.nvfp4 import TrainingRecipe

BF16 = torch.bfloat16


def _init_on_meta(cls, *args, **kw):
    """The torchtitan / FSDP2 way: build on meta, materialize, then every module's reset_parameters()
    in module order, from the same seed as a direct build."""
    mod = cls(*args, device="meta", **kw)
    mod.to_empty(device="cpu")
    with torch.no_grad():  # the garbage to_empty leaves, made loud
        for t in [*mod.parameters(), *mod.buffers()]:
            t.fill_(float("nan") if t.is_floating_point() else -7)
    torch.manual_seed(0)
    for m in mod.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    return mod


def _direct(cls, *args, **kw):
    torch.manual_seed(0)
    return cls(*args, **kw)


def _assert_same_state(a, b):
    sa = {**dict(a.named_parameters()), **dict(a.named_buffers())}
    sb = {**dict(b.named_parameters()), **dict(b.named_buffers())}
    assert sa.keys() == sb.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=name)


CASES = {  # one line each: what the case covers
    "gpt-oss block": (MoE, (32, 24, 4, 2), dict(dtype=BF16)),
    "plain block": (MoE, (32, 24, 4, 2), dict(dtype=BF16, bias=False, router_bias=False, activation="swiglu")),
    "NVFP4 block (the Hadamard signs)": (MoE, (32, 32, 4, 2), dict(dtype=BF16, nvfp4=TrainingRecipe(seed=5))),
    "experts alone": (GroupedExperts, (32, 24, 4), dict(dtype=BF16)),
    "gpt-oss experts": (GptOssExperts, (32, 24, 4), dict(dtype=BF16)),
}


@pytest.mark.parametrize("case", CASES)
def test_meta_build_initializes_every_parameter_and_buffer(case):
    cls, args, kw = CASES[case]
    built = _init_on_meta(cls, *args, **kw)
    _assert_same_state(built, _direct(cls, *args, **kw))


def test_meta_build_then_checkpoint_matches():
    """A checkpoint loaded after to_empty restores the persistent state; reset_parameters covers the
    non-persistent buffers no checkpoint holds (tokens_per_expert, the NVFP4 signs)."""
    kw = dict(dtype=BF16, nvfp4=TrainingRecipe(seed=5))
    src = _direct(MoE, 32, 32, 4, 2, **kw)
    src.expert_bias.uniform_()
    built = _init_on_meta(MoE, 32, 32, 4, 2, **kw)
    built.load_state_dict(src.state_dict())
    _assert_same_state(built, src)


def test_expert_parallel_meta_build(tmp_path):
    from moekit.distributed import ExpertParallelMoE

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        built = _init_on_meta(ExpertParallelMoE, 32, 24, 4, 2, dtype=BF16)
        _assert_same_state(built, _direct(ExpertParallelMoE, 32, 24, 4, 2, dtype=BF16))
    finally:
        dist.destroy_process_group()


def test_torchtitan_init_weights_resets_the_experts():
    ex = _direct(GptOssExperts, 32, 24, 4, dtype=BF16)
    with torch.no_grad():
        for p in ex.parameters():
            p.fill_(float("nan"))
    torch.manual_seed(0)
    ex.init_weights(0.02)
    _assert_same_state(ex, _direct(GptOssExperts, 32, 24, 4, dtype=BF16))


BAD = {  # constructor call -> (error, what the message must name)
    "hidden_dim whose rows are not 16-byte aligned": (lambda: MoE(32, 12, 4, 2, dtype=BF16), ValueError, "hidden_dim"),
    "dim whose rows are not 16-byte aligned": (lambda: GroupedExperts(20, 16, 4), ValueError, "dim"),
    "no experts": (lambda: GroupedExperts(32, 16, 0), ValueError, "num_experts"),
    "a bogus gate/up layout": (lambda: MoE(32, 16, 4, 2, gate_up_layout="bogus"), ValueError, "gate_up_layout"),
    "a zero clamp": (lambda: MoE(32, 16, 4, 2, swiglu_limit=0.0), ValueError, "swiglu_limit"),
    "a negative clamp on the experts": (lambda: GptOssExperts(32, 16, 4, swiglu_limit=-1.0), ValueError,
                                        "swiglu_limit"),
    "a NaN alpha": (lambda: MoE(32, 16, 4, 2, swiglu_alpha=float("nan")), ValueError, "swiglu_alpha"),
    "a misspelled keyword (hidden=)": (lambda: MoE(32, 16, 4, 2, hidden=3), TypeError, "hidden"),
    # NVFP4 quantizes dim and hidden_dim in blocks of 16 (nvfp4.quantize refused it at the first forward)
    "nvfp4 with hidden_dim 24": (lambda: MoE(32, 24, 4, 2, nvfp4=True), ValueError, "^MoE: with nvfp4, hidden_dim"),
    "nvfp4 with dim 24": (lambda: GroupedExperts(24, 32, 4, nvfp4=TrainingRecipe(seed=1)), ValueError,
                          "^GroupedExperts: with nvfp4, dim"),
    "nvfp4 as a string": (lambda: MoE(32, 32, 4, 2, nvfp4="nvfp4"), TypeError, "^MoE: nvfp4"),
    "nvfp4 with float64 parameters": (lambda: MoE(32, 32, 4, 2, nvfp4=True, dtype=torch.float64), TypeError,
                                      "^MoE: dtype"),
    # flags that a string or a tensor would pass as true
    "a string bias": (lambda: MoE(32, 16, 4, 2, bias="False"), TypeError, "^MoE: bias"),
    "a string router_bias": (lambda: MoE(32, 16, 4, 2, router_bias="False"), TypeError, "^MoE: router_bias"),
    "a tensor renormalize": (lambda: MoE(32, 16, 4, 2, renormalize=torch.tensor(0)), TypeError, "^MoE: renormalize"),
    "a string aux_loss": (lambda: MoE(32, 16, 4, 2, aux_loss="no"), TypeError, "^MoE: aux_loss"),
    "a string bias on the experts": (lambda: GptOssExperts(32, 16, 4, bias="no"), TypeError, "^GptOssExperts: bias"),
    # dtypes the parameters cannot be (failed inside nn.Parameter or init, naming neither)
    "integer parameters": (lambda: MoE(32, 16, 4, 2, dtype=torch.int32), TypeError, "^MoE: dtype"),
    "complex parameters": (lambda: GroupedExperts(32, 16, 4, dtype=torch.complex64), TypeError,
                           "^GroupedExperts: dtype"),
    "a dtype by name": (lambda: MoE(32, 16, 4, 2, dtype="bfloat16"), TypeError, "^MoE: dtype"),
    # SwiGLU settings the message already called finite, or that failed deep inside
    "an infinite alpha": (lambda: MoE(32, 16, 4, 2, swiglu_alpha=float("inf")), ValueError, "^MoE: swiglu_alpha"),
    "an infinite linear offset": (lambda: MoE(32, 16, 4, 2, swiglu_linear_offset=float("inf")), ValueError,
                                  "^MoE: swiglu_linear_offset"),
    "a clamp given as a string": (lambda: MoE(32, 16, 4, 2, swiglu_limit="7"), ValueError, "^MoE: swiglu_limit"),
    "a clamp given as True": (lambda: MoE(32, 16, 4, 2, swiglu_limit=True), ValueError, "^MoE: swiglu_limit"),
    # TrainingRecipe: flags, and a seed that failed at the first stochastically rounded backward
    "a recipe with a negative seed": (lambda: TrainingRecipe(seed=-1), ValueError, "^TrainingRecipe: seed"),
    "a recipe with a seed past 2^63": (lambda: TrainingRecipe(seed=2**63), ValueError, "^TrainingRecipe: seed"),
    "a recipe with a float seed": (lambda: TrainingRecipe(seed=1.5), ValueError, "^TrainingRecipe: seed"),
    "a recipe with a string flag": (lambda: TrainingRecipe(random_hadamard="no"), TypeError,
                                    "^TrainingRecipe: random_hadamard"),
    # HFGptOssExperts(original): what its forward would refuse, named by original's attribute
    "HF experts with F = 12": (lambda: HFGptOssExperts(_HFStandIn(f=12)), ValueError,
                               r"^HFGptOssExperts: F \(original.down_proj"),
    "HF experts with D = 20": (lambda: HFGptOssExperts(_HFStandIn(d=20)), ValueError,
                               r"^HFGptOssExperts: D \(original.gate_up_proj"),
    "HF experts with a negative limit": (lambda: HFGptOssExperts(_HFStandIn(limit=-7.0)), ValueError,
                                         "^HFGptOssExperts: original.limit"),
    "HF experts with a NaN alpha": (lambda: HFGptOssExperts(_HFStandIn(alpha=float("nan"))), ValueError,
                                    "^HFGptOssExperts: original.alpha"),
    "HF experts with mismatched projections": (lambda: HFGptOssExperts(_HFStandIn(down_f=16)), ValueError,
                                               "^HFGptOssExperts: original.gate_up_proj"),
}


class _HFStandIn(nn.Module):
    """transformers' GptOssExperts parameters and attributes, without transformers."""

    def __init__(self, d=32, f=24, e=4, limit=7.0, alpha=1.702, down_f=None):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(e, d, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * f))
        self.down_proj = nn.Parameter(torch.zeros(e, down_f or f, d))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, d))
        self.alpha, self.limit = alpha, limit


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments_are_refused_at_construction(case):
    """The same error on the kernels and on the reference: nothing has run yet."""
    make, error, names = BAD[case]
    for reference in (False, True):
        with moekit.options(reference=reference), pytest.raises(error, match=names):
            make()


def test_the_checks_accept_what_runs():
    """Every configuration the blocks run passes the checks: parameters in each floating dtype (not
    float64 with NVFP4), NVFP4 at multiples of 16, no clamp (None or +inf), the largest Philox seed."""
    for kw in (dict(dtype=torch.float64), dict(dtype=torch.float16), dict(), dict(swiglu_limit=None),
               dict(swiglu_limit=float("inf")), dict(nvfp4=TrainingRecipe(seed=2**63 - 1)),
               dict(nvfp4=False, dtype=torch.float64), dict(nvfp4=True, dtype=torch.float32)):
        MoE(32, 32, 4, 2, **kw)
        GroupedExperts(32, 32, 4, **kw)
    assert HFGptOssExperts(_HFStandIn()).limit == 7.0


def test_expert_parallel_checks_its_arguments(tmp_path):
    from moekit.distributed import ExpertParallelMoE

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for make, error, names in (
            (lambda: ExpertParallelMoE(32, 24, 4, 2, chunks=True), ValueError, "^ExpertParallelMoE: chunks"),
            (lambda: ExpertParallelMoE(32, 24, 4, 2, aux_loss="yes"), TypeError, "^ExpertParallelMoE: aux_loss"),
            (lambda: ExpertParallelMoE(32, 24, 4, 2, bias="no"), TypeError, "^ExpertParallelMoE: bias"),
            (lambda: ExpertParallelMoE(32, 24, 4, 2, nvfp4=True), ValueError,
             "^ExpertParallelMoE: with nvfp4, hidden_dim"),
            (lambda: ExpertParallelMoE(32, 24, 4, 2, dtype=torch.int8), TypeError, "^ExpertParallelMoE: dtype"),
        ):
            with pytest.raises(error, match=names):
                make()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_empty_batch_is_an_empty_result(out_dtype):
    a = torch.randn(0, 4, 16, dtype=BF16, requires_grad=True)
    b = torch.randn(0, 16, 8, dtype=BF16, requires_grad=True)
    out = moekit.grouped_mm(a, b, out_dtype=out_dtype)
    ref = torch.bmm(a, b)
    assert out.shape == ref.shape == (0, 4, 8) and out.dtype == (out_dtype or BF16)
    assert moekit.grouped_mm_ref(a, b, out_dtype=out_dtype).shape == (0, 4, 8)
    out.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape

"""Construction: a meta-device build initializes every parameter and buffer, bad arguments are refused
where the user passes them (naming them), and an empty batch is a result, not an error."""

import pytest
import torch
import torch.distributed as dist

import moekit
from moekit import GptOssExperts, GroupedExperts, MoE
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
}


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments_are_refused_at_construction(case):
    make, error, names = BAD[case]
    with pytest.raises(error, match=names):
        make()


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

"""moekit.warmup: the module is left as it was (parameters, .grad, buffers, aux_loss, the NVFP4 random
streams), so that a warmed-up module computes exactly what an untouched twin computes; ``-m gpu``: after
it, a step of the same shape compiles no kernel."""

import sys

import pytest
import torch

import moekit
from moekit.nvfp4 import TrainingRecipe

gpu = pytest.mark.gpu

CONFIGS = [
    pytest.param(dict(), id="gpt-oss"),
    pytest.param(dict(bias=False, router_bias=False, activation="swiglu", aux_loss=True), id="plain-aux-loss"),
    pytest.param(dict(bias=False, router_bias=False, activation="swiglu", nvfp4=TrainingRecipe(seed=3)),
                 id="nvfp4-stochastic"),
    pytest.param(dict(fp8=True), id="gpt-oss-fp8"),
]


def _moe(device="cpu", dtype=torch.bfloat16, **kw):
    torch.manual_seed(0)
    return moekit.MoE(32, 32, 4, 2, device=device, dtype=dtype, **kw)


def _step(module, x):
    out = module(x)
    grads = torch.autograd.grad(out.float().square().sum(), [p for p in module.parameters() if p.requires_grad])
    return out, grads


@pytest.mark.parametrize("kw", CONFIGS)
def test_warmup_leaves_the_module_as_it_was(interpreter, kw):
    warm, cold = _moe(**kw), _moe(**kw)
    x = torch.randn(9, 32, dtype=torch.bfloat16)
    with torch.no_grad():  # buffers that are not zero, to see them restored
        warm.tokens_per_expert += torch.arange(4)
        cold.tokens_per_expert += torch.arange(4)
    warm.aux_loss = cold.aux_loss = "before"
    moekit.warmup(warm, x)
    assert all(p.grad is None for p in warm.parameters())
    assert warm.aux_loss == "before"
    for (name, a), b in zip(warm.state_dict().items(), cold.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(warm.tokens_per_expert, cold.tokens_per_expert)  # (not in the state dict)
    # the same step on both: the same bits, the NVFP4 stochastic rounding included
    (out_w, grads_w), (out_c, grads_c) = _step(warm, x), _step(cold, x)
    assert torch.equal(out_w, out_c)
    for a, b in zip(grads_w, grads_c, strict=True):
        assert torch.equal(a, b)


def test_warmup_forward_only_and_under_no_grad(interpreter):
    module = _moe(bias=False, router_bias=False, activation="swiglu")
    x = torch.randn(5, 32, dtype=torch.bfloat16, requires_grad=True)
    moekit.warmup(module, x, backward=False)
    with torch.no_grad():
        moekit.warmup(module, x)  # backward asked for, but grad mode is off: forward only
    assert x.grad is None and all(p.grad is None for p in module.parameters())


def test_warmup_rejects_what_it_cannot_run():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        moekit.warmup(lambda x: x, torch.zeros(1))
    with pytest.raises(TypeError, match="x must be a tensor"):
        moekit.warmup(torch.nn.Identity(), [1.0])


def _compiled_kernels() -> int:
    """How many (kernel, specialization) pairs Triton has compiled for moekit's kernels so far."""
    from triton.runtime.jit import JITFunction

    total = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("moekit._kernels") or mod is None:
            continue
        for obj in vars(mod).values():
            if isinstance(obj, JITFunction) and obj.__module__ == name:
                total += sum(len(cache[0]) for cache in obj.device_caches.values())
    return total


@gpu
@pytest.mark.parametrize("kw", [
    pytest.param(dict(), id="gpt-oss"),
    pytest.param(dict(bias=False, router_bias=False, activation="swiglu"), id="plain"),
])
def test_after_warmup_a_step_compiles_nothing_gpu(kw):
    torch.manual_seed(0)
    module = moekit.MoE(256, 128, 8, 2, device="cuda", dtype=torch.bfloat16, **kw)
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    moekit.warmup(module, x)
    before = _compiled_kernels()
    assert before > 0
    _step(module, torch.randn_like(x))  # new values, same shape: new routing
    torch.cuda.synchronize()
    assert _compiled_kernels() == before

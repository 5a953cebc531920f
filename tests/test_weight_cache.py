"""``moekit.weight_cache``: inside it the FP8 and NVFP4 experts quantize each weight once per direction and
version, with the uncached outputs and gradients bit for bit; an update that autograd sees quantizes again;
nothing is cached outside a scope, while compiling or while a CUDA graph captures."""

import pytest
import torch
from test_fp8 import DEVICES, _device

import moekit
from moekit import quantized
from moekit.fp8 import train as fp8_train
from moekit.nvfp4 import train as nvfp4_train

PLAIN = dict(bias=False, router_bias=False, activation="swiglu")
PRECISIONS = {  # constructor argument, the module and the name of its weight quantization
    "fp8": (dict(fp8=True), fp8_train, "quantize_weights"),
    "nvfp4": (dict(nvfp4=nvfp4_train.TrainingRecipe(seed=3, stochastic_rounding=False)), nvfp4_train,
              "_quantize_weights_now"),
}


def _counted(monkeypatch, module, name) -> list:
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _steps(moe, xs, dys) -> list:
    """Forward and every gradient of each micro-batch."""
    out = []
    for x, dy in zip(xs, dys, strict=True):
        x = x.clone().requires_grad_()
        y = moe(x)
        out.append((y, *torch.autograd.grad(y, [x, *moe.parameters()], dy)))
    return out


def _assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        for t, u in zip(a, b, strict=True):
            torch.testing.assert_close(t, u, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_a_scope_quantizes_each_weight_once_with_the_same_bits(device, precision, monkeypatch):
    dev = _device(device)
    kw, module, name = PRECISIONS[precision]
    moe = moekit.MoE(64, 32, 4, 2, device=dev, dtype=torch.bfloat16, **PLAIN, **kw)
    xs = [torch.randn(24, 64, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    dys = [torch.randn_like(x) for x in xs]
    calls = _counted(monkeypatch, module, name)
    want = _steps(moe, xs, dys)
    per_step = len(calls) // 3
    assert per_step >= 2 and len(calls) == 3 * per_step  # (both weights, each step: nothing cached outside)
    calls.clear()
    with moekit.weight_cache():
        got = _steps(moe, xs, dys)
        assert len(calls) == per_step  # once per weight and direction for the three micro-batches
        with torch.no_grad():
            moe.experts.mlp1_weight_EGD.mul_(2)  # an update autograd sees: that weight quantized again
        calls.clear()
        updated = _steps(moe, xs[:1], dys[:1])
        w1 = moe.experts.mlp1_weight_EGD.shape
        assert calls and all(sorted(s) == sorted(w1) for s in calls)
    assert quantized._CACHE is None  # the copies go with the scope
    _assert_same(got, want)
    _assert_same(updated, _steps(moe, xs[:1], dys[:1]))


def test_what_the_cache_keys_and_when_it_stays_out(monkeypatch):
    """Per tag and view; nested scopes share the outermost; nothing cached while compiling; a scope left by
    an exception closes."""
    w, made = torch.randn(4, 6), []

    def quantize(t):
        made.append(t.shape)
        return (t * 2,)

    quantized.cached_weight(w, "a", quantize)
    quantized.cached_weight(w, "a", quantize)
    assert len(made) == 2
    with moekit.weight_cache():
        first = quantized.cached_weight(w, "a", quantize)
        assert quantized.cached_weight(w, "a", quantize) is first and len(made) == 3
        quantized.cached_weight(w.mT, "a", quantize)  # another view
        quantized.cached_weight(w, "b", quantize)  # another tag (direction, recipe)
        assert len(made) == 5
        with moekit.weight_cache():
            assert quantized.cached_weight(w, "a", quantize) is first
        assert quantized._CACHE is not None
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            quantized.cached_weight(w, "a", quantize)
        assert len(made) == 6
    assert quantized._CACHE is None
    with pytest.raises(RuntimeError, match="boom"), moekit.weight_cache():
        raise RuntimeError("boom")
    assert quantized._CACHE is None


@pytest.mark.gpu
def test_nothing_is_cached_while_a_cuda_graph_captures():
    """A graph would keep reading a cached copy after the scope frees it: a capture quantizes itself."""
    w, made = torch.randn(4, 6, device="cuda"), []

    def quantize(t):
        made.append(t.shape)
        return (t * 2,)

    graph = torch.cuda.CUDAGraph()
    with moekit.weight_cache():
        quantized.cached_weight(w, "a", quantize)
        with torch.cuda.graph(graph):
            quantized.cached_weight(w, "a", quantize)
    assert len(made) == 2

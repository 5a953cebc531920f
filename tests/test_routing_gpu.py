"""The MoE block on a CUDA GPU: routing metadata at scale, no host sync, CUDA graphs, torch.compile."""

import pytest
import torch

from moekit import MoE, route_metadata_ref
from moekit.bench.baselines import TorchtitanMoE
from moekit.routing import route_metadata
from moekit.testing import assert_within_baseline

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16


@pytest.mark.parametrize("t, e, k", [(24576, 32, 4), (24576, 128, 8), (1, 8, 8)])
def test_route_metadata_exact(t, e, k):
    ids = torch.rand(t, e, device=DEV).topk(k, -1).indices.to(torch.int32)
    for a, b in zip(route_metadata(ids, e), route_metadata_ref(ids, e), strict=True):
        assert torch.equal(a, b)


D, F = 576, 320  # neither a multiple of 128: both bias gradients ride on the weight-gradient GEMMs


def _case():
    torch.manual_seed(5)
    moe = MoE(D, F, 16, 4, device=DEV, dtype=BF16)
    x = torch.randn(2048, D, device=DEV, dtype=BF16, requires_grad=True)
    return moe, x, torch.randn_like(x)


def test_moe_against_torchtitan_block():
    moe, x, dy = _case()
    base = TorchtitanMoE(moe)
    moe32 = MoE(D, F, 16, 4, device=DEV, dtype=torch.float32)
    moe32.load_state_dict({k: v.float() for k, v in moe.state_dict().items()})
    x32 = x.detach().float().requires_grad_()
    outs = [m(xx) for m, xx in ((moe, x), (base, x), (TorchtitanMoE(moe32), x32))]
    assert_within_baseline(outs[0], outs[2], outs[1], what="moe")
    grads = [torch.autograd.grad(o, [xx, *m.parameters()], dy.to(o.dtype))
             for o, xx, m in zip(outs, (x, x, x32), (moe, moe, moe32), strict=True)]
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for name, got, want, base_grad in zip(names, *grads, strict=True):
        assert_within_baseline(got, want, base_grad, what=f"d{name}")


def test_moe_no_sync_graph_compile():
    moe, x, dy = _case()
    params = [x, *moe.parameters()]
    eager = torch.autograd.grad(moe(x), params, dy)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.autograd.grad(moe(x), params, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # deterministic: the same step twice gives the same bits
    again = torch.autograd.grad(moe(x), params, dy)
    for a, b in zip(eager, again, strict=True):
        assert torch.equal(a, b)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.autograd.grad(moe(x), params, dy)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = torch.autograd.grad(moe(x), params, dy)
    graph.replay()
    for a, b in zip(static, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    # Inductor re-fuses the router's fp32 softmax / renormalization, so routing weights may differ in
    # the last fp32 bit and a few bf16 outputs by one ulp: compare at two bf16 ulps, not bitwise.
    compiled = torch.compile(moe, fullgraph=True)
    out_c = compiled(x)
    torch.testing.assert_close(out_c, moe(x), rtol=2**-7, atol=2**-7)

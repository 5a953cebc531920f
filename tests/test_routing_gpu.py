"""The MoE block on a CUDA GPU: routing metadata at scale, no host sync, CUDA graphs, torch.compile."""

import pytest
import torch

from moekit import MoE, router_topk_ref, routing_metadata_ref, topk_router
from moekit.bench.baselines import TorchtitanMoE
from moekit.gate import router_logits_bwd_fwd, router_logits_bwd_ref, split_router_logits_fwd, split_router_logits_ref
from moekit.routing import (
    router_topk_fwd,
    routing_metadata_fwd,
    sorted_weights,
    topk_weights_grad_fwd,
    topk_weights_grad_ref,
)
from moekit.testing import assert_within_baseline

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16


@pytest.mark.parametrize("t, e, k", [(24576, 32, 4), (24576, 128, 8), (1, 8, 8)])
def test_route_metadata_exact(t, e, k):
    ids = torch.rand(t, e, device=DEV).topk(k, -1).indices.to(torch.int32)
    for a, b in zip(routing_metadata_fwd(ids, e), routing_metadata_ref(ids, e), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("e", [8, 128, 160])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_router_logits_kernel_against_its_reference(e, bias):
    """The router-logits kernel on the hardware: against the split reference (fp32 GEMMs of the exact
    bf16 terms) up to the order of fp32 sums; strided tokens, an odd T, two expert blocks (E = 160)."""
    torch.manual_seed(e)
    x = torch.randn(4099, 4096, device=DEV).to(BF16)[:, ::2]
    w, b = torch.randn(e, 2048, device=DEV) * 0.02, (torch.randn(e, device=DEV) if bias else None)
    got, want = split_router_logits_fwd(x, w, b), split_router_logits_ref(x, w, b)
    scale = (x.float().abs() @ w.abs().t()).max()
    assert (got - want).abs().max() <= 1e-6 * scale


@pytest.mark.parametrize("e", [8, 128, 160])
def test_router_logits_backward_kernel_against_its_reference(e):
    """The router GEMM's input gradients in one kernel on the hardware: against the reference (fp32
    GEMMs of the same bf16-rounded operands) up to the order of fp32 sums; strided tokens, odd T."""
    torch.manual_seed(e)
    x = torch.randn(4099, 4096, device=DEV).to(BF16)[:, ::2]
    w, g = torch.randn(e, 2048, device=DEV) * 0.02, torch.randn(4099, e, device=DEV) * 1e-3
    dx, dw = router_logits_bwd_fwd(g, x, w, True, True)
    rx, rw = router_logits_bwd_ref(g, x, w)
    torch.testing.assert_close(dx, rx, rtol=1e-2, atol=1e-7)
    gb = g.to(BF16).float()
    assert (dw - rw).abs().max() <= 1e-5 * (gb.abs().t() @ x.float().abs()).max()


@pytest.mark.parametrize("t", [2048, 2049], ids=["kernel", "cublas"])
def test_router_logits_backward_op_on_both_sides_of_its_token_limit(t):
    """The backward op: one kernel up to KERNEL_MAX_TOKENS tokens, cuBLAS past them; both against the
    reference, with the added gradient of x."""
    from moekit.gate import KERNEL_MAX_TOKENS, router_logits_bwd_op

    assert KERNEL_MAX_TOKENS == 2048  # (the two cases straddle it)
    torch.manual_seed(t)
    x, w = torch.randn(t, 1024, device=DEV).to(BF16), torch.randn(64, 1024, device=DEV) * 0.02
    g, other = torch.randn(t, 64, device=DEV) * 1e-3, torch.randn(t, 1024, device=DEV).to(BF16)
    dx, dw = router_logits_bwd_op(g, x, w, True, True, other)
    rx, rw = router_logits_bwd_ref(g, x, w)
    torch.testing.assert_close(dx, other + rx, rtol=1e-2, atol=1e-6)
    assert (dw - rw).abs().max() <= 1e-5 * (g.to(BF16).float().abs().t() @ x.float().abs()).max()


def test_router_small_kernels():
    """The router's one-kernel helpers on the GPU: the router-logits kernel's bf16 split of the gate
    weight bit for bit (subnormals included, NaN as NaN), the scores' gradient against float64, the
    sorted weights exact."""
    from test_routing import split_bf16_case

    w, _ = split_bf16_case(DEV)  # (x the identity: each logit is one weight's hi + lo)
    x = torch.eye(w.shape[1], device=DEV, dtype=BF16)
    got, want = split_router_logits_fwd(x, w, None), split_router_logits_ref(x, w, None)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])
    t, e, k = 16384, 128, 8
    scores = torch.rand(t, e, device=DEV).softmax(-1)
    experts = scores.topk(k, -1).indices.to(torch.int32)
    dw = torch.randn(t, k, device=DEV)
    for renormalize in (True, False):
        got = topk_weights_grad_fwd(dw, scores, experts, renormalize)
        ref = topk_weights_grad_ref(dw.double(), scores.double(), experts.long(), renormalize)
        assert ((got.double() - ref).abs().amax(1) / ref.abs().amax(1)).max() < 1e-6
        for score_func in ("softmax", "sigmoid"):  # the logits' gradient, the score function's backward fused
            got = topk_weights_grad_fwd(dw, scores, experts, renormalize, score_func)
            ref = topk_weights_grad_ref(dw.double(), scores.double(), experts.long(), renormalize, score_func)
            fp32 = topk_weights_grad_ref(dw, scores, experts.long(), renormalize, score_func)
            err, err32 = ((a.double() - ref).abs().amax(1) / ref.abs().amax(1) for a in (got, fp32))
            assert err.max() < max(4 * err32.max(), 1e-6), (score_func, err.max(), err32.max())
    _, _, _, row_of = routing_metadata_fwd(experts, e)
    weights = torch.rand(t, k, device=DEV, requires_grad=True)
    s = sorted_weights(weights, row_of)
    assert torch.equal(s[row_of.long()], weights)
    g = torch.randn(t * k, device=DEV)
    s.backward(g)
    assert torch.equal(weights.grad, g[row_of.long()])


@pytest.mark.parametrize("t, e, k", [(16384, 128, 8), (24576, 32, 4), (4000, 64, 6), (5, 256, 8)])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_topk_exact(t, e, k, score_func):
    """The fused router picks exactly the experts of the torch reference on the GPU (on the logits, or
    on the scores plus an expert bias), ties and NaN included, with its weights to fp32 rounding."""
    lg = torch.randn(t, e, device=DEV)
    lg[::3, 1] = lg[::3, 2]  # exact ties
    lg[1::5, :6] = 0.25
    lg[2, 0] = float("nan")
    lg[3::11, e // 2] = float("-inf")
    scores = lg.softmax(-1) if score_func == "softmax" else lg.sigmoid()
    for bias in (None, torch.zeros(e, device=DEV), torch.randn(e, device=DEV) * 0.05):
        key = lg if bias is None else scores + bias
        for renormalize in (True, False):
            w, ids = router_topk_fwd(key, scores, k, renormalize)
            w_ref, ids_ref = router_topk_ref(lg, k, score_func=score_func, renormalize=renormalize,
                                             expert_bias=bias)
            assert torch.equal(ids.long(), ids_ref)
            torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-7, equal_nan=True)
            if bias is not None:  # the bias added in the kernel: the same choice and bits
                w2, ids2 = router_topk_fwd(scores, scores, k, renormalize, bias)
                assert torch.equal(ids2, ids)
                torch.testing.assert_close(w2, w, rtol=0, atol=0, equal_nan=True)


D, F = 576, 320  # neither a multiple of 128: both bias gradients ride on the weight-gradient GEMMs


BLOCKS = {  # the gpt-oss block, and the bias-free plain-SwiGLU block of Qwen3 / Mixtral / DeepSeek / OLMoE
    "gpt-oss": {},
    "plain": dict(bias=False, router_bias=False, activation="swiglu"),
}


def _case(block):
    torch.manual_seed(5)
    moe = MoE(D, F, 16, 4, device=DEV, dtype=BF16, **BLOCKS[block])
    x = torch.randn(2048, D, device=DEV, dtype=BF16, requires_grad=True)
    return moe, x, torch.randn_like(x)


@pytest.mark.parametrize("block", list(BLOCKS))
def test_moe_against_torchtitan_block(block):
    moe, x, dy = _case(block)
    base = TorchtitanMoE(moe)
    moe32 = MoE(D, F, 16, 4, device=DEV, dtype=torch.float32, **BLOCKS[block])
    moe32.load_state_dict({k: v.float() for k, v in moe.state_dict().items()})
    x32 = x.detach().float().requires_grad_()
    outs = [m(xx) for m, xx in ((moe, x), (base, x), (TorchtitanMoE(moe32), x32))]
    assert_within_baseline(outs[0], outs[2], outs[1], what="moe")
    grads = [torch.autograd.grad(o, [xx, *m.parameters()], dy.to(o.dtype))
             for o, xx, m in zip(outs, (x, x, x32), (moe, moe, moe32), strict=True)]
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for name, got, want, base_grad in zip(names, *grads, strict=True):
        assert_within_baseline(got, want, base_grad, what=f"d{name}")


@pytest.mark.parametrize("block", list(BLOCKS))
def test_moe_no_sync_graph_compile(block):
    moe, x, dy = _case(block)
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


def test_weight_gradients_arrive_in_the_parameter_layout():
    """Without biases the expert weight gradients come out in the (E, N, K) parameters' own layout,
    so .backward() accumulates them without a strided copy."""
    moe, x, dy = _case("plain")
    w1, w2 = moe.experts.mlp1_weight_EGD, moe.experts.mlp2_weight_EDF
    g1, g2 = torch.autograd.grad(moe(x), [w1, w2], dy)
    assert g1.is_contiguous() and g2.is_contiguous()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_fused_router_equals_its_composition_gpu(score_func):
    """The fused router (tensor-core logits recomputed in the backward) against the composition of
    router_logits, the scores and the top-k op: the same choices, weights and gradients, bit for bit (through
    a softmax, the gradients up to the rounding of its backward's row sum, which the op takes in one kernel)."""
    from moekit.gate import router_logits
    from moekit.routing import _router_topk_op

    torch.manual_seed(5)
    t, d, e, k = 4096, 1024, 64, 6
    x = torch.randn(t, d, device=DEV).to(BF16).requires_grad_()
    w = (torch.randn(e, d, device=DEV) * 0.02).requires_grad_()
    b = torch.randn(e, device=DEV).requires_grad_()
    eb = torch.randn(e, device=DEV) * 0.01
    r = topk_router(x, w, b, top_k=k, score_func=score_func, expert_bias=eb)
    logits = router_logits(x, w, b)
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    want_w, want_ids = _router_topk_op(scores + eb, scores, k, True)
    assert torch.equal(r.experts, want_ids) and torch.equal(r.weights, want_w)
    dw = torch.randn(t, k, device=DEV)
    for g, h in zip(torch.autograd.grad(r.weights, [x, w, b], dw), torch.autograd.grad(want_w, [x, w, b], dw),
                    strict=True):
        if score_func == "sigmoid":
            assert torch.equal(g, h), (g.float() - h.float()).abs().max()
        else:  # the softmax backward's row sum in the top-k weights' kernel: fp32 rounding, then x's bf16
            tol = 2.0 ** -7 if g.dtype == BF16 else 1e-5
            torch.testing.assert_close(g, h, rtol=tol, atol=tol * h.abs().max().item())


def test_router_logits_on_tensor_cores_match_fp32():
    from moekit.gate import router_logits, router_logits_op

    torch.manual_seed(3)
    x = torch.randn(4096, 2048, device=DEV).to(BF16).requires_grad_()
    w = (torch.randn(64, 2048, device=DEV) * 0.02).requires_grad_()
    b = torch.randn(64, device=DEV).requires_grad_()
    got = router_logits(x, w, b)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    want = x64 @ w64.T + b64
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() / want.abs().max() < 1e-5  # hi + lo: ~16 mantissa bits
    g = torch.randn_like(got)
    got.backward(g)
    want.backward(g.double())
    for t, t64 in ((x, x64), (w, w64), (b, b64)):
        rel = (t.grad.double() - t64.grad).norm() / t64.grad.norm()
        assert rel < 1e-2, float(rel)  # the logits' gradient is rounded to bf16
    torch.library.opcheck(router_logits_op.op, (x[:256], w, b))

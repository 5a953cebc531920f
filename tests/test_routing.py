"""Router, routing metadata, combine, gather and the MoE block on CPU (kernels under the interpreter).

Routing and permutations must match exactly; numerics against float64 within PyTorch's own bf16 error.
"""

import pytest
import torch

import moekit
from moekit import MoE, combine, combine_ref, gather_rows, router_topk_ref, routing_metadata_ref, topk_router
from moekit.bench.baselines import TorchtitanMoE
from moekit.gate import router_logits_bwd_fwd, router_logits_bwd_ref, split_router_logits_fwd, split_router_logits_ref
from moekit.routing import (
    _router_topk_op,
    gather_token_rows,
    router_topk_fwd,
    routing_metadata_fwd,
    topk_weights_grad_fwd,
    topk_weights_grad_ref,
)
from moekit.testing import assert_within_baseline

BF16 = torch.bfloat16


def _ids(t, e, k, *, hot=None):
    """(T, K) distinct expert ids per token; ``hot`` forces every token onto experts 0..K-1."""
    if hot:
        return torch.arange(k, dtype=torch.int32).repeat(t, 1)
    return torch.rand(t, e).topk(k, -1).indices.to(torch.int32)


@pytest.mark.parametrize(
    "t, e, k, hot",
    [
        pytest.param(37, 8, 2, False, id="odd-t"),  # partial metadata block
        pytest.param(300, 128, 8, False, id="qwen-like"),  # several blocks, E=128
        pytest.param(700, 128, 8, False, id="scan-loops"),  # more blocks than the scan's row chunk
        pytest.param(300, 12, 3, False, id="e-not-pow2"),  # a scan program with masked expert columns
        pytest.param(1, 4, 4, False, id="t1-k-eq-e"),  # T=1 and K=E
        pytest.param(200, 16, 1, True, id="all-on-one"),  # every token on expert 0; 15 empty experts
        pytest.param(0, 8, 2, False, id="t0"),  # no tokens
    ],
)
def test_route_metadata_matches_stable_argsort(interpreter, t, e, k, hot):
    ids = _ids(t, e, k, hot=hot)
    got = routing_metadata_fwd(ids, e)
    want = routing_metadata_ref(ids, e)
    for name, a, b in zip(("counts", "offs", "token_idx", "row_of"), got, want, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_router(interpreter, score_func, renormalize):
    x = torch.randn(50, 32)
    w, b = torch.randn(8, 32), torch.randn(8)
    r = topk_router(x, w, b, top_k=3, score_func=score_func, renormalize=renormalize, aux_loss=True)
    logits = x.double() @ w.double().T + b.double()
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    ids = scores.topk(3, -1).indices
    assert torch.equal(r.experts.long(), ids)
    want = scores.gather(1, ids)
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(r.weights.double(), want, rtol=1e-5, atol=1e-6)
    counts = torch.bincount(ids.flatten(), minlength=8)
    assert torch.equal(r.counts.long(), counts)
    loss = 8 * (counts.double() / ids.numel() * scores.mean(0)).sum()
    torch.testing.assert_close(r.aux_loss.double(), loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("biases", [False, True], ids=["no-biases", "biases"])
def test_fused_router_equals_its_composition_and_saves_only_the_scores(interpreter, score_func, renormalize, biases):
    """topk_router without aux loss is one op whose backward reads the scores it saved (and recomputes
    nothing): its weights, experts and the gradients of x, the gate weight and its bias are those of the
    composition that aux_loss=True runs (router_logits, the scores, the top-k kernel), bit for bit (through
    a softmax, up to the rounding of its backward's row sum, which the op takes in the top-k weights'
    kernel), and the one (T, E) tensor it saves for the backward is the fp32 scores."""
    t, d, e, k = 40, 24, 12, 3
    x = torch.randn(t, d, dtype=BF16, requires_grad=True)
    w = (torch.randn(e, d) * 0.3).requires_grad_()
    b = torch.randn(e).requires_grad_() if biases else None
    eb = torch.randn(e) * 0.1 if biases else None
    params = [p for p in (x, w, b) if p is not None]
    saved = []

    def pack(s):
        saved.append(tuple(s.shape))
        return s

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
        r = topk_router(x, w, b, top_k=k, score_func=score_func, renormalize=renormalize, expert_bias=eb)
    assert saved.count((t, e)) == 1, saved
    composed = topk_router(x, w, b, top_k=k, score_func=score_func, renormalize=renormalize, expert_bias=eb,
                           aux_loss=True)
    want_w, want_ids = composed.weights, composed.experts
    assert torch.equal(r.experts, want_ids) and torch.equal(r.weights, want_w)
    dw = torch.randn(t, k)
    got = torch.autograd.grad(r.weights, params, dw)
    want = torch.autograd.grad(want_w, params, dw)
    for g, h in zip(got, want, strict=True):
        if score_func == "sigmoid":
            assert torch.equal(g, h), (g - h).abs().max()
        else:  # the softmax backward's row sum in the top-k kernel's order: fp32 rounding, then x's bf16
            tol = 2.0 ** -7 if g.dtype == BF16 else 1e-6
            torch.testing.assert_close(g, h, rtol=tol, atol=tol * h.abs().max().item())


def test_fused_router_under_autocast_recomputes_the_forwards_logits(interpreter):
    """Under torch.autocast the logits stay fp32 in the forward and in the backward's recomputation, so
    the gradients are those outside autocast."""
    x = torch.randn(40, 24, requires_grad=True)
    w = torch.randn(12, 24, requires_grad=True)
    dw = torch.randn(40, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = topk_router(x, w, top_k=3)
    got = torch.autograd.grad(r.weights, [x, w], dw)
    plain = topk_router(x, w, top_k=3)
    assert torch.equal(r.experts, plain.experts) and torch.equal(r.weights, plain.weights)
    for g, h in zip(got, torch.autograd.grad(plain.weights, [x, w], dw), strict=True):
        assert torch.equal(g, h)


def _tricky_logits(t, e):
    """Random fp32 logits with exact ties, -0 against +0, -inf, and a NaN in some rows."""
    lg = torch.randn(t, e)
    lg[::3, 1] = lg[::3, 4 % e]  # exact ties
    lg[1::5, : min(e, 6)] = 0.5  # a run of equal logits
    lg[2::7, 0], lg[2::7, e - 1] = -0.0, 0.0
    lg[4::9, e // 2] = float("-inf")
    lg[5, e // 3] = float("nan")
    return lg


def _scores(lg, score_func):
    return lg.softmax(-1) if score_func == "softmax" else lg.sigmoid()


@pytest.mark.parametrize("e, k", [(8, 2), (40, 8), (128, 8), (6, 6)], ids=["e8k2", "e40k8", "e128k8", "k-eq-e"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "expert-bias"])
def test_router_topk_kernel_matches_reference(interpreter, e, k, score_func, renormalize, biased):
    """The fused top-k kernel picks exactly the reference's experts (ties to the lower index, NaN
    first, -0 equal to +0; on the logits, or on scores + expert bias) and gives its weights to fp32
    rounding; T = 0 gives empty outputs."""
    lg = _tricky_logits(67, e)
    bias = torch.randn(e) * 0.05 if biased else None
    scores = _scores(lg, score_func)
    key = lg if bias is None else scores + bias
    w, ids = router_topk_fwd(key, scores, k, renormalize)
    w_ref, ids_ref = router_topk_ref(lg, k, score_func=score_func, renormalize=renormalize, expert_bias=bias)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=2e-6, atol=1e-7, equal_nan=True)
    if biased:  # the bias added in the kernel: the same choice and bits as on the stored sum
        w2, ids2 = router_topk_fwd(scores, scores, k, renormalize, bias)
        assert torch.equal(ids2, ids)
        torch.testing.assert_close(w2, w, rtol=0, atol=0, equal_nan=True)
    w0, ids0 = router_topk_fwd(key[:0], scores[:0], k, renormalize)
    assert w0.shape == ids0.shape == (0, k)
    with pytest.raises(ValueError, match="top_k"):
        router_topk_fwd(key, scores, e + 1, renormalize)
    for wrong in (torch.zeros(e + 1), torch.zeros(e, dtype=torch.float64)):
        with pytest.raises(ValueError, match="expert bias"):
            router_topk_fwd(scores, scores, k, renormalize, wrong)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_router_topk_backward_against_autograd(interpreter, score_func, renormalize):
    """The fused router's gradient to the logits equals autograd through the reference in float64."""
    lg = torch.randn(33, 16, requires_grad=True)
    w, ids = _router_topk_op(lg.detach(), _scores(lg, score_func), 4, renormalize)
    dw = torch.randn_like(w)
    (got,) = torch.autograd.grad(w, lg, dw)
    lg64 = lg.detach().double().requires_grad_()
    w_ref, ids_ref = router_topk_ref(lg64, 4, score_func=score_func, renormalize=renormalize)
    (want,) = torch.autograd.grad(w_ref, lg64, dw.double())
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("t, e, k", [(37, 16, 4), (5, 128, 8), (9, 6, 6)], ids=["e16k4", "e128k8", "k-eq-e"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
def test_topk_weights_grad_kernel_matches_reference(interpreter, t, e, k, renormalize):
    """The one-kernel scores' gradient equals the torch formula: the K chosen entries per row (through
    the renormalization, including a row whose chosen scores sum below its 1e-20 clamp), exact zeros
    elsewhere, every entry written."""
    scores = torch.rand(t, e)
    scores[0] = 1e-21  # the chosen scores sum below the 1e-20 clamp: the divisor is a constant there
    experts = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    dw = torch.randn(t, k)
    got = topk_weights_grad_fwd(dw, scores, experts, renormalize)
    want = topk_weights_grad_ref(dw.double(), scores.double(), experts.long(), renormalize)
    chosen = torch.zeros(t, e, dtype=torch.bool).scatter(1, experts.long(), True)
    assert torch.equal(got[~chosen], torch.zeros_like(got[~chosen]))
    err = (got.double() - want).abs().amax(1) / want.abs().amax(1)  # per row, relative to its largest entry
    assert err.max() < 1e-6, err.max()
    assert topk_weights_grad_fwd(dw[:0], scores[:0], experts[:0], renormalize).shape == (0, e)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("t, e, k", [(37, 16, 4), (5, 128, 8), (9, 6, 6)], ids=["e16k4", "e128k8", "k-eq-e"])
def test_topk_weights_grad_kernel_through_the_score_function(interpreter, t, e, k, score_func):
    """With score_func the kernel returns the logits' gradient: torch's softmax / sigmoid backward of the
    scores' gradient, against float64 within 4x the error of torch's fp32 composition, every entry written
    (the softmax's off the chosen columns too); the
    sigmoid's bit for bit against torch's fp32 backward of the kernel's own scores' gradient; a NaN
    score propagates as through torch's backward."""
    logits = torch.randn(t, e) * 3
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    experts = scores.topk(k, -1).indices.to(torch.int32)
    dw = torch.randn(t, k)
    for renormalize in (True, False):
        got = topk_weights_grad_fwd(dw, scores, experts, renormalize, score_func)
        want = topk_weights_grad_ref(dw.double(), scores.double(), experts.long(), renormalize, score_func)
        torch32 = topk_weights_grad_ref(dw, scores, experts.long(), renormalize, score_func)
        err, err32 = ((a.double() - want).abs().amax(1) / want.abs().amax(1) for a in (got, torch32))
        assert err.max() < max(4 * err32.max(), 1e-6), (err.max(), err32.max())  # torch fp32 order
        if score_func == "sigmoid":
            ds = topk_weights_grad_fwd(dw, scores, experts, renormalize)
            assert torch.equal(got, torch.ops.aten.sigmoid_backward(ds, scores))
        elif not renormalize:  # off the chosen columns too: -s_j * sum
            assert (got != 0).all()
    scores[1, 0] = float("nan")
    got = topk_weights_grad_fwd(dw, scores, experts, True, score_func)
    want = topk_weights_grad_ref(dw, scores, experts.long(), True, score_func)
    assert torch.equal(got.isnan(), want.isnan()) and got[1].isnan().any()
    assert topk_weights_grad_fwd(dw[:0], scores[:0], experts[:0], True, score_func).shape == (0, e)
    with pytest.raises(ValueError, match="score_func"):
        topk_weights_grad_fwd(dw, scores, experts, True, "tanh")
    with pytest.raises(ValueError, match="score_func"):
        topk_weights_grad_ref(dw, scores, experts.long(), True, "tanh")


def split_bf16_case(device):
    """fp32 weights of every magnitude (subnormal ones too) and the special values, and the bf16 terms
    [hi; lo] that torch's casts give them."""
    w = torch.randn(7, 33, device=device) * torch.logspace(-40, 38, 33, device=device)
    w[0, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.3895e38])
    hi = w.to(torch.bfloat16)
    return w, torch.cat([hi, (w - hi.float()).to(torch.bfloat16)])


def test_router_logits_kernel_splits_the_weight_as_torch(interpreter):
    """The router-logits kernel splits the fp32 gate weight into torch's two bf16 terms (round to nearest
    even for both): with x the identity, each logit is one weight's hi + lo, bit for bit against the
    reference (NaN as NaN; a 0 * inf product makes a row with an inf NaN, as in any GEMM). On the CPU
    this checks the kernel's arithmetic under the interpreter's casts (conftest.py rounds them as the GPU
    does, but drops fp32 subnormals' bits); the hardware's are compared on the GPU (test_routing_gpu.py)."""
    w, split = split_bf16_case("cpu")
    x = torch.eye(w.shape[1], dtype=BF16)
    got, want = split_router_logits_fwd(x, w, None), split_router_logits_ref(x, w, None)
    assert torch.equal(got.isnan(), want.isnan())
    keep = ((w == 0) | (w.abs() >= 1e-30)).t() & ~want.isnan()  # hi and lo both normal or zero
    assert keep.sum() > 150
    assert torch.equal(got[keep], want[keep])
    assert torch.equal(want[keep], (split[:7].float() + split[7:].float()).t()[keep])  # (the reference's split)


@pytest.mark.parametrize("t, e, d", [(0, 8, 64), (1, 1, 16), (37, 12, 33), (130, 130, 200)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_router_logits_kernel_against_float64(interpreter, t, e, d, bias):
    """One kernel for the router's fp32 logits of bf16 tokens: against the split reference up to the
    order of fp32 sums, and against float64 to the split's ~16 bits; odd sizes, two expert blocks
    (E = 130), no tokens, tokens with a stride."""
    torch.manual_seed(t + e)
    x = torch.randn(t, 2 * d).to(BF16)[:, ::2]  # (stride 2 along D)
    w, b = torch.randn(e, d) * 0.05, (torch.randn(e) if bias else None)
    got = split_router_logits_fwd(x, w, b)
    assert got.shape == (t, e) and got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, split_router_logits_ref(x, w, b), rtol=1e-6, atol=1e-6)
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert ((got.double() - want).abs().max() <= 1e-5 * (x.double().abs() @ w.double().abs().t()).max()) if t else True
    with pytest.raises(ValueError, match="bf16"):
        split_router_logits_fwd(x.float(), w, b)


def test_router_topk_double_backward(interpreter):
    """A gradient of the top-k weights' gradient (``create_graph=True``) goes through the differentiable
    reference and matches float64 autograd through ``router_topk_ref``."""
    lg = torch.randn(21, 12, requires_grad=True)
    c = torch.randn(21, 4)
    w, _ = _router_topk_op(lg.detach(), lg.softmax(-1), 4, True)
    (g,) = torch.autograd.grad((w * c).sum(), lg, create_graph=True)
    g.square().sum().backward()
    lg64 = lg.detach().double().requires_grad_()
    w64, _ = router_topk_ref(lg64, 4, renormalize=True)
    (g64,) = torch.autograd.grad((w64 * c.double()).sum(), lg64, create_graph=True)
    g64.square().sum().backward()
    torch.testing.assert_close(lg.grad.double(), lg64.grad, rtol=1e-4, atol=1e-6)


def test_expert_bias_changes_choice_not_weights(interpreter):
    x, w = torch.randn(40, 16), torch.randn(4, 16)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 is chosen by everyone
    r = topk_router(x, w, top_k=1, expert_bias=bias, renormalize=False)
    assert (r.experts == 3).all()
    torch.testing.assert_close(r.weights[:, 0], (x @ w.T).softmax(-1)[:, 3])


def test_combine_and_gather_against_float64(interpreter):
    t, e, k, d = 33, 8, 3, 40
    ids = _ids(t, e, k)
    _, _, token_idx, row_of = routing_metadata_fwd(ids, e)
    y = torch.randn(t * k, d).to(BF16).requires_grad_()
    w = torch.rand(t, k).requires_grad_()
    out = combine(y, w, row_of)
    dout = torch.randn(t, d).to(BF16)
    out.backward(dout)
    y64, w64 = y.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = combine_ref(y64, w64, row_of)
    ref.backward(dout.double())
    y16, w16 = y.detach().requires_grad_(), w.detach().requires_grad_()
    base = combine_ref(y16, w16, row_of)
    base.backward(dout)
    assert_within_baseline(out, ref, base, what="combine")
    assert_within_baseline(y.grad, y64.grad, y16.grad, what="dy")
    assert_within_baseline(w.grad, w64.grad, w16.grad, what="dw")

    class _R:  # the routing fields gather_rows reads
        pass

    r = _R()
    r.token_idx, r.row_of = token_idx, row_of
    x = torch.randn(t, d).to(BF16).requires_grad_()
    xs = gather_rows(x, r)
    assert torch.equal(xs, x.detach()[token_idx.long()])
    g = torch.randn_like(xs)
    xs.backward(g)
    want = torch.zeros(t, d, dtype=torch.float64).index_add_(0, token_idx.long(), g.double())
    assert_within_baseline(x.grad, want, torch.zeros(t, d).index_add_(0, token_idx.long(), g.float()).to(BF16))


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "plain"])
def test_combine_and_gather_with_absent_choices(interpreter, weighted):
    """Negative row_of entries (expert parallelism's choices on other ranks) add nothing, get zero
    weight gradients and name no row; the other entries name each of the R < T*K rows once."""
    t, k, d = 31, 4, 40
    present = torch.rand(t, k) < 0.6
    present[0] = False  # a token with no choice here
    present[1] = True  # one with all of them
    r = int(present.sum())
    row_of = torch.full((t, k), -1, dtype=torch.int32)
    row_of[present] = torch.randperm(r, dtype=torch.int32)
    y = torch.randn(r, d).to(BF16).requires_grad_()
    w = torch.rand(t, k).requires_grad_() if weighted else None
    out = combine(y, w, row_of)
    dout = torch.randn(t, d).to(BF16)
    out.backward(dout)
    mask = present.double()[..., None]
    w64 = torch.ones(t, k, dtype=torch.float64) if w is None else w.detach().double()
    ref = (y.detach().double()[row_of.clamp_min(0).long()] * mask * w64[..., None]).sum(1)
    assert_within_baseline(out, ref, combine_ref(y.detach(), w, row_of), what="combine")
    assert torch.equal(out[0], torch.zeros(d, dtype=BF16))
    dy = torch.zeros(r, d, dtype=torch.float64)
    dy[row_of[present].long()] = (dout.double()[:, None, :] * w64[..., None]).expand(t, k, d)[present]
    torch.testing.assert_close(y.grad.double(), dy, rtol=2**-8, atol=0)
    if weighted:
        dw = (dout.double()[:, None, :] * y.detach().double()[row_of.clamp_min(0).long()]).sum(-1) * present
        torch.testing.assert_close(w.grad.double(), dw, rtol=1e-2, atol=1e-2)
        assert (w.grad[~present] == 0).all()

    token_idx = torch.empty(r, dtype=torch.int32)
    token_idx[row_of[present].long()] = torch.arange(t, dtype=torch.int32)[:, None].expand(t, k)[present]
    x = torch.randn(t, d).to(BF16).requires_grad_()
    xs = gather_token_rows(x, token_idx, row_of)
    assert torch.equal(xs, x.detach()[token_idx.long()])
    g = torch.randn_like(xs)
    xs.backward(g)
    want = torch.zeros(t, d, dtype=torch.float64).index_add_(0, token_idx.long(), g.double())
    assert_within_baseline(x.grad, want, torch.zeros(t, d).index_add_(0, token_idx.long(), g.float()).to(BF16))


@pytest.mark.parametrize("t, e, d", [(0, 8, 64), (1, 1, 16), (37, 12, 33), (130, 80, 200)])
@pytest.mark.parametrize("need_x, need_w", [(True, True), (True, False), (False, True)])
def test_router_logits_backward_kernel_against_float64(interpreter, t, e, d, need_x, need_w):
    """One kernel for the router GEMM's input gradients (dx bf16, dW fp32) from the logits' fp32 gradient
    rounded to bf16: against the reference up to the order of fp32 sums and against float64 of the same
    rounded operands; each gradient alone, odd sizes, two expert tiles along E (E = 80), no tokens (dW
    zero), strided tokens; outputs poisoned first."""
    torch.manual_seed(t + e + d)
    x = torch.randn(t, 2 * d).to(BF16)[:, ::2]
    w, g = torch.randn(e, d) * 0.05, torch.randn(t, e)
    with moekit.options(poison=True):
        dx, dw = router_logits_bwd_fwd(g, x, w, need_x, need_w)
    rx, rw = router_logits_bwd_ref(g, x, w)
    g64 = g.to(BF16).double()
    if need_x:
        assert dx.shape == (t, d) and dx.dtype == BF16
        torch.testing.assert_close(dx, rx, rtol=1e-2, atol=1e-6)  # (one bf16 rounding apart at most)
        assert_within_baseline(dx, g64 @ w.to(BF16).double(), rx)
    else:
        assert dx.numel() == 0
    if need_w:
        assert dw.shape == (e, d) and dw.dtype == torch.float32
        torch.testing.assert_close(dw, rw, rtol=1e-5, atol=1e-5)
        want = g64.t() @ x.double()
        assert (dw.double() - want).abs().max() <= 1e-5 * max(1.0, (g64.abs().t() @ x.double().abs()).max())
    else:
        assert dw.numel() == 0
    if need_x:  # another gradient of x added in the kernel, with the bits of torch's bf16 add
        other = torch.randn(t, d).to(BF16)
        got, _ = router_logits_bwd_fwd(g, x, w, True, need_w, dx_add=other)
        assert torch.equal(got, other + dx)
        with pytest.raises(ValueError, match="dx_add"):
            router_logits_bwd_fwd(g, x, w, True, need_w, dx_add=other.float())


def test_router_logits_backward_op_schema(interpreter):
    """The router backward's custom op, with and without the added gradient of x: schema, fake and
    dispatch checks (torch.library.opcheck)."""
    from moekit.gate import router_logits_bwd_op

    x, w, g = torch.randn(9, 20).to(BF16), torch.randn(5, 20), torch.randn(9, 5)
    for args in ((g, x, w, True, True), (g, x, w, True, False, torch.randn(9, 20).to(BF16)), (g, x, w, False, True)):
        torch.library.opcheck(router_logits_bwd_op.op, args)
    for reference in (False, True):  # the same error on the kernel's path and the reference's
        with moekit.options(reference=reference), pytest.raises(ValueError, match="dx_add must be"):
            router_logits_bwd_op(g, x, w, True, True, torch.randn(9, 21).to(BF16))


def test_plain_combine_and_sorted_weights(interpreter):
    """combine without weights is a plain sum whose backward copies each token's gradient to its K
    rows (y is not saved); sorted_weights puts the (T, K) weights in expert-sorted row order."""
    from moekit import sorted_weights

    t, e, k, d = 29, 8, 3, 40
    _, _, _, row_of = routing_metadata_fwd(_ids(t, e, k), e)
    y = torch.randn(t * k, d).to(BF16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        out = combine(y, None, row_of)
    assert not any(x is y for x in saved)
    dout = torch.randn(t, d).to(BF16)
    out.backward(dout)
    want = y.detach().double()[row_of.long()].sum(1)
    assert_within_baseline(out, want, combine_ref(y.detach(), None, row_of), what="plain combine")
    expect = torch.empty_like(y)
    expect[row_of.flatten().long()] = dout.repeat_interleave(k, 0)
    assert torch.equal(y.grad, expect)

    w = torch.rand(t, k).requires_grad_()
    s = sorted_weights(w, row_of)
    assert torch.equal(s[row_of.long()], w.detach())
    g = torch.randn(t * k)
    s.backward(g)
    assert torch.equal(w.grad, g[row_of.long()])
    # absent choices (-1) scatter nothing and get a zero gradient; a NaN gradient reaches its weight
    absent = row_of.clone()
    absent[::4, 0] = -1
    w = torch.rand(t, k).requires_grad_()
    g[row_of[1, 1]] = float("nan")
    sorted_weights(w, absent).backward(g)
    torch.testing.assert_close(w.grad, torch.where(absent >= 0, g[absent.clamp(min=0).long()], 0.0), rtol=0, atol=0,
                               equal_nan=True)
    assert w.grad[0, 0] == 0 and w.grad[1, 1].isnan()


BLOCKS = {  # the gpt-oss block, and the bias-free plain-SwiGLU block of Qwen3 / Mixtral / DeepSeek / OLMoE
    "gpt-oss": {},
    "plain": dict(bias=False, router_bias=False, activation="swiglu"),
}


@pytest.mark.parametrize("block", list(BLOCKS))
def test_moe_matches_torchtitan_block(interpreter, block):
    torch.manual_seed(7)
    moe = MoE(32, 24, 8, 2, dtype=BF16, **BLOCKS[block])
    base = TorchtitanMoE(moe)
    x = (torch.randn(2, 20, 32) * 2).to(BF16).requires_grad_()
    out = moe(x)
    ref = base(x)
    assert out.shape == x.shape
    moe32 = MoE(32, 24, 8, 2, dtype=torch.float32, **BLOCKS[block])
    moe32.load_state_dict({k: v.float() for k, v in moe.state_dict().items()})
    oracle = TorchtitanMoE(moe32)(x.detach().float())
    assert_within_baseline(out, oracle, ref, what="moe")
    dy = torch.randn_like(out)
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    dx = x.grad.clone()
    moe.zero_grad()
    x.grad = None
    base(x).backward(dy)
    for name, p in moe.named_parameters():
        assert p.grad is not None and torch.isfinite(grads[name]).all(), name
        rel = (grads[name].float() - p.grad.float()).norm() / p.grad.float().norm().clamp_min(1e-12)
        assert rel < 0.05, (name, float(rel))
    assert ((dx.float() - x.grad.float()).norm() / x.grad.float().norm()) < 0.05


def test_moe_balancing_state(interpreter):
    moe = MoE(16, 8, 4, 2, dtype=BF16, aux_loss=True)
    moe(torch.randn(10, 16).to(BF16))
    assert moe.tokens_per_expert.sum() == 20 and moe.aux_loss is not None
    moe.update_expert_bias(0.1)
    assert moe.tokens_per_expert.sum() == 0 and moe.expert_bias.abs().sum() > 0


def test_routed_counts_stay_exact_under_a_cast(interpreter):
    """A cast of the whole block (``.to(torch.bfloat16)``) leaves the routed counts int64: a bf16 count
    stops counting exactly past 256."""
    moe = MoE(16, 8, 4, 2).to(BF16)
    moe(torch.randn(300, 16).to(BF16))
    assert moe.tokens_per_expert.dtype == torch.int64 and moe.tokens_per_expert.sum() == 600


def test_bias_free_block_has_no_bias_parameters():
    moe = MoE(16, 8, 4, 2, **BLOCKS["plain"])
    assert set(dict(moe.named_parameters())) == {"router.weight", "experts.mlp1_weight_EGD", "experts.mlp2_weight_EDF"}
    assert moe.experts.swiglu["swiglu_limit"] is None and moe.experts.swiglu["swiglu_alpha"] == 1.0


def test_weight_gradients_arrive_in_the_parameter_layout(interpreter):
    """Without biases the expert weight gradients come out in the (E, N, K) parameters' own layout,
    so .backward() accumulates them without a strided copy."""
    moe = MoE(32, 24, 8, 2, dtype=BF16, **BLOCKS["plain"])
    w1, w2 = moe.experts.mlp1_weight_EGD, moe.experts.mlp2_weight_EDF
    g1, g2 = torch.autograd.grad(moe(torch.randn(20, 32).to(BF16)).float().sum(), [w1, w2])
    assert g1.is_contiguous() and g2.is_contiguous() and not g1.isnan().any() and not g2.isnan().any()


@pytest.mark.parametrize("mutate, error, match", [
    pytest.param(lambda y, w, r: (y[None], w, r), ValueError, "y \\(R, D\\)", id="y-3d"),
    pytest.param(lambda y, w, r: (y, w[:, :1], r), ValueError, "weights \\(T, K\\)", id="weights-shape"),
    pytest.param(lambda y, w, r: (y, w, r.long()), TypeError, "row_of int32", id="row-of-int64"),
    pytest.param(lambda y, w, r: (y, w.to("meta"), r), ValueError, "one device", id="devices"),
])
def test_combine_rejects_bad_inputs(mutate, error, match):
    y, w, r = torch.randn(8, 16).to(BF16), torch.rand(4, 2), torch.arange(8, dtype=torch.int32).view(4, 2)
    with pytest.raises(error, match=match):
        combine(*mutate(y, w, r))


def test_combine_reads_a_transposed_row_of(interpreter):
    """row_of may be any (T, K) view: the kernel indexes it densely, so the op hands it over contiguous."""
    y, w = torch.randn(12, 16).to(BF16), torch.rand(6, 2)
    row_of = torch.randperm(12, dtype=torch.int32).view(2, 6).mT  # (6, 2), not contiguous
    assert torch.equal(combine(y, w, row_of), combine_ref(y, w, row_of))


@pytest.mark.parametrize("reference", [False, True], ids=["kernels", "reference"])
def test_routing_metadata_drops_ids_outside_the_experts(interpreter, reference):
    """Ids outside [0, E) (the expert-parallel sentinel E, or bad ids) are counted nowhere and sorted
    after every expert's rows: past offs[-1], where nothing is computed; no write leaves the outputs."""
    import moekit
    from moekit import routing_metadata

    e = 6
    ids = torch.randint(0, e, (50, 3), dtype=torch.int32)
    ids[::4, 0] = e
    ids[1::7, 2] = -1
    ids[2::9, 1] = 1000
    bad = (ids < 0) | (ids >= e)
    with moekit.options(reference=reference):
        counts, offs, token_idx, row_of = routing_metadata(ids, e)
    want = torch.bincount(ids[~bad].long(), minlength=e)
    assert counts.tolist() == want.tolist() and offs.tolist() == want.cumsum(0).tolist()
    assert (row_of[bad] >= offs[-1]).all() and (row_of[~bad] < offs[-1]).all()
    assert sorted(row_of.flatten().tolist()) == list(range(150))  # a permutation: every row written once
    assert torch.equal(token_idx[row_of.flatten().long()], torch.arange(150, dtype=torch.int32) // 3)


def test_dispatch_is_the_routing_rows_whole():
    """``routing_metadata`` returns a ``Dispatch`` that unpacks as its old 4-tuple, ``Routing.dispatch`` is
    the router's, and ``GroupedExperts.routed`` on it is the permute-free ``forward`` with its tensors."""
    torch.manual_seed(0)
    x = torch.randn(12, 32, dtype=torch.bfloat16)
    r = moekit.topk_router(x, torch.randn(4, 32), None, top_k=2)
    d = moekit.routing_metadata(r.experts, 4)
    counts, offs, token_idx, row_of = d
    assert isinstance(d, moekit.Dispatch) and d.counts is counts and d.row_of is row_of
    for a, b in zip(d, r.dispatch, strict=True):
        assert torch.equal(a, b)
    experts = moekit.GroupedExperts(32, 16, 4, dtype=torch.bfloat16)
    with moekit.options(reference=True):
        got = experts.routed(x, r.dispatch)
        want = experts(x, r.counts, r.token_idx, r.row_of, None, r.offs)
    assert torch.equal(got, want) and got.shape == (r.token_idx.numel(), 32)

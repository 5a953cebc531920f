"""NaN and inf propagate through every op family as through the float64 reference: a non-finite input
is never turned into a finite output and reaches exactly the entries it reaches there (README,
"Non-finite values").

- grouped_mm (forward; dgrad and wgrad through autograd; 3D x 3D), the expert ops (sorted and
  permute-free rows, row scales, every gradient): NaN and inf entries as in float64.
- Routing: a NaN token's logits are all NaN, which count as the largest keys, ties to the lower index
  (``router_topk_ref``): it goes to experts 0..K-1 with NaN weights, as in float64; an inf token too.
- The MoE block: a NaN or an inf in one token stays in its output row; the output and every gradient
  have the NaN and inf entries of the block computed in float64.
- SwiGLU (standalone and fused into the up-projection, forward and backward): NaN in, NaN out, as
  ``torch.clamp`` gives. On the GPU ``tl.minimum`` would return the limit for a NaN (``min.f32``), while
  the interpreter propagates it; the kernels clamp with selects, so both agree with the reference.
- NVFP4 quantization: a block holding a NaN or an inf gets the NaN scale (``tests/test_nvfp4.py`` checks
  the bits); here the NVFP4 GEMM and the NVFP4 training block carry the NaN to their outputs and to
  every gradient the bf16 block makes NaN, instead of quantizing it to 0.

Each test runs on the CPU (the references, and the kernels under the interpreter) and on the GPU (the
``_gpu`` twins; ``_randn`` draws on the CPU, so that a twin sees the CPU run's numbers).
"""
import pytest
import torch

import moekit
from moekit import MoE, grouped_mm_swiglu, grouped_mm_swiglu_ref, nvfp4, swiglu
from moekit.epilogue import SwiGLU, swiglu_bwd_torch, swiglu_torch
from moekit.gate import router_logits_op
from moekit.nvfp4 import TrainingRecipe
from moekit.testing import offs_from_counts

BF16 = torch.bfloat16
DEV = "cuda"
gpu = pytest.mark.gpu
GPT_OSS = dict(swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_linear_offset=1.0, gate_up_layout="interleaved")
PLAIN = dict(swiglu_alpha=1.0, swiglu_limit=None, swiglu_linear_offset=0.0, gate_up_layout="halves")


NAN, INF = float("nan"), float("inf")
PATHS = ["reference", "interpreter"]  # the CPU runs: pure PyTorch, or the Triton kernels interpreted
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # (numpy, on NaN)


def _spec(kw):
    return SwiGLU(kw["swiglu_alpha"], kw["swiglu_limit"], kw["swiglu_linear_offset"], kw["gate_up_layout"])


def _randn(*shape, scale=1.0):
    """bf16 normal values drawn on the CPU, so that a GPU twin gets the same numbers."""
    return (torch.randn(*shape) * scale).to(BF16)


def _same_nan_inf(got, want, what):
    """NaN and +-inf exactly where the float64 reference has them."""
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape, what
    for name, test in (("NaN", torch.isnan), ("inf", torch.isinf)):
        diff = test(got) != test(want)
        assert not diff.any(), f"{what}: {name} at {diff.nonzero()[:6].tolist()} differs from float64"


def _on_path(request, path):
    if path == "interpreter":
        request.getfixturevalue("interpreter")
    return moekit.options(reference=path == "reference")


# ---- grouped_mm -----------------------------------------------------------------------------------


def _check_grouped_mm(device, counts=(5, 0, 7, 4), k=32, n=24):
    """NaN and inf in rows of x, a NaN in one expert's weight, a NaN in the output gradient: the forward,
    the dgrad and the wgrad (through autograd) and the 3D x 3D form have float64's NaN and inf entries."""
    m = sum(counts) + 4  # 4 rows past offs[-1]: zero in the output and in dx
    a, b, dy = _randn(m, k), _randn(len(counts), k, n), _randn(m, n)
    a[1, 3], a[8, 0], b[3, 5, 7], dy[2, 4] = NAN, INF, NAN, NAN
    offs = offs_from_counts(list(counts))
    res = []
    for mm, dev, dt in ((moekit.grouped_mm, device, BF16), (moekit.grouped_mm_ref, "cpu", torch.float64)):
        ta, tb = a.to(dev, dt, copy=True).requires_grad_(), b.to(dev, dt, copy=True).requires_grad_()
        out = mm(ta, tb, offs.to(dev))
        out.backward(dy.to(dev, dt))
        res.append((out, ta.grad, tb.grad))
    for name, got, want in zip(("out", "dx", "dw"), *res, strict=True):
        _same_nan_inf(got, want, name)
    out, dx, dw = res[0]
    assert out[1].isnan().all() and out[8].isinf().all() and out[offs[2] : offs[3], 7].isnan().all()
    assert dx[2].isnan().all() and dw[0, 3].isnan().all() and dw[0, :, 4].isnan().all() and not dw[1].any()
    a3, b3 = _randn(3, 8, k), _randn(3, k, n)
    a3[1, 2, 3], b3[2, 0, 5] = NAN, INF
    out3 = moekit.grouped_mm(a3.to(device), b3.to(device))
    _same_nan_inf(out3, torch.bmm(a3.double(), b3.double()), "3d x 3d")


@pytest.mark.parametrize("path", PATHS)
def test_grouped_mm_propagates_nan_and_inf(request, path):
    with _on_path(request, path):
        _check_grouped_mm("cpu")


@gpu
@pytest.mark.parametrize("sizes", [((5, 0, 7, 4), 32, 24), ((300, 0, 517, 180), 256, 256)], ids=["small", "large"])
def test_grouped_mm_propagates_nan_and_inf_gpu(tma_path, sizes):
    _check_grouped_mm(DEV, *sizes)


# ---- the expert ops -------------------------------------------------------------------------------


def _check_expert_ops(device, kw, gathered, counts=(6, 0, 9, 5), d=32, f=32):
    """Up-projection with bias + SwiGLU, down-projection with bias, and every gradient (x, both weights,
    both biases, and the row scales when gathered), with a NaN token and an inf token: h, aux, the
    output and the gradients have float64's NaN and inf entries. ``gathered``: permute-free rows
    (token_idx / row_of of sum(counts) / 2 tokens' random top-2) with row scales, as the block runs them."""
    e = len(counts)
    w1, b1 = _randn(e, d, 2 * f, scale=d**-0.5), _randn(e, 2 * f)
    w2, b2 = _randn(e, f, d, scale=f**-0.5), _randn(e, d)
    if gathered:
        t = sum(counts) // 2
        ids = torch.rand(t, e).topk(2, -1).indices
        _, offs, token_idx, row_of = moekit.routing_metadata_ref(ids, e)
        scale = torch.rand(2 * t)
    else:
        t, offs = sum(counts), offs_from_counts(list(counts))
    x = _randn(t, d)
    x[2, 1], x[7, 4] = NAN, INF
    dy = _randn(int(offs[-1]), d)
    res = []
    for dev, dt in ((device, BF16), ("cpu", torch.float64)):
        leaves = [v.to(dev, dt, copy=True).requires_grad_() for v in (x, w1, b1, w2, b2)]
        tx, tw1, tb1, tw2, tb2 = leaves
        o, extra = offs.to(dev), {}
        if gathered:
            leaves.append(scale.to(dev, torch.float32 if dt == BF16 else dt, copy=True).requires_grad_())
            extra = dict(row_scale=leaves[-1])
        if dt == BF16:
            route = dict(token_idx=token_idx.to(dev), row_of=row_of.to(dev)) if gathered else {}
            h, aux = grouped_mm_swiglu(tx, tw1, o, bias=tb1, **route, **extra, **kw)
            out = moekit.grouped_mm_downproj(h, tw2, o, bias=tb2, aux_biased_acc=aux, **extra, **kw)
        else:
            rows = tx[token_idx.long()] if gathered else tx
            h, aux = grouped_mm_swiglu_ref(rows, tw1, o, bias=tb1, **extra, **kw)
            out = moekit.grouped_mm_downproj_ref(h, tw2, o, bias=tb2, aux_biased_acc=aux, **extra, **kw)
        out.backward(dy.to(dev, dt))
        res.append([h, aux, out, *(v.grad for v in leaves)])
    names = ["h", "aux", "out", "dx", "dw_up", "db_up", "dw_down", "db_down", "d_row_scale"]
    for name, got, want in zip(names, *res, strict=False):
        _same_nan_inf(got, want, name)
    rows = row_of[2].tolist() if gathered else [2]  # the NaN token's rows: NaN out, NaN in dw_up
    assert res[0][2][rows].isnan().all() and res[0][4].isnan().any()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gathered", [False, True], ids=["sorted", "permute-free"])
@pytest.mark.parametrize("kw", [GPT_OSS, PLAIN], ids=["gpt-oss", "plain"])
def test_expert_ops_propagate_nan_and_inf(request, path, gathered, kw):
    with _on_path(request, path):
        _check_expert_ops("cpu", kw, gathered)


@gpu
@pytest.mark.parametrize("gathered", [False, True], ids=["sorted", "permute-free"])
@pytest.mark.parametrize("kw", [GPT_OSS, PLAIN], ids=["gpt-oss", "plain"])
@pytest.mark.parametrize("fused_dswiglu", [False, True], ids=["dgrad-then-dswiglu", "fused-dswiglu"])
def test_expert_ops_propagate_nan_and_inf_gpu(expert_path, gathered, kw, fused_dswiglu):
    with moekit.options(fused_dswiglu=fused_dswiglu):
        _check_expert_ops(DEV, kw, gathered)
        _check_expert_ops(DEV, kw, gathered, counts=(300, 0, 517, 180), d=256, f=256)  # the Hopper kernels' sizes


# ---- routing --------------------------------------------------------------------------------------


def _check_routing(device, score_func, biased, aux_loss):
    """A NaN token (all its logits NaN) goes to experts 0..K-1 with NaN weights, an inf token (logits
    +-inf) to float64's choice; the metadata, and the NaN and inf entries of the weights and of their
    gradients to x and the gate, are float64's (``router_topk_ref`` on float64 logits)."""
    t, d, e, k = 12, 32, 8, 2
    x, w, b = _randn(t, d), torch.randn(e, d), torch.randn(e)
    x[3, 5], x[7, 0] = NAN, INF
    eb = torch.randn(e) * 0.5 if biased else None  # (large enough that no finite token is near a tie)
    dw = torch.randn(t, k)
    kw = dict(top_k=k, score_func=score_func, renormalize=True)
    tx, tw = x.to(device, copy=True).requires_grad_(), w.to(device, copy=True).requires_grad_()
    r = moekit.topk_router(tx, tw, b.to(device), expert_bias=None if eb is None else eb.to(device),
                           aux_loss=aux_loss, **kw)
    r.weights.backward(dw.to(device))
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    weights, experts = moekit.router_topk_ref(x64 @ w64.T + b.double(), expert_bias=eb, **kw)
    weights.backward(dw.double())
    assert torch.equal(r.experts.cpu().long(), experts) and experts[3].tolist() == list(range(k))
    meta = zip((r.counts, r.offs, r.token_idx, r.row_of), moekit.routing_metadata_ref(experts.int(), e), strict=True)
    assert all(torch.equal(got.cpu(), want) for got, want in meta)
    _same_nan_inf(r.weights, weights, "weights")
    finite_tokens = (torch.arange(t) != 3) & (torch.arange(t) != 7)
    assert r.weights[3].isnan().all() and torch.isfinite(r.weights[finite_tokens.to(device)]).all()
    _same_nan_inf(tx.grad, x64.grad, "dx")
    _same_nan_inf(tw.grad, w64.grad, "dw")
    assert not aux_loss or r.aux_loss.isnan()  # the NaN token's scores are in every expert's mean


ROUTERS = [("softmax", False, False), ("sigmoid", True, False), ("softmax", True, True), ("sigmoid", False, True)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("score_func, biased, aux_loss", ROUTERS)
def test_routing_of_nan_and_inf_tokens(request, path, score_func, biased, aux_loss):
    with _on_path(request, path):
        _check_routing("cpu", score_func, biased, aux_loss)


@gpu
@pytest.mark.parametrize("score_func, biased, aux_loss", ROUTERS)
def test_routing_of_nan_and_inf_tokens_gpu(score_func, biased, aux_loss):
    _check_routing(DEV, score_func, biased, aux_loss)


def _check_split_logits(device):
    """The router logits of bf16 tokens and an fp32 gate as the GPU computes them (``router_logits_op``:
    x @ hi + x @ lo, the gate split into two bf16 terms; on the CPU too, for this check): an inf token's
    logits are float64's +-inf. (The sum gave NaN wherever lo's sign was not hi's or lo was 0, and the
    token went to other experts than in float64.)"""
    x, w, b = _randn(6, 32), torch.randn(8, 32), torch.randn(8)
    x[1, 0], x[2, 3], x[4, 7] = INF, NAN, -INF
    got = router_logits_op(x.to(device), w.to(device), b.to(device))
    _same_nan_inf(got, x.double() @ w.double().T + b.double(), "logits")


@pytest.mark.parametrize("path", PATHS)
def test_split_router_logits_keep_an_inf_token_inf(request, path):
    with _on_path(request, path):
        _check_split_logits("cpu")


@gpu
def test_split_router_logits_keep_an_inf_token_inf_gpu():
    _check_split_logits(DEV)


# ---- the MoE block --------------------------------------------------------------------------------


def _block64(moe, x):
    """The block in float64 from its parameters: ``router_topk_ref``'s choice and weights, each token's
    K experts one by one, the weighted sum. Returns (out, x leaf, {name: parameter leaf})."""
    p = {n: v.detach().cpu().double().requires_grad_() for n, v in moe.named_parameters()}
    zero = torch.zeros((), dtype=torch.float64)
    x = x.cpu().double().requires_grad_()
    weights, experts = moekit.router_topk_ref(x @ p["router.weight"].T + p.get("router.bias", zero), moe.top_k,
                                              score_func=moe.score_func, renormalize=moe.renormalize,
                                              expert_bias=moe.expert_bias.cpu().double())
    out, spec = 0, _spec(moe.experts.swiglu)
    for ek, wk in zip(experts.T, weights.T, strict=True):  # each token's k-th choice
        b1, b2 = (p[n][ek] if n in p else zero for n in ("experts.mlp1_bias_EG", "experts.mlp2_bias_ED"))
        h = swiglu_torch(torch.einsum("td,tgd->tg", x, p["experts.mlp1_weight_EGD"][ek]) + b1, spec)
        out = out + wk[:, None] * (torch.einsum("tf,tdf->td", h, p["experts.mlp2_weight_EDF"][ek]) + b2)
    return out, x, p


def _check_block(device, block, value):
    """One NaN or inf in token 5: its output row is all NaN and every other row finite; the output and
    the gradients to x and to every parameter have the NaN and inf entries of the block in float64 (the
    scaled-rows path without a down-projection bias, the weighted combine with one)."""
    kw = dict(bias=False, router_bias=False, activation="swiglu") if block == "plain" else {}
    torch.manual_seed(1)
    moe = MoE(32, 32, 4, 2, dtype=BF16, **kw).to(device)
    x, dy = _randn(12, 32), _randn(12, 32)
    x[5, 3] = value
    tx = x.to(device, copy=True).requires_grad_()
    out = moe(tx)
    out.backward(dy.to(device))
    want, x64, p64 = _block64(moe, x)
    want.backward(dy.double())
    _same_nan_inf(out, want, "out")
    assert out[5].isnan().all() and torch.isfinite(out[torch.arange(12, device=device) != 5]).all()
    _same_nan_inf(tx.grad, x64.grad, "dx")
    for name, param in moe.named_parameters():
        _same_nan_inf(param.grad, p64[name].grad, name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("block", ["gpt-oss", "plain"])
def test_block_keeps_a_non_finite_token_in_its_row(request, path, block, value):
    with _on_path(request, path):
        _check_block("cpu", block, value)


@gpu
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("block", ["gpt-oss", "plain"])
def test_block_keeps_a_non_finite_token_in_its_row_gpu(block, value):
    _check_block(DEV, block, value)


# ---- SwiGLU ---------------------------------------------------------------------------------------


def _pre_with_specials(m, f, device):
    """(m, 2f) bf16 pre-activations with NaN and +-inf in gate and linear columns of both layouts."""
    pre = torch.randn(m, 2 * f, device=device) * 4
    pre[0, 0] = pre[1, 1] = float("nan")  # interleaved: a gate, a linear
    pre[2, f] = pre[3, f + 1] = float("nan")  # halves: a linear
    pre[4, 2] = float("inf")
    pre[5, 3] = -float("inf")
    pre[6, 4] = -float("inf")
    return pre.to(BF16)


def _check_swiglu(device, kw):
    spec = _spec(kw)
    pre = _pre_with_specials(12, 24, device).requires_grad_()
    h = swiglu(pre, **kw)
    want = swiglu_torch(pre.detach().double(), spec)
    assert want.isnan().any()
    assert torch.equal(h.isnan(), want.isnan())
    torch.testing.assert_close(h.double(), want, rtol=2e-2, atol=2e-2, equal_nan=True)
    dh = torch.randn(12, 24, device=device).to(BF16)
    h.backward(dh)
    dwant = swiglu_bwd_torch(pre.detach().double(), dh.double(), spec)
    assert torch.equal(pre.grad.isnan(), dwant.isnan())


def _check_fused_up_projection(device, kw):
    """The up-projection's SwiGLU epilogue: a NaN and an inf token give the reference's NaN pattern."""
    counts = [5, 0, 11]
    offs = offs_from_counts(counts, device=device)
    x = torch.randn(16, 32, device=device).to(BF16)
    x[3, 7] = float("nan")
    x[9, 2] = float("inf")
    w = (torch.randn(3, 32, 64, device=device) * 0.2).to(BF16)
    h, _ = grouped_mm_swiglu(x, w, offs, **kw)
    want, _ = grouped_mm_swiglu_ref(x.double(), w.double(), offs, **kw)
    assert want[3].isnan().all() and want[9].isnan().any() and torch.isfinite(want[[0, 1, 2, 10]]).all()
    assert torch.equal(h.isnan(), want.isnan()) and torch.equal(h.isinf(), want.isinf())


@pytest.mark.parametrize("kw", [GPT_OSS, PLAIN], ids=["gpt-oss", "plain"])
def test_swiglu_propagates_nan(interpreter, kw):
    _check_swiglu("cpu", kw)
    _check_fused_up_projection("cpu", kw)


@gpu
@pytest.mark.parametrize("kw", [GPT_OSS, PLAIN], ids=["gpt-oss", "plain"])
def test_swiglu_propagates_nan_gpu(kw):
    _check_swiglu(DEV, kw)
    _check_fused_up_projection(DEV, kw)


def _check_nvfp4_gemm(device):
    """A NaN in one row of A: that row's output is NaN, and no other."""
    counts = [6, 10]
    offs = offs_from_counts(counts, device=device)
    a = torch.randn(16, 64, device=device).to(BF16)
    a[7, 40] = float("nan")
    w = torch.randn(2, 64, 32, device=device).to(BF16)
    out = nvfp4.grouped_mm_nvfp4(*nvfp4.quantize(a), *nvfp4.quantize_weights(w), offs)
    rows = out.isnan().any(1)
    assert out[7].isnan().all() and rows.sum() == 1


def _block_pair(device):
    torch.manual_seed(1)
    plain = moekit.MoE(64, 32, 4, 2, bias=True, dtype=BF16, device=device)
    quant = moekit.MoE(64, 32, 4, 2, bias=True, nvfp4=TrainingRecipe(seed=3), dtype=BF16, device=device)
    quant.load_state_dict(plain.state_dict())
    return plain, quant


def _check_nvfp4_block(device):
    """One NaN in one token of ``MoE(..., nvfp4=TrainingRecipe())``: the token's output is NaN as in the
    bf16 block, the other tokens' are finite, and every gradient the bf16 block makes NaN is NaN here
    too (the Hadamard rotation spreads the NaN over its 16-row block, whose quantization must not turn
    it into finite but wrong weight gradients)."""
    plain, quant = _block_pair(device)
    x = torch.randn(32, 64, device=device).to(BF16)
    x[5, 9] = float("nan")
    dy = torch.randn(32, 64, device=device).to(BF16)
    results = []
    for moe in (plain, quant):
        xi = x.clone().requires_grad_()
        out = moe(xi)
        params = [p for p in moe.parameters() if p.requires_grad]
        results.append((out, torch.autograd.grad(out, [xi, *params], dy)))
    (out_p, grads_p), (out_q, grads_q) = results
    assert out_p[5].isnan().all() and torch.equal(out_q.isnan(), out_p.isnan())
    names = ["x"] + [n for n, p in plain.named_parameters() if p.requires_grad]
    pairs = zip(names, grads_p, grads_q, strict=True)
    swallowed = [n for n, gp, gq in pairs if gp.isnan().any() and not gq.isnan().any()]
    assert not swallowed, swallowed
    assert grads_q[0][5].isnan().all()  # the NaN token's own input gradient


@pytest.mark.parametrize("path", ["reference", "interpreter"])
def test_nvfp4_propagates_nan(request, path):
    if path == "interpreter":
        request.getfixturevalue("interpreter")
    with moekit.options(reference=path == "reference"):
        _check_nvfp4_gemm("cpu")
        _check_nvfp4_block("cpu")


@gpu
def test_nvfp4_propagates_nan_gpu():
    _check_nvfp4_gemm(DEV)
    _check_nvfp4_block(DEV)

"""Fused expert MLP on CPU: the kernels under TRITON_INTERPRET=1 against float64 references.

Errors of a bf16 chain are held to PyTorch's own: moekit's error against the float64 oracle must be
within 2x that of the reference computed from the same bf16 inputs (``assert_within_baseline``).
"""

import pytest
import torch

import moekit
from moekit import (
    GptOssExperts,
    grouped_mm_downproj,
    grouped_mm_downproj_ref,
    grouped_mm_swiglu,
    grouped_mm_swiglu_ref,
    swiglu,
)
from moekit.bench.baselines import TorchtitanExperts
from moekit.epilogue import SwiGLU, swiglu_bwd_torch, swiglu_torch
from moekit.experts import grouped_colsum
from moekit.testing import assert_run_within_reference, assert_within_baseline, offs_from_counts, reference_run

BF16 = torch.bfloat16

VARIANTS = {
    "gpt-oss": dict(swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_linear_offset=1.0, gate_up_layout="interleaved"),
    "gpt-oss-halves": dict(swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_linear_offset=1.0, gate_up_layout="halves"),
    "no-limit": dict(swiglu_alpha=1.702, swiglu_limit=None, swiglu_linear_offset=1.0, gate_up_layout="interleaved"),
    "plain-silu-halves": dict(swiglu_alpha=1.0, swiglu_limit=None, swiglu_linear_offset=0.0, gate_up_layout="halves"),
}


# ---------------------------------------------------------------------------------------------------
# the epilogue math, at and around the clamp boundaries
# ---------------------------------------------------------------------------------------------------
def _boundary_pre(m, f):
    """Pre-activations that sit exactly on, just inside and just outside +-limit, plus random ones."""
    special = torch.tensor([7.0, -7.0, 6.96875, 7.03125, -6.96875, -7.03125, 0.0, 20.0, -20.0, 1.0])
    pre = torch.randn(m, 2 * f) * 4
    pre.view(-1)[: special.numel() * 7 : 7] = special  # scattered over gate and linear columns
    return pre.to(BF16)  # all the special values are exact in bf16


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_swiglu_kernel_matches_twin(interpreter, variant):
    kw = VARIANTS[variant]
    spec = SwiGLU(kw["swiglu_alpha"], kw["swiglu_limit"], kw["swiglu_linear_offset"], kw["gate_up_layout"])
    pre = _boundary_pre(24, 40).requires_grad_()
    h = swiglu(pre, **kw)
    ref = swiglu_torch(pre.detach().double(), spec)
    assert_within_baseline(h, ref, swiglu_torch(pre.detach(), spec), what="swiglu")
    dh = torch.randn(24, 40).to(BF16)
    h.backward(dh)
    dref = swiglu_bwd_torch(pre.detach().double(), dh.double(), spec)
    assert_within_baseline(pre.grad, dref, swiglu_bwd_torch(pre.detach(), dh, spec), what="dswiglu")
    if spec.limit is not None:  # clamp masks: zero gradient strictly outside, full gradient on the bound
        g, lin = (pre.detach()[:, 0::2], pre.detach()[:, 1::2]) if not spec.halves else pre.detach().chunk(2, 1)
        dg, dl = (pre.grad[:, 0::2], pre.grad[:, 1::2]) if not spec.halves else pre.grad.chunk(2, 1)
        assert (dg[g > 7.0] == 0).all() and (dl[lin.abs() > 7.0] == 0).all()
        assert (dg[g == 7.0] != 0).any() or not (g == 7.0).any()


# ---------------------------------------------------------------------------------------------------
# fused up- and down-projection
# ---------------------------------------------------------------------------------------------------
# (counts per expert, rows M, D, F) and why
CASES = [
    pytest.param([10, 0, 22], 40, 32, 40, id="empty-expert-tail-rows"),  # an empty expert; 8 rows past offs[-1]
    pytest.param([0, 33, 0], 33, 24, 24, id="all-on-one"),  # every row on one expert; odd M
    pytest.param([5, 7], 12, 136, 72, id="odd-d-f"),  # D, F not tile multiples
    pytest.param([0, 0], 0, 16, 16, id="m-zero"),  # no rows
    pytest.param([7, 0, 5], 12, 16, 128, id="f-tile-multiple"),  # db_down from a column-sum pass, not a ones row
]


def _expert_inputs(counts, m, d, f, *, bias=True, w_views=True):
    offs = offs_from_counts(counts)
    e = len(counts)
    x = torch.randn(m, d).to(BF16)
    if m:
        x[int(offs[-1]) :] = float("nan")  # rows no expert owns must not leak
    if w_views:  # torchtitan storage, read through .mT views
        w1 = (torch.randn(e, 2 * f, d) / d**0.5).to(BF16).mT
        w2 = (torch.randn(e, d, f) / f**0.5).to(BF16).mT
    else:
        w1 = (torch.randn(e, d, 2 * f) / d**0.5).to(BF16)
        w2 = (torch.randn(e, f, d) / f**0.5).to(BF16)
    b1 = torch.randn(e, 2 * f).to(BF16) if bias else None
    b2 = torch.randn(e, d).to(BF16) if bias else None
    return x, w1, b1, w2, b2, offs


def _leaf(t):
    return None if t is None else t.detach().requires_grad_()


def _run(fns, x, w1, b1, w2, b2, offs, kw):
    swiglu_fn, down_fn = fns
    h, aux = swiglu_fn(x, w1, offs, bias=b1, **kw)
    out = down_fn(h, w2, offs, bias=b2, aux_biased_acc=aux, **kw)
    return h, aux, out


NAMES = ("h", "aux", "out", "dx", "dw1", "db1", "dw2", "db2")


def _check_chain(kw, counts, m, d, f):
    """Run the fused chain forward and backward and hold it to the reference's error; returns the
    leaves (x, w1, b1, w2, b2, with their gradients), h, aux, out and offs."""
    x, w1, b1, w2, b2, offs = _expert_inputs(counts, m, d, f)
    leaves = [_leaf(t) for t in (x, w1, b1, w2, b2)]
    h, aux, out = _run((grouped_mm_swiglu, grouped_mm_downproj), *leaves, offs, kw)
    dy = torch.randn_like(out)
    out.backward(dy)

    def ref_chain(*ls):
        return _run((grouped_mm_swiglu_ref, grouped_mm_downproj_ref), *ls, offs, kw)

    grads = None if m == 0 else [leaf.grad for leaf in leaves]
    assert_run_within_reference(ref_chain, (x, w1, b1, w2, b2), dy, (h, aux, out), grads, names=NAMES)
    return leaves, h, aux, out, offs


@pytest.mark.parametrize("counts, m, d, f", CASES)
@pytest.mark.parametrize("variant", ["gpt-oss", "gpt-oss-halves"])
def test_forward_and_backward(interpreter, tma_path, counts, m, d, f, variant):
    leaves, h, aux, out, offs = _check_chain(VARIANTS[variant], counts, m, d, f)
    tail = int(offs[-1]) if m else 0
    assert (out[tail:] == 0).all() and (aux[tail:] == 0).all() and (h[tail:] == 0).all()
    if m == 0:  # no rows: every parameter gradient is an exact zero (the ones-row wgrad included)
        assert all(not leaf.grad.any() for leaf in leaves[1:])
        return
    for g, c in enumerate(counts):
        if c == 0:  # an empty expert's parameter gradients are exactly zero
            assert not leaves[1].grad[g].any() and not leaves[2].grad[g].any() and not leaves[3].grad[g].any()


@pytest.mark.parametrize("save_h", [True, False], ids=["save-h", "recompute-h"])
def test_down_weight_gradient_from_saved_or_recomputed_h(interpreter, save_h):
    """dW_down and db_down from h saved in the forward (``save_h=True``; db_down from a column-sum pass
    here) and from h recomputed out of aux in the backward (the default; db_down from the ones
    column the recompute appends): both within the reference's error."""
    with moekit.options(save_h=save_h):
        leaves = _check_chain(VARIANTS["gpt-oss"], [10, 0, 22], 40, 32, 24)[0]
    assert not leaves[3].grad[1].any() and not leaves[4].grad[1].any()  # the empty expert's


@pytest.mark.parametrize("save_h", [True, False], ids=["save-h", "recompute-h"])
@pytest.mark.parametrize("variant", ["gpt-oss", "plain-silu-halves"])
def test_row_scale_against_float64(interpreter, save_h, variant):
    """h = row_scale * SwiGLU(aux): the forward, and the gradients to x, the weights, the biases and the
    row scales (from the SwiGLU backward pass), against float64. Scales of rows past offs[-1] are NaN
    and must not leak anywhere."""
    kw = VARIANTS[variant]
    x, w1, b1, w2, b2, offs = _expert_inputs([10, 0, 22], 40, 32, 24)
    scale = torch.rand(40) + 0.25
    scale[32:] = float("nan")
    leaves = [_leaf(t) for t in (x, w1, b1, w2, b2, scale)]

    def chain(fns, x, w1, b1, w2, b2, s):
        h, aux = fns[0](x, w1, offs, bias=b1, row_scale=s, **kw)
        return h, aux, fns[1](h, w2, offs, bias=b2, aux_biased_acc=aux, row_scale=s, **kw)

    with moekit.options(save_h=save_h):
        h, aux, out = chain((grouped_mm_swiglu, grouped_mm_downproj), *leaves)
        dy = torch.randn_like(out)
        out.backward(dy)
    assert (h[32:] == 0).all() and (out[32:] == 0).all() and (leaves[5].grad[32:] == 0).all()

    def ref_chain(*ls):
        return chain((grouped_mm_swiglu_ref, grouped_mm_downproj_ref), *ls)

    grads = [leaf.grad for leaf in leaves]
    assert_run_within_reference(ref_chain, (x, w1, b1, w2, b2, scale), dy, (h, aux, out), grads,
                                names=(*NAMES, "d_scale"))


@pytest.mark.parametrize("w_down_trained", [True, False], ids=["w-down-trained", "w-down-frozen"])
def test_h_is_saved_only_for_a_down_weight_gradient(interpreter, w_down_trained):
    """The forward keeps h alive only when dW_down will need it (the ``save_h`` option)."""
    x, w1, b1, w2, b2, offs = _expert_inputs([10, 0, 22], 40, 32, 24)
    saved = []
    with moekit.options(save_h=True), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                                               lambda t: t):
        h, aux = grouped_mm_swiglu(_leaf(x), w1, offs, bias=b1)
        grouped_mm_downproj(h, w2.requires_grad_(w_down_trained), offs, bias=b2, aux_biased_acc=aux)
    assert any(t is h for t in saved) == w_down_trained


@pytest.mark.parametrize("variant", ["no-limit", "plain-silu-halves"])
def test_variants_without_bias_and_contiguous_weights(interpreter, variant):
    kw = VARIANTS[variant]
    x, w1, b1, w2, b2, offs = _expert_inputs([9, 0, 14], 23, 32, 24, bias=False, w_views=False)
    x = torch.nan_to_num(x)
    leaves = [_leaf(t) for t in (x, w1, w2)]
    h, aux = grouped_mm_swiglu(leaves[0], leaves[1], offs, **kw)
    out = grouped_mm_downproj(h, leaves[2], offs, aux_biased_acc=aux, **kw)
    out.backward(torch.ones_like(out))
    ls = [_leaf(t.double()) for t in (x, w1, w2)]
    h64, aux64 = grouped_mm_swiglu_ref(ls[0], ls[1], offs, **kw)
    grouped_mm_downproj_ref(h64, ls[2], offs, aux_biased_acc=aux64, **kw).sum().backward()
    bs = [_leaf(t) for t in (x, w1, w2)]
    h16, aux16 = grouped_mm_swiglu_ref(bs[0], bs[1], offs, **kw)
    grouped_mm_downproj_ref(h16, bs[2], offs, aux_biased_acc=aux16, **kw).float().sum().backward()
    assert_within_baseline(h, h64, h16, what="h")
    for name, a, b, c in zip(("dx", "dw1", "dw2"), leaves, ls, bs, strict=True):
        assert_within_baseline(a.grad, b.grad, c.grad, what=name)


@pytest.mark.parametrize("reference", [False, True], ids=["kernels", "reference"])
def test_gradient_through_h_raises(interpreter, reference):
    """The same error on both paths when a gradient reaches h."""
    x, w1, b1, w2, b2, offs = _expert_inputs([8, 8], 16, 16, 16)
    x = _leaf(x)
    with moekit.options(reference=reference):
        h, aux = grouped_mm_swiglu(x, w1, offs, bias=b1)
        out = grouped_mm_downproj(h, w2, offs, bias=b2, aux_biased_acc=aux)
    with pytest.raises(RuntimeError, match="aux_biased_acc"):
        (out.float().sum() + h.float().sum()).backward(retain_graph=True)
    out.float().sum().backward()  # through aux alone: fine on both paths
    assert x.grad is not None and x.grad.isfinite().all()


def test_downproj_without_aux_is_a_plain_gemm(interpreter):
    """Without aux the gradient flows to h like any grouped GEMM + bias."""
    offs = offs_from_counts([6, 0, 10])
    h = torch.randn(20, 24).to(BF16).requires_grad_()
    w = (torch.randn(3, 24, 32) / 5).to(BF16).requires_grad_()
    b = torch.randn(3, 32).to(BF16).requires_grad_()
    out = grouped_mm_downproj(h, w, offs, bias=b)
    dy = torch.randn_like(out)
    out.backward(dy)
    ls = [_leaf(t.double()) for t in (h, w, b)]
    out64 = grouped_mm_downproj_ref(*ls[:2], offs, bias=ls[2])
    out64.backward(dy.double())
    bs = [_leaf(t) for t in (h, w, b)]
    out16 = grouped_mm_downproj_ref(*bs[:2], offs, bias=bs[2])
    out16.backward(dy)
    assert_within_baseline(out, out64, out16, what="out")
    for name, a, r, c in zip(("dh", "dw", "db"), (h, w, b), ls, bs, strict=True):
        assert_within_baseline(a.grad, r.grad, c.grad, what=name)
    assert not h.grad[16:].any()


def test_colsum_exact_zero_for_empty_groups(interpreter):
    offs = offs_from_counts([5, 0, 12, 0])
    x = torch.randn(20, 40).to(BF16)
    x[17:] = float("nan")
    out = grouped_colsum(x, offs)
    ref = torch.stack([x[:5].double().sum(0), torch.zeros(40, dtype=torch.float64), x[5:17].double().sum(0),
                       torch.zeros(40, dtype=torch.float64)])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert not out[1].any() and not out[3].any()


def test_module_matches_torchtitan_baseline(interpreter):
    """GptOssExperts against the plain-torch torchtitan-style experts on the same weights."""
    torch.manual_seed(1)
    ex = GptOssExperts(32, 24, 4, dtype=BF16)
    base = TorchtitanExperts(ex)
    counts = torch.tensor([7, 0, 13, 4])
    x = torch.randn(24, 32).to(BF16) * 3  # large enough to hit the clamps
    out = ex(x, counts)
    ref = base(x, counts)
    ex32 = GptOssExperts(32, 24, 4, dtype=torch.float32)  # torch._grouped_mm has no float64
    ex32.load_state_dict({k: v.float() for k, v in ex.state_dict().items()})
    oracle = TorchtitanExperts(ex32)(x.float(), counts)
    assert_within_baseline(out, oracle, ref, what="module")
    assert set(ex.state_dict()) == {"mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED"}


@pytest.mark.parametrize(
    "call, match",
    [
        pytest.param(lambda x, w, o: grouped_mm_swiglu(x.float(), w, o), "bfloat16", id="dtype"),
        pytest.param(lambda x, w, o: grouped_mm_swiglu(x[:, :8], w, o), "K mismatch", id="k-mismatch"),
        pytest.param(lambda x, w, o: grouped_mm_swiglu(x, w, o.long()), "int32", id="offs-dtype"),
        pytest.param(lambda x, w, o: grouped_mm_swiglu(x, w, o, bias=torch.zeros(2, 3).to(BF16)), "bias", id="bias"),
        pytest.param(lambda x, w, o: grouped_mm_swiglu(x, w, o, gate_up_layout="split"), "layout", id="layout"),
        pytest.param(lambda x, w, o: grouped_mm_swiglu(x, w[..., :31], o), "2F", id="odd-2f"),
        pytest.param(lambda x, w, o: grouped_mm_downproj(x, w[:, :, :16].mT, o, aux_biased_acc=x), "aux", id="aux"),
        pytest.param(lambda x, w, o: grouped_mm_swiglu(x, w, o, row_scale=torch.ones(16).to(BF16)), "row_scale",
                     id="row-scale-dtype"),
        pytest.param(lambda x, w, o: grouped_mm_swiglu(x, w, o, row_scale=torch.ones(15)), "row_scale",
                     id="row-scale-shape"),
        pytest.param(lambda x, w, o: grouped_mm_downproj(x, w[:, :, :16].mT, o, row_scale=torch.ones(16)),
                     "aux_biased_acc", id="row-scale-without-aux"),
    ],
)
def test_validation(call, match):
    x = torch.randn(16, 16).to(BF16)
    w = torch.randn(2, 16, 32).to(BF16)
    with pytest.raises((TypeError, ValueError), match=match):
        call(x, w, offs_from_counts([8, 8]))


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("d", [32, 128], ids=["db-up-in-wgrad", "db-up-colsum"])  # D % 128 decides
def test_permute_free_dispatch(interpreter, tma_path, layout, d):
    """Gathering token rows inside the GEMMs equals running them on an explicit x[token_idx] copy."""
    from moekit.routing import routing_metadata_fwd

    t, k, e, f = 20, 2, 4, 24
    ids = torch.rand(t, e).topk(k, -1).indices.to(torch.int32)
    ids[:, 0] = torch.where(ids[:, 0] == 1, 0, ids[:, 0])  # expert 1 gets fewer rows
    counts, offs, token_idx, row_of = routing_metadata_fwd(ids, e)
    x = torch.randn(t, d).to(BF16).requires_grad_()
    w1 = (torch.randn(e, 2 * f, d) / d**0.5).to(BF16).mT.detach().requires_grad_()
    b1 = torch.randn(e, 2 * f).to(BF16).requires_grad_()
    h, aux = grouped_mm_swiglu(x, w1, offs, bias=b1, token_idx=token_idx, row_of=row_of, gate_up_layout=layout)
    xs = x.detach()[token_idx.long()]
    h_copy, aux_copy = grouped_mm_swiglu(xs, w1.detach(), offs, bias=b1.detach(), gate_up_layout=layout)
    assert torch.equal(aux, aux_copy) and torch.equal(h, h_copy)

    w2 = (torch.randn(e, d, f) / f**0.5).to(BF16).mT.detach().requires_grad_()
    out = grouped_mm_downproj(h, w2, offs, aux_biased_acc=aux, gate_up_layout=layout)
    dy = torch.randn_like(out)
    out.backward(dy)

    def ref_chain(xr, w1r, b1r, w2r):
        hr, auxr = grouped_mm_swiglu_ref(xr[token_idx.long()], w1r, offs, bias=b1r, gate_up_layout=layout)
        return grouped_mm_downproj_ref(hr, w2r, offs, aux_biased_acc=auxr, gate_up_layout=layout)

    inputs = (x, w1, b1, w2)
    grads64, grads16 = (reference_run(ref_chain, inputs, dy, dtype)[1] for dtype in (torch.float64, BF16))
    for name, got, want, base in zip(("dx", "dw1", "db1", "dw2"), (x.grad, w1.grad, b1.grad, w2.grad),
                                     grads64, grads16, strict=True):
        assert_within_baseline(got, want, base, what=name)


@pytest.mark.parametrize("save_h", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("caller_marks", [True, False], ids=["caller-marks-absent", "op-marks-absent"])
def test_unwritten_tails(interpreter, tma_path, bias, save_h, caller_marks):
    """tail="unwritten" (expert parallelism's fixed slots): the rows past offs[-1] of h, aux, the output
    and the dgrads are left as they were (NaN here: every output starts poisoned), the rows of the
    groups and every gradient equal the default path's bit for bit, and the tails' NaN reaches none.
    The op takes the choices past offs[-1] as absent itself when the caller passes the router's
    row_of (then only the combine needs them marked)."""
    from moekit.routing import routing_metadata_fwd, sorted_weights

    t, k, e, d, f = 40, 2, 4, 32, 24
    ids = torch.rand(t, 2 * e).topk(k, -1).indices.to(torch.int32)  # ids >= e: "other ranks'": dropped
    _, offs, token_idx, row_of = routing_metadata_fwd(torch.where(ids < e, ids, e), e + 1)
    offs, tail = offs[:e], int(offs[e - 1])
    absent = torch.where(row_of < tail, row_of, -1)
    assert 16 <= t * k - tail  # whole row blocks of the SwiGLU pass past offs[-1]
    given = absent if caller_marks else row_of
    x = torch.randn(t, d).to(BF16)
    w1 = (torch.randn(e, 2 * f, d) / d**0.5).to(BF16)
    w2 = (torch.randn(e, d, f) / f**0.5).to(BF16)
    b1, b2 = (torch.randn(e, 2 * f).to(BF16), torch.randn(e, d).to(BF16)) if bias else (None, None)
    weights = torch.rand(t, k)
    dy = torch.randn(t, d).to(BF16)

    def run(tail_mode, rows):
        leaves = [v.clone().requires_grad_() for v in (x, w1, w2, weights)]
        bs = [None if v is None else v.clone().requires_grad_() for v in (b1, b2)]
        scale = None if bias else sorted_weights(leaves[3], rows)
        with moekit.options(save_h=save_h):
            h, aux = grouped_mm_swiglu(leaves[0], leaves[1].mT, offs, bias=bs[0], token_idx=token_idx,
                                       row_of=rows, row_scale=scale, tail=tail_mode)
            out = grouped_mm_downproj(h, leaves[2].mT, offs, bias=bs[1], aux_biased_acc=aux, row_scale=scale,
                                      tail=tail_mode)
        y = moekit.combine(out, leaves[3] if bias else None, absent)  # the combine skips them either way
        y.backward(dy)
        grads = [v.grad for v in leaves + bs if v is not None]
        return h, aux, out, grads

    h, aux, out, grads = run("unwritten", given)
    h0, aux0, out0, grads0 = run("zeros", absent)
    for got, want in ((h, h0), (aux, aux0), (out, out0)):
        assert torch.equal(got[:tail], want[:tail]) and not want[tail:].any()
        assert got[tail:].isnan().all()  # never written
    for got, want in zip(grads, grads0, strict=True):
        assert not got.isnan().any() and torch.equal(got, want)
    with pytest.raises(ValueError, match="tail"):
        grouped_mm_swiglu(x, w1.mT, offs, tail="none")

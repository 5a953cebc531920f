"""Fused expert MLP on a CUDA GPU: realistic shapes against float64, clamp-heavy inputs, both paths,
opcheck, torch.compile, CUDA graphs and no host sync."""

import pytest
import torch

import moekit
from moekit import (
    GptOssExperts,
    config,
    experts,
    grouped_gemm,
    grouped_mm_downproj,
    grouped_mm_downproj_ref,
    grouped_mm_swiglu,
    grouped_mm_swiglu_ref,
)
from moekit.bench.baselines import TorchtitanExperts
from moekit.epilogue import SwiGLU
from moekit.experts import (
    _colsum_op,
    _gathered_wgrad_op,
    _grouped_mm_downproj_bwd_op,
    _grouped_mm_downproj_op,
    _grouped_mm_swiglu_op,
    _swiglu_op,
    _wgrad_colsum_op,
)
from moekit.testing import (
    assert_run_within_reference,
    assert_within_baseline,
    offs_from_counts,
    routed_counts,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16


def _inputs(counts, rows, d, f, *, x_scale=1.0):
    offs = offs_from_counts(counts, device=DEV)
    e = len(counts)
    x = torch.randn(rows, d, device=DEV).to(BF16) * x_scale
    x[int(sum(counts)) :] = float("nan")
    w1 = (torch.randn(e, 2 * f, d, device=DEV) / d**0.5).to(BF16).mT
    w2 = (torch.randn(e, d, f, device=DEV) / f**0.5).to(BF16).mT
    b1 = torch.randn(e, 2 * f, device=DEV).to(BF16)
    b2 = torch.randn(e, d, device=DEV).to(BF16)
    return x, w1, b1, w2, b2, offs


def _leaf(t):
    return t.detach().requires_grad_()


def _chain(fns, x, w1, b1, w2, b2, offs, layout):
    h, aux = fns[0](x, w1, offs, bias=b1, gate_up_layout=layout)
    return h, aux, fns[1](h, w2, offs, bias=b2, aux_biased_acc=aux, gate_up_layout=layout)


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("x_scale", [1.0, 6.0], ids=["normal", "clamp-heavy"])
# F % 128 != 0 hands db_down to the dW_down GEMM; D % 128 == 64 hands db_up to the dW_up GEMM (ws path)
@pytest.mark.parametrize("d, f", [(960, 1000), (1024, 1024), (960, 960)],
                         ids=["bias-grads-in-wgrad", "bias-grads-colsum", "f-mod-128-is-64"])
@pytest.mark.parametrize("save_h", [True, False], ids=["save-h", "recompute-h"])
def test_forward_backward_against_float64(expert_path, layout, x_scale, d, f, save_h):
    """h saved for dW_down (``save_h=True``) or recomputed from aux (the default). db_down comes
    from the dW_down GEMM (a ones column on the recomputed h where F % 128 != 0, a virtual ones row on
    a saved h where F % 128 == 64) or from a column-sum pass."""
    with moekit.options(save_h=save_h):
        _forward_backward_against_float64(layout, x_scale, d, f)


def _forward_backward_against_float64(layout, x_scale, d, f):
    counts = routed_counts(2048, 8, 4, skew=3.0).tolist()
    counts[1] = 0
    rows = sum(counts) + 40  # rows past offs[-1]
    x, w1, b1, w2, b2, offs = _inputs(counts, rows, d, f, x_scale=x_scale)
    leaves = [_leaf(t) for t in (x, w1, b1, w2, b2)]
    h, aux, out = _chain((grouped_mm_swiglu, grouped_mm_downproj), *leaves, offs, layout)
    dy = torch.randn_like(out)
    out.backward(dy)

    def ref_chain(*ls):
        return _chain((grouped_mm_swiglu_ref, grouped_mm_downproj_ref), *ls, offs, layout)

    names = ("h", "aux", "out", "dx", "dw1", "db1", "dw2", "db2")
    assert_run_within_reference(ref_chain, (x, w1, b1, w2, b2), dy, (h, aux, out), [t.grad for t in leaves],
                                names=names)
    tail = int(offs[-1])
    assert not out[tail:].any() and not leaves[0].grad[tail:].any()
    assert not leaves[1].grad[1].any() and not leaves[3].grad[1].any()


@pytest.mark.parametrize("layout", ["interleaved", "halves"])
@pytest.mark.parametrize("save_h", [True, False], ids=["save-h", "recompute-h"])
def test_row_scale_against_float64(layout, save_h):
    """h = row_scale * SwiGLU(aux) (the MoE block's weights before the down-projection) at a realistic
    size: the forward and every gradient, the row scales' included, against float64. Scales of rows
    past offs[-1] are NaN and must not leak."""
    counts = routed_counts(2048, 8, 4, skew=3.0).tolist()
    counts[1] = 0
    tail = sum(counts)
    x, w1, _, w2, _, offs = _inputs(counts, tail + 40, 960, 1000)
    scale = torch.rand(tail + 40, device=DEV) + 0.25
    scale[tail:] = float("nan")
    leaves = [_leaf(t) for t in (x, w1, w2, scale)]

    def chain(fns, x, w1, w2, s):
        h, aux = fns[0](x, w1, offs, row_scale=s, gate_up_layout=layout)
        return h, aux, fns[1](h, w2, offs, aux_biased_acc=aux, row_scale=s, gate_up_layout=layout)

    with moekit.options(save_h=save_h):
        h, aux, out = chain((grouped_mm_swiglu, grouped_mm_downproj), *leaves)
        dy = torch.randn_like(out)
        out.backward(dy)
    assert not h[tail:].any() and not out[tail:].any() and not leaves[3].grad[tail:].any()
    assert_run_within_reference(lambda *ls: chain((grouped_mm_swiglu_ref, grouped_mm_downproj_ref), *ls),
                                (x, w1, w2, scale), dy, (h, aux, out), [t.grad for t in leaves],
                                names=("h", "aux", "out", "dx", "dw1", "dw2", "d_scale"))


@pytest.mark.parametrize("w_layout", ["EFD", "EDF"], ids=["w-k-major", "w-n-major"])
@pytest.mark.parametrize("f, ones_col", [(1000, True), (1000, False), (1024, False)],
                         ids=["ones-col", "partial-tile", "full-tiles"])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "row-scales"])
@pytest.mark.parametrize("programs", [None, 4], ids=["one-per-sm", "4-programs"])
def test_warp_specialized_dswiglu_dgrad(monkeypatch, w_layout, f, ones_col, scaled, programs):
    """The down-projection's dgrad with the dSwiGLU epilogue (one warp-specialized GEMM with an epilogue
    partition) against the warp-specialized plain dgrad followed by the pass: the same dH bits, so the
    same d_aux and h bit for bit, and the row scales' gradient to fp32 rounding (summed in another
    order). Outputs poisoned; empty experts, a group of one row, groups ending mid-step and inside
    the second consumer's rows, rows past offs[-1] (aux NaN there), clamp-heavy aux, K = 1000 (a
    partial last K box). With 4 programs each walks ~30 tiles, so the dH buffers change hands many
    times (one program per SM runs at most two tiles here)."""
    if not config.use_warp_specialized(torch.device(DEV)):
        pytest.skip("needs an sm_90 GPU with Gluon")
    opts = dict(fused_dswiglu=True, poison=True)
    if programs is not None:
        opts["sm_margin"] = config.num_sms(torch.device(DEV)) - programs
    counts = [700, 0, 1, 1300, 255, 0, 2048, 33]
    offs = offs_from_counts(counts, device=DEV)
    m, d, e = sum(counts) + 40, 1000, len(counts)
    grad = torch.randn(m, d, device=DEV).to(BF16)
    aux = (torch.randn(m, 2 * f, device=DEV) * 4).to(BF16)
    aux[sum(counts):] = float("nan")
    w = torch.randn(e, f, d, device=DEV) / d**0.5
    w = w.to(BF16) if w_layout == "EFD" else w.mT.contiguous().to(BF16).mT
    scale = torch.rand(m, device=DEV) + 0.5 if scaled else None
    spec = SwiGLU(alpha=1.702, limit=7.0, linear_offset=1.0)  # gpt-oss's clamps: both masks matter
    launches = []
    launch = experts.ws_dswiglu
    monkeypatch.setattr(experts, "ws_dswiglu", lambda *a, **k: launches.append(1) or launch(*a, **k))
    with moekit.options(**opts):
        d_aux, h, dscale = experts.grouped_mm_dswiglu(grad, w, offs, aux, spec, ones_col=ones_col, scale=scale)
    assert launches == [1], launches
    dh = grouped_gemm.grouped_mm_fwd(grad, w.mT, offs)
    want_aux, want_h, want_ds = experts.swiglu_bwd(aux, dh, spec, with_h=True, ones_col=ones_col, scale=scale)
    assert d_aux.shape == want_aux.shape and h.shape == want_h.shape and h.stride() == want_h.stride()
    assert not d_aux.isnan().any() and not h.isnan().any()
    tail = sum(counts)  # rows of no group: zeros here, whatever the pass made of aux's NaN there
    assert torch.equal(d_aux[:tail], want_aux[:tail]) and torch.equal(h[:tail], want_h[:tail])
    assert not d_aux[tail:].any() and not h[tail:].any()
    if ones_col:
        assert (h[:tail, f] == 1).all()
    if scaled:
        assert dscale.shape == (m,) and dscale.dtype == torch.float32 and not dscale[tail:].any()
        torch.testing.assert_close(dscale[:tail], want_ds[:tail], rtol=1e-5, atol=1e-4)
    else:
        assert dscale is None


@pytest.mark.parametrize("fused", [False, True], ids=["dgrad-and-pass", "fused"])
def test_dswiglu_unwritten_tail(monkeypatch, fused):
    """zero_tail=False (expert parallelism's device splits) on the GPU paths: the rows past offs[-1] of
    d_aux and h stay as they were (NaN: poisoned), the rest equals the zero-tail call bit for bit, and
    NaN in the inputs' tails (unwritten there too under device splits) reaches nothing."""
    if fused and not config.use_warp_specialized(torch.device(DEV)):
        pytest.skip("needs an sm_90 GPU with Gluon")
    counts, f, d = [700, 0, 1300, 33], 1024, 1000
    offs = offs_from_counts(counts, device=DEV)
    m, tail = sum(counts) + 500, sum(counts)
    grad = torch.randn(m, d, device=DEV).to(BF16)
    aux = (torch.randn(m, 2 * f, device=DEV) * 4).to(BF16)
    aux[tail:] = 0  # as the zero-tail up-projection leaves it (the pass makes h = SwiGLU(aux) there)
    w = (torch.randn(len(counts), f, d, device=DEV) / d**0.5).to(BF16)
    scale = torch.rand(m, device=DEV) + 0.5
    spec = SwiGLU()
    launches = []
    launch = experts.ws_dswiglu
    monkeypatch.setattr(experts, "ws_dswiglu", lambda *a, **k: launches.append(1) or launch(*a, **k))
    outs = {}
    for zero_tail in (True, False):
        if not zero_tail:
            for tensor in (grad, aux, scale):
                tensor[tail:] = float("nan")
        with moekit.options(fused_dswiglu=fused, poison=True):
            outs[zero_tail] = experts.grouped_mm_dswiglu(grad, w, offs, aux, spec, scale=scale, zero_tail=zero_tail)
    assert launches == ([1, 1] if fused else []), launches
    for zeroed, unwritten in zip(outs[True][:2], outs[False][:2], strict=True):
        assert torch.equal(zeroed[:tail], unwritten[:tail]) and not zeroed[tail:].any()
        assert unwritten[tail:].isnan().all()
    torch.testing.assert_close(outs[True][2], outs[False][2], rtol=0, atol=0)  # d_scale: zeros past the tail


def _module_step(ex, x, counts, dy):
    out = ex(x, counts)
    out.backward(dy)
    return out


def _module_case():
    torch.manual_seed(3)
    ex = GptOssExperts(512, 320, 8, device=DEV, dtype=BF16)  # F % 128 != 0: db_down rides on dW_down
    counts = routed_counts(1024, 8, 4, device=DEV)
    x = torch.randn(4096, 512, device=DEV, dtype=BF16, requires_grad=True)
    return ex, x, counts, torch.randn(4096, 512, device=DEV, dtype=BF16)


def test_module_matches_torchtitan_baseline_and_saves_less():
    ex, x, counts, dy = _module_case()
    base = TorchtitanExperts(ex)
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    out = ex(x, counts)
    saved_moekit = torch.cuda.memory_allocated() - m0 - out.numel() * out.element_size()
    m1 = torch.cuda.memory_allocated()
    ref = base(x, counts)
    saved_base = torch.cuda.memory_allocated() - m1 - ref.numel() * ref.element_size()
    ex32 = GptOssExperts(512, 320, 8, device=DEV, dtype=torch.float32)
    ex32.load_state_dict({k: v.float() for k, v in ex.state_dict().items()})
    oracle = TorchtitanExperts(ex32)(x.detach().float(), counts)
    assert_within_baseline(out, oracle, ref, what="module")
    assert saved_moekit <= 0.5 * saved_base, (saved_moekit, saved_base)


def test_no_host_sync_and_cuda_graph():
    ex, x, counts, dy = _module_case()
    _module_step(ex, x, counts, dy)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _module_step(ex, x, counts, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    static_x = x.detach().clone().requires_grad_()
    static_counts = counts.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for p in ex.parameters():
            p.grad = None
        _module_step(ex, static_x, static_counts, dy)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    for p in ex.parameters():
        p.grad = None
    static_x.grad = None
    with torch.cuda.graph(graph):
        out_graph = _module_step(ex, static_x, static_counts, dy)
    new_counts = routed_counts(1024, 8, 4, skew=3.0, device=DEV)
    static_counts.copy_(new_counts)
    graph.replay()
    grads_graph = [p.grad.clone() for p in ex.parameters()]
    for p in ex.parameters():
        p.grad = None
    x2 = static_x.detach().clone().requires_grad_()
    out_eager = _module_step(ex, x2, new_counts, dy)
    torch.testing.assert_close(out_graph, out_eager, rtol=0, atol=0)
    for g_graph, p in zip(grads_graph, ex.parameters(), strict=True):
        torch.testing.assert_close(g_graph, p.grad, rtol=0, atol=0)


def test_compile_fullgraph():
    ex, x, counts, dy = _module_case()
    compiled = torch.compile(ex, fullgraph=True)
    out = _module_step(compiled, x, counts, dy)
    grads = [p.grad.clone() for p in ex.parameters()] + [x.grad.clone()]
    for p in ex.parameters():
        p.grad = None
    x.grad = None
    ref = _module_step(ex, x, counts, dy)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, b in zip(grads, [p.grad for p in ex.parameters()] + [x.grad], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_opcheck():
    x, w1, b1, w2, b2, offs = _inputs([300, 0, 700], 1024, 256, 192)
    x = torch.nan_to_num(x)
    spec = (1.702, 7.0, 1.0, "interleaved")
    # No gradients into _grouped_mm_swiglu_op here: opcheck backpropagates random gradients into every output,
    # h included, which the fused contract rejects by design (test_gradient_through_h_raises). Its
    # autograd is checked against float64 above.
    scale = torch.rand(1024, device=DEV) + 0.5
    torch.library.opcheck(_grouped_mm_swiglu_op.op, (x, w1, offs, b1, None, None, None, *spec, True))
    torch.library.opcheck(_grouped_mm_swiglu_op.op, (x, w1, offs, b1, None, None, scale, *spec, True))
    h, aux = _grouped_mm_swiglu_op(x, w1, offs, b1, None, None, None, *spec, True)
    torch.library.opcheck(_grouped_mm_downproj_op.op,
                          (h.detach(), _leaf(w2), offs, _leaf(b2), _leaf(aux), None, *spec, True))
    torch.library.opcheck(_grouped_mm_downproj_op.op,
                          (h.detach(), _leaf(w2), offs, None, _leaf(aux), _leaf(scale), *spec, True))
    dy = torch.randn(1024, 256, device=DEV, dtype=BF16)
    # h recomputed: db_down in the wgrad (F % 128 != 0), or a column-sum pass (zero tails: opcheck compares
    # whole outputs, and an unwritten tail holds whatever was there)
    torch.library.opcheck(_grouped_mm_downproj_bwd_op.op, (dy, w2, offs, aux, None, None, True, True, *spec, True))
    torch.library.opcheck(_grouped_mm_downproj_bwd_op.op, (dy, w2, offs, aux, None, None, False, True, *spec, True))
    torch.library.opcheck(_grouped_mm_downproj_bwd_op.op, (dy, w2, offs, aux, None, scale, True, False, *spec, True))
    # h saved: F = 192 (% 128 == 64) gives db_down in the wgrad (ws)
    torch.library.opcheck(_grouped_mm_downproj_bwd_op.op,
                          (dy, w2, offs, aux, h.detach(), None, True, True, *spec, True))
    torch.library.opcheck(_grouped_mm_downproj_bwd_op.op,
                          (dy, w2, offs, aux, h.detach(), scale, True, False, *spec, True))
    torch.library.opcheck(_colsum_op.op, (dy, offs))
    torch.library.opcheck(_wgrad_colsum_op.op, (x, dy, offs))  # D = 256: sums from a pass
    torch.library.opcheck(_wgrad_colsum_op.op, (x[:, :192], dy, offs))  # D % 128 == 64: from the GEMM (ws)
    from moekit.routing import routing_metadata_fwd

    ids = torch.rand(500, 3, device=DEV).topk(2, -1).indices.to(torch.int32)
    _, offs3, token_idx, _ = routing_metadata_fwd(ids, 3)
    tokens = torch.randn(500, 200, device=DEV, dtype=BF16)  # D = 200: the ones column fits the last tile
    d_aux = torch.randn(1000, 96, device=DEV, dtype=BF16)
    torch.library.opcheck(_gathered_wgrad_op.op, (tokens, token_idx, d_aux, offs3))
    torch.library.opcheck(_swiglu_op.op, (_leaf(aux), *spec))

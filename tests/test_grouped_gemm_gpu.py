"""grouped_mm on a CUDA GPU: realistic shapes against a float64 reference, every tile config the
heuristic can pick, autograd, no host sync, CUDA graphs, opcheck and torch.compile."""

import pytest
import torch

from moekit import config, grouped_gemm, grouped_mm, grouped_mm_ref
from moekit.grouped_gemm import grouped_mm_fwd, grouped_mm_op, ragged_k
from moekit.hopper import ws_gemm, ws_ok
from moekit.testing import assert_close, offs_from_counts, random_counts, routed_counts

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16


def _ref(a, b, offs):
    return grouped_mm_ref(torch.nan_to_num(a.double()), torch.nan_to_num(b.double()), offs)


def _ragged_m_inputs(counts, m, k, n, *, b_trans=True):
    offs = offs_from_counts(counts, device=DEV)
    a = torch.randn(m, k, device=DEV).to(BF16)
    a[int(sum(counts)) :] = float("nan")  # unowned rows: must not leak
    e = len(counts)
    b = torch.randn(e, n, k, device=DEV).to(BF16).mT if b_trans else torch.randn(e, k, n, device=DEV).to(BF16)
    return a, b / k**0.5, offs


# (E, rows, K, N, routing) and why
SHAPES = [
    pytest.param(8, 8192, 2880, 5760, "balanced", id="gptoss-up-e8"),  # the main 128x256 path, B as (E, N, K) view
    pytest.param(32, 6144, 2880, 2880, "skewed", id="gptoss-down-e32-skewed"),  # empty and hot experts
    pytest.param(128, 4096, 2048, 1536, "skewed", id="qwen-up-e128"),  # E+1 > 128 groups, short groups
    pytest.param(32, 1024, 2880, 5760, "balanced", id="small-m"),  # 32 rows/expert: the small-M config
    pytest.param(4, 1000, 136, 72, "random", id="odd-kn"),  # K, N not tile multiples
]


def _counts(e, rows, routing):
    if routing == "random":
        return random_counts(rows - 37, e)  # leaves 37 rows past offs[-1]
    return routed_counts(rows // 4, e, 4, skew=3.0 if routing == "skewed" else 0.0).tolist()


@pytest.mark.parametrize("e, rows, k, n, routing", SHAPES)
def test_forward_dgrad_wgrad(tma_path, e, rows, k, n, routing):
    counts = _counts(e, rows, routing)
    a, b, offs = _ragged_m_inputs(counts, rows, k, n)
    out = grouped_mm(a, b, offs)
    assert_close(out, _ref(a, b, offs), BF16, what="fwd")
    assert (out[int(offs[-1]) :] == 0).all()

    dy = torch.randn(rows, n, device=DEV).to(BF16)
    dx = grouped_mm(dy, b.mT, offs)
    assert_close(dx, _ref(dy, b.mT, offs), BF16, what="dgrad")

    x = torch.nan_to_num(a)
    dw = grouped_mm(x.mT, dy, offs)
    assert_close(dw, _ref(x.mT, dy, offs), BF16, what="wgrad")
    for g, c in enumerate(counts):
        if c == 0:
            assert (dw[g] == 0).all()


CONFIGS = [
    config.TileConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3),
    config.TileConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, flatten=True),
    config.TileConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    config.TileConfig(64, 256, 64, group_m=8, num_warps=4, num_stages=4),
    config.TileConfig(64, 128, 128, group_m=1, num_warps=4, num_stages=4),
    config.TileConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=4, flatten=True, split_store=True),
    config.TileConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=2, split_store=True, programs_per_sm=2),
]


def _cfg_id(c):
    flags = f"f{int(c.flatten)}h{int(c.split_store)}p{c.programs_per_sm}"
    return f"{c.block_m}x{c.block_n}x{c.block_k}-s{c.num_stages}-{flags}"


# (counts, rows, K, N, b_trans, bias) and why
WS_CASES = [
    pytest.param([300, 0, 517, 180], 1100, 200, 296, True, True, id="empty-expert-tails"),  # K, N tails, tail rows
    pytest.param([300, 0, 517, 180], 1100, 200, 296, False, True, id="b-row-major"),  # weights (E, K, N)
    pytest.param([0, 0, 999, 0], 999, 64, 128, True, False, id="one-expert"),  # every row on one expert
    pytest.param([1, 2, 3, 4, 5], 15, 136, 264, False, True, id="tiny-groups"),  # groups inside one tile
    pytest.param([4096, 3000, 5000, 4192], 16288, 2880, 2880, True, True, id="gptoss"),  # many tiles per SM
    pytest.param([4096, 3000, 5000, 4192], 16288, 2880, 2880, False, False, id="gptoss-b-row-major"),
    pytest.param([70, 0, 130, 1], 260, 96, 40, False, True, id="n-below-64"),  # one column tile, mostly past N
    pytest.param([70, 0, 130, 1], 260, 96, 40, True, False, id="n-below-64-b-trans"),
]


@pytest.mark.parametrize("counts, rows, k, n, b_trans, has_bias", WS_CASES)
def test_warp_specialized_kernel(counts, rows, k, n, b_trans, has_bias):
    """The warp-specialized Hopper GEMM (plain epilogue) on its own: every element written once."""
    a, b, offs = _ragged_m_inputs(counts, rows, k, n, b_trans=b_trans)
    a[int(sum(counts)) :] = 1.0  # rows past offs[-1] must come out zero, not a @ b
    if not ws_ok(a, b):
        pytest.skip("needs an sm_90 GPU with Gluon")
    bias = torch.randn(len(counts), n, device=DEV).to(BF16) if has_bias else None
    out = torch.full((rows, n), float("nan"), device=DEV, dtype=BF16)
    ws_gemm(a, b, offs, out, bias=bias)
    ref = _ref(a, b, offs)
    if bias is not None:
        groups = torch.repeat_interleave(torch.arange(len(counts), device=DEV), torch.tensor(counts, device=DEV))
        ref[: int(sum(counts))] += bias.double()[groups]
    assert not out.isnan().any()
    assert_close(out, ref, BF16, what="ws_gemm")
    assert not out[int(sum(counts)) :].any()


# (counts over Kt, Kt, M, N, column sums) and why
WS_WGRAD_CASES = [
    pytest.param([300, 0, 517, 180], 1100, 200, 296, "", id="empty-expert-tails"),  # M, N tails, tail rows
    pytest.param([1, 2, 3, 70, 5], 90, 136, 264, "", id="tiny-groups"),  # groups shorter than BLOCK_K
    pytest.param([0, 0, 999, 0], 999, 64, 128, "", id="one-expert"),  # every row in one group
    pytest.param([300, 0, 517, 180], 1100, 129, 200, "row", id="ones-row"),  # ones row alone in a tile
    pytest.param([768] * 12 + [0, 1500], 10716, 2881, 2880, "row", id="gptoss-120b-ones-row"),  # db_down
    pytest.param([300, 0, 517, 180], 1100, 192, 296, "virtual", id="virtual-ones"),  # M % 128 == 64
    pytest.param([768] * 12 + [0, 1500], 10716, 2880, 5760, "virtual", id="gptoss-120b-virtual-ones"),  # db_up
]


@pytest.mark.parametrize("counts, kt, m, n, sums", WS_WGRAD_CASES)
def test_warp_specialized_wgrad(monkeypatch, counts, kt, m, n, sums):
    """The warp-specialized ragged-K GEMM: a (M, Kt) with unit stride along M (x.mT), b (Kt, N). Rows
    of Kt past offs[-1] hold NaN and must not leak; an empty group's block is exactly zero. Column sums
    of b, in fp32: "row", from a's own last row of ones; "virtual", from a constant row of ones in the
    empty half of the last row tile."""
    if not config.use_warp_specialized(torch.device(DEV)):
        pytest.skip("needs an sm_90 GPU with Gluon")
    calls = []
    launch = grouped_gemm.ws_ragged_k
    monkeypatch.setattr(grouped_gemm, "ws_ragged_k", lambda *args: calls.append(1) or launch(*args))
    offs = offs_from_counts(counts, device=DEV)
    x = torch.randn(kt, (m + 63) // 64 * 64, device=DEV).to(BF16)[:, :m]  # row stride padded like h's
    dy = torch.randn(kt, n, device=DEV).to(BF16)
    if sums == "row":
        x[:, -1] = 1.0
    x[int(sum(counts)) :], dy[int(sum(counts)) :] = float("nan"), float("nan")
    out = ragged_k(x.mT, dy, offs, BF16, None, ones_row=sums == "row", colsum=sums == "virtual")
    assert calls, "the ragged-K GEMM did not take the warp-specialized kernel"
    ref = _ref(x.mT, dy, offs)
    if sums:
        out, colsum = out
        want = ref[:, -1] if sums == "row" else _ref(torch.ones(1, kt, device=DEV, dtype=BF16), dy, offs)[:, 0]
        assert colsum is not None and colsum.dtype == torch.float32 and not colsum.isnan().any()
        torch.testing.assert_close(colsum, want.float(), rtol=1e-5, atol=1e-3)
        ref = ref[:, :-1] if sums == "row" else ref
    assert not out.isnan().any()
    assert_close(out, ref, BF16, what="ws wgrad")
    for g, c in enumerate(counts):
        if c == 0:
            assert (out[g] == 0).all()


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_pinned_configs(tma_path, cfg):
    counts = [700, 0, 1, 1300, 255, 0, 2048, 33]
    a, b, offs = _ragged_m_inputs(counts, 4700, 1024, 768, b_trans=False)
    assert_close(grouped_mm_fwd(a, b, offs, cfg=cfg), _ref(a, b, offs), BF16, what="ragged-m")
    x, dy = torch.nan_to_num(a), torch.randn(4700, 768, device=DEV).to(BF16)
    assert_close(grouped_mm_fwd(x.mT, dy, offs, cfg=cfg), _ref(x.mT, dy, offs), BF16, what="ragged-k")


def test_fp32_out_and_3d3d():
    a, b, offs = _ragged_m_inputs([100, 0, 300], 512, 256, 384)
    out = grouped_mm(a, b, offs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, _ref(a, b, offs), torch.float32)
    a3, b3 = torch.randn(4, 200, 256, device=DEV).to(BF16), torch.randn(4, 256, 72, device=DEV).to(BF16)
    assert_close(grouped_mm(a3, b3), torch.bmm(a3.double(), b3.double()), BF16)


@pytest.mark.parametrize("rows, counts", [(0, [0, 0]), (1, [0, 1]), (64, [0, 0])], ids=["m0", "t1", "all-tail"])
def test_edge_sizes(rows, counts):
    a, b, offs = _ragged_m_inputs(counts, rows, 64, 32)
    out = grouped_mm(a, b, offs)
    assert_close(out, _ref(a, b, offs), BF16)
    dw = grouped_mm(torch.nan_to_num(a).mT, torch.randn(rows, 32, device=DEV).to(BF16), offs)
    assert dw.shape == (2, 64, 32)


def _train_step(a, b, offs, dy):
    out = grouped_mm(a, b, offs)
    out.backward(dy)
    return out


def _leaves(rows=2048, k=512, n=768, counts=(300, 0, 1000, 600)):
    a, b, offs = _ragged_m_inputs(list(counts), rows, k, n)
    a = torch.nan_to_num(a).requires_grad_()
    b = b.detach().requires_grad_()
    return a, b, offs, torch.randn(rows, n, device=DEV).to(BF16)


def test_autograd_against_reference():
    a, b, offs, dy = _leaves()
    _train_step(a, b, offs, dy)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    grouped_mm_ref(a64, b64, offs).backward(dy.double())
    assert_close(a.grad, a64.grad, BF16, what="dA")
    assert_close(b.grad, b64.grad, BF16, what="dB")
    assert (b.grad[1] == 0).all()


def test_no_host_sync():
    a, b, offs, dy = _leaves()
    _train_step(a, b, offs, dy)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        a.grad = b.grad = None
        _train_step(a, b, offs, dy)
        grouped_mm(a.detach().mT, dy, offs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_capture_and_replay():
    a, b, offs, dy = _leaves()
    static = [t.detach().clone() for t in (a, b)]
    static_offs, static_dy = offs.clone(), dy.clone()

    def step():
        x, w = static[0].requires_grad_(), static[1].requires_grad_()
        x.grad = w.grad = None
        out = grouped_mm(x, w, static_offs)
        out.backward(static_dy)
        return out, x.grad, w.grad

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    # new data, new routing: the graph must follow both through device memory alone
    new_a = torch.randn_like(a)
    new_offs = offs_from_counts([1000, 200, 0, 700], device=DEV)
    static[0].data.copy_(new_a)
    static_offs.copy_(new_offs)
    graph.replay()
    x = new_a.detach().requires_grad_()
    w = b.detach().clone().requires_grad_()
    out = grouped_mm(x, w, new_offs)
    out.backward(dy)
    torch.testing.assert_close(outs[0], out, rtol=0, atol=0)
    torch.testing.assert_close(outs[1], x.grad, rtol=0, atol=0)
    torch.testing.assert_close(outs[2], w.grad, rtol=0, atol=0)


@pytest.mark.parametrize("form", ["2d3d", "2d2d"])
def test_opcheck(form):
    a, b, offs = _ragged_m_inputs([40, 0, 88], 160, 64, 96)
    a = torch.nan_to_num(a)
    if form == "2d2d":
        a, b = a.mT, torch.randn(160, 96, device=DEV).to(BF16)
    torch.library.opcheck(grouped_mm_op.op, (a.requires_grad_(), b.detach().requires_grad_(), offs, None))


def test_compile_fullgraph():
    a, b, offs, dy = _leaves()

    @torch.compile(fullgraph=True)
    def fn(x, w, o):
        return torch.relu(grouped_mm(x, w, o)) * 2

    out = fn(a, b, offs)
    out.backward(dy)
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    ref = torch.relu(grouped_mm(a, b, offs)) * 2
    ref.backward(dy)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(ga, a.grad, rtol=0, atol=0)
    torch.testing.assert_close(gb, b.grad, rtol=0, atol=0)

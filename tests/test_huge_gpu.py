"""Operands and outputs past 2**31 elements on a CUDA GPU, where 32-bit offsets overflow (the class of
torchtitan#1932's illegal address). Each test puts a small group, or the rows it checks, at the very
end of a tensor of more than 2**31 elements and holds those rows to a float64 reference; rows past
offs[-1] must stay zero. Skipped, with the reason, on a GPU with too little free memory."""

import pytest
import torch

from moekit import combine, grouped_mm, grouped_mm_swiglu
from moekit.epilogue import SwiGLU, swiglu_torch
from moekit.routing import gather_rows_with_ones
from moekit.testing import assert_close, offs_from_counts

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16 = torch.bfloat16
BIG = 2**31


def _need(gib: float) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs {gib:.0f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


@pytest.fixture(autouse=True)
def _release():
    yield
    torch.cuda.empty_cache()


def test_torchtitan_1932_forward_output_past_2_31():
    """(M, K) @ (E, K, N) with M * N > 2**31: the last group's output rows start past element 2**31."""
    _need(12)
    n, k = 32768, 64
    counts = [66_000, 0, 700]
    m = sum(counts) + 40  # 40 rows past offs[-1]
    assert m * n > BIG
    a = torch.randn(m, k, device=DEV, dtype=BF16)
    b = torch.randn(len(counts), k, n, device=DEV, dtype=BF16) / k**0.5
    out = grouped_mm(a, b, offs_from_counts(counts, device=DEV))
    start = counts[0] + counts[1]
    assert start * n > BIG
    want = a[start : start + counts[2]].double() @ b[2].double()
    assert_close(out[start : start + counts[2]], want, BF16, what="last group")
    assert not out[sum(counts) :].any()


def test_torchtitan_1932_wgrad_input_past_2_31():
    """The ragged-K weight gradient a^T @ dy with a (M, K) of more than 2**31 elements: the last
    group's rows of a lie past element 2**31."""
    _need(12)
    k, n = 1104, 64
    counts = [1_953_000, 0, 300]
    m = sum(counts)
    assert m * k > BIG
    a = torch.randn(m, k, device=DEV, dtype=BF16)
    dy = torch.randn(m, n, device=DEV, dtype=BF16)
    dw = grouped_mm(a.mT, dy, offs_from_counts(counts, device=DEV))
    start = counts[0]
    assert start * k > BIG
    want = a[start:].double().T @ dy[start:].double()
    assert_close(dw[2], want, BF16, what="last group")
    assert not dw[1].any()


def test_torchtitan_1932_gathered_up_projection_past_2_31():
    """The permute-free up-projection (rows gathered through token_idx) with an (R, 2F) output of more
    than 2**31 elements; the rows checked are the last ones, of the last expert."""
    _need(16)
    t, top_k, d, f, e = 2**19, 4, 256, 520, 4
    r = t * top_k
    assert r * 2 * f > BIG
    x = torch.randn(t, d, device=DEV, dtype=BF16)
    w = torch.randn(e, d, 2 * f, device=DEV, dtype=BF16) / d**0.5
    token_idx = torch.randint(0, t, (r,), device=DEV, dtype=torch.int32)
    row_of = torch.zeros(t, top_k, device=DEV, dtype=torch.int32)  # (only the backward reads it)
    counts = [r // 4] * 4
    h, aux = grouped_mm_swiglu(x, w, offs_from_counts(counts, device=DEV), token_idx=token_idx, row_of=row_of)
    rows = torch.arange(r - 256, r, device=DEV)
    want_aux = x[token_idx[rows].long()].double() @ w[3].double()
    assert_close(aux[rows], want_aux, BF16, what="aux")
    assert_close(h[rows], swiglu_torch(aux[rows].double(), SwiGLU()), BF16, what="h")


def test_torchtitan_1932_row_gather_past_2_31():
    """The backward's copy of x's routed rows (with its ones column) past 2**31 elements."""
    _need(12)
    t, r, d = 2**18, 2**21, 1100
    assert r * (d + 1) > BIG
    x = torch.randn(t, d, device=DEV, dtype=BF16)
    token_idx = torch.randint(0, t, (r,), device=DEV, dtype=torch.int32)
    out = gather_rows_with_ones(x, token_idx)
    tail = slice(r - 300, r)
    assert torch.equal(out[tail, :d], x[token_idx[tail].long()]) and (out[tail, d] == 1).all()


def test_torchtitan_1932_combine_past_2_31():
    """The weighted combine and its backward with y (R, D) of more than 2**31 elements: the last tokens'
    rows lie past element 2**31 (an identity routing puts token t's rows at t*K .. t*K + K - 1)."""
    _need(20)
    t, top_k, d = 2**18, 8, 1100
    r = t * top_k
    assert r * d > BIG
    y = torch.randn(r, d, device=DEV, dtype=BF16).requires_grad_()
    w = torch.rand(t, top_k, device=DEV).requires_grad_()
    row_of = torch.arange(r, device=DEV, dtype=torch.int32).view(t, top_k)
    out = combine(y, w, row_of)
    dout = torch.randn(t, d, device=DEV, dtype=BF16)
    out.backward(dout)
    last = slice(t - 64, t)
    ys = y.detach()[(t - 64) * top_k :].double().view(64, top_k, d)
    want = (ys * w.detach()[last].double()[..., None]).sum(1)
    assert_close(out[last], want, BF16, what="combine")
    want_dy = dout[last].double()[:, None, :] * w.detach()[last].double()[..., None]
    assert_close(y.grad[(t - 64) * top_k :], want_dy.reshape(-1, d), BF16, what="dy")
    assert_close(w.grad[last], (ys * dout[last].double()[:, None, :]).sum(-1), torch.float32, what="dw")

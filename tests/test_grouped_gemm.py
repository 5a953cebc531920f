"""grouped_mm on CPU: the Triton kernels under TRITON_INTERPRET=1 against a float64 reference.

Tiny shapes, the interpreter's tile config (32x32x16, 4 persistent programs, so every program walks
several tiles), both the TMA-descriptor path and the pointer path. Outputs are NaN-poisoned before
each launch (conftest), so an element a kernel forgets to write fails.
"""

import pytest
import torch

import moekit
from moekit import config, grouped_mm, grouped_mm_ref
from moekit.grouped_gemm import grouped_mm_fwd
from moekit.testing import assert_close, offs_from_counts

BF16 = torch.bfloat16

# (counts per expert, rows M, K, N) and why the case exists
RAGGED_M_CASES = [
    pytest.param([20, 13, 31, 0], 64, 40, 72, id="uneven-with-empty"),  # partial tiles, an empty expert
    pytest.param([0, 0, 70, 0], 70, 24, 40, id="all-on-one"),  # every row on one expert
    pytest.param([9, 0, 0, 11], 48, 136, 72, id="odd-k-n-tail"),  # K, N not tile multiples; rows past offs[-1]
    pytest.param([0, 0, 0], 0, 16, 24, id="m-zero"),  # no rows at all
    pytest.param([0, 0], 24, 16, 8, id="all-tail"),  # rows exist but no expert owns any: all zeros
    pytest.param([1], 1, 16, 8, id="one-row"),  # T=1
    pytest.param([5, 3, 4, 2, 6, 0, 7, 1, 8], 40, 16, 32, id="e9"),  # E+1 not a power of two
]


def _inputs_2d3d(counts, m, k, n, *, a_trans=False, b_trans=False):
    offs = offs_from_counts(counts)
    a = torch.randn(k, m).to(BF16).mT if a_trans else torch.randn(m, k).to(BF16)
    # rows no expert owns hold NaN: they must neither leak into other rows nor reach the output
    if m:
        a[int(offs[-1]):] = float("nan")
    e = len(counts)
    b = torch.randn(e, n, k).to(BF16).mT if b_trans else torch.randn(e, k, n).to(BF16)
    return a, b, offs


@pytest.mark.parametrize("counts, m, k, n", RAGGED_M_CASES)
@pytest.mark.parametrize("b_trans", [False, True], ids=["b-kn", "b-nk-view"])
def test_ragged_m_forward(interpreter, tma_path, counts, m, k, n, b_trans):
    a, b, offs = _inputs_2d3d(counts, m, k, n, b_trans=b_trans)
    out = grouped_mm(a, b, offs)
    ref = grouped_mm_ref(torch.nan_to_num(a.double()), b.double(), offs)
    assert out.dtype == BF16
    assert_close(out, ref, BF16, what="2d3d")
    assert (out[int(offs[-1]) if m else 0:] == 0).all(), "rows past offs[-1] must be exactly zero"


def test_ragged_m_transposed_a_and_fp32_out(interpreter, tma_path):
    a, b, offs = _inputs_2d3d([10, 0, 22], 40, 24, 48, a_trans=True)
    out = grouped_mm(a, b, offs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, grouped_mm_ref(torch.nan_to_num(a.double()), b.double(), offs), torch.float32)


# (counts over the ragged reduction dim, Kt, M, N) and why
RAGGED_K_CASES = [
    pytest.param([20, 0, 31, 13], 64, 40, 72, id="uneven-with-empty"),  # an empty group must be exactly 0
    pytest.param([0, 64, 0], 64, 24, 40, id="all-on-one"),
    pytest.param([7, 0, 10], 24, 136, 72, id="odd-m-n-tail"),  # Kt past offs[-1] holds NaN
    pytest.param([0, 0], 0, 16, 24, id="kt-zero"),  # nothing to reduce: all zeros
    pytest.param([3, 5], 8, 8, 16, id="short-groups"),  # groups shorter than one K step
]


def _inputs_2d2d(counts, kt, m, n):
    offs = offs_from_counts(counts)
    x = torch.randn(kt, m).to(BF16)  # the activations of a wgrad; a = x.mT has unit stride along M
    dy = torch.randn(kt, n).to(BF16)
    if kt:
        x[int(offs[-1]):] = float("nan")
        dy[int(offs[-1]):] = float("nan")
    return x.mT, dy, offs


@pytest.mark.parametrize("counts, kt, m, n", RAGGED_K_CASES)
def test_ragged_k_forward(interpreter, tma_path, counts, kt, m, n):
    a, b, offs = _inputs_2d2d(counts, kt, m, n)
    out = grouped_mm(a, b, offs)
    ref = grouped_mm_ref(torch.nan_to_num(a.double()), torch.nan_to_num(b.double()), offs)
    assert out.shape == (len(counts), m, n)
    for g, c in enumerate(counts):
        if c == 0:
            assert (out[g] == 0).all(), f"empty group {g} must be exactly zero"
    assert_close(out, ref, BF16, what="2d2d")


def test_ragged_k_row_major_operands(interpreter, tma_path):
    """a with unit stride along Kt and b with unit stride along Kt: the pointer fallback."""
    offs = offs_from_counts([9, 0, 15])
    a = torch.randn(40, 24).to(BF16)
    b = torch.randn(32, 24).to(BF16).mT
    out = grouped_mm(a, b, offs)
    assert_close(out, grouped_mm_ref(a.double(), b.double(), offs), BF16)


def test_batched_3d3d(interpreter):
    a, b = torch.randn(3, 16, 24).to(BF16), torch.randn(3, 24, 40).to(BF16)
    assert_close(grouped_mm(a, b), torch.bmm(a.double(), b.double()), BF16)


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(config.TileConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=1), id="16x16-g1"),
        pytest.param(config.TileConfig(32, 64, 32, group_m=4, num_warps=4, num_stages=1), id="32x64-g4"),
    ],
)
def test_pinned_configs(interpreter, tma_path, cfg):
    """Other tile shapes and swizzle widths than the interpreter default."""
    a, b, offs = _inputs_2d3d([17, 0, 40, 3], 70, 48, 72)
    ref = grouped_mm_ref(torch.nan_to_num(a.double()), b.double(), offs)
    assert_close(grouped_mm_fwd(a, b, offs, cfg=cfg), ref, BF16)
    x, dy, offs_k = _inputs_2d2d([17, 0, 40, 3], 64, 48, 72)
    ref_k = grouped_mm_ref(torch.nan_to_num(x.double()), torch.nan_to_num(dy.double()), offs_k)
    assert_close(grouped_mm_fwd(x, dy, offs_k, cfg=cfg), ref_k, BF16)


@pytest.mark.parametrize("counts", [[12, 0, 30, 6], [0, 48, 0, 0]], ids=["with-empty", "all-on-one"])
def test_ragged_m_backward(interpreter, counts):
    m, k, n = 56, 40, 72
    offs = offs_from_counts(counts)
    a = torch.randn(m, k).to(BF16).requires_grad_()
    b = torch.randn(len(counts), n, k).to(BF16).mT.detach().requires_grad_()  # torchtitan's (E, N, K) storage
    dy = torch.randn(m, n).to(BF16)
    grouped_mm(a, b, offs).backward(dy)

    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    grouped_mm_ref(a64, b64, offs).backward(dy.double())
    assert_close(a.grad, a64.grad, BF16, what="dA")
    assert_close(b.grad, b64.grad, BF16, what="dB")
    for g, c in enumerate(counts):
        if c == 0:
            assert (b.grad[g] == 0).all(), "an empty expert's weight gradient must be exactly zero"
    assert (a.grad[int(offs[-1]):] == 0).all()


def test_ragged_k_backward(interpreter):
    counts, m, n = [10, 0, 20], 24, 40
    offs = offs_from_counts(counts)
    a = torch.randn(30, m).to(BF16).mT.detach().requires_grad_()
    b = torch.randn(30, n).to(BF16).requires_grad_()
    dy = torch.randn(3, m, n).to(BF16)
    grouped_mm(a, b, offs).backward(dy)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    grouped_mm_ref(a64, b64, offs).backward(dy.double())
    assert_close(a.grad, a64.grad, BF16, what="dA")
    assert_close(b.grad, b64.grad, BF16, what="dB")


def test_custom_op_path_matches_eager_path(interpreter):
    """torch.compile traces the registered moekit::grouped_mm; eager calls skip the dispatcher (its
    autograd.Function runs the same implementation and formula). Same kernels, same bits."""
    from moekit.grouped_gemm import grouped_mm_op

    offs = offs_from_counts([10, 0, 22])
    a = torch.randn(40, 24).to(BF16).requires_grad_()
    b = torch.randn(3, 40, 24).to(BF16).mT.detach().requires_grad_()
    dy = torch.randn(40, 40).to(BF16)
    out_eager = grouped_mm(a, b, offs)
    assert type(out_eager.grad_fn).__name__ == "GroupedMmFnBackward"  # the eager path, not the dispatcher's
    out_eager.backward(dy)
    grads = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    out_op = grouped_mm_op.op(a, b, offs, None)  # through the dispatcher
    assert "moekit_grouped_mm" in type(out_op.grad_fn).__name__
    out_op.backward(dy)
    for x, y in zip((out_eager, *grads), (out_op, a.grad, b.grad), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_backward_with_expanded_grad(interpreter):
    """out.sum().backward() hands a stride-0 gradient; it must be made usable, not rejected."""
    offs = offs_from_counts([8, 8])
    a = torch.randn(16, 16).to(BF16).requires_grad_()
    b = torch.randn(2, 16, 24).to(BF16).requires_grad_()
    grouped_mm(a, b, offs).float().sum().backward()
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    grouped_mm_ref(a64, b64, offs).sum().backward()
    assert_close(a.grad, a64.grad, BF16)
    assert_close(b.grad, b64.grad, BF16)


def test_cpu_without_interpreter_uses_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a, b, offs = _inputs_2d3d([5, 0, 9], 16, 16, 8)
    out = grouped_mm(torch.nan_to_num(a), b, offs)
    torch.testing.assert_close(out, grouped_mm_ref(torch.nan_to_num(a), b, offs), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------------------------------
def _ok():
    return torch.randn(16, 32).to(BF16), torch.randn(2, 32, 24).to(BF16), offs_from_counts([8, 8])


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        pytest.param(lambda a, b, o: (a.float(), b, o), TypeError, "bfloat16 or float16", id="dtype"),
        pytest.param(lambda a, b, o: (a, b.half(), o), TypeError, "share a dtype", id="mixed-dtype"),
        pytest.param(lambda a, b, o: (a[:, :16], b, o), ValueError, "K mismatch", id="k-mismatch"),
        pytest.param(lambda a, b, o: (a, b, o.long()), TypeError, "int32", id="offs-int64"),
        pytest.param(lambda a, b, o: (a, b, o[None]), TypeError, "1-D", id="offs-2d"),
        pytest.param(lambda a, b, o: (a, b, o[:1]), ValueError, "E = 2", id="offs-length"),
        pytest.param(lambda a, b, o: (a, b, None), ValueError, "needs offs", id="offs-missing"),
        pytest.param(lambda a, b, o: (a, b.to("meta"), o), ValueError, "is on", id="devices"),
        pytest.param(lambda a, b, o: (a, torch.randn(2, 32, 20).to(BF16), o), ValueError, r"b.stride\(1\)",
                     id="misaligned-stride"),
        pytest.param(lambda a, b, o: (torch.randn(16, 64).to(BF16)[:, ::2], b, o), ValueError, "unit stride",
                     id="no-unit-stride"),
        pytest.param(lambda a, b, o: (torch.randn(16 * 32 + 1).to(BF16)[1:].view(16, 32), b, o), ValueError,
                     "storage", id="misaligned-base"),
    ],
)
def test_validation_errors(mutate, error, match):
    a, b, offs = mutate(*_ok())
    with pytest.raises(error, match=match):
        grouped_mm(a, b, offs)


@pytest.mark.parametrize("bad", [[8, 4], [-1, 8], [8, 17]], ids=["decreasing", "negative", "past-m"])
def test_validate_checks_offs_values(bad):
    a, b, _ = _ok()
    offs = torch.tensor(bad, dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm(a, b, offs, validate=True)
    with moekit.options(debug=True), pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm(a, b, offs)


@pytest.mark.parametrize("counts, m", [
    pytest.param([300, 0, 517, 180], 1100, id="empty-expert-tail-rows"),  # rows past offs[-1] get zeros
    pytest.param([300, 0, 517, 4000], 1100, id="offs-past-m"),  # a bad offs is clamped to M, never past it
    pytest.param([0, 0], 40, id="all-tail"),  # no row tiles at all
])
@pytest.mark.parametrize("zero_tail", [True, False], ids=["zero-tail", "unwritten-tail"])
def test_warp_specialized_tile_table(interpreter, counts, m, zero_tail):
    """The row-tile table of the warp-specialized Hopper GEMM (a plain Triton prologue, so it runs
    here; the Gluon GEMM itself needs an sm_90 GPU: tests/test_grouped_gemm_gpu.py), and the zeros it
    writes past offs[-1] (none without ZERO_TAIL)."""
    from moekit._kernels.hopper_gemm import _tile_table_kernel

    e, bm, n, n2 = len(counts), 128, 300, 10
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    max_tiles = -(-m // bm) + e
    table = torch.full((4 * (max_tiles + 1),), -7, dtype=torch.int32)
    c, c2 = torch.ones(m, n), torch.ones(m, n2)
    _tile_table_kernel[(8,)](offs, table, c, c2, m, n, n2, e, c.stride(0), c2.stride(0), max_tiles,
                             BLOCK_M=bm, BLOCK_E=8, BLOCK_T=128, BLOCK_Z=32, ZERO_TAIL=zero_tail)
    ends = offs.clamp(max=m).tolist()
    starts = [0] + ends[:-1]
    first = [sum(-(-(ends[h] - starts[h]) // bm) for h in range(g)) for g in range(e)]
    want = [[g, starts[g], ends[g], first[g]] for g in range(e) for _ in range(starts[g], ends[g], bm)]
    assert table[0].item() == len(want)
    assert table[4:].view(-1, 4).tolist() == want + [[0, 0, 0, 0]] * (max_tiles - len(want))
    tail = ends[-1]
    if zero_tail:
        assert not c[tail:].any() and not c2[tail:].any()
    else:
        assert (c[tail:] == 1).all() and (c2[tail:] == 1).all()
    assert (c[:tail] == 1).all() and (c2[:tail] == 1).all()

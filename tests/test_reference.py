"""The reference against an independent oracle (torch._grouped_mm on CPU, and per-group fp64 matmuls)."""

import pytest
import torch

from moekit import grouped_mm_ref
from moekit.testing import assert_close, offs_from_counts

CASES = [
    # (counts, rows M, K, N) reason
    pytest.param([3, 5, 0, 8], 16, 24, 40, id="empty-expert"),
    pytest.param([0, 0, 16, 0], 16, 8, 16, id="all-on-one"),
    pytest.param([4, 4], 12, 16, 8, id="tail-rows"),
    pytest.param([0, 0], 0, 16, 8, id="m-zero"),
]


@pytest.mark.parametrize("counts, m, k, n", CASES)
def test_ref_2d3d_matches_loop(counts, m, k, n):
    offs = offs_from_counts(counts)
    a, b = torch.randn(m, k, dtype=torch.float64), torch.randn(len(counts), k, n, dtype=torch.float64)
    out = grouped_mm_ref(a, b, offs)
    start = 0
    for g, end in enumerate(offs.tolist()):
        torch.testing.assert_close(out[start:end], a[start:end] @ b[g], rtol=0, atol=1e-12)
        start = end
    assert (out[start:] == 0).all()


@pytest.mark.parametrize("counts, m, k, n", CASES)
def test_ref_2d2d_matches_loop(counts, m, k, n):
    offs = offs_from_counts(counts)
    kt = m  # the ragged dim plays the role of the rows here
    a, b = torch.randn(k, kt, dtype=torch.float64), torch.randn(kt, n, dtype=torch.float64)
    out = grouped_mm_ref(a, b, offs)
    start = 0
    for g, end in enumerate(offs.tolist()):
        torch.testing.assert_close(out[g], a[:, start:end] @ b[start:end], rtol=0, atol=1e-12)
        if end == start:
            assert (out[g] == 0).all()
        start = end


def test_ref_matches_torch_grouped_mm_on_cpu():
    """torch._grouped_mm works on CPU too; it is a second, independent oracle for the bf16 reference."""
    counts = [7, 0, 9, 16]
    offs = offs_from_counts(counts)
    a = torch.randn(32, 64, dtype=torch.bfloat16)
    b = torch.randn(4, 64, 48, dtype=torch.bfloat16)
    assert_close(grouped_mm_ref(a, b, offs), torch._grouped_mm(a, b, offs), torch.bfloat16)
    dy = torch.randn(32, 48, dtype=torch.bfloat16)
    assert_close(grouped_mm_ref(a.mT, dy, offs), torch._grouped_mm(a.mT, dy, offs), torch.bfloat16)


def test_ref_is_differentiable():
    offs = offs_from_counts([2, 0, 4])
    a = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 8, 8, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, y: grouped_mm_ref(x, y, offs), (a, b))

"""Host-side TMA descriptors: the plain ones, the weight descriptor over (E, K, N) or (E, N, K)
storage, and the row-bounded descriptors whose row bound is set per access (the module docstring of
``_kernels/grouped_gemm.py`` explains the construction)."""

from __future__ import annotations

import torch

from ._kernels.grouped_gemm import ROW_BOUND_BIG
from .validation import ALIGN

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton without host descriptors: pointer path only
    TensorDescriptor = None


def tma_ok(t: torch.Tensor, unit_dim: int) -> bool:
    """Whether ``t`` can back a TMA descriptor with ``unit_dim`` as its contiguous axis."""
    item = t.element_size()
    if t.stride(unit_dim) != 1 or t.data_ptr() % ALIGN:
        return False
    return all((t.stride(d) * item) % ALIGN == 0 for d in range(t.dim()) if d != unit_dim % t.dim())


def row_bounded(t: torch.Tensor, block: list[int], make=None):
    """Descriptor over a 2-D row-major ``t`` whose row bound is set per access (see the kernels' doc).
    ``make(t, shape, strides, block)`` builds it: Triton's ``TensorDescriptor`` by default, or
    ``hopper.ws_desc`` for the Gluon kernels."""
    s = t.stride(0)
    big = ROW_BOUND_BIG.value
    make = make or TensorDescriptor
    return make(t, [0x7FFF0000, 0x7FFF0000, big, t.shape[1]], [2**34 - s, s, s, 1], [1, 1, *block])


def weight_descriptor(w: torch.Tensor, block_k: int, block_n: int, make=None):
    """Descriptor over an (E, K, N) weight with unit stride along N (boxes [1, block_k, block_n]), or
    along K (then over (E, N, K), boxes [1, block_n, block_k]). ``make`` as in ``row_bounded``."""
    make = make or TensorDescriptor
    if w.stride(2) == 1:
        return make(w, list(w.shape), [w.stride(0), w.stride(1), 1], [1, block_k, block_n])
    e, k, n = w.shape
    return make(w, [e, n, k], [w.stride(0), w.stride(2), 1], [1, block_n, block_k])

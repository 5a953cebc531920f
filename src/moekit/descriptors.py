"""Host-side TMA descriptors: the plain ones, the weight descriptor over (E, K, N) or (E, N, K)
storage, and the row-bounded descriptors whose row bound is set per access (the module docstring of
``_kernels/grouped_gemm.py`` explains the construction)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ._kernels.grouped_gemm import ROW_BOUND_BIG
from .validation import ALIGN

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - triton without host descriptors: pointer path only
    TensorDescriptor = None


def tma_ok(t: torch.Tensor, unit_dim: int) -> bool:
    """Whether ``t`` can back a TMA descriptor with ``unit_dim`` as its contiguous axis: a unit stride
    there, and a 16-byte aligned address and other strides."""
    strides = t.stride()
    if strides[unit_dim] != 1 or t.data_ptr() % ALIGN:
        return False
    item, unit = t.element_size(), unit_dim % len(strides)
    for d, s in enumerate(strides):
        if d != unit and s * item % ALIGN:
            return False
    return True


@functools.cache
def _gluon_descriptor_class():
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    return GluonDescriptor


@functools.cache
def _plain_fields(cls):
    """The defaults of ``cls``'s dataclass fields, or None where its instances cannot be built field by
    field (slots, or not a dataclass)."""
    if "__slots__" in cls.__dict__ or not dataclasses.is_dataclass(cls):
        return None
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


_CHECKED: set = set()  # (class, dtype, box, layout, rank) built once through the class's own checks


def descriptor(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int], layout=None):
    """A host TMA descriptor over ``t``: Triton's ``TensorDescriptor``, or Gluon's with the shared
    ``layout`` (``block`` is the box).

    The first descriptor of each (kind, dtype, box, layout, rank) is built through the class's own
    checks (rank, box, alignment, shape, layout width); later ones are built field by field, without
    them (~5 us of host each): what varies between them is checked by the callers' ``tma_ok`` (the
    address and the strides' 16-byte alignment) and here (a positive shape, a unit last stride)."""
    if layout is None:
        cls, fields = TensorDescriptor, {"base": t, "shape": shape, "strides": strides, "block_shape": block}
    else:
        cls = _gluon_descriptor_class()
        fields = {"base": t, "shape": shape, "strides": strides, "block_shape": block, "layout": layout}
    defaults = _plain_fields(cls)
    key = (cls, t.dtype, tuple(block), layout, len(shape))
    if defaults is None or key not in _CHECKED:
        made = cls(**fields)
        _CHECKED.add(key)
        return made
    if min(shape) <= 0 or strides[-1] != 1:
        raise ValueError(f"moekit: a TMA descriptor needs a positive shape and a unit last stride, got shape "
                         f"{shape}, strides {strides}")
    made = object.__new__(cls)
    made.__dict__.update(defaults)
    made.__dict__.update(fields)
    return made


def row_bounded(t: torch.Tensor, block: list[int], make=None):
    """Descriptor over a 2-D row-major ``t`` whose row bound is set per access (see the kernels' doc).
    ``make(t, shape, strides, block)`` builds it: Triton's ``TensorDescriptor`` (``descriptor``) by default, or
    ``hopper.ws_desc`` for the Gluon kernels."""
    s = t.stride(0)
    big = ROW_BOUND_BIG.value
    make = make or descriptor
    return make(t, [0x7FFF0000, 0x7FFF0000, big, t.shape[1]], [2**34 - s, s, s, 1], [1, 1, *block])


def weight_descriptor(w: torch.Tensor, block_k: int, block_n: int, make=None):
    """Descriptor over an (E, K, N) weight with unit stride along N (boxes [1, block_k, block_n]), or
    along K (then over (E, N, K), boxes [1, block_n, block_k]). ``make`` as in ``row_bounded``."""
    make = make or descriptor
    if w.stride(2) == 1:
        return make(w, list(w.shape), [w.stride(0), w.stride(1), 1], [1, block_k, block_n])
    e, k, n = w.shape
    return make(w, [e, n, k], [w.stride(0), w.stride(2), 1], [1, block_n, block_k])

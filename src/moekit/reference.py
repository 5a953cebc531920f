"""Pure-PyTorch twins of moekit's public ops: the CPU path and the test oracle.

Each ``*_ref`` takes the same arguments as its op, computes in float32 (or float64 when given float64
inputs) and is differentiable through ordinary torch autograd. These functions read ``offs`` on the
host, which is fine for a reference and never done by the kernels.
"""

from __future__ import annotations

import torch


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(v) for v in offs.tolist()]
    return list(zip([0] + ends[:-1], ends, strict=False))


def grouped_mm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference for :func:`moekit.grouped_mm`; same forms, shapes and zero-fill semantics.

    - 2D x 3D: ``a`` (M, K), ``b`` (E, K, N), ``offs`` (E,) -> (M, N); rows past ``offs[-1]`` are 0.
    - 2D x 2D: ``a`` (M, Kt), ``b`` (Kt, N), ``offs`` (E,) over Kt -> (E, M, N); empty groups are 0.
    - 3D x 3D: ``a`` (E, M, K), ``b`` (E, K, N), no ``offs`` -> (E, M, N).
    """
    out_dtype = out_dtype or a.dtype
    cdt = _compute_dtype(a, b)
    af, bf = a.to(cdt), b.to(cdt)
    if a.dim() == 3 and b.dim() == 3:
        return torch.bmm(af, bf).to(out_dtype)
    if offs is None:
        raise ValueError("grouped_mm_ref: offs is required unless both a and b are 3-D")
    if a.dim() == 2 and b.dim() == 3:
        pieces = [af[s:e] @ bf[g] for g, (s, e) in enumerate(_bounds(offs))]
        end = pieces and int(offs[-1]) or 0
        pieces.append(af.new_zeros(a.shape[0] - end, b.shape[-1]))
        return torch.cat(pieces, dim=0).to(out_dtype)
    if a.dim() == 2 and b.dim() == 2:
        # Slice products (not a masked full product) keep an empty group exactly zero and free of any
        # NaN that rows outside the group might hold.
        pieces = [af[:, s:e] @ bf[s:e] for s, e in _bounds(offs)]
        return torch.stack(pieces, dim=0).to(out_dtype)
    raise ValueError(f"grouped_mm_ref: unsupported form {a.dim()}D x {b.dim()}D")

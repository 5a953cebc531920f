"""Pure-PyTorch twins of moekit's public ops: the CPU path and the test oracle.

Each ``*_ref`` takes the same arguments as its op, computes in float32 (or float64 when given float64
inputs) and is differentiable through ordinary torch autograd. These functions read ``offs`` on the
host, which is fine for a reference and never done by the kernels.
"""

from __future__ import annotations

import torch

from .epilogue import SwiGLU, swiglu_torch

H_GRADIENT_ERROR = (
    "moekit: a gradient reached h, the SwiGLU output of grouped_mm_swiglu. Its fused backward "
    "carries the gradient through aux instead: consume h only through "
    "grouped_mm_downproj(h, w_down, offs=offs, aux_biased_acc=aux, ...) with the same SwiGLU settings, "
    "or use moekit.grouped_mm plus a separate activation if h feeds anything else."
)

ROW_SCALE_ERROR = "grouped_mm_downproj: row_scale needs aux_biased_acc (its gradient comes from the fused backward)"


class _NoGradientToH(torch.autograd.Function):
    """Identity whose backward raises ``H_GRADIENT_ERROR``: the fused op's h carries no gradient, and
    the reference enforces the same contract."""

    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(H_GRADIENT_ERROR)


class _ValuesWithGradientOf(torch.autograd.Function):
    """``h``'s values with ``s``'s gradient (the fused down-projection's contract). The same as
    ``h.detach() + (s - s.detach())`` for finite values, but an inf of h stays inf (inf - inf is NaN)."""

    @staticmethod
    def forward(ctx, h, s):
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, grad


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def group_bounds(offs: torch.Tensor, bound: int) -> list[tuple[int, int]]:
    """Each group's [start, end), clamped as the kernels clamp them: end = offs[g] within [0, bound],
    start = offs[g - 1] within [0, end]. Monotonic offs within bounds pass unchanged; others still
    give in-bounds ranges, and the values of the rows they cover are unspecified, the shapes not
    (the kernels also zero the rows past offs[-1], which such a range can overlap)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "moekit: the pure-PyTorch reference reads offs on the host and cannot be traced by torch.compile; "
            "compile on a CUDA device (the kernels are custom ops), or run the reference eagerly"
        )
    raw = [int(v) for v in offs.tolist()]
    ends = [min(max(v, 0), bound) for v in raw]
    starts = [min(max(v, 0), e) for v, e in zip([0] + raw[:-1], ends, strict=True)]
    return list(zip(starts, ends, strict=True))


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
        out = af.new_zeros(a.shape[0], b.shape[-1])
        for g, (start, end) in enumerate(group_bounds(offs, a.shape[0])):
            out[start:end] = af[start:end] @ bf[g]
        return out.to(out_dtype)
    if a.dim() == 2 and b.dim() == 2:
        # Slice products (not a masked full product) keep an empty group exactly zero and free of any
        # NaN that rows outside the group might hold.
        pieces = [af[:, s:e] @ bf[s:e] for s, e in group_bounds(offs, a.shape[1])]
        return torch.stack(pieces, dim=0).to(out_dtype)
    raise ValueError(f"grouped_mm_ref: unsupported form {a.dim()}D x {b.dim()}D")


def _row_bias(bias: torch.Tensor, offs: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """bias (E, N) expanded to one row per routed row (rows, N); rows past offs[-1] get 0."""
    out = bias.new_zeros(rows, bias.shape[1], dtype=dtype)
    for g, (start, end) in enumerate(group_bounds(offs, rows)):
        out[start:end] = bias[g].to(dtype)
    return out


def _scaled_swiglu(aux, spec, row_scale, offs, dtype):
    """SwiGLU(aux) (times row_scale, in the compute dtype, before rounding), rounded to ``dtype``; rows
    past offs[-1] are 0 whatever their scale."""
    if row_scale is None:
        return swiglu_torch(aux, spec).to(dtype)
    cdt = torch.float64 if aux.dtype == torch.float64 else torch.float32
    scale = row_scale.to(cdt)
    ends = group_bounds(offs, aux.shape[0])
    end = ends[-1][1] if ends else 0
    scale = torch.cat([scale[:end], scale.new_zeros(aux.shape[0] - end)])
    return (swiglu_torch(aux.to(cdt), spec) * scale[:, None]).to(dtype)


def grouped_mm_swiglu_ref(
    x, w_up, offs, *, bias=None, row_scale=None, swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_linear_offset=1.0,
    gate_up_layout="interleaved",
):
    """Reference for :func:`moekit.grouped_mm_swiglu`: ``(h, aux)`` with aux = x @ w_up[g] + bias[g]
    rounded to x.dtype, and h = SwiGLU(aux) (times ``row_scale``) computed from that rounded aux (as
    the kernel does). As on the kernels, h carries no gradient: a gradient that reaches it raises
    ``H_GRADIENT_ERROR``."""
    spec = SwiGLU(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout)
    cdt = _compute_dtype(x, w_up)
    pre = grouped_mm_ref(x, w_up, offs, out_dtype=cdt)
    if bias is not None:
        pre = pre + _row_bias(bias, offs, x.shape[0], cdt)
    aux = pre.to(x.dtype)
    scale = None if row_scale is None else row_scale.detach()
    return _NoGradientToH.apply(_scaled_swiglu(aux, spec, scale, offs, x.dtype)), aux


def grouped_mm_downproj_ref(
    h, w_down, offs, *, bias=None, aux_biased_acc=None, row_scale=None, swiglu_alpha=1.702, swiglu_limit=7.0,
    swiglu_linear_offset=1.0, gate_up_layout="interleaved",
):
    """Reference for :func:`moekit.grouped_mm_downproj`: h @ w_down[g] + bias[g].

    With ``aux_biased_acc``, the forward uses h as given, as the kernels do, and autograd carries the
    gradient through SwiGLU(aux) (times ``row_scale``) instead of h: the fused op's contract."""
    if row_scale is not None and aux_biased_acc is None:
        raise ValueError(ROW_SCALE_ERROR)
    if aux_biased_acc is not None:
        spec = SwiGLU(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout)
        s = _scaled_swiglu(aux_biased_acc, spec, row_scale, offs, h.dtype)
        h = _ValuesWithGradientOf.apply(h.detach(), s)  # h's values, SwiGLU(aux)'s gradient
    cdt = _compute_dtype(h, w_down)
    out = grouped_mm_ref(h, w_down, offs, out_dtype=cdt)
    if bias is not None:
        out = out + _row_bias(bias, offs, h.shape[0], cdt)
    return out.to(h.dtype)


def swiglu_ref(pre, *, swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_linear_offset=1.0, gate_up_layout="interleaved"):
    """Reference for :func:`moekit.swiglu`: (M, 2F) -> (M, F), differentiable."""
    return swiglu_torch(pre, SwiGLU(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout))

"""Epilogue specs and their torch twins.

An epilogue is data: a small frozen spec that the launchers turn into constexprs for one
``@triton.jit`` device function (``_kernels/epilogue.py``), which every fused GEMM and standalone
kernel calls. The torch functions here compute the same thing and serve as the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("interleaved", "halves")


@dataclass(frozen=True)
class SwiGLU:
    """SwiGLU over a (.., 2F) pre-activation: ``h = g_c * sigmoid(alpha * g_c) * (l_c + linear_offset)``.

    - ``g_c = g.clamp(max=limit)``, ``l_c = l.clamp(-limit, limit)``; ``limit=None`` disables clamping.
    - gpt-oss is the default (alpha 1.702, limit 7, offset 1); ``alpha=1, limit=None, linear_offset=0``
      is the plain ``silu(g) * u``.
    - ``layout="interleaved"``: g, l = pre[..., 0::2], pre[..., 1::2] (gpt-oss, torchtitan, HF);
      ``"halves"``: g, l = pre[..., :F], pre[..., F:] (Llama, Qwen, DeepSeek stacking).
    """

    alpha: float = 1.702
    limit: float | None = 7.0
    linear_offset: float = 1.0
    layout: str = "interleaved"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"SwiGLU: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"SwiGLU: limit must be positive or None, got {self.limit}")

    @property
    def halves(self) -> bool:
        return self.layout == "halves"

    def constexprs(self) -> dict:
        """The kernel constexprs of this spec."""
        limit = None if self.limit is None else float(self.limit)
        return dict(ALPHA=float(self.alpha), LIMIT=limit, OFFSET=float(self.linear_offset), HALVES=self.halves)


def split_gate_linear(pre: torch.Tensor, spec: SwiGLU) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and linear halves (.., F) of a (.., 2F) pre-activation, as views."""
    if spec.halves:
        f = pre.shape[-1] // 2
        return pre[..., :f], pre[..., f:]
    return pre[..., 0::2], pre[..., 1::2]


def swiglu_torch(pre: torch.Tensor, spec: SwiGLU) -> torch.Tensor:
    """Torch twin of ``swiglu_apply``: (.., 2F) -> (.., F), computed in fp32 (fp64 for fp64 input),
    returned in ``pre.dtype``. Differentiable; its autograd is the reference backward."""
    cdt = torch.float64 if pre.dtype == torch.float64 else torch.float32
    g, lin = (t.to(cdt) for t in split_gate_linear(pre, spec))
    if spec.limit is not None:
        g = g.clamp(max=spec.limit)
        lin = lin.clamp(-spec.limit, spec.limit)
    return (g * torch.sigmoid(spec.alpha * g) * (lin + spec.linear_offset)).to(pre.dtype)


def swiglu_bwd_torch(pre: torch.Tensor, dh: torch.Tensor, spec: SwiGLU) -> torch.Tensor:
    """Torch twin of ``swiglu_apply_bwd``: d(pre) (.., 2F) from dh (.., F), via autograd of ``swiglu_torch``."""
    cdt = torch.float64 if pre.dtype == torch.float64 else torch.float32
    x = pre.detach().to(cdt).requires_grad_()
    (grad,) = torch.autograd.grad(swiglu_torch(x, spec), x, dh.to(cdt))
    return grad.to(pre.dtype)

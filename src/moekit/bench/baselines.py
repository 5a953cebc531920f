"""Baselines written with plain torch ops, as ../shared/BENCH.md defines them."""

from __future__ import annotations

import torch
from torch import nn


class TorchtitanGptOssExperts(nn.Module):
    """torchtitan 0.3.0's ``GptOssGroupedExperts`` semantics, in plain torch ops.

    Same parameters as :class:`moekit.GptOssExperts`. ``torch._grouped_mm`` for both projections, the
    biases added by ``repeat_interleave(..., output_size=R)`` (no sync), and the gpt-oss SwiGLU on the
    interleaved columns. Requires ``sum(counts) == R``.
    """

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts  # share the moekit module's parameters

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        alpha, limit = ex.swiglu["swiglu_alpha"], ex.swiglu["swiglu_limit"]
        counts = num_tokens_per_expert_E
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        rows = x_RD.shape[0]
        w1, w2 = ex.mlp1_weight_EGD.to(x_RD.dtype), ex.mlp2_weight_EDF.to(x_RD.dtype)
        h = torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs)
        h = h + torch.repeat_interleave(ex.mlp1_bias_EG.to(h.dtype), counts, dim=0, output_size=rows)
        gate = h[..., ::2].clamp(max=limit)
        lin = h[..., 1::2].clamp(-limit, limit)
        out = gate * torch.sigmoid(alpha * gate) * (lin + 1)
        out = torch._grouped_mm(out, w2.transpose(-2, -1), offs)
        return out + torch.repeat_interleave(ex.mlp2_bias_ED.to(out.dtype), counts, dim=0, output_size=rows)

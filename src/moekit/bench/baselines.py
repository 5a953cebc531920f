"""Baselines written with plain torch ops, as ../shared/BENCH.md defines them."""

from __future__ import annotations

import os

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


class TorchtitanMoE(nn.Module):
    """The torchtitan-style gpt-oss MoE block of BENCH.md in plain torch ops, sharing a
    :class:`moekit.MoE`'s parameters: fp32 router, softmax, top-k, renormalize; stable argsort
    dispatch with ``x[token]``; the experts above; fp32 weighting and ``scatter_add`` combine."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe
        self.experts = TorchtitanGptOssExperts(moe.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        e = moe.router.weight.shape[0]
        logits = torch.nn.functional.linear(x.float(), moe.router.weight.float(), moe.router.bias.float())
        scores = logits.softmax(-1)
        top_scores, ids = (scores + moe.expert_bias).topk(moe.top_k, dim=-1)
        top_scores = scores.gather(1, ids)
        top_scores = top_scores / top_scores.sum(-1, keepdim=True)
        order = torch.argsort(ids.view(-1), stable=True)
        token = order // moe.top_k
        counts = torch.histc(ids.view(-1).float(), bins=e, min=0, max=e).to(torch.int64)  # no sync
        ys = self.experts(x[token], counts)
        ys = ys.float() * top_scores.view(-1)[order][:, None]
        out = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
        out = out.scatter_add(0, token[:, None].expand(-1, x.shape[1]), ys)
        return out.to(x.dtype).reshape(shape)


def sonicmoe_block(d: int, f: int, e: int, top_k: int, device) -> nn.Module | None:
    """SonicMoE's MoE block (Tri Dao's lab, CuTe-DSL) at the same shape, or None unless asked for
    with ``MOEKIT_BENCH_SONICMOE=1`` and importable (it needs its CuTe-DSL stack:
    ``../shared/tools/sonicmoe_bundle.sh``, unpacked by benchmarks/run_gpu.sh). Opt-in because the
    block benchmark hung in three of four H100 runs with it (bench/results/2026-11-22-h100-moe).
    Configured as BENCH.md's reference figures were taken: plain SwiGLU (no clamp, no +1), no
    biases, a router without bias. Calls return the (T, D) output only."""
    if torch.device(device).type != "cuda" or os.environ.get("MOEKIT_BENCH_SONICMOE", "0") != "1":
        return None
    try:
        from sonicmoe import MoE as SonicMoE
        from sonicmoe.enums import ActivationType
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return None

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = SonicMoE(
                num_experts=e, num_experts_per_tok=top_k, hidden_size=d, intermediate_size=f,
                activation_function=ActivationType.SWIGLU, add_bias=False, std=0.02,
            ).to(device=device, dtype=torch.bfloat16)

        def forward(self, x):
            return self.moe(x)[0]

    return Block()

"""The torchtitan-style baselines, written with plain torch ops: torchtitan 0.3.0's MoE (router, stable
argsort dispatch, grouped experts on ``torch._grouped_mm``, fp32 ``scatter_add`` combine)."""

from __future__ import annotations

import torch
from torch import nn


class TorchtitanExperts(nn.Module):
    """torchtitan's grouped experts in plain torch ops, sharing a :class:`moekit.GroupedExperts`'s
    parameters. gpt-oss (``GptOssGroupedExperts``): one ``torch._grouped_mm`` for the interleaved
    gate/linear rows, biases added by ``repeat_interleave(..., output_size=R)`` (no sync), the gpt-oss
    SwiGLU on strided columns. Plain SwiGLU without biases (``GroupedExperts``, Qwen3 and the rest):
    ``silu(x @ w1^T) * (x @ w3^T)`` as two grouped GEMMs over the gate and up rows. Both end with
    the down-projection's ``torch._grouped_mm``. Requires ``sum(counts) == R``.
    """

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts  # share the moekit module's parameters

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        sw = ex.swiglu
        counts = num_tokens_per_expert_E
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        rows = x_RD.shape[0]
        w1, w2 = ex.mlp1_weight_EGD.to(x_RD.dtype), ex.mlp2_weight_EDF.to(x_RD.dtype)
        f = w2.shape[2]
        gate_w, up_w = (w1[:, 0::2], w1[:, 1::2]) if sw["gate_up_layout"] == "interleaved" else (w1[:, :f], w1[:, f:])
        plain = sw["swiglu_limit"] is None and sw["swiglu_alpha"] == 1.0 and sw["swiglu_linear_offset"] == 0.0
        if ex.mlp1_bias_EG is None and plain:
            gate = torch._grouped_mm(x_RD, gate_w.transpose(-2, -1), offs)
            out = torch.nn.functional.silu(gate) * torch._grouped_mm(x_RD, up_w.transpose(-2, -1), offs)
        else:
            h = torch._grouped_mm(x_RD, w1.transpose(-2, -1), offs)
            if ex.mlp1_bias_EG is not None:
                h = h + torch.repeat_interleave(ex.mlp1_bias_EG.to(h.dtype), counts, dim=0, output_size=rows)
            gate, lin = (h[..., ::2], h[..., 1::2]) if sw["gate_up_layout"] == "interleaved" else h.chunk(2, -1)
            limit, alpha = sw["swiglu_limit"], sw["swiglu_alpha"]
            if limit is not None:
                gate, lin = gate.clamp(max=limit), lin.clamp(-limit, limit)
            out = gate * torch.sigmoid(alpha * gate) * (lin + sw["swiglu_linear_offset"])
        out = torch._grouped_mm(out, w2.transpose(-2, -1), offs)
        if ex.mlp2_bias_ED is not None:
            out = out + torch.repeat_interleave(ex.mlp2_bias_ED.to(out.dtype), counts, dim=0, output_size=rows)
        return out


class TorchtitanMoE(nn.Module):
    """The torchtitan-style MoE block in plain torch ops, sharing a :class:`moekit.MoE`'s parameters:
    fp32 router logits on an fp32 copy of x, softmax, top-k, renormalize; stable argsort dispatch with
    ``x[token]``; the experts above; fp32 weighting and ``scatter_add`` combine."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.moe = moe
        self.experts = TorchtitanExperts(moe.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        e = moe.router.weight.shape[0]
        bias = None if moe.router.bias is None else moe.router.bias.float()
        logits = torch.nn.functional.linear(x.float(), moe.router.weight.float(), bias)
        scores = logits.softmax(-1)
        top_scores, ids = (scores + moe.expert_bias).topk(moe.top_k, dim=-1)
        top_scores = scores.gather(1, ids)
        if moe.renormalize:
            top_scores = top_scores / top_scores.sum(-1, keepdim=True)
        order = torch.argsort(ids.view(-1), stable=True)
        token = order // moe.top_k
        counts = torch.histc(ids.view(-1).float(), bins=e, min=0, max=e).to(torch.int64)  # no sync
        ys = self.experts(x[token], counts)
        ys = ys.float() * top_scores.view(-1)[order][:, None]
        out = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
        out = out.scatter_add(0, token[:, None].expand(-1, x.shape[1]), ys)
        return out.to(x.dtype).reshape(shape)

"""nn.Modules built on moekit's ops."""

from __future__ import annotations

import torch
from torch import nn

from .experts import grouped_mm_downproj, grouped_mm_swiglu
from .routing import combine, topk_router


class GptOssExperts(nn.Module):
    """gpt-oss expert MLPs, a drop-in for torchtitan's ``GptOssGroupedExperts``.

    Parameters keep torchtitan's storage and names: ``mlp1_weight_EGD`` (E, 2F, D) with interleaved
    gate/linear rows, ``mlp1_bias_EG`` (E, 2F), ``mlp2_weight_EDF`` (E, D, F), ``mlp2_bias_ED`` (E, D).
    The kernels read the weights through ``.mT`` views, so nothing is copied.

    ``forward(x_RD, num_tokens_per_expert_E)``: x (R, D) rows sorted by expert, counts (E,) of any
    integer dtype on x's device -> (R, D). Rows past ``sum(counts)`` come out as zeros. Weights in
    another dtype than x are cast to x's dtype for the GEMMs. Permute-free: pass x as the (T, D)
    tokens with ``token_idx_R`` and ``row_of_TK`` from :func:`moekit.topk_router`; the GEMMs then
    read token rows in place and the result is still (R, D) in expert-sorted order.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        *,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float | None = 7.0,
        swiglu_linear_offset: float = 1.0,
        gate_up_layout: str = "interleaved",
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.swiglu = dict(
            swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit, swiglu_linear_offset=swiglu_linear_offset,
            gate_up_layout=gate_up_layout,
        )
        self.mlp1_weight_EGD = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim, **kw))
        self.mlp1_bias_EG = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, **kw))
        self.mlp2_weight_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        self.mlp2_bias_ED = nn.Parameter(torch.empty(num_experts, dim, **kw))
        self.reset_parameters()

    def reset_parameters(self, init_std: float = 0.02) -> None:
        for w in (self.mlp1_weight_EGD, self.mlp2_weight_EDF):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)
        for b in (self.mlp1_bias_EG, self.mlp2_bias_ED):
            nn.init.trunc_normal_(b, mean=0.0, std=init_std)

    def forward(
        self,
        x_RD: torch.Tensor,
        num_tokens_per_expert_E: torch.Tensor,
        token_idx_R: torch.Tensor | None = None,
        row_of_TK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        w1, w2 = self.mlp1_weight_EGD, self.mlp2_weight_EDF
        if w1.dtype != x_RD.dtype:
            w1, w2 = w1.to(x_RD.dtype), w2.to(x_RD.dtype)
        h, aux = grouped_mm_swiglu(
            x_RD, w1.mT, offs, bias=self.mlp1_bias_EG, token_idx=token_idx_R, row_of=row_of_TK, **self.swiglu
        )
        return grouped_mm_downproj(
            h, w2.mT, offs, bias=self.mlp2_bias_ED, aux_biased_acc=aux, **self.swiglu
        )

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}, {self.swiglu}"


class MoE(nn.Module):
    """A gpt-oss MoE block, configured like torchtitan's: router gate ``Linear(D, E, bias=True)`` with
    fp32 logits, softmax (or sigmoid) scores, top-k with renormalization, :class:`GptOssExperts`, and
    a weighted combine in fp32. No host sync anywhere.

    ``forward(x)``: x (..., D) -> (..., D). With ``aux_loss=True`` the switch-style load-balancing
    loss of the last forward is in ``self.aux_loss``. Aux-loss-free balancing: ``tokens_per_expert``
    accumulates routed counts on the device, and ``update_expert_bias(rate)`` nudges ``expert_bias``
    (used for the choice only) toward balance and resets the counts.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        renormalize: bool = True,
        aux_loss: bool = False,
        device=None,
        dtype=None,
        **swiglu,
    ):
        super().__init__()
        self.top_k, self.score_func, self.renormalize, self.use_aux_loss = top_k, score_func, renormalize, aux_loss
        self.router = nn.Linear(dim, num_experts, bias=True, device=device, dtype=torch.float32)
        self.experts = GptOssExperts(dim, hidden_dim, num_experts, device=device, dtype=dtype, **swiglu)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, device=device), persistent=False)
        self.aux_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        r = topk_router(
            x2, self.router.weight, self.router.bias, top_k=self.top_k, score_func=self.score_func,
            renormalize=self.renormalize, expert_bias=self.expert_bias, aux_loss=self.use_aux_loss,
        )
        with torch.no_grad():
            self.tokens_per_expert += r.counts
        self.aux_loss = r.aux_loss
        ys = self.experts(x2, r.counts, r.token_idx, r.row_of)  # permute-free: no copy of x
        return combine(ys, r.weights, r.row_of).reshape(shape)

    @torch.no_grad()
    def update_expert_bias(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the others."""
        load = self.tokens_per_expert
        self.expert_bias += rate * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()


__all__ = ["GptOssExperts", "MoE"]

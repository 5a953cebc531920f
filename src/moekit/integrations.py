"""Drop moekit into existing models, sharing their parameters (no copies, same state dicts).

* Hugging Face transformers' gpt-oss: :func:`patch_hf_gpt_oss` swaps every ``GptOssExperts`` (the
  per-expert Python loop) for :class:`HFGptOssExperts`, which keeps the same parameters
  (``gate_up_proj`` (E, D, 2F) with interleaved gate/up columns, ``gate_up_proj_bias``,
  ``down_proj`` (E, F, D), ``down_proj_bias``) and the same ``forward(hidden_states,
  router_indices, routing_weights)``.
* torchtitan's gpt-oss: :func:`patch_torchtitan` swaps every ``GptOssGroupedExperts`` for
  :class:`moekit.GptOssExperts` holding the same parameter objects.
"""

from __future__ import annotations

from torch import nn

from .experts import grouped_mm_downproj, grouped_mm_swiglu
from .layers import GptOssExperts
from .routing import combine, routing_metadata


class HFGptOssExperts(nn.Module):
    """moekit's kernels behind transformers' ``GptOssExperts`` interface and parameters.

    ``forward(hidden_states (T, D), router_indices (T, K), routing_weights (T, K)) -> (T, D)``:
    the sum over each token's K experts of weight * expert(x), like the original, but with grouped
    GEMMs, permute-free dispatch, fused bias + SwiGLU and an fp32, atomic-free combine.
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        self.gate_up_proj = original.gate_up_proj
        self.gate_up_proj_bias = original.gate_up_proj_bias
        self.down_proj = original.down_proj
        self.down_proj_bias = original.down_proj_bias
        self.alpha, self.limit = float(original.alpha), float(original.limit)
        self.num_experts = original.gate_up_proj.shape[0]

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        counts, offs, token_idx, row_of = routing_metadata(router_indices.reshape(x.shape[0], -1), self.num_experts)
        w1, w2 = self.gate_up_proj.to(x.dtype), self.down_proj.to(x.dtype)
        kw = dict(swiglu_alpha=self.alpha, swiglu_limit=self.limit, swiglu_linear_offset=1.0)
        h, aux = grouped_mm_swiglu(x, w1, offs, bias=self.gate_up_proj_bias, token_idx=token_idx, row_of=row_of, **kw)
        ys = grouped_mm_downproj(h, w2, offs, bias=self.down_proj_bias, aux_biased_acc=aux, **kw)
        weights = routing_weights.reshape(x.shape[0], -1)
        if weights.shape[1] != row_of.shape[1]:  # transformers may pass dense (T, E) scores
            weights = weights.gather(1, router_indices.reshape(x.shape[0], -1).long())
        return combine(ys, weights.float(), row_of).reshape(hidden_states.shape)


def _swap(model: nn.Module, class_name: str, build) -> int:
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ == class_name]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, build(module))
    return len(targets)


def patch_hf_gpt_oss(model: nn.Module) -> int:
    """Replace every transformers ``GptOssExperts`` in ``model`` by :class:`HFGptOssExperts`, in
    place, sharing its parameters. Returns how many were replaced."""
    return _swap(model, "GptOssExperts", HFGptOssExperts)


def patch_torchtitan(model: nn.Module) -> int:
    """Replace every torchtitan ``GptOssGroupedExperts`` by :class:`moekit.GptOssExperts` holding the
    same parameter objects (``mlp1_weight_EGD``, ``mlp1_bias_EG``, ``mlp2_weight_EDF``,
    ``mlp2_bias_ED``). Returns how many were replaced."""

    def build(module):
        e, two_f, d = module.mlp1_weight_EGD.shape
        new = GptOssExperts(d, two_f // 2, e, device="meta")
        for name in ("mlp1_weight_EGD", "mlp1_bias_EG", "mlp2_weight_EDF", "mlp2_bias_ED"):
            setattr(new, name, getattr(module, name))
        return new

    return _swap(model, "GptOssGroupedExperts", build)


__all__ = ["HFGptOssExperts", "patch_hf_gpt_oss", "patch_torchtitan"]

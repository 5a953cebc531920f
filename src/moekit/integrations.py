"""Drop moekit into existing models, sharing their parameters (no copies, same state dicts).

* Hugging Face transformers, every MoE family whose experts use transformers' experts interface (Qwen2/3
  MoE, Mixtral, OLMoE, DeepSeek, gpt-oss, ...): :func:`register_hf_experts` registers moekit as the
  experts implementation ``"moekit"``; load or configure the model with
  ``experts_implementation="moekit"`` (``model.config._experts_implementation``).
* Hugging Face transformers' gpt-oss, module swap: :func:`patch_hf_gpt_oss` swaps every ``GptOssExperts`` (the
  per-expert Python loop) for :class:`HFGptOssExperts`, which keeps the same parameters
  (``gate_up_proj`` (E, D, 2F) with interleaved gate/up columns, ``gate_up_proj_bias``,
  ``down_proj`` (E, F, D), ``down_proj_bias``) and the same ``forward(hidden_states,
  router_indices, routing_weights)``.
* torchtitan's gpt-oss: :func:`patch_torchtitan` swaps every ``GptOssGroupedExperts`` for
  :class:`moekit.GptOssExperts` holding the same parameter objects.
"""

from __future__ import annotations

import torch
from torch import nn

from .experts import grouped_mm_downproj, grouped_mm_swiglu
from .layers import ACTIVATIONS, ROW_ALIGN, GptOssExperts, check_number
from .routing import combine, routing_metadata
from .validation import autocast

HF_EXPERTS_IMPLEMENTATION = "moekit"


def _is_silu(act) -> bool:
    """Whether ``act`` computes SiLU (transformers wraps it in classes of its own), probed on the CPU."""
    probe = torch.linspace(-8.0, 8.0, 33)
    try:
        return torch.allclose(act(probe), torch.nn.functional.silu(probe))
    except Exception:  # noqa: BLE001 - not an elementwise activation of one tensor
        return False


def _default_gate(module: nn.Module) -> bool:
    """Whether the module gates with transformers' default ``act_fn(gate) * up``."""
    from transformers.integrations.moe import _default_apply_gate

    return getattr(type(module), "_apply_gate", None) is _default_apply_gate


def _hf_swiglu(module: nn.Module) -> dict:
    """The SwiGLU keywords of a transformers experts module: gpt-oss's (``alpha``, ``limit``, ``+1``) or
    the plain ``silu(gate) * up`` of the default gate; anything else is not a moekit epilogue. Worked
    out once per module."""
    kw = getattr(module, "_moekit_swiglu", None)
    if kw is not None:
        return kw
    layout = "halves" if getattr(module, "is_concatenated", True) else "interleaved"
    if hasattr(module, "alpha") and hasattr(module, "limit"):  # gpt-oss's own _apply_gate
        kw = dict(swiglu_alpha=float(module.alpha), swiglu_limit=float(module.limit), swiglu_linear_offset=1.0)
    elif _default_gate(module) and _is_silu(getattr(module, "act_fn", None)):
        kw = dict(ACTIVATIONS["swiglu"])
    else:
        raise NotImplementedError(
            f"moekit: {type(module).__name__}'s activation is neither SiLU-gated nor gpt-oss's SwiGLU; "
            "use another experts implementation for it"
        )
    module._moekit_swiglu = kw = {**kw, "gate_up_layout": layout}
    return kw


def hf_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface on moekit's kernels: hidden_states (T, D) bf16/fp16, top_k_index
    (T, K) expert ids, top_k_weights (T, K) (or dense (T, E) scores) -> (T, D), the weighted sum of each
    token's K experts.

    The module's ``gate_up_proj`` ((E, 2F, D), or (E, D, 2F) when ``is_transposed``; gate/up as halves
    or interleaved per ``is_concatenated``), ``down_proj`` and optional biases are read in place, through
    ``.mT`` views where needed. Ids equal to E (expert parallelism's "not on this rank") contribute
    nothing and cost no GEMM work (``routing_metadata`` drops them). No host sync."""
    if getattr(module, "has_gate", True) is False or getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError("moekit: experts without a gate, or with a post-expert norm, are not supported")
    x = autocast(hidden_states).reshape(-1, hidden_states.shape[-1])
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"moekit: the experts run in bf16 or fp16, got hidden states in {x.dtype}")
    kw = _hf_swiglu(module)
    e = module.num_experts
    ids = top_k_index.reshape(x.shape[0], -1)
    weights = top_k_weights.reshape(ids.shape[0], -1).float()
    if weights.shape[1] != ids.shape[1]:  # dense (T, E) scores: take each token's chosen ones
        weights = weights.gather(1, ids.long().clamp(0, e - 1))
    counts, offs, token_idx, row_of = routing_metadata(ids, e)  # drops sentinel ids (= E)
    w_up, w_down = module.gate_up_proj.to(x.dtype), module.down_proj.to(x.dtype)
    if not getattr(module, "is_transposed", False):  # (E, 2F, D) and (E, D, F): read as (E, D, 2F), (E, F, D)
        w_up, w_down = w_up.mT, w_down.mT
    b_up = getattr(module, "gate_up_proj_bias", None) if getattr(module, "has_bias", False) else None
    b_down = getattr(module, "down_proj_bias", None) if getattr(module, "has_bias", False) else None
    h, aux = grouped_mm_swiglu(x, w_up, offs, bias=b_up, token_idx=token_idx, row_of=row_of, **kw)
    ys = grouped_mm_downproj(h, w_down, offs, bias=b_down, aux_biased_acc=aux, **kw)
    return combine(ys, weights, row_of).reshape(hidden_states.shape)  # (in x's dtype, the autocast one)


def register_hf_experts() -> str:
    """Register moekit in transformers' experts interface; returns the name to select it with
    (``experts_implementation="moekit"``). Needs a transformers with ``integrations.moe``."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as err:
        raise ImportError("moekit: this transformers has no experts interface (transformers.integrations.moe)") from err
    ExpertsInterface.register(HF_EXPERTS_IMPLEMENTATION, hf_experts_forward)
    return HF_EXPERTS_IMPLEMENTATION


def _check_hf_gpt_oss(original: nn.Module) -> None:
    """What ``HFGptOssExperts(original)`` can check before any forward, naming ``original``'s attribute:
    ``gate_up_proj`` (E, D, 2F) and ``down_proj`` (E, F, D), D and F multiples of 8 (as
    :class:`moekit.GroupedExperts` needs: the kernels read 16-byte aligned rows of 16-bit elements), a
    finite ``alpha`` and a positive ``limit``."""
    name = "HFGptOssExperts"
    up, down = original.gate_up_proj, original.down_proj
    if up.dim() != 3 or up.shape[2] % 2 or tuple(down.shape) != (up.shape[0], up.shape[2] // 2, up.shape[1]):
        raise ValueError(f"{name}: original.gate_up_proj must be (E, D, 2F) and original.down_proj (E, F, D), got "
                         f"{tuple(up.shape)} and {tuple(down.shape)}")
    for what, v in (("D (original.gate_up_proj.shape[1])", up.shape[1]), ("F (original.down_proj.shape[1])",
                                                                          down.shape[1])):
        if v % ROW_ALIGN:
            raise ValueError(f"{name}: {what} must be a multiple of {ROW_ALIGN}, got {v}: the expert kernels read "
                             f"rows of 16-bit elements at 16-byte alignment")
    alpha, limit = (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v
                    for v in (original.alpha, original.limit))
    check_number(name, "original.alpha", alpha)
    check_number(name, "original.limit", limit, positive=True)


class HFGptOssExperts(nn.Module):
    """moekit's kernels behind transformers' ``GptOssExperts`` interface and parameters.

    ``forward(hidden_states (T, D), router_indices (T, K), routing_weights (T, K)) -> (T, D)``:
    the sum over each token's K experts of weight * expert(x), like the original, but with grouped
    GEMMs, permute-free dispatch, fused bias + SwiGLU and an fp32, atomic-free combine.
    """

    def __init__(self, original: nn.Module):
        super().__init__()
        _check_hf_gpt_oss(original)
        self.gate_up_proj = original.gate_up_proj
        self.gate_up_proj_bias = original.gate_up_proj_bias
        self.down_proj = original.down_proj
        self.down_proj_bias = original.down_proj_bias
        self.alpha, self.limit = float(original.alpha), float(original.limit)
        self.num_experts = original.gate_up_proj.shape[0]

    # the layout flags of transformers' experts interface, read by hf_experts_forward
    is_concatenated, is_transposed, has_bias = False, True, True

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        return hf_experts_forward(self, hidden_states, router_indices, routing_weights)


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


__all__ = ["HFGptOssExperts", "hf_experts_forward", "patch_hf_gpt_oss", "patch_torchtitan", "register_hf_experts"]

"""nn.Modules built on moekit's ops."""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from . import block
from .epilogue import LAYOUTS
from .experts import TAILS, grouped_mm_downproj, grouped_mm_swiglu
from .fp8.train import FP8Training
from .fp8.train import TrainingRecipe as FP8Recipe
from .nvfp4.formats import BLOCK as NVFP4_BLOCK
from .nvfp4.train import NVFP4Training, TrainingRecipe
from .quantized import recipe_of
from .routing import Dispatch, Routing, check_router_args, combine, sorted_weights, topk_router
from .validation import autocast, unit_columns

ACTIVATIONS = {
    "gpt-oss": dict(swiglu_alpha=1.702, swiglu_limit=7.0, swiglu_linear_offset=1.0),  # clamped, +1 on the linear half
    "swiglu": dict(swiglu_alpha=1.0, swiglu_limit=None, swiglu_linear_offset=0.0),  # silu(gate) * up
}
ROW_ALIGN = 8  # elements: the kernels read rows of D and F 16-bit elements at 16-byte alignment
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # cast to x's 16-bit dtype for the GEMMs
NVFP4_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what nvfp4.quantize_weights reads


def check_flags(owner: str, **flags) -> None:
    """Boolean constructor arguments: a string ("False") or a tensor in their place would read as true."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{owner}: {name} must be a bool, got {type(v).__name__} {v!r}")


def check_number(owner: str, name: str, v, *, positive: bool = False, none_ok: bool = False) -> None:
    """A real number (not a bool): finite, or with ``positive`` > 0 (+inf included: a clamp at +inf is
    none); ``none_ok``: or None."""
    if none_ok and v is None:
        return
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v
    if not (ok and (v > 0 if positive else math.isfinite(v))):
        want = ("a positive number" if positive else "a finite number") + (" or None" if none_ok else "")
        raise ValueError(f"{owner}: {name} must be {want}, got {v!r}")


def check_expert_args(owner: str, dim, hidden_dim, num_experts, activation: str, gate_up_layout: str,
                      swiglu: dict, *, bias: bool = False, dtype=None, nvfp4=None, fp8=None) -> dict:
    """Check the experts' constructor arguments where the user passed them, and return the SwiGLU
    keywords they resolve to. The same checks on every device, so that a module the CPU reference
    accepts runs on the kernels too.

    ``dim`` and ``hidden_dim`` are multiples of 8 (the kernels read 16-byte aligned rows of 16-bit
    elements), of 16 with ``nvfp4`` (its operands are quantized in blocks of 16 along both); ``dtype``
    (None: torch's default dtype) is a floating dtype the experts cast from, not float64 with ``nvfp4``."""
    for name, v in (("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", num_experts)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{owner}: {name} must be an int >= 1, got {v!r}")
    check_flags(owner, bias=bias)
    try:
        quantized = recipe_of(nvfp4, TrainingRecipe, "nvfp4") is not None
        in_fp8 = recipe_of(fp8, FP8Recipe, "fp8") is not None
    except TypeError as err:
        raise TypeError(f"{owner}: {err}") from None
    if quantized and in_fp8:
        raise ValueError(f"{owner}: nvfp4 and fp8 are two precisions of the expert GEMMs: choose one")
    for name, v in (("dim", dim), ("hidden_dim", hidden_dim)):
        if v % ROW_ALIGN:
            raise ValueError(f"{owner}: {name} must be a multiple of {ROW_ALIGN}, got {v}: the expert kernels "
                             f"read rows of {name} 16-bit elements at 16-byte alignment")
        if quantized and v % NVFP4_BLOCK:
            raise ValueError(f"{owner}: with nvfp4, {name} must be a multiple of {NVFP4_BLOCK}, got {v}: NVFP4 "
                             f"quantizes the expert GEMMs' operands in blocks of {NVFP4_BLOCK} along dim and "
                             f"hidden_dim")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{owner}: dtype must be a torch.dtype or None, got {type(dtype).__name__} {dtype!r}")
    allowed = NVFP4_DTYPES if quantized or in_fp8 else PARAM_DTYPES  # (what the quantizers read)
    resolved = torch.get_default_dtype() if dtype is None else dtype
    if resolved not in allowed:
        what = f"{resolved} (torch's default dtype)" if dtype is None else str(resolved)
        which = " with nvfp4" if quantized else " with fp8" if in_fp8 else ""
        raise TypeError(f"{owner}: dtype must be one of {[str(d) for d in allowed]}{which}, got {what}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{owner}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    unknown = set(swiglu) - set(ACTIVATIONS["swiglu"])
    if unknown:
        raise TypeError(f"{owner}: unknown keyword(s) {sorted(unknown)}")
    resolved = {**ACTIVATIONS[activation], **swiglu}
    if gate_up_layout not in LAYOUTS:
        raise ValueError(f"{owner}: gate_up_layout must be one of {LAYOUTS}, got {gate_up_layout!r}")
    check_number(owner, "swiglu_limit", resolved["swiglu_limit"], positive=True, none_ok=True)
    for name in ("swiglu_alpha", "swiglu_linear_offset"):
        check_number(owner, name, resolved[name])
    return {**resolved, "gate_up_layout": gate_up_layout}


class GroupedExperts(nn.Module):
    """E expert SwiGLU MLPs over expert-sorted rows: ``down(SwiGLU(x @ W_up[g] + b_up[g])) + b_down[g]``.

    Parameters keep torchtitan's gpt-oss storage and names, so that the weights are read through
    ``.mT`` views with no copy: ``mlp1_weight_EGD`` (E, 2F, D) with the gate/linear rows laid out as
    ``gate_up_layout`` says ("interleaved": g0, l0, g1, ...; "halves": [gate | linear]),
    ``mlp2_weight_EDF`` (E, D, F), and with ``bias=True`` ``mlp1_bias_EG`` (E, 2F) and ``mlp2_bias_ED``
    (E, D); with ``bias=False`` there are no bias parameters and no bias work in the kernels.
    ``activation`` is "swiglu" (``silu(gate) * up``: Qwen3, Mixtral, DeepSeek, OLMoE) or "gpt-oss"
    (alpha 1.702, clamp 7, ``+1`` on the linear half); explicit ``swiglu_*`` keywords override it.

    ``forward(x_RD, num_tokens_per_expert_E)``: x (R, D) rows sorted by expert, counts (E,) of any
    integer dtype on x's device -> (R, D). Rows past ``sum(counts)`` come out as zeros. Weights in
    another dtype than x are cast to x's dtype for the GEMMs. Permute-free: pass x as the (T, D)
    tokens with ``token_idx_R`` and ``row_of_TK`` from :func:`moekit.topk_router`; the GEMMs then
    read token rows in place and the result is still (R, D) in expert-sorted order (R may be less
    than T*K, with negative row_of entries for choices that have no row: see
    :func:`moekit.grouped_mm_swiglu`). ``row_scale_R``
    (R,) float32 scales each row's SwiGLU output before the down-projection (the routing weights, so
    that the combine is a plain sum); the bias is not scaled. ``offs_E`` (E,) int32, the cumulative
    counts where the caller has them (``Routing.offs``), saves their recomputation. ``tail="unwritten"``
    leaves the rows past ``sum(counts)`` unwritten, in the output and in the gradients, for a caller
    that reads none of them (:func:`moekit.grouped_mm_swiglu`; the NVFP4 path writes zeros anyway).
    ``routed(x_TD, dispatch, row_scale_R=None, tail="zeros")`` is the permute-free call with a routing's
    :class:`moekit.Dispatch` whole (``Routing.dispatch``, or :func:`moekit.routing_metadata`'s result).

    ``nvfp4``: True or a :class:`moekit.nvfp4.TrainingRecipe` runs the two expert GEMMs and their
    backward on emulated NVFP4 operands (``moekit.nvfp4.train``); ``fp8``: True or a
    :class:`moekit.fp8.TrainingRecipe`, on blockwise-scaled FP8 operands (``moekit.fp8.train``). Either
    runs through ``moekit.quantized``'s interface (the SwiGLU and the biases unfused); the parameters stay
    as they are.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        *,
        bias: bool = False,
        activation: str = "swiglu",
        gate_up_layout: str = "interleaved",
        nvfp4=None,
        fp8=None,
        device=None,
        dtype=None,
        **swiglu,
    ):
        super().__init__()
        self.swiglu = check_expert_args(type(self).__name__, dim, hidden_dim, num_experts, activation, gate_up_layout,
                                        swiglu, bias=bias, dtype=dtype, nvfp4=nvfp4, fp8=fp8)
        kw = dict(device=device, dtype=dtype)
        self.num_experts, self.dim, self.hidden_dim = num_experts, dim, hidden_dim
        self.mlp1_weight_EGD = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim, **kw))
        self.mlp2_weight_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        if bias:
            self.mlp1_bias_EG = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, **kw))
            self.mlp2_bias_ED = nn.Parameter(torch.empty(num_experts, dim, **kw))
        else:
            self.register_parameter("mlp1_bias_EG", None)
            self.register_parameter("mlp2_bias_ED", None)
        self.reset_parameters()
        self.nvfp4 = NVFP4Training.build(nvfp4, device)
        self.fp8 = FP8Training.build(fp8)

    def reset_parameters(self, init_std: float = 0.02) -> None:
        """Every parameter from a truncated normal of std ``init_std`` (a meta-device build, materialized
        with ``to_empty``, is initialized by this; the NVFP4 state resets itself)."""
        for p in (self.mlp1_weight_EGD, self.mlp2_weight_EDF, self.mlp1_bias_EG, self.mlp2_bias_ED):
            if p is not None:
                nn.init.trunc_normal_(p, mean=0.0, std=init_std)

    def init_weights(self, init_std: float = 0.02) -> None:
        """torchtitan's name for :meth:`reset_parameters` (its ``MoE.init_weights`` calls it on the experts)."""
        self.reset_parameters(init_std)

    def routed(self, x_TD: torch.Tensor, dispatch: Dispatch, row_scale_R: torch.Tensor | None = None,
               tail: str = "zeros") -> torch.Tensor:
        """The experts on a routing's rows, permute-free: x (T, D) tokens in token order, each sorted row
        read from its token (``dispatch.token_idx``) -> (R, D) in expert-sorted order, for
        ``combine(y, weights, dispatch.row_of)``. ``row_scale_R`` and ``tail`` as in ``forward``, which it
        calls through the module (its hooks run: FSDP2 gathers the parameters there)."""
        return self(x_TD, dispatch.counts, dispatch.token_idx, dispatch.row_of, row_scale_R, dispatch.offs, tail)

    def forward(
        self,
        x_RD: torch.Tensor,
        num_tokens_per_expert_E: torch.Tensor,
        token_idx_R: torch.Tensor | None = None,
        row_of_TK: torch.Tensor | None = None,
        row_scale_R: torch.Tensor | None = None,
        offs_E: torch.Tensor | None = None,
        tail: str = "zeros",
    ) -> torch.Tensor:
        if tail not in TAILS:  # (checked here too: the NVFP4 path below writes zeros whatever it says)
            raise ValueError(f"{type(self).__name__}: tail must be one of {TAILS}, got {tail!r}")
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32) if offs_E is None else offs_E
        x_RD = autocast(x_RD)
        if self.nvfp4 is not None:
            return self.nvfp4.experts(self, x_RD, offs, token_idx_R, row_of_TK, row_scale_R)
        if x_RD.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{type(self).__name__}: tokens must be bfloat16 or float16 (the experts compute in "
                            f"16-bit with fp32 accumulation; fp32 weights are cast), got {x_RD.dtype}")
        if self.fp8 is not None:
            return self.fp8.experts(self, x_RD, offs, token_idx_R, row_of_TK, row_scale_R)
        w1, w2 = self.mlp1_weight_EGD, self.mlp2_weight_EDF
        if w1.dtype != x_RD.dtype:
            w1, w2 = w1.to(x_RD.dtype), w2.to(x_RD.dtype)
        h, aux = grouped_mm_swiglu(
            x_RD, w1.mT, offs, bias=self.mlp1_bias_EG, token_idx=token_idx_R, row_of=row_of_TK,
            row_scale=row_scale_R, tail=tail, **self.swiglu,
        )
        return grouped_mm_downproj(h, w2.mT, offs, bias=self.mlp2_bias_ED, aux_biased_acc=aux, row_scale=row_scale_R,
                                   tail=tail, **self.swiglu)

    def extra_repr(self) -> str:
        bias = self.mlp1_bias_EG is not None
        return f"experts={self.num_experts}, dim={self.dim}, hidden_dim={self.hidden_dim}, bias={bias}, {self.swiglu}"


class GptOssExperts(GroupedExperts):
    """gpt-oss expert MLPs, a drop-in for torchtitan's ``GptOssGroupedExperts``: :class:`GroupedExperts`
    with biases and the gpt-oss SwiGLU on interleaved gate/linear rows by default."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, bias: bool = True,
                 activation: str = "gpt-oss", **kw):
        super().__init__(dim, hidden_dim, num_experts, bias=bias, activation=activation, **kw)


class RoutedBlock(nn.Module):
    """What every MoE block shares, whatever holds its experts: the argument checks, the router (gate
    ``Linear(D, E)`` in fp32), the balancing state (``expert_bias`` (E,), ``tokens_per_expert`` (E,)
    int64, ``aux_loss``) and the routing of a step. :class:`MoE` keeps its experts on this device;
    :class:`moekit.distributed.ExpertParallelMoE` shards them over a process group. A subclass
    registers ``self.experts`` after this constructor, so the state dict's keys are the same for both."""

    def __init__(self, owner: str, dim: int, hidden_dim: int, num_experts: int, top_k: int, *, bias: bool,
                 activation: str, router_bias: bool, score_func: str, renormalize: bool, aux_loss: bool, device,
                 dtype, experts_kw: dict):
        super().__init__()
        check_router_args(owner, num_experts, top_k, score_func)
        check_expert_args(owner, dim, hidden_dim, num_experts, activation,
                          experts_kw.get("gate_up_layout", "interleaved"),
                          {k: v for k, v in experts_kw.items() if k not in ("gate_up_layout", "nvfp4", "fp8")},
                          bias=bias, dtype=dtype, nvfp4=experts_kw.get("nvfp4"), fp8=experts_kw.get("fp8"))
        check_flags(owner, router_bias=router_bias, renormalize=renormalize, aux_loss=aux_loss)
        self.top_k, self.score_func, self.renormalize, self.use_aux_loss = top_k, score_func, renormalize, aux_loss
        self.router = nn.Linear(dim, num_experts, bias=router_bias, device=device, dtype=torch.float32)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device), persistent=True)
        # routed counts: int64, exact, and untouched by a cast of the module's floating-point tensors
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64, device=device),
                             persistent=False)
        self.aux_loss = None

    def reset_parameters(self) -> None:
        """The block's own state: ``expert_bias`` and ``tokens_per_expert`` back to zeros (the router and
        the experts reset themselves). A meta-device build needs it after ``to_empty``."""
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()
        self.aux_loss = None

    def route(self, x2: torch.Tensor) -> Routing:
        """Route this step's tokens x2 (T, D): the router's top-k, with the routed counts added to
        ``tokens_per_expert`` and the aux loss (or None) left in ``self.aux_loss``."""
        r = topk_router(
            x2, self.router.weight, self.router.bias, top_k=self.top_k, score_func=self.score_func,
            renormalize=self.renormalize, expert_bias=self.expert_bias, aux_loss=self.use_aux_loss,
        )
        with torch.no_grad():
            self.tokens_per_expert += r.counts
        self.aux_loss = r.aux_loss
        return r

    def expert_load(self) -> torch.Tensor:
        """(E,) fp32 tokens routed to each expert since the last balancing step (this block's own)."""
        return self.tokens_per_expert.float()

    @torch.no_grad()
    def update_expert_bias(self, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the others."""
        load = self.expert_load()
        self.expert_bias += rate * torch.sign(load.mean() - load)
        self.tokens_per_expert.zero_()


class MoE(RoutedBlock):
    """An MoE block: router, permute-free dispatch, :class:`GroupedExperts`, and a weighted combine in
    fp32. No host sync anywhere; deterministic forward and backward.

    Where the down-projection has no bias, each routed row's weight scales its SwiGLU output inside
    the up-projection's epilogue (the down-projection is linear, so its output arrives weighted) and
    the combine is a plain sum over each token's K rows. The weights' gradient then comes out of the
    SwiGLU backward pass, and the (T*K, D) expert output is neither saved nor re-read.

    - Router: gate ``Linear(D, E, bias=router_bias)`` created in fp32 (a cast of the module casts it
      too); logits in fp32 (bf16 operands on the tensor cores with fp32 accumulation where the input
      is bf16 and the gate fp32 on a GPU), ``score_func``
      "softmax" or "sigmoid", top-k, and the chosen scores renormalized to sum to 1 when
      ``renormalize``.
    - Balancing: ``aux_loss=True`` leaves the switch-style load-balancing loss of the last forward in
      ``self.aux_loss``. Aux-loss-free: ``tokens_per_expert`` accumulates routed counts on the device,
      and ``update_expert_bias(rate)`` nudges ``expert_bias`` (used for the choice only) toward balance.
    - Experts: ``bias`` and ``activation`` as in :class:`GroupedExperts` (plus any ``swiglu_*``,
      ``gate_up_layout``, ``nvfp4`` or ``fp8`` keyword). The defaults are the gpt-oss block (expert and
      router biases, the gpt-oss SwiGLU); ``bias=False, router_bias=False, activation="swiglu"`` is the
      Qwen3 / Mixtral / DeepSeek / OLMoE block.

    ``forward(x)``: x (..., D) bf16/fp16 -> (..., D) in x.dtype; under ``torch.autocast`` an fp32 x
    (and fp32 expert weights) run in the autocast dtype, and the output is in it, as ``torch.matmul``'s.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        *,
        bias: bool = True,
        activation: str = "gpt-oss",
        router_bias: bool = True,
        score_func: str = "softmax",
        renormalize: bool = True,
        aux_loss: bool = False,
        device=None,
        dtype=None,
        **experts_kw,
    ):
        super().__init__("MoE", dim, hidden_dim, num_experts, top_k, bias=bias, activation=activation,
                         router_bias=router_bias, score_func=score_func, renormalize=renormalize, aux_loss=aux_loss,
                         device=device, dtype=dtype, experts_kw=experts_kw)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, bias=bias, activation=activation,
                                      device=device, dtype=dtype, **experts_kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = unit_columns(autocast(x).reshape(-1, shape[-1]))
        # (self.__class__: graphs.py calls this forward on a weakref.proxy of the module)
        own = self.__class__.route is RoutedBlock.route and type(self.experts).forward is GroupedExperts.forward
        params = block.step_inputs(self, x2) if own else None
        if params is not None:  # one autograd node, the same launches (moekit.block)
            out, counts = block.moe_step(self, x2, params)
            with torch.no_grad():  # (add_, not +=: nn.Module's __setattr__ costs host microseconds)
                self.tokens_per_expert.add_(counts)
            if self.aux_loss is not None:
                self.aux_loss = None
            return _shaped(out, shape)
        r = self.route(x2)
        if self.experts.mlp2_bias_ED is None:  # weights applied before the (linear) down-projection
            scale = sorted_weights(r.weights, r.row_of)
            ys = self.experts.routed(x2, r.dispatch, scale)  # permute-free: no copy of x
            return _shaped(combine(ys, None, r.row_of), shape)
        ys = self.experts.routed(x2, r.dispatch)
        return _shaped(combine(ys, r.weights, r.row_of), shape)


def _shaped(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return out if out.shape == shape else out.reshape(shape)  # (a view of the same shape: an autograd node)


__all__ = [
    "ACTIVATIONS", "GptOssExperts", "GroupedExperts", "MoE", "RoutedBlock", "check_expert_args", "check_flags",
    "check_number",
]

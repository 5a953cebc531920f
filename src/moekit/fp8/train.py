"""FP8 training of the expert MLPs: DeepSeek-V3's blockwise recipe on Hopper's FP8 tensor cores.

Each expert GEMM ``y = x @ W[g]`` (:class:`FP8GroupedLinearFn`) runs on e4m3 operands with fp32 scales:

- forward ``y = x @ W``: x in 1 x 128 groups along K (``quantize``), W in 128 x 128 blocks
  (``quantize_weights`` of the (E, N, K) parameter as stored), ``grouped_mm_fp8``;
- dgrad ``dx = dy @ W^T`` (``TrainingRecipe.dgrad``): dy in 1 x 128 groups along N, W^T's 128 x 128
  blocks (the same blocks transposed: ``quantize_weights(W^T)``), ``grouped_mm_fp8``; else a bf16
  ``grouped_mm`` on dy and W;
- wgrad ``dW[g] = dy_g^T x_g`` (``TrainingRecipe.wgrad``): both operands in 128 x 1 groups of one expert's
  rows (``quantize_ragged_t``), ``weight_grad_fp8``, accumulated in fp32 and returned in the parameter's
  dtype; x is quantized that way in the forward and saved in FP8 (with its scales: ~0.5x the bf16 x's
  bytes). Else x is saved as it is and the wgrad is a bf16 ``grouped_mm``.

Every partial product over 128 of K is promoted into fp32 with its two scales (Hopper's FP8 accumulator
keeps ~14 bits). Rows past offs[-1] give zeros and read nothing into any scale an expert's rows use.
Non-finite values propagate as through bf16 (``fp8.formats``). Nothing syncs with the host; nothing is
random. The master weights keep their dtype; biases, the SwiGLU and the routing weights stay in the
activation dtype (``moekit.quantized``).
"""

from __future__ import annotations

import dataclasses

import torch

from ..grouped_gemm import grouped_mm
from ..quantized import QuantizedExperts, cached_weight, recipe_of
from .formats import quantize, quantize_ragged_t, quantize_weights
from .gemm import grouped_mm_fp8, weight_grad_fp8


@dataclasses.dataclass(frozen=True)
class TrainingRecipe:
    """Which expert GEMMs run in FP8, and how they scale (the forward always does).

    - ``dgrad``: the input gradient in FP8 (else bf16);
    - ``wgrad``: the weight gradient in FP8, with x saved in FP8 (else bf16, with x saved as it is);
    - ``pow2_scales``: scales rounded up to powers of two (UE8M0), else exact fp32 amax / 448.
    """

    dgrad: bool = True
    wgrad: bool = True
    pow2_scales: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, bool):
                raise TypeError(f"fp8.TrainingRecipe: {f.name} must be a bool, got {type(v).__name__} {v!r}")


class FP8GroupedLinearFn(torch.autograd.Function):
    """x (M, K) expert-sorted rows (bf16 / fp16), w (E, K, N) (a ``.mT`` view of an (E, N, K) parameter),
    offs (E,) int32, recipe -> (M, N) in x's dtype, the three GEMMs as the module docstring says; rows past
    offs[-1] are zeros."""

    @staticmethod
    def forward(ctx, x, w, offs, recipe: TrainingRecipe):
        pow2 = recipe.pow2_scales
        xq, xs = quantize(x, pow2_scales=pow2)
        wq, ws = cached_weight(w.mT, ("fp8", pow2), lambda t: quantize_weights(t, pow2_scales=pow2))  # (E, N, K)
        y = grouped_mm_fp8(xq, xs, wq, ws, offs, out_dtype=x.dtype)
        if recipe.wgrad and ctx.needs_input_grad[1]:
            xt, xts, _ = quantize_ragged_t(x, offs, pow2_scales=pow2)
            ctx.save_for_backward(w, offs, xt, xts, None)
        else:
            ctx.save_for_backward(w, offs, None, None, x if ctx.needs_input_grad[1] else None)
        ctx.recipe, ctx.x_dtype = recipe, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        w, offs, xt, xts, x = ctx.saved_tensors
        recipe = ctx.recipe
        dy = dy.to(ctx.x_dtype).contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if recipe.dgrad:
                dyq, dys = quantize(dy, pow2_scales=recipe.pow2_scales)
                pow2 = recipe.pow2_scales
                wtq, wts = cached_weight(w, ("fp8", pow2),  # (E, K, N): W^T's blocks
                                         lambda t: quantize_weights(t, pow2_scales=pow2))
                dx = grouped_mm_fp8(dyq, dys, wtq, wts, offs, out_dtype=ctx.x_dtype)
            else:
                dx = grouped_mm(dy, w.mT.to(dy.dtype), offs)
        if ctx.needs_input_grad[1]:
            if xt is not None:
                dyt, dyts, _ = quantize_ragged_t(dy, offs, pow2_scales=recipe.pow2_scales)
                dw = weight_grad_fp8(dyt, dyts, xt, xts, offs, out_dtype=torch.float32).mT  # (E, K, N)
            else:
                dw = grouped_mm(x.mT, dy, offs, out_dtype=torch.float32)
            dw = dw.to(w.dtype)
        return dx, dw, None, None


class FP8Training(QuantizedExperts):
    """The FP8 precision of one :class:`moekit.GroupedExperts` (``moekit.quantized``'s interface): its recipe.
    It holds no state: nothing random, nothing cached between steps (but inside ``moekit.weight_cache``)."""

    def __init__(self, recipe: TrainingRecipe):
        super().__init__()
        self.recipe = recipe

    @staticmethod
    def build(fp8_arg) -> FP8Training | None:
        """``GroupedExperts(fp8=...)``: None / False -> None, True -> the default recipe, a recipe."""
        recipe = recipe_of(fp8_arg, TrainingRecipe, "fp8")
        return None if recipe is None else FP8Training(recipe)

    def linear(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return FP8GroupedLinearFn.apply(x, w, offs, self.recipe)

    def extra_repr(self) -> str:
        return str(self.recipe)


__all__ = ["FP8GroupedLinearFn", "FP8Training", "TrainingRecipe"]

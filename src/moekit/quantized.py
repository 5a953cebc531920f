"""Quantized expert GEMMs behind one interface: what NVFP4 and FP8 training of the experts share.

A precision (``nvfp4.train.NVFP4Training``, ``fp8.train.FP8Training``) is a :class:`QuantizedExperts`: an
``nn.Module`` owned by a :class:`moekit.GroupedExperts` that provides ``linear(x, w, offs)``, one expert GEMM
``x (M, K) @ w[g] (K, N)`` per expert-sorted row group, with its backward, on quantized operands.
:meth:`QuantizedExperts.experts` runs the expert MLP on it, with the same arguments and the same result as
the bf16 experts up to the quantization: the permute-free row gather (each token's K rows summed back
without atomics where ``row_of`` is given), the up-projection, its bias, the SwiGLU, the routing weights
(``row_scale``), the down-projection and its bias. The SwiGLU and the biases run unfused, in the
activation dtype; rows past offs[-1] come out as zeros.

:func:`weight_cache` scopes the quantized weights: inside it each precision quantizes a weight once (per
direction, recipe and version) and reuses it, as across the micro-batches of one optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .experts import swiglu
from .routing import gather_token_rows


def row_experts(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows,) int64: the expert of each expert-sorted row (E for the rows past offs[-1]), on the device."""
    return torch.searchsorted(offs.long(), torch.arange(rows, device=offs.device), right=True)


def recipe_of(arg, recipe_cls: type, name: str):
    """A constructor's precision argument (``GroupedExperts(nvfp4=...)``, ``fp8=...``): None or False -> None,
    True -> ``recipe_cls()``, an instance of ``recipe_cls`` -> itself; anything else raises."""
    if arg is None or arg is False:
        return None
    if arg is True:
        return recipe_cls()
    if not isinstance(arg, recipe_cls):
        raise TypeError(f"{name} must be a bool or a moekit.{name}.TrainingRecipe, got {type(arg).__name__}")
    return arg


_CACHE: dict | None = None  # the open weight_cache scope's entries (process-wide: backwards run on other threads)


@contextlib.contextmanager
def weight_cache():
    """A scope in which the FP8 and NVFP4 experts quantize each weight once and reuse it: the forward's
    quantized weight, and the dgrad's where it is quantized apart, per weight memory, view (shape,
    strides), dtype, recipe and version. Wrap the micro-batches of one optimizer step (the optimizer step
    outside it)::

        with moekit.weight_cache():
            for x, target in micro_batches:
                loss_fn(moe(x), target).backward()
        opt.step()

    The weights must not change inside the scope: an in-place write that autograd sees (``torch.optim``'s,
    any op under ``no_grad``) bumps the version and the weight is quantized again, but a write through
    ``.data`` is not seen. The quantized copies (about half a bf16 weight's bytes per direction) are held
    until the outermost scope ends. Nothing is cached while ``torch.compile`` traces or a CUDA graph
    captures (a graph would keep reading the copies after the scope frees them); nested scopes share the
    outermost one. Outputs and gradients are the uncached ones bit for bit."""
    global _CACHE
    outer = _CACHE is not None
    if not outer:
        _CACHE = {}
    try:
        yield
    finally:
        if not outer:
            _CACHE = None


def cached_weight(w: torch.Tensor, tag, quantize: Callable[[torch.Tensor], tuple]) -> tuple:
    """``quantize(w)``, or inside :func:`weight_cache` its result for ``w``'s memory, view, dtype and version
    under ``tag`` (what else decides the result: the direction and the recipe's flags), made once. The entry
    holds ``w``, so no other tensor can take its memory while the scope lasts."""
    cache = _CACHE
    if cache is None or torch.compiler.is_compiling() or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return quantize(w)
    key = (tag, w.data_ptr(), w.shape, w.stride(), w.dtype, w.device)
    entry = cache.get(key)
    if entry is None or entry[1] != w._version:
        entry = cache[key] = (w, w._version, quantize(w))
    return entry[2]


def _bias_rows(bias: torch.Tensor, expert: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return F.pad(bias.to(dtype), (0, 0, 0, 1))[expert]  # (the rows past offs[-1] get zeros)


class QuantizedExperts(nn.Module):
    """The interface of a quantized precision of the experts (the module docstring)."""

    def linear(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x (M, K) expert-sorted rows @ w (E, K, N) (a ``.mT`` view of an (E, N, K) parameter) per expert, on
        quantized operands, differentiable -> (M, N) in x's dtype; rows past offs[-1] are zeros."""
        raise NotImplementedError

    def experts(self, mod, x_RD, offs, token_idx_R=None, row_of_TK=None, row_scale_R=None) -> torch.Tensor:
        """The forward of ``GroupedExperts`` ``mod`` on this precision's GEMMs: the same arguments (x (R, D)
        sorted rows, or (T, D) tokens with ``token_idx_R`` and ``row_of_TK``), the same result up to the
        quantization, (R, D)."""
        if token_idx_R is not None:
            x_RD = x_RD[token_idx_R.long()] if row_of_TK is None else gather_token_rows(x_RD, token_idx_R, row_of_TK)
        biased = mod.mlp1_bias_EG is not None or mod.mlp2_bias_ED is not None
        expert = row_experts(offs, x_RD.shape[0]) if biased else None
        pre = self.linear(x_RD, mod.mlp1_weight_EGD.mT, offs)  # (R, 2F)
        if mod.mlp1_bias_EG is not None:
            pre = pre + _bias_rows(mod.mlp1_bias_EG, expert, pre.dtype)
        h = swiglu(pre, **mod.swiglu)  # (R, F)
        if row_scale_R is not None:
            h = (h.float() * row_scale_R[:, None]).to(h.dtype)
        out = self.linear(h, mod.mlp2_weight_EDF.mT, offs)  # (R, D)
        if mod.mlp2_bias_ED is not None:
            out = out + _bias_rows(mod.mlp2_bias_ED, expert, out.dtype)
        return out


__all__ = ["QuantizedExperts", "cached_weight", "recipe_of", "row_experts", "weight_cache"]

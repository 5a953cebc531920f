"""FP8 (e4m3) with blockwise fp32 scales, the recipe of DeepSeek-V3's training: the format
(``formats``: quantize activations in 1 x 128 groups, weights in 128 x 128 blocks, a weight gradient's
operands in 128 x 1 groups of one expert's rows, and dequantize) and the grouped GEMMs on it (``gemm``:
the rows-ragged forward, and the weight gradient) and the training of the experts on them (``train``:
``GroupedExperts(fp8=...)``). Every op has a pure-PyTorch ``*_ref`` twin (the
format's bit for bit). The modules import down: formats; gemm on formats; train on both.
"""

from .formats import (
    AMAX_FLOOR,
    E4M3_MAX,
    GROUP,
    dequantize,
    dequantize_ragged_t,
    dequantize_ragged_t_ref,
    dequantize_ref,
    dequantize_weights,
    dequantize_weights_ref,
    quantize,
    quantize_ragged_t,
    quantize_ragged_t_ref,
    quantize_ref,
    quantize_weights,
    quantize_weights_ref,
    ragged_groups_ref,
)
from .gemm import grouped_mm_fp8, grouped_mm_fp8_ref, weight_grad_fp8, weight_grad_fp8_ref
from .train import FP8GroupedLinearFn, FP8Training, TrainingRecipe

__all__ = [
    "AMAX_FLOOR", "E4M3_MAX", "FP8GroupedLinearFn", "FP8Training", "GROUP", "TrainingRecipe", "dequantize",
    "dequantize_ragged_t", "dequantize_ragged_t_ref", "dequantize_ref", "dequantize_weights", "dequantize_weights_ref",
    "grouped_mm_fp8", "grouped_mm_fp8_ref", "quantize", "quantize_ragged_t", "quantize_ragged_t_ref", "quantize_ref",
    "quantize_weights", "quantize_weights_ref", "ragged_groups_ref", "weight_grad_fp8", "weight_grad_fp8_ref",
]

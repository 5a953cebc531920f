"""NVFP4: the format (``formats``: quantize, dequantize, the block-scale layouts), the expert GEMMs on
NVFP4 operands (``gemm``), SwiGLU fused with quantization (``swiglu``) and the training recipe of the
experts (``train``). Every op has a pure-PyTorch ``*_ref`` twin. The modules import down: formats;
gemm and swiglu on formats; train on all three.
"""

from .formats import (
    BLOCK,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    blocked_size,
    deinterleave8_ref,
    dequantize,
    dequantize_ref,
    e2m1_codes_ref,
    e2m1_values_ref,
    global_scale_ref,
    interleave8_ref,
    pack_ref,
    philox_ref,
    quantize,
    quantize_reads_words,
    quantize_ref,
    quantize_weights,
    quantize_weights_ref,
    ragged_row_tiles,
    random_bits_ref,
    to_blocked,
    to_blocked_experts,
    to_blocked_experts_ref,
    to_blocked_ragged,
    to_blocked_ragged_ref,
    to_blocked_ref,
    unpack_ref,
)
from .gemm import (
    grouped_mm_nvfp4,
    grouped_mm_nvfp4_ref,
    grouped_mm_nvfp4_wgrad,
    grouped_mm_nvfp4_wgrad_ref,
    pack_weights,
    unpack_weights,
)
from .swiglu import (
    grouped_mm_swiglu_nvfp4,
    grouped_mm_swiglu_nvfp4_ref,
    swiglu_quantize_nvfp4,
    swiglu_quantize_nvfp4_ref,
)
from .train import NVFP4Training, TrainingRecipe, hadamard16, random_signs

__all__ = [
    "BLOCK", "E2M1_MAX", "E2M1_VALUES", "E4M3_MAX", "NVFP4Training", "TrainingRecipe", "blocked_size",
    "deinterleave8_ref", "dequantize", "dequantize_ref", "e2m1_codes_ref", "e2m1_values_ref", "global_scale_ref",
    "grouped_mm_nvfp4", "grouped_mm_nvfp4_ref", "grouped_mm_nvfp4_wgrad", "grouped_mm_nvfp4_wgrad_ref",
    "grouped_mm_swiglu_nvfp4", "grouped_mm_swiglu_nvfp4_ref", "hadamard16", "interleave8_ref", "pack_ref",
    "pack_weights", "philox_ref", "quantize", "quantize_reads_words", "quantize_ref", "quantize_weights",
    "quantize_weights_ref", "ragged_row_tiles", "random_bits_ref", "random_signs", "swiglu_quantize_nvfp4",
    "swiglu_quantize_nvfp4_ref", "to_blocked", "to_blocked_experts", "to_blocked_experts_ref", "to_blocked_ragged",
    "to_blocked_ragged_ref", "to_blocked_ref", "unpack_ref", "unpack_weights",
]

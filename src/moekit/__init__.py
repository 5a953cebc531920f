"""moekit: Mixture-of-Experts training kernels for PyTorch (Triton on GPU, pure PyTorch on CPU).

Dimension legend used in every docstring and shape comment:

    T  tokens             K  experts per token (top-k)      E  experts
    R  routed rows, T*K   D  model dim                      F  expert hidden dim
    M, N, K  the GEMM dims of one group: (M, K) @ (K, N); Kt a ragged reduction length

Expert-sorted rows are split into groups by ``offs`` (E,) int32: cumulative row ends that live on the
device and are never read by the host.
"""

from . import distributed, fp8, nvfp4
from .config import Options, TileConfig, get_options, options, set_options
from .epilogue import SwiGLU
from .experts import grouped_mm_downproj, grouped_mm_swiglu, swiglu
from .graphs import graphed
from .grouped_gemm import grouped_mm
from .layers import GptOssExperts, GroupedExperts, MoE
from .nvfp4 import (
    grouped_mm_nvfp4,
    grouped_mm_nvfp4_ref,
    grouped_mm_nvfp4_wgrad,
    grouped_mm_nvfp4_wgrad_ref,
    grouped_mm_swiglu_nvfp4,
    grouped_mm_swiglu_nvfp4_ref,
    swiglu_quantize_nvfp4,
    swiglu_quantize_nvfp4_ref,
)
from .quantized import weight_cache
from .reference import grouped_mm_downproj_ref, grouped_mm_ref, grouped_mm_swiglu_ref, swiglu_ref
from .routing import (
    Dispatch,
    Routing,
    combine,
    combine_ref,
    gather_rows,
    router_topk_ref,
    routing_metadata,
    routing_metadata_ref,
    sorted_weights,
    topk_router,
)
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "GptOssExperts",
    "GroupedExperts",
    "MoE",
    "Options",
    "Dispatch",
    "Routing",
    "SwiGLU",
    "TileConfig",
    "combine",
    "combine_ref",
    "distributed",
    "fp8",
    "gather_rows",
    "get_options",
    "graphed",
    "grouped_mm",
    "grouped_mm_downproj",
    "grouped_mm_downproj_ref",
    "grouped_mm_nvfp4",
    "grouped_mm_nvfp4_ref",
    "grouped_mm_nvfp4_wgrad",
    "grouped_mm_nvfp4_wgrad_ref",
    "grouped_mm_ref",
    "grouped_mm_swiglu",
    "grouped_mm_swiglu_nvfp4",
    "grouped_mm_swiglu_nvfp4_ref",
    "grouped_mm_swiglu_ref",
    "nvfp4",
    "options",
    "routing_metadata",
    "routing_metadata_ref",
    "router_topk_ref",
    "set_options",
    "sorted_weights",
    "swiglu",
    "swiglu_quantize_nvfp4",
    "swiglu_quantize_nvfp4_ref",
    "swiglu_ref",
    "topk_router",
    "warmup",
    "weight_cache",
    "__version__",
]

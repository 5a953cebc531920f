"""moekit's configuration, in three parts:

- ``settings``: the runtime options (:class:`Options`, :func:`set_options`, :func:`options`) and the
  allocator of kernel outputs (:func:`empty`, poisoned under the ``poison`` option);
- ``target``: which path ops take on a device and what the GPU offers;
- ``heuristics``: tile configurations and the heuristics that pick them.

Every public name of the three is importable from here (``config.num_sms``, ``config.TileConfig``).
"""

from .heuristics import (
    NVFP4_DECODE_ROWS,
    TileConfig,
    grouped_mm_config,
    nvfp4_gemm_config,
    nvfp4_gemm_dequantizes,
    ones_row_is_free,
    swiglu_bwd_blocks,
)
from .settings import Options, empty, fused_dswiglu, get_options, options, save_h, set_options
from .target import (
    TRITON_TESTED,
    check_triton,
    is_interpreting,
    num_sms,
    use_gluon_quantize,
    use_nvfp4_ptx_decode,
    use_tma,
    use_warp_specialized,
    uses_triton,
)

__all__ = [
    "NVFP4_DECODE_ROWS", "TRITON_TESTED", "Options", "TileConfig", "check_triton", "empty", "fused_dswiglu",
    "get_options", "grouped_mm_config", "is_interpreting", "num_sms", "nvfp4_gemm_config", "nvfp4_gemm_dequantizes",
    "ones_row_is_free", "options", "save_h", "set_options", "swiglu_bwd_blocks", "use_gluon_quantize",
    "use_nvfp4_ptx_decode", "use_tma", "use_warp_specialized", "uses_triton",
]

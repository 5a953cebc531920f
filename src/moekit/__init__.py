"""moekit: Mixture-of-Experts training kernels for PyTorch (Triton on GPU, pure PyTorch on CPU).

Dimension legend used in every docstring and shape comment:

    T  tokens             K  experts per token (top-k)      E  experts
    R  routed rows, T*K   D  model dim                      F  expert hidden dim
    M, N, K  the GEMM dims of one group: (M, K) @ (K, N); Kt a ragged reduction length

Expert-sorted rows are split into groups by ``offs`` (E,) int32: cumulative row ends that live on the
device and are never read by the host.
"""

from .config import TileConfig, set_debug
from .grouped_gemm import grouped_mm
from .reference import grouped_mm_ref

__version__ = "0.1.0"

__all__ = ["TileConfig", "grouped_mm", "grouped_mm_ref", "set_debug", "__version__"]

"""Target information: which path ops take on a device (the kernels, the interpreter or the
reference), the installed Triton's check, and what the GPU offers (TMA, the warp-specialized Gluon
kernels, the Gluon quantize kernels, the PTX decode, the SM count)."""

from __future__ import annotations

import functools
import os

import torch

from .settings import get_options


def is_interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``, Triton's own
    variable, which must be set before Triton compiles anything)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def uses_triton(device: torch.device) -> bool:
    """Whether ops on ``device`` go through the Triton kernels (else the pure-PyTorch reference, which
    also serves meta tensors). Raises when the installed Triton is one moekit's kernels were not tested
    with."""
    use = not get_options().reference and (device.type == "cuda" or (is_interpreting() and device.type != "meta"))
    if use and not torch.compiler.is_compiling():  # checked when eager calls first run
        check_triton()
    return use


TRITON_TESTED = ((3, 6), (3, 7))  # the Triton minor releases the test suites pass on (pyproject.toml)


@functools.cache
def check_triton() -> None:
    """Raise one clear error if the kernels cannot run with the installed Triton (and numpy, for the
    interpreter); called on the first op that would launch a kernel."""
    import numpy
    import triton

    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if version not in TRITON_TESTED:
        raise RuntimeError(
            f"moekit: Triton {triton.__version__} is installed, but moekit's kernels are tested on Triton "
            f"3.6 and 3.7 only: pip install 'triton>=3.6,<3.8' (or set MOEKIT_REFERENCE=1 for the "
            f"pure-PyTorch path)"
        )
    numpy_version = tuple(int(p) for p in numpy.__version__.split(".")[:2])
    if is_interpreting() and version == (3, 6) and numpy_version >= (2, 4):
        raise RuntimeError(
            f"moekit: Triton 3.6's interpreter (TRITON_INTERPRET=1) fails with numpy {numpy.__version__}: "
            f"pip install 'numpy<2.4', or Triton 3.7"
        )


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_tma(device: torch.device) -> bool:
    """TMA descriptors on Hopper and newer, unless the ``tma`` option is off."""
    if not get_options().tma:
        return False
    if device.type != "cuda":
        return is_interpreting()  # the interpreter emulates descriptors; tests cover both paths
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def use_warp_specialized(device: torch.device) -> bool:
    """The warp-specialized Gluon kernels on Hopper (sm_90): ``_kernels/hopper_gemm.py``, the default there
    for the bf16 GEMMs they cover, and ``_kernels/nvfp4_gemm_ws.py``, the NVFP4 GEMM's default for
    packed weights; off with the ``warp_specialized`` option."""
    if not get_options().warp_specialized or device.type != "cuda" or not use_tma(device):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) == (9, 0) and _has_gluon()


def use_gluon_quantize(device: torch.device) -> bool:
    """The Gluon NVFP4 kernels (``_kernels/nvfp4_gluon.py``: quantize with 1x16 blocks rounded to nearest,
    and the standalone SwiGLU -> NVFP4 pass) on Hopper and newer GPUs (measured on the H100 only),
    unless the ``gluon_quantize`` option is off; the Triton kernels everywhere else. Both write the same
    bits."""
    if not get_options().gluon_quantize or device.type != "cuda" or not _has_gluon():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def use_nvfp4_ptx_decode(device: torch.device) -> bool:
    """The NVFP4 grouped GEMM's inline-PTX decode (``cvt.rn.f16x2.e4m3x2`` needs sm_89) on sm_89 and
    newer, unless the ``nvfp4_ptx_decode`` option is off; never under the interpreter, which runs no PTX."""
    if not get_options().nvfp4_ptx_decode or device.type != "cuda" or is_interpreting():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)






@functools.cache
def _has_gluon() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Programs in a persistent launch: one per SM less the ``sm_margin`` option (at least one; a small
    fixed number on the interpreter)."""
    if device.type != "cuda":
        return 4
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, sms - get_options().sm_margin)

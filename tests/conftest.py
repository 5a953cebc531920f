"""CPU runs use Triton's interpreter for the kernels; `-m gpu` tests need CUDA.

TRITON_INTERPRET must be set before any @triton.jit function is decorated, so this runs first.
"""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_rounds_bf16_to_nearest():
    """Triton 3.6's interpreter casts fp32 -> bf16 by truncation (round toward zero), even when
    asked for "rtne"; the GPU rounds to nearest even (cvt.rn.bf16.f32). Emulate the GPU, so CPU tests
    see the rounding the kernels really have instead of a bias toward zero twice as large."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = np.ascontiguousarray(src.data, dtype=np.float32)
            bits = x.view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(x), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, dst_type.scalar)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _interpreter_rounds_bf16_to_nearest()

import moekit  # noqa: E402  (after TRITON_INTERPRET)
from moekit import config  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=None, help="random cases per fuzz test (test_fuzz.py)")
    parser.addoption("--fuzz-seed", type=int, default=0, help="the first fuzz case's seed")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_cpu = pytest.mark.skip(reason="CPU suite: runs the kernels under TRITON_INTERPRET=1 on a CPU-only machine")
    for item in items:
        if "gpu" in item.keywords:
            if not HAS_CUDA:
                item.add_marker(skip_gpu)
        elif HAS_CUDA and "interpreter" in item.fixturenames:
            item.add_marker(skip_cpu)


@pytest.fixture
def interpreter():
    """Marks a test that runs the Triton kernels on CPU tensors through the interpreter."""
    assert config.is_interpreting()
    return True


@pytest.fixture(autouse=True)
def _poison_and_seed():
    """Every kernel output starts as NaN, and every test draws fresh random inputs from its own seed."""
    with moekit.options(poison=True):
        torch.manual_seed(0x5EED)
        yield


@pytest.fixture(params=[True, False], ids=["tma", "ptr"])
def tma_path(request):
    """Run a kernel test through the TMA-descriptor path and through the plain-pointer path."""
    with moekit.options(tma=request.param):
        yield request.param


@pytest.fixture(params=["ws", "tma", "ptr"])
def expert_path(request):
    """The fused expert kernels three ways: the warp-specialized Hopper kernel where it applies (an
    sm_90 GPU; elsewhere "ws" runs the Triton TMA path again), Triton with TMA, Triton with pointers."""
    with moekit.options(warp_specialized=request.param == "ws", tma=request.param != "ptr"):
        yield request.param


__all__ = ["moekit"]

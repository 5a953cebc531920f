"""CPU runs use Triton's interpreter for the kernels; `-m gpu` tests need CUDA.

TRITON_INTERPRET must be set before any @triton.jit function is decorated, so this runs first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import moekit  # noqa: E402  (after TRITON_INTERPRET)
from moekit import config  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


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
    config.set_poison(True)
    torch.manual_seed(0x5EED)
    yield
    config.set_poison(False)
    config.set_debug(False)


@pytest.fixture(params=[True, False], ids=["tma", "ptr"])
def tma_path(request, monkeypatch):
    """Run a kernel test through the TMA-descriptor path and through the plain-pointer path."""
    monkeypatch.setenv("MOEKIT_NO_TMA", "0" if request.param else "1")
    return request.param


__all__ = ["moekit"]

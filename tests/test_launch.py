"""The launch layer (``moekit.launch``): its cache key is at least as fine as Triton's specialization
(CPU), and on the GPU a launch through it gives the bits of Triton's own launch path."""

import itertools

import pytest
import torch

import moekit
from moekit import launch
from moekit.bench import MoEShape
from moekit.bench.moe import training_step


def _args():
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 16,
            2**40, 2**40 + 1]
    buf = torch.empty(256, dtype=torch.uint8)
    tensors = [buf[i:].view(dtype) for i in (0, 2, 4, 8, 16, 32) for dtype in (torch.bfloat16, torch.float32)
               if (buf.data_ptr() + i) % dtype.itemsize == 0 and (256 - i) % dtype.itemsize == 0]
    tensors.append(torch.nn.Parameter(torch.empty(4)))
    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.empty(64, 64, dtype=torch.bfloat16)
    descs = [TensorDescriptor(base, [64, 64], [64, 1], block) for block in ([16, 32], [32, 16], [16, 32])]
    descs.append(TensorDescriptor(base.float(), [64, 64], [64, 1], [16, 32]))
    return [*ints, True, False, 0.5, 2.0, None, *tensors, *descs]


def test_cache_key_is_finer_than_tritons_specialization():
    """Two arguments with one launch-layer fact must get one Triton specialization: otherwise a kernel
    compiled for one (say, a 16-byte aligned pointer) would be launched for the other."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    def spec(a):
        return native_specialize_impl(BaseBackend, a, False, True, True)

    args = _args()
    facts = [launch._arg_key(a) for a in args]
    pairs = 0
    for (a, fa), (b, fb) in itertools.combinations(zip(args, facts, strict=True), 2):
        if fa == fb:
            pairs += 1
            assert spec(a) == spec(b), (a, b)
    assert pairs > 10  # the check compared something
    # and the facts do tell apart what Triton tells apart
    assert len({launch._arg_key(a) for a in (1, True, 1.0)}) == 3
    assert launch._arg_key(args[-4]) != launch._arg_key(args[-3])  # two boxes


def test_interpreter_launches_through_triton(interpreter):
    from moekit._kernels.routing import _combine_kernel

    assert launch.kernel(_combine_kernel) is _combine_kernel


@pytest.mark.gpu
def test_fast_launch_gives_tritons_bits():
    """A training step of the block, through the launch layer and through Triton's launch path:
    the same outputs and gradients, bit for bit."""
    shape = MoEShape("t", 512, 256, 16, 4, tokens=1000)
    results = []
    for fast in (False, True, True):  # the second fast run launches every kernel from the cache
        with moekit.options(fast_launch=fast):
            moe, x, step = training_step(shape, "gpt-oss")
            out = moe(x)
            grads = step()
            torch.cuda.synchronize()
            results.append([out, *grads])
    for ref, got in zip(results[0], results[2], strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    from moekit._kernels.routing import _combine_kernel

    assert launch.cached_signatures(_combine_kernel) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "ptr"])
def test_misaligned_offs_gets_its_own_kernel(tma):
    """The same GEMM with offs 16-byte aligned and one element off (a view): Triton specializes the
    pointer's alignment, and so must the cache; every result matches the reference."""
    e, k, n, m = 4, 64, 96, 57
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    buf = torch.tensor([0, 10, 30, 30, 57], device="cuda", dtype=torch.int32)
    aligned = buf[1:].clone()
    with moekit.options(tma=tma):
        for offs in (aligned, buf[1:], aligned):
            assert (offs.data_ptr() % 16 == 0) == (offs is aligned)
            got = moekit.grouped_mm(x, w.mT, offs)
            ref = moekit.grouped_mm_ref(x.float(), w.mT.float(), offs)
            torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)

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


class _FakeParam:
    def __init__(self, name, default=None, has_default=False):
        self.name, self.default, self.has_default = name, default, has_default


class _FakeJIT:
    """A JIT function's face (names, defaults, ``fn[grid](...)``) that records what Triton's path got."""

    arg_names = ["a", "b", "C", "D"]
    params = [_FakeParam("a"), _FakeParam("b"), _FakeParam("C", 3, True), _FakeParam("D", 4, True)]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs)) or object()


@pytest.mark.parametrize("call", [((1, 2), {}), ((1, 2), {"D": 5}), ((1,), {"b": 2, "C": 7}), ((1, 2, 3, 4), {}),
                                  ((), {"D": 5, "b": 2, "a": 1})], ids=["defaults", "kw", "kw-order", "all", "all-kw"])
def test_cached_launch_passes_every_argument_in_declaration_order(monkeypatch, call):
    """The first call of a signature goes through Triton's path; later ones hand the cached kernel's
    launcher every declared argument in declaration order (positional, keyword, default)."""
    args, kwargs = call
    fn = _FakeJIT()
    runs = []
    monkeypatch.setattr(launch, "_driver", lambda: type("D", (), {"get_current_device": staticmethod(lambda: 0)}))
    monkeypatch.setattr(launch, "_run", lambda compiled, grid, values, device: runs.append(list(values)))
    k = launch.Kernel(fn)
    k[(1,)](*args, **kwargs)
    assert fn.calls == [(args, kwargs)] and runs == []
    k[(1,)](*args, **kwargs)
    merged = dict(zip(fn.arg_names[:len(args)], args, strict=True)) | kwargs
    assert runs == [[merged.get(n, p.default) for n, p in zip(fn.arg_names, fn.params, strict=True)]]
    k[(1,)](*args, **kwargs, **({} if "C" in kwargs or len(args) > 2 else {"C": 9}))  # another signature
    assert len(fn.calls) == 1 + (0 if "C" in kwargs or len(args) > 2 else 1)


def test_missing_argument_goes_to_tritons_path(monkeypatch):
    fn = _FakeJIT()
    monkeypatch.setattr(launch, "_driver", lambda: type("D", (), {"get_current_device": staticmethod(lambda: 0)}))
    k = launch.Kernel(fn)
    k[(1,)](1)  # b missing: Triton's own error would come from its path
    k[(1,)](1)
    assert len(fn.calls) == 2


def test_host_grid_arithmetic_is_tritons():
    import triton

    for n in (-5, -1, 0, 1, 2, 3, 4, 5, 127, 128, 129, 2**31 + 1):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128):
            assert launch.cdiv(n, d) == triton.cdiv(n, d), (n, d)


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

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
    monkeypatch.setattr(launch, "run", lambda compiled, grid, values, device, direct=None: runs.append(list(values)))
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


def _fake_compiled(monkeypatch, descriptors: bool):
    """A compiled kernel whose launcher is Triton's own ``CudaLauncher`` class (of the installed version)
    around a C launch function that records its arguments; the descriptor encoding (which needs a GPU)
    is replaced by one that records what it encoded."""
    from triton.backends.nvidia import driver as nvidia

    calls, encoded = [], []

    def make(arg, meta):
        encoded.append((arg.base.data_ptr(), tuple(arg.shape)))
        return [("map", arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides), meta["swizzle"]), *arg.shape,
                *arg.strides]

    monkeypatch.setattr(nvidia, "make_tensordesc_arg", make)
    if descriptors:
        signature = {"a": "*bf16", "x": "tensordesc<bf16[16, 32]>", "n": "i32", "y": "tensordesc<bf16[1, 16, 32]>",
                     "B": "constexpr"}
        metas = [{"swizzle": 1}, {"swizzle": 2}]
    else:
        signature, metas = {"a": "*bf16", "n": "i32", "B": "constexpr"}, None
    launcher = object.__new__(nvidia.CudaLauncher)
    launcher.launch = nvidia.wrap_handle_tensordesc(lambda *a: calls.append(a), signature, metas)
    launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, True
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    if "arg_annotations" in nvidia.CudaLauncher.__init__.__code__.co_names:  # Triton 3.7's shared launch
        launcher.arg_annotations, launcher.kernel_signature = "annotations", b"signature"
    compiled = type("Compiled", (), {})()
    compiled.run, compiled.function, compiled.packed_metadata = launcher, 77, (4, 1, 0)
    compiled.src = type("Src", (), {"signature": signature})()
    compiled.metadata = type("Meta", (), {"tensordesc_meta": metas})()
    return compiled, calls, encoded


@pytest.mark.parametrize("descriptors", [False, True], ids=["pointers", "descriptors"])
def test_direct_launch_hands_the_c_launcher_tritons_arguments(monkeypatch, descriptors):
    """``_Direct`` calls the C launch function with what Triton's ``CudaLauncher`` would pass it, and
    encodes a descriptor once per (address, shape, strides), again for a new region."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    compiled, calls, encoded = _fake_compiled(monkeypatch, descriptors)
    direct = launch._direct(compiled)
    assert direct is not None
    a, b = torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(64, 64, dtype=torch.bfloat16)

    def values(x):
        if not descriptors:
            return (a, 5, 16)
        return (a, TensorDescriptor(x, [64, 64], [64, 1], [16, 32]), 5,
                TensorDescriptor(x, [1, 64, 64], [4096, 64, 1], [1, 16, 32]), 16)

    def flat(call):  # Triton 3.7 passes the kernel's arguments as one sequence (a tuple or a list)
        return call[:-1] + tuple(call[-1]) if isinstance(call[-1], (tuple, list)) else call

    for x in (a, a, b):
        compiled.run(1, 2, 3, 99, compiled.function, compiled.packed_metadata, None, None, None, *values(x))
        direct(1, 2, 3, 99, None, None, None, values(x))
        assert flat(calls[-1]) == flat(calls[-2]) and len(flat(calls[-1])) > 12
    if descriptors:  # Triton's path encodes both descriptors at every launch; the direct one once per region
        assert len(encoded) == 2 * 3 + 2 * 2
        assert flat(calls[-1]) != flat(calls[1])  # the new region's encoding reached the launch


def test_direct_launch_declines_what_it_does_not_know(monkeypatch):
    compiled, _, _ = _fake_compiled(monkeypatch, True)
    compiled.run.global_scratch_size = 128  # scratch memory: Triton's launcher allocates it
    assert launch._direct(compiled) is None
    compiled, _, _ = _fake_compiled(monkeypatch, True)
    compiled.metadata.tensordesc_meta = None  # descriptors decomposed to pointers
    assert launch._direct(compiled) is None
    assert launch._direct(object()) is None


@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_descriptors_built_without_checks_equal_checked_ones(gluon):
    """``descriptors.descriptor`` builds the first descriptor of a kind through the class's checks and
    later ones field by field: the same class and fields as the checked constructor gives."""
    from moekit import descriptors

    layout = None
    if gluon:
        from triton.experimental.gluon import language as gl

        layout = gl.NVMMASharedLayout.get_default_for([16, 32], gl.bfloat16)
    t = torch.empty(128, 64, dtype=torch.bfloat16)
    descriptors.descriptor(t, [128, 64], [64, 1], [16, 32], layout)
    assert (t.dtype, (16, 32), layout, 2) in {k[1:] for k in descriptors._CHECKED}
    later = descriptors.descriptor(t[16:], [112, 64], [64, 1], [16, 32], layout)
    cls = descriptors._gluon_descriptor_class() if gluon else descriptors.TensorDescriptor
    ref = cls(t[16:], [112, 64], [64, 1], [16, 32], *([layout] if gluon else []))
    assert type(later) is cls and vars(later).keys() == vars(ref).keys()
    for name, value in vars(ref).items():
        if name == "base":
            assert later.base.data_ptr() == value.data_ptr() and later.base.shape == value.shape
        else:
            assert getattr(later, name) == value, name
    for shape, strides in (([0, 64], [64, 1]), ([112, 64], [1, 112])):
        with pytest.raises(ValueError, match="positive shape and a unit last stride"):
            descriptors.descriptor(t, shape, strides, [16, 32], layout)


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
    # every kernel of the step launches through the direct path, TMA descriptors included
    entries = [e for _, k in launch._KERNELS.values() if isinstance(k, launch.Kernel) for e in k._compiled.values()]
    assert entries and all(direct is not None for _, direct in entries)
    assert any(direct.slots for _, direct in entries)


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

"""The launch layer: every Triton and Gluon kernel of moekit is launched through :func:`kernel`.

``kernel(fn)[grid](*args, **kwargs)`` launches the ``@triton.jit`` / ``@gluon.jit`` function ``fn``
exactly as ``fn[grid](*args, **kwargs)`` would, with less host work on every call after the first:

- Triton's own launch binds every argument, specializes each one (``native_specialize_impl``), turns
  the specialization and the options into a string key, looks the compiled kernel up under it, checks
  the kernel's globals and only then launches. For a GEMM with ~30 arguments that is most of the
  launch's host time (docs/design.md, section 9).
- Here the first call of a signature goes through Triton (which compiles or finds the kernel, and
  launches it), and the compiled kernel is kept under a key of the call's *specialization facts*:
  per tensor its dtype and whether its address is 16-byte aligned; per tensor descriptor its dtype,
  box and shared layout; per int, float, bool, None, constexpr and launch option its type and value.
  These are the facts Triton specializes on (for an int: whether it is 1, divisible by 16, and fits in
  32 bits), or finer, so one key never maps to two different compiled kernels. Later calls with the same
  facts launch the compiled kernel directly: its launcher (``CompiledKernel.run``) takes every
  argument in declaration order, as Triton's would, and encodes the TMA descriptors as Triton does.
- What depends only on the call's argument types and keyword names (which values key by value and
  which by facts, where each declared parameter comes from) is worked out once per such signature
  (``_Layout``), so a cached launch walks only its tensors and descriptors in Python.
- A cached kernel is launched through ``_Direct``: the C launch function under Triton's ``CudaLauncher``,
  called with the argument list Triton's Python wrapper would build, and each TMA descriptor's expansion
  (``CUtensorMap``, shape, strides) kept under the facts it encodes (address, shape, strides, padding;
  the dtype, box and swizzle are the compiled kernel's), so a descriptor over the same memory region is
  encoded once, not at every launch. The encoding is a pure function of that key, so a kept expansion
  is never stale; it holds no tensor. Where the launcher is not of the two forms known (Triton 3.6's
  compiled-per-kernel module, 3.7's shared ``launch`` with argument annotations) or the kernel needs
  scratch memory, ``CompiledKernel.run`` launches it as before.

What is skipped on the fast path, and why that is safe: the globals check (moekit's kernels read only
module constants); the compile-cache lookup by string (the key above is finer); the pre-run hooks
(none are registered on moekit's kernels). Launch hooks (``triton.knobs.runtime.launch_enter_hook``,
set by profilers) are honoured; while none is set, no launch-metadata dict is built. Under Triton's
CPU interpreter, and with the ``fast_launch`` option off, every call goes through Triton unchanged.

``cdiv`` and ``next_power_of_2`` are Triton's for host ints, as plain functions: Triton's are
constexpr functions, whose every host call costs ~5 us.
"""

from __future__ import annotations

import functools

import torch

from . import config
from .config import settings as _settings

_CACHE_LIMIT = 4096  # signatures per kernel; past it the cache starts afresh (a run whose sizes never repeat)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv(a, b)`` for host ints, without its constexpr-function call (~5 us of host each)."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2(n)`` for host ints (0 for n <= 0, as Triton's), without its
    constexpr-function call."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _tensor_fact(t: torch.Tensor):
    return t.dtype, t.data_ptr() & 15 == 0


def _desc_fact(d):
    return d.base.dtype, tuple(d.block_shape), getattr(d, "layout", None), d.padding


DESCRIPTORS: tuple = ()


def _register_descriptors() -> None:
    global DESCRIPTORS
    found = []
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor

        found.append(TensorDescriptor)
    except ImportError:  # pragma: no cover - Triton without host descriptors
        pass
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

        found.append(GluonDescriptor)
    except ImportError:  # pragma: no cover - Triton without Gluon
        pass
    DESCRIPTORS = tuple(found)


_register_descriptors()


class _Layout:
    """What a call signature (argument types, keyword names) fixes, worked out once: which values key
    the cache as themselves (scalars, dtypes, tuples: with their types, which the signature holds, so
    that 1, 1.0 and True stay apart), which by their specialization facts (tensors, of any subclass,
    and descriptors), and where each declared parameter's value comes from (a positional argument, a
    keyword or the default)."""

    __slots__ = ("by_value", "tensors", "descriptors", "order")

    def __init__(self, types: tuple, kw_names: tuple, kernel: Kernel):
        self.by_value = tuple(i for i, t in enumerate(types)
                              if not issubclass(t, torch.Tensor) and t not in DESCRIPTORS)
        self.tensors = tuple(i for i, t in enumerate(types) if issubclass(t, torch.Tensor))
        self.descriptors = tuple(i for i, t in enumerate(types) if t in DESCRIPTORS)
        n_args, n_values = len(types) - len(kw_names), len(types)
        order = []
        for j, name in enumerate(kernel._names):
            if j < n_args:
                order.append(j)
            elif name in kw_names:
                order.append(n_args + kw_names.index(name))
            else:  # a missing argument without a default raises KeyError here: Triton's path reports it
                order.append(n_values + kernel._default_index[name])
        self.order = None if order == list(range(n_values)) else tuple(order)


def _arg_key(a):
    """One argument's key part, as ``Kernel`` builds it (a test aid)."""
    t = type(a)
    if issubclass(t, torch.Tensor):
        return t, _tensor_fact(a)
    return t, _desc_fact(a) if t in DESCRIPTORS else a


class Kernel:
    """A JIT function behind the launch layer: ``Kernel(fn)[grid](*args, **kwargs)``."""

    __slots__ = ("fn", "_names", "_defaults", "_default_index", "_layouts", "_compiled")

    def __init__(self, fn):
        self.fn = fn
        self._names = tuple(fn.arg_names)
        defaults = [(p.name, p.default) for p in fn.params if p.has_default]
        self._defaults = tuple(v for _, v in defaults)
        self._default_index = {name: i for i, (name, _) in enumerate(defaults)}
        self._layouts: dict = {}
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _key(self, values: tuple, sig: tuple, layout: _Layout, device: int):
        return (sig, device, tuple([values[i] for i in layout.by_value]),
                tuple([(values[i].dtype, values[i].data_ptr() & 15 == 0) for i in layout.tensors]),
                tuple([_desc_fact(values[i]) for i in layout.descriptors]))

    def _launch(self, grid, args, kwargs):
        recorder = _settings.recorder()
        if recorder is None:
            _settings.note_launch()
        if not config.get_options().fast_launch:
            if recorder is not None:
                recorder.launch(None, None, grid, ())  # (a launch it cannot replay)
            return self.fn[grid](*args, **kwargs)
        device = _driver().get_current_device()
        if kwargs:
            values = args + tuple(kwargs.values())
            sig = (tuple(map(type, values)), tuple(kwargs))
        else:
            values = args
            sig = (tuple(map(type, values)), ())
        try:
            layout = self._layouts.get(sig)
            if layout is None:
                layout = self._layouts[sig] = _Layout(sig[0], sig[1], self)
            key = self._key(values, sig, layout, device)
            entry = self._compiled.get(key)
        except (TypeError, KeyError):  # a value that cannot key a cache, a missing argument: Triton's path
            if recorder is not None:
                recorder.launch(None, None, grid, ())
            return self.fn[grid](*args, **kwargs)
        if layout.order is not None:
            every = values + self._defaults
            values = [every[i] for i in layout.order]
        if entry is None:
            compiled = self.fn[grid](*args, **kwargs)  # binds, compiles or finds, launches
            if compiled is not None:
                if len(self._compiled) >= _CACHE_LIMIT:
                    self._compiled.clear()
                entry = self._compiled[key] = (compiled, _direct(compiled))
            if recorder is not None:
                recorder.launch(*(entry or (None, None)), grid, values)
            return compiled
        compiled, direct = entry
        if recorder is not None:
            recorder.launch(compiled, direct, grid, values)
        run(compiled, grid, values, device, direct)
        return compiled


@functools.cache
def _driver():
    import triton

    return triton.runtime.driver.active


@functools.cache
def _hooks():
    import triton

    return triton.knobs.runtime


def _live(hook):
    """The launch hook, or None where none is set: Triton's hooks are chains of callables (a
    ``HookChain``, whose ``calls`` is empty unless a profiler added one), and an empty chain passed on
    would cost a launch-metadata dict and two Python calls per launch."""
    if hook is None or getattr(hook, "calls", True):
        return hook
    return None


_DESC_CACHE_LIMIT = 512  # encoded descriptors per kernel; past it that cache starts afresh


class _Direct:
    """A compiled kernel's launch without Triton's Python launcher: the C launch function, the launch
    options, and the TMA descriptors' expansions kept by the facts they encode (module docstring)."""

    __slots__ = ("compiled", "raw", "annotated", "base", "tail", "slots", "make", "encoded")

    def __init__(self, compiled, raw, annotated: bool, slots: tuple, make):
        launcher = compiled.run
        self.compiled, self.raw, self.annotated, self.slots, self.make = compiled, raw, annotated, slots, make
        coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        # Triton 3.7: launch(grid, stream, function, coop, pdl, metadata, launch metadata, hooks, scratch x 2,
        # annotations, signature, [args]); 3.6: launch(grid, stream, function, coop, pdl, scratch x 2,
        # metadata, launch metadata, hooks, *args)
        self.base = (compiled.function, coop, pdl) if annotated else (compiled.function, coop, pdl, None, None)
        self.tail = (None, None, launcher.arg_annotations, launcher.kernel_signature) if annotated else ()
        self.encoded: dict = {}

    def expand(self, values) -> list:
        """The kernel's arguments as Triton's launcher hands them to the C launch function."""
        args = list(values)
        encoded = self.encoded
        for i, meta in self.slots:  # descending: each splice leaves the earlier positions in place
            d = args[i]
            key = (i, d.base.data_ptr(), tuple(d.shape), tuple(d.strides), d.padding,
                   getattr(d, "round_f32_to_tf32", False))
            expansion = encoded.get(key)
            if expansion is None:
                if len(encoded) >= _DESC_CACHE_LIMIT:
                    encoded.clear()
                expansion = encoded[key] = self.make(d, meta)
            args[i:i + 1] = expansion
        return args

    def __call__(self, g0, g1, g2, stream, meta, enter, leave, values) -> None:
        packed = self.compiled.packed_metadata
        args = self.expand(values) if self.slots else values
        if self.annotated:
            self.raw(g0, g1, g2, stream, *self.base, packed, meta, enter, leave, *self.tail, args)
        else:
            self.raw(g0, g1, g2, stream, *self.base, packed, meta, enter, leave, *args)

    def launch_expanded(self, g0, g1, g2, stream, args) -> None:
        """The launch with ``args`` already expanded (each descriptor spliced in as ``make`` encodes it),
        no launch hook set (a launch plan's replay, which keeps the expansions itself)."""
        packed = self.compiled.packed_metadata
        if self.annotated:
            self.raw(g0, g1, g2, stream, *self.base, packed, None, None, None, *self.tail, args)
        else:
            self.raw(g0, g1, g2, stream, *self.base, packed, None, None, None, *args)


def _direct(compiled):
    """``compiled``'s :class:`_Direct` launch, or None where its launcher is not one of the forms known."""
    launcher = getattr(compiled, "run", None)
    try:
        if type(launcher).__name__ != "CudaLauncher" or launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        from triton.backends.nvidia import driver as nvidia

        signature = list(compiled.src.signature.values())
        positions = [i for i, s in enumerate(signature) if isinstance(s, str) and s.startswith("tensordesc")]
        metas = getattr(compiled.metadata, "tensordesc_meta", None)
        wrapped = launcher.launch
        if positions:
            if not metas or len(metas) != len(positions) or not hasattr(nvidia, "make_tensordesc_arg"):
                return None  # descriptors decomposed to pointers, or an unknown wrapper
            cells = dict(zip(wrapped.__code__.co_freevars, wrapped.__closure__ or (), strict=False))
            if "launcher" not in cells:
                return None
            raw = cells["launcher"].cell_contents
        else:
            raw = wrapped
        annotated = hasattr(launcher, "arg_annotations") and hasattr(launcher, "kernel_signature")
        slots = tuple(sorted(zip(positions, metas, strict=True), key=lambda s: -s[0])) if positions else ()
        return _Direct(compiled, raw, annotated, slots, nvidia.make_tensordesc_arg)
    except (AttributeError, ImportError, TypeError, ValueError):
        return None


def current_device() -> int:
    """The current CUDA device's index, as Triton's driver reads it."""
    return _driver().get_current_device()


def current_stream(device: int) -> int:
    """``device``'s current stream handle, as Triton's driver reads it."""
    return _driver().get_current_stream(device)


def hooked() -> bool:
    """Whether a launch hook (a profiler's) is set."""
    return _live(_hooks().launch_enter_hook) is not None


def run(compiled, grid, values, device: int, direct=None) -> None:
    """Launch ``compiled`` on ``device``'s current stream with ``values`` in declaration order (pointer
    arguments may be addresses), through ``direct`` (its :class:`_Direct`) where given."""
    stream = _driver().get_current_stream(device)
    n = len(grid)
    g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
    hooks = _hooks()
    enter, leave = _live(hooks.launch_enter_hook), _live(hooks.launch_exit_hook)
    meta = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
    if direct is not None:
        direct(g0, g1, g2, stream, meta, enter, leave, values)
    else:
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *values)


_KERNELS: dict = {}  # id(fn) -> (fn, its Kernel): a JIT function's own hash is a Python call into Triton


def kernel(fn):
    """The launch layer's :class:`Kernel` for the JIT function ``fn`` (one per function, kept, and ``fn``
    with it, so that its id is not reused); ``fn`` itself where it is no compiled JIT function (Triton's
    interpreter makes every kernel one of its own)."""
    entry = _KERNELS.get(id(fn))
    if entry is None or entry[0] is not fn:
        from triton.runtime.jit import JITFunction

        entry = _KERNELS[id(fn)] = (fn, Kernel(fn) if isinstance(fn, JITFunction) else fn)
    return entry[1]


def cached_signatures(fn) -> int:
    """How many call signatures of ``fn`` the launch layer holds a compiled kernel for (a test aid)."""
    entry = _KERNELS.get(id(fn))
    return 0 if entry is None or entry[0] is not fn else len(entry[1]._compiled)


__all__ = [
    "DESCRIPTORS", "Kernel", "cached_signatures", "cdiv", "current_device", "hooked", "kernel", "next_power_of_2",
    "run",
]

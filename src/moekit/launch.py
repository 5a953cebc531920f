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

What is skipped on the fast path, and why that is safe: the globals check (moekit's kernels read only
module constants); the compile-cache lookup by string (the key above is finer); the pre-run hooks
(none are registered on moekit's kernels). Launch hooks (``triton.knobs.runtime.launch_enter_hook``,
set by profilers) are honoured. Under Triton's CPU interpreter, and with the ``fast_launch`` option
off, every call goes through Triton unchanged.
"""

from __future__ import annotations

import functools

import torch

from . import config

_OPTION_NAMES = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion",
                           "launch_cooperative_grid", "launch_pdl"})
_BY_VALUE = frozenset({int, bool, float, type(None)})  # keyed by (type, value): finer than Triton's facts
_CACHE_LIMIT = 4096  # signatures per kernel; past it the cache starts afresh (a run whose sizes never repeat)


def _tensor_fact(t: torch.Tensor):
    return t.dtype, t.data_ptr() & 15 == 0


def _desc_fact(d):
    return d.base.dtype, tuple(d.block_shape), getattr(d, "layout", None), d.padding


def _value(a):
    return a  # a tl.dtype passed positionally, a tuple: its value, which must hash


_FACTS = {torch.Tensor: _tensor_fact, torch.nn.Parameter: _tensor_fact}


def _register_descriptors() -> None:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor

        _FACTS[TensorDescriptor] = _desc_fact
    except ImportError:  # pragma: no cover - Triton without host descriptors
        pass
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

        _FACTS[GluonDescriptor] = _desc_fact
    except ImportError:  # pragma: no cover - Triton without Gluon
        pass


_register_descriptors()


def _facts(values, types) -> tuple:
    """The key part of each value: itself for scalars (with ``types`` beside it, so that 1, 1.0 and
    True stay apart), the specialization facts for tensors and descriptors."""
    return tuple([a if t in _BY_VALUE else _FACTS.get(t, _value)(a) for a, t in zip(values, types, strict=True)])


def _arg_key(a):
    """One argument's key, as ``Kernel`` builds it (a test aid)."""
    return type(a), _facts((a,), (type(a),))[0]


class Kernel:
    """A JIT function behind the launch layer: ``Kernel(fn)[grid](*args, **kwargs)``."""

    __slots__ = ("fn", "_names", "_defaults", "_compiled")

    def __init__(self, fn):
        self.fn = fn
        self._names = tuple(fn.arg_names)
        self._defaults = {p.name: p.default for p in fn.params if p.has_default}
        self._compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _key(self, args, kwargs, device: int):
        kw_values = tuple(kwargs.values())
        kw_types = tuple(map(type, kw_values))
        arg_types = tuple(map(type, args))
        return (_facts(args, arg_types), arg_types, tuple(kwargs), _facts(kw_values, kw_types), kw_types, device)

    def _launch(self, grid, args, kwargs):
        if not config.get_options().fast_launch:
            return self.fn[grid](*args, **kwargs)
        device = _driver().get_current_device()
        try:
            key = self._key(args, kwargs, device)
            compiled = self._compiled.get(key)
        except TypeError:  # an argument whose value cannot key a cache: Triton's own path
            return self.fn[grid](*args, **kwargs)
        if compiled is None:
            compiled = self.fn[grid](*args, **kwargs)  # binds, compiles or finds, launches
            if compiled is not None:
                if len(self._compiled) >= _CACHE_LIMIT:
                    self._compiled.clear()
                self._compiled[key] = compiled
            return compiled
        values = list(args)
        defaults = self._defaults
        for name in self._names[len(args):]:
            values.append(kwargs[name] if name in kwargs else defaults[name])
        _run(compiled, grid, values, device)
        return compiled


@functools.cache
def _driver():
    import triton

    return triton.runtime.driver.active


@functools.cache
def _hooks():
    import triton

    return triton.knobs.runtime


def _run(compiled, grid, values, device: int) -> None:
    stream = _driver().get_current_stream(device)
    n = len(grid)
    g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
    hooks = _hooks()
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
    meta = compiled.launch_metadata(grid, stream, *values) if enter is not None else None
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *values)


_KERNELS: dict = {}


def kernel(fn):
    """The launch layer's :class:`Kernel` for the JIT function ``fn`` (one per function, kept); ``fn``
    itself where it is no compiled JIT function (Triton's interpreter makes every kernel one of its
    own)."""
    k = _KERNELS.get(fn)
    if k is None:
        from triton.runtime.jit import JITFunction

        k = _KERNELS[fn] = Kernel(fn) if isinstance(fn, JITFunction) else fn
    return k


def cached_signatures(fn) -> int:
    """How many call signatures of ``fn`` the launch layer holds a compiled kernel for (a test aid)."""
    k = _KERNELS.get(fn)
    return 0 if k is None else len(k._compiled)


__all__ = ["Kernel", "cached_signatures", "kernel"]

"""Launch plans: a launcher's host decisions made once per call signature.

A launcher (``ragged_m``, ``grouped_mm_swiglu_fwd``, ``combine_fwd``, ...) decides its path, tile
config, grid, descriptors and arguments from its inputs' metadata, then allocates its outputs and
launches; below T ~ 4096 those decisions are most of an eager block step's host time (docs/design.md,
section 9). :func:`planned` wraps such a launcher:

- **Key.** Per call: moekit's options, the current device, and per argument its value, or for a tensor
  its shape, strides, dtype, device and address modulo 16 (the launch layer's specialization facts
  follow from these).
- **Record.** The first call of a key runs the launcher while ``config.empty`` and the launch layer
  report to a recorder: each allocation, and each launch (the compiled kernel, its grid and its
  arguments in declaration order). Every pointer among the launches' arguments (a tensor, or a TMA
  descriptor's base) and every output must then lie in the memory of one input tensor or one
  allocation, at an offset that the key fixes; no input or allocation may have been written by torch
  (its version counter moved), every launch must be one the launch layer launches directly, and there
  must be at least one. Otherwise the key is refused and always runs the launcher itself: a torch op
  among the launches, a tensor from elsewhere, Triton's own launch path all show up here.
- **Replay.** Later calls of the key allocate the same buffers, launch the recorded kernels with each
  pointer moved to this call's tensors (descriptors re-encoded only where their address is new: the
  launch layer's cache) and return the outputs as the same views. The kernels and their arguments are
  the recorded ones, so the bits are the launcher's.

Plans run with the ``plans`` and ``fast_launch`` options on, off Triton's interpreter and while no
launch hook (a profiler) is set; a launcher called while another one records runs itself, and the
outer recording sees its work. ``plans`` off runs every launcher as written.
"""

from __future__ import annotations

import functools
import threading

import torch

from . import config, launch
from .config import settings

_LIMIT = 1024  # plans per launcher; past it they start afresh (a run whose shapes never repeat)
_REFUSED = object()
_CONSTANTS: list = []  # (start, end) of the tensors that ``constant`` registered: alive for good


def constant(t: torch.Tensor) -> torch.Tensor:
    """Register ``t``, a tensor the caller keeps alive for the life of the process and never writes again
    (a cached tile of ones), as memory a plan may point at as it is; returns ``t``."""
    storage = t.untyped_storage()
    _CONSTANTS.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return t


class _Address:
    """A moved TMA descriptor's base: what the launch layer and Triton's encoder read of it."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _Recorder:
    """What a launcher allocates and launches on the recording thread."""

    def __init__(self):
        self.thread = threading.get_ident()
        self.allocs: list = []
        self.launches: list = []
        self.ok = True

    def alloc(self, t: torch.Tensor) -> None:
        if threading.get_ident() == self.thread:
            self.allocs.append((t, t._version))

    def launch(self, compiled, direct, grid, values) -> None:
        if threading.get_ident() != self.thread:
            return
        if direct is None:
            self.ok = False
        else:
            self.launches.append((compiled, direct, tuple(grid), list(values)))


def _fact(a):
    if isinstance(a, torch.Tensor):
        return a.shape, a.stride(), a.dtype, a.device, a.data_ptr() & 15
    return type(a), a


def _tensors(args, kwargs) -> list:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


class _Plan:
    __slots__ = ("allocs", "launches", "outputs")

    def __init__(self, allocs, launches, outputs):
        self.allocs, self.launches, self.outputs = allocs, launches, outputs

    def replay(self, args, kwargs):
        sources = _tensors(args, kwargs)
        sources += [config.empty(shape, dtype=dtype, device=device) for shape, dtype, device in self.allocs]
        ptrs = [t.data_ptr() for t in sources]
        device = launch.current_device()
        for compiled, direct, grid, template, pointers, descriptors in self.launches:
            values = list(template)
            for i, s, off in pointers:
                values[i] = ptrs[s] + off
            for i, s, off, desc in descriptors:
                moved = object.__new__(type(desc))
                moved.__dict__.update(desc.__dict__)
                moved.base = _Address(ptrs[s] + off)
                values[i] = moved
            launch.run(compiled, grid, values, device, direct)
        return _rebuild(self.outputs, sources)


def _rebuild(spec, sources):
    if spec is None:
        return None
    if spec[0] == "tuple":
        return tuple(_rebuild(s, sources) for s in spec[1])
    _, s, off, shape, stride = spec
    src = sources[s]
    if off == 0 and src.shape == shape and src.stride() == stride:
        return src
    return src.as_strided(shape, stride, src.storage_offset() + off // src.element_size())


def _resolve(ptr: int, spans: list, bases: list):
    """(source, offset from its data pointer) of the one source whose memory holds ``ptr``, or None."""
    for s, (lo, hi) in enumerate(spans):
        if lo <= ptr < hi:
            return s, ptr - bases[s]
    return None


def _spec(o, spans: list, bases: list, dtypes: list):
    """How to rebuild a recorded output (``_rebuild``), or False where it cannot be."""
    if o is None:
        return None
    if isinstance(o, tuple | list):
        parts = [_spec(x, spans, bases, dtypes) for x in o]
        return False if any(p is False for p in parts) else ("tuple", parts)
    if not isinstance(o, torch.Tensor) or o.numel() == 0:
        return False
    where = _resolve(o.data_ptr(), spans, bases)
    if where is None or o.dtype != dtypes[where[0]]:
        return False
    return ("tensor", *where, o.shape, o.stride())


def _record(rec: _Recorder, inputs: list, versions: list, out):
    """The plan of a recorded call, or None where it cannot be replayed (the module docstring). It keeps
    no tensor, and makes no reference cycle through one: a recorded call's tensors (autograd outputs among
    them, and through their graph the gradient accumulators made on the stream of that time) must go when
    their caller drops them, not at the next garbage collection."""
    if not rec.ok or not rec.launches or any(t._version != v for t, v in zip(inputs, versions, strict=True)):
        return None
    if any(t._version != v for t, v in rec.allocs):
        return None
    sources = inputs + [t for t, _ in rec.allocs]
    spans, bases, dtypes = [], [t.data_ptr() for t in sources], [t.dtype for t in sources]
    for t in sources:
        storage = t.untyped_storage()
        spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    del sources
    ordered = sorted(spans)
    if any(a[1] > b[0] and a[0] != a[1] for a, b in zip(ordered, ordered[1:], strict=False)):
        return None  # two sources share memory: a pointer would not say whose it is
    launches = []
    for compiled, direct, grid, values in rec.launches:
        pointers, descriptors = [], []
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor) or type(v) in launch.DESCRIPTORS:
                ptr = (v if isinstance(v, torch.Tensor) else v.base).data_ptr()
                where = _resolve(ptr, spans, bases)
                if where is None and any(lo <= ptr < hi for lo, hi in _CONSTANTS):
                    continue  # kept as it is
                if where is None:
                    return None
                if isinstance(v, torch.Tensor):
                    pointers.append((i, *where))
                else:
                    desc = object.__new__(type(v))
                    desc.__dict__.update(v.__dict__)
                    desc.base = None  # (the plan keeps no tensor alive)
                    descriptors.append((i, *where, desc))
                values[i] = None
        launches.append((compiled, direct, grid, tuple(values), tuple(pointers), tuple(descriptors)))
    outputs = _spec(out, spans, bases, dtypes)
    if outputs is False:
        return None
    allocs = [(t.shape, t.dtype, t.device) for t, _ in rec.allocs]
    return _Plan(allocs, launches, outputs)


def planned(fn):
    """Wrap the launcher ``fn`` with per-signature launch plans (the module docstring)."""
    plans: dict = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        opts = config.get_options()
        if not (opts.plans and opts.fast_launch) or settings.RECORDER is not None or config.is_interpreting():
            return fn(*args, **kwargs)
        if launch.hooked():
            return fn(*args, **kwargs)
        try:
            key = (opts, launch.current_device(), tuple(map(_fact, args)),
                   tuple((k, _fact(v)) for k, v in kwargs.items()))
            plan = plans.get(key)
        except TypeError:  # an argument that cannot key a plan
            return fn(*args, **kwargs)
        if plan is _REFUSED:
            return fn(*args, **kwargs)
        if plan is not None:
            return plan.replay(args, kwargs)
        inputs = _tensors(args, kwargs)
        versions = [t._version for t in inputs]
        rec = settings.RECORDER = _Recorder()
        try:
            out = fn(*args, **kwargs)
        finally:
            settings.RECORDER = None
        if len(plans) >= _LIMIT:
            plans.clear()
        plans[key] = _record(rec, inputs, versions, out) or _REFUSED
        return out

    call.plans = plans
    return call


def plan_counts(fn) -> tuple[int, int]:
    """(replayable, refused) signatures that the planned launcher ``fn`` holds (a test aid)."""
    held = list(fn.plans.values())
    return sum(p is not _REFUSED for p in held), sum(p is _REFUSED for p in held)


__all__ = ["constant", "plan_counts", "planned"]

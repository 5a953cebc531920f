"""Launch plans: a function's host decisions made once per call signature.

A launcher (``ragged_m``, ``combine_fwd``, ...) or a whole block step (``moekit.block``) decides its
path, tile configs, grids, descriptors and arguments from its inputs' metadata, then runs torch ops
and launches kernels; below T ~ 4096 those decisions are most of an eager block step's host time
(docs/design.md, section 9). :func:`planned` wraps such a function:

- **Key.** Per call: moekit's options, the current device, grad mode, inference mode and autocast
  (CUDA's, the CPU's), and per argument its value, or for a tensor its type, shape, strides, dtype,
  device, address modulo 16 and requires_grad (everything the launch layer and the launchers decide on
  follows from these: a planned function reads no tensor's values on the host).
- **Record.** The first call of a key runs the function as written (a signature that never comes back
  costs no recording); the second runs it under this thread's recorder, which sees every torch op below
  autograd (a ``TorchDispatchMode``: allocations, views, copies, GEMMs) and every launch of the launch
  layer (the compiled kernel, its grid and its arguments in declaration order). Each tensor an op or a
  launch takes must be an input, an earlier op's output, or memory registered with :func:`constant`;
  each output must be one of those. The call is refused (the key then always runs the function itself)
  where that fails, where a launch is one the launch layer cannot launch directly (Triton's own path),
  where an op's output shape or value depends on data (``nonzero``, ``item``) or copies to the host,
  where an op runs under another grad mode than the call, where an output requires grad (autograd
  recorded above the ops) or is a ``detach``, where two inputs overlap, or where nothing was launched.
  Where another thread launched during the recording (which it may have missed), the key records again
  on its next call.
- **Replay.** Later calls of the key run the recorded ops on this call's tensors and launch the
  recorded kernels with each pointer moved (each TMA descriptor encoded once per address it meets, the
  plan keeping its encodings by address: the rest of what it encodes is the recording's; one over
  constant memory encoded when the plan is made), and return the outputs. The ops and the kernels are
  the recorded ones on the same values, so the bits are the function's (the common ops through torch's
  public bindings, allocations as ``torch.empty_strided``: an op overload's generic call costs more
  host). A view that only kernels read is not rebuilt, a view that undoes one (``t.mT.mT``) is the tensor
  it views, small kernel-only scratch comes from one allocation, and every other intermediate is dropped
  after its last use, where the function dropped it.

Plans run with the ``plans`` and ``fast_launch`` options on, off Triton's interpreter, while no launch
hook (a profiler), dispatch mode or function mode is set, and never in a recording: a planned function
called while another one records runs itself, and the outer recording sees its work. A recording holds
its tensors weakly and keeps none once it is done (the plan holds only registered constants).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import config, launch
from .config import settings

_LIMIT = 1024  # plans per function; past it they start afresh (a run whose shapes never repeat)
_REFUSED, _RETRY = object(), object()
_CONSTANTS: list = []  # (start, end) of the tensors that ``constant`` registered: alive for good
_UNREPLAYABLE = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_OP, _LAUNCH = 0, 1
_DETACH, _EMPTY = torch.ops.aten.detach.default, torch.ops.aten.empty.memory_format
_ALLOCS = (_EMPTY, torch.ops.aten.empty_strided.default)  # replayed as torch.empty_strided: an OpOverload's
# generic call parses its arguments by schema, 3-5x the host time of the public binding (a CPU: 12-15 us
# against 3)
_ARENA = -1  # a pointer into the replay's one allocation for kernel-only scratch
_ARENA_SLICE_MAX = 1 << 20  # bytes: larger kernel-only allocations keep their own (freed as they were)
_ARENA_ALIGN = 512  # bytes, as the caching allocator aligns
_ENCODED_LIMIT = 64  # a replayed descriptor's encodings kept, by address; past it they start afresh
_aten = torch.ops.aten
_VIEWS = {_aten.t.default, _aten.transpose.int, _aten.permute.default, _aten.view.default, _aten.select.int,
          _aten.slice.Tensor, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.expand.default, _aten.alias.default}
# ops a replay calls through torch's public bindings, whose parameters are the schema's in its order (the
# recorded positional arguments fit them as they are): the op overload's generic call parses its arguments by
# schema, 5-25 us a call more on an H200 host (softmax's backward 50 us there)
_PUBLIC = {_aten._softmax.default: torch._softmax, _aten._softmax_backward_data.default: torch._softmax_backward_data,
           _aten.add.Tensor: torch.add, _aten.mul.Tensor: torch.mul, _aten.sigmoid.default: torch.sigmoid,
           _aten.transpose.int: torch.transpose, _aten.t.default: torch.t, _aten.sum.dim_IntList: torch.sum,
           _aten.mm.default: torch.mm}


def constant(t: torch.Tensor) -> torch.Tensor:
    """Register ``t``, a tensor the caller keeps alive for the life of the process and never writes again
    (a cached tile of ones), as memory a plan may point at as it is; returns ``t``."""
    storage = t.untyped_storage()
    _CONSTANTS.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return t


def _is_constant(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    lo = storage.data_ptr()
    return any(a <= lo and lo + storage.nbytes() <= b for a, b in _CONSTANTS)


class _Address:
    """A moved TMA descriptor's base: what the launch layer and Triton's encoder read of it."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes that t's elements span."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) if t.numel() else -1
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


class _Recorder(TorchDispatchMode):
    """A recording on one thread (the module docstring): ``steps`` in order, each a torch op with its
    tensor arguments as source indices, or a launch with its pointers as (source, byte offset); the
    sources are the inputs, then each op's outputs."""

    moekit_recorder = True  # (moekit.dispatch treats this mode as absent: custom ops stay direct calls)

    def __init__(self, inputs: list):
        super().__init__()
        self.grad = torch.is_grad_enabled()
        self.sources = [weakref.ref(t) for t in inputs]  # (weak: a tensor goes when the function drops it)
        self.n_inputs = len(inputs)
        self.index, self.refs, self.views, self.detached = {}, {}, {}, set()
        for i in reversed(range(len(inputs))):
            self._source(inputs[i], i)
        self.steps: list = []
        self.alias: dict = {}  # source -> (source it views, byte offset): a view op's output
        self.empties: dict = {}  # source -> its bytes: an uninitialized CUDA allocation
        self.launched = False
        self.ok = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.ok:
            return out
        if func is _DETACH and not (torch.is_grad_enabled() and args[0].requires_grad):
            s = self._slot(args[0])  # (what torch's factory functions add under a mode: no op to replay)
            if s is False:
                self.ok = False
            elif s is not None:
                self._source(out, s)
                self.detached.add(id(out))  # (not an output: a replay would hand back the tensor itself)
            return out
        self.ok = self._op(func, args, kwargs, out)
        return out

    def _source(self, t: torch.Tensor, s: int) -> None:
        self.index[id(t)] = s
        self.refs[id(t)] = weakref.ref(t)
        self.views[(t.data_ptr(), t.shape, t.stride(), t.dtype)] = s

    def _slot(self, t):
        """t's source index (itself, or the same view of the same live memory), None for registered constant
        memory (kept as it is), False for neither."""
        s = self.index.get(id(t))
        if s is not None and self.refs[id(t)]() is t:
            return s
        s = self.views.get((t.data_ptr(), t.shape, t.stride(), t.dtype))
        if s is not None and self.sources[s]() is not None:
            return s
        return None if _is_constant(t) else False

    def _holes(self, values):
        """(``values`` as a list with each tensor that has a source replaced by None, [(position, source)]), or
        None where a tensor has none (registered constant memory stays in place)."""
        out, holes = list(values), []
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                s = self._slot(v)
                if s is False:
                    return None
                if s is not None:
                    holes.append((i, s))
                    out[i] = None
        return out, holes

    def _op(self, func, args, kwargs, out) -> bool:
        if any(tag in func.tags for tag in _UNREPLAYABLE) or torch.is_grad_enabled() != self.grad:
            return False  # (data read on the host; an op under another grad mode than the call's)
        got = self._holes(args)
        if got is None:
            return False
        template, top = got
        slots = [(i, -1, s) for i, s in top]
        for i, a in enumerate(args):
            if isinstance(a, list | tuple) and any(isinstance(b, torch.Tensor) for b in a):
                got = self._holes(a)
                if got is None:
                    return False
                template[i] = got[0]
                slots += [(i, j, s) for j, s in got[1]]
        keys = list(kwargs)
        got = self._holes([kwargs[k] for k in keys])
        if got is None:
            return False
        kw_template = dict(zip(keys, got[0], strict=True))
        kw_slots = [(keys[j], s) for j, s in got[1]]
        many = isinstance(out, list | tuple)
        outs = out if many else (out,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            return False
        if any(o.device.type == "cpu" for o in outs) and any(
                isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in (*args, *kwargs.values())):
            return False  # a copy to the host: its values could steer the function
        if func in _VIEWS and slots and slots[0][:2] == (0, -1) and not many:
            same = self._same_view(slots[0][2], out)
            if same is not None:  # (a view that undoes a view, ``t.mT.mT``: no step, the earlier source itself)
                self._source(out, same)
                return True
        nested = tuple(sorted({i for i, j, _ in slots if j >= 0}))
        first = len(self.sources)
        if func in _ALLOCS and not kwargs.get("pin_memory") and out.layout == torch.strided:  # (no tensor args)
            self.steps.append((_OP, torch.empty_strided, (tuple(out.shape), out.stride()),
                               {"dtype": out.dtype, "device": out.device}, (), (), (), False, first, func, 1))
        else:
            self.steps.append((_OP, _PUBLIC.get(func, func._op), tuple(template), kw_template, tuple(slots), nested,
                               tuple(kw_slots), many, first, func, len(outs)))
        for o in outs:
            self._source(o, len(self.sources))
            self.sources.append(weakref.ref(o))
        if func in _VIEWS and slots and slots[0][:2] == (0, -1) and not many and _same_memory(args[0], out):
            self.alias[first] = (slots[0][2], out.data_ptr() - args[0].data_ptr())
        elif func is _EMPTY and out.is_cuda and not kwargs.get("pin_memory") and out.untyped_storage().nbytes():
            self.empties[first] = out.untyped_storage().nbytes()
        return True

    def _same_view(self, s: int, out: torch.Tensor):
        """The source, among s and the sources s views (not an input), that is ``out``'s view of the same memory
        (address, shape, strides, dtype), or None."""
        while True:
            t = self.sources[s]()
            if (s >= self.n_inputs and t is not None and t.data_ptr() == out.data_ptr() and t.shape == out.shape
                    and t.stride() == out.stride() and t.dtype == out.dtype and _same_memory(t, out)):
                return s
            if s not in self.alias:
                return None
            s = self.alias[s][0]

    def _where(self, t):
        """(source, byte offset from its data pointer) of tensor t's memory; None for constant memory; False
        where it is neither."""
        s = self._slot(t)
        if s is not False:
            return None if s is None else (s, 0)
        ptr = t.data_ptr()
        for s, ref in enumerate(self.sources):
            src = ref()
            if src is None:
                continue
            lo, hi = _extent(src)
            if lo <= ptr < hi or ptr == lo:
                return s, ptr - lo
        return None if _is_constant(t) else False

    def launch(self, compiled, direct, grid, values) -> None:
        """The launch layer's report of a launch (``direct`` None: one it cannot launch directly)."""
        if not self.ok:
            return
        if direct is None:
            self.ok = False
            return
        template, pointers, descriptors = list(values), [], []
        for i, v in enumerate(values):
            is_desc = type(v) in launch.DESCRIPTORS
            if not (is_desc or isinstance(v, torch.Tensor)):
                continue
            where = self._where(v.base if is_desc else v)
            if where is False:
                self.ok = False
                return
            if where is None:
                continue  # constant memory: kept as it is
            if is_desc:
                desc = object.__new__(type(v))
                desc.__dict__.update(v.__dict__)
                desc.base = None  # (the plan keeps no tensor alive)
                descriptors.append((i, *where, desc))
            else:
                pointers.append((i, *where))
            template[i] = None
        self.launched = True
        self.steps.append((_LAUNCH, compiled, direct, tuple(grid), tuple(template), tuple(pointers),
                           tuple(descriptors)))

    def plan(self, n_inputs: int, out):
        """The recorded call's plan, or None where it cannot be replayed."""
        if not (self.ok and self.launched):
            return None
        spans = sorted(_extent(t) for t in (ref() for ref in self.sources[:n_inputs]) if t.numel())
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:], strict=False)):
            return None  # two inputs share memory: a pointer would not say whose it is
        outputs = self._output(out, n_inputs)
        if outputs is False:
            return None
        return _lean(self.steps, len(self.sources), n_inputs, self.alias, self.empties, outputs)

    def _output(self, o, n_inputs: int):
        if o is None:
            return None
        if isinstance(o, tuple | list):
            parts = [self._output(x, n_inputs) for x in o]
            return False if any(p is False for p in parts) else tuple(parts)
        if not isinstance(o, torch.Tensor) or id(o) in self.detached:
            return False
        s = self._slot(o)
        if s is None or s is False or (s >= n_inputs and o.requires_grad):
            return False  # (an output from elsewhere, or an autograd graph that a replay would not build)
        return s


def _flat(spec) -> list:
    if spec is None:
        return []
    if isinstance(spec, tuple):
        return [s for part in spec for s in _flat(part)]
    return [spec]


def _lean(steps: list, n_sources: int, n_inputs: int, alias: dict, empties: dict, outputs) -> _Plan:
    """The recorded steps with what a replay need not run taken out: a view op whose output only
    kernels read (they get its address: the viewed source's plus a fixed offset), and a small
    allocation that only kernels use (a slice of one allocation per replay, ``_ARENA_SLICE_MAX``). Each
    step carries the sources a replay drops after it (their last use), so memory goes when it went in
    the function."""
    needed = set(_flat(outputs))
    kept = []
    for step in reversed(steps):
        if step[0] == _OP:
            first = step[8]
            if first in alias and first not in needed:
                continue
            if first in empties and first not in needed and empties[first] <= _ARENA_SLICE_MAX:
                continue
            needed.update(s for _, _, s in step[4])
            needed.update(s for _, s in step[6])
        kept.append(step)
    kept.reverse()
    arena, size = {}, 0
    for s, nbytes in empties.items():
        if s not in needed and nbytes <= _ARENA_SLICE_MAX:
            arena[s] = size
            size += -(-nbytes // _ARENA_ALIGN) * _ARENA_ALIGN

    def where(s, off):  # (source or _ARENA, offset) that a replay holds
        while s in alias and s not in needed:
            s, extra = alias[s]
            off += extra
        if s in arena:
            return _ARENA, arena[s] + off
        return s, off

    lean, last = [], {}
    for k, step in enumerate(kept):
        if step[0] == _LAUNCH:
            _, compiled, direct, grid, template, pointers, descriptors = step
            template, at = _expand_constants(direct, template, {d[0] for d in descriptors})
            pointers = tuple((at(i), *where(s, off)) for i, s, off in pointers)
            metas = dict(direct.slots) if descriptors else {}
            # (descending positions: each splice of an expansion leaves the earlier ones in place; per
            # descriptor its encodings by address, the rest of what they encode being the recording's)
            descriptors = tuple((at(i), *where(s, off), desc, metas[i], {})
                                for i, s, off, desc in sorted(descriptors, key=lambda d: -d[0]))
            step = (_LAUNCH, direct, (*grid, 1, 1)[:3], template, pointers, descriptors)
            used = [s for _, s, _ in pointers] + [d[1] for d in descriptors]
        else:
            used = [s for _, _, s in step[4]] + [s for _, s in step[6]]
            used += range(step[8], step[8] + step[10])
        for s in used:
            last[s] = k
        lean.append(step)
    keep = set(_flat(outputs)) | set(range(n_inputs)) | {_ARENA}
    drops: dict = {}
    for s, k in last.items():
        if s not in keep:
            drops.setdefault(k, []).append(s)
    lean = [(*step, tuple(drops.get(k, ()))) for k, step in enumerate(lean)]
    return _Plan(lean, n_sources, n_inputs, size, outputs)


def _expand_constants(direct, template: tuple, moving: set):
    """(template with its descriptors over constant memory expanded once, as the launch encodes them,
    and the map from a position in ``template`` to its position in the result)."""
    fixed = sorted((i for i, _ in direct.slots if i not in moving), reverse=True) if direct.slots else []
    if not fixed:
        return template, lambda i: i
    metas, values = dict(direct.slots), list(template)
    grown = []  # (position, extra arguments its expansion adds)
    for i in fixed:
        expansion = direct.make(values[i], metas[i])
        values[i:i + 1] = expansion
        grown.append((i, len(expansion) - 1))
    return tuple(values), lambda i: i + sum(extra for j, extra in grown if j < i)


class _Plan:
    __slots__ = ("steps", "n_sources", "n_inputs", "arena", "outputs")

    def __init__(self, steps, n_sources, n_inputs, arena, outputs):
        self.steps, self.n_sources, self.n_inputs, self.arena, self.outputs = (steps, n_sources, n_inputs, arena,
                                                                              outputs)

    def replay(self, args, kwargs):
        src = _tensors(args, kwargs)
        src += [None] * (self.n_sources - self.n_inputs)
        device = launch.current_device()
        stream = launch.current_stream(device)
        arena = base = None
        if self.arena:  # (freed on return: stream-ordered, as the kernels that use it)
            arena = torch.empty(self.arena, dtype=torch.uint8, device=torch.device("cuda", device))
            base = arena.data_ptr()
        for step in self.steps:
            if step[0] == _OP:
                _, op, template, kw, slots, nested, kw_slots, many, first, _, _, drops = step
                a = list(template)
                for i in nested:
                    a[i] = list(a[i])
                for i, j, s in slots:
                    if j < 0:
                        a[i] = src[s]
                    else:
                        a[i][j] = src[s]
                if kw_slots:
                    kw = dict(kw)
                    for k, s in kw_slots:
                        kw[k] = src[s]
                out = op(*a, **kw)
                if many:
                    src[first:first + len(out)] = out
                else:
                    src[first] = out
            else:
                _, direct, grid, template, pointers, descriptors, drops = step
                values = list(template)
                for i, s, off in pointers:
                    values[i] = (base if s == _ARENA else src[s].data_ptr()) + off
                for i, s, off, desc, meta, encoded in descriptors:
                    address = (base if s == _ARENA else src[s].data_ptr()) + off
                    expansion = encoded.get(address)
                    if expansion is None:  # (a new address: the descriptor moved there, encoded once)
                        moved = object.__new__(type(desc))
                        moved.__dict__.update(desc.__dict__)
                        moved.base = _Address(address)
                        if len(encoded) >= _ENCODED_LIMIT:
                            encoded.clear()
                        expansion = encoded[address] = direct.make(moved, meta)
                    values[i:i + 1] = expansion
                direct.launch_expanded(*grid, stream, values)
            for s in drops:  # (a source's last use: freed where the function freed it, stream-ordered)
                src[s] = None
        del arena
        return _rebuild(self.outputs, src)


def _rebuild(spec, src):
    if spec is None:
        return None
    if isinstance(spec, tuple):
        return tuple(_rebuild(s, src) for s in spec)
    return src[spec]


def _fact(a):
    if isinstance(a, torch.Tensor):
        return type(a), a.shape, a.stride(), a.dtype, a.device, a.data_ptr() & 15, a.requires_grad
    return type(a), a


def _autocast():
    """CUDA's and the CPU's autocast state (dtypes where on), or None where both are off."""
    cuda, cpu = torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu")
    if not (cuda or cpu):
        return None
    return (cuda and torch.get_autocast_dtype("cuda"), cpu and torch.get_autocast_dtype("cpu"))


def _tensors(args, kwargs) -> list:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _record(fn, args, kwargs):
    """(fn's output, its plan, None where it cannot be replayed, or ``_RETRY`` where a launch on another
    thread fell within the recording, which it may have missed): fn run under this thread's recorder, which
    nothing keeps once this returns."""
    inputs = _tensors(args, kwargs)
    rec = _Recorder(inputs)
    foreign = settings.FOREIGN
    settings.set_recorder(rec)
    try:
        with rec:
            out = fn(*args, **kwargs)
    finally:
        settings.set_recorder(None)
    plan = _RETRY if settings.FOREIGN != foreign else rec.plan(len(inputs), out)
    for held in (rec.sources, rec.index, rec.refs, rec.views, rec.detached, rec.steps):
        held.clear()
    return out, plan


def planned(fn):
    """Wrap ``fn`` (tensors and hashable values in, tensors, None and tuples of them out; no tensor values
    read on the host) with per-signature launch plans (the module docstring)."""
    plans: dict = {}
    seen: set = set()  # signatures run once, recorded when they come back

    @functools.wraps(fn)
    def call(*args, **kwargs):
        opts = config.get_options()
        if not (opts.plans and opts.fast_launch) or settings.recorder() is not None or config.is_interpreting():
            return fn(*args, **kwargs)
        if launch.hooked() or torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
            return fn(*args, **kwargs)
        try:
            key = (opts, launch.current_device(), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                   _autocast(), tuple(map(_fact, args)), tuple((k, _fact(v)) for k, v in kwargs.items()))
            plan = plans.get(key)
        except TypeError:  # an argument that cannot key a plan
            return fn(*args, **kwargs)
        if plan is not None:
            if plan is _REFUSED:
                return fn(*args, **kwargs)
            if key[4]:  # the recorded ops are autocast's casts and their results: no second pass through it
                with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
                    return plan.replay(args, kwargs)
            return plan.replay(args, kwargs)
        if key not in seen:  # first seen: run as written (a signature that never comes back costs no recording)
            if len(seen) >= _LIMIT:
                seen.clear()
            seen.add(key)
            return fn(*args, **kwargs)
        out, plan = _record(fn, args, kwargs)
        if plan is not _RETRY:
            seen.discard(key)
            if len(plans) >= _LIMIT:
                plans.clear()
            plans[key] = plan or _REFUSED
        return out

    call.plans, call.seen = plans, seen
    return call


def plan_counts(fn) -> tuple[int, int]:
    """(replayable, refused) signatures that the planned function ``fn`` holds (a test aid)."""
    held = list(fn.plans.values())
    return sum(p is not _REFUSED for p in held), sum(p is _REFUSED for p in held)


__all__ = ["constant", "plan_counts", "planned"]

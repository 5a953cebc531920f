"""moekit's runtime options: :class:`Options`, read from the environment once at import, changed with
:func:`set_options` or the :func:`options` context manager; and the allocator of kernel outputs, which
poisons them under the ``poison`` option."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Options:
    """moekit's runtime options. Each field's default comes from the environment variable named beside
    it, read once, when moekit is imported (``1``/``0``; a count for ``sm_margin``); :func:`set_options`
    and :func:`options` change them afterwards. Ops read the options when they run, and under
    ``torch.compile`` when they are traced, so set them before compiling.

    - ``reference`` (``MOEKIT_REFERENCE``, off): every op runs its pure-PyTorch ``*_ref`` twin, on any
      device.
    - ``debug`` (``MOEKIT_DEBUG``, off): ``grouped_mm`` checks that ``offs`` is non-decreasing and in
      bounds on every call, as ``validate=True`` does (a device sync per call).
    - ``tma`` (``MOEKIT_TMA``, on): TMA descriptors on Hopper and newer; off forces the pointer path.
    - ``warp_specialized`` (``MOEKIT_WARP_SPECIALIZED``, on): the warp-specialized Gluon kernels on
      sm_90; off runs the Triton kernels there too.
    - ``save_h`` (``MOEKIT_SAVE_H``, off): the fused down-projection saves h for its weight gradient;
      off (the default) recomputes h from aux in the SwiGLU backward pass: R x F bf16 less saved
      memory (as little as SonicMoE saves) for 0-4% of a block step (docs/design.md).
    - ``fused_dswiglu`` (``MOEKIT_FUSED_DSWIGLU``, off): the down-projection's dgrad computes the
      SwiGLU backward in an epilogue partition on sm_90, overlapping the next tile's main loop (d_aux
      and h bit-equal to the default). Off because it does not pay on the H100: 0.84-0.87x the dgrad
      plus the pass at K = 4096 (mixtral; qwen3-235b with (E, F, D) weights, a layout the block does
      not use), 0.99-1.17x elsewhere, and no block step faster, as its streams cost the GEMM its L2
      reuse (docs/design.md, section 5.6).
    - ``sm_margin`` (``MOEKIT_SM_MARGIN``, 0): SMs the persistent GEMMs leave free (they launch one
      program per SM minus this many). Under expert parallelism with overlap the all-to-all's NCCL
      kernel (32 CTAs on two H200s) runs beside the GEMMs, and a persistent GEMM that finds SMs taken
      waits for them (its tiles are assigned statically). Margins of 16 and 32 SMs did not pay on
      two or four H200s (docs/design.md, section 15).
    - ``gluon_quantize`` (``MOEKIT_GLUON_QUANTIZE``, on): NVFP4 quantization with 1x16 blocks rounded to
      nearest, and the standalone SwiGLU -> NVFP4 pass, run the Gluon kernels on Hopper and newer (each
      thread holds whole blocks); off, the Triton kernels. The bits are the same (docs/design.md,
      section 14).
    - ``nvfp4_ptx_decode`` (``MOEKIT_NVFP4_PTX_DECODE``, on): the emulated NVFP4 grouped GEMM decodes
      its operands with inline PTX byte tables into f16 on sm_89 and newer; off, the decode written in
      Triton ops into bf16. The products are exact either way (docs/design.md, section 14).
    - ``fast_launch`` (``MOEKIT_FAST_LAUNCH``, on): kernels launch through ``moekit.launch``, which keeps
      each compiled kernel under its call's specialization facts and launches it directly on later
      calls, skipping Triton's per-call binding (tens of microseconds of host time per GEMM launch); off,
      every launch goes through Triton's ``fn[grid](...)``. The kernels and their bits are the same.
    - ``fused_block`` (``MOEKIT_FUSED_BLOCK``, on): a :class:`moekit.MoE` step (plain tensors, no hooks on
      its experts, no aux loss, not NVFP4 or FP8) runs as one autograd node, whose forward and backward
      call the ops' launchers directly, or under ``torch.compile`` as two custom ops that do
      (``moekit.block``); off, it composes the public ops, one node each. The kernels and their bits are
      the same; the fused step spends less host time.
    - ``plans`` (``MOEKIT_PLANS``, on, with ``fast_launch``): the fused block step's forward and backward,
      and the launchers of the block's kernels, keep a launch plan per call signature (``moekit.plans``):
      later calls run the recorded torch ops and launch the recorded kernels with their pointers moved,
      deciding nothing again. The kernels and their bits are the same.
    - ``poison`` (no variable; a test aid): every kernel output starts as NaN (-1 for integers), so an
      unwritten element shows.
    """

    reference: bool = False
    debug: bool = False
    tma: bool = True
    warp_specialized: bool = True
    save_h: bool = False
    fused_dswiglu: bool = False
    sm_margin: int = 0
    gluon_quantize: bool = True
    nvfp4_ptx_decode: bool = True
    fast_launch: bool = True
    fused_block: bool = True
    plans: bool = True
    poison: bool = False


_ENV = {f.name: f"MOEKIT_{f.name.upper()}" for f in dataclasses.fields(Options) if f.name != "poison"}
_COUNTS = {"sm_margin"}  # int options; the rest are switches


def _from_env() -> Options:
    values = {}
    for name, var in _ENV.items():
        raw = os.environ.get(var)
        if raw is None:
            continue
        if name in _COUNTS:
            if not raw.isdigit():
                raise ValueError(f"moekit: {var} must be a count >= 0, got {raw!r}")
            values[name] = int(raw)
            continue
        if raw not in ("0", "1"):
            raise ValueError(f"moekit: {var} must be 0 or 1, got {raw!r}")
        values[name] = raw == "1"
    return Options(**values)


_options = _from_env()


def get_options() -> Options:
    """The options in force (see :class:`Options`)."""
    return _options


def set_options(**changes) -> Options:
    """Change options by name (``set_options(save_h=False)``); returns the previous :class:`Options`."""
    global _options
    unknown = set(changes) - {f.name for f in dataclasses.fields(Options)}
    if unknown:
        raise TypeError(f"moekit.set_options: unknown option(s) {sorted(unknown)}; see moekit.Options")
    values = {}
    for k, v in changes.items():
        if k in _COUNTS:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"moekit.set_options: {k} must be an int >= 0, got {v!r}")
            values[k] = v
        else:
            values[k] = bool(v)
    previous = _options
    _options = dataclasses.replace(_options, **values)
    return previous


@contextlib.contextmanager
def options(**changes):
    """Context manager: ``with moekit.options(warp_specialized=False): ...`` sets options for the block
    and restores the previous ones on exit."""
    global _options
    previous = set_options(**changes)
    try:
        yield _options
    finally:
        _options = previous


_RECORDING = threading.local()  # moekit.plans' recording in progress on this thread, as ``recorder``
ACTIVE = 0  # recordings in progress, on every thread
FOREIGN = 0  # launches made on a thread that was not recording while a recording was in progress


def recorder():
    """``moekit.plans``' recording in progress on this thread (the launch layer reports its launches to it),
    or None."""
    return getattr(_RECORDING, "recorder", None)


def set_recorder(rec) -> None:
    """Make ``rec`` (or None) this thread's recording, counted in ``ACTIVE``."""
    global ACTIVE
    ACTIVE += (rec is not None) - (recorder() is not None)
    _RECORDING.recorder = rec


def note_launch() -> None:
    """The launch layer's note of a launch that no recording on its thread sees."""
    global FOREIGN
    if ACTIVE:
        FOREIGN += 1


def empty(shape, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output (poisoned under the ``poison`` option: NaN, or -1 for integer outputs)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if _options.poison:
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out


def fused_dswiglu() -> bool:
    """Whether the down-projection's dgrad computes d_aux in an epilogue partition (the
    ``fused_dswiglu`` option) instead of a plain dgrad followed by the SwiGLU backward pass. Off by
    default: it does not pay on the H100 (docs/design.md, section 5.6)."""
    return _options.fused_dswiglu


def save_h() -> bool:
    """Whether the fused down-projection saves h for its weight gradient (the ``save_h`` option, off by
    default) instead of recomputing it from aux in the backward. Saving h keeps 0.5 GiB more per
    gpt-oss-20b layer alive and spares the SwiGLU backward pass h's recompute and store."""
    return _options.save_h

"""SwiGLU fused with NVFP4 quantization of its output: h = SwiGLU(pre) written as (values, scales).

Dimension legend: M rows (routed rows R in an MoE), F the expert hidden dim (h's width, pre is 2F),
D the model dim, E experts.

What the quantizer sees. The unfused path stores h in the activation dtype (``moekit.swiglu`` or
``grouped_mm_swiglu`` return bf16) and then quantizes it (``nvfp4.quantize``). The fused ops do the
same in registers: h is computed in fp32 by the package's SwiGLU device function, rounded to the
activation dtype, and quantized with ``nvfp4_quantize_tile`` (the bits of ``nvfp4.quantize_ref``). So

- fused == ``nvfp4.quantize(moekit.swiglu(pre), g)`` bit for bit, on every device;
- fused == the pure-PyTorch ``*_ref`` bit for bit wherever the fp32 SwiGLU of torch and of the
  kernel round to the same bf16 h. They can differ by an ulp of fp32 (``torch.sigmoid`` against
  Triton's ``exp``; on NVIDIA GPUs ``exp`` is approximate), which changes a bf16 h, and then maybe its
  block's scale, for a small fraction of elements; the interpreter tests see none on their inputs.

Gate/up layouts (``gate_up_layout``): ``"interleaved"`` (gate, up = pre[:, 0::2], pre[:, 1::2]),
``"halves"`` ([gate | up]) and ``"interleaved8"`` (gate 0-7, up 0-7, gate 8-15, ...:
``nvfp4.interleave8_ref``, so a 16-column block of a GEMM's output tile holds 8 gate and 8 up).

Public ops (forward only: NVFP4 h feeds a down-projection that is not differentiated through it),
each with its ``*_ref`` twin; on CUDA (and under ``TRITON_INTERPRET=1``) they run the kernels of
``_kernels/nvfp4_swiglu.py`` with no host sync, CUDA-graph safe (the global scale is a device tensor).
On Hopper the standalone pass runs ``_kernels/nvfp4_gluon.py`` (the ``gluon_quantize`` option), and
the up-projection with interleaved bf16 columns runs the warp-specialized kernel with the
``SWIGLU_NVFP4`` epilogue (``_kernels/hopper_gemm.py``, the ``warp_specialized`` option):
- ``swiglu_quantize_nvfp4(pre, global_scale, ...)``: a standalone (M, 2F) pre-activation;
- ``grouped_mm_swiglu_nvfp4(x, w_up, offs, global_scale, ...)``: the up-projection GEMM with the
  SwiGLU -> NVFP4 epilogue.
"""

from __future__ import annotations

import torch

from .. import config, launch
from .._kernels.nvfp4_swiglu import _grouped_mm_swiglu_nvfp4_kernel, _swiglu_quantize_kernel
from ..descriptors import descriptor, weight_descriptor
from ..dispatch import traced_or_eager
from ..epilogue import SwiGLU, swiglu_torch
from ..experts import TL_DTYPES, check_expert_inputs, tma_views_ok
from ..hopper import ws_swiglu_nvfp4, ws_swiglu_nvfp4_ok
from ..reference import grouped_mm_swiglu_ref
from .formats import BLOCK, deinterleave8_ref, describe, device_scale, quantize_ref

LAYOUTS = ("interleaved", "halves", "interleaved8")
# The Gluon SwiGLU -> NVFP4 kernel's tile (rows, 16-element blocks of h per row, warps) and its
# persistent programs per SM (a sweep on an H100, docs/design.md): for a
# bf16 pre-activation, whose h the kernel quantizes as 32-bit words, and for fp16 / fp32 (element by
# element, the fastest tile of that path)
SWIGLU_QUANTIZE_TILE = {True: (128, 8, 16), False: (64, 8, 16)}
SWIGLU_QUANTIZE_PROGRAMS_PER_SM = {True: 2, False: 3}
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# --------------------------------------------------------------------------------------------------
# input checks, shared by the references and the kernels' public functions (the same errors from both)
# --------------------------------------------------------------------------------------------------


def _check_spec(alpha, limit, linear_offset, layout, name: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{name}: gate_up_layout must be one of {LAYOUTS}, got {layout!r}")
    SwiGLU(alpha, limit, linear_offset, "halves")  # its own checks (limit > 0 or None)


def _check_global_scale(g, t: torch.Tensor, name: str) -> None:
    if not isinstance(g, torch.Tensor) or not g.is_floating_point():
        raise TypeError(f"{name}: global_scale must be a floating-point tensor, got {describe(g)}")
    if g.dim() != 0:
        raise ValueError(f"{name}: global_scale must be a 0-dim tensor, got shape {tuple(g.shape)}")
    if g.device != t.device:
        raise ValueError(f"{name}: global_scale is on {g.device} but the input is on {t.device}")


def _check_pre(pre, name: str) -> None:
    if not isinstance(pre, torch.Tensor) or pre.dtype not in IN_DTYPES:
        raise TypeError(f"{name}: pre must be a bfloat16, float16 or float32 tensor, got {describe(pre)}")
    if pre.dim() != 2 or pre.shape[1] % (2 * BLOCK) or (pre.numel() and pre.stride(1) != 1):
        raise ValueError(f"{name}: pre must be (M, 2F) with F a multiple of {BLOCK} and unit column stride, "
                         f"got shape {tuple(pre.shape)} strides {pre.stride()}")


def _check_gemm(x, w_up, offs, bias, global_scale, name: str) -> None:
    check_expert_inputs(name, x, w_up, offs, bias, w_up.shape[2] if w_up.dim() == 3 else 0)
    if w_up.shape[2] % (2 * BLOCK):
        raise ValueError(f"{name}: w_up must be (E, D, 2F) with F a multiple of {BLOCK}, got {tuple(w_up.shape)}")
    _check_global_scale(global_scale, x, name)


def _spec_torch(alpha, limit, linear_offset) -> SwiGLU:
    return SwiGLU(alpha, limit, linear_offset, "halves")


# --------------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------------


def swiglu_ref_any_layout(pre: torch.Tensor, alpha: float, limit: float | None, linear_offset: float,
                          layout: str) -> torch.Tensor:
    """h (M, F) in pre.dtype = SwiGLU of a (M, 2F) pre-activation in any of ``LAYOUTS``."""
    if layout == "interleaved8":
        return swiglu_torch(deinterleave8_ref(pre), _spec_torch(alpha, limit, linear_offset))
    return swiglu_torch(pre, SwiGLU(alpha, limit, linear_offset, layout))


def swiglu_quantize_nvfp4_ref(
    pre: torch.Tensor, global_scale: torch.Tensor, *, swiglu_alpha: float = 1.702, swiglu_limit: float | None = 7.0,
    swiglu_linear_offset: float = 1.0, gate_up_layout: str = "interleaved",
) -> tuple[torch.Tensor, ...]:
    """Reference for :func:`swiglu_quantize_nvfp4`: ``nvfp4.quantize_ref(h, global_scale)`` of
    h = SwiGLU(pre) in pre's dtype (``moekit.swiglu_ref``, after deinterleaving ``"interleaved8"``)."""
    name = "swiglu_quantize_nvfp4"
    _check_pre(pre, name)
    _check_global_scale(global_scale, pre, name)
    _check_spec(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout, name)
    h = swiglu_ref_any_layout(pre, swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout)
    return quantize_ref(h, global_scale)


def grouped_mm_swiglu_nvfp4_ref(
    x: torch.Tensor, w_up: torch.Tensor, offs: torch.Tensor, global_scale: torch.Tensor, *,
    bias: torch.Tensor | None = None, swiglu_alpha: float = 1.702, swiglu_limit: float | None = 7.0,
    swiglu_linear_offset: float = 1.0, gate_up_layout: str = "interleaved",
) -> tuple[torch.Tensor, ...]:
    """Reference for :func:`grouped_mm_swiglu_nvfp4`: ``nvfp4.quantize_ref`` of the h of
    ``grouped_mm_swiglu_ref`` (pre rounded to x's dtype, then SwiGLU, rounded again); ``"interleaved8"``
    runs it on the deinterleaved weights and bias, the same h."""
    name = "grouped_mm_swiglu_nvfp4"
    _check_gemm(x, w_up, offs, bias, global_scale, name)
    _check_spec(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout, name)
    layout = gate_up_layout
    if layout == "interleaved8":
        w_up, bias, layout = deinterleave8_ref(w_up), None if bias is None else deinterleave8_ref(bias), "halves"
    h, _ = grouped_mm_swiglu_ref(x, w_up, offs, bias=bias, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                                 swiglu_linear_offset=swiglu_linear_offset, gate_up_layout=layout)
    values, scales, g = quantize_ref(h.detach(), global_scale)
    # rows past offs[-1]: zero codes and zero scales, also for a global scale outside the format (or
    # offs out of contract, which leaves h nonzero there)
    tail = (torch.arange(h.shape[0], device=h.device) >= offs[-1:])[:, None] if offs.numel() else True
    scales = torch.where(tail, torch.zeros_like(scales.view(torch.uint8)), scales.view(torch.uint8))
    values = torch.where(tail, torch.zeros_like(values.view(torch.uint8)), values.view(torch.uint8))
    return values.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e4m3fn), g


# --------------------------------------------------------------------------------------------------
# launchers (float4 / float8 outputs travel as uint8)
# --------------------------------------------------------------------------------------------------


def _swiglu_constexprs(alpha, limit, linear_offset, layout) -> dict:
    return dict(ALPHA=float(alpha), LIMIT=None if limit is None else float(limit), OFFSET=float(linear_offset),
                LAYOUT=layout)


def swiglu_quantize_nvfp4_fwd(pre: torch.Tensor, gscale: torch.Tensor, alpha: float, limit: float | None,
                              linear_offset: float, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """pre (M, 2F), unit column stride; gscale (1,) fp32 -> (values (M, F / 2) uint8, scales (M, F / 16)
    uint8)."""
    m, f = pre.shape[0], pre.shape[1] // 2
    values = config.empty((m, f // 2), dtype=torch.uint8, device=pre.device)
    scales = config.empty((m, f // BLOCK), dtype=torch.uint8, device=pre.device)
    if values.numel() == 0:
        return values, scales
    if config.use_gluon_quantize(pre.device):
        from .._kernels.nvfp4_gluon import _swiglu_quantize_rows_kernel

        words = pre.dtype == torch.bfloat16
        bm, nb, warps = SWIGLU_QUANTIZE_TILE[words]
        tiles_f = launch.cdiv(f, 16 * nb)
        row_programs = max(1, min(launch.cdiv(m, bm), config.num_sms(pre.device)
                                  * SWIGLU_QUANTIZE_PROGRAMS_PER_SM[words] // tiles_f))
        launch.kernel(_swiglu_quantize_rows_kernel)[(row_programs, tiles_f)](
            pre, values, scales, gscale, m, f, pre.stride(0),
            **_swiglu_constexprs(alpha, limit, linear_offset, layout),
            BLOCK_M=bm, NB=nb, TPW_B=nb, num_warps=warps,
        )
        return values, scales
    bm, bf = (16, 32) if config.is_interpreting() else (32, 128)
    bf = min(bf, max(BLOCK, launch.next_power_of_2(f)))
    launch.kernel(_swiglu_quantize_kernel)[(launch.cdiv(m, bm), launch.cdiv(f, bf))](
        pre, values, scales, gscale,
        m, f, pre.stride(0),
        **_swiglu_constexprs(alpha, limit, linear_offset, layout),
        BLOCK_M=bm, BLOCK_F=bf,
        num_warps=4,
    )
    return values, scales


def grouped_mm_swiglu_nvfp4_fwd(x, w, offs, bias, gscale, alpha, limit, linear_offset, layout,
                                cfg: config.TileConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, D), w (E, D, 2F), offs (E,) int32, bias (E, 2F) or None, gscale (1,) fp32 -> (values
    (M, F / 2) uint8, scales (M, F / 16) uint8); rows past offs[-1] get zero codes and zero scales.
    ``cfg`` pins the tile (tests); its block_n must cover whole 16-blocks of h (block_n % 32 == 0)."""
    m, d = x.shape
    e, two_f = w.shape[0], w.shape[2]
    f = two_f // 2
    values = config.empty((m, f // 2), dtype=torch.uint8, device=x.device)
    scales = config.empty((m, f // BLOCK), dtype=torch.uint8, device=x.device)
    if values.numel() == 0:
        return values, scales
    if cfg is None and layout == "interleaved" and d > 0 and ws_swiglu_nvfp4_ok(x, w):
        spec = SwiGLU(alpha, limit, linear_offset, layout)
        return ws_swiglu_nvfp4(x, w, offs, values, scales, gscale, bias=bias, spec=spec)
    cfg = cfg or config.grouped_mm_config(
        m // e, two_f, d, e, ragged_k=False, tma=config.use_tma(x.device), out_bytes=x.element_size(),
        device=x.device, epilogue="swiglu",
    )
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    bf = bn // 2
    if bf % BLOCK:
        raise ValueError(f"grouped_mm_swiglu_nvfp4: block_n must be a multiple of {2 * BLOCK}, got {bn}")
    halves = layout == "halves"
    if d > 0 and tma_views_ok(x, w, ()):
        a_arg = descriptor(x, [m, d], [x.stride(0), 1], [bm, bk])
        b_arg, tma = weight_descriptor(w, bk, bf if halves else bn), True
    else:
        a_arg, b_arg, tma = x, w, False
    tiles = (launch.cdiv(m, bm) + e + 1) * launch.cdiv(f, bf)
    launch.kernel(_grouped_mm_swiglu_nvfp4_kernel)[(min(config.num_sms(x.device) * cfg.programs_per_sm, tiles),)](
        a_arg, b_arg, values, scales, offs, bias, gscale,
        m, f, d, e,
        x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        bias.stride(0) if bias is not None else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, BLOCK_E=launch.next_power_of_2(e + 1),
        B_TRANS=w.stride(2) != 1, USE_TMA=tma, DOT_F32=config.is_interpreting(), FLATTEN=cfg.flatten,
        OUT_DTYPE=TL_DTYPES[x.dtype], **_swiglu_constexprs(alpha, limit, linear_offset, layout),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return values, scales


# --------------------------------------------------------------------------------------------------
# custom ops: what torch.compile traces (eager calls skip the custom-op dispatch and call the launchers)
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("moekit::nvfp4_swiglu_quantize", mutates_args=())
def _swiglu_quantize_op(
    pre: torch.Tensor, gscale: torch.Tensor, alpha: float, limit: float | None, linear_offset: float, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return swiglu_quantize_nvfp4_fwd(pre, gscale, alpha, limit, linear_offset, layout)


@_swiglu_quantize_op.register_fake
def _(pre, gscale, alpha, limit, linear_offset, layout):
    m, f = pre.shape[0], pre.shape[1] // 2
    return pre.new_empty((m, f // 2), dtype=torch.uint8), pre.new_empty((m, f // BLOCK), dtype=torch.uint8)


@torch.library.custom_op("moekit::grouped_mm_swiglu_nvfp4", mutates_args=())
def _grouped_mm_swiglu_nvfp4_op(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None, gscale: torch.Tensor,
    alpha: float, limit: float | None, linear_offset: float, layout: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_mm_swiglu_nvfp4_fwd(x, w, offs, bias, gscale, alpha, limit, linear_offset, layout)


@_grouped_mm_swiglu_nvfp4_op.register_fake
def _(x, w, offs, bias, gscale, alpha, limit, linear_offset, layout):
    m, f = x.shape[0], w.shape[2] // 2
    return x.new_empty((m, f // 2), dtype=torch.uint8), x.new_empty((m, f // BLOCK), dtype=torch.uint8)


# --------------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------------


def _as_nvfp4(values: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return values.view(torch.float4_e2m1fn_x2), scales.view(torch.float8_e4m3fn), global_scale.float()


def swiglu_quantize_nvfp4(
    pre: torch.Tensor, global_scale: torch.Tensor, *, swiglu_alpha: float = 1.702, swiglu_limit: float | None = 7.0,
    swiglu_linear_offset: float = 1.0, gate_up_layout: str = "interleaved",
) -> tuple[torch.Tensor, ...]:
    """h = SwiGLU(pre) quantized to NVFP4 along F, in one pass: pre is read once, h never reaches memory.

    - ``pre`` (M, 2F) bf16 / fp16 / fp32, F % 16 == 0, unit column stride, in ``gate_up_layout``
      (``"interleaved"``, ``"halves"`` or ``"interleaved8"``, see the module docstring).
    - ``global_scale``: a 0-dim float tensor on pre's device (read on the device: no host sync,
      CUDA-graph safe).
    - SwiGLU parameters as in :class:`moekit.epilogue.SwiGLU` (gpt-oss by default; ``swiglu_alpha=1,
      swiglu_limit=None, swiglu_linear_offset=0`` is plain ``silu(gate) * up``).

    Returns (values (M, F / 2) float4_e2m1fn_x2, scales (M, F / 16) float8_e4m3fn, global_scale 0-dim
    fp32): the bits of ``nvfp4.quantize(moekit.swiglu(pre), global_scale)``, with h rounded to pre's
    dtype before quantizing (module docstring). Forward only. CPU tensors (without the interpreter) run
    ``swiglu_quantize_nvfp4_ref``.
    """
    name = "swiglu_quantize_nvfp4"
    _check_pre(pre, name)
    _check_global_scale(global_scale, pre, name)
    _check_spec(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout, name)
    if not config.uses_triton(pre.device):
        return swiglu_quantize_nvfp4_ref(pre, global_scale, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit,
                                         swiglu_linear_offset=swiglu_linear_offset, gate_up_layout=gate_up_layout)
    values, scales = traced_or_eager(_swiglu_quantize_op, swiglu_quantize_nvfp4_fwd, pre, device_scale(global_scale),
                          float(swiglu_alpha), None if swiglu_limit is None else float(swiglu_limit),
                          float(swiglu_linear_offset), gate_up_layout)
    return _as_nvfp4(values, scales, global_scale)


def grouped_mm_swiglu_nvfp4(
    x: torch.Tensor, w_up: torch.Tensor, offs: torch.Tensor, global_scale: torch.Tensor, *,
    bias: torch.Tensor | None = None, swiglu_alpha: float = 1.702, swiglu_limit: float | None = 7.0,
    swiglu_linear_offset: float = 1.0, gate_up_layout: str = "interleaved",
) -> tuple[torch.Tensor, ...]:
    """The expert up-projection with SwiGLU, writing h as NVFP4: h = SwiGLU(x[rows_g] @ w_up[g] + bias[g]).

    - ``x`` (M, D) bf16 / fp16, expert-sorted rows; ``w_up`` (E, D, 2F) of x's dtype, any layout
      ``grouped_mm_swiglu`` takes (a K-major ``w.mT`` too), F % 16 == 0, its 2F columns in
      ``gate_up_layout``; ``offs`` (E,) int32 cumulative row ends, read on the device; ``bias`` (E, 2F)
      or None; ``global_scale`` a 0-dim float tensor on x's device.
    - Returns (values (M, F / 2) float4_e2m1fn_x2, scales (M, F / 16) float8_e4m3fn, row-major,
      global_scale 0-dim fp32). Rows at or past offs[-1] get zero codes and zero scales (their h is 0).
      ``nvfp4.to_blocked_ragged(scales, offs)`` gives the swizzled scales a block-scaled GEMM reads.
    - The bits of ``nvfp4.quantize(grouped_mm_swiglu(x, w_up, offs, bias=bias, ...)[0], global_scale)``:
      pre is rounded to x's dtype before SwiGLU and h again before quantizing, as the unfused path
      stores them. aux is not written: forward only (inference, or a forward whose backward
      recomputes aux). No host sync; CUDA-graph safe.
    """
    name = "grouped_mm_swiglu_nvfp4"
    _check_gemm(x, w_up, offs, bias, global_scale, name)
    _check_spec(swiglu_alpha, swiglu_limit, swiglu_linear_offset, gate_up_layout, name)
    offs = offs.contiguous()  # the kernels read offs by position: a strided view becomes a copy
    if not config.uses_triton(x.device):
        return grouped_mm_swiglu_nvfp4_ref(x, w_up, offs, global_scale, bias=bias, swiglu_alpha=swiglu_alpha,
                                           swiglu_limit=swiglu_limit, swiglu_linear_offset=swiglu_linear_offset,
                                           gate_up_layout=gate_up_layout)
    values, scales = traced_or_eager(_grouped_mm_swiglu_nvfp4_op, grouped_mm_swiglu_nvfp4_fwd, x, w_up, offs, bias,
                          device_scale(global_scale), float(swiglu_alpha),
                          None if swiglu_limit is None else float(swiglu_limit), float(swiglu_linear_offset),
                          gate_up_layout)
    return _as_nvfp4(values, scales, global_scale)

"""The FP8 format of blockwise-scaled training: e4m3 values, one fp32 scale per group of 128 elements.

The recipe DeepSeek-V3 trained with: activations and output gradients in 1 x 128 groups along the
reduction dimension, weights in 128 x 128 blocks, and the operands of a weight gradient (whose reduction
runs over tokens) in 128 x 1 groups of one expert's consecutive rows. A group g of x is stored as

    x[i] ~= e4m3(values[i]) * scales[g]

- **Scale.** amax = max |x| over the group (in fp32), floored at ``AMAX_FLOOR`` (1e-12: an all-zero
  group gets a tiny scale and zero codes, never inf or NaN). scale = amax / 448 and inverse = 448 /
  amax, each rounded once to fp32; with ``pow2_scales`` (UE8M0, as DeepGEMM's Blackwell path and
  Megatron's MXFP8 read them) scale is the power of two at or above amax / 448 and the inverse its exact
  reciprocal.
- **Values.** x * inverse in fp32, clamped to +-448 (e4m3fn's largest finite value: the rounding of the
  inverse may carry x * inverse just past it), rounded to e4m3fn to nearest, ties to even, as
  ``torch.Tensor.to(torch.float8_e4m3fn)`` and the hardware's ``cvt.rn.satfinite`` do.
- **Non-finite values propagate**, as through a bf16 GEMM: a group holding a NaN or an +-inf gets a NaN
  scale and zero codes, so it dequantizes to NaN, and every GEMM that reads it gives NaN where a bf16
  one gives NaN or inf. The other groups are untouched.

Ops, each with its pure-PyTorch ``*_ref`` twin (the CPU path and the tests' oracle), bit for bit; on
CUDA (and under ``TRITON_INTERPRET=1``) they run the kernels of ``_kernels/fp8.py``, with no host sync
and CUDA-graph safe:

- ``quantize(x)``: x (M, K) -> values (M, K), scales (M, cdiv(K, 128)): 1 x 128 groups along K;
- ``quantize_weights(w)``: w (E, A, B) -> values (E, A, B), scales (E, cdiv(A, 128), cdiv(B, 128));
- ``quantize_ragged_t(x, offs)``: x (M, K) with expert-sorted rows -> values_t (K, M), scales (G, K),
  group_offs (E,): 128 x 1 groups of one expert's consecutive rows (an expert's last group holds its
  remaining count mod 128 rows, down to 1), stored transposed as the FP8 tensor cores read a weight
  gradient's operands (K-major, the reduction over tokens contiguous). G = cdiv(M, 128) + E bounds
  the groups from the shapes alone; ``group_offs`` holds their cumulative count per expert (as ``offs``
  does rows), scale rows past ``group_offs[-1]`` are zero, and so are the codes of rows past
  ``offs[-1]``;
- ``dequantize``, ``dequantize_weights``, ``dequantize_ragged_t``: back to fp32.

Values are ``torch.float8_e4m3fn``, scales fp32.
"""

from __future__ import annotations

import torch

from .. import config, launch
from .._kernels.fp8 import _quantize_blocks_kernel, _quantize_ragged_t_kernel, _quantize_rows_kernel
from ..dispatch import traced_or_eager

E4M3_MAX = 448.0
GROUP = 128  # elements per scale along a group's dimension (weights: 128 x 128)
AMAX_FLOOR = 1e-12
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the quantize ops read
_ROWS_PER_PROGRAM = 32  # quantize: rows per program, one 128-column group each (8-64: 0.58-0.61 of copy)
_COLS_PER_PROGRAM = 64  # quantize_ragged_t: columns per program, one row group each (32-128: 0.36-0.41)


# --------------------------------------------------------------------------------------------------
# input checks, shared by the references and the kernels' public functions (the same errors from both)
# --------------------------------------------------------------------------------------------------


def _check_input(x: torch.Tensor, ndim: int, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != ndim:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got {got}")
    if x.dtype not in IN_DTYPES:
        raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {x.dtype}")


def _check_offs(offs: torch.Tensor, x: torch.Tensor, name: str) -> None:
    if not isinstance(offs, torch.Tensor) or offs.dim() != 1 or offs.numel() == 0 or offs.dtype != torch.int32:
        got = (offs.dtype, tuple(offs.shape)) if isinstance(offs, torch.Tensor) else type(offs).__name__
        raise ValueError(f"{name}: offs must be a non-empty 1-D int32 tensor of cumulative row counts, got {got}")
    if offs.device != x.device:
        raise ValueError(f"{name}: offs must be on x's device ({x.device}), got {offs.device}")


def _check_quantized(values: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if values.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        raise TypeError(f"{name}: expected float8_e4m3fn values and float32 scales, got {values.dtype} and "
                        f"{scales.dtype}")
    if values.device != scales.device:
        raise ValueError(f"{name}: values and scales must be on one device")


def groups_along(n: int) -> int:
    return -(-n // GROUP)


# --------------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------------


def _scale_ref(amax: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, inverse) per group from its fp32 amax: the module docstring's rule."""
    a = amax.clamp_min(AMAX_FLOOR)
    # tensor by tensor: torch divides by (or into) a Python scalar through its reciprocal, rounding twice
    c = torch.full_like(a, E4M3_MAX)
    s = a / c
    if not pow2:
        return s, c / a
    bits = s.view(torch.int32)
    up = torch.where(bits & 0x7FFFFF != 0, (bits & 0x7F800000) + 0x800000, bits & 0x7F800000)
    return up.view(torch.float32), ((254 << 23) - up).view(torch.float32)


def _quantize_groups(g: torch.Tensor, dims: tuple[int, ...], pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """g: x in fp32 viewed with each group spread over ``dims`` -> (values, scales with ``dims`` reduced
    to size 1)."""
    bad = (~g.isfinite()).amax(dim=dims, keepdim=True)
    s, inv = _scale_ref(g.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=dims, keepdim=True), pow2)
    q = torch.where(bad, 0.0, (g * inv).clamp(-E4M3_MAX, E4M3_MAX))
    return q.to(torch.float8_e4m3fn), torch.where(bad, float("nan"), s)


def quantize_ref(x: torch.Tensor, *, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize``'s twin: x (M, K) -> (values (M, K) float8_e4m3fn, scales (M, cdiv(K, 128)) fp32)."""
    _check_input(x, 2, "fp8.quantize")
    m, k = x.shape
    kp = groups_along(k) * GROUP
    g = torch.nn.functional.pad(x.float(), (0, kp - k)).contiguous().view(m, kp // GROUP, GROUP)  # (any strides)
    values, scales = _quantize_groups(g, (2,), pow2_scales)
    return values.view(m, kp)[:, :k].contiguous(), scales.view(m, kp // GROUP)


def quantize_weights_ref(w: torch.Tensor, *, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_weights``' twin: w (E, A, B) -> (values (E, A, B), scales (E, cdiv(A, 128), cdiv(B, 128)))."""
    _check_input(w, 3, "fp8.quantize_weights")
    e, a, b = w.shape
    ga, gb = groups_along(a), groups_along(b)
    g = torch.nn.functional.pad(w.float(), (0, gb * GROUP - b, 0, ga * GROUP - a)).contiguous()  # (any strides)
    values, scales = _quantize_groups(g.view(e, ga, GROUP, gb, GROUP), (2, 4), pow2_scales)
    return values.view(e, ga * GROUP, gb * GROUP)[:, :a, :b].contiguous(), scales.view(e, ga, gb)


def ragged_groups_ref(offs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 128-row groups of expert-sorted rows: (group_offs (E,) int32, the cumulative group count per
    expert; group (rows,) int64, each row's group, -1 past offs[-1]). offs is clamped into [0, rows]."""
    end = offs.long().clamp(0, rows)
    start = torch.cat([end.new_zeros(1), end[:-1]])
    group_offs = ((end - start).clamp_min(0) + GROUP - 1).div(GROUP, rounding_mode="floor").cumsum(0)
    r = torch.arange(rows, device=offs.device)
    expert = torch.searchsorted(end, r, right=True)  # the first expert whose end is past r
    inside = expert < end.numel()
    e = expert.clamp(max=end.numel() - 1)
    first = torch.cat([group_offs.new_zeros(1), group_offs[:-1]])[e]
    group = first + (r - start[e]).div(GROUP, rounding_mode="floor")
    return group_offs.to(torch.int32), torch.where(inside, group, -1)


def quantize_ragged_t_ref(x: torch.Tensor, offs: torch.Tensor, *,
                          pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_ragged_t``'s twin: x (M, K), offs (E,) int32 -> (values_t (K, M), scales (cdiv(M, 128) +
    E, K), group_offs (E,) int32)."""
    _check_input(x, 2, "fp8.quantize_ragged_t")
    _check_offs(offs, x, "fp8.quantize_ragged_t")
    m, k = x.shape
    n_groups = groups_along(m) + offs.numel()
    group_offs, group = ragged_groups_ref(offs, m)
    xf = x.float()
    inside = group >= 0
    slot = torch.where(inside, group, n_groups)  # rows past offs[-1] go to a dropped extra group
    # per group and column: the amax, and whether a NaN or an inf is among its values
    at = slot[:, None].expand(m, k)
    amax = xf.new_zeros(n_groups + 1, k).scatter_reduce_(0, at, xf.abs().nan_to_num(0.0, 0.0, 0.0), "amax")
    bad = xf.new_zeros(n_groups + 1, k).scatter_reduce_(0, at, (~xf.isfinite()).float(), "amax") != 0
    s, inv = _scale_ref(amax, pow2_scales)
    q = torch.where(bad[slot], 0.0, (xf * inv[slot]).clamp(-E4M3_MAX, E4M3_MAX))
    q = torch.where(inside[:, None], q, 0.0)
    scales = torch.where(bad, float("nan"), s)
    used = torch.arange(n_groups + 1, device=x.device)[:, None] < group_offs[-1].long()
    scales = torch.where(used, scales, 0.0)[:n_groups]
    return q.to(torch.float8_e4m3fn).t().contiguous(), scales, group_offs


def dequantize_ref(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values (M, K) float8_e4m3fn, scales (M, cdiv(K, 128)) fp32 -> x (M, K) fp32."""
    _check_quantized(values, scales, "fp8.dequantize")
    k = values.shape[-1]
    return values.float() * scales.repeat_interleave(GROUP, dim=-1)[..., :k]


def dequantize_weights_ref(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values (E, A, B) float8_e4m3fn, scales (E, cdiv(A, 128), cdiv(B, 128)) fp32 -> w (E, A, B) fp32."""
    _check_quantized(values, scales, "fp8.dequantize_weights")
    _, a, b = values.shape
    full = scales.repeat_interleave(GROUP, dim=1).repeat_interleave(GROUP, dim=2)[:, :a, :b]
    return values.float() * full


def dequantize_ragged_t_ref(values_t: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """values_t (K, M) float8_e4m3fn, scales (G, K) fp32, offs (E,) int32 -> x (M, K) fp32, zero past
    offs[-1] (``quantize_ragged_t``'s layout)."""
    _check_quantized(values_t, scales, "fp8.dequantize_ragged_t")
    _, group = ragged_groups_ref(offs, values_t.shape[1])
    padded = torch.cat([scales, scales.new_zeros(1, scales.shape[1])])  # rows past offs[-1] read zeros
    return values_t.float().t() * padded[torch.where(group >= 0, group, scales.shape[0])]


# The dequantize ops are their references' torch ops on any device (no kernel of their own: elementwise
# products that the GEMMs fold into their epilogues); no host sync.


def dequantize(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values (M, K) float8_e4m3fn, scales (M, cdiv(K, 128)) fp32 -> x (M, K) fp32 (``quantize``'s layout)."""
    return dequantize_ref(values, scales)


def dequantize_weights(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """values (E, A, B) float8_e4m3fn, scales (E, cdiv(A, 128), cdiv(B, 128)) fp32 -> w (E, A, B) fp32."""
    return dequantize_weights_ref(values, scales)


def dequantize_ragged_t(values_t: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """values_t (K, M) float8_e4m3fn, scales (G, K) fp32, offs (E,) int32 -> x (M, K) fp32, zero past
    offs[-1] (``quantize_ragged_t``'s layout)."""
    return dequantize_ragged_t_ref(values_t, scales, offs)


# --------------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------------


def _hw_cvt(t: torch.Tensor) -> bool:
    return t.is_cuda and not config.is_interpreting()


def quantize_fwd(x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    values = config.empty((m, k), dtype=torch.uint8, device=x.device)
    scales = config.empty((m, groups_along(k)), dtype=torch.float32, device=x.device)
    if m and k:
        launch.kernel(_quantize_rows_kernel)[(launch.cdiv(m, _ROWS_PER_PROGRAM), groups_along(k))](
            x, values, scales, m, k, x.stride(0), values.stride(0), scales.stride(0),
            POW2=pow2, HW_CVT=_hw_cvt(x), BLOCK_M=_ROWS_PER_PROGRAM, GROUP=GROUP, num_warps=4,
        )
    return values, scales


def quantize_weights_fwd(w: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    e, a, b = w.shape
    values = config.empty((e, a, b), dtype=torch.uint8, device=w.device)
    scales = config.empty((e, groups_along(a), groups_along(b)), dtype=torch.float32, device=w.device)
    if e and a and b:
        launch.kernel(_quantize_blocks_kernel)[(e, groups_along(a), groups_along(b))](
            w, values, scales, a, b, w.stride(0), w.stride(1), w.stride(2), scales.stride(0), scales.stride(1),
            POW2=pow2, HW_CVT=_hw_cvt(w), BLOCK=GROUP, num_warps=8,
        )
    return values, scales


def quantize_ragged_t_fwd(x: torch.Tensor, offs: torch.Tensor,
                          pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x.shape
    e = offs.numel()
    x = x if x.stride(1) == 1 else x.contiguous()
    n_groups = groups_along(m) + e
    values_t = config.empty((k, m), dtype=torch.uint8, device=x.device)
    scales = config.empty((n_groups, k), dtype=torch.float32, device=x.device)
    group_offs = config.empty((e,), dtype=torch.int32, device=x.device)
    if k:
        launch.kernel(_quantize_ragged_t_kernel)[(n_groups, launch.cdiv(k, _COLS_PER_PROGRAM))](
            x, offs.contiguous(), values_t, scales, group_offs, m, k, e, x.stride(0), values_t.stride(0),
            scales.stride(0), POW2=pow2, HW_CVT=_hw_cvt(x), BLOCK_K=_COLS_PER_PROGRAM, GROUP=GROUP,
            BLOCK_E=max(launch.next_power_of_2(e), 2), num_warps=4,
        )
    else:  # no columns: no program runs, so the group counts come from the reference's arithmetic
        group_offs.copy_(ragged_groups_ref(offs, m)[0])
    return values_t, scales, group_offs


@torch.library.custom_op("moekit::fp8_quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fwd(x, pow2)


@_quantize_op.register_fake
def _(x, pow2):
    m, k = x.shape
    return x.new_empty((m, k), dtype=torch.uint8), x.new_empty((m, groups_along(k)), dtype=torch.float32)


@torch.library.custom_op("moekit::fp8_quantize_weights", mutates_args=())
def _quantize_weights_op(w: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_weights_fwd(w, pow2)


@_quantize_weights_op.register_fake
def _(w, pow2):
    e, a, b = w.shape
    scales = w.new_empty((e, groups_along(a), groups_along(b)), dtype=torch.float32)
    return w.new_empty((e, a, b), dtype=torch.uint8), scales


@torch.library.custom_op("moekit::fp8_quantize_ragged_t", mutates_args=())
def _quantize_ragged_t_op(x: torch.Tensor, offs: torch.Tensor,
                          pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_ragged_t_fwd(x, offs, pow2)


@_quantize_ragged_t_op.register_fake
def _(x, offs, pow2):
    m, k = x.shape
    return (x.new_empty((k, m), dtype=torch.uint8),
            x.new_empty((groups_along(m) + offs.numel(), k), dtype=torch.float32), offs.new_empty(offs.shape))


# --------------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------------


def quantize(x: torch.Tensor, *, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x (M, K) bf16 / fp16 / fp32 in 1 x 128 groups along K -> (values (M, K) float8_e4m3fn,
    scales (M, cdiv(K, 128)) fp32), bit for bit ``quantize_ref`` (the module docstring states the
    rule; a last group of K % 128 columns is scaled by its own amax). Not differentiable."""
    _check_input(x, 2, "fp8.quantize")
    if not config.uses_triton(x.device):
        return quantize_ref(x, pow2_scales=pow2_scales)
    values, scales = traced_or_eager(_quantize_op, quantize_fwd, x, bool(pow2_scales))
    return values.view(torch.float8_e4m3fn), scales


def quantize_weights(w: torch.Tensor, *, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize weights w (E, A, B) (any strides) in 128 x 128 blocks over their last two dims ->
    (values (E, A, B) float8_e4m3fn contiguous, scales (E, cdiv(A, 128), cdiv(B, 128)) fp32), bit for bit
    ``quantize_weights_ref``. Blocks are symmetric, so ``quantize_weights(w.mT)`` gives the transposed
    values and scales (a dgrad's K-major copy). Not differentiable."""
    _check_input(w, 3, "fp8.quantize_weights")
    if not config.uses_triton(w.device):
        return quantize_weights_ref(w, pow2_scales=pow2_scales)
    values, scales = traced_or_eager(_quantize_weights_op, quantize_weights_fwd, w, bool(pow2_scales))
    return values.view(torch.float8_e4m3fn), scales


def quantize_ragged_t(x: torch.Tensor, offs: torch.Tensor, *,
                      pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize expert-sorted rows x (M, K) (expert e's rows are [offs[e-1], offs[e]), offs (E,) int32 on
    x's device, non-decreasing: not checked on the device, values clamped into [0, M]) in 128 x 1 groups
    of one expert's consecutive rows, stored transposed -> (values_t (K, M) float8_e4m3fn, scales
    (cdiv(M, 128) + E, K) fp32, group_offs (E,) int32), bit for bit ``quantize_ragged_t_ref``. An
    expert's last group holds its row count mod 128 rows (one row: its scale is that row's |x| / 448);
    scale rows past group_offs[-1] and the codes of rows past offs[-1] are zero. No host sync. Not
    differentiable."""
    _check_input(x, 2, "fp8.quantize_ragged_t")
    _check_offs(offs, x, "fp8.quantize_ragged_t")
    if not config.uses_triton(x.device):
        return quantize_ragged_t_ref(x, offs, pow2_scales=pow2_scales)
    values_t, scales, group_offs = traced_or_eager(_quantize_ragged_t_op, quantize_ragged_t_fwd, x, offs,
                                                   bool(pow2_scales))
    return values_t.view(torch.float8_e4m3fn), scales, group_offs


__all__ = [
    "AMAX_FLOOR", "E4M3_MAX", "GROUP", "dequantize", "dequantize_ragged_t", "dequantize_ragged_t_ref",
    "dequantize_ref", "dequantize_weights", "dequantize_weights_ref", "quantize", "quantize_ragged_t",
    "quantize_ragged_t_ref", "quantize_ref", "quantize_weights", "quantize_weights_ref", "ragged_groups_ref",
]

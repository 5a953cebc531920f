"""The grouped GEMMs on blockwise FP8 operands: the rows-ragged one, ``quantize``'s activations times
``quantize_weights``' expert weights (the forward and dgrad GEMM of FP8 training), and the weight
gradient ``weight_grad_fp8`` on ``quantize_ragged_t``'s operands (its own docstring).

``grouped_mm_fp8(a, a_scales, b, b_scales, offs)``: a (M, K) e4m3 with (M, cdiv(K, 128)) fp32 scales,
b (E, N, K) e4m3 (K-major, the layout FP8 tensor cores read: a weight (E, out, in) as stored, or
``quantize_weights(w.mT)`` for its transpose) with (E, cdiv(N, 128), cdiv(K, 128)) fp32 scales, offs (E,)
int32 cumulative row counts -> (M, N): row m of expert e is sum over K groups kb of the fp32 partial
product times a_scale[m, kb] * b_scale[e, n // 128, kb]; rows past offs[-1] are zero. ``*_ref`` is the
same computation in torch ops (per-group fp32 partial products, then the scales); the two differ only in
the order of fp32 accumulation, and each is held to a float64 product of the dequantized operands.
Non-finite scales (a group that held a NaN or an inf) propagate to the rows and columns they scale.
"""

from __future__ import annotations

import torch

from .. import config, launch
from .._kernels.fp8_gemm import _grouped_mm_fp8_kernel, _weight_grad_fp8_kernel
from ..descriptors import descriptor, tma_ok
from ..reference import group_bounds
from .formats import GROUP, groups_along

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (rows per program, warps, pipeline stages); the columns per program are one 128-wide scale group
TILE_TMA = (64, 4, 3)  # TMA operands (H200: 0.98-1.04x bf16; 128 and 256 rows 0.61-0.96x: probes/fp8_tiles.py)
TILE_POINTERS = (64, 4, 3)  # masked pointer operands (K % 16 != 0)


def _check(a, a_scales, b, b_scales, offs, out_dtype, name: str = "grouped_mm_fp8") -> None:
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[2]:
        raise ValueError(f"{name}: a (M, K) and b (E, N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    (m, k), (e, n, _) = a.shape, b.shape
    want_a, want_b = (m, groups_along(k)), (e, groups_along(n), groups_along(k))
    if tuple(a_scales.shape) != want_a or tuple(b_scales.shape) != want_b:
        raise ValueError(f"{name}: scales {want_a} and {want_b} for a {tuple(a.shape)} and b {tuple(b.shape)}, got "
                         f"{tuple(a_scales.shape)} and {tuple(b_scales.shape)}")
    if a_scales.dtype != torch.float32 or b_scales.dtype != torch.float32:
        raise TypeError(f"{name}: scales must be float32, got {a_scales.dtype} and {b_scales.dtype}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or tuple(offs.shape) != (e,):
        got = (offs.dtype, tuple(offs.shape)) if isinstance(offs, torch.Tensor) else type(offs).__name__
        raise ValueError(f"{name}: offs must be an ({e},) int32 tensor of cumulative row counts, got {got}")
    if len({t.device for t in (a, a_scales, b, b_scales, offs)}) != 1:
        raise ValueError(f"{name}: a, b, their scales and offs must be on one device")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{name}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


def grouped_mm_fp8_ref(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                       offs: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``grouped_mm_fp8``'s twin in torch ops (reads offs on the host: not for torch.compile)."""
    _check(a, a_scales, b, b_scales, offs, out_dtype)
    (m, k), n = a.shape, b.shape[1]
    out = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    col_scales = b_scales.repeat_interleave(GROUP, dim=1)[:, :n]  # (E, N, GK)
    for g, (s, t) in enumerate(group_bounds(offs, m)):
        for kb in range(groups_along(k)):
            ks = slice(kb * GROUP, min(k, (kb + 1) * GROUP))
            part = a[s:t, ks].float() @ b[g, :, ks].float().T
            out[s:t] += part * (a_scales[s:t, kb, None] * col_scales[g, None, :, kb])
    return out.to(out_dtype)


def grouped_mm_fp8_fwd(a, a_scales, b, b_scales, offs, out_dtype: torch.dtype, tile: tuple | None = None,
                       tma: bool | None = None) -> torch.Tensor:
    """The kernel's launch (inputs checked by the caller). ``tile`` (rows per program, warps, stages) and
    ``tma`` override the defaults: TMA operands where the device has TMA (and under the interpreter, which
    emulates it) and the rows are 16-byte aligned (K % 16 == 0), with ``TILE_TMA``; else pointers, with
    ``TILE_POINTERS``."""
    (m, k), (e, n, _) = a.shape, b.shape
    out = config.empty((m, n), dtype=out_dtype, device=a.device)
    if m and n:
        a = a if a.stride(1) == 1 else a.contiguous()
        b = b if b.stride(2) == 1 and b.stride(0) == n * b.stride(1) else b.contiguous()
        b_scales = b_scales if b_scales.stride(2) == 1 else b_scales.contiguous()
        if tma is None:
            tma = config.use_tma(a.device) and k > 0 and tma_ok(a, 1) and tma_ok(b, 2)
        block_m, warps, stages = tile or (TILE_TMA if tma else TILE_POINTERS)
        if tma:
            a_arg = descriptor(a, [m, k], [a.stride(0), 1], [block_m, GROUP])
            b_arg = descriptor(b, [e * n, k], [b.stride(1), 1], [GROUP, GROUP])
        else:
            a_arg, b_arg = a.view(torch.uint8), b.view(torch.uint8)
        launch.kernel(_grouped_mm_fp8_kernel)[(launch.cdiv(m, block_m) + e, launch.cdiv(n, GROUP))](
            a_arg, a_scales.contiguous(), b_arg, b_scales, offs.contiguous(), out,
            m, n, k, e,
            a.stride(0), a_scales.shape[1], b.stride(0), b.stride(1), b_scales.stride(0), b_scales.stride(1),
            out.stride(0), BLOCK_M=block_m, BLOCK_N=GROUP, BLOCK_K=GROUP,
            BLOCK_E=max(launch.next_power_of_2(e), 2), USE_TMA=tma, num_warps=warps, num_stages=stages,
        )
    return out


@torch.library.custom_op("moekit::grouped_mm_fp8", mutates_args=())
def _grouped_mm_fp8_op(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                       offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a and b as their e4m3 bytes (uint8): torch has few fp8 ops on the CPU, which op checks need."""
    fp8_dtype = torch.float8_e4m3fn
    return grouped_mm_fp8_fwd(a.view(fp8_dtype), a_scales, b.view(fp8_dtype), b_scales, offs, out_dtype)


@_grouped_mm_fp8_op.register_fake
def _(a, a_scales, b, b_scales, offs, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def grouped_mm_fp8(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
                   offs: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows-ragged a (M, K) @ b[e] (N, K)^T per expert on blockwise FP8 operands -> (M, N) in out_dtype
    (the module docstring states the computation). offs is read on the device (non-decreasing, not
    checked there; clamped into [0, M] as ``moekit.grouped_mm`` clamps it): no host sync, CUDA-graph
    safe. Not differentiable."""
    _check(a, a_scales, b, b_scales, offs, out_dtype)
    if not config.uses_triton(a.device):
        return grouped_mm_fp8_ref(a, a_scales, b, b_scales, offs, out_dtype=out_dtype)
    if torch.compiler.is_compiling():
        return _grouped_mm_fp8_op(a.view(torch.uint8), a_scales, b.view(torch.uint8), b_scales, offs, out_dtype)
    return grouped_mm_fp8_fwd(a, a_scales, b, b_scales, offs, out_dtype)


# --------------------------------------------------------------------------------------------------
# the weight gradient: K ragged (each expert's rows), operands from quantize_ragged_t
# --------------------------------------------------------------------------------------------------


def _check_wgrad(dy_t, dy_scales, x_t, x_scales, offs, out_dtype, name: str = "weight_grad_fp8") -> None:
    if dy_t.dim() != 2 or x_t.dim() != 2 or dy_t.shape[1] != x_t.shape[1]:
        raise ValueError(f"{name}: dy_t (N, M) and x_t (K, M) over the same M rows, got {tuple(dy_t.shape)} and "
                         f"{tuple(x_t.shape)}")
    if dy_t.dtype != torch.float8_e4m3fn or x_t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: dy_t and x_t must be float8_e4m3fn, got {dy_t.dtype} and {x_t.dtype}")
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1 or offs.numel() == 0:
        got = (offs.dtype, tuple(offs.shape)) if isinstance(offs, torch.Tensor) else type(offs).__name__
        raise ValueError(f"{name}: offs must be an (E,) int32 tensor of cumulative row counts, got {got}")
    (n, m), k, e = dy_t.shape, x_t.shape[0], offs.numel()
    g = groups_along(m) + e
    if tuple(dy_scales.shape) != (g, n) or tuple(x_scales.shape) != (g, k):
        raise ValueError(f"{name}: scales ({g}, {n}) and ({g}, {k}) (quantize_ragged_t's, cdiv(M, 128) + E groups), "
                         f"got {tuple(dy_scales.shape)} and {tuple(x_scales.shape)}")
    if dy_scales.dtype != torch.float32 or x_scales.dtype != torch.float32:
        raise TypeError(f"{name}: scales must be float32, got {dy_scales.dtype} and {x_scales.dtype}")
    if len({t.device for t in (dy_t, dy_scales, x_t, x_scales, offs)}) != 1:
        raise ValueError(f"{name}: the operands, their scales and offs must be on one device")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{name}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


def weight_grad_fp8_ref(dy_t: torch.Tensor, dy_scales: torch.Tensor, x_t: torch.Tensor, x_scales: torch.Tensor,
                        offs: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``weight_grad_fp8``'s twin in torch ops (reads offs on the host: not for torch.compile)."""
    _check_wgrad(dy_t, dy_scales, x_t, x_scales, offs, out_dtype)
    (n, m), k = dy_t.shape, x_t.shape[0]
    out = torch.zeros(offs.numel(), n, k, dtype=torch.float32, device=dy_t.device)
    g = 0
    for ex, (s, t) in enumerate(group_bounds(offs, m)):
        for r0 in range(s, t, GROUP):
            rows = slice(r0, min(t, r0 + GROUP))
            part = dy_t[:, rows].float() @ x_t[:, rows].float().T
            out[ex] += part * (dy_scales[g, :, None] * x_scales[g, None, :])
            g += 1
    return out.to(out_dtype)


_WGRAD_TILE = (64, 64, 4)  # (BLOCK_N, BLOCK_K, warps): a first, untuned choice


def weight_grad_fp8_fwd(dy_t, dy_scales, x_t, x_scales, offs, out_dtype: torch.dtype) -> torch.Tensor:
    (n, m), k, e = dy_t.shape, x_t.shape[0], offs.numel()
    out = config.empty((e, n, k), dtype=out_dtype, device=dy_t.device)
    if n and k:
        dy_t = dy_t if dy_t.stride(1) == 1 else dy_t.contiguous()
        x_t = x_t if x_t.stride(1) == 1 else x_t.contiguous()
        dy_scales, x_scales = dy_scales.contiguous(), x_scales.contiguous()
        block_n, block_k, warps = _WGRAD_TILE
        launch.kernel(_weight_grad_fp8_kernel)[(e * launch.cdiv(n, block_n) * launch.cdiv(k, block_k),)](
            dy_t.view(torch.uint8), dy_scales, x_t.view(torch.uint8), x_scales, offs.contiguous(), out,
            m, n, k, e, dy_t.stride(0), dy_scales.stride(0), x_t.stride(0), x_scales.stride(0), out.stride(0),
            out.stride(1), BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP,
            BLOCK_E=max(launch.next_power_of_2(e), 2), num_warps=warps,
        )
    return out


@torch.library.custom_op("moekit::weight_grad_fp8", mutates_args=())
def _weight_grad_fp8_op(dy_t: torch.Tensor, dy_scales: torch.Tensor, x_t: torch.Tensor, x_scales: torch.Tensor,
                        offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dy_t and x_t as their e4m3 bytes (uint8), as ``moekit::grouped_mm_fp8``."""
    fp8_dtype = torch.float8_e4m3fn
    return weight_grad_fp8_fwd(dy_t.view(fp8_dtype), dy_scales, x_t.view(fp8_dtype), x_scales, offs, out_dtype)


@_weight_grad_fp8_op.register_fake
def _(dy_t, dy_scales, x_t, x_scales, offs, out_dtype):
    return dy_t.new_empty((offs.shape[0], dy_t.shape[0], x_t.shape[0]), dtype=out_dtype)


def weight_grad_fp8(dy_t: torch.Tensor, dy_scales: torch.Tensor, x_t: torch.Tensor, x_scales: torch.Tensor,
                    offs: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight gradient of ``grouped_mm_fp8``'s b on FP8 operands: dW[e] = dY_e^T X_e -> (E, N, K) in
    out_dtype, dY_e and X_e expert e's rows [offs[e-1], offs[e]).

    dy_t, dy_scales, _ = ``quantize_ragged_t(dy, offs)`` and x_t, x_scales, _ = ``quantize_ragged_t(x, offs)``:
    dy_t (N, M) and x_t (K, M) e4m3, scales (cdiv(M, 128) + E, N) and (.., K) fp32, one row per 128-row group
    of an expert's rows (its last group its tail, down to 1 row). dW[e][n, k] = sum over e's groups g of the
    fp32 partial product times dy_scale[g, n] * x_scale[g, k]. Rows past offs[-1] are read by no expert; an
    expert without rows gets zeros. offs is read on the device (clamped as ``quantize_ragged_t`` clamps it):
    no host sync, CUDA-graph safe. Not differentiable."""
    _check_wgrad(dy_t, dy_scales, x_t, x_scales, offs, out_dtype)
    if not config.uses_triton(dy_t.device):
        return weight_grad_fp8_ref(dy_t, dy_scales, x_t, x_scales, offs, out_dtype=out_dtype)
    if torch.compiler.is_compiling():
        return _weight_grad_fp8_op(dy_t.view(torch.uint8), dy_scales, x_t.view(torch.uint8), x_scales, offs,
                                   out_dtype)
    return weight_grad_fp8_fwd(dy_t, dy_scales, x_t, x_scales, offs, out_dtype)


__all__ = ["grouped_mm_fp8", "grouped_mm_fp8_ref", "weight_grad_fp8", "weight_grad_fp8_ref"]

"""NVFP4: the format, and the pure-PyTorch references of its quantization and layouts.

An NVFP4 tensor x (M, K) is stored as
- ``values`` (M, K / 2) ``torch.float4_e2m1fn_x2``: e2m1 codes (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
  and a sign bit), two per byte, the even element in the low nibble;
- ``scales`` (M, K / 16) ``torch.float8_e4m3fn``: one scale per block of 16 consecutive elements
  along K;
- ``global_scale``: an fp32 scalar (or one per expert) equal to amax / (6 * 448), so that every block
  scale fits e4m3's range;
so that x ~= e2m1(values) * scales * global_scale.

Rounding is to nearest with ties to even, once: a value is divided by its block's (e4m3-rounded) scale
times the global scale in fp32 and rounded to e2m1 directly, as the hardware conversion
``cvt.rn.satfinite.e2m1x2.f32`` does, saturating at +-6. A block whose scale underflows e4m3 gets
scale 0 and all-zero values. Non-finite inputs have a documented result rather than a NaN scale:
the amaxes ignore them, +-inf saturates to +-6 times the block scale, NaN becomes 0.

GEMM kernels read block scales in the tiled layout that cuBLAS and ``torch._scaled_mm`` use for block
scaling: the (rows, K / 16) scale matrix padded to 128 rows x 4 columns tiles, each tile stored as 512
contiguous bytes where the scale of row r and column c of the tile sits at
``(r % 32) * 16 + (r // 32) * 4 + c``, the tiles in row-major order (``to_blocked_ref``). For a
grouped GEMM each expert's rows start a new row tile (``to_blocked_ragged_ref``), and each expert's
weight scales form their own tiles (``to_blocked_experts_ref``).

The quantize and GEMM kernels build on these references; this module holds the references and the
layout helpers, which run anywhere.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of codes 0-7 (bit 3 is the sign)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16  # elements per block scale
TILE_ROWS, TILE_COLS = 128, 4  # the swizzled scale tile
INTERLEAVE = 8  # the gate/up column granularity of the "interleaved8" layout

# Midpoints between neighbouring magnitudes; a value exactly on one rounds to the even code.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _check_blocks(x: torch.Tensor, name: str) -> None:
    if not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"{name}: x must be a floating-point tensor of at least one dim, got {x.dtype}")
    if x.shape[-1] % BLOCK:
        raise ValueError(f"{name}: the last dim must be a multiple of {BLOCK}, got {x.shape[-1]}")


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN as 0 and +-inf left out (as 0): what the amaxes see."""
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def global_scale_ref(x: torch.Tensor, *, per_expert: bool = False) -> torch.Tensor:
    """amax(|x|) / (6 * 448) as fp32: a scalar, or with ``per_expert`` one per leading index (E,).
    An all-zero (or all non-finite) tensor gets 1.0, with which every value quantizes to 0."""
    a = _finite_abs(x)
    amax = a.flatten(1).amax(1) if per_expert else a.amax()
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def e2m1_codes_ref(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scales) -> 4-bit e2m1 codes (uint8, sign in bit 3): round to
    nearest, ties to even, saturating at +-6; NaN -> +0."""
    v = v.float()
    mag = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=E2M1_MAX)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=v.device)
    code = torch.bucketize(mag, mids)  # mids[code - 1] < mag <= mids[code]
    tie = mag == mids[code.clamp(max=len(_MIDPOINTS) - 1)]
    code = torch.where(tie & (code % 2 == 1), code + 1, code)  # an odd code has mantissa 1: go up to even
    sign = (v < 0) & (code > 0)
    return (code + 8 * sign).to(torch.uint8)


def e2m1_values_ref(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def pack_ref(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) 4-bit codes -> (..., K / 2) ``float4_e2m1fn_x2``, the even element in the low nibble."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.float4_e2m1fn_x2)


def unpack_ref(values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_ref``: (..., K / 2) ``float4_e2m1fn_x2`` -> (..., K) uint8 codes."""
    b = values.view(torch.uint8)
    return torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)


def _leading(g: torch.Tensor, ndim: int) -> torch.Tensor:
    """A scalar or per-expert (E,) global scale shaped to broadcast over a tensor of ``ndim`` dims."""
    return g.float().reshape(g.shape + (1,) * (ndim - g.dim()))


def quantize_ref(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """x (..., K) float -> (values (..., K / 2) float4_e2m1fn_x2, scales (..., K / 16) float8_e4m3fn,
    global_scale). ``global_scale``: a 0-dim fp32 tensor, or (E,) for x (E, ..., K) with one per expert;
    computed from the whole of x when None."""
    _check_blocks(x, "nvfp4.quantize_ref")
    g0 = global_scale_ref(x) if global_scale is None else global_scale.float()
    blocks = x.float().unflatten(-1, (-1, BLOCK))  # (..., K / 16, 16)
    g = _leading(g0, blocks.dim())
    amax = _finite_abs(blocks).amax(-1, keepdim=True)
    scales = (amax / (E2M1_MAX * g)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = scales.float() * g
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    codes = torch.where(denom > 0, e2m1_codes_ref(blocks / safe), torch.zeros_like(blocks, dtype=torch.uint8))
    return pack_ref(codes.flatten(-2)), scales.squeeze(-1), g0


def dequantize_ref(values: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """(values (..., K / 2), scales (..., K / 16), global_scale () or (E,)) -> x (..., K) fp32."""
    v = e2m1_values_ref(unpack_ref(values)).unflatten(-1, (-1, BLOCK))
    return (v * scales.float()[..., None] * _leading(global_scale, v.dim())).flatten(-2)


# --------------------------------------------------------------------------------------------------
# the swizzled scale layout
# --------------------------------------------------------------------------------------------------


def blocked_size(rows: int, cols: int) -> int:
    """Bytes of ``to_blocked_ref`` for a (rows, cols) scale matrix: whole 128 x 4 tiles."""
    return -(-rows // TILE_ROWS) * -(-cols // TILE_COLS) * TILE_ROWS * TILE_COLS


def _blocked_index(rows: int, cols: int, device) -> torch.Tensor:
    """(rows, cols) int64: where each scale lands in the flat tiled layout."""
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(cols, device=device)[None, :]
    tiles_per_row = -(-cols // TILE_COLS)
    tile = (r // TILE_ROWS) * tiles_per_row + c // TILE_COLS
    inner = (r % 32) * 16 + ((r % TILE_ROWS) // 32) * 4 + c % TILE_COLS
    return tile * (TILE_ROWS * TILE_COLS) + inner


def to_blocked_ref(scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) block scales -> the flat tiled layout (``blocked_size(rows, cols)`` elements, padding 0)."""
    rows, cols = scales.shape
    out = scales.new_zeros(blocked_size(rows, cols))
    out.view(torch.uint8)[_blocked_index(rows, cols, scales.device).flatten()] = scales.reshape(-1).view(torch.uint8)
    return out


def ragged_row_tiles(offs: torch.Tensor) -> torch.Tensor:
    """(E,) cumulative row ends -> (E,) int32 cumulative ends of the experts' rows padded to whole 128-row
    tiles: where each expert's scales end in ``to_blocked_ragged_ref``'s row space. On the device, no sync."""
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).clamp(min=0)
    return ((counts + TILE_ROWS - 1) // TILE_ROWS * TILE_ROWS).cumsum(0).to(torch.int32)


def to_blocked_ragged_ref(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Scales (M, cols) of expert-sorted rows split by ``offs`` (E,) -> the tiled layout with each expert's
    rows starting a new 128-row tile, sized for the static bound of ``(ceil(M / 128) + E)`` row tiles
    (the tiles past the last expert's are zeros); ``ragged_row_tiles(offs)`` gives each expert's end."""
    m, cols = scales.shape
    e = offs.numel()
    bound = (-(-m // TILE_ROWS) + e) * TILE_ROWS
    padded = scales.new_zeros(bound, cols)
    ends = [int(v) for v in offs.tolist()]
    tile_ends = [int(v) for v in ragged_row_tiles(offs).tolist()]
    for g in range(e):
        start, end = (ends[g - 1] if g else 0), ends[g]
        dst = tile_ends[g - 1] if g else 0
        padded[dst : dst + max(end - start, 0)] = scales[start:end]
    return to_blocked_ref(padded)


def to_blocked_experts_ref(scales: torch.Tensor) -> torch.Tensor:
    """Per-expert weight scales (E, rows, cols) -> (E, blocked_size(rows, cols)): each expert's own tiles."""
    return torch.stack([to_blocked_ref(s) for s in scales])


# --------------------------------------------------------------------------------------------------
# the gate/up layout of a fused SwiGLU
# --------------------------------------------------------------------------------------------------


def interleave8_ref(t: torch.Tensor) -> torch.Tensor:
    """(..., 2F) as [gate | up] halves -> gate/up interleaved by 8 columns: gate 0-7, up 0-7, gate 8-15, ...
    (F a multiple of 8), so that a 16-element scale block holds 8 gate and 8 up values."""
    f = t.shape[-1] // 2
    if t.shape[-1] % (2 * INTERLEAVE):
        raise ValueError(f"interleave8_ref: the last dim must be a multiple of {2 * INTERLEAVE}, got {t.shape[-1]}")
    gate, up = t[..., :f].unflatten(-1, (-1, INTERLEAVE)), t[..., f:].unflatten(-1, (-1, INTERLEAVE))
    return torch.stack([gate, up], dim=-2).flatten(-3)


def deinterleave8_ref(t: torch.Tensor) -> torch.Tensor:
    """Inverse of ``interleave8_ref``: gate/up interleaved by 8 -> [gate | up] halves."""
    pairs = t.unflatten(-1, (-1, 2, INTERLEAVE))
    return torch.cat([pairs[..., 0, :].flatten(-2), pairs[..., 1, :].flatten(-2)], dim=-1)

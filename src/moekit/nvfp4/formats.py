"""The NVFP4 format: its quantization and block-scale layouts; pure-PyTorch references and Triton ops.

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
scale 0 and all-zero values. Non-finite inputs propagate, as they do through a bf16 GEMM: a block
holding a NaN or an +-inf gets the NaN scale (e4m3 code 0x7F) and zero codes, so it dequantizes to NaN
and every GEMM that reads it gives NaN where a bf16 one would have given NaN or inf. The global
scale's amax leaves them out, so the other blocks quantize as if they were absent.

GEMM kernels read block scales in the tiled layout that cuBLAS and ``torch._scaled_mm`` use for block
scaling: the (rows, K / 16) scale matrix padded to 128 rows x 4 columns tiles, each tile stored as 512
contiguous bytes where the scale of row r and column c of the tile sits at
``(r % 32) * 16 + (r // 32) * 4 + c``, the tiles in row-major order (``to_blocked_ref``). For a
grouped GEMM each expert's rows start a new row tile (``to_blocked_ragged_ref``), and each expert's
weight scales form their own tiles (``to_blocked_experts_ref``).

Public ops, each with its pure-PyTorch ``*_ref`` twin (the CPU path and the tests' oracle), bit-exact
with it; on CUDA (and under ``TRITON_INTERPRET=1``) they run the kernels of ``_kernels/nvfp4.py``, with
no host sync (``to_blocked_ragged`` reads ``offs`` on the device) and CUDA-graph safe:
- ``quantize(x, global_scale=None, *, rounding="nearest", seed=0, offset=0)``: activations (..., K); with
  ``global_scale=None`` the amax is reduced on the device; ``rounding="stochastic"`` rounds each value
  up or down at random, unbiased, on the Philox stream ``tl.randint4x(seed, offset + i // 4)`` that
  ``random_bits_ref`` reproduces in torch (gradients in the NVFP4 training recipe);
- ``quantize_weights(w, global_scale=None, *, block_2d=False)``: weights (E, K, N) along K, per-expert
  global scales, 1x16 blocks or the 16x16 blocks of the NVFP4 training recipe;
- ``dequantize(values, scales, global_scale, *, dtype=torch.float32)``;
- ``to_blocked(scales)``, ``to_blocked_ragged(scales, offs)``, ``to_blocked_experts(scales)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import config, launch
from .._kernels.nvfp4 import (
    _amax_kernel,
    _dequantize_kernel,
    _global_scale_kernel,
    _quantize_kernel,
    _to_blocked_kernel,
    _to_blocked_ragged_kernel,
)
from ..dispatch import traced_or_eager

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of codes 0-7 (bit 3 is the sign)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16  # elements per block scale
TILE_ROWS, TILE_COLS = 128, 4  # the swizzled scale tile
# The Gluon quantize kernel's tile (rows, 16-element blocks per row, warps) and its persistent programs
# per SM: the fastest of a sweep on an H100 (docs/design.md)
QUANTIZE_TILE = (128, 8, 16)
QUANTIZE_PROGRAMS_PER_SM = 2  # fp32, fp16 and bf16 inputs off the word path
QUANTIZE_WORDS_PROGRAMS_PER_SM = 1  # bf16 read as words (one program of 16 warps fits an SM's registers)
INTERLEAVE = 8  # the gate/up column granularity of the "interleaved8" layout

# Midpoints between neighbouring magnitudes; a value exactly on one rounds to the even code.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

ROUNDINGS = ("nearest", "stochastic")  # the e2m1 rounding modes of ``quantize``
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what quantize reads and dequantize writes
SCALE_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # what the layout functions move (uint8: raw scale bytes)


# --------------------------------------------------------------------------------------------------
# input checks, shared by the references and the kernels' public functions (the same errors from both)
# --------------------------------------------------------------------------------------------------


def describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_blocks(x, name: str, *, weights: bool = False) -> None:
    """x (..., K), or with ``weights`` w (E, K, N): bf16 / fp16 / fp32, K a multiple of 16."""
    what = "w (E, K, N)" if weights else "x (..., K)"
    if not isinstance(x, torch.Tensor) or x.dtype not in IN_DTYPES:
        raise TypeError(f"{name}: {what[0]} must be a bfloat16, float16 or float32 tensor, got {describe(x)}")
    if x.dim() != 3 if weights else x.dim() < 1:
        raise ValueError(f"{name}: expected {what}, got shape {tuple(x.shape)}")
    if x.shape[1 if weights else -1] % BLOCK:
        raise ValueError(f"{name}: K must be a multiple of {BLOCK}, got {what} with shape {tuple(x.shape)}")


def _check_global_scale(g, t: torch.Tensor, name: str) -> None:
    """A 0-dim float tensor, or (E,) for a tensor t (E, ...) with one scale per leading index, on t's device."""
    if not isinstance(g, torch.Tensor) or not g.is_floating_point():
        raise TypeError(f"{name}: global_scale must be a floating-point tensor, got {describe(g)}")
    if not (g.dim() == 0 or (g.dim() == 1 and t.dim() >= 2 and g.shape[0] == t.shape[0])):
        raise ValueError(f"{name}: global_scale must be 0-dim, or (E,) for a tensor (E, ...), got "
                         f"{tuple(g.shape)} for {tuple(t.shape)}")
    if g.device != t.device:
        raise ValueError(f"{name}: global_scale is on {g.device} but the tensor is on {t.device}")


def _check_quantized(values, scales, global_scale, dtype, name: str) -> None:
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float4_e2m1fn_x2:
        raise TypeError(f"{name}: values must be a float4_e2m1fn_x2 tensor, got {describe(values)}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: scales must be a float8_e4m3fn tensor, got {describe(scales)}")
    if dtype not in IN_DTYPES:
        raise TypeError(f"{name}: dtype must be torch.float32, bfloat16 or float16, got {dtype}")
    if values.dim() < 1 or values.shape[:-1] != scales.shape[:-1] or values.shape[-1] != 8 * scales.shape[-1]:
        raise ValueError(f"{name}: values (..., K / 2) and scales (..., K / 16) do not match: "
                         f"{tuple(values.shape)} and {tuple(scales.shape)}")
    if values.device != scales.device:
        raise ValueError(f"{name}: values are on {values.device} but scales on {scales.device}")
    _check_global_scale(global_scale, values, name)


def _check_scales(scales, ndim: int, name: str) -> None:
    if not isinstance(scales, torch.Tensor) or scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"{name}: scales must be a float8_e4m3fn or uint8 tensor, got {describe(scales)}")
    if scales.dim() != ndim:
        want = "(rows, cols)" if ndim == 2 else "(E, rows, cols)"
        raise ValueError(f"{name}: scales must be {want}, got shape {tuple(scales.shape)}")


def _check_offs(offs, scales: torch.Tensor, name: str) -> None:
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        raise TypeError(f"{name}: offs must be a 1-D int32 tensor, got {describe(offs)}")
    if offs.device != scales.device:
        raise ValueError(f"{name}: offs is on {offs.device} but scales on {scales.device}")


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN as 0 and +-inf left out (as 0): what the global scale's amax sees."""
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def _block_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| in fp32 with NaN and +-inf as +inf: what a block's amax sees (an infinite amax marks a block
    with a non-finite value, which gets the NaN scale)."""
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.full_like(a, float("inf")))


def global_scale_ref(x: torch.Tensor, *, per_expert: bool = False) -> torch.Tensor:
    """amax(|x|) / (6 * 448) as fp32: a scalar, or with ``per_expert`` one per leading index (E,).
    An all-zero (or all non-finite) tensor gets 1.0, with which every value quantizes to 0."""
    a = _finite_abs(x)
    a = a.flatten(1) if per_expert else a.flatten()
    amax = F.pad(a, (0, 1)).amax(-1)  # a 0 beside the values: an empty tensor gets 1.0 too
    # A tensor divisor: CUDA torch turns division by a Python number into a multiplication by its
    # reciprocal, which can differ from the correctly rounded quotient in the last bit.
    return torch.where(amax > 0, amax / torch.full_like(amax, E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def e2m1_codes_ref(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scales) -> 4-bit e2m1 codes (uint8, sign in bit 3): round to
    nearest, ties to even, saturating at +-6; NaN -> +0."""
    v = v.float()
    mag = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=E2M1_MAX)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=v.device)
    code = torch.bucketize(mag.contiguous(), mids)  # mids[code - 1] < mag <= mids[code]
    tie = mag == mids[code.clamp(max=len(_MIDPOINTS) - 1)]
    code = torch.where(tie & (code % 2 == 1), code + 1, code)  # an odd code has mantissa 1: go up to even
    sign = (v < 0) & (code > 0)
    return (code + 8 * sign).to(torch.uint8)


# --------------------------------------------------------------------------------------------------
# stochastic rounding: Triton's Philox stream in torch, and the e2m1 rounding that draws from it
# --------------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_SEED_LIMIT = 2**63


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a (int64 in [0, 2^32)) and a 32-bit constant b: the product
    is below 2^64, and int64 multiplication keeps its 64 bits (two's complement wraparound), so an
    arithmetic shift and a mask give the high word."""
    p = a * b
    return (p >> 32) & _M32, p & _M32


def philox_ref(key: tuple[int, int], counter: tuple[torch.Tensor, ...], rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 (Salmon et al. 2011; Random123's ``philox4x32``), Triton's ``philox_impl``: a 64-bit
    key as two 32-bit words, four int64 tensors of 32-bit counter words -> four int64 tensors of
    32-bit output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi_b, lo_b = _mul32(c2, _PHILOX_ROUND[1])
        hi_a, lo_a = _mul32(c0, _PHILOX_ROUND[0])
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _M32, (k1 + _PHILOX_KEY[1]) & _M32
    return c0, c1, c2, c3


def random_bits_ref(seed: int, offset: int, shape, device=None) -> torch.Tensor:
    """The random stream of stochastic rounding, as an int64 tensor of 32-bit words of ``shape``
    (numel a multiple of 4): element i (row-major) takes word i % 4 of Triton's
    ``tl.randint4x(seed, offset + i // 4)`` (int64 counters: the high word in the second counter word)."""
    i = offset + torch.arange(math.prod(shape) // 4, dtype=torch.int64, device=device)
    zero = torch.zeros_like(i)
    words = philox_ref((seed & _M32, seed >> 32), (i & _M32, (i >> 32) & _M32, zero, zero))
    return torch.stack(words, -1).view(shape)


def e2m1_codes_sr_ref(v: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scales) and a 32-bit random word each (int64) -> 4-bit e2m1
    codes, stochastically rounded: the magnitude saturates at 6 (NaN -> 0), then rounds up to the next
    e2m1 magnitude with probability (|v| - lo) / (hi - lo), in the uniform u = (bits >> 8) * 2^-24 < that
    fraction. Exact in fp32 (``|v| - lo`` by Sterbenz, the gaps powers of two), so E[value] = v up to
    2^-24 of a gap."""
    v = v.float()
    mag = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=E2M1_MAX)
    grid = torch.tensor(E2M1_VALUES[1:], dtype=torch.float32, device=v.device)
    code = torch.bucketize(mag.contiguous(), grid, right=True)  # grid[code - 1] <= mag < grid[code]
    lo = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)[code]
    inv_gap = torch.where(code >= 6, 0.5, torch.where(code >= 4, 1.0, 2.0))
    u = (rbits >> 8).float() * 2.0**-24
    code = code + ((u < (mag - lo) * inv_gap) & (code < 7)).long()
    sign = (v < 0) & (code > 0)
    return (code + 8 * sign).to(torch.uint8)


def _check_rounding(rounding: str, seed: int, offset: int, numel: int, name: str) -> bool:
    """Whether ``rounding`` is stochastic; checks the mode and that seed and offset + numel fit 63 bits."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"{name}: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "nearest":
        return False
    if not (isinstance(seed, int) and isinstance(offset, int)) or isinstance(seed, bool) or isinstance(offset, bool):
        raise TypeError(f"{name}: seed and offset must be Python ints, got {type(seed).__name__} and "
                        f"{type(offset).__name__}")
    if not (0 <= seed < _SEED_LIMIT and 0 <= offset and offset + numel // 4 <= _SEED_LIMIT):
        raise ValueError(f"{name}: need 0 <= seed < 2^63 and 0 <= offset, offset + numel / 4 <= 2^63, got seed "
                         f"{seed}, offset {offset}, numel {numel}")
    return True


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


def _quantizing_scale(g: torch.Tensor) -> torch.Tensor:
    """A global scale as every quantizer uses it: a negative one, outside the format, as NaN (its blocks
    then get NaN scales and zero values, as for a NaN scale) and -0 as +0. The kernels read it the same
    way (``_kernels/nvfp4._read_global_scale``)."""
    return torch.where(g >= 0, g.abs(), torch.full_like(g, float("nan")))


def _quantize_blocks(
    blocks: torch.Tensor, g0: torch.Tensor, amax: torch.Tensor, rbits: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """blocks (..., K / 16, 16) fp32 with their amaxes (..., K / 16, 1; ``_block_abs``, +inf for a block
    with a non-finite value) -> (values, scales); with ``rbits`` (blocks' shape, int64 random words) the
    e2m1 rounding is stochastic."""
    g = _leading(_quantizing_scale(g0), blocks.dim())
    ratio = amax / (E2M1_MAX * g)
    # a NaN ratio (0 / 0, NaN / NaN) and a non-finite block as the positive NaN of the GPU, code 0x7F:
    # the CPU's 0 / 0 has the sign bit set
    ratio = torch.where(ratio.isnan() | amax.isinf(), torch.full_like(ratio, float("nan")), ratio)
    scales = ratio.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = scales.float() * g
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    q = blocks / safe
    codes = e2m1_codes_ref(q) if rbits is None else e2m1_codes_sr_ref(q, rbits)
    codes = torch.where(denom > 0, codes, torch.zeros_like(codes))
    return pack_ref(codes.flatten(-2)), scales.squeeze(-1)


def quantize_ref(
    x: torch.Tensor, global_scale: torch.Tensor | None = None, *, rounding: str = "nearest", seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, ...]:
    """x (..., K) bf16 / fp16 / fp32, K % 16 == 0 -> (values (..., K / 2) float4_e2m1fn_x2, scales
    (..., K / 16) float8_e4m3fn, global_scale). ``global_scale``: a 0-dim float tensor, or (E,) for x
    (E, ..., K) with one per expert (returned as fp32); computed from the whole of x when None.
    A global scale that is not positive and finite gives all-zero values (a negative one is read as NaN:
    ``_quantizing_scale``). ``rounding``: "nearest"
    (ties to even) or "stochastic" (``e2m1_codes_sr_ref``; element i of x's row-major order draws
    ``random_bits_ref(seed, offset, ...)[i]``, so a call uses Philox counters [offset, offset + numel / 4))."""
    _check_blocks(x, "nvfp4.quantize")
    stochastic = _check_rounding(rounding, seed, offset, x.numel(), "nvfp4.quantize")
    if global_scale is not None:
        _check_global_scale(global_scale, x, "nvfp4.quantize")
    g0 = global_scale_ref(x) if global_scale is None else global_scale.float()
    blocks = x.float().unflatten(-1, (-1, BLOCK))  # (..., K / 16, 16)
    rbits = random_bits_ref(seed, offset, blocks.shape, x.device) if stochastic else None
    values, scales = _quantize_blocks(blocks, g0, _block_abs(blocks).amax(-1, keepdim=True), rbits)
    return values, scales, g0


def quantize_weights_ref(
    w: torch.Tensor, global_scale: torch.Tensor | None = None, *, block_2d: bool = False
) -> tuple[torch.Tensor, ...]:
    """Weights w (E, K, N) bf16 / fp16 / fp32, K % 16 == 0, quantized along K -> (values (E, N, K / 2),
    scales (E, N, K / 16), global_scale): the quantized ``w.mT``, K-major per expert. ``global_scale``:
    0-dim or (E,); None computes one per expert, (E,). ``block_2d``: 16 x 16 blocks (16 columns n x 16
    along K) share one scale, that of their amax (the NVFP4 training recipe's weight blocks; the last
    block of a partial N holds fewer columns); the scales keep the (E, N, K / 16) shape, repeated."""
    _check_blocks(w, "nvfp4.quantize_weights", weights=True)
    if global_scale is not None:
        _check_global_scale(global_scale, w, "nvfp4.quantize_weights")
    g0 = global_scale_ref(w, per_expert=True) if global_scale is None else global_scale.float()
    blocks = w.mT.float().unflatten(-1, (-1, BLOCK))  # (E, N, K / 16, 16)
    amax = _block_abs(blocks).amax(-1, keepdim=True)  # (E, N, K / 16, 1)
    if block_2d:
        n = amax.shape[1]
        tiles = F.pad(amax, (0, 0, 0, 0, 0, -n % BLOCK)).unflatten(1, (-1, BLOCK)).amax(2)  # (E, N / 16, K / 16, 1)
        amax = tiles.repeat_interleave(BLOCK, 1)[:, :n]
    values, scales = _quantize_blocks(blocks, g0, amax)
    return values, scales, g0


def dequantize_ref(
    values: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(values (..., K / 2) float4_e2m1fn_x2, scales (..., K / 16) float8_e4m3fn, global_scale () or (E,)
    for values (E, ..., K / 2)) -> x (..., K): (value * scale) * global_scale in fp32, then ``dtype``."""
    _check_quantized(values, scales, global_scale, dtype, "nvfp4.dequantize")
    v = e2m1_values_ref(unpack_ref(values)).unflatten(-1, (-1, BLOCK))
    return (v * scales.float()[..., None] * _leading(global_scale, v.dim())).flatten(-2).to(dtype)


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
    _check_scales(scales, 2, "nvfp4.to_blocked")
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
    _check_scales(scales, 2, "nvfp4.to_blocked_ragged")
    _check_offs(offs, scales, "nvfp4.to_blocked_ragged")
    m, cols = scales.shape
    e = offs.numel()
    bound = (-(-m // TILE_ROWS) + e) * TILE_ROWS
    padded = scales.new_zeros(bound, cols)
    ends = [int(v) for v in offs.tolist()]
    tile_ends = [int(v) for v in ragged_row_tiles(offs).tolist()]
    for g in range(e):
        start, end = (ends[g - 1] if g else 0), ends[g]
        dst = tile_ends[g - 1] if g else 0
        # tile by tile, as the kernel reads them: bad offs (past M, negative, decreasing) read no row
        # outside [0, M) and write no tile past the bound
        for row0 in range(start, end, TILE_ROWS):
            n = min(end - row0, TILE_ROWS, m - row0, bound - dst) if row0 >= 0 else 0
            if n > 0:
                padded[dst : dst + n] = scales[row0 : row0 + n]
            dst += TILE_ROWS
    return to_blocked_ref(padded)


def to_blocked_experts_ref(scales: torch.Tensor) -> torch.Tensor:
    """Per-expert weight scales (E, rows, cols) -> (E, blocked_size(rows, cols)): each expert's own tiles."""
    _check_scales(scales, 3, "nvfp4.to_blocked_experts")
    out = scales.new_zeros(scales.shape[0], blocked_size(*scales.shape[1:]))
    for e, s in enumerate(scales):
        out[e] = to_blocked_ref(s)
    return out


# --------------------------------------------------------------------------------------------------
# the gate/up layout of a fused SwiGLU
# --------------------------------------------------------------------------------------------------


def interleave8_ref(t: torch.Tensor) -> torch.Tensor:
    """(..., 2F) as [gate | up] halves -> gate/up interleaved by 8 columns: gate 0-7, up 0-7, gate 8-15, ...
    (F a multiple of 8), so that a 16-element scale block holds 8 gate and 8 up values."""
    if t.dim() == 0 or t.shape[-1] % (2 * INTERLEAVE):
        raise ValueError(f"interleave8_ref: the last dim must be a multiple of {2 * INTERLEAVE}, got shape "
                         f"{tuple(t.shape)}")
    f = t.shape[-1] // 2
    gate, up = t[..., :f].unflatten(-1, (-1, INTERLEAVE)), t[..., f:].unflatten(-1, (-1, INTERLEAVE))
    return torch.stack([gate, up], dim=-2).flatten(-3)


def deinterleave8_ref(t: torch.Tensor) -> torch.Tensor:
    """Inverse of ``interleave8_ref``: gate/up interleaved by 8 -> [gate | up] halves."""
    if t.dim() == 0 or t.shape[-1] % (2 * INTERLEAVE):
        raise ValueError(f"deinterleave8_ref: the last dim must be a multiple of {2 * INTERLEAVE}, got shape "
                         f"{tuple(t.shape)}")
    pairs = t.unflatten(-1, (-1, 2, INTERLEAVE))
    return torch.cat([pairs[..., 0, :].flatten(-2), pairs[..., 1, :].flatten(-2)], dim=-1)


# --------------------------------------------------------------------------------------------------
# launchers (byte tensors in and out: float4 / float8 travel as uint8 views)
# --------------------------------------------------------------------------------------------------


def _tile(k: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of the quantize, dequantize and amax kernels: BLOCK_M a multiple of 16 (the
    16 x 16 weight blocks), BLOCK_K a power of two >= 16 and no wider than K needs."""
    bm, bk = (16, 64) if config.is_interpreting() else (32, 128)
    return bm, min(bk, max(BLOCK, launch.next_power_of_2(k)))


def _tiles_per_program(tiles_per_row: int) -> int:
    """BLOCK_T of the layout kernels: 128 x 4 tiles (512 bytes each) per program."""
    return min(8 if config.is_interpreting() else 4, launch.next_power_of_2(max(tiles_per_row, 1)))


def global_scale_fwd(x3: torch.Tensor) -> torch.Tensor:
    """x3 (G, R, K) float, any strides -> (G,) fp32 global scales, ``global_scale_ref`` of each x3[g]:
    partial amaxes from a grid of programs, then one program per group reduces them. No sync."""
    groups, r, k = x3.shape
    bm, bk = _tile(k)
    programs = max(1, min(launch.cdiv(r, bm), launch.cdiv(4 * config.num_sms(x3.device), max(groups, 1))))
    gscale = config.empty((groups,), dtype=torch.float32, device=x3.device)
    if groups == 0:
        return gscale
    partial = config.empty((groups, programs), dtype=torch.float32, device=x3.device)
    launch.kernel(_amax_kernel)[(programs, groups)](x3, partial, r, k, *x3.stride(), BLOCK_R=bm, BLOCK_K=bk,
                                                   num_warps=4)
    launch.kernel(_global_scale_kernel)[(groups,)](partial, gscale, programs,
                                                   BLOCK_P=min(1024, launch.next_power_of_2(programs)))
    return gscale


def quantize_reads_words(x3: torch.Tensor) -> bool:
    """Whether the Gluon quantize kernel reads x3 (G, R, K) as 32-bit words of two elements (its bf16
    path, ``_kernels/nvfp4_gluon._quantize_words``): bf16 with a unit column stride, even strides and a
    4-byte aligned start. Other inputs go element by element, to the same bits."""
    return (x3.dtype == torch.bfloat16 and x3.stride(2) == 1 and x3.stride(0) % 2 == 0 and x3.stride(1) % 2 == 0
            and x3.data_ptr() % 4 == 0)


def quantize_fwd(x3: torch.Tensor, gscale: torch.Tensor, per_group: bool, block_2d: bool,
                 stochastic: bool = False, seed: int = 0, offset: int = 0):
    """x3 (G, R, K) float, any strides; gscale (G,) fp32 when ``per_group``, else (1,) -> (values
    (G * R, K / 2) uint8, scales (G * R, K / 16) uint8). ``block_2d``: 16 x 16 blocks over (R, K).
    ``stochastic``: element i of the (G * R, K) output rounds on word i % 4 of
    ``tl.randint4x(seed, offset + i // 4)``."""
    groups, r, k = x3.shape
    values = config.empty((groups * r, k // 2), dtype=torch.uint8, device=x3.device)
    scales = config.empty((groups * r, k // BLOCK), dtype=torch.uint8, device=x3.device)
    if values.numel() == 0:
        return values, scales
    if not block_2d and not stochastic and config.use_gluon_quantize(x3.device):
        from .._kernels.nvfp4_gluon import _quantize_rows_kernel

        bm, nb, warps = QUANTIZE_TILE  # 16 warps x 4 rows x 2 repeats; 8 blocks (128 elements) of a row
        tiles_k = launch.cdiv(k, 16 * nb)
        sms = config.num_sms(x3.device)
        words = quantize_reads_words(x3)
        if words:  # persistent over each group's tiles
            grid = (max(1, min(launch.cdiv(r, bm) * tiles_k, sms * QUANTIZE_WORDS_PROGRAMS_PER_SM // groups)), 1,
                    groups)
        else:  # persistent along the rows of each column tile
            grid = (max(1, min(launch.cdiv(r, bm), sms * QUANTIZE_PROGRAMS_PER_SM // (tiles_k * groups))), tiles_k,
                    groups)
        launch.kernel(_quantize_rows_kernel)[grid](
            x3, values, scales, gscale, r, k, *x3.stride(), int(per_group),
            BLOCK_M=bm, NB=nb, TPW_B=nb, WORDS=words,
            num_warps=warps,
        )
        return values, scales
    bm, bk = _tile(k)
    launch.kernel(_quantize_kernel)[(launch.cdiv(r, bm), launch.cdiv(k, bk), groups)](
        x3, values, scales, gscale,
        r, k, *x3.stride(),
        int(per_group),
        seed, offset,
        BLOCK_M=bm, BLOCK_K=bk, BLOCK_2D=block_2d, STOCHASTIC=stochastic,
        num_warps=4,
    )
    return values, scales


def dequantize_fwd(v3: torch.Tensor, s3: torch.Tensor, gscale: torch.Tensor, per_group: bool,
                   dtype: torch.dtype, packed: bool = False) -> torch.Tensor:
    """v3 (G, R, K / 2), s3 (G, R, K / 16) uint8, any strides; gscale as in ``quantize_fwd`` -> (G * R, K).
    ``packed``: v3 in ``nvfp4_gemm.pack_weights``'s order (K % 64 == 0)."""
    groups, r, half = v3.shape
    k = 2 * half
    out = config.empty((groups * r, k), dtype=dtype, device=v3.device)
    if out.numel() == 0:
        return out
    bm, bk = _tile(k)
    launch.kernel(_dequantize_kernel)[(launch.cdiv(r, bm), launch.cdiv(k, bk), groups)](
        v3, s3, gscale, out,
        r, k,
        *v3.stride(), *s3.stride(),
        int(per_group),
        BLOCK_M=bm, BLOCK_K=bk, PACKED=packed,
        num_warps=4,
    )
    return out


def to_blocked_fwd(s3: torch.Tensor) -> torch.Tensor:
    """s3 (E, rows, cols) uint8, any strides -> (E, blocked_size(rows, cols)) uint8."""
    e, rows, cols = s3.shape
    tiles_per_row = launch.cdiv(cols, TILE_COLS)
    out = config.empty((e, blocked_size(rows, cols)), dtype=torch.uint8, device=s3.device)
    if out.numel():
        bt = _tiles_per_program(tiles_per_row)
        launch.kernel(_to_blocked_kernel)[(launch.cdiv(rows, TILE_ROWS), launch.cdiv(tiles_per_row, bt), e)](
            s3, out, rows, cols, *s3.stride(), tiles_per_row, BLOCK_T=bt, num_warps=4
        )
    return out


def to_blocked_ragged_fwd(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """scales (M, cols) uint8, any strides; offs (E,) int32 -> the flat ragged layout, (ceil(M / 128) + E)
    row tiles: the grid covers that bound and each program finds its expert from offs on the device."""
    m, cols = scales.shape
    e = offs.numel()
    tiles_per_row = launch.cdiv(cols, TILE_COLS)
    row_tiles = launch.cdiv(m, TILE_ROWS) + e
    out = config.empty((row_tiles * tiles_per_row * TILE_ROWS * TILE_COLS,), dtype=torch.uint8, device=scales.device)
    if out.numel():
        bt = _tiles_per_program(tiles_per_row)
        launch.kernel(_to_blocked_ragged_kernel)[(row_tiles, launch.cdiv(tiles_per_row, bt))](
            scales, offs, out,
            m, cols, e, *scales.stride(), tiles_per_row,
            BLOCK_T=bt, BLOCK_E=launch.next_power_of_2(max(e, 1)),
            num_warps=4,
        )
    return out


# --------------------------------------------------------------------------------------------------
# custom ops: what torch.compile traces (eager calls skip the custom-op dispatch and call the launchers)
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("moekit::nvfp4_global_scale", mutates_args=())
def _global_scale_op(x3: torch.Tensor) -> torch.Tensor:
    return global_scale_fwd(x3)


@_global_scale_op.register_fake
def _(x3):
    return x3.new_empty((x3.shape[0],), dtype=torch.float32)


@torch.library.custom_op("moekit::nvfp4_quantize", mutates_args=())
def _quantize_op(
    x3: torch.Tensor, gscale: torch.Tensor, per_group: bool, block_2d: bool, stochastic: bool = False,
    seed: int = 0, offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fwd(x3, gscale, per_group, block_2d, stochastic, seed, offset)


@_quantize_op.register_fake
def _(x3, gscale, per_group, block_2d, stochastic=False, seed=0, offset=0):
    g, r, k = x3.shape
    return x3.new_empty((g * r, k // 2), dtype=torch.uint8), x3.new_empty((g * r, k // BLOCK), dtype=torch.uint8)


@torch.library.custom_op("moekit::nvfp4_dequantize", mutates_args=())
def _dequantize_op(
    v3: torch.Tensor, s3: torch.Tensor, gscale: torch.Tensor, per_group: bool, dtype: torch.dtype
) -> torch.Tensor:
    return dequantize_fwd(v3, s3, gscale, per_group, dtype)


@_dequantize_op.register_fake
def _(v3, s3, gscale, per_group, dtype):
    g, r, half = v3.shape
    return v3.new_empty((g * r, 2 * half), dtype=dtype)


@torch.library.custom_op("moekit::nvfp4_to_blocked", mutates_args=())
def _to_blocked_op(s3: torch.Tensor) -> torch.Tensor:
    return to_blocked_fwd(s3)


@_to_blocked_op.register_fake
def _(s3):
    return s3.new_empty((s3.shape[0], blocked_size(*s3.shape[1:])))


@torch.library.custom_op("moekit::nvfp4_to_blocked_ragged", mutates_args=())
def _to_blocked_ragged_op(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return to_blocked_ragged_fwd(scales, offs)


@_to_blocked_ragged_op.register_fake
def _(scales, offs):
    m, cols = scales.shape
    return scales.new_empty(((-(-m // TILE_ROWS) + offs.shape[0]) * blocked_size(TILE_ROWS, cols),))


# --------------------------------------------------------------------------------------------------
# public ops
# --------------------------------------------------------------------------------------------------


def device_scale(global_scale: torch.Tensor) -> torch.Tensor:
    """A given global scale as the kernels read it: fp32, 1-D, contiguous (no copy when it already is)."""
    return global_scale.float().reshape(-1).contiguous()


def quantize(
    x: torch.Tensor, global_scale: torch.Tensor | None = None, *, rounding: str = "nearest", seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Quantize activations x (..., K) bf16 / fp16 / fp32, K % 16 == 0, to NVFP4 -> (values (..., K / 2)
    float4_e2m1fn_x2, scales (..., K / 16) float8_e4m3fn, global_scale fp32), bit for bit
    ``quantize_ref``.

    ``global_scale``: a 0-dim float tensor, or (E,) for x (E, ..., K) with one per leading index, on x's
    device; returned as given (as fp32). With None it is computed on the device (``global_scale_ref``
    of all of x) and returned 0-dim. No host sync either way; with a given scale, CUDA-graph safe.
    A given scale is not checked on the device: 0, inf, NaN and negative scales give all-zero values and
    the block scales of ``quantize_ref`` (a negative scale is outside the format and is read as NaN, -0
    as +0).

    ``rounding="stochastic"`` (gradients): each value rounds to one of its two neighbouring e2m1 values
    with probability proportional to its distance from the other, so the quantization is unbiased;
    element i (x's row-major order) draws word i % 4 of Philox ``tl.randint4x(seed, offset + i // 4)``.
    Python ints ``0 <= seed < 2^63``, ``offset >= 0``: the same (seed, offset) gives the same bits; a
    caller that advances ``offset`` by ``x.numel() // 4`` per call never reuses a random number. Scales,
    saturation and underflow are those of round-to-nearest, so the rounding is unbiased except where a
    block's e4m3 scale rounded down and its largest values saturate at 6 (up to ~6% toward zero)."""
    _check_blocks(x, "nvfp4.quantize")
    stochastic = _check_rounding(rounding, seed, offset, x.numel(), "nvfp4.quantize")
    if global_scale is not None:
        _check_global_scale(global_scale, x, "nvfp4.quantize")
    if not config.uses_triton(x.device):
        return quantize_ref(x, global_scale, rounding=rounding, seed=seed, offset=offset)
    k = x.shape[-1]
    per_group = global_scale is not None and global_scale.dim() == 1
    lead = x.shape[0] if per_group else 1
    x3 = x.reshape(lead, math.prod(x.shape[:-1]) // max(lead, 1), k)  # (G, R, K)
    if global_scale is not None:
        gscale = device_scale(global_scale)
    else:
        gscale = traced_or_eager(_global_scale_op, global_scale_fwd, x3)
    values, scales = traced_or_eager(_quantize_op, quantize_fwd, x3, gscale, per_group, False, stochastic, seed, offset)
    g_out = global_scale.float() if global_scale is not None else gscale.reshape(())
    return (values.view(torch.float4_e2m1fn_x2).view(*x.shape[:-1], k // 2),
            scales.view(torch.float8_e4m3fn).view(*x.shape[:-1], k // BLOCK), g_out)


def quantize_weights(
    w: torch.Tensor, global_scale: torch.Tensor | None = None, *, block_2d: bool = False
) -> tuple[torch.Tensor, ...]:
    """Quantize expert weights w (E, K, N) bf16 / fp16 / fp32, K % 16 == 0, along K -> (values
    (E, N, K / 2) float4_e2m1fn_x2, scales (E, N, K / 16) float8_e4m3fn, global_scale), bit for bit
    ``quantize_weights_ref``: the NVFP4 tensor of ``w.mT``, K-major per expert, whatever w's strides.

    ``global_scale``: 0-dim or (E,) float, on w's device; None computes one per expert on the device,
    (E,) fp32. ``block_2d``: 16 x 16 blocks share one scale (the NVFP4 training recipe's weights)."""
    _check_blocks(w, "nvfp4.quantize_weights", weights=True)
    if global_scale is not None:
        _check_global_scale(global_scale, w, "nvfp4.quantize_weights")
    if not config.uses_triton(w.device):
        return quantize_weights_ref(w, global_scale, block_2d=block_2d)
    e, k, n = w.shape
    x3 = w.mT  # (E, N, K): the kernel reads any strides
    if global_scale is None:
        gscale = g_out = traced_or_eager(_global_scale_op, global_scale_fwd, x3)
        per_group = True
    else:
        gscale, g_out, per_group = device_scale(global_scale), global_scale.float(), global_scale.dim() == 1
    values, scales = traced_or_eager(_quantize_op, quantize_fwd, x3, gscale, per_group, block_2d)
    return (values.view(torch.float4_e2m1fn_x2).view(e, n, k // 2),
            scales.view(torch.float8_e4m3fn).view(e, n, k // BLOCK), g_out)


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(values (..., K / 2) float4_e2m1fn_x2, scales (..., K / 16) float8_e4m3fn, global_scale () or (E,)
    for values (E, ..., K / 2)) -> x (..., K) in ``dtype`` (fp32, bf16 or fp16), bit for bit
    ``dequantize_ref``: (value * scale) * global_scale in fp32, then one rounding to ``dtype``."""
    _check_quantized(values, scales, global_scale, dtype, "nvfp4.dequantize")
    if not config.uses_triton(values.device):
        return dequantize_ref(values, scales, global_scale, dtype=dtype)
    half = values.shape[-1]
    per_group = global_scale.dim() == 1
    lead = values.shape[0] if per_group else 1
    rows = math.prod(values.shape[:-1]) // max(lead, 1)
    v3 = values.view(torch.uint8).reshape(lead, rows, half)
    s3 = scales.view(torch.uint8).reshape(lead, rows, half // 8)
    out = traced_or_eager(_dequantize_op, dequantize_fwd, v3, s3, device_scale(global_scale), per_group, dtype)
    return out.view(*values.shape[:-1], 2 * half)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Scales (rows, cols) float8_e4m3fn (or uint8) -> the flat tiled layout, ``blocked_size(rows, cols)``
    elements of the same dtype, padding 0: bit for bit ``to_blocked_ref``."""
    _check_scales(scales, 2, "nvfp4.to_blocked")
    if not config.uses_triton(scales.device):
        return to_blocked_ref(scales)
    return traced_or_eager(_to_blocked_op, to_blocked_fwd, scales.view(torch.uint8)[None]).view(scales.dtype).view(-1)


def to_blocked_experts(scales: torch.Tensor) -> torch.Tensor:
    """Per-expert weight scales (E, rows, cols) -> (E, blocked_size(rows, cols)), each expert's own tiles:
    bit for bit ``to_blocked_experts_ref``."""
    _check_scales(scales, 3, "nvfp4.to_blocked_experts")
    if not config.uses_triton(scales.device):
        return to_blocked_experts_ref(scales)
    return traced_or_eager(_to_blocked_op, to_blocked_fwd, scales.view(torch.uint8)).view(scales.dtype)


def to_blocked_ragged(scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Scales (M, cols) of expert-sorted rows and ``offs`` (E,) int32 cumulative row ends (non-decreasing,
    offs[-1] <= M, read on the device only) -> the tiled layout with each expert's rows starting a new
    128-row tile, sized for the static bound of (ceil(M / 128) + E) row tiles; rows past offs[-1] and
    the unused tiles are not laid out (zeros). Bit for bit ``to_blocked_ragged_ref``; no host sync."""
    _check_scales(scales, 2, "nvfp4.to_blocked_ragged")
    _check_offs(offs, scales, "nvfp4.to_blocked_ragged")
    offs = offs.contiguous()  # the kernels read offs by position: a strided view becomes a copy
    if not config.uses_triton(scales.device):
        return to_blocked_ragged_ref(scales, offs)
    out = traced_or_eager(_to_blocked_ragged_op, to_blocked_ragged_fwd, scales.view(torch.uint8), offs)
    return out.view(scales.dtype)

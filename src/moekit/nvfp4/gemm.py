"""``grouped_mm_nvfp4``: the rows-ragged (2D x 3D) grouped GEMM on NVFP4 operands, forward only; and
``grouped_mm_nvfp4_wgrad``, the ragged-K form that weight gradients take (at the end of this file).

Reads as: reference (``grouped_mm_nvfp4_ref``) -> kernels (``_kernels/nvfp4_gemm.py``, and
``_kernels/nvfp4_gemm_ws.py`` on sm_90) -> launcher (``grouped_mm_nvfp4_fwd``) -> custom op
``moekit::grouped_mm_nvfp4`` with a fake -> public ``grouped_mm_nvfp4``. No autograd: the op is a
forward GEMM (inference, or the forward pass of an NVFP4 training step whose backward runs elsewhere);
its inputs are integer-coded and carry no gradient.

Hopper has no FP4 tensor cores, so the kernels emulate them: it reads the packed operands (a quarter
of bf16's bytes, plus 1/16 for the scales), decodes them exactly to f16 in registers (inline PTX, sm_89
and newer; bf16 elsewhere) and multiplies on the tensor cores with fp32 accumulation (why the decode is
exact: ``_kernels/nvfp4_gemm.py``). With few rows per expert (the transposed tile) the rows are decoded
once beforehand and only the weights in the kernel: on sm_90 with packed weights
(``pack_weights``) a warp-specialized Gluon kernel streams them through shared memory
(``_kernels/nvfp4_gemm_ws.py``), elsewhere the Triton kernel loads them into registers. With many rows per expert (above
``config.NVFP4_DECODE_ROWS`` on average) the GEMM is compute-bound and decoding in the main loop
would repeat each decode per tile: both operands are dequantized to bf16 first (exact) and the bf16
rows-ragged GEMM applies the global scales to its fp32 accumulator.

Legend: M rows (tokens routed to experts, expert-sorted), N output columns, K reduction length,
E experts.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from .. import config, launch
from .._kernels.nvfp4_gemm import _grouped_mm_nvfp4_kernel
from ..dispatch import traced_or_eager
from ..grouped_gemm import grouped_mm, ragged_m
from ..reference import group_bounds
from .formats import BLOCK, dequantize, dequantize_fwd, e2m1_values_ref, unpack_ref

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP4, E4M3 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn

# --------------------------------------------------------------------------------------------------
# input checks: the reference and the kernel path raise the same errors
# --------------------------------------------------------------------------------------------------

_NAME = "grouped_mm_nvfp4"


def describe(t) -> str:
    return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _check_dtype(t, name: str, dtype: torch.dtype, op: str = _NAME) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise TypeError(f"{op}: {name} must be a {dtype} tensor, got {describe(t)}")


def check_inputs(a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out_dtype,
                 w_packed: bool = False) -> None:
    """Dtypes, shapes, K % 16 (K % 64 and contiguous weights when ``w_packed``) and devices: everything
    that needs no host sync (see ``grouped_mm_nvfp4``)."""
    for t, name, dtype in (
        (a_values, "a_values", FP4), (a_scales, "a_scales", E4M3), (a_global, "a_global", torch.float32),
        (w_values, "w_values", FP4), (w_scales, "w_scales", E4M3), (w_global, "w_global", torch.float32),
        (offs, "offs", torch.int32),
    ):
        _check_dtype(t, name, dtype)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{_NAME}: out_dtype must be torch.bfloat16, float16 or float32, got {out_dtype}")
    if a_values.dim() != 2 or w_values.dim() != 3:
        raise ValueError(f"{_NAME}: expected a_values (M, K / 2) and w_values (E, N, K / 2), got "
                         f"{tuple(a_values.shape)} and {tuple(w_values.shape)}")
    k = 2 * a_values.shape[1]
    if k % BLOCK:
        raise ValueError(f"{_NAME}: K must be a multiple of {BLOCK}, got K = {k} (a_values {tuple(a_values.shape)})")
    if w_values.shape[2] != a_values.shape[1]:
        raise ValueError(f"{_NAME}: K mismatch, a_values {tuple(a_values.shape)} vs w_values {tuple(w_values.shape)}")
    m, (e, n, _) = a_values.shape[0], w_values.shape
    for t, name, want in ((a_scales, "a_scales", (m, k // BLOCK)), (w_scales, "w_scales", (e, n, k // BLOCK))):
        if tuple(t.shape) != want:
            raise ValueError(f"{_NAME}: {name} must be {want} (one scale per {BLOCK} elements along K), "
                             f"got {tuple(t.shape)}")
    if a_global.dim() != 0:
        raise ValueError(f"{_NAME}: a_global must be 0-dim, got shape {tuple(a_global.shape)}")
    if tuple(w_global.shape) != (e,):
        raise ValueError(f"{_NAME}: w_global must be (E,) = ({e},), got shape {tuple(w_global.shape)}")
    if offs.dim() != 1 or offs.shape[0] != e:
        raise ValueError(f"{_NAME}: offs must be 1-D with E = {e} entries, got shape {tuple(offs.shape)}")
    if e == 0:
        raise ValueError(f"{_NAME}: there must be at least one expert (E >= 1)")
    if w_packed:
        _check_packable(w_values, _NAME)
    for t, name in ((a_scales, "a_scales"), (a_global, "a_global"), (w_values, "w_values"),
                    (w_scales, "w_scales"), (w_global, "w_global"), (offs, "offs")):
        if t.device != a_values.device:
            raise ValueError(f"{_NAME}: {name} is on {t.device} but a_values on {a_values.device}")


def _check_pack_k(values, name: str) -> None:
    if not isinstance(values, torch.Tensor) or values.dtype not in (FP4, torch.uint8) or values.dim() < 1:
        raise TypeError(f"{name}: expected NVFP4 codes (..., K / 2) as {FP4} or uint8, got {describe(values)}")
    if values.shape[-1] % PACK_CHUNK:
        raise ValueError(f"{name}: packed weights need K a multiple of {2 * PACK_CHUNK}, got K = "
                         f"{2 * values.shape[-1]} ({tuple(values.shape)})")


def _check_packable(w_values, name: str) -> None:
    _check_pack_k(w_values, name)
    if not w_values.is_contiguous():
        raise ValueError(f"{name}: packed weights must be contiguous, as pack_weights returns them; got strides "
                         f"{w_values.stride()} for w_values {tuple(w_values.shape)}")
    if w_values.storage_offset() % 16:  # the kernel reads them as aligned 32-bit words
        raise ValueError(f"{name}: packed weights must start 16-byte aligned in their storage, got a storage "
                         f"offset of {w_values.storage_offset()} bytes")


# --------------------------------------------------------------------------------------------------
# the packed weight order
# --------------------------------------------------------------------------------------------------

PACK_CHUNK = 32  # bytes (64 elements, four scale blocks) per permuted chunk of a row
# The sign bits of a packed 32-bit word: code k (bits 4k..4k+3 of the word) keeps its magnitude in bits
# 4k..4k+2 and has its sign moved from bit 4k+3 (K_ORDER_SIGN_BITS[k]) to PACKED_SIGN_BITS[k]: the signs
# of codes 0-3 to the top bits of bytes 0-3, those of codes 4-7 to bit 3 of bytes 0-3.
K_ORDER_SIGN_BITS = (3, 7, 11, 15, 19, 23, 27, 31)
PACKED_SIGN_BITS = (7, 15, 23, 31, 3, 11, 19, 27)


def _move_signs(b: torch.Tensor, src: tuple, dst: tuple) -> torch.Tensor:
    """uint8 codes (..., K / 2), read as 32-bit words: each word's sign bits moved from bits ``src[k]`` to
    ``dst[k]``, the magnitudes kept. In int32, two temporaries the size of the codes."""
    b = b.contiguous()
    if b.storage_offset() % 4:  # a word view needs 4-byte alignment
        b = b.clone()
    w = b.view(torch.int32)
    out = w & 0x77777777
    bit = torch.empty_like(w)
    for k in range(8):  # (an arithmetic shift: the mask keeps the one bit)
        torch.bitwise_right_shift(w, src[k], out=bit)
        bit &= 1
        bit <<= dst[k]
        out |= bit
    return out.view(torch.uint8)


def pack_weights(w_values: torch.Tensor) -> torch.Tensor:
    """NVFP4 weight codes (..., N, K / 2) ``float4_e2m1fn_x2`` (or uint8) -> the same codes in the order
    the GEMM's Hopper kernels read fastest, contiguous, same shape and dtype; K a multiple of 64.

    Two steps, on each row:

    - the bytes: within each 32-byte chunk (64 elements, four scale blocks), byte ``8g + 4h + t`` (block
      g, its half h, t in 0-3) moves to ``8t + 2g + h``. In the wgmma register layout that the decoded
      weights feed, thread t of a quad holds bytes t and t + 4 of every block; after packing they are
      8 consecutive bytes, which the kernels load as two 32-bit words;
    - the signs: in each 32-bit word (eight codes, code k in bits 4k..4k+3) the sign of code k moves
      from bit 4k + 3 to ``PACKED_SIGN_BITS[k]`` (codes 0-3: the top bit of bytes 0-3; codes 4-7: bit
      3 of bytes 0-3), so that the decode ors them straight into the table lookups of codes 0-3 and
      4-7 (``_kernels/nvfp4_gemm_ws.py``).

    Pure PyTorch, any device; ``unpack_weights`` inverts it. The scales keep their layout."""
    _check_pack_k(w_values, "pack_weights")
    b = w_values.view(torch.uint8)
    chunks = b.unflatten(-1, (-1, 4, 2, 4))  # (..., chunk, g, h, t)
    b = chunks.permute(*range(b.dim() - 1), -4, -1, -3, -2).contiguous().flatten(-4)
    return _move_signs(b, K_ORDER_SIGN_BITS, PACKED_SIGN_BITS).view(w_values.dtype)


def unpack_weights(w_values: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_weights``: packed codes (..., N, K / 2) -> the K-ordered codes, contiguous."""
    _check_pack_k(w_values, "unpack_weights")
    b = _move_signs(w_values.view(torch.uint8), PACKED_SIGN_BITS, K_ORDER_SIGN_BITS)
    chunks = b.unflatten(-1, (-1, 4, 4, 2))  # (..., chunk, t, g, h)
    return chunks.permute(*range(b.dim() - 1), -4, -2, -1, -3).contiguous().flatten(-4).view(w_values.dtype)


# --------------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------------


def _decode64(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., K / 2) e2m1 codes and (..., K / 16) e4m3 scales -> (..., K) float64 value * scale (exact)."""
    v = e2m1_values_ref(unpack_ref(values)).double().unflatten(-1, (-1, BLOCK))
    return (v * scales.double()[..., None]).flatten(-2)


def grouped_mm_nvfp4_ref(
    a_values: torch.Tensor,
    a_scales: torch.Tensor,
    a_global: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor,
    w_global: torch.Tensor,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    w_packed: bool = False,
) -> torch.Tensor:
    """Reference for ``grouped_mm_nvfp4`` (same arguments, same errors): the operands decoded to
    ``e2m1 value * e4m3 scale`` in float64 (exact), one float64 matmul per expert, times
    ``a_global * w_global[g]`` in float64, one rounding to ``out_dtype``. Rows past offs[-1] are 0.
    Reads ``offs`` on the host (a sync; the kernel path never does)."""
    check_inputs(a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out_dtype, w_packed)
    if w_packed:
        w_values = unpack_weights(w_values)
    m, n = a_values.shape[0], w_values.shape[1]
    a = _decode64(a_values, a_scales)  # (M, K)
    out = torch.zeros(m, n, dtype=torch.float64, device=a_values.device)
    for g, (start, end) in enumerate(group_bounds(offs, m)):
        if end > start:
            w = _decode64(w_values[g], w_scales[g])  # (N, K), one expert at a time
            out[start:end] = (a[start:end] @ w.T) * (a_global.double() * w_global[g].double())
    return out.to(out_dtype)


# --------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------

_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A () fp32 tensor holding 1 on ``device``, made once per device (not during a CUDA-graph capture,
    whose memory pool would own it: a capture that comes first makes its own)."""
    one = _ONES.get(device)
    if one is None:
        one = torch.ones((), dtype=torch.float32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _ONES[device] = one
    return one


def _decode_rows(a_values, a_scales, dtype: torch.dtype) -> torch.Tensor:
    """Validated activations (M, K / 2), scales (M, K / 16) -> value * block scale (M, K) in ``dtype``
    (exact): ``nvfp4.dequantize`` with a global scale of 1, launched directly (the inputs are checked,
    and the op is already inside this one's custom op)."""
    v3 = a_values.view(torch.uint8)[None]
    s3 = a_scales.view(torch.uint8)[None]
    return dequantize_fwd(v3, s3, _one(a_values.device), False, dtype)


def _dequantized_mm(a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out_dtype, w_packed):
    """Many rows per expert: both operands dequantized to bf16 with a global scale of 1 (value * block
    scale, exact), the bf16 rows-ragged GEMM, and ``a_global * w_global[g]`` on its fp32 accumulator
    (``group_scale``): the emulated kernel's numbers, from bf16 tensor-core GEMM speed. Temporaries:
    A (M, K) and the weights (E, N, K) in bf16."""
    one = _one(a_values.device)
    a = dequantize(a_values.view(FP4), a_scales.view(E4M3), one, dtype=torch.bfloat16)
    if w_packed:  # read in the packed order (contiguous, checked)
        e, n, half = w_values.shape
        v3 = w_values.view(torch.uint8).view(1, e * n, half)
        s3 = w_scales.view(torch.uint8).reshape(1, e * n, -1)
        w = dequantize_fwd(v3, s3, one, False, torch.bfloat16, packed=True).view(e, n, 2 * half)
    else:
        w = dequantize(w_values.view(FP4), w_scales.view(E4M3), one, dtype=torch.bfloat16)  # (E, N, K)
    scale = a_global * w_global  # (E,) fp32, the product the kernel forms
    return ragged_m(a, w.mT, offs, out_dtype, None, group_scale=scale)


def ws_ok(a_values, w_values, w_scales, w_packed: bool) -> bool:
    """Whether the warp-specialized Hopper kernel (``_kernels/nvfp4_gemm_ws.py``) can run: sm_90 with
    Gluon and the PTX decode, packed weights, and scales it can read as 32-bit words (contiguous, K a
    multiple of 64, 4-byte aligned)."""
    return (w_packed and config.use_warp_specialized(a_values.device)
            and config.use_nvfp4_ptx_decode(a_values.device)
            and w_scales.is_contiguous() and w_scales.storage_offset() % 4 == 0
            and w_values.shape[2] % PACK_CHUNK == 0)


@functools.cache
def _ws_layouts(block_m: int):
    """The shared-memory layouts of the warp-specialized kernel's TMA boxes (built once: each costs host
    time): the f16 activations' [block_m, 64] box, 128-byte swizzle, and the weight bytes' [128, 32]
    box, unswizzled."""
    from triton.experimental.gluon import language as gl

    return (gl.NVMMASharedLayout.get_default_for([block_m, 64], gl.float16),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))


def _ws_mm(a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out, cfg: config.TileConfig):
    """The warp-specialized kernel into ``out`` (M, N) on inputs that ``ws_ok`` takes, M, N, K > 0: A
    decoded once to f16 beforehand (exact), the packed weights and their scale words streamed through
    a ring of ``cfg.num_stages`` shared-memory stages of ``cfg.block_k / 64`` chunks; tiles of 128
    weight rows by ``cfg.block_m`` (16, 32 or 64) expert rows."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from .._kernels import hopper_gemm as hk  # Gluon: imported only where it runs
    from .._kernels.nvfp4_gemm_ws import _grouped_mm_nvfp4_ws_kernel

    (m, half), (e, n, _) = a_values.shape, w_values.shape
    k, bm = 2 * half, cfg.block_m
    av = _decode_rows(a_values, a_scales, torch.float16)
    a_layout, w_layout = _ws_layouts(bm)
    a_desc = GluonDescriptor(av, [m, k], [k, 1], [bm, 64], a_layout)
    wv = w_values.view(torch.uint8).reshape(e * n, half)
    w_desc = GluonDescriptor(wv, [e * n, half], [half, 1], [128, 32], w_layout)
    ws = w_scales.view(torch.uint8).reshape(e * n, k // BLOCK).view(torch.int32)
    max_row_tiles = launch.cdiv(m, bm) + e
    table = torch.empty(4 * (max_row_tiles + 1), dtype=torch.int32, device=a_values.device)
    # (the tile table's kernel also zeroes the rows past offs[-1])
    launch.kernel(hk._tile_table_kernel)[(max(launch.cdiv(max_row_tiles, 32), 8),)](
        offs, table, out, out, m, n, 0, e, out.stride(0), out.stride(0), max_row_tiles,
        BLOCK_M=bm, BLOCK_E=launch.next_power_of_2(e + 1), BLOCK_T=32, BLOCK_Z=32, ZERO_TAIL=True, num_warps=4,
    )
    programs = config.num_sms(a_values.device) * cfg.programs_per_sm
    launch.kernel(_grouped_mm_nvfp4_ws_kernel)[(min(programs, max_row_tiles * launch.cdiv(n, 128)),)](
        a_desc, w_desc, ws, a_global, w_global, w_global.stride(0), out, out.stride(0), table, n, k,
        NUM_PROGRAMS=programs, GROUP_M=1, STAGES=cfg.num_stages, CHUNKS=cfg.block_k // 64,
        REGS=cfg.max_registers, num_warps=4, maxnreg=cfg.max_registers,
    )
    return out


def grouped_mm_nvfp4_fwd(
    a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out_dtype, w_packed: bool = False,
    cfg: config.TileConfig | None = None,
) -> torch.Tensor:
    """Launch the kernel on validated inputs; float4 / float8 tensors or their uint8 views (any strides,
    the output's column stride 1; packed weights contiguous). ``cfg`` pins a tile (tests); BLOCK_K must
    be a power of two >= 16, and a multiple of 64 with packed weights (for a warp-specialized tile, a
    positive multiple of 64: 64 per chunk of a ring stage)."""
    (m, half), (e, n, _) = a_values.shape, w_values.shape
    k = 2 * half
    out = config.empty((m, n), dtype=out_dtype, device=a_values.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if cfg is None and config.nvfp4_gemm_dequantizes(m, e):
        return _dequantized_mm(a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out_dtype, w_packed)
    ptx = config.use_nvfp4_ptx_decode(a_values.device)
    ws = ws_ok(a_values, w_values, w_scales, w_packed)
    cfg = cfg or config.nvfp4_gemm_config(m, e, a_values.device, w_packed, ptx, ws)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    if cfg.warp_specialized:
        if not ws or bn != 128 or bk < 64 or bk % 64 or bm not in (16, 32, 64) or not cfg.max_registers:
            raise ValueError(f"{_NAME}: the warp-specialized kernel needs sm_90 with the PTX decode, packed weights "
                             f"with contiguous 4-byte-aligned scales, and a tile of 16, 32 or 64 rows by 128 with "
                             f"block_k a positive multiple of 64 and max_registers; got {cfg}")
        return _ws_mm(a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out, cfg)
    if bk % BLOCK or bk & (bk - 1):
        raise ValueError(f"{_NAME}: block_k must be a power of two and a multiple of {BLOCK}, got {bk}")
    if w_packed and bk % (2 * PACK_CHUNK):
        raise ValueError(f"{_NAME}: packed weights need block_k a multiple of {2 * PACK_CHUNK}, got {bk}")
    max_tiles = (launch.cdiv(m, bm) + e + 1) * launch.cdiv(n, bn)  # each expert adds <= 1 partial row tile
    programs = min(config.num_sms(a_values.device) * cfg.programs_per_sm, max_tiles)
    op_dtype = torch.float16 if ptx else torch.float32 if config.is_interpreting() else torch.bfloat16
    if cfg.swap:  # A decoded once (exact: value * block scale), not once per column tile
        av = asc = _decode_rows(a_values, a_scales, op_dtype)
    else:
        av, asc = a_values.view(torch.uint8), a_scales.view(torch.uint8)
    wv, wsc = w_values.view(torch.uint8), w_scales.view(torch.uint8)
    launch.kernel(_grouped_mm_nvfp4_kernel)[(programs,)](
        av, asc, a_global,
        wv, wsc, w_global,
        out, offs,
        m, n, k, e,
        *av.stride(), *asc.stride(),
        *wv.stride(), *wsc.stride(), w_global.stride(0),
        out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=cfg.group_m, BLOCK_E=launch.next_power_of_2(e + 1),
        OP_DTYPE={torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[op_dtype],
        PTX=ptx, W_PACKED=w_packed, SWAP=cfg.swap, A_DECODED=cfg.swap, NUM_STAGES=cfg.num_stages,
        W_PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )
    return out


# --------------------------------------------------------------------------------------------------
# custom op: what torch.compile traces (float4 / float8 travel as uint8 views)
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("moekit::grouped_mm_nvfp4", mutates_args=())
def _grouped_mm_nvfp4_op(
    a_values: torch.Tensor, a_scales: torch.Tensor, a_global: torch.Tensor,
    w_values: torch.Tensor, w_scales: torch.Tensor, w_global: torch.Tensor,
    offs: torch.Tensor, out_dtype: torch.dtype, w_packed: bool,
) -> torch.Tensor:
    return grouped_mm_nvfp4_fwd(a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out_dtype,
                                w_packed)


@_grouped_mm_nvfp4_op.register_fake
def _(a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out_dtype, w_packed):
    return a_values.new_empty((a_values.shape[0], w_values.shape[1]), dtype=out_dtype)


# --------------------------------------------------------------------------------------------------
# public op
# --------------------------------------------------------------------------------------------------


def grouped_mm_nvfp4(
    a_values: torch.Tensor,
    a_scales: torch.Tensor,
    a_global: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor,
    w_global: torch.Tensor,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    w_packed: bool = False,
) -> torch.Tensor:
    """Grouped GEMM of NVFP4 activations with NVFP4 expert weights, rows ragged by expert. Forward only.

    ``out[offs[g-1]:offs[g]] = dequant(a)[offs[g-1]:offs[g]] @ dequant(w[g])^T`` (offs[-1] := 0 before
    the first group) -> (M, N) ``out_dtype`` (bf16 by default, fp16 or fp32); rows at or past
    ``offs[-1]`` are **zero**, as in ``moekit.grouped_mm``.

    Operands, all on one device (K a multiple of 16; each block of 16 consecutive elements along K
    shares one scale; codes packed two per byte, the even element in the low nibble):

    - ``a_values`` (M, K / 2) ``float4_e2m1fn_x2``, ``a_scales`` (M, K / 16) ``float8_e4m3fn`` in plain
      row-major form (not the swizzled tile layout), ``a_global`` 0-dim fp32: the activations, quantized
      along K, expert-sorted rows, as ``nvfp4.quantize(x)`` returns them for x (M, K);
    - ``w_values`` (E, N, K / 2), ``w_scales`` (E, N, K / 16), ``w_global`` (E,) fp32: each expert's
      (K, N) weight quantized along K and stored K-major, as ``nvfp4.quantize_weights(w)`` returns them
      for w (E, K, N);
    - ``offs`` (E,) int32 cumulative row ends on the device, non-decreasing, offs[-1] <= M (never read
      by the host; out-of-range values are clamped as in ``grouped_mm``).

    ``w_packed=True``: ``w_values`` comes from ``pack_weights`` (K a multiple of 64, contiguous), whose
    order the Hopper kernels read with word loads and decode a word at a time (on sm_90 the
    warp-specialized kernel, ``_kernels/nvfp4_gemm_ws.py``); pack the weights once and reuse them.
    Otherwise any strides are accepted.

    Numerics: ``e2m1 * e4m3`` products are exact in f16 and bf16, so the result is
    ``sum_K (a value * a scale) * (w value * w scale)`` accumulated in fp32, times
    ``a_global * w_global[g]`` in fp32, rounded once to ``out_dtype``; ``grouped_mm_nvfp4_ref`` computes
    the same in float64. A NaN scale code (0x7F / 0xFF, which ``nvfp4.quantize`` writes for a block
    holding a NaN or an inf) gives NaN in its rows.

    Runs the Triton kernels on CUDA (and under ``TRITON_INTERPRET=1``): no host sync, CUDA-graph safe;
    above 64 rows per expert on average with bf16 temporaries of A (M, K) and the weights (E, N, K);
    elsewhere (or with the ``reference`` option) the pure-PyTorch ``grouped_mm_nvfp4_ref``. Under
    torch.compile it is the custom op ``moekit::grouped_mm_nvfp4``.
    """
    check_inputs(a_values, a_scales, a_global, w_values, w_scales, w_global, offs, out_dtype, w_packed)
    offs = offs.contiguous()  # the kernels read offs by position: a strided view becomes a copy
    if not config.uses_triton(a_values.device):
        return grouped_mm_nvfp4_ref(a_values, a_scales, a_global, w_values, w_scales, w_global, offs,
                                    out_dtype=out_dtype, w_packed=w_packed)
    args = (a_values.view(torch.uint8), a_scales.view(torch.uint8), a_global,
            w_values.view(torch.uint8), w_scales.view(torch.uint8), w_global, offs, out_dtype, w_packed)
    return traced_or_eager(_grouped_mm_nvfp4_op, grouped_mm_nvfp4_fwd, *args)


# --------------------------------------------------------------------------------------------------
# the ragged-K form: weight gradients
# --------------------------------------------------------------------------------------------------

_WGRAD = "grouped_mm_nvfp4_wgrad"


def check_wgrad_inputs(a_values, a_scales, a_global, b_values, b_scales, b_global, offs, out_dtype) -> None:
    """Dtypes, shapes, T % 16 and devices of ``grouped_mm_nvfp4_wgrad`` (no host sync)."""
    for t, name, dtype in (
        (a_values, "a_values", FP4), (a_scales, "a_scales", E4M3), (a_global, "a_global", torch.float32),
        (b_values, "b_values", FP4), (b_scales, "b_scales", E4M3), (b_global, "b_global", torch.float32),
        (offs, "offs", torch.int32),
    ):
        _check_dtype(t, name, dtype, _WGRAD)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{_WGRAD}: out_dtype must be torch.bfloat16, float16 or float32, got {out_dtype}")
    if a_values.dim() != 2 or b_values.dim() != 2 or a_values.shape[1] != b_values.shape[1]:
        raise ValueError(f"{_WGRAD}: expected a_values (M, T / 2) and b_values (N, T / 2) with one T, got "
                         f"{tuple(a_values.shape)} and {tuple(b_values.shape)}")
    t = 2 * a_values.shape[1]
    if t % BLOCK:
        raise ValueError(f"{_WGRAD}: T must be a multiple of {BLOCK}, got T = {t} (a_values {tuple(a_values.shape)})")
    for v, s, name in ((a_values, a_scales, "a_scales"), (b_values, b_scales, "b_scales")):
        if tuple(s.shape) != (v.shape[0], t // BLOCK):
            raise ValueError(f"{_WGRAD}: {name} must be {(v.shape[0], t // BLOCK)} (one scale per {BLOCK} elements "
                             f"along T), got {tuple(s.shape)}")
    for g, name in ((a_global, "a_global"), (b_global, "b_global")):
        if g.dim() != 0:
            raise ValueError(f"{_WGRAD}: {name} must be 0-dim, got shape {tuple(g.shape)}")
    if offs.dim() != 1 or offs.shape[0] == 0:
        raise ValueError(f"{_WGRAD}: offs must be 1-D with E >= 1 entries, got shape {tuple(offs.shape)}")
    for x, name in ((a_scales, "a_scales"), (a_global, "a_global"), (b_values, "b_values"),
                    (b_scales, "b_scales"), (b_global, "b_global"), (offs, "offs")):
        if x.device != a_values.device:
            raise ValueError(f"{_WGRAD}: {name} is on {x.device} but a_values on {a_values.device}")


def grouped_mm_nvfp4_wgrad_ref(
    a_values: torch.Tensor,
    a_scales: torch.Tensor,
    a_global: torch.Tensor,
    b_values: torch.Tensor,
    b_scales: torch.Tensor,
    b_global: torch.Tensor,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Reference for ``grouped_mm_nvfp4_wgrad`` (same arguments, same errors): both operands decoded in
    float64 (exact), one float64 product per group over its columns, times ``a_global * b_global``, one
    rounding to ``out_dtype``; an empty group is zero. Reads ``offs`` on the host."""
    check_wgrad_inputs(a_values, a_scales, a_global, b_values, b_scales, b_global, offs, out_dtype)
    a, b = _decode64(a_values, a_scales), _decode64(b_values, b_scales)  # (M, T), (N, T)
    out = torch.zeros(offs.shape[0], a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    scale = a_global.double() * b_global.double()
    for g, (start, end) in enumerate(group_bounds(offs, a.shape[1])):
        if end > start:
            out[g] = (a[:, start:end] @ b[:, start:end].T) * scale
    return out.to(out_dtype)


def grouped_mm_nvfp4_wgrad_fwd(a_values, a_scales, a_global, b_values, b_scales, b_global, offs,
                               out_dtype) -> torch.Tensor:
    """Validated inputs (float4 / float8 or their uint8 views, any strides) -> (E, M, N): both operands
    dequantized to bf16 with a global scale of 1 (exact), the bf16 ragged-K GEMM into fp32, then
    ``a_global * b_global`` in fp32 and one rounding to ``out_dtype``."""
    if a_values.shape[1] == 0:  # T = 0: every group is empty
        return torch.zeros(offs.shape[0], a_values.shape[0], b_values.shape[0], dtype=out_dtype,
                           device=a_values.device)
    a = _decode_rows(a_values, a_scales, torch.bfloat16)  # (M, T)
    b = _decode_rows(b_values, b_scales, torch.bfloat16)  # (N, T)
    out = grouped_mm(a, b.T, offs, out_dtype=torch.float32)  # (E, M, N); empty groups zero
    out.mul_(a_global * b_global)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


@torch.library.custom_op("moekit::grouped_mm_nvfp4_wgrad", mutates_args=())
def _grouped_mm_nvfp4_wgrad_op(
    a_values: torch.Tensor, a_scales: torch.Tensor, a_global: torch.Tensor,
    b_values: torch.Tensor, b_scales: torch.Tensor, b_global: torch.Tensor,
    offs: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    return grouped_mm_nvfp4_wgrad_fwd(a_values, a_scales, a_global, b_values, b_scales, b_global, offs, out_dtype)


@_grouped_mm_nvfp4_wgrad_op.register_fake
def _(a_values, a_scales, a_global, b_values, b_scales, b_global, offs, out_dtype):
    return a_values.new_empty((offs.shape[0], a_values.shape[0], b_values.shape[0]), dtype=out_dtype)


def grouped_mm_nvfp4_wgrad(
    a_values: torch.Tensor,
    a_scales: torch.Tensor,
    a_global: torch.Tensor,
    b_values: torch.Tensor,
    b_scales: torch.Tensor,
    b_global: torch.Tensor,
    offs: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The ragged-K grouped GEMM on NVFP4 operands, as weight gradients need it. Forward only.

    ``out[g] = dequant(a)[:, offs[g-1]:offs[g]] @ dequant(b)[:, offs[g-1]:offs[g]]^T`` (offs[-1] := 0
    before the first group) -> (E, M, N) ``out_dtype`` (bf16 by default, fp16 or fp32); a group with no
    columns is **zero**; columns at or past ``offs[-1]`` take part in no group.

    Operands, on one device, both quantized along T (the tokens: the reduction), T a multiple of 16:

    - ``a_values`` (M, T / 2) ``float4_e2m1fn_x2``, ``a_scales`` (M, T / 16) ``float8_e4m3fn``,
      ``a_global`` 0-dim fp32: for a weight gradient dW (E, K, N) = x^T dy per expert, x^T (K, T), as
      ``nvfp4.quantize(x.T)`` returns it;
    - ``b_values`` (N, T / 2), ``b_scales`` (N, T / 16), ``b_global`` 0-dim fp32: dy^T (N, T);
    - ``offs`` (E,) int32 cumulative column ends on the device, non-decreasing, offs[-1] <= T (never
      read by the host). A 16-element block that straddles two groups has one scale for both; to give
      each expert its own blocks, start every group on a multiple of 16 (``train.padded_rows``
      places expert-sorted rows so).

    Numerics: the decoded operands (``e2m1 * e4m3``, exact in bf16) multiply with fp32 accumulation, the
    fp32 result is multiplied by ``a_global * b_global`` and rounded once to ``out_dtype``;
    ``grouped_mm_nvfp4_wgrad_ref`` computes the same in float64.

    Emulated on every GPU (Hopper has no FP4 tensor cores, and at the token counts of training the GEMM
    is compute-bound): both operands are dequantized to bf16 (temporaries (M, T) and (N, T)) and run
    through ``moekit.grouped_mm``'s ragged-K kernels into an fp32 (E, M, N), which the global scales
    then multiply. No host sync, CUDA-graph safe; on the CPU (or with the ``reference`` option)
    ``grouped_mm_nvfp4_wgrad_ref``. Under torch.compile it is the custom op ``moekit::grouped_mm_nvfp4_wgrad``.
    """
    check_wgrad_inputs(a_values, a_scales, a_global, b_values, b_scales, b_global, offs, out_dtype)
    offs = offs.contiguous()  # the kernels read offs by position: a strided view becomes a copy
    if not config.uses_triton(a_values.device):
        return grouped_mm_nvfp4_wgrad_ref(a_values, a_scales, a_global, b_values, b_scales, b_global, offs,
                                          out_dtype=out_dtype)
    args = (a_values.view(torch.uint8), a_scales.view(torch.uint8), a_global,
            b_values.view(torch.uint8), b_scales.view(torch.uint8), b_global, offs, out_dtype)
    return traced_or_eager(_grouped_mm_nvfp4_wgrad_op, grouped_mm_nvfp4_wgrad_fwd, *args)

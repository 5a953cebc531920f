"""Tile configurations and the one heuristic per kernel family that picks them (the grouped GEMM,
the SwiGLU backward pass, the NVFP4 GEMM). Tests pin a config to cover a code path on purpose; the
warp-specialized Gluon kernels have one fixed tile (``hopper.py``). Figures behind the choices are in
docs/design.md."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from .target import is_interpreting


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of a grouped GEMM kernel.

    ``block_m`` x ``block_n`` is the output tile, ``block_k`` the reduction step; ``group_m`` row
    tiles are walked together for L2 reuse; ``flatten`` lets Triton fuse the persistent tile loop
    with the K loop so the next tile's loads overlap this tile's epilogue; ``split_store`` writes
    the tile as two halves (half the epilogue's shared memory); ``programs_per_sm`` persistent
    programs share each SM (above 1 only when their shared memory fits together); ``swap`` (the NVFP4
    GEMM) computes the tile transposed, the weights' rows as the MMA's rows; ``max_registers`` caps the
    registers per thread (Triton's ``maxnreg``), so that more programs reside on an SM's 64K registers
    at once (the NVFP4 GEMM; the grid stays ``programs_per_sm`` programs per SM); ``prefetch`` (the NVFP4
    GEMM) loads the weights' next K step into registers while the current one is decoded and multiplied;
    ``warp_specialized`` (the NVFP4 GEMM, packed weights, sm_90) runs the warp-specialized Gluon kernel
    (``_kernels/nvfp4_gemm_ws.py``): ``block_n`` 128, ``block_k`` 64 x the chunks per ring stage,
    ``num_stages`` the ring's depth, ``max_registers`` the consumers' registers (required).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = False
    split_store: bool = False
    programs_per_sm: int = 1
    swap: bool = False
    max_registers: int | None = None
    prefetch: bool = False
    warp_specialized: bool = False


_WGRAD_BLOCK_M = 128  # block_m of every ragged-K (wgrad) configuration below


def ones_row_is_free(rows: int) -> bool:
    """Whether a row of ones appended to a wgrad operand of ``rows`` rows costs no MMA work: the
    ragged-K GEMM's last row tile is then partial, and the extra row lands in its padding."""
    return rows % _WGRAD_BLOCK_M != 0


_INTERPRETER_CONFIG = TileConfig(block_m=32, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)


_SMEM_BYTES = 227 * 1024  # Hopper's per-block shared memory limit (sm_80: 163 KB; such launches drop stages)


def _fit_stages(cfg: TileConfig, out_bytes: int, smem_bytes: int = _SMEM_BYTES) -> TileConfig:
    """Lower ``num_stages`` until the operand ring plus the epilogue's store buffer fit in shared memory."""
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * 2
    store = cfg.block_m * cfg.block_n * out_bytes // (2 if cfg.split_store else 1)
    stages = cfg.num_stages
    while stages > 2 and stages * stage + store > smem_bytes - 8 * 1024:  # ~8 KB: barriers, scratch
        stages -= 1
    return dataclasses.replace(cfg, num_stages=stages)


@functools.lru_cache(maxsize=1024)
def grouped_mm_config(
    m: int, n: int, k: int, num_groups: int, *, ragged_k: bool, tma: bool, out_bytes: int, device: torch.device,
    epilogue: str = "none",
) -> TileConfig:
    """Pick the tile configuration for a grouped GEMM.

    ``m`` x ``n`` is the output of one group's GEMM (for the ragged-M form, ``m`` is the average rows
    per group), ``k`` the reduction length (for the ragged-K form, the average per group),
    ``out_bytes`` the output element size. ``tma`` says which load path the launch takes: the pointer
    path keeps its tiles smaller, since a 128x256 tile there needs 255 registers and spills
    (benchmarks/compiler_report.py). Choices come from benchmarks/sweep_grouped_mm.py on an H100.
    ``epilogue`` names the fused epilogue ("none", "swiglu"); both use the same tiles today.
    """
    if device.type != "cuda":
        return _INTERPRETER_CONFIG
    if not tma:
        cfg = TileConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    elif not ragged_k:
        if m <= 64:
            # Few rows per expert: the GEMM streams the weights once; wide K steps and deep pipelines
            # keep enough bytes in flight to approach copy bandwidth.
            cfg = TileConfig(block_m=64, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=4)
        else:
            cfg = TileConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3,
                             flatten=True)
    elif k <= 128:
        # A K loop of one or two steps: storing the (E, M, N) output dominates. Two programs per SM,
        # each small enough to share it, overlap one's store with the other's loads.
        cfg = TileConfig(block_m=_WGRAD_BLOCK_M, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=2,
                         split_store=True, programs_per_sm=2)
    else:
        # sweep_wgrad_v3: 3 stages, GROUP_M 8, no flattening wins or ties on every wgrad measured
        # (gpt-oss-20b up 4.82 ms vs 5.14 with 4 stages + split store; mixtral down 8.30 vs 8.54).
        cfg = TileConfig(block_m=_WGRAD_BLOCK_M, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
    return _fit_stages(cfg, out_bytes)


_NVFP4_INTERPRETER_CONFIG = TileConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)


def swiglu_bwd_blocks() -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_F, num_warps, column programs) of the SwiGLU backward pass (``experts.swiglu_bwd``).

    One program per 16 rows walks all their columns, 64 at a time, with 8 warps: 0.90 of the device
    copy bandwidth on an H100 at gpt-oss-20b and qwen3-30b-a3b sizes, against 0.80-0.83 for a program
    per 16 x 128 block with 4 warps (a tile sweep on an H100). The interpreter takes small blocks
    on the same schedule."""
    return (16, 16, 4, 1) if is_interpreting() else (16, 64, 8, 1)


NVFP4_DECODE_ROWS = 64  # rows per expert up to which the NVFP4 GEMM decodes in its main loop


def nvfp4_gemm_dequantizes(m: int, e: int) -> bool:
    """Whether the NVFP4 grouped GEMM of m rows over e experts dequantizes both operands to bf16 first
    and runs the bf16 grouped GEMM (above ``NVFP4_DECODE_ROWS`` rows per expert on average: there the
    GEMM is compute-bound, and decoding every tile in the main loop ran at 0.22-0.27x of bf16 on an
    H100), rather than decoding in the main loop (``nvfp4_gemm_config``)."""
    return m > NVFP4_DECODE_ROWS * e


def nvfp4_gemm_config(m: int, e: int, device: torch.device, packed: bool = False, ptx: bool = True,
                      ws: bool = False) -> TileConfig:
    """The tile of the NVFP4 grouped GEMM's decoding kernel (``nvfp4_gemm``) for m rows over e experts,
    at most ``NVFP4_DECODE_ROWS`` rows per expert on average (above, the launcher dequantizes instead:
    ``nvfp4_gemm_dequantizes``). BLOCK_K is a power of two and a multiple of 16 (whole scale blocks), of
    64 with ``packed`` weights (``nvfp4_gemm.pack_weights``); ``ptx``: the inline-PTX decode runs
    (``use_nvfp4_ptx_decode``); ``ws``: the warp-specialized kernel can run (``nvfp4_gemm.ws_ok``: packed
    weights on sm_90).

    The warp-specialized kernel (``ws``) streams the weights through a ring of shared-memory stages of
    64-element chunks. For 16 and 32 rows: two programs per SM at 104 registers, four chunks per stage
    and 3 stages (0.141-0.145 and 0.157-0.161 ms at E = 32, K = 2880, N = 5760; at 32 rows two stages
    of four chunks 0.177, of eight 0.160, three of eight 0.157, one program at 160 registers with 3 or
    4 stages of four chunks 0.163 and 0.157); for 64 rows one program at 160 registers, two chunks, 4
    stages (0.192-0.203 ms; four chunks with 3 or 4 stages 0.206 and 0.203, two programs at 104
    registers with two stages of four or eight chunks 0.214 and 0.203). H100,
    CUDA-graph replays.

    The transposed tile (``swap``): 128 weight rows by an M tile of 16, 32 or 64 rows, the smallest that
    holds the average expert's rows, so the GEMM decodes each weight tile about once. BLOCK_K 128, or 64
    with the 64-row tile (0.50 against 0.54 ms at 64 rows per expert; 128 was faster at 16). The 64-row
    tile is capped at 168 registers per thread (3 resident programs per SM instead of 2: 0.338 against
    0.368 ms with packed weights); at 16 and 32 rows the cap changed nothing or cost 5%, and a cap of
    128 cost 10-70% everywhere. The 64-row tile, and the 32-row one but for K-ordered bytes under the
    PTX decode, load the weights' next K step ahead (``prefetch``): 0.338 -> 0.282 ms at 64 rows (packed,
    with the cap), 0.402 -> 0.330 (K-ordered), 0.270 -> 0.260 at 32 rows (packed), 0.435 -> 0.406
    (Triton-op decode); it cost 0.298 -> 0.357-0.377 ms at 32 rows on K-ordered bytes with the PTX
    decode and 0.268 -> 0.280 at 16 rows (packed). Under the interpreter: a small
    untransposed tile (tests pin the others). Measured on an H100: ``benchmarks/bench_nvfp4.py``,
    ``benchmarks/sweep_nvfp4_gemm.py``."""
    if device.type != "cuda":
        return dataclasses.replace(_NVFP4_INTERPRETER_CONFIG, block_k=64) if packed else _NVFP4_INTERPRETER_CONFIG
    block_m = 16 if m <= 16 * e else 32 if m <= 32 * e else 64
    if ws:
        two = block_m <= 32  # two programs per SM (their rings fit shared memory together)
        return TileConfig(block_m=block_m, block_n=128, block_k=256 if two else 128, group_m=1, num_warps=4,
                          num_stages=3 if two else 4, programs_per_sm=2 if two else 1, swap=True,
                          max_registers=104 if two else 160, warp_specialized=True)
    return TileConfig(block_m=block_m, block_n=128, block_k=128 if block_m <= 32 else 64, group_m=1,
                      num_warps=4, num_stages=3, programs_per_sm=4, swap=True,
                      max_registers=168 if block_m == 64 else None,
                      prefetch=block_m == 64 or (block_m == 32 and (packed or not ptx)))

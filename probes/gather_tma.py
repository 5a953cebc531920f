"""Probe: can Hopper's TMA gather rows, one [1, BLOCK_K] box per routed row, into a shared-memory
tile that a wgmma could read as it reads a whole box? (docs/design.md, section 13: the block's copies
of x and dO for the GEMMs exist because Hopper's TMA has no gather.)

``_gather_tma_kernel``: for each 128-row tile of the routed rows and each 64-column step, the
kernel issues one TMA load per row, ``x[token_idx[r], k:k + 64]``, into row r of a [128, 64] bf16
stage, all on one mbarrier, then reads the stage back through the whole tile's NVMMA layout (the
one a wgmma operand has) and writes it to ``out``. ``out == x[token_idx]`` holds only if every box
landed where a full box's row would. Timed against ``index_select`` and moekit's Triton row gather
(``gather_token_rows``), in GB/s of bytes moved (read + written).

The 128-byte swizzle that the GEMMs' operands use cannot be expressed: a one-row box (or stage
slice) with it fails to compile in Triton 3.6.0 and 3.7.1 ("Illegal shared layout"; slicing the
swizzled stage by rows: "We don't support splitting along the swizzling pattern"). ``--swizzle 0``
(no swizzle) compiles, 128 TMA loads per 64-column step, and on an H100 the boxes land where the
whole tile's layout reads them; it gathered 131072 rows x 2048 in 0.714 ms against 0.230 ms for
moekit's Triton gather (docs/design.md, section 13).

    python probes/gather_tma.py [--swizzle 0] [--tokens 16384] [--dim 2048] [--top-k 8]
    python probes/gather_tma.py --compile-only [--swizzle 0|128]     # sm_90 SASS statistics, no GPU
"""

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

BLOCK_M = 128
BLOCK_K = 64
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # Triton 3.7 / 3.6


@gluon.jit
def _gather_tma_kernel(x_desc, token_idx, out, R, D, stride_out,
                       BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
    row0 = gl.program_id(0) * BLOCK_M
    # the stage as BLOCK_M boxes of one row (a 128-byte-swizzled memdesc cannot be sliced by rows), read
    # back as one [BLOCK_M, BLOCK_K] tile with the 128-byte swizzle
    stage = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, 1, BLOCK_K], x_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    LOAD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
    phase = 0
    for k in range(0, D, BLOCK_K):
        mbarrier.expect(bar, BLOCK_M * BLOCK_K * 2)
        for i in gl.static_range(BLOCK_M):  # one box per row; rows past R repeat the last one
            r = gl.load(token_idx + gl.minimum(row0 + i, R - 1))
            tma.async_copy_global_to_shared(x_desc, [r, k], bar, stage.index(i))
        mbarrier.wait(bar, phase)
        phase ^= 1
        tile = stage._reinterpret(gl.bfloat16, [BLOCK_M, BLOCK_K], x_desc.layout).load(LOAD)
        cols = k + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LOAD))
        dst = out + gl.expand_dims(rows.to(gl.int64) * stride_out, 1) + gl.expand_dims(cols, 0)
        gl.store(dst, tile, mask=gl.expand_dims(rows < R, 1) & gl.expand_dims(cols < D, 0))
        _cta_barrier()  # every warp has read the stage before the next step's boxes land
        fence_async_shared()
    mbarrier.invalidate(bar)


SWIZZLE = [0]  # bytes; set from --swizzle


def _layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=SWIZZLE[0], element_bitwidth=16, rank=2)


def gather_tma(x: torch.Tensor, token_idx: torch.Tensor) -> torch.Tensor:
    """x (T, D) bf16, D % 64 == 0; token_idx (R,) int32 -> x[token_idx] (R, D), by per-row TMA boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    r, d = token_idx.numel(), x.shape[1]
    out = torch.empty(r, d, dtype=x.dtype, device=x.device)
    desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [1, BLOCK_K], _layout())
    _gather_tma_kernel[(triton.cdiv(r, BLOCK_M),)](desc, token_idx, out, r, d, out.stride(0),
                                                   BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=4)
    return out


def compile_only():
    """The kernel compiled for sm_90 without a GPU: SASS instructions, registers, TMA loads."""
    import re

    from cuobjdump import dump
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    block_ty = f"tensordesc<bf16[1, {BLOCK_K}],{_layout()!r}>"
    sig = {"x_desc": block_ty, "token_idx": "*i32", "out": "*bf16", "R": "i32", "D": "i32", "stride_out": "i32",
           "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "num_warps": "constexpr"}
    const = {"BLOCK_M": BLOCK_M, "BLOCK_K": BLOCK_K, "num_warps": 4}
    kernel = triton.compile(GluonASTSource(_gather_tma_kernel, sig, constexprs=const),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    _, ops, res = dump(kernel)
    tma_ops = sum(op.startswith("UTMALDG") for op in ops)
    regs = re.search(r"REG:(\d+)", res).group(1)
    print(f"sm_90: {len(ops)} SASS instructions, {tma_ops} UTMALDG, {regs} registers")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--swizzle", type=int, default=0, choices=[0, 32, 64, 128], help="the stage's swizzle, bytes")
    a = p.parse_args()
    SWIZZLE[0] = a.swizzle
    if a.compile_only:
        compile_only()
        return
    from moekit.bench import bench_ms, copy_bandwidth_gbs
    from moekit.routing import gather_token_rows, routing_metadata

    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.dim, device="cuda", dtype=torch.bfloat16)
    experts = torch.rand(a.tokens, 128, device="cuda").topk(a.top_k, -1).indices.to(torch.int32)
    _, _, token_idx, row_of = routing_metadata(experts, 128)
    want = x[token_idx.long()]
    got = gather_tma(x, token_idx)
    print(f"per-row TMA boxes: out == x[token_idx]: {torch.equal(got, want)}")
    odd = token_idx[: token_idx.numel() - 77]  # a partial last tile
    print(f"  partial last tile: {torch.equal(gather_tma(x, odd), x[odd.long()])}")
    moved = 2 * want.numel() * want.element_size()  # each routed row read once and written once
    print(f"device copy {copy_bandwidth_gbs():.0f} GB/s; gathers of {want.shape[0]} rows x {a.dim} (GB/s):")
    for name, fn in (("per-row TMA", lambda: gather_tma(x, token_idx)),
                     ("index_select", lambda: x.index_select(0, token_idx)),
                     ("moekit Triton gather", lambda: gather_token_rows(x, token_idx, row_of))):
        ms = bench_ms(fn)
        print(f"  {name}: {ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()

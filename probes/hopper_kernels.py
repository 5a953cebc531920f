"""Measurement instruments for the warp-specialized rows-ragged GEMM (``hopper_gemm.py``): the same
kernel with one of its two costs taken out, so that a power probe can split a GEMM's energy between
moving operands from L2 into shared memory and the tensor-core math
(``probes/stream.py``). Neither computes anything useful; nothing in moekit calls them.

* ``_ws_stream_kernel``: the loader warp walks the tiles and streams every A and B box through the
  ring exactly as the GEMM does; the two consumer warpgroups only wait for each stage and free it.
* ``_ws_mma_kernel``: the loader fills the ring once, from the first tile's boxes; the consumers
  then run the GEMM's wgmma loop over every tile on those resident stages, with no loads and no
  stores (a store under a mask that is never true keeps the accumulator live).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from moekit._kernels.hopper_gemm import _advance, _b_operand, _load_partition, _shared_state


@gluon.jit
def _stream_partition(ready, empty, table, K, tiles_n, BLOCK_K: gl.constexpr, NUM_SMS: gl.constexpr,
                      STAGES: gl.constexpr):
    total = gl.load(table) * tiles_n
    k_iters = gl.cdiv(K, BLOCK_K)
    idx = 0
    phase = 0
    for _t in range(gl.program_id(0), total, NUM_SMS):
        for _k in range(k_iters):
            mbarrier.wait(ready.index(idx), phase)
            mbarrier.arrive(empty.index(idx))
            idx, phase = _advance(idx, phase, STAGES)


@gluon.jit
def _ws_stream_kernel(a_desc, b_desc, c_desc, table, K, N, NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, B_TRANS: gl.constexpr):
    a_bufs, b_bufs, bufs, ready, empty = _shared_state(a_desc, b_desc, c_desc, 1, STAGES, 2)
    tiles_n = gl.cdiv(N, c_desc.block_type.shape[1])
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    gl.warp_specialize(
        [
            (_stream_partition, (ready, empty, table, K, tiles_n, BLOCK_K, NUM_SMS, STAGES)),
            (_stream_partition, (ready, empty, table, K, tiles_n, BLOCK_K, NUM_SMS, STAGES)),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, table, K, tiles_n,
                               NUM_SMS, GROUP_M, STAGES, B_TRANS)),
        ],
        [4, 1],
        [232, 40],
    )


@gluon.jit
def _mma_only_partition(a_bufs, b_bufs, ready, c_ptr, table, K, tiles_n, CONSUMER: gl.constexpr,
                        NUM_SMS: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    HALF: gl.constexpr = BLOCK_M // 2
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    if B_TRANS:
        BLOCK_N: gl.constexpr = b_bufs.shape[2]
    else:
        BLOCK_N: gl.constexpr = b_bufs.shape[3]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    for i in gl.static_range(STAGES):
        mbarrier.wait(ready.index(i), 0)
    total = gl.load(table) * tiles_n
    k_iters = gl.cdiv(K, BLOCK_K)
    rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    for t in range(gl.program_id(0), total, NUM_SMS):
        acc = warpgroup_mma_init(gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout))
        for ki in range(k_iters):
            idx = ki % STAGES
            a = a_bufs.index(idx).slice(CONSUMER * HALF, HALF, dim=0)
            acc = warpgroup_mma(a, _b_operand(b_bufs.index(idx), B_TRANS), acc, is_async=True)
            warpgroup_mma_wait(1, deps=(acc,))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        never = (rows[:, None] + t) < -K  # false, but not provably so: keeps the wgmmas
        gl.store(c_ptr + rows[:, None] * BLOCK_N + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=never)


@gluon.jit
def _prime_partition(a_desc, b_desc, a_bufs, b_bufs, ready, STAGES: gl.constexpr, B_TRANS: gl.constexpr):
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    for i in gl.static_range(STAGES):
        bar = ready.index(i)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [0, i * BLOCK_K], bar, a_bufs.index(i))
        if B_TRANS:
            tma.async_copy_global_to_shared(b_desc, [0, 0, i * BLOCK_K], bar, b_bufs.index(i))
        else:
            tma.async_copy_global_to_shared(b_desc, [0, i * BLOCK_K, 0], bar, b_bufs.index(i))


@gluon.jit
def _ws_mma_kernel(a_desc, b_desc, c_desc, c_ptr, table, K, N, NUM_SMS: gl.constexpr, STAGES: gl.constexpr,
                   B_TRANS: gl.constexpr):
    a_bufs, b_bufs, bufs, ready, empty = _shared_state(a_desc, b_desc, c_desc, 1, STAGES, 2)
    tiles_n = gl.cdiv(N, c_desc.block_type.shape[1])
    gl.warp_specialize(
        [
            (_mma_only_partition, (a_bufs, b_bufs, ready, c_ptr, table, K, tiles_n, 0, NUM_SMS, STAGES,
                                   B_TRANS)),
            (_mma_only_partition, (a_bufs, b_bufs, ready, c_ptr, table, K, tiles_n, 1, NUM_SMS, STAGES,
                                   B_TRANS)),
            (_prime_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, STAGES, B_TRANS)),
        ],
        [4, 1],
        [232, 40],
    )

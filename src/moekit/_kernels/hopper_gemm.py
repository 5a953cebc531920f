"""Warp-specialized ping-pong grouped GEMM for Hopper (Gluon), rows ragged.

``c[rows_g] = epilogue(a[rows_g] @ b[g])`` for the groups that ``offs`` splits the rows of ``a`` into;
the same contract as ``_grouped_mm_ragged_m_kernel`` in ``grouped_gemm.py``, but scheduled the way
CUTLASS's "ping-pong" kernels are:

* one TMA warp (the loader) streams A and B tiles into a ring of shared-memory stages;
* two consumer warpgroups take turns: while one runs its tile's wgmma main loop, the other runs the
  previous tile's epilogue (bias, SwiGLU, the stores), so the epilogue costs no tensor-core time.
  An mbarrier pair (``turn``) hands the main loop from one consumer to the other; the loader fills
  the ring in exactly that order, so the one ring serves both.

Tiles: the prologue kernel ``_tile_table_kernel`` turns ``offs`` into a table of row tiles on the
device (group, first row) and writes zeros to the rows past ``offs[-1]``; the GEMM walks
``table_size x tiles_n`` tiles persistently, GROUP_M row tiles at a time, with no host sync.
Rows of a tile past its group's end are read (they belong to the next group, or are TMA zero
fill) but never stored.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)


# --------------------------------------------------------------------------------------------------
# prologue: the row-tile table (plain Triton)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _tile_table_kernel(
    offs_ptr, table_ptr, c_ptr, M, N, E, stride_cm, max_tiles,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_Z: tl.constexpr,
):
    """table[0] = (number of row tiles, 0); table[1 + i] = (group, first row) of row tile i.

    Also zero-fills c's rows [offs[-1], M), the rows that belong to no group."""
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + e, mask=e < E, other=0)
    ends = tl.minimum(tl.maximum(ends, 0), M)
    starts = tl.load(offs_ptr + e - 1, mask=(e >= 1) & (e < E), other=0)
    starts = tl.minimum(tl.maximum(starts, 0), ends)
    tiles = tl.where(e < E, tl.cdiv(ends - starts, BLOCK_M), 0)
    tiles_end = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    if pid == 0:
        tl.store(table_ptr, total)
        tl.store(table_ptr + 1, 0)
    i = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.sum((tiles_end[None, :] <= i[:, None]).to(tl.int32), 1)
    hit = e[None, :] == g[:, None]
    first_tile = tl.sum(tl.where(hit, tiles_end - tiles, 0), 1)
    start = tl.sum(tl.where(hit, starts, 0), 1)
    keep = (i < total) & (i < max_tiles)
    tl.store(table_ptr + 2 + 2 * i, g, mask=keep)
    tl.store(table_ptr + 3 + 2 * i, start + (i - first_tile) * BLOCK_M, mask=keep)
    # rows past offs[-1]: zeros, BLOCK_Z rows per program and step
    last = tl.max(tl.where(e < E, ends, 0), 0)
    for r0 in range(last + pid * BLOCK_Z, M, tl.num_programs(0) * BLOCK_Z):
        r = r0 + tl.arange(0, BLOCK_Z)
        for n0 in range(0, N, 128):
            cols = n0 + tl.arange(0, 128)
            ptrs = c_ptr + r[:, None].to(tl.int64) * stride_cm + cols[None, :]
            mask = (r[:, None] < M) & (cols[None, :] < N)
            tl.store(ptrs, tl.zeros([BLOCK_Z, 128], c_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# the warp-specialized GEMM
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _tile_at(t, table, offs_ptr, tiles_n, n_rows_tiles, GROUP_M: gl.constexpr):
    """Tile index -> (group, first row, group end row, pid_n), GROUP_M row tiles at a time."""
    width = GROUP_M * tiles_n
    first_m = (t // width) * GROUP_M
    rows = gl.minimum(n_rows_tiles - first_m, GROUP_M)
    mt = first_m + (t % width) % rows
    pid_n = (t % width) // rows
    g = gl.load(table + 2 + 2 * mt)
    row = gl.load(table + 3 + 2 * mt)
    end = gl.load(offs_ptr + g)
    return g, row, end, pid_n


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, table, offs_ptr, K, tiles_n,
                    NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                    B_TRANS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    if B_TRANS:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    else:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[2]
    n_rows_tiles = gl.load(table)
    k_iters = gl.cdiv(K, BLOCK_K)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    idx = 0
    phase = 1  # the first pass over the ring finds every stage free
    for t in range(gl.program_id(0), n_rows_tiles * tiles_n, NUM_SMS):
        g, row, end, pid_n = _tile_at(t, table, offs_ptr, tiles_n, n_rows_tiles, GROUP_M)
        col = pid_n * BLOCK_N
        for ki in range(k_iters):
            k = ki * BLOCK_K
            mbarrier.wait(empty.index(idx), phase)
            bar = ready.index(idx)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [row, k], bar, a_bufs.index(idx))
            if B_TRANS:  # memory (E, N, K)
                tma.async_copy_global_to_shared(b_desc, [g, col, k], bar, b_bufs.index(idx))
            else:  # memory (E, K, N)
                tma.async_copy_global_to_shared(b_desc, [g, k, col], bar, b_bufs.index(idx))
            idx += 1
            if idx == STAGES:
                idx = 0
                phase ^= 1


@gluon.jit
def _epilogue_store(acc, c_desc, c_smem, c_ptr, stride_cm, bias_ptr, stride_bias, g, row, end, col, N,
                    HAS_BIAS: gl.constexpr):
    """Bias, then the tile to c: a TMA store when all its rows are in the group, masked stores else."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    BLOCK_N: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = acc.type.layout
    cols = col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    if HAS_BIAS:
        bias = gl.load(bias_ptr + g.to(gl.int64) * stride_bias + cols, mask=cols < N, other=0.0)
        acc = acc + bias.to(gl.float32)[None, :]
    out = acc.to(c_desc.dtype)
    if row + BLOCK_M <= end:
        tma.store_wait(0)  # the previous tile's store still reads c_smem
        c_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row, col], c_smem)
    else:
        rows = row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
        gl.store(ptrs, out, mask=(rows[:, None] < end) & (cols[None, :] < N))


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem, c_ptr, stride_cm,
                   bias_ptr, stride_bias, table, offs_ptr, N, K, tiles_n,
                   CONSUMER: gl.constexpr, NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    n_rows_tiles = gl.load(table)
    k_iters = gl.cdiv(K, BLOCK_K)
    pid = gl.program_id(0)
    j = 0
    for t in range(pid + CONSUMER * NUM_SMS, n_rows_tiles * tiles_n, 2 * NUM_SMS):
        g, row, end, pid_n = _tile_at(t, table, offs_ptr, tiles_n, n_rows_tiles, GROUP_M)
        # the loader filled the ring tile after tile, k_iters stages each
        count = (2 * j + CONSUMER) * k_iters
        idx = count % STAGES
        phase = (count // STAGES) & 1
        mbarrier.wait(turn.index(CONSUMER), j & 1)
        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout))
        for ki in range(k_iters):
            mbarrier.wait(ready.index(idx), phase)
            if B_TRANS:
                b = b_bufs.index(idx).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
            else:
                b = b_bufs.index(idx).reshape([BLOCK_K, BLOCK_N])
            acc = warpgroup_mma(a_bufs.index(idx), b, acc, is_async=True)
            warpgroup_mma_wait(1, deps=(acc,))
            # the MMA before this one is done: free its stage. (Computed, not carried: Triton 3.6
            # hoisted a loop-carried `prev = idx` out of this loop as if it were invariant.)
            mbarrier.arrive(empty.index(gl.where(idx == 0, STAGES - 1, idx - 1)), pred=ki > 0)
            idx += 1
            if idx == STAGES:
                idx = 0
                phase ^= 1
        mbarrier.arrive(turn.index(1 - CONSUMER))  # the other consumer's main loop may start
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(gl.where(idx == 0, STAGES - 1, idx - 1)))
        _epilogue_store(acc, c_desc, c_smem, c_ptr, stride_cm, bias_ptr, stride_bias, g, row, end,
                        pid_n * BLOCK_N, N, HAS_BIAS)
        j += 1
    tma.store_wait(0)


@gluon.jit
def _grouped_mm_pingpong_kernel(
    a_desc, b_desc, c_desc, c_ptr, stride_cm, bias_ptr, stride_bias, table, offs_ptr, N, K,
    NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    """a_desc: (M, K) [BM, BK]; b_desc: (E, N, K) [1, BN, BK] (B_TRANS) or (E, K, N) [1, BK, BN];
    c_desc: (M, N) [BM, BN]. table: the row-tile table of ``_tile_table_kernel``."""
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    tiles_n = gl.cdiv(N, BLOCK_N)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem0 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c_smem1 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    mbarrier.arrive(turn.index(0))  # consumer 0 runs the first main loop

    # (argument tuples are spelled out: a tuple built with `+` turns constexprs into tensors)
    gl.warp_specialize(
        [
            (_mma_partition, (a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem0, c_ptr, stride_cm,
                              bias_ptr, stride_bias, table, offs_ptr, N, K, tiles_n,
                              0, NUM_SMS, GROUP_M, STAGES, B_TRANS, HAS_BIAS)),
            (_mma_partition, (a_bufs, b_bufs, ready, empty, turn, c_desc, c_smem1, c_ptr, stride_cm,
                              bias_ptr, stride_bias, table, offs_ptr, N, K, tiles_n,
                              1, NUM_SMS, GROUP_M, STAGES, B_TRANS, HAS_BIAS)),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, table, offs_ptr, K, tiles_n,
                               NUM_SMS, GROUP_M, STAGES, B_TRANS)),
        ],
        [4, 1],
        [232, 40],
    )

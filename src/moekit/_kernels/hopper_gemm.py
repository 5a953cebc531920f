"""Warp-specialized grouped GEMMs for Hopper (Gluon): rows ragged with fused epilogues, and K ragged.

* ``_grouped_mm_ws_kernel``: ``c[rows_g] = epilogue(a[rows_g] @ b[g])`` for the groups that ``offs``
  splits the rows of ``a`` into: the contract of ``_grouped_mm_ragged_m_kernel`` (``grouped_gemm.py``)
  and of the up-projection's SwiGLU kernel (``experts.py``).
* ``_grouped_mm_ws_ragged_k_kernel``: ``c[g] = a[:, ks_g:ke_g] @ b[ks_g:ke_g]`` (the weight gradients),
  the contract of ``_grouped_mm_ragged_k_kernel``, including its ones row for a bias gradient.

Both run Hopper's warp-specialized schedule (``hopper_dswiglu.py`` builds the down-projection's
dgrad with the SwiGLU backward from the same parts):

* a TMA warp (the loader) streams A and B tiles into a ring of shared-memory stages, running ahead
  of the math across tile boundaries;
* two consumer warpgroups share each 128 x 256 tile (64 rows each). Each starts its accumulator from
  the bias, runs the wgmma main loop, stages the bf16 result in shared memory, sends it out with one
  asynchronous TMA store that overlaps the next tile's main loop, and computes SwiGLU from the
  staged tile.

Measured alternatives (docs/design.md, section 11): a ping-pong schedule (two consumers taking turns on
128 x 128 tiles) needs twice the shared-memory and L2 traffic per FLOP and ran at 500-530 TF/s
against 690 for this one.

Epilogues (``EPILOGUE``):

* ``PLAIN``: c = a @ b[g] (+ bias[g]).
* ``SWIGLU``: the up-projection. c is aux = a @ b[g] + bias[g] (M, 2F), gate and linear columns
  interleaved; out2 is h = SwiGLU(aux) (M, F), computed from the rounded aux.
* ``SWIGLU_NVFP4``: the up-projection writing h as NVFP4 (``moekit.grouped_mm_swiglu_nvfp4``): aux is
  staged as for SWIGLU but never stored; h = SwiGLU(aux), rounded to bf16 as SWIGLU stores it, is
  quantized with 1x16 blocks (``nvfp4_gluon._quantize_blocks``, each thread one 16-column block of a
  row) into c = values (M, N / 4) and out2 = scales (M, N / 32), uint8, with the global scale at
  ``gscale``: the bytes of ``nvfp4.quantize`` of SWIGLU's h.

Interleaved pairs are read as int32 words (gate in the low half, linear in the high half), so that
the SwiGLU never needs a stride-2 access or a layout shuffle.

Tiles (rows ragged): ``_tile_table_kernel`` turns ``offs`` into a table of row tiles on the device
(group, group start, group end, the group's first row tile) and writes zeros to the rows past
``offs[-1]``; every partition walks the tiles persistently with no host sync, group by group and
GROUP_M row tiles at a time inside a group, so that a band of row tiles never spans two groups'
weights in L2. Rows of a tile past its group's end are read but never stored. Each partition loads
the next tile's coordinates (and the consumers its bias) during the current tile, off the critical
path. (K ragged): every group owns the same output tiles; TMA loads through row-bounded
descriptors read the rows past the group's end as zeros.
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

from .epilogue import swiglu_apply
from .grouped_gemm import ROW_BOUND_BIG, _group_table, _swizzle
from .hopper_modes import ColSum, Epilogue
from .nvfp4 import _read_global_scale
from .nvfp4_gluon import LIFT_BY_SCALE, _quantize_blocks, _store_blocks, _tile_indices

PLAIN = tl.constexpr(Epilogue.PLAIN.value)  # the modes, defined once in hopper_modes.py
SWIGLU = tl.constexpr(Epilogue.SWIGLU.value)
SWIGLU_NVFP4 = tl.constexpr(Epilogue.SWIGLU_NVFP4.value)
COLSUM_NONE = tl.constexpr(ColSum.NONE.value)
COLSUM_ROW = tl.constexpr(ColSum.ROW.value)
COLSUM_VIRTUAL = tl.constexpr(ColSum.VIRTUAL.value)
EPI_ROWS = tl.constexpr(16)  # rows per step of the epilogue


# --------------------------------------------------------------------------------------------------
# prologue: the row-tile table (plain Triton)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _tile_table_kernel(
    offs_ptr, table_ptr, c_ptr, c2_ptr, M, N, N2, E, stride_cm, stride_c2m, max_tiles,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_Z: tl.constexpr,
    ZERO_TAIL: tl.constexpr,
):
    """table[0] = number of row tiles; table[4 + 4i : 8 + 4i] = (group, group start row, group end
    row, the group's first row tile) for row tile i, the rows clamped to [0, M] as in ``_group_table``.

    With ZERO_TAIL, also zero-fills the rows [offs[-1], M) of c (M, N) and c2 (M, N2), the rows of no
    group (otherwise they are left unwritten)."""
    pid = tl.program_id(0)
    # group E of the table is the tail [offs[-1], M): it gets zeros here, not row tiles
    e, starts, ends, tiles, _, _ = _group_table(offs_ptr, M, E, 1, BLOCK_M, BLOCK_E)
    tiles = tl.where(e < E, tiles, 0)
    tiles_end = tl.cumsum(tiles, 0)
    total = tl.sum(tiles, 0)
    if pid == 0:
        tl.store(table_ptr, total)
    i = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.sum((tiles_end[None, :] <= i[:, None]).to(tl.int32), 1)
    hit = e[None, :] == g[:, None]
    first_tile = tl.sum(tl.where(hit, tiles_end - tiles, 0), 1)
    start = tl.sum(tl.where(hit, starts, 0), 1)
    end = tl.sum(tl.where(hit, ends, 0), 1)
    # entries past the last row tile are zeros (group 0, no rows): safe for the partitions to prefetch
    real = i < total
    keep = i < max_tiles
    tl.store(table_ptr + 4 + 4 * i, tl.where(real, g, 0), mask=keep)
    tl.store(table_ptr + 5 + 4 * i, tl.where(real, start, 0), mask=keep)
    tl.store(table_ptr + 6 + 4 * i, tl.where(real, end, 0), mask=keep)
    tl.store(table_ptr + 7 + 4 * i, tl.where(real, first_tile, 0), mask=keep)
    if ZERO_TAIL:  # rows past offs[-1]: zeros, BLOCK_Z rows per program and step
        last = tl.sum(tl.where(e == E, starts, 0), 0)
        for r0 in range(last + pid * BLOCK_Z, M, tl.num_programs(0) * BLOCK_Z):
            r = r0 + tl.arange(0, BLOCK_Z)
            for n0 in range(0, N, 128):
                cols = n0 + tl.arange(0, 128)
                ptrs = c_ptr + r[:, None].to(tl.int64) * stride_cm + cols[None, :]
                mask = (r[:, None] < M) & (cols[None, :] < N)
                tl.store(ptrs, tl.zeros([BLOCK_Z, 128], c_ptr.dtype.element_ty), mask=mask)
            for n0 in range(0, N2, 128):
                cols = n0 + tl.arange(0, 128)
                ptrs = c2_ptr + r[:, None].to(tl.int64) * stride_c2m + cols[None, :]
                mask = (r[:, None] < M) & (cols[None, :] < N2)
                tl.store(ptrs, tl.zeros([BLOCK_Z, 128], c2_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------------
# the warp-specialized GEMM
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _tile_at(t, table, tiles_n, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """Tile index -> (group, first row, group end row, pid_n). Tiles go group by group (tiles_n per
    row tile), GROUP_M row tiles at a time inside a group, so that a band of row tiles never spans
    two groups' weights in L2."""
    entry = table + 4 + 4 * (t // tiles_n)  # any row tile of t's group
    g = gl.load(entry)
    start = gl.load(entry + 1)
    end = gl.load(entry + 2)
    first = gl.load(entry + 3)
    pid_m, pid_n = _swizzle(t - first * tiles_n, gl.cdiv(end - start, BLOCK_M), tiles_n, GROUP_M)
    return g, start + pid_m * BLOCK_M, end, pid_n


@gluon.jit
def _tile_clamped(t, total, table, tiles_n, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """``_tile_at`` for a tile index that may be past the last tile (the prefetch of a program's next
    tile): clamped to the last one, or to tile 0 of a zero entry when there are none."""
    return _tile_at(gl.minimum(t, gl.maximum(total - 1, 0)), table, tiles_n, BLOCK_M, GROUP_M)


@gluon.jit
def _bias_row(bias_ptr, stride_bias, g, pid_n, N, BLOCK_N: gl.constexpr, acc_layout: gl.constexpr):
    """bias[g, pid_n * BLOCK_N :][:BLOCK_N] in the accumulator's column layout (zeros past N)."""
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    return gl.load(bias_ptr + g.to(gl.int64) * stride_bias + cols, mask=cols < N, other=0.0)


@gluon.jit
def _load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, table, K, tiles_n,
                    NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr):
    """The loader warp of the rows-ragged kernels: one A box and one B box per ring stage."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    if B_TRANS:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    else:
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[2]
    total = gl.load(table) * tiles_n
    k_iters = gl.cdiv(K, BLOCK_K)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    idx = 0
    phase = 1  # the first pass over the ring finds every stage free
    nxt = _tile_clamped(gl.program_id(0), total, table, tiles_n, BLOCK_M, GROUP_M)
    for t in range(gl.program_id(0), total, NUM_SMS):
        g, row, end, pid_n = nxt
        nxt = _tile_clamped(t + NUM_SMS, total, table, tiles_n, BLOCK_M, GROUP_M)
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
            idx, phase = _advance(idx, phase, STAGES)


@gluon.jit
def _ring_state(a_desc, b_desc, A_PER_STAGE: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The ring in shared memory (A_PER_STAGE A boxes and one B box per stage) and the ready / empty
    barriers of each stage (every consumer partition frees every stage)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [A_PER_STAGE * STAGES] + a_desc.block_type.shape,
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return a_bufs, b_bufs, ready, empty


@gluon.jit
def _shared_state(a_desc, b_desc, c_desc, A_PER_STAGE: gl.constexpr, STAGES: gl.constexpr,
                  CONSUMERS: gl.constexpr):
    """Shared memory of the kernels: ``_ring_state`` and one epilogue buffer (a c_desc box) per
    consumer partition."""
    a_bufs, b_bufs, ready, empty = _ring_state(a_desc, b_desc, A_PER_STAGE, STAGES, CONSUMERS)
    bufs = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS] + c_desc.block_type.shape, c_desc.layout)
    return a_bufs, b_bufs, bufs, ready, empty


@gluon.jit
def _free_previous(empty, idx, pred, STAGES: gl.constexpr):
    """Free the ring stage before stage idx, whose wgmma the caller has waited for."""
    # the stage to free is computed, not carried: Triton 3.6 hoisted a loop-carried `prev = idx`
    # out of the K loop as if it were invariant
    mbarrier.arrive(empty.index(gl.where(idx == 0, STAGES - 1, idx - 1)), pred=pred)


@gluon.jit
def _advance(idx, phase, STAGES: gl.constexpr):
    """The ring position after stage idx: (idx, phase)."""
    idx += 1
    if idx == STAGES:
        idx = 0
        phase ^= 1
    return idx, phase


@gluon.jit
def _b_operand(box, B_TRANS: gl.constexpr):
    """A ring stage's [1, BN, BK] (B_TRANS: weights (E, N, K)) or [1, BK, BN] B box as the wgmma's
    (BK, BN) operand."""
    if B_TRANS:
        b = box.reshape([box.shape[1], box.shape[2]]).permute((1, 0))
    else:
        b = box.reshape([box.shape[1], box.shape[2]])
    return b


@gluon.jit
def _ring_mma(a, b, acc, ready, empty, idx, phase, ki, STAGES: gl.constexpr):
    """One consumer step over the ring: wait for stage idx, issue its wgmma (a, b are views of that
    stage), and free the stage of the MMA before it once that one is done. Returns (acc, idx, phase)."""
    mbarrier.wait(ready.index(idx), phase)
    acc = warpgroup_mma(a, b, acc, is_async=True)
    warpgroup_mma_wait(1, deps=(acc,))
    _free_previous(empty, idx, ki > 0, STAGES)
    idx, phase = _advance(idx, phase, STAGES)
    return acc, idx, phase


@gluon.jit
def _ring_drain(acc, empty, idx, k_iters, STAGES: gl.constexpr):
    """After a tile's K loop: wait for its last wgmma and free that stage (none if k_iters == 0)."""
    acc = warpgroup_mma_wait(0, deps=(acc,))
    _free_previous(empty, idx, k_iters > 0, STAGES)
    return acc


@gluon.jit
def _row_tile_mainloop(a_bufs, b_bufs, ready, empty, acc, idx, phase, k_iters, CONSUMER: gl.constexpr,
                       STAGES: gl.constexpr, B_TRANS: gl.constexpr):
    """Consumer CONSUMER's main loop over one rows-ragged tile: its HALF rows of each A stage times the
    stage's B box into acc, every stage freed after. Returns (acc, idx, phase)."""
    HALF: gl.constexpr = a_bufs.shape[1] // 2
    for ki in range(k_iters):
        a = a_bufs.index(idx).slice(CONSUMER * HALF, HALF, dim=0)
        acc, idx, phase = _ring_mma(a, _b_operand(b_bufs.index(idx), B_TRANS), acc, ready, empty, idx, phase,
                                    ki, STAGES)
    acc = _ring_drain(acc, empty, idx, k_iters, STAGES)
    return acc, idx, phase


@gluon.jit
def _unpack_pairs(w):
    """int32 words of bf16 pairs -> (low, high) halves as fp32, exactly."""
    return (w << 16).to(gl.float32, bitcast=True), (w & -65536).to(gl.float32, bitcast=True)


@gluon.jit
def _epilogue(buf, c_desc, c_ptr, stride_c, out2_ptr, stride_out2, row, end, pid_n, N,
              EPILOGUE: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr, OFFSET: gl.constexpr):
    """Store one consumer's rows [row, row + HALF) of a tile, staged in ``buf`` (see the module doc).

    A full tile leaves by one TMA store; a tile cut by its group's end by masked stores. SWIGLU reads
    the staged aux as int32 words of bf16 pairs, and c_ptr is aux's word view (stride in words)."""
    HALF: gl.constexpr = buf.shape[0]
    BLOCK_N: gl.constexpr = buf.shape[1]
    R: gl.constexpr = EPI_ROWS
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    rows_in = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    if EPILOGUE == SWIGLU:  # BLOCK_N // 2 (gate, linear) words per row
        W: gl.constexpr = BLOCK_N // 2
        src = buf._reinterpret(gl.int32, [HALF, W], gl.NVMMASharedLayout.get_default_for([HALF, W], gl.int32))
    else:
        W: gl.constexpr = BLOCK_N
        src = buf
    cols = pid_n * W + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    c_cols = N // 2 if EPILOGUE == SWIGLU else N
    full = row + HALF <= end
    if full:  # the staged tile is the output (plain) or aux (SwiGLU) as it stands
        tma.async_copy_shared_to_global(c_desc, [row, pid_n * BLOCK_N], buf)
    if (EPILOGUE == SWIGLU) | (not full):
        for r0 in gl.static_range(0, HALF, R):  # (unrolled: a shared-memory slice needs a constant start)
            rows = row + r0 + rows_in
            rows64 = rows.to(gl.int64)[:, None]
            mask = (rows[:, None] < end) & (cols[None, :] < c_cols)
            x = src.slice(r0, R, dim=0).load(layout)
            if not full:
                gl.store(c_ptr + rows64 * stride_c + cols[None, :], x, mask=mask)
            if EPILOGUE == SWIGLU:
                gate, lin = _unpack_pairs(x)
                h = swiglu_apply(gate, lin, ALPHA, LIMIT, OFFSET)
                gl.store(out2_ptr + rows64 * stride_out2 + cols[None, :], h.to(out2_ptr.dtype.element_ty),
                         mask=mask)


@gluon.jit
def _epilogue_nvfp4(buf, values_ptr, scales_ptr, g, row, end, pid_n, N,
                    ALPHA: gl.constexpr, LIMIT: gl.constexpr, OFFSET: gl.constexpr):
    """SWIGLU_NVFP4: one consumer's rows [row, row + HALF) of the staged aux -> NVFP4 h (module doc).
    A thread takes the 16 (gate, linear) words of one block of h per row step."""
    HALF: gl.constexpr = buf.shape[0]
    W: gl.constexpr = buf.shape[1] // 2  # h columns of the tile
    NB: gl.constexpr = W // 16
    R: gl.constexpr = EPI_ROWS
    LQ: gl.constexpr = gl.BlockedLayout([1, 16], [32 // NB, NB], [4, 1], [1, 0])
    L4: gl.constexpr = gl.BlockedLayout([1, 1, 8, 2], [32 // NB, NB, 1, 1], [4, 1, 1, 1], [3, 2, 1, 0])
    src = buf._reinterpret(gl.int32, [HALF, W], gl.NVMMASharedLayout.get_default_for([HALF, W], gl.int32))
    F = N // 2
    r_in, b_off, byte3, nib4 = _tile_indices(R, NB, L4)
    blk2 = pid_n * NB + b_off
    for r0 in gl.static_range(0, HALF, R):
        gate, lin = _unpack_pairs(src.slice(r0, R, dim=0).load(LQ))
        h = swiglu_apply(gate, lin, ALPHA, LIMIT, OFFSET).to(gl.bfloat16).to(gl.float32)
        h4 = gl.convert_layout(gl.reshape(h, [R, NB, 8, 2]), L4, assert_trivial=True)
        packed, s_code = _quantize_blocks(h4, g, nib4, LIFT_BY_SCALE)
        rows2 = row + r0 + r_in
        _store_blocks(values_ptr, scales_ptr, packed, s_code, rows2.to(gl.int64), blk2,
                      (rows2 < end) & (blk2 < F // 16), F, byte3)


@gluon.jit
def _mma_partition(a_bufs, b_bufs, ready, empty, buf, c_desc, c_ptr, stride_c, out2_ptr, stride_out2,
                   bias_ptr, stride_bias, gscale_ptr, table, N, K, tiles_n,
                   CONSUMER: gl.constexpr, NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, B_TRANS: gl.constexpr, HAS_BIAS: gl.constexpr,
                   EPILOGUE: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr, OFFSET: gl.constexpr):
    """Consumer warpgroup CONSUMER: rows [CONSUMER * HALF, (CONSUMER + 1) * HALF) of every tile,
    main loop then epilogue."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    HALF: gl.constexpr = BLOCK_M // 2
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = buf.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    total = gl.load(table) * tiles_n
    k_iters = gl.cdiv(K, BLOCK_K)
    idx = 0
    phase = 0
    # the next tile's table entry and bias load during this tile's main loop and epilogue, off the
    # critical path
    nxt = _tile_clamped(gl.program_id(0), total, table, tiles_n, BLOCK_M, GROUP_M)
    if HAS_BIAS:
        bias = _bias_row(bias_ptr, stride_bias, nxt[0], nxt[3], N, BLOCK_N, acc_layout)
    if EPILOGUE == SWIGLU_NVFP4:
        g_scale = _read_global_scale(gscale_ptr)
    for t in range(gl.program_id(0), total, NUM_SMS):
        g, row, end, pid_n = nxt
        nxt = _tile_clamped(t + NUM_SMS, total, table, tiles_n, BLOCK_M, GROUP_M)
        acc = gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout)
        if HAS_BIAS:  # the accumulator starts from the bias: no registers held for it in the epilogue
            acc = acc + bias.to(gl.float32)[None, :]
        acc, idx, phase = _row_tile_mainloop(a_bufs, b_bufs, ready, empty, warpgroup_mma_init(acc), idx, phase,
                                             k_iters, CONSUMER, STAGES, B_TRANS)
        if HAS_BIAS:
            bias = _bias_row(bias_ptr, stride_bias, nxt[0], nxt[3], N, BLOCK_N, acc_layout)
        tma.store_wait(0)  # the previous tile's TMA store has read buf
        buf.store(acc.to(buf.dtype))
        fence_async_shared()
        if EPILOGUE == SWIGLU_NVFP4:
            _epilogue_nvfp4(buf, c_ptr, out2_ptr, g_scale, row + CONSUMER * HALF, end, pid_n, N, ALPHA, LIMIT,
                            OFFSET)
        else:
            _epilogue(buf, c_desc, c_ptr, stride_c, out2_ptr, stride_out2, row + CONSUMER * HALF, end, pid_n, N,
                      EPILOGUE, ALPHA, LIMIT, OFFSET)
    tma.store_wait(0)


@gluon.jit
def _grouped_mm_ws_kernel(
    a_desc, b_desc, c_desc,  # a (M, K) [BM, BK]; c (M, N) [BM // 2, BN]
    # b (E, N, K) [1, BN, BK] (B_TRANS) or (E, K, N) [1, BK, BN]
    c_ptr, stride_c, out2_ptr, stride_out2,  # the outputs, by epilogue (module doc)
    bias_ptr, stride_bias, table,  # bias (E, N) or None; the row-tile table of _tile_table_kernel
    gscale_ptr,  # SWIGLU_NVFP4: the (1,) fp32 global scale (unused otherwise)
    N, K,
    NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr,
    HAS_BIAS: gl.constexpr, EPILOGUE: gl.constexpr,
    ALPHA: gl.constexpr, LIMIT: gl.constexpr, OFFSET: gl.constexpr,
):
    a_bufs, b_bufs, bufs, ready, empty = _shared_state(a_desc, b_desc, c_desc, 1, STAGES, 2)
    tiles_n = gl.cdiv(N, c_desc.block_type.shape[1])

    # (argument tuples are spelled out: a tuple built with `+` turns constexprs into tensors)
    gl.warp_specialize(
        [
            (_mma_partition, (a_bufs, b_bufs, ready, empty, bufs.index(0), c_desc, c_ptr, stride_c, out2_ptr,
                              stride_out2, bias_ptr, stride_bias, gscale_ptr, table, N, K, tiles_n,
                              0, NUM_SMS, GROUP_M, STAGES, B_TRANS, HAS_BIAS, EPILOGUE, ALPHA, LIMIT, OFFSET)),
            (_mma_partition, (a_bufs, b_bufs, ready, empty, bufs.index(1), c_desc, c_ptr, stride_c, out2_ptr,
                              stride_out2, bias_ptr, stride_bias, gscale_ptr, table, N, K, tiles_n,
                              1, NUM_SMS, GROUP_M, STAGES, B_TRANS, HAS_BIAS, EPILOGUE, ALPHA, LIMIT, OFFSET)),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, table, K, tiles_n,
                               NUM_SMS, GROUP_M, STAGES, B_TRANS)),
        ],
        [4, 1],
        [232, 40],
    )


# --------------------------------------------------------------------------------------------------
# the warp-specialized ragged-K GEMM (wgrad)
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _k_tile_at(t, offs_ptr, KT, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """Tile index -> (group, pid_m, pid_n, k_start, k_end): every group owns tiles_m x tiles_n output
    tiles, and reduces over its rows [k_start, k_end) of the ragged dim, clamped to [0, KT]."""
    per_group = tiles_m * tiles_n
    g = t // per_group
    pid_m, pid_n = _swizzle(t % per_group, tiles_m, tiles_n, GROUP_M)
    k_end = gl.minimum(gl.maximum(gl.load(offs_ptr + g), 0), KT)
    k_start = gl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    k_start = gl.minimum(gl.maximum(k_start, 0), k_end)
    return g, pid_m, pid_n, k_start, k_end


@gluon.jit
def _k_load_partition(a_desc, ones_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, KT, total, tiles_m,
                      tiles_n, NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                      COLSUM: gl.constexpr):
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[2]
    HALF: gl.constexpr = a_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[3]
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    idx = 0
    phase = 1  # the first pass over the ring finds every stage free
    for t in range(gl.program_id(0), total, NUM_SMS):
        g, pid_m, pid_n, k_start, k_end = _k_tile_at(t, offs_ptr, KT, tiles_m, tiles_n, GROUP_M)
        row = pid_m * (2 * HALF)
        col = pid_n * BLOCK_N
        # row-bounded boxes (grouped_gemm.py's module doc): rows of the ragged dim >= k_end read 0
        big_k = ROW_BOUND_BIG - k_end
        ones_tile = (COLSUM == COLSUM_VIRTUAL) & (pid_m == tiles_m - 1)
        for k in range(k_start, k_end, BLOCK_K):
            mbarrier.wait(empty.index(idx), phase)
            bar = ready.index(idx)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [ROW_BOUND_BIG, k_end, big_k + k, row], bar,
                                            a_bufs.index(2 * idx))
            if ones_tile:  # the second half of the last row tile holds no rows of a: a row of ones
                tma.async_copy_global_to_shared(ones_desc, [0, 0, 0, 0], bar, a_bufs.index(2 * idx + 1))
            else:
                tma.async_copy_global_to_shared(a_desc, [ROW_BOUND_BIG, k_end, big_k + k, row + HALF], bar,
                                                a_bufs.index(2 * idx + 1))
            tma.async_copy_global_to_shared(b_desc, [ROW_BOUND_BIG, k_end, big_k + k, col], bar,
                                            b_bufs.index(idx))
            idx, phase = _advance(idx, phase, STAGES)


@gluon.jit
def _k_mma_partition(a_bufs, b_bufs, ready, empty, buf, c_desc, colsum_ptr, stride_colsum, offs_ptr,
                     M_C, N, KT, total, tiles_m, tiles_n,
                     CONSUMER: gl.constexpr, NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr,
                     STAGES: gl.constexpr, COLSUM: gl.constexpr):
    """Consumer warpgroup CONSUMER: output rows [CONSUMER * HALF, (CONSUMER + 1) * HALF) of every
    tile, main loop, then the tile leaves by a TMA store that drops rows >= M_C and columns >= N.
    With a COLSUM, the row M_C of the product (a row of ones) goes to colsum[g] in fp32."""
    BLOCK_K: gl.constexpr = a_bufs.shape[3]
    HALF: gl.constexpr = a_bufs.shape[4]
    BLOCK_N: gl.constexpr = b_bufs.shape[4]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    idx = 0
    phase = 0
    # the next tile's coordinates load during this tile's main loop, off the critical path
    nxt = _k_tile_at(gl.program_id(0), offs_ptr, KT, tiles_m, tiles_n, GROUP_M)
    for t in range(gl.program_id(0), total, NUM_SMS):
        g, pid_m, pid_n, k_start, k_end = nxt
        nxt = _k_tile_at(gl.minimum(t + NUM_SMS, total - 1), offs_ptr, KT, tiles_m, tiles_n, GROUP_M)
        row = pid_m * (2 * HALF) + CONSUMER * HALF
        col = pid_n * BLOCK_N
        k_iters = gl.cdiv(k_end - k_start, BLOCK_K)
        acc = warpgroup_mma_init(gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout))
        for ki in range(k_iters):
            a = a_bufs.index(2 * idx + CONSUMER).reshape([BLOCK_K, HALF]).permute((1, 0))
            b = b_bufs.index(idx).reshape([BLOCK_K, BLOCK_N])
            acc, idx, phase = _ring_mma(a, b, acc, ready, empty, idx, phase, ki, STAGES)
        acc = _ring_drain(acc, empty, idx, k_iters, STAGES)
        tma.store_wait(0)  # the previous tile's TMA store has read buf
        buf.reshape([HALF, BLOCK_N]).store(acc.to(buf.dtype))
        if COLSUM != COLSUM_NONE:
            if (M_C >= row) & (M_C < row + HALF):
                # the threads that hold row M_C store it as it is: no reduction, no second copy of acc
                rows = row + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
                cols = col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
                ptrs = colsum_ptr + g.to(gl.int64) * stride_colsum + (rows * 0)[:, None] + cols[None, :]
                gl.store(ptrs, acc, mask=(rows[:, None] == M_C) & (cols[None, :] < N))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [g, row, col], buf)
    tma.store_wait(0)


@gluon.jit
def _grouped_mm_ws_ragged_k_kernel(
    a_desc,  # row-bounded (Kt, M) memory of a = (M, Kt) with unit stride along M, box [1, 1, BK, BM // 2]
    ones_desc,  # COLSUM_VIRTUAL: a (1, 1, BK, BM // 2) tile whose column 0 is ones (else a_desc again)
    b_desc,  # row-bounded (Kt, N), box [1, 1, BK, BN]
    c_desc,  # c (E, M_C, N), box [1, BM // 2, BN]
    colsum_ptr, stride_colsum,  # (E, N) fp32: the per-group column sums of b (COLSUM), else unused
    offs_ptr, M, N, KT, E,  # M: rows of a (with its ones row for COLSUM_ROW)
    NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    COLSUM: gl.constexpr,  # COLSUM_NONE; COLSUM_ROW: a's last row is ones; COLSUM_VIRTUAL: M % BM == BM / 2
):
    """c[g] = a[:, ks_g:ke_g] @ b[ks_g:ke_g] for the groups that offs splits the Kt dim into, rows of c
    past M_C dropped (M - 1 for COLSUM_ROW, else M); an empty group's tiles come out as zeros."""
    a_bufs, b_bufs, bufs, ready, empty = _shared_state(a_desc, b_desc, c_desc, 2, STAGES, 2)
    if COLSUM == COLSUM_ROW:
        M_C = M - 1
    else:
        M_C = M
    if COLSUM == COLSUM_VIRTUAL:  # row M of the product: a row of ones in an empty tile half
        tiles_m = gl.cdiv(M + 1, 2 * a_desc.block_type.shape[3])
    else:
        tiles_m = gl.cdiv(M, 2 * a_desc.block_type.shape[3])
    tiles_n = gl.cdiv(N, b_desc.block_type.shape[3])
    total = E * tiles_m * tiles_n

    gl.warp_specialize(
        [
            (_k_mma_partition, (a_bufs, b_bufs, ready, empty, bufs.index(0), c_desc, colsum_ptr, stride_colsum,
                                offs_ptr,
                                M_C, N, KT, total, tiles_m, tiles_n,
                                0, NUM_SMS, GROUP_M, STAGES, COLSUM)),
            (_k_mma_partition, (a_bufs, b_bufs, ready, empty, bufs.index(1), c_desc, colsum_ptr, stride_colsum,
                                offs_ptr,
                                M_C, N, KT, total, tiles_m, tiles_n,
                                1, NUM_SMS, GROUP_M, STAGES, COLSUM)),
            (_k_load_partition, (a_desc, ones_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, KT, total,
                                 tiles_m, tiles_n, NUM_SMS, GROUP_M, STAGES, COLSUM)),
        ],
        [4, 1],
        [232, 40],
    )

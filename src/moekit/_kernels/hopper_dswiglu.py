"""The down-projection's dgrad with the SwiGLU backward fused (Gluon, Hopper): ``_grouped_mm_ws_dswiglu_kernel``.

For the groups that ``offs`` splits the rows into, dH = a[rows_g] @ b[g] (M, N) is never stored. From
it and aux (M, 2N, gate and linear columns interleaved, read as int32 words):

* c = d_aux = dSwiGLU(aux) * (s * dH) (M, 2N), as words;
* out2 = h = s * SwiGLU(aux) (M, N2), N2 >= N: column N is ones when N2 > N (the ones column of a
  bias gradient riding on dW_down), later columns zeros;
* with row scales s (HAS_SCALE; otherwise s = 1), parts[pid_n, row] = <dH, SwiGLU(aux)> over the
  tile's columns: one fp32 partial row sum per column tile, which the launcher adds up (deterministic).

Schedule: the rows-ragged kernel's loader warp and two consumer warpgroups (64 rows of a 128 x 256
tile each, ``hopper_gemm.py``), plus a 2-warp epilogue partition. A consumer ends each tile by
rounding its accumulator to bf16 into its shared-memory buffer and goes on to the next tile's main
loop; the epilogue partition reads the buffer, loads aux from global memory, and writes d_aux, h and
the row sums while the tensor cores run the next tile. Per consumer, two barriers hand the buffer
back and forth (dh_ready: written; dh_empty: read).

Registers: ptxas compiles the whole kernel under the launch's cap (64K registers over its threads),
whatever ``setmaxnreg`` a partition asks for, and a consumer's 64 x 256 fp32 accumulator needs 154.
A 4-warp epilogue would make four warpgroups (512 threads, 128 registers); with 2 warps the kernel
stays at three (384 threads, 168 registers for every partition).

The buffers are row-major with a 16-byte XOR swizzle by row whose period is the step's rows
(``min(EPI_ROWS, 8)``): the epilogue views a buffer as [steps, EPI_ROWS, BLOCK_N], and a shared layout
swizzles by the row index inside its last two dims, so the period must divide EPI_ROWS for the view to
address the bytes the consumer wrote. With 4-row steps the consumers' stores take a 2-way bank conflict
(a period of 8 would make them conflict-free); the epilogue's row reads are conflict-free either way.

The epilogue walks 4-row steps in a runtime loop (one copy of the math in the instruction cache),
each thread 2 rows x 2 runs of 4 columns, so that a warp's access to a row is contiguous and fills
whole 32-byte sectors (8 contiguous words per thread would make each instruction touch half of every
sector: twice the L2 requests); each step's aux and row-scale loads go out two steps ahead of its
math. The aux loads and the d_aux and h stores ask L2 to evict them first: they stream once, and the
main loop's operands are what L2 should keep. (ptxas, sm_90, 168 registers: 4-row steps spill nothing
with plain SwiGLU and 12 bytes per thread with gpt-oss's clamps; 8-row steps spill more.) The same
rows-ragged tile walk as the other kernels (``_tile_clamped``): rows of a tile past its group's end
are masked, and with zero_tail the row-tile table's kernel zero-fills the rows of c and out2 past
offs[-1].
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma_init

from .epilogue import swiglu_apply_bwd
from .hopper_gemm import _load_partition, _ring_state, _row_tile_mainloop, _tile_clamped, _unpack_pairs

# a barrier over the calling partition's warps (a named barrier inside warp_specialize): Triton 3.6
# spells it thread_barrier, 3.7 barrier
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.jit
def _pack_pairs(low, high):
    """Inverse of ``_unpack_pairs``: fp32 (low, high) -> int32 words of the two bf16 rounded to nearest
    even, in one instruction per word (the bits of two ``.to(gl.bfloat16)``)."""
    return gl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [low, high], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _dsw_mma_partition(a_bufs, b_bufs, ready, empty, buf, dh_ready, dh_empty, table, K, tiles_n,
                       CONSUMER: gl.constexpr, NUM_SMS: gl.constexpr, STAGES: gl.constexpr,
                       B_TRANS: gl.constexpr):
    """Consumer warpgroup CONSUMER: rows [CONSUMER * HALF, (CONSUMER + 1) * HALF) of every tile, the
    main loop, then dH as bf16 into ``buf`` once the epilogue partition has read the previous one."""
    HALF: gl.constexpr = buf.shape[0]
    BLOCK_N: gl.constexpr = buf.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    total = gl.load(table) * tiles_n
    k_iters = gl.cdiv(K, BLOCK_K)
    idx = 0
    phase = 0
    for t in range(gl.program_id(0), total, NUM_SMS):
        acc = warpgroup_mma_init(gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout))
        acc, idx, phase = _row_tile_mainloop(a_bufs, b_bufs, ready, empty, acc, idx, phase, k_iters, CONSUMER,
                                             STAGES, B_TRANS)
        # the tile's parity, computed from t (not carried: docs/design.md, section 12)
        mbarrier.wait(dh_empty, (((t - gl.program_id(0)) // NUM_SMS) & 1) ^ 1)
        buf.store(acc.to(buf.dtype))
        _partition_barrier()  # every thread's part of buf is written before the one arrival
        mbarrier.arrive(dh_ready)


@gluon.jit
def _load_aux_words(aux_ptr, stride_aux, rows, cols, end, N):
    """aux words (gate, linear) of dH columns ``cols`` for ``rows``; zeros past the group's end or N."""
    mask = (rows < end)[:, None] & (cols < N)[None, :]
    return gl.load(aux_ptr + rows.to(gl.int64)[:, None] * stride_aux + cols[None, :], mask=mask, other=0,
                   eviction_policy="evict_first")


@gluon.jit
def _load_row_scales(scale_ptr, rows, end):
    """The row scales of ``rows`` (fp32); zeros past the group's end."""
    return gl.load(scale_ptr + rows, mask=rows < end, other=0.0)


@gluon.jit
def _dsw_epilogue_partition(bufs, dh_ready, dh_empty, aux_ptr, stride_aux, c_ptr, stride_c, out2_ptr, stride_out2,
                            scale_ptr, parts_ptr, M, table, N, N2, tiles_n,
                            NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, HAS_SCALE: gl.constexpr,
                            ONES_COL: gl.constexpr, EPI_ROWS: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr,
                            OFFSET: gl.constexpr):
    """The dSwiGLU epilogue of every tile (module doc), half by half as the consumers hand them over."""
    HALF: gl.constexpr = bufs.shape[1]
    BLOCK_N: gl.constexpr = bufs.shape[2]
    R: gl.constexpr = EPI_ROWS
    STEPS: gl.constexpr = HALF // R
    # 4 consecutive columns per thread: a warp's load or store of a row is one contiguous run (16-byte
    # words, 8-byte bf16), so every 32-byte sector is whole in one instruction
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [2, 1], [1, 0])
    # the same bytes as [2 * STEPS, R, BLOCK_N]: step i of consumer c's rows is index c * STEPS + i
    steps = bufs._reinterpret(bufs.dtype, [2 * STEPS, R, BLOCK_N], bufs.type.layout)
    rows_in = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    cols_in = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    total = gl.load(table) * tiles_n
    nxt = _tile_clamped(gl.program_id(0), total, table, tiles_n, 2 * HALF, GROUP_M)
    for t in range(gl.program_id(0), total, NUM_SMS):
        g, row, end, pid_n = nxt
        nxt = _tile_clamped(t + NUM_SMS, total, table, tiles_n, 2 * HALF, GROUP_M)
        tile_phase = ((t - gl.program_id(0)) // NUM_SMS) & 1
        cols = pid_n * BLOCK_N + cols_in
        col_ok = (cols < N)[None, :]
        h_ok = (cols < N2)[None, :]
        for c in range(2):
            first = row + c * HALF
            # aux and the row scales need no dH: the first two steps' loads go out before the wait,
            # and each step's loads two steps ahead of its math (none past the half's last step)
            w1 = _load_aux_words(aux_ptr, stride_aux, first + rows_in, cols, end, N)
            w2 = _load_aux_words(aux_ptr, stride_aux, first + R + rows_in, cols, end, N)
            if HAS_SCALE:
                s1 = _load_row_scales(scale_ptr, first + rows_in, end)
                s2 = _load_row_scales(scale_ptr, first + R + rows_in, end)
            mbarrier.wait(dh_ready.index(c), tile_phase)
            for i in range(STEPS):
                rows = first + i * R + rows_in
                row_ok = rows < end
                ahead_end = gl.where(i + 2 < STEPS, end, 0)
                w = w1
                w1 = w2
                w2 = _load_aux_words(aux_ptr, stride_aux, rows + 2 * R, cols, ahead_end, N)
                if HAS_SCALE:
                    s = s1
                    s1 = s2
                    s2 = _load_row_scales(scale_ptr, rows + 2 * R, ahead_end)
                dh = steps.index(c * STEPS + i).load(layout).to(gl.float32)
                gate, lin = _unpack_pairs(w)
                if HAS_SCALE:
                    dg, dl, h = swiglu_apply_bwd(gate, lin, dh * s[:, None], ALPHA, LIMIT, OFFSET)
                    gl.store(parts_ptr + pid_n.to(gl.int64) * M + rows, gl.sum(dh * h, 1), mask=row_ok)
                    h = h * s[:, None]
                else:
                    dg, dl, h = swiglu_apply_bwd(gate, lin, dh, ALPHA, LIMIT, OFFSET)
                rows64 = rows.to(gl.int64)[:, None]
                gl.store(c_ptr + rows64 * stride_c + cols[None, :], _pack_pairs(dg, dl), mask=row_ok[:, None] & col_ok,
                         eviction_policy="evict_first")
                if ONES_COL:
                    h = gl.where(cols[None, :] == N, 1.0, h)
                gl.store(out2_ptr + rows64 * stride_out2 + cols[None, :], h.to(out2_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & h_ok, eviction_policy="evict_first")
            _partition_barrier()  # both warps have read the half: its consumer may write the next tile's
            mbarrier.arrive(dh_empty.index(c))


@gluon.jit
def _grouped_mm_ws_dswiglu_kernel(
    a_desc, b_desc,  # a (M, K) [BM, BK]; b (E, N, K) [1, BN, BK] (B_TRANS) or (E, K, N) [1, BK, BN]
    aux_ptr, stride_aux, c_ptr, stride_c,  # aux and d_aux (M, 2N) as int32 words (M, N)
    out2_ptr, stride_out2,  # h (M, N2)
    scale_ptr, parts_ptr,  # HAS_SCALE: s (M,) fp32 and the row sums (tiles_n, M) fp32; else unused
    table, M, N, N2, K,  # the row-tile table of _tile_table_kernel
    BLOCK_N: gl.constexpr,  # the tile's columns (the B box's)
    NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_TRANS: gl.constexpr,
    HAS_SCALE: gl.constexpr, ONES_COL: gl.constexpr,  # ONES_COL: N2 > N (module doc)
    EPI_ROWS: gl.constexpr,  # rows per step of the epilogue partition (a multiple of 2: its 2 warps)
    ALPHA: gl.constexpr, LIMIT: gl.constexpr, OFFSET: gl.constexpr,
):
    a_bufs, b_bufs, ready, empty = _ring_state(a_desc, b_desc, 1, STAGES, 2)
    HALF: gl.constexpr = a_desc.block_type.shape[0] // 2
    PERIOD: gl.constexpr = 8 if EPI_ROWS >= 8 else EPI_ROWS  # the swizzle's period in rows (module doc)
    bufs = gl.allocate_shared_memory(gl.bfloat16, [2, HALF, BLOCK_N], gl.SwizzledSharedLayout(8, 1, PERIOD, [1, 0]))
    dh_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dh_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(dh_ready.index(i), count=1)
        mbarrier.init(dh_empty.index(i), count=1)
    tiles_n = gl.cdiv(N, BLOCK_N)

    # (argument tuples are spelled out: a tuple built with `+` turns constexprs into tensors)
    gl.warp_specialize(
        [
            (_dsw_mma_partition, (a_bufs, b_bufs, ready, empty, bufs.index(0), dh_ready.index(0), dh_empty.index(0),
                                  table, K, tiles_n, 0, NUM_SMS, STAGES, B_TRANS)),
            (_dsw_mma_partition, (a_bufs, b_bufs, ready, empty, bufs.index(1), dh_ready.index(1), dh_empty.index(1),
                                  table, K, tiles_n, 1, NUM_SMS, STAGES, B_TRANS)),
            (_dsw_epilogue_partition, (bufs, dh_ready, dh_empty, aux_ptr, stride_aux, c_ptr, stride_c, out2_ptr,
                                       stride_out2, scale_ptr, parts_ptr, M, table, N, N2, tiles_n,
                                       NUM_SMS, GROUP_M, HAS_SCALE, ONES_COL, EPI_ROWS, ALPHA, LIMIT, OFFSET)),
            (_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, table, K, tiles_n,
                               NUM_SMS, GROUP_M, STAGES, B_TRANS)),
        ],
        [4, 2, 1],  # consumer 1, the epilogue, the loader
        [168, 168, 168],  # (module doc: three warpgroups, 168 registers each)
    )

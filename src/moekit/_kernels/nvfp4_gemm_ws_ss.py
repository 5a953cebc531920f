"""The NVFP4 grouped GEMM for few rows per expert with the weights decoded into shared memory (Gluon).

``_grouped_mm_nvfp4_ws_ss_kernel`` computes what ``nvfp4_gemm_ws._grouped_mm_nvfp4_ws_kernel`` computes,
``out[rows_g] = (a[rows_g] @ w[g]^T) * a_global * w_global[g]``, on the same inputs and tiles (128 weight
rows by BLOCK_M activation rows of one expert), with the work split otherwise:

* the loader warp is that kernel's: each K step's packed codes and activations by TMA, the scale
  words by ``cp.async``, into a ring of STAGES stages of CHUNKS 64-element chunks;
* two decoder warpgroups, 64 weight rows each, decode every chunk of their rows to f16 (the same
  PTX, ``_E2M1_2WORDS_SCALED_F16``) and store it into a second ring of DSTAGES decoded [64, 64] tiles
  (128-byte swizzle), then release the code stage;
* one MMA warpgroup issues the wgmmas with both operands in shared memory (the decoded weights as A,
  the activations as B) into two [64, BLOCK_M] accumulators, one per decoder's rows, and runs the
  epilogue, while the decoders go on with the next tile.

So the warps that wait on the tensor cores do no decoding, and the decoders never wait for a wgmma.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from .hopper_gemm import _advance, _tile_clamped
from .nvfp4_gemm_ws import _E2M1_2WORDS_CONSTRAINTS, _E2M1_2WORDS_SCALED_F16, CHUNK, ROWS_W, _ws_load_partition

# a barrier over the calling partition's warps: Triton 3.6 spells it thread_barrier, 3.7 barrier
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.jit
def _decode_rows(w_bufs, s_bufs, slot, DECODER: gl.constexpr, WL: gl.constexpr):
    """Chunk ``slot`` of the code ring for decoder DECODER: its 64 rows' words and scale words from
    shared memory -> the [64, 64] f16 values (times their block scales, exact)."""
    word_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    wbox = w_bufs.index(slot)._reinterpret(gl.int32, [ROWS_W, 8], word_smem)
    words = gl.reshape(wbox.slice(DECODER * 64, 64, dim=0).load(WL), [64, 4, 2])  # [row, t, j]
    L3: gl.constexpr = words.type.layout
    sw = s_bufs.index(slot * 2 + DECODER).load(gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    w0, w1 = gl.split(words)
    o = gl.inline_asm_elementwise(
        _E2M1_2WORDS_SCALED_F16, _E2M1_2WORDS_CONSTRAINTS, [w0, w1, gl.expand_dims(sw, 1)],
        dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    # as in nvfp4_gemm_ws._decode_chunk: [row, t, e, h, gg] per word j, then [row, j, gg, h, t, e]
    x0 = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])), gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
    x1 = gl.join(gl.join(gl.join(o[8], o[9]), gl.join(o[10], o[11])),
                 gl.join(gl.join(o[12], o[13]), gl.join(o[14], o[15])))
    x = gl.permute(gl.join(x0, x1), [0, 5, 4, 3, 1, 2])
    return gl.reshape(x, [64, CHUNK])


@gluon.jit
def _ss_decode_partition(w_bufs, s_bufs, ready, empty, d_bufs, d_ready, d_empty, table, K, tiles_n,
                         DECODER: gl.constexpr, NUM_PROGRAMS: gl.constexpr, STAGES: gl.constexpr,
                         CHUNKS: gl.constexpr, DSTAGES: gl.constexpr):
    """Decoder warpgroup DECODER: weight rows [64 * DECODER, +64) of every chunk, into the decoded ring."""
    # a chunk's words [64 rows, 8 words] as nvfp4_gemm_ws reads them (word 2t + j of rows r and r + 8)
    WL: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]],
                                                  lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                                  warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 8])
    total = gl.load(table) * tiles_n
    k_iters = gl.cdiv(K // CHUNK, CHUNKS)
    idx = 0
    phase = 0
    didx = 0
    dphase = 1  # the first pass over the decoded ring finds every tile free
    for _t in range(gl.program_id(0), total, NUM_PROGRAMS):
        for _k in range(k_iters):
            mbarrier.wait(ready.index(idx), phase)
            for c in gl.static_range(CHUNKS):
                x = _decode_rows(w_bufs, s_bufs, idx * CHUNKS + c, DECODER, WL)
                mbarrier.wait(d_empty.index(didx), dphase)
                d_bufs.index(didx * 2 + DECODER).store(x)
                fence_async_shared()
                _partition_barrier()  # every thread's rows are stored (and the stage's codes read)
                mbarrier.arrive(d_ready.index(didx))
                didx, dphase = _advance(didx, dphase, DSTAGES)
            mbarrier.arrive(empty.index(idx))
            idx, phase = _advance(idx, phase, STAGES)


@gluon.jit
def _ss_mma_partition(a_bufs, d_bufs, ready, empty, d_ready, d_empty, out, stride_out, a_global, w_global,
                      stride_wg, table, N, K, tiles_n, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr,
                      STAGES: gl.constexpr, CHUNKS: gl.constexpr, DSTAGES: gl.constexpr):
    """The MMA warpgroup: both halves of every tile from the decoded ring and the activation ring, and the
    epilogue (global scales, transposed pointer store of the expert's rows)."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    total = gl.load(table) * tiles_n
    k_iters = gl.cdiv(K // CHUNK, CHUNKS)
    ag = gl.load(a_global)
    wi = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))  # a half's weight rows
    mi = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))  # the tile's activation rows
    idx = 0
    phase = 0
    didx = 0
    dphase = 0
    nxt = _tile_clamped(gl.program_id(0), total, table, tiles_n, BLOCK_M, GROUP_M)
    for t in range(gl.program_id(0), total, NUM_PROGRAMS):
        g, row, end, pid_n = nxt
        nxt = _tile_clamped(t + NUM_PROGRAMS, total, table, tiles_n, BLOCK_M, GROUP_M)
        acc0 = warpgroup_mma_init(gl.zeros([64, BLOCK_M], gl.float32, acc_layout))
        acc1 = warpgroup_mma_init(gl.zeros([64, BLOCK_M], gl.float32, acc_layout))
        for _k in range(k_iters):
            mbarrier.wait(ready.index(idx), phase)
            prev = didx  # bound to its own value before the loop (a name copied in the body: design 13)
            for c in gl.static_range(CHUNKS):
                mbarrier.wait(d_ready.index(didx), dphase)
                b = a_bufs.index(idx * CHUNKS + c).permute((1, 0))
                acc0 = warpgroup_mma(d_bufs.index(didx * 2), b, acc0, is_async=True)
                acc1 = warpgroup_mma(d_bufs.index(didx * 2 + 1), b, acc1, is_async=True)
                if c > 0:  # the previous chunk's two wgmmas are done: its decoded tiles are free
                    warpgroup_mma_wait(2, deps=(acc0, acc1))
                    mbarrier.arrive(d_empty.index(prev))
                prev = didx
                didx, dphase = _advance(didx, dphase, DSTAGES)
            warpgroup_mma_wait(0, deps=(acc0, acc1))
            mbarrier.arrive(d_empty.index(prev))
            mbarrier.arrive(empty.index(idx))
            idx, phase = _advance(idx, phase, STAGES)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        scale = ag * gl.load(w_global + g.to(gl.int64) * stride_wg)
        rows = row + mi
        row_ok = gl.expand_dims(rows < end, 0)
        dst = out + gl.expand_dims(rows.to(gl.int64) * stride_out, 0)
        cols = pid_n * ROWS_W + wi
        gl.store(dst + gl.expand_dims(cols, 1), (acc0 * scale).to(out.dtype.element_ty),
                 mask=row_ok & gl.expand_dims(cols < N, 1))
        cols = cols + 64
        gl.store(dst + gl.expand_dims(cols, 1), (acc1 * scale).to(out.dtype.element_ty),
                 mask=row_ok & gl.expand_dims(cols < N, 1))


@gluon.jit
def _grouped_mm_nvfp4_ws_ss_kernel(
    a_desc,  # the decoded activations (M, K) f16, boxes [BLOCK_M, 64], 128-byte swizzle
    w_desc,  # the packed weight codes as (E * N, K / 2) uint8, boxes [128, 32], no swizzle
    w_scales,  # the weights' e4m3 scale codes as (E * N, K / 64) int32 words (row-major, contiguous)
    a_global, w_global, stride_wg,  # () fp32; (E,) fp32
    out, stride_out,  # (M, N), unit column stride
    table,  # the row-tile table of hopper_gemm._tile_table_kernel (BLOCK_M rows per tile)
    N, K,
    NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, CHUNKS: gl.constexpr,
    DSTAGES: gl.constexpr,  # decoded [128, 64] f16 tiles in flight between the decoders and the MMA
    REGS: gl.constexpr,  # registers per thread of the decoder warpgroups (the launch's maxnreg)
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * CHUNKS, BLOCK_M, CHUNK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * CHUNKS, ROWS_W, CHUNK // 2], w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gl.int32, [STAGES * CHUNKS * 2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    d_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    d_bufs = gl.allocate_shared_memory(gl.float16, [DSTAGES * 2, 64, CHUNK], d_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [DSTAGES, 1], mbarrier.MBarrierLayout())
    d_empty = gl.allocate_shared_memory(gl.int64, [DSTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1 + 32)  # the TMA bytes' arrival, one cp.async arrival per loader lane
        mbarrier.init(empty.index(i), count=3)  # both decoders (codes, scales) and the MMA (activations)
    for i in gl.static_range(DSTAGES):
        mbarrier.init(d_ready.index(i), count=2)  # both decoders' halves
        mbarrier.init(d_empty.index(i), count=1)  # the MMA warpgroup
    tiles_n = gl.cdiv(N, ROWS_W)
    gl.warp_specialize(
        [
            (_ss_mma_partition, (a_bufs, d_bufs, ready, empty, d_ready, d_empty, out, stride_out, a_global,
                                 w_global, stride_wg, table, N, K, tiles_n, NUM_PROGRAMS, GROUP_M, STAGES, CHUNKS,
                                 DSTAGES)),
            (_ss_decode_partition, (w_bufs, s_bufs, ready, empty, d_bufs, d_ready, d_empty, table, K, tiles_n, 0,
                                    NUM_PROGRAMS, STAGES, CHUNKS, DSTAGES)),
            (_ss_decode_partition, (w_bufs, s_bufs, ready, empty, d_bufs, d_ready, d_empty, table, K, tiles_n, 1,
                                    NUM_PROGRAMS, STAGES, CHUNKS, DSTAGES)),
            (_ws_load_partition, (a_desc, w_desc, w_scales, a_bufs, w_bufs, s_bufs, ready, empty, table, N, K,
                                  tiles_n, NUM_PROGRAMS, GROUP_M, STAGES, CHUNKS)),
        ],
        [4, 4, 1],
        [REGS, REGS, 40],
    )

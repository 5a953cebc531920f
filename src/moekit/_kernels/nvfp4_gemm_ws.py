"""The NVFP4 grouped GEMM for few rows per expert, warp-specialized for Hopper (Gluon).

``_grouped_mm_nvfp4_ws_kernel`` computes ``_grouped_mm_nvfp4_kernel``'s transposed tile (``SWAP`` with
``A_DECODED``, packed weights, the PTX decode; ``_kernels/nvfp4_gemm.py``) with the weights streamed
through shared memory instead of registers: ``out[rows_g] = (a[rows_g] @ w[g]^T) * a_global *
w_global[g]``, a the activations already decoded to f16 (value * block scale, exact), w the packed
e2m1 codes (``nvfp4_gemm.pack_weights``) with their e4m3 block scales.

The schedule (persistent programs, one or two per SM, over tiles of 128 weight rows by BLOCK_M
activation rows of one expert, from the row-tile table of ``hopper_gemm._tile_table_kernel``):

* a loader warp streams each K step's boxes into a ring of STAGES stages: CHUNKS weight boxes of
  [128, 32] bytes (64 elements per row, unswizzled: the consumers read them with their own layout)
  and CHUNKS activation boxes of [BLOCK_M, 64] f16 by TMA, and the step's scale words (four e4m3
  scales, one 64-element chunk, per 32-bit word) by ``cp.async``: the scales' row stride, K / 16
  bytes, is not the 16-byte multiple that a TMA descriptor needs (K = 2880: 180);
* two consumer warpgroups, 64 weight rows each, load their bytes from the stage in the layout of the
  wgmma's register operand, decode them to f16 (``_E2M1_2WORDS_SCALED_F16``), and run the wgmma with
  the weights from registers and the activations from shared memory (the tile transposed: the
  weights' rows are the MMA's M, the expert's rows its N).

The loader runs ahead by the ring's depth, so the weights' DRAM latency stays off the consumers'
path; in the Triton kernel each program waits out its own loads, one K step ahead at best.

Why the packed order matches the register operand: for each 16-element block of a row, thread t of a
quad of the wgmma layout holds elements 2t, 2t + 1 (register 0 or 1 by row) and 2t + 8, 2t + 9
(registers 2, 3), the bytes t and t + 4 of the block. ``pack_weights`` puts those bytes of two blocks
into one word: word w = 2t + j of a 64-element chunk holds bytes t and t + 4 of blocks 2j and 2j + 1.
A thread's two words per chunk and row are 8 consecutive bytes, one 64-bit shared load, and the
decoded f16 values land in the operand's registers with no data movement (``convert_layout`` is
asserted trivial). Within each word it also moves the codes' sign bits beside the table bytes they
belong to (``_E2M1_2WORDS_SCALED_F16``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from .hopper_gemm import _advance, _tile_clamped
from .nvfp4_gemm import _E2M1_TABLE, _word_decode_ptx

ROWS_W = gl.constexpr(128)  # weight rows per tile: two consumer warpgroups of 64
CHUNK = gl.constexpr(64)  # elements per packed chunk (32 bytes, 8 words, 4 scale blocks)

# Two packed words of a row ($16: j = 0, $17: j = 1) and the row's scale word ($18: the e4m3 scales of
# blocks 0-3 of the chunk, block 0 in the low byte) -> the words' 16 elements in f16 ($0-$7 from word 0,
# $8-$15 from word 1, byte by byte, the low nibble first), each e2m1 value times its block scale
# (exact). Word j holds bytes of blocks 2j and 2j + 1, so one scale word serves both: two cvt turn its
# halves into f16 pairs. Per word (eight codes c0-c7, the magnitude of code i in bits 4i..4i+2):
# - the magnitudes (signs masked off) select the f16 high bytes of 0, 0.5, 1, 1.5, 2, 3, 4, 6 from an
#   8-byte table, four codes per prmt (h0: c0-c3, h1: c4-c7; the low bytes are 0 in f16);
# - the signs: the packed order keeps the signs of c0-c3 in the top bits of the word's bytes and those
#   of c4-c7 in bit 3 (``nvfp4_gemm.pack_weights``), so a lop3 ors them into h0 (and, the word shifted
#   by 4, into h1);
# - a prmt per pair spreads two high bytes into an f16 pair, and a packed multiply applies the block
#   scale (an operand select of the scale's f16 half).
_E2M1_2WORDS_SCALED_F16 = gl.constexpr("""{
.reg .b32 m, mh, h0, h1, p0, p1, p2, p3, v4, ta, tb, sa, sb, s01, s23;
.reg .b16 t0, t1, s0, s1, s2, s3;
mov.b32 {t0, t1}, $18;
cvt.rn.f16x2.e4m3x2 s01, t0;
cvt.rn.f16x2.e4m3x2 s23, t1;
mov.b32 {s0, s1}, s01;
mov.b32 {s2, s3}, s23;
""" + _E2M1_TABLE + _word_decode_ptx("$16", "s0", "s1", 0) + _word_decode_ptx("$17", "s2", "s3", 8) + "}")


_E2M1_2WORDS_CONSTRAINTS = gl.constexpr(",".join(["=h"] * 16) + ",r,r,r")


@gluon.jit
def _decode_chunk(words, scale_words, dot_layout: gl.constexpr):
    """One chunk of a consumer's 64 weight rows: words [64, 4 (t), 2 (j)] int32 (word 2t + j of each row,
    j in registers) and the rows' scale words [64, 1] (four e4m3 codes, blocks 0-3 of the chunk) -> the
    decoded [64, 64] f16 tile in the wgmma's register-operand layout."""
    w0, w1 = gl.split(words)
    o = gl.inline_asm_elementwise(
        _E2M1_2WORDS_SCALED_F16, _E2M1_2WORDS_CONSTRAINTS, [w0, w1, scale_words],
        dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    # per word j: [64, 4 (t), e, h, gg] (each join adds a last dim); word byte 2 gg + h holds elements
    # 2t + e of half h of block 2j + gg, i.e. element 32j + 16gg + 8h + 2t + e of the chunk
    x0 = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])), gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
    x1 = gl.join(gl.join(gl.join(o[8], o[9]), gl.join(o[10], o[11])),
                 gl.join(gl.join(o[12], o[13]), gl.join(o[14], o[15])))
    x = gl.permute(gl.join(x0, x1), [0, 5, 4, 3, 1, 2])  # [row, t, e, h, gg, j] -> [row, j, gg, h, t, e]
    x = gl.reshape(x, [64, CHUNK])
    return gl.convert_layout(x, dot_layout, assert_trivial=True)


@gluon.jit
def _load_chunk(w_bufs, s_bufs, idx, c: gl.constexpr, CONSUMER: gl.constexpr, CHUNKS: gl.constexpr,
                dot_layout: gl.constexpr, WL: gl.constexpr):
    """Chunk c of ring stage idx for consumer CONSUMER: its 64 rows' words and scale words from shared
    memory, decoded (``_decode_chunk``)."""
    word_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    wbox = w_bufs.index(idx * CHUNKS + c)._reinterpret(gl.int32, [ROWS_W, 8], word_smem)
    words = gl.reshape(wbox.slice(CONSUMER * 64, 64, dim=0).load(WL), [64, 4, 2])  # [row, t, j]
    L3: gl.constexpr = words.type.layout
    sw = s_bufs.index((idx * CHUNKS + c) * 2 + CONSUMER).load(gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    return _decode_chunk(words, gl.expand_dims(sw, 1), dot_layout)


@gluon.jit
def _ws_load_partition(a_desc, w_desc, w_scales, a_bufs, w_bufs, s_bufs, ready, empty, table, N, K, tiles_n,
                       NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                       CHUNKS: gl.constexpr):
    """The loader warp: TMA for the weight and activation boxes, cp.async for the scale words."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    # the scale words of one (chunk, consumer) slot: 64 rows, 2 per lane
    SL: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    ri = gl.arange(0, 64, layout=SL)
    total = gl.load(table) * tiles_n
    kw = K // CHUNK  # scale words (chunks) per weight row
    k_iters = gl.cdiv(kw, CHUNKS)
    nbytes: gl.constexpr = CHUNKS * (a_desc.block_type.nbytes + w_desc.block_type.nbytes)
    idx = 0
    phase = 1  # the first pass over the ring finds every stage free
    nxt = _tile_clamped(gl.program_id(0), total, table, tiles_n, BLOCK_M, GROUP_M)
    for t in range(gl.program_id(0), total, NUM_PROGRAMS):
        g, row, end, pid_n = nxt
        nxt = _tile_clamped(t + NUM_PROGRAMS, total, table, tiles_n, BLOCK_M, GROUP_M)
        col = pid_n * ROWS_W
        wrow = g * N + col  # the tile's first row of the (E * N, K / 2) weight bytes
        srows = (wrow + ri).to(gl.int64) * kw  # the consumer-0 rows; consumer 1's are 64 further
        # rows past N belong to the next expert: their output columns are never stored, and their scale
        # words (past the last expert: out of bounds) are not read
        for ki in range(k_iters):
            mbarrier.wait(empty.index(idx), phase)
            bar = ready.index(idx)
            mbarrier.expect(bar, nbytes)
            for c in gl.static_range(CHUNKS):
                kc = ki * CHUNKS + c  # chunks past K read as zeros (codes and activations)
                tma.async_copy_global_to_shared(a_desc, [row, kc * CHUNK], bar, a_bufs.index(idx * CHUNKS + c))
                tma.async_copy_global_to_shared(w_desc, [wrow, kc * (CHUNK // 2)], bar,
                                                w_bufs.index(idx * CHUNKS + c))
            for c in gl.static_range(CHUNKS):
                kc = ki * CHUNKS + c
                for h in gl.static_range(2):
                    async_copy.async_copy_global_to_shared(s_bufs.index((idx * CHUNKS + c) * 2 + h),
                                                           w_scales + (srows + h * 64 * kw + kc),
                                                           mask=(col + h * 64 + ri < N) & (kc < kw))
            async_copy.mbarrier_arrive(bar, increment_count=False)
            idx, phase = _advance(idx, phase, STAGES)


@gluon.jit
def _ws_mma_partition(a_bufs, w_bufs, s_bufs, ready, empty, out, stride_out, a_global, w_global, stride_wg,
                      table, N, K, tiles_n, CONSUMER: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                      GROUP_M: gl.constexpr, STAGES: gl.constexpr, CHUNKS: gl.constexpr):
    """Consumer warpgroup CONSUMER: weight rows [64 * CONSUMER, +64) of every tile, decode, wgmma and
    the epilogue (global scales, transposed pointer store of the expert's rows)."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    dot_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # a chunk's words [64 rows, 8 words]: word 2t + j of rows r and r + 8 in the thread that holds
    # those rows' elements 2t.. of every block in the wgmma register layout (rows: lane // 4, +8 by
    # register, +16 by warp; t: lane % 4; j by register)
    WL: gl.constexpr = gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]],
                                                  lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                                  warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 8])
    total = gl.load(table) * tiles_n
    k_iters = gl.cdiv(K // CHUNK, CHUNKS)
    ag = gl.load(a_global)
    wi = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))  # the consumer's weight rows
    mi = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc_layout))  # the tile's activation rows
    idx = 0
    phase = 0
    nxt = _tile_clamped(gl.program_id(0), total, table, tiles_n, BLOCK_M, GROUP_M)
    for t in range(gl.program_id(0), total, NUM_PROGRAMS):
        g, row, end, pid_n = nxt
        nxt = _tile_clamped(t + NUM_PROGRAMS, total, table, tiles_n, BLOCK_M, GROUP_M)
        acc = warpgroup_mma_init(gl.zeros([64, BLOCK_M], gl.float32, acc_layout))
        for _ in range(k_iters):
            mbarrier.wait(ready.index(idx), phase)
            # chunk c + 1 decodes while chunk c's wgmma runs; the last waits for its own (a register
            # operand stays live until its wgmma is done: ``deps``)
            wt = _load_chunk(w_bufs, s_bufs, idx, 0, CONSUMER, CHUNKS, dot_layout, WL)
            for c in gl.static_range(CHUNKS):
                acc = warpgroup_mma(wt, a_bufs.index(idx * CHUNKS + c).permute((1, 0)), acc, is_async=True)
                if c + 1 < CHUNKS:
                    wt_next = _load_chunk(w_bufs, s_bufs, idx, c + 1, CONSUMER, CHUNKS, dot_layout, WL)
                    warpgroup_mma_wait(0, deps=(acc, wt))
                    wt = wt_next
            warpgroup_mma_wait(0, deps=(acc, wt))
            mbarrier.arrive(empty.index(idx))
            idx, phase = _advance(idx, phase, STAGES)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        # the global scales' product, then one multiply, as the Triton kernel and the reference do
        scale = ag * gl.load(w_global + g.to(gl.int64) * stride_wg)
        cols = pid_n * ROWS_W + CONSUMER * 64 + wi
        rows = row + mi
        dst = out + gl.expand_dims(rows.to(gl.int64) * stride_out, 0) + gl.expand_dims(cols, 1)
        mask = gl.expand_dims(rows < end, 0) & gl.expand_dims(cols < N, 1)
        gl.store(dst, (acc * scale).to(out.dtype.element_ty), mask=mask)


@gluon.jit
def _grouped_mm_nvfp4_ws_kernel(
    a_desc,  # the decoded activations (M, K) f16, boxes [BLOCK_M, 64], 128-byte swizzle
    w_desc,  # the packed weight codes as (E * N, K / 2) uint8, boxes [128, 32], no swizzle
    w_scales,  # the weights' e4m3 scale codes as (E * N, K / 64) int32 words (row-major, contiguous)
    a_global, w_global, stride_wg,  # () fp32; (E,) fp32
    out, stride_out,  # (M, N), unit column stride
    table,  # the row-tile table of hopper_gemm._tile_table_kernel (BLOCK_M rows per tile)
    N, K,
    NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, CHUNKS: gl.constexpr,
    REGS: gl.constexpr,  # registers per thread of the consumer warpgroups (the launch's maxnreg)
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * CHUNKS, BLOCK_M, CHUNK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * CHUNKS, ROWS_W, CHUNK // 2], w_desc.layout)
    # scale words: one row of 64 per (stage, chunk, consumer)
    s_bufs = gl.allocate_shared_memory(gl.int32, [STAGES * CHUNKS * 2, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1 + 32)  # the TMA bytes' arrival, one cp.async arrival per loader lane
        mbarrier.init(empty.index(i), count=2)  # both consumers
    tiles_n = gl.cdiv(N, ROWS_W)
    gl.warp_specialize(
        [
            (_ws_mma_partition, (a_bufs, w_bufs, s_bufs, ready, empty, out, stride_out, a_global, w_global,
                                 stride_wg, table, N, K, tiles_n, 0, NUM_PROGRAMS, GROUP_M, STAGES, CHUNKS)),
            (_ws_mma_partition, (a_bufs, w_bufs, s_bufs, ready, empty, out, stride_out, a_global, w_global,
                                 stride_wg, table, N, K, tiles_n, 1, NUM_PROGRAMS, GROUP_M, STAGES, CHUNKS)),
            (_ws_load_partition, (a_desc, w_desc, w_scales, a_bufs, w_bufs, s_bufs, ready, empty, table, N, K,
                                  tiles_n, NUM_PROGRAMS, GROUP_M, STAGES, CHUNKS)),
        ],
        [4, 1],
        [REGS, 40],
    )

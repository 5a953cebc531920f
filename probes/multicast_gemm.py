"""Probe (issue 16): a pipelined, warp-specialized GEMM in 2-CTA clusters with the weight tile
multicast, against the same kernel without multicast, moekit's one-CTA kernel and cuBLAS.

C (M, N) = A (M, K) @ B (N, K)^T, bf16 in, bf16 out, fp32 accumulate, on Triton >= 3.7 (Gluon's
``multicast=``). The schedule is moekit's (``_kernels/hopper_gemm.py``): a TMA loader, two consumer
warpgroups of 64 rows sharing each CTA's 128 x 256 tile, a ring of STAGES stages, the bf16 tile staged
in shared memory and sent out by a TMA store. A cluster of two CTAs takes a 256 x 256 tile: each CTA
loads its own 128 rows of A (two [64, BK] boxes, one per consumer), and the [256, BK] B box of each K
step is loaded once from L2 by cluster rank 0 and multicast into both CTAs' stage.

Layouts: every shared and distributed layout is *broadcast* across the cluster (``cga_layout=[[0,
0]]``), so the code generator treats each CTA as if it were alone; each CTA reads its rank
(``%cluster_ctarank``) and offsets its rows by it. Only the B load is a cluster operation: Gluon issues
the multicast copy from rank 0 alone, and each CTA's "ready" mbarrier expects its A boxes plus the
whole B box. The barriers come from ``mbarrier.allocate_mbarrier(batch=STAGES)`` (one per CTA); a
broadcast mbarrier layout handed to ``warp_specialize`` crashed the compiler.

A cluster barrier waits for every non-exited thread of the cluster, and Triton's worker warps wait in
its partition dispatch until the default warps reach ``warp_specialize`` (read from the PTX). So the
barriers' cluster-wide initialisation sync runs at the start of every partition, and the loader has 4
warps (one issues): an idle padding warp beside a one-warp loader would never arrive.

Stage release across the cluster: rank 0 may refill a stage only when *both* CTAs' consumers are done
with it, since its copy lands in both. Two ways (variants below):
* ``remote``: each consumer arrives on rank 0's "empty" barrier of the stage (``mapa`` + ``mbarrier.arrive
  .shared::cluster``, PTX's default semantics: release at CTA scope, as CUTLASS's ``ClusterBarrier``);
  rank 0's barriers count both CTAs' consumers, rank 1's its own. Gluon 3.7.1 has no remote arrive
  for sm_90 (an mbarrier with the two-CTA layout lowers its arrive to the local ``shared::cta`` form)
  and no way to take a shared-memory address into inline PTX, so the barriers' byte offset is read
  back from the compiled PTX (``_empty_offset``) and checked after every launch. A probe only.
  Correct only because rank 1 cannot run ahead of rank 0 (it waits for rank 0's copy): the same
  protocol with each CTA loading its own B gave wrong results and launch failures.
* ``clusterbar``: the hardware cluster barrier, one phase per K step (every consumer thread arrives
  once its wgmma is done, after waiting for the previous phase; the loader arrives and waits for step
  j - STAGES before loading step j). Needs nothing from the compiler, but only one phase is ever in
  flight.

    PYTHONPATH=src python probes/multicast_gemm.py --compile-only   # sm_90 PTX facts, no GPU
    PYTHONPATH=src python probes/multicast_gemm.py                  # H100: check, then time
"""

import argparse
import functools
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    cluster,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moekit._kernels.grouped_gemm import _swizzle  # the tile order of moekit's kernels
from moekit._kernels.hopper_gemm import _advance

BM, BN, BK = 128, 256, 64  # per CTA (--bk sets BK)
STAGES = 3  # --stages
# the remote arrival's semantics (--arrive-sem): "" is PTX's default, release at CTA scope
ARRIVE_SEM = gl.constexpr("")
BCAST = [[0, 0]]  # a layout replicated over the two CTAs of a cluster


@gluon.jit
def _cluster_rank():
    # (inline asm needs an argument to set the result's shape: the program id, unused)
    return gl.inline_asm_elementwise("mov.u32 $0, %cluster_ctarank;", "=r,r", [gl.program_id(0)],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _arrive_rank0(stage, EMPTY_OFF: gl.constexpr, SEM: gl.constexpr):
    """One arrival (thread 0 of the warpgroup) on cluster rank 0's "empty" barrier of ``stage``, at byte
    EMPTY_OFF + 8 * stage of the kernel's shared memory (read back from the compiled PTX)."""
    gl.inline_asm_elementwise(
        f"""{{ .reg .b32 a, r, t; .reg .pred p;
        mov.u32 t, %tid.x; and.b32 t, t, 127; setp.eq.u32 p, t, 0;
        mov.u32 a, global_smem; mad.lo.u32 a, $1, 8, a; add.u32 a, a, {EMPTY_OFF};
        mapa.shared::cluster.u32 r, a, 0;
        @p mbarrier.arrive.{SEM}shared::cluster.b64 _, [r];
        mov.u32 $0, 0; }}""", "=r,r", [stage], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, CLUSTER_M: gl.constexpr,
            NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_CTAS: gl.constexpr,
            MULTICAST: gl.constexpr, EMPTY_OFF: gl.constexpr):
    HALF: gl.constexpr = a_desc.block_type.shape[0]  # A comes in two boxes, one per consumer
    BLOCK_M: gl.constexpr = 2 * HALF
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    tiles_m = gl.cdiv(M, CLUSTER_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_iters = gl.cdiv(K, BLOCK_K)
    rank = _cluster_rank() if NUM_CTAS > 1 else 0
    if NUM_CTAS > 1:  # the barriers' initialisation, cluster-wide (see the kernel)
        cluster.arrive(relaxed=True)
        cluster.wait()
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    idx = 0
    phase = 1
    j = 0  # K steps loaded so far (the cluster barrier's phase count)
    for t in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = _swizzle(t, tiles_m, tiles_n, GROUP_M)
        row = pid_m * CLUSTER_M + rank * BLOCK_M
        for ki in range(k_iters):
            if (NUM_CTAS > 1) & (EMPTY_OFF == -1):
                if j >= STAGES:  # both CTAs have freed the stage that step j - STAGES used
                    cluster.arrive()
                    cluster.wait()
            else:  # (clusters: rank 0's barrier counts both CTAs' consumers)
                mbarrier.wait(empty.index(idx), phase)
            bar = ready.index(idx)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [row, ki * BLOCK_K], bar, a_bufs.index(2 * idx))
            tma.async_copy_global_to_shared(a_desc, [row + HALF, ki * BLOCK_K], bar, a_bufs.index(2 * idx + 1))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, ki * BLOCK_K], bar, b_bufs.index(idx),
                                            multicast=MULTICAST)
            idx, phase = _advance(idx, phase, STAGES)
            j += 1
    if NUM_CTAS > 1:
        if EMPTY_OFF == -1:
            for _ in range(gl.minimum(j, STAGES)):  # the phases of the last stages
                cluster.arrive()
                cluster.wait()
        cluster.arrive()  # closing
        cluster.wait()


@gluon.jit
def _release(empty, idx, j, rank, STAGES: gl.constexpr, NUM_CTAS: gl.constexpr, EMPTY_OFF: gl.constexpr):
    """Free the stage before idx (step j - 1). Clusters: the cluster barrier (EMPTY_OFF < 0), or an
    arrival on rank 0's barrier plus, on rank 1, two on its own (each barrier counts 4)."""
    prev = gl.where(idx == 0, STAGES - 1, idx - 1)
    if (NUM_CTAS == 1) | (EMPTY_OFF == -2):  # -2: each CTA on its own (no multicast)
        mbarrier.arrive(empty.index(prev))
    elif EMPTY_OFF == -1:
        if j > 1:
            cluster.wait()
        cluster.arrive()
    else:
        # (Gluon's arrive syncs the warpgroup first: every warp's wgmma is done before either arrival)
        mbarrier.arrive(empty.index(prev), count=2, pred=rank == 1)
        _arrive_rank0(prev, EMPTY_OFF, ARRIVE_SEM)


@gluon.jit
def _consumer(a_bufs, b_bufs, ready, empty, buf, c_desc, M, N, K, CONSUMER: gl.constexpr, CLUSTER_M: gl.constexpr,
              NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_CTAS: gl.constexpr,
              EMPTY_OFF: gl.constexpr):
    HALF: gl.constexpr = a_bufs.shape[1]
    BLOCK_M: gl.constexpr = 2 * HALF
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16],
                                                         cga_layout=[[0, 0]] if NUM_CTAS > 1 else [])
    tiles_m = gl.cdiv(M, CLUSTER_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_iters = gl.cdiv(K, BLOCK_K)
    rank = _cluster_rank() if NUM_CTAS > 1 else 0
    if NUM_CTAS > 1:  # the barriers' initialisation, cluster-wide (see the kernel)
        if CONSUMER == 0:
            mbarrier.fence_init_release_cluster()  # by the thread that initialised them
        cluster.arrive(relaxed=True)
        cluster.wait()
    idx = 0
    phase = 0
    j = 0  # K steps consumed so far
    for t in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = _swizzle(t, tiles_m, tiles_n, GROUP_M)
        row = pid_m * CLUSTER_M + rank * BLOCK_M + CONSUMER * HALF
        acc = warpgroup_mma_init(gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout))
        for ki in range(k_iters):
            mbarrier.wait(ready.index(idx), phase)
            a = a_bufs.index(2 * idx + CONSUMER)
            acc = warpgroup_mma(a, b_bufs.index(idx).permute((1, 0)), acc, is_async=True)
            warpgroup_mma_wait(1, deps=(acc,))
            if ki > 0:  # the previous step's wgmma is done: free its stage
                _release(empty, idx, j, rank, STAGES, NUM_CTAS, EMPTY_OFF)
            idx, phase = _advance(idx, phase, STAGES)
            j += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if k_iters > 0:
            _release(empty, idx, j, rank, STAGES, NUM_CTAS, EMPTY_OFF)
        tma.store_wait(0)
        buf.store(acc.to(buf.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row, pid_n * BLOCK_N], buf)
    tma.store_wait(0)
    if NUM_CTAS > 1:
        if EMPTY_OFF == -1:
            if j > 0:
                cluster.wait()
        cluster.arrive()  # closing
        cluster.wait()


@gluon.jit
def _mc_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, MULTICAST: gl.constexpr, EMPTY_OFF: gl.constexpr):
    NUM_CTAS: gl.constexpr = gl.num_ctas()
    CLUSTER_M: gl.constexpr = 2 * a_desc.block_type.shape[0] * NUM_CTAS
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = mbarrier.allocate_mbarrier(batch=STAGES)  # one barrier per stage in each CTA
    empty = mbarrier.allocate_mbarrier(batch=STAGES)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2 if (NUM_CTAS == 1) | (EMPTY_OFF < 0) else 4)
    # A peer's multicast signals this CTA's barriers, so their initialisation must be visible
    # cluster-wide before any load. Every partition syncs the cluster on entry, not this code: the
    # worker warps wait in Triton's partition dispatch until the default warps reach warp_specialize,
    # and a cluster barrier needs every thread of the cluster. For the same reason the loader has 4
    # warps (one issues): an idle padding warp would never arrive.
    gl.warp_specialize(
        [
            (_consumer, (a_bufs, b_bufs, ready, empty, bufs.index(0), c_desc, M, N, K, 0, CLUSTER_M, NUM_PROGRAMS,
                         GROUP_M, STAGES, NUM_CTAS, EMPTY_OFF)),
            (_consumer, (a_bufs, b_bufs, ready, empty, bufs.index(1), c_desc, M, N, K, 1, CLUSTER_M, NUM_PROGRAMS,
                         GROUP_M, STAGES, NUM_CTAS, EMPTY_OFF)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, CLUSTER_M, NUM_PROGRAMS, GROUP_M,
                       STAGES, NUM_CTAS, MULTICAST, EMPTY_OFF)),
        ],
        [4, 4],
        [232, 40],
    )


def _layout(block, num_ctas):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16, cga_layout=BCAST if num_ctas > 1 else None)


def launch(a, b, c, *, num_ctas, multicast, remote=False, stages=None, group_m=8, programs=None):
    stages = stages or STAGES
    (m, k), n = a.shape, b.shape[0]
    descs = [TensorDescriptor.from_tensor(t, blk, _layout(blk, num_ctas))
             for t, blk in ((a, [BM // 2, BK]), (b, [BN, BK]), (c, [BM // 2, BN]))]
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    programs = programs or sms // num_ctas
    tiles = triton.cdiv(m, BM * num_ctas) * triton.cdiv(n, BN)
    grid = (min(programs, tiles),)
    if remote == "local":
        empty_off = -2
    else:
        empty_off = _empty_offset(num_ctas, multicast, stages, programs, group_m) if remote else -1
    kern = _mc_gemm_kernel[grid](*descs, m, n, k, NUM_PROGRAMS=programs, GROUP_M=group_m, STAGES=stages,
                                 MULTICAST=multicast, EMPTY_OFF=empty_off, num_warps=4, num_ctas=num_ctas,
                                 maxnreg=168)
    if empty_off >= 0:
        assert _init_offsets(kern.asm["ptx"], 4)[0] == empty_off, "the empty barriers moved"
    return kern


def _init_offsets(ptx, count):
    """Byte offsets in the kernel's shared memory of the mbarriers initialised with ``count``."""
    base = re.search(r"mov\.b32\s+(%r\d+), global_smem;", ptx).group(1)
    adds = dict(re.findall(rf"add\.s32\s+(%r\d+), {base}, (\d+);", ptx))
    inits = re.findall(rf"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\], {count};", ptx)
    return sorted(int(adds[r]) for r in inits)


_OFFSETS = {}


def _empty_offset(num_ctas, multicast, stages, programs, group_m):
    """Where the compiler put the "empty" barriers: compile once for sm_90 with a placeholder offset
    and read it back from the PTX (the offset does not depend on the placeholder)."""
    key = (num_ctas, multicast, stages, programs, group_m)
    if key not in _OFFSETS:
        kern = _compile(num_ctas, multicast, stages, programs, group_m, empty_off=0)
        offs = _init_offsets(kern.asm["ptx"], 4)
        assert len(offs) == stages and offs == [offs[0] + 8 * i for i in range(stages)], offs
        _OFFSETS[key] = offs[0]
    return _OFFSETS[key]


def _compile(num_ctas, multicast, stages, programs, group_m, empty_off):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {n: f"tensordesc<bf16{blk},{_layout(blk, num_ctas)!r}>"
           for n, blk in (("a_desc", [BM // 2, BK]), ("b_desc", [BN, BK]), ("c_desc", [BM // 2, BN]))}
    sig.update(M="i32", N="i32", K="i32", NUM_PROGRAMS="constexpr", GROUP_M="constexpr", STAGES="constexpr",
               MULTICAST="constexpr", EMPTY_OFF="constexpr")
    src = GluonASTSource(_mc_gemm_kernel, sig, dict(NUM_PROGRAMS=programs, GROUP_M=group_m, STAGES=stages,
                                                     MULTICAST=multicast, EMPTY_OFF=empty_off))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_ctas=num_ctas, maxnreg=168))


VARIANTS = {  # name: (num_ctas, multicast, stage release)
    "cluster2-multicast-remote": (2, True, True),
    "cluster2-multicast-clusterbar": (2, True, False),  # timed with --cluster-barrier
    "cluster2-own-B-local": (2, False, "local"),  # clusters, each CTA on its own: what clusters cost
    "1cta": (1, False, False),
}


def compile_only(dump):
    for name, (num_ctas, multicast, remote) in VARIANTS.items():
        programs = 132 // num_ctas
        off = -2 if remote == "local" else _empty_offset(num_ctas, multicast, STAGES, programs, 8) if remote else -1
        kern = _compile(num_ctas, multicast, STAGES, programs, 8, off)
        ptx = kern.asm["ptx"]
        if off >= 0:
            assert _init_offsets(ptx, 4)[0] == off
        print(f"[{name}] shared {kern.metadata.shared} B, empty barriers at {off}; PTX: multicast loads "
              f"{ptx.count('multicast::cluster')}, cluster barriers {ptx.count('barrier.cluster')}, remote arrives "
              f"{ptx.count('shared::cluster.b64')}, warps {kern.metadata.num_warps}")
        if dump:
            with open(f"{dump}/{name}.ptx", "w") as fh:
                fh.write(ptx)


def check_and_time(shapes, reps, with_clusterbar=False):
    from triton.testing import do_bench

    import moekit

    torch.manual_seed(0)
    failed = False
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = torch.mm(a, b.T)
        flops = 2 * m * n * k
        runs = {}
        for name, (num_ctas, multicast, remote) in VARIANTS.items():
            if name.endswith("clusterbar") and not with_clusterbar:
                continue
            c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            launch(a, b, c, num_ctas=num_ctas, multicast=multicast, remote=remote)
            torch.cuda.synchronize()
            bad = (c.float() - ref.float()).abs().max().item()
            ok = bad <= 0.02 * ref.float().abs().max().item() and not torch.isnan(c).any().item()
            failed |= not ok
            print(f"  {name} {m}x{n}x{k}: max |err| {bad:.3g} vs cuBLAS ({'ok' if ok else 'FAIL'})", flush=True)
            runs[name] = functools.partial(launch, a, b, c, num_ctas=num_ctas, multicast=multicast, remote=remote)
        if (m, n, k) == shapes[1] and with_clusterbar:  # fewer clusters than 66 (measured: slower)
            for p in (64, 60, 56):
                runs[f"multicast-remote {p} clusters"] = functools.partial(
                    launch, a, b, torch.empty_like(ref), num_ctas=2, multicast=True, remote=True, programs=p)
        offs = torch.tensor([m], device="cuda", dtype=torch.int32)
        bt = b.unsqueeze(0).mT  # (1, K, N), K-major: moekit's one-CTA warp-specialized kernel
        runs["moekit grouped_mm"] = functools.partial(moekit.grouped_mm, a, bt, offs)
        runs["cuBLAS mm"] = functools.partial(torch.mm, a, b.T)
        times = {name: [] for name in runs}
        for _ in range(reps):  # interleaved
            for name, fn in runs.items():
                times[name].append(do_bench(fn, warmup=25, rep=100))
        print(f"| {m}x{n}x{k} | " + " | ".join(
            f"{name} {sorted(v)[len(v) // 2]:.3f} ms {flops / sorted(v)[len(v) // 2] / 1e9:.0f} TF/s"
            for name, v in times.items()) + " |", flush=True)
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--dump", metavar="DIR", help="with --compile-only: write each variant's PTX into DIR")
    parser.add_argument("--cluster-barrier", action="store_true", help="also time the cluster-barrier release")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bk", type=int, default=BK)
    parser.add_argument("--stages", type=int, default=STAGES)
    parser.add_argument("--arrive-sem", default="", help='e.g. "release.cluster." (default: PTX\'s default)')
    args = parser.parse_args()
    globals().update(BK=args.bk, STAGES=args.stages, ARRIVE_SEM=gl.constexpr(args.arrive_sem))
    if args.compile_only:
        compile_only(args.dump)
        return 0
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}")
    # gpt-oss-20b up / down-projection rows (24576 tokens x 4), mixtral-like, a small one
    shapes = [(512, 512, 256), (98304, 5760, 2880), (98304, 2880, 2880), (32768, 28672, 4096)]
    return check_and_time(shapes, args.reps, args.cluster_barrier)


if __name__ == "__main__":
    sys.exit(main())

"""Probe: does Triton's Gluon lower TMA multicast for sm_90 in a 2-CTA cluster (issue 16)?

One tiny Gluon kernel, written the way Gluon writes multi-CTA kernels: the program is the whole
cluster (``num_ctas=2`` at launch; ``gl.program_id`` counts clusters, and the driver launches
``grid * num_ctas`` CTAs in clusters of ``num_ctas``), and each tensor's ``cga_layout`` says how
the cluster's CTAs split it. A cluster computes a [256, 128] tile of ``C = A @ B^T`` with K = 64:

* A: a [256, 64] box split by rows (``cga_layout=[[1, 0]]``): each CTA loads its own [128, 64]
  half, no multicast.
* B: a [128, 64] box (B is (N, K), K-major, as the weights are stored) broadcast to both CTAs
  (``cga_layout=[[0, 0]]``) and loaded with ``tma.async_copy_global_to_shared(..., multicast=True)``.
* Each CTA waits on its own mbarrier (``mbarrier.allocate_mbarrier()``: one per CTA) for its A half
  plus the whole B tile (``nbytes_per_cta``: 16 KB + 16 KB), after ``mbarrier.sync_cluster_init()``
  (fence + cluster arrive/wait, so that a peer's multicast never signals a barrier not yet
  initialised); then one ``warpgroup_mma`` on [128, 64] x [64, 128] per CTA, a fp32 TMA store of
  its [128, 128] half of C, and a closing cluster arrive/wait so that no CTA exits while a peer may
  still be writing into its shared memory.

Variants, each reported on its own: ``multicast`` (the kernel above) and ``broadcast``, the same
broadcast B layout loaded with ``multicast=False`` (the closest alternative: every CTA loads the
whole B itself), and ``1cta``, the plain one-CTA kernel as a control.

Found on 3.7.1 (compile-only): the ``multicast`` PTX has ``.explicitcluster`` /
``.reqnctapercluster 2`` and one ``cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::
complete_tx::bytes.multicast::cluster`` with ctaMask 3, issued by cluster rank 0 alone for the whole
[128, 64] B box; each CTA's own barrier expects 32768 bytes.

    python probes/multicast.py --compile-only   # no GPU: compile for sm_90, inspect the PTX
    python probes/multicast.py                  # on an H100: run, check against torch in fp32
"""

import argparse
import re
import sys
import traceback

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    cluster,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64  # per CTA
NUM_WARPS = 4
VARIANTS = {  # name: (num_ctas, multicast)
    "multicast": (2, True),
    "broadcast": (2, False),
    "1cta": (1, False),
}


@gluon.jit
def _multicast_mma_kernel(a_desc, b_desc, c_desc, MULTICAST: gl.constexpr):
    CLUSTER_M: gl.constexpr = c_desc.block_type.shape[0]
    CLUSTER_N: gl.constexpr = c_desc.block_type.shape[1]
    TWO_CTAS: gl.constexpr = gl.num_ctas() > 1
    off_m = gl.program_id(0) * CLUSTER_M
    off_n = gl.program_id(1) * CLUSTER_N

    a_smem = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    bar = mbarrier.allocate_mbarrier()  # one barrier in each CTA
    mbarrier.init(bar, count=1)
    if TWO_CTAS:
        # a peer's multicast signals this CTA's barrier: it must be initialised cluster-wide first
        mbarrier.sync_cluster_init()

    # per CTA: its half of A plus the whole B, whichever CTA issued the copy that brings it
    mbarrier.expect(bar, a_desc.nbytes_per_cta + b_desc.nbytes_per_cta)
    tma.async_copy_global_to_shared(a_desc, [off_m, 0], bar, a_smem)
    tma.async_copy_global_to_shared(b_desc, [off_n, 0], bar, b_smem, multicast=MULTICAST)
    mbarrier.wait(bar, phase=0, deps=[a_smem, b_smem])

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, CLUSTER_N, 16],
        cga_layout=c_desc.layout.cga_layout)
    acc = gl.zeros([CLUSTER_M, CLUSTER_N], gl.float32, acc_layout)
    acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, use_acc=False)
    mbarrier.invalidate(bar)

    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout, acc)
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)
    if TWO_CTAS:
        # no CTA may exit while its peer's multicast can still land in its shared memory
        cluster.arrive()
        cluster.wait()


def _layouts(num_ctas):
    """The NVMMA shared layouts of A, B and C for a cluster of ``num_ctas`` CTAs stacked along M."""
    split, bcast = ([[1, 0]], [[0, 0]]) if num_ctas == 2 else (None, None)
    a = gl.NVMMASharedLayout.get_default_for([BLOCK_M * num_ctas, BLOCK_K], gl.bfloat16, cga_layout=split)
    b = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16, cga_layout=bcast)
    c = gl.NVMMASharedLayout.get_default_for([BLOCK_M * num_ctas, BLOCK_N], gl.float32, cga_layout=split)
    return a, b, c


def _boxes(num_ctas):
    """Cluster-level box shapes of A, B and C."""
    return [BLOCK_M * num_ctas, BLOCK_K], [BLOCK_N, BLOCK_K], [BLOCK_M * num_ctas, BLOCK_N]


def compile_sm90(variant):
    """Compile one variant for sm_90 on the host; returns the CompiledKernel."""
    num_ctas, multicast = VARIANTS[variant]
    dtypes = ("bf16", "bf16", "fp32")
    sig = {name: f"tensordesc<{dt}{box},{layout!r}>"
           for name, dt, box, layout in zip(("a_desc", "b_desc", "c_desc"), dtypes, _boxes(num_ctas),
                                            _layouts(num_ctas), strict=True)}
    sig["MULTICAST"] = "constexpr"
    src = GluonASTSource(_multicast_mma_kernel, sig, {"MULTICAST": multicast})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS, num_ctas=num_ctas))


PTX_CHECKS = {
    "multicast TMA load (.multicast::cluster)": r"cp\.async\.bulk\.tensor\.[^;\n]*multicast::cluster[^;\n]*",
    "plain TMA load": r"cp\.async\.bulk\.tensor\.\w+\.shared::\w+\.global(?![^;\n]*multicast)[^;\n]*",
    ".reqnctapercluster": r"\.reqnctapercluster[^\n]*",
    ".explicitcluster": r"\.explicitcluster[^\n]*",
    "cluster barrier": r"barrier\.cluster\.(?:arrive|wait)[^;\n]*",
    "CTA rank in cluster (%cluster_ctarank)": r"%cluster_ctarank",
    "mbarrier init fence": r"fence\.mbarrier_init[^;\n]*",
    "remote mbarrier (mapa / shared::cluster mbarrier)": r"(?:mapa[^;\n]*|mbarrier\.[^;\n]*shared::cluster[^;\n]*)",
    "wgmma": r"wgmma\.mma_async[^;\n]*",
}


def report_ptx(ptx):
    """Print, for each PTX feature, whether it appears and its distinct lines (first few)."""
    for label, pattern in PTX_CHECKS.items():
        lines = sorted({" ".join(m.group(0).split()) for m in re.finditer(pattern, ptx)})
        print(f"  {label}: {'yes' if lines else 'NO'} ({len(lines)} distinct)")
        for line in lines[:3]:
            print(f"      {line if len(line) <= 140 else line[:137] + '...'}")


def compile_only(dump):
    multicast_ok = False
    for variant, (num_ctas, multicast) in VARIANTS.items():
        print(f"[{variant}] num_ctas={num_ctas} multicast={multicast}: ", end="", flush=True)
        try:
            kernel = compile_sm90(variant)
        except Exception as exc:
            print("FAILED to compile")
            print("  " + "".join(traceback.format_exception_only(exc)).strip().replace("\n", "\n  "))
            continue
        ptx = kernel.asm["ptx"]
        meta = kernel.metadata
        print(f"compiled to cubin ({len(kernel.asm['cubin'])} B), shared {meta.shared} B, num_ctas {meta.num_ctas}, "
              f"per-CTA TMA boxes {[d['block_size'] for d in meta.tensordesc_meta]}")
        report_ptx(ptx)
        if dump:
            path = f"{dump}/multicast_{variant}.ptx"
            with open(path, "w") as fh:
                fh.write(ptx)
            print(f"  PTX written to {path}")
        if variant == "multicast":
            multicast_ok = re.search(PTX_CHECKS["multicast TMA load (.multicast::cluster)"], ptx) is not None
    print(f"\nverdict: Triton {triton.__version__} Gluon "
          f"{'LOWERS' if multicast_ok else 'does NOT lower'} TMA multicast for sm_90 in a 2-CTA cluster")
    return 0 if multicast_ok else 1


def run_gpu(m, n):
    torch.manual_seed(0)
    failed = False
    for variant, (num_ctas, multicast) in VARIANTS.items():
        cluster_m = BLOCK_M * num_ctas
        assert m % cluster_m == 0 and n % BLOCK_N == 0
        a = torch.randn(m, BLOCK_K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, BLOCK_K, device="cuda", dtype=torch.bfloat16)  # (N, K), K-major
        c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.float32)
        descs = [TensorDescriptor.from_tensor(t, box, layout)
                 for t, box, layout in zip((a, b, c), _boxes(num_ctas), _layouts(num_ctas), strict=True)]
        kernel = _multicast_mma_kernel[(m // cluster_m, n // BLOCK_N)](
            *descs, MULTICAST=multicast, num_warps=NUM_WARPS, num_ctas=num_ctas)
        torch.cuda.synchronize()
        ref = a.float() @ b.float().T
        err = (c - ref).abs().max().item()
        ok = err <= 1e-3 * ref.abs().max().item()  # fp32 accumulate over K = 64: only summation order differs
        failed |= not ok
        has_mc = ".multicast::cluster" in kernel.asm["ptx"]
        print(f"[{variant}] num_ctas={num_ctas} multicast={multicast} ({m}x{n}x{BLOCK_K}): "
              f"max |err| {err:.3g}, PTX .multicast::cluster {has_mc}: {'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 on the host, inspect the PTX")
    parser.add_argument("--dump", metavar="DIR", help="with --compile-only: write each variant's PTX into DIR")
    parser.add_argument("-m", type=int, default=1024)
    parser.add_argument("-n", type=int, default=512)
    args = parser.parse_args()
    if args.compile_only:
        return compile_only(args.dump)
    return run_gpu(args.m, args.n)


if __name__ == "__main__":
    sys.exit(main())

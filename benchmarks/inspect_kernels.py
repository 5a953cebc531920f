"""Compiler report for every grouped-GEMM kernel variant compiled in this process.

Runs a small problem through each heuristic branch, then prints registers, spills, shared memory and
the count of HGMMA (wgmma) instructions in the SASS of each compiled variant.
"""

import torch

from moekit import grouped_mm
from moekit._kernels.grouped_gemm import _grouped_mm_ragged_k_kernel, _grouped_mm_ragged_m_kernel
from moekit.testing import offs_from_counts


def _warm():
    for rows, k, n, e in ((8192, 2880, 5760, 8), (256, 2880, 5760, 8)):
        offs = offs_from_counts([rows // e] * e, device="cuda")
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        grouped_mm(x, w.mT, offs)
        grouped_mm(dy, w, offs)
        grouped_mm(x.mT, dy, offs)
    torch.cuda.synchronize()


def main():
    _warm()
    print("| kernel | constexprs | regs | spills | smem KB | HGMMA | LDL/STL |")
    print("|---|---|---|---|---|---|---|")
    for fn in (_grouped_mm_ragged_m_kernel, _grouped_mm_ragged_k_kernel):
        for cache in fn.device_caches.values():
            for kernel in cache[0].values():
                sass = kernel.asm.get("sass", "") if hasattr(kernel.asm, "get") else ""
                const = {k: v for k, v in kernel.src.constants.items()} if hasattr(kernel, "src") else {}
                keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "USE_TMA", "B_TRANS", "FLATTEN")
                tag = ",".join(f"{k}={const.get(k)}" for k in keys if k in str(const)) or "-"
                local = sass.count("LDL") + sass.count("STL")
                print(
                    f"| {fn.__name__} | {tag} | {kernel.n_regs} | {kernel.n_spills} | "
                    f"{kernel.metadata.shared / 1024:.0f} | {sass.count('HGMMA')} | {local} |"
                )


if __name__ == "__main__":
    main()

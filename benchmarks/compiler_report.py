"""Compiler report for the grouped-GEMM kernels, built ahead of time for sm_90 on any machine.

No GPU needed: Triton compiles to a cubin for GPUTarget('cuda', 90), and its bundled cuobjdump reads
registers, local memory (spills) and the SASS. Prints a markdown table: one row per kernel variant
that the config heuristic can launch, with the HGMMA (wgmma) count and any LDL/STL (local memory).

    python benchmarks/compiler_report.py
"""

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moekit._kernels.experts import _grouped_mm_swiglu_kernel
from moekit._kernels.grouped_gemm import _grouped_mm_ragged_k_kernel, _grouped_mm_ragged_m_kernel
from moekit.config import TileConfig
from moekit.epilogue import SwiGLU

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

CONFIGS = {
    "128x256x64 w8 s3": TileConfig(128, 256, 64, num_warps=8, num_stages=3),
    "128x256x64 w8 s4 split": TileConfig(128, 256, 64, num_warps=8, num_stages=4, split_store=True),
    "64x256x64 w4 s4": TileConfig(64, 256, 64, num_warps=4, num_stages=4),
    "64x128x128 w4 s4": TileConfig(64, 128, 128, group_m=1, num_warps=4, num_stages=4),
    "128x128x64 w8 s3": TileConfig(128, 128, 64, num_warps=8, num_stages=3),
}


def _signature(kernel, cfg: TileConfig, tma: bool, b_trans: bool, ones_row: bool = False):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    cn = bn // 2 if cfg.split_store else bn
    ragged_k = kernel is _grouped_mm_ragged_k_kernel
    if not tma:
        descs = {"a": "*bf16", "b": "*bf16", "c": "*bf16"}
    elif ragged_k:
        descs = {"a": f"tensordesc<bf16[1,1,{bk},{bm}]>", "b": f"tensordesc<bf16[1,1,{bk},{bn}]>",
                 "c": f"tensordesc<bf16[1,{bm},{cn}]>"}
    else:
        b_block = f"1,{bn},{bk}" if b_trans else f"1,{bk},{bn}"
        descs = {"a": f"tensordesc<bf16[{bm},{bk}]>", "b": f"tensordesc<bf16[{b_block}]>",
                 "c": f"tensordesc<bf16[1,1,{bm},{cn}]>"}
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, USE_TMA=tma, SPLIT_STORE=cfg.split_store,
                 DOT_F32=False, FLATTEN=cfg.flatten)
    if not ragged_k:
        const.update(BLOCK_E=64, B_TRANS=b_trans, bias=None, group_scale=None)
    elif ones_row:
        descs["colsum"] = "*fp32"
    else:
        const["colsum"] = None
    sig = {}
    for name in kernel.arg_names:
        sig[name] = descs.get(name) or ("*i32" if name == "offs_ptr" else "constexpr" if name in const else "i32")
    return sig, const


def _expert_signature(kernel, cfg: TileConfig, halves: bool):
    """TMA-path signature of the fused up-projection (B as a (E, N, K) view, torchtitan storage)."""
    import triton.language as tl

    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    half = bn // 2
    b_block = half if halves else bn
    up_pair = f"tensordesc<bf16[1,1,{bm},{half // 2 if halves else half}]>"  # stored in two halves
    descs = {"a": f"tensordesc<bf16[{bm},{bk}]>", "b": f"tensordesc<bf16[1,{b_block},{bk}]>",
             "aux_a": up_pair, "aux_b": up_pair, "h": f"tensordesc<bf16[1,1,{bm},{half // 2}]>", "bias": "*bf16"}
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, BLOCK_E=64, USE_TMA=True,
                 DOT_F32=False, FLATTEN=cfg.flatten, B_TRANS=True, OUT_DTYPE=tl.bfloat16, a_index=None,
                 **SwiGLU(layout="halves" if halves else "interleaved").constexprs())
    sig = {n: descs.get(n) or ("*i32" if n == "offs_ptr" else "constexpr" if n in const else "i32")
           for n in kernel.arg_names}
    return sig, const


def report(kernel, cfg, tma, b_trans=False, halves=None, ones_row=False):
    if halves is None:
        sig, const = _signature(kernel, cfg, tma, b_trans, ones_row)
    else:
        sig, const = _expert_signature(kernel, cfg, halves)
    compiled = triton.compile(
        ASTSource(kernel, sig, const),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(compiled.asm["cubin"])
        fh.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", fh.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage).group(1)
    local = re.search(r"LOCAL:(\d+)", usage).group(1)
    return regs, local, compiled.metadata.shared // 1024, sass.count("HGMMA"), sass.count("LDL") + sass.count("STL")


def main():
    print("| kernel | config | path | regs | local B | smem KB | HGMMA | LDL/STL |")
    print("|---|---|---|---|---|---|---|---|")
    for label, cfg in list(CONFIGS.items())[:1]:
        for kernel in (_grouped_mm_swiglu_kernel,):
            for halves in (False, True):
                name = kernel.__name__.replace("_grouped_mm_", "")
                layout = "halves" if halves else "interleaved"
                try:
                    cells = report(kernel, cfg, True, halves=halves)
                except Exception as exc:
                    cells = (f"error: {str(exc).splitlines()[0][:80]}",) + ("",) * 4
                print(f"| {name} | {label} | tma {layout} | " + " | ".join(str(c) for c in cells) + " |", flush=True)
    for label, cfg in CONFIGS.items():
        variants = [
            (_grouped_mm_ragged_m_kernel, "tma b=(E,N,K)", True, True),
            (_grouped_mm_ragged_m_kernel, "tma b=(E,K,N)", True, False),
            (_grouped_mm_ragged_m_kernel, "pointers", False, False),
            (_grouped_mm_ragged_k_kernel, "tma", True, False),
            (_grouped_mm_ragged_k_kernel, "tma ones-row", True, False),
            (_grouped_mm_ragged_k_kernel, "pointers", False, False),
        ]
        for kernel, path, tma, b_trans in variants:
            try:
                cells = report(kernel, cfg, tma, b_trans, ones_row="ones-row" in path)
            except Exception as exc:  # report, don't stop: a config may not fit shared memory
                cells = (f"error: {str(exc).splitlines()[0][:60]}",) + ("",) * 4
            name = kernel.__name__.replace("_grouped_mm_", "")
            print(f"| {name} | {label} | {path} | " + " | ".join(str(c) for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()

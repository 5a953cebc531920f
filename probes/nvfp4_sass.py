"""SASS of the NVFP4 quantize kernel for sm_90, compiled on any machine (no GPU needed): the static
instruction count per program and per element, and the most frequent opcodes. The quantize pass is
bound by its instructions, not by memory (docs/design.md, NVFP4), so this count is what a leaner
rounding has to cut.

    python probes/nvfp4_sass.py [--block-m 32] [--block-k 128] [--warps 4]
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moekit._kernels.nvfp4 import _quantize_kernel

SIGNATURE = {
    "x": "*bf16", "values": "*u8", "scales": "*u8", "gscale": "*fp32", "R": "i32", "K": "i32",
    "stride_g": "i64", "stride_r": "i32", "stride_k": "constexpr", "G_STRIDE": "i32", "seed": "i64",
    "offset": "i64", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr", "BLOCK_2D": "constexpr",
    "STOCHASTIC": "constexpr",
}


def opcodes(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--block-m", type=int, default=32)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--warps", type=int, default=4)
    args = p.parse_args()
    consts = {"stride_k": 1, "BLOCK_M": args.block_m, "BLOCK_K": args.block_k, "BLOCK_2D": False,
              "STOCHASTIC": False}
    # The alignments a launch on real tensors specializes on (16-byte pointers, K and the row stride
    # multiples of 16): without them the loads compile unvectorized.
    names = list(SIGNATURE)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("x", "values", "scales", "gscale", "K", "stride_r")}
    kernel = triton.compile(ASTSource(_quantize_kernel, SIGNATURE, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=args.warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    ops = opcodes(subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout)
    os.unlink(f.name)
    total = sum(ops.values())
    per_thread = args.block_m * args.block_k // (32 * args.warps)
    print(f"{total} instructions per program, {total / per_thread:.0f} per element ({per_thread} per thread)")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common(25)))


if __name__ == "__main__":
    main()

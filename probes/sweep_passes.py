"""Tile sweep of two bandwidth-bound passes, against the device copy bandwidth: the SwiGLU backward
pass (``_swiglu_bwd_kernel``, with row scales and the recomputed h, as the MoE block runs it) and the
NVFP4 quantize kernel (``_quantize_kernel``). Prints GB/s (bytes read + written) per tile config.

    python probes/sweep_passes.py
"""

import itertools

import torch
import triton

from moekit._kernels.epilogue import _swiglu_bwd_kernel
from moekit._kernels.nvfp4 import _quantize_kernel
from moekit.bench import bench_ms, copy_bandwidth_gbs
from moekit.epilogue import SwiGLU


def swiglu_bwd(m, f, block_r, block_f, warps, col_programs):
    pre = torch.randn(m, 2 * f, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(m, f, device="cuda", dtype=torch.bfloat16)
    dpre, h = torch.empty_like(pre), torch.empty_like(dh)
    scale = torch.rand(m, device="cuda")
    col_blocks = col_programs or triton.cdiv(f, block_f)
    parts = torch.empty(col_blocks, m, device="cuda")
    spec = SwiGLU(1.0, None, 0.0, "interleaved")

    def run():
        _swiglu_bwd_kernel[(triton.cdiv(m, block_r), col_blocks)](
            pre, dh, dpre, h, m, f, pre.stride(0), dh.stride(0), dpre.stride(0), h.stride(0), f, scale, parts, None,
            **spec.constexprs(), ONES_COL=False, BLOCK_R=block_r, BLOCK_F=block_f, num_warps=warps)
    return (pre.numel() * 2 * 2 + dh.numel() * 2 * 2) / bench_ms(run) / 1e6


def quantize(m, k, bm, bk, warps):
    x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
    values = torch.empty(m, k // 2, device="cuda", dtype=torch.uint8)
    scales = torch.empty(m, k // 16, device="cuda", dtype=torch.uint8)
    g = torch.ones(1, device="cuda") * 1e-3

    def run():
        _quantize_kernel[(triton.cdiv(m, bm), triton.cdiv(k, bk), 1)](
            x, values, scales, g, m, k, *x.stride(), 0, BLOCK_M=bm, BLOCK_K=bk, BLOCK_2D=False, num_warps=warps)
    return (x.numel() * 2 + values.numel() + scales.numel()) / bench_ms(run) / 1e6


def main():
    copy = copy_bandwidth_gbs()
    print(f"copy {copy:.0f} GB/s")
    for m, f in ((98304, 2880), (131072, 768)):
        res = []
        for br, bf, w, cp in itertools.product((16, 32), (64, 128, 256), (4, 8), (0, 1)):
            if br * bf > 8192 or (cp and bf > 128):
                continue
            res.append((swiglu_bwd(m, f, br, bf, w, cp), br, bf, w, cp))
        res.sort(reverse=True)
        print(f"swiglu_bwd M={m} F={f}: default (16,128,4,0) {[r for r in res if r[1:] == (16, 128, 4, 0)]}")
        for r in res[:6]:
            print(f"  {r[0]:.0f} GB/s ({r[0] / copy:.2f}) BLOCK_R={r[1]} BLOCK_F={r[2]} w={r[3]} one_col={r[4]}")
    for m, k in ((98304, 2880), (131072, 2048)):
        res = []
        for bm, bk, w in itertools.product((32, 64, 128), (64, 128, 256), (4, 8)):
            if bm * bk > 16384:
                continue
            res.append((quantize(m, k, bm, bk, w), bm, bk, w))
        res.sort(reverse=True)
        print(f"quantize M={m} K={k}: default (32,128,4) {[r for r in res if r[1:] == (32, 128, 4)]}")
        for r in res[:6]:
            print(f"  {r[0]:.0f} GB/s ({r[0] / copy:.2f}) BLOCK_M={r[1]} BLOCK_K={r[2]} warps={r[3]}")


if __name__ == "__main__":
    main()

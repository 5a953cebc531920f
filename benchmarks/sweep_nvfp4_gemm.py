"""Tile sweep of the emulated NVFP4 grouped GEMM's transposed tile (few rows per expert), on a GPU.

For each average of rows per expert (``--rows``), E = 32 experts, K = 2880, N = 5760 (gpt-oss-20b's
up-projection): moekit's bf16 grouped GEMM, the NVFP4 GEMM with the default tile, and every tile of
the sweep (``swap=True``, pinned through ``grouped_mm_nvfp4_fwd``), each checked bit for bit against
the default tile's output, the fastest printed first.

    python benchmarks/sweep_nvfp4_gemm.py [--rows 16 64] [--block-m 16 32 64] [--block-n 128 256]
        [--block-k 64 128] [--warps 4 8] [--programs 1 2 4] [--maxnreg 0 168 128] [--prefetch 0 1] [--packed]
"""

import argparse
import functools
import itertools

import torch
from triton.testing import do_bench

import moekit
from moekit import config, nvfp4
from moekit.nvfp4.gemm import grouped_mm_nvfp4_fwd, pack_weights

E, K, N = 32, 2880, 5760


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64], help="rows per expert")
    parser.add_argument("--block-m", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-n", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--block-k", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--programs", type=int, nargs="+", default=[1, 2, 4], help="programs per SM")
    parser.add_argument("--maxnreg", type=int, nargs="+", default=[0],
                        help="register caps per thread (0: none; Triton's maxnreg)")
    parser.add_argument("--prefetch", type=int, nargs="+", default=[0],
                        help="0/1: the weights' next K step loaded ahead in registers (TileConfig.prefetch)")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--packed", action="store_true", help="packed weights (nvfp4_gemm.pack_weights)")
    args = parser.parse_args()
    dev = "cuda"
    print(f"{torch.cuda.get_device_name()} | E={E} K={K} N={N}")
    for rows in args.rows:
        m = rows * E
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows
        a = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * 0.02
        q = [*nvfp4.quantize(a), *nvfp4.quantize_weights(w), offs]
        if args.packed:
            q[3] = pack_weights(q[3])
        t_bf16 = do_bench(functools.partial(moekit.grouped_mm, a, w, offs), warmup=50, rep=200)
        fp4 = functools.partial(moekit.grouped_mm_nvfp4, *q, w_packed=args.packed)
        t_default = do_bench(fp4, warmup=50, rep=200)
        want = fp4()
        print(f"\n{rows} rows per expert: bf16 {t_bf16:.3f} ms, NVFP4 default tile {t_default:.3f} ms "
              f"(bf16 / NVFP4 {t_bf16 / t_default:.2f})")
        results = []
        for bm, bn, bk, warps, programs, nreg, pre in itertools.product(
                args.block_m, args.block_n, args.block_k, args.warps, args.programs, args.maxnreg, args.prefetch):
            cfg = config.TileConfig(bm, bn, bk, group_m=1, num_warps=warps, num_stages=3, programs_per_sm=programs,
                                    swap=True, max_registers=nreg or None, prefetch=bool(pre))
            try:
                run = functools.partial(grouped_mm_nvfp4_fwd, *q, torch.bfloat16, args.packed, cfg=cfg)
                equal = torch.equal(run(), want)
                t = do_bench(run, warmup=10, rep=50)
            except Exception as exc:  # a tile that does not compile: report it and go on
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            results.append((t, bm, bn, bk, warps, programs, nreg, pre, equal))
        for t, bm, bn, bk, warps, programs, nreg, pre, equal in sorted(results)[:args.top]:
            print(f"  {t:.3f} ms ({t_bf16 / t:.2f}) block_m {bm} block_n {bn} block_k {bk} warps {warps} "
                  f"programs/SM {programs} maxnreg {nreg or '-'} prefetch {pre}"
                  f"{'' if equal else '  DIFFERS from the default tile'}")


if __name__ == "__main__":
    main()

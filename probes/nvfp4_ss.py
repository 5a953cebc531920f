"""Probe: the NVFP4 GEMM with the weights decoded into shared memory (``_kernels/nvfp4_gemm_ws_ss.py``)
against the warp-specialized kernel that decodes into registers (the op's default), at few rows per
expert (E = 32, K = 2880, N = 5760: gpt-oss-20b's up-projection), packed weights.

    python probes/nvfp4_ss.py --compile-only [--block-m 16] [--stages 4] [--chunks 2] [--dstages 4]
    python probes/nvfp4_ss.py [--rows 16 32 64] [--stages 4] [--chunks 2] [--dstages 4] [--rounds 5]

On a GPU each configuration's output is compared bit for bit with the default kernel's and within
rounding with the float64 reference; times are medians of CUDA-graph replays, the kernels interleaved
round by round.
"""

import argparse
import itertools
import re

import torch
import triton
from cuobjdump import dump

E, K, N = 32, 2880, 5760


def compile_only(block_m, stages, chunks, dstages, regs):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from moekit._kernels.nvfp4_gemm_ws_ss import _grouped_mm_nvfp4_ws_ss_kernel

    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, 64], gl.float16)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    sig = {"a_desc": f"tensordesc<fp16[{block_m}, 64],{a_layout!r}>", "w_desc": f"tensordesc<u8[128, 32],{w_layout!r}>",
           "w_scales": "*i32", "a_global": "*fp32", "w_global": "*fp32", "stride_wg": "i32", "out": "*bf16",
           "stride_out": "i32", "table": "*i32", "N": "i32", "K": "i32", "NUM_PROGRAMS": "constexpr",
           "GROUP_M": "constexpr", "STAGES": "constexpr", "CHUNKS": "constexpr", "DSTAGES": "constexpr",
           "REGS": "constexpr"}
    const = {"NUM_PROGRAMS": 132, "GROUP_M": 1, "STAGES": stages, "CHUNKS": chunks, "DSTAGES": dstages,
             "REGS": regs}
    kernel = triton.compile(GluonASTSource(_grouped_mm_nvfp4_ws_ss_kernel, sig, constexprs=const),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=regs))
    sass, ops, res = dump(kernel)
    count = {op: sum(o.startswith(op) for o in ops) for op in ("HGMMA", "PRMT", "LDS", "STS", "LDL", "STL",
                                                              "UTMALDG", "LDGSTS", "BAR")}
    got = {k: re.search(rf"{k}:(\d+)", res).group(1) for k in ("REG", "SHARED")}
    print(f"sm_90 block_m {block_m} stages {stages} chunks {chunks} dstages {dstages}: {len(ops)} SASS "
          f"instructions, registers {got['REG']}, shared {got['SHARED']}, {count}", flush=True)
    return sass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--block-m", type=int, nargs="+", default=None)
    p.add_argument("--stages", type=int, nargs="+", default=[4])
    p.add_argument("--chunks", type=int, nargs="+", default=[2])
    p.add_argument("--dstages", type=int, nargs="+", default=[4])
    p.add_argument("--regs", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    if a.compile_only:
        for bm, st, ch, ds in itertools.product(a.block_m or [16], a.stages, a.chunks, a.dstages):
            compile_only(bm, st, ch, ds, a.regs)
        return

    import functools
    import statistics

    from triton.testing import do_bench_cudagraph

    from moekit import config, grouped_mm, nvfp4
    from moekit.nvfp4_gemm import _ws_mm, grouped_mm_nvfp4, grouped_mm_nvfp4_ref, pack_weights

    torch.manual_seed(0)
    dev = "cuda"
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * 0.02
    wv, wsc, wg = nvfp4.quantize_weights(w)
    wp = pack_weights(wv)
    print(torch.cuda.get_device_name(), f"| E={E} K={K} N={N} | triton {triton.__version__}", flush=True)
    for rows in a.rows:
        m = rows * E
        x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
        av, asc, ag = nvfp4.quantize(x)
        counts = torch.full((E,), rows, device=dev)
        counts[0] += 3
        counts[1] -= 3  # ragged
        offs = counts.cumsum(0).to(torch.int32)
        args = (av, asc, ag, wp, wsc, wg, offs)
        ref = grouped_mm_nvfp4_ref(*args, out_dtype=torch.bfloat16, w_packed=True).float()
        base = grouped_mm_nvfp4(*args, w_packed=True)
        fns = {"registers (default)": functools.partial(grouped_mm_nvfp4, *args, w_packed=True),
               "bf16 grouped_mm": functools.partial(grouped_mm, x, w, offs)}
        bm = min(64, triton.next_power_of_2(rows))
        for bmv, st, ch, ds in itertools.product(a.block_m or [bm], a.stages, a.chunks, a.dstages):
            cfg = config.TileConfig(bmv, 128, 64 * ch, group_m=1, num_warps=4, num_stages=st, programs_per_sm=1,
                                    swap=True, max_registers=a.regs, warp_specialized=True)
            label = f"shared, block_m {bmv} stages {st} chunks {ch} dstages {ds}"

            buf = torch.full((m, N), float("nan"), device=dev, dtype=torch.bfloat16)  # poisoned, reused

            def run(cfg=cfg, ds=ds, buf=buf, args=args):
                return _ws_mm(*args, buf, cfg, decoded_stages=ds)
            try:
                out = run().clone()
                torch.cuda.synchronize()
            except Exception as exc:  # a configuration that does not fit or compile: say so, go on
                print(f"  {label}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                continue
            print(f"  {label}: max err vs ref {(out.float() - ref).abs().max().item():.3e}, NaN "
                  f"{out.isnan().any().item()}, bit-equal to the default {torch.equal(out, base)}", flush=True)
            fns[label] = run
        times = {k: [] for k in fns}
        for r in range(a.rounds):
            order = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
            for k in order:
                times[k].append(do_bench_cudagraph(fns[k], rep=50, return_mode="median"))
        t0 = statistics.median(times["registers (default)"])
        print(f"{rows} rows per expert (graph replays, medians of {a.rounds} interleaved rounds):")
        for k, v in times.items():
            t = statistics.median(v)
            print(f"  {t:.3f} ms (x{t / t0:.3f})  {k}", flush=True)


if __name__ == "__main__":
    main()

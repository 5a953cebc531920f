"""Probe: the warp-specialized NVFP4 GEMM (``_kernels/nvfp4_gemm_ws.py``) against the Triton kernel and
bf16, at few rows per expert (E = 32, K = 2880, N = 5760: gpt-oss-20b's up-projection), packed weights.

    python probes/nvfp4_ws.py --compile-only [--block-m 16] [--stages 8] [--chunks 1]   # sm_90 SASS, no GPU
    python probes/nvfp4_ws.py [--rows 16 32 64] [--stages 4 8] [--chunks 1 2] [--programs 1 2]

On a GPU every configuration's output is compared bit for bit with the first one's and within
rounding with the float64 reference (``grouped_mm_nvfp4_ref``).
"""

import argparse
import itertools
import re

import torch
import triton
from cuobjdump import dump

E, K, N = 32, 2880, 5760
REGS_CAP = [160]  # compile-only: maxnreg (--regs)


def compile_only(block_m, stages, chunks):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from moekit._kernels.nvfp4_gemm_ws import _grouped_mm_nvfp4_ws_kernel

    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, 64], gl.float16)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    sig = {"a_desc": f"tensordesc<fp16[{block_m}, 64],{a_layout!r}>", "w_desc": f"tensordesc<u8[128, 32],{w_layout!r}>",
           "w_scales": "*i32", "a_global": "*fp32", "w_global": "*fp32", "stride_wg": "i32", "out": "*bf16",
           "stride_out": "i32", "table": "*i32", "N": "i32", "K": "i32", "NUM_PROGRAMS": "constexpr",
           "GROUP_M": "constexpr", "STAGES": "constexpr", "CHUNKS": "constexpr", "REGS": "constexpr"}
    const = {"NUM_PROGRAMS": 132, "GROUP_M": 1, "STAGES": stages, "CHUNKS": chunks, "REGS": REGS_CAP[0]}
    kernel = triton.compile(GluonASTSource(_grouped_mm_nvfp4_ws_kernel, sig, constexprs=const),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=REGS_CAP[0]))
    sass, ops, res = dump(kernel)
    count = {op: sum(o.startswith(op) for o in ops) for op in ("HGMMA", "PRMT", "LDS", "LDL", "STL", "UTMALDG",
                                                              "LDGSTS", "SHFL", "STS")}
    regs, smem = re.search(r"REG:(\d+)", res).group(1), re.search(r"SHARED:(\d+)", res).group(1)
    print(f"sm_90 block_m {block_m} stages {stages} chunks {chunks}: {len(ops)} SASS instructions, "
          f"registers {regs}, shared {smem}, {count}")
    return sass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--block-m", type=int, nargs="+", default=None)
    p.add_argument("--stages", type=int, nargs="+", default=[8])
    p.add_argument("--chunks", type=int, nargs="+", default=[1])
    p.add_argument("--programs", type=int, nargs="+", default=[1])
    p.add_argument("--regs", type=int, nargs="+", default=[160], help="registers per consumer thread (maxnreg)")
    p.add_argument("--sass", help="write the SASS of the first configuration here")
    a = p.parse_args()
    if a.compile_only:
        REGS_CAP[0] = a.regs[0]
        for bm, st, ch in itertools.product(a.block_m or [16], a.stages, a.chunks):
            sass = compile_only(bm, st, ch)
            if a.sass:
                open(a.sass, "w").write(sass)
                a.sass = None
        return

    import functools

    from triton.testing import do_bench_cudagraph

    import moekit
    from moekit import config, nvfp4
    from moekit.nvfp4.gemm import grouped_mm_nvfp4_fwd, grouped_mm_nvfp4_ref, pack_weights

    def bench(fn):  # GPU time: each call replayed from a CUDA graph (the launchers' host time is out)
        return do_bench_cudagraph(fn, rep=100, return_mode="median")

    torch.manual_seed(0)
    dev = "cuda"
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * 0.02
    wv, wsc, wg = nvfp4.quantize_weights(w)
    wp = pack_weights(wv)
    print(torch.cuda.get_device_name(), f"| E={E} K={K} N={N}")
    for rows in a.rows:
        m = rows * E
        x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
        av, asc, ag = nvfp4.quantize(x)
        counts = torch.full((E,), rows, device=dev)
        counts[0] += 3
        counts[1] -= 3  # ragged
        offs = counts.cumsum(0).to(torch.int32)
        args = (av, asc, ag, wp, wsc, wg, offs, torch.bfloat16)
        ref = grouped_mm_nvfp4_ref(*args[:7], out_dtype=torch.bfloat16, w_packed=True).float()
        tri_cfg = config.nvfp4_gemm_config(m, E, x.device, packed=True)  # the Triton kernel's tile
        tri = grouped_mm_nvfp4_fwd(*args, True, cfg=tri_cfg)
        t_bf16 = bench(functools.partial(moekit.grouped_mm, x, w, offs))
        t_tri = bench(functools.partial(grouped_mm_nvfp4_fwd, *args, True, cfg=tri_cfg))
        op = functools.partial(moekit.grouped_mm_nvfp4, *args[:7], w_packed=True)
        t_op = bench(op)
        from moekit.bench import bench_ms, host_us
        tri_op = functools.partial(grouped_mm_nvfp4_fwd, *args, True, cfg=tri_cfg)
        print(f"  eager (do_bench) ms: the op {bench_ms(op):.3f}, Triton {bench_ms(tri_op):.3f}; host us per call: "
              f"the op {host_us(op):.0f}, Triton {host_us(tri_op):.0f}")
        print(f"\n{rows} rows per expert: bf16 {t_bf16:.3f} ms, Triton NVFP4 {t_tri:.3f} ms ({t_bf16 / t_tri:.2f}x),"
              f" the op (heuristic) {t_op:.3f} ms ({t_bf16 / t_op:.2f}x),"
              f" Triton vs ref max err {(tri.float() - ref).abs().max().item():.3e}")
        first = None
        for bm, st, ch, pr, rg in itertools.product(a.block_m or [min(64, triton.next_power_of_2(rows))], a.stages,
                                                    a.chunks, a.programs, a.regs):
            try:
                cfg = config.TileConfig(bm, 128, 64 * ch, group_m=1, num_warps=4, num_stages=st, programs_per_sm=pr,
                                        swap=True, max_registers=rg, warp_specialized=True)
                out = grouped_mm_nvfp4_fwd(*args, True, cfg=cfg)
                torch.cuda.synchronize()
            except Exception as exc:  # a configuration that does not fit or compile: say so, go on
                print(f"  block_m {bm} stages {st} chunks {ch} programs {pr} regs {rg}: {type(exc).__name__}: "
                      f"{str(exc)[:300]}")
                continue
            err = (out.float() - ref).abs().max().item()
            same = "" if first is None else f", bit-equal to the first: {torch.equal(out, first)}"
            first = out if first is None else first
            tri_eq = torch.equal(out, tri)
            t = bench(functools.partial(grouped_mm_nvfp4_fwd, *args, True, cfg=cfg))
            print(f"  {t:.3f} ms ({t_bf16 / t:.2f}x bf16) block_m {bm} stages {st} chunks {ch} programs {pr} "
                  f"regs {rg}: max err vs ref {err:.3e}, NaN {out.isnan().any().item()}, equal to Triton's "
                  f"{tri_eq}{same}")


if __name__ == "__main__":
    main()

"""NVFP4 kernels on the GPU against their bandwidth roof and their bf16 counterparts, in one process.

- quantize and the fused SwiGLU -> NVFP4 pass: GB/s (bytes read + written) against a device copy;
- the fused up-projection writing NVFP4 h against moekit's bf16 fused up-projection;
- the NVFP4 grouped GEMM against moekit's bf16 grouped GEMM, at few rows per expert (weight-bandwidth
  bound) and at gpt-oss-20b training size, with each of its two decodes (the ``nvfp4_ptx_decode``
  option) and with packed weights (``nvfp4_gemm.pack_weights``); with many rows per expert the op
  dequantizes both operands and runs the bf16 GEMM instead (``config.nvfp4_gemm_dequantizes``). The
  GEMM rows time CUDA-graph replays (the kernels alone: at a quarter of a millisecond the host's time
  per eager call, checks, descriptors and launches, can exceed the GPU's) and give the eager time of
  the NVFP4 call beside them.

    python benchmarks/bench_nvfp4.py
"""

import functools

import torch

import moekit
from moekit import config, nvfp4
from moekit.bench import balanced_offs, bandwidth_preamble, bench_ms, graph_ms
from moekit.nvfp4 import gemm as nvfp4_gemm
from moekit.nvfp4.gemm import pack_weights


def main():
    dev = "cuda"
    copy = bandwidth_preamble("kernel")
    m, k = 24576 * 4, 2880
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    g = nvfp4.quantize(x)[2]
    ms = bench_ms(lambda: nvfp4.quantize(x, g))
    gbs = (2 * m * k + m * k // 2 + m * k // 16) / ms / 1e6
    print(f"| quantize (given scale) | {m}x{k} bf16 | {ms:.3f} | {gbs:.0f} | {gbs / copy:.2f} |")
    ms = bench_ms(lambda: nvfp4.quantize(x))  # x read twice: amax, then quantize
    gbs = (4 * m * k + m * k // 2 + m * k // 16) / ms / 1e6
    print(f"| quantize (scale on device) | {m}x{k} bf16 | {ms:.3f} | {gbs:.0f} | {gbs / copy:.2f} |")
    f = 2880
    pre = torch.randn(m, 2 * f, device=dev, dtype=torch.bfloat16)
    for layout in ("interleaved", "halves"):
        ms = bench_ms(lambda layout=layout: moekit.swiglu_quantize_nvfp4(pre, g, gate_up_layout=layout))
        gbs = (2 * m * 2 * f + m * f // 2 + m * f // 16) / ms / 1e6
        print(f"| swiglu_quantize_nvfp4 ({layout}) | {m}x{2 * f} bf16 | {ms:.3f} | {gbs:.0f} | {gbs / copy:.2f} |")

    print("\n| op | problem | NVFP4 ms | bf16 ms | bf16 / NVFP4 |\n|---|---|---|---|---|")  # the fused up-projection
    e, d = 32, 2880
    offs = balanced_offs(m, e, dev)
    w_up = torch.randn(e, 2 * f, d, device=dev, dtype=torch.bfloat16).mT * 0.02
    xs = torch.randn(m, d, device=dev, dtype=torch.bfloat16)
    t_fp4 = bench_ms(lambda: moekit.grouped_mm_swiglu_nvfp4(xs, w_up, offs, g))
    t_bf16 = bench_ms(lambda: moekit.grouped_mm_swiglu(xs, w_up, offs))
    print(f"| up-projection + SwiGLU (-> NVFP4 h vs bf16 h, aux) | gpt-oss-20b M={m} | {t_fp4:.3f} | {t_bf16:.3f} | "
          f"{t_bf16 / t_fp4:.2f} |")
    print("\n| grouped GEMM | problem | NVFP4 ms (graph) | bf16 ms (graph) | bf16 / NVFP4 | NVFP4 ms (eager) |\n"
          "|---|---|---|---|---|---|")
    for rows_per_expert in (16, 32, 64, m // e):
        mm = rows_per_expert * e
        a = torch.randn(mm, d, device=dev, dtype=torch.bfloat16)
        w = torch.randn(e, d, 2 * f, device=dev, dtype=torch.bfloat16) * 0.02
        o = balanced_offs(mm, e, dev)
        av, as_, ag = nvfp4.quantize(a)
        wv, ws_, wg = nvfp4.quantize_weights(w)
        wp = pack_weights(wv)
        t_bf16 = graph_ms(lambda q=(a, w, o): moekit.grouped_mm(*q))
        ws = nvfp4_gemm.ws_ok(av, wp, ws_, True)  # sm_90: the warp-specialized kernel takes packed weights
        variants = ((True, True, True, f"packed weights, {'warp-specialized' if ws else 'Triton'} kernel"),
                    (True, True, False, "PTX decode, packed weights"), (True, False, True, "PTX decode"),
                    (False, False, True, "Triton-op decode"))
        if config.nvfp4_gemm_dequantizes(mm, e):  # the decode does not run: both operands go to bf16 first
            variants = ((True, True, True, "dequantized to bf16, packed weights"),
                        (True, False, True, "dequantized to bf16"))
        for ptx, packed, ws_on, decode in variants:
            call = functools.partial(moekit.grouped_mm_nvfp4, av, as_, ag, wp if packed else wv, ws_, wg, o,
                                     w_packed=packed)
            with moekit.options(nvfp4_ptx_decode=ptx, warp_specialized=ws_on):
                t_fp4, t_eager = graph_ms(call), bench_ms(call)
            print(f"| grouped_mm_nvfp4 ({decode}) | E={e} K={d} N={2 * f}, {rows_per_expert} rows/expert | "
                  f"{t_fp4:.3f} | {t_bf16:.3f} | {t_bf16 / t_fp4:.2f} | {t_eager:.3f} |")


if __name__ == "__main__":
    main()

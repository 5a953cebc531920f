"""FP8 blockwise quantize passes and the FP8 grouped GEMM on the GPU, in one process.

Quantize: GB/s counts the bytes read (bf16 operands) plus written (e4m3 values and fp32 scales), against
the device copy. Shapes: the activations of a gpt-oss-20b layer at training size (1 x 128 groups along
K), the same rows as a weight gradient's operand (128 x 1 groups within each of 32 balanced experts,
stored transposed), and the expert weights (128 x 128 blocks). GEMM: ``fp8.grouped_mm_fp8`` against
moekit's bf16 ``grouped_mm`` on the same problem (gpt-oss-20b's up-projection, 32 experts), CUDA-graph
replays.

    python benchmarks/bench_fp8.py
"""

import torch

import moekit
from moekit import fp8
from moekit.bench import balanced_offs, bandwidth_preamble, bench_ms, graph_ms


def main():
    dev = "cuda"
    copy = bandwidth_preamble("pass")
    m, k, e = 24576 * 4, 2880, 32
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    offs = balanced_offs(m, e)
    w = torch.randn(e, 2 * k, k, device=dev, dtype=torch.bfloat16)
    rows = [
        ("quantize (1x128)", f"{m}x{k} bf16", lambda: fp8.quantize(x), 3 * m * k + 4 * m * (k // 128)),
        ("quantize, UE8M0 scales", f"{m}x{k} bf16", lambda: fp8.quantize(x, pow2_scales=True),
         3 * m * k + 4 * m * (k // 128)),
        ("quantize_ragged_t (128x1, transposed)", f"{m}x{k} bf16, E={e}", lambda: fp8.quantize_ragged_t(x, offs),
         3 * m * k + 4 * (m // 128 + e) * k),
        ("quantize_weights (128x128)", f"{e}x{2 * k}x{k} bf16", lambda: fp8.quantize_weights(w),
         3 * w.numel() + 4 * w.numel() // 128**2),
    ]
    for name, shape, fn, nbytes in rows:
        ms = bench_ms(fn)
        gbs = nbytes / ms / 1e6
        print(f"| {name} | {shape} | {ms:.3f} | {gbs:.0f} | {gbs / copy:.2f} |", flush=True)
    print("\n| grouped GEMM | problem | FP8 ms | FP8 TF/s | bf16 ms | bf16 TF/s | bf16 / FP8 |")
    print("|---|---|---|---|---|---|---|")
    mm, n = 32768, 2 * k
    a = torch.randn(mm, k, device=dev, dtype=torch.bfloat16)
    o = balanced_offs(mm, e)
    av, as_ = fp8.quantize(a)
    wv, ws = fp8.quantize_weights(w)
    t8 = graph_ms(lambda: fp8.grouped_mm_fp8(av, as_, wv, ws, o))
    t16 = graph_ms(lambda: moekit.grouped_mm(a, w.mT, o))
    tf = 2.0 * mm * n * k / 1e9
    print(f"| forward (rows-ragged) | M={mm} K={k} N={n} E={e} | {t8:.3f} | {tf / t8:.0f} | {t16:.3f} | "
          f"{tf / t16:.0f} | {t16 / t8:.2f} |", flush=True)


if __name__ == "__main__":
    main()

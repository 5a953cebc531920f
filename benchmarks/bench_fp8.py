"""FP8 blockwise quantize passes on the GPU against the device copy's bandwidth, in one process.

GB/s counts the bytes read (bf16 operands) plus written (e4m3 values and fp32 scales). Shapes: the
activations of a gpt-oss-20b layer at training size (1 x 128 groups along K), the same rows as a weight
gradient's operand (128 x 1 groups within each of 32 balanced experts, stored transposed), and the
expert weights (128 x 128 blocks).

    python benchmarks/bench_fp8.py
"""

import torch

from moekit import fp8
from moekit.bench import bench_ms, copy_bandwidth_gbs, environment


def main():
    dev = "cuda"
    torch.manual_seed(0)
    print(environment())
    copy = copy_bandwidth_gbs()
    print(f"device copy: {copy:.0f} GB/s (read + write)\n")
    print("| pass | shape | ms | GB/s | of copy |\n|---|---|---|---|---|")
    m, k, e = 24576 * 4, 2880, 32
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    offs = torch.linspace(m / e, m, e, device=dev).round().to(torch.int32)
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


if __name__ == "__main__":
    main()

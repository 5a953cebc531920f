"""Block sizes of the SwiGLU-backward pass (``moekit.experts.dswiglu_pass``) at gpt-oss-20b, on a GPU.

Times each (rows per tile, rows per step, h columns, warps, stages) choice, and the ungrouped
standalone ``swiglu_bwd`` for scale; bytes moved = aux + dh read, d_aux + h written.

    python benchmarks/sweep_dswiglu.py
"""

import torch

from moekit.bench import bench_ms
from moekit.epilogue import SwiGLU
from moekit.experts import dswiglu_pass, swiglu_bwd
from moekit.testing import offs_from_counts, routed_counts

CHOICES = [  # (rows per tile, rows per step, h columns per step, programs per tile, warps)
    (128, 32, 64, 8, 4),
    (128, 16, 64, 8, 4),
    (128, 16, 128, 8, 4),
    (128, 32, 128, 8, 4),
    (128, 16, 128, 4, 4),
    (64, 16, 128, 8, 4),
    (128, 8, 256, 8, 4),
]


def main():
    t, k, e, f = 24576, 4, 32, 2880
    rows = t * k
    offs = offs_from_counts(routed_counts(t, e, k).tolist(), device="cuda")
    aux = torch.randn(rows, 2 * f, device="cuda", dtype=torch.bfloat16) * 3
    dh = torch.randn(rows, f, device="cuda", dtype=torch.bfloat16)
    spec = SwiGLU()
    gbytes = rows * f * 2 * (2 + 1 + 2 + 1) / 1e9
    ms = bench_ms(lambda: swiglu_bwd(aux, dh, spec))
    print(f"| swiglu_bwd (no h, no sums) | {ms:.3f} ms | {rows * f * 2 * 5 / 1e9 / ms:.2f} TB/s |")
    ref = dswiglu_pass(aux, dh, offs, spec, ones_col=True, bias_sums=True, blocks=CHOICES[0])
    print("| blocks (tile, step, cols, splits, warps) | ms | TB/s |\n|---|---|---|")
    for blocks in CHOICES:
        out = dswiglu_pass(aux, dh, offs, spec, ones_col=True, bias_sums=True, blocks=blocks)
        same = all(torch.equal(a, b) for a, b in zip(out[:2], ref[:2], strict=True))
        ms = bench_ms(lambda blocks=blocks: dswiglu_pass(aux, dh, offs, spec, ones_col=True, bias_sums=True,
                                                         blocks=blocks))
        print(f"| {blocks} | {ms:.3f} | {gbytes / ms:.2f} |{'' if same else ' MISMATCH'}", flush=True)
    for ones, sums in ((False, False), (True, False), (False, True)):
        ms = bench_ms(lambda ones=ones, sums=sums: dswiglu_pass(aux, dh, offs, spec, ones_col=ones, bias_sums=sums))
        print(f"| default, ones column {ones}, bias sums {sums} | {ms:.3f} | {gbytes / ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()

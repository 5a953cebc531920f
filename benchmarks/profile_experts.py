"""Per-kernel CUDA time of one GptOssExperts training step (forward + backward), via torch.profiler,
then the GPU's idle time inside a step: the wall time of 5 steps (CUDA events, no profiler) against
the sum of their kernels, and the longest gaps between consecutive kernels with their neighbours.

    python benchmarks/profile_experts.py [--shape gpt-oss-20b]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from moekit import GptOssExperts
from moekit.bench import SHAPES, cuda_kernels
from moekit.testing import routed_counts


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="gpt-oss-20b")
    args = parser.parse_args()
    s = SHAPES[args.shape]
    rows = s.tokens * s.top_k
    ex = GptOssExperts(s.d, s.f, s.e, device="cuda", dtype=torch.bfloat16)
    counts = routed_counts(s.tokens, s.e, s.top_k, device="cuda")
    x = torch.randn(rows, s.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, s.d, device="cuda", dtype=torch.bfloat16)
    params = [x, *ex.parameters()]
    for _ in range(3):
        torch.autograd.grad(ex(x, counts), params, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(ex(x, counts), params, dy)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    kernels = cuda_kernels(prof)
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 5e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        torch.autograd.grad(ex(x, counts), params, dy)
    end.record()
    torch.cuda.synchronize()
    print(f"{args.shape}: {start.elapsed_time(end) / 5:.2f} ms per step (no profiler), kernels {busy:.2f} ms")
    pairs = zip(kernels, kernels[1:], strict=False)
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name, b.name) for a, b in pairs), reverse=True)
    for gap, before, after in gaps[:8]:
        print(f"  idle {gap / 1e3:.3f} ms between {before[:50]} and {after[:50]}")


if __name__ == "__main__":
    main()

"""Per-kernel CUDA time of one GptOssExperts training step (forward + backward), via torch.profiler.

    python benchmarks/profile_experts.py [--shape gpt-oss-20b]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from moekit import GptOssExperts
from moekit.bench import SHAPES
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


if __name__ == "__main__":
    main()

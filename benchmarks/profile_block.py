"""Every kernel of one ``moekit.MoE`` training step (forward + backward), in launch order, with its
CUDA time (torch.profiler), then the split into grouped GEMMs and glue and the wall time of a step
without the profiler. The block is built as the MoE-block benchmark builds it (``--config plain``:
no biases, plain SwiGLU; ``gpt-oss``: biases and the gpt-oss SwiGLU).

    python benchmarks/profile_block.py --shape qwen3-30b-a3b [--config plain] [--precision fp8] [--steps 3]
        [--host] [--forward]

``--precision fp8`` or ``nvfp4`` builds the experts in that precision (``MoE(..., fp8=True)``); every run
ends with the kernels summed by name, the largest first.

``--forward`` profiles the forward alone (the call a training step makes, x requiring grad), and adds
its do_bench time, the figure the MoE-block table reports as "fwd ms".

``--host`` adds the host's side: the time to enqueue one step (no sync inside it), which bounds the
step from below when it exceeds the GPU's busy time, and cProfile's top Python functions over the
enqueue of a few steps.
"""

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moekit.bench import BLOCK_SHAPES, GEMM_KERNELS, bench_ms, cuda_kernels
from moekit.bench.moe import CONFIGS, training_step


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(BLOCK_SHAPES))
    parser.add_argument("--config", default="plain", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--forward", action="store_true")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp8", "nvfp4"])
    args = parser.parse_args()
    s = BLOCK_SHAPES[args.shape]
    moe, x, step = training_step(s, args.config, **({} if args.precision == "bf16" else {args.precision: True}))
    if args.forward:
        def step():
            return moe(x)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    kernels = cuda_kernels(prof)
    per_step = len(kernels) // args.steps
    what = "forward" if args.forward else "step"
    print(f"{args.shape} ({args.config}, {args.precision}, T={s.tokens}): {per_step} kernels per {what}, the last "
          f"{what}'s in order")
    gemm = glue = 0.0
    for e in kernels[-per_step:]:
        ms = e.time_range.elapsed_us() / 1e3
        is_gemm = e.name.startswith(GEMM_KERNELS)
        gemm, glue = gemm + ms * is_gemm, glue + ms * (not is_gemm)
        print(f"  {ms:7.3f} ms  {'GEMM' if is_gemm else 'glue'}  {e.name[:90]}")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / args.steps
    print(f"  GEMMs {gemm:.3f} ms, glue {glue:.3f} ms ({100 * glue / (gemm + glue):.0f}%), "
          f"kernels {gemm + glue:.3f} ms, wall {wall:.3f} ms per step (no profiler)")
    pairs = zip(kernels[-per_step:], kernels[-per_step + 1:], strict=False)
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name, b.name) for a, b in pairs), reverse=True)
    print(f"  idle between kernels: {sum(g[0] for g in gaps) / 1e3:.3f} ms in all; the longest:")
    for gap, before, after in gaps[:6]:
        print(f"    {gap / 1e3:.3f} ms between {before[:40]} and {after[:40]}")
    by_name: dict = {}
    for e in kernels[-per_step:]:
        ms, n = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (ms + e.time_range.elapsed_us() / 1e3, n + 1)
    print("  by kernel name, the largest first:")
    for name, (ms, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"    {ms:7.3f} ms  x{n:<2d} {name[:90]}")
    if args.forward:
        print(f"  do_bench: {bench_ms(step):.3f} ms per forward")
    if args.host:
        host(step, args.steps)


def host(step, steps):
    """Enqueue time per step (the queue drained first; fewer launches than the queue holds)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    enqueue = (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    print(f"  host: {enqueue:.3f} ms to enqueue one step")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()

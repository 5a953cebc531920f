"""Probe: is an eager MoE-block step bound by the host? For each shape, one process times a training
step (forward + ``autograd.grad``) four ways:

* ``eager``: ``triton.testing.do_bench`` as the benchmark does (L2 flushed before each call);
* ``eager-queued``: ten steps back to back between two events, after a warm-up that fills the queue;
* ``graph``: the same step captured in a CUDA graph and replayed (no host work per kernel);
* ``host``: the wall time for the host to enqueue one step, the GPU idle at the start;

plus the sum of the step's kernel times (torch.profiler).

    python probes/host_bound.py [shape ...]
"""

import sys
import time

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from moekit.bench import BLOCK_SHAPES, cuda_graphed, cuda_kernels
from moekit.bench.moe import training_step


def probe(name):
    _, _, step = training_step(BLOCK_SHAPES[name])
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(step, warmup=25, rep=200, return_mode="median")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        step()
    start.record()
    for _ in range(10):
        step()
    end.record()
    torch.cuda.synchronize()
    queued = start.elapsed_time(end) / 10
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sum(e.time_range.elapsed_us() for e in cuda_kernels(prof)) / 1e3
    replay = triton.testing.do_bench(cuda_graphed(step), warmup=25, rep=200, return_mode="median")
    print(f"{name}: eager {eager:.3f} ms, eager-queued {queued:.3f}, graph {replay:.3f}, kernels {kernels:.3f}, "
          f"host {host:.3f} ms to enqueue a step")


if __name__ == "__main__":
    for shape in sys.argv[1:] or ["qwen3-30b-a3b", "olmoe-1b-7b", "gpt-oss-20b"]:
        probe(shape)

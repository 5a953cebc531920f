"""Probe: where the host's time per MoE-block step goes. A block of a shape's D, F, E and K runs on
few tokens (so the GPU finishes long before the host), autograd on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``, so cProfile sees the backward too), and
cProfile reports the functions with the most time of their own and the most cumulative time; a
plain timing gives the host milliseconds per step without the profiler.

    python probes/host_cost.py [--shape qwen3-30b-a3b] [--config plain] [--tokens 256] [--steps 20]
"""

import argparse
import cProfile
import pstats
import time

import torch

from moekit.bench import BLOCK_SHAPES
from moekit.bench.moe import CONFIGS, training_step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(BLOCK_SHAPES))
    p.add_argument("--config", default="plain", choices=sorted(CONFIGS))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=45)
    a = p.parse_args()
    shape = BLOCK_SHAPES[a.shape]
    shape = type(shape)(shape.name, shape.d, shape.f, shape.e, shape.top_k, tokens=a.tokens)
    torch.autograd.set_multithreading_enabled(False)
    _, _, step = training_step(shape, a.config)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    host = (time.perf_counter() - t0) * 1e3 / a.steps
    torch.cuda.synchronize()
    gpu = (time.perf_counter() - t0) * 1e3 / a.steps
    print(f"{a.shape} ({a.config}), T = {a.tokens}: host {host:.2f} ms per step enqueued, {gpu:.2f} ms with the "
          f"GPU drained")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(a.top)
    stats.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()

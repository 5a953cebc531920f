"""Host-side cost per call (microseconds) of each layer of grouped_mm, next to torch._grouped_mm.

Small problems (decode-like, small-M) finish on the GPU in ~0.2 ms, so a Python launch path that
costs as much shows up in eager timings. This measures the CPU time per call with the GPU kept busy
(calls are queued without synchronizing), and the same kernel timed eagerly and as CUDA-graph replays.
"""

import time

import torch
import triton

from moekit import grouped_mm
from moekit.bench import SHAPES
from moekit.bench.grouped_mm import _problem
from moekit.grouped_gemm import grouped_mm_op, ragged_m


def host_us(fn, n=300):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    x, dy, w, offs = _problem(SHAPES["small-M"], "down", "balanced", "cuda")
    b = w.mT
    calls = {
        "moekit.grouped_mm (public)": lambda: grouped_mm(x, b, offs),
        "moekit::grouped_mm custom op": lambda: grouped_mm_op(x, b, offs, None),
        "launcher (ragged_m)": lambda: ragged_m(x, b, offs, torch.bfloat16, None),
        "torch._grouped_mm": lambda: torch._grouped_mm(x, b, offs),
    }
    print("| call | host us/call | eager ms (do_bench) | graph ms (do_bench_cudagraph) |")
    print("|---|---|---|---|")
    for name, fn in calls.items():
        eager = triton.testing.do_bench(fn, return_mode="median")
        graph = triton.testing.do_bench_cudagraph(fn, return_mode="median")
        print(f"| {name} | {host_us(fn):.1f} | {eager:.3f} | {graph:.3f} |")


if __name__ == "__main__":
    main()
